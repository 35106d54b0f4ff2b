"""The model registry: a TOML file naming every model Darkroom may serve, read and
checked into ``ModelSpec``s (``services.models.spec``), and looked up by name or
capability."""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Iterable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from services.errors import ModelError
from services.models.builtins import BUILTINS
from services.models.parallel import ParallelError, Parallelism, refusal
from services.models.spec import (
    ADAPTED_FAMILIES,
    BUILTIN_SIM,
    FAMILY_DEFAULTS,
    MAX_FPS,
    PATCHED_FAMILIES,
    SERVED_TEXT_ENCODER_FAMILIES,
    STORE_PREFIX,
    TEXT_ENCODER_PLACES,
    ModelFamily,
    ModelSpec,
    scheduler_class,
    store_reference,
)

DEFAULT_REGISTRY = Path(__file__).with_name("default_registry.toml")
# What a model's ``attention`` and ``quantize`` options may be.
ATTENTION = frozenset({"", "sdpa", "flash", "efficient", "cudnn", "eager"})
QUANTIZE = frozenset({"", "int8", "fp8"})


class ModelRegistry:
    def __init__(self, models: dict[str, ModelSpec]) -> None:
        self.models = models

    @classmethod
    def load(cls, path: str | Path | None = None, *, presets: Collection[str] | None = ()) -> ModelRegistry:
        """The registry at ``path`` (the shipped one by default), with those of its
        on-request models that ``presets`` names (None: all of them)."""
        path = Path(path) if path else DEFAULT_REGISTRY
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ModelError(f"cannot read model registry {path}: {exc}") from exc
        models = {name: _spec(name, table, path) for name, table in data.get("models", {}).items()}
        if presets is not None:
            on_request = sorted(n for n, m in models.items() if m.on_request)
            unknown = sorted(set(presets) - set(on_request))
            if unknown:
                raise ModelError(f"presets {unknown} are not on-request models of {path} (those are {on_request})")
            models = {name: spec for name, spec in models.items() if not spec.on_request or name in presets}
        if not models:
            raise ModelError(f"model registry {path} names no models")
        _check_defaults(models.values(), path)
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

    def capabilities(self) -> set[str]:
        return {spec.capability for spec in self.models.values()}

    def default_for(self, capability: str) -> ModelSpec | None:
        """The model a client gets for ``capability`` when it names none: the one
        marked default, else the only one."""
        specs = [s for s in self.models.values() if s.capability == capability]
        marked = [s for s in specs if s.default]
        return marked[0] if marked else (specs[0] if len(specs) == 1 else None)

    def listing(self) -> list[ModelSpec]:
        """Every model as clients see them: by capability (image first), each
        capability's default first, then by name."""
        defaults = {c: self.default_for(c) for c in self.capabilities()}
        return sorted(
            self.models.values(),
            key=lambda s: (s.capability != "image", s.capability, defaults[s.capability] is not s, s.name),
        )


def _spec(name: str, table: dict[str, Any], path: Path) -> ModelSpec:
    known = {f.name for f in fields(ModelSpec)} - {"name"}
    unknown = set(table) - known
    if unknown:
        raise ModelError(f"model {name!r} in {path}: unknown keys {sorted(unknown)}")
    families = [f.value for f in ModelFamily]
    if table.get("family") not in families:
        raise ModelError(f"model {name!r}: family {table.get('family')!r} is not one of {families}")
    family = ModelFamily(table["family"])
    parallel = _parallel(name, family, table.get("parallel", {}))
    spec = ModelSpec(
        name=name, **{"capability": FAMILY_DEFAULTS[family][2], **table, "family": family, "parallel": parallel}
    )
    if "adapters_per_job" not in table and isinstance(spec.adapter_slots, int) and spec.adapter_slots > 0:
        # Unsaid, a job may name as many as the default, or as the model has slots.
        spec = replace(spec, adapters_per_job=min(spec.adapters_per_job, spec.adapter_slots))
    if (spec.family == ModelFamily.SIM) != (spec.source == BUILTIN_SIM):
        raise ModelError(f"model {name!r}: the sim family, and only it, has source {BUILTIN_SIM!r}")
    if spec.sim_image:
        if spec.family != ModelFamily.SIM:
            raise ModelError(f"model {name!r}: only a sim model has a sim_image")
        image = path.parent / Path(spec.sim_image).expanduser()
        if not image.is_file():
            raise ModelError(f"model {name!r}: sim_image {image} is not a file")
        spec = replace(spec, sim_image=str(image))
    if spec.source.startswith("builtin:") and spec.source != BUILTIN_SIM and spec.source not in BUILTINS:
        raise ModelError(f"model {name!r}: unknown source {spec.source!r}; builtins: {', '.join(sorted(BUILTINS))}")
    if spec.source.startswith(STORE_PREFIX):
        store_reference(spec)  # a well-formed NAME[:VERSION]; the store itself is asked when it loads
    if spec.attention not in ATTENTION:
        raise ModelError(f"model {name!r}: attention {spec.attention!r} is not one of {sorted(ATTENTION)}")
    if spec.quantize not in QUANTIZE:
        raise ModelError(f"model {name!r}: quantize {spec.quantize!r} is not one of {sorted(QUANTIZE)}")
    if spec.text_encoders not in TEXT_ENCODER_PLACES:
        raise ModelError(f"model {name!r}: text_encoders {spec.text_encoders!r} is not one of {TEXT_ENCODER_PLACES}")
    if spec.text_encoders == "service" and spec.family not in SERVED_TEXT_ENCODER_FAMILIES:
        raise ModelError(f"model {name!r}: a {spec.family} model has no text encoders a decoder serves")
    _check_speed(spec)
    if spec.cuda_graphs and not (spec.compile or spec.optimize):
        raise ModelError(f"model {name!r}: cuda_graphs come with compile (or optimize)")
    if parallel.grouped and spec.cuda_graphs:
        raise ModelError(
            f"model {name!r}: a parallel model takes no cuda_graphs (a graph cannot capture its collectives)"
        )
    unsharded = [key for key in ("fuse_qkv", "channels_last", "quantize") if getattr(spec, key)]
    if parallel.tensor > 1 and unsharded:
        raise ModelError(
            f"model {name!r}: parallel.tensor with {', '.join(unsharded)}: a network's weights split across "
            "its group are not fused, re-laid out or quantized yet"
        )
    if spec.max_batch < 1:
        raise ModelError(f"model {name!r}: max_batch must be at least 1, not {spec.max_batch}")
    if not spec.price >= 0:
        raise ModelError(f"model {name!r}: price must be at least 0, not {spec.price}")
    _check_checkpointing(spec)
    _check_frames(spec)
    _check_adapters(spec)
    _check_inputs(spec)
    if spec.scheduler:
        scheduler_class(spec)
    return spec


def _parallel(name: str, family: ModelFamily, table: Any) -> Parallelism:
    try:
        shape = Parallelism.of(table)
    except ParallelError as exc:
        raise ModelError(f"model {name!r}: {exc}") from None
    reason = refusal(family, shape)
    if reason is not None:
        raise ModelError(f"model {name!r}: {reason}")
    return shape


def _check_speed(spec: ModelSpec) -> None:
    if not (isinstance(spec.optimize, bool) or spec.optimize == "aggressive"):
        raise ModelError(f'model {spec.name!r}: optimize must be true, false or "aggressive", not {spec.optimize!r}')
    value = spec.step_cache
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ModelError(f"model {spec.name!r}: step_cache must be a number within 0..1 (0: off), not {value!r}")


def _check_frames(spec: ModelSpec) -> None:
    if spec.size_step < 1 or spec.frames_step < 1:
        raise ModelError(f"model {spec.name!r}: size_step and frames_step must be at least 1")
    if spec.family in PATCHED_FAMILIES and spec.size_step % 16:
        raise ModelError(
            f"model {spec.name!r}: family {spec.family} patches its latents 2x2: size_step must be a multiple "
            f"of 16, not {spec.size_step}"
        )
    if not spec.makes_video:
        if (spec.max_frames, spec.default_frames) != (1, 1):
            raise ModelError(f"model {spec.name!r}: only a video family has frames (family {spec.family})")
        return
    if not 1 < spec.default_frames <= spec.max_frames or (spec.default_frames - 1) % spec.frames_step:
        raise ModelError(
            f"model {spec.name!r}: default_frames {spec.default_frames} must be 1 plus a (positive) multiple of "
            f"frames_step {spec.frames_step}, at most max_frames {spec.max_frames}"
        )
    if not 1 <= spec.default_fps <= MAX_FPS:
        raise ModelError(f"model {spec.name!r}: default_fps must be within 1..{MAX_FPS:g}, not {spec.default_fps}")


def _check_defaults(specs: Iterable[ModelSpec], path: Path) -> None:
    marked: dict[str, list[str]] = {}
    for spec in specs:
        if spec.default:
            marked.setdefault(spec.capability, []).append(spec.name)
    for capability, names in sorted(marked.items()):
        if len(names) > 1:
            raise ModelError(f"model registry {path}: {sorted(names)} are each marked the default {capability} model")


def _check_adapters(spec: ModelSpec) -> None:
    name = spec.name
    for key in ("adapter_slots", "adapter_rank", "adapters_per_job"):
        value = getattr(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"model {name!r}: {key} must be a whole number >= 0, not {value!r}")
    if not spec.adapter_slots:
        return
    if spec.family not in ADAPTED_FAMILIES:
        raise ModelError(f"model {name!r}: a {spec.family} model takes no adapters (adapter_slots)")
    if spec.adapter_rank < 1:
        raise ModelError(f"model {name!r}: adapter_rank must be at least 1")
    if not 1 <= spec.adapters_per_job <= spec.adapter_slots:
        raise ModelError(
            f"model {name!r}: adapters_per_job must be within 1..adapter_slots ({spec.adapter_slots}), "
            f"not {spec.adapters_per_job}"
        )


def _check_inputs(spec: ModelSpec) -> None:
    for key in ("min_input_side", "max_prompt_bytes"):
        value = getattr(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"model {spec.name!r}: {key} must be a whole number >= 0 (0: the family's), not {value!r}")
    aspect = spec.max_input_aspect
    # ``not aspect >= 1`` refuses NaN too.
    if isinstance(aspect, bool) or not isinstance(aspect, int | float) or (aspect != 0 and not aspect >= 1):
        raise ModelError(
            f"model {spec.name!r}: max_input_aspect must be a number >= 1 (0: the family's), not {aspect!r}"
        )


def _check_checkpointing(spec: ModelSpec) -> None:
    for key, kinds, what in (
        ("checkpoint_every_steps", (int,), "a whole number"),
        ("checkpoint_every_s", (int, float), "a number"),
    ):
        value = getattr(spec, key)
        # ``not value >= 0`` refuses NaN too; bool is an int to Python, not to TOML users.
        if isinstance(value, bool) or not isinstance(value, kinds) or not value >= 0:
            raise ModelError(f"model {spec.name!r}: {key} must be {what} >= 0, not {value!r}")


def toml_value(value: Any) -> str:
    """A registry entry's value as TOML writes it (for files made of entries: the
    miniatures' parallel twins, the benchmarks' variants)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a ModelFamily too
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, Parallelism):
        value = value.as_dict()
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return repr(value)
