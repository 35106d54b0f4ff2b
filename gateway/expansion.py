"""Prompt expansion at submit: whether a request's prompt is expanded (it asks, or
its tenant's default), and the gateway's one expander, run off the event loop.

It runs at the gateway, once per job, after the request is validated and admitted
(a tenant past its limits is refused before it takes the thread) and before the job
is stored: the expanded prompt is stored on the job, returned
to the client, and sampled from on every attempt, so that the image never depends
on where or how often the job ran. The expander is loaded as the gateway starts
(a model: read from its directory, or built if it is the builtin), on a thread of
its own that then runs every expansion, one at a time: a model is not thread-safe,
and expansions queue there rather than on the event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.metrics import EXPANSION_SECONDS
from services.config.fields import SettingsError
from services.config.safety import ExpansionSettings
from services.errors import FieldViolation, InvalidArgument
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.expansion import OFF, Expander, build_expander

log = logging.getLogger(__name__)


def asks_expansion(request: pb.SubmitJobRequest, tenant_default: bool) -> bool:
    """Whether the job's prompt is expanded: as the request says, else as its tenant's default."""
    return request.expand_prompt if request.HasField("expand_prompt") else tenant_default


class Expansion:
    """The gateway's expander (none where ``prompt_expander`` is off), and the thread it runs on."""

    name = "prompt expansion"

    def __init__(self, settings: ExpansionSettings, models_dir: Path) -> None:
        self.settings = settings
        self.models_dir = models_dir
        self.enabled = settings.prompt_expander != OFF
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expansion")
        self._expander: Expander | None = None

    def check(self, request: pb.SubmitJobRequest) -> None:
        """InvalidArgument naming ``expand_prompt`` where the request asks for an
        expansion that this gateway does not make. A tenant's default asks nothing:
        where expansion is off, its prompts are left as they are."""
        if request.expand_prompt and not self.enabled:
            why = "this gateway expands no prompts (DARKROOM_PROMPT_EXPANDER=off): leave it unset or false"
            raise InvalidArgument([FieldViolation("expand_prompt", why)])

    async def expand(self, prompt: str, seed: int) -> str:
        """``prompt`` expanded, seeded by ``seed``, on the expansion thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._expand, prompt, seed)

    def _expand(self, prompt: str, seed: int) -> str:
        expander = self._loaded()
        started = time.perf_counter()
        expanded = expander.expand(prompt, seed)
        EXPANSION_SECONDS.labels(expander=expander.name).observe(time.perf_counter() - started)
        return expanded

    def _loaded(self) -> Expander:
        if self._expander is None:
            started = time.perf_counter()
            expander = build_expander(self.settings, self.models_dir)
            assert expander is not None, "expansion is off"
            expander.expand("a warm-up", 0)  # a model's first call sets up what later calls reuse
            self._expander = expander
            log.info("prompt expander %s ready in %.2fs", expander.name, time.perf_counter() - started)
        return self._expander

    async def start(self, stop: asyncio.Event) -> bool:
        """Loads the expander before the gateway serves, so that the first request
        does not wait for it; a model that cannot be loaded stops the gateway."""
        if self.enabled:
            try:
                await asyncio.get_running_loop().run_in_executor(self._thread, self._loaded)
            except ValueError as exc:  # a vocabulary or model directory that cannot be used
                raise SettingsError(str(exc)) from exc
        return True

    async def stop(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
