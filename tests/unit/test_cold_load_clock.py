"""A cold model load is the operator's time, not the tenant's: the sampler's real
engine, its model family's load held until the test lets it go, over in-memory
fakes of the database and the decoders. The first job of a cold model is charged
its sampling alone, its recorded start on the GPU is after the load, no open seat
is advertised while the model loads (placement would send joiners to wait behind
it), and the load shows in the sampler's own load metric."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import torch
from prometheus_client import REGISTRY

from gpu_worker.decoding.decoders import Decoders
from gpu_worker.denoising.checkpoint_capture import MemberCheckpoints
from gpu_worker.denoising.members import BatchMember, MemberInputs, MemberResult
from gpu_worker.denoising.running_batch import BatchJoins
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.batch_sampling import SampledBatch
from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.outcomes import Started
from gpu_worker.jobs.runner import JobRunner
from gpu_worker.jobs.tracker import JobTracker
from services.bus.dispatch import Dispatch
from services.db.repository import Repository
from services.db.states import JobStatus
from services.errors import ModelError
from services.generation import GenerationParams
from services.models.loader import Loaded
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily, ModelSpec
from tests.fakes import FakeRepository, RecordedEvents
from tests.records import new_job, record
from tests.unit.test_runner import FakeDecoders

MODEL = "tiny"
LOAD_S = 1.0  # how long the test holds the load: far longer than the sampling
WITHIN_S = 10.0


class HeldLoad:
    """The tiny family's loader and loop: its load waits until ``release`` (or fails
    with ``failure``); its loop takes one step, as a diffusers loop with joiners would."""

    loads_weights = True
    takes_joiners = True
    reads_prompts = False  # its loop reads no prompt

    def __init__(self, failure: Exception | None = None) -> None:
        self.failure = failure
        self.loading = threading.Event()
        self.release = threading.Event()
        self.denoised_s = 0.0

    def load(self, spec: ModelSpec) -> Loaded:
        self.loading.set()
        began = time.perf_counter()
        assert self.release.wait(WITHIN_S), "the load was never let go"
        if self.failure is not None:
            raise self.failure
        return Loaded(object(), 0, time.perf_counter() - began)

    def encode_prompts(
        self,
        model: Any,
        spec: ModelSpec,
        batch: Sequence[GenerationParams],
        images: Mapping[str, MemberInputs] | None = None,
    ) -> None:
        pass

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        return None

    def sample(
        self,
        model: Any,
        spec: ModelSpec,
        members: Sequence[BatchMember],
        checkpoints: MemberCheckpoints,
        joins: BatchJoins | None = None,
    ) -> list[MemberResult]:
        began = time.perf_counter()
        if joins is not None:
            joins.stepped(members, 0)
            assert joins.close() == []
        latents: list[MemberResult] = [torch.ones(m.params.num_images, 4, 8, 8) for m in members]
        self.denoised_s = time.perf_counter() - began
        return latents


class Sampler:
    """A JobRunner over the real engine, its tiny family's load held."""

    def __init__(self, held: HeldLoad, models_dir: Path) -> None:
        self.repo = FakeRepository()
        engine = SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))
        engine.denoisers[ModelFamily.TINY] = held
        store = JobStore(cast(Repository, self.repo), RecordedEvents(), "w1", outcome_retry_s=5.0)
        self.runner = JobRunner(store, engine, cast(Decoders, FakeDecoders()), JobTracker(), unfit_after_failures=3)
        self.sampled: list[tuple[list[Started], SampledBatch]] = []
        self.seats_opened = asyncio.Event()

    async def start(self, job_id: str) -> Started:
        job = record(new_job(id=job_id, model=MODEL), status=JobStatus.SCHEDULED, attempt=1, worker_id="w1")
        self.repo.attempts.jobs[job_id] = job
        [started] = (await self.runner.start([Dispatch(job_id, 1)])).values()
        assert isinstance(started, Started)
        return started

    def sample(self, started: Started) -> asyncio.Task[None]:
        return asyncio.create_task(
            self.runner.sample([started], lambda jobs, s: self.sampled.append((jobs, s)), self.seats_opened.set)
        )

    async def finish(self) -> None:
        for jobs, sampled in self.sampled:
            await self.runner.finish(jobs, sampled)


def load_seconds(model: str) -> float:
    return REGISTRY.get_sample_value("darkroom_model_load_seconds_sum", {"model": model}) or 0.0


async def test_the_first_job_of_a_cold_model_is_charged_its_sampling_alone(tmp_path: Path) -> None:
    held = HeldLoad()
    h = Sampler(held, tmp_path)
    first = await h.start("first")
    loads_before = load_seconds(MODEL)
    sampling = h.sample(first)
    assert await asyncio.to_thread(held.loading.wait, WITHIN_S), "the load never began"
    await asyncio.sleep(LOAD_S)  # the load takes this long
    # While it loads: no room advertised, for placement or for the heartbeat.
    assert h.runner.seats() is None and h.runner.open_seats() == [] and not h.seats_opened.is_set()
    loaded_at = datetime.now(UTC)
    held.release.set()
    await asyncio.wait_for(sampling, WITHIN_S)
    assert h.seats_opened.is_set(), "its seats opened once denoising began"
    await h.finish()

    [[result]] = h.repo.attempts.finished
    assert held.denoised_s <= result.busy_s < LOAD_S
    assert first.sampled_s == result.busy_s
    # Its start on the GPU, as recorded (DECODING's sampling_began): after the load.
    assert first.sampling_at is not None and first.sampling_at >= loaded_at
    assert load_seconds(MODEL) - loads_before >= LOAD_S


async def test_a_load_that_fails_charges_no_one(tmp_path: Path) -> None:
    held = HeldLoad(failure=ModelError("the store did not answer"))
    h = Sampler(held, tmp_path)
    first = await h.start("first")
    sampling = h.sample(first)
    assert await asyncio.to_thread(held.loading.wait, WITHIN_S), "the load never began"
    await asyncio.sleep(LOAD_S / 4)  # the load takes this long, then fails
    held.release.set()
    await asyncio.wait_for(sampling, WITHIN_S)
    assert not h.seats_opened.is_set(), "no denoising, no seats"
    await h.finish()

    assert [(job_id, retryable) for job_id, _, retryable in h.repo.attempts.failed] == [("first", True)]
    assert h.repo.attempts.charged == {"first": 0.0}
    assert first.sampled_s == 0.0
