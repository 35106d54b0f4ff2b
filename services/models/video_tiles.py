"""A video VAE's tiled decode (Wan's ``AutoencoderKLWan.tiled_decode``) in two
halves, so that a group's ranks can share it: ``decode_tiles`` decodes any of the
tiles (each tile every frame, the VAE's causal cache cleared between tiles, as
diffusers does), and ``blend`` joins them, overlaps blended, into the video the
VAE's own tiled decode makes, exactly: the same tiles, the same arithmetic in the
same order, whichever process decoded each tile (docs/parallel.md).

``TileGrid.of`` reads the tiling from the VAE (its ``enable_tiling`` sizes) once, on
the process that blends; the others are sent it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Tile = tuple[int, int]  # its top-left corner, in latent rows and columns
Tiles = dict[Tile, torch.Tensor]  # decoded: (1, 3, F, H, W) each


@dataclass(frozen=True)
class TileGrid:
    """Where the tiles of one latent video (frames, height, width) lie and how they blend."""

    frames: int
    height: int  # latent rows
    width: int
    tile_height: int  # a tile's latent rows and columns
    tile_width: int
    stride_height: int  # latent rows between tiles' corners
    stride_width: int
    sample_stride_height: int  # the same in decoded pixels (patches, where the VAE patchifies)
    sample_stride_width: int
    blend_height: int
    blend_width: int
    sample_height: int
    sample_width: int
    patch_size: int | None

    @classmethod
    def of(cls, vae: Any, shape: Sequence[int]) -> TileGrid:
        """The tiling ``vae.tiled_decode`` would use for latents of ``shape`` (N, C, F, h, w)."""
        _, _, frames, height, width = shape
        scale = vae.spatial_compression_ratio
        patch = vae.config.patch_size
        sample_stride_height, sample_stride_width = vae.tile_sample_stride_height, vae.tile_sample_stride_width
        tile_sample_height, tile_sample_width = vae.tile_sample_min_height, vae.tile_sample_min_width
        sample_height, sample_width = height * scale, width * scale
        if patch is not None:
            sample_height, sample_width = sample_height // patch, sample_width // patch
            sample_stride_height, sample_stride_width = sample_stride_height // patch, sample_stride_width // patch
            tile_sample_height, tile_sample_width = tile_sample_height // patch, tile_sample_width // patch
        return cls(
            frames=frames,
            height=height,
            width=width,
            tile_height=vae.tile_sample_min_height // scale,
            tile_width=vae.tile_sample_min_width // scale,
            stride_height=vae.tile_sample_stride_height // scale,
            stride_width=vae.tile_sample_stride_width // scale,
            sample_stride_height=sample_stride_height,
            sample_stride_width=sample_stride_width,
            blend_height=tile_sample_height - sample_stride_height,
            blend_width=tile_sample_width - sample_stride_width,
            sample_height=sample_height,
            sample_width=sample_width,
            patch_size=patch,
        )

    @property
    def tiled(self) -> bool:
        """Whether the VAE's own decode tiles it: only a video wider or taller than a tile."""
        return self.width > self.tile_width or self.height > self.tile_height

    @property
    def rows(self) -> range:
        return range(0, self.height, self.stride_height)

    @property
    def columns(self) -> range:
        return range(0, self.width, self.stride_width)

    @property
    def tiles(self) -> list[Tile]:
        """Every tile, row by row."""
        return [(i, j) for i in self.rows for j in self.columns]

    def share(self, rank: int, size: int) -> list[Tile]:
        """The tiles rank ``rank`` of ``size`` decodes: every ``size``-th, from its own."""
        return self.tiles[rank::size]


# A process's way to have every tile of a grid decoded, shared out among a group's
# ranks: (model, vae, latents, grid) to the tiles; None when it cannot now (the
# caller then decodes them all itself).
TileSharing = Callable[[str, Any, torch.Tensor, TileGrid], Tiles | None]


def set_tile_size(vae: Any, pixels: int) -> None:
    """``vae``'s tiles ``pixels`` a side, overlapping by a quarter as its defaults do
    (256, every 192): smaller, for a small video to tile (tests, benchmarks)."""
    vae.tile_sample_min_height = vae.tile_sample_min_width = pixels
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = pixels * 3 // 4


def decode_tiles(vae: Any, z: torch.Tensor, grid: TileGrid, tiles: Sequence[Tile]) -> Tiles:
    """``tiles`` of ``z`` (1, C, F, h, w: un-normalised latents) decoded, each every
    frame: what ``tiled_decode``'s first loop makes of them."""
    out: Tiles = {}
    try:
        for i, j in tiles:
            vae.clear_cache()
            frames = []
            for k in range(grid.frames):
                vae._conv_idx = [0]
                tile = z[:, :, k : k + 1, i : i + grid.tile_height, j : j + grid.tile_width]
                tile = vae.post_quant_conv(tile)
                frames.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
            out[(i, j)] = torch.cat(frames, dim=2)
    finally:
        vae.clear_cache()  # the cache holds device memory between calls otherwise
    return out


def blend(vae: Any, grid: TileGrid, decoded: Tiles) -> torch.Tensor:
    """Every tile of ``grid`` (``decoded``, on one device) joined into the video
    (1, 3, F, H, W), clamped to [-1, 1]: ``tiled_decode``'s second half."""
    rows = [[decoded[(i, j)] for j in grid.columns] for i in grid.rows]
    joined = []
    for r, row in enumerate(rows):
        cut = []
        for c, tile in enumerate(row):
            if r > 0:
                tile = vae.blend_v(rows[r - 1][c], tile, grid.blend_height)
            if c > 0:
                tile = vae.blend_h(row[c - 1], tile, grid.blend_width)
            cut.append(tile[:, :, :, : grid.sample_stride_height, : grid.sample_stride_width])
        joined.append(torch.cat(cut, dim=-1))
    video = torch.cat(joined, dim=3)[:, :, :, : grid.sample_height, : grid.sample_width]
    if grid.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        video = unpatchify(video, patch_size=grid.patch_size)
    return torch.clamp(video, min=-1.0, max=1.0)
