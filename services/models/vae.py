"""Latents to pixels with a real diffusers ``AutoencoderKL``: a batch in one call,
an image too large to decode whole in overlapping tiles, and every image checked
before anyone encodes it. The decoder service runs it; a sampler runs it too when no
decoder can (``local_decode_fallback``)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.config.sections import DecodeSettings
from services.errors import DegenerateOutput, FieldViolation, InvalidArgument
from services.models import loader, sim
from services.models.registry import ModelFamily, ModelRegistry

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"float32": "<f4", "float16": "<f2"}
# The defaults of DARKROOM_DECODE_TILE_ABOVE_PIXELS and DARKROOM_DECODE_MIN_PIXEL_STD,
# for a sampler's local fallback.
DEFAULT_TILE_ABOVE_PIXELS = 1536 * 1536
DEFAULT_MIN_PIXEL_STD = 0.002


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


class _SimConfig:
    scaling_factor = 1.0
    shift_factor = None
    block_out_channels = (0,) * 4  # pixels per latent: 2 ** (4 - 1)


class SimVae:
    """A sim model's VAE (services/models/sim.py): a fixed projection, no weights."""

    config = _SimConfig()
    dtype = torch.float32

    def decode(self, z: torch.Tensor) -> Any:
        return _Sample(sim.decode(z))

    def tiled_decode(self, z: torch.Tensor) -> Any:
        return self.decode(z)


@dataclass(frozen=True)
class _Sample:
    sample: torch.Tensor


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # HxWx3 uint8
    tiled: bool
    # Why no image should be made of it (non-finite or near-constant pixels); empty when fine.
    fault: str = ""


@dataclass(eq=False)
class VaeDecoderEngine:
    registry: ModelRegistry
    models_dir: Path
    device: torch.device
    tile_above_pixels: int = DEFAULT_TILE_ABOVE_PIXELS
    min_pixel_std: float = DEFAULT_MIN_PIXEL_STD
    _vaes: dict[str, Any] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @classmethod
    def from_settings(
        cls, decode: DecodeSettings, registry: ModelRegistry, models_dir: Path, device: torch.device
    ) -> VaeDecoderEngine:
        return cls(
            registry, models_dir, device, tile_above_pixels=decode.tile_above_pixels, min_pixel_std=decode.min_pixel_std
        )

    def warm_models(self) -> list[str]:
        return sorted(self._vaes)

    def load(self, name: str) -> Any:
        with self._lock:
            if name in self._vaes:
                return self._vaes[name]
            spec = self.registry.get(name)
            if spec.family == ModelFamily.SIM:
                vae = self._vaes[name] = SimVae()
                return vae
            from diffusers import AutoencoderKL

            dtype = torch.float32
            if self.device.type == "cuda" and spec.dtype != "float32":
                # SD's VAE overflows in float16; bfloat16 keeps the range.
                dtype = torch.bfloat16
            loaded = loader.load(AutoencoderKL, spec, self.models_dir, self.device, dtype=dtype, subfolder="vae")
            vae = loaded.value.eval()
            self._vaes[name] = vae
            log.info("loaded VAE of %s on %s (%d MiB, %.2fs)", name, self.device, loaded.bytes >> 20, loaded.seconds)
            return vae

    def check_model(self, model: str) -> None:
        if model not in self.registry:
            raise InvalidArgument([FieldViolation("model", f"unknown model {model!r}")])

    def decode_images(self, model: str, latents: torch.Tensor) -> list[DecodedImage]:
        """One image per latent, each with its fault if it has one."""
        self.check_model(model)
        vae = self.load(model)
        config = vae.config
        z = latents.to(self.device, vae.dtype) / config.scaling_factor
        if getattr(config, "shift_factor", None):
            z = z + config.shift_factor
        scale = 2 ** (len(config.block_out_channels) - 1)
        tiled = z.shape[-2] * z.shape[-1] * scale * scale > self.tile_above_pixels
        with torch.inference_mode():
            if tiled:
                # One image at a time, tile by tile: memory stays that of a tile,
                # whatever the image's size.
                decoded = torch.cat([vae.tiled_decode(z[i : i + 1]).sample for i in range(len(z))])
            elif self.device.type == "cuda":
                decoded = vae.decode(z).sample
            else:
                # On a CPU each image alone: kernels block a batch differently, and
                # only so is a batched job's image exactly the one it gets alone.
                decoded = torch.cat([vae.decode(z[i : i + 1]).sample for i in range(len(z))])
            unit = decoded.float() / 2 + 0.5
            finite = torch.isfinite(unit).flatten(1).all(dim=1).tolist()
            unit = unit.nan_to_num(0.0).clamp(0, 1)
            stds = unit.flatten(1).std(dim=1).tolist()
            pixels = (unit * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        images = []
        for image, is_finite, std in zip(pixels, finite, stds, strict=True):
            fault = ""
            if not is_finite:
                fault = "decoded pixels contain NaN or infinity"
            elif std < self.min_pixel_std:
                fault = f"decoded pixels are degenerate: standard deviation {std:.2e} < {self.min_pixel_std:.0e}"
            images.append(DecodedImage(image, tiled, fault))
        return images

    def decode(self, model: str, latents: torch.Tensor) -> list[np.ndarray]:
        """One HxWx3 uint8 array per latent; DegenerateOutput if any image is unusable."""
        images = self.decode_images(model, latents)
        for i, image in enumerate(images):
            if image.fault:
                raise DegenerateOutput(f"image {i}: {image.fault}")
        return [image.pixels for image in images]
