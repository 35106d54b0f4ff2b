"""Compiled once per fleet: what compiling a model's networks produced
(``torch.compiler.save_cache_artifacts``: inductor's generated kernels, AOTAutograd's
graphs, autotuning results) kept in the model store under a key made of everything
that makes it valid, and loaded (``torch.compiler.load_cache_artifacts``) by every
other sampler before it compiles the same: its compilation then generates no code
(inductor's graph cache hits), and takes what tracing takes.

The key: the model's content (its files' paths and sizes, and its configs' bytes),
torch's and triton's versions, the device (a GPU's name and compute capability; a
CPU's architecture and the instructions torch uses), the speed options, the
compiler backend and the shapes the warm-up compiles. Another key misses, and the
sampler compiles as if there were no cache, then shares what it compiled. An
artifact that does not load (corrupt, truncated, of another build) is skipped the
same way, never a failed load; so is a store that cannot be reached. A sampler
writes only under ``compiled/`` (``services.ops.model_store``): loading an artifact
runs code it holds, so the fleet trusts its samplers' artifacts as it trusts their
models (docs/security.md).

Within one host, inductor's own cache on disk already spares a second process the
work; without a store there is nothing more to do."""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from services.models.store.errors import ModelStoreError

log = logging.getLogger(__name__)

# The files whose bytes are part of a model's identity; the rest (weights) by size.
_CONFIG_SUFFIXES = (".json", ".txt", ".model")


class CacheResult(enum.Enum):
    FLEET = "fleet"  # loaded from the store: the compilation generates nothing
    MISS = "miss"  # no artifact under the key: compiled here, then shared
    CORRUPT = "corrupt"  # an artifact that did not load: compiled here, then shared again
    UNAVAILABLE = "unavailable"  # the store did not answer: compiled here, not shared


@dataclass(frozen=True)
class CompileKey:
    content: str
    torch: str
    triton: str
    device: str
    options: str
    backend: str
    shapes: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def content_digest(source: Path) -> str:
    """A model directory's identity: each file's relative path and size, and the
    bytes of its configs (a weight file is named by its size: hashing gigabytes at
    each load would cost more than the compilation it saves)."""
    h = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = path.relative_to(source).as_posix()
        h.update(f"{relative}\0{path.stat().st_size}\0".encode())
        if path.suffix in _CONFIG_SUFFIXES:
            h.update(path.read_bytes())
    return h.hexdigest()


def device_identity(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    return f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"


def triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return "none"


def compile_key(content: str, device: torch.device, options: Any, backend: str, shapes: Any) -> CompileKey:
    """The key of a compilation of the model of ``content`` on ``device`` with the
    speed options ``options``, warmed up at ``shapes`` (any value with a stable repr)."""
    device_id = device_identity(device)
    return CompileKey(content, torch.__version__, triton_version(), device_id, repr(options), backend, repr(shapes))


class CompileCache:
    """The fleet's compiled artifacts in the model store (``ObjectStore``'s
    ``read_compiled`` and ``write_compiled``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def load(self, key: CompileKey) -> CacheResult:
        """Before compiling: the artifacts under ``key`` loaded, if any load."""
        digest = key.digest()
        try:
            data = self.store.read_compiled(digest)
        except ModelStoreError as exc:
            log.warning("the fleet's compile cache is unavailable (%s): compiling here", exc)
            return CacheResult.UNAVAILABLE
        if data is None:
            return CacheResult.MISS
        try:
            if torch.compiler.load_cache_artifacts(data) is None:
                raise ValueError("no artifacts in it")
        except Exception as exc:  # whatever a bad artifact raises: it is only a cache
            log.warning("compiled artifacts %s do not load (%s: %s): compiling here", digest, type(exc).__name__, exc)
            return CacheResult.CORRUPT
        return CacheResult.FLEET

    def save(self, key: CompileKey) -> bool:
        """After compiling: this process's artifacts shared under ``key``."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        try:
            self.store.write_compiled(key.digest(), saved[0])
        except ModelStoreError as exc:
            log.warning("compiled artifacts not shared with the fleet: %s", exc)
            return False
        return True
