"""How long a compiled model takes to load: its network compiled whole (one graph per
batch bucket and guidance mode) against regional compilation (each repeated block
compiled once, shared by every block of its class and shapes: ``speed.REGIONS``,
the default), issue 45's first item.

    python bench/compile_time.py                          # the miniatures, inductor, on the CPU
    python bench/compile_time.py --backend aot_eager      # tracing alone, no code generated
    python bench/compile_time.py --models tiny --device cuda --max-batch 8
    python bench/compile_time.py --smoke                  # CI's check that it still runs
    python bench/compile_time.py --fleet                  # and each compiled from the fleet's cache

Each model loads through ``SamplerEngine`` exactly as a sampler loads it with
``compile = true``: its network compiled and warmed up for each batch bucket up to
``--max-batch``, guided and not. What is timed is that load (weights, compilation and
warm-up), from a fresh compiler cache (``torch._dynamo.reset()``; inductor's own
on-disk cache is pointed at an empty directory each time), and the graphs the
compiler was handed are counted. "Whole" is today's full-graph compile of the
network, forced by finding it no regions. Nothing here is a test; the times move
with the machine, the counts do not.

``--fleet`` (inductor only) then times issue 45's second item: each model's
regional compilation in a sampler process of its own with an empty compiler cache,
twice, sharing a real model store (seaweedfs, started here): the first compiles and
shares its artifacts, the second (as on another host) loads them first
(``bench/support/compiled_load.py``). It prints each one's compilation seconds and
the graphs inductor generated code for (its graph cache's misses)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gpu_worker.engine import SamplerEngine
from services.models import speed
from services.models.builtins import BUILTINS, builtin_dir, ensure_builtin
from services.models.registry import ModelRegistry

MODELS = ("tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image")
# The smallest to trace: dynamo takes 45 s over the tiny UNet on two cores, 5 s over tiny-flux.
SMOKE = {"models": "tiny-flux", "backend": "aot_eager", "max_batch": 1}


class Counting:
    """A compile backend that counts the graphs it is handed, then compiles them with ``backend``."""

    def __init__(self, backend: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.backend = lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return self.backend(graph, example_inputs)


def load_seconds(
    model: str, models_dir: Path, device: torch.device, max_batch: int, backend: str, whole: bool
) -> tuple[float, int]:
    """Seconds to load ``model`` compiled (whole or by regions), and the graphs compiled."""
    import torch._dynamo

    spec = replace(ModelRegistry.load().get(model), compile=True, max_batch=max_batch, adapter_slots=0)
    torch._dynamo.reset()
    counting = Counting(backend)
    speed.COMPILE_BACKEND = counting  # type: ignore[assignment]
    regions = speed.compile_regions
    if whole:
        speed.compile_regions = lambda module, **kwargs: 0  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # nothing compiled before is reused
            engine = SamplerEngine(ModelRegistry({model: spec}), models_dir, device)
            began = time.perf_counter()
            engine.load(model)
            return time.perf_counter() - began, counting.graphs
    finally:
        speed.compile_regions = regions  # type: ignore[assignment]


def fleet_loads(
    model: str, models_dir: Path, max_batch: int, device: torch.device, store_env: dict[str, str], tmp: Path
) -> list[dict]:
    """Two cold loads of ``model`` in processes of their own, each with an empty
    compiler cache, sharing the store of ``store_env``: what each printed."""
    script = Path(__file__).resolve().parent / "support" / "compiled_load.py"
    loads = []
    for i in range(2):
        env = {**os.environ, **store_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"{model}-{i}")}
        command = [sys.executable, str(script), str(models_dir), model, "--max-batch", str(max_batch)]
        command += ["--device", str(device)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{model}: a load failed:\n{proc.stderr[-4000:]}")
        loads.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return loads


def fleet_table(models: list[str], models_dir: Path, max_batch: int, device: torch.device) -> None:
    from services.mesh.secrets import compile_signing_key
    from services.ops.model_store import EmbeddedModelStore

    print("\nRegional compilation, cold and from the fleet's compile cache (a process each, empty compiler caches):\n")
    print("| model | cold s | from the fleet's cache s | cached / cold | graphs generated cold | from the cache |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        store = EmbeddedModelStore(Path(tmp) / "store")
        store.start()
        key = compile_signing_key(Path(tmp))  # the samplers' (services.models.compile_record)
        sampler_env = {**store.sampler_env(), "DARKROOM_COMPILE_SIGNING_KEY_FILE": str(key)}
        try:
            for model in models:
                cold, cached = fleet_loads(model, models_dir, max_batch, device, sampler_env, Path(tmp))
                if (cold["result"], cached["result"]) != ("miss", "fleet"):
                    raise SystemExit(f"{model}: the fleet's cache gave {cold['result']}, then {cached['result']}")
                misses = [load["inductor"].get("fxgraph_cache_miss", 0) for load in (cold, cached)]
                print(
                    f"| {model} | {cold['compile_s']:.1f} | {cached['compile_s']:.1f} | "
                    f"{cached['compile_s'] / cold['compile_s']:.2f} | {misses[0]} | {misses[1]} |"
                )
        finally:
            store.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--models-dir", help="where the models are built (default: a temporary directory)")
    parser.add_argument("--fleet", action="store_true", help="also cold against the fleet's cache (inductor)")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    device = torch.device(args.device)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        models_dir = Path(args.models_dir or scratch)
        registry = ModelRegistry.load()
        for model in models:
            source = registry.get(model).source
            ensure_builtin(BUILTINS[source], builtin_dir(models_dir, source))
        print(f"Loads with compile = true, buckets up to {args.max_batch}, {args.backend} on {device}:\n")
        print("| model | backend | whole s | regional s | regional / whole | graphs whole | graphs regional |")
        print("|---|---|---|---|---|---|---|")
        for model in models:
            whole_s, whole_graphs = load_seconds(model, models_dir, device, args.max_batch, args.backend, True)
            regional_s, regional_graphs = load_seconds(model, models_dir, device, args.max_batch, args.backend, False)
            print(
                f"| {model} | {args.backend} | {whole_s:.1f} | {regional_s:.1f} | {regional_s / whole_s:.2f} | "
                f"{whole_graphs} | {regional_graphs} |"
            )
        if args.fleet:
            fleet_table(models, models_dir, args.max_batch, device)


if __name__ == "__main__":
    main()
