"""Decoded frames to video files: MP4 (H.264) or animated WebP. A video job names its
format ("mp4" or "webp"); "webp" is also a still image's format, and an animated WebP
is a WebP with several frames. FFmpeg comes inside PyAV's wheels; no system ffmpeg."""

from __future__ import annotations

import io
import math
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc, Interpolation
from PIL import Image, ImageSequence

from services.errors import FieldViolation, InvalidArgument
from services.models.spec import MAX_FPS

VIDEO_MIME_TYPES = {"mp4": "video/mp4", "webp": "image/webp"}
_MP4, _WEBP = VIDEO_MIME_TYPES["mp4"], VIDEO_MIME_TYPES["webp"]

# crf 18: visually lossless for clean generated frames. veryfast: 2-4x faster than
# medium for files a few percent larger; superfast and below turn off the lookahead,
# and files triple. mbtree off: x264's macroblock-tree (its SIMD propagation) reads
# memory it never wrote, so the same frames encoded twice in one process came out
# as different bytes (seen here: 2-3 different files in 12 encodes of one clip),
# and a resumed video could never equal its uninterrupted one. Without it files are
# larger at the same crf (about 1.6x on the miniatures' noise), for bytes that
# depend on the frames alone.
_X264_OPTIONS = {"crf": "18", "preset": "veryfast", "x264-params": "mbtree=0"}
# x264 is deterministic for a given thread count, but the count changes the output and
# its default (auto) follows the host's cores: fixed, so every host writes the same
# bytes. One: more threads cost a few percent in size and gained nothing on 2 cores;
# a decoder encodes several videos at once.
_X264_THREADS = 1
# Also fixed for repeatable bytes: swscale's SIMD paths round differently unless told
# to be bit-exact. BT.709, limited range, and tagged so: untagged, players guess
# between BT.601 and BT.709, and colours shift.
_SWS_FLAGS = Interpolation.BILINEAR | Interpolation.ACCURATE_RND | Interpolation.BITEXACT
_WEBP_OPTIONS = {"quality": 90, "method": 4, "loop": 0}


@dataclass(frozen=True)
class VideoInfo:
    mime_type: str
    frames: int
    width: int
    height: int
    fps: float  # 0.0 for a one-frame WebP: Pillow writes it as a still, without a duration


def check_video(mime_type: str, width: int, height: int, fps: float) -> None:
    """InvalidArgument naming each parameter that cannot be encoded."""
    bad = []
    if mime_type not in (_MP4, _WEBP):
        known = ", ".join(VIDEO_MIME_TYPES.values())
        bad.append(FieldViolation("mime_type", f"cannot encode {mime_type!r} as video; known: {known}"))
    for field, side in (("width", width), ("height", height)):
        if side < 1:
            bad.append(FieldViolation(field, f"{side} is not a positive size"))
        elif side % 2 and mime_type == _MP4:
            bad.append(FieldViolation(field, f"{side} is odd: H.264 needs even sizes (4:2:0 colour is half size)"))
    if not (math.isfinite(fps) and 1.0 <= fps <= MAX_FPS):
        bad.append(FieldViolation("fps", f"{fps} is outside 1..{MAX_FPS:g}"))
    if bad:
        raise InvalidArgument(bad)


class VideoWriter:
    """Frames in, a video file out, a chunk of frames at a time. MP4 encodes frames as
    they come (into a temporary file: FFmpeg's +faststart rewrites the file to move
    its index to the front, so that it plays while it downloads). WebP keeps every
    frame until ``finish`` (Pillow encodes an animation in one call), at 4 bytes a
    pixel: 130 MB for 81 frames of 832x480.
    CPU-bound: callers on an event loop run it in a thread."""

    def __init__(self, mime_type: str, width: int, height: int, fps: float):
        check_video(mime_type, width, height, fps)
        self.mime_type, self.width, self.height, self.fps = mime_type, width, height, fps
        self.frames = 0
        self._open = True
        self._images: list[Image.Image] = []
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        if mime_type == _MP4:
            self._dir = tempfile.TemporaryDirectory(prefix="darkroom-video-")
            self._path = Path(self._dir.name) / "video.mp4"
            self._container = av.open(str(self._path), "w", format="mp4", options={"movflags": "+faststart"})
            self._stream = self._container.add_stream(
                "libx264", rate=Fraction(fps).limit_denominator(1001), options=_X264_OPTIONS
            )
            codec = self._stream.codec_context
            codec.width, codec.height, codec.pix_fmt, codec.thread_count = width, height, "yuv420p", _X264_THREADS
            codec.colorspace, codec.color_range = Colorspace.ITU709, ColorRange.MPEG
            codec.color_primaries, codec.color_trc = ColorPrimaries.BT709, ColorTrc.BT709

    def add(self, frames: np.ndarray) -> None:
        """Appends (N, height, width, 3) uint8 RGB frames."""
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
            raise ValueError(f"frames must be a uint8 array, not {getattr(frames, 'dtype', type(frames).__name__)}")
        if frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be (N, {self.height}, {self.width}, 3) RGB, not {frames.shape}")
        if not self._open:
            raise ValueError("this video is finished")
        for frame in frames:
            if self.mime_type == _WEBP:
                self._images.append(Image.fromarray(frame))
            else:
                rgb = av.VideoFrame.from_ndarray(frame, format="rgb24")
                yuv = rgb.reformat(
                    format="yuv420p",
                    dst_colorspace=Colorspace.ITU709,
                    dst_color_range=ColorRange.MPEG,
                    interpolation=_SWS_FLAGS,
                    threads=1,
                )
                yuv.pts = self.frames
                self._container.mux(self._stream.encode(yuv))
            self.frames += 1

    def finish(self) -> bytes:
        """The video file; the writer takes no more frames."""
        if not self._open:
            raise ValueError("this video is finished")
        if not self.frames:
            raise ValueError("no frames: a video needs at least one")
        try:
            if self.mime_type == _WEBP:
                return _webp(self._images, self.fps)
            self._container.mux(self._stream.encode(None))  # the frames x264 holds back
            self._container.close()  # writes the index, then moves it to the front
            return self._path.read_bytes()
        finally:
            self.close()

    def close(self) -> None:
        """Frees the frames and the temporary file; for a writer abandoned unfinished."""
        self._open = False
        self._images = []
        if self._dir is not None:
            self._container.close()
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _webp(images: list[Image.Image], fps: float) -> bytes:
    # WebP durations are whole milliseconds: rounding each frame's end, not each
    # duration, keeps the total right (24 fps: 42, 41, 42, ... ms).
    ends = [round((i + 1) * 1000 / fps) for i in range(len(images))]
    durations = [end - start for start, end in pairwise([0, *ends])]
    buf = io.BytesIO()
    images[0].save(buf, "WEBP", save_all=True, append_images=images[1:], duration=durations, **_WEBP_OPTIONS)
    return buf.getvalue()


def encode_video(frames: np.ndarray, mime_type: str, fps: float) -> bytes:
    """(N, H, W, 3) uint8 RGB frames as a video file of ``mime_type``."""
    if frames.ndim != 4:
        raise ValueError(f"frames must be (N, H, W, 3) RGB, not {frames.shape}")
    with VideoWriter(mime_type, frames.shape[2], frames.shape[1], fps) as writer:
        writer.add(frames)
        return writer.finish()


def probe_video(data: bytes) -> VideoInfo:
    """The format, frame count, size and frame rate of an MP4 or a WebP."""
    if _mime_type(data) == _MP4:
        with av.open(io.BytesIO(data), "r") as container:
            stream = container.streams.video[0]
            frames = stream.frames or sum(p.size > 0 for p in container.demux(stream))
            rate = stream.average_rate or stream.guessed_rate or 0
            return VideoInfo(_MP4, frames, stream.codec_context.width, stream.codec_context.height, float(rate))
    with Image.open(io.BytesIO(data)) as image:
        total_ms = 0
        for frame in ImageSequence.Iterator(image):
            frame.load()  # Pillow reads a frame's duration as it decodes it
            total_ms += frame.info.get("duration", 0)
        frames = getattr(image, "n_frames", 1)
        return VideoInfo(_WEBP, frames, image.width, image.height, frames * 1000 / total_ms if total_ms else 0.0)


def read_frames(data: bytes) -> np.ndarray:
    """An MP4's or a WebP's frames, as (N, H, W, 3) uint8 RGB."""
    if _mime_type(data) == _MP4:
        with av.open(io.BytesIO(data), "r") as container:
            # The stream's tags say how its YUV maps to RGB (BT.709 for ours).
            return np.stack(
                [f.to_ndarray(format="rgb24", src_color_range=f.color_range) for f in container.decode(video=0)]
            )
    with Image.open(io.BytesIO(data)) as image:
        return np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)])


def _mime_type(data: bytes) -> str:
    if data[4:8] == b"ftyp":
        return _MP4
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _WEBP
    raise ValueError("not an MP4 or a WebP file")
