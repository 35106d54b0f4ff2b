"""Each speed option's code path on the CPU, with the miniature SD model: the sampler
and the decoder with the option on give what they give without it, within tolerance
(quantization: its drift is measured and bounded); a compiled network is compiled by
regions as the model loads, for every batch bucket, and no job compiles it again,
whatever its batch, images or guidance.

``torch.compile`` runs here with a backend that counts the graphs dynamo gives it and
runs each as traced: the very graphs inductor would be given (full graph, the same
guards and recompilations), without AOT autograd's tracing (a third of these tests'
time) or inductor's code, which takes minutes on two cores. Inductor itself runs in
tests/integration/test_compile_cache.py, AOT autograd in ``bench/compile_time.py
--smoke``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models import speed
from services.models.registry import ModelRegistry
from services.models.spec import ModelSpec
from services.models.vae import VaeDecoderEngine

CPU = torch.device("cpu")
# How far an option may move latents that take values of about 1 (the largest
# absolute difference): reordered float32 sums move them by 1e-6 or so.
TOLERANCE = 1e-4


class Compilations:
    """A compile backend that counts the graphs it is given, then runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return graph.forward


@pytest.fixture
def compilations(monkeypatch: pytest.MonkeyPatch) -> Iterator[Compilations]:
    import torch._dynamo

    torch._dynamo.reset()
    counter = Compilations()
    monkeypatch.setattr(speed, "COMPILE_BACKEND", counter)
    yield counter
    torch._dynamo.reset()


def tiny(**options: Any) -> ModelSpec:
    """The miniature without adapter slots (which keep fuse_qkv off: test_adapter_batches)."""
    return replace(ModelRegistry.load().get("tiny"), adapter_slots=0, **options)


def engine(models_dir: Path, spec: ModelSpec) -> SamplerEngine:
    return SamplerEngine(ModelRegistry({spec.name: spec}), models_dir, CPU)


def job(seed: int, images: int = 1, guidance: float = 7.5, size: int = 128) -> GenerationParams:
    """A job at the miniature's default size (128), where the network was warmed up."""
    return GenerationParams("tiny", "a lighthouse at dusk", "", size, size, 4, guidance, seed, images)


def latents(e: SamplerEngine, params: GenerationParams) -> torch.Tensor:
    return e.sample(params, lambda step, total: None, threading.Event())


JOBS = [job(1), job(2, images=3), job(3, guidance=1.0)]


@pytest.fixture(scope="module")
def plain(models_dir: Path) -> list[torch.Tensor]:
    e = engine(models_dir, tiny())
    return [latents(e, p) for p in JOBS]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "options",
    [
        {"channels_last": True},
        {"fuse_qkv": True},
        {"attention": "sdpa"},
        {"attention": "eager"},
        {"attention": "flash"},
        {"attention": "efficient"},
        {"attention": "cudnn"},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_an_option_keeps_the_latents_within_tolerance(
    models_dir: Path, plain: list[torch.Tensor], options: dict[str, Any]
) -> None:
    spec = tiny(**options)
    e = engine(models_dir, spec)
    network = e.load("tiny").unet
    if options.get("channels_last"):
        assert network.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    if options.get("fuse_qkv"):
        assert any(getattr(m, "fused_projections", False) for m in network.modules())
    assert largest_difference([latents(e, p) for p in JOBS], plain) < TOLERANCE


def test_compile_is_regional_happens_as_the_model_loads_and_never_on_a_job(
    models_dir: Path, plain: list[torch.Tensor], compilations: Compilations
) -> None:
    e = engine(models_dir, tiny(compile=True))
    network = e.load("tiny").unet
    assert compilations.graphs > 0, "compiled as it loaded"
    warmed = compilations.graphs
    # By regions: each repeated block class compiled, the network itself left eager.
    assert type(network).__name__ == "UNet2DConditionModel"
    compiled = {type(m).__name__ for m in network.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {"BasicTransformerBlock", "ResnetBlock2D"}
    assert speed.regions(network) == ("BasicTransformerBlock", "ResnetBlock2D")
    # What the heartbeat tells placement: the compilation is part of what a load here costs.
    footprint = e.footprints()["tiny"]
    assert 0 < footprint["compile_s"] <= footprint["load_s"]
    # Batches of every bucket, images padded to one (3 to 4), guidance on and off.
    got = [latents(e, p) for p in JOBS]
    together = JOBS[:2]  # one batch key: the same guidance
    batch = e.sample_batch([BatchMember(p, lambda step, total: None, threading.Event()) for p in together])
    # Members of other steps and guidance share a batch (as a job that joined one would).
    mixed = [replace(JOBS[0], steps=JOBS[0].steps + 2, guidance_scale=3.0), JOBS[1]]
    e.sample_batch([BatchMember(p, lambda step, total: None, threading.Event()) for p in mixed])
    assert compilations.graphs == warmed, "a job compiled the network again"
    assert largest_difference(got, plain) < TOLERANCE
    assert all(isinstance(b, torch.Tensor) for b in batch)
    assert largest_difference([b for b in batch if isinstance(b, torch.Tensor)], plain[:2]) < TOLERANCE
    # Another size compiles at most once, when first met (the regions' sizes have gone
    # dynamic over the buckets' warm-up, so it may compile nothing), and then no more.
    latents(e, job(4, size=64))
    again = compilations.graphs
    latents(e, job(5, images=2, size=64))
    assert compilations.graphs == again


def test_optimize_turns_on_every_option_that_keeps_images_and_no_other(
    models_dir: Path, plain: list[torch.Tensor], compilations: Compilations
) -> None:
    spec = tiny(optimize=True)
    options = speed.SpeedOptions.of(spec, CPU)
    assert options == speed.SpeedOptions(compile=True, channels_last=True, fuse_qkv=True)
    # Quantization moves images: only asked for by name, beside optimize or not.
    assert speed.SpeedOptions.of(tiny(optimize=True, quantize="int8"), CPU).quantize == "int8"
    e = engine(models_dir, spec)
    e.load("tiny")
    warmed = compilations.graphs
    assert largest_difference([latents(e, p) for p in JOBS], plain) < TOLERANCE
    assert compilations.graphs == warmed


def test_optimize_on_a_parallel_model_leaves_out_what_its_group_cannot_run() -> None:
    """No CUDA graph around a group's collectives; neither fused, re-laid out nor
    quantized weights where a group shards them (gathered as each block runs)."""
    from services.models.parallel import Parallelism

    cuda = torch.device("cuda")  # its capability never asked: the attention kernel is named
    single = speed.SpeedOptions.of(tiny(optimize=True, attention="flash"), cuda)
    assert single == speed.SpeedOptions(True, True, True, "flash", True)
    split = tiny(optimize=True, attention="flash", parallel=Parallelism(cfg=2))
    assert speed.SpeedOptions.of(split, cuda) == speed.SpeedOptions(True, False, True, "flash", True)
    sharded = replace(split, parallel=Parallelism(tensor=2))
    assert speed.SpeedOptions.of(sharded, cuda) == speed.SpeedOptions(compile=True, attention="flash")
    aggressive = replace(sharded, optimize="aggressive")
    assert speed.SpeedOptions.of(aggressive, cuda).quantize == ""


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_weights_move_the_latents_by_a_measured_bounded_amount(
    models_dir: Path, plain: list[torch.Tensor], kind: str
) -> None:
    e = engine(models_dir, tiny(quantize=kind))
    got = [latents(e, p) for p in JOBS]
    drift = speed.latent_drift(got, plain)
    assert 0.0 < drift < 0.25, f"{kind} moved the latents by {drift:.4f} (relative RMS)"


def test_drift_is_the_relative_rms_difference() -> None:
    ones = [torch.ones(2, 4)]
    assert speed.latent_drift(ones, ones) == 0.0
    assert speed.latent_drift([torch.full((2, 4), 1.1)], ones) == pytest.approx(0.1)


def test_buckets_pad_batches_to_powers_of_two_and_the_batch_size() -> None:
    assert speed.buckets(8) == [1, 2, 4, 8]
    assert speed.buckets(6) == [1, 2, 4, 6]
    assert speed.buckets(1) == [1]
    assert [speed.bucket(rows, 6) for rows in range(1, 8)] == [1, 2, 4, 4, 6, 6, 7]


def test_the_decoder_s_vae_with_the_options_decodes_alike_and_compiles_once(
    models_dir: Path, compilations: Compilations
) -> None:
    z = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(5))  # the default size's latents
    base = VaeDecoderEngine(ModelRegistry({"tiny": tiny()}), models_dir, CPU)
    fast = VaeDecoderEngine(ModelRegistry({"tiny": tiny(optimize=True)}), models_dir, CPU)
    fast.load("tiny")
    warmed = compilations.graphs
    assert warmed > 0, "compiled as it loaded"
    reference = [i.pixels for i in base.decode_images("tiny", z)]
    got = [i.pixels for i in fast.decode_images("tiny", z)]
    assert compilations.graphs == warmed
    assert max(int(abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(reference, got, strict=True)) <= 1
