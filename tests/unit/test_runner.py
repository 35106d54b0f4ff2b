"""The sampler's JobRunner over in-memory fakes of the database, the engine and the
decoders: outcomes are retried while the database is away and left for redelivery
when it stays away; a batch that fails as a whole reruns one by one; cancelled,
preempted and failed members store what they came to; failures in a row that are not
the jobs' own make the worker unfit, and a broken group at once; a progress write's
answer stops the job."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

import pytest
import torch

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.decoding.decoders import Decoders, DecodeUnavailable
from gpu_worker.denoising.group_mesh import GroupBroken
from gpu_worker.denoising.members import BadOutput, BatchMember, JobSuspended, MemberResult
from gpu_worker.denoising.running_batch import RunningBatch
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs import progress
from gpu_worker.jobs.batch_sampling import SampledBatch
from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.outcomes import Outcome, Started
from gpu_worker.jobs.runner import JobRunner
from gpu_worker.jobs.tracker import JobTracker, StopReason
from services.bus.dispatch import Dispatch
from services.db.records import ImageRecord, JobRecord, StoredCheckpoint
from services.db.repository import Repository, Standing
from services.db.states import JobStatus
from services.errors import FieldViolation, InvalidArgument, JobInterrupted
from services.models.registry import ModelRegistry
from tests.fakes import FakeRepository, RecordedEvents
from tests.records import new_job, record

LATENTS = torch.ones(1, 4, 8, 8)
SUSPENDED_AT = Checkpoint(3, 4, b"state at step 3")


def sampled_alike(member: BatchMember) -> MemberResult:
    """What the real engine leaves a member with: its latents, or, once stopped, a
    suspension (when asked for one) or an interruption."""
    if member.stopping.is_set():
        return JobSuspended("tiny", SUSPENDED_AT) if member.suspend() else JobInterrupted("tiny")
    return LATENTS


class ScriptedEngine:
    """``sample_batch`` runs ``each`` on every member; ``whole`` may raise for the batch."""

    def __init__(
        self,
        each: Callable[[BatchMember], MemberResult] = sampled_alike,
        whole: Callable[[Sequence[BatchMember]], None] = lambda members: None,
    ) -> None:
        self.registry = ModelRegistry.load()
        self.each = each
        self.whole = whole
        self.batches: list[list[str]] = []  # the prompts of each call
        self.joins: list[RunningBatch | None] = []  # what each call was given to take joiners from

    takes_joiners_too = False  # True: as a diffusers loop's, its batch takes joiners

    def encodes_prompts(self, model: str) -> bool:
        return False  # its batches read no prompt

    def takes_joiners(self, model: str) -> bool:
        return self.takes_joiners_too

    def devices_for(self, model: str) -> int:
        return 1  # a single GPU's

    def sample_batch(
        self,
        members: Sequence[BatchMember],
        joins: RunningBatch | None = None,
        on_denoising: Callable[[], None] = lambda: None,
    ) -> list[MemberResult]:
        self.joins.append(joins)
        self.batches.append([m.params.prompt for m in members])
        on_denoising()
        self.whole(members)
        return [self.each(m) for m in members]


class FakeDecoders:
    def __init__(self, failure: Callable[[JobRecord], BaseException | None] = lambda job: None) -> None:
        self.failure = failure
        self.decoded: list[str] = []

    async def decode_many(
        self, jobs: Sequence[tuple[JobRecord, torch.Tensor]]
    ) -> dict[str, list[ImageRecord] | BaseException]:
        self.decoded.extend(job.id for job, _ in jobs)
        return {
            job.id: self.failure(job) or [ImageRecord(0, b"png", "image/png", 64, 64, job.params.seed)]
            for job, _ in jobs
        }


class Harness:
    def __init__(
        self,
        engine: ScriptedEngine | None = None,
        decoders: FakeDecoders | None = None,
        *,
        outcome_retry_s: float = 5.0,
        unfit_after: int = 3,
        continuous_batching: bool = True,
    ) -> None:
        self.repo = FakeRepository()
        self.events = RecordedEvents()
        self.engine = engine or ScriptedEngine()
        self.decoders = decoders or FakeDecoders()
        store = JobStore(cast(Repository, self.repo), self.events, "w1", outcome_retry_s=outcome_retry_s)
        self.runner = JobRunner(
            store,
            cast(SamplerEngine, self.engine),
            cast(Decoders, self.decoders),
            JobTracker(),
            unfit_after_failures=unfit_after,
            continuous_batching=continuous_batching,
        )

    def submit(self, job_id: str, prompt: str = "a fox", images: int = 1) -> None:
        new = new_job(id=job_id, prompt=prompt, num_images=images)
        job = record(new, status=JobStatus.SCHEDULED, attempt=1, worker_id="w1")
        self.repo.attempts.jobs[job_id] = job

    async def start(self, *job_ids: str) -> dict[str, Started]:
        started = await self.runner.start([Dispatch(job_id, 1) for job_id in job_ids])
        assert all(isinstance(s, Started) for s in started.values()), started
        return cast(dict[str, Started], started)

    async def run(self, *job_ids: str, before: Callable[[dict[str, Started]], None] = lambda s: None) -> list[Outcome]:
        """Starts, samples and finishes the jobs as one batch."""
        started = await self.start(*job_ids)
        before(started)
        batch = list(started.values())
        outcomes: dict[str, Outcome] = {}
        for jobs, sampled in await self.sample(batch):
            outcomes.update(zip((s.job.id for s in jobs), await self.runner.finish(jobs, sampled), strict=True))
        return [outcomes[s.job.id] for s in batch]

    async def sample(self, batch: list[Started]) -> list[tuple[list[Started], SampledBatch]]:
        """The batch sampled: its members as they came out, with what their sampling was."""
        out: list[tuple[list[Started], SampledBatch]] = []
        await self.runner.sample(batch, lambda jobs, sampled: out.append((jobs, sampled)))
        return out


def the_suspension(h: Harness) -> tuple[object, ...]:
    """The one suspension stored: job, step, total, data, reason and whether preempted."""
    [suspension] = h.repo.checkpoints.suspended
    return tuple(suspension[k] for k in ("job_id", "step", "total", "data", "reason", "preempted"))


async def test_an_outcome_is_retried_while_the_database_is_away() -> None:
    h = Harness()
    h.submit("a")
    h.repo.attempts.outage.calls = 2
    assert await h.run("a") == [Outcome.STORED]
    assert h.repo.attempts.outage.tried == 3
    assert [r.job_id for r in h.repo.attempts.finished[0]] == ["a"]
    assert h.events.statuses("a") == [JobStatus.RUNNING, JobStatus.DECODING, JobStatus.SUCCEEDED]


async def test_an_outcome_the_database_never_takes_is_left_for_redelivery() -> None:
    h = Harness(outcome_retry_s=0.3)
    h.submit("a")
    h.repo.attempts.outage.calls = -1  # away for good
    assert await h.run("a") == [Outcome.NOT_STORED]
    assert h.repo.attempts.outage.tried >= 2 and h.repo.attempts.finished == []
    assert JobStatus.SUCCEEDED not in h.events.statuses("a")
    assert h.runner.tracker.running() == []  # its watch is closed all the same


async def test_a_dispatch_not_this_workers_is_acked_without_running() -> None:
    h = Harness()
    h.submit("mine")
    h.submit("stale")
    h.repo.attempts.stale.add("stale")
    started = await h.runner.start([Dispatch("mine", 1), Dispatch("stale", 1)])
    assert started["stale"] is Outcome.STORED
    assert isinstance(started["mine"], Started)
    assert h.events.statuses("stale") == []


async def test_a_batch_that_fails_whole_reruns_one_by_one_and_the_bad_job_fails_alone() -> None:
    def poisoned(members: Sequence[BatchMember]) -> None:
        if any(m.params.prompt == "poison" for m in members):
            raise RuntimeError("CUDA error: device-side assert triggered")

    h = Harness(ScriptedEngine(whole=poisoned))
    for job_id, prompt in (("a", "a fox"), ("p", "poison"), ("b", "a hen")):
        h.submit(job_id, prompt)
    assert await h.run("a", "p", "b") == [Outcome.STORED] * 3
    assert h.engine.batches == [["a fox", "poison", "a hen"], ["a fox"], ["poison"], ["a hen"]]
    assert h.repo.attempts.failed == [("p", "RuntimeError: CUDA error: device-side assert triggered", True)]
    # Each rerun goes out (to decode and store) as it ends.
    assert [[r.job_id for r in f] for f in h.repo.attempts.finished] == [["a"], ["b"]]


async def test_a_cancelled_member_stores_cancelled_and_the_rest_finish() -> None:
    h = Harness()
    h.submit("c")
    h.submit("d")
    outcomes = await h.run("c", "d", before=lambda started: started["c"].watch.stop(StopReason.CANCELLED))
    assert outcomes == [Outcome.STORED, Outcome.STORED]
    assert h.repo.attempts.cancelled == ["c"]
    assert h.events.statuses("c") == [JobStatus.RUNNING, JobStatus.CANCELLED]
    assert h.decoders.decoded == ["d"]  # a cancelled job's work is not decoded
    assert h.events.statuses("d")[-1] == JobStatus.SUCCEEDED


async def test_each_member_is_charged_its_images_share_of_its_batch_s_sampling_time() -> None:
    h = Harness()
    h.submit("one")
    h.submit("three", images=3)
    h.submit("gone")
    started = await h.start("one", "three", "gone")
    started["gone"].watch.stop(StopReason.CANCELLED)
    batch = list(started.values())
    [(jobs, sampled)] = await h.sample(batch)
    await h.runner.finish(jobs, sampled)
    [finished] = h.repo.attempts.finished
    shares = {r.job_id: r.busy_s for r in finished}
    assert shares["one"] > 0 and shares["three"] == pytest.approx(3 * shares["one"])
    # A member cancelled part of the way is charged for its place in the batch too.
    assert h.repo.attempts.charged["gone"] == pytest.approx(shares["one"])
    assert sum(shares.values()) + h.repo.attempts.charged["gone"] == pytest.approx(started["one"].sampled_s)
    assert {s.batch_rows for s in batch} == {5}


async def test_a_preempted_member_stores_its_checkpoint_and_goes_back_to_the_queue() -> None:
    h = Harness()
    h.submit("p")
    outcomes = await h.run("p", before=lambda started: started["p"].watch.stop(StopReason.PREEMPTED, "for job-x"))
    assert outcomes == [Outcome.STORED]
    assert the_suspension(h) == ("p", 3, 4, b"state at step 3", "for job-x", True)
    assert h.events.statuses("p") == [JobStatus.RUNNING, None, JobStatus.QUEUED]
    assert h.repo.attempts.failed == [] and h.decoders.decoded == []


async def test_a_resumed_member_that_cannot_capture_its_state_is_suspended_at_its_stored_step() -> None:
    # Its capture failed, so it stops with nothing of its own to save: it keeps the
    # checkpoint it resumed from, and its suspension says so (its next attempt
    # resumes from that step, and the record's resumption matches it).
    h = Harness(ScriptedEngine(each=lambda m: JobInterrupted("tiny")))
    h.submit("r")
    h.repo.attempts.jobs["r"] = replace(h.repo.attempts.jobs["r"], checkpoint_step=3, checkpoint_attempt=0)
    h.repo.checkpoints.stored["r"] = StoredCheckpoint("r", 0, 3, 4, b"state at step 3")
    outcomes = await h.run("r", before=lambda started: started["r"].watch.stop(StopReason.SUSPENDED, "drain"))
    assert outcomes == [Outcome.STORED]
    assert the_suspension(h) == ("r", 3, 4, None, "drain", False)


async def test_failures_in_a_row_make_the_runner_unfit_and_a_decoder_outage_does_not() -> None:
    away = FakeDecoders(lambda job: DecodeUnavailable("no decoder could decode it"))
    h = Harness(decoders=away, unfit_after=2)
    for job_id in ("d1", "d2", "d3"):
        h.submit(job_id)
    await h.run("d1", "d2", "d3")
    assert [(job_id, retryable) for job_id, _, retryable in h.repo.attempts.failed] == [
        (j, True) for j in "d1 d2 d3".split()
    ]
    assert not h.runner.unfit

    verdicts: dict[str, MemberResult] = {"nan": BadOutput("NaN latents"), "fine": LATENTS}
    verdicts["invalid"] = InvalidArgument([FieldViolation("prompt", "cannot be encoded")])
    h = Harness(ScriptedEngine(each=lambda m: verdicts[m.params.prompt]), unfit_after=2)
    for job_id, prompt in (("j1", "nan"), ("j2", "fine"), ("j3", "nan"), ("j4", "invalid"), ("j5", "nan")):
        h.submit(job_id, prompt)
    for job_id in ("j1", "j2", "j3", "j4"):
        await h.run(job_id)  # j2's stored result ends the streak; j4's failure is its own
    assert not h.runner.unfit and h.runner.failures.count == 1
    assert [(job_id, retryable) for job_id, _, retryable in h.repo.attempts.failed][-1] == ("j4", False)
    await h.run("j5")
    assert h.runner.unfit


async def test_a_broken_group_fails_its_batch_once_and_ends_the_worker_at_once() -> None:
    """A batch across a group whose rank is gone: each member's attempt fails once,
    retryable, with no rerun one by one (the group runs nothing more), and the runner
    is unfit before the failures are written, so that its consumer takes no job (the
    requeued one included) into the broken group."""

    def broke(members: Sequence[BatchMember]) -> None:
        raise GroupBroken("the group broke: RuntimeError: Connection closed by peer")

    h = Harness(ScriptedEngine(whole=broke), unfit_after=3)
    for job_id in ("g1", "g2"):
        h.submit(job_id)
    unfit_as_written: list[bool] = []
    fail = h.repo.attempts.fail

    async def failing(*args: object, **kwargs: object) -> JobStatus | None:
        unfit_as_written.append(h.runner.unfit)
        return await fail(*args, **kwargs)  # type: ignore[arg-type]

    h.repo.attempts.fail = failing  # type: ignore[method-assign]
    await h.run("g1", "g2")
    assert h.engine.batches == [["a fox", "a fox"]], "no rerun one by one"
    assert [(job_id, retryable) for job_id, _, retryable in h.repo.attempts.failed] == [("g1", True), ("g2", True)]
    assert unfit_as_written == [True, True] and h.runner.unfit
    assert "Connection closed by peer" in h.runner.failures.why_unfit()
    h.runner.failures.succeeded()
    assert h.runner.unfit, "a stored result elsewhere does not mend a broken group"


async def test_a_progress_write_that_learns_of_a_cancel_stops_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "PROGRESS_WRITE_EVERY_S", 0.0)
    noticed = threading.Event()

    def stepping(member: BatchMember) -> MemberResult:
        member.on_step(1, 4)  # from the sampling thread, as the engine reports a step
        if member.stopping.wait(timeout=10):
            noticed.set()
        return sampled_alike(member)

    h = Harness(ScriptedEngine(each=stepping))
    h.submit("c")
    h.repo.attempts.standing = Standing.CANCEL_REQUESTED
    assert await h.run("c") == [Outcome.STORED]
    assert noticed.is_set(), "the cancel never reached the sampling thread"
    assert h.repo.attempts.progress_calls == [("c", 1, 4)]
    assert any(e.progress and (e.step, e.total) == (1, 4) for e in h.events.published)
    assert h.repo.attempts.cancelled == ["c"]


@pytest.mark.parametrize("continuous", [True, False])
async def test_a_batch_takes_joiners_only_where_continuous_batching_is_on(continuous: bool) -> None:
    engine = ScriptedEngine()
    engine.takes_joiners_too = True
    h = Harness(engine, continuous_batching=continuous)
    h.submit("a")
    assert await h.run("a") == [Outcome.STORED]
    [joins] = engine.joins
    assert (joins is not None) is continuous
    assert h.events.statuses("a")[-1] == JobStatus.SUCCEEDED
    assert h.runner.seats() is None, "no batch on the device"


async def test_a_batch_whose_model_went_stale_takes_no_one_more() -> None:
    """Its store version changed mid-batch: the batch ends with its members, and a
    job of its model runs as the next batch, which loads the model afresh."""
    on_device, finish = threading.Event(), threading.Event()

    def held(member: BatchMember) -> MemberResult:
        on_device.set()
        assert finish.wait(10)
        return sampled_alike(member)

    engine = ScriptedEngine(each=held)
    engine.takes_joiners_too = True
    h = Harness(engine)
    h.submit("a")
    h.submit("b")
    running = asyncio.create_task(h.run("a"))
    try:
        assert await asyncio.to_thread(on_device.wait, 10)
        assert h.runner.seats() is not None
        engine.takes_joiners_too = False  # as the engine answers for a model marked stale
        assert h.runner.seats() is None
        joiner = (await h.start("b"))["b"]
        await h.runner.prepare([joiner])
        assert not h.runner.join([joiner])
    finally:
        finish.set()
    assert await running == [Outcome.STORED]
