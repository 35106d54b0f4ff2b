"""NATS in the sealed mesh: TLS with a certificate of the fleet's CA both ways,
and a user per service with the subjects it may use. A sampler's user is its
own (``sampler-WORKER_ID``): it may consume only its own dispatch subject, read
replies only on its own inbox, and publish only job events, and never the
dispatch stream, another worker's consumer or the stream's messages. It may also
take the model store's origin leases (a bucket of their own).

Each user publishes job events under its own name only
(``darkroom.job.<job id>.<user>``): a gateway that hears one knows who published
it, and tells a stream's client a sampler's steps, previews and statuses only when
that sampler holds the job's attempt (``gateway/streams.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from services.bus.credentials import inbox_prefix
from services.bus.dispatch import DISPATCH_PREFIX, DISPATCH_STREAM, check_worker_id, consumer_name
from services.bus.events import JOB_PREFIX, SAMPLER_PUBLISHER_PREFIX, WORK_SUBJECT
from services.bus.presence_board import CANARY, PLAN, plan_key, worker_key
from services.bus.presence_board import STREAM as PRESENCE_STREAM
from services.bus.presence_board import SUBJECT_PREFIX as PRESENCE_PREFIX
from services.db.states import WorkerKind
from services.mesh.pki import CertPaths
from services.mesh.secrets import nats_password_path, password
from services.models.host_cache.origin import STREAM as ORIGIN_STREAM
from services.models.host_cache.origin import SUBJECT_PREFIX as ORIGIN_PREFIX

SAMPLER_USER_PREFIX = SAMPLER_PUBLISHER_PREFIX  # a sampler publishes under its user's name
# The decoders' one user: they publish their heartbeats and nothing else.
DECODER_USER = "decoder"
# The users a sealed NATS has before its samplers are known.
CONTROL_USERS = ("scheduler", "gateway", "operator", DECODER_USER)
_PRESENCE_API = f"$JS.API.%s.{PRESENCE_STREAM}"
# The model store's origin leases (``services.models.host_cache.origin``): a bucket of
# its own, which any sampler may make and whose keys (one per blob) any may take.
_ORIGIN_API = f"$JS.API.%s.{ORIGIN_STREAM}"


def _origin_leases() -> list[str]:
    """Binding to the bucket (made by the first sampler), taking, refreshing, marking
    and deleting a lease (publishes on its key), and reading one (direct or not)."""
    return [
        _ORIGIN_API % "STREAM.INFO",
        _ORIGIN_API % "STREAM.CREATE",
        f"{ORIGIN_PREFIX}.origin.*",
        f"{_ORIGIN_API % 'DIRECT.GET'}.>",
        _ORIGIN_API % "STREAM.MSG.GET",
    ]


def _presence_watch() -> list[str]:
    """What watching the presence bucket takes: binding to it, an ordered
    consumer of its own (created, read, deleted), and that consumer's flow control."""
    return [
        _PRESENCE_API % "STREAM.INFO",
        _PRESENCE_API % "CONSUMER.CREATE",
        f"{_PRESENCE_API % 'CONSUMER.CREATE'}.>",
        f"{_PRESENCE_API % 'CONSUMER.INFO'}.>",
        f"{_PRESENCE_API % 'CONSUMER.DELETE'}.>",
        f"$JS.FC.{PRESENCE_STREAM}.>",
    ]


def sampler_user(worker_id: str) -> str:
    return f"{SAMPLER_USER_PREFIX}{check_worker_id(worker_id)}"


def permissions(user: str) -> dict[str, dict[str, list[str]]]:
    """What ``user`` may publish and subscribe to (allow lists: the rest is denied).
    The operator's tools may do anything (inspect the stream, audit dispatches).
    The others publish job events under their own name only."""
    events = f"{JOB_PREFIX}.*.{user}"
    if user == "operator":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if user == "scheduler":
        return {
            "publish": {
                "allow": [
                    f"{DISPATCH_PREFIX}.>",
                    events,
                    WORK_SUBJECT,
                    "$JS.API.>",
                    f"{PRESENCE_PREFIX}.{PLAN}.*",
                    f"{PRESENCE_PREFIX}.{CANARY}.*",
                    f"$JS.FC.{PRESENCE_STREAM}.>",
                ]
            },
            "subscribe": {"allow": [WORK_SUBJECT, f"{inbox_prefix(user)}.>"]},
        }
    if user == "gateway":
        return {
            "publish": {"allow": [events, WORK_SUBJECT, *_presence_watch()]},
            "subscribe": {"allow": [f"{JOB_PREFIX}.>", f"{inbox_prefix(user)}.>"]},
        }
    if user.startswith(SAMPLER_USER_PREFIX):
        worker_id = check_worker_id(user.removeprefix(SAMPLER_USER_PREFIX))
        consumer = consumer_name(worker_id)
        api = f"$JS.API.CONSUMER.%s.{DISPATCH_STREAM}.{consumer}"
        return {
            "publish": {
                "allow": [
                    events,
                    WORK_SUBJECT,
                    f"{api % 'CREATE'}.{DISPATCH_PREFIX}.{worker_id}",
                    api % "INFO",
                    api % "MSG.NEXT",
                    f"$JS.ACK.{DISPATCH_STREAM}.{consumer}.>",
                    # Its own heartbeat, its own warm plan, and the decoders' heartbeats.
                    f"{PRESENCE_PREFIX}.{worker_key(WorkerKind.SAMPLER, worker_id)}",
                    f"{_PRESENCE_API % 'DIRECT.GET'}.{PRESENCE_PREFIX}.{plan_key(worker_id)}",
                    _PRESENCE_API % "STREAM.MSG.GET",
                    *_presence_watch(),
                    *_origin_leases(),
                ]
            },
            "subscribe": {"allow": [f"{inbox_prefix(user)}.>"]},
        }
    if user == DECODER_USER:
        decoders = f"{PRESENCE_PREFIX}.{WorkerKind.DECODER.value}.*"
        return {
            "publish": {
                "allow": [
                    decoders,
                    _PRESENCE_API % "STREAM.INFO",
                    # Reading its own heartbeat back, after an update whose answer was
                    # lost (``PresenceBoard.announce``): without it, every later
                    # heartbeat fails and the decoder drops out of presence.
                    f"{_PRESENCE_API % 'DIRECT.GET'}.{decoders}",
                    _PRESENCE_API % "STREAM.MSG.GET",
                ]
            },
            "subscribe": {"allow": [f"{inbox_prefix(user)}.>"]},
        }
    raise ValueError(f"NATS user {user!r}: scheduler, gateway, operator, decoder or sampler-WORKER_ID")


def server_config(
    *,
    port: int,
    store_dir: Path,
    mesh_dir: Path | None,
    users: Iterable[str],
    name: str = "",
    host: str = "127.0.0.1",
    cluster_port: int | None = None,
    routes: Iterable[str] = (),
) -> str:
    """nats-server's configuration (its format takes JSON values), listening on
    ``host``; with ``cluster_port``, a node of a cluster routed to ``routes``
    (each ``host:port``). With ``mesh_dir``: TLS required of clients and routes, a
    certificate of the fleet's CA required of each, and ``users`` with their
    passwords (made where missing) and permissions; without, open, as a mesh
    that is not sealed."""
    lines = [
        f'listen: "{host}:{port}"',
        "jetstream: " + json.dumps({"store_dir": str(store_dir)}),
        # Clients and routes cut off by a partition are dropped within seconds,
        # not the default's minutes (their sockets stay open while nothing arrives).
        'ping_interval: "5s"',
        "ping_max: 2",
    ]
    if name:
        lines.append(f"server_name: {json.dumps(name)}")
    tls: dict[str, object] = {}
    if mesh_dir is not None:
        paths = CertPaths.of(mesh_dir, "nats")
        tls = {"cert_file": str(paths.cert), "key_file": str(paths.key), "ca_file": str(paths.ca), "verify": True}
        accounts = [
            {"user": user, "password": password(nats_password_path(mesh_dir, user)), "permissions": permissions(user)}
            for user in dict.fromkeys(users)
        ]
        lines.append("tls: " + json.dumps(tls))
        lines.append("authorization: " + json.dumps({"users": accounts}))
    if cluster_port is not None:
        cluster: dict[str, object] = {
            "name": "darkroom",
            "listen": f"{host}:{cluster_port}",
            "routes": [f"nats-route://{route}" for route in routes],
        }
        if tls:
            cluster["tls"] = tls  # routes too: a node presents the nats certificate to its peers
        lines.append("cluster: " + json.dumps(cluster))
    return "\n".join(lines) + "\n"
