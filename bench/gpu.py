"""The GPU services measured against a bare diffusers loop doing the same work, as a
user would compare them: the whole stack (gateway, scheduler, JetStream,
PostgreSQL, one sampler, one decoder, all on this machine) against one process
calling the pipeline.

    python bench/gpu.py                      # on a GPU: SD 1.5 at 512 px, 20 steps; SDXL at 1024 px, 30 steps
    python bench/gpu.py --cases flux-dev     # Flux.1 dev at 1024 px, 28 steps (also sd35m, flux-dev-fp8,
                                             # flux-schnell, qwen-image, z-image-turbo; flux-kontext:
                                             # instruction edits of a 1024 px image)
    python bench/gpu.py --device cpu         # on a CPU: small sizes (the miniatures, SD 1.5 at 128 px)
    python bench/gpu.py --smoke              # CI's check that it still runs: two miniatures, one round of each
    python bench/gpu.py --modes saturated,one-job --cases sd15 --options optimize,compile

Modes (``--modes``, all by default):

- ``rounds``: ``batch`` jobs of one shape submitted at once and waited for, per batch
  size, against the bare loop running the same images as one pipeline call; peak
  memory; the sampler's local decode and the cost of shipping latents to the decoder.
- ``saturated``: N jobs submitted at once (``--jobs``), images per second until the
  last is stored, against the bare loop at the model's batch size; the median of each
  stage from the jobs' own records; the sampler's busy ratio (denoising over the
  time work waited, from its own account).
- ``one-job``: one job alone, its total and each stage from its record (median of
  ``--rounds``), against the bare loop's one image (sampling and a local decode).
- ``options``: the saturated and one-job rows again for each speed option named in
  ``--options`` (a registry entry with that option, served by the same stack),
  each against a bare loop with the same options, and how far the option moves the
  bare loop's latents from the plain loop's (relative RMS; ``services.models.speed``).

The models are the real architectures with random weights (``sd15-random``,
``sdxl-random``, ``sd35-medium-random``, ``flux1-dev-random``, ``flux1-schnell-random``:
the default registry's on-request presets), built once into the data directory; they
cost exactly what the real ones cost. The bare loop (``bench/support/bare_loop.py``)
includes the VAE decode, as the stack's decoder does. Nothing here is a test; it prints tables for
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.support.bare_loop import EDIT_PROMPT, PROMPT, Bare, Case, bare_loop, edit_input
from bench.support.stack_run import BenchStack
from services.models import speed
from services.models.registry import DEFAULT_REGISTRY, ModelRegistry, toml_value
from services.models.spec import ModelSpec

GPU_CASES = (
    Case("sd15", "sd15-random", 512, 20, 64),
    Case("sdxl", "sdxl-random", 1024, 30, 16),
    # MLPerf's SDXL benchmark runs 20 steps: how far the stack stands from 2.18 img/s per H200.
    Case("sdxl20", "sdxl-random", 1024, 20, 16),
    # Today's families, each run when named (their weights take 16 to 34 GB of disk).
    Case("sd35m", "sd35-medium-random", 1024, 28, 16),
    Case("flux-dev", "flux1-dev-random", 1024, 28, 8),
    Case("flux-dev-fp8", "flux1-dev-fp8-random", 1024, 28, 8),
    Case("flux-schnell", "flux1-schnell-random", 1024, 4, 16),
    Case("flux-kontext", "flux1-kontext-random", 1024, 28, 8, edit=True),
    Case("qwen-image", "qwen-image-random", 1328, 50, 4),
    Case("z-image-turbo", "z-image-turbo-random", 1024, 8, 16),
)
# What a GPU run measures unless --cases names others.
GPU_DEFAULT = ("sd15", "sdxl")
CPU_CASES = (
    Case("tiny", "tiny", 128, 10, 16),
    Case("sd15", "sd15-random", 128, 4, 8),
    Case("tiny-sd3", "tiny-sd3", 128, 8, 16),
    Case("tiny-flux", "tiny-flux", 128, 8, 16),
    Case("tiny-flux-kontext", "tiny-flux-kontext", 128, 8, 16, edit=True),
    Case("tiny-qwen-image", "tiny-qwen-image", 128, 8, 16),
    Case("tiny-z-image", "tiny-z-image", 128, 8, 16),
)
# The bench's paths once each: a UNet, and a transformer's edit (every family runs
# through the same loop; each family's own tests are the suite's).
SMOKE_CASES = (
    Case("tiny", "tiny", 64, 4, 4),
    Case("tiny-flux-kontext", "tiny-flux-kontext", 64, 4, 4, edit=True),
)
STAGES = ("queue", "schedule", "dispatch", "sample", "decode", "store")
# Each speed option --options can name, as registry keys.
OPTIONS: dict[str, dict[str, Any]] = {
    "optimize": {"optimize": True},
    "compile": {"compile": True},
    "cuda-graphs": {"compile": True, "cuda_graphs": True},
    "channels-last": {"channels_last": True},
    "cudnn-attention": {"attention": "cudnn"},
    "flash-attention": {"attention": "flash"},
    "fuse-qkv": {"fuse_qkv": True},
    "int8": {"quantize": "int8"},
    "fp8": {"quantize": "fp8"},
}
SMOKE = {"device": "cpu", "rounds": 1, "options": "channels-last", "batches": "1,2"}


# -- the stack -------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """Jobs submitted together and waited for: their records and the wall time."""

    jobs: list[Any]

    @property
    def wall_s(self) -> float:
        """From the first job's submission to the last one's images stored."""
        created = min(j.timings.created_time.ToDatetime() for j in self.jobs)
        stored = max(j.timings.finished_time.ToDatetime() for j in self.jobs)
        return (stored - created).total_seconds()

    @property
    def images_per_s(self) -> float:
        return sum(j.num_images or 1 for j in self.jobs) / self.wall_s

    def batch_sizes(self) -> list[int]:
        """The images of each batch the jobs ran in, in order (a batch's jobs share
        the moment it finished denoising)."""
        sizes: dict[Any, int] = {}
        for j in self.jobs:
            at = j.timings.decoding_time.ToDatetime()
            sizes[at] = sizes.get(at, 0) + (j.num_images or 1)
        return [sizes[at] for at in sorted(sizes)]

    def stage_medians(self) -> dict[str, float]:
        return {
            stage: statistics.median(getattr(j.stage_durations, f"{stage}_seconds") for j in self.jobs)
            for stage in (*STAGES, "total")
        }


class Stack(BenchStack):
    """The whole stack on this machine, serving the cases' models and their option variants."""

    def __init__(
        self,
        registry: Path,
        presets: Sequence[str],
        preload: Sequence[str],
        device: torch.device,
        data: Path,
        decode_locally: bool,
    ) -> None:
        super().__init__(
            {
                "DARKROOM_DATA_DIR": str(data),
                "DARKROOM_DEVICE": device.type,
                "DARKROOM_MODEL_REGISTRY": str(registry),
                "DARKROOM_PRESETS": ",".join(presets),
                "DARKROOM_PRELOAD_MODELS": ",".join(preload),
                "DARKROOM_DECODE_LOCALLY": "true" if decode_locally else "false",
            }
        )

    def round(self, model: str, case: Case, jobs: int, seed: int) -> Round:
        """``jobs`` jobs of one shape submitted at once (seeds differ), waited for to the end."""
        from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
        from tests.helpers import wait_terminal

        image = edit_input(case.size) if case.edit else b""
        requests = [
            pb.SubmitJobRequest(
                model=model,
                prompt=EDIT_PROMPT if case.edit else PROMPT,
                width=case.size,
                height=case.size,
                steps=case.steps,
                seed=seed + i,
                image=image,
            )
            for i in range(jobs)
        ]
        with ThreadPoolExecutor(min(jobs, 16)) as pool:
            ids = [reply.job_id for reply in pool.map(self.client.SubmitJob, requests)]
        done = [wait_terminal(self.client, job_id, timeout=1800) for job_id in ids]
        failed = [j.error for j in done if j.status != pb.JOB_STATUS_SUCCEEDED]
        assert not failed, failed
        return Round(done)

    def sampler(self) -> Any:
        from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

        [sampler] = [w for w in self.client.GetStats(pb.GetStatsRequest()).workers if w.kind == "sampler"]
        return sampler


def variant_name(model: str, option: str) -> str:
    return f"{model}--{option}"


def write_registry(path: Path, cases: Sequence[Case], options: Sequence[str]) -> dict[str, ModelSpec]:
    """The default registry, with an entry per case model and option (the model's own
    entry with the option on, built from the same weights)."""
    base = ModelRegistry.load(presets=None)
    variants = {}
    for model in sorted({c.model for c in cases}):
        for option in options:
            spec = dataclasses.replace(
                base.get(model), name=variant_name(model, option), on_request=False, default=False, **OPTIONS[option]
            )
            variants[spec.name] = spec
    lines = [DEFAULT_REGISTRY.read_text()]
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    for name, spec in variants.items():
        lines.append(f'\n[models."{name}"]')
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if field.name != "name" and (field.name in ("source", "family") or value != defaults.get(field.name)):
                lines.append(f"{field.name} = {toml_value(value)}")
    path.write_text("\n".join(lines) + "\n")
    return variants


# -- the report --------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def rounds_table(cases: Sequence[Case], batches: Sequence[int], bare: dict[Any, Bare], through: dict[Any, Any]) -> None:
    mib = 2**20
    print("\n## Rounds: `batch` jobs submitted at once and waited for\n")
    print(
        "| model | size | steps | batch | bare img/s | bare s/img | stack img/s | stack s/img | stack/bare "
        "| peak MiB bare | peak MiB stack | decode on sampler, local ms/img | remote (ship latents) ms/img |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for batch in batches:
            b, (rate, peak) = bare[(case.name, "", batch)], through[(case.name, batch)]
            print(
                f"| {case.model} | {case.size} | {case.steps} | {batch} | {b.images_per_s:.2f} | "
                f"{1 / b.images_per_s:.3f} | {rate:.2f} | {1 / rate:.3f} | {rate / b.images_per_s:.2f} | "
                f"{b.peak_bytes / mib:.0f} | {peak / mib:.0f} | "
                f"{1000 * b.decode_s_per_image:.1f} | {1000 * b.ship_s_per_image:.2f} |"
            )


@dataclass(frozen=True)
class Saturated:
    case: Case
    option: str
    batch: int  # the bare loop's: the model's batch size
    bare: Bare
    run: Round
    busy: float  # the sampler's denoising over the time work waited, over the run
    occupancy: float  # the sampler's denoising over the run's wall time


@dataclass(frozen=True)
class Alone:
    case: Case
    option: str
    bare: Bare  # batch 1
    runs: list[Round]


def saturated_table(rows: Sequence[Saturated]) -> None:
    print("\n## Saturated: N jobs submitted at once, until the last is stored\n")
    print(
        "| model | size | steps | options | N | bare img/s (batch) | stack img/s | stack/bare | busy ratio "
        "| occupancy | the stack's batches | stage medians ms: queue | schedule | dispatch | sample | decode | store |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        st, rate, bare = row.run.stage_medians(), row.run.images_per_s, row.bare.images_per_s
        print(
            f"| {row.case.model} | {row.case.size} | {row.case.steps} | {row.option or 'none'} | {len(row.run.jobs)} | "
            f"{bare:.2f} ({row.batch}) | {rate:.2f} | {rate / bare:.3f} | {row.busy:.3f} | {row.occupancy:.3f} | "
            f"{','.join(map(str, row.run.batch_sizes()))} | " + " | ".join(ms(st[s]) for s in STAGES) + " |"
        )


def one_job_table(rows: Sequence[Alone]) -> None:
    print("\n## One job alone: its record's stages, median of the rounds\n")
    print(
        "| model | size | steps | options | bare s (sample + local decode) | stack s | stack - bare ms "
        "| queue | schedule | dispatch | sample | decode | store |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        st = {k: statistics.median(r.stage_medians()[k] for r in row.runs) for k in (*STAGES, "total")}
        bare = 1 / row.bare.images_per_s
        print(
            f"| {row.case.model} | {row.case.size} | {row.case.steps} | {row.option or 'none'} | {bare:.3f} | "
            f"{st['total']:.3f} | {ms(st['total'] - bare)} | " + " | ".join(ms(st[s]) for s in STAGES) + " |"
        )


def options_table(rows: list[tuple[Case, str, Bare, Bare, float]]) -> None:
    print("\n## Speed options: the bare loop with each, against the plain bare loop\n")
    print("| model | size | steps | option | resolved | bare img/s plain | bare img/s with | speed-up | latent drift |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, option, plain, fast, drift in rows:
        print(
            f"| {case.model} | {case.size} | {case.steps} | {option} | {OPTIONS[option]} | "
            f"{plain.images_per_s:.2f} | {fast.images_per_s:.2f} | {fast.images_per_s / plain.images_per_s:.2f} | "
            f"{drift:.4f} |"
        )


# -- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", default="rounds,saturated,one-job,options")
    parser.add_argument("--cases", default="", help="case names (default: all for the device)")
    parser.add_argument("--options", default="optimize", help=f"speed options for --modes options: {sorted(OPTIONS)}")
    parser.add_argument("--batches", default="", help="rounds mode's batch sizes (default: 1,2,4,8; CPU 1,2,4)")
    parser.add_argument("--jobs", type=int, default=0, help="saturated mode's jobs (default: the case's)")
    parser.add_argument(
        "--rounds", type=int, default=0, help="rounds per measurement (default: 3 on a GPU, 2 on a CPU)"
    )
    parser.add_argument(
        "--decode",
        choices=("service", "local"),
        default="service",
        help="where the stack decodes: its decoder service (the default stack), or the sampler itself "
        "(DARKROOM_DECODE_LOCALLY: a box whose decoder shares the GPU)",
    )
    parser.add_argument("--data-dir", default="", help="where models are built and the stack runs (default: temp)")
    parser.add_argument("--smoke", action="store_true", help=f"CI quick check: {SMOKE}, a UNet and an edit")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    every = SMOKE_CASES if args.smoke else GPU_CASES if gpu else CPU_CASES
    wanted = set(args.cases.split(",")) if args.cases else {c.name for c in every if c.name in GPU_DEFAULT or not gpu}
    cases = tuple(c for c in every if c.name in wanted)
    unknown = wanted - {c.name for c in every}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; for this device: {[c.name for c in every]}")
    modes = set(args.modes.split(","))
    options = [o for o in args.options.split(",") if o] if "options" in modes else []
    if set(options) - set(OPTIONS):
        parser.error(f"unknown options {sorted(set(options) - set(OPTIONS))}; known: {sorted(OPTIONS)}")
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (1, 2, 4, 8) if gpu else (1, 2, 4)
    rounds = args.rounds or (3 if gpu else 2)
    data = Path(args.data_dir or tempfile.mkdtemp(prefix="darkroom-bench-"))
    models = data / "models"
    what = torch.cuda.get_device_name(device) if gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# GPU services against a bare loop: {what}; {rounds} rounds; torch {torch.__version__}")
    print(f"# modes {sorted(modes)}; cases {[c.name for c in cases]}; options {options or 'none'}")
    print(f"# the stack decodes on {'the sampler' if args.decode == 'local' else 'its decoder service'}")

    # A smoke run checks the options' path once, on its first case: the same code for every family.
    options_of = {c.name: options if not args.smoke or i == 0 else [] for i, c in enumerate(cases)}
    registry_path = data / "registry.toml"
    data.mkdir(parents=True, exist_ok=True)
    write_registry(registry_path, cases, options)
    registry = ModelRegistry.load(registry_path, presets=None)

    # The bare loops first, one model at a time on the device; each also builds its weights.
    bare: dict[tuple[str, str, int], Bare] = {}
    drift: dict[tuple[str, str], float] = {}
    for case in cases:
        spec = registry.get(case.model)
        sizes = set(batches) if "rounds" in modes else set()
        sizes |= {1} if "one-job" in modes or options_of[case.name] else set()
        sizes |= {spec.max_batch} if "saturated" in modes or options_of[case.name] else set()
        for batch, result in bare_loop(spec, case, sorted(sizes), device, rounds, models).items():
            bare[(case.name, "", batch)] = result
        for option in options_of[case.name]:
            fast = registry.get(variant_name(case.model, option))
            for batch, result in bare_loop(fast, case, sorted({1, spec.max_batch}), device, rounds, models).items():
                bare[(case.name, option, batch)] = result
            plain, got = (
                bare[(case.name, "", spec.max_batch)].latents,
                bare[(case.name, option, spec.max_batch)].latents,
            )
            drift[(case.name, option)] = speed.latent_drift([got], [plain])

    presets = sorted({c.model for c in cases} - set(ModelRegistry.load().models))
    through: dict[tuple[str, int], tuple[float, int]] = {}
    saturated: list[Saturated] = []
    alone: list[Alone] = []
    preload = sorted({c.model for c in cases})
    with Stack(registry_path, presets, preload, device, data, args.decode == "local") as stack:
        for case in cases:
            batch = registry.get(case.model).max_batch
            if "rounds" in modes:
                for size in batches:
                    stack.round(case.model, case, size, 0)  # warm-up
                    runs, peak = [], 0
                    for r in range(rounds):
                        runs.append(stack.round(case.model, case, size, 1000 * (r + 1)))
                        peak = max(peak, stack.sampler().vram_used_bytes)
                    rate = sum(len(x.jobs) for x in runs) / sum(len(x.jobs) / x.images_per_s for x in runs)
                    through[(case.name, size)] = (rate, peak)
            for option in ["", *options_of[case.name]]:
                model = variant_name(case.model, option) if option else case.model
                stack.round(model, case, 1, 7)  # warm-up: a variant's load (and compilation) is not measured
                if "saturated" in modes or option:
                    run, busy, occupancy = saturated_run(stack, model, case, args.jobs or case.jobs)
                    saturated.append(
                        Saturated(case, option, batch, bare[(case.name, option, batch)], run, busy, occupancy)
                    )
                if "one-job" in modes or option:
                    runs = [stack.round(model, case, 1, 5000 + r) for r in range(rounds)]
                    alone.append(Alone(case, option, bare[(case.name, option, 1)], runs))
    if "rounds" in modes:
        rounds_table(cases, batches, bare, through)
    if saturated:
        saturated_table(saturated)
    if alone:
        one_job_table(alone)
    if options:
        rows = []
        for case in cases:
            batch = registry.get(case.model).max_batch
            for option in options_of[case.name]:
                rows.append(
                    (
                        case,
                        option,
                        bare[(case.name, "", batch)],
                        bare[(case.name, option, batch)],
                        drift[(case.name, option)],
                    )
                )
        options_table(rows)
    return 0


def saturated_run(stack: Stack, model: str, case: Case, jobs: int) -> tuple[Round, float, float]:
    """A saturated round; the sampler's busy ratio over it (from its own account,
    once its heartbeat holds every batch of the round); and its occupancy, its
    denoising over the round's wall time (which counts what the busy ratio does not:
    the sampler idle with no work dispatched to it, the round's first batch and its
    last decode)."""
    from tests.helpers import wait_for

    before = stack.sampler()
    run = stack.round(model, case, jobs, 100)
    # At most this many: jobs that joined a running batch leave it at other boundaries
    # (other decode times) yet count as one of its batches; a saturated round leaves the
    # sampler running nothing only once its last batch is denoised.
    batches = len(run.batch_sizes())

    def accounted(w: Any) -> bool:
        done = w.denoised_batches - before.denoised_batches
        return done >= batches or (done > 0 and not w.running_jobs)

    after = wait_for(stack.sampler, accounted, timeout=30, what="the sampler's account of the round")
    denoising = after.denoising_seconds - before.denoising_seconds
    waiting = after.work_waiting_seconds - before.work_waiting_seconds
    return run, denoising / waiting if waiting else float("nan"), denoising / run.wall_s


if __name__ == "__main__":
    sys.exit(main())
