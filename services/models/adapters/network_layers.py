"""The layers of a denoising network an adapter may adapt, and whether an adapter
fits them: each layer it names is one of the network's linear (or 1x1
convolution) layers, of the same features. Read from a live network, or from the
network's ``config.json`` alone (built on the meta device: no weights read), which
is what pushing an adapter checks it against."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from services.models.adapters.lora_files import AdapterError, LoraWeights

# (in features, out features) of each adaptable layer, by module name.
Layers = Mapping[str, tuple[int, int]]


def adaptable(module: torch.nn.Module) -> tuple[int, int] | None:
    """A layer's (in, out) features if an adapter may adapt it."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.Conv2d) and module.kernel_size == (1, 1) and module.groups == 1:
        return module.in_channels, module.out_channels
    return None


def network_layers(network: torch.nn.Module) -> dict[str, tuple[int, int]]:
    found = {}
    for name, module in network.named_modules():
        features = adaptable(module)
        if features is not None:
            found[name] = features
    return found


def layers_of_config(config_path: Path) -> dict[str, tuple[int, int]]:
    """The adaptable layers of the network ``config_path`` (a diffusers
    ``config.json``) describes, built without weights."""
    import diffusers

    try:
        config: dict[str, Any] = json.loads(Path(config_path).read_text())
        cls = getattr(diffusers, config["_class_name"])
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise AdapterError(f"cannot read the base network's config {config_path}: {exc}") from exc
    with torch.device("meta"):
        network = cls.from_config(config)
    return network_layers(network)


def check_fits(weights: LoraWeights, layers: Layers, *, max_rank: int | None = None) -> None:
    """Raises AdapterError naming the first layer of ``weights`` that ``layers`` lack
    or that has other features, or a rank above ``max_rank``."""
    for name, layer in weights.layers.items():
        features = layers.get(name)
        if features is None:
            raise AdapterError(f"the adapter adapts {name}, which is not a linear layer of the base network")
        given = (int(layer.down.shape[1]), int(layer.up.shape[0]))
        if given != features:
            raise AdapterError(
                f"the adapter's layer {name} maps {given[0]} features to {given[1]}; the base network's, "
                f"{features[0]} to {features[1]}"
            )
    if max_rank is not None and weights.rank > max_rank:
        raise AdapterError(f"the adapter's rank is {weights.rank}; the model takes adapters of rank {max_rank} at most")
