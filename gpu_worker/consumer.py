"""Consuming this worker's dispatches from its own JetStream subject, one at a time.

A message is acked only once the job's outcome is durable (or the job turned out
not to be this worker's); one whose outcome could not be stored is left for
redelivery; a malformed one is terminated. Lost connections to NATS are ridden
out: the loop waits and binds its consumer again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError

from gpu_worker.runner import JobRunner, Outcome
from services.backoff import Backoff
from services.bus import BUS_ERRORS, Bus, ConsumerSettings, Dispatch
from services.errors import BusError, MalformedDispatch

log = logging.getLogger("darkroom.gpu_worker.consumer")

FETCH_WAIT_S = 0.5
# A dispatch whose outcome could not be stored comes back after this long.
REDELIVER_AFTER_S = 2.0


class DispatchConsumer:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        runner: JobRunner,
        consumer: ConsumerSettings,
        *,
        on_idle: Callable[[], Awaitable[None]],
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.runner = runner
        self.consumer = consumer
        self.on_idle = on_idle

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set, or the runner finds this worker unfit; returns once
        the job in hand has an outcome."""
        sub = None
        backoff = Backoff()
        try:
            while not stop.is_set() and not self.runner.unfit:
                try:
                    if sub is None:
                        sub = await self.bus.dispatch_consumer(self.worker_id, self.consumer)
                    msgs = await sub.fetch(1, timeout=FETCH_WAIT_S)
                    backoff.reset()
                except (TimeoutError, NatsTimeoutError):
                    await self.on_idle()  # the moment to load or drop models
                    continue
                except (*BUS_ERRORS, BusError) as exc:
                    log.warning("cannot fetch dispatches, retrying in %.1fs: %s", backoff.next_s, exc)
                    # Bind afresh: the consumer may have been recreated meanwhile.
                    await self._unsubscribe(sub)
                    sub = None
                    await backoff.wait(stop)
                    continue
                for msg in msgs:
                    await self.handle(msg)
        finally:
            await self._unsubscribe(sub)

    @staticmethod
    async def _unsubscribe(sub) -> None:
        # A pull subscription left to drain waits on its expired fetches.
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def handle(self, msg: Msg) -> None:
        try:
            dispatch = Dispatch.decode(msg.data)
        except MalformedDispatch as exc:
            log.error("terminating a dispatch on %s: %s", msg.subject, exc)
            await self._settle(msg.term(), "terminate")
            return
        keepalive = asyncio.create_task(self._keep_in_progress(msg))
        try:
            outcome = await self.runner.run(dispatch)
        except Exception:
            # A defect, not the job's fault: the dispatch comes back, the worker goes on.
            log.exception("running %s failed unexpectedly; leaving it for redelivery", dispatch.job_id)
            outcome = Outcome.NOT_STORED
        finally:
            keepalive.cancel()
        if outcome is Outcome.STORED:
            await self._settle(msg.ack(), f"ack {dispatch.job_id}")
        else:
            await self._settle(msg.nak(delay=REDELIVER_AFTER_S), f"nak {dispatch.job_id}")

    @staticmethod
    async def _settle(call: Awaitable[None], what: str) -> None:
        # Not settled (NATS away): JetStream redelivers it after the ack wait, and
        # the redelivery finds the outcome stored, or runs the job again.
        try:
            await call
        except BUS_ERRORS as exc:
            log.warning("cannot %s: %s", what, exc)

    async def _keep_in_progress(self, msg: Msg) -> None:
        """Keeps JetStream from redelivering a job while it runs."""
        while True:
            await asyncio.sleep(self.consumer.ack_wait_s / 3)
            with contextlib.suppress(*BUS_ERRORS):
                await msg.in_progress()
