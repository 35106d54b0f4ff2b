"""How one service connects to a sealed NATS: its user, password, TLS context and
inbox. The bus's connections take these (``connection.connect_nats``); the sealed
mesh's accounts (``services.mesh.nats_auth``) give each user its inbox as here."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from services.mesh.pki import CertPaths
from services.mesh.secrets import read_nats_password


def inbox_prefix(user: str) -> str:
    """Where a user's replies come: its own, so that no one else may read them."""
    return f"_INBOX.{user}"


@dataclass(frozen=True)
class NatsCredentials:
    """How one service connects: its user, password, TLS context and inbox. The
    context takes a renewed certificate when ``reload_if_renewed`` is called (at
    each disconnection): the next connection presents it."""

    user: str
    password: str
    tls: ssl.SSLContext
    paths: CertPaths | None = None
    _loaded: list[tuple[float, float, float]] = field(default_factory=list, compare=False)

    def reload_if_renewed(self) -> bool:
        if self.paths is None:
            return False
        mtimes = self.paths.mtimes()
        if self._loaded and self._loaded[0] == mtimes:
            return False
        try:
            self.tls.load_cert_chain(str(self.paths.cert), str(self.paths.key))
        except (OSError, ssl.SSLError):
            return False  # half-written: the next disconnection tries again
        self._loaded[:] = [mtimes]
        return True

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)

    @classmethod
    def of(cls, mesh_dir: str | Path, role: str, user: str) -> NatsCredentials | None:
        """``user``'s credentials, presenting ``role``'s certificate; None where the
        mesh is open."""
        if not str(mesh_dir):
            return None
        paths = CertPaths.of(Path(mesh_dir), role)
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(paths.ca))
        context.load_cert_chain(str(paths.cert), str(paths.key))
        return cls(user, read_nats_password(Path(mesh_dir), user), context, paths, [paths.mtimes()])
