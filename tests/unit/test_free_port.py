"""A stack picks all its ports before any child binds one, so free_port() must
never hand out one port twice in a process, bound or not: two children given one
port fight over it, and a client reaches whichever won (CI once saw the HTTP API's
port answered by a metrics server, 405)."""

from __future__ import annotations

import socket

from services.ops.processes import free_port


def test_free_port_never_hands_out_a_port_twice_even_while_nothing_binds_it() -> None:
    # Among 1,000 random picks from ~22,000 ports, a repeat is all but certain
    # (the birthday bound: 1 - exp(-1000²/(2·22768)) > 0.9999) unless prevented.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_a_handed_out_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port
