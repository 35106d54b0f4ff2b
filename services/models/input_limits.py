"""What a model takes of a job's inputs: an input image's (an edit's, an upscale's)
shortest side and aspect ratio, and, for a family whose text encoder reads its
prompt whole beside the image, the prompt's length. The gateway refuses a job past
them before anything is stored; the sampler that prepares a job checks its image
again (a job stored before a limit was, or by an older gateway), failing it as the
job's own fault. And the size at which a family whose text encoder sees the input
image sees it (``edit_condition_size``), which never leaves what its processor
takes. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.errors import FieldViolation
from services.models.spec import ModelFamily, ModelSpec

# A family whose text encoder sees the input image (``ModelSpec.prompt_sees_image``)
# sees it at about this many pixels, at its own aspect ratio up to
# EDIT_CONDITION_MAX_ASPECT. Within 4:1 the image's tokens (the Qwen2-VL processor's
# 28x28-pixel cells, more of them the longer the image's sides) stay at most 1,386,
# within the EDIT_CONDITION_TOKENS that a compiled network's text holds beside a
# whole prompt; further out they grow past them, and past 200:1 the processor
# refuses the image.
EDIT_CONDITION_AREA = 1024 * 1024
EDIT_CONDITION_MAX_ASPECT = 4.0
EDIT_CONDITION_TOKENS = 1424
# The prompt Qwen-Image-Edit's text encoder reads beside the image, in tokens
# (QwenImageEditPipeline's tokenizer_max_length); its pipeline cuts none of it.
QWEN_EDIT_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class InputLimits:
    min_side: int  # an input image's shortest side, in pixels
    max_aspect: float  # its longest side over its shortest
    prompt_bytes: int  # a prompt's (and negative prompt's) UTF-8 bytes; 0: the gateway's max_prompt_chars alone


# Unless its family says otherwise: an input at least two of the VAE's 8-pixel
# latent cells across, and no longer than 16:1, the widest output a model of
# 1024-pixel sides and a 64-pixel least side makes (an input past it is resized to
# a shape it has nothing of).
DEFAULT_INPUT_LIMITS = InputLimits(min_side=16, max_aspect=16.0, prompt_bytes=0)
FAMILY_INPUT_LIMITS = {
    # Its byte-level tokenizer's every token is at least one byte: a prompt of at
    # most QWEN_EDIT_PROMPT_TOKENS bytes is always read whole.
    ModelFamily.QWEN_IMAGE_EDIT: InputLimits(
        min_side=16, max_aspect=EDIT_CONDITION_MAX_ASPECT, prompt_bytes=QWEN_EDIT_PROMPT_TOKENS
    ),
}


def input_limits(spec: ModelSpec) -> InputLimits:
    """The model's limits: the registry's where it sets them, else its family's."""
    family = FAMILY_INPUT_LIMITS.get(spec.family, DEFAULT_INPUT_LIMITS)
    return InputLimits(
        min_side=spec.min_input_side or family.min_side,
        max_aspect=spec.max_input_aspect or family.max_aspect,
        prompt_bytes=spec.max_prompt_bytes or family.prompt_bytes,
    )


def image_violations(field: str, width: int, height: int, spec: ModelSpec) -> list[FieldViolation]:
    """What is wrong with an input image of ``width`` x ``height`` for ``spec``'s
    model (named by ``field``: ``image``, ``mask``), if anything."""
    limits = input_limits(spec)
    short, long = sorted((width, height))
    if short < limits.min_side:
        return [
            FieldViolation(
                field,
                f"is {width}x{height} pixels; {spec.name} takes an input of at least {limits.min_side} px on each side",
            )
        ]
    if long / short > limits.max_aspect:
        return [
            FieldViolation(
                field,
                f"is {width}x{height} pixels, an aspect ratio of {long / short:.3g}:1; "
                f"{spec.name} takes at most {limits.max_aspect:g}:1",
            )
        ]
    return []


def prompt_violations(field: str, text: str, spec: ModelSpec) -> list[FieldViolation]:
    """A prompt (``field``: ``prompt``, ``negative_prompt``) longer than ``spec``'s
    model reads whole, if it is."""
    limit = input_limits(spec).prompt_bytes
    size = len(text.encode())
    if not limit or size <= limit:
        return []
    return [
        FieldViolation(
            field,
            f"is {size} bytes in UTF-8; {spec.name} takes at most {limit}, what its text encoder reads whole "
            "beside the image",
        )
    ]


def edit_condition_size(width: int, height: int) -> tuple[int, int]:
    """The size an input image of ``width`` x ``height`` is resized to for a family
    whose text encoder sees it (and for its latents): ``EDIT_CONDITION_AREA`` at its
    aspect ratio, in multiples of 32, as ``QwenImageEditPipeline``'s
    calculate_dimensions makes it. An aspect past EDIT_CONDITION_MAX_ASPECT (refused
    at the gateway; a job stored before it was) is squeezed to it: neither side is
    ever under 512 pixels, and the image's tokens never pass EDIT_CONDITION_TOKENS."""
    ratio = max(width, 1) / max(height, 1)
    ratio = min(max(ratio, 1 / EDIT_CONDITION_MAX_ASPECT), EDIT_CONDITION_MAX_ASPECT)
    fitted = math.sqrt(EDIT_CONDITION_AREA * ratio)
    return round(fitted / 32) * 32, round(fitted / ratio / 32) * 32
