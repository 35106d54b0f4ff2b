"""What a submit's model decides of its media: frames and fps for a video model,
and whether it takes an input image, a mask, a strength and previews (an
upscale's input checked again once read, and every input's sides and aspect). Pure, as ``gateway.validation`` is:
violations named by field."""

from __future__ import annotations

import math

from gateway.convert import UPSCALE
from gateway.inputs import InputImage
from services.errors import FieldViolation
from services.generation import GenerationParams
from services.models.input_limits import image_violations
from services.models.spec import MAX_FPS, ModelSpec
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

MAX_PREVIEWS = 3


def media_violations(req: pb.SubmitJobRequest, params: GenerationParams, spec: ModelSpec) -> list[FieldViolation]:
    """Frames and fps for a video model; whether the model takes an input image, a
    mask and a strength (what the image is checked once it is read)."""
    bad = _frames(req, params, spec)
    if spec.upscales:
        bad += upscale_violations(req, spec, None)
    elif spec.instruction_edits:
        bad += _instruction_edit(req, spec)
    elif req.image and not spec.edits:
        bad.append(FieldViolation("image", f"{spec.name} makes {spec.capability} from text; it takes no input image"))
    if req.mask and not spec.edits and not spec.instruction_edits:
        bad.append(FieldViolation("mask", f"{spec.name} does not inpaint"))
    if req.previews > MAX_PREVIEWS:
        bad.append(FieldViolation("previews", f"{req.previews} is outside 0..{MAX_PREVIEWS}"))
    elif req.previews and not spec.previews:
        bad.append(FieldViolation("previews", f"{spec.name} makes no previews: they are for the image families"))
    if req.HasField("strength") and not spec.instruction_edits:
        if not req.image or spec.upscales:
            bad.append(FieldViolation("strength", "applies to edits of an input image (image) only"))
        elif not 0.0 < params.strength <= 1.0:  # also rejects NaN
            bad.append(FieldViolation("strength", f"{req.strength} is outside (0, 1]"))
    return bad


def _frames(req: pb.SubmitJobRequest, params: GenerationParams, spec: ModelSpec) -> list[FieldViolation]:
    if not spec.makes_video:
        bad = []
        if req.frames > 1:
            bad.append(FieldViolation("frames", f"{spec.name} makes images; frames are for a video model"))
        if req.fps:
            bad.append(FieldViolation("fps", f"{spec.name} makes images; fps is for a video model"))
        return bad
    bad = []
    step = spec.frames_step
    least = 1 + step  # one frame is an image
    if not least <= params.frames <= spec.max_frames or (params.frames - 1) % step:
        below = params.frames - (params.frames - 1) % step
        near = " or ".join(str(f) for f in (below, below + step) if least <= f <= spec.max_frames)
        bad.append(
            FieldViolation(
                "frames",
                f"{params.frames} does not fit {spec.name}: frames are 1 plus a multiple of {step} (its VAE's "
                f"temporal compression), {least}..{spec.max_frames}" + (f"; try {near}" if near else ""),
            )
        )
    if not (math.isfinite(params.fps) and 1.0 <= params.fps <= MAX_FPS):
        bad.append(FieldViolation("fps", f"{req.fps} is outside 1..{MAX_FPS:g}"))
    return bad


def _instruction_edit(req: pb.SubmitJobRequest, spec: ModelSpec) -> list[FieldViolation]:
    """An instruction-editing model's job: an input image and a prompt, no mask, no strength."""
    bad = []
    if not req.image:
        bad.append(FieldViolation("image", f"{spec.name} edits an input image as its prompt says: give one"))
    if req.mask:
        bad.append(FieldViolation("mask", f"{spec.name} edits by instruction: it takes no mask"))
    if req.HasField("strength"):
        bad.append(FieldViolation("strength", f"{spec.name} edits by instruction from noise: strength does not apply"))
    return bad


def input_shape_violations(spec: ModelSpec, image: InputImage | None, mask: InputImage | None) -> list[FieldViolation]:
    """The input image's and mask's (once read) sides and aspect ratio past the
    model's bounds (``services.models.input_limits``), each named by its field: on
    every path, a size given in the request too, since a family whose text encoder
    sees the image sees it at its own aspect, whatever the output's size."""
    return [
        violation
        for field, read in (("image", image), ("mask", mask))
        if read is not None
        for violation in image_violations(field, read.width, read.height, spec)
    ]


def upscale_violations(req: pb.SubmitJobRequest, spec: ModelSpec, image: InputImage | None) -> list[FieldViolation]:
    """An upscale's input: required, and (``image``, once read) a multiple of 8 whose
    four times is the size asked for."""
    if not req.image:
        return [FieldViolation("image", f"is required: {spec.name} enlarges an input image four times")]
    if image is None:
        return []  # not read yet, or its own violation is already named
    bad = []
    for name, asked, side in (("width", req.width, image.width), ("height", req.height, image.height)):
        if side % 8:
            bad.append(FieldViolation("image", f"is {side} px in {name}; an upscale's input is a multiple of 8"))
        if asked and asked != side * UPSCALE:
            bad.append(FieldViolation(name, f"{asked}: an upscale's output is four times its input, {side * UPSCALE}"))
    return bad
