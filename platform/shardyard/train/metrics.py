"""Throughput, progress output, the metrics log (and the trackers, train/tracking.py) and the
end-of-run report.

Metrics do not travel through `ray.train.report`: in Ray Train V2 each report waits for the
controller, which drains a one-slot queue on its health-check poll (every 2 s), so reporting at
every log interval would throttle training to that poll. Rank 0 prints progress and writes the
metrics log itself, as JSON lines in the run's storage (storage/events.py). Nothing calls
`ray.train.report`: checkpoints are shardyard's commit records alone (checkpoint/record.py).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardyard.checkpoint.record import newest_name
from shardyard.spec import JobSpec
from shardyard.storage.events import METRICS_FILE, JsonLines, read_metrics
from shardyard.storage.store import RunStorage
from shardyard.tables import format_table
from shardyard.train.tracking import open_trackers

LOSS_PLOT = "loss_curve.png"


@dataclass
class RunResult:
    run_dir: Path
    checkpoint: str | None
    summary: dict[str, Any]


class Throughput:
    """Samples, tokens and seconds since the last read."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
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
        self.restart()
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
        if "mfu" in metrics:
            text += f" | MFU {metrics['mfu']:.1%}"
        for name, value in metrics.items():  # val_loss, and a task of the user's own's metrics
            if name.startswith("val_") and name != "val_perplexity":
                text += f" | {name.replace('_', ' ')} {value:.4f}"
        if self._bar is None:
            print(text, flush=True)
        else:
            self._bar.set_description(text)
            self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class MetricsLog:
    """Rank 0's log: one row per logged step into `metrics.jsonl`, and the same scalars to each
    tracker `run.loggers` names."""

    def __init__(self, spec: JobSpec, resume_step: int) -> None:
        self.file = JsonLines(RunStorage(spec.run_uri), METRICS_FILE)
        self.file.append({"resumed_at": resume_step, "time": time.time()})
        self.trackers = open_trackers(spec)
        self._failing: set = set()  # trackers whose last log failed

    def append(self, row: dict[str, Any]) -> None:
        row = {**row, "time": time.time()}
        self.file.append(row)
        for tracker in self.trackers:
            try:
                tracker.log(row)
            except Exception as err:  # noqa: BLE001 - a tracking server's outage must not stop training
                # metrics.jsonl has the row: say so once per outage, not every step.
                if tracker not in self._failing:
                    print(f"shardyard: {type(tracker).__name__} did not take step {row['step']}'s metrics "
                          f"({err}); metrics.jsonl has them, training goes on", flush=True)
                self._failing.add(tracker)
            else:
                self._failing.discard(tracker)

    def close(self) -> None:
        """Ends each tracker's run; one that cannot (its server down at the end) is reported, and
        the run, whose last checkpoint is already committed, still succeeds."""
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001 - as in append: the record is metrics.jsonl
                print(f"shardyard: {type(tracker).__name__} could not end its run ({err}); "
                      f"metrics.jsonl has every row", flush=True)


# ----------------------------------------------------------------------------- the end of a run


def plot_loss(rows: list[dict[str, Any]], title: str) -> bytes:
    """The loss curve as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".", label="training")
    validated = [r for r in rows if "val_loss" in r]
    if validated:
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], marker="o", label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def efficiency(steady: list[dict[str, Any]]) -> dict[str, Any]:
    """The end-of-run table's hardware figures: mean model TFLOP/s and MFU over the steady rows,
    the peak memory of any rank, the last gradient norm (rows written before these were measured
    have none)."""
    out: dict[str, Any] = {}
    for key in ("model_tflops_per_s", "mfu"):
        values = [r[key] for r in steady if key in r]
        if values:
            out[key] = sum(values) / len(values)
    if any("peak_memory_gib" in r for r in steady):
        out["peak_memory_gib"] = max(r.get("peak_memory_gib", 0.0) for r in steady)
    if "grad_norm" in steady[-1]:
        out["last_grad_norm"] = steady[-1]["grad_norm"]
    return out


def summarize(run_dir: str | Path, title: str, wall_s: float) -> dict[str, Any]:
    """Write the loss plot beside the metrics; return the numbers for the end-of-run table."""
    rows = read_metrics(run_dir)
    if not rows:
        return {"steps": 0, "wall_s": wall_s}
    storage = RunStorage(run_dir)
    storage.write_bytes(plot_loss(rows, title), LOSS_PLOT)
    # The first interval includes start-up and warm-up; leave it out of the steady-state rate.
    steady = rows[1:] or rows
    validated = [r for r in rows if "val_loss" in r]
    last_validation = {**{k: v for k, v in validated[-1].items() if k.startswith("val_")},
                       "best_val_loss": min(r["val_loss"] for r in validated)} if validated else {}
    return {
        "steps": rows[-1]["step"],
        "final_loss": rows[-1]["loss"],
        "best_loss": min(r["loss"] for r in rows),
        **last_validation,
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "samples_per_s": sum(r["samples_per_s"] for r in steady) / len(steady),
        "world_size": rows[-1]["world_size"],
        **efficiency(steady),
        "wall_s": wall_s,
        "loss_plot": storage.url(LOSS_PLOT),
        "metrics": storage.url(METRICS_FILE),
    }


def finish_run(spec: JobSpec, title: str, start: float, startup: dict[str, float] | None = None) -> RunResult:
    """The end-of-run table and loss plot; the run's newest committed checkpoint. `startup`: the
    launch's start-up phases (train/startup.py), shown in the table too."""
    summary = summarize(spec.run_uri, title, time.perf_counter() - start) | (startup or {})
    storage = RunStorage(spec.run_uri)
    newest = newest_name(storage)
    summary["checkpoint"] = storage.url(newest) if newest else None
    print(format_table(title, summary), flush=True)
    return RunResult(spec.run_dir, summary["checkpoint"], summary)
