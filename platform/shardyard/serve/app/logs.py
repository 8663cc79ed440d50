"""Where Serve's lines go when shardyard starts Serve: its INFO lines in Ray's log files, shardyard's
own lines and Serve's errors on the console (`shardyard serve`, `shardyard pool`)."""

from __future__ import annotations

from typing import Any


def serve_log_levels(own: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Serve's logging (`serve.start`'s, then the application's) for a command that serves. On a
    Ray of the command's own, Serve's and HAProxy's INFO lines (dozens at each start), its access
    log and the warning that a loopback host cannot route across nodes (there is one node) are not
    logged (Serve takes one level for its files and the console alike), nor are Serve's INFO lines
    in this process: shardyard's own lines and Serve's errors reach the console, and Ray's own logs
    stay whole. On a shared cluster, Serve's settings as they are."""
    if not own:
        return {"log_level": "INFO"}, None
    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    return {"log_level": "ERROR"}, {"log_level": "WARNING", "enable_access_log": False}


def ray_logs() -> str:
    """Where the newest Ray session on this machine (this command's own) keeps its logs."""
    from shardyard.cluster import cluster_record

    return str(cluster_record().parent / "session_latest" / "logs")
