"""A backend away (the database, the model store) is nobody's fault: an attempt it
ends is retried and counts nothing against its worker, and the worker's failure
streak advances only once a failure that blames it is stored (one whose write never
landed is redelivered, and counts when it fails again). Over the runner of
test_runner and the input preparation of test_job_inputs, with in-memory fakes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from gpu_worker.decoding.decoders import Decoders
from gpu_worker.denoising.diffusers_family import ConditioningNotServed
from gpu_worker.denoising.members import BadOutput, BatchMember, MemberResult
from gpu_worker.jobs.edit_inputs import EditInputs
from gpu_worker.jobs.job_store import JobStore, OutcomeNotStored
from gpu_worker.jobs.outcomes import Outcome
from services.db.records import JobRecord
from services.db.states import JobStatus
from services.errors import StoreUnavailable
from services.generation import JobInputs
from services.models.registry import ModelRegistry
from services.models.store.errors import ModelStoreUnavailable
from tests.records import new_job, record
from tests.unit.test_job_inputs import EncodingDecoders, edit
from tests.unit.test_runner import LATENTS, Harness, ScriptedEngine


async def test_a_backend_away_fails_the_attempt_to_be_retried_and_leaves_its_worker_fit() -> None:
    """One failure the worker's would make it unfit (``unfit_after=1``)."""
    outages: dict[str, MemberResult] = {
        "adapter": ModelStoreUnavailable("model store http://store:8333 (bucket models): reading a manifest: refused"),
        "database": StoreUnavailable("database unavailable: connection refused"),
    }
    h = Harness(ScriptedEngine(each=lambda m: outages[m.params.prompt]), unfit_after=1)
    for prompt in outages:
        h.submit(prompt, prompt)
        assert await h.run(prompt) == [Outcome.STORED]
    assert [(job_id, retryable) for job_id, _, retryable in h.repo.attempts.failed] == [
        ("adapter", True),
        ("database", True),
    ]
    assert h.runner.failures.count == 0 and not h.runner.unfit


async def test_a_failure_that_blames_the_worker_counts_once_its_write_lands() -> None:
    h = Harness(ScriptedEngine(each=lambda m: BadOutput("NaN latents")), unfit_after=1, outcome_retry_s=0.3)
    h.submit("nan")
    h.repo.attempts.outage.calls = -1  # the database away for good
    assert await h.run("nan") == [Outcome.NOT_STORED]
    assert h.repo.attempts.failed == [] and h.runner.failures.count == 0 and not h.runner.unfit
    h.repo.attempts.outage.calls = 0  # back: the dispatch is redelivered and fails again
    assert await h.run("nan") == [Outcome.STORED]
    assert [job_id for job_id, _, _ in h.repo.attempts.failed] == ["nan"]
    assert h.runner.failures.count == 1 and h.runner.unfit


class InputsAway:
    """The job store's side of the inputs while the database stays away: what its
    retries end in."""

    async def inputs(self, jobs: Sequence[JobRecord]) -> dict[str, JobInputs]:
        raise OutcomeNotStored(f"cannot read the input images of {len(jobs)} jobs: database unavailable")


def conditioned(member: BatchMember) -> MemberResult:
    """As a family whose text encoders are the decoder service's samples a member:
    without its conditioning, it cannot (``DiffusersFamily.conditioning``)."""
    if member.inputs is None or member.inputs.conditioning is None:
        return ConditioningNotServed(f"{member.params.model}: no conditioning came for this job")
    return LATENTS


async def test_a_database_away_while_inputs_are_read_leaves_every_job_of_the_batch_for_redelivery() -> None:
    served = replace(ModelRegistry.load().get("tiny"), text_encoders="service")
    registry = ModelRegistry({"tiny": served})
    h = Harness(ScriptedEngine(each=conditioned), unfit_after=1)
    text = record(new_job(id="text", model="tiny", width=64, height=64), status=JobStatus.SCHEDULED, attempt=1)
    for job in (edit("image", model="tiny"), replace(text, worker_id="w1")):
        h.repo.attempts.jobs[job.id] = job
    h.runner.edit_inputs = EditInputs(
        cast(JobStore, InputsAway()), cast(Decoders, EncodingDecoders()), registry, guided=lambda p: True
    )
    assert await h.run("image", "text") == [Outcome.NOT_STORED, Outcome.NOT_STORED]
    assert h.repo.attempts.failed == [] and h.runner.failures.count == 0
    assert h.engine.batches == []  # nothing sampled without its inputs
