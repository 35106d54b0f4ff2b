"""Prompts encoded while their jobs' starts are written: a dispatch carries its job's
prompts (as the sampler encodes them) and shape, so the text encoders run while
the start's statement is in flight instead of after it, and the prompt cache holds
the conditioning when the job is prepared (``JobRunner.prepare``), which waits for
this encoding rather than repeat it. Nothing depends on it: the cache key is made
from the same values the job's record gives, so a prompt encoded ahead for a job
that turns out not to be this worker's is a cache entry, never a wrong one, and one
that cannot be encoded here is encoded (and fails its job alone) when its batch
starts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from gpu_worker.engine import SamplerEngine
from services.bus.dispatch import Dispatch
from services.generation import GenerationParams

log = logging.getLogger(__name__)


def sampled_params(dispatch: Dispatch) -> GenerationParams | None:
    """What the sampler encodes the job's prompt as, from its dispatch alone (its
    seed and adapters aside, which its conditioning does not depend on); None
    where the dispatch does not say its prompts and shape."""
    shape, prompts = dispatch.shape, dispatch.prompts
    if shape is None or prompts is None:
        return None
    return GenerationParams(
        shape.model,
        prompts.prompt,
        prompts.negative_prompt,
        shape.width,
        shape.height,
        shape.steps,
        shape.guidance_scale,
        0,
        shape.num_images,
        shape.frames,
    )


class PromptsAhead:
    def __init__(self, engine: SamplerEngine) -> None:
        self.engine = engine
        self._encoding: dict[str, asyncio.Future[None]] = {}  # by job id
        self._running: set[asyncio.Future[None]] = set()  # forgotten or not, until done

    def start(self, dispatches: Sequence[Dispatch]) -> None:
        """Starts encoding the prompts these dispatches carry, off the event loop."""
        by_model: dict[str, list[tuple[str, GenerationParams]]] = {}
        for dispatch in dispatches:
            params = sampled_params(dispatch)
            if params is not None and self.engine.encodes_prompts(params.model):
                by_model.setdefault(params.model, []).append((dispatch.job_id, params))
        loop = asyncio.get_running_loop()
        for jobs in by_model.values():
            encoding = loop.run_in_executor(None, self._encode, [params for _, params in jobs])
            self._running.add(encoding)
            encoding.add_done_callback(self._running.discard)
            self._encoding.update((job_id, encoding) for job_id, _ in jobs)

    async def wait(self, job_ids: Iterable[str]) -> None:
        """Until what was started for these jobs is encoded (or failed)."""
        encodings = {e for job_id in job_ids if (e := self._encoding.pop(job_id, None)) is not None}
        if encodings:
            await asyncio.wait(encodings)

    def forget(self, job_ids: Iterable[str]) -> None:
        """Jobs that will not be prepared here (not started): their encoding runs on, unwaited."""
        for job_id in job_ids:
            self._encoding.pop(job_id, None)

    def _encode(self, batch: list[GenerationParams]) -> None:
        try:
            self.engine.encode_prompts(batch)
        except Exception as exc:
            log.debug("prompts of %d jobs not encoded ahead: %s", len(batch), exc)
