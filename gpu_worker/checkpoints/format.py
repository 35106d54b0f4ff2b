"""Checkpoints of a denoising job: its state at a step boundary, as bytes another
process (on another device of the same kind) resumes from, to the same image.

What the remaining steps need, and nothing else, is kept (a ``Snapshot``):

- the latents, in their exact dtype;
- each image's ``torch.Generator`` state, for the stochastic schedulers' noise;
- what else the remaining steps read, by name: an edit's input latents, its mask
  and the noise it started from (``extras``);
- the noise scheduler's state, taken generically from its ``__dict__`` (its config
  aside): only the attributes that differ from a fresh scheduler set to the job's
  steps. The schedule tables (betas, sigmas, timesteps...) are a function of the
  config and the steps and come back by rebuilding the scheduler; the history a
  multistep solver keeps (``model_outputs``, ``lower_order_nums``, ``_step_index``,
  ``last_sample``...) differs from a fresh one's and is kept, whatever the class
  calls it, so a scheduler nobody listed here still resumes exactly.

The prompt's conditioning is not kept: it is recomputed from the prompt (the prompt
cache), as the uninterrupted run computed it.

Checkpoints are read from a shared database, so they are written with ``torch.save``
and read with ``torch.load(weights_only=True)``, which builds tensors and plain
containers only and never runs code from the bytes. Values that loader refuses
(numpy arrays and scalars, dtypes, devices) and the containers whose type must come
back (a tuple is not a list) are written as tagged tuples; every container is tagged,
so a bare tuple in the data is always a tag. Tensors are written from the CPU with a
flag saying whether they lived on the accelerator, and go back there on restore.

The data also holds a format version, the request's fingerprint (model, size, frames,
steps, guidance, seed, images, strength, the input image's and mask's digests,
its adapters and their scales, noise-scheduler class) and the diffusers version that wrote
the scheduler's state; a checkpoint that does not match, or cannot be read, raises
``CheckpointMismatch``, and the job then runs from step 0: slower, never another
image. A checkpoint with no state (``step`` 0, or any step of the ``sim`` family,
whose latents come from the seeds) holds the fingerprint and step only.

When checkpoints are taken and how a running member's state goes in and out of
them is ``gpu_worker.denoising.checkpoint_capture``."""

from __future__ import annotations

import functools
import importlib.metadata
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.errors import DarkroomError
from services.generation import GenerationParams

# Bump on any change to the layout below: older checkpoints are then refused (and
# their jobs run from step 0), never misread.
FORMAT = 2
# The scheduler's config, which rebuilding it restores; not state.
_CONFIG_ATTRIBUTES = frozenset({"_internal_dict"})
_PRIMITIVES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Checkpoint:
    step: int  # denoising steps done (0..total)
    total: int  # the job's steps
    data: bytes  # the serialised state; opaque to everything but gpu_worker.denoising.checkpoint_capture


class CheckpointMismatch(DarkroomError):
    """The checkpoint does not belong to this request (model, size, steps, guidance,
    seed, images, noise scheduler class, format version) or cannot be read."""


def fingerprint(job: GenerationParams, scheduler: str) -> dict[str, Any]:
    """What makes a checkpoint this job's: any difference gives another image.
    The prompts are not in it: the runner resumes a job by its id, and keeping
    them out keeps prompts out of the checkpoint bytes."""
    identity: dict[str, Any] = {
        "model": job.model,
        "width": job.width,
        "height": job.height,
        "steps": job.steps,
        "guidance_scale": float(job.guidance_scale),
        "seed": job.seed,
        "num_images": job.num_images,
        "frames": job.frames,
        "strength": float(job.strength),
        "image": job.image_digest,
        "mask": job.mask_digest,
        "scheduler": scheduler,
    }
    if job.adapters:  # absent without: the checkpoints of jobs before adapters still fit
        identity["adapters"] = [[use.key, float(use.scale)] for use in job.adapters]
    return identity


@dataclass(frozen=True)
class Snapshot:
    """A denoising loop's state at a step boundary, on its device."""

    latents: torch.Tensor
    generators: list[torch.Tensor]  # each image's Generator.get_state()
    scheduler: dict[str, Any]  # the attributes that differ from a fresh scheduler's
    removed: tuple[str, ...]  # attributes a fresh scheduler has and this one no longer does
    device_type: str  # generator states are per kind of device: "cpu", "cuda"
    # What else the remaining steps read, by name (an edit's input latents, mask, first noise).
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)


# -- the noise scheduler's state ---------------------------------------------------


def scheduler_state(live: Any, fresh: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The attributes of ``live`` that differ from ``fresh`` (the same class and
    config, set to the same steps), and those ``fresh`` has that ``live`` lacks."""
    now = {k: v for k, v in vars(live).items() if k not in _CONFIG_ATTRIBUTES}
    base = {k: v for k, v in vars(fresh).items() if k not in _CONFIG_ATTRIBUTES}
    changed = {k: v for k, v in now.items() if k not in base or not _same(v, base[k])}
    return changed, tuple(sorted(set(base) - set(now)))


def apply_scheduler_state(scheduler: Any, changed: Mapping[str, Any], removed: tuple[str, ...]) -> None:
    """Makes a fresh ``scheduler`` (set to the job's steps) the one captured."""
    for name in removed:
        vars(scheduler).pop(name, None)
    for name, value in changed.items():
        setattr(scheduler, name, value)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` can stand for ``b`` exactly. Unsure is False: the value is then
    kept, which costs bytes, never exactness."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        # torch.equal alone compares values across dtypes and ignores the device.
        return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


# -- values weights_only loading accepts ----------------------------------------------


def _pack(value: Any) -> Any:
    if type(value) in _PRIMITIVES:
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach()
        on_device = t.device.type != "cpu"
        # A clone on the CPU: torch.save writes a view's whole storage otherwise.
        return ("tensor", t.cpu() if on_device else t.clone(), on_device)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError("cannot checkpoint a numpy array of objects")
        return ("ndarray", torch.from_numpy(np.ascontiguousarray(value).copy()))
    if isinstance(value, np.generic):
        return ("npscalar", value.dtype.str, value.item())
    if isinstance(value, torch.dtype):
        return ("dtype", str(value).removeprefix("torch."))
    if isinstance(value, torch.device):
        return ("device", value.type != "cpu")
    if type(value) is list:
        return ("list", [_pack(v) for v in value])
    if type(value) is tuple:
        return ("tuple", [_pack(v) for v in value])
    if type(value) is dict:
        return ("dict", [[_pack(k), _pack(v)] for k, v in value.items()])
    raise TypeError(f"cannot checkpoint a {type(value).__qualname__}")


def _unpack(value: Any, device: torch.device) -> Any:
    if type(value) in _PRIMITIVES:
        return value
    if type(value) is not tuple or not value:
        raise CheckpointMismatch(f"unexpected {type(value).__name__} in the checkpoint")
    tag, *rest = value
    if tag == "tensor":
        t, on_device = rest
        return t.to(device) if on_device else t
    if tag == "ndarray":
        return rest[0].numpy()
    if tag == "npscalar":
        dtype = np.dtype(rest[0])
        if dtype.kind not in "biufc":
            raise CheckpointMismatch(f"unexpected numpy dtype {dtype} in the checkpoint")
        return dtype.type(rest[1])
    if tag == "dtype":
        found = getattr(torch, rest[0], None)
        if not isinstance(found, torch.dtype):
            raise CheckpointMismatch(f"unknown dtype {rest[0]!r} in the checkpoint")
        return found
    if tag == "device":
        return device if rest[0] else torch.device("cpu")
    if tag == "list":
        return [_unpack(v, device) for v in rest[0]]
    if tag == "tuple":
        return tuple(_unpack(v, device) for v in rest[0])
    if tag == "dict":
        return {_unpack(k, device): _unpack(v, device) for k, v in rest[0]}
    raise CheckpointMismatch(f"unknown tag {tag!r} in the checkpoint")


@functools.cache
def _diffusers_version() -> str:
    # Scheduler attributes are diffusers' internals: another version may name or
    # mean them differently, so its checkpoints are refused rather than misread.
    try:
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:
        return ""


# -- the bytes -----------------------------------------------------------------------


def capture(step: int, total: int, fingerprint: Mapping[str, Any], snapshot: Snapshot | None) -> Checkpoint:
    """The checkpoint of a job ``step`` steps into ``total``; ``snapshot`` None for a
    job whose state the step alone gives (step 0, the sim family). Copies tensors off
    the device, so it waits for the device's queued work."""
    if not 0 <= step <= total:
        raise ValueError(f"step {step} is not within 0..{total}")
    state = None
    if snapshot is not None:
        state = {
            "diffusers": _diffusers_version(),
            "device_type": snapshot.device_type,
            "latents": _pack(snapshot.latents),
            "generators": [_pack(g) for g in snapshot.generators],
            "scheduler": _pack(dict(snapshot.scheduler)),
            "removed": list(snapshot.removed),
            "extras": _pack(dict(snapshot.extras)),
        }
    payload = {"format": FORMAT, "fingerprint": dict(fingerprint), "step": step, "total": total, "state": state}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return Checkpoint(step, total, buffer.getvalue())


def restore(checkpoint: Checkpoint, fingerprint: Mapping[str, Any], device: torch.device) -> Snapshot | None:
    """The snapshot in ``checkpoint``, its tensors on ``device`` (those that were on
    the CPU stay there), or None for a checkpoint with no state. Raises
    CheckpointMismatch unless it is ``fingerprint``'s, in this format, and readable."""
    try:
        payload = torch.load(io.BytesIO(checkpoint.data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointMismatch(f"the checkpoint cannot be read: {type(exc).__name__}: {exc}") from None
    try:
        return _read(payload, checkpoint, fingerprint, device)
    except CheckpointMismatch:
        raise
    except Exception as exc:  # well-formed bytes, but not what capture writes
        raise CheckpointMismatch(f"the checkpoint is malformed: {type(exc).__name__}: {exc}") from None


def _read(
    payload: Any, checkpoint: Checkpoint, fingerprint: Mapping[str, Any], device: torch.device
) -> Snapshot | None:
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointMismatch(f"checkpoint format {found!r}, not {FORMAT}")
    theirs = payload["fingerprint"]
    if theirs != dict(fingerprint):
        differ = sorted(k for k in set(theirs) | set(fingerprint) if theirs.get(k) != fingerprint.get(k))
        raise CheckpointMismatch(f"the checkpoint belongs to another request: it differs in {differ}")
    if (payload["step"], payload["total"]) != (checkpoint.step, checkpoint.total):
        raise CheckpointMismatch(
            f"the checkpoint's data is of step {payload['step']}/{payload['total']}, "
            f"not {checkpoint.step}/{checkpoint.total}"
        )
    state = payload["state"]
    if state is None:
        return None
    if state["diffusers"] != _diffusers_version():
        raise CheckpointMismatch(f"the checkpoint was written by diffusers {state['diffusers']}")
    scheduler = _unpack(state["scheduler"], device)
    generators = [_unpack(g, device) for g in state["generators"]]
    if not isinstance(scheduler, dict) or not all(isinstance(g, torch.Tensor) for g in generators):
        raise CheckpointMismatch("the checkpoint's scheduler or generator state is malformed")
    latents = _unpack(state["latents"], device)
    if not isinstance(latents, torch.Tensor):
        raise CheckpointMismatch("the checkpoint's latents are not a tensor")
    removed = tuple(state["removed"])
    if not all(isinstance(name, str) for name in [*scheduler, *removed]):
        raise CheckpointMismatch("the checkpoint's scheduler attributes are malformed")
    extras = _unpack(state["extras"], device)
    if not isinstance(extras, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in extras.items()
    ):
        raise CheckpointMismatch("the checkpoint's extra tensors are malformed")
    return Snapshot(latents, generators, scheduler, removed, str(state["device_type"]), extras)
