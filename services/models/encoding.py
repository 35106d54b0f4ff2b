"""Decoded pixels to image files: PNG, JPEG or WebP; a video's frames to MP4 or
animated WebP (``services.models.video_encoding``). A job names its format ("png",
"jpeg", "webp", "mp4", stored on the job); a decode request carries its MIME type."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from services.errors import FieldViolation, InvalidArgument
from services.models.video_encoding import VIDEO_MIME_TYPES, encode_video

MIME_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4"}
DEFAULT_MIME_TYPE = MIME_TYPES["png"]
# PNG: fast and lossless (level 1 is several times faster than the default, a few
# percent larger). JPEG and WebP: visually lossless at about a tenth of the PNG's size.
_SAVE_OPTIONS = {
    "image/png": ("PNG", {"compress_level": 1}),
    "image/jpeg": ("JPEG", {"quality": 90}),
    "image/webp": ("WEBP", {"quality": 90, "method": 4}),
}


def mime_type_of(output_format: str) -> str:
    """The MIME type of a job's output format."""
    try:
        return MIME_TYPES[output_format]
    except KeyError:
        raise InvalidArgument(
            [FieldViolation("output_format", f"unknown format {output_format!r}; known: {', '.join(MIME_TYPES)}")]
        ) from None


def check_mime_type(mime_type: str, *, video: bool = False) -> str:
    """``mime_type`` if an image (or a video) can be encoded as it (empty means PNG,
    or MP4); else InvalidArgument."""
    if video:
        mime_type = mime_type or VIDEO_MIME_TYPES["mp4"]
        if mime_type not in VIDEO_MIME_TYPES.values():
            known = ", ".join(VIDEO_MIME_TYPES.values())
            raise InvalidArgument(
                [FieldViolation("mime_type", f"cannot encode a video as {mime_type!r}; known: {known}")]
            )
        return mime_type
    mime_type = mime_type or DEFAULT_MIME_TYPE
    if mime_type not in _SAVE_OPTIONS:
        raise InvalidArgument(
            [FieldViolation("mime_type", f"cannot encode {mime_type!r}; known: {', '.join(_SAVE_OPTIONS)}")]
        )
    return mime_type


def encode_output(pixels: np.ndarray, mime_type: str, fps: float = 0.0) -> bytes:
    """An image (HxWx3 uint8) as an image file, or a video's frames (FxHxWx3) as a
    video file at ``fps``. CPU-bound: callers on an event loop run it in a thread."""
    if pixels.ndim == 4:
        return encode_video(pixels, mime_type, fps)
    return encode(pixels, mime_type)


def encode(pixels: np.ndarray, mime_type: str) -> bytes:
    """An HxWx3 uint8 array as an image file of ``mime_type``. CPU-bound: callers on
    an event loop run it in a thread."""
    image_format, options = _SAVE_OPTIONS[check_mime_type(mime_type)]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=image_format, **options)
    return buf.getvalue()
