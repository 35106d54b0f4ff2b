"""The random-weight presets have the real architectures: the same parameter counts."""

from __future__ import annotations

import pytest

from services.models.presets import parameter_counts
from services.models.registry import BUILTIN_PRESETS, ModelFamily, ModelRegistry

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


def test_the_default_registry_offers_both_presets() -> None:
    registry = ModelRegistry.load()
    presets = {spec.source: spec for spec in registry.models.values() if spec.source in BUILTIN_PRESETS}
    assert {s.family for s in presets.values()} == {"sd15", "sdxl"}
    assert presets["builtin:sdxl-random"].default_width == 1024
