"""An S3 bucket on a local S3 server (moto), with or without conditional writes, as run storage."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from shardyard.localdist import free_port


@dataclass
class Bucket:
    fs: Any  # s3fs's filesystem, paths as "bucket/..."
    env: dict[str, str]  # the endpoint and credentials, as a node's environment or a job's runtime env holds them


@contextmanager
def s3_bucket(monkeypatch: pytest.MonkeyPatch, conditional_writes: bool = True) -> Iterator[Bucket]:
    """s3://bucket on a fresh S3 server (moto's standalone server: the S3 protocol over HTTP on a
    local port). Its endpoint and credentials are in this process's environment, as on a cluster
    node (local ranks inherit them); a submitted job gets them from its runtime env. Without
    `conditional_writes` the endpoint is a proxy that drops `If-None-Match` on its way to moto:
    an S3-compatible store that ignores conditional writes."""
    import logging

    import fsspec
    import requests
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server logs a line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    # moto keeps every server's buckets in one state per process: start from an empty store.
    requests.post(f"http://127.0.0.1:{port}/moto-api/reset", timeout=30).raise_for_status()
    proxy = None if conditional_writes else unconditional_proxy(port)
    endpoint = f"http://127.0.0.1:{proxy.server_address[1] if proxy else port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "shardyard",
           "AWS_SECRET_ACCESS_KEY": "shardyard", "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # fsspec reuses a filesystem made with the same arguments: one made for an earlier test's
    # server would still talk to that server's port.
    s3 = fsspec.get_filesystem_class("s3")
    s3.clear_instance_cache()
    fs = s3(use_listings_cache=False)
    fs.mkdir("bucket")
    try:
        yield Bucket(fs, env)
    finally:
        s3.clear_instance_cache()
        if proxy is not None:
            proxy.shutdown()
        server.stop()


def unconditional_proxy(port: int) -> Any:
    """An HTTP proxy on a thread, forwarding every request to 127.0.0.1:`port` without its
    `If-None-Match` header (the header moto, like S3, honours for a create-if-absent PUT)."""
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() != "if-none-match"}
            upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
