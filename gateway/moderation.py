"""``Moderate``: each input checked as a submit would be, so that a client can check
before it pays. A text goes through the prompt filter (categories "profanity" and
"sexual", scored 1 or 0); an image through the image filter's classifier
(open_nsfw: category "sexual", its score, flagged from IMAGE_FILTER_THRESHOLD).
Only the categories Darkroom checks are answered: no "violence" false that would
read as "checked, and clean". The list and the classifier are used whether or not
the filters on submits and outputs are on: a caller who asks is answered.

Inputs are checked before any is judged, each mistake named by its field
(``inputs[2].image``). Decoding and scoring images costs CPU: it runs in a thread,
one request's images at a time, and the classifier is loaded (about 0.3 s) on
the first image a gateway is asked about. Each image is brought down to the
classifier's input as it is decoded (a JPEG decoded at that scale), its whole
pixels let go at once, and scored on its own: a call of 32 images of 4096x4096
holds about 6 MiB of them, not 1.5 GiB. The servicer draws each call that
``check`` passed on its tenant's rate limit before the work."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from gateway.inputs import decode_input
from gateway.metrics import MODERATED
from services.errors import FieldViolation, InvalidArgument
from services.moderation import MAX_INPUTS
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.image_filter import ImageClassifier, OpenNsfw
from services.safety.prompt_filter import CATEGORIES, SEXUAL_CATEGORY, PromptFilter

# open_nsfw brings every image to 256x256 (bilinear) before it crops the middle
# 224: one brought down to this as it is decoded scores as the whole would.
CLASSIFIER_SIZE = 256


@dataclass(frozen=True)
class Limits:
    max_text_chars: int
    max_image_bytes: int
    threshold: float  # the NSFW score from which an image is flagged


def text_result(prompt_filter: PromptFilter, text: str) -> pb.ModerationResult:
    verdict = prompt_filter.check(text)
    return pb.ModerationResult(
        flagged=verdict.flagged,
        categories={c: c in verdict.categories for c in CATEGORIES},
        category_scores={c: 1.0 if c in verdict.categories else 0.0 for c in CATEGORIES},
    )


def image_result(score: float, threshold: float) -> pb.ModerationResult:
    flagged = score >= threshold
    return pb.ModerationResult(
        flagged=flagged, categories={SEXUAL_CATEGORY: flagged}, category_scores={SEXUAL_CATEGORY: score}
    )


def check_inputs(request: pb.ModerateRequest, limits: Limits) -> list[FieldViolation]:
    """What is wrong with the request's inputs short of decoding its images."""
    if not request.inputs:
        return [FieldViolation("inputs", "is empty: give at least one text or image")]
    if len(request.inputs) > MAX_INPUTS:
        return [FieldViolation("inputs", f"holds {len(request.inputs)} inputs; at most {MAX_INPUTS} are taken")]
    bad = []
    for i, one in enumerate(request.inputs):
        kind = one.WhichOneof("input")
        if kind is None:
            bad.append(FieldViolation(f"inputs[{i}]", "is empty: set text or image"))
        elif kind == "text" and len(one.text) > limits.max_text_chars:
            bad.append(
                FieldViolation(
                    f"inputs[{i}].text", f"is {len(one.text)} characters; the limit is {limits.max_text_chars}"
                )
            )
        elif kind == "image" and not one.image:
            bad.append(FieldViolation(f"inputs[{i}].image", "is empty"))
    return bad


def classifier_pixels(image: Image.Image) -> np.ndarray:
    """``image`` decoded at the classifier's input (CLASSIFIER_SIZE square, RGB);
    a JPEG at the smallest scale (1/2 to 1/8) no smaller than that. Blocking."""
    image.draft("RGB", (CLASSIFIER_SIZE, CLASSIFIER_SIZE))
    image.load()
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return np.asarray(rgb.resize((CLASSIFIER_SIZE, CLASSIFIER_SIZE), Image.Resampling.BILINEAR))


class Moderator:
    """Moderate's work for one gateway: the prompt filter's list, and the classifier,
    made once on first use by ``classifier``."""

    def __init__(
        self, prompt_filter: PromptFilter, limits: Limits, classifier: Callable[[], ImageClassifier] = OpenNsfw
    ) -> None:
        self.prompt_filter, self.limits = prompt_filter, limits
        self._make_classifier = classifier
        self._classifier: ImageClassifier | None = None
        self._loading = threading.Lock()
        # One request's images scored at a time: a burst of them queues here rather
        # than taking every core from the gateway's own work.
        self._scoring = asyncio.Semaphore(1)

    def check(self, request: pb.ModerateRequest) -> None:
        """InvalidArgument naming every input that is wrong short of decoding it."""
        bad = check_inputs(request, self.limits)
        if bad:
            raise InvalidArgument(bad)

    async def moderate(self, request: pb.ModerateRequest) -> pb.ModerateResponse:
        """A result per input of a request ``check`` passed; InvalidArgument naming
        every image that does not decode."""
        images = {i: one.image for i, one in enumerate(request.inputs) if one.WhichOneof("input") == "image"}
        scores: dict[int, float] = {}
        if images:
            async with self._scoring:
                scores = await asyncio.to_thread(self._score, images)
        results = []
        for i, one in enumerate(request.inputs):
            if i in scores:
                result = image_result(scores[i], self.limits.threshold)
                kind = "image"
            else:
                result = text_result(self.prompt_filter, one.text)
                kind = "text"
            MODERATED.labels(kind=kind, flagged=str(result.flagged).lower()).inc()
            results.append(result)
        return pb.ModerateResponse(results=results)

    def _score(self, images: dict[int, bytes]) -> dict[int, float]:
        """Each image's NSFW score, by its input's index; InvalidArgument naming every
        image that does not decode. Blocking."""
        pixels: dict[int, np.ndarray] = {}
        bad = []
        for i, data in images.items():
            field = f"inputs[{i}].image"
            found = decode_input(field, data, max_bytes=self.limits.max_image_bytes, decode=classifier_pixels)
            if isinstance(found, FieldViolation):
                bad.append(found)
            else:
                pixels[i] = found
        if bad:
            raise InvalidArgument(bad)
        classifier = self.classifier()
        # One at a time: the classifier's batch of 32 would hold 32 of its inputs in float32 at once.
        return {i: classifier.scores([one])[0] for i, one in pixels.items()}

    def classifier(self) -> ImageClassifier:
        """The classifier, loaded on first use. Blocking."""
        with self._loading:
            if self._classifier is None:
                self._classifier = self._make_classifier()
            return self._classifier
