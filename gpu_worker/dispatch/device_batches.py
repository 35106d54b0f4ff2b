"""Started jobs on their way from RUNNING to settled: the batch on the device, the next
one starting beside it (its attempts RUNNING, its inputs fetched, its prompts
encoded) so that the device never waits for the host, jobs joining the batch on the
device at its next step boundary, and the members out of it decoding and storing in
the background while it goes on. A dispatch is acked once its job's outcome is
durable, or left for redelivery when it could not be stored."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.msg import Msg

from gpu_worker.dispatch.acks import Acks
from gpu_worker.jobs.batch_sampling import SampledBatch
from gpu_worker.jobs.outcomes import Outcome, Started
from gpu_worker.jobs.runner import JobRunner
from services.bus.dispatch import Dispatch
from services.generation import BatchKey, JoinKey
from services.seats import OpenSeat
from services.telemetry import logs

log = logging.getLogger(__name__)

# Batches whose jobs may be decoding and storing while the next one samples.
MAX_FINISHING = 2


@dataclass
class InHand:
    """A fetched dispatch, not yet started."""

    msg: Msg
    dispatch: Dispatch
    key: BatchKey | None  # None: its job could not be read; it runs alone
    rows: int
    arrived: float

    @property
    def join_key(self) -> JoinKey | None:
        return self.key.join_key if self.key is not None else None


class DeviceBatches:
    def __init__(self, runner: JobRunner, acks: Acks, changed: asyncio.Event, on_work: Callable[[], None]) -> None:
        self.runner = runner
        self.acks = acks
        # Set whenever the device frees, a batch begins taking jobs in, or members leave it.
        self._changed = changed
        self._on_work = on_work  # ``starting`` changed
        self.starting = 0  # dispatches taken out of hand that are not out of their batch
        self._sampling: asyncio.Task[None] | None = None  # the batch on the device
        self._finishing: set[asyncio.Task[None]] = set()
        # The jobs of the batch on the device not out of it yet, by their Started's identity.
        self._in_batch: dict[int, tuple[InHand, Started]] = {}

    @property
    def device_busy(self) -> bool:
        return self._sampling is not None and not self._sampling.done()

    @property
    def idle(self) -> bool:
        """Nothing starting, on the device or finishing."""
        return not self.starting and not self._finishing

    def seats(self) -> OpenSeat | None:
        """The room of the batch on the device."""
        return self.runner.seats()

    async def drain(self) -> None:
        """Until every started job has its outcome."""
        if self._sampling is not None:
            await self._sampling
        if self._finishing:
            await asyncio.wait(self._finishing)

    async def run_batch(self, batch: list[InHand]) -> None:
        """Starts the batch while the previous one samples, then samples it as soon as
        the device is free."""
        started = await self._start(batch)
        if started:
            await self._on_device_next(started)

    async def join(self, batch: list[InHand]) -> None:
        """Starts jobs that join the batch on the device at its next step boundary;
        if it ended (or filled) meanwhile, they run as the next batch."""
        started = await self._start(batch, backpressure=False)
        if not started:
            return
        if self.runner.join([s for _, s in started]):
            # In the batch now: they come out of it (on this loop) no sooner than this returns.
            self._in_batch.update((id(job), (pending, job)) for pending, job in started)
            return
        await self._on_device_next(started)

    async def _on_device_next(self, started: list[tuple[InHand, Started]]) -> None:
        if self._sampling is not None:
            await self._sampling
        self._sampling = asyncio.create_task(self._sample(started))
        self._sampling.add_done_callback(lambda _: self._changed.set())

    async def _start(self, batch: list[InHand], *, backpressure: bool = True) -> list[tuple[InHand, Started]]:
        """Starts the dispatches' jobs (RUNNING, inputs made, prompts encoded): those
        that started, counted as starting until they are out of their batch; the rest
        settled."""
        self.starting += len(batch)
        self._on_work()
        try:
            started = await self._start_jobs(batch, backpressure)
        except BaseException:
            self.starting -= len(batch)
            self._on_work()
            raise
        self.starting -= len(batch) - len(started)
        self._on_work()
        return started

    async def _start_jobs(self, batch: list[InHand], backpressure: bool) -> list[tuple[InHand, Started]]:
        # Backpressure: decoding and storing may not fall further behind than this
        # (a joiner adds to a batch already bounded by its model's size).
        while backpressure and len(self._finishing) >= MAX_FINISHING:
            await asyncio.wait(self._finishing, return_when=asyncio.FIRST_COMPLETED)
        started: list[tuple[InHand, Started]] = []
        try:
            results: dict[str, Started | Outcome] = await self.runner.start([p.dispatch for p in batch])
        except Exception:
            log.exception(
                "starting %d jobs failed unexpectedly; leaving them for redelivery",
                len(batch),
                extra=logs.jobs_fields(p.dispatch.job_id for p in batch),
            )
            results = {}
        for pending in batch:
            result = results.get(pending.dispatch.job_id, Outcome.NOT_STORED)
            if isinstance(result, Outcome):
                await self._settled(pending, result)
            else:
                started.append((pending, result))
        if started:
            await self.runner.prepare([s for _, s in started])
        return started

    async def _sample(self, started: list[tuple[InHand, Started]]) -> None:
        for pair in started:
            self._in_batch[id(pair[1])] = pair
        try:
            await self.runner.sample([s for _, s in started], self._out_of_batch, self._changed.set)
        except Exception as exc:
            # A defect, not the jobs' own: each attempt still in the batch fails with
            # it (and, in a row, makes the worker unfit); the loop goes on.
            stranded = [job for _, job in self._in_batch.values()]
            extra = logs.jobs_fields(j.job.id for j in stranded)
            log.exception("sampling %d jobs failed unexpectedly", len(stranded), extra=extra)
            for job in stranded:
                job.result = exc
            if stranded:
                self._out_of_batch(stranded, SampledBatch(learnable=False))

    def _out_of_batch(self, jobs: list[Started], sampled: SampledBatch) -> None:
        """Jobs out of the batch on the device (its seats free for others): decoded
        and stored in the background."""
        pairs = [self._in_batch.pop(id(job)) for job in jobs if id(job) in self._in_batch]
        self.starting -= len(pairs)
        self._on_work()
        self._changed.set()
        if pairs:
            task = asyncio.create_task(self._finish(pairs, sampled))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def _finish(self, started: list[tuple[InHand, Started]], sampled: SampledBatch) -> None:
        try:
            outcomes = await self.runner.finish([job for _, job in started], sampled)
        except Exception:
            # A defect, not the jobs' fault: the dispatches come back, the worker goes on.
            log.exception(
                "finishing %d jobs failed unexpectedly; leaving them for redelivery",
                len(started),
                extra=logs.jobs_fields(job.job.id for _, job in started),
            )
            outcomes = [Outcome.NOT_STORED] * len(started)
        for (pending, _), outcome in zip(started, outcomes, strict=True):
            await self._settled(pending, outcome)

    async def _settled(self, pending: InHand, outcome: Outcome) -> None:
        await self.acks.settled(pending.msg, pending.dispatch.job_id, outcome)
