"""The layers of a denoising network an adapter may adapt, and whether an adapter
fits them: each layer it names is one of the network's linear (or 1x1
convolution) layers, of the same features, that the network calls one input row
per row of its call. Read from a live network, or from the network's
``config.json`` alone (built on the meta device: no weights read), which is what
pushing an adapter checks it against: the sampler's slots wrap the very layers
``network_layers`` gives, so what a push accepts is what a batch can apply."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.models.adapters.lora_files import AdapterError, LoraWeights


@dataclass(frozen=True)
class NetworkLayers:
    """A network's linear (and 1x1 convolution) layers, by module name: those an
    adapter may adapt, by their (in, out) features, and those it may not, by why."""

    adapted: Mapping[str, tuple[int, int]]
    refused: Mapping[str, str]


@dataclass(frozen=True)
class _OtherRows:
    """Layers of a network (a pattern of their module names) that it calls with other
    rows than its call's own, why, and the config flag that makes it so (None: always)."""

    layers: re.Pattern[str]
    why: str
    flag: str | None = None


# By the network's class. A row's delta is computed from its call's row of the same
# index, so where an input row is a token of every row's sequences concatenated, or a
# row the network added, no job's adapter can be applied to that job alone.
_OTHER_ROWS: Mapping[str, _OtherRows] = {
    "ZImageTransformer2DModel": _OtherRows(
        re.compile(r"(all_x_embedder|cap_embedder|siglip_embedder)\."),
        "Z-Image embeds every image's patches (and every caption's tokens) of a call as one concatenated "
        "sequence, so no row of its input is one job's",
    ),
    "QwenImageTransformer2DModel": _OtherRows(
        re.compile(r"time_text_embed\.|transformer_blocks\.\d+\.img_mod\."),
        "with zero_cond_t, Qwen-Image embeds each row's timestep and a zero one (twice the call's rows) and "
        "modulates its image stream by both",
        flag="zero_cond_t",
    ),
}


def adaptable(module: torch.nn.Module) -> tuple[int, int] | None:
    """A layer's (in, out) features if it is a layer an adapter's kind can adapt."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.Conv2d) and module.kernel_size == (1, 1) and module.groups == 1:
        return module.in_channels, module.out_channels
    return None


def network_layers(network: torch.nn.Module) -> NetworkLayers:
    """The one list of ``network``'s layers that both a push's check and the
    sampler's slots read."""
    other_rows = _OTHER_ROWS.get(type(network).__name__)
    config: Mapping[str, Any] = getattr(network, "config", {})
    if other_rows is not None and other_rows.flag is not None and not config.get(other_rows.flag):
        other_rows = None
    adapted, refused = {}, {}
    for name, module in network.named_modules():
        features = adaptable(module)
        if features is None or not name:
            continue
        if other_rows is not None and other_rows.layers.match(name):
            refused[name] = other_rows.why
        else:
            adapted[name] = features
    return NetworkLayers(adapted, refused)


def layers_of_config(config_path: Path) -> NetworkLayers:
    """The layers of the network ``config_path`` (a diffusers ``config.json``)
    describes, built without weights."""
    import diffusers

    try:
        config: dict[str, Any] = json.loads(Path(config_path).read_text())
        cls = getattr(diffusers, config["_class_name"])
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise AdapterError(f"cannot read the base network's config {config_path}: {exc}") from exc
    with torch.device("meta"):
        network = cls.from_config(config)
    return network_layers(network)


def check_fits(weights: LoraWeights, layers: NetworkLayers, *, max_rank: int | None = None) -> None:
    """Raises AdapterError naming the first layer of ``weights`` that ``layers`` lack,
    refuse (with why) or have of other features, or a rank above ``max_rank``."""
    for name, layer in weights.layers.items():
        why = layers.refused.get(name)
        if why is not None:
            raise AdapterError(f"the adapter adapts {name}, a layer no batch can adapt for one job alone: {why}")
        features = layers.adapted.get(name)
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
