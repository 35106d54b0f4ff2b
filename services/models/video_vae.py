"""A video model's latents to frames with its diffusers VAE (Wan's
``AutoencoderKLWan``): the latents un-normalised as the pipeline does, then decoded
in temporal chunks, one latent frame (four frames; the first, one) at a time, the
VAE's causal cache carrying what came before, each chunk brought to uint8 on the
CPU at once, so device memory stays that of a chunk whatever the video's length.
A video larger than ``tile_above_pixels`` per frame is decoded in spatial tiles
instead (the VAE's own tiled decode, every frame of a tile at once), on a group
shared out among its ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.models.frames import FrameStats
from services.models.video_tiles import TileGrid, Tiles, blend

# A tiled video's tiles decoded elsewhere too: (vae, latents, grid) to every tile, or None.
Share = Callable[[Any, torch.Tensor, TileGrid], Tiles | None]


def decode_video(
    vae: Any, z: torch.Tensor, tile_above_pixels: int, share: Share | None = None
) -> tuple[torch.Tensor, FrameStats, bool]:
    """One video's latents (C, latent frames, h, w) as its frames (F, H, W, 3) uint8
    on the CPU, what their pixels add up to (for the output check), and whether it
    was tiled. ``share``: where a tiled video's tiles can be shared out (a group's
    ranks: ``services.models.video_tiles``); the video is the same either way."""
    config = vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    x = z.unsqueeze(0) * std + mean  # the pipeline's ``latents / (1 / std) + mean``
    scale = vae.spatial_compression_ratio
    stats = FrameStats()
    if x.shape[-2] * x.shape[-1] * scale * scale > tile_above_pixels:
        vae.enable_tiling()
        grid = TileGrid.of(vae, x.shape)
        tiles = share(vae, x, grid) if share is not None and grid.tiled else None
        decoded = blend(vae, grid, tiles) if tiles is not None else vae.decode(x).sample
        return _to_frames(decoded, stats), stats, True
    chunks = []
    vae.clear_cache()
    try:
        h = vae.post_quant_conv(x)
        for i in range(h.shape[2]):
            vae._conv_idx = [0]
            out = vae.decoder(h[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
            chunks.append(_to_frames(out.clamp(-1.0, 1.0), stats))
    finally:
        vae.clear_cache()  # the cache holds device memory between calls otherwise
    return torch.cat(chunks), stats, False


def _to_frames(decoded: torch.Tensor, stats: FrameStats) -> torch.Tensor:
    """(1, 3, F, H, W) in [-1, 1] as (F, H, W, 3) uint8 on the CPU, counted in ``stats``."""
    unit = decoded[0].float() / 2 + 0.5
    stats.add(unit)
    return (unit.nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).cpu()
