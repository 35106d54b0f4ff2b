"""What a sampler does with each dispatch it takes: keeps it from being redelivered
while its job waits or runs, then acks it once the job's outcome is durable, or naks
it for redelivery (at once when it was never started; later when its outcome could
not be stored), or terminates it when it cannot be read. A settlement NATS does not
take (the bus away) is left to JetStream: it redelivers after the ack wait, and the
redelivery finds the outcome stored, or runs the job again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from nats.aio.msg import Msg

from gpu_worker.jobs.outcomes import Outcome
from services.bus.connection import BUS_ERRORS
from services.telemetry import logs

log = logging.getLogger(__name__)

# A dispatch whose outcome could not be stored comes back after this long.
REDELIVER_AFTER_S = 2.0


class Acks:
    def __init__(self, ack_wait_s: float) -> None:
        self.ack_wait_s = ack_wait_s
        self._unsettled: dict[str, Msg] = {}  # every dispatch taken and not yet settled, by its ack subject

    def taken(self, msg: Msg) -> None:
        self._unsettled[msg.reply] = msg

    async def settled(self, msg: Msg, job_id: str, outcome: Outcome) -> None:
        """Its job came to ``outcome``: acked once durable, else redelivered later."""
        self._unsettled.pop(msg.reply, None)
        if outcome is Outcome.STORED:
            await self._settle(msg.ack(), f"ack {job_id}", job_id)
        else:
            await self._settle(msg.nak(delay=REDELIVER_AFTER_S), f"nak {job_id}", job_id)

    async def handed_back(self, msg: Msg, job_id: str) -> None:
        """Never started here: redelivered at once, to this worker's next run or another."""
        self._unsettled.pop(msg.reply, None)
        await self._settle(msg.nak(), f"nak {job_id}", job_id)

    async def terminated(self, msg: Msg) -> None:
        """It cannot be read: never redelivered."""
        await self._settle(msg.term(), "terminate")

    @staticmethod
    async def _settle(call: Awaitable[None], what: str, job_id: str = "") -> None:
        try:
            await call
        except BUS_ERRORS as exc:
            log.warning("cannot %s: %s", what, exc, extra=logs.job_fields(job_id) if job_id else None)

    async def keep_in_progress(self) -> None:
        """Keeps JetStream from redelivering the jobs this worker holds while they
        wait or run: all of them, every third of the ack wait. Runs until cancelled."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for msg in list(self._unsettled.values()):
                with contextlib.suppress(*BUS_ERRORS):
                    await msg.in_progress()
