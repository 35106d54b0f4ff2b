"""Splitting encoded images into stream-sized chunks."""

from __future__ import annotations

from collections.abc import Iterator

CHUNK_BYTES = 64 * 1024


def split(data: bytes, size: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes, bool]]:
    """(offset, chunk, is_last) for each chunk; an empty image is one empty last chunk."""
    for offset in range(0, max(len(data), 1), size):
        yield offset, data[offset : offset + size], offset + size >= len(data)
