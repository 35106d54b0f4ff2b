"""The sampler's DispatchConsumer over a fake subscription and a fake runner: a
dispatch is acked only once its job's outcome is stored (and left for redelivery when
it is not), batches are formed by key once the rest of a scheduling pass's jobs have
arrived, what is held but not started goes back when the worker stops, and jobs
already started get their outcomes first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import cast

from gpu_worker.dispatch.acks import REDELIVER_AFTER_S
from gpu_worker.dispatch.consumer import DispatchConsumer
from gpu_worker.jobs.batch_sampling import OnSampled, SampledBatch
from gpu_worker.jobs.outcomes import Outcome, Started
from gpu_worker.jobs.runner import JobRunner
from gpu_worker.jobs.tracker import JobWatch
from services.bus.dispatch import Bus, ConsumerSettings, Dispatch
from services.generation import JobShape
from services.models.registry import ModelRegistry
from services.seats import OpenSeat
from tests.fakes import FakeDispatches, FakeMsg, eventually
from tests.records import new_job, record

A = JobShape("tiny", 64, 64, 4, 7.5, 1)
B = JobShape("tiny", 64, 64, 8, 7.5, 1)  # another number of steps: another batch


class FakeRunner:
    """Starts every dispatch; its batches finish once ``release`` is set, each job
    with the outcome ``outcomes`` names (STORED unless named)."""

    def __init__(self) -> None:
        self.unfit = False
        self.batches: list[list[str]] = []
        self.outcomes: dict[str, Outcome] = {}
        self.release = asyncio.Event()
        self.release.set()
        self.finishing: list[str] = []
        self.device = asyncio.Event()  # set: a batch's sampling ends at once
        self.device.set()
        self.sampling: list[Started] = []
        self.takes_joiners = True
        self.joined: list[str] = []

    async def start(self, dispatches: Sequence[Dispatch]) -> dict[str, Started | Outcome]:
        self.batches.append([d.job_id for d in dispatches])
        timer = asyncio.get_running_loop().call_later(3600, lambda: None)
        timer.cancel()
        return {
            d.job_id: Started(record(new_job(id=d.job_id), attempt=d.attempt), JobWatch(d.job_id, 1), timer, 600.0)
            for d in dispatches
        }

    async def prepare(self, batch: Sequence[Started]) -> None:
        pass

    async def sample(
        self, batch: Sequence[Started], on_sampled: OnSampled, on_seats: Callable[[], None] = lambda: None
    ) -> None:
        self.sampling = [*batch]
        on_seats()
        try:
            await self.device.wait()
            on_sampled(self.sampling, SampledBatch(learnable=False))
        finally:
            self.sampling = []

    def seats(self) -> OpenSeat | None:
        """Room for two more images of the running batch's model and size, while one runs."""
        if not self.sampling or not self.takes_joiners:
            return None
        rows = sum(s.job.params.num_images for s in self.sampling)
        return OpenSeat(self.sampling[0].job.params.join_key, rows, max(2 - rows + 1, 0), 4) if rows < 3 else None

    def join(self, batch: Sequence[Started]) -> bool:
        if not self.sampling:
            return False
        self.joined.extend(s.job.id for s in batch)
        self.sampling.extend(batch)
        return True

    async def finish(self, batch: Sequence[Started], sampled: SampledBatch) -> list[Outcome]:
        self.finishing.extend(s.job.id for s in batch)
        await self.release.wait()
        return [self.outcomes.get(s.job.id, Outcome.STORED) for s in batch]


def msg(job_id: str, shape: JobShape | None = A, pass_id: str = "", pass_jobs: int = 0) -> FakeMsg:
    return FakeMsg(Dispatch(job_id, 1, pass_id=pass_id, pass_jobs=pass_jobs, shape=shape).encode(), f"reply.{job_id}")


class Harness:
    def __init__(self, batch_wait_s: float = 0.0) -> None:
        self.sub = FakeDispatches()
        self.runner = FakeRunner()
        self.consumer = DispatchConsumer(
            cast(Bus, self.sub),
            "w1",
            cast(JobRunner, self.runner),
            ConsumerSettings(ack_wait_s=30.0),
            registry=ModelRegistry.load(),
            on_idle=self._idle,
            batch_wait_s=batch_wait_s,
        )
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.consumer.run(self.stop))

    async def _idle(self) -> None:
        pass

    async def stopped(self) -> None:
        self.stop.set()
        self.sub.wake()
        await asyncio.wait_for(self.task, 5.0)


async def test_a_dispatch_is_acked_only_once_its_outcome_is_stored() -> None:
    h = Harness()
    h.runner.release.clear()
    stored, lost = msg("stored"), msg("lost", shape=B)
    h.runner.outcomes["lost"] = Outcome.NOT_STORED
    h.sub.deliver(stored, lost)
    await eventually(lambda: h.runner.finishing == ["stored", "lost"], "both batches finishing")
    assert stored.settled == [] and lost.settled == []  # decoding and storing: not yet settled
    h.runner.release.set()
    await eventually(lambda: bool(stored.settled and lost.settled), "both settled")
    assert stored.settled == ["ack"]
    assert lost.settled == [f"nak {REDELIVER_AFTER_S}"]  # the database stayed away: redelivered later
    await h.stopped()


async def test_batches_form_by_key_once_the_pass_s_jobs_have_arrived() -> None:
    h = Harness()
    # One scheduling pass sent four jobs here; the last two arrive a pull later.
    h.sub.deliver(msg("a1", A, "p1", 4), msg("b1", B, "p1", 4))
    h.sub.deliver(msg("a2", A, "p1", 4), msg("a3", A, "p1", 4))
    await eventually(lambda: len(h.runner.batches) == 2, "two batches")
    assert h.runner.batches == [["a1", "a2", "a3"], ["b1"]]
    await h.stopped()


async def test_a_malformed_dispatch_is_terminated() -> None:
    h = Harness()
    bad = FakeMsg(b"not a dispatch", "reply.bad")
    h.sub.deliver(bad)
    await eventually(lambda: bad.settled == ["term"], "terminated")
    await h.stopped()
    assert h.runner.batches == []


async def test_stopping_hands_back_what_is_held_and_not_started() -> None:
    h = Harness(batch_wait_s=30.0)  # the dispatch waits in hand for company
    held = msg("held")
    h.sub.deliver(held)
    await eventually(lambda: h.sub.pulls >= 2, "held, and pulling for more")
    await h.stopped()
    assert held.settled == ["nak"]  # redelivered at once, to this worker's next run or another
    assert h.runner.batches == []


async def test_stopping_waits_for_the_outcomes_of_started_jobs() -> None:
    h = Harness()
    h.runner.release.clear()
    started = msg("started")
    h.sub.deliver(started)
    await eventually(lambda: h.runner.finishing == ["started"], "finishing")
    h.stop.set()
    h.sub.wake()
    done, _ = await asyncio.wait({h.task}, timeout=0.2)
    assert not done and started.settled == []
    h.runner.release.set()
    await asyncio.wait_for(h.task, 5.0)
    assert started.settled == ["ack"]


async def test_an_unfit_runner_ends_the_loop() -> None:
    h = Harness()
    h.runner.unfit = True
    h.sub.wake()
    await asyncio.wait_for(h.task, 5.0)


async def test_a_job_of_the_running_batchs_model_and_size_joins_it_whatever_its_steps() -> None:
    h = Harness()
    h.runner.device.clear()
    first, joiner = msg("first"), msg("joiner", shape=B)
    h.sub.deliver(first)
    await eventually(lambda: [s.job.id for s in h.runner.sampling] == ["first"], "the first batch on the device")
    # Another number of steps: another batch key, the same join key.
    h.sub.deliver(joiner)
    await eventually(lambda: h.runner.joined == ["joiner"], "the job joining the running batch")
    assert h.runner.batches == [["first"], ["joiner"]], "started on its own, then offered to the batch"
    assert joiner.settled == [], "not acked before its outcome"
    h.runner.device.set()
    await eventually(lambda: first.settled == joiner.settled == ["ack"], "both acked once stored")
    await h.stopped()


async def test_a_job_of_another_size_waits_and_stops_later_joiners_jumping_ahead() -> None:
    h = Harness()
    h.runner.device.clear()
    msgs = [msg("first"), msg("other", shape=JobShape("tiny", 128, 128, 4, 7.5, 1)), msg("later")]
    h.sub.deliver(msgs[0])
    await eventually(lambda: bool(h.runner.sampling), "the first batch on the device")
    h.sub.deliver(*msgs[1:])  # in hand together: the older one of another size first
    await eventually(lambda: len(h.consumer._in_hand) == 2, "both in hand")
    h.runner.device.set()
    await eventually(lambda: all(m.settled == ["ack"] for m in msgs), "all acked")
    assert h.runner.joined == [], "the later job did not join past the older one of another size"
    assert h.runner.batches == [["first"], ["other"], ["later"]]
    await h.stopped()
