"""A group's follower: the engine of its own that runs, in step, what its leader
sends (``follow_commands``: loads, batches, its share of a video's tiles), and the
sampler process around it (``follow_leader``: the commands followed in a thread of
its own while its event loop shows it alive and waits for a stop). It hands nothing
out: results are the leader's."""

from __future__ import annotations

import asyncio
import logging
import threading

import torch

from gpu_worker.denoising.diffusers_family import DiffusersFamily
from gpu_worker.denoising.group_mesh import GroupMesh
from gpu_worker.denoising.group_mesh import leave as leave_group
from gpu_worker.engine import SamplerEngine
from gpu_worker.group.channel import (
    Channel,
    Decode,
    FollowerLockstep,
    Load,
    ReceivedJoins,
    Sample,
    Shutdown,
    failure_text,
)
from gpu_worker.group.engines import join_group
from services.models.device import module_dtype
from services.models.vae import VaeDecoderEngine
from services.models.video_tiles import Tiles, decode_tiles

log = logging.getLogger(__name__)


async def follow_leader(engine: SamplerEngine, group: GroupMesh, stop: asyncio.Event) -> int:
    """A group's follower: no dispatch, database or server of its own; it runs what
    its leader sends until told to shut down (0), or until its leader is gone (a
    collective fails: 1, and its supervisor re-forms the group)."""
    channel = follower_engine(engine, group)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()

    def run() -> None:
        try:
            follow_commands(engine, channel)
            outcome: BaseException | None = None
        except BaseException as exc:  # the leader's end: a collective that failed
            outcome = exc
        loop.call_soon_threadsafe(_settle, done, outcome)

    # A daemon: a follower stopped by a signal exits without waiting for a collective.
    threading.Thread(target=run, name="group-follower", daemon=True).start()
    log.info("rank %d of a group of %d on %s, following its leader", group.rank, group.size, group.device)
    stopping: asyncio.Future[object] = asyncio.ensure_future(stop.wait())
    ended: asyncio.Future[object] = asyncio.ensure_future(done)
    await asyncio.wait([ended, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not done.done():
        log.info("stopped before its leader said so")
        return 0
    failed = done.result()
    if failed is not None:
        log.error("its leader is gone (%s); exiting for the group to re-form", failed)
        return 1
    leave_group()
    return 0


def _settle(done: asyncio.Future[BaseException | None], outcome: BaseException | None) -> None:
    if not done.done():
        done.set_result(outcome)


def follower_engine(engine: SamplerEngine, mesh: GroupMesh) -> Channel:
    """Makes ``engine`` a follower's (it drops only what its leader drops); its channel."""
    channel = Channel(mesh)
    join_group(engine, mesh, FollowerLockstep(channel))
    for denoiser in engine.denoisers.values():
        if isinstance(denoiser, DiffusersFamily):
            denoiser.text_from_leader = True
    engine.models.evicts = False
    return channel


def follow_commands(engine: SamplerEngine, channel: Channel, stop: threading.Event | None = None) -> None:
    """A follower's loop: runs each command its leader sends until told to shut
    down. A command that fails here is logged; the leader's own outcome stands (a
    difference that breaks a collective ends the group: docs/parallel.md)."""
    vaes: VaeDecoderEngine | None = None
    while stop is None or not stop.is_set():
        command = channel.receive()
        for name in command.drop:
            engine.unload(name)
        if isinstance(command, Shutdown):
            return
        if isinstance(command, Load):
            failure = None
            try:
                engine.load(command.name)
            except Exception as exc:
                log.exception("rank %d: loading %s failed", channel.mesh.rank, command.name)
                failure = exc
            channel.gather(failure_text(failure))  # the leader's load ends when every rank's has
            continue
        if isinstance(command, Decode):
            # Its VAEs are loaded as videos come: a follower's engine holds no decoder.
            vaes = vaes or VaeDecoderEngine(engine.registry, engine.models_dir, engine.device)
            channel.collect(_decoded_share(vaes, command, channel.mesh))
            continue
        try:
            if isinstance(command, Sample):
                joins = ReceivedJoins(channel) if command.joins else None
                engine.sample_batch([s.member() for s in command.members], joins)
        except Exception:
            log.exception("rank %d: %s failed", channel.mesh.rank, type(command).__name__)


def _decoded_share(vaes: VaeDecoderEngine, command: Decode, mesh: GroupMesh) -> Tiles | str:
    """This rank's share of a video's tiles, on the host, for its leader; why not, if not."""
    try:
        vae = vaes.load(command.model)
        latents = command.latents.to(vaes.device, module_dtype(vae))
        with torch.inference_mode():
            tiles = decode_tiles(vae, latents, command.grid, command.grid.share(mesh.rank, mesh.size))
        return {tile: t.to("cpu") for tile, t in tiles.items()}
    except Exception as exc:
        log.exception("rank %d: decoding its tiles of %s failed", mesh.rank, command.model)
        return f"{type(exc).__name__}: {exc}"
