"""What a model is to Darkroom: its family, and the entry that the model registry
(``services.models.registry``, a TOML file) holds for it: its source, its limits,
its first estimates and its options; the noise scheduler and the model-store
version it names."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from services.errors import ModelError
from services.models.parallel import SINGLE, Parallelism


class ModelFamily(enum.StrEnum):
    """What kind of model it is: how it loads and denoises."""

    SD15 = "sd15"
    SDXL = "sdxl"
    TINY = "tiny"  # SD-shaped, built locally with random weights
    SIM = "sim"  # no weights: it only takes its modelled time
    WAN = "wan"  # Wan 2.1 text to video
    SD_X4_UPSCALER = "sd_x4_upscaler"  # Stable Diffusion's x4 upscaler: an image in, 4x its size out
    SD3 = "sd3"  # Stable Diffusion 3 and 3.5: an MMDiT over two CLIPs and a T5, flow matching
    FLUX = "flux"  # Flux.1 dev (the guidance scale an input) and schnell (no guidance)
    FLUX_KONTEXT = "flux_kontext"  # Flux.1 Kontext: an input image edited as its prompt says
    QWEN_IMAGE = "qwen_image"  # Qwen-Image: a 20B MMDiT over a Qwen2.5-VL's text, true classifier-free guidance
    Z_IMAGE = "z_image"  # Z-Image and Z-Image-Turbo: a single-stream DiT over a Qwen3 chat model's states
    QWEN_IMAGE_EDIT = "qwen_image_edit"  # Qwen-Image-Edit: an input image edited as its prompt says


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
    ModelFamily.SD3: (35.0, 8.0, "image"),  # 3.5 Medium; Large is about 3x
    ModelFamily.FLUX: (70.0, 20.0, "image"),
    ModelFamily.FLUX_KONTEXT: (140.0, 20.0, "image"),  # its input image's tokens double the sequence
    ModelFamily.QWEN_IMAGE: (210.0, 40.0, "image"),  # 20B: about 3x Flux.1's step, two calls with guidance
    ModelFamily.Z_IMAGE: (40.0, 12.0, "image"),  # a 6B DiT: half Flux.1's transformer, Qwen3-4B beside it
    ModelFamily.QWEN_IMAGE_EDIT: (420.0, 40.0, "image"),  # its input image's tokens double the sequence
}
# The families whose transformer patches latents 2x2 (or packs them): sizes are
# multiples of 16 (the VAE's 8 times the patch's 2).
PATCHED_FAMILIES = frozenset(
    {
        ModelFamily.WAN,
        ModelFamily.SD3,
        ModelFamily.FLUX,
        ModelFamily.FLUX_KONTEXT,
        ModelFamily.QWEN_IMAGE,
        ModelFamily.Z_IMAGE,
        ModelFamily.QWEN_IMAGE_EDIT,
    }
)
# The families whose models also edit images (image to image and inpainting; by
# instruction for those below).
EDITING_FAMILIES = frozenset(
    {
        ModelFamily.SD15,
        ModelFamily.SDXL,
        ModelFamily.TINY,
        ModelFamily.SD3,
        ModelFamily.FLUX,
        ModelFamily.FLUX_KONTEXT,
        ModelFamily.QWEN_IMAGE,
        ModelFamily.Z_IMAGE,
        ModelFamily.QWEN_IMAGE_EDIT,
    }
)
# The families that edit by instruction: every job an input image and a prompt saying
# what to change, denoised from noise beside the image (no strength, no mask).
INSTRUCTION_EDIT_FAMILIES = frozenset({ModelFamily.FLUX_KONTEXT, ModelFamily.QWEN_IMAGE_EDIT})
# The families whose text encoder sees the input image with the prompt: a job's
# conditioning is its prompt's and its image's, the image resized to about a
# megapixel at its own aspect ratio (``services.models.input_limits.edit_condition_size``).
PROMPT_SEES_IMAGE_FAMILIES = frozenset({ModelFamily.QWEN_IMAGE_EDIT})
# The families whose latents a preview reads as colours (``gpu_worker.jobs.previews``).
PREVIEW_FAMILIES = frozenset(
    {
        ModelFamily.SD15,
        ModelFamily.SDXL,
        ModelFamily.TINY,
        ModelFamily.SD3,
        ModelFamily.FLUX,
        ModelFamily.FLUX_KONTEXT,
        ModelFamily.QWEN_IMAGE,
        ModelFamily.Z_IMAGE,
        ModelFamily.QWEN_IMAGE_EDIT,
    }
)
# A model in the model store: ``store:NAME[:VERSION]`` (services/models/store).
STORE_PREFIX = "store:"
# What a ``sim`` model's source must be: it has no weights (services/models/sim.py).
BUILTIN_SIM = "builtin:sim"
# Where a model's text encoders may run (``ModelSpec.text_encoders``).
TEXT_ENCODER_PLACES = ("device", "host", "service")
# The families whose text encoders the decoder service may run (``"service"``): those
# whose prompts the shared encoding (``services.models.prompt_encoding``) encodes.
SERVED_TEXT_ENCODER_FAMILIES = frozenset(
    {
        ModelFamily.SD15,
        ModelFamily.SDXL,
        ModelFamily.TINY,
        ModelFamily.SD3,
        ModelFamily.FLUX,
        ModelFamily.FLUX_KONTEXT,
        ModelFamily.QWEN_IMAGE,
        ModelFamily.QWEN_IMAGE_EDIT,
        ModelFamily.Z_IMAGE,
        ModelFamily.WAN,
    }
)
# The families whose models take LoRA adapters (``adapter_slots``): their networks'
# layers are called with a call's rows first (services/models/adapters).
ADAPTED_FAMILIES = frozenset(
    {ModelFamily.SD15, ModelFamily.SDXL, ModelFamily.TINY, ModelFamily.SD3, ModelFamily.FLUX}
    | {ModelFamily.FLUX_KONTEXT, ModelFamily.QWEN_IMAGE, ModelFamily.QWEN_IMAGE_EDIT, ModelFamily.Z_IMAGE}
)
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
    # What an input image (an edit's, an upscale's) and a prompt may be, 0 taking the
    # family's (``services.models.input_limits``): the image's shortest side in pixels,
    # its longest side over its shortest, and a prompt's UTF-8 bytes.
    min_input_side: int = 0
    max_input_aspect: float = 0.0
    max_prompt_bytes: int = 0
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
    # ``optimize = "aggressive"``: those, and step caching and FP8 (on FP8 hardware).
    optimize: bool | str = False
    compile: bool = False
    cuda_graphs: bool = False
    channels_last: bool = False
    attention: str = ""
    fuse_qkv: bool = False
    quantize: str = ""
    # Step caching (gpu_worker/denoising/step_cache.py): a step reuses a job's last
    # prediction while its estimated change stays within this (0: off).
    step_cache: float = 0.0
    # Where its text encoders run: "device", beside its network (the default);
    # "host": kept in the sampler's host memory and run on its CPU, each prompt's
    # conditioning then moved to the device (T5-XXL's 9.5 GB off a card too small);
    # or "service": loaded once by the decoder service, which encodes every sampler's
    # prompts (``VaeDecoder.EncodePrompt``), the samplers loading the network alone.
    text_encoders: str = "device"
    # LoRA adapters (docs/adapters.md): how many a sampler keeps resident on the
    # device beside the model (0: the model takes none), the largest rank it takes
    # (every slot is padded to it: a compiled network never compiles for another),
    # and how many one job may name (unsaid: 4, or adapter_slots if fewer).
    adapter_slots: int = 0
    adapter_rank: int = 32
    adapters_per_job: int = 4
    # An output whose latents vary less than this (standard deviation) is degenerate.
    min_output_std: float = 1e-3
    # The noise scheduler: a diffusers scheduler class name such as
    # "DPMSolverMultistepScheduler", built from the model's own scheduler config;
    # "" keeps the model's own class.
    scheduler: str = ""
    # A running job writes a checkpoint (gpu_worker/denoising/checkpoint_capture.py) every
    # so many steps, or seconds, whichever comes first; 0 turns either off. By default every
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
    # Z-Image: a guided prediction's norm capped at this multiple of the prompted
    # one's (ZImagePipeline's ``cfg_normalization``); 0 leaves it uncapped.
    cfg_normalization: float = 0.0
    # A sim model's picture (a path; relative: to the registry's directory): its
    # outputs are that picture, resized to the job's size, whatever the seed (tests).
    sim_image: str = ""
    # How one replica spreads over GPUs (``services.models.parallel``): only a group of
    # that shape serves it; ``vram_mb`` is then each GPU's part.
    parallel: Parallelism = SINGLE

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

    @property
    def instruction_edits(self) -> bool:
        return self.family in INSTRUCTION_EDIT_FAMILIES

    @property
    def prompt_sees_image(self) -> bool:
        return self.family in PROMPT_SEES_IMAGE_FAMILIES

    @property
    def previews(self) -> bool:
        return self.family in PREVIEW_FAMILIES


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
