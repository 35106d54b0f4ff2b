"""Hosts of their own on one machine: each a Linux network namespace with its own
address, hostname and interface, plugged by a veth link into a bridge that lives
in a namespace of its own (the switch), so the machine's own network and
firewall are never touched. The test process itself is a client on the switch.

A host is cut off by disabling its port on the bridge: its frames are dropped both
ways while its link stays up, as when a switch or a route fails between hosts (a
pulled cable would tell the host at once; a partition does not). Latency and loss
are ``tc netem`` on each host's egress."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The fleet's processes come before the rest of a loaded machine. Its failovers are
# races between timers on different hosts (a cut primary must demote itself before
# the monitor promotes its standby; a peer too slow is given up), which a test
# beside it that takes both cores would otherwise decide. Negative nice values
# need root, which the fleet needs anyway.
FAVOURED_NICE = -10


def favour_session(pid: int) -> None:
    """Raises the CPU weight of the session ``pid`` leads. With the kernel's autogroup
    scheduling each session is weighed as one, whatever its processes' own nice
    values (which ``nice`` sets, for kernels without it)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(FAVOURED_NICE))


class NetworkUnavailable(Exception):
    """This machine cannot build namespaces (not root, no ``ip``, no netns support)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _has_netem(netns: str) -> bool:
    """Whether this kernel has ``sch_netem`` (tried on a namespace's loopback)."""
    added = subprocess.run(
        ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        capture_output=True,
    )
    if added.returncode != 0:
        return False
    subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return True


TOOLS = ("ip", "tc", "bridge", "unshare", "iptables")


def why_unavailable(euid: int, missing_tools: Sequence[str], netns_error: str) -> str:
    """Why hosts cannot be built, given the user the tests run as, the tools not
    installed and what the kernel said to a namespace ('' if it made one); '' when
    they can."""
    if euid != 0:
        return "network namespaces need root (CI runs as root)"
    if missing_tools:
        return f"{', '.join(missing_tools)} not installed (Debian: iproute2, util-linux, iptables)"
    if netns_error:
        return f"cannot make a network namespace: {netns_error}"
    return ""


def unavailable_reason() -> str:
    """Why hosts cannot be built here; empty when they can."""
    euid = os.geteuid()
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    netns_error = ""
    if euid == 0 and not missing:
        probe = f"drk-probe-{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            netns_error = made.stderr.strip() or f"ip netns add exited {made.returncode}"
        else:
            _ip("netns", "del", probe, check=False)
    return why_unavailable(euid, missing, netns_error)


@dataclass
class Host:
    """One host: a namespace with an address on the fleet's subnet."""

    network: Network
    name: str
    address: str
    port: str  # its veth end on the switch's bridge
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _delayer: subprocess.Popen[bytes] | None = None

    @property
    def netns(self) -> str:
        return f"{self.network.prefix}-{self.name}"

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this host: its namespace and its own hostname."""
        return [
            "ip", "netns", "exec", self.netns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.name, *args,
        ]  # fmt: skip

    def spawn(self, args: Sequence[str], *, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Starts a process on this host, its output appended to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["nice", "-n", str(FAVOURED_NICE), *self.command(args)],
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        favour_session(proc.pid)
        self.processes.append(proc)
        return proc

    def run(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60) -> str:
        """Runs a command on this host to its end; its output, or an error with it."""
        done = subprocess.run(
            self.command(args), env=dict(env or os.environ), capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def cut(self) -> None:
        """Off the network, both ways, while everything on it keeps running."""
        self.network.switch(["bridge", "link", "set", "dev", self.port, "state", "0"])

    def heal(self) -> None:
        self.network.switch(["bridge", "link", "set", "dev", self.port, "state", "3"])

    def impair(self, *, delay_ms: int, loss_percent: float) -> None:
        """Delay and loss on everything this host sends (0 and 0: none). ``tc netem``
        where the kernel has it; else the firewall drops ``loss_percent`` at random
        and hands the rest to a process that holds each packet ``delay_ms``."""
        self._clear_impairment()
        if not delay_ms and not loss_percent:
            return
        if self.network.has_netem:
            self.run(["tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                      "delay", f"{delay_ms}ms", "loss", f"{loss_percent}%"])  # fmt: skip
            return
        if loss_percent:
            self.run(["iptables", "-A", "OUTPUT", "-o", "eth0", "-m", "statistic", "--mode", "random",
                      "--probability", f"{loss_percent / 100:.4f}", "-j", "DROP"])  # fmt: skip
        if delay_ms:
            self._delayer = self.spawn(
                [sys.executable, "-m", "tests.fleet.delay", str(delay_ms)],
                env={**os.environ},
                log=self.network.logs / f"{self.name}-delay.log",
            )
            # Until the holder is bound, packets pass undelayed rather than wait (--queue-bypass).
            self.run(["iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE",
                      "--queue-num", "0", "--queue-bypass"])  # fmt: skip

    def limit_rate(self, mbit: float) -> None:
        """What this host sends held to ``mbit`` megabits a second by a token bucket
        (``tc tbf``), every packet passing in order; 0: unlimited. Unlike a delay, a
        bulk transfer keeps flowing, only slower (and its packets are not held by a
        process of ours, which a flood of them stalls)."""
        subprocess.run(self.command(["tc", "qdisc", "del", "dev", "eth0", "root"]), capture_output=True)
        if mbit:
            self.run(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                      "rate", f"{mbit}mbit", "burst", "64kb", "latency", "500ms"])  # fmt: skip

    def _clear_impairment(self) -> None:
        if self.network.has_netem:
            subprocess.run(self.command(["tc", "qdisc", "del", "dev", "eth0", "root"]), capture_output=True)
        else:
            subprocess.run(self.command(["iptables", "-F", "OUTPUT"]), capture_output=True)
        if self._delayer is not None:
            self._delayer.kill()
            self._delayer.wait()
            self._delayer = None

    def pids(self) -> list[int]:
        """Every process in this host's namespace."""
        listed = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in listed.split()]


class Network:
    """A switch and the hosts plugged into it, on 10.<n>.<m>.0/24, where n and m
    come from this process so that two test runs on one machine do not meet. The
    test process reaches every host through its own link, ``client_address``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        token = os.getpid() % 60000
        self.prefix = f"drk{token}"
        self.subnet = f"10.{200 + token // 250 % 50}.{token % 250}"
        self.client_address = f"{self.subnet}.1"
        self.hosts: dict[str, Host] = {}
        self._switch = f"{self.prefix}-switch"
        self._client_link = f"{self.prefix}c"
        _ip("netns", "add", self._switch)
        self.switch(["ip", "link", "add", "br0", "type", "bridge"])
        self.switch(["ip", "link", "set", "br0", "up"])
        # The client's link: one end here, with the client's address; the other on the bridge.
        _ip("link", "add", self._client_link, "type", "veth", "peer", "name", "client", "netns", self._switch)
        _ip("addr", "add", f"{self.client_address}/24", "dev", self._client_link)
        _ip("link", "set", self._client_link, "up")
        self.switch(["ip", "link", "set", "client", "master", "br0", "up"])
        self.has_netem = _has_netem(self._switch)

    def switch(self, args: Sequence[str]) -> None:
        subprocess.run(["ip", "netns", "exec", self._switch, *args], check=True, capture_output=True)

    def add(self, name: str) -> Host:
        """A new host, plugged in and up, with the next address."""
        address = f"{self.subnet}.{10 + len(self.hosts)}"
        host = Host(self, name, address, port=f"p-{name}"[:15])
        _ip("netns", "add", host.netns)
        _ip("link", "add", f"{self.prefix}t", "type", "veth", "peer", "name", host.port, "netns", self._switch)
        _ip("link", "set", f"{self.prefix}t", "netns", host.netns)
        self.switch(["ip", "link", "set", host.port, "master", "br0", "up"])
        inside = ["ip", "netns", "exec", host.netns]
        for args in (
            ["ip", "link", "set", f"{self.prefix}t", "name", "eth0"],
            ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
            ["ip", "link", "set", "eth0", "up"],
            ["ip", "link", "set", "lo", "up"],
        ):
            subprocess.run([*inside, *args], check=True, capture_output=True)
        self.hosts[name] = host
        return host

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    def close(self) -> None:
        """Kills whatever still runs on the hosts and removes the namespaces and links."""
        for host in self.hosts.values():
            for proc in host.processes:
                if proc.poll() is None:
                    with contextlib.suppress(OSError, subprocess.SubprocessError):
                        os.killpg(proc.pid, 9)
            for pid in host.pids():
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    os.kill(pid, 9)
        deadline = time.monotonic() + 10
        while any(h.pids() for h in self.hosts.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for host in self.hosts.values():
            for proc in host.processes:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    proc.wait(1)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self._client_link, check=False)
        _ip("netns", "del", self._switch, check=False)
