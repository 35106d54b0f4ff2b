"""A prompt's conditioning as each family's pipeline encodes it, as named tensors: the
one encoding both a sampler (text encoders on its device or its host) and the decoder
service (``text_encoders = "service"``) run, so a conditioning is the same wherever it
was made. The names are ``Conditioning``'s fields (``gpu_worker.denoising.prompts``);
on the wire they travel as safetensors bytes (named, dtypes kept; never pickle)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from services.errors import FieldViolation, InvalidArgument
from services.models.input_limits import EDIT_CONDITION_TOKENS, QWEN_EDIT_PROMPT_TOKENS
from services.models.spec import ModelFamily

# The T5 prompt length of Flux.1 dev (and of FluxPipeline's default); schnell was trained with 256.
FLUX_DEV_TEXT_LEN = 512
FLUX_SCHNELL_TEXT_LEN = 256
# The T5 prompt length SD 3's pipeline defaults to (and SD 3 was trained with).
SD3_TEXT_LEN = 256
# The longest prompt, in tokens: QwenImagePipeline's default max_sequence_length.
QWEN_TEXT_LEN = 512
# An edit's longest text, in tokens: a prompt QwenImageEditPipeline reads whole, and
# its input image's at most EDIT_CONDITION_TOKENS (1,386 within 4:1: the template's
# seven around them fit in what is left). A longer one (a prompt past what the
# gateway takes) is cut to it, as QwenImagePipeline cuts a long prompt's: a compiled
# network takes every text padded to it, and a longer one would fail every call that
# shares it.
QWEN_EDIT_TEXT_LEN = QWEN_EDIT_PROMPT_TOKENS + EDIT_CONDITION_TOKENS
# ZImagePipeline's longest prompt, in tokens with its chat template.
Z_IMAGE_TEXT_LEN = 512
# The prompt length Wan was trained with; its pipeline pads every prompt to it.
WAN_TEXT_LEN = 512
# The negative prompt of a Qwen-Image job that gives none: Qwen-Image's examples' (the
# pipeline guides only with one, and the empty string is a prompt like any other).
NO_NEGATIVE_PROMPT = " "
# The families whose pipelines encode with CLIP and a UNet's encode_prompt (the x4
# upscaler's too: a sampler encodes its prompt, the decoder never serves it).
_UNET_FAMILIES = frozenset({ModelFamily.SD15, ModelFamily.SDXL, ModelFamily.TINY, ModelFamily.SD_X4_UPSCALER})

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PromptParams:
    """What a conditioning depends on besides its model (a job's ``GenerationParams``
    has these too): its prompts, and the size SDXL's time ids name."""

    prompt: str
    negative_prompt: str = ""
    width: int = 512
    height: int = 512


def text_length(tokenizer: Any, longest: int) -> int:
    """The T5 prompt length: the pipeline's, unless the tokenizer's own is shorter (a miniature's)."""
    if tokenizer is None:
        return longest
    return min(longest, int(tokenizer.model_max_length))


def encode(
    pipe: Any,
    family: ModelFamily,
    params: Any,
    device: torch.device,
    cfg: bool,
    *,
    network_config: Mapping[str, Any] | None = None,
    image: torch.Tensor | None = None,
) -> Tensors:
    """The conditioning of ``params`` (``cfg``: with its negative half) by ``pipe``'s
    text encoders on ``device``. ``network_config``: the denoising network's config
    (Flux's prompt length depends on whether it embeds guidance); ``image``: for a
    family whose text encoder sees the input image, its pixels (1, 3, h, w) uint8."""
    if family in _UNET_FAMILIES:
        return _unet(pipe, family, params, device, cfg)
    if family == ModelFamily.SD3:
        return _sd3(pipe, params, device, cfg)
    if family in (ModelFamily.FLUX, ModelFamily.FLUX_KONTEXT):
        return _flux(pipe, params, device, network_config or {})
    if family == ModelFamily.QWEN_IMAGE:
        return _qwen_image(pipe, params, device, cfg)
    if family == ModelFamily.QWEN_IMAGE_EDIT:
        if image is None:
            model = getattr(params, "model", "the model")
            raise InvalidArgument([FieldViolation("image", f"{model} takes an input image, and this job has none")])
        return _qwen_image_edit(pipe, params, device, cfg, image)
    if family == ModelFamily.Z_IMAGE:
        return _z_image(pipe, params, device, cfg)
    if family == ModelFamily.WAN:
        return _wan(pipe, params, device, cfg)
    raise ValueError(f"a {family} model has no text encoders to encode with")


def _named(**tensors: torch.Tensor | None) -> Tensors:
    return {name: t for name, t in tensors.items() if t is not None}


def _unet(pipe: Any, family: ModelFamily, params: Any, device: torch.device, cfg: bool) -> Tensors:
    negative = params.negative_prompt or None
    if family == ModelFamily.SDXL:
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt(
            prompt=params.prompt,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=negative,
        )
        projection = pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None else None
        size = (params.height, params.width)
        time_ids = pipe._get_add_time_ids(
            size, (0, 0), size, dtype=embeds.dtype, text_encoder_projection_dim=projection
        ).to(device)
        return _named(
            embeds=embeds,
            negative_embeds=neg if cfg else None,
            pooled=pooled,
            negative_pooled=neg_pooled if cfg else None,
            time_ids=time_ids,
        )
    embeds, neg = pipe.encode_prompt(params.prompt, device, 1, cfg, negative)
    return _named(embeds=embeds, negative_embeds=neg if cfg else None)


def _sd3(pipe: Any, params: Any, device: torch.device, cfg: bool) -> Tensors:
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
        prompt=params.prompt,
        prompt_2=None,
        prompt_3=None,
        negative_prompt=params.negative_prompt or "",
        do_classifier_free_guidance=cfg,
        num_images_per_prompt=1,
        max_sequence_length=text_length(pipe.tokenizer_3, SD3_TEXT_LEN),
        device=device,
    )
    if not cfg:
        return _named(embeds=embeds, pooled=pooled)
    return _named(embeds=embeds, negative_embeds=negative, pooled=pooled, negative_pooled=negative_pooled)


def _flux(pipe: Any, params: Any, device: torch.device, network_config: Mapping[str, Any]) -> Tensors:
    longest = FLUX_DEV_TEXT_LEN if network_config.get("guidance_embeds") else FLUX_SCHNELL_TEXT_LEN
    embeds, pooled, _ = pipe.encode_prompt(
        prompt=params.prompt,
        prompt_2=None,
        device=device,
        num_images_per_prompt=1,
        max_sequence_length=text_length(pipe.tokenizer_2, longest),
    )
    return _named(embeds=embeds, pooled=pooled)


def _qwen_image(pipe: Any, params: Any, device: torch.device, cfg: bool) -> Tensors:
    """Each text alone, as the pipeline encodes it: a prompt alone has no padding, so
    its mask (every position a token) is left out."""
    longest = text_length(pipe.tokenizer, QWEN_TEXT_LEN)
    embeds, _ = pipe.encode_prompt(params.prompt, device, 1, max_sequence_length=longest)
    if not cfg:
        return _named(embeds=embeds)
    negative_prompt = params.negative_prompt or NO_NEGATIVE_PROMPT
    negative, _ = pipe.encode_prompt(negative_prompt, device, 1, max_sequence_length=longest)
    return _named(embeds=embeds, negative_embeds=negative)


def _qwen_image_edit(pipe: Any, params: Any, device: torch.device, cfg: bool, image: torch.Tensor) -> Tensors:
    """Each text alone with the image, as the pipeline encodes them: its processor
    takes the image's pixels as a picture. Each cut to QWEN_EDIT_TEXT_LEN tokens (the
    pipeline cuts none): its encoder is causal, so a token kept holds what it would
    had the text ended there."""
    from PIL import Image

    picture = Image.fromarray(image[0].permute(1, 2, 0).numpy())
    longest = text_length(pipe.tokenizer, QWEN_EDIT_TEXT_LEN)
    embeds, _ = pipe.encode_prompt(params.prompt, image=picture, device=device)
    if not cfg:
        return _named(embeds=embeds[:, :longest])
    negative_prompt = params.negative_prompt or NO_NEGATIVE_PROMPT
    negative, _ = pipe.encode_prompt(negative_prompt, image=picture, device=device)
    return _named(embeds=embeds[:, :longest], negative_embeds=negative[:, :longest])


def _z_image(pipe: Any, params: Any, device: torch.device, cfg: bool) -> Tensors:
    """Its text keeps its own length; ``text_lengths`` (host tensors) say each row's."""
    embeds, negative = pipe.encode_prompt(
        prompt=params.prompt,
        device=device,
        do_classifier_free_guidance=cfg,
        negative_prompt=params.negative_prompt or None,
        max_sequence_length=text_length(pipe.tokenizer, Z_IMAGE_TEXT_LEN),
    )
    [embeds] = embeds
    lengths = torch.tensor([len(embeds)])
    if not cfg:
        return _named(embeds=embeds[None], text_lengths=lengths)
    [negative] = negative
    return _named(
        embeds=embeds[None],
        negative_embeds=negative[None],
        text_lengths=lengths,
        negative_text_lengths=torch.tensor([len(negative)]),
    )


def _wan(pipe: Any, params: Any, device: torch.device, cfg: bool) -> Tensors:
    """In the text encoder's dtype: the sampler casts it to its transformer's."""
    embeds, negative = pipe.encode_prompt(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt or "",
        do_classifier_free_guidance=cfg,
        num_videos_per_prompt=1,
        max_sequence_length=WAN_TEXT_LEN,
        device=device,
    )
    return _named(embeds=embeds, negative_embeds=negative if cfg else None)


def to_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Named tensors as safetensors bytes: each with its dtype and shape, read from the host."""
    return safetensors_save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})


def from_bytes(data: bytes) -> Tensors:
    """``to_bytes``'s tensors again, on the host; ValueError for bytes that are none."""
    try:
        return safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed headers
        raise ValueError(f"not a safetensors conditioning: {exc}") from None
