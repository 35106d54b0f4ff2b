"""The sampler: diffusers text encoder + UNet + noise scheduler, run step by step.

Runs in a worker thread (never on the event loop). Progress is reported and
a stop checked between denoising steps, through ``callback_on_step_end``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.errors import JobInterrupted, ModelError
from services.models.device import DTYPES
from services.models.registry import ModelRegistry, ModelSpec, resolve_source

log = logging.getLogger("darkroom.sampler")


@dataclass(frozen=True)
class SampleRequest:
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int


class SamplerEngine:
    def __init__(self, registry: ModelRegistry, models_dir: Path, device: torch.device) -> None:
        self.registry = registry
        self.models_dir = models_dir
        self.device = device
        self._pipes: dict[str, Any] = {}
        self._lock = threading.Lock()

    def dtype_for(self, spec: ModelSpec) -> torch.dtype:
        return DTYPES[spec.dtype] if self.device.type == "cuda" else torch.float32

    def warm_models(self) -> list[str]:
        return sorted(self._pipes)

    def load(self, name: str) -> Any:
        with self._lock:
            if name in self._pipes:
                return self._pipes[name]
            from diffusers import DiffusionPipeline

            spec = self.registry.get(name)
            source, kwargs = resolve_source(spec, self.models_dir)
            # The VAE lives in its own service; the sampler never loads it.
            kwargs["vae"] = None
            if spec.family in ("sd15", "tiny"):
                kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
            started = time.perf_counter()
            try:
                pipe = DiffusionPipeline.from_pretrained(source, torch_dtype=self.dtype_for(spec), **kwargs)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load model {name!r} from {source}: {exc}") from exc
            pipe = pipe.to(self.device)
            pipe.set_progress_bar_config(disable=True)
            self._pipes[name] = pipe
            log.info("loaded %s from %s on %s in %.2fs", name, source, self.device, time.perf_counter() - started)
            return pipe

    def unload(self, name: str) -> None:
        with self._lock:
            pipe = self._pipes.pop(name, None)
        if pipe is None:
            return
        del pipe
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("dropped %s", name)

    def sample(
        self, req: SampleRequest, on_step: Callable[[int, int], None], stopping: threading.Event
    ) -> torch.Tensor:
        """Runs the denoising loop and returns the latents, (num_images, C, H/8, W/8).
        Raises JobInterrupted at the first step boundary after ``stopping`` is set."""
        if stopping.is_set():
            raise JobInterrupted(req.model)
        pipe = self.load(req.model)
        generators = [
            torch.Generator(device=self.device).manual_seed((req.seed + i) % 2**63) for i in range(req.num_images)
        ]

        def step_end(_pipe: Any, step: int, _timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            on_step(step + 1, req.steps)
            if stopping.is_set():
                raise JobInterrupted(req.model)
            return tensors

        with torch.inference_mode():
            out = pipe(
                prompt=req.prompt,
                negative_prompt=req.negative_prompt or None,
                width=req.width,
                height=req.height,
                num_inference_steps=req.steps,
                guidance_scale=req.guidance_scale,
                num_images_per_prompt=req.num_images,
                generator=generators,
                output_type="latent",
                callback_on_step_end=step_end,
            )
        return out.images
