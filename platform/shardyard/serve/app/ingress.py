"""The HTTP ingress of a Ray instance started to serve (`shardyard serve` with no cluster to join,
the serving benchmark): Ray Serve's HAProxy (`RAY_SERVE_ENABLE_HA_PROXY`) in front of replicas
that take HTTP themselves, instead of Serve's default proxy.

Why: the default proxy (uvicorn) starts no timer before a request's headers are in, so a client
that sends half a header holds its connection for good; HAProxy's client timeout answers it 408
and closes it (with no `timeout http-request`, which Ray leaves unset, HAProxy waits for headers
`timeout client` long). The same timeout bounds every later pause of the client's: in sending
its body (HAProxy answers 400 then), in reading a stream. Waiting for the replica's answer is not
the client's pause: Ray sets no server timeout, and the app's own `request_timeout_s` applies.
HAProxy also forwards to the replica's own HTTP server, one hop fewer than through the proxy
actor (Serve's direct ingress).

What Ray's template does that a user should know: it binds a read-only stats page and a Prometheus
exporter on every interface; here they are bound to the loopback interface (serve/app/haproxy_loopback.py)
on free ports, so two instances on a machine do not collide. Its admin socket is mode 666, so its
files go in a directory of this user's alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from shardyard.ports import quiet_free_port
from shardyard.serve.app import haproxy_loopback as loopback
from shardyard.serve.app.port_holder import HAPROXY_DIR_PREFIX, stop_haproxy_of

ENABLE = "RAY_SERVE_ENABLE_HA_PROXY"
CLIENT_TIMEOUT = "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"
HAPROXY_DEFAULT_CLIENT_TIMEOUT_S = 3600  # Ray's, when CLIENT_TIMEOUT is unset
# Above the app's body_timeout_s (10 by default): a body paused that long meets the app's 408, in
# OpenAI's error shape, before HAProxy's own 400.
DEFAULT_HEADER_TIMEOUT_S = 15
MIN_DRAINING_PERIOD_S = 2
# Ray's variables for HAProxy's files (each under a directory per node inside the one named).
FILES = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
         "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}


def haproxy_environment(header_timeout_s: int, files: str) -> dict[str, str]:
    """The variables that give a Ray instance started with them HAProxy as its ingress."""
    stats = quiet_free_port()
    return {ENABLE: "1", CLIENT_TIMEOUT: str(header_timeout_s),
            # Ray keeps a stopping replica 30 s at least, for load balancers outside the cluster to
            # notice; here HAProxy is the only one and hears of it from Serve's controller at once
            # (at 30 s, Ctrl-C took 36 s to stop the command instead of 7).
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(MIN_DRAINING_PERIOD_S),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "RAY_SERVE_HAPROXY_METRICS_PORT": str(quiet_free_port({stats})),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": files, loopback.BINARY: loopback.script(files),
            **{variable: os.path.join(files, name) for variable, name in FILES.items()}}


@contextmanager
def haproxy_ingress(header_timeout_s: int) -> Iterator[None]:
    """Within: a Ray instance this process starts (its workers inherit this environment) takes
    HTTP through HAProxy with that header deadline. Leave after that Ray instance has ended: its
    end leaves HAProxy running, holding the port, and HAProxy is stopped here. (Not by Serve's
    shutdown: it stops HAProxy while Serve's own updates of it may still be coming, and an update
    that finds it gone logs a traceback on the console.)"""
    # Mode 0700; short, as HAProxy takes socket paths of 97 characters at most (node ids take 56).
    files = tempfile.mkdtemp(prefix=HAPROXY_DIR_PREFIX, dir="/tmp")
    environment = haproxy_environment(header_timeout_s, files)
    before = {variable: os.environ.get(variable) for variable in environment}
    os.environ.update(environment)
    try:
        yield
    finally:
        stop_haproxy_of(files)
        for variable, value in before.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        shutil.rmtree(files, ignore_errors=True)


def header_deadline_s() -> int | None:
    """In a replica: how long the cluster's ingress waits for a request's headers (None: without
    end, Serve's default proxy). Replicas inherit the environment their node was started with."""
    if os.environ.get(ENABLE) != "1":
        return None
    return int(os.environ.get(CLIENT_TIMEOUT, HAPROXY_DEFAULT_CLIENT_TIMEOUT_S))
