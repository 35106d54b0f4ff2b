"""Adapters applied per row of one network call, on the miniature SD UNet: each row
gets what diffusers' own LoRA loading (PEFT) gives for its adapters and scales; a
compiled network serves new adapters without compiling again; an evicted adapter
reloads to the same output; and adapters that do not fit are refused by name."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.adapters.slots import AdapterSlots, SlotsFull
from services.models import speed
from services.models.adapters.lora_files import AdapterError, LoraLayer, LoraWeights, read_lora
from services.models.adapters.network_layers import check_fits, layers_of_config, network_layers
from services.models.spec import ModelFamily
from tests.lora_files import attention_layers, write_diffusers_lora, write_kohya_lora

TINY = ModelFamily.TINY


def unet(models_dir: Path) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet").eval()


def inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, 16, 16, generator=g)
    text = torch.randn(rows, 77, 32, generator=g)
    return x, torch.tensor(500), text


@torch.inference_mode()
def call(network: Any, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    return network(x, t, encoder_hidden_states=text, return_dict=False)[0]


@pytest.fixture(scope="module")
def adapters(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    network = unet(models_dir)
    root = tmp_path_factory.mktemp("adapters")
    every = list(network_layers(network).adapted)
    return {
        "style": write_kohya_lora(root / "style", network, attention_layers(network), rank=4, alpha=8.0, seed=1),
        "plain": write_kohya_lora(root / "plain", network, attention_layers(network), seed=1, text_encoder=False),
        "subject": write_diffusers_lora(root / "subject", network, every, rank=8, seed=2),
        "wide": write_diffusers_lora(root / "wide", network, attention_layers(network), rank=16, seed=3),
    }


def slots_on(network: Any, *, slots: int = 4, rank: int = 16, per_row: int = 2, rows: int = 8) -> AdapterSlots:
    return AdapterSlots(network, slots=slots, rank=rank, per_row=per_row, rows=rows, dtype=torch.float32)


def test_an_adapter_gives_what_diffusers_own_lora_loading_gives(models_dir: Path, adapters: dict[str, Path]) -> None:
    from diffusers import StableDiffusionPipeline

    x, t, text = inputs(1)
    pipe = StableDiffusionPipeline.from_pretrained(models_dir / "tiny", safety_checker=None)
    base = call(pipe.unet, x, t, text)
    pipe.load_lora_weights(adapters["plain"], weight_name="style.safetensors", adapter_name="style")
    pipe.load_lora_weights(adapters["subject"], adapter_name="subject")
    pipe.set_adapters(["style", "subject"], [0.7, 1.3])
    reference = call(pipe.unet, x, t, text)
    assert not torch.allclose(reference, base, atol=1e-3)  # the adapters move the output

    network = unet(models_dir)
    slots = slots_on(network)
    slots.load("style", read_lora(adapters["plain"], TINY))
    slots.load("subject", read_lora(adapters["subject"], TINY))
    with slots.rows([(("style", 0.7), ("subject", 1.3))]):
        ours = call(network, x, t, text)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    with slots.rows([()]):
        torch.testing.assert_close(call(network, x, t, text), base, rtol=0, atol=0)


def test_each_row_of_a_mixed_call_gets_its_own_adapters(models_dir: Path, adapters: dict[str, Path]) -> None:
    network = unet(models_dir)
    slots = slots_on(network)
    for name in ("style", "subject", "wide"):
        slots.load(name, read_lora(adapters[name], TINY))
    rows: list[tuple[tuple[str, float], ...]] = [
        (("style", 1.0),),
        (("style", 1.0),),
        (),
        (("subject", 0.5), ("wide", 1.0)),
        (("wide", -0.8),),
        (),
    ]
    x, t, text = inputs(6)
    with slots.rows(rows):
        mixed = call(network, x, t, text)
    for i, row in enumerate(rows):
        with slots.rows([row]):
            alone = call(network, x[i : i + 1], t, text[i : i + 1])
        # The base network's CPU kernels block other batch sizes differently: close, and
        # each row's delta is its own (another row's adapter would move it by far more).
        torch.testing.assert_close(mixed[i : i + 1], alone, rtol=1e-5, atol=1e-5)


@pytest.fixture
def compilations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    import torch._dynamo

    torch._dynamo.reset()
    graphs = [0]

    def counting(graph: Any, example_inputs: Any) -> Any:  # as test_speed_options.Compilations
        graphs[0] += 1
        return graph.forward

    monkeypatch.setattr(speed, "COMPILE_BACKEND", counting)
    yield graphs
    torch._dynamo.reset()


def test_a_compiled_network_serves_new_and_reloaded_adapters_without_compiling_again(
    models_dir: Path, adapters: dict[str, Path], compilations: list[int]
) -> None:
    eager = unet(models_dir)
    eager_slots = slots_on(eager, slots=1)
    network = unet(models_dir)
    slots = slots_on(network, slots=1)
    compiled = speed.prepare(network, speed.SpeedOptions(compile=True))
    x, t, text = inputs(2)
    with slots.rows([(), ()]):
        call(compiled, x, t, text)
    first = compilations[0]
    assert first > 0
    for name in ("style", "wide", "subject", "style"):  # one slot: each evicts the last
        slots.load(name, read_lora(adapters[name], TINY))
        eager_slots.load(name, read_lora(adapters[name], TINY))
        rows: list[tuple[tuple[str, float], ...]] = [((name, 0.9),), ()]
        with slots.rows(rows):
            got = call(compiled, x, t, text)
        with eager_slots.rows(rows):
            torch.testing.assert_close(got, call(eager, x, t, text), rtol=1e-5, atol=1e-5)
    assert compilations[0] == first


def test_an_evicted_adapter_reloads_to_the_same_output(models_dir: Path, adapters: dict[str, Path]) -> None:
    network = unet(models_dir)
    slots = slots_on(network, slots=2)
    x, t, text = inputs(1)
    style = read_lora(adapters["style"], TINY)
    slots.load("style", style)
    with slots.rows([(("style", 1.0),)]):
        first = call(network, x, t, text)
    slots.load("subject", read_lora(adapters["subject"], TINY))
    slots.load("wide", read_lora(adapters["wide"], TINY))  # the least recently used, style, goes
    assert slots.resident == ["subject", "wide"]
    slots.load("style", style)
    with slots.rows([(("style", 1.0),)]):
        assert torch.equal(call(network, x, t, text), first)


def test_adapters_that_running_jobs_hold_are_never_evicted(models_dir: Path, adapters: dict[str, Path]) -> None:
    slots = slots_on(unet(models_dir), slots=1)
    slots.load("style", read_lora(adapters["style"], TINY))
    slots.hold(["style"])
    with pytest.raises(SlotsFull, match="all 1 adapter slots"):
        slots.load("wide", read_lora(adapters["wide"], TINY))
    assert slots.resident == ["style"]
    slots.release(["style"])
    slots.load("wide", read_lora(adapters["wide"], TINY))
    assert slots.resident == ["wide"]


def test_kohya_files_are_read_with_their_alphas_and_their_text_encoder_part_named_as_skipped(
    adapters: dict[str, Path],
) -> None:
    style = read_lora(adapters["style"], TINY)
    assert style.skipped == ("text_encoder",)
    assert style.rank == 4
    subject = read_lora(adapters["subject"], TINY)
    assert subject.skipped == () and subject.rank == 8
    # alpha 8 over rank 4: every up projection twice the file's.
    from safetensors.torch import load_file

    raw = load_file(adapters["style"] / "style.safetensors")
    [name] = [n for n in style.layers if n.endswith("attn1.to_q")][:1]
    key = "lora_unet_" + name.replace(".", "_")
    torch.testing.assert_close(style.layers[name].up, raw[f"{key}.lora_up.weight"] * 2.0)


def test_adapters_that_do_not_fit_are_refused_naming_the_layer(
    models_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    layers = layers_of_config(models_dir / "tiny" / "unet" / "config.json")
    assert layers == network_layers(unet(models_dir))
    check_fits(read_lora(adapters["wide"], TINY), layers, max_rank=16)
    with pytest.raises(AdapterError, match=r"rank is 16; .* rank 8 at most"):
        check_fits(read_lora(adapters["wide"], TINY), layers, max_rank=8)
    name = next(iter(layers.adapted))
    wrong = LoraWeights({name: LoraLayer(torch.zeros(4, 7), torch.zeros(3, 4))}, ())
    with pytest.raises(AdapterError, match=f"layer {name} maps 7 features to 3"):
        check_fits(wrong, layers)
    stray = LoraWeights({"mid_block.nowhere": LoraLayer(torch.zeros(4, 7), torch.zeros(3, 4))}, ())
    with pytest.raises(AdapterError, match=r"adapts mid_block\.nowhere, which is not a linear layer"):
        check_fits(stray, layers)
    two = tmp_path / "two"
    shutil.copytree(adapters["subject"], two)
    shutil.copy(adapters["style"] / "style.safetensors", two)
    with pytest.raises(AdapterError, match=r"one \.safetensors file; found 2"):
        read_lora(two, TINY)
    with pytest.raises(AdapterError, match="not to wan"):
        read_lora(adapters["style"], ModelFamily.WAN)


def sdxl_shaped_unet() -> Any:
    """SDXL's UNet in miniature: linear projections, two conditions it adds (pooled
    text, sizes) and a block of two transformer layers."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    network: Any = UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
        transformer_layers_per_block=(1, 2),
    )
    return network.eval()


def test_an_sdxl_shaped_unet_takes_each_rows_adapters_with_its_added_conditions(tmp_path: Path) -> None:
    """SDXL's UNet adds its pooled text and size conditions through linear layers of its
    own (``add_embedding``): they are called rows first too."""
    network = sdxl_shaped_unet()
    assert "add_embedding.linear_1" in network_layers(network).adapted
    directory = write_diffusers_lora(tmp_path / "xl", network, list(network_layers(network).adapted), rank=4, seed=5)
    weights = read_lora(directory, ModelFamily.SDXL)
    slots = slots_on(network, rank=4)
    slots.load("xl", weights)
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(3, 4, 16, 16, generator=g), torch.randn(3, 77, 32, generator=g)
    added = {"text_embeds": torch.randn(3, 32, generator=g), "time_ids": torch.randn(3, 6, generator=g)}

    def run(rows: list[tuple[tuple[str, float], ...]], i: slice) -> torch.Tensor:
        conditions = {k: v[i] for k, v in added.items()}
        with torch.inference_mode(), slots.rows(rows):
            return network(x[i], 500, encoder_hidden_states=text[i], added_cond_kwargs=conditions).sample

    rows: list[tuple[tuple[str, float], ...]] = [(("xl", 1.0),), (), (("xl", -0.5),)]
    mixed = run(rows, slice(0, 3))
    for i, row in enumerate(rows):
        torch.testing.assert_close(mixed[i : i + 1], run([row], slice(i, i + 1)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mixed[0], run([()], slice(0, 1))[0], atol=1e-3)
