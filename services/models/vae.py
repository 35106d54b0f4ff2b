"""Latents to pixels with a real diffusers ``AutoencoderKL``, then PNG bytes. The decoder
service runs it; a sampler runs it too when no decoder can (``local_decode_fallback``)."""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from services.errors import FieldViolation, InvalidArgument, ModelError
from services.models.registry import ModelRegistry, resolve_source

log = logging.getLogger("darkroom.vae")

_NUMPY_DTYPES = {"float32": "<f4", "float16": "<f2"}


def latents_from_bytes(data: bytes, shape: list[int], dtype: str) -> torch.Tensor:
    if dtype not in _NUMPY_DTYPES:
        raise InvalidArgument([FieldViolation("dtype", f"must be one of {sorted(_NUMPY_DTYPES)}")])
    if len(shape) != 4 or any(d <= 0 for d in shape):
        raise InvalidArgument([FieldViolation("shape", "must be (batch, channels, height, width), all positive")])
    expected = int(np.prod(shape)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
    if len(data) != expected:
        raise InvalidArgument([FieldViolation("latents", f"{len(data)} bytes, shape {shape} needs {expected}")])
    array = np.frombuffer(data, dtype=_NUMPY_DTYPES[dtype]).reshape(shape)
    return torch.from_numpy(array.astype(np.float32))


def encode_png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class VaeDecoderEngine:
    def __init__(self, registry: ModelRegistry, models_dir: Path, device: torch.device) -> None:
        self.registry = registry
        self.models_dir = models_dir
        self.device = device
        self._vaes: dict[str, Any] = {}
        self._lock = threading.Lock()

    def warm_models(self) -> list[str]:
        return sorted(self._vaes)

    def load(self, name: str) -> Any:
        with self._lock:
            if name in self._vaes:
                return self._vaes[name]
            from diffusers import AutoencoderKL

            spec = self.registry.get(name)
            source, kwargs = resolve_source(spec, self.models_dir)
            dtype = torch.float32
            if self.device.type == "cuda" and spec.dtype != "float32":
                # SD's VAE overflows in float16; bfloat16 keeps the range.
                dtype = torch.bfloat16
            try:
                vae = AutoencoderKL.from_pretrained(source, subfolder="vae", torch_dtype=dtype, **kwargs)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load the VAE of {name!r} from {source}: {exc}") from exc
            vae = vae.to(self.device).eval()
            self._vaes[name] = vae
            log.info("loaded VAE of %s on %s", name, self.device)
            return vae

    def decode(self, model: str, latents: torch.Tensor) -> list[np.ndarray]:
        """Returns one HxWx3 uint8 array per latent."""
        if model not in self.registry:
            raise InvalidArgument([FieldViolation("model", f"unknown model {model!r}")])
        vae = self.load(model)
        config = vae.config
        latents = latents.to(self.device, vae.dtype)
        latents = latents / config.scaling_factor
        if getattr(config, "shift_factor", None):
            latents = latents + config.shift_factor
        with torch.inference_mode():
            images = vae.decode(latents).sample
        images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return list(images.permute(0, 2, 3, 1).cpu().numpy())
