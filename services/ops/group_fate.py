"""The members of a sampler group share one fate under a supervisor: one that exits
or hangs breaks the group (its collectives cannot go on without it), so the others
are killed at once rather than left in a collective until its timeout, and all
start again together, re-forming on a fresh port with the next epoch. The jobs
the group held are requeued as its leader registers again (docs/parallel.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from services.config.fields import ENV_PREFIX
from services.ops.processes import ManagedProcess, free_port

if TYPE_CHECKING:
    from services.ops.supervisor import Child

log = logging.getLogger(__name__)

MEMBERS = f"{ENV_PREFIX}GROUP_MEMBERS"
ADDRESS = f"{ENV_PREFIX}GROUP_ADDRESS"
EPOCH = f"{ENV_PREFIX}GROUP_EPOCH"


def group_of(child: Child) -> str | None:
    """The group ``child`` is a member of (its members, as the host names them)."""
    return child.env.get(MEMBERS) or None


def share_fate(children: Mapping[str, Child], broken: Iterable[str], kill_grace_s: float) -> None:
    """For each group with a member among ``broken`` (exited or hung this poll, its
    restart already set): its running members killed, every member given the same
    restart time (the latest), a fresh port and the next epoch."""
    groups = {g for name in broken if (g := group_of(children[name])) is not None}
    for group in groups:
        members = [c for c in children.values() if group_of(c) == group]
        for member in members:
            with member.lock:
                if member.running and member.wanted:
                    log.error("%s: killed with its group (a member broke it)", member.name)
                    ManagedProcess.stop(member, kill_grace_s)
                    member.proc = None
                    member.last_exit = "its group broke"
        restart_at = max(m.next_start_at for m in members)
        host, _, _ = members[0].env.get(ADDRESS, "127.0.0.1:0").rpartition(":")
        address = f"{host}:{free_port()}"
        epoch = str(max(int(m.env.get(EPOCH, "0") or 0) for m in members) + 1)
        for member in members:
            member.next_start_at = restart_at
            member.env = {**member.env, ADDRESS: address, EPOCH: epoch}
        log.warning("group %s re-forms at %s (epoch %s)", group, address, epoch)
