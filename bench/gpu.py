"""The GPU services measured: a bare diffusers loop versus the same work through the
whole stack (gateway, scheduler, JetStream, PostgreSQL, one sampler, one decoder),
at several batch sizes.

    python bench/gpu.py                 # on a GPU: SD 1.5 at 512 px, 20 steps; SDXL at 1024 px, 30 steps
    python bench/gpu.py --device cpu    # on a CPU: small sizes (the tiny model, SD 1.5 at 128 px)

The models are the real architectures with random weights (``sd15-random``,
``sdxl-random``: the default registry's on-request presets, which the bench's stack
serves through DARKROOM_PRESETS), built once into the data directory.
Through the stack, each round submits ``batch`` jobs of one shape at once (seeds
differ), so the sampler runs them as one batch; the bare loop runs the same
images as one pipeline call. Both include the VAE decode. Columns:

- images/s and s/image, bare and through the stack, and their ratio;
- peak GPU memory of the bare loop (``torch.cuda.max_memory_allocated``), and of
  the sampler through the stack (NVML's used memory in its heartbeats);
- the sampler's time per image spent on decoding: decoding locally (the VAE on
  the sampler's device, as in the bare loop) versus shipping latents to the
  decoder service (serializing them for the request), which is all the sampler
  does with a remote decoder.

Nothing here is a test; it prints a table for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from services.models.registry import ModelFamily, ModelRegistry, resolve_source


@dataclass(frozen=True)
class Case:
    model: str
    size: int
    steps: int


GPU_CASES = (Case("sd15-random", 512, 20), Case("sdxl-random", 1024, 30))
CPU_CASES = (Case("tiny", 128, 10), Case("sd15-random", 128, 4))
PROMPT = "a lighthouse on a cliff at dusk, oil painting"


@dataclass(frozen=True)
class Bare:
    images_per_s: float
    peak_bytes: int
    decode_s_per_image: float  # the VAE on the sampler's device
    ship_s_per_image: float  # serializing latents for the decoder service


@dataclass(frozen=True)
class Through:
    images_per_s: float
    peak_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_loop(case: Case, batches: tuple[int, ...], device: torch.device, rounds: int, models: Path) -> dict[int, Bare]:
    from diffusers import DiffusionPipeline

    from gpu_worker.decoders import decode_request

    spec = ModelRegistry.load(presets=None).get(case.model)
    source, kwargs = resolve_source(spec, models)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    extra = {"safety_checker": None, "requires_safety_checker": False} if spec.family != ModelFamily.SDXL else {}
    pipe = DiffusionPipeline.from_pretrained(source, torch_dtype=dtype, **kwargs, **extra).to(device)
    pipe.set_progress_bar_config(disable=True)
    results = {}
    for batch in batches:
        _sample(pipe, case, batch, 0, device)  # warm-up: kernels, allocator
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        started = time.perf_counter()
        decode_s = ship_s = 0.0
        for r in range(rounds):
            latents = _sample(pipe, case, batch, 1000 * (r + 1), device)
            _sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample.float().cpu()
            _sync(device)
            t1 = time.perf_counter()
            job = _job(case, batch)
            decode_request([(job, latents)], [None])
            t2 = time.perf_counter()
            decode_s += t1 - t0
            ship_s += t2 - t1
        took = time.perf_counter() - started - ship_s
        images = batch * rounds
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        results[batch] = Bare(images / took, peak, decode_s / images, ship_s / images)
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _sample(pipe: Any, case: Case, batch: int, seed: int, device: torch.device) -> torch.Tensor:
    generators = [torch.Generator(device).manual_seed(seed + i) for i in range(batch)]
    with torch.inference_mode():
        return pipe(
            prompt=[PROMPT] * batch,
            width=case.size,
            height=case.size,
            num_inference_steps=case.steps,
            generator=generators,
            output_type="latent",
        ).images


def _job(case: Case, batch: int) -> Any:  # a JobRecord-shaped stand-in for decode_request
    from types import SimpleNamespace

    return SimpleNamespace(model=case.model, id="bench", output_format="png", num_images=batch)


def through_stack(
    cases: tuple[Case, ...], batches: tuple[int, ...], device: torch.device, rounds: int, data: Path
) -> dict[tuple[str, int], Through]:
    from services.config.sections import Settings
    from services.ops.stack import LocalStack
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
    from tests.helpers import stub

    settings = Settings.from_env(
        {
            "DARKROOM_DATA_DIR": str(data),
            "DARKROOM_GATEWAY_PORT": "0",
            "DARKROOM_DEVICE": device.type,
            "DARKROOM_PRELOAD_MODELS": ",".join(sorted({c.model for c in cases})),
            "DARKROOM_PRESETS": ",".join(sorted({c.model for c in cases} - set(ModelRegistry.load().models))),
            "DARKROOM_BATCH_WAIT_MS": "50",
            "DARKROOM_LOG_LEVEL": "WARNING",
        }
    )
    stack = LocalStack(settings, cpu_workers=1, decoders=1, durable=False)
    results = {}
    stack.start(timeout=1800)
    try:
        client = stub(stack)
        with ThreadPoolExecutor(max(batches)) as pool:
            for case in cases:
                for batch in batches:
                    _stack_round(client, pool, case, batch, 0)  # warm-up
                    started = time.perf_counter()
                    peak = 0
                    for r in range(rounds):
                        _stack_round(client, pool, case, batch, 1000 * (r + 1))
                        stats = client.GetStats(pb.GetStatsRequest()).workers
                        peak = max([peak] + [w.vram_used_bytes for w in stats if w.kind == "sampler"])
                    took = time.perf_counter() - started
                    results[(case.model, batch)] = Through(batch * rounds / took, peak)
    finally:
        stack.stop()
    return results


def _stack_round(client: Any, pool: ThreadPoolExecutor, case: Case, batch: int, seed: int) -> None:
    """``batch`` jobs of one shape submitted at once, waited for to the end."""
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
    from tests.helpers import wait_terminal

    requests = [
        pb.SubmitJobRequest(
            model=case.model, prompt=PROMPT, width=case.size, height=case.size, steps=case.steps, seed=seed + i
        )
        for i in range(batch)
    ]
    for reply in list(pool.map(client.SubmitJob, requests)):
        job = wait_terminal(client, reply.job_id, timeout=1800)
        assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per batch size (default: 5 on a GPU, 2 on a CPU)")
    parser.add_argument(
        "--data-dir", default="", help="where models are built and the stack runs (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    cases, batches = (GPU_CASES, (1, 2, 4, 8)) if gpu else (CPU_CASES, (1, 2, 4))
    rounds = args.rounds or (5 if gpu else 2)
    data = Path(args.data_dir or tempfile.mkdtemp(prefix="darkroom-bench-"))
    models = data / "models"
    what = torch.cuda.get_device_name(device) if gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {what}; {rounds} rounds per batch size; models in {models}")

    bare = {}
    for case in cases:
        for batch, result in bare_loop(case, batches, device, rounds, models).items():
            bare[(case.model, batch)] = result
    stack = through_stack(cases, batches, device, rounds, data)

    mib = 2**20
    print()
    print(
        "| model | size | steps | batch | bare img/s | bare s/img | stack img/s | stack s/img | stack/bare "
        "| peak MiB bare | peak MiB stack | decode on sampler, local ms/img | remote (ship latents) ms/img |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for batch in batches:
            b, s = bare[(case.model, batch)], stack[(case.model, batch)]
            print(
                f"| {case.model} | {case.size} | {case.steps} | {batch} | {b.images_per_s:.2f} | "
                f"{1 / b.images_per_s:.3f} | {s.images_per_s:.2f} | {1 / s.images_per_s:.3f} | "
                f"{s.images_per_s / b.images_per_s:.2f} | "
                f"{b.peak_bytes / mib:.0f} | {s.peak_bytes / mib:.0f} | "
                f"{1000 * b.decode_s_per_image:.1f} | {1000 * b.ship_s_per_image:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
