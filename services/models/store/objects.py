"""The one client of the model store's bucket (any S3-compatible endpoint): blobs by
digest, manifests by name and version, and the concurrent ranged reads a host's
cache fetches blobs with. The driver's errors become the project's in ``services.models.store.s3``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import obstore
from obstore.exceptions import AlreadyExistsError
from obstore.store import S3Store

if TYPE_CHECKING:
    from obstore import ObjectMeta

from services.config.model_store import ModelStoreSettings
from services.models.store.errors import ModelNotInStore, ModelStoreError, ModelVersionExists
from services.models.store.manifest import (
    COMPILED_PREFIX,
    MANIFESTS_PREFIX,
    Manifest,
    blob_key,
    check_name,
    compiled_key,
    latest_key,
    manifest_key,
)
from services.models.store.records import Removal, StoredVersion
from services.models.store.s3 import driver_errors, s3_client, scoped_client

_MB = 1024 * 1024


class ObjectStore:
    def __init__(
        self, store: S3Store, *, url: str, bucket: str, fetch_streams: int = 8, fetch_range_bytes: int = 16 * _MB
    ) -> None:
        self._store = store
        self.url = url
        self.bucket = bucket
        self.fetch_streams = fetch_streams
        self.fetch_range_bytes = fetch_range_bytes

    @classmethod
    def from_settings(cls, settings: ModelStoreSettings) -> ObjectStore:
        return cls(
            s3_client(settings),
            url=settings.model_store_url,
            bucket=settings.model_store_bucket,
            fetch_streams=settings.model_fetch_streams,
            fetch_range_bytes=settings.model_fetch_range_mb * _MB,
        )

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return driver_errors(self.url, self.bucket, doing)

    def _exists(self, key: str) -> bool:
        with self._errors(f"looking for {key}"):
            try:
                obstore.head(self._store, key)
                return True
            except FileNotFoundError:
                return False

    def scoped(self, prefix: str) -> ObjectStore:
        """This store's client for the store of its own under ``prefix`` (a tenant's
        adapters, under ``tenants/<tenant id>/``): the same layout of blobs and
        manifests, every key under ``prefix``, with this client's identity."""
        if not prefix.endswith("/") or prefix.startswith("/"):
            raise ValueError(f"a store's prefix is a folder: {prefix!r}")
        return ObjectStore(
            scoped_client(self._store, prefix),
            url=self.url,
            bucket=f"{self.bucket}/{prefix.rstrip('/')}",
            fetch_streams=self.fetch_streams,
            fetch_range_bytes=self.fetch_range_bytes,
        )

    # Compiled artifacts and their signed records (services.models.compile_cache): small, whole, by name.

    def read_compiled(self, name: str) -> bytes | None:
        with self._errors(f"reading compiled/{name}"):
            try:
                return bytes(obstore.get(self._store, compiled_key(name)).bytes())
            except FileNotFoundError:
                return None

    def write_compiled(self, name: str, data: bytes) -> None:
        with self._errors(f"writing compiled/{name}"):
            obstore.put(self._store, compiled_key(name), data)

    def compiled_names(self) -> dict[str, int]:
        """Each object under ``compiled/`` by name, with its size."""
        with self._errors("listing compiled artifacts"):
            listed = obstore.list(self._store, COMPILED_PREFIX).collect()
        return {meta["path"].removeprefix(COMPILED_PREFIX): meta["size"] for meta in listed}

    def remove_compiled(self, names: Iterable[str]) -> None:
        with self._errors("removing compiled artifacts"):
            obstore.delete(self._store, [compiled_key(name) for name in names])

    # Blobs.

    def has_blob(self, digest: str) -> bool:
        return self._exists(blob_key(digest))

    def put_blob(self, digest: str, path: Path) -> None:
        """Uploads the file at ``path`` as the blob ``digest`` (streamed, in parts);
        the caller hashed it. An object appears whole or not at all."""
        with self._errors(f"uploading {path} as blob {digest}"):
            obstore.put(self._store, blob_key(digest), Path(path))

    def small_blob(self, digest: str) -> bytes:
        """A blob's bytes whole, in memory: for a config file, never for weights."""
        with self._errors(f"reading blob {digest}"):
            try:
                return bytes(obstore.get(self._store, blob_key(digest)).bytes())
            except FileNotFoundError:
                raise ModelNotInStore(f"blob {digest} is not in the model store {self.url}") from None

    async def read_blob(
        self,
        digest: str,
        size: int,
        dest_fd: int,
        *,
        offset: int = 0,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Writes bytes [offset, size) of blob ``digest`` into the open file
        ``dest_fd`` at their own offsets, as ranged reads ``fetch_streams`` at a
        time, ``fetch_range_bytes`` each: no more than those ranges are held in
        memory. ``on_bytes(n)`` after each range written. The digest is not
        checked here: the cache checks the whole file."""
        if not 0 <= offset <= size:
            raise ValueError(f"offset {offset} is outside blob {digest} of {size} bytes")
        starts = iter(range(offset, size, self.fetch_range_bytes))
        key = blob_key(digest)

        async def fetch_ranges() -> None:
            # Each stream takes the next range when it has written its last.
            for start in starts:
                end = min(start + self.fetch_range_bytes, size)
                with self._errors(f"reading blob {digest} bytes {start}-{end}"):
                    data = await obstore.get_range_async(self._store, key, start=start, end=end)
                if len(data) != end - start:
                    raise ModelStoreError(
                        f"model store {self.url}: blob {digest} gave {len(data)} bytes for range {start}-{end}"
                    )
                await asyncio.to_thread(_pwrite_all, dest_fd, memoryview(data), start)
                if on_bytes is not None:
                    on_bytes(end - start)

        streams = min(self.fetch_streams, max(1, -(-(size - offset) // self.fetch_range_bytes)))
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest
                for _ in range(streams):
                    group.create_task(fetch_ranges())
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the first failure; the rest are of the same cause

    # Manifests.

    def latest_version(self, name: str) -> str | None:
        check_name("model name", name)
        with self._errors(f"reading the latest version of {name}"):
            try:
                return bytes(obstore.get(self._store, latest_key(name)).bytes()).decode().strip() or None
            except FileNotFoundError:
                return None

    def read_manifest(self, name: str, version: str | None = None) -> Manifest:
        """The manifest of ``name:version`` (the latest when None)."""
        check_name("model name", name)
        if version is None:
            version = self.latest_version(name)
            if version is None:
                raise ModelNotInStore(f"model {name!r} is not in the model store {self.url} (bucket {self.bucket})")
        check_name("version", version)
        with self._errors(f"reading the manifest of {name}:{version}"):
            try:
                raw = bytes(obstore.get(self._store, manifest_key(name, version)).bytes())
            except FileNotFoundError:
                raise ModelNotInStore(
                    f"model {name}:{version} is not in the model store {self.url} (bucket {self.bucket})"
                ) from None
        manifest = Manifest.from_json(raw)
        if (manifest.name, manifest.version) != (name, version):
            raise ModelStoreError(
                f"the manifest at {manifest_key(name, version)} is of {manifest.name}:{manifest.version}"
            )
        return manifest

    def read_manifest_if_present(self, name: str, version: str) -> Manifest | None:
        try:
            return self.read_manifest(name, version)
        except ModelNotInStore:
            return None

    def point_latest(self, name: str, version: str) -> None:
        with self._errors(f"pointing the latest version of {name} at {version}"):
            obstore.put(self._store, latest_key(name), check_name("version", version).encode())

    def write_manifest(self, manifest: Manifest, *, replace: bool = False) -> None:
        """Writes the manifest (after its blobs: a manifest names only stored
        blobs), then points the model's latest at it. Without
        ``replace`` the version must be new: the write is conditional, so of two
        pushes of one version at once the second is refused, not silently lost."""
        key = manifest_key(manifest.name, manifest.version)
        with self._errors(f"writing the manifest of {manifest.name}:{manifest.version}"):
            try:
                obstore.put(self._store, key, manifest.to_json(), mode="overwrite" if replace else "create")
            except AlreadyExistsError:
                raise ModelVersionExists(
                    f"{manifest.name}:{manifest.version} was pushed by someone else meanwhile; push again to compare"
                ) from None
        self.point_latest(manifest.name, manifest.version)

    def _manifest_objects(self) -> list[ObjectMeta]:
        """Every stored manifest object (``manifests/<name>/<version>.json``)."""
        with self._errors("listing the manifests"):
            objects = [o for chunk in obstore.list(self._store, prefix=MANIFESTS_PREFIX) for o in chunk]
        return [o for o in objects if o["path"].endswith(".json") and o["path"].count("/") == 2]

    def manifests(self) -> list[tuple[Manifest, datetime]]:
        """Every version's manifest and when it was pushed, by name then by when."""
        objects = sorted(self._manifest_objects(), key=lambda o: (o["path"].split("/")[1], o["last_modified"]))
        found = []
        for o in objects:
            _, name, version = o["path"].removesuffix(".json").split("/")
            found.append((self.read_manifest(name, version), o["last_modified"]))
        return found

    def list_models(self) -> list[StoredVersion]:
        """Every version of every model, by name then by when it was pushed."""
        listed = []
        objects = sorted(self._manifest_objects(), key=lambda o: (o["path"].split("/")[1], o["last_modified"]))
        latest: dict[str, str | None] = {}
        for o in objects:
            name, version = o["path"].split("/")[1], o["path"].split("/")[2].removesuffix(".json")
            if name not in latest:
                latest[name] = self.latest_version(name)
            manifest = self.read_manifest(name, version)
            files = len(manifest.files)
            kind = str(manifest.entry.get("kind", "model"))
            listed.append(StoredVersion(name, version, manifest.total_bytes, files, latest[name] == version, kind))
        return listed

    def remove(self, name: str, version: str | None = None) -> Removal:
        """Removes ``name:version`` (every version of ``name`` when None), then the
        blobs only they referenced. A removed latest points at the version pushed
        last of those that remain. Not meant to race a push of the same blobs."""
        check_name("model name", name)
        objects = self._manifest_objects()
        mine = sorted((o for o in objects if o["path"].split("/")[1] == name), key=lambda o: o["last_modified"])
        versions = [o["path"].split("/")[2].removesuffix(".json") for o in mine]
        doomed = versions if version is None else [v for v in versions if v == check_name("version", version)]
        if not doomed:
            what = name if version is None else f"{name}:{version}"
            raise ModelNotInStore(f"model {what} is not in the model store {self.url} (bucket {self.bucket})")
        removed_blobs: dict[str, int] = {}
        for v in doomed:
            removed_blobs.update(self.read_manifest(name, v).blobs())
        with self._errors(f"removing {name}"):
            obstore.delete(self._store, [manifest_key(name, v) for v in doomed])
            remaining = [v for v in versions if v not in doomed]
            if remaining:
                if self.latest_version(name) in doomed:
                    obstore.put(self._store, latest_key(name), remaining[-1].encode())
            else:
                obstore.delete(self._store, latest_key(name))
        # Garbage collection by reference: what the manifests left still name is kept.
        referenced: set[str] = set()
        for o in self._manifest_objects():
            other, other_version = o["path"].split("/")[1], o["path"].split("/")[2].removesuffix(".json")
            referenced.update(self.read_manifest(other, other_version).blobs())
        unreferenced = {d: s for d, s in removed_blobs.items() if d not in referenced}
        with self._errors(f"deleting the blobs of {name}"):
            if unreferenced:
                obstore.delete(self._store, [blob_key(d) for d in unreferenced])
        return Removal(
            tuple(doomed), len(unreferenced), sum(unreferenced.values()), len(removed_blobs) - len(unreferenced)
        )


def _pwrite_all(fd: int, data: memoryview, position: int) -> None:
    while data:
        written = os.pwrite(fd, data, position)
        data, position = data[written:], position + written
