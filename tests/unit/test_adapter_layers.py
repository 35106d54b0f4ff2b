"""One list of the layers an adapter may adapt, for the push that checks it and the
sampler that applies it: for every adapted family's network, what a push accepts
(read from the network's config, on the meta device) is what the sampler's slots
wrap, and exactly the linear layers a real batch calls with one input row per row
of its call. A layer called with every row's tokens concatenated (Z-Image's
embedders) or with rows the network adds (Qwen-Image's with ``zero_cond_t``) is
neither wrapped nor accepted: an adapter of it is refused naming it and why."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.adapters.library import AdapterLibrary, slots_of
from gpu_worker.adapters.mixed_lora import AdaptedLayer, RowTable
from gpu_worker.adapters.slots import AdapterSlots
from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.adapters.lora_files import LORA_LOADERS, AdapterError, read_lora
from services.models.adapters.network_layers import adaptable, check_fits, layers_of_config
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily
from tests.lora_files import write_diffusers_lora
from tests.unit import test_flux_kontext, test_qwen_image_edit
from tests.unit.test_joining import member
from tests.unit.test_mixed_lora import sdxl_shaped_unet

CPU = torch.device("cpu")
# Every adapted family's miniature; SDXL's network is the UNet's class, with its own
# conditions (``sdxl_shaped_unet``, below).
MINIATURES = (
    "tiny",
    "tiny-sd3",
    "tiny-flux",
    "tiny-flux-kontext",
    "tiny-qwen-image",
    "tiny-qwen-image-edit",
    "tiny-z-image",
)
EDITS = {"tiny-flux-kontext": test_flux_kontext, "tiny-qwen-image-edit": test_qwen_image_edit}


@contextlib.contextmanager
def row_counts(network: torch.nn.Module, table: RowTable) -> Iterator[dict[str, bool]]:
    """For each linear layer of ``network`` called meanwhile, wrapped or not, whether
    every call gave it one input row per row of the network's call (``table``'s)."""
    wrapped = {id(m.base) for m in network.modules() if isinstance(m, AdaptedLayer)}
    seen: dict[str, bool] = {}
    hooks = []
    for name, module in network.named_modules():
        if isinstance(module, AdaptedLayer) or (adaptable(module) and id(module) not in wrapped):

            def record(module: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                seen[name] = seen.get(name, True) and args[0].shape[0] == table.rows

            hooks.append(module.register_forward_pre_hook(record))
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def two_members(model: str, guidance: float, size: int) -> list[BatchMember]:
    edit = EDITS.get(model)
    if edit is not None:
        return [edit.member(edit.params(seed, steps=2), edit.image(seed)) for seed in (1, 2)]
    return [
        member(GenerationParams(model, f"a lighthouse {seed}" * seed, "", size, size, 2, guidance, seed, 1))
        for seed in (1, 2)
    ]


@pytest.mark.parametrize("model", MINIATURES)
def test_a_push_accepts_the_layers_the_sampler_wraps_which_a_batch_calls_one_row_per_row(
    models_dir: Path, model: str
) -> None:
    spec = replace(ModelRegistry.load().get(model), adapter_slots=1, adapter_rank=4, adapters_per_job=1)
    pushed = layers_of_config(models_dir / model / LORA_LOADERS[spec.family][1] / "config.json")
    engine = SamplerEngine(ModelRegistry({model: spec}), models_dir, CPU, adapters=AdapterLibrary())
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    denoiser.fuse_batches = True  # one call for both members: two rows (four, guided) each call
    pipe = engine.load(model)
    slots = slots_of(pipe)
    assert slots is not None
    with row_counts(denoiser.network(pipe), slots.table) as calls:
        results = engine.sample_batch(two_members(model, spec.default_guidance, spec.default_width))
    assert all(isinstance(r, torch.Tensor) for r in results), results
    assert calls == {**dict.fromkeys(pushed.adapted, True), **dict.fromkeys(pushed.refused, False)}
    assert {name: layer.features for name, layer in slots.layers.items()} == pushed.adapted


def zero_cond_qwen_image() -> Any:
    """Qwen-Image's network as Qwen-Image-Edit-2511 configures it (``zero_cond_t``)."""
    from diffusers import QwenImageTransformer2DModel

    from services.models.qwen_tiny import TINY_TRANSFORMER

    torch.manual_seed(0)
    network: Any = QwenImageTransformer2DModel(**TINY_TRANSFORMER, zero_cond_t=True)
    return network.eval()


def call_qwen_image(network: Any, rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    text = torch.randn(rows, 7, 32, generator=g)
    image = torch.randn(rows, 2 * 4 * 4, 64, generator=g)  # a latent and an input image's, 4x4 patches each
    network(
        image,
        text,
        torch.ones(rows, 7),
        torch.full((rows,), 0.5),
        [[(1, 4, 4), (1, 4, 4)]] * rows,
    )


def call_sdxl_unet(network: Any, rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    added = {"text_embeds": torch.randn(rows, 32, generator=g), "time_ids": torch.randn(rows, 6, generator=g)}
    network(
        torch.randn(rows, 4, 16, 16, generator=g),
        500,
        encoder_hidden_states=torch.randn(rows, 77, 32, generator=g),
        added_cond_kwargs=added,
    )


@pytest.mark.parametrize(
    ("make", "call"),
    [(sdxl_shaped_unet, call_sdxl_unet), (zero_cond_qwen_image, call_qwen_image)],
    ids=["sdxl", "qwen-image-zero-cond-t"],
)
def test_networks_without_a_miniature_have_one_list_too(
    tmp_path: Path, make: Callable[[], Any], call: Callable[[Any, int], None]
) -> None:
    network = make()
    network.save_config(tmp_path)
    pushed = layers_of_config(tmp_path / "config.json")
    slots = AdapterSlots(network, slots=1, rank=4, per_row=1, rows=3, dtype=torch.float32)
    with torch.inference_mode(), row_counts(network, slots.table) as calls, slots.rows([(), (), ()]):
        call(network, 3)
    assert calls == {**dict.fromkeys(pushed.adapted, True), **dict.fromkeys(pushed.refused, False)}
    assert {name: layer.features for name, layer in slots.layers.items()} == pushed.adapted


def test_qwen_image_with_zero_cond_t_refuses_its_timestep_and_image_modulation_layers(tmp_path: Path) -> None:
    network = zero_cond_qwen_image()
    network.save_config(tmp_path)
    refused = layers_of_config(tmp_path / "config.json").refused
    assert sorted(refused) == [
        "time_text_embed.timestep_embedder.linear_1",
        "time_text_embed.timestep_embedder.linear_2",
        "transformer_blocks.0.img_mod.1",
        "transformer_blocks.1.img_mod.1",
    ]


@pytest.mark.parametrize("layer", ["all_x_embedder.2-1", "cap_embedder.1"])
def test_a_z_image_adapter_of_an_embedder_of_every_rows_tokens_is_refused_naming_it(
    models_dir: Path, tmp_path: Path, layer: str
) -> None:
    from diffusers import ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel.from_pretrained(models_dir / "tiny-z-image", subfolder="transformer")
    directory = write_diffusers_lora(
        tmp_path / "adapter", transformer, ["layers.0.attention.to_q", layer], prefix="transformer"
    )
    weights = read_lora(directory, ModelFamily.Z_IMAGE)
    assert layer in weights.layers  # the family's loader reads it: the check refuses it
    layers = layers_of_config(models_dir / "tiny-z-image" / "transformer" / "config.json")
    expected = f"the adapter adapts {layer}, a layer no batch can adapt for one job alone: Z-Image embeds every"
    with pytest.raises(AdapterError, match=re.escape(expected)):
        check_fits(weights, layers)
