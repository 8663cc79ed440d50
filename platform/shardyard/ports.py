"""Ports picked for a process to bind later, where a port handed out by a bind to port 0 could be
handed to another process first."""

from __future__ import annotations

import random
import socket
from pathlib import Path


# Ports picked before a process binds them (HAProxy's stats page and exporter, a local Ray's
# dashboard): above Ray's worker ports (10002-19999 by default)
# and below the kernel's ephemeral range, whose ports Ray's own processes take (binding port 0) as
# the instance starts: a free port from that range was taken before HAProxy bound it (a failed run).
PORT_RANGE = (20000, 32768)


def ephemeral_start(ranges: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port the kernel hands out for a bind to port 0 (Linux; else IANA's 49152)."""
    try:
        return int(ranges.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def quiet_free_port(taken: set[int] = frozenset()) -> int:
    """A port free now that no bind to port 0 will be handed meanwhile (outside `taken`)."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], ephemeral_start())
    for port in random.sample(range(low, high), min(200, high - low)):
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))  # free on every interface: the strictest probe
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port between {low} and {high}")
