"""The ideal row of the placement benchmark: the physical limit of a fleet for a
work-conserving policy.

``ideal_scenario`` keeps a scenario's GPUs, speeds, throttling, failures and
trace, and takes away what placement can only lose time to: every model is
warm on every GPU it fits (pinned there, so it is warm again after a failure)
and loading one costs nothing, nor does writing or reading a checkpoint.

``IdealPolicy`` runs it from one central queue and never leaves a GPU idle while
a job it fits waits: latency-bound jobs first (earliest deadline, arrival plus
target), then best-effort ones (highest priority, then oldest), each on the
fastest idle GPU that fits its model. A latency-bound job that finds no such GPU
suspends a running best-effort batch (free here) on a GPU that fits its model.

Jobs run one at a time: it forms no batches, so on a scenario whose models batch
it is the limit of one-at-a-time placement.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.simulator.fleet import SimFleet
from scheduler.simulator.scenario import Scenario
from scheduler.simulator.world import Gpu, Job

NAME = "ideal"


def ideal_scenario(sc: Scenario) -> Scenario:
    """``sc`` with every model warm on every GPU it fits and no load, checkpoint
    or resume cost; GPUs, speeds, thermal events, failures and the trace unchanged."""
    models = {name: replace(m, load_s=0.0) for name, m in sc.models.items()}
    gpus = tuple(
        replace(g, pinned=tuple(name for name in sorted(models) if models[name].vram_gb <= g.vram_gb)) for g in sc.gpus
    )
    return replace(sc, models=models, gpus=gpus, checkpoint_s=0.0, resume_s=0.0)


def _order(job: Job) -> tuple[int, float, float, int]:
    t = job.trace
    if t.target_s is not None:
        return (0, t.arrival_s + t.target_s, 0.0, t.id)
    return (1, -t.priority, t.arrival_s, t.id)


class IdealPolicy:
    """Work-conserving placement on the ideal scenario (see the module's text)."""

    name = NAME

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario

    def dispatch(self, sim: SimFleet, now: float) -> list[tuple[Job, str]]:
        live = sorted(sim.live(), key=lambda g: g.id)
        idle = [g for g in live if g.idle and not g.queue]
        # GPUs already asked to suspend free up for waiting latency-bound jobs:
        # each is claimed by one of them before another batch is suspended.
        stopping = [g for g in live if any(j.suspend_requested for j in g.batch)]
        placed: list[tuple[Job, str]] = []
        for job in sorted(sim.pending, key=_order):
            able = [g for g in idle if sim.fits(g, job.model)]
            if able:
                best = min(able, key=lambda g: (-sim.speed(g, now), g.id))
                idle.remove(best)
                placed.append((job, best.id))
                continue
            if job.trace.best_effort:
                continue
            claimed = next((g for g in stopping if sim.fits(g, job.model)), None)
            if claimed is not None:
                stopping.remove(claimed)
                continue
            victim = self._victim(sim, job, live, now)
            if victim is not None:
                sim.suspend(victim.id, now)
        return placed

    @staticmethod
    def _victim(sim: SimFleet, job: Job, live: list[Gpu], now: float) -> Gpu | None:
        """The GPU fitting ``job``'s model whose running batch is all best effort,
        not yet asked to suspend, with the most work left (ties: lowest id)."""
        candidates = [
            g
            for g in live
            if g.running is not None
            and not g.queue
            and sim.fits(g, job.model)
            and all(j.trace.best_effort and not j.suspend_requested for j in g.batch)
        ]
        return min(candidates, key=lambda g: (-(g.busy_until - now), g.id), default=None)

    def on_done(
        self, sim: SimFleet, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None
    ) -> None:
        pass

    def on_tick(self, sim: SimFleet, now: float) -> None:
        pass
