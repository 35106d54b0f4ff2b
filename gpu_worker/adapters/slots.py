"""A network's adapter slots: its adaptable layers wrapped once, as the model loads
(``AdaptedLayer``): those ``network_layers`` gives, the very list a push checks an
adapter against (a layer the network calls with other rows than its call's is
neither wrapped nor accepted), and the adapters resident in a fixed number of slots, the least
recently used one that no running member holds evicted for a newcomer. Loading or
evicting an adapter writes the layers' buffers in place: nothing is compiled again,
and the base weights are never touched."""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence

import torch

from gpu_worker.adapters.mixed_lora import AdaptedLayer, RowTable
from services.models.adapters.lora_files import AdapterError, LoraWeights
from services.models.adapters.network_layers import check_fits, network_layers

# What a member's rows carry: (adapter key, scale) pairs, its adapters in the order
# the job named them.
MemberAdapters = Sequence[tuple[str, float]]


class SlotsFull(AdapterError):
    """Every slot holds an adapter a running member uses: a newcomer waits."""


class AdapterSlots:
    def __init__(
        self, network: torch.nn.Module, *, slots: int, rank: int, per_row: int, rows: int, dtype: torch.dtype
    ) -> None:
        if slots < 1:
            raise ValueError("adapter slots must be at least 1")
        device = next(network.parameters()).device
        self.rank = rank
        self.slots = slots
        self.table = RowTable(rows, per_row, device, dtype)
        self.network_layers = network_layers(network)
        self.layers: dict[str, AdaptedLayer] = {}
        for name in self.network_layers.adapted:
            parent, _, child = name.rpartition(".")
            layer = AdaptedLayer(network.get_submodule(name), self.table, slots + 1, rank)  # slot 0: none
            setattr(network.get_submodule(parent) if parent else network, child, layer)
            self.layers[name] = layer
        self._resident: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self._held: Counter[str] = Counter()

    @property
    def bytes(self) -> int:
        """What every slot's projections, and the rows' table, take on the device."""
        table = self.table.slots.nbytes + self.table.scales.nbytes
        return table + sum(layer.down.nbytes + layer.up.nbytes for layer in self.layers.values())

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def holds(self, key: str) -> bool:
        return key in self._resident

    def load(self, key: str, weights: LoraWeights) -> int:
        """The slot of adapter ``key``, its weights written into one if it has none
        (evicting the least recently used adapter no member holds)."""
        slot = self._resident.get(key)
        if slot is not None:
            self._resident.move_to_end(key)
            return slot
        check_fits(weights, self.network_layers, max_rank=self.rank)
        slot = self._free_slot()
        for name, layer in self.layers.items():
            adapted = weights.layers.get(name)
            dtype = layer.down.dtype
            layer.load(
                slot,
                adapted.down.to(dtype) if adapted else None,
                adapted.up.to(dtype) if adapted else None,
            )
        self._resident[key] = slot
        return slot

    def evict(self, key: str) -> None:
        slot = self._resident.pop(key, None)
        if slot is None:
            return
        for layer in self.layers.values():
            layer.load(slot, None, None)

    def _free_slot(self) -> int:
        taken = set(self._resident.values())
        free = next((s for s in range(1, self.slots + 1) if s not in taken), None)
        if free is not None:
            return free
        victim = next((k for k in self._resident if not self._held[k]), None)
        if victim is None:
            raise SlotsFull(f"all {self.slots} adapter slots hold adapters that running jobs use")
        slot = self._resident[victim]
        self.evict(victim)
        return slot

    def hold(self, keys: Sequence[str]) -> None:
        """Keeps ``keys`` resident until ``release``: a running member uses them."""
        self._held.update(keys)

    def release(self, keys: Sequence[str]) -> None:
        self._held.subtract(keys)
        self._held += Counter()  # drops the zeros

    @contextlib.contextmanager
    def rows(self, rows: Sequence[MemberAdapters]) -> Iterator[None]:
        """Around one network call: each of its rows' adapters (resident), by key and scale."""
        self.table.set([[(self._resident[key], scale) for key, scale in row] for row in rows])
        yield
