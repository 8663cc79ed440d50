"""Helpers shared by the benchmarks: a printed table and a JSON file per benchmark."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# Benchmarks run from a checkout; make the package importable without installing it again, and
# the journeys the tests run too (tests/helpers/: a fake autoscaling cluster, a pool episode,
# vLLM's load client), which some benchmarks time.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))  # every row's keys, in order
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


# The CPU features speed depends on most (machines of one kind differ: vLLM's CPU build decodes
# about twice as fast with AMX as with AVX2 alone).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """What the figures were measured on: the CPU's model and the features of CPU_FLAGS it has,
    its logical cores, and the GPU, if any."""
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    found: dict[str, Any] = {"cpu": fields.get("model name", platform.processor() or "unknown"),
                             "cpu_flags": [f for f in CPU_FLAGS if f in flags], "logical_cpus": os.cpu_count()}
    try:
        import torch

        found["torch"] = torch.__version__
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return found


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """`payload` as benchmarks/results/NAME.json, with the machine it was measured on."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    print(f"\nwrote {path}")
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return "" if value is None else str(value)
