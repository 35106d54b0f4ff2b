"""Adapted layers that apply each row's own adapters in one call, never merged into
the base weights: a layer's output is its base output plus, for each row, the sum
of its adapters' low-rank deltas, each by its scale (S-LoRA's and Punica's way for
language models, here for a denoising network).

Every adapter resident on the device has a slot (slot 0 is none: zeros), and each
adapted layer holds every slot's projections padded to one rank, so that a row's
delta is a gather and two batched products of fixed shape: a compiled network
serves any set of adapters, loaded or evicted, without compiling again. A call's
rows name their slots and scales in the ``RowTable`` every adapted layer shares.
Each row's delta is computed from that row alone (a batched product per row), the
same whatever the other rows of the call are."""

from __future__ import annotations

import torch

from services.models.adapters.lora_files import AdapterError


class RowTable(torch.nn.Module):
    """Each row of the current network call: its adapters' slots and scales (up to
    ``per_row``; unused ones slot 0, scale 0). Written in place before each call, so
    a compiled network reads it as it reads a buffer, never as a constant."""

    slots: torch.Tensor
    scales: torch.Tensor

    def __init__(self, capacity: int, per_row: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("slots", torch.zeros(capacity, per_row, dtype=torch.long, device=device))
        self.register_buffer("scales", torch.zeros(capacity, per_row, dtype=dtype, device=device))
        self.rows = 0  # of the current call
        self.used: frozenset[int] = frozenset()  # the slots the current call's rows use
        self._written: tuple[tuple[tuple[int, float], ...], ...] = ()  # what the device holds (): zeros

    def set(self, rows: list[list[tuple[int, float]]]) -> None:
        """The current call's rows, each its (slot, scale) pairs. Copied to the device
        only when they differ from what it holds: a batch without adapters copies
        nothing, call after call (the loop's steps copy nothing onto the device)."""
        capacity, per_row = self.slots.shape
        if len(rows) > capacity:
            raise AdapterError(f"a network call of {len(rows)} rows; adapters are set up for {capacity} at most")
        if any(len(row) > per_row for row in rows):
            raise AdapterError(f"a row with more than {per_row} adapters")
        self.rows = len(rows)
        self.used = frozenset(slot for row in rows for slot, scale in row if slot and scale)
        written = tuple(tuple(row) for row in rows) if self.used else ()
        if written == self._written:
            return
        slots = torch.zeros(capacity, per_row, dtype=torch.long)
        scales = torch.zeros(capacity, per_row, dtype=torch.float32)
        for i, row in enumerate(rows if self.used else []):
            for j, (slot, scale) in enumerate(row):
                slots[i, j], scales[i, j] = slot, scale
        # Host to device without a read back: the GPU never waits for the host here.
        self.slots.copy_(slots, non_blocking=True)
        self.scales.copy_(scales, non_blocking=True)
        self._written = written


class AdaptedLayer(torch.nn.Module):
    """A linear (or 1x1 convolution) layer and every slot's LoRA projections for it."""

    down: torch.Tensor  # (slots, rank, in features)
    up: torch.Tensor  # (slots, out features, rank)

    def __init__(self, base: torch.nn.Module, table: RowTable, slots: int, rank: int) -> None:
        super().__init__()
        self.base = base
        self.table = table
        weight = base.weight
        assert isinstance(weight, torch.Tensor)
        if isinstance(base, torch.nn.Linear):
            features = (base.in_features, base.out_features)
        elif isinstance(base, torch.nn.Conv2d):
            features = (base.in_channels, base.out_channels)
        else:
            raise TypeError(f"cannot adapt a {type(base).__name__}")
        self.features = features
        dtype = table.scales.dtype
        self.register_buffer("down", torch.zeros(slots, rank, features[0], dtype=dtype, device=weight.device))
        self.register_buffer("up", torch.zeros(slots, features[1], rank, dtype=dtype, device=weight.device))
        self.held: set[int] = set()  # slots with projections for this layer

    # What the network's own code reads of the layer it wrapped (Z-Image's timestep
    # embedder reads its first layer's weight for its dtype).
    @property
    def weight(self) -> torch.Tensor:
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.base.bias
        assert bias is None or isinstance(bias, torch.Tensor)
        return bias

    def load(self, slot: int, down: torch.Tensor | None, up: torch.Tensor | None) -> None:
        """Slot ``slot``'s projections for this layer (None: the adapter leaves it be)."""
        self.down[slot].zero_()
        self.up[slot].zero_()
        if down is None or up is None:
            self.held.discard(slot)
            return
        rank = down.shape[0]
        self.down[slot, :rank].copy_(down)
        self.up[slot, :, :rank].copy_(up)
        self.held.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not torch.compiler.is_compiling() and not (self.held & self.table.used):
            return y  # eager: no row of this call adapts this layer
        conv = x.dim() == 4 and isinstance(self.base, torch.nn.Conv2d)
        rows = x.shape[0]
        if not torch.compiler.is_compiling() and rows != self.table.rows:
            raise AdapterError(f"an adapted layer called with {rows} rows in a call of {self.table.rows}")
        h = x.flatten(2).transpose(1, 2) if conv else x.reshape(rows, -1, x.shape[-1])
        slots = self.table.slots[:rows]
        k, rank = slots.shape[1], self.down.shape[1]
        down = self.down[slots].reshape(rows, k * rank, -1)  # (rows, k·rank, in)
        up = self.up[slots].permute(0, 2, 1, 3).reshape(rows, -1, k * rank)  # (rows, out, k·rank)
        scales = self.table.scales[:rows].repeat_interleave(rank, dim=1).unsqueeze(1)
        delta = torch.bmm(torch.bmm(h.to(down.dtype), down.transpose(1, 2)) * scales, up.transpose(1, 2))
        if conv:
            return y + delta.transpose(1, 2).reshape(y.shape).to(y.dtype)
        return y + delta.reshape(y.shape).to(y.dtype)
