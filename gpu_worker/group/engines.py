"""A group's engines. The leader's (``GroupEngine``) is the sampler's engine, serving
the parallel models of its group's size across every rank and every other model
alone, as a single sampler would (the followers then wait). Each spanning load and
batch is sent to the followers before it runs; each follower runs what it is sent
(``gpu_worker.group.follower``). A video the group decodes, it decodes across its
ranks (``decode_kept``, ``share_tiles``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from gpu_worker.denoising.diffusers_family import DiffusersFamily
from gpu_worker.denoising.group_mesh import GroupBroken, GroupError, GroupMesh
from gpu_worker.denoising.lockstep import Lockstep
from gpu_worker.denoising.members import BatchMember, MemberInputs, MemberResult
from gpu_worker.denoising.running_batch import BatchJoins
from gpu_worker.engine import SamplerEngine, batch_model
from gpu_worker.group.channel import (
    Channel,
    Decode,
    LeaderLockstep,
    Load,
    MemberSpec,
    Sample,
    SentJoins,
    Shutdown,
    failure_text,
)
from gpu_worker.group.watchdog import StallWatch, watch
from gpu_worker.models.model_cache import ModelLoader
from services.db.records import JobRecord
from services.generation import JobShape
from services.models.spec import ModelSpec
from services.models.video_tiles import TileGrid, Tiles, decode_tiles

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long a video to decode waits for its group's batch to end: about one step's boundary.
KEEP_WAIT_S = 1.0


def join_group(engine: SamplerEngine, mesh: GroupMesh, lockstep: Lockstep) -> None:
    for denoiser in engine.denoisers.values():
        if isinstance(denoiser, DiffusersFamily):
            denoiser.group, denoiser.lockstep = mesh, lockstep


class GroupEngine(SamplerEngine):
    """The leader's engine. One lock orders everything sent to the followers: a
    load from the warm planner waits for a running parallel batch to end."""

    def __init__(self, *args: Any, mesh: GroupMesh, stall_after_s: float = 300.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mesh = mesh
        self.channel = Channel(mesh)
        self._lock = threading.RLock()
        self._dropped: list[str] = []  # sent with the next command
        self._kept = threading.local()  # .held: this thread holds the lock for a kept decode
        self.stall, self._stall_lock, self._closed = StallWatch(stall_after_s), threading.Lock(), threading.Event()
        self.broken: str | None = None  # what broke the group (``across``); it then runs nothing across it
        join_group(self, mesh, LeaderLockstep(self.channel, self._boundary))
        forget, loader_for = self.models.on_drop, self.models.loader_for

        def dropped(name: str) -> None:
            forget(name)
            if self.spans(name):
                self._dropped.append(name)

        self.models.on_drop = dropped
        self.models.loader_for = lambda spec: (
            _SentLoad(self, loader_for(spec)) if self.spans(spec.name) else loader_for(spec)
        )

    def group_facts(self) -> dict[str, Any] | None:
        return self.mesh.facts()

    def devices_for(self, model: str) -> int:
        return self.mesh.size if self.spans(model) else 1

    def spans(self, model: str) -> bool:
        """Whether a batch of ``model`` runs across the group (else on its leader alone)."""
        return self.mesh.serves(self.registry.get(model).parallel)

    def load(self, name: str) -> Any:
        with self._lock:
            return super().load(name)

    def unload(self, name: str) -> None:
        with self._lock:
            super().unload(name)

    def sample_batch(
        self,
        members: Sequence[BatchMember],
        joins: BatchJoins | None = None,
        on_denoising: Callable[[], None] = lambda: None,
    ) -> list[MemberResult]:
        spec = self.registry.get(batch_model(members))
        with self._lock:
            if not self.spans(spec.name):
                return super().sample_batch(members, joins, on_denoising)
            with self._on_stream():
                loaded = self.models.get(spec.name)
                with self._stall_lock:
                    self.stall.began(time.monotonic())
                try:
                    specs = tuple(self._member_spec(loaded, m) for m in members)
                    with self.across():
                        self.channel.send(Sample(specs, joins is not None, self._drops()))
                        spec_of = functools.partial(self._member_spec, loaded)
                        sent = SentJoins(joins, self.channel, spec_of) if joins is not None else None
                        return self._sample(loaded, members, sent, on_denoising)
                finally:
                    with self._stall_lock:
                        self.stall.ended()

    @contextlib.contextmanager
    def across(self) -> Iterator[None]:
        """Around a command from its sending until every rank has met its last
        collective. A failure inside (a rank gone, or this rank failing where its
        followers go on into a collective it will never meet) leaves no rank knowing
        where the others are: the group is broken, and this and every later command
        raises ``GroupBroken`` (which ends this worker for its supervisor to re-form
        the group) rather than take more jobs into it. A member's own failure is
        agreed on by every rank and raises nothing here."""
        if self.broken is not None:
            raise GroupBroken(f"the group broke earlier: {self.broken}")
        try:
            yield
        except Exception as exc:
            self.broken = failure_text(exc)
            log.error("the group broke: %s", self.broken)
            raise GroupBroken(f"the group broke: {self.broken}") from exc

    def _member_spec(self, pipe: Any, member: BatchMember) -> MemberSpec:
        """``member`` as its followers rebuild it: with its conditioning, where the
        leader encodes the prompts (``leader_encodes``: the followers load no text
        encoder). A prompt that fails to encode here goes without: the member fails on
        every rank, with the leader's own error."""
        spec = self.registry.get(member.params.model)
        denoiser = self.denoiser_for(spec)
        if not isinstance(denoiser, DiffusersFamily) or not denoiser.leader_encodes(spec):
            return MemberSpec.of(member)
        try:
            conditioning = denoiser.encode_cached(pipe, spec, member.params, member.inputs)
        except Exception:
            return MemberSpec.of(member)
        return MemberSpec.of(member, replace(member.inputs or MemberInputs(), conditioning=conditioning))

    def decode_kept(
        self, jobs: Sequence[tuple[JobRecord, torch.Tensor]], decode: Callable[[Any], T], tile_above_pixels: int
    ) -> T | None:
        """``decode(jobs)`` here, its videos' tiles shared across the group, rather
        than sent to a decoder service: for videos large enough to tile, once the
        group runs no batch (a video's last members leave inside their batch, which
        ends a moment later: it waits ``KEEP_WAIT_S`` for that). None, and the caller
        sends them on, when they are not such videos or the group is still busy (a
        decode on the leader's card alone would slow every rank's steps)."""
        if not tiles_video(jobs[0][0].shape, tile_above_pixels) or not self._lock.acquire(timeout=KEEP_WAIT_S):
            return None
        self._kept.held = True  # share_tiles gives the group back as soon as its tiles are in
        try:
            return decode(jobs)
        finally:
            self._give_back_kept()

    def _give_back_kept(self) -> None:
        if getattr(self._kept, "held", False):
            self._kept.held = False
            self._lock.release()

    def share_tiles(self, model: str, vae: Any, latents: torch.Tensor, grid: TileGrid) -> Tiles | None:
        """A tiled video's tiles decoded across the group, each rank its share
        (``VaeDecoderEngine.share_tiles``), the followers' sent back to the leader;
        None while the group runs a batch (the leader then decodes alone rather than
        hold a running batch's members, or its joiners, behind a decode). A tile a
        follower could not decode is decoded here."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            with self._stall_lock:
                self.stall.began(time.monotonic())
            failure, tiles = None, {}
            with self.across():
                self.channel.send(Decode(model, latents.to("cpu"), grid, self._drops()))
                try:
                    tiles = decode_tiles(vae, latents, grid, grid.share(0, self.mesh.size))
                except Exception as exc:  # its followers' tiles are collected all the same
                    failure = exc
                theirs = self.channel.collect(None) or []
            if failure is not None:
                raise failure
            for rank, sent in enumerate(theirs[1:], start=1):
                if isinstance(sent, str):
                    log.warning("rank %d could not decode its tiles of %s (%s): decoding them here", rank, model, sent)
                    sent = decode_tiles(vae, latents, grid, grid.share(rank, self.mesh.size))
                tiles |= {tile: t.to(latents.device) for tile, t in sent.items()}
            return tiles
        finally:
            with self._stall_lock:
                self.stall.ended()
            self._lock.release()
            self._give_back_kept()  # the rest of a kept decode (checks, encoding) needs no group

    def start_watchdog(self, on_stall: Callable[[], None] | None = None) -> threading.Thread:
        """Starts its watchdog (``gpu_worker.group.watchdog``) until ``close``."""
        args = (self.stall, self._stall_lock, self._closed) + ((on_stall,) if on_stall is not None else ())
        thread = threading.Thread(target=watch, args=args, name="group-watchdog", daemon=True)
        thread.start()
        return thread

    def _boundary(self) -> None:
        with self._stall_lock:
            self.stall.boundary(time.monotonic())

    def close(self) -> None:
        """Its followers told to exit (a sampler that stops), unless the group broke:
        they are gone, or in a collective no command reaches."""
        self._closed.set()
        with self._lock:
            if self.broken is None:
                self.channel.send(Shutdown(self._drops()))

    def _drops(self) -> tuple[str, ...]:
        dropped, self._dropped = tuple(self._dropped), []
        return dropped


def tiles_video(shape: JobShape, tile_above_pixels: int) -> bool:
    """Whether a job's output is a video that decodes in tiles (``decode_video``)."""
    return shape.frames > 1 and shape.width * shape.height > tile_above_pixels


class _SentLoad:
    """A parallel model's load, sent to the followers before it runs here (its
    network's warm-up and compilation run collectives they must meet), and done when
    every rank has loaded it: a batch's first step never waits on another rank's load
    (which the watchdog would take for a stall), and a rank that could not load it
    fails the load here, by name."""

    def __init__(self, engine: GroupEngine, loader: ModelLoader) -> None:
        self.engine, self.loader = engine, loader
        self.loads_weights = loader.loads_weights

    def load(self, spec: ModelSpec) -> Any:
        channel, loaded, failure = self.engine.channel, None, None
        with self.engine.across():
            channel.send(Load(spec.name, self.engine._drops()))
            try:
                loaded = self.loader.load(spec)
            except Exception as exc:  # every rank's outcome is gathered all the same
                failure = exc
            every = channel.gather(failure_text(failure))
        failed = [(rank, why) for rank, why in enumerate(every) if why is not None]
        if failure is not None:
            raise failure
        if failed:
            rank, why = failed[0]
            raise GroupError(f"{spec.name}: rank {rank} of the group could not load it: {why}")
        return loaded
