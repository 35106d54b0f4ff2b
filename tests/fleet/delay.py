"""Holds every packet a host sends for a fixed time before letting it go: the
delay half of ``tc netem`` for kernels built without ``sch_netem`` (this
machine's and CI's). The host's firewall hands its outgoing packets to NFQUEUE
queue 0 (``iptables -j NFQUEUE``); this process, inside the host's namespace,
gives each its verdict (accept) after the delay, in order. Loss stays in the
kernel (``-m statistic``). Raw nfnetlink, so nothing needs building.

    python -m tests.fleet.delay DELAY_MS"""

from __future__ import annotations

import collections
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NLM_F_REQUEST = 1
NF_ACCEPT = 1
QUEUE = 0
QUEUE_MAXLEN = 65536


def _attribute(kind: int, data: bytes) -> bytes:
    length = 4 + len(data)
    return struct.pack("=HH", length, kind) + data + b"\0" * (-length % 4)


def _message(kind: int, attributes: bytes, family: int = socket.AF_UNSPEC) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(QUEUE)) + attributes
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, 0, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets in one read of the socket."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at = offset + 20  # past nlmsghdr and nfgenmsg
            while at + 4 <= offset + length:
                size, attribute = struct.unpack_from("=HH", data, at)
                if size < 4:
                    break
                if attribute & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + 4)[0])
                at += size + (-size % 4)
        offset += length + (-length % 4)
    return ids


def run(delay_s: float) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    sock.send(_message(NFQNL_MSG_CONFIG, _attribute(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0))))
    sock.send(_message(NFQNL_MSG_CONFIG, _attribute(NFQA_CFG_PARAMS, struct.pack("!IBxxx", 0, NFQNL_COPY_META))))
    sock.send(_message(NFQNL_MSG_CONFIG, _attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))))
    print(f"delaying every packet sent by {delay_s * 1000:.0f} ms", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([sock], [], [], wait)[0]:
            now = time.monotonic()
            try:
                data = sock.recv(1 << 20)
            except OSError:  # ENOBUFS: the kernel dropped queue messages; the packets stay queued
                continue
            held.extend((now + delay_s, packet_id) for packet_id in _packet_ids(data))
        due = None
        now = time.monotonic()
        while held and held[0][0] <= now:
            due = held.popleft()[1]
        if due is not None:
            # Packets are held in order for the same time: one verdict lets go of all up to ``due``.
            verdict = _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, due))
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, verdict))


if __name__ == "__main__":
    run(float(sys.argv[1]) / 1000)
