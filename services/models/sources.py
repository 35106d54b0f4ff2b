"""Where ``from_pretrained`` finds a model of the registry: a builtin built into the
models directory on first use, a version of the model store resolved in the
host's cache, a local directory, or a hub id."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from services.errors import ModelError
from services.models.builtins import BUILTINS, builtin_dir, ensure_builtin
from services.models.spec import ModelSpec, store_reference


def resolve_source(
    spec: ModelSpec, models_dir: Path, *, building: AbstractContextManager[Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """Where ``from_pretrained`` loads the model from, and how. A builtin is built
    under ``building`` (building one constructs modules, as a load does); a store
    model's fetch, a network wait of up to minutes, is under no lock of the caller's."""
    builtin = BUILTINS.get(spec.source)
    if builtin is not None:
        with building or nullcontext():
            return str(ensure_builtin(builtin, builtin_dir(models_dir, spec.source))), {"local_files_only": True}
    stored = store_reference(spec)
    if stored is not None:
        from services.models.host_cache import loading  # the store's client is loaded only where used

        return str(loading.model_dir(spec.name, *stored)), {"local_files_only": True}
    local = Path(spec.source).expanduser()
    if local.is_dir():
        return str(local), {"local_files_only": True}
    if spec.source.startswith(("/", ".", "~")):
        raise ModelError(f"model {spec.name!r}: directory {spec.source} does not exist")
    return spec.source, {}
