"""A video's latents decoded in temporal chunks give exactly the frames Wan's VAE
gives decoding the whole video at once; above the tiling size, spatial tiles of the
frames' size, which, decoded in shares (as a group's ranks decode them) and blended,
are exactly the VAE's own tiled video; and the output check sees a blank video."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import AutoencoderKLWan

from services.models.frames import FrameStats
from services.models.video_tiles import TileGrid, Tiles, blend, decode_tiles, set_tile_size
from services.models.video_vae import decode_video


@pytest.fixture(scope="module")
def vae(models_dir: Path) -> Any:  # diffusers' VAE: its tiling attributes are not typed
    return AutoencoderKLWan.from_pretrained(models_dir / "tiny-wan", subfolder="vae", local_files_only=True).eval()


def whole(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """What the pipeline gets: the whole video in one decode, as uint8 frames."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.inference_mode():
        video = vae.decode(z.unsqueeze(0) * std + mean).sample[0]
    return ((video.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)


def test_chunks_decode_exactly_the_whole_videos_frames(vae: Any) -> None:
    z = torch.randn(16, 5, 6, 8, generator=torch.Generator().manual_seed(1))  # 17 frames of 64x48
    with torch.inference_mode():
        frames, stats, tiled = decode_video(vae, z, tile_above_pixels=10**9)
    assert frames.shape == (17, 48, 64, 3) and frames.dtype == torch.uint8 and not tiled
    assert torch.equal(frames, whole(vae, z))
    assert stats.count == 17 * 48 * 64 * 3 and stats.finite and stats.std > 0.01


def test_a_video_above_the_tiling_size_decodes_in_tiles(vae: Any) -> None:
    z = torch.randn(16, 2, 12, 16, generator=torch.Generator().manual_seed(2))  # 5 frames of 128x96
    set_tile_size(vae, 64)
    with torch.inference_mode():
        frames, _, tiled = decode_video(vae, z, tile_above_pixels=64 * 64)
    assert tiled and frames.shape == (5, 96, 128, 3)
    assert vae.use_tiling


def test_tiles_decoded_in_shares_blend_into_the_vaes_own_tiled_video(vae: Any) -> None:
    z = torch.randn(1, 16, 2, 12, 16, generator=torch.Generator().manual_seed(3))  # 5 frames of 128x96
    set_tile_size(vae, 64)
    vae.enable_tiling()
    grid = TileGrid.of(vae, z.shape)
    assert grid.tiles == [(0, 0), (0, 6), (0, 12), (6, 0), (6, 6), (6, 12)]
    assert grid.share(0, 2) == [(0, 0), (0, 12), (6, 6)] and grid.share(1, 2) == [(0, 6), (6, 0), (6, 12)]
    with torch.inference_mode():
        own = vae.tiled_decode(z).sample
        tiles = decode_tiles(vae, z, grid, grid.share(1, 2)) | decode_tiles(vae, z, grid, grid.share(0, 2))
        assert torch.equal(blend(vae, grid, tiles), own)


def test_a_shared_out_video_is_the_one_decoded_alone_and_one_not_shared_decodes_here(vae: Any) -> None:
    z = torch.randn(16, 2, 12, 16, generator=torch.Generator().manual_seed(4))
    set_tile_size(vae, 64)
    asked: list[int] = []

    def in_halves(vae: Any, x: torch.Tensor, grid: TileGrid) -> Tiles:
        asked.append(len(grid.tiles))
        return decode_tiles(vae, x, grid, grid.share(1, 2)) | decode_tiles(vae, x, grid, grid.share(0, 2))

    with torch.inference_mode():
        alone, _, _ = decode_video(vae, z, tile_above_pixels=64 * 64)
        shared, _, tiled = decode_video(vae, z, tile_above_pixels=64 * 64, share=in_halves)
        refused, _, _ = decode_video(vae, z, tile_above_pixels=64 * 64, share=lambda *_: None)
    assert tiled and asked == [6]
    assert torch.equal(shared, alone) and torch.equal(refused, alone)
    # No wider or taller than a tile (64 px): the VAE decodes it whole, and so it is not shared.
    with torch.inference_mode():
        decode_video(vae, z[..., :8, :8], tile_above_pixels=32 * 32, share=in_halves)
    assert asked == [6] and not TileGrid.of(vae, (1, 16, 2, 8, 8)).tiled


def test_the_output_check_sees_a_blank_video() -> None:
    stats = FrameStats()
    stats.add(torch.full((3, 2, 8, 8), 0.5))
    assert "degenerate" in stats.fault(0.002)
    stats.add(torch.tensor([float("nan")]))
    assert "NaN" in stats.fault(0.002)
