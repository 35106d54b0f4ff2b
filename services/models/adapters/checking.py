"""An uploaded adapter checked as `darkroom models push --lora` checks one (its file
read as the base model's family reads it, every layer it adapts one the sampler
adapts per job, of the same features, its rank at most the base model's), in a
process of its own: ``python -m services.models.adapters.checking REQUEST`` reads
the request, a JSON file, and answers on stdout. The gateway, which takes the file
from the internet, never parses it itself nor imports torch and diffusers for it,
and a file that exhausts the parser takes this process alone, within its deadline.

The request: ``directory`` (the adapter's, one .safetensors file), ``family``,
``max_rank``, and the base network's config: ``network_config`` (the JSON itself,
as the store's manifest of the base model records it) or ``source`` and
``models_dir`` (a builtin or a directory, read from there). The answer: ``rank``,
``layers`` and ``skipped``, or ``error``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.errors import ModelError
from services.models.adapters.families import LORA_LOADERS
from services.models.adapters.lora_files import LoraWeights, read_lora
from services.models.adapters.network_layers import check_fits, layers_of_config
from services.models.spec import ModelFamily
from services.models.store.push import source_directory


def check(request: dict[str, Any]) -> LoraWeights:
    """The adapter's weights if they fit the base network; AdapterError (or
    ModelError) naming what does not."""
    family = ModelFamily(request["family"])
    network = LORA_LOADERS[family][1]
    weights = read_lora(Path(request["directory"]), family)
    with tempfile.TemporaryDirectory() as scratch:
        if request.get("network_config") is not None:
            config = Path(scratch) / "config.json"
            config.write_text(json.dumps(request["network_config"]))
        else:
            config = source_directory(request["source"], Path(request["models_dir"])) / network / "config.json"
        check_fits(weights, layers_of_config(config), max_rank=request.get("max_rank"))
    return weights


def main() -> int:
    try:
        weights = check(json.loads(Path(sys.argv[1]).read_text()))
    except (ModelError, ValueError, KeyError, OSError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    except Exception as exc:  # a file the readers below refuse in a way of their own
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"rank": weights.rank, "layers": len(weights.layers), "skipped": list(weights.skipped)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
