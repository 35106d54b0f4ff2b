"""Jobs with their own LoRA adapters through the sampler's loop, on the CPU with the
tiny model: a batch whose members name other adapters (or none), and a joiner with
yet another, each get exactly their solo latents; on the GPU's fused path, one call
for them all, within float tolerance (the new families' with adapters of every
layer a push accepts); a job suspended mid-way resumes with its adapters to its
uninterrupted latents; and an adapter evicted to make room for others reloads to
the same image."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_worker.adapters.library import AdapterLibrary, slots_of
from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.running_batch import RunningBatch
from gpu_worker.engine import SamplerEngine
from services.errors import ModelError
from services.generation import AdapterUse, GenerationParams
from services.models.adapters.lora_files import read_lora
from services.models.adapters.network_layers import check_fits, layers_of_config
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily
from tests.lora_files import attention_layers, write_diffusers_lora, write_kohya_lora
from tests.unit import test_speed_options
from tests.unit.test_checkpoint import Member, latents, run, suspended
from tests.unit.test_joining import Departures, member
from tests.unit.test_speed_options import Compilations

CPU = torch.device("cpu")
compilations = test_speed_options.compilations  # the counting compile backend, as a fixture here


@pytest.fixture(scope="module")
def adapter_dirs(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffusers import UNet2DConditionModel

    network = UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")
    root = tmp_path_factory.mktemp("adapters")
    return {
        "style": write_kohya_lora(root / "style", network, attention_layers(network), seed=1),
        "subject": write_diffusers_lora(root / "subject", network, attention_layers(network), rank=8, seed=2),
        "wide": write_diffusers_lora(root / "wide", network, attention_layers(network), rank=16, seed=3),
    }


def new_engine(models_dir: Path, adapter_dirs: dict[str, Path], slots: int = 4) -> SamplerEngine:
    spec = replace(ModelRegistry.load().get("tiny"), adapter_slots=slots, adapter_rank=16, adapters_per_job=2)
    library = AdapterLibrary(lambda use: adapter_dirs[use.name])
    return SamplerEngine(ModelRegistry({"tiny": spec}), models_dir, CPU, adapters=library)


def job(seed: int, *adapters: tuple[str, float], steps: int = 5, guidance: float = 7.5) -> GenerationParams:
    uses = tuple(AdapterUse(name, "v1", scale) for name, scale in adapters)
    return GenerationParams("tiny", f"a lighthouse {seed}", "", 64, 64, steps, guidance, seed, 1, adapters=uses)


def solo(engine: SamplerEngine, p: GenerationParams) -> torch.Tensor:
    return engine.sample(p, lambda step, total: None, threading.Event())


def test_members_with_other_adapters_and_a_joiner_get_their_solo_latents(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    engine = new_engine(models_dir, adapter_dirs)
    mixed = [job(1, ("style", 1.0)), job(2), job(3, ("subject", 0.6), ("wide", 1.2), guidance=1.0)]
    late = job(4, ("wide", -0.7), steps=3)

    def on_step(step: int, total: int) -> None:
        if step == 2:
            batch.offer([member(late)])

    members = [member(mixed[0], on_step), *(member(p) for p in mixed[1:])]
    batch = RunningBatch(late.join_key, 8, members, Departures())
    results = engine.sample_batch(members, batch)
    for p, result in zip([*mixed, late], results, strict=True):
        assert isinstance(result, torch.Tensor)
        assert torch.equal(result, solo(engine, p)), p
    # The adapters matter: without them the first job's image is another.
    first = results[0]
    assert isinstance(first, torch.Tensor)
    assert not torch.allclose(first, solo(engine, replace(mixed[0], adapters=())), atol=1e-3)
    slots = slots_of(engine.load("tiny"))
    assert slots is not None
    assert sorted(slots.resident) == ["style:v1", "subject:v1", "wide:v1"]


def test_on_the_gpus_path_one_call_with_every_members_adapters_gives_each_its_solo_latents(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    reference = new_engine(models_dir, adapter_dirs)
    fused = new_engine(models_dir, adapter_dirs)
    denoiser = fused.denoisers[ModelFamily.TINY]
    assert isinstance(denoiser, DiffusersDenoiser)
    denoiser.fuse_batches = True
    mixed = [job(11, ("style", 1.0)), job(12), job(13, ("subject", 0.6), ("wide", 1.2)), job(14, ("wide", 1.0))]
    results = fused.sample_batch([member(p) for p in mixed])
    for p, result in zip(mixed, results, strict=True):
        assert isinstance(result, torch.Tensor)
        # A fused call's arithmetic differs from a solo call's in the last bits.
        torch.testing.assert_close(result, solo(reference, p), rtol=1e-4, atol=1e-4)


def test_a_suspended_job_resumes_with_its_adapters_to_its_uninterrupted_latents(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    req = job(21, ("style", 0.8), ("wide", 0.5))
    [stopped] = run(new_engine(models_dir, adapter_dirs), Member(req, suspend_at=2))
    [resumed] = run(new_engine(models_dir, adapter_dirs), Member(req, resume=suspended(stopped)))
    assert torch.equal(latents(resumed), solo(new_engine(models_dir, adapter_dirs), req))


def test_an_adapter_evicted_for_others_reloads_to_the_same_image(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    engine = new_engine(models_dir, adapter_dirs, slots=2)
    first = job(31, ("style", 1.0))
    before = solo(engine, first)
    solo(engine, job(32, ("subject", 1.0), ("wide", 1.0)))  # both slots: style is evicted
    slots = slots_of(engine.load("tiny"))
    assert slots is not None and sorted(slots.resident) == ["subject:v1", "wide:v1"]
    # What its heartbeat tells placement: the resident ones, and what a load took.
    heard = engine.adapters()
    assert heard["adapters"] == ["subject:v1", "wide:v1"] and heard["adapter_load_s"] > 0
    assert torch.equal(solo(engine, first), before)


def test_a_job_naming_adapters_for_a_model_without_slots_fails_alone(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    library = AdapterLibrary(lambda use: adapter_dirs[use.name])
    spec = replace(ModelRegistry.load().get("tiny"), adapter_slots=0)
    engine = SamplerEngine(ModelRegistry({"tiny": spec}), models_dir, CPU, adapters=library)
    results = engine.sample_batch([member(job(41, ("style", 1.0))), member(job(42))])
    assert isinstance(results[0], Exception) and "takes no adapters" in str(results[0])
    assert isinstance(results[1], torch.Tensor)


def test_a_compiled_sampler_runs_jobs_with_new_adapters_without_compiling_again(
    models_dir: Path, adapter_dirs: dict[str, Path], compilations: Compilations
) -> None:
    spec = replace(ModelRegistry.load().get("tiny"), compile=True, adapter_slots=2, adapter_rank=16)
    library = AdapterLibrary(lambda use: adapter_dirs[use.name])
    engine = SamplerEngine(ModelRegistry({"tiny": spec}), models_dir, CPU, adapters=library)
    engine.load("tiny")  # compiled and warmed up, every bucket, guided and not
    compiled = compilations.graphs
    for adapters in [(("style", 1.0),), (("subject", 0.5), ("wide", 1.0)), (), (("style", 0.3),)]:
        p = replace(job(51, *adapters), width=128, height=128)
        result = solo(engine, p)
        assert bool(torch.isfinite(result).all())
    assert compilations.graphs == compiled


def test_a_registry_entry_with_few_slots_takes_that_many_adapters_a_job_unless_it_says(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text('[models.small]\nsource = "builtin:tiny"\nfamily = "tiny"\nadapter_slots = 2\n')
    assert ModelRegistry.load(path).get("small").adapters_per_job == 2


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ('family = "sim"\nsource = "builtin:sim"\nadapter_slots = 4', "a sim model takes no adapters"),
        ('family = "tiny"\nadapter_slots = -1', "adapter_slots must be a whole number >= 0, not -1"),
        ('family = "tiny"\nadapter_slots = 4\nadapter_rank = 0', "adapter_rank must be at least 1"),
        (
            'family = "tiny"\nadapter_slots = 2\nadapters_per_job = 3',
            "adapters_per_job must be within 1..adapter_slots",
        ),
    ],
)
def test_the_registry_refuses_adapter_settings_that_cannot_work(tmp_path: Path, lines: str, error: str) -> None:
    path = tmp_path / "registry.toml"
    source = "" if "source" in lines else 'source = "builtin:tiny"\n'
    path.write_text(f"[models.bad]\n{source}{lines}\n")
    with pytest.raises(ModelError, match=error.replace(".", r"\.")):
        ModelRegistry.load(path)


FLOW_MODELS = ("tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-z-image")


@pytest.mark.parametrize("model", FLOW_MODELS)
def test_the_new_families_take_adapters_of_every_layer_a_push_accepts_per_member_of_a_fused_call(
    models_dir: Path, tmp_path: Path, model: str
) -> None:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(models_dir / model)
    layers = layers_of_config(models_dir / model / "transformer" / "config.json")  # as a push reads them
    directory = write_diffusers_lora(
        tmp_path / "adapter", pipe.transformer, list(layers.adapted), rank=4, seed=9, prefix="transformer"
    )
    spec = replace(ModelRegistry.load().get(model), adapter_slots=2, adapter_rank=4, adapters_per_job=1)
    check_fits(read_lora(directory, spec.family), layers, max_rank=spec.adapter_rank)  # what a push checks
    library = AdapterLibrary(lambda use: directory)

    def new() -> SamplerEngine:
        return SamplerEngine(ModelRegistry({model: spec}), models_dir, CPU, adapters=library)

    size = spec.default_width
    styled = replace(
        job(61, ("style", 1.0), steps=3, guidance=spec.default_guidance), model=model, width=size, height=size
    )
    plain = replace(styled, adapters=(), seed=62)
    fused = new()
    denoiser = fused.denoisers[spec.family]
    assert isinstance(denoiser, DiffusersDenoiser)
    denoiser.fuse_batches = True
    results = fused.sample_batch([member(styled), member(plain)])
    reference = new()
    for p, result in zip((styled, plain), results, strict=True):
        assert isinstance(result, torch.Tensor), result
        torch.testing.assert_close(result, solo(reference, p), rtol=1e-4, atol=1e-4)
    first = results[0]
    assert isinstance(first, torch.Tensor)
    assert not torch.allclose(solo(reference, replace(styled, adapters=())), first, atol=1e-3)


def test_members_with_adapters_never_read_the_device_back_and_copy_onto_it_only_as_they_start(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    from gpu_worker.denoising.checkpoint_capture import CheckpointPolicy, MemberCheckpoints
    from tests.unit.test_host_sync import META, HostToDevice

    spec = replace(ModelRegistry.load().get("tiny"), adapter_slots=4, adapter_rank=16, adapters_per_job=2)
    library = AdapterLibrary(lambda use: adapter_dirs[use.name])
    engine = SamplerEngine(ModelRegistry({"tiny": spec}), models_dir, META, adapters=library)
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    pipe = engine.load("tiny")
    requests = [job(71, ("style", 1.0)), job(72), job(73, ("subject", 0.5), ("wide", 1.0))]
    copies: list[int] = []
    counter = HostToDevice()
    members = [member(p, lambda step, total: copies.append(counter.copies)) for p in requests]
    with counter:
        runs = denoiser.denoise(pipe, spec, members, MemberCheckpoints(META, CheckpointPolicy()))
    assert [r.result for r in runs] == [None] * 3 and all(r.step == r.total for r in runs)
    # The first step copies the members' rows' adapters onto the device; no later one copies anything.
    first_round = len(members)
    assert copies[first_round - 1 :] == [copies[first_round - 1]] * (len(copies) - first_round + 1)


def test_a_model_that_takes_adapters_keeps_its_projections_unfused_and_quantizes_beneath_them(
    models_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    from services.models import speed

    spec = replace(ModelRegistry.load().get("tiny"), adapter_slots=2, adapter_rank=16, fuse_qkv=True)
    assert not speed.SpeedOptions.of(spec, CPU).fuse_qkv
    assert not speed.SpeedOptions.of(replace(spec, fuse_qkv=False, optimize=True), CPU).fuse_qkv
    styled = job(81, ("style", 1.0))
    plain = solo(new_engine(models_dir, adapter_dirs), styled)
    library = AdapterLibrary(lambda use: adapter_dirs[use.name])
    int8 = SamplerEngine(ModelRegistry({"tiny": replace(spec, quantize="int8")}), models_dir, CPU, adapters=library)
    quantized = solo(int8, styled)
    slots = slots_of(int8.load("tiny"))
    assert slots is not None
    layer = next(iter(slots.layers.values()))
    assert type(layer.base.weight).__name__ == "Int8Tensor" and layer.down.dtype == torch.float32
    # The base weights quantized, the adapters' deltas not: the drift is int8's alone.
    unadapted = solo(int8, replace(styled, adapters=()))
    assert float((quantized - plain).abs().max()) < 0.05 * float(plain.abs().max())
    assert not torch.allclose(quantized, unadapted, atol=1e-3)


def test_an_attempt_that_found_every_slot_held_is_retried_and_an_adapter_that_cannot_apply_is_not() -> None:
    from gpu_worker.adapters.slots import SlotsFull
    from gpu_worker.jobs.failures import classify
    from services.models.adapters.lora_files import AdapterError
    from services.models.store.errors import ModelNotInStore

    full = classify(SlotsFull("all 2 adapter slots hold adapters that running jobs use"))
    assert (full.retryable, full.blames_worker) == (True, False)
    for exc in (AdapterError("the adapter adapts x, which is not a linear layer"), ModelNotInStore("style:v1")):
        failure = classify(exc)
        assert (failure.retryable, failure.blames_worker, failure.cause) == (False, False, "invalid input")
