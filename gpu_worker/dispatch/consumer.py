"""Consuming this worker's dispatches from its own JetStream subject, in batches.

Dispatches are fetched in a task of their own, so that they arrive while a batch
samples, and wait in hand. A job of the running batch's model and size (whatever its
steps, guidance and seed) joins it at its next step boundary while it has room, from
the oldest in hand: one of another shape stops that, so a batch that keeps taking
jobs in never starves older work (continuous batching). Otherwise the oldest and the
later ones of its batch key (model, size, steps, guidance) up to the model's batch
size start together, once the rest of the jobs their scheduling pass sent here have
arrived (they are published together) and ``batch_wait_s`` has passed since the
oldest arrived; 0, the default, waits for the announced jobs only.

Started jobs go through ``DeviceBatches``: while one batch samples, the next is
started as soon as it is full, or, when it could still grow, the moment the device
frees. A message is acked only once its job's outcome is durable (or the job turned
out not to be this worker's); one whose outcome could not be stored is left for
redelivery; a malformed one is terminated. Lost connections to NATS are ridden out:
the fetcher waits and binds its consumer again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from nats.aio.msg import Msg

from gpu_worker.busy import BusyClock
from gpu_worker.dispatch.acks import Acks
from gpu_worker.dispatch.batch_choice import PassArrivals, joiners, next_batch
from gpu_worker.dispatch.device_batches import DeviceBatches, InHand
from gpu_worker.jobs.runner import JobRunner
from services.backoff import Backoff
from services.bus.connection import BUS_ERRORS
from services.bus.dispatch import Bus, ConsumerSettings, Dispatch
from services.errors import BusError, MalformedDispatch
from services.generation import BatchKey
from services.models.registry import ModelRegistry

log = logging.getLogger(__name__)

FETCH_WAIT_S = 0.5
# How long the jobs a scheduling pass sent here are waited for: they are published
# together, so the rest arrive within milliseconds or were lost.
SIBLING_PATIENCE_S = 0.05


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
        self._passes = PassArrivals()
        # Set whenever what a batch could be formed from changes: dispatches arrived,
        # the device freed, room in hand.
        self._changed = asyncio.Event()
        self.acks = Acks(consumer.ack_wait_s)
        self.batches = DeviceBatches(runner, self.acks, self._changed, self._work_changed)

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
            await self.batches.drain()
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
                    await self.batches.join(batch)
                    continue
                chosen, full = next_batch(self._in_hand, self._max_rows)
                now = time.monotonic()
                wait_s = max(
                    self.batch_wait_s - (now - self._in_hand[0].arrived),
                    self._passes.wait_s(now, SIBLING_PATIENCE_S),
                )
                ready = full or wait_s <= 0 or len(self._in_hand) >= self.max_in_hand
                # While the device is busy a batch that could still grow waits for it.
                device_busy = self.batches.device_busy
                if ready and (full or not device_busy):
                    batch = [self._in_hand[i] for i in chosen]
                    self._in_hand = [p for i, p in enumerate(self._in_hand) if i not in chosen]
                    await self.batches.run_batch(batch)
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
                if not self._in_hand and self.batches.idle:
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
        self.busy.work(bool(self._in_hand) or self.batches.starting > 0)

    def _joiners(self) -> list[int]:
        """Indexes in hand of the jobs that join the batch on the device now."""
        seats = self.batches.seats()
        if seats is None:
            return []
        return joiners(self._in_hand, seats.key, seats.free_rows)
