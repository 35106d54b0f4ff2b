"""Text encoders served by the decoder service (``text_encoders = "service"``): the
sampler loads the network alone (its encoders None, its bytes the network's), each
member brings the conditioning the decoder's engine encoded with the shared encoding
(``services.models.prompt_encoding``), as safetensors bytes, and on the CPU the latents
are exactly those of encoders on the device. The decoder's engine loads a model's
encoders once, keeps what it encoded by prompt, and refuses a model by name."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_worker.denoising.diffusers_denoiser import TEXT_ENCODERS, ConditioningNotServed, DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.denoising.prompts import Conditioning
from gpu_worker.engine import SamplerEngine
from services.errors import InvalidArgument, ModelError
from services.generation import GenerationParams
from services.models import prompt_encoding
from services.models.loader import module_bytes
from services.models.prompt_encoding import PromptParams
from services.models.registry import ModelRegistry
from services.models.text_encoders import PromptRequest, TextEncoderEngine

CPU = torch.device("cpu")
MODELS = ["tiny-flux", "tiny-sd3", "tiny-z-image"]


def registry(model: str, place: str) -> ModelRegistry:
    return ModelRegistry({model: replace(ModelRegistry.load().get(model), text_encoders=place)})


def engine(models_dir: Path, model: str, place: str) -> SamplerEngine:
    return SamplerEngine(registry(model, place), models_dir, CPU)


def job(model: str, prompt: str = "a lighthouse", seed: int = 1, guidance: float = 3.5) -> GenerationParams:
    return GenerationParams(model, prompt, "fog", 64, 64, 3, guidance, seed, 1)


def served(encoders: TextEncoderEngine, sampler: SamplerEngine, params: GenerationParams) -> MemberInputs:
    """The member's inputs as the worker makes them: the decoder's bytes, read back."""
    asked = PromptRequest(
        params.model,
        PromptParams(params.prompt, params.negative_prompt, params.width, params.height),
        sampler.classifier_free(params),
    )
    data, _ = encoders.encode(asked)
    return MemberInputs(conditioning=Conditioning.of(prompt_encoding.from_bytes(data)))


def test_a_conditioning_round_trips_through_safetensors_with_every_field_and_dtype() -> None:
    every = Conditioning(
        embeds=torch.randn(1, 7, 16, dtype=torch.bfloat16),
        negative_embeds=torch.randn(1, 5, 16, dtype=torch.float16),
        pooled=torch.randn(1, 8),
        negative_pooled=torch.randn(1, 8),
        time_ids=torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]),
        mask=torch.tensor([[True] * 5 + [False] * 2]),
        negative_mask=torch.ones(1, 5, dtype=torch.bool),
        text_lengths=torch.tensor([5]),  # Z-Image's host fields: int64
        negative_text_lengths=torch.tensor([3]),
    )
    data = prompt_encoding.to_bytes(every.tensors())
    assert not data.startswith(b"\x80")  # no pickle
    back = Conditioning.of(prompt_encoding.from_bytes(data))
    assert set(back.tensors()) == set(every.tensors()) and len(every.tensors()) == 9
    for name, tensor in every.tensors().items():
        got = back.tensors()[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    with pytest.raises(ValueError, match="safetensors"):
        prompt_encoding.from_bytes(b"not a conditioning")
    with pytest.raises(ValueError, match="no \\['weights'\\]"):
        Conditioning.of({"weights": torch.zeros(1)})


@pytest.mark.parametrize("model", MODELS)
def test_the_decoders_encoding_is_exactly_the_samplers(models_dir: Path, model: str) -> None:
    sampler = engine(models_dir, model, "device")
    spec = sampler.registry.get(model)
    denoiser = sampler.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    pipe = sampler.load(model)
    encoders = TextEncoderEngine(registry(model, "service"), models_dir, CPU, 2**20)
    for params in (job(model), job(model, guidance=0.0)):
        cfg = denoiser.classifier_free(params)
        with torch.inference_mode():  # as the sampler encodes (T5's CPU kernels differ outside it)
            own = denoiser.encode_prompt(pipe, spec, params, cfg).tensors()
        theirs = served(encoders, sampler, params).conditioning
        assert theirs is not None and set(theirs.tensors()) == set(own)
        for name, tensor in own.items():
            assert theirs.tensors()[name].dtype == tensor.dtype
            assert torch.equal(theirs.tensors()[name], tensor), name


@pytest.mark.parametrize("model", MODELS)
def test_a_served_model_loads_without_its_encoders_and_gives_the_devices_latents(models_dir: Path, model: str) -> None:
    service = engine(models_dir, model, "service")
    pipe = service.load(model)
    assert all(getattr(pipe, name, None) is None for name in TEXT_ENCODERS)
    denoiser = service.denoiser_for(service.registry.get(model))
    assert isinstance(denoiser, DiffusersDenoiser)
    [measured] = [m["bytes"] for m in service.models.footprints().values()]
    assert measured == module_bytes(denoiser.network(pipe))
    device = engine(models_dir, model, "device")
    encoders = TextEncoderEngine(registry(model, "service"), models_dir, CPU, 2**20)
    jobs = [job(model, "a lighthouse", 1), job(model, "a red fox", 2, guidance=5.0)]
    members = [
        BatchMember(p, lambda step, total: None, threading.Event(), inputs=served(encoders, service, p)) for p in jobs
    ]
    batch = service.sample_batch(members)
    for p, got in zip(jobs, batch, strict=True):
        alone = device.sample(p, lambda step, total: None, threading.Event())
        assert isinstance(got, torch.Tensor) and torch.equal(got, alone)
    # Each member's conditioning is its own, on it: a cache emptied before the batch loses nothing.
    service.prompts.forget(model)
    again = service.sample_batch(members)
    assert all(torch.equal(a, b) for a, b in zip(again, batch, strict=True))  # type: ignore[arg-type]


def test_a_served_member_without_its_conditioning_fails_alone(models_dir: Path) -> None:
    model = "tiny-flux"
    service = engine(models_dir, model, "service")
    encoders = TextEncoderEngine(registry(model, "service"), models_dir, CPU, 2**20)
    good = job(model, "a red fox", 2)
    results = service.sample_batch(
        [
            BatchMember(job(model), lambda step, total: None, threading.Event()),
            BatchMember(good, lambda step, total: None, threading.Event(), inputs=served(encoders, service, good)),
        ]
    )
    assert isinstance(results[0], ConditioningNotServed) and "decoder service" in str(results[0])
    assert isinstance(results[1], torch.Tensor)


def test_the_decoder_encodes_a_prompt_once_and_refuses_a_model_by_name(models_dir: Path) -> None:
    encoders = TextEncoderEngine(registry("tiny-flux", "service"), models_dir, CPU, 2**20)
    asked = PromptRequest("tiny-flux", PromptParams("a lighthouse"), False)
    first, cached = encoders.encode(asked)
    again, cached_again = encoders.encode(asked)
    assert (cached, cached_again, first) == (False, True, again)
    assert (encoders.encoded, encoders.reused) == (1, 1)
    telemetry = encoders.telemetry()
    assert telemetry["text_encoder_models"] == ["tiny-flux"] and telemetry["text_encoder_bytes"] > 0
    assert encoders.cache.bytes == len(first)
    for unknown in ("nope", "tiny"):  # not in its registry; its encoders not served
        with pytest.raises(InvalidArgument) as err:
            encoders.encode(replace(asked, model=unknown))
        assert [v.field for v in err.value.violations] == ["model"]
    mixed = ModelRegistry({"tiny": ModelRegistry.load().get("tiny")})
    with pytest.raises(InvalidArgument, match="not served"):
        TextEncoderEngine(mixed, models_dir, CPU, 0).encode(replace(asked, model="tiny"))


def test_a_conditioning_larger_than_the_cache_is_not_kept(models_dir: Path) -> None:
    encoders = TextEncoderEngine(registry("tiny-flux", "service"), models_dir, CPU, 16)
    asked = PromptRequest("tiny-flux", PromptParams("a lighthouse"), False)
    assert [encoders.encode(asked)[1] for _ in range(2)] == [False, False]
    assert encoders.cache.bytes == 0


def test_the_registry_takes_service_and_refuses_it_for_a_family_without_served_encoders(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    flux = '[models.m]\nsource = "builtin:tiny-flux"\nfamily = "flux"\nsize_step = 16\n'
    path.write_text(flux + 'text_encoders = "service"\n')
    assert ModelRegistry.load(path).get("m").text_encoders == "service"
    path.write_text('[models.m]\nsource = "builtin:sim"\nfamily = "sim"\ntext_encoders = "service"\n')
    with pytest.raises(ModelError, match="no text encoders a decoder serves"):
        ModelRegistry.load(path)
