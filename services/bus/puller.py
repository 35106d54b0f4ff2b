"""Pulling one worker's dispatches from its durable consumer, as they come."""

from __future__ import annotations

import json
import time

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import Header

from services.bus.connection import BUS_ERRORS
from services.errors import BusError

# How long JetStream may take to answer a pull request that does not wait.
PULL_ANSWER_S = 5.0
_IDLE_HEARTBEAT = "100"


class DispatchPuller:
    """Pulls a worker's dispatches from its consumer as they come. A request asks for
    up to n messages with ``no_wait``: JetStream sends what it holds and says "no
    more", so a batch is never held back waiting to fill. Only when it holds nothing
    does a request linger, for one message, which it returns the moment it comes.
    (A plain pull of n that lingers is answered when n have come or it expires: a
    lone dispatch would wait out the expiry.) Each request has its own reply subject,
    so a late answer to an earlier one is recognised; a message from one is kept."""

    def __init__(self, nc: nats.NATS, api_subject: str, inbox: str, sub: Subscription) -> None:
        self.nc = nc
        self.api_subject = api_subject
        self.inbox = inbox
        self.sub = sub
        self._requests = 0

    @classmethod
    async def bind(cls, nc: nats.NATS, stream: str, consumer: str) -> DispatchPuller:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(f"{inbox}.*")
        return cls(nc, f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}", inbox, sub)

    async def _request(self, body: dict[str, object]) -> str:
        self._requests += 1
        reply = f"{self.inbox}.{self._requests}"
        await self.nc.publish(self.api_subject, json.dumps(body).encode(), reply=reply)
        return reply

    async def pull(self, n: int, wait_s: float) -> list[Msg]:
        """Up to ``n`` messages: those the consumer holds now, or, when it holds none,
        the first to come within ``wait_s`` (none: an empty list)."""
        try:
            reply = await self._request({"batch": n, "no_wait": True})
            msgs = await self._collect(reply, n, PULL_ANSWER_S)
            if msgs:
                return msgs
            reply = await self._request({"batch": 1, "expires": int(wait_s * 1e9)})
            return await self._collect(reply, 1, wait_s + PULL_ANSWER_S)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot pull dispatches: {exc}") from exc

    async def _collect(self, reply: str, n: int, timeout_s: float) -> list[Msg]:
        """Messages until ``n``, or until the request ``reply`` is answered "no more"
        or "expired", or ``timeout_s`` passes."""
        msgs: list[Msg] = []
        deadline = time.monotonic() + timeout_s
        while len(msgs) < n:
            try:
                msg = await self.sub.next_msg(timeout=max(deadline - time.monotonic(), 0.001))
            except NatsTimeoutError:
                return msgs
            status = msg.headers.get(Header.STATUS) if msg.headers else None
            if not status:
                msgs.append(msg)  # a message, for this request or a late one for an earlier
            elif msg.subject == reply and status != _IDLE_HEARTBEAT:
                return msgs  # no more, expired, or refused (too many waiting): asked again later
        return msgs

    async def unsubscribe(self) -> None:
        await self.sub.unsubscribe()
