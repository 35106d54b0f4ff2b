"""The group's process group, formed once as the sampler starts: ``torch.distributed``
over its ranks (gloo on a CPU; NCCL for the network's collectives on GPUs), a gloo
group beside it for the leader's commands, and, for each parallel shape of its size,
the meshes that shape splits over, built once (building one is a collective) and
shared by every model of the shape it loads. A group of N serves every parallel
model of N GPUs."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.config.workers import GroupSettings
from services.models.parallel import Parallelism, shapes_of

log = logging.getLogger(__name__)

# How long forming the group (and a load's skew between ranks) may take before a
# rank gives up; a hung member mid-job is found sooner, by the leader's watchdog.
FORM_TIMEOUT = datetime.timedelta(minutes=10)


class GroupError(RuntimeError):
    """What a group cannot run, or what ended a member on another of its ranks."""


class GroupBroken(GroupError):
    """A command sent across the group did not end on every rank together (a rank is
    gone, or the leader failed where its followers went on into a collective): no
    rank can tell where the others are, so the group serves nothing more until its
    supervisor re-forms it (``services.ops.group_fate``)."""


@dataclass(frozen=True)
class ShapeMesh:
    """What one parallel shape splits over, from this rank."""

    shape: Parallelism
    context_parallel: Any  # diffusers' ParallelConfig for ``sequence``, or None
    cfg_group: Any  # the process group of the two ranks that split guidance's halves, or None
    cfg_rank: int  # which half this rank computes: 0 the negative prompt's, 1 the prompt's
    shard_mesh: Any = None  # the device mesh its weights are sharded over (``tensor``), or None


@dataclass(frozen=True)
class GroupMesh:
    """A formed group: its ranks, its control group, and its shapes' meshes."""

    rank: int
    size: int
    device: torch.device
    control: Any  # a gloo process group: the leader's commands and the ranks' agreements
    shapes: dict[Parallelism, ShapeMesh]
    members: tuple[str, ...] = ()  # its members' devices in rank order, as the host names them

    def facts(self) -> dict[str, Any]:
        """For the leader's heartbeat (``telemetry["group"]``): what placement and
        billing count it as."""
        return {
            "size": self.size,
            "members": list(self.members),
            "shapes": [shape.describe() for shape in self.shapes],
        }

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def serves(self, shape: Parallelism) -> bool:
        return shape in self.shapes

    def of(self, shape: Parallelism) -> ShapeMesh:
        found = self.shapes.get(shape)
        if found is None:
            raise GroupError(f"a group of {self.size} cannot serve a replica of {shape.describe()}")
        return found


def form(settings: GroupSettings, device: torch.device) -> GroupMesh:
    """Joins the group ``settings`` describe (every rank calls this) and builds its meshes."""
    host, _, port = settings.address.rpartition(":")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL, or every rank makes a context on the first GPU
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=settings.rank,
        world_size=settings.size,
        timeout=FORM_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=FORM_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    shapes = {shape: _shape_mesh(shape, device) for shape in shapes_of(settings.size)}
    log.info("group formed: rank %d of %d on %s", settings.rank, settings.size, device)
    return GroupMesh(settings.rank, settings.size, device, control, shapes, settings.members)


def _shape_mesh(shape: Parallelism, device: torch.device) -> ShapeMesh:
    """The world as (cfg, tensor, ring, ulysses): a rank's guidance half is its first
    coordinate, its share of the weights or of the sequence the rest."""
    mesh = dist.device_mesh.init_device_mesh(
        device.type,
        (shape.cfg, shape.tensor, 1, shape.sequence),
        mesh_dim_names=("cfg", "tensor", "ring", "ulysses"),
    )
    context_parallel = _context_parallel(shape, mesh, device) if shape.sequence > 1 else None
    shards = mesh["tensor"] if shape.tensor > 1 else None
    if shape.cfg > 1:
        return ShapeMesh(shape, context_parallel, mesh.get_group("cfg"), mesh.get_local_rank("cfg"), shards)
    return ShapeMesh(shape, context_parallel, None, 0, shards)


def _context_parallel(shape: Parallelism, mesh: Any, device: torch.device) -> Any:
    """Diffusers' config for Ulysses over the mesh's sequence columns, set up here
    rather than by ``enable_parallelism``, which takes each rank's device to be
    ``cuda:rank`` (and divides by a CPU's zero accelerators)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    submesh = mesh["ring", "ulysses"]
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=shape.sequence, mesh=submesh))
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=submesh)
    return config


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
