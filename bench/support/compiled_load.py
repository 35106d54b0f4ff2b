"""One sampler's cold load of a model with ``compile = true``, in a process of its
own, with the fleet's compile cache in the model store the environment names
(``DARKROOM_MODEL_STORE_*``, the samplers' signing key in
``DARKROOM_COMPILE_SIGNING_KEY_FILE``) and inductor's own cache wherever
``TORCHINDUCTOR_CACHE_DIR`` says (empty: as on another host). It prints one JSON
line: what the fleet's cache gave it, the seconds compiling took, inductor's
counters (``fxgraph_cache_hit``, ``fxgraph_cache_miss``) and how many artifacts'
files it dropped from its compiler cache first. Run by
``bench/compile_time.py --fleet`` and ``tests/integration/test_compile_cache.py``.

    python bench/support/compiled_load.py MODELS_DIR MODEL [--size 64] [--max-batch 1]"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from prometheus_client import REGISTRY
from torch._dynamo.utils import counters

from gpu_worker.engine import SamplerEngine
from services.config.model_store import ModelStoreSettings
from services.config.workers import SamplerSettings
from services.models.compile_cache import CompileCache
from services.models.registry import ModelRegistry
from services.models.store.objects import ObjectStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models_dir", type=Path)
    parser.add_argument("model")
    parser.add_argument("--size", type=int, default=0, help="the warm-up's size (default: the model's)")
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    base = ModelRegistry.load().get(args.model)
    size = args.size or base.default_width
    spec = replace(
        base,
        compile=True,
        max_batch=args.max_batch,
        max_images=min(base.max_images, args.max_batch),
        default_width=size,
        default_height=size,
        adapter_slots=0,
    )
    signing = SamplerSettings.from_env().compile_signing_key
    store = ObjectStore.from_settings(ModelStoreSettings.from_env())
    cache = CompileCache(store, signing.key if signing is not None else None, "compiled-load")
    device = torch.device(args.device)
    engine = SamplerEngine(ModelRegistry({spec.name: spec}), args.models_dir, device, compile_cache=cache)
    loaded = engine.denoiser_for(spec).load(spec)  # what the engine's model cache does on a cold load
    result = loaded.compile_cache.value if loaded.compile_cache is not None else None
    dropped = REGISTRY.get_sample_value("darkroom_model_compile_cache_dropped_total") or 0
    inductor = dict(counters["inductor"])
    print(json.dumps({"result": result, "compile_s": loaded.compile_s, "inductor": inductor, "dropped": int(dropped)}))


if __name__ == "__main__":
    main()
