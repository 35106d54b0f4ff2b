"""One batch on the device, as its runner sees it: its members, the jobs that join it
at a step boundary, and each member handed out as it leaves, with how long it ran
and beside how many images. A batch whose model's loop takes no joiners (the sim
family) hands all its members out together at its end.

Its clock starts, and its seats open, when denoising begins: the load of a cold
model before it (a store download may take minutes) is the operator's time, shown
in ``darkroom_model_load_seconds``, never charged to the jobs that waited for it.

If the batch fails as a whole (its model, the device), the members still in it run
again one by one, so that a job that broke it fails alone."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from gpu_worker.denoising.group_mesh import GroupBroken
from gpu_worker.denoising.members import BatchMember, MemberResult
from gpu_worker.denoising.running_batch import RunningBatch
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.outcomes import Started
from gpu_worker.jobs.progress import BatchProgress
from services.seats import OpenSeat
from services.telemetry import logs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledBatch:
    """Members of a batch that left it at one step boundary (or all of a batch that
    takes no joiners), their latents or what ended them on each (``Started``)."""

    learnable: bool  # their model was warm and they ran whole: their times say how long such runs take
    # Recording them DECODING, under way while they decode: their outcomes wait for it.
    recorded: asyncio.Future[None] | None = None


# Where the runner hands members out as they leave their batch, on the event loop.
OnSampled = Callable[[list[Started], SampledBatch], None]


class BatchRunner(Protocol):
    """What a batch asks of the runner that runs it (``runner.JobRunner``)."""

    @property
    def engine(self) -> SamplerEngine: ...

    @property
    def store(self) -> JobStore: ...

    @property
    def continuous_batching(self) -> bool: ...

    def is_warm(self, model: str) -> bool:
        """Whether ``model`` has run a job since it loaded."""
        ...

    def member(self, started: Started, loop: asyncio.AbstractEventLoop, batch: BatchProgress) -> BatchMember:
        """The job as a batch member: its steps reported, its periodic checkpoints stored."""
        ...

    def sampled(self, cohort: list[Started], *, model: str, was_warm: bool) -> SampledBatch:
        """Members that left their batch: observed, traced, and those with latents
        recorded DECODING (under way while they decode)."""
        ...


class BatchSampling:
    def __init__(
        self,
        runner: BatchRunner,
        model: str,
        loop: asyncio.AbstractEventLoop,
        on_sampled: OnSampled,
        on_seats: Callable[[], None],
    ) -> None:
        self.runner = runner
        self.engine = runner.engine
        self.model = model
        self.loop = loop
        self.on_sampled = on_sampled
        self.on_seats = on_seats
        self.was_warm = runner.is_warm(model)
        self.progress = BatchProgress(runner.store, runner.store.events, loop)
        self._members: dict[int, tuple[BatchMember, Started]] = {}  # by the member's identity: not out yet
        self._running: RunningBatch | None = None
        self._began: float | None = None  # when denoising began; None: not yet (its model loading)
        self._rows = 0
        self._count = 0  # members it ever had

    async def run(self, batch: Sequence[Started]) -> None:
        members = [self._add(s, self.runner.member(s, self.loop, self.progress)) for s in batch]
        self._rows = sum(m.params.num_images for m in members)
        if self.runner.continuous_batching and self.engine.takes_joiners(self.model):
            spec = self.engine.registry.get(self.model)
            key = members[0].params.join_key
            self._running = RunningBatch(key, spec.max_batch, members, self._left_from_thread)
        try:
            results = await asyncio.to_thread(self.engine.sample_batch, members, self._running, self._denoising)
        except Exception as exc:
            if self._running is not None:
                self._running.shut()
            await self._one_by_one(exc)
            return
        # With joiners, each went out as it left: those hand-offs were queued on the
        # loop before this thread's end was, so they have all run by now. The rest
        # (all, from a loop that takes no joiners) go out together.
        self._left([(m, r) for m, r in zip(members, results, strict=False) if id(m) in self._members])
        self._left([(m, RuntimeError("the batch ended without it")) for m, _ in list(self._members.values())])

    def join(self, batch: Sequence[Started]) -> bool:
        if self._running is None or not self._still_takes_joiners():
            return False
        members = [self.runner.member(s, self.loop, self.progress) for s in batch]
        before = self._running.offer(members)
        if before is None:
            return False
        for member, started in zip(members, batch, strict=True):
            self._add(started, member)
            started.joined_rows = before
        return True

    def seats(self) -> OpenSeat | None:
        return self._running.seats() if self._running is not None and self._still_takes_joiners() else None

    def _still_takes_joiners(self) -> bool:
        # Asked again at each offer: a model marked stale mid-batch takes no one more.
        return self.engine.takes_joiners(self.model)

    def _add(self, started: Started, member: BatchMember) -> BatchMember:
        self._members[id(member)] = (member, started)
        self._count += 1
        return member

    def _denoising(self) -> None:
        """In the sampling thread: the model is loaded and the first step begins."""
        self._began = time.perf_counter()
        if self._running is not None:
            self._running.begin()
            self.loop.call_soon_threadsafe(self.on_seats)

    def _left_from_thread(self, cohort: list[tuple[BatchMember, MemberResult]]) -> None:
        self.loop.call_soon_threadsafe(self._left, cohort)

    def _left(self, cohort: Sequence[tuple[BatchMember, MemberResult]]) -> None:
        """Members that left at one boundary: their results on them, and out."""
        now = time.perf_counter()
        wall = datetime.now(UTC)
        out: list[Started] = []
        for member, result in cohort:
            entry = self._members.pop(id(member), None)
            if entry is None:
                continue  # out already
            started = entry[1]
            if self._running is not None:
                began, rows = self._running.ran(member)
            else:
                # Not begun (its model did not load): it ran for no time.
                began, rows = (self._began if self._began is not None else now), self._rows
            started.result = result
            started.watch.sampled = True
            started.sampled_s = max(now - began, 0.0)
            started.batch_rows = max(rows, member.params.num_images)
            started.sampling_at = wall - timedelta(seconds=started.sampled_s)
            out.append(started)
        if out:
            self.on_sampled(out, self.runner.sampled(out, model=self.model, was_warm=self.was_warm))

    async def _one_by_one(self, exc: Exception) -> None:
        remaining = list(self._members.values())
        if self._count == 1 or isinstance(exc, GroupBroken):  # a broken group runs nothing more
            self._left([(m, exc) for m, _ in remaining])
            return
        extra = logs.jobs_fields(s.job.id for _, s in remaining)
        log.warning("a batch of %d failed (%s); running its jobs one by one", self._count, exc, extra=extra)
        self._running = None  # each runs alone: its own time and rows
        for member, _ in remaining:
            self._began, self._rows = None, member.params.num_images
            result: MemberResult
            try:
                [result] = await asyncio.to_thread(self.engine.sample_batch, [member], None, self._denoising)
            except Exception as alone:
                result = alone
            self._left([(member, result)])
