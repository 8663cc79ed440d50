"""Who holds the port `shardyard serve` wants, and taking it back from an HAProxy orphan.

`shardyard serve` on a Ray instance of its own serves HTTP through HAProxy (ingress.py), which
Serve's proxy actor runs as a child process. Killed abruptly (SIGKILL, or Ray stopped under it),
the command leaves that HAProxy running, re-parented, holding the port for good. The next
`shardyard serve` on the port takes it back when the holder is such an orphan: an `haproxy`
process running a configuration from a directory `shardyard serve` made (HAPROXY_DIR_PREFIX),
whose parent is no longer a Ray process. Any other holder is named, for the user to stop. A
`shardyard serve` that stops normally stops its own HAProxy the same way, after its Ray instance.
"""

from __future__ import annotations

import os
import socket

import psutil

HAPROXY_DIR_PREFIX = "sy-haproxy-"  # the directories of HAProxy's files that `shardyard serve` makes
STOP_WAIT_S = 5.0


def can_listen(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (a port left in TIME_WAIT by one that
    stopped can be listened on again)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def listener_on(port: int) -> psutil.Process | None:
    """The process listening on TCP `port` (None: none this user may see)."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port \
                and connection.pid is not None:
            try:
                return psutil.Process(connection.pid)
            except psutil.NoSuchProcess:
                continue
    return None


def orphaned_haproxy(process: psutil.Process) -> bool:
    """An HAProxy that `shardyard serve` started through Serve, whose Ray instance is gone."""
    try:
        if process.name() != "haproxy" or not any(HAPROXY_DIR_PREFIX in arg for arg in process.cmdline()):
            return False
        parent = process.parent()
        return parent is None or not " ".join(parent.cmdline()).startswith("ray::")
    except psutil.Error:
        return False


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}, {' '.join(process.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {process.pid}"


def claim(host: str, port: int) -> str | None:
    """Make host:port free for `shardyard serve`: None when it is (after stopping an HAProxy
    orphan, said on stdout), else why not, naming the process that holds it."""
    if can_listen(host, port):
        return None
    holder = listener_on(port)
    if holder is None:
        return (f"{host}:{port} is taken (another server is listening there, run by another user): "
                f"choose another with --port")
    if not orphaned_haproxy(holder):
        return f"{host}:{port} is taken by {describe(holder)}: stop it, or choose another with --port"
    print(f"shardyard: {host}:{port} is held by HAProxy ({describe(holder)}) left by a shardyard serve whose Ray "
          f"instance is gone: stopping it", flush=True)
    stop(holder)
    return None if can_listen(host, port) else f"{host}:{port} is still taken after stopping {describe(holder)}"


def stop(process: psutil.Process) -> None:
    """SIGTERM (HAProxy closes its listeners at once), SIGKILL if it lingers."""
    try:
        process.terminate()
        try:
            process.wait(STOP_WAIT_S)
        except psutil.TimeoutExpired:
            process.kill()
            process.wait(STOP_WAIT_S)
    except psutil.NoSuchProcess:
        pass


def stop_haproxy_of(files: str) -> None:
    """Stop every HAProxy running a configuration from `files` (one instance's: the process serving
    and any still draining after a reload), as Ray's end leaves them."""
    inside = os.path.join(files, "")
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "haproxy" and any(arg.startswith(inside) for arg in process.info["cmdline"] or ()):
            stop(process)
