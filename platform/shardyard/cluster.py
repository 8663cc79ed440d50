"""Connecting to Ray: the cluster a submitted job runs in, one already running on this machine, or
a local instance started for this command."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

import ray

from shardyard.ports import quiet_free_port
from shardyard.spec.base import SpecError

# torchft's Lighthouse (hot recovery) logs every quorum at INFO, several lines per step.
QUIET = {"env_vars": {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}}


def connect_ray(min_cpus: float, attach_to_running: bool = False) -> bool:
    """Attach to the cluster in RAY_ADDRESS (set inside `ray job submit` jobs), optionally to one
    already running on this machine, or else start a local Ray instance with at least `min_cpus`
    logical CPUs. Returns whether the cluster may grow: one started here never does."""
    if ray.is_initialized():
        return True
    if os.environ.get("RAY_ADDRESS"):
        join(os.environ["RAY_ADDRESS"], runtime_env=QUIET)
        return True
    if attach_to_running and (address := running_cluster()) is not None:
        join(address, runtime_env=QUIET)
        return True
    # address="local": a new instance even if an earlier cluster left its address behind. At
    # least `min_cpus` logical CPUs, so a 4-worker job still runs (oversubscribed, slower) on a
    # 2-core laptop. With the dashboard: Ray Train's placement-group cleaner asks the State API,
    # which the dashboard serves, about its controller every second, and without it warned each
    # time; its cost was not measurable (benchmarks/ddp_overhead.py, docs/benchmarks.md).
    start_local_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(min_cpus)))
    return False


class RayUnreachable(SpecError):
    """The cluster a command was told to join (RAY_ADDRESS) cannot be joined: a user's setting to
    fix, said at once, before anything starts."""


def join(address: str, **options: Any) -> None:
    """`ray.init` on the running cluster at `address` ("auto", "host:port", "ray://host:port"), or
    RayUnreachable saying why: no process listening there (Ray itself retries that for many
    minutes before it says so), or Ray refusing the connection (a missing token, for one)."""
    try:
        answer_at(address, timeout_s=5)
    except ValueError:
        pass  # no port in it ("auto"): Ray finds the cluster
    except OSError as err:
        raise RayUnreachable(
            f"no Ray cluster answers at {address} ({err.strerror or err}): start one there "
            "(`ray start --head`), or unset RAY_ADDRESS to run on a Ray instance started for this command"
        ) from None
    try:
        ray.init(address=address, **options)
    except ConnectionError as err:  # Ray's reason is the last line of its cause's traceback
        reason = str(err.__cause__ or err).strip().splitlines()[-1]
        raise RayUnreachable(f"could not join the Ray cluster at {address}: {reason}") from None


def answer_at(address: str, timeout_s: float) -> None:
    """Connects to `address` ("host:port", a scheme before it, an IPv6 host in brackets) and leaves:
    OSError when nothing takes the connection, ValueError when it names no port."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def start_local_ray(**options: Any) -> None:
    """A new local Ray instance (`ray.init` options beside the dashboard and quiet logs), its token
    file private before and after (Ray makes one at the umask when there was none)."""
    keep_ray_token_private()
    quiet_token_notice()
    dashboard = quiet_free_port()
    runtime_env = local_runtime_env()
    # Ray Train's placement-group cleaner (an actor) asks the State API whether the run's controller
    # is alive. Told no address, it asks the newest Ray on the machine: beside a `ray start`
    # cluster that is the other one, which knows no such actor, so the cleaner took the controller
    # for dead and quit. Its workers ask this instance's dashboard, named before it starts.
    runtime_env["env_vars"]["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard}"
    ray.init(address="local", include_dashboard=True, dashboard_port=dashboard, runtime_env=runtime_env, **options)
    keep_ray_token_private()


def local_runtime_env() -> dict[str, Any]:
    """A local instance's workers import what the command does: the user's own modules (a
    model.factory) from the directory it runs in, then PYTHONPATH. (On a cluster, `ray job submit
    --working-dir .` puts that directory on every worker's path.)"""
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {**QUIET["env_vars"], "PYTHONPATH": path}}


def quiet_token_notice() -> None:
    """Ray warns at every local start that it turned token authentication on, its default and
    shardyard's (docs/clusters.md says so once): that notice stays out of the console. (Setting
    RAY_AUTH_MODE=token instead only works before Ray is imported.)"""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def keep_ray_token_private() -> None:
    """Ray's token file (`~/.ray/auth_token`, which it writes at the umask) readable by this user
    alone: where home directories can be entered, anyone who reads it runs jobs as this user on
    every Ray instance this user starts."""
    token = Path.home() / ".ray" / "auth_token"
    if token.is_file() and token.stat().st_uid == os.getuid() and token.stat().st_mode & 0o077:
        token.chmod(0o600)


def address_to_join() -> str:
    """For `ray.init`: RAY_ADDRESS's cluster, or the one running on this machine, or "local" (a
    new instance, also when a cluster that was killed left its address behind)."""
    return os.environ.get("RAY_ADDRESS") or running_cluster() or "local"


def cluster_record() -> Path:
    """Where `ray start` records the cluster it started (Ray's `<temp dir>/ray/ray_current_cluster`,
    the address `ray.init()` without one attaches to), with Ray's choice of temp dir."""
    if "RAY_TMPDIR" in os.environ:
        temp = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        temp = os.environ["TMPDIR"]
    else:
        temp = "/tmp"
    return Path(temp) / "ray" / "ray_current_cluster"


def untrusted(path: Path) -> str | None:
    """Why `path` may have been written by another user (None: it cannot): it is not this user's,
    or the group or others may write it."""
    info = path.stat()
    if info.st_uid != os.getuid():
        return f"{path} belongs to another user"
    if info.st_mode & 0o022:
        return f"{path} can be written by other users"
    return None


def running_cluster() -> str | None:
    """The address in `cluster_record` if its GCS takes a connection; None if there is no record,
    or its cluster is gone (one killed without `ray stop` leaves its record, and `ray.init()`
    then waits for it without end), or another user could have written the record: Ray makes its
    folder writable by everyone, and a record pointing at a GCS of theirs would receive this
    user's Ray token and send back what the driver unpickles. Such a cluster is joined by
    RAY_ADDRESS only."""
    record = cluster_record()
    if record.exists() and (why := untrusted(record.parent) or untrusted(record)):
        print(f"shardyard: not attaching to the Ray cluster recorded in {record}: {why}, so the record may "
              f"point at anyone's; to join that cluster, set RAY_ADDRESS to its address", file=sys.stderr, flush=True)
        return None
    try:
        address = record.read_text().strip()
        answer_at(address, timeout_s=2)
        return address
    except (OSError, ValueError):
        if record.exists():
            print(f"shardyard: the Ray cluster recorded in {record} does not answer (stopped without "
                  "`ray stop`?); not attaching to it", file=sys.stderr, flush=True)
        return None
