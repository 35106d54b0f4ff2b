"""Encoding decoded frames as MP4 (H.264) or animated WebP, and reading them back."""

from __future__ import annotations

from pathlib import Path
from threading import Event

import numpy as np
import pytest
import torch

from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.errors import InvalidArgument
from services.generation import GenerationParams
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.models.video_encoding import (
    VIDEO_MIME_TYPES,
    VideoInfo,
    VideoWriter,
    encode_video,
    probe_video,
    read_frames,
)

MP4, WEBP = "video/mp4", "image/webp"
CPU = torch.device("cpu")


def clip(frames: int = 9, width: int = 64, height: int = 48) -> np.ndarray:
    """Smooth colour gradients drifting a few pixels a frame: like generated video."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack(
        [np.stack([(x * 3 + 4 * i) % 256, y * 255 // height, (x + y + 6 * i) % 256], axis=-1) for i in range(frames)]
    ).astype(np.uint8)


def test_video_formats_name_their_mime_types() -> None:
    assert VIDEO_MIME_TYPES == {"mp4": "video/mp4", "webp": "image/webp"}


# H.264 halves the colour resolution (4:2:0); WebP at quality 90 stays closer. Measured:
# about 2.0 and 1.2.
@pytest.mark.parametrize(("mime_type", "max_error"), [(MP4, 3.0), (WEBP, 1.6)])
def test_a_video_reads_back_with_its_frames_size_and_rate(mime_type: str, max_error: float) -> None:
    frames = clip()
    data = encode_video(frames, mime_type, fps=8)
    if mime_type == MP4:
        assert data[4:8] == b"ftyp"
    else:
        assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    assert probe_video(data) == VideoInfo(mime_type, frames=9, width=64, height=48, fps=8.0)
    decoded = read_frames(data)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() <= max_error


def test_an_mp4_starts_with_its_index_so_it_plays_while_it_downloads() -> None:
    data = encode_video(clip(), MP4, fps=8)
    boxes, at = [], 0
    while at < len(data):
        boxes.append(data[at + 4 : at + 8])
        at += int.from_bytes(data[at : at + 4], "big")
    assert boxes.index(b"moov") < boxes.index(b"mdat")


@pytest.mark.parametrize("mime_type", [MP4, WEBP])
def test_chunks_make_the_same_file_as_all_at_once_and_every_time(mime_type: str) -> None:
    frames = clip()
    whole = encode_video(frames, mime_type, fps=8)
    assert encode_video(frames, mime_type, fps=8) == whole
    with VideoWriter(mime_type, 64, 48, 8) as writer:
        for chunk in (frames[:1], frames[1:1], frames[1:5], frames[5:]):
            writer.add(chunk)
        assert writer.finish() == whole


def test_a_fractional_rate_and_millisecond_frame_times_keep_the_rate() -> None:
    frames = clip(frames=24)
    assert probe_video(encode_video(frames, MP4, fps=23.976)).fps == pytest.approx(23.976)
    # WebP frames last whole milliseconds: 42, 41, 42, ... for 24 fps, 1 s in all.
    assert probe_video(encode_video(frames, WEBP, fps=24)).fps == pytest.approx(24.0)


@pytest.mark.parametrize(
    ("mime_type", "width", "height", "fps", "field", "words"),
    [
        ("video/webm", 64, 48, 8, "mime_type", "video/webm"),
        ("image/png", 64, 48, 8, "mime_type", "image/png"),
        (MP4, 63, 48, 8, "width", "H.264 needs even sizes"),
        (MP4, 64, 47, 8, "height", "H.264 needs even sizes"),
        (MP4, 0, 48, 8, "width", "not a positive size"),
        (MP4, 64, 48, 0.5, "fps", "outside 1..120"),
        (WEBP, 64, 48, 121, "fps", "outside 1..120"),
        (WEBP, 64, 48, float("nan"), "fps", "outside 1..120"),
    ],
)
def test_what_cannot_be_encoded_is_refused_by_name(
    mime_type: str, width: int, height: int, fps: float, field: str, words: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        VideoWriter(mime_type, width, height, fps)
    assert [v.field for v in err.value.violations] == [field]
    assert words in str(err.value)


def test_webp_takes_odd_sizes() -> None:
    assert probe_video(encode_video(clip(frames=2, width=63, height=47), WEBP, fps=8)).width == 63


@pytest.mark.parametrize("mime_type", [MP4, WEBP])
def test_frames_of_the_wrong_size_or_type_or_none_at_all_are_refused(mime_type: str) -> None:
    with VideoWriter(mime_type, 64, 48, 8) as writer:
        with pytest.raises(ValueError, match=r"\(N, 48, 64, 3\)"):
            writer.add(clip(width=48, height=64))
        with pytest.raises(ValueError, match=r"\(N, 48, 64, 3\)"):
            writer.add(clip()[0])  # one frame, without the frame axis
        with pytest.raises(ValueError, match="uint8"):
            writer.add(clip().astype(np.float32))
        with pytest.raises(ValueError, match="no frames"):
            writer.finish()


def test_a_finished_writer_takes_no_more_frames() -> None:
    writer = VideoWriter(MP4, 64, 48, 8)
    writer.add(clip())
    writer.finish()
    with pytest.raises(ValueError, match="finished"):
        writer.add(clip())


def test_what_is_not_a_video_is_not_read() -> None:
    with pytest.raises(ValueError, match="not an MP4 or a WebP"):
        probe_video(b"\x89PNG\r\n\x1a\n" + bytes(32))


def test_the_same_frames_make_the_same_mp4_whatever_the_heap_holds(models_dir: Path) -> None:
    """Bytes that depend on the frames alone, so that a resumed video equals its
    uninterrupted one: x264's macroblock-tree read memory it never wrote, and the
    bytes followed what earlier allocations had left in the heap. Frames of the
    miniature video model, which showed it (synthetic ones rarely did)."""
    registry = ModelRegistry.load()
    params = GenerationParams("tiny-wan", "waves", "", 64, 48, 4, 5.0, 3, 1, frames=17, fps=8.0)
    [latents] = SamplerEngine(registry, models_dir, CPU).sample_batch([BatchMember(params, lambda *_: None, Event())])
    assert isinstance(latents, torch.Tensor)
    [decoded] = VaeDecoderEngine(registry, models_dir, CPU).decode_images("tiny-wan", latents)
    rng = np.random.default_rng(0)
    made = set()
    for i in range(12):
        churn = [np.full(int(size), i * 21 % 256, np.uint8) for size in rng.integers(1 << 10, 1 << 20, 60)]
        del churn
        made.add(encode_video(decoded.pixels, MP4, fps=8))
    assert len(made) == 1
