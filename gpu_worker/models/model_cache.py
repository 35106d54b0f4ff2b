"""The models a sampler holds in memory: loaded on demand, measured (bytes and load
seconds, for the scheduler's costs), and evicted by ``gpu_worker.models.residency``'s rule
when a new one needs the room, within a memory budget; pinned models go last.

Loads run in a worker thread, one at a time; ``footprints`` and ``warm_models`` are
read from the event loop and never wait for a load.

A model whose store version changed under it (removed, or pushed again with other
content) is marked stale: it counts as not loaded, and its next use drops it and
loads it afresh, between batches, never under a batch that runs it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_worker.metrics import MODEL_COMPILE_CACHE, MODEL_COMPILE_SECONDS, MODEL_LOAD_SECONDS
from gpu_worker.models.residency import DoesNotFit, Resident, victims
from services.errors import ModelError
from services.models.host_cache import loading as host_cache_loading
from services.models.loader import Loaded
from services.models.registry import ModelRegistry
from services.models.spec import ModelSpec

log = logging.getLogger(__name__)

# On a GPU, memory kept free beyond the models, for activations.
ACTIVATION_HEADROOM = 0.15


class ModelLoader(Protocol):
    """How one model family's models load (``gpu_worker.denoising.denoiser.Denoiser``)."""

    # False: its models have no weights, take no memory and are never evicted.
    loads_weights: bool

    def load(self, spec: ModelSpec) -> Loaded:
        """The model on the device, measured."""
        ...


@dataclass
class _Held:
    model: Any
    bytes: int
    load_s: float  # its compilation included: what a later load here costs
    last_used: float
    pinned: bool
    compile_s: float = 0.0  # of its load, compiling its networks


class ModelCache:
    def __init__(
        self,
        registry: ModelRegistry,
        loader_for: Callable[[ModelSpec], ModelLoader],
        device: torch.device,
        *,
        memory_budget_bytes: int = 0,
        pinned: Sequence[str] = (),
        on_drop: Callable[[str], None] = lambda name: None,
        evicts: bool = True,
    ) -> None:
        self.registry = registry
        self.loader_for = loader_for
        self.device = device
        # 0: the GPU's own memory (less headroom), unlimited on a CPU.
        self.memory_budget_bytes = memory_budget_bytes
        self.pinned = frozenset(pinned)
        self.on_drop = on_drop  # what else goes with a dropped model (its prompts' conditioning)
        # False: a group's follower, which drops what its leader drops and nothing else.
        self.evicts = evicts
        self._held: dict[str, _Held] = {}
        self._measured: dict[str, int] = {}  # bytes of each model loaded here, even if evicted since
        self._lock = threading.RLock()
        self._stale: set[str] = set()  # added to from the event loop, which never waits for ``_lock``

    def __contains__(self, name: str) -> bool:
        return name in self._held and name not in self._stale

    def warm_models(self) -> list[str]:
        return sorted(name for name in list(self._held) if name not in self._stale)

    def is_stale(self, name: str) -> bool:
        return name in self._stale

    def mark_stale(self, names: Collection[str]) -> None:
        """These loaded models are not what their source now holds: each is loaded
        afresh at its next use."""
        self._stale.update(name for name in names if name in self._held)

    def loaded(self) -> list[Any]:
        """The loaded models themselves (pipelines)."""
        return [h.model for h in list(self._held.values())]

    def footprints(self) -> dict[str, dict[str, float]]:
        """Measured bytes and load seconds of each loaded model, for the scheduler."""
        held = list(self._held.items())  # one step under the GIL, whatever a loading thread does
        return {
            name: {"bytes": h.bytes, "load_s": round(h.load_s, 3), "compile_s": round(h.compile_s, 3)}
            for name, h in held
        }

    def get(self, name: str) -> Any:
        """The model, loaded first if it is not held (evicting others to make room)."""
        with self._lock:
            if name in self._stale:
                log.info("%s changed in the model store; loading it afresh", name)
                self._drop(name)
            held = self._held.get(name)
            if held is not None:
                held.last_used = time.monotonic()
                return held.model
            spec = self.registry.get(name)
            loader = self.loader_for(spec)
            if not loader.loads_weights:
                loaded = loader.load(spec)
                self._held[name] = _Held(loaded.value, 0, 0.0, time.monotonic(), name in self.pinned)
                return loaded.value
            # Its measured size once it has been loaded here; the registry's before.
            self._make_room(name, self._measured.get(name, spec.vram_bytes))
            began = time.perf_counter()
            loaded = loader.load(spec)
            # The whole wait, a store download included: no job is charged it. (The
            # load alone, ``loaded.seconds``, is what a later load here costs.)
            MODEL_LOAD_SECONDS.labels(model=name).observe(time.perf_counter() - began)
            if loaded.compile_s:
                MODEL_COMPILE_SECONDS.labels(model=name).observe(loaded.compile_s)
            if loaded.compile_cache is not None:
                MODEL_COMPILE_CACHE.labels(model=name, result=loaded.compile_cache.value).inc()
            now = time.monotonic()
            self._held[name] = _Held(
                loaded.value, loaded.bytes, loaded.seconds, now, name in self.pinned, loaded.compile_s
            )
            self._measured[name] = loaded.bytes
            # Bigger than the registry said: others make room now, not at the next load.
            self._make_room(name, 0)
            log.info("loaded %s on %s in %.2fs (%.0f MiB)", name, self.device, loaded.seconds, loaded.bytes / 2**20)
            return loaded.value

    def unload(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def capacity_bytes(self) -> int | None:
        """What its models may take together, or None for no limit."""
        limits = [self.memory_budget_bytes] if self.memory_budget_bytes else []
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            limits.append(int(total * (1 - ACTIVATION_HEADROOM)))
        return min(limits) if limits else None

    def _free_bytes(self) -> int | None:
        """Bytes a new model may take now, or None for no limit."""
        used = sum(h.bytes for h in self._held.values())
        limits = []
        if self.memory_budget_bytes:
            limits.append(self.memory_budget_bytes - used)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            limits.append(free - int(total * ACTIVATION_HEADROOM))
        return min(limits) if limits else None

    def _make_room(self, name: str, need: int) -> None:
        """Evicts other models until ``need`` more bytes fit."""
        free = self._free_bytes() if self.evicts else None
        if free is None:
            return
        residents = [
            Resident(other, h.bytes, self.registry.get(other).eviction_priority, h.last_used, h.pinned)
            for other, h in self._held.items()
            if other != name
        ]
        try:
            chosen = victims(need, free, residents)
        except DoesNotFit as exc:
            raise ModelError(f"model {name!r} does not fit in this worker's memory: {exc}") from None
        for victim in chosen:
            log.info("evicting %s to make room for %s", victim, name)
            self._drop(victim)

    def _drop(self, name: str) -> None:
        self._stale.discard(name)
        held = self._held.pop(name, None)
        if held is None:
            return
        self.on_drop(name)
        del held
        host_cache_loading.release(name)  # a store: model's version may leave the host's disk now
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("dropped %s", name)
