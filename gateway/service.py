"""The public gRPC front door: its server and its process (the servicer is in
``gateway.servicer``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from gateway.adapters import store_of
from gateway.expansion import Expansion
from gateway.servicer import ImageGenerationServicer
from services.bus.credentials import NatsCredentials
from services.bus.events import Events
from services.config.fields import SettingsError
from services.config.http import HttpSettings
from services.config.sections import GatewaySettings, KernelSettings
from services.db.repository import Repository
from services.mesh.rpc import MeshIdentity, public_server_credentials
from services.models.registry import ModelRegistry
from services.open_access import anonymous_allowed, refusal
from services.ops.host import Closing, EventsInBackground, GrpcServer, Metrics, Migrations, Part, host
from services.ops.lifecycle import run_service
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import Server, build_server

log = logging.getLogger(__name__)


def create_server(
    kernel: KernelSettings,
    settings: GatewaySettings,
    repo: Repository,
    registry: ModelRegistry,
    events: Events | None = None,
    http: HttpSettings | None = None,
) -> tuple[Server, ImageGenerationServicer]:
    """The public gRPC server (not started); port 0 picks a free port. Without
    ``events`` (NATS), streams read their jobs from the database. ``http``: the
    HTTP API in front of it, whose listener counts for open access (none: one on
    the loopback)."""
    servicer = ImageGenerationServicer(
        settings,
        repo,
        registry,
        events or Events(),
        stale_after_s=kernel.worker_stale_after_s,
        mesh=MeshIdentity.of(kernel.mesh_dir, "gateway"),
        anonymous=anonymous_allowed(settings, http or HttpSettings()),
        safety=kernel.safety,
        expansion=Expansion(settings.expansion, kernel.models_dir),
        store=store_of(kernel.model_store),
        models_dir=kernel.models_dir,
    )
    server = build_server(
        [
            (
                lambda s: image_generation_pb2_grpc.add_ImageGenerationServicer_to_server(servicer, s),
                "darkroom.v1.ImageGeneration",
            )
        ],
        settings.host,
        settings.port,
        credentials=public_server_credentials(Path(settings.tls_cert), Path(settings.tls_key))
        if settings.tls_cert
        else None,
    )
    return server, servicer


class OpenAccessCheck:
    """Refuses to start a gateway that would be open (no tenants, no keys) where
    open access is not allowed (``services.open_access``), before its port opens."""

    name = "open access check"

    def __init__(self, settings: GatewaySettings, http: HttpSettings, repo: Repository) -> None:
        self.settings, self.http, self.repo = settings, http, repo

    async def start(self, stop: asyncio.Event) -> bool:
        if self.settings.api_keys or anonymous_allowed(self.settings, self.http):
            return True
        why = refusal(self.settings, self.http, tenants_exist=await self.repo.tenants.any())
        if why:
            raise SettingsError(why)
        return True

    async def stop(self) -> None:
        pass


async def serve(kernel: KernelSettings, settings: GatewaySettings, stop: asyncio.Event) -> int:
    registry = kernel.registry()
    # The HTTP API's listener as this process's environment gives it (`darkroom up`
    # gives the gateway the HTTP API's DARKROOM_HTTP_HOST): it is as open as this gateway.
    http = HttpSettings.from_env()
    repo = Repository(kernel.database_url, application_name="darkroom-gateway", pooled=kernel.database_pooled)
    events = Events(publisher="gateway")
    server, servicer = create_server(kernel, settings, repo, registry, events, http)
    parts: list[Part] = [
        Metrics(kernel, "gateway"),
        Migrations(kernel),
        Closing("database", repo.close),
        OpenAccessCheck(settings, http, repo),
        servicer.expansion,  # its expander loaded (a model built, the first time) before the port opens
        # The gateway serves without NATS (streams then read the database).
        EventsInBackground(
            kernel,
            events,
            connection_name="darkroom-gateway",
            credentials=NatsCredentials.of(kernel.mesh_dir, "gateway", "gateway"),
            presence=servicer.presence,
        ),
        Closing("sampler channels", servicer.close),
        GrpcServer(server, grace_s=kernel.shutdown_grace_s),
    ]

    async def work() -> None:
        log.info("gateway listening on %s:%d", settings.host, server.port)
        await stop.wait()

    return await host(parts, work, stop)


def main() -> None:
    run_service("gateway", serve, GatewaySettings)
