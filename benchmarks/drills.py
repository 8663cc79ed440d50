"""The drill suite (tests/drills/, marked `drill`): each drill is one mistake a user or a neighbour
makes, with the outcome shardyard must give (refused with a message, or recovered) and the work it
may lose. Runs every drill through pytest and prints the table README reports: drill, expected
outcome, work lost, and whether the drill held.

    python benchmarks/drills.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common import print_table, write_json

DRILLS = Path(__file__).resolve().parents[1] / "tests" / "drills"


class DrillTable:
    """A pytest plugin that keeps each drill's declared outcome and its result."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._declared: dict[str, dict[str, str]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("drill")
            if marker is not None:
                self._declared[item.nodeid] = dict(marker.kwargs)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        failed_setup = report.when == "setup" and not report.passed
        if report.nodeid in self._declared and (report.when == "call" or failed_setup):
            declared = self._declared.pop(report.nodeid)
            name = report.nodeid.rsplit("::", 1)[-1].removeprefix("test_").replace("_", " ")
            self.rows.append({"drill": name, "expected": declared.get("outcome"), "work lost": declared.get("lost"),
                              "held": "yes" if report.passed else "NO", "seconds": round(report.duration, 2)})


def main() -> int:
    table = DrillTable()
    code = pytest.main([str(DRILLS), "-m", "drill", "-q", "-p", "no:cacheprovider"], plugins=[table])
    print_table("drills", table.rows)
    held = sum(row["held"] == "yes" for row in table.rows)
    print(f"\n{held} of {len(table.rows)} drills held")
    write_json("drills", {"tried": len(table.rows), "held": held, "drills": table.rows})
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
