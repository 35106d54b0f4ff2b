"""One rank of a sampler group, run by the parallel-model tests: the leader runs the
jobs of its script file through a ``GroupEngine`` (parallel ones across the group,
single-GPU ones alone), its watchdog on, and saves each one's outcome; a follower
follows. A last batch marked ``stuck`` (its job's prompt "stuck ...") stalls the
follower as a rank stuck in a collective would, and the leader's watchdog ends it;
a batch whose job's prompt is "dies ..." ends the follower (exit 9) as it begins. A
batch the group cannot run (``GroupError``) has that error, in words, as its outcome.

    python -m tests.integration.children.group_rank SCRIPT RANK
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from gpu_worker.adapters.library import AdapterLibrary
from gpu_worker.denoising.group_mesh import GroupError, form, leave
from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberResult
from gpu_worker.denoising.running_batch import RunningBatch
from gpu_worker.engine import SamplerEngine
from gpu_worker.group import engines
from gpu_worker.group.engines import GroupEngine
from gpu_worker.group.follower import follow_commands, follower_engine
from services.config.workers import GroupSettings
from services.generation import GenerationParams
from services.models import speed
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.models.video_tiles import set_tile_size

CPU = torch.device("cpu")
# The steps each job (by prompt) was previewed at, on the leader.
PREVIEWS: dict[str, list[int]] = {}


def main() -> None:
    torch.set_num_threads(1)
    # A test's compile backend: the graphs dynamo traces, run as traced (no code generated).
    speed.COMPILE_BACKEND = "aot_eager"
    script = pickle.loads(Path(sys.argv[1]).read_bytes())
    rank = int(sys.argv[2])
    mesh = form(GroupSettings(size=script["size"], rank=rank, address=script["address"]), CPU)
    registry = ModelRegistry.load(script["registry"])
    dirs = {name: Path(path) for name, path in script.get("adapters", {}).items()}
    library = AdapterLibrary(lambda use: dirs[use.name])
    if rank > 0:
        follower = SamplerEngine(registry, Path(script["models_dir"]), CPU, adapters=library)
        footprints = Path(f"{script['out']}.rank{rank}")
        _misbehave(follower, footprints)
        follow_commands(follower, follower_engine(follower, mesh))
        leave()
        footprints.write_bytes(pickle.dumps(follower.footprints()))
        return
    stall_s = script.get("stall_after_s", 60.0)
    leader = GroupEngine(registry, Path(script["models_dir"]), CPU, mesh=mesh, adapters=library, stall_after_s=stall_s)
    leader.start_watchdog()
    graphs: dict[str, int] = {}  # the graphs dynamo traced on the leader, by batch (its model's loading included)
    outcomes: dict[str, object] = {"served": leader.served_models(), "graphs": graphs}
    for label, batch in script["batches"]:
        if batch.get("stuck"):  # its outcomes so far kept: the watchdog ends this process
            outcomes.update(previews=PREVIEWS, footprints=leader.footprints())
            Path(script["out"]).write_bytes(pickle.dumps(outcomes))
        traced = counters["stats"]["unique_graphs"]
        try:
            outcomes[label] = _decode(leader, batch["decode"]) if "decode" in batch else _run(leader, batch)
        except GroupError as exc:
            outcomes[label] = _plain(exc)
        graphs[label] = counters["stats"]["unique_graphs"] - traced
    outcomes.update(previews=PREVIEWS, footprints=leader.footprints())
    leader.close()
    leave()
    Path(script["out"]).write_bytes(pickle.dumps(outcomes))


def _misbehave(follower: SamplerEngine, footprints: Path) -> None:
    """A batch whose first job's prompt begins "stuck" stalls the follower as if inside
    a collective (alive, never answering); one whose prompt begins "dies" ends it as a
    crash would, its leader waiting in the batch's first collective. Its footprints
    are kept first."""
    sample_batch = follower.sample_batch

    def misbehaving(members: Sequence[BatchMember], *args: Any, **kwargs: Any) -> list[MemberResult]:
        prompt = members[0].params.prompt
        if prompt.startswith(("stuck", "dies")):
            footprints.write_bytes(pickle.dumps(follower.footprints()))
            if prompt.startswith("dies"):
                os._exit(9)
            time.sleep(3600)
        return sample_batch(members, *args, **kwargs)

    follower.sample_batch = misbehaving  # type: ignore[method-assign]


def _decode(leader: GroupEngine, decode: dict[str, Any]) -> dict[str, object]:
    """A video decoded as the group's sampler decodes it (``share_tiles``) with tiles
    of ``tile`` pixels: its frames, and the tiles this rank decoded itself."""
    vaes = VaeDecoderEngine(leader.registry, leader.models_dir, CPU, tile_above_pixels=decode["tile"] ** 2)
    vaes.share_tiles = leader.share_tiles
    set_tile_size(vaes.load(decode["model"]), decode["tile"])
    here: list[object] = []
    decode_tiles = engines.decode_tiles

    def counted(vae: Any, z: torch.Tensor, grid: Any, tiles: Sequence[Any]) -> Any:
        here.extend(tiles)
        return decode_tiles(vae, z, grid, tiles)

    engines.decode_tiles = counted
    try:
        [video] = vaes.decode_images(decode["model"], decode["latents"])
    finally:
        engines.decode_tiles = decode_tiles
    return {"frames": video.pixels, "tiled": video.tiled, "here": here}


def _run(leader: GroupEngine, batch: dict[str, Any]) -> dict[str, object]:
    """A batch of jobs, each one's outcome by its prompt. A job is its params, or a
    dict of ``params`` and: ``stop_at`` (a step after which it is stopped),
    ``suspend`` (stopped, it suspends), ``resume`` (a checkpoint). ``join``: jobs
    offered to the running batch after its second step; ``preview_at``: the steps
    it is previewed at (``PREVIEWS``)."""
    outcomes: dict[str, object] = {}
    members = [_member(job) for job in batch["jobs"]]
    joiners = [_member(job) for job in batch.get("join", [])]
    if not joiners:
        results = leader.sample_batch(members)
        return {m.params.prompt: _plain(r) for m, r in zip(members, results, strict=True)}

    def offer(step: int, total: int) -> None:
        if step == 2:
            running.offer(joiners)

    members[0] = replace(members[0], on_step=offer)
    running = RunningBatch(
        members[0].params.join_key,
        8,
        members,
        lambda cohort: outcomes.update((m.params.prompt, _plain(r)) for m, r in cohort),
    )
    running.begin()
    leader.sample_batch(members, running)
    return outcomes


def _member(job: GenerationParams | dict[str, Any]) -> BatchMember:
    spec: dict[str, Any] = job if isinstance(job, dict) else {"params": job}
    stop = threading.Event()
    stop_at = spec.get("stop_at")

    def on_step(step: int, total: int) -> None:
        if step == stop_at:
            stop.set()

    suspends = bool(spec.get("suspend"))
    previews = PREVIEWS.setdefault(spec["params"].prompt, [])
    return BatchMember(
        spec["params"],
        on_step,
        stop,
        resume=spec.get("resume"),
        suspend=lambda: suspends,
        preview_at=frozenset(spec.get("preview_at", ())),
        on_preview=lambda step, total, latents: previews.append(step),
    )


def _plain(result: object) -> object:
    """Picklable: latents, a suspension's checkpoint, or what ended it, in words."""
    if isinstance(result, torch.Tensor | JobSuspended):
        return result if isinstance(result, torch.Tensor) else result.checkpoint
    return f"{type(result).__name__}: {result}"


if __name__ == "__main__":
    main()
