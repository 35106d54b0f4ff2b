"""What the image filter's score does to an output, as plain data: the policy a
job is checked under (decided at submit), whether it may have previews, the
verdict a score comes to under it, and what is encoded of an output once judged
(as made, blurred, or nothing). The decoder service and a sampler decoding its
own latents both judge through ``judged``, so an output is treated the same
wherever it is decoded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter

from services.config.safety import OUTPUT_POLICIES, SafetySettings

# Verdicts, as stored on an image and returned with it.
PASSED = ""  # under the threshold, or not checked (then its score is None)
FLAGGED = "flagged"  # returned as made, marked
BLURRED = "blurred"  # returned blurred
BLOCKED = "blocked"  # withheld: no bytes stored or sent
VERDICT_OF = {"flag": FLAGGED, "blur": BLURRED, "block": BLOCKED}
VERDICTS = (PASSED, FLAGGED, BLURRED, BLOCKED)
# The blur's radius, as a share of the output's longer side: at 1/16 a face or a
# body is a smear of colour, whatever the output's size.
BLUR_SHARE = 1 / 16
# A video's frames scored at most: evenly spaced, the first and last among them.
SAMPLED_FRAMES = 8


def output_policy(safety: SafetySettings, lane: str, tenant_policy: str | None) -> str:
    """The policy a job's outputs are checked under, fixed at submit: its tenant's
    if it has one, else its lane's; "" (not checked) while the image filter is off."""
    if not safety.image_filter:
        return ""
    return tenant_policy or safety.policy_for(lane)


def previews_allowed(policy: str) -> bool:
    """Whether a job checked under ``policy`` may have rough previews of its images
    sent while they denoise. A preview is never scored (it leaves mid-denoising,
    before there is an output to score), so only where every output leaves as made
    whatever its score: not checked, or "flag". Under "block" or "blur" a preview
    would show what the filter withholds or blurs."""
    return policy in ("", "flag")


def check_policy(policy: str) -> str:
    """``policy`` if it is one (or "": not checked); ValueError otherwise."""
    if policy and policy not in OUTPUT_POLICIES:
        raise ValueError(f"output policy {policy!r} is not one of {', '.join(OUTPUT_POLICIES)}")
    return policy


def verdict(policy: str, score: float | None, threshold: float) -> str:
    """What ``score`` comes to under ``policy``: PASSED below ``threshold`` or when
    not checked; else the policy's verdict."""
    if not policy or score is None or score < threshold:
        return PASSED
    return VERDICT_OF[check_policy(policy)]


def sampled_frames(frames: int, most: int = SAMPLED_FRAMES) -> list[int]:
    """The frames of a video of ``frames`` that are scored: up to ``most``, evenly
    spaced from the first to the last (a video's score is its highest)."""
    if frames <= most:
        return list(range(frames))
    return sorted({round(i * (frames - 1) / (most - 1)) for i in range(most)})


def blurred(pixels: np.ndarray) -> np.ndarray:
    """``pixels`` (HxWx3 uint8, or a video's FxHxWx3) under a Gaussian blur of
    radius BLUR_SHARE of the longer side, each frame alike."""
    if pixels.ndim == 4:
        return np.stack([blurred(frame) for frame in pixels])
    radius = max(pixels.shape[:2]) * BLUR_SHARE
    return np.asarray(Image.fromarray(pixels).filter(ImageFilter.GaussianBlur(radius)), dtype=np.uint8)


@dataclass(frozen=True)
class Judged:
    """An output once judged: what to encode of it (None: blocked, nothing), its
    score (None: not checked) and its verdict."""

    pixels: np.ndarray | None
    nsfw_score: float | None
    verdict: str

    @property
    def blocked(self) -> bool:
        return self.verdict == BLOCKED


def judged(pixels: np.ndarray, policy: str, score: float | None, threshold: float) -> Judged:
    """``pixels`` as the verdict of ``score`` under ``policy`` has them returned."""
    found = verdict(policy, score, threshold)
    if found == BLOCKED:
        return Judged(None, score, found)
    if found == BLURRED:
        return Judged(blurred(pixels), score, found)
    return Judged(pixels, score, found)
