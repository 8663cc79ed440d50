"""Plain-text tables for end-of-run and end-of-job summaries."""

from __future__ import annotations

import math
from typing import Any


def format_table(title: str, summary: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 100 and not math.isclose(v, round(v)) else f"{v:,.1f}"
        return str(v)

    width = max(len(k) for k in summary)
    lines = [title, "-" * max(len(title), 40)]
    lines += [f"{k.ljust(width)}  {fmt(v)}" for k, v in summary.items()]
    return "\n".join(lines)
