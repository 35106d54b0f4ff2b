"""What the fleet's compiled artifacts put in this host's compiler cache: the files
that ``torch.compiler.load_cache_artifacts`` created or changed as it loaded each
one (inductor's graphs under ``fxgraph/``, AOTAutograd's under ``aotautograd/``,
autotuning results, dynamo's profiles, triton's kernels), found by comparing the
cache's directories before and after, and kept in a small JSON file per artifact
(``<cache dir>/darkroom-fleet/<digest>.json``). An artifact later found bad has
those files deleted: a later compilation on this host generates its code afresh
rather than taking it from inductor's cache.

The cache's directories are inductor's (``TORCHINDUCTOR_CACHE_DIR``, or torch's
default under the temporary directory) and triton's where ``TRITON_CACHE_DIR`` puts
it elsewhere. Another process of the host writing there during a load has its
files counted as the artifact's too: dropping them costs that process a compilation,
never a wrong load."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from services.mesh.pki import write_private

PROVENANCE_DIR = "darkroom-fleet"

# A file's identity in a snapshot: a rewrite (torch's writes replace a file) changes it.
Stat = tuple[int, int, int]


@dataclass(frozen=True)
class Provenance:
    """The files of this host's compiler cache that loading one artifact wrote."""

    digest: str  # the compile key's
    artifact_sha256: str
    files: tuple[str, ...]  # absolute paths


def cache_roots() -> list[Path]:
    """Where torch writes what it loads from cache artifacts, now."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inductor = Path(cache_dir())
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton and not Path(triton).resolve().is_relative_to(inductor.resolve()):
        return [inductor, Path(triton)]
    return [inductor]


def snapshot(roots: list[Path]) -> dict[str, Stat]:
    """Every cache file under ``roots`` with its identity; locks and this module's
    own files aside."""
    found: dict[str, Stat] = {}
    for root in roots:
        for directory, subdirectories, files in os.walk(root):
            if Path(directory) == root and PROVENANCE_DIR in subdirectories:
                subdirectories.remove(PROVENANCE_DIR)
            for name in files:
                if name.endswith(".lock"):
                    continue
                path = os.path.join(directory, name)
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile by another process
                    st = os.stat(path)
                    found[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


class HostEntries:
    """This host's record of which cache files each loaded artifact wrote."""

    def _directory(self) -> Path:
        return cache_roots()[0] / PROVENANCE_DIR

    @contextlib.contextmanager
    def recording(self, digest: str, artifact_sha256: str) -> Iterator[None]:
        """Keeps, as the artifact's, the cache files created or changed while the
        block runs (whether or not it raises: a load that failed halfway may have
        written some)."""
        roots = cache_roots()
        before = snapshot(roots)
        try:
            yield
        finally:
            after = snapshot(roots)
            written = {path for path, stat in after.items() if before.get(path) != stat}
            if written:
                self._add(Provenance(digest, artifact_sha256, tuple(sorted(written))))

    def _add(self, provenance: Provenance) -> None:
        # Another sampler of the host that loaded the same artifact keeps its files too.
        kept = next((p for p in self.loaded() if p.digest == provenance.digest), None)
        if kept is not None and kept.artifact_sha256 == provenance.artifact_sha256:
            files = tuple(sorted({*kept.files, *provenance.files}))
            provenance = Provenance(provenance.digest, provenance.artifact_sha256, files)
        path = self._directory() / f"{provenance.digest}.json"
        write_private(path, json.dumps(asdict(provenance), indent=1).encode())

    def loaded(self) -> list[Provenance]:
        """The artifacts this host loaded and has not dropped."""
        found = []
        for path in sorted(self._directory().glob("*.json")):
            with contextlib.suppress(FileNotFoundError, ValueError, TypeError, KeyError):
                values = json.loads(path.read_text())
                found.append(Provenance(values["digest"], values["artifact_sha256"], tuple(values["files"])))
        return found

    def drop(self, provenance: Provenance) -> int:
        """Deletes the artifact's files (those still under the cache's directories)
        and its record here; how many files were deleted."""
        roots = [root.resolve() for root in cache_roots()]
        deleted = 0
        for name in provenance.files:
            path = Path(name)
            if not any(path.resolve().is_relative_to(root) for root in roots):
                continue  # not the cache's: a record written under another cache directory
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                deleted += 1
        (self._directory() / f"{provenance.digest}.json").unlink(missing_ok=True)
        return deleted
