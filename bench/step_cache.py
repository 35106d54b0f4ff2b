"""What step caching buys and costs (issue 45): the same batch of ``--batch`` jobs
(one image each, their own prompts and seeds) uncached and at each ``--thresholds``
value of the model's ``step_cache``, in images per second through ``SamplerEngine``
as a worker runs it, and how far each cached image moved from its uncached one once
decoded: PSNR and the largest pixel difference (0-255).

    python bench/step_cache.py                       # the miniatures on the CPU
    python bench/step_cache.py --models sdxl-random --size 1024 --steps 30 --device cuda
    python bench/step_cache.py --models flux1-dev-random --size 1024 --steps 28 --rounds 2 --device cuda
    python bench/step_cache.py --smoke               # CI's check that it still runs
    python bench/step_cache.py --threads 1           # on a CPU shared with other work

The threshold is swapped in the engine's registry between runs, the loaded network
kept: step caching changes the loop, never the network. Each setting runs once to
warm up, then the settings alternate for ``--rounds`` rounds, so that drift hits
them alike; each figure is the median round, and every round must repeat its
warm-up's latents. On a CPU the engine runs each member alone, on a GPU one fused
call per step for the members that compute. The miniatures' weights are random and
the real-size presets' too: the drift is that of such networks, a measure of the
mechanism, not of a trained model's images. Nothing here is a test."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine

PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 1234
MINIATURES = "tiny,tiny-sd3,tiny-flux,tiny-qwen-image,tiny-z-image"
SMOKE = {"models": "tiny", "size": 64, "steps": 6, "batch": 2, "rounds": 1, "thresholds": "0.1", "device": "cpu"}


def requests(model: str, size: int, steps: int, guidance: float, n: int) -> list[GenerationParams]:
    return [GenerationParams(model, f"{PROMPT}, {i}", "", size, size, steps, guidance, SEED + i, 1) for i in range(n)]


def run_batch(engine: SamplerEngine, batch: Sequence[GenerationParams]) -> tuple[float, list[torch.Tensor], int]:
    """Seconds, each member's latents, and the cached steps of them all."""
    cached: list[int] = []
    members = [BatchMember(p, _no_step, threading.Event(), on_cached_steps=cached.append) for p in batch]
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = engine.sample_batch(members)
    if cuda:
        torch.cuda.synchronize()
    took = time.perf_counter() - started
    for r in results:
        if not isinstance(r, torch.Tensor):
            raise SystemExit(f"a member failed: {r!r}")
    return took, [r for r in results if isinstance(r, torch.Tensor)], sum(cached)


def _no_step(step: int, total: int) -> None:
    pass


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def bench_model(args: argparse.Namespace, model: str, models_dir: Path, device: torch.device) -> list[str]:
    registry = ModelRegistry.load(args.registry, presets=None)
    spec = replace(registry.get(model), max_batch=max(registry.get(model).max_batch, args.batch))
    engine = SamplerEngine(ModelRegistry({model: spec}), models_dir, device)
    decoder = VaeDecoderEngine(ModelRegistry({model: spec}), models_dir, device)
    size = args.size or spec.default_width
    batch = requests(model, size, args.steps, spec.default_guidance, args.batch)
    thresholds = [0.0, *(float(t) for t in args.thresholds.split(","))]

    def run(threshold: float) -> tuple[float, list[torch.Tensor], int]:
        engine.registry.models[model] = replace(spec, step_cache=threshold)
        return run_batch(engine, batch)

    warm = {t: run(t) for t in thresholds}
    seconds: dict[float, list[float]] = {t: [] for t in thresholds}
    for _ in range(args.rounds):
        for t in thresholds:
            took, latents, _ = run(t)
            seconds[t].append(took)
            if not all(torch.equal(a, b) for a, b in zip(latents, warm[t][1], strict=True)):
                raise SystemExit(f"{model} at step_cache={t}: a round's latents differ from its warm-up's")
    pixels = {t: [decoder.decode_images(model, z)[0].pixels for z in warm[t][1]] for t in thresholds}
    base = statistics.median(seconds[0.0])
    rows = []
    for t in thresholds:
        took = statistics.median(seconds[t])
        pairs = list(zip(pixels[t], pixels[0.0], strict=True))
        scores = [psnr(a, b) for a, b in pairs]
        worst = max(int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in pairs)
        rows.append(
            f"| {model} | {size} | {args.steps} | {args.batch} | {t:g} | {args.batch / took:.3f} | {base / took:.2f}x "
            f"| {warm[t][2] / args.batch:.1f} | {min(scores):.1f} | {worst} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", help="a registry file (default: the default registry)")
    parser.add_argument("--models", default=MINIATURES, help="comma-separated model names")
    parser.add_argument("--size", type=int, default=0, help="width and height (default: each model's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="members, one image each")
    parser.add_argument("--thresholds", default="0.05,0.1,0.2", help="step_cache values beside uncached (0)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (default: its own)")
    parser.add_argument("--models-dir", help="where builtin models are built (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help=f"CI's quick check: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"step caching on {device}, median of {args.rounds} rounds; PSNR: the worst member's")
    print("| model | size | steps | batch | step_cache | img/s | speed-up | cached steps per image ", end="")
    print("| PSNR dB | max pixel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="darkroom-bench-") as scratch:
        models_dir = Path(args.models_dir or scratch)
        for model in args.models.split(","):
            for row in bench_model(args, model, models_dir, device):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
