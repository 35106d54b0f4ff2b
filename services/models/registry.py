"""The model registry: a TOML file naming every model Darkroom may serve."""

from __future__ import annotations

import enum
import os
import shutil
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from services.errors import ModelError

DEFAULT_REGISTRY = Path(__file__).with_name("default_registry.toml")


class ModelFamily(enum.StrEnum):
    """What kind of model it is: how it loads and denoises."""

    SD15 = "sd15"
    SDXL = "sdxl"
    TINY = "tiny"  # SD-shaped, built locally with random weights
    SIM = "sim"  # no weights: it only takes its modelled time


# Per family: one 512x512 step on a reference GPU (ms), and a load (s). Learned
# durations replace the first after a few jobs.
FAMILY_DEFAULTS = {
    ModelFamily.SD15: (25.0, 5.0),
    ModelFamily.SDXL: (60.0, 10.0),
    ModelFamily.TINY: (30.0, 0.5),
    ModelFamily.SIM: (25.0, 1.0),
}
ATTENTION = frozenset({"", "sdpa", "eager"})
BUILTIN_TINY = "builtin:tiny"
# What a ``sim`` model's source must be: it has no weights (services/models/sim.py).
BUILTIN_SIM = "builtin:sim"
# Random-weight copies of the real architectures, built on first use (services/models/presets.py).
BUILTIN_PRESETS = {"builtin:sd15-random": ModelFamily.SD15, "builtin:sdxl-random": ModelFamily.SDXL}
# A job running longer than this is stopped, unless its model says otherwise.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    family: ModelFamily
    dtype: str = "float16"
    vram_mb: int = 4096
    eviction_priority: int = 0
    min_size: int = 64
    max_width: int = 1024
    max_height: int = 1024
    default_width: int = 512
    default_height: int = 512
    max_steps: int = 150
    default_steps: int = 25
    max_images: int = 4
    # First estimates, before durations are learned; 0 takes the family's default.
    step_ms_512: float = 0.0
    load_s: float = 0.0
    # What kind of work it is; the scheduler's per-capability caps apply to it.
    capability: str = "image"
    # A job running longer than this is stopped, and retried or failed.
    timeout_s: float = DEFAULT_TIMEOUT_S
    # Weight files to load: "" the default ones, "fp16" the ``*.fp16.*`` variant.
    variant: str = ""
    # Images one batch may hold on a GPU (jobs of the same model, size, steps and
    # guidance run together); 1 turns batching off for the model.
    max_batch: int = 8
    # Speed options, applied on a GPU: ``torch.compile`` of the UNet, the
    # channels-last memory format, and the attention implementation ("" leaves
    # the model's own; "sdpa" or "eager" pick one).
    compile: bool = False
    channels_last: bool = False
    attention: str = ""
    # An output whose latents vary less than this (standard deviation) is degenerate.
    min_output_std: float = 1e-3
    # The noise scheduler: a diffusers scheduler class name such as
    # "DPMSolverMultistepScheduler", built from the model's own scheduler config;
    # "" keeps the model's own class.
    scheduler: str = ""
    # A running job writes a checkpoint (gpu_worker/checkpoint_capture.py) every so many
    # steps, or seconds, whichever comes first; 0 turns either off. By default every
    # 10 s: a crash then costs at most 10 s of a job, and a checkpoint (a few ms,
    # written while the next steps run) costs well under 1 % of them.
    checkpoint_every_steps: int = 0
    checkpoint_every_s: float = 10.0
    # Credits a tenant pays per GPU-second of its sampling.
    price: float = 1.0

    @property
    def vram_bytes(self) -> int:
        return self.vram_mb * 1024 * 1024

    @property
    def step_s_512(self) -> float:
        return (self.step_ms_512 or FAMILY_DEFAULTS[self.family][0]) / 1000.0

    @property
    def load_seconds(self) -> float:
        return self.load_s or FAMILY_DEFAULTS[self.family][1]


class ModelRegistry:
    def __init__(self, models: dict[str, ModelSpec]) -> None:
        self.models = models

    @classmethod
    def load(cls, path: str | Path | None = None) -> ModelRegistry:
        path = Path(path) if path else DEFAULT_REGISTRY
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ModelError(f"cannot read model registry {path}: {exc}") from exc
        known = {f.name for f in fields(ModelSpec)} - {"name"}
        models: dict[str, ModelSpec] = {}
        for name, table in data.get("models", {}).items():
            unknown = set(table) - known
            if unknown:
                raise ModelError(f"model {name!r} in {path}: unknown keys {sorted(unknown)}")
            families = [f.value for f in ModelFamily]
            if table.get("family") not in families:
                raise ModelError(f"model {name!r}: family {table.get('family')!r} is not one of {families}")
            spec = ModelSpec(name=name, **{**table, "family": ModelFamily(table["family"])})
            if (spec.family == ModelFamily.SIM) != (spec.source == BUILTIN_SIM):
                raise ModelError(f"model {name!r}: the sim family, and only it, has source {BUILTIN_SIM!r}")
            if spec.attention not in ATTENTION:
                raise ModelError(f"model {name!r}: attention {spec.attention!r} is not one of {sorted(ATTENTION)}")
            if spec.max_batch < 1:
                raise ModelError(f"model {name!r}: max_batch must be at least 1, not {spec.max_batch}")
            if not spec.price >= 0:
                raise ModelError(f"model {name!r}: price must be at least 0, not {spec.price}")
            _check_checkpointing(spec)
            if spec.scheduler:
                scheduler_class(spec)
            models[name] = spec
        if not models:
            raise ModelError(f"model registry {path} names no models")
        return cls(models)

    def get(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            raise ModelError(f"unknown model {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def names(self) -> list[str]:
        return sorted(self.models)


def _check_checkpointing(spec: ModelSpec) -> None:
    for key, kinds, what in (
        ("checkpoint_every_steps", (int,), "a whole number"),
        ("checkpoint_every_s", (int, float), "a number"),
    ):
        value = getattr(spec, key)
        # ``not value >= 0`` refuses NaN too; bool is an int to Python, not to TOML users.
        if isinstance(value, bool) or not isinstance(value, kinds) or not value >= 0:
            raise ModelError(f"model {spec.name!r}: {key} must be {what} >= 0, not {value!r}")


def scheduler_class(spec: ModelSpec) -> type[Any]:
    """The diffusers noise-scheduler class ``spec.scheduler`` names. Imports diffusers,
    so the registry does only for models that name one."""
    import diffusers

    found = getattr(diffusers, spec.scheduler, None) if spec.scheduler.isidentifier() else None
    # A class whose optional dependencies are missing is a stand-in that is no SchedulerMixin.
    if not (isinstance(found, type) and issubclass(found, diffusers.SchedulerMixin)):
        raise ModelError(
            f"model {spec.name!r}: scheduler {spec.scheduler!r} is not a diffusers noise scheduler class "
            "(or its optional dependencies are not installed)"
        )
    return found


def resolve_source(spec: ModelSpec, models_dir: Path) -> tuple[str, dict[str, Any]]:
    """Where ``from_pretrained`` loads the model from, and how."""
    if spec.source == BUILTIN_TINY:
        return str(ensure_tiny_model(models_dir / spec.name)), {"local_files_only": True}
    if spec.source in BUILTIN_PRESETS:
        return str(ensure_preset(BUILTIN_PRESETS[spec.source], models_dir / spec.name)), {"local_files_only": True}
    local = Path(spec.source).expanduser()
    if local.is_dir():
        return str(local), {"local_files_only": True}
    if spec.source.startswith(("/", ".", "~")):
        raise ModelError(f"model {spec.name!r}: directory {spec.source} does not exist")
    return spec.source, {}


def ensure_tiny_model(path: Path) -> Path:
    """Builds the tiny model at ``path`` once; concurrent callers see a whole model or none."""
    from services.models.tiny import TINY_MARKER, build_tiny_model

    return _ensure_built(path, TINY_MARKER, build_tiny_model)


def ensure_preset(kind: ModelFamily, path: Path) -> Path:
    """Builds the random-weight ``kind`` architecture at ``path`` once."""
    from services.models.presets import PRESET_MARKER, build_preset

    return _ensure_built(path, PRESET_MARKER, lambda scratch: build_preset(kind, scratch))


def _ensure_built(path: Path, marker: str, build: Callable[[Path], Path]) -> Path:
    if (path / marker).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        build(scratch)
        try:
            os.rename(scratch, path)
        except OSError:
            if not (path / marker).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path
