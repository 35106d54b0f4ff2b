"""Checks a ``SubmitJobRequest`` against the model registry, in two steps. Pure:
violations are collected and named by field, before anything is stored.
``check_submit`` checks every field that needs no input image read, cheaply, so a
caller refuses a mistake, or a tenant past its limits, before any decoding;
``read_submit`` then reads (decodes) the input image and mask (``gateway.inputs``),
and checks what they decide (their sides and aspect within the model's bounds, and
the sizes they give): a caller on an event loop runs it in a thread."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from gateway.adapters import violations as adapter_violations
from gateway.convert import generation_params
from gateway.inputs import read_inputs
from gateway.media_checks import input_shape_violations, media_violations, upscale_violations
from gateway.names import check_lengths
from services.config.placement import PlacementSettings
from services.db.records import NewJob
from services.db.tenant_records import DEFAULT_TENANT
from services.errors import FieldViolation, InvalidArgument, PermissionDenied
from services.generation import GenerationParams, JobInputs
from services.models.input_limits import prompt_violations
from services.models.registry import ModelRegistry
from services.models.spec import ModelSpec
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.prompt_filter import PromptFilter
from services.safety.verdicts import previews_allowed

MAX_GUIDANCE = 50.0
MAX_SEED = 2**63 - 1
DEFAULT_PLACEMENT = PlacementSettings()
DEFAULT_MAX_INPUT_BYTES = 16 * 2**20
# The output formats a job may ask for, by the name stored on the job: an image's,
# and a video's.
OUTPUT_FORMATS = {
    pb.OUTPUT_FORMAT_UNSPECIFIED: "png",
    pb.OUTPUT_FORMAT_PNG: "png",
    pb.OUTPUT_FORMAT_JPEG: "jpeg",
    pb.OUTPUT_FORMAT_WEBP: "webp",
}
VIDEO_FORMATS = {pb.OUTPUT_FORMAT_UNSPECIFIED: "mp4", pb.OUTPUT_FORMAT_MP4: "mp4", pb.OUTPUT_FORMAT_WEBP: "webp"}


@dataclass(frozen=True)
class Checked:
    """A submit with every field checked but its input image and mask (unread)."""

    spec: ModelSpec
    lane: str
    priority: int
    output_format: str
    deadline: datetime | None
    tenant: str


def validate_submit(
    req: pb.SubmitJobRequest,
    registry: ModelRegistry,
    *,
    max_prompt_chars: int,
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
    placement: PlacementSettings = DEFAULT_PLACEMENT,
    now: datetime,
    tenant: str = DEFAULT_TENANT,
    tenant_lane: str | None = None,
) -> NewJob:
    """The job ``req`` asks for: ``check_submit``, then ``read_submit``."""
    checked = check_submit(
        req,
        registry,
        max_prompt_chars=max_prompt_chars,
        placement=placement,
        now=now,
        tenant=tenant,
        tenant_lane=tenant_lane,
    )
    return read_submit(req, checked, max_input_bytes=max_input_bytes)


def check_submit(
    req: pb.SubmitJobRequest,
    registry: ModelRegistry,
    *,
    max_prompt_chars: int,
    placement: PlacementSettings = DEFAULT_PLACEMENT,
    now: datetime,
    tenant: str = DEFAULT_TENANT,
    tenant_lane: str | None = None,
) -> Checked:
    """Every field of ``req`` that needs no input image read, or InvalidArgument
    naming each that is wrong: cheap, before any limit is looked at or any input
    decoded. Lanes are ``placement``'s; an empty ``lane`` means the tenant's, or
    without one the lowest. A lane above the tenant's is PermissionDenied. Names
    longer than any taken are refused first, alone (``gateway.names``)."""
    check_lengths(req)
    spec = registry.models.get(req.model)
    params = generation_params(req, spec)  # an edit's size, where the request gives none, is its input's
    lanes = {lane.name: lane.priority for lane in placement.lanes}
    lane = req.lane or tenant_lane or placement.default_lane.name
    output_format = (VIDEO_FORMATS if spec is not None and spec.makes_video else OUTPUT_FORMATS).get(req.output_format)
    deadline = req.deadline.ToDatetime(tzinfo=UTC) if req.HasField("deadline") else None
    bad = [
        *_nul_free(req),
        *_model_and_prompts(req, registry, max_prompt_chars),
        *(_known_sizes(req, params, spec) + media_violations(req, params, spec) if spec is not None else []),
        *(adapter_violations(req, spec) if spec is not None else []),
        *_the_rest(req, params, lanes, lane, output_format),
    ]
    if req.mask and not req.image:
        bad.append(FieldViolation("mask", "needs an input image to inpaint (image)"))
    if deadline is not None and deadline <= now:
        bad.append(FieldViolation("deadline", f"{deadline.isoformat()} has already passed"))
    if bad:
        raise InvalidArgument(bad)
    if tenant_lane is not None and lanes[lane] > lanes.get(tenant_lane, min(lanes.values())):
        raise PermissionDenied(f"lane {lane!r} is above the lane of tenant {tenant!r}, {tenant_lane!r}")
    assert spec is not None and output_format is not None
    return Checked(spec, lane, lanes[lane], output_format, deadline, tenant)


def read_submit(req: pb.SubmitJobRequest, checked: Checked, *, max_input_bytes: int) -> NewJob:
    """The job ``req`` asks for once ``check_submit`` passed it, its input image and
    mask read and what they decide checked (an edit's size, an upscale's input), or
    InvalidArgument naming what is wrong. Reading decodes them: a caller on an event
    loop runs this in a thread where the request has either."""
    spec = checked.spec
    image, mask, bad = read_inputs(req.image, req.mask, max_bytes=max_input_bytes)
    params = generation_params(req, spec, image, mask)
    shapes = input_shape_violations(spec, image, mask)
    if shapes:  # the sizes an input past its model's bounds gives say nothing more
        bad += shapes
    elif image is not None:
        bad += _sizes(params, spec) + (upscale_violations(req, spec, image) if spec.upscales else [])
    if bad:
        raise InvalidArgument(bad)
    return NewJob(
        id=str(uuid.uuid4()),
        lane=checked.lane,
        priority=checked.priority,
        params=params,
        idempotency_key=req.idempotency_key or None,
        deadline=checked.deadline,
        output_format=checked.output_format,
        tenant=checked.tenant,
        price=spec.price,
        task=params.task(spec.upscales),
        previews=req.previews,
        inputs=JobInputs(image.data, mask.data if mask else None) if image is not None else None,
    )


def under_output_policy(new: NewJob, policy: str) -> NewJob:
    """``new`` to be checked under ``policy`` (decided at submit, stored on the job):
    its previews dropped, without a refusal, where the policy withholds or blurs
    flagged outputs. Previews are a stream's extra, and a client of one tenant works
    unchanged under another's policy (an OpenAI client's ``partial_images`` too)."""
    return replace(new, output_policy=policy, previews=new.previews if previews_allowed(policy) else 0)


def violates_policy(prompt: str, prompt_filter: PromptFilter | None) -> bool:
    """Whether the prompt filter (None: off) flags ``prompt``; the caller refuses the
    submit (ContentPolicyViolation) before anything is stored or charged. Only the
    prompt: a negative prompt names what to steer away from ("nsfw, nude")."""
    return prompt_filter is not None and prompt_filter.check(prompt).flagged


def _nul_free(req: pb.SubmitJobRequest) -> list[FieldViolation]:
    """A NUL character in any text field: PostgreSQL's text cannot hold one (the
    insert would fail as an internal error), and no prompt or name needs it."""
    return [
        FieldViolation(field.name, "must not contain a NUL character (U+0000)")
        for field, value in req.ListFields()
        if field.type == field.TYPE_STRING and "\x00" in value
    ]


def _model_and_prompts(req: pb.SubmitJobRequest, registry: ModelRegistry, max_chars: int) -> list[FieldViolation]:
    """The model, and the prompts within the gateway's characters and what the
    model's text encoder reads whole (``services.models.input_limits``)."""
    bad = []
    spec = registry.models.get(req.model)
    if not req.model:
        bad.append(FieldViolation("model", "is required"))
    elif spec is None:
        bad.append(FieldViolation("model", f"unknown model {req.model!r}; known: {', '.join(registry.names())}"))
    if not req.prompt.strip():
        bad.append(FieldViolation("prompt", "must not be empty"))
    elif len(req.prompt) > max_chars:
        bad.append(FieldViolation("prompt", f"is {len(req.prompt)} characters; the limit is {max_chars}"))
    elif spec is not None:
        bad += prompt_violations("prompt", req.prompt, spec)
    if len(req.negative_prompt) > max_chars:
        bad.append(FieldViolation("negative_prompt", f"is longer than {max_chars} characters"))
    elif spec is not None:
        bad += prompt_violations("negative_prompt", req.negative_prompt, spec)
    return bad


def _known_sizes(req: pb.SubmitJobRequest, params: GenerationParams, spec: ModelSpec) -> list[FieldViolation]:
    """``_sizes`` of what is known before an input is read: a side the request leaves
    to its input image is that image's, checked once it is read."""
    bad = _sizes(params, spec)
    return bad if not req.image else [v for v in bad if v.field not in ("width", "height") or getattr(req, v.field)]


def _sizes(params: GenerationParams, spec: ModelSpec) -> list[FieldViolation]:
    """Size, steps and images within the model's limits."""
    bad = []
    step = spec.size_step
    for name, value, limit in (("width", params.width, spec.max_width), ("height", params.height, spec.max_height)):
        if value % step:
            bad.append(FieldViolation(name, f"{value} is not a multiple of {step} ({spec.name})"))
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
    if lane not in lanes:
        bad.append(FieldViolation("lane", f"unknown lane {req.lane!r}; known: {', '.join(sorted(lanes))}"))
    if output_format is None:
        known = VIDEO_FORMATS if params.is_video else OUTPUT_FORMATS
        names = ", ".join(pb.OutputFormat.Name(v) for v in known if v != pb.OUTPUT_FORMAT_UNSPECIFIED)
        asked = _format_name(req.output_format)
        what = "a video" if params.is_video else "an image"
        bad.append(FieldViolation("output_format", f"{asked} is not a format for {what}; known: {names}"))
    return bad


def _format_name(value: int) -> str:
    return pb.OutputFormat.Name(value) if value in pb.OutputFormat.values() else str(value)
