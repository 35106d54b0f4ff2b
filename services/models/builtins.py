"""The models Darkroom builds itself, on first use, into the models directory: the
miniatures with random weights that tests and the demo run on a CPU, and the real
architectures with random weights that benchmarks measure."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Builtin:
    """A model Darkroom builds itself, on first use, into the models directory:
    ``build(path)`` of ``module``, which leaves ``marker`` in a whole model."""

    module: str
    build: str
    marker: str


_FLOW_TINY = "services.models.flow_tiny"
_FLOW_PRESETS = "services.models.flow_presets"
_QWEN = "services.models.qwen_tiny"
_Z_IMAGE = "services.models.z_image"
BUILTINS = {
    # Miniatures with random weights, for tests and the demo: they run on a CPU in seconds.
    "builtin:tiny": Builtin("services.models.tiny", "build_tiny_model", "darkroom_tiny.json"),
    "builtin:tiny-wan": Builtin("services.models.wan", "build_tiny_wan", "darkroom_tiny_wan.json"),
    "builtin:tiny-wan22": Builtin("services.models.wan", "build_tiny_wan22", "darkroom_tiny_wan22.json"),
    "builtin:tiny-upscaler": Builtin("services.models.upscaler", "build_tiny_upscaler", "darkroom_tiny_upscaler.json"),
    "builtin:tiny-sd3": Builtin(_FLOW_TINY, "build_tiny_sd3", "darkroom_tiny_sd3.json"),
    "builtin:tiny-flux": Builtin(_FLOW_TINY, "build_tiny_flux_dev", "darkroom_tiny_flux.json"),
    "builtin:tiny-flux-schnell": Builtin(_FLOW_TINY, "build_tiny_flux_schnell", "darkroom_tiny_flux.json"),
    "builtin:tiny-flux-kontext": Builtin(_FLOW_TINY, "build_tiny_flux_kontext", "darkroom_tiny_flux.json"),
    "builtin:tiny-qwen-image": Builtin(_QWEN, "build_tiny_qwen_image", "darkroom_tiny_qwen_image.json"),
    "builtin:tiny-z-image": Builtin(_Z_IMAGE, "build_tiny_z_image", "darkroom_tiny_z_image.json"),
    "builtin:tiny-qwen-image-edit": Builtin(_QWEN, "build_tiny_qwen_image_edit", "darkroom_tiny_qwen_image_edit.json"),
    # The real architectures with random weights, for benchmarks: they cost what the
    # real models cost to load and run; their output is noise.
    "builtin:sd15-random": Builtin("services.models.presets", "build_sd15_preset", "darkroom_preset.json"),
    "builtin:sdxl-random": Builtin("services.models.presets", "build_sdxl_preset", "darkroom_preset.json"),
    "builtin:wan-random": Builtin("services.models.wan", "build_wan_preset", "darkroom_preset.json"),
    "builtin:upscaler-random": Builtin("services.models.upscaler", "build_upscaler_preset", "darkroom_preset.json"),
    "builtin:sd35-medium-random": Builtin(_FLOW_PRESETS, "build_sd35_medium_preset", "darkroom_preset.json"),
    "builtin:flux1-dev-random": Builtin(_FLOW_PRESETS, "build_flux1_dev_preset", "darkroom_preset.json"),
    "builtin:flux1-schnell-random": Builtin(_FLOW_PRESETS, "build_flux1_schnell_preset", "darkroom_preset.json"),
    "builtin:qwen-image-random": Builtin(_FLOW_PRESETS, "build_qwen_image_preset", "darkroom_preset.json"),
    "builtin:z-image-turbo-random": Builtin(_Z_IMAGE, "build_z_image_turbo_preset", "darkroom_preset.json"),
}


# The miniatures: `darkroom up` builds them up front.
MINIATURES = frozenset(
    {
        "builtin:tiny",
        "builtin:tiny-wan",
        "builtin:tiny-wan22",
        "builtin:tiny-upscaler",
        "builtin:tiny-sd3",
        "builtin:tiny-flux",
        "builtin:tiny-flux-schnell",
        "builtin:tiny-flux-kontext",
        "builtin:tiny-qwen-image",
        "builtin:tiny-z-image",
        "builtin:tiny-qwen-image-edit",
    }
)


def builtin_dir(models_dir: Path, source: str) -> Path:
    """Where the builtin ``source`` is built: one directory per builtin, whichever
    registry entries serve it (a variant with other options shares its weights)."""
    return models_dir / source.removeprefix("builtin:")


def ensure_builtin(builtin: Builtin, path: Path) -> Path:
    """Builds ``builtin`` at ``path`` once; concurrent callers see a whole model or none."""
    build = getattr(importlib.import_module(builtin.module), builtin.build)
    return _ensure_built(path, builtin.marker, build)


def _ensure_built(path: Path, marker: str, build: Callable[[Path], Path]) -> Path:
    if (path / marker).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        build(scratch)
        try:
            os.rename(scratch, path)
        except OSError:
            if not (path / marker).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path
