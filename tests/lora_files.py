"""LoRA adapter files for tests, written deterministically from a seed for the
layers of a real network: in diffusers' (PEFT) format, or kohya's with alphas and a
text encoder's part."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.models.adapters.network_layers import adaptable, network_layers

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


def attention_layers(network: torch.nn.Module) -> list[str]:
    """The network's attention projections: what trainers adapt by default."""
    return [n for n in network_layers(network).adapted if n.endswith(ATTENTION)]


def lora_tensors(
    network: torch.nn.Module, layers: Iterable[str], *, rank: int, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(down, up) of each layer (any linear or 1x1 convolution layer of the network,
    one the sampler refuses too), drawn from ``seed``, large enough to move an image."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(layers):
        features = adaptable(network.get_submodule(name))
        assert features is not None, name
        fan_in, fan_out = features
        down, up = torch.randn(rank, fan_in, generator=g) / fan_in**0.5, torch.randn(fan_out, rank, generator=g) * 0.3
        if isinstance(network.get_submodule(name), torch.nn.Conv2d):  # a 1x1 convolution's, as trainers save it
            down, up = down[:, :, None, None], up[:, :, None, None]
        out[name] = (down, up)
    return out


def write_diffusers_lora(
    directory: Path,
    network: torch.nn.Module,
    layers: Iterable[str],
    *,
    rank: int = 4,
    seed: int = 0,
    prefix: str = "unet",
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, (down, up) in lora_tensors(network, layers, rank=rank, seed=seed).items():
        state[f"{prefix}.{name}.lora_A.weight"] = down.contiguous()
        state[f"{prefix}.{name}.lora_B.weight"] = up.contiguous()
    save_file(state, directory / "pytorch_lora_weights.safetensors")
    return directory


def write_kohya_lora(
    directory: Path,
    network: torch.nn.Module,
    layers: Iterable[str],
    *,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    text_encoder: bool = True,
) -> Path:
    """kohya's names (``lora_unet_`` and underscores), an alpha per layer, and (with
    ``text_encoder``) a text encoder layer the sampler does not apply."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, (down, up) in lora_tensors(network, layers, rank=rank, seed=seed).items():
        key = "lora_unet_" + name.replace(".", "_")
        state[f"{key}.lora_down.weight"] = down.contiguous()
        state[f"{key}.lora_up.weight"] = up.contiguous()
        state[f"{key}.alpha"] = torch.tensor(alpha)
    if not text_encoder:
        save_file(state, directory / "style.safetensors")
        return directory
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    state[f"{te}.lora_down.weight"] = torch.zeros(rank, 32)
    state[f"{te}.lora_up.weight"] = torch.zeros(32, rank)
    state[f"{te}.alpha"] = torch.tensor(alpha)
    save_file(state, directory / "style.safetensors")
    return directory
