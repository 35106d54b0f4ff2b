"""JetStream dispatch against a real nats-server: a worker's durable consumer
follows its settings, and a forgotten worker leaves nothing on the stream."""

from __future__ import annotations

import asyncio

import pytest

from services.bus.dispatch import Bus, ConsumerSettings, Dispatch
from services.errors import MalformedDispatch
from services.generation import JobShape, Prompts
from services.ops.embedded_nats import EmbeddedNats

pytestmark = [pytest.mark.integration, pytest.mark.quick]


async def test_existing_consumer_is_updated_to_new_settings(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect([nats_server.url], name="test")
    try:
        sub = await bus.dispatch_consumer("host-cpu0", ConsumerSettings(ack_wait_s=60, max_ack_pending=64))
        await sub.unsubscribe()
        assert await bus.consumer_settings("host-cpu0") == ConsumerSettings(60.0, 64)
        carrying = Dispatch("j2", 1, 1.5, "p1", 2, JobShape("tiny", 64, 64, 4, 7.5, 1), Prompts("a cat", "fog"))
        await bus.publish_dispatches([("host-cpu0", Dispatch("j1", 1)), ("host-cpu0", carrying)])
        sub = await bus.dispatch_consumer("host-cpu0", ConsumerSettings(ack_wait_s=15, max_ack_pending=8))
        assert await bus.consumer_settings("host-cpu0") == ConsumerSettings(15.0, 8)
        # The same durable consumer, with what was waiting on it.
        msgs = await sub.pull(2, wait_s=2)
        assert [Dispatch.decode(msg.data) for msg in msgs] == [Dispatch("j1", 1), carrying]
        for msg in msgs:
            await msg.ack()
        await sub.unsubscribe()
    finally:
        await bus.close()


async def test_forgotten_worker_leaves_no_consumer_and_no_messages(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect([nats_server.url], name="test")
    try:
        sub = await bus.dispatch_consumer("host-gpu3", ConsumerSettings())
        await sub.unsubscribe()
        await bus.publish_dispatches([("host-gpu3", Dispatch("j1", 1)), ("host-gpu4", Dispatch("j2", 1))])
        await bus.forget_worker("host-gpu3")
        await bus.forget_worker("host-gpu3")  # twice: nothing left to do, no error
        info = await bus.js.stream_info("DARKROOM_DISPATCH")
        assert info.state.messages == 1, "only the other worker's message is left"
        consumers = {c.name for c in await bus.js.consumers_info("DARKROOM_DISPATCH")}
        assert "worker-host-gpu3" not in consumers
    finally:
        await bus.close()


async def test_duplicate_publish_of_one_attempt_is_dropped(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect([nats_server.url], name="test")
    try:
        await bus.publish_dispatches([("host-cpu7", Dispatch("j1", 1)), ("host-cpu7", Dispatch("j1", 1))])
        await bus.publish_dispatches([("host-cpu7", Dispatch("j1", 1)), ("host-cpu7", Dispatch("j1", 2))])
        sub = await bus.dispatch_consumer("host-cpu7", ConsumerSettings())
        msgs = await sub.pull(10, wait_s=0.5)
        assert [Dispatch.decode(m.data).attempt for m in msgs] == [1, 2]  # one message per attempt
        await sub.unsubscribe()
    finally:
        await bus.close()


async def test_a_pull_returns_what_is_there_without_waiting_for_a_full_batch(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect([nats_server.url], name="test")
    try:
        sub = await bus.dispatch_consumer("host-cpu5", ConsumerSettings())
        await bus.publish_dispatches([("host-cpu5", Dispatch("j1", attempt)) for attempt in (1, 2, 3)])
        # Three of the ten asked for: answered at once, not when the 60 s pass.
        msgs = await asyncio.wait_for(sub.pull(10, wait_s=60), 10)
        assert [Dispatch.decode(m.data).attempt for m in msgs] == [1, 2, 3]
        for msg in msgs:
            await msg.ack()
        assert await sub.pull(10, wait_s=0.2) == []  # nothing there: an empty answer once the wait is over
        await sub.unsubscribe()
    finally:
        await bus.close()


async def test_a_waiting_pull_returns_a_lone_dispatch_as_it_comes(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect([nats_server.url], name="test")
    try:
        sub = await bus.dispatch_consumer("host-cpu6", ConsumerSettings())
        waiting = asyncio.ensure_future(sub.pull(64, wait_s=60))
        await asyncio.sleep(0.2)  # the pull is lingering on the server
        await bus.publish_dispatches([("host-cpu6", Dispatch("j9", 1))])
        # One message, not the 64 asked for: it comes now, not when the 60 s pass.
        [msg] = await asyncio.wait_for(waiting, 10)
        assert Dispatch.decode(msg.data) == Dispatch("j9", 1)
        await msg.ack()
        await sub.unsubscribe()
    finally:
        await bus.close()


@pytest.mark.parametrize("prompts", ['"a cat"', '["a cat"]', '["a cat", 3]', '{"prompt": "a cat"}'])
def test_a_dispatch_whose_prompts_are_malformed_is_refused(prompts: str) -> None:
    with pytest.raises(MalformedDispatch, match="prompts must be"):
        Dispatch.decode(f'{{"job_id": "j1", "attempt": 1, "prompts": {prompts}}}'.encode())
