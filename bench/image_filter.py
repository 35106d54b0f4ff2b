"""What the image filter adds to the decoder's time per image: the decoder service's
own Decode (its batcher, the VAE, the PNG encoding and, with the filter on, open_nsfw
scoring every output in its own thread), fed by concurrent requests as samplers
feed it, with the filter off and on, rounds alternating.

    python bench/image_filter.py                 # SD 1.5's VAE (its real shape, random weights), 512 px, CPU
    python bench/image_filter.py --device cuda   # the same on a GPU, the classifier on it too
    python bench/image_filter.py --smoke         # CI's check that it still runs: the tiny VAE, 64 px, one round

Per image: the decoder's wall time with the filter off and on (images decoded over
the time from the first request to the last chunk, the median of the rounds), their
difference as a share of the time off (the issue's target: at most 5 % at 512 px on
the CPU; on a busy machine this difference is within the rounds' noise), and the
classifier's own time per image (its calls, timed, over the images it scored) as a
share of the decoder's time off: the bound of what it can add on a CPU. The
classifier runs in a thread beside the decode: on a GPU decoder on that GPU (a
torch module), its preprocessing on the host; on a CPU decoder by onnxruntime,
sharing the cores, so its CPU time is what it adds. A sampler is not involved: it
never runs the filter unless it decodes its own latents. Nothing here is a test; it prints a table for
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from services.config.safety import SafetySettings
from services.models.builtins import BUILTINS, ensure_builtin
from services.models.device import pick_device
from services.models.presets import VAE, save_module
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2
from services.safety.image_filter import load_image_filter
from services.safety.metrics import IMAGE_FILTER_IMAGES, IMAGE_FILTER_SECONDS
from vae_worker.decode_batches import DecodeBatcher
from vae_worker.output_checks import OutputChecks
from vae_worker.service import VaeDecoderServicer

SMOKE = {"device": "cpu", "size": 64, "images": 2, "rounds": 1, "model": "tiny"}


def sd15_vae(models: Path) -> Path:
    """SD 1.5's VAE alone (its real shape, random weights): what a decoder loads of
    ``sd15-random``, without building the rest of it."""
    path = models / "sd15-vae"
    if not (path / "vae" / "config.json").exists():
        from diffusers import AutoencoderKL

        torch.manual_seed(0)
        save_module(path / "vae", AutoencoderKL(**VAE, sample_size=512), torch.float16)
    return path


def registry(models: Path, model: str) -> ModelRegistry:
    where = models / "registry.toml"
    if model == "tiny":
        source = str(ensure_builtin(BUILTINS["builtin:tiny"], models / "tiny"))
        family = "tiny"
    else:
        source, family = str(sd15_vae(models)), "sd15"
    where.write_text(
        f'[models.{model}]\nsource = "{source}"\nfamily = "{family}"\nmax_width = 1024\nmax_height = 1024\n'
    )
    return ModelRegistry.load(where)


def request(model: str, size: int, seed: int, policy: str) -> vae_decoder_pb2.DecodeRequest:
    """One job's latents (one image), as a sampler sends them."""
    z = torch.randn(1, 4, size // 8, size // 8, generator=torch.Generator().manual_seed(seed))
    return vae_decoder_pb2.DecodeRequest(
        model=model,
        latents=z.numpy().astype("<f4").tobytes(),
        shape=list(z.shape),
        dtype="float32",
        jobs=[vae_decoder_pb2.DecodeJob(job_id=f"j{seed}", images=1, mime_type="image/png", output_policy=policy)],
    )


async def one_round(servicer: VaeDecoderServicer, model: str, size: int, images: int, policy: str) -> float:
    """Seconds per image: ``images`` one-image requests sent at once, until each has its last chunk."""

    async def decode(seed: int) -> None:
        async for chunk in servicer.Decode(request(model, size, seed, policy), None):  # type: ignore[arg-type]
            assert not chunk.error, chunk.error
            assert not policy or chunk.HasField("nsfw_score")

    began = time.perf_counter()
    await asyncio.gather(*(decode(seed) for seed in range(images)))
    return (time.perf_counter() - began) / images


def classifier_seconds() -> tuple[float, float]:
    """The classifier's seconds so far, and the images it scored."""
    samples = [
        s for metric in (*IMAGE_FILTER_SECONDS.collect(), *IMAGE_FILTER_IMAGES.collect()) for s in metric.samples
    ]
    found = {s.name: s.value for s in samples}
    return found["darkroom_image_filter_seconds_sum"], found["darkroom_image_filter_images_total"]


async def run(args: argparse.Namespace, models: Path) -> dict[str, Any]:
    device = pick_device(args.device)
    engine = VaeDecoderEngine(registry(models, args.model), models, device)
    batcher = DecodeBatcher(engine, wait_s=0.005, max_images=args.batch)
    image_filter = load_image_filter(SafetySettings(), device=device)
    assert image_filter is not None
    servicers = {"off": VaeDecoderServicer(batcher), "on": VaeDecoderServicer(batcher, OutputChecks(image_filter))}
    policies = {"off": "", "on": "flag"}
    await one_round(servicers["on"], args.model, args.size, args.batch, "flag")  # loads, warms both
    per_image: dict[str, list[float]] = {"off": [], "on": []}
    spent, scored = classifier_seconds()
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            per_image[mode].append(await one_round(servicers[mode], args.model, args.size, args.images, policies[mode]))
    seconds, images = classifier_seconds()
    off, on = statistics.median(per_image["off"]), statistics.median(per_image["on"])
    return {
        "off_ms": 1000 * off,
        "on_ms": 1000 * on,
        "filter_ms": 1000 * (seconds - spent) / max(1.0, images - scored),
        "share": (on - off) / off,
        "device": str(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="sd15-vae", help="sd15-vae (SD 1.5's VAE, random weights) or tiny")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--images", type=int, default=4, help="one-image requests per round, sent at once")
    parser.add_argument("--batch", type=int, default=4, help="the decoder's largest batch")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating; the median is shown")
    parser.add_argument("--models-dir", type=Path, help="where the VAE is built (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="the tiny VAE at 64 px, one round: that it runs")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    with tempfile.TemporaryDirectory(prefix="darkroom-bench-") as tmp:
        found = asyncio.run(run(args, args.models_dir or Path(tmp)))
    print(f"{args.model} at {args.size} px on {found['device']}, {args.images} images a round, batches of {args.batch}")
    print()
    print(
        "| model | size | device | decoder ms/image, filter off | filter on | added (wall) | classifier ms/image "
        "| classifier / decode |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.model} | {args.size} | {found['device']} | {found['off_ms']:.1f} | {found['on_ms']:.1f} | "
        f"{100 * found['share']:+.2f} % | {found['filter_ms']:.1f} | "
        f"{100 * found['filter_ms'] / found['off_ms']:.2f} % |"
    )


if __name__ == "__main__":
    main()
