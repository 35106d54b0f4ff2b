"""LoRA adapters as versions of the model store, against a real S3 server
(seaweedfs): ``darkroom models push --lora`` checks an adapter against the network
of the model it adapts before anything is uploaded, refuses one that does not fit
by name (Z-Image's of a layer fed every row's tokens at once, which no batch could
apply to one job, with why), lists it as an adapter, and a sampler's host fetches it through its cache
to the very weights that were pushed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.adapters.library import AdapterLibrary, store_directory
from services.config.model_store import ModelStoreSettings
from services.generation import AdapterUse
from services.models.adapters.lora_files import read_lora
from services.models.spec import ModelFamily
from services.models.store.objects import ObjectStore
from tests.integration.test_model_store import darkroom
from tests.lora_files import attention_layers, write_diffusers_lora, write_kohya_lora

pytestmark = pytest.mark.integration

REGISTRY = """
[models.tiny]
source = "builtin:tiny"
family = "tiny"
default = true
dtype = "float32"
adapter_slots = 4
adapter_rank = 8

[models.tiny-flux]
source = "builtin:tiny-flux"
family = "flux"
dtype = "float32"
size_step = 16

[models.tiny-z-image]
source = "builtin:tiny-z-image"
family = "z_image"
dtype = "float32"
size_step = 16
adapter_slots = 2
adapter_rank = 4
"""


@pytest.fixture
def env(model_store: Any, tmp_path: Path, models_dir: Path) -> dict[str, str]:
    registry = tmp_path / "registry.toml"
    registry.write_text(REGISTRY)
    return {
        **os.environ,
        **model_store.env(),
        "DARKROOM_DATA_DIR": str(tmp_path / "data"),
        "DARKROOM_MODELS_DIR": str(models_dir),
        "DARKROOM_MODEL_REGISTRY": str(registry),
        "DARKROOM_MODEL_CACHE_DIR": str(tmp_path / "cache"),
    }


@pytest.fixture(scope="module")
def unet(models_dir: Path) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")


def names(model_store: Any) -> dict[str, str]:
    store = ObjectStore.from_settings(ModelStoreSettings.from_env(model_store.env()))
    return {f"{v.name}:{v.version}": v.kind for v in store.list_models()}


def test_an_adapter_pushes_checked_lists_as_one_and_a_sampler_fetches_its_weights(
    env: dict[str, str], model_store: Any, unet: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    style = write_kohya_lora(tmp_path / "style", unet, attention_layers(unet), rank=4, alpha=8.0, seed=5)
    pushed = darkroom(env, "push", "--lora", str(style), "style-a:v1")
    assert pushed.returncode == 0, pushed.stderr
    assert "adapter for tiny (tiny): rank 4, 32 layers of its network; not applied: its text_encoder part" in (
        pushed.stdout
    )
    listed = darkroom(env, "list")
    row = next(line.split() for line in listed.stdout.splitlines() if line.startswith("style-a "))
    assert row[:3] == ["style-a", "v1", "lora"]

    for key, value in env.items():
        if key.startswith("DARKROOM_"):
            monkeypatch.setenv(key, value)
    fetched = AdapterLibrary(store_directory).weights(AdapterUse("style-a", "v1"), ModelFamily.TINY)
    local = read_lora(style, ModelFamily.TINY)
    assert fetched.layers.keys() == local.layers.keys()
    for name, layer in local.layers.items():
        assert torch.equal(fetched.layers[name].down, layer.down) and torch.equal(fetched.layers[name].up, layer.up)


def test_adapters_that_do_not_fit_their_model_are_refused_by_name_and_nothing_is_stored(
    env: dict[str, str], model_store: Any, unet: Any, tmp_path: Path, models_dir: Path
) -> None:
    wide = write_diffusers_lora(tmp_path / "wide", unet, attention_layers(unet), rank=16, seed=6)
    small = write_diffusers_lora(tmp_path / "small", unet, attention_layers(unet), rank=2, seed=7)
    from diffusers import UNet2DConditionModel

    other: Any = UNet2DConditionModel(  # another shape of UNet: its layers' features differ
        sample_size=8,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    misfit = write_diffusers_lora(tmp_path / "misfit", other, attention_layers(other), rank=2, seed=8)
    for args, expected in (
        (("push", "--lora", str(wide), "wide-a:v1"), "the adapter's rank is 16; the model takes adapters of rank 8"),
        (("push", "--lora", str(misfit), "misfit-a:v1"), "maps 16 features to 16; the base network's, 32 to 32"),
        (("push", "--lora", "--base", "tiny-flux", str(small), "small-a:v1"), "adapts no layer of a flux model"),
        (("push", "--base", "tiny", str(small), "small-a:v1"), "--base names the model an adapter adapts"),
        (("push", "--lora", str(tmp_path / "absent"), "absent-a:v1"), "no such directory"),
    ):
        failed = darkroom(env, *args)
        assert failed.returncode != 0 and expected in failed.stderr, failed.stderr
    stored = names(model_store)
    assert not any(n.startswith(("wide-a:", "misfit-a:", "small-a:", "absent-a:")) for n in stored)


def test_a_z_image_adapter_of_an_embedder_of_every_rows_tokens_is_refused_at_push_naming_it(
    env: dict[str, str], model_store: Any, tmp_path: Path, models_dir: Path
) -> None:
    from diffusers import ZImageTransformer2DModel

    transformer: Any = ZImageTransformer2DModel.from_pretrained(models_dir / "tiny-z-image", subfolder="transformer")
    per_row = ["layers.0.attention.to_q", "layers.0.feed_forward.w1", "t_embedder.mlp.0"]
    embedder = write_diffusers_lora(
        tmp_path / "embedder", transformer, [*per_row, "all_x_embedder.2-1"], prefix="transformer"
    )
    failed = darkroom(env, "push", "--lora", "--base", "tiny-z-image", str(embedder), "embedder-z:v1")
    assert failed.returncode == 1, failed.stderr
    expected = "the adapter adapts all_x_embedder.2-1, a layer no batch can adapt for one job alone: Z-Image embeds"
    assert expected in failed.stderr
    # Its other layers alone push: each is adapted per job.
    fits = write_diffusers_lora(tmp_path / "fits", transformer, per_row, prefix="transformer")
    pushed = darkroom(env, "push", "--lora", "--base", "tiny-z-image", str(fits), "fits-z:v1")
    assert pushed.returncode == 0, pushed.stderr
    stored = names(model_store)
    assert "fits-z:v1" in stored and not any(n.startswith("embedder-z:") for n in stored)
