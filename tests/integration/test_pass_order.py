"""A placement pass against a real PostgreSQL publishes its dispatches before its
preemption check and its note of unserved work: neither read may stand between a
placed job and its sampler (issue 46), and a pass whose preemption check fails has
still published what it placed."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from scheduler import facts
from scheduler.passes import Passes
from services.bus.dispatch import Bus, Dispatch
from services.bus.presence_board import PresenceBoard
from services.config.sections import SchedulerSettings
from services.db.repository import Repository
from services.db.states import JobStatus, WorkerKind
from services.models.registry import ModelRegistry
from services.presence_view import PresenceView
from tests.records import new_job, worker_record

pytestmark = pytest.mark.integration


class RecordingBus:
    """The dispatch bus as a pass sees it, recording what it publishes into ``moves``."""

    nc = None  # no NATS: job events go nowhere

    def __init__(self, moves: list[str]) -> None:
        self.moves = moves
        self.published: list[tuple[str, Dispatch]] = []

    async def publish_dispatches(self, dispatches: list[tuple[str, Dispatch]], *, timeout_s: float = 5.0) -> None:
        self.published += dispatches
        self.moves.append("published")


class RecordingPreempter:
    def __init__(self, moves: list[str], *, fails: bool = False) -> None:
        self.moves = moves
        self.fails = fails

    async def after_pass(self, fleet: Any, decision: Any) -> None:
        self.moves.append("preemption check")
        if self.fails:
            raise ConnectionError("the sampler asked to suspend did not answer")


async def no_board() -> PresenceBoard:
    raise AssertionError("a placement pass stores no warm plan")


def passes_on(repo: Repository, moves: list[str], *, preemption_fails: bool = False) -> tuple[Passes, RecordingBus]:
    bus = RecordingBus(moves)
    passes = Passes(
        SchedulerSettings.from_env({}),
        repo,
        cast(Bus, bus),
        ModelRegistry.load(),
        stale_after_s=10.0,
        presence=PresenceView((WorkerKind.SAMPLER,)),
        board=no_board,
    )
    passes.preempter = RecordingPreempter(moves, fails=preemption_fails)  # type: ignore[assignment]
    sampler = facts.worker(worker_record("w1", ("tiny",)))
    passes.live_samplers = lambda: (sampler,)  # type: ignore[method-assign]

    async def note_waiting(placements: Sequence[Any]) -> None:
        moves.append("waiting noted")

    passes.note_waiting = note_waiting  # type: ignore[method-assign]
    return passes, bus


async def test_a_pass_publishes_its_dispatches_before_its_preemption_check_and_waiting_note(
    repo: Repository,
) -> None:
    [(job, _)] = await repo.jobs.create_many([(new_job(model="tiny", prompt="a quiet harbour"), datetime.now(UTC))])
    moves: list[str] = []
    passes, bus = passes_on(repo, moves)
    assert await passes.place() == 1
    assert moves == ["published", "preemption check", "waiting noted"]
    [(worker_id, dispatch)] = bus.published
    assert (worker_id, dispatch.job_id, dispatch.attempt) == ("w1", job.id, 1)
    assert dispatch.prompts is not None and dispatch.prompts.prompt == "a quiet harbour"


async def test_a_failed_preemption_check_leaves_what_the_pass_placed_published(repo: Repository) -> None:
    [(job, _)] = await repo.jobs.create_many([(new_job(model="tiny"), datetime.now(UTC))])
    moves: list[str] = []
    passes, bus = passes_on(repo, moves, preemption_fails=True)
    with pytest.raises(ConnectionError):
        await passes.place()
    assert moves == ["published", "preemption check"]
    assert [d.job_id for _, d in bus.published] == [job.id]
    state = await repo.jobs.get(job.id)
    assert state is not None and state.status == JobStatus.SCHEDULED and state.worker_id == "w1"
