"""Pushing a LoRA adapter to the model store as a version of its own, tied to the
registry model it adapts: its files read as that model's family reads them, and
checked against that model's network (its layers' names and features, read from
the network's config alone, each one a layer the sampler adapts per job, and its
rank against the model's ``adapter_rank``) before anything is uploaded. The manifest's entry says what it is, so that a
gateway refuses a request that names it for another family without reading it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from services.models.adapters.lora_files import LORA_LOADERS, AdapterError, LoraWeights, read_lora
from services.models.adapters.network_layers import NetworkLayers, check_fits, layers_of_config
from services.models.spec import ADAPTED_FAMILIES, ModelSpec, store_reference
from services.models.store.objects import ObjectStore
from services.models.store.push import PushResult, push_directory, source_directory

KIND = "lora"


def base_layers(base: ModelSpec, models_dir: Path, store: ObjectStore) -> NetworkLayers:
    """The layers of ``base``'s denoising network, from its config file:
    in the model store (that file's blob alone), a builtin or a local directory."""
    network = LORA_LOADERS[base.family][1]
    config = f"{network}/config.json"
    stored = store_reference(base)
    if stored is None:
        return layers_of_config(source_directory(base.source, models_dir) / config)
    manifest = store.read_manifest(*stored)
    ref = next((f for f in manifest.files if f.path == config), None)
    if ref is None:
        raise AdapterError(f"{manifest.name}:{manifest.version} in the model store has no {config}")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "config.json"
        path.write_bytes(store.small_blob(ref.digest))
        return layers_of_config(path)


def adapter_entry(base: ModelSpec, weights: LoraWeights) -> dict[str, Any]:
    return {
        "kind": KIND,
        "family": str(base.family),
        "base": base.name,
        "rank": weights.rank,
        "layers": len(weights.layers),
        "skipped": list(weights.skipped),
    }


def check_adapter(weights: LoraWeights, base: ModelSpec, models_dir: Path, store: ObjectStore) -> None:
    """Raises AdapterError where ``weights`` (read for ``base``'s family) cannot adapt
    ``base``: a model that takes no adapters; a layer its network lacks, has of other
    features or cannot adapt for one job of a batch, named; a rank above its
    ``adapter_rank``."""
    _takes_adapters(base)
    check_fits(
        weights, base_layers(base, models_dir, store), max_rank=base.adapter_rank if base.adapter_slots else None
    )


def push_adapter(
    store: ObjectStore, directory: Path, reference: str, base: ModelSpec, models_dir: Path, *, force: bool = False
) -> tuple[PushResult, LoraWeights]:
    _takes_adapters(base)  # before its files are read: a refusal that names the model
    weights = read_lora(directory, base.family)
    check_adapter(weights, base, models_dir, store)
    return push_directory(store, directory, reference, entry=adapter_entry(base, weights), force=force), weights


def _takes_adapters(base: ModelSpec) -> None:
    if base.family not in ADAPTED_FAMILIES:
        raise AdapterError(f"model {base.name!r} is a {base.family} model, which takes no adapters")
