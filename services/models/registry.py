"""The model registry: a TOML file naming every model Darkroom may serve."""

from __future__ import annotations

import enum
import tomllib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from services.errors import ModelError
from services.models.builtins import BUILTINS

DEFAULT_REGISTRY = Path(__file__).with_name("default_registry.toml")


class ModelFamily(enum.StrEnum):
    """What kind of model it is: how it loads and denoises."""

    SD15 = "sd15"
    SDXL = "sdxl"
    TINY = "tiny"  # SD-shaped, built locally with random weights
    SIM = "sim"  # no weights: it only takes its modelled time
    WAN = "wan"  # Wan 2.1 text to video
    SD_X4_UPSCALER = "sd_x4_upscaler"  # Stable Diffusion's x4 upscaler: an image in, 4x its size out


# Per family: one 512x512 step (of one frame) on a reference GPU (ms), a load (s),
# and the capability its models have unless the registry says otherwise. Learned
# durations replace the first after a few jobs.
FAMILY_DEFAULTS = {
    ModelFamily.SD15: (25.0, 5.0, "image"),
    ModelFamily.SDXL: (60.0, 10.0, "image"),
    ModelFamily.TINY: (30.0, 0.5, "image"),
    ModelFamily.SIM: (25.0, 1.0, "image"),
    ModelFamily.WAN: (40.0, 15.0, "video"),
    ModelFamily.SD_X4_UPSCALER: (40.0, 5.0, "upscale"),
}
# The families whose models also edit images (image to image, inpainting).
EDITING_FAMILIES = frozenset({ModelFamily.SD15, ModelFamily.SDXL, ModelFamily.TINY})
ATTENTION = frozenset({"", "sdpa", "flash", "efficient", "cudnn", "eager"})
QUANTIZE = frozenset({"", "int8", "fp8"})
# A model in the model store: ``store:NAME[:VERSION]`` (services/models/store).
STORE_PREFIX = "store:"
# What a ``sim`` model's source must be: it has no weights (services/models/sim.py).
BUILTIN_SIM = "builtin:sim"
# Frames per second a video may ask for.
MAX_FPS = 120.0
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
    # Speed options of its networks (``services.models.speed``): the one switch
    # ``optimize`` turns on every one that keeps images within tolerance on the
    # device; or each alone: ``torch.compile`` (warmed up as it loads, batches padded
    # to buckets), CUDA graphs (compiled with them), the channels-last memory format,
    # the attention implementation ("" the model's own; "sdpa" PyTorch's, "flash",
    # "efficient", "cudnn" one SDPA kernel, "eager" the plain one), fused QKV
    # projections, and weights quantized by torchao ("int8", "fp8": an opt-in that
    # moves images; ``bench/gpu.py`` reports how far).
    optimize: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    channels_last: bool = False
    attention: str = ""
    fuse_qkv: bool = False
    quantize: str = ""
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
    # The model a client gets for its capability when it names none (listed first).
    default: bool = False
    # Served only when DARKROOM_PRESETS names it (the full-size random-weight presets).
    on_request: bool = False
    # Widths and heights are multiples of this (8 for SD's VAE; 16 for Wan's patches).
    size_step: int = 8
    # Video models: frames of a video (frames - 1 a multiple of frames_step, the
    # VAE's temporal compression), and frames per second of the file.
    max_frames: int = 1
    default_frames: int = 1
    frames_step: int = 1
    default_fps: float = 0.0
    # The guidance scale of a request that gives none.
    default_guidance: float = 7.5
    # A sim model's picture (a path; relative: to the registry's directory): its
    # outputs are that picture, resized to the job's size, whatever the seed (tests).
    sim_image: str = ""

    @property
    def vram_bytes(self) -> int:
        return self.vram_mb * 1024 * 1024

    @property
    def step_s_512(self) -> float:
        return (self.step_ms_512 or FAMILY_DEFAULTS[self.family][0]) / 1000.0

    @property
    def load_seconds(self) -> float:
        return self.load_s or FAMILY_DEFAULTS[self.family][1]

    @property
    def makes_video(self) -> bool:
        return self.family == ModelFamily.WAN

    @property
    def upscales(self) -> bool:
        return self.family == ModelFamily.SD_X4_UPSCALER

    @property
    def edits(self) -> bool:
        return self.family in EDITING_FAMILIES


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
    spec = ModelSpec(name=name, **{"capability": FAMILY_DEFAULTS[family][2], **table, "family": family})
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
    if spec.cuda_graphs and not (spec.compile or spec.optimize):
        raise ModelError(f"model {name!r}: cuda_graphs come with compile (or optimize)")
    if spec.max_batch < 1:
        raise ModelError(f"model {name!r}: max_batch must be at least 1, not {spec.max_batch}")
    if not spec.price >= 0:
        raise ModelError(f"model {name!r}: price must be at least 0, not {spec.price}")
    _check_checkpointing(spec)
    _check_frames(spec)
    if spec.scheduler:
        scheduler_class(spec)
    return spec


def _check_frames(spec: ModelSpec) -> None:
    if spec.size_step < 1 or spec.frames_step < 1:
        raise ModelError(f"model {spec.name!r}: size_step and frames_step must be at least 1")
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


def store_reference(spec: ModelSpec) -> tuple[str, str | None] | None:
    """``(name, version or None for the latest)`` of a model whose source is
    ``store:NAME[:VERSION]`` (pushed with `darkroom models push`); None for any other."""
    if not spec.source.startswith(STORE_PREFIX):
        return None
    from services.models.store.manifest import parse_reference

    try:
        return parse_reference(spec.source.removeprefix(STORE_PREFIX))
    except ModelError as exc:
        raise ModelError(f"model {spec.name!r}: source {spec.source!r}: {exc}") from None
