"""A fleet and a workload, read from TOML, and the trace of jobs it generates.

See ``default_scenario.toml`` beside this file for every key, with comments. An
operator describes their own GPUs and models there and runs
``python bench/placement.py --scenario FILE``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from scheduler.estimates import REFERENCE_PIXELS
from scheduler.policy import ModelCost
from scheduler.simulator import curve
from scheduler.simulator.conditions import Adapters, Bursts, Failure, Tenants, Thermal
from services.config.fields import SettingsError, naming_tables
from services.config.placement import PlacementSettings, PreemptionSettings, check_names

DEFAULT_SCENARIO = Path(__file__).with_name("default_scenario.toml")
GIB = 1024**3


class ScenarioError(SettingsError):
    """The scenario file is missing something or names something unknown (its
    ``[darkroom]`` settings raise SettingsError, as the environment's do)."""


@dataclass(frozen=True)
class SimModel:
    name: str
    capability: str
    step_s_512: float  # the true time of one 512x512 step at speed 1.0
    load_s: float
    vram_gb: float
    eviction_priority: int = 0
    # What the registry claims before anything is learned, as a multiple of the truth.
    estimate_factor: float = 1.0
    # Images a GPU may run as one batch (jobs of one type), and the batch-efficiency
    # curve: the time of a batch of k images as a multiple of one image's, for
    # k = 1, 2, ...; past its end it goes on with its last slope. Empty: linear
    # (batching gains nothing).
    max_batch: int = 1
    batch_efficiency: tuple[float, ...] = ()
    # Or the curve as measured (instead of batch_efficiency): images per second at
    # some batch sizes, from 1 up; the factors are interpolated between (``curve``).
    curve_images: tuple[int, ...] = ()
    curve_images_per_s: tuple[float, ...] = ()
    # A parallel model (docs/parallel.md): the GPUs one replica spans on a group of
    # that size, and how much faster the group runs it than one of its GPUs (the
    # truth; placement starts from its own guess, then learns it). A single GPU runs
    # it unsplit, at its own speed.
    parallel_size: int = 1
    group_speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.curve_images or self.curve_images_per_s:
            if self.batch_efficiency:
                raise ValueError("give batch_efficiency or curve_images and curve_images_per_s, not both")
            curve.check_curve(self.curve_images, self.curve_images_per_s)

    def batch_factor(self, images: int) -> float:
        if self.curve_images:
            return curve.batch_factor(self.curve_images, self.curve_images_per_s, images)
        factors = self.batch_efficiency
        if not factors:
            return float(images)
        if images <= len(factors):
            return factors[images - 1]
        slope = factors[-1] - factors[-2] if len(factors) > 1 else factors[-1]
        return factors[-1] + slope * (images - len(factors))

    def cost(self) -> ModelCost:
        return ModelCost(
            capability=self.capability,
            step_s_512=self.step_s_512 * self.estimate_factor,
            load_s=self.load_s,
            vram_bytes=int(self.vram_gb * GIB),
            eviction_priority=self.eviction_priority,
            max_batch=self.max_batch,
            parallel_size=self.parallel_size,
        )


@dataclass(frozen=True)
class SimGpu:
    id: str
    speed: float
    vram_gb: float
    pinned: tuple[str, ...] = ()  # loaded at boot (and what seed 000 pins)
    capabilities: tuple[str, ...] = ()  # seed 000's capability tags: models it may take
    # The kinds of work its sampler is let serve, as DARKROOM_CAPABILITIES says; empty: all.
    serves: tuple[str, ...] = ()
    # A group of this many GPUs, each of ``speed`` and ``vram_gb``, serving as one
    # worker: it spans the models of its size (``SimModel.group_speedup``) and runs
    # the rest on its leader alone.
    gpus: int = 1


@dataclass(frozen=True)
class JobType:
    name: str
    model: str
    width: int
    height: int
    steps: int
    batch: int = 1
    lane: str = ""  # every job of the type in this lane; empty: paid by ``paid_share``, else free


@dataclass(frozen=True)
class Phase:
    start_s: float
    weights: dict[str, float]  # job type -> relative share of jobs


@dataclass(frozen=True)
class SeedSettings:
    concurrency: int = 1  # seed 000: jobs a worker takes at once
    busy_video_workers: int = 3  # seed 000: video fan-out while jobs queue
    max_queue_depth: int = 2  # seed 001: a warm GPU takes more only below this


@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    seed: int
    noise_sigma: float
    idle_temperature_c: float
    paid_share: float
    plan_interval_s: float
    demand_window_s: float
    scheduler_batch: int
    p99_limit_s: float
    loads: tuple[float, ...]
    scan: tuple[float, ...]
    models: dict[str, SimModel]
    gpus: tuple[SimGpu, ...]
    job_types: dict[str, JobType]
    phases: tuple[Phase, ...]
    bursts: Bursts
    thermal: tuple[Thermal, ...]
    failures: tuple[Failure, ...]
    darkroom: PlacementSettings
    seeds: SeedSettings = field(default_factory=SeedSettings)
    # Darkroom's preemption (a scenario file's table over the production defaults),
    # and what a suspension costs a GPU: writing the checkpoint, and reading it back.
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    checkpoint_s: float = 0.05
    resume_s: float = 0.5
    tenants: Tenants = field(default_factory=Tenants)
    adapters: Adapters = field(default_factory=Adapters)

    def work_s(self, jt: JobType) -> float:
        """True seconds of a job of this type on a speed-1.0 GPU."""
        m = self.models[jt.model]
        return m.step_s_512 * jt.steps * (jt.width * jt.height / REFERENCE_PIXELS) * jt.batch

    def phase_work_s(self, phase: Phase) -> float:
        """Mean work per job in a phase."""
        weight_sum = sum(phase.weights.values())
        return sum(w * self.work_s(self.job_types[t]) for t, w in phase.weights.items()) / weight_sum

    def phase_capacity(self, phase: Phase) -> float:
        """Jobs per second with every model warm where needed: the sum of GPU speeds
        (a group's, each of its GPUs) over the mean work per job."""
        return sum(g.speed * g.gpus for g in self.gpus) / self.phase_work_s(phase)

    def capacity_jobs_per_s(self) -> float:
        """The capacity averaged over the trace's phases, by their length."""
        total = 0.0
        for i, phase in enumerate(self.phases):
            end = self.phases[i + 1].start_s if i + 1 < len(self.phases) else self.duration_s
            total += self.phase_capacity(phase) * (end - phase.start_s)
        return total / self.duration_s

    def temperature(self, gpu: str, now: float) -> tuple[float, float]:
        """(temperature, speed multiplier) of a GPU at a time."""
        for t in self.thermal:
            if t.gpu == gpu and t.start_s <= now < t.end_s:
                return t.temperature_c, t.slowdown
        return self.idle_temperature_c, 1.0


def _build(cls: Any, where: str, table: dict[str, Any], **extra: Any) -> Any:
    known = {f.name for f in fields(cls)} - set(extra)
    unknown = set(table) - known
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        return cls(**extra, **{k: tuple(v) if isinstance(v, list) else v for k, v in table.items()})
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from exc


def _fleet(
    data: dict[str, Any], path: Path
) -> tuple[dict[str, SimModel], tuple[SimGpu, ...], dict[str, JobType], tuple[Phase, ...]]:
    """The models, GPUs, job types and phases, each naming only what exists."""
    models = {n: _build(SimModel, f"models.{n}", t, name=n) for n, t in data.get("models", {}).items()}
    gpus = tuple(_build(SimGpu, f"gpus[{i}]", t) for i, t in enumerate(data.get("gpus", [])))
    job_types = {n: _build(JobType, f"jobs.{n}", t, name=n) for n, t in data.get("jobs", {}).items()}
    phases = tuple(
        Phase(float(p["start_s"]), {k: float(v) for k, v in p["weights"].items()}) for p in data.get("phases", [])
    )
    for jt in job_types.values():
        if jt.model not in models:
            raise ScenarioError(f"jobs.{jt.name}: unknown model {jt.model!r}")
    for phase in phases:
        for t in phase.weights:
            if t not in job_types:
                raise ScenarioError(f"phase at {phase.start_s}s: unknown job type {t!r}")
    kinds = {m.capability for m in models.values()}
    for g in gpus:
        for m in (*g.pinned, *g.capabilities):
            if m not in models:
                raise ScenarioError(f"gpu {g.id}: unknown model {m!r}")
        for kind in g.serves:
            if kind not in kinds:
                raise ScenarioError(f"gpu {g.id}: serves {kind!r}, which no model has ({', '.join(sorted(kinds))})")
    if not gpus or not phases or phases[0].start_s != 0:
        raise ScenarioError(f"{path}: needs [[gpus]] and [[phases]], the first starting at 0")
    return models, gpus, job_types, phases


def load(path: str | Path | None = None) -> Scenario:
    path = Path(path) if path else DEFAULT_SCENARIO
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc}") from exc
    sim = data.get("simulation", {})
    models, gpus, job_types, phases = _fleet(data, path)
    dr = data.get("darkroom", {})
    darkroom = PlacementSettings.from_table({k: v for k, v in dr.items() if k != "preemption"}, "darkroom")
    preemption = PreemptionSettings.from_table(dr.get("preemption", {}), "darkroom.preemption")
    with naming_tables({PlacementSettings: "darkroom", PreemptionSettings: "darkroom.preemption"}):
        check_names(darkroom, preemption, {m.capability for m in models.values()})
    lane_names = [lane.name for lane in darkroom.lanes]
    for jt in job_types.values():
        if jt.lane and jt.lane not in lane_names:
            raise ScenarioError(f"jobs.{jt.name}: unknown lane {jt.lane!r}")
    return Scenario(
        name=str(sim.get("name", path.stem)),
        duration_s=float(sim.get("duration_s", 3600)),
        seed=int(sim.get("seed", 1)),
        noise_sigma=float(sim.get("noise_sigma", 0.1)),
        idle_temperature_c=float(sim.get("idle_temperature_c", 65)),
        paid_share=float(sim.get("paid_share", 0.0)),
        plan_interval_s=float(sim.get("plan_interval_s", 30)),
        demand_window_s=float(sim.get("demand_window_s", 180)),
        scheduler_batch=int(sim.get("scheduler_batch", 32)),
        p99_limit_s=float(sim.get("p99_limit_s", 30)),
        loads=tuple(float(x) for x in sim.get("loads", (0.5, 0.7, 0.85, 0.95))),
        scan=tuple(float(x) for x in sim.get("scan", ())),
        models=models,
        gpus=gpus,
        job_types=job_types,
        phases=phases,
        bursts=_build(Bursts, "bursts", data.get("bursts", {})),
        tenants=_build(Tenants, "tenants", data.get("tenants", {})),
        adapters=_build(Adapters, "adapters", data.get("adapters", {})),
        thermal=tuple(_build(Thermal, f"thermal[{i}]", t) for i, t in enumerate(data.get("thermal", []))),
        failures=tuple(_build(Failure, f"failures[{i}]", t) for i, t in enumerate(data.get("failures", []))),
        darkroom=darkroom,
        seeds=_build(SeedSettings, "seeds", data.get("seeds", {})),
        preemption=preemption,
        checkpoint_s=float(sim.get("checkpoint_s", Scenario.checkpoint_s)),
        resume_s=float(sim.get("resume_s", Scenario.resume_s)),
    )
