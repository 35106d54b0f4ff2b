"""Parallel models on a group of two CPU ranks over gloo (real processes, real
collectives): for every family and mode with a plan, the group's latents are the
single process's (Ulysses and the split halves change only how a matrix product
is blocked: within 1e-5 and 1e-4, docs/parallel.md); a job joins the group's
running batch at a step boundary and gets its solo latents; a member stopped on the
group leaves while the rest finish; a job suspended on the group resumes on one
sampler, and one suspended on one sampler resumes on the group, to the
uninterrupted latents; previews come from the leader; compiled and step-caching
twins, and a job with a LoRA adapter beside one without, keep one sampler's latents;
a video's tiles decode across the group into the video one process decodes;
a sharded twin holds half its network on each rank (and compiled, keeps its latents),
and a follower no text encoder; last, a follower stuck as inside a collective is left
by its leader's watchdog. A second, short group loses its follower as a batch begins:
the leader runs nothing more across it. A group of four runs the products of two
modes (sharded weights with a split sequence or split halves) to the single latents.

One group of two runs every case but the products (its two ranks start once; they
compile two twins; the watchdog waits 15 s: about 100 CPU s in all); the group of
four about 30 CPU s more."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from gpu_worker.adapters.library import AdapterLibrary
from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.denoising.members import BatchMember, JobSuspended
from gpu_worker.engine import SamplerEngine
from services.generation import AdapterUse, GenerationParams
from services.models.loader import module_bytes
from services.models.parallel_miniatures import write_registry
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.models.video_tiles import set_tile_size
from services.ops.lifecycle import EXIT_UNFIT
from services.ops.processes import free_port
from tests.lora_files import attention_layers, write_kohya_lora

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
# (single model, its parallel twin, guidance, extra params, tolerance)
PAIRS: list[tuple[str, str, float, dict[str, Any], float]] = [
    ("tiny-flux", "tiny-flux-sequence2", 3.5, {}, 1e-5),
    ("tiny", "tiny-cfg2", 7.5, {}, 1e-4),
    ("tiny-wan", "tiny-wan-sequence2", 5.0, {"frames": 5, "fps": 8.0}, 1e-5),
    ("tiny-wan", "tiny-wan-cfg2", 5.0, {"frames": 5, "fps": 8.0}, 1e-4),
    ("tiny-qwen-image", "tiny-qwen-image-sequence2", 4.0, {}, 1e-5),
    ("tiny-qwen-image", "tiny-qwen-image-cfg2", 4.0, {}, 1e-4),
    # Split by heads (diffusers' plan): each rank's share of the projections and heads.
    ("tiny-flux", "tiny-flux-tensor2", 3.5, {}, 1e-5),
    ("tiny-qwen-image", "tiny-qwen-image-tensor2", 4.0, {}, 1e-5),
    # Sharded by blocks, gathered as each runs: the same computation on every rank.
    ("tiny", "tiny-tensor2", 7.5, {}, 1e-5),
    ("tiny-wan", "tiny-wan-tensor2", 5.0, {"frames": 5, "fps": 8.0}, 1e-5),
    # Wan 2.2's two experts (its four steps cross the boundary), both split alike.
    ("tiny-wan22", "tiny-wan22-sequence2", 5.0, {"frames": 5, "fps": 8.0}, 1e-5),
    ("tiny-wan22", "tiny-wan22-tensor2", 5.0, {"frames": 5, "fps": 8.0}, 1e-5),
]
WAN22 = "tiny-wan22"
# Products of two modes, on a group of four ranks: each shape's own mesh of two by two.
PRODUCTS: list[tuple[str, str, float, dict[str, Any], float]] = [
    ("tiny-flux", "tiny-flux-sequence2-tensor2", 3.5, {}, 1e-5),
    ("tiny-wan", "tiny-wan-sequence2-tensor2", 5.0, {"frames": 5, "fps": 8.0}, 1e-5),
    ("tiny-qwen-image", "tiny-qwen-image-sequence2-cfg2", 4.0, {}, 1e-4),
    ("tiny", "tiny-cfg2-tensor2", 7.5, {}, 1e-4),
    ("tiny-qwen-image", "tiny-qwen-image-cfg2-tensor2", 4.0, {}, 1e-4),  # split by heads
]
FLUX = "tiny-flux-sequence2"
# A video's latents (5 frames of 128x96) and the tiles (64 px, overlapping by 16) its decode takes: six.
VIDEO = torch.randn(1, 16, 2, 12, 16, generator=torch.Generator().manual_seed(5))
TILE = 64
# The twin again, compiled (its blocks traced with the all-to-all inside them), and step-caching.
SPEED_OPTIONS = ("-compiled", "-cached")
# The twins a job with an adapter runs on beside one without: (label, twin, tolerance).
ADAPTED = [("adapter", "tiny-cfg2", 1e-4), ("adapter-sharded", "tiny-tensor2", 1e-5)]
# Sharded twins compiled, (twin, its model, guidance): split by heads, its blocks traced
# with the plan's all-reduces inside them; by blocks, each sharded block's forward
# traced, its weights gathered eagerly around it.
SHARDED_COMPILED = [("tiny-flux-tensor2-compiled", "tiny-flux", 3.5), ("tiny-tensor2-compiled", "tiny", 7.5)]


def job(model: str, seed: int, guidance: float, steps: int = 4, **extra: Any) -> GenerationParams:
    return GenerationParams(model, f"a lighthouse {seed}", "", 64, 64, steps, guidance, seed, 1, **extra)


def sharded_speed_job(model: str, guidance: float) -> GenerationParams:
    return replace(job(model, 9, guidance, steps=8), width=128, height=128)


def speed_job(variant: str) -> GenerationParams:
    """A job of the twin with a speed option, at the size it compiled for as it loaded
    (another size would compile again mid-batch, on each rank at its own pace)."""
    return replace(job(f"{FLUX}{variant}", 9, 3.5, steps=8), width=128, height=128)


def single(registry: ModelRegistry, models_dir: Path) -> SamplerEngine:
    return SamplerEngine(registry, models_dir, CPU)


def solo(engine: SamplerEngine, p: GenerationParams, **extra: Any) -> Any:
    [result] = engine.sample_batch([BatchMember(p, lambda step, total: None, threading.Event(), **extra)])
    return result


def suspended(engine: SamplerEngine, p: GenerationParams, at: int) -> Checkpoint:
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == at:
            stop.set()

    [result] = engine.sample_batch([BatchMember(p, on_step, stop, suspend=lambda: True)])
    assert isinstance(result, JobSuspended), result
    return result.checkpoint


@pytest.fixture(scope="module")
def registry_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Compiled for one batch bucket: each bucket is another compilation.
    variants: dict[str, dict[str, Any]] = {
        "-compiled": {"compile": True, "max_batch": 1, "max_images": 1},
        "-cached": {"step_cache": 0.2},
    }
    return write_registry(tmp_path_factory.mktemp("registry") / "registry.toml", variants=variants)


@pytest.fixture(scope="module")
def registry(registry_file: Path) -> ModelRegistry:
    return ModelRegistry.load(registry_file)


@pytest.fixture(scope="module")
def resumed_here(registry: ModelRegistry, models_dir: Path) -> Checkpoint:
    """A Flux job suspended at step 2 on one sampler, for the group to resume."""
    return suspended(single(registry, models_dir), job(FLUX, 7, 3.5, steps=5), 2)


@pytest.fixture(scope="module")
def adapter_dirs(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffusers import UNet2DConditionModel

    network = UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")
    return {
        "style": write_kohya_lora(tmp_path_factory.mktemp("adapters") / "style", network, attention_layers(network))
    }


@pytest.fixture(scope="module")
def adapters(adapter_dirs: dict[str, Path]) -> AdapterLibrary:
    return AdapterLibrary(lambda use: adapter_dirs[use.name])


def styled(seed: int, model: str = "tiny-cfg2") -> GenerationParams:
    """A job of a twin with a LoRA adapter: on the guided twin each rank adapts its own
    half's rows; on the sharded one, each rank every row, its layers' weights gathered."""
    return replace(job(model, seed, 7.5), adapters=(AdapterUse("style", "v1", 0.8),))


@pytest.fixture(scope="module")
def group(
    registry_file: Path,
    models_dir: Path,
    resumed_here: Checkpoint,
    adapter_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Every case's outcome from one group of two ranks, by batch label and prompt."""
    work = tmp_path_factory.mktemp("group")
    batches: list[tuple[str, dict[str, Any]]] = [
        (parallel, {"jobs": [job(parallel, 1, guidance, **extra)]}) for _, parallel, guidance, extra, _ in PAIRS
    ]
    batches += [
        ("join", {"jobs": [job(FLUX, 2, 3.5, steps=5)], "join": [job(FLUX, 3, 2.5, steps=4)]}),
        ("stop", {"jobs": [job(FLUX, 4, 3.5), {"params": job(FLUX, 5, 3.5), "stop_at": 2}]}),
        ("suspend", {"jobs": [{"params": job(FLUX, 6, 3.5, steps=5), "stop_at": 3, "suspend": True}]}),
        ("resume", {"jobs": [{"params": job(FLUX, 7, 3.5, steps=5), "resume": resumed_here}]}),
        ("preview", {"jobs": [{"params": job(FLUX, 8, 3.5), "preview_at": [2]}]}),
        *((f"{FLUX}{v}", {"jobs": [speed_job(v)]}) for v in SPEED_OPTIONS),
        *((twin, {"jobs": [sharded_speed_job(twin, guidance)]}) for twin, _, guidance in SHARDED_COMPILED),
        *((label, {"jobs": [styled(10, model), job(model, 11, 7.5)]}) for label, model, _ in ADAPTED),
        ("decode", {"decode": {"model": "tiny-wan", "latents": VIDEO, "tile": TILE}}),
        # Last: the follower stalls as inside a collective; the leader's watchdog (15 s) ends it.
        ("stuck", {"jobs": [replace(job(FLUX, 12, 3.5), prompt="stuck 12")], "stuck": True}),
    ]
    adapters = {n: str(p) for n, p in adapter_dirs.items()}
    return run_group(work, registry_file, models_dir, batches, adapters=adapters, stall_after_s=15.0)


@pytest.fixture(scope="module")
def four(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each product's job on one group of four ranks (about 30 CPU s: four processes)."""
    work = tmp_path_factory.mktemp("four")
    registry_file = write_registry(work / "registry.toml", 4)
    batches = [(twin, {"jobs": [job(twin, 1, guidance, **extra)]}) for _, twin, guidance, extra, _ in PRODUCTS]
    return run_group(work, registry_file, models_dir, batches, size=4)


@pytest.fixture(scope="module")
def broken(registry_file: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A group whose follower dies as its first batch begins, sent a second batch."""
    batches = [
        ("dies", {"jobs": [replace(job("tiny-cfg2", 13, 7.5), prompt="dies 13")]}),
        ("after", {"jobs": [job("tiny-cfg2", 14, 7.5)]}),
    ]
    return run_group(tmp_path_factory.mktemp("broken"), registry_file, models_dir, batches)


def write_script(
    work: Path, registry_file: Path, models_dir: Path, batches: list[Any], size: int = 2, **more: Any
) -> Path:
    """The script of a group of ``size`` ranks running ``batches`` (``children/group_rank.py``)."""
    script = {
        "size": size,
        "address": f"127.0.0.1:{free_port()}",
        "registry": str(registry_file),
        "models_dir": str(models_dir),
        "batches": batches,
        "out": str(work / "outcomes.pkl"),
        **more,
    }
    (work / "script.pkl").write_bytes(pickle.dumps(script))
    return work / "script.pkl"


def run_group(
    work: Path, registry_file: Path, models_dir: Path, batches: list[Any], size: int = 2, **more: Any
) -> dict[str, Any]:
    """A group of ``size`` ranks running ``batches``; the leader's outcomes (and its
    first follower's footprints)."""
    script = write_script(work, registry_file, models_dir, batches, size, **more)
    leader, *followers = (rank_process(script, rank) for rank in range(size))
    try:
        outcomes: dict[str, Any] = {
            "leader exit": leader.wait(timeout=300),
            "follower alive": any(f.poll() is None for f in followers),
        }
    finally:
        for follower in followers:
            follower.kill()
            follower.wait()
    outcomes |= pickle.loads((work / "outcomes.pkl").read_bytes())
    outcomes["follower footprints"] = pickle.loads((work / "outcomes.pkl.rank1").read_bytes())
    return outcomes


def rank_process(script: Path, rank: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.children.group_rank", str(script), str(rank)], cwd=ROOT
    )


def latents(result: Any) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


@pytest.mark.parametrize(("plain", "parallel", "guidance", "extra", "tolerance"), PAIRS)
def test_a_group_s_latents_are_the_single_process_s(
    group: dict[str, Any],
    registry: ModelRegistry,
    models_dir: Path,
    plain: str,
    parallel: str,
    guidance: float,
    extra: dict[str, Any],
    tolerance: float,
) -> None:
    [on_group] = group[parallel].values()
    alone = single_latents(on_group, registry, models_dir, job(plain, 1, guidance, **extra), tolerance)
    assert not torch.equal(alone, latents(solo(single(registry, models_dir), job(plain, 2, guidance, **extra))))


def single_latents(
    on_group: Any, registry: ModelRegistry, models_dir: Path, p: GenerationParams, tolerance: float
) -> torch.Tensor:
    """The latents of ``p`` on one sampler, checked against ``on_group``'s (the same job's on a group)."""
    alone = latents(solo(single(registry, models_dir), p))
    assert latents(on_group).shape == alone.shape
    assert torch.allclose(latents(on_group), alone, atol=tolerance, rtol=0)
    return alone


@pytest.mark.parametrize(("plain", "product", "guidance", "extra", "tolerance"), PRODUCTS)
def test_a_group_of_four_s_products_of_modes_keep_the_single_process_s_latents(
    four: dict[str, Any],
    registry: ModelRegistry,
    models_dir: Path,
    plain: str,
    product: str,
    guidance: float,
    extra: dict[str, Any],
    tolerance: float,
) -> None:
    """Sharded weights with a split sequence or split halves, and both splits: each
    rank's share of the compute with its row's gathered weights."""
    [on_group] = four[product].values()
    single_latents(on_group, registry, models_dir, job(plain, 1, guidance, **extra), tolerance)


def test_a_job_joins_a_group_s_running_batch_and_gets_its_solo_latents(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    engine = single(registry, models_dir)
    first, joiner = job(FLUX, 2, 3.5, steps=5), job(FLUX, 3, 2.5, steps=4)
    assert set(group["join"]) == {first.prompt, joiner.prompt}
    for p in (first, joiner):
        assert torch.allclose(latents(group["join"][p.prompt]), latents(solo(engine, p)), atol=1e-5, rtol=0)


def test_a_member_stopped_on_a_group_leaves_and_the_rest_finish(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    kept, stopped = job(FLUX, 4, 3.5), job(FLUX, 5, 3.5)
    assert group["stop"][stopped.prompt].startswith("JobInterrupted")
    assert torch.allclose(
        latents(group["stop"][kept.prompt]), latents(solo(single(registry, models_dir), kept)), atol=1e-5
    )


def test_a_job_suspended_on_a_group_resumes_on_one_sampler(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    p = job(FLUX, 6, 3.5, steps=5)
    checkpoint = group["suspend"][p.prompt]
    assert isinstance(checkpoint, Checkpoint) and checkpoint.step == 3
    engine = single(registry, models_dir)
    resumed = latents(solo(engine, p, resume=checkpoint))
    assert torch.allclose(resumed, latents(solo(engine, p)), atol=1e-5, rtol=0)


def test_a_job_suspended_on_one_sampler_resumes_on_a_group(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    p = job(FLUX, 7, 3.5, steps=5)
    uninterrupted = latents(solo(single(registry, models_dir), p))
    assert torch.allclose(latents(group["resume"][p.prompt]), uninterrupted, atol=1e-5, rtol=0)


def test_previews_come_from_the_group_s_leader(group: dict[str, Any]) -> None:
    assert group["previews"][job(FLUX, 8, 3.5).prompt] == [2]


@pytest.mark.parametrize("variant", SPEED_OPTIONS)
def test_a_group_s_speed_options_keep_its_latents(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path, variant: str
) -> None:
    """The same model on one sampler (unsplit) and on the group: compiled, the group
    traces its blocks with the all-to-all inside them; caching, every rank reuses
    the same steps (each decides from the same gathered predictions)."""
    p = speed_job(variant)
    [on_group] = group[p.model].values()
    # Compiled as tests compile (aot_eager: the traced graphs run as they are), its
    # latents are the plain model's: no compilation here.
    alone = replace(p, model="tiny-flux") if variant == "-compiled" else p
    assert torch.allclose(latents(on_group), latents(solo(single(registry, models_dir), alone)), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("twin", "model", "guidance"), SHARDED_COMPILED)
def test_a_sharded_twin_compiles_its_blocks_and_keeps_its_latents(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path, twin: str, model: str, guidance: float
) -> None:
    """Compiled as tests compile (aot_eager), its latents are the plain model's; it
    traced its blocks as it loaded (Flux.1's two kinds; the UNet's)."""
    p = sharded_speed_job(twin, guidance)
    [on_group] = group[twin].values()
    alone = latents(solo(single(registry, models_dir), replace(p, model=model)))
    assert torch.allclose(latents(on_group), alone, atol=1e-5, rtol=0)
    assert group["graphs"][twin] >= 2
    assert group["footprints"][twin]["compile_s"] > 0


@pytest.mark.parametrize(("label", "model", "tolerance"), ADAPTED)
def test_a_job_with_an_adapter_beside_one_without_on_a_group(
    group: dict[str, Any],
    registry: ModelRegistry,
    models_dir: Path,
    adapters: AdapterLibrary,
    label: str,
    model: str,
    tolerance: float,
) -> None:
    engine = SamplerEngine(registry, models_dir, CPU, adapters=adapters)
    adapted, plain = styled(10, model), job(model, 11, 7.5)
    for p in (adapted, plain):
        assert torch.allclose(latents(group[label][p.prompt]), latents(solo(engine, p)), atol=tolerance, rtol=0)
    assert not torch.allclose(latents(group[label][adapted.prompt]), latents(solo(engine, job(model, 10, 7.5))))


def test_a_video_s_tiles_decode_across_the_group_into_the_single_process_s_video(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    vaes = VaeDecoderEngine(registry, models_dir, CPU, tile_above_pixels=TILE**2)
    set_tile_size(vaes.load("tiny-wan"), TILE)
    [alone] = vaes.decode_images("tiny-wan", VIDEO)
    decoded = group["decode"]
    assert decoded["tiled"] and alone.tiled
    assert decoded["here"] == [(0, 0), (0, 12), (6, 6)], "the leader decoded its share of the six tiles, no more"
    assert numpy.array_equal(decoded["frames"], alone.pixels), "the same video, whoever decoded each tile"


def test_a_group_whose_follower_is_stuck_is_left_by_its_leader(group: dict[str, Any]) -> None:
    """The last batch: the follower alive but stuck (as inside a collective) holds the
    leader in its first collective; the leader's watchdog exits it (EXIT_UNFIT) once no
    step boundary came for its stall time, for the supervisor to re-form the group."""
    assert group["leader exit"] == EXIT_UNFIT
    assert group["follower alive"], "the stuck follower is the supervisor's to kill"
    assert "stuck" not in group


def test_a_group_whose_follower_dies_mid_batch_runs_nothing_more_across_it(broken: dict[str, Any]) -> None:
    """The leader, in the batch's first collective, finds its peer gone: the batch
    fails as ``GroupBroken`` (which ends its worker: tests/unit/test_runner.py), the
    next is refused before any collective rather than fail or hang another job, and
    the leader ends in order, sending its gone follower nothing."""
    assert broken["dies"].startswith("GroupBroken: the group broke: RuntimeError"), broken["dies"]
    assert broken["after"].startswith("GroupBroken: the group broke earlier: RuntimeError"), broken["after"]
    assert broken["leader exit"] == 0 and not broken["follower alive"]


def holds_half_its_network(engine: SamplerEngine, model: str, sharded: float) -> bool:
    """Whether ``sharded`` (a rank's bytes of a twin of ``model``, sharded by blocks
    over two) is ``model``'s text encoders whole and half its network (FSDP pads a
    shard to divide evenly)."""
    pipe = engine.load(model)
    network = sum(module_bytes(n) for n in (pipe.transformer, getattr(pipe, "transformer_2", None)) if n is not None)
    whole = engine.footprints()[model]["bytes"]
    return whole - network / 2 - 1024 <= sharded <= whole - 0.45 * network


def test_a_model_sharded_by_blocks_holds_half_its_network_on_each_rank(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    """What the leader measured of the Wan twins (no plan: sharded by blocks) as they
    loaded: Wan 2.2's holds half of each of its experts."""
    engine = single(registry, models_dir)
    for model in ("tiny-wan", WAN22):
        assert holds_half_its_network(engine, model, group["footprints"][f"{model}-tensor2"]["bytes"]), model


def test_a_model_split_by_heads_holds_half_of_each_projection_its_plan_splits(
    group: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    """The Flux.1 twin, split by diffusers' plan: half of each projection the plan splits
    by columns or rows on each rank; its embeddings, norms and modulation, and its
    text encoders, whole."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    engine = single(registry, models_dir)
    network = engine.load("tiny-flux").transformer
    params = dict(network.named_parameters())
    specs = resolve_tp_shard_specs(network, type(network)._tp_plan, 2)
    split = sum(params[name].nbytes for name, spec in specs.items() if spec.dim is not None)
    assert split > module_bytes(network) / 4
    assert group["footprints"]["tiny-flux-tensor2"]["bytes"] == engine.footprints()["tiny-flux"]["bytes"] - split // 2


def test_sharded_weights_with_a_split_sequence_hold_half_the_network_on_each_rank(
    four: dict[str, Any], registry: ModelRegistry, models_dir: Path
) -> None:
    """Four ranks, two by two: a split sequence shards its weights by blocks."""
    sharded = four["footprints"]["tiny-flux-sequence2-tensor2"]["bytes"]
    assert holds_half_its_network(single(registry, models_dir), "tiny-flux", sharded)
    assert four["leader exit"] == 0


def test_a_follower_loads_no_text_encoder_its_leader_encodes_for(group: dict[str, Any]) -> None:
    """The leader encodes the prompts of what the group spans and sends each member's
    conditioning: a follower holds the network alone, a compiled twin's too (its
    compilation's warm-up takes the leader's conditioning of each warm-up prompt)."""
    leader, follower = group["footprints"], group["follower footprints"]
    for model in (FLUX, f"{FLUX}-compiled", *(twin for twin, _, _ in SHARDED_COMPILED)):
        assert follower[model]["bytes"] < leader[model]["bytes"], model
