"""Encoding decoded pixels as PNG, JPEG or WebP, and the names of the formats."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from services.errors import InvalidArgument
from services.models.encoding import MIME_TYPES, check_mime_type, encode, mime_type_of

MAGIC = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff", "image/webp": b"RIFF"}
PIL_FORMAT = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}


def gradient(width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)


# PNG is lossless; JPEG and WebP stay close at their quality.
@pytest.mark.parametrize(("mime_type", "max_error"), [("image/png", 0.0), ("image/jpeg", 4.0), ("image/webp", 4.0)])
def test_each_format_encodes_an_image_of_its_kind_and_size(mime_type: str, max_error: float) -> None:
    pixels = gradient(96, 64)
    data = encode(pixels, mime_type)
    assert data.startswith(MAGIC[mime_type])
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        assert img.format == PIL_FORMAT[mime_type]
        assert img.size == (96, 64)
        decoded = np.asarray(img.convert("RGB"))
    assert np.abs(decoded.astype(int) - pixels.astype(int)).mean() <= max_error


def test_job_formats_name_their_mime_types() -> None:
    assert {f: mime_type_of(f) for f in MIME_TYPES} == {
        "png": "image/png",
        "jpeg": "image/jpeg",
        "webp": "image/webp",
        "mp4": "video/mp4",
    }
    with pytest.raises(InvalidArgument) as err:
        mime_type_of("gif")
    assert [v.field for v in err.value.violations] == ["output_format"]


def test_an_empty_mime_type_means_png_and_an_unknown_one_is_refused() -> None:
    assert check_mime_type("") == "image/png"
    with pytest.raises(InvalidArgument) as err:
        check_mime_type("image/gif")
    assert [v.field for v in err.value.violations] == ["mime_type"]
    assert "image/gif" in str(err.value)
