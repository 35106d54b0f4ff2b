"""A LoRA adapter's weights as the sampler applies them: for each layer of the
denoising network it adapts, its down and up projections, its alpha over its rank
folded into the up projection. Read with the base family's own diffusers loader
(``lora_state_dict``), so that every format that loader converts (diffusers/PEFT,
kohya's, and the trainers' others for Flux and Qwen-Image) is read here too.

Only the denoising network's layers are applied: a text encoder's part of an
adapter (kohya's ``lora_te``) is listed as skipped, never silently half-used."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.errors import ModelError
from services.models.adapters.families import LORA_LOADERS
from services.models.spec import ADAPTED_FAMILIES, ModelFamily


class AdapterError(ModelError):
    """An adapter's files cannot be read, or do not fit the network they name."""


@dataclass(frozen=True)
class LoraLayer:
    """One adapted layer: ``up @ down`` is its weight's change at scale 1."""

    down: torch.Tensor  # (rank, in features)
    up: torch.Tensor  # (out features, rank), alpha / rank folded in

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclass(frozen=True)
class LoraWeights:
    layers: Mapping[str, LoraLayer]  # by the network's module name
    skipped: tuple[str, ...]  # parts of the file not applied (a text encoder's)

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.down, layer.up))


def weights_file(directory: Path) -> Path:
    """The adapter's one ``.safetensors`` file in ``directory``."""
    found = sorted(p for p in Path(directory).glob("*.safetensors") if not p.name.startswith("."))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(p.name for p in found)})"
        raise AdapterError(f"{directory}: an adapter is one .safetensors file; found {what}")
    return found[0]


def read_lora(directory: Path, family: ModelFamily) -> LoraWeights:
    """The adapter in ``directory`` for a model of ``family``, in float32 on the CPU."""
    if family not in ADAPTED_FAMILIES:
        raise AdapterError(f"adapters apply to {', '.join(sorted(ADAPTED_FAMILIES))}; not to {family}")
    pipeline, network = LORA_LOADERS[family]
    path = weights_file(directory)
    state, alphas, metadata = _state_dict(pipeline, path)
    ours = {k[len(network) + 1 :]: v for k, v in state.items() if k.startswith(network + ".")}
    skipped = sorted({k.split(".", 1)[0] for k in state if not k.startswith(network + ".")})
    if not ours:
        raise AdapterError(f"{path.name} adapts no layer of a {family} model's {network}")
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    peft = convert_unet_state_dict_to_peft(ours) if not any("lora_A" in k for k in ours) else ours
    layer_alphas = _layer_alphas(alphas, network)
    layers: dict[str, LoraLayer] = {}
    for key in sorted(peft):
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        up = peft.get(f"{module}.lora_B.weight")
        if up is None:
            raise AdapterError(f"{path.name}: layer {module} has a down projection and no up projection")
        down = _as_matrix(peft[key], module)
        up = _as_matrix(up, module)
        if up.shape[1] != down.shape[0]:
            raise AdapterError(f"{path.name}: layer {module}'s projections disagree on its rank")
        alpha = _alpha(module, down.shape[0], layer_alphas, metadata)
        layers[module] = LoraLayer(down, up * (alpha / down.shape[0]))
    unpaired = [k for k in peft if ".lora_" not in k or k.endswith(".lora_B.bias")]
    if unpaired:
        raise AdapterError(f"{path.name}: {unpaired[0]} is not a LoRA weight the sampler applies")
    return LoraWeights(layers, tuple(skipped))


def _state_dict(pipeline: str, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, Any]]:
    """The file's state dict in diffusers' names, its network alphas (kohya's) and
    its LoRA metadata (a PEFT adapter's alpha), as the family's loader reads them."""
    import diffusers

    cls = getattr(diffusers, pipeline)
    try:
        try:
            read = cls.lora_state_dict(str(path.parent), weight_name=path.name, return_lora_metadata=True)
        except TypeError:  # a loader that returns no metadata
            read = cls.lora_state_dict(str(path.parent), weight_name=path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise AdapterError(f"cannot read {path.name} as a LoRA: {exc}") from exc
    parts = read if isinstance(read, tuple) else (read,)
    state = parts[0]
    alphas = next((p for p in parts[1:] if isinstance(p, dict) and _numbers(p)), None) or {}
    metadata = next((p for p in parts[1:] if isinstance(p, dict) and not _numbers(p)), None) or {}
    return dict(state), {k: float(v) for k, v in alphas.items()}, dict(metadata)


def _numbers(d: dict[str, Any]) -> bool:
    return bool(d) and all(isinstance(v, int | float | torch.Tensor) for v in d.values())


def _as_matrix(weight: torch.Tensor, module: str) -> torch.Tensor:
    """A linear layer's projection, or a 1x1 convolution's as one."""
    if weight.dim() == 4 and weight.shape[2:] == (1, 1):
        weight = weight[:, :, 0, 0]
    if weight.dim() != 2:
        raise AdapterError(f"layer {module}: a projection of shape {tuple(weight.shape)}; only linear and 1x1 ones")
    return weight.detach().to("cpu", torch.float32).contiguous()


def _layer_alphas(alphas: Mapping[str, float], network: str) -> dict[str, float]:
    """Kohya's per-layer alphas, by the network's module name."""
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    ours = {k.removesuffix(".alpha")[len(network) + 1 :]: v for k, v in alphas.items() if k.startswith(network + ".")}
    converted = convert_unet_state_dict_to_peft(dict.fromkeys(ours, torch.empty(0)))
    return {k.rsplit(".lora_", 1)[0]: ours[old] for k, old in zip(converted, ours, strict=True)}


def _alpha(module: str, rank: int, layer_alphas: Mapping[str, float], metadata: Mapping[str, Any]) -> float:
    """The layer's alpha: kohya's for the layer, a PEFT adapter's (its pattern's, or
    its one), or its rank (a scale of 1), as diffusers' loader takes it."""
    if module in layer_alphas:
        return layer_alphas[module]
    pattern = metadata.get("alpha_pattern") or {}
    for suffix, value in pattern.items():
        if module == suffix or module.endswith("." + suffix):
            return float(value)
    if "lora_alpha" in metadata:
        return float(metadata["lora_alpha"])
    return float(rank)
