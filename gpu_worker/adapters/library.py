"""Where a sampler's adapters come from and how a model's network holds them: each
version's weights read once from its directory (the host cache's copy of the model
store's version) and kept in host memory, so that an adapter evicted from the device
reloads without reading its file again; and a loaded pipeline's ``AdapterSlots``."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpu_worker.adapters.slots import AdapterSlots
from services.generation import AdapterUse
from services.models.adapters.lora_files import LoraWeights, read_lora
from services.models.spec import ModelFamily, ModelSpec
from services.models.store.manifest import tenant_prefix, tenant_store_name

_SLOTS: weakref.WeakKeyDictionary[Any, AdapterSlots] = weakref.WeakKeyDictionary()


def store_directory(use: AdapterUse) -> Path:
    """An adapter version's directory in the host cache, fetched first if needed: a
    tenant's own from its tenant's part of the store."""
    from services.models.host_cache import loading  # the store's client is loaded only where used

    if use.owner:
        name, prefix = tenant_store_name(use.owner, use.name), tenant_prefix(use.owner)
        return loading.model_dir(f"adapter:{use.key}", name, use.version, prefix=prefix)
    return loading.model_dir(f"adapter:{use.key}", use.name, use.version)


class AdapterLibrary:
    def __init__(self, directory_of: Callable[[AdapterUse], Path] = store_directory, host_bytes: int = 2**30) -> None:
        self._directory_of = directory_of
        self._host_bytes = host_bytes
        self._read: OrderedDict[tuple[str, ModelFamily], LoraWeights] = OrderedDict()
        self._lock = threading.Lock()
        self.load_s: float | None = None  # a moving average of loading one onto the device

    def loaded(self, seconds: float) -> None:
        """An adapter took ``seconds`` from its files (or host memory) into a slot."""
        self.load_s = seconds if self.load_s is None else 0.8 * self.load_s + 0.2 * seconds

    def weights(self, use: AdapterUse, family: ModelFamily) -> LoraWeights:
        key = (use.key, family)
        with self._lock:
            found = self._read.get(key)
            if found is not None:
                self._read.move_to_end(key)
                return found
        weights = read_lora(self._directory_of(use), family)
        with self._lock:
            self._read[key] = weights
            while len(self._read) > 1 and sum(w.bytes for w in self._read.values()) > self._host_bytes:
                self._read.popitem(last=False)
        return weights


def attach_slots(pipe: Any, network: torch.nn.Module, spec: ModelSpec, rows: int, dtype: torch.dtype) -> AdapterSlots:
    """``network``'s adaptable layers wrapped, as ``spec`` sets its slots up, for calls
    of up to ``rows`` rows: before its speed options, so that a compiled network
    compiles them in."""
    slots = AdapterSlots(
        network,
        slots=spec.adapter_slots,
        rank=spec.adapter_rank,
        per_row=spec.adapters_per_job,
        rows=rows,
        dtype=dtype,
    )
    _SLOTS[pipe] = slots
    return slots


def slots_of(pipe: Any) -> AdapterSlots | None:
    """The pipeline's adapter slots; None for a model that takes no adapters."""
    return _SLOTS.get(pipe)
