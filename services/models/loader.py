"""Loading model components with ``from_pretrained``, the same way in every service:
the registry entry names the source and the weight variant, loading errors become
``ModelError``, and what is loaded is measured (bytes, seconds)."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.errors import ModelError
from services.models.compile_cache import CacheResult
from services.models.device import DTYPES
from services.models.sources import resolve_source
from services.models.spec import ModelSpec

# One load at a time in a process. ``from_pretrained`` builds modules under a
# meta-device mode, and torch's mode stack is process-wide, not per thread: two
# loads in two threads (a sampler's engine and its local decoder, two decoders'
# engines) can exit each other's mode and leave every later tensor on "meta".
_LOADING = threading.Lock()


@dataclass(frozen=True)
class Loaded:
    value: Any
    bytes: int  # parameters and buffers of every torch module in it
    seconds: float  # the whole load, its compilation included
    compile_s: float = 0.0  # of which compiling (and warming up) its networks
    # Whether its compilation came from the fleet's compile cache (None: not asked).
    compile_cache: CacheResult | None = None


def compute_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The registry's dtype on a GPU; float32 on a CPU, where half precision is slow or missing."""
    return DTYPES[spec.dtype] if device.type == "cuda" else torch.float32


def module_bytes(obj: Any) -> int:
    """Bytes of parameters and buffers of a module, or of every module of a pipeline."""
    modules = [obj] if isinstance(obj, torch.nn.Module) else list(getattr(obj, "components", {}).values())
    total = 0
    for module in modules:
        if isinstance(module, torch.nn.Module):
            tensors = list(module.parameters()) + list(module.buffers())
            # A sharded parameter (a DTensor) counts its own shard: what is on this device.
            local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
            total += sum(t.numel() * t.element_size() for t in local)
    return total


def load(
    cls: Any,
    spec: ModelSpec,
    models_dir: Path,
    device: torch.device,
    *,
    dtype: torch.dtype,
    host_parts: Collection[str] = (),
    **kwargs: Any,
) -> Loaded:
    """``cls.from_pretrained`` for ``spec``, moved to ``device`` but for a pipeline's
    ``host_parts``, which stay in host memory; its bytes are those on ``device``."""
    # Building a builtin model (on first use) constructs modules too; fetching a
    # store model is a download, which other loads of the process need not wait for.
    source, source_kwargs = resolve_source(spec, models_dir, building=_LOADING)
    if spec.variant:
        source_kwargs["variant"] = spec.variant
    with _LOADING:
        started = time.perf_counter()
        try:
            value = cls.from_pretrained(source, torch_dtype=dtype, **source_kwargs, **kwargs)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load {spec.name!r} from {source}: {exc}") from exc
    if not host_parts:
        value = value.to(device)
        on_device = module_bytes(value)
    else:
        moved = {name: part for name, part in value.components.items() if name not in host_parts}
        for part in moved.values():
            if isinstance(part, torch.nn.Module):
                part.to(device)
        on_device = sum(module_bytes(part) for part in moved.values() if isinstance(part, torch.nn.Module))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Loaded(value, on_device, time.perf_counter() - started)
