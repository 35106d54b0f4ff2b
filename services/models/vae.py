"""Latents to pixels with a real diffusers ``AutoencoderKL``: a batch in one call,
an image too large to decode whole in overlapping tiles, and every image checked
before anyone encodes it. The decoder service runs it; a sampler runs it too when no
decoder can (``local_decode_fallback``)."""

from __future__ import annotations

import functools
import io
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from services.config.workers import DecodeSettings
from services.errors import DegenerateOutput, FieldViolation, InvalidArgument
from services.models import image_vae, loader, sim, speed
from services.models.device import module_dtype
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily, ModelSpec
from services.models.video_tiles import TileSharing
from services.models.video_vae import decode_video

# The families whose VAE is Qwen-Image's (``services.models.image_vae``).
QWEN_VAE_FAMILIES = frozenset({ModelFamily.QWEN_IMAGE, ModelFamily.QWEN_IMAGE_EDIT})

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"float32": "<f4", "float16": "<f2"}
# The defaults of DARKROOM_DECODE_TILE_ABOVE_PIXELS and DARKROOM_DECODE_MIN_PIXEL_STD,
# for a sampler's local fallback.
DEFAULT_TILE_ABOVE_PIXELS = 1536 * 1536
DEFAULT_MIN_PIXEL_STD = 0.002


def pixels_of(image: bytes, width: int, height: int) -> np.ndarray:
    """An input image's RGB pixels (HxWx3 uint8) at ``width`` x ``height`` (Lanczos
    when it is resized); InvalidArgument if it is no image."""
    try:
        with Image.open(io.BytesIO(image)) as opened:
            rgb = opened.convert("RGB")
    except Exception as exc:
        raise InvalidArgument([FieldViolation("image", f"cannot be read: {exc}")]) from None
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.LANCZOS)
    return np.asarray(rgb, dtype=np.uint8)


def latents_from_bytes(data: bytes, shape: list[int], dtype: str) -> torch.Tensor:
    if dtype not in _NUMPY_DTYPES:
        raise InvalidArgument([FieldViolation("dtype", f"must be one of {sorted(_NUMPY_DTYPES)}")])
    if len(shape) not in (4, 5) or any(d <= 0 for d in shape):
        raise InvalidArgument(
            [
                FieldViolation(
                    "shape",
                    "must be (batch, channels, height, width), or a video's (batch, channels, frames, "
                    "height, width), all positive",
                )
            ]
        )
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
    pixels: np.ndarray  # HxWx3 uint8; a video's FxHxWx3
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
    # Where a tiled video's tiles can be shared out: a group's ranks (gpu_worker.group).
    share_tiles: TileSharing | None = None
    _vaes: dict[str, Any] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _stream: Any = field(default=None, init=False)

    @classmethod
    def from_settings(
        cls, decode: DecodeSettings, registry: ModelRegistry, models_dir: Path, device: torch.device
    ) -> VaeDecoderEngine:
        return cls(
            registry, models_dir, device, tile_above_pixels=decode.tile_above_pixels, min_pixel_std=decode.min_pixel_std
        )

    def warm_models(self) -> list[str]:
        return sorted(self._vaes)

    def served_models(self) -> list[str]:
        return self.registry.names()

    def load(self, name: str) -> Any:
        with self._lock:
            if name in self._vaes:
                return self._vaes[name]
            spec = self.registry.get(name)
            if spec.family == ModelFamily.SIM:
                vae = self._vaes[name] = SimVae()
                return vae
            from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

            dtype = torch.float32
            if self.device.type == "cuda" and spec.dtype != "float32" and not spec.makes_video:
                # SD's VAE overflows in float16; bfloat16 keeps the range. Wan's
                # decodes in float32, as its pipeline's examples do.
                dtype = torch.bfloat16
            cls: type[Any] = AutoencoderKLWan if spec.makes_video else AutoencoderKL
            if spec.family in QWEN_VAE_FAMILIES:
                cls = AutoencoderKLQwenImage
            loaded = loader.load(cls, spec, self.models_dir, self.device, dtype=dtype, subfolder="vae")
            vae = loaded.value.eval()
            log.info("loaded VAE of %s on %s (%d MiB, %.2fs)", name, self.device, loaded.bytes >> 20, loaded.seconds)
            options = self._options(name)
            if options.any:
                self._prepare(vae, spec, options)
            self._vaes[name] = vae
            return vae

    def decode_stream(self) -> torch.cuda.Stream | None:
        """A CUDA stream of the lowest priority, for decodes that share the GPU with a
        sampler's denoising (which runs on a stream of the highest); None elsewhere."""
        if self.device.type != "cuda":
            return None
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device, priority=0)
            return self._stream

    def _options(self, model: str) -> speed.SpeedOptions:
        """The model's speed options for its VAE (``speed.prepare_vae``): a 2D image
        VAE's only (a video VAE's decoder keeps a cache across chunks, and Qwen-Image's
        is one: its 3D convolutions have no channels-last layout)."""
        spec = self.registry.get(model)
        if spec.makes_video or spec.family == ModelFamily.SIM or spec.family in QWEN_VAE_FAMILIES:
            return speed.SpeedOptions()
        return replace(speed.SpeedOptions.of(spec, self.device), quantize="")

    def _prepare(self, vae: Any, spec: ModelSpec, options: speed.SpeedOptions) -> None:
        """Applies the speed options; a compiled decoder is run once per batch bucket
        at the model's default size as it loads, not on a job."""
        began = time.perf_counter()
        speed.prepare_vae(vae, options)
        if not options.compile:
            return
        scale = _pixels_per_latent(vae)
        channels = vae.config.latent_channels
        with torch.inference_mode():
            for rows in speed.buckets(self._max_rows(spec)):
                z = torch.zeros(rows, channels, spec.default_height // scale, spec.default_width // scale)
                self._decode_batch(vae, z.to(self.device, module_dtype(vae)), options, spec)
        took = time.perf_counter() - began
        log.info("%s's VAE compiled (%s) and warmed up in %.1fs", spec.name, options.describe(), took)

    def _max_rows(self, spec: ModelSpec) -> int:
        # On a CPU each image decodes alone (see decode_images).
        return spec.max_batch if self.device.type != "cpu" else 1

    def _decode_batch(self, vae: Any, z: torch.Tensor, options: speed.SpeedOptions, spec: ModelSpec) -> torch.Tensor:
        """One VAE call, padded to its bucket where the decoder is compiled."""
        rows = len(z)
        with speed.network_call(options):
            return speed.owned(vae.decode(speed.padded(z, self._max_rows(spec), options)).sample, options)[:rows]

    def check_model(self, model: str) -> None:
        if model not in self.registry:
            raise InvalidArgument([FieldViolation("model", f"unknown model {model!r}")])

    def decode_images(self, model: str, latents: torch.Tensor) -> list[DecodedImage]:
        """One image per latent (a video per video latent), each with its fault if it has one."""
        self.check_model(model)
        vae = self.load(model)
        if latents.dim() == 5:
            return self._decode_videos(model, vae, latents)
        spec = self.registry.get(model)
        z = latents.to(self.device, module_dtype(vae))
        if spec.family in QWEN_VAE_FAMILIES:
            z = image_vae.vae_input(vae, z)  # (N, C, 1, h, w)
        else:
            z = z / vae.config.scaling_factor
            if getattr(vae.config, "shift_factor", None):
                z = z + vae.config.shift_factor
        scale = _pixels_per_latent(vae)
        tiled = z.shape[-2] * z.shape[-1] * scale * scale > self.tile_above_pixels
        options = self._options(model)
        with torch.inference_mode():
            if tiled:
                # One image at a time, tile by tile: memory stays that of a tile,
                # whatever the image's size.
                decoded = torch.cat([vae.tiled_decode(z[i : i + 1]).sample for i in range(len(z))])
            elif self.device.type != "cpu":
                decoded = self._decode_batch(vae, z, options, spec)
            else:
                # On a CPU each image alone: kernels block a batch differently, and
                # only so is a batched job's image exactly the one it gets alone.
                decoded = torch.cat([self._decode_batch(vae, z[i : i + 1], options, spec) for i in range(len(z))])
            if decoded.dim() == 5:
                decoded = decoded[:, :, 0]  # Qwen-Image's frame of one
            unit = decoded.float() / 2 + 0.5
            all_finite = torch.isfinite(unit).flatten(1).all(dim=1)
            unit = unit.nan_to_num(0.0).clamp(0, 1)
            spread = unit.flatten(1).std(dim=1)
            checks = torch.stack([all_finite.to(spread.dtype), spread]).cpu().tolist()
            pixels = (unit * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            finite, stds = [bool(f) for f in checks[0]], checks[1]
        images = []
        for image, is_finite, std in zip(pixels, finite, stds, strict=True):
            fault = ""
            if not is_finite:
                fault = "decoded pixels contain NaN or infinity"
            elif std < self.min_pixel_std:
                fault = f"decoded pixels are degenerate: standard deviation {std:.2e} < {self.min_pixel_std:.0e}"
            images.append(DecodedImage(image, tiled, fault))
        return images

    def _decode_videos(self, model: str, vae: Any, latents: torch.Tensor) -> list[DecodedImage]:
        videos = []
        share = functools.partial(self.share_tiles, model) if self.share_tiles is not None else None
        with torch.inference_mode():
            for z in latents.to(self.device, module_dtype(vae)):
                frames, stats, tiled = decode_video(vae, z, self.tile_above_pixels, share)
                videos.append(DecodedImage(frames.numpy(), tiled, stats.fault(self.min_pixel_std)))
        return videos

    def encode_image(self, model: str, image: bytes, width: int, height: int) -> torch.Tensor:
        """An edit's input image (PNG, JPEG or WebP bytes), resized to ``width`` x
        ``height``, as the latents its model denoises: (1, C, height/8, width/8),
        float32 on the CPU. The distribution's mode, not a sample: the same input
        gives the same latents."""
        self.check_model(model)
        if self.registry.get(model).family == ModelFamily.SIM or self.registry.get(model).makes_video:
            raise InvalidArgument([FieldViolation("model", f"{model} takes no input image")])
        vae = self.load(model)
        pixels = pixels_of(image, width, height)
        with torch.inference_mode():
            x = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0).to(self.device, module_dtype(vae)) / 127.5 - 1.0
            if self.registry.get(model).family in QWEN_VAE_FAMILIES:
                encoded = vae.encode(x.unsqueeze(2)).latent_dist.mode()
                return image_vae.denoised_latents(vae, encoded).to("cpu", torch.float32)
            z = vae.encode(x).latent_dist.mode()
            config = vae.config
            if getattr(config, "shift_factor", None):
                z = z - config.shift_factor
            return (z * config.scaling_factor).to("cpu", torch.float32)

    def decode(self, model: str, latents: torch.Tensor) -> list[np.ndarray]:
        """One HxWx3 uint8 array per latent; DegenerateOutput if any image is unusable."""
        images = self.decode_images(model, latents)
        for i, image in enumerate(images):
            if image.fault:
                raise DegenerateOutput(f"image {i}: {image.fault}")
        return [image.pixels for image in images]


def _pixels_per_latent(vae: Any) -> int:
    """How many pixels a latent spans across: a 3D VAE says so itself."""
    return getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
