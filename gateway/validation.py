"""Checks a ``SubmitJobRequest`` against the model registry. Pure: every violation
is collected and named by field, before anything is stored."""

from __future__ import annotations

import secrets
import uuid
from datetime import UTC, datetime

from services.config.placement import PlacementSettings
from services.db.records import NewJob
from services.errors import FieldViolation, InvalidArgument
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

MAX_GUIDANCE = 50.0
DEFAULT_GUIDANCE = 7.5
MAX_IDEMPOTENCY_KEY = 256
MAX_SEED = 2**63 - 1
DEFAULT_PLACEMENT = PlacementSettings()
# The output formats a job may ask for, by the name stored on the job.
OUTPUT_FORMATS = {
    pb.OUTPUT_FORMAT_UNSPECIFIED: "png",
    pb.OUTPUT_FORMAT_PNG: "png",
    pb.OUTPUT_FORMAT_JPEG: "jpeg",
    pb.OUTPUT_FORMAT_WEBP: "webp",
}


def validate_submit(
    req: pb.SubmitJobRequest,
    registry: ModelRegistry,
    *,
    max_prompt_chars: int,
    placement: PlacementSettings = DEFAULT_PLACEMENT,
    now: datetime,
) -> NewJob:
    """Lanes are ``placement``'s; an empty ``lane`` means the lowest."""
    lanes = {lane.name: lane.priority for lane in placement.lanes}
    bad: list[FieldViolation] = []
    spec = registry.models.get(req.model)
    if not req.model:
        bad.append(FieldViolation("model", "is required"))
    elif spec is None:
        bad.append(FieldViolation("model", f"unknown model {req.model!r}; known: {', '.join(registry.names())}"))
    if not req.prompt.strip():
        bad.append(FieldViolation("prompt", "must not be empty"))
    elif len(req.prompt) > max_prompt_chars:
        bad.append(FieldViolation("prompt", f"is {len(req.prompt)} characters; the limit is {max_prompt_chars}"))
    if len(req.negative_prompt) > max_prompt_chars:
        bad.append(FieldViolation("negative_prompt", f"is longer than {max_prompt_chars} characters"))
    width = req.width or (spec.default_width if spec else 0)
    height = req.height or (spec.default_height if spec else 0)
    steps = req.steps or (spec.default_steps if spec else 0)
    num_images = req.num_images or 1
    if spec is not None:
        for name, value, limit in (("width", width, spec.max_width), ("height", height, spec.max_height)):
            if value % 8:
                bad.append(FieldViolation(name, f"{value} is not a multiple of 8"))
            elif not spec.min_size <= value <= limit:
                bad.append(FieldViolation(name, f"{value} is outside {spec.min_size}..{limit} for {spec.name}"))
        if not 1 <= steps <= spec.max_steps:
            bad.append(FieldViolation("steps", f"{steps} is outside 1..{spec.max_steps} for {spec.name}"))
        if not 1 <= num_images <= spec.max_images:
            bad.append(FieldViolation("num_images", f"{num_images} is outside 1..{spec.max_images}"))
    guidance = req.guidance_scale if req.HasField("guidance_scale") else DEFAULT_GUIDANCE
    if not 0.0 <= guidance <= MAX_GUIDANCE:  # also rejects NaN
        bad.append(FieldViolation("guidance_scale", f"{req.guidance_scale} is outside 0..{MAX_GUIDANCE}"))
    if req.HasField("seed") and req.seed > MAX_SEED:
        bad.append(FieldViolation("seed", f"must be at most {MAX_SEED}"))
    if len(req.idempotency_key) > MAX_IDEMPOTENCY_KEY:
        bad.append(FieldViolation("idempotency_key", f"is longer than {MAX_IDEMPOTENCY_KEY} characters"))
    lane = req.lane or placement.default_lane.name
    if lane not in lanes:
        bad.append(FieldViolation("lane", f"unknown lane {req.lane!r}; known: {', '.join(sorted(lanes))}"))
    output_format = OUTPUT_FORMATS.get(req.output_format)
    if output_format is None:
        known = ", ".join(pb.OutputFormat.Name(v) for v in OUTPUT_FORMATS if v != pb.OUTPUT_FORMAT_UNSPECIFIED)
        bad.append(FieldViolation("output_format", f"unknown value {req.output_format}; known: {known}"))
    deadline = None
    if req.HasField("deadline"):
        deadline = req.deadline.ToDatetime(tzinfo=UTC)
        if deadline <= now:
            bad.append(FieldViolation("deadline", f"{deadline.isoformat()} has already passed"))
    if bad:
        raise InvalidArgument(bad)
    assert spec is not None and output_format is not None
    return NewJob(
        id=str(uuid.uuid4()),
        lane=lane,
        priority=lanes[lane],
        model=spec.name,
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        width=width,
        height=height,
        steps=steps,
        guidance_scale=float(guidance),
        # Fixed at submit so that a retried attempt reproduces the same image.
        seed=req.seed if req.HasField("seed") else secrets.randbits(63),
        num_images=num_images,
        idempotency_key=req.idempotency_key or None,
        deadline=deadline,
        output_format=output_format,
    )
