"""Consuming this worker's dispatches from its own JetStream subject, in batches.

Dispatches are fetched in a task of their own, so that they arrive while a batch
samples, and wait in hand; the oldest and the later ones of its batch key (model,
size, steps, guidance) up to the model's batch size run together, once the rest of
the jobs their scheduling pass sent here have arrived (they are published together)
and ``batch_wait_s`` has passed since the oldest arrived; 0, the default, waits for
the announced jobs only.

The device never waits for the host between batches: while one batch samples, the
next is started (its attempts RUNNING, its inputs fetched, its prompts encoded) as
soon as it is full, or, when it could still grow, the moment the device frees; its
sampling begins as the previous one's ends. Once a batch's latents are out, its
jobs are decoded and stored in the background. A message is acked only once its
job's outcome is durable (or the job turned out not to be this worker's); one whose
outcome could not be stored is left for redelivery; a malformed one is terminated.
Lost connections to NATS are ridden out: the fetcher waits and binds its consumer
again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from gpu_worker.acks import Acks
from gpu_worker.batch_choice import PassArrivals, joiners, next_batch
from gpu_worker.busy import BusyClock
from gpu_worker.outcomes import Outcome, Started
from gpu_worker.runner import JobRunner, SampledBatch
from services.backoff import Backoff
from services.bus.connection import BUS_ERRORS
from services.bus.dispatch import Bus, ConsumerSettings, Dispatch
from services.errors import BusError, MalformedDispatch
from services.generation import BatchKey, JoinKey
from services.models.registry import ModelRegistry
from services.telemetry import logs

log = logging.getLogger(__name__)

FETCH_WAIT_S = 0.5
# How long the jobs a scheduling pass sent here are waited for: they are published
# together, so the rest arrive within milliseconds or were lost.
SIBLING_PATIENCE_S = 0.05
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


class DispatchConsumer:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        runner: JobRunner,
        consumer: ConsumerSettings,
        *,
        registry: ModelRegistry,
        on_idle: Callable[[], Awaitable[None]],
        batch_wait_s: float = 0.0,
        max_in_hand: int = 16,
        busy: BusyClock | None = None,
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.runner = runner
        self.consumer = consumer
        self.registry = registry  # each model's batch size
        self.on_idle = on_idle
        self.batch_wait_s = batch_wait_s
        self.max_in_hand = max_in_hand
        self.busy = busy or BusyClock()
        self._in_hand: list[InHand] = []
        self._starting = 0  # dispatches taken out of hand whose batch has not finished sampling
        self._sampling: asyncio.Task[None] | None = None  # the batch on the device
        self._finishing: set[asyncio.Task[None]] = set()
        # The jobs of the batch on the device not out of it yet, by their Started's identity.
        self._in_batch: dict[int, tuple[InHand, Started]] = {}
        self._passes = PassArrivals()
        # Set whenever what a batch could be formed from changes: dispatches arrived,
        # the device freed, room in hand.
        self._changed = asyncio.Event()
        self.acks = Acks(consumer.ack_wait_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set, or the runner finds this worker unfit; returns once
        every started job has an outcome. Dispatches in hand but not started are
        left for redelivery (the worker hands their jobs back as it deregisters)."""
        keepalive = asyncio.create_task(self.acks.keep_in_progress())
        fetcher = asyncio.create_task(self._fetch(stop))
        stopping = asyncio.create_task(self._wake_on(stop))
        try:
            await self._form_batches(stop)
        finally:
            stopping.cancel()
            self._changed.set()
            # The fetcher ends by itself within a fetch's wait: cancelling it mid-pull
            # could lose what that pull brings, until JetStream redelivers it.
            sub = await fetcher
            if self._sampling is not None:
                await self._sampling
            if self._finishing:
                await asyncio.wait(self._finishing)
            keepalive.cancel()
            for pending in self._in_hand:
                await self.acks.handed_back(pending.msg, pending.dispatch.job_id)
            self._in_hand = []
            self._work_changed()
            await self._unsubscribe(sub)

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._changed.set()

    def _running(self, stop: asyncio.Event) -> bool:
        return not stop.is_set() and not self.runner.unfit

    async def _form_batches(self, stop: asyncio.Event) -> None:
        while self._running(stop):
            self._changed.clear()
            wait_s = FETCH_WAIT_S
            if self._in_hand:
                joining = self._joiners()
                if joining:
                    batch = [self._in_hand[i] for i in joining]
                    self._in_hand = [p for i, p in enumerate(self._in_hand) if i not in joining]
                    await self._join(batch)
                    continue
                chosen, full = next_batch(self._in_hand, self._max_rows)
                now = time.monotonic()
                wait_s = max(
                    self.batch_wait_s - (now - self._in_hand[0].arrived),
                    self._passes.wait_s(now, SIBLING_PATIENCE_S),
                )
                ready = full or wait_s <= 0 or len(self._in_hand) >= self.max_in_hand
                # While the device is busy a batch that could still grow waits for it.
                device_busy = self._sampling is not None and not self._sampling.done()
                if ready and (full or not device_busy):
                    batch = [self._in_hand[i] for i in chosen]
                    self._in_hand = [p for i, p in enumerate(self._in_hand) if i not in chosen]
                    await self._run_batch(batch)
                    continue
                if device_busy:
                    wait_s = FETCH_WAIT_S  # the device freeing says when
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(wait_s, 0.0))

    async def _fetch(self, stop: asyncio.Event) -> Any:
        """Keeps dispatches coming into hand until the loop ends; returns its subscription."""
        sub = None
        backoff = Backoff()
        while self._running(stop):
            room = self.max_in_hand - len(self._in_hand)
            if room <= 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), FETCH_WAIT_S)
                continue
            try:
                if sub is None:
                    sub = await self.bus.dispatch_consumer(self.worker_id, self.consumer)
                msgs = await sub.pull(room, FETCH_WAIT_S)
                backoff.reset()
            except (*BUS_ERRORS, BusError) as exc:
                log.warning("cannot fetch dispatches, retrying in %.1fs: %s", backoff.next_s, exc)
                # Bind afresh: the consumer may have been recreated meanwhile.
                await self._unsubscribe(sub)
                sub = None
                await backoff.wait(stop)
                continue
            if not msgs:
                if not self._in_hand and not self._starting and not self._finishing:
                    await self.on_idle()  # the moment to load or drop models
                continue
            await self._take(msgs)
            self._changed.set()
        return sub

    def _max_rows(self, key: Hashable) -> int:
        assert isinstance(key, BatchKey)
        spec = self.registry.models.get(key.model)
        return spec.max_batch if spec is not None else 1

    @staticmethod
    async def _unsubscribe(sub) -> None:
        # A pull subscription left to drain waits on its expired fetches.
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _take(self, msgs: list[Msg]) -> None:
        """Puts fetched dispatches in hand, each with its job's batch key (a dispatch
        that does not say its job's shape runs alone)."""
        now = time.monotonic()
        for msg in msgs:
            try:
                dispatch = Dispatch.decode(msg.data)
            except MalformedDispatch as exc:
                log.error("terminating a dispatch on %s: %s", msg.subject, exc)
                await self.acks.terminated(msg)
                continue
            self._passes.arrived(dispatch.pass_id, dispatch.pass_jobs, now)
            shape = dispatch.shape
            key = shape.key if shape else None
            self.acks.taken(msg)
            self._in_hand.append(InHand(msg, dispatch, key, shape.num_images if shape else 1, now))
        self._work_changed()

    def _work_changed(self) -> None:
        self.busy.work(bool(self._in_hand) or self._starting > 0)

    def _joiners(self) -> list[int]:
        """Indexes in hand of the jobs that join the batch on the device now."""
        seats = self.runner.seats()
        if seats is None:
            return []
        return joiners(self._in_hand, seats.key, seats.free_rows)

    async def _run_batch(self, batch: list[InHand]) -> None:
        """Starts the batch while the previous one samples, then samples it as soon as
        the device is free."""
        started = await self._start(batch)
        if started:
            await self._on_device_next(started)

    async def _join(self, batch: list[InHand]) -> None:
        """Starts jobs that join the batch on the device at its next step boundary;
        if it ended (or filled) meanwhile, they run as the next batch."""
        started = await self._start(batch, backpressure=False)
        if not started:
            return
        for pair in started:
            self._in_batch[id(pair[1])] = pair
        if self.runner.join([s for _, s in started]):
            return
        for _, job in started:
            del self._in_batch[id(job)]
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
        self._starting += len(batch)
        self._work_changed()
        try:
            started = await self._start_jobs(batch, backpressure)
        except BaseException:
            self._starting -= len(batch)
            self._work_changed()
            raise
        self._starting -= len(batch) - len(started)
        self._work_changed()
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
        self._starting -= len(pairs)
        self._work_changed()
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
