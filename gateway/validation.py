"""Checks a ``SubmitJobRequest`` against the model registry. Pure: every violation
is collected and named by field, before anything is stored."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from gateway.convert import generation_params
from services.config.placement import PlacementSettings
from services.db.records import NewJob
from services.db.tenant_records import DEFAULT_TENANT
from services.errors import FieldViolation, InvalidArgument, PermissionDenied
from services.generation import GenerationParams
from services.models.registry import ModelRegistry, ModelSpec
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
    tenant: str = DEFAULT_TENANT,
    tenant_lane: str | None = None,
) -> NewJob:
    """The job ``req`` asks for, or InvalidArgument naming every field that is wrong.
    Lanes are ``placement``'s; an empty ``lane`` means the tenant's, or without
    one the lowest. A lane above the tenant's is PermissionDenied."""
    spec = registry.models.get(req.model)
    params = generation_params(req, spec, default_guidance=DEFAULT_GUIDANCE)
    lanes = {lane.name: lane.priority for lane in placement.lanes}
    lane = req.lane or tenant_lane or placement.default_lane.name
    output_format = OUTPUT_FORMATS.get(req.output_format)
    deadline = req.deadline.ToDatetime(tzinfo=UTC) if req.HasField("deadline") else None
    bad = [
        *_model_and_prompts(req, registry, max_prompt_chars),
        *(_sizes(params, spec) if spec is not None else []),
        *_the_rest(req, params, lanes, lane, output_format),
    ]
    if deadline is not None and deadline <= now:
        bad.append(FieldViolation("deadline", f"{deadline.isoformat()} has already passed"))
    if bad:
        raise InvalidArgument(bad)
    if tenant_lane is not None and lanes[lane] > lanes.get(tenant_lane, min(lanes.values())):
        raise PermissionDenied(f"lane {lane!r} is above the lane of tenant {tenant!r}, {tenant_lane!r}")
    assert output_format is not None
    return NewJob(
        id=str(uuid.uuid4()),
        lane=lane,
        priority=lanes[lane],
        params=params,
        idempotency_key=req.idempotency_key or None,
        deadline=deadline,
        output_format=output_format,
        tenant=tenant,
        price=registry.get(params.model).price,
    )


def _model_and_prompts(req: pb.SubmitJobRequest, registry: ModelRegistry, max_chars: int) -> list[FieldViolation]:
    bad = []
    if not req.model:
        bad.append(FieldViolation("model", "is required"))
    elif req.model not in registry.models:
        bad.append(FieldViolation("model", f"unknown model {req.model!r}; known: {', '.join(registry.names())}"))
    if not req.prompt.strip():
        bad.append(FieldViolation("prompt", "must not be empty"))
    elif len(req.prompt) > max_chars:
        bad.append(FieldViolation("prompt", f"is {len(req.prompt)} characters; the limit is {max_chars}"))
    if len(req.negative_prompt) > max_chars:
        bad.append(FieldViolation("negative_prompt", f"is longer than {max_chars} characters"))
    return bad


def _sizes(params: GenerationParams, spec: ModelSpec) -> list[FieldViolation]:
    """Size, steps and images within the model's limits."""
    bad = []
    for name, value, limit in (("width", params.width, spec.max_width), ("height", params.height, spec.max_height)):
        if value % 8:
            bad.append(FieldViolation(name, f"{value} is not a multiple of 8"))
        elif not spec.min_size <= value <= limit:
            bad.append(FieldViolation(name, f"{value} is outside {spec.min_size}..{limit} for {spec.name}"))
    if not 1 <= params.steps <= spec.max_steps:
        bad.append(FieldViolation("steps", f"{params.steps} is outside 1..{spec.max_steps} for {spec.name}"))
    if not 1 <= params.num_images <= spec.max_images:
        bad.append(FieldViolation("num_images", f"{params.num_images} is outside 1..{spec.max_images}"))
    return bad


def _the_rest(
    req: pb.SubmitJobRequest, params: GenerationParams, lanes: dict[str, int], lane: str, output_format: str | None
) -> list[FieldViolation]:
    bad = []
    if not 0.0 <= params.guidance_scale <= MAX_GUIDANCE:  # also rejects NaN
        bad.append(FieldViolation("guidance_scale", f"{req.guidance_scale} is outside 0..{MAX_GUIDANCE}"))
    if req.HasField("seed") and req.seed > MAX_SEED:
        bad.append(FieldViolation("seed", f"must be at most {MAX_SEED}"))
    if len(req.idempotency_key) > MAX_IDEMPOTENCY_KEY:
        bad.append(FieldViolation("idempotency_key", f"is longer than {MAX_IDEMPOTENCY_KEY} characters"))
    if lane not in lanes:
        bad.append(FieldViolation("lane", f"unknown lane {req.lane!r}; known: {', '.join(sorted(lanes))}"))
    if output_format is None:
        known = ", ".join(pb.OutputFormat.Name(v) for v in OUTPUT_FORMATS if v != pb.OUTPUT_FORMAT_UNSPECIFIED)
        bad.append(FieldViolation("output_format", f"unknown value {req.output_format}; known: {known}"))
    return bad
