"""Throughput, progress output, the metrics log and the end-of-run report.

Metrics do not travel through `ray.train.report`: in Ray Train V2 each report waits for the
controller, which drains a one-slot queue on its health-check poll (every 2 s), so reporting at
every log interval would throttle training to that poll. Rank 0 prints progress and writes the
metrics log itself; `ray.train.report` is called only with checkpoints (see checkpoint.py).
"""

from __future__ import annotations

import io
import json
import math
import time
from typing import Any

import pyarrow.fs
from ray.train import UserCallback

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
LOSS_PLOT = "loss_curve.png"


class Throughput:
    """Samples, tokens and seconds since the last read."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._start = time.perf_counter()
        self._steps = self._samples = self._tokens = 0

    def add(self, samples: int, tokens: int) -> None:
        self._steps += 1
        self._samples += samples
        self._tokens += tokens

    def read(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        out = {"samples_per_s": self._samples / elapsed, "tokens_per_s": self._tokens / elapsed,
               "step_time_s": elapsed / max(self._steps, 1)}
        self._reset()
        return out


class Progress:
    """Rank 0's progress: a bar on a terminal (Ray's tqdm draws it on the driver), else one plain
    line per report, which reads well in `ray job logs` and CI output."""

    def __init__(self, total_steps: int, start_step: int, as_bar: bool) -> None:
        self.total = total_steps
        self._bar = None
        if as_bar:
            from ray.experimental.tqdm_ray import tqdm

            self._bar = tqdm(total=total_steps, desc="train", unit="step")
            self._bar.update(start_step)

    def update(self, steps: int, metrics: dict[str, Any]) -> None:
        text = (f"step {metrics['step']}/{self.total} | loss {metrics['loss']:.4f} | "
                f"{metrics['tokens_per_s']:,.0f} tok/s | {metrics['samples_per_s']:,.1f} samples/s"
                f" | world {metrics['world_size']}")
        if self._bar is None:
            print(text, flush=True)
        else:
            self._bar.set_description(text)
            self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class MetricsFile:
    """A JSON-lines file of a run (`metrics.jsonl` by default), written by rank 0 or the
    controller and read by the driver.

    Written through pyarrow's filesystem layer, so the same code serves a local directory and
    s3:// or gs:// storage (object stores cannot append, so the small file is rewritten whole).
    """

    def __init__(self, storage_path: str, run_name: str, name: str = METRICS_FILE) -> None:
        self.fs, root = pyarrow.fs.FileSystem.from_uri(storage_path)
        self.dir = f"{root}/{run_name}"
        self.path = f"{self.dir}/{name}"

    def read(self) -> list[dict[str, Any]]:
        if self.fs.get_file_info(self.path).type == pyarrow.fs.FileType.NotFound:
            return []
        with self.fs.open_input_stream(self.path) as f:
            return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]

    def write(self, rows: list[dict[str, Any]]) -> None:
        self.fs.create_dir(self.dir, recursive=True)
        with self.fs.open_output_stream(self.path) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows).encode())

    def write_bytes(self, name: str, data: bytes) -> str:
        with self.fs.open_output_stream(f"{self.dir}/{name}") as f:
            f.write(data)
        return f"{self.dir}/{name}"


class MetricsLog:
    """Rank 0's log: one row per step. A restarted run drops the rows past the checkpoint it
    resumed from, since it is about to recompute those steps."""

    def __init__(self, file: MetricsFile, resume_step: int) -> None:
        self.file = file
        self.rows = [r for r in file.read() if r["step"] <= resume_step]

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append({**row, "time": time.time()})
        self.file.write(self.rows)


def read_events(storage_path: str, run_name: str) -> list[dict[str, Any]]:
    return MetricsFile(storage_path, run_name, EVENTS_FILE).read()


def log_event(storage_path: str, run_name: str, event: str, **fields: Any) -> None:
    """Append one event (`start` of a worker group, `failure`, `healed`, `injected_crash`) to the
    run's event log."""
    file = MetricsFile(storage_path, run_name, EVENTS_FILE)
    file.write([*file.read(), {"event": event, "time": time.time(), **fields}])


class FailureLog(UserCallback):
    """Runs on the Ray Train controller: records each worker failure before the group restarts."""

    def __init__(self, storage_path: str, run_name: str) -> None:
        self.storage_path, self.run_name = storage_path, run_name

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {r: f"{type(e).__name__}: {e}"[:300] for r, e in sorted(worker_exceptions.items())}
        log_event(self.storage_path, self.run_name, "failure", ranks=sorted(errors), errors=errors)


def plot_loss(rows: list[dict[str, Any]], title: str) -> bytes:
    """The loss curve as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def summarize(file: MetricsFile, title: str, wall_s: float) -> dict[str, Any]:
    """Write the loss plot beside the metrics; return the numbers for the end-of-run table."""
    rows = file.read()
    if not rows:
        return {"steps": 0, "wall_s": wall_s}
    # The first interval includes start-up and warm-up; leave it out of the steady-state rate.
    steady = rows[1:] or rows
    return {
        "steps": rows[-1]["step"],
        "final_loss": rows[-1]["loss"],
        "best_loss": min(r["loss"] for r in rows),
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "samples_per_s": sum(r["samples_per_s"] for r in steady) / len(steady),
        "world_size": rows[-1]["world_size"],
        "wall_s": wall_s,
        "loss_plot": file.write_bytes(LOSS_PLOT, plot_loss(rows, title)),
        "metrics": file.path,
    }


def format_table(title: str, summary: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 100 and not math.isclose(v, round(v)) else f"{v:,.1f}"
        return str(v)

    width = max(len(k) for k in summary)
    lines = [title, "-" * max(len(title), 40)]
    lines += [f"{k.ljust(width)}  {fmt(v)}" for k, v in summary.items()]
    return "\n".join(lines)
