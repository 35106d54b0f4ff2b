"""An edit's or upscale's input image and mask, checked before anything is stored:
bytes within the limit, a PNG, JPEG or WebP that decodes whole, pixels within
bounds read from the header before decoding (a small file can claim a huge
image), and a mask of the image's size. Pure, but decoding costs CPU: a caller on
an event loop runs it in a thread."""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from PIL import Image

from services.errors import FieldViolation
from services.models.spec import ModelSpec

T = TypeVar("T")
FORMATS = ("PNG", "JPEG", "WEBP")
# An input's pixels, from its header, before anything decodes it: 4096 x 4096.
MAX_INPUT_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class InputImage:
    data: bytes
    width: int
    height: int
    digest: str  # SHA-256, hex


def read_input(field: str, data: bytes, *, max_bytes: int) -> InputImage | FieldViolation:
    """The input image in ``data``, or what is wrong with it (named by ``field``)."""
    found = decode_input(field, data, max_bytes=max_bytes, decode=_size_once_loaded)
    if isinstance(found, FieldViolation):
        return found
    width, height = found
    return InputImage(data, width, height, hashlib.sha256(data).hexdigest())


def read_inputs(
    image: bytes, mask: bytes, *, max_bytes: int
) -> tuple[InputImage | None, InputImage | None, list[FieldViolation]]:
    """An edit's input image and mask (each None where not given, or wrong), and
    what is wrong with them: each on its own, and a mask not of the image's size."""
    bad = []
    read = {}
    for name, data in (("image", image), ("mask", mask)):
        if data:
            found = read_input(name, data, max_bytes=max_bytes)
            if isinstance(found, FieldViolation):
                bad.append(found)
            else:
                read[name] = found
    image_read, mask_read = read.get("image"), read.get("mask")
    if image_read is not None and mask_read is not None:
        size, wanted = (mask_read.width, mask_read.height), (image_read.width, image_read.height)
        if size != wanted:
            bad.append(
                FieldViolation(
                    "mask", f"is {size[0]}x{size[1]}; it must be the input image's size, {wanted[0]}x{wanted[1]}"
                )
            )
    return image_read, mask_read, bad


def decode_input(field: str, data: bytes, *, max_bytes: int, decode: Callable[[Image.Image], T]) -> T | FieldViolation:
    """What ``decode`` makes of the image in ``data`` once its bytes and header pass
    (what it decodes must decode whole), or what is wrong with it (named by ``field``)."""
    if len(data) > max_bytes:
        return FieldViolation(field, f"is {len(data)} bytes; the limit is {max_bytes} ({max_bytes / 2**20:g} MiB)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
                if width * height > MAX_INPUT_PIXELS:
                    return FieldViolation(
                        field, f"is {width}x{height} pixels; at most {MAX_INPUT_PIXELS} pixels (4096x4096) are taken"
                    )
                if getattr(image, "n_frames", 1) > 1:
                    return FieldViolation(field, "is an animated image; one still image is taken")
                return decode(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return FieldViolation(field, f"claims more than {MAX_INPUT_PIXELS} pixels")
    except Exception as exc:  # Pillow raises many kinds for bad bytes
        return FieldViolation(field, f"is not a PNG, JPEG or WebP image that decodes whole: {exc}")


def _size_once_loaded(image: Image.Image) -> tuple[int, int]:
    image.load()
    return image.size


def fit_within(width: int, height: int, spec: ModelSpec) -> tuple[int, int]:
    """An output size for an input of ``width`` x ``height``: its own, scaled
    (keeping its aspect) into the model's limits where it can be, each side a
    multiple of the model's size step."""
    step = spec.size_step
    scale = min(1.0, spec.max_width / width, spec.max_height / height)
    scale = max(scale, spec.min_size / width, spec.min_size / height)
    return max(step, int(width * scale) // step * step), max(step, int(height * scale) // step * step)
