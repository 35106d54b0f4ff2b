"""Video through the stack against the bare pipeline: the same text-to-video job
(prompt, size, frames, steps, seed) run by diffusers' ``WanPipeline`` alone and
encoded to MP4, versus submitted through the whole stack (gateway, scheduler,
JetStream, PostgreSQL, one sampler, one decoder) and waited for to its stored MP4.

    python bench/media.py                 # on a GPU: wan-random (Wan 2.1 T2V 1.3B), 832x480, 81 frames, 30 steps
    python bench/media.py --device cpu    # on a CPU: tiny-wan, 64x64, 17 frames, 8 steps
    python bench/media.py --smoke         # CI's check that it still runs: the CPU case, one round

Prints seconds per video for each, their ratio, and the stack's stage durations
(queue, dispatch, sample, decode with encode, store) from the job's own timings.
Nothing here is a test; it prints a table for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from services.models.registry import ModelRegistry
from services.models.sources import resolve_source


@dataclass(frozen=True)
class Case:
    model: str
    width: int
    height: int
    frames: int
    steps: int
    fps: float


GPU_CASE = Case("wan-random", 832, 480, 81, 30, 16.0)
CPU_CASE = Case("tiny-wan", 64, 64, 17, 8, 8.0)
PROMPT = "waves breaking on a rocky shore at dusk"
SMOKE = {"device": "cpu", "rounds": 1}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare(case: Case, device: torch.device, rounds: int, models: Path) -> float:
    """Seconds per video: the pipeline (with its VAE decode), then the MP4 encode."""
    from diffusers import WanPipeline

    from services.models.video_encoding import encode_video

    spec = ModelRegistry.load(presets=None).get(case.model)
    source, kwargs = resolve_source(spec, models)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = WanPipeline.from_pretrained(source, torch_dtype=dtype, **kwargs).to(device)
    if device.type == "cuda":
        pipe.vae.to(torch.float32)  # as the decoder service runs it
    pipe.set_progress_bar_config(disable=True)
    took = []
    for r in range(rounds + 1):  # the first warms kernels and caches up
        _sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            frames = pipe(
                prompt=PROMPT,
                width=case.width,
                height=case.height,
                num_frames=case.frames,
                num_inference_steps=case.steps,
                generator=torch.Generator(device).manual_seed(r),
                output_type="np",
            ).frames[0]
        encode_video((frames * 255).round().clip(0, 255).astype("uint8"), "video/mp4", case.fps)
        took.append(time.perf_counter() - started)
    del pipe
    return sum(took[1:]) / rounds


def through_stack(case: Case, device: torch.device, rounds: int, data: Path) -> tuple[float, dict[str, float]]:
    """Seconds per video from submit to its stored MP4, and the mean stage durations."""
    from services.config.sections import Settings
    from services.ops.stack import LocalStack
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
    from tests.helpers import stub, wait_terminal

    presets = [] if case.model in ModelRegistry.load().models else [case.model]
    settings = Settings.from_env(
        {
            "DARKROOM_DATA_DIR": str(data),
            "DARKROOM_GATEWAY_PORT": "0",
            "DARKROOM_DEVICE": device.type,
            "DARKROOM_PRELOAD_MODELS": case.model,
            "DARKROOM_PRESETS": ",".join(presets),
            "DARKROOM_LOG_LEVEL": "WARNING",
        }
    )
    stack = LocalStack(settings, cpu_workers=1, decoders=1, durable=False)
    stack.start(timeout=3600)
    took, stages = [], []
    try:
        client = stub(stack)
        for r in range(rounds + 1):
            request = pb.SubmitJobRequest(
                model=case.model,
                prompt=PROMPT,
                width=case.width,
                height=case.height,
                frames=case.frames,
                fps=case.fps,
                steps=case.steps,
                seed=r,
                lane="paid",
            )
            started = time.perf_counter()
            job = wait_terminal(client, client.SubmitJob(request).job_id, timeout=3600)
            took.append(time.perf_counter() - started)
            assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
            stages.append(job.stage_durations)
    finally:
        stack.stop()
    names = ("queue", "schedule", "dispatch", "sample", "decode", "store")
    mean = {n: sum(getattr(s, f"{n}_seconds") for s in stages[1:]) / rounds for n in names}
    return sum(took[1:]) / rounds, mean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default="", help="where models are built and the stack runs (default: temp)")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    device = torch.device(args.device)
    case = GPU_CASE if device.type == "cuda" else CPU_CASE
    data = Path(args.data_dir or tempfile.mkdtemp(prefix="darkroom-media-"))
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {what}; {args.rounds} rounds after one warm-up; models in {data / 'models'}")
    if args.smoke and device.type != "cuda":
        print(f"smoke: the CPU case only; the GPU case ({GPU_CASE.model}) needs --device cuda")
    alone = bare(case, device, args.rounds, data / "models")
    stacked, stages = through_stack(case, device, args.rounds, data)
    print()
    print("| model | size | frames | steps | bare s/video | stack s/video | stack/bare | " + " | ".join(stages) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(stages))
    cells = " | ".join(f"{s:.3f}" for s in stages.values())
    print(
        f"| {case.model} | {case.width}x{case.height} | {case.frames} | {case.steps} | {alone:.3f} | "
        f"{stacked:.3f} | {stacked / alone:.2f} | {cells} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
