"""Throughput measurement, the progress bar, the metrics log and the end-of-run report."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ray.train import UserCallback

METRICS_FILE = "metrics.jsonl"
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


class MetricsLog(UserCallback):
    """Appends rank 0's reported metrics to `<run_dir>/metrics.jsonl` (runs on the controller)."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir) / METRICS_FILE

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if not metrics or not metrics[0]:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({**metrics[0], "time": time.time()}) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metrics log, one row per step: a step logged twice (recomputed after a restart) keeps
    its latest value."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def plot_loss(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(out.parent.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summarize(run_dir: str | Path, wall_s: float) -> dict[str, Any]:
    """Write the loss plot and return the numbers for the end-of-run table."""
    rows = read_metrics(run_dir)
    if not rows:
        return {"steps": 0, "wall_s": wall_s}
    # The first interval includes start-up and warm-up; leave it out of the steady-state rate.
    steady = rows[1:] or rows
    summary = {
        "steps": rows[-1]["step"],
        "final_loss": rows[-1]["loss"],
        "best_loss": min(r["loss"] for r in rows),
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "samples_per_s": sum(r["samples_per_s"] for r in steady) / len(steady),
        "world_size": rows[-1]["world_size"],
        "wall_s": wall_s,
        "loss_plot": str(plot_loss(rows, Path(run_dir) / LOSS_PLOT)),
        "metrics": str(Path(run_dir) / METRICS_FILE),
    }
    return summary


def format_table(title: str, summary: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 100 and not math.isclose(v, round(v)) else f"{v:,.1f}"
        return str(v)

    width = max(len(k) for k in summary)
    lines = [title, "-" * max(len(title), 40)]
    lines += [f"{k.ljust(width)}  {fmt(v)}" for k, v in summary.items()]
    return "\n".join(lines)
