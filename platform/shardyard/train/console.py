"""The training command's console: shardyard's lines, what the workers print, and Ray's warnings
reach it; the tracebacks Ray forwards when a worker fails (Ray's, gloo's: dozens of lines that
train/restart_lines.py says in one) and Ray's notes about its own actors go to the run's Ray log.

Ray forwards each worker's output to the driver as lines prefixed with the process they came
from, `(RayTrainWorker pid=123)`. A traceback arrives as one burst of such lines: from its first
line on, the lines of that process are logged, not shown, until it is quiet for BURST_GAP_S or
prints a line of shardyard's."""

from __future__ import annotations

import io
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from shardyard.storage.store import RunStorage

RAY_LOG = "ray_output.log"
BURST_GAP_S = 1.0
# `(RayTrainWorker pid=123, ip=10.0.0.2)`, Ray's color codes around it where it writes to a terminal.
FORWARDED = re.compile(r"^(?:\x1b\[[0-9;]*m)?\((?P<source>[^()]+)\)(?:\x1b\[0m)? ?(?P<text>.*)$", re.DOTALL)
# What may begin a forwarded line, before its end has come (print writes the newline apart).
MAY_BE_FORWARDED = re.compile(r"^(?:\x1b(?:\[[0-9;]*m?)?)?(?:\(|$)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
OWN_LINE = re.compile(r"^(?:shardyard\b|step \d+/\d+ \|)")
# Where a burst of a failure's tracebacks begins. Ray Train's controller opens its own with the
# backend's failed shutdown (a worker is gone), and later repeats of the workers' lines (Ray's
# deduplication, "[repeated 2x across cluster]") may open with a frame.
BURST_STARTS = ("Traceback (most recent call last):", "Error in training function:",
                "Graceful shutdown of backend failed", 'File "')
# Ray's notes about its own machinery: nothing a user can act on, or what shardyard says itself.
RAY_NOTES = (
    # Ray Train's PreemptionWatcher actor, at every launch (ray-project/ray#53727).
    "has constructor arguments in the object store and max_restarts > 0",
    # The raylet, for a killed worker: shardyard's failure line names it.
    "A worker died or was killed while executing a task by an unexpected system error",
)


class RayLog:
    """The file diverted lines go to, opened at the first; the console is told where it is once
    a traceback goes there (Ray's notes alone are not worth a line)."""

    def __init__(self, path: Path, console: TextIO) -> None:
        self.path = path
        self.console = console
        self._file: TextIO | None = None
        self._told = False
        self._lock = threading.Lock()  # written by the stdout and the stderr filter

    def write(self, source: str, text: str, traceback: bool) -> None:
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            if traceback and not self._told:
                self.console.write(f"shardyard: Ray's tracebacks of this launch go to {self.path}\n")
                self.console.flush()
                self._told = True
            self._file.write(f"{time.strftime('%H:%M:%S')} ({source}) {text}\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RayConsole(io.TextIOBase):
    """A text stream in front of `console` that sends a failure's forwarded tracebacks and Ray's
    notes to `log` instead."""

    def __init__(self, console: TextIO, log: RayLog) -> None:
        super().__init__()
        self.console = console
        self.log = log
        self._pending = ""
        self._burst_seen: dict[str, float] = {}  # source -> when its current burst last had a line
        self._lock = threading.Lock()  # Ray's log thread prints beside the driver's own

    def writable(self) -> bool:
        return True

    # What callers ask of a stream (tqdm, Ray, faulthandler) is the console's.
    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.console, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            while "\n" in self._pending:
                line, self._pending = self._pending.split("\n", 1)
                self._route(line)
            # Not the start of a forwarded line (a progress bar's redraw): to the console as it is.
            if self._pending and not MAY_BE_FORWARDED.match(self._pending):
                self.console.write(self._pending)
                self._pending = ""
        return len(text)

    def flush(self) -> None:
        self.console.flush()

    def end(self) -> None:
        """Whatever is left without its newline."""
        with self._lock:
            if self._pending:
                self._route(self._pending)
                self._pending = ""

    def _route(self, line: str) -> None:
        forwarded = FORWARDED.match(line)
        if forwarded is None:
            self.console.write(line + "\n")
            return
        source, text = forwarded["source"], ANSI.sub("", forwarded["text"])
        if self._in_burst(source, text):
            self.log.write(source, text, traceback=True)
        elif any(note in text for note in RAY_NOTES):
            self.log.write(source, text, traceback=False)
        else:
            self.console.write(line + "\n")

    def _in_burst(self, source: str, text: str) -> bool:
        """Whether the line is part of a traceback burst of `source`'s (and keeps it going)."""
        now = time.monotonic()
        if OWN_LINE.match(text):
            self._burst_seen.pop(source, None)
            return False
        if now - self._burst_seen.get(source, -BURST_GAP_S - 1) <= BURST_GAP_S or text.lstrip().startswith(BURST_STARTS):
            self._burst_seen[source] = now
            return True
        return False


def ray_log_path(run_uri: str, run_name: str) -> Path:
    """The run directory's RAY_LOG; for a run kept in object storage, a file of the same name in
    this machine's temporary directory (the lines are a driver's, read where it runs)."""
    storage = RunStorage(run_uri)
    if not storage.remote:
        return Path(storage.path(RAY_LOG))
    return Path(tempfile.gettempdir()) / f"shardyard-{run_name}-{RAY_LOG}"


@contextmanager
def ray_console(run_uri: str, run_name: str) -> Iterator[None]:
    """While the block runs, this process's stdout and stderr go through a RayConsole each (Ray
    prints a forwarded line to the stream it was written to), diverting to one RayLog."""
    log = RayLog(ray_log_path(run_uri, run_name), sys.stderr)
    out, err = RayConsole(sys.stdout, log), RayConsole(sys.stderr, log)
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out.console, err.console
        out.end()
        err.end()
        log.close()
