"""Random-weight copies of the real Stable Diffusion 1.5 and SDXL base architectures,
built from their configs: the same modules, parameter counts and shapes as the
real models, so they cost exactly what the real ones cost to load and run, with
no model hub. Their output is noise. For benchmarks and capacity planning.

A byte-level tokenizer stands in for CLIP's vocabulary (which needs a download);
the embedding tables keep CLIP's 49,408 rows."""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from services.models.spec import ModelFamily

PRESET_MARKER = "darkroom_preset.json"
CLIP_VOCAB = 49408


def clip_tokenizer() -> Any:
    """A byte-level CLIP tokenizer (no download): every byte is a token."""
    import tempfile

    from transformers import CLIPTokenizer

    from services.models.tiny import _byte_level_vocab

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "vocab.json").write_text(json.dumps(_byte_level_vocab()))
        (tmp / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=77)


def save_module(directory: Path, module: Any, dtype: Any) -> None:
    """Saves ``module`` in ``dtype`` at ``directory``, then lets it go: a full-size
    network's gigabytes are freed before the next is built."""
    module.to(dtype).save_pretrained(directory)
    del module
    gc.collect()


def _clip_config(tokenizer: Any, **sizes: Any) -> Any:
    from transformers import CLIPTextConfig

    vocab = tokenizer.get_vocab()
    return CLIPTextConfig(
        vocab_size=CLIP_VOCAB,
        max_position_embeddings=77,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **sizes,
    )


SD15_TEXT = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, hidden_act="quick_gelu",
    projection_dim=768,
)  # fmt: skip
SDXL_TEXT_2 = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20, hidden_act="gelu",
    projection_dim=1280,
)  # fmt: skip
SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    cross_attention_dim=768,
    attention_head_dim=8,
)
SDXL_UNET = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    cross_attention_dim=2048,
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
)
SCHEDULER = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000, steps_offset=1
)
PRESETS = {ModelFamily.SD15: "Stable Diffusion 1.5", ModelFamily.SDXL: "Stable Diffusion XL base 1.0"}


def build_preset(kind: ModelFamily, path: Path, *, seed: int = 0) -> Path:
    """Builds the ``kind`` (SD 1.5 or SDXL) architecture with random weights and
    saves it as a float16 diffusers directory at ``path``, one component at a time
    (an SDXL UNet alone is 10 GB in float32)."""

    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if kind not in PRESETS:
        raise ValueError(f"preset {kind!r} is not one of {sorted(PRESETS)}")
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)

    def save(name: str, module: Any) -> None:
        save_module(path / name, module, torch.float16)

    tokenizer = clip_tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    save("text_encoder", CLIPTextModel(_clip_config(tokenizer, **SD15_TEXT)))
    if kind == ModelFamily.SDXL:
        tokenizer.save_pretrained(path / "tokenizer_2")
        save("text_encoder_2", CLIPTextModelWithProjection(_clip_config(tokenizer, **SDXL_TEXT_2)))
        save("unet", UNet2DConditionModel(**SDXL_UNET))
        save("vae", AutoencoderKL(**VAE, sample_size=1024, scaling_factor=0.13025, force_upcast=True))
        scheduler: Any = EulerDiscreteScheduler(**SCHEDULER, timestep_spacing="leading")
        pipeline = ("diffusers", "StableDiffusionXLPipeline")
        extra: dict[str, Any] = {"force_zeros_for_empty_prompt": True}
        components = ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet", "vae", "scheduler"]
    else:
        save("unet", UNet2DConditionModel(**SD15_UNET))
        save("vae", AutoencoderKL(**VAE, sample_size=512))
        scheduler = PNDMScheduler(**SCHEDULER, skip_prk_steps=True)
        pipeline = ("diffusers", "StableDiffusionPipeline")
        extra = {"requires_safety_checker": False, "safety_checker": [None, None], "feature_extractor": [None, None]}
        components = ["text_encoder", "tokenizer", "unet", "vae", "scheduler"]
    scheduler.save_pretrained(path / "scheduler")
    index: dict[str, Any] = {"_class_name": pipeline[1], "_diffusers_version": _diffusers_version(), **extra}
    library = {"tokenizer": "transformers", "tokenizer_2": "transformers"}
    classes = {
        "text_encoder": "CLIPTextModel",
        "text_encoder_2": "CLIPTextModelWithProjection",
        "tokenizer": "CLIPTokenizer",
        "tokenizer_2": "CLIPTokenizer",
        "unet": "UNet2DConditionModel",
        "vae": "AutoencoderKL",
        "scheduler": type(scheduler).__name__,
    }
    for name in components:
        lib = library.get(name, "transformers" if name.startswith("text_encoder") else "diffusers")
        index[name] = [lib, classes[name]]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    (path / PRESET_MARKER).write_text(json.dumps({"preset": kind, "seed": seed, "note": "random weights"}))
    return path


def build_sd15_preset(path: Path) -> Path:
    return build_preset(ModelFamily.SD15, path)


def build_sdxl_preset(path: Path) -> Path:
    return build_preset(ModelFamily.SDXL, path)


def _diffusers_version() -> str:
    import diffusers

    return str(diffusers.__version__)


def parameter_counts(kind: ModelFamily) -> dict[str, int]:
    """Parameters of each network of the ``kind`` architecture, built on the meta
    device (no memory): what the presets must match."""

    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    with torch.device("meta"):
        unet = UNet2DConditionModel(**(SDXL_UNET if kind == ModelFamily.SDXL else SD15_UNET))
        networks: dict[str, Any] = {
            "unet": unet,
            "text_encoder": CLIPTextModel(_clip_config(tokenizer, **SD15_TEXT)),
            "vae": AutoencoderKL(**VAE),
        }
        if kind == ModelFamily.SDXL:
            networks["text_encoder_2"] = CLIPTextModelWithProjection(_clip_config(tokenizer, **SDXL_TEXT_2))
    return {name: sum(p.numel() for p in net.parameters()) for name, net in networks.items()}


def save_network(path: Path, make: Callable[[], Any], dtype: Any) -> None:
    """Builds a network with ``dtype`` as torch's default, so its parameters are created (and
    initialised by the library's own code) in that dtype, saves it, and lets it go."""
    with default_dtype(dtype):
        module = make()
    big = sum(p.numel() for p in module.parameters()) > 10**8
    # Shards of 5 GB keep the text encoder's save within its own size plus one shard, also with
    # safetensors versions that copy a shard's bytes before writing.
    module.save_pretrained(path, max_shard_size="5GB")
    del module
    if big:  # a reference cycle would keep gigabytes alive; a full collection costs ~0.4 s
        gc.collect()


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
