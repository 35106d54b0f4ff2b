"""A host's supervised processes: which children a host runs (its samplers and
decoders), with what settings, metrics ports and restart policy, and in which order
they stop. ``darkroom up`` (``LocalStack``) and ``darkroom supervise`` share them.

A child is given the settings its service reads (``variables_read``: the kernel's
section and its own) and no other ``DARKROOM_*`` variable: the supervisor holds
every section, a sampler needs none of the gateway's keys."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping

from services.bus.dispatch import host_token
from services.config.fields import ENV_PREFIX
from services.config.http import HttpSettings
from services.config.model_store import ModelStoreSettings
from services.config.sections import GatewaySettings, KernelSettings, SchedulerSettings, Settings
from services.config.workers import DecoderSettings, SamplerSettings
from services.ops import SERVICE_MODULES, forkserver
from services.ops.forkserver import ForkServer
from services.ops.gpu_groups import group_name, nvml_distance, plan_groups
from services.ops.processes import free_port
from services.ops.supervisor import Child, RestartPolicy
from services.telemetry.metrics import Target

# Stopping front to back: stop taking work first, let samplers finish (or hand
# back) theirs, and keep the decoders up until they have.
STOP_ORDER_RANK = {"http": 0, "gateway": 0, "scheduler": 1, "sampler": 2, "decoder": 3}
# The variables each service reads besides the kernel's (its ``run_service`` section):
# the gateway also the HTTP API's listener, for it is as open as the gateway is
# (services/open_access.py), and nothing else of the HTTP API's.
_OWN_VARIABLES = {
    "gateway": GatewaySettings.variables() | {HttpSettings.setting("host").variable},
    "scheduler": SchedulerSettings.variables(),
    "sampler": SamplerSettings.variables(),
    "decoder": DecoderSettings.variables(),
    "http": HttpSettings.variables(),
}


def variables_read(service: str) -> frozenset[str]:
    """The ``DARKROOM_*`` variables a process of ``service`` reads: the kernel's and its own."""
    return frozenset(KernelSettings.variables() | _OWN_VARIABLES[service])


def visible_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0


def fork_servers(settings: Settings) -> dict[str, ForkServer]:
    """Where each service is forked from (services.ops.forkserver): this process's
    fork servers, on a host without a GPU, unless turned off (none on GPUs: see
    services.ops.forkserver)."""
    if not settings.supervisor.fork_server or visible_gpus():
        return {}
    log_path = settings.kernel.data_dir / "logs" / "forkserver.log"
    return {service: forkserver.shared(log_path, preload) for service, preload in forkserver.PRELOAD_OF.items()}


def restart_policy(settings: Settings) -> RestartPolicy:
    supervisor = settings.supervisor
    return RestartPolicy(
        backoff_s=supervisor.restart_backoff_s,
        backoff_max_s=supervisor.restart_backoff_max_s,
        hang_after_s=supervisor.hang_after_s,
        kill_grace_s=min(settings.kernel.shutdown_grace_s, 5.0),
    )


# What each service reads the model store with (DARKROOM_MODEL_STORE_ACCESS_KEY): a
# sampler its own identity, which may also write compiled artifacts (the reader's
# where none is set); a decoder the reader's; a gateway its own, which reads
# manifests and keeps tenants' adapters, and never the reader's (it faces the
# internet: the reader's reads every model's bytes). The scheduler and the HTTP API
# nothing of the store; the writer's and the roles' identities no service: they are
# the operator's and the supervisor's to hand out.
_STORE_ROLES = ("WRITER", "SAMPLER", "GATEWAY")


def _model_store_env(service: str, store: ModelStoreSettings) -> dict[str, str]:
    """The model store's variables as ``service`` is given them."""
    env = {f"{ENV_PREFIX}MODEL_STORE_{role}_{part}_KEY": "" for role in _STORE_ROLES for part in ("ACCESS", "SECRET")}
    url, access, secret = store.model_store_url, store.model_store_access_key, store.model_store_secret_key
    if service == "sampler" and store.model_store_sampler_access_key:
        access, secret = store.model_store_sampler_access_key, store.model_store_sampler_secret_key
    elif service == "gateway" and (store.model_store_gateway_access_key or access):
        # An unsigned store is read unsigned by all; a signed one by the gateway's own identity, or not at all.
        access, secret = store.model_store_gateway_access_key, store.model_store_gateway_secret_key
        url = url if access else ""
    elif service not in ("sampler", "decoder", "gateway"):
        url, access, secret = "", "", ""
    env.update(
        {
            f"{ENV_PREFIX}MODEL_STORE_URL": url,
            f"{ENV_PREFIX}MODEL_STORE_ACCESS_KEY": access,
            f"{ENV_PREFIX}MODEL_STORE_SECRET_KEY": secret,
        }
    )
    return env


def child(settings: Settings, name: str, service: str, env: Mapping[str, str] | None = None) -> Child:
    """A supervised process of ``service`` (a key of SERVICE_MODULES) with these
    settings, changed by the ``DARKROOM_*`` variables of ``env`` (checked here,
    so that a bad one stops the caller): those its service reads (``variables_read``)
    and no other ``DARKROOM_*`` variable, of this process's environment either; of
    the model store's, only what the service reads it with (``_model_store_env``).
    The other variables of this process's environment and of ``env`` pass as they are."""
    env = env or {}
    changed = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    asked = settings.with_env(changed)
    own = asked.with_env(_model_store_env(service, asked.kernel.model_store))
    read = variables_read(service)
    given = {k: v for k, v in own.to_env().items() if k in read}
    others = {k: v for k, v in {**os.environ, **env}.items() if not k.startswith(ENV_PREFIX)}
    data = settings.kernel.data_dir
    return Child(
        name,
        SERVICE_MODULES[service],
        {**others, **given},
        data / "logs" / f"{name}.log",
        data / "run" / f"{name}.alive",
        service=service,
    )


class MetricsPorts:
    """Each supervised child's metrics port, kept across its restarts: consecutive
    from ``first`` (ports an operator can name), or free ones when it is 0."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.given: list[int] = []

    def next(self) -> int:
        if self.first:
            port = self.first + len(self.given)
        else:
            port = free_port()  # never one handed out before, bound or not yet
        self.given.append(port)
        return port


def host_children(
    settings: Settings, *, decoders: int, cpu_samplers: int = 1, ports: MetricsPorts | None = None
) -> list[Child]:
    """A GPU host's processes: ``decoders`` VAE workers and one sampler per visible
    GPU (``CUDA_VISIBLE_DEVICES`` set for each), or CPU samplers when there is
    none; the devices of a group (``gpu_groups``) are its members, the first
    leading. Worker ids come from the host and the GPU (a group's, from its
    devices), so a restarted sampler takes back its own subject. Metrics ports go
    to the samplers first, by GPU, then to the decoders: a sampler's port does not
    move when the decoders change."""
    ports = ports or MetricsPorts(settings.kernel.metrics_port)
    host = host_token()
    gpus = visible_gpus()
    devices = gpus or cpu_samplers
    threads: dict[str, str] = {}
    if not gpus:
        # Without a GPU, samplers and decoders compute on the CPU: each gets its
        # share of the cores. torch's threads, every process's on every core at
        # once, spin and wait on each other and make each step many times slower.
        share = max(1, (os.cpu_count() or 1) // max(cpu_samplers + decoders, 1))
        threads = {"OMP_NUM_THREADS": str(share)}
    groups = _groups(settings, devices, bool(gpus))
    grouped = {i: group for group in groups for i in group}
    meeting = {group: free_port() for group in groups}  # where each group's ranks meet
    samplers = []
    for i in range(devices):
        env = {**threads, "DARKROOM_METRICS_PORT": str(ports.next())}
        group = grouped.get(i)
        if group is not None:
            env.update(_member_env(host, "gpu" if gpus else "cpu", group, group.index(i), meeting[group], bool(gpus)))
        elif gpus:
            env.update(
                {"CUDA_VISIBLE_DEVICES": str(i), "DARKROOM_DEVICE": "cuda:0", "DARKROOM_WORKER_ID": f"{host}-gpu{i}"}
            )
        else:
            env.update(DARKROOM_DEVICE="cpu", DARKROOM_WORKER_ID=f"{host}-cpu{i}")
        samplers.append(child(settings, f"sampler-{i}", "sampler", env))
    vaes = [
        child(
            settings,
            f"decoder-{i}",
            "decoder",
            {**threads, "DARKROOM_WORKER_ID": f"{host}-decoder{i}", "DARKROOM_METRICS_PORT": str(ports.next())},
        )
        for i in range(decoders)
    ]
    # Decoders start first: a sampler that is ready has somewhere to decode.
    return vaes + samplers


def _groups(settings: Settings, devices: int, gpus: bool) -> list[tuple[int, ...]]:
    registry = settings.kernel.registry()
    sizes = {spec.parallel.size for spec in registry.models.values()}
    distance = nvml_distance(_physical(devices)) if gpus and any(s > 1 for s in sizes) else None
    return plan_groups(settings.supervisor.gpu_groups, devices, sizes, distance)


def _physical(devices: int) -> list[int]:
    """NVML's index of each visible GPU (``CUDA_VISIBLE_DEVICES`` of indices; else 0..)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) >= devices and all(v.isdigit() for v in visible):
        return [int(v) for v in visible[:devices]]
    return list(range(devices))


def _member_env(host: str, kind: str, group: tuple[int, ...], rank: int, port: int, gpus: bool) -> dict[str, str]:
    """A group member's variables: every member sees the group's devices in rank
    order and computes on its own (``cuda:RANK``), so that NCCL keeps its peer paths;
    the leader registers as the group."""
    worker_id = f"{host}-{group_name(kind, group)}"
    env = {
        "DARKROOM_GROUP_SIZE": str(len(group)),
        "DARKROOM_GROUP_RANK": str(rank),
        "DARKROOM_GROUP_ADDRESS": f"127.0.0.1:{port}",
        "DARKROOM_GROUP_MEMBERS": ",".join(f"{kind}{i}" for i in group),
        "DARKROOM_WORKER_ID": worker_id if rank == 0 else f"{worker_id}-rank{rank}",
    }
    if gpus:
        env.update({"CUDA_VISIBLE_DEVICES": ",".join(map(str, group)), "DARKROOM_DEVICE": f"cuda:{rank}"})
    else:
        env["DARKROOM_DEVICE"] = "cpu"
    return env


def metrics_target(c: Child) -> Target | None:
    """Where Prometheus scrapes the child (None: it serves no metrics)."""
    port = int(c.env.get(f"{ENV_PREFIX}METRICS_PORT") or 0)
    if not port:
        return None
    host = c.env.get(f"{ENV_PREFIX}METRICS_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()  # listening everywhere: named as other hosts know it
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Target(c.name, c.service, host_token(), address)


def metrics_targets(children: Iterable[Child]) -> list[Target]:
    return [t for t in map(metrics_target, children) if t is not None]


def stop_order(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: STOP_ORDER_RANK.get(n.split("-")[0], 2))
