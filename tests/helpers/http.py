"""HTTP on real sockets: an ASGI app served by uvicorn, clients that trickle their bodies
(slowloris), token files as private as they must be."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardyard.localdist import free_port


def private_file(path: Path, text: str) -> Path:
    """A file only this user may read and write (mode 600), as token files must be."""
    path.write_text(text)
    path.chmod(0o600)
    return path


@contextmanager
def served_by_uvicorn(app: Any, root_path: str = "") -> Iterator[str]:
    """`app` (ASGI) on a real socket, served by uvicorn on a thread of this process (behind a proxy
    that mounts it at `root_path`, when given): its base URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                            root_path=root_path))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def trickled_bodies(url: str, path: str, token: str, count: int, declared: int = 1024) -> Iterator[list[Any]]:
    """`count` slowloris clients: each sends a POST's whole head with the token, then one byte of
    the body it declared, then nothing. The open sockets, closed on leaving."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    sockets = []
    try:
        for _ in range(count):
            sock = socket.create_connection((where.hostname, where.port), timeout=30)
            sock.sendall(f"POST {where.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {where.hostname}\r\n"
                         f"Authorization: Bearer {token}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{".encode())
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()
