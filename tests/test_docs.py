"""The documentation: the site builds with `mkdocs build --strict` (no broken link, page or
anchor), the configuration reference is what the spec defines today, and README stays a front
page. No Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo import REPO


pytestmark = pytest.mark.timeout(120)


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=100)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


def test_the_reference_is_written_from_the_spec_as_it_is() -> None:
    from shardyard.docs import PAGE, reference

    assert PAGE.read_text() == reference(), "the spec changed: run `python -m shardyard.docs`"
    assert "| `optim.lr` | float | `0.001` | peak learning rate |" in PAGE.read_text()
    assert "|  |" not in PAGE.read_text()  # every key says what it means


def test_readme_is_a_front_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in ("getting-started", "job-spec", "reference", "serving", "benchmarks"):
        assert f"(docs/{page}.md)" in readme and (REPO / "docs" / f"{page}.md").is_file()
