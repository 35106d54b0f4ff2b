"""The random-weight presets have the real architectures: the same parameter counts."""

from __future__ import annotations

import pytest

from services.errors import ModelError
from services.models.presets import parameter_counts
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily

# The published models' counts (diffusers' and transformers' own classes).
REAL = {
    ModelFamily.SD15: {"unet": 859_520_964, "text_encoder": 123_060_480, "vae": 83_653_863},
    ModelFamily.SDXL: {
        "unet": 2_567_463_684,
        "text_encoder": 123_060_480,
        "text_encoder_2": 694_659_840,
        "vae": 83_653_863,
    },
}


@pytest.mark.parametrize("kind", sorted(REAL))
def test_a_preset_has_the_real_parameter_counts(kind: ModelFamily) -> None:
    assert parameter_counts(kind) == REAL[kind]


def test_the_default_registry_offers_the_presets_only_on_request() -> None:
    served = ModelRegistry.load()
    everything = ModelRegistry.load(presets=None)
    presets = {name: spec for name, spec in everything.models.items() if spec.on_request}
    assert set(presets) == {
        "sd15-random",
        "sdxl-random",
        "wan-random",
        "upscaler-random",
        "sd35-medium-random",
        "flux1-dev-random",
        "flux1-dev-fp8-random",
        "flux1-schnell-random",
        "flux1-kontext-random",
        "qwen-image-random",
        "z-image-turbo-random",
    }
    assert not set(presets) & set(served.models)
    assert ModelRegistry.load(presets=["wan-random"]).get("wan-random").family == ModelFamily.WAN
    assert presets["sdxl-random"].default_width == 1024


def test_a_preset_not_in_the_registry_is_refused_by_name() -> None:
    with pytest.raises(ModelError, match="'sd3-random'"):
        ModelRegistry.load(presets=["sd3-random"])


def test_each_capability_lists_its_default_first() -> None:
    listing = [(s.capability, s.name, s.default) for s in ModelRegistry.load(presets=None).listing()]
    assert listing[0] == ("image", "tiny", True)
    firsts: dict[str, tuple[str, bool]] = {}
    for capability, name, default in listing:
        firsts.setdefault(capability, (name, default))
    assert firsts == {"image": ("tiny", True), "video": ("tiny-wan", True), "upscale": ("tiny-upscaler", True)}
