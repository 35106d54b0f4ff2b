"""A model's text encoders apart from its network: which components of its pipeline
they are, and the decoder service's engine for models whose registry entry says
``text_encoders = "service"``. The engine loads a model's encoders (and tokenizers) on
first use, without its network or VAE, encodes prompts with the shared encoding
(``services.models.prompt_encoding``) and keeps the conditionings it made, as
safetensors bytes, by prompt, bounded in bytes: a batch's members, a retry and a
resume on another sampler reuse one encoding."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.errors import FieldViolation, InvalidArgument
from services.models import loader, prompt_encoding
from services.models.registry import ModelRegistry
from services.models.sources import resolve_source
from services.models.spec import ModelSpec

log = logging.getLogger(__name__)

# A pipeline's text encoders, as its components are named.
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# What a pipeline holds besides its encoders, tokenizers and noise scheduler: not
# loaded where only its text is encoded.
NOT_ENCODERS = ("unet", "transformer", "vae", "safety_checker", "feature_extractor", "image_encoder")


def pipeline_index(spec: ModelSpec, models_dir: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Where the model loads from, how, and its pipeline's components (``model_index.json``)."""
    from diffusers import DiffusionPipeline

    source, kwargs = resolve_source(spec, models_dir)
    return source, kwargs, dict(DiffusionPipeline.load_config(source, **kwargs))


def text_encoder_names(spec: ModelSpec, models_dir: Path) -> list[str]:
    """The text encoders its pipeline has."""
    _, _, index = pipeline_index(spec, models_dir)
    return [name for name in TEXT_ENCODERS if name in index]


@dataclass
class _Encoders:
    pipe: Any
    network_config: dict[str, Any]  # the denoising network's config, read from its file
    bytes: int


class ConditioningCache:
    """Least recently used conditionings (safetensors bytes), up to ``max_bytes`` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()

    def get(self, key: tuple[Any, ...]) -> bytes | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: tuple[Any, ...], value: bytes) -> None:
        if key in self._entries or len(value) > self.max_bytes:
            return
        self._entries[key] = value
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= len(dropped)


@dataclass(frozen=True)
class PromptRequest:
    """What a sampler asks a conditioning of: ``guided`` with its negative half, and
    (Qwen-Image-Edit) the input image its text encoder sees, resized to ``image_size``."""

    model: str
    params: prompt_encoding.PromptParams
    guided: bool
    image: bytes = b""
    image_size: tuple[int, int] = (0, 0)

    def key(self) -> tuple[Any, ...]:
        p = self.params
        digest = hashlib.sha256(self.image).hexdigest() if self.image else ""
        return (self.model, p.prompt, p.negative_prompt, self.guided, p.width, p.height, digest, self.image_size)


class TextEncoderEngine:
    """The text encoders of the models it serves, each loaded once, on ``device``."""

    def __init__(self, registry: ModelRegistry, models_dir: Path, device: torch.device, cache_bytes: int) -> None:
        self.registry = registry
        self.models_dir = models_dir
        self.device = device
        self.cache = ConditioningCache(cache_bytes)
        self.encoded = 0  # conditionings it made
        self.reused = 0  # conditionings its cache held
        self._encoders: dict[str, _Encoders] = {}
        self._lock = threading.Lock()  # one load or encoding at a time: they share the device

    def check_model(self, model: str) -> ModelSpec:
        spec = self.registry.models.get(model)
        if spec is None:
            raise InvalidArgument([FieldViolation("model", f"unknown model {model!r}")])
        if spec.text_encoders != "service":
            raise InvalidArgument(
                [
                    FieldViolation(
                        "model", f"{model}'s text encoders are not served (text_encoders = {spec.text_encoders!r})"
                    )
                ]
            )
        return spec

    def warm_models(self) -> list[str]:
        return sorted(self._encoders)

    def held_bytes(self) -> int:
        """What its loaded text encoders hold on its device."""
        return sum(e.bytes for e in self._encoders.values())

    def telemetry(self) -> dict[str, Any]:
        return {
            "text_encoder_models": self.warm_models(),
            "text_encoder_bytes": self.held_bytes(),
            "encoded_prompts": self.encoded,
            "reused_prompts": self.reused,
            "prompt_cache_bytes": self.cache.bytes,
        }

    def encode(self, request: PromptRequest) -> tuple[bytes, bool]:
        """The conditioning's safetensors bytes, and whether the cache held it."""
        spec = self.check_model(request.model)
        if spec.prompt_sees_image and not request.image:
            raise InvalidArgument([FieldViolation("image", f"{spec.name}'s text encoder sees the input image")])
        key = request.key()
        with self._lock:
            found = self.cache.get(key)
            if found is not None:
                self.reused += 1
                return found, True
            encoders = self._load(spec)
            image = self._image(request) if spec.prompt_sees_image else None
            with torch.inference_mode():
                tensors = prompt_encoding.encode(
                    encoders.pipe,
                    spec.family,
                    request.params,
                    self.device,
                    request.guided,
                    network_config=encoders.network_config,
                    image=image,
                )
            data = prompt_encoding.to_bytes(tensors)
            self.cache.put(key, data)
            self.encoded += 1
            return data, False

    def load(self, model: str) -> None:
        spec = self.check_model(model)
        with self._lock:
            self._load(spec)

    def _load(self, spec: ModelSpec) -> _Encoders:
        found = self._encoders.get(spec.name)
        if found is not None:
            return found
        from diffusers import DiffusionPipeline

        source, kwargs, index = pipeline_index(spec, self.models_dir)
        parts: dict[str, Any] = {name: None for name in NOT_ENCODERS if name in index}
        if "safety_checker" in index:
            parts["requires_safety_checker"] = False
        if spec.prompt_sees_image:
            from services.models.qwen_processor import load_processor

            parts["processor"] = load_processor(Path(source) / "processor")
        dtype = loader.compute_dtype(spec, self.device)
        loaded = loader.load(DiffusionPipeline, spec, self.models_dir, self.device, dtype=dtype, **parts)
        loaded.value.set_progress_bar_config(disable=True)
        encoders = _Encoders(loaded.value, _network_config(source, kwargs, index), loaded.bytes)
        log.info(
            "loaded the text encoders of %s on %s (%d MiB, %.2fs)",
            spec.name,
            self.device,
            loaded.bytes >> 20,
            loaded.seconds,
        )
        self._encoders[spec.name] = encoders
        return encoders

    def _image(self, request: PromptRequest) -> torch.Tensor:
        """The input image as the text encoder sees it: (1, 3, h, w) uint8 at its condition size."""
        from services.models.vae import pixels_of

        width, height = request.image_size
        if not (width > 0 and height > 0):
            raise InvalidArgument([FieldViolation("image_width", "and image_height are required with an image")])
        return torch.tensor(pixels_of(request.image, width, height)).permute(2, 0, 1).unsqueeze(0)


def _network_config(source: str, kwargs: dict[str, Any], index: dict[str, Any]) -> dict[str, Any]:
    """The denoising network's config, read from its file (its weights never load here):
    Flux's prompt length depends on whether it embeds guidance."""
    import diffusers

    for name in ("transformer", "unet"):
        if name in index:
            cls = getattr(diffusers, index[name][1])
            return dict(cls.load_config(source, subfolder=name, **kwargs))
    return {}
