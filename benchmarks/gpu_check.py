"""The GPU check: what only a GPU can tell, measured in one run on a GPU machine.

    python benchmarks/gpu_prepare.py      # where pip reaches its registries: the wheels the GPU machine lacks
    OUT=results bash benchmarks/gpu_check.sh   # on the GPU machine, from a copy of the checkout with .gpu_wheels/

Stages, most wanted first, each in a process of its own under a time cap, all within BUDGET_S (a
stage that would start past it is skipped and said so):
- peak: the bf16 matmul rate (8192^3), the ceiling MFU is read against;
- train: `shardyard train` on the MFU model (a 0.67B Llama: hidden 2048, 16 layers, sequences of
  2048, FSDP2 on one GPU, bf16), through Ray, with its checkpoint at the end;
- relaunch: that run launched again for 2 more steps as a user does (its own local Ray), the time
  from the command to the first step in phases (train/startup.py);
- loop: a plain PyTorch loop on the same model, data and batch (bf16 autocast, fused AdamW),
  eager, compiled block by block, and compiled with float8 linears where the GPU has them: what
  `shardyard train` is compared with;
- readme: README's default job as written, on this machine (one GPU: it must train, not wait);
- pytest_gpu: `pytest -m gpu`;
- serving: the built-in engine (continuous batching, paged KV cache, compiled decode steps)
  against transformers' `generate` on one Llama with a 32,000-token vocabulary, 16 streams of
  128-token prompts and 64 new tokens each (the serving comparison's load);
- train_compiled: `shardyard train` with `parallelism.compile`;
- train_float8: with `run.precision: float8` and compile (compute capability 8.9+).

The training stages' jobs are validated before the first stage starts: a stage whose job does not
validate is not run and its status says why. Everything lands in $OUT/summary.json (the device,
the date, each stage's status, seconds, job and figures) and the stages' output in $OUT/log.txt.
Copy summary.json to benchmarks/results/gpu/ and its figures to docs/benchmarks.md.

Without CUDA the same stages run on a small model and the GPU-only ones are skipped: the suite runs
them so (tests/test_gpu_check.py), and the script cannot rot between GPU runs.

    python benchmarks/gpu_check.py --out DIR [--stages loop,serving] [--budget 450]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import common  # noqa: F401  (puts the package on sys.path)
import torch

from common import print_table

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 440
CUDA = torch.cuda.is_available()
SHARDYARD = str(Path(sys.executable).with_name("shardyard"))


def mfu_job(name: str, storage: Path, steps: int, *extra: str) -> list[str]:
    """`shardyard train` arguments for the MFU model: on a GPU the 0.67B Llama, on a CPU a small one."""
    shape = (["model.config.hidden_size=2048", "model.config.intermediate_size=4096",
              "model.config.num_hidden_layers=16", "model.config.num_attention_heads=16",
              "model.config.num_key_value_heads=16", "model.config.max_position_embeddings=2048",
              "model.block_size=2048", "batch.global_batch_size=16", "batch.micro_batch_size=8"] if CUDA else
             ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
              "model.block_size=64", "batch.global_batch_size=4", "batch.micro_batch_size=2"])
    overrides = [*shape, "data.name=synthetic", "data.num_samples=1024", "scaling.num_workers=1",
                 "parallelism.activation_checkpointing=false", "optim.name=adamw", f"run.steps={steps}",
                 "run.log_every=2", "checkpoint.every_n_steps=100000", "checkpoint.keep=1",
                 f"checkpoint.storage_path={storage}", f"run.name={name}", *extra]
    return ["jobs/configs/llama_fsdp.yaml", *(item for o in overrides for item in ("--set", o))]


def shardyard_train(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 400) -> dict[str, Any]:
    """One `shardyard train` command; its wall time, exit code and the run's steady figures and
    start-up phases (from its metrics and its launch's `first_step` event)."""
    from shardyard.storage.events import read_events
    from shardyard.train.metrics import read_metrics

    began = time.perf_counter()
    done = subprocess.run([SHARDYARD, "train", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
    result: dict[str, Any] = {"exit_code": done.returncode, "wall_s": time.perf_counter() - began}
    setting = dict(a.split("=", 1) for a in args if "=" in a)
    run_dir = Path(setting["checkpoint.storage_path"]) / setting["run.name"]
    rows = read_metrics(run_dir) if run_dir.exists() else []
    steady = rows[1:] or rows
    if steady:
        for key in ("tokens_per_s", "model_tflops_per_s", "mfu", "peak_memory_gib"):
            values = [r[key] for r in steady if key in r]
            if values:
                result[key] = sum(values) / len(values)
    firsts = [e for e in read_events(run_dir) if e["event"] == "first_step"] if run_dir.exists() else []
    if firsts:
        result["startup"] = {k: v for k, v in firsts[-1].items() if k.endswith("_s")}
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("shardyard: ") and ("GPU" in line or "CPU" in line):
            result["placement"] = line  # where the workers went, and why
    return result


# ----------------------------------------------------------------------------- stages


def peak() -> dict[str, Any]:
    """bf16 matmul TFLOP/s: ten timed 8192^3 products after three warm-ups."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    return {"device": torch.cuda.get_device_name(), "capability": capability,
            "bf16_matmul_tflops": 10 * 2 * 8192**3 / (time.perf_counter() - began) / 1e12}


def loop() -> dict[str, Any]:
    """The plain loop: the MFU model, its data, one optimizer step per global batch."""
    from shardyard.models import build_model
    from shardyard.parallel.compile import apply_compile
    from shardyard.parallel.float8 import apply_float8, float8_unsupported
    from shardyard.planner import ModelShape
    from shardyard.train.efficiency import device_peak_flops, flops_per_token

    spec = job_of(mfu_job("loop", Path(tempfile.gettempdir()), 1))
    device = torch.device("cuda" if CUDA else "cpu")
    shape = ModelShape.of(spec)
    per_token = flops_per_token(shape.total, shape.n_layer, shape.n_embd, spec.model.block_size)
    peak_flops = device_peak_flops(device)
    batch, micro = spec.batch.global_batch_size, spec.batch.micro_batch_size
    tokens = torch.randint(0, 256, (batch, spec.model.block_size + 1), device=device)
    variants = {"eager": [], "compiled": [apply_compile]}
    if float8_unsupported(device) is None:
        variants["float8 compiled"] = [apply_float8, apply_compile]
    out: dict[str, Any] = {"parameters": shape.total}
    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for i in range(0, batch, micro):
            chunk = tokens[i:i + micro]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=CUDA):
                logits = model(chunk[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
            (loss / (batch // micro)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for name, changes in variants.items():
        torch.manual_seed(0)
        model = build_model(spec.model)
        for change in changes:
            change(model)
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=CUDA)
        timed = 5 if CUDA else 2
        for _ in range(3):  # warm-up, compiles
            step(model, optimizer)
        if CUDA:
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(timed):
            step(model, optimizer)
        if CUDA:
            torch.cuda.synchronize()
        rate = timed * batch * spec.model.block_size / (time.perf_counter() - began)
        out[name] = {"tokens_per_s": rate, "model_tflops_per_s": rate * per_token / 1e12,
                     **({"mfu": rate * per_token / peak_flops} if peak_flops else {})}
        del model, optimizer
        if CUDA:
            torch.cuda.empty_cache()
    return out


def own_ray() -> dict[str, str]:
    """The environment for a command that starts a local Ray of its own, as a user's does (inside
    the caller's RAY_TMPDIR, if it has one: whoever cleans that up finds these processes too)."""
    return {"RAY_TMPDIR": tempfile.mkdtemp(prefix="sy-", dir=os.environ.get("RAY_TMPDIR", "/tmp"))}


MFU_STEPS = 12 if CUDA else 4
# The `shardyard train` arguments of each stage that trains through the command, by stage: check()
# validates them all before the first stage starts, so a job that no longer validates costs no
# device time and is named in the summary.
TRAINING_JOBS: dict[str, Callable[[Path], list[str]]] = {
    "train": lambda work: mfu_job("mfu", work, MFU_STEPS),
    "relaunch": lambda work: mfu_job("mfu", work, MFU_STEPS + 2),
    "readme": lambda work: ["jobs/configs/gpt_ddp.yaml", "--set", "run.steps=4", "--set",
                            f"checkpoint.storage_path={work / 'readme'}", "--set", "run.name=gpt_ddp"],
    "train_compiled": lambda work: mfu_job("mfu_compiled", work, MFU_STEPS, "parallelism.compile=true"),
    "train_float8": lambda work: mfu_job("mfu_float8", work, 12, "parallelism.compile=true", "run.precision=float8"),
}


def job_of(args: list[str]) -> Any:
    """The spec `shardyard train ARGS` would train, validated as the command validates it."""
    from shardyard.spec import load_spec

    return load_spec(REPO / args[0], [a for a in args[1:] if a != "--set"])


def train(work: Path) -> dict[str, Any]:
    """`shardyard train` on the MFU model, eager (its checkpoint is what the relaunch loads)."""
    return shardyard_train(TRAINING_JOBS["train"](work), own_ray())


def train_compiled(work: Path) -> dict[str, Any]:
    return shardyard_train(TRAINING_JOBS["train_compiled"](work), own_ray())


def relaunch(work: Path) -> dict[str, Any]:
    """The eager run again, 2 steps longer, from the command as a user types it (a local Ray of
    its own): time to the first step, phase by phase. Without the train stage's run, one is
    trained first (not timed)."""
    if not (work / "mfu").exists():
        shardyard_train(TRAINING_JOBS["train"](work), own_ray())
    return shardyard_train(TRAINING_JOBS["relaunch"](work), own_ray())


def readme(work: Path) -> dict[str, Any]:
    """README's default job as written (4 steps, its own storage) on this machine."""
    return shardyard_train(TRAINING_JOBS["readme"](work), own_ray(), timeout_s=300)


def pytest_gpu(work: Path) -> dict[str, Any]:
    """`pytest -m gpu`, each test's outcome as it ends: a run the stage's cap cuts short still
    says which tests passed, failed and were not reached."""
    outcomes: dict[str, str] = {}
    with subprocess.Popen([sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
                           "-o", "addopts=-ra", "tests/"],  # in one process, one GPU test at a time
                          # A calling session's own options (PYTEST_ADDOPTS: its workers, say) are not this one's.
                          env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as tests:
        for line in tests.stdout:
            print(line, end="", flush=True)
            if match := re.match(r"(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", line):
                outcomes[match[1]] = match[2]
                # Written as each test ends: what the cap leaves is still read by the orchestra.
                (work / "pytest_gpu.json").write_text(json.dumps(_tally(outcomes, None), indent=2))
    return _tally(outcomes, tests.returncode)


def _tally(outcomes: dict[str, str], exit_code: int | None) -> dict[str, Any]:
    counted = list(outcomes.values())
    return {"exit_code": exit_code, **{kind.lower(): counted.count(kind) for kind in ("PASSED", "FAILED", "SKIPPED",
                                                                                      "ERROR")},
            "tests": len(counted), "failed_tests": [t for t, o in outcomes.items() if o in ("FAILED", "ERROR")]}


def serving(work: Path) -> dict[str, Any]:
    """Output tokens/s of the built-in engine and of transformers' `generate` on one model and load."""
    from transformers import AutoModelForCausalLM

    from shardyard.serve.engine.batching import prefill_budget
    from shardyard.serve.engine.decoding import DecodingEngine
    from shardyard.serve.generation import Completion
    from shardyard.serve.executor.local_model import LocalModel
    from shardyard.serve.resolved import load_config
    from shardyard.serve.sampling import Sampling
    from helpers.vllm_bench import model_directory

    streams, prompt_tokens, new_tokens = 16, 128, 64
    directory = model_directory(work / "llama", hidden=2048 if CUDA else 64, layers=16 if CUDA else 2,
                                heads=16 if CUDA else 4, context=512, vocab_size=32000 if CUDA else 320)
    dtype = torch.bfloat16 if CUDA else torch.float32
    prompts = torch.randint(0, 300, (streams, prompt_tokens)).tolist()
    cfg = load_config({"checkpoint": str(directory), "batching.max_batch_size": streams}, use_gpu=CUDA)
    local = LocalModel(str(directory), CUDA, cfg.cache_blocks, dtype=dtype, compile_for=streams if CUDA else 0)
    budget = prefill_budget(local.forward, 512, streams, cfg.batching.token_latency_target_ms / 1000)

    async def engine_round() -> float:
        engine = DecodingEngine(local.forward, streams, 512, cfg.cache_blocks, budget, lambda: None, (),
                                packs=local.cache_attends, executor=local.executor)

        async def one(prompt: list[int]) -> int:
            return len([t async for t in engine.tokens(engine.submit(
                Completion(prompt, new_tokens, Sampling(ignore_eos=True))))])

        began = time.perf_counter()
        made = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return made / (time.perf_counter() - began)

    asyncio.run(engine_round())  # compiles the decode steps, fills the caches' shapes
    engine_rate = asyncio.run(engine_round())
    local.close()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to("cuda" if CUDA else "cpu").eval()
    batch = torch.tensor(prompts, device=model.device)

    def generate_round() -> float:
        began = time.perf_counter()
        with torch.no_grad():
            made = model.generate(batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if CUDA:
            torch.cuda.synchronize()
        return (made.shape[1] - prompt_tokens) * streams / (time.perf_counter() - began)

    generate_round()
    generate_rate = generate_round()
    return {"streams": streams, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "engine_tokens_per_s": engine_rate, "generate_tokens_per_s": generate_rate,
            "engine_vs_generate": engine_rate / generate_rate}


def train_float8(work: Path) -> dict[str, Any]:
    return shardyard_train(TRAINING_JOBS["train_float8"](work), own_ray())


def float8_gpu() -> bool:
    return CUDA and torch.cuda.get_device_capability() >= (8, 9)


# name: (what it runs, its cap in seconds, whether it can run here)
STAGES: dict[str, tuple[Callable[..., dict[str, Any]], float, Callable[[], bool]]] = {
    "peak": (peak, 60, lambda: CUDA),
    "train": (train, 150, lambda: True),
    "relaunch": (relaunch, 120, lambda: True),
    "loop": (loop, 120, lambda: True),
    "readme": (readme, 90, lambda: True),
    "pytest_gpu": (pytest_gpu, 150, lambda: True),
    "serving": (serving, 150, lambda: True),
    "train_compiled": (train_compiled, 150, lambda: True),
    "train_float8": (train_float8, 150, float8_gpu),
}

# ----------------------------------------------------------------------------- the orchestra


def run_stage(name: str, work: Path) -> None:
    """In the stage's own process: run it, write its figures to WORK/<name>.json."""
    function = STAGES[name][0]
    figures = function(work) if function.__code__.co_argcount else function()
    (work / f"{name}.json").write_text(json.dumps(figures, indent=2))


def checked_jobs(stages: list[str], work: Path) -> dict[str, dict[str, Any]]:
    """For each training stage asked for: its job in brief, or why it does not validate."""
    from shardyard.spec import SpecError

    jobs: dict[str, dict[str, Any]] = {}
    for name in (s for s in stages if s in TRAINING_JOBS):
        args = TRAINING_JOBS[name](work)
        try:
            spec = job_of(args)
        except SpecError as error:
            jobs[name] = {"invalid": str(error)}
            continue
        jobs[name] = {"config": args[0], "model": spec.model.name, "strategy": spec.parallelism.strategy,
                      "workers": spec.scaling.num_workers, "steps": spec.run.steps}
    return jobs


def check(out: Path, stages: list[str], budget_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log = (out / "log.txt").open("a")
    began = time.monotonic()
    summary: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                               "device": torch.cuda.get_device_name() if CUDA else "cpu (no CUDA)",
                               "torch": torch.__version__, "budget_s": budget_s, "stages": {}}
    jobs = checked_jobs(stages, work)
    for name in stages:
        _, cap, possible = STAGES[name]
        brief = jobs.get(name, {})
        if "invalid" in brief:
            summary["stages"][name] = {"status": f"invalid job: {brief['invalid']}"}
            continue
        job = {"job": brief} if brief else {}
        # The caps are the GPU machine's device-time plan; a 2-core CPU machine starts Ray and its
        # workers several times slower, and there no device time is spent.
        cap = cap if CUDA else 2 * cap
        left = budget_s - (time.monotonic() - began)
        if not possible():
            summary["stages"][name] = {"status": "skipped: needs a GPU" + (" of compute capability 8.9+"
                                                                           if name == "train_float8" else ""), **job}
            continue
        if left < 20:
            summary["stages"][name] = {"status": f"skipped: the budget of {budget_s:g} s was spent", **job}
            continue
        log.write(f"\n===== {name} (cap {min(cap, left):.0f} s)\n")
        log.flush()
        stage_began = time.monotonic()
        try:
            done = subprocess.run([sys.executable, __file__, "--stage", name, "--work", str(work)], cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=min(cap, left))
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode}): see log.txt"
        except subprocess.TimeoutExpired:
            status = f"timed out after {min(cap, left):.0f} s"
        result = work / f"{name}.json"
        summary["stages"][name] = {"status": status, "seconds": round(time.monotonic() - stage_began, 1),
                                   **job,
                                   **(json.loads(result.read_text()) if result.exists() else {})}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))  # what is known so far survives a kill
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="where summary.json and log.txt go ($OUT)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, of: " + ", ".join(STAGES))
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all stages")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # one stage, in its own process
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        run_stage(args.stage, args.work)
        return
    stages = args.stages.split(",")
    unknown = [s for s in stages if s not in STAGES]
    if unknown or args.out is None:
        parser.error(f"unknown stages {unknown}" if unknown else "--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = check(args.out, stages, args.budget)
    print_table(f"Device check, {summary['device']}, {summary['date']}",
                [{"stage": name, "status": s["status"], "seconds": s.get("seconds")}
                 for name, s in summary["stages"].items()])
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
