from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet import network, postgres_ha
from tests.fleet.fleet import Fleet
from tests.needs import require


@pytest.fixture(scope="module")
def fleet(models_dir: Path) -> Iterator[Fleet]:
    """The whole fleet, started once for the module's scenarios; each scenario
    heals what it broke."""
    # Skipped where it cannot run (not root, no namespaces, no pg_auto_failover);
    # failed in CI, which is meant to run it.
    require(network.unavailable_reason() or postgres_ha.unavailable_reason())
    # Outside pytest's own (0700) directories: the postgres user works under it.
    root = Path(tempfile.mkdtemp(prefix="darkroom-fleet-"))
    root.chmod(0o755)
    hosts = network.Network(root / "logs")
    built = Fleet(root, hosts, models_dir)
    try:
        built.start()
        yield built
    finally:
        built.stop()
        hosts.close()
        if not os.environ.get("DARKROOM_KEEP_FLEET"):  # its logs, for a look after a failure
            shutil.rmtree(root, ignore_errors=True)
