"""Parallel models on groups (docs/parallel.md): one job across N devices against one
device, through the sampler's own engines (a ``GroupEngine`` leading, followers
following, each rank a process); and, in the simulator, the seeds' box with and
without a group.

    python bench/parallel.py --case flux-dev-1024        # GPU: 1, 2 and 4 GPUs (--models-dir DIR)
    python bench/parallel.py --case wan14b-480p          # GPU: 4 and 8 GPUs (DARKROOM_BENCH_WAN14B)
    python bench/parallel.py --case group-of-one         # GPU: a group of one against a plain sampler
    python bench/parallel.py --case qwen-image-1328-tensor2   # GPU: Qwen-Image's weights sharded on 2
    python bench/parallel.py --simulate [--seeds N]      # the seeds' box, one GPU a video or four
    python bench/parallel.py --smoke                     # CPU, gloo: 2 and 4 ranks, the miniatures

Per run it prints, per model and group: seconds a step (the median of ``--rounds``
jobs after a warm-up), the speed-up over one device, (on a CPU) how far the
group's latents are from one device's, and for a video its decode in tiles, shared
out across the group's ranks against one device's (the same video). A group of one is a group formed of one
rank: its own cost (the leader's boundary broadcasts) against a plain sampler.
The same inputs print the same tables, but for the measured times."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.models.parallel import SINGLE, Parallelism
from services.models.parallel_miniatures import twin_name
from services.models.registry import ModelRegistry
from services.ops.processes import free_port


@dataclass(frozen=True)
class Case:
    model: str  # a registry model (its parallel twins are made here)
    width: int
    height: int
    steps: int
    frames: int = 1
    # Per run: (devices, shape); devices 0 is a plain sampler, no group.
    runs: tuple[tuple[int, Parallelism], ...] = ()
    source: str = ""  # an environment variable naming a model directory, if the registry's is not it
    tile: int = 0  # a video's VAE tiles, pixels a side (0: the VAE's own); its decode is timed tiled


SEQ = Parallelism
CASES: dict[str, Case] = {
    "flux-dev-1024": Case("flux1-dev-random", 1024, 1024, 28, runs=((0, SINGLE), (2, SEQ(2)), (4, SEQ(4)))),
    "wan14b-480p": Case(
        "wan-random", 832, 480, 40, 81, runs=((4, SEQ(4)), (8, SEQ(8))), source="DARKROOM_BENCH_WAN14B"
    ),
    "group-of-one": Case("flux1-dev-random", 1024, 1024, 28, runs=((0, SINGLE), (1, SINGLE))),
    # Split by heads (diffusers' plan, docs/parallel.md): weights and compute split.
    "qwen-image-1328-tensor2": Case("qwen-image-random", 1328, 1328, 50, runs=((0, SINGLE), (2, SEQ(tensor=2)))),
    # Sharded by blocks on two (a split sequence shards by blocks), the sequence split on two: four cards.
    "qwen-image-1328-sequence2-tensor2": Case(
        "qwen-image-random", 1328, 1328, 50, runs=((0, SINGLE), (4, SEQ(sequence=2, tensor=2)))
    ),
}
# Each shape's path once (the video's product of sequence and guidance splits covers
# both; its groups' processes are most of the smoke's time).
SMOKE_CASES = (
    Case("tiny-flux", 128, 128, 4, runs=((0, SINGLE), (2, SEQ(2)), (2, SEQ(tensor=2)))),
    Case("tiny-wan", 64, 64, 4, 9, runs=((0, SINGLE), (4, SEQ(2, 2))), tile=32),
)


def registry_for(case: Case) -> ModelRegistry:
    """The case's model, and a twin of it for each shape it runs as."""
    base = ModelRegistry.load(presets=None).get(case.model)
    if case.source and os.environ.get(case.source):
        base = replace(base, source=os.environ[case.source])
    models = {case.model: base}
    for _, shape in case.runs:
        if shape.grouped:
            name = twin_name(case.model, shape)
            models[name] = replace(base, name=name, parallel=shape)
    return ModelRegistry(models)


def rank_main(case: Case, devices: int, shape: Parallelism, rank: int, address: str, rounds: int, out: str) -> None:
    """One rank of a run (devices 0: a plain sampler, alone)."""
    import torch

    from gpu_worker.denoising.group_mesh import form, leave
    from gpu_worker.engine import SamplerEngine
    from gpu_worker.group.engines import GroupEngine
    from gpu_worker.group.follower import follow_commands, follower_engine
    from services.config.workers import GroupSettings
    from services.generation import GenerationParams

    torch.set_num_threads(1) if not torch.cuda.is_available() else None
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    registry, models_dir = registry_for(case), Path(os.environ.get("DARKROOM_MODELS_DIR", "models"))
    model = twin_name(case.model, shape) if shape.grouped else case.model
    if devices == 0:
        engine: SamplerEngine = SamplerEngine(registry, models_dir, device)
    else:
        mesh = form(GroupSettings(size=devices, rank=rank, address=address), device)
        if rank > 0:
            follower = SamplerEngine(registry, models_dir, device)
            follow_commands(follower, follower_engine(follower, mesh))
            leave()
            return
        engine = GroupEngine(registry, models_dir, device, mesh=mesh)
    params = GenerationParams(
        model,
        "a lighthouse at dusk",
        "",
        case.width,
        case.height,
        case.steps,
        3.5,
        7,
        1,
        frames=case.frames,
        fps=16.0 if case.frames > 1 else 0.0,
    )
    engine.warm_up(model)
    seconds, latents = [], None
    for _ in range(rounds):
        began = time.perf_counter()
        latents = engine.sample(params, lambda step, total: None, threading.Event())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - began)
    found = {"step_s": statistics.median(seconds) / case.steps, "latents": latents}
    if case.frames > 1:
        found["decode_s"] = decode_seconds(case, engine, model, latents, rounds)
    if isinstance(engine, GroupEngine):
        engine.close()
        leave()
    Path(out).write_bytes(pickle.dumps(found))


def decode_seconds(case: Case, engine: Any, model: str, latents: Any, rounds: int) -> float:
    """A video's decode in tiles (the median of ``rounds`` after a warm-up): a group's
    shared out across its ranks (``share_tiles``), one device's alone. The same video."""
    import torch

    from gpu_worker.group.engines import GroupEngine
    from services.models.vae import VaeDecoderEngine
    from services.models.video_tiles import set_tile_size

    vaes = VaeDecoderEngine(engine.registry, engine.models_dir, engine.device, tile_above_pixels=1)
    if isinstance(engine, GroupEngine):
        vaes.share_tiles = engine.share_tiles
    if case.tile:
        set_tile_size(vaes.load(model), case.tile)
    video = latents.reshape(1, *latents.shape[-4:])
    seconds = []
    for _ in range(rounds + 1):
        began = time.perf_counter()
        vaes.decode_images(model, video)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds[1:])


def run(case: Case, devices: int, shape: Parallelism, rounds: int) -> dict[str, Any]:
    """One run's ranks, each a process; the leader's figures."""
    import torch

    from services.models.sources import resolve_source

    # Built (a miniature) or fetched here once, not by every rank at once.
    resolve_source(registry_for(case).get(case.model), Path(os.environ.get("DARKROOM_MODELS_DIR", "models")))
    # Forked on a CPU (its imports done once); spawned on GPUs, where a fork inherits a CUDA context.
    context: Any = multiprocessing.get_context("spawn" if torch.cuda.is_available() else "fork")
    with tempfile.TemporaryDirectory(prefix="darkroom-parallel-") as tmp:
        out, address = str(Path(tmp) / "out.pkl"), f"127.0.0.1:{free_port()}"
        ranks = [
            context.Process(target=rank_main, args=(case, devices, shape, r, address, rounds, out))
            for r in range(max(devices, 1))
        ]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join()
        codes = [p.exitcode for p in ranks]
        if codes != [0] * len(ranks):
            raise SystemExit(f"{case.model} on {devices} ({shape.describe()}): ranks exited {codes}")
        found: dict[str, Any] = pickle.loads(Path(out).read_bytes())
        return found


def bench_cases(cases: tuple[Case, ...], rounds: int) -> None:
    print(
        "| model | size | steps | frames | devices | shape | s/step | speed-up | max diff from one "
        "| decode s (tiled) | decode speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        alone: dict[str, Any] | None = None
        for devices, shape in case.runs:
            found = run(case, devices, shape, rounds)
            alone = found if devices == 0 else alone
            speedup = f"{alone['step_s'] / found['step_s']:.2f}x" if alone is not None else "-"
            diff = (found["latents"] - alone["latents"]).abs().max().item() if alone is not None else float("nan")
            size = f"{case.width}x{case.height}"
            label = "one (plain)" if devices == 0 else str(devices)
            decode, decode_speedup = "-", "-"
            if "decode_s" in found:
                decode = f"{found['decode_s']:.3f}"
                if alone is not None and "decode_s" in alone:
                    decode_speedup = f"{alone['decode_s'] / found['decode_s']:.2f}x"
            print(
                f"| {case.model} | {size} | {case.steps} | {case.frames} | {label} | {shape.describe()} | "
                f"{found['step_s']:.4f} | {speedup} | {diff:.1e} | {decode} | {decode_speedup} |",
                flush=True,
            )


def simulate(seeds: int, loads: tuple[float, ...], duration_s: float | None = None) -> None:
    """The seeds' box with a group of four against the same seven cards single."""
    from scheduler.simulator import scenario as scenarios
    from scheduler.simulator import trace as traces
    from scheduler.simulator.engine import Simulation
    from scheduler.simulator.policies import POLICIES
    from scheduler.simulator.report import median, summarize

    grouped = scenarios.load(scenarios.DEFAULT_SCENARIO.with_name("groups_scenario.toml"))
    if duration_s is not None:
        grouped = replace(grouped, duration_s=duration_s)
    layouts = {"3 single + a group of 4": grouped, "7 single": ungrouped(grouped)}
    print("| load | layout | video p50 s | video p99 s | image p99 s | utilisation |")
    print("|---|---|---|---|---|---|")
    for load in loads:
        for name, sc in layouts.items():
            rows = []
            for seed in range(grouped.seed, grouped.seed + seeds):
                seeded = replace(sc, seed=seed)
                trace = traces.trace(replace(grouped, seed=seed), load)  # the same jobs for both layouts
                rows.append(summarize(Simulation(seeded, POLICIES["darkroom"](seeded), trace, load=load).run()))
            video = [r.latency.get("video", (float("nan"),) * 3) for r in rows]
            image = [r.p99("image") for r in rows]
            print(
                f"| {load:.2f} | {name} | {median(v[0] for v in video):.1f} | {median(v[2] for v in video):.1f} | "
                f"{median(image):.1f} | {median(r.utilisation for r in rows):.2f} |",
                flush=True,
            )


def ungrouped(sc: Any) -> Any:
    """``sc`` with each group broken up into single cards (placement as before groups)."""
    from scheduler.simulator.scenario import SimGpu

    gpus: list[SimGpu] = []
    for gpu in sc.gpus:
        first = int(gpu.id.removeprefix("gpus").split("-")[0]) if gpu.gpus > 1 else 0
        gpus += [replace(gpu, id=f"gpu{first + i}", gpus=1) for i in range(gpu.gpus)] if gpu.gpus > 1 else [gpu]
    return replace(sc, gpus=tuple(gpus))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="a GPU case (repeatable)")
    parser.add_argument("--simulate", action="store_true", help="the seeds' box with and without a group")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo: the miniatures, and a short simulation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", default="models", help="where models are built or found (default: ./models)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    began = time.perf_counter()
    os.environ["DARKROOM_MODELS_DIR"] = args.models_dir
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="darkroom-parallel-models-") as models:
            os.environ["DARKROOM_MODELS_DIR"] = models
            bench_cases(SMOKE_CASES, rounds=1)
        simulate(seeds=1, loads=(0.35,), duration_s=600.0)
    else:
        if args.case:
            bench_cases(tuple(CASES[c] for c in args.case), args.rounds)
        if args.simulate:
            simulate(args.seeds, (0.2, 0.35, 0.5, 0.7))
    print(f"took {time.perf_counter() - began:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
