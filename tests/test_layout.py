"""The package's structure, read from its imports: no two modules import each other (directly or
round a longer cycle), the training loop does not need Ray, and nothing reaches into a library's
internal modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo import REPO

PACKAGE = REPO / "platform" / "shardyard"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each shardyard module's imports of other shardyard modules (function-level ones included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardyard"):
                candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
                found.add(next(c for c in candidates if c in modules))
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def external_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


@pytest.mark.timeout(30)
def test_no_import_cycles() -> None:
    graph = imports()
    # A package's __init__ re-exporting its own submodules is not a cycle of separate modules.
    def edges(name: str) -> set[str]:
        return {m for m in graph[name] if not name.startswith(m + ".") and not m.startswith(name + ".")}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in edges(node):
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [cycle for name in graph if (cycle := cycle_from(name))]
    assert not cycles, cycles[0]


@pytest.mark.timeout(30)
def test_the_trainer_needs_no_ray_and_nothing_reaches_into_library_internals() -> None:
    assert not any(m.split(".")[0] == "ray" for m in external_imports(PACKAGE / "train" / "trainer.py"))
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "checkpoint_manager_snapshot" not in text, path
        assert not any("._internal" in m or m.startswith("ray.train.v2._") for m in external_imports(path)), path


@pytest.mark.timeout(30)
def test_strategies_know_no_model_library() -> None:
    """Strategies see models through one interface (models/__init__.py): repeated blocks and a
    tensor-parallel plan. Only the Hugging Face adapter, the spec's model section, the data's
    tokenizers (a model directory's tokenizer, a trained one saved as transformers reads it) and the
    reader of a model directory's weights (transformers converts files laid out otherwise than the
    model) import transformers."""
    for path in (PACKAGE / "parallel").rglob("*.py"):
        assert not any(m.split(".")[0] == "transformers" for m in external_imports(path)), path
    users = {module_name(p) for p in PACKAGE.rglob("*.py")
             if any(m.split(".")[0] == "transformers" for m in external_imports(p))}
    assert users == {"shardyard.models.hf", "shardyard.spec.models", "shardyard.data.tokenizer",
                     "shardyard.checkpoint.pretrained"}, users


# The floors of the house, lowest first (docs/architecture.md draws them): a room imports only
# rooms on its own floor or below. Training and serving share a floor and import nothing of each
# other; the pool, the CLI, the Python API and the generated reference stand on both.
FLOORS = [
    {"exit_codes", "ports", "tables", "runtime", "storage", "localdist"},
    {"layout", "spec", "cluster"},
    {"models", "optim", "data"},
    {"parallel", "planner"},
    {"checkpoint"},
    {"train", "serve"},
    {"pool", "cli", "docs", "api"},
]


def room_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def floor_of(module: str) -> int:
    room = room_of(module)
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


@pytest.mark.timeout(30)
def test_every_room_is_on_a_floor_and_no_import_runs_up_one() -> None:
    graph = imports()
    unplaced = sorted({room_of(name) for name in graph} - set().union(*FLOORS) - {"shardyard"})
    assert not unplaced, f"rooms on no floor: {unplaced}"
    upward = sorted((name, used) for name, uses in graph.items() if name != "shardyard" for used in uses
                    if floor_of(used) > floor_of(name))
    assert not upward, upward


@pytest.mark.timeout(30)
def test_no_module_is_over_400_lines() -> None:
    """A module that grows past this is doing more than one job: split it by concern."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


@pytest.mark.timeout(30)
def test_training_and_serving_import_nothing_of_each_other_and_ray_train_has_one_adapter() -> None:
    graph = imports()
    for name, uses in graph.items():
        if room_of(name) in ("train", "serve"):
            other = {"train": "serve", "serve": "train"}[room_of(name)]
            assert not any(room_of(u) == other for u in uses), (name, uses)
    ray_train = {module_name(p) for p in PACKAGE.rglob("*.py")
                 if any(m == "ray.train" or m.startswith("ray.train.") for m in external_imports(p))}
    assert {name.rsplit(".", 1)[0] for name in ray_train} == {"shardyard.train.ray_train"}, ray_train


# serve/'s wings, each importing only those below it: the vocabulary every wing speaks (sampling,
# generation), the executor that runs the model, the engine that decides what runs, the follower
# that swaps weights, the HTTP surface, and the app that puts them together.
WINGS = ["sampling", "generation", "executor", "engine", "follow", "http", "app"]


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["shardyard", "serve"] and len(parts) > 2 and parts[2] in WINGS else None


@pytest.mark.timeout(30)
def test_serving_is_wings_of_small_rooms_that_point_down_and_only_the_app_knows_which_engine_decodes() -> None:
    """Each wing of serve/ imports only the wings below it; the
    routes, the gate and the follower speak to the engine backend's protocol only (none imports
    an engine), and the follower and the gate know no HTTP (no FastAPI, no Serve): each is tested
    without Ray Serve."""
    graph = imports()
    upward = sorted((name, used) for name, uses in graph.items() for used in uses
                    if (a := wing_of(name)) and (b := wing_of(used)) and WINGS.index(b) > WINGS.index(a))
    assert not upward, upward
    engines = {"shardyard.serve.engine.builtin", "shardyard.serve.engine.vllm_engine", "shardyard.serve.engine.decoding",
               "shardyard.serve.executor.local_model", "shardyard.serve.engine.static_batches"}
    for name in ("http.openai_routes", "http.admin_routes", "follow.gate", "follow.follower"):
        assert not graph[f"shardyard.serve.{name}"] & engines, (name, graph[f"shardyard.serve.{name}"] & engines)
    for name in ("follow.gate", "follow.follower", "engine.backend"):
        outside = external_imports(PACKAGE / "serve" / f"{name.replace('.', '/')}.py")
        assert not {m for m in outside if m.split(".")[0] in ("fastapi", "starlette") or m.startswith("ray.serve")}, name


@pytest.mark.timeout(60)
def test_validating_a_config_imports_no_torch() -> None:
    """Every launch validates the spec before anything else: for README's job that stays a
    fraction of a second because the rules it asks (layout/) are plain arithmetic. Importing
    torch made it seconds (0.2 s -> 3 s). (A Hugging Face model's spec reads its config through
    transformers, which imports torch: its shapes are needed.)"""
    probe = ("import sys; from shardyard.spec import load_spec; "
             f"load_spec({str(REPO / 'jobs' / 'configs' / 'gpt_ddp.yaml')!r}); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout[:500]


TESTS = REPO / "tests"
# Folders of tests that are not a room of the package: the hardening drills, and what tests share.
NOT_ROOMS = {"drills", "helpers"}
BENCHMARKS = {p.stem for p in (REPO / "benchmarks").glob("*.py")}


@pytest.mark.timeout(30)
def test_the_tests_mirror_the_package_and_share_through_helpers_only() -> None:
    """Each folder of tests is a room of the package (a folder or a module: tests/cluster/ tests
    cluster.py), the drills' or the helpers'; no test module imports another, nor a conftest (fixtures are
    reached by name: a conftest imported as a module is whichever one pytest loaded last), nor a
    benchmark (the benchmarks are off the tests' path; what both run lives in tests/helpers/)."""
    rooms = {p.relative_to(PACKAGE).with_suffix("") for p in PACKAGE.rglob("*")
             if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}
    for path in TESTS.rglob("*.py"):
        folder = path.parent.relative_to(TESTS)
        if folder.parts and folder.parts[0] not in NOT_ROOMS:
            assert folder in rooms, \
                f"{path.relative_to(REPO)}: tests/{folder} is no room of platform/shardyard/"
        imported = {name.partition(".")[0] for name in external_imports(path)}
        shared = sorted(n for n in imported if n.startswith("test_") or n == "conftest")
        assert not shared, f"{path.relative_to(REPO)} imports {shared}: move what it needs to tests/helpers/"
        timed = sorted(imported & BENCHMARKS)
        assert not timed, f"{path.relative_to(REPO)} imports the benchmarks' {timed}: tests/helpers/ holds what both use"
