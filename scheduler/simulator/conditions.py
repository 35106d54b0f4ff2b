"""What happens to a simulated fleet and who sends its work, beside its models and
GPUs (``scenario``): GPUs running hot and failing, bursts of arrivals, the tenants
that send them, the LoRA adapters the jobs name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thermal:
    gpu: str
    start_s: float
    end_s: float
    temperature_c: float
    slowdown: float  # speed multiplier while hot


@dataclass(frozen=True)
class Failure:
    gpu: str
    at_s: float
    down_s: float


@dataclass(frozen=True)
class Bursts:
    every_s: float = 0.0
    length_s: float = 0.0
    factor: float = 1.0


@dataclass(frozen=True)
class Tenants:
    """Who sends the jobs (the fair-share scenario): with ``light`` tenants, the
    quiet arrivals are theirs, spread evenly, and the bursts' extra arrivals are
    one heavy tenant's. 0: every job is one tenant's."""

    light: int = 0

    def __post_init__(self) -> None:
        if self.light < 0:
            raise ValueError(f"tenants.light must be at least 0, not {self.light}")


HEAVY = "heavy"


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters the jobs name (the adapters scenario): with ``count`` of them, a
    ``share`` of the jobs names one, drawn by Zipf's law (the adapter of rank r
    weighs r^-zipf); each GPU keeps ``slots`` resident, the least recently used
    going first, and loads one in ``load_s``. 0: no job names an adapter."""

    count: int = 0
    zipf: float = 1.1
    share: float = 1.0
    slots: int = 16
    load_s: float = 0.5

    def __post_init__(self) -> None:
        if self.count < 0 or self.slots < 1 or self.load_s < 0 or not 0 <= self.share <= 1 or self.zipf < 0:
            raise ValueError("adapters: count >= 0, slots >= 1, load_s >= 0, share in 0..1, zipf >= 0")
