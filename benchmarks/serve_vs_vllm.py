"""shardyard's built-in engine against vLLM, on the same model directories and the same loads, all
measured by vLLM's own client (`vllm bench serve`): random prompts, 128 tokens in, 64 out, at 1,
16 and 64 concurrent streams; and a shared-prefix load, every prompt the same 1,000 random tokens
then 128 of its own, at 16 streams, served with prefix caching on and off (`--no-shared-prefix`:
the random load only).

    .vllm-env/bin/python benchmarks/serve_vs_vllm.py [--shapes v4096 v32000 v4096-hd128] [--dtype bfloat16]
        [--concurrency 1 16 64] [--prompts 64] [--rounds N] [--app-set KEY=VALUE ...]

The models (`SHAPES`): Llama directories of 8 layers, hidden 512, random weights, a 2,048-token
context, with a byte-level BPE of 4,096 or 32,000 tokens learnt from the standard library's
sources, head_dim 64 or 128 (vLLM's CPU attention needs 64 or more); `v320`, the 320-token
vocabulary earlier figures were measured on, on request. Every server serves in `--dtype`:
bfloat16 by default, which is what `vllm serve` takes for `auto` on an x86 CPU (a float32
directory included), so vLLM runs at its own defaults; `--dtype float32` compares both in float32.
shardyard serves each through README's own path, `shardyard serve DIRECTORY` run as a user runs
it (its own local Ray of the machine's CPUs, Serve behind HAProxy, one replica, continuous
batching, 16 requests at once, one shard in its engine core's process: `shardyard`;
`shardyard-two-shards`: two pipeline shards, as README's config did until 2026-11-29;
`shardyard-one-thread` and `-two-threads`: the engine core on one or two OpenMP threads for every
pass, `engine.cpu_threads`; `shardyard-compiled`: its decode steps compiled, `engine.enforce_eager`
false, timed after the graphs it compiles as it starts), with its
built-in engine and with `engine: vllm`; then `vllm serve` (its CPU build, 2 GiB of KV cache, prefix caching on, its
default) serves it alone. `engine: vllm` is given vLLM's own limits (`max_num_seqs` 128, the same
2 GiB of KV cache): it is measured against the same engine, configured alike, behind shardyard's
serving path. `--app-set` adds a setting to shardyard's apps (a ServeConfig key, dotted: engine.cpus_per_shard=0.5).
`--rounds N` measures the servers in turn N times and reports each row's median, and each round's
ratio to vLLM (taken against vLLM's row of the same model in the same round): this machine's speed
drifts between runs by more than some of the gaps measured.
Run by the python of vLLM's environment (make_vllm_env.sh) with shardyard installed into it: the
`engine: vllm` replica imports vLLM.
Reported: output tokens/s, time to first token and time per output token (p50), inter-token
latency (p99), and shardyard's ratio to vLLM for each.

`shardyard-in-process` measures the built-in engine alone, without Serve, HTTP or a client: the
same model, built as the app builds it (ServeConfig's defaults, the replica's threads), the same
random load at each concurrency, and where its time goes: the model's decode passes, its prefill
passes, and the engine's own work (scheduling, sampling bookkeeping, streaming to callers) as
the rest of the wall time. For it and for each app of the built-in engine, a second table says
where an iteration's time goes, in milliseconds per iteration by the engine's phases (scheduling,
the hand-off to the model's thread and back, the model, attention over the KV cache, sampling,
emitting tokens: serve/engine/decoding.py), read from the app's `/metrics` around each load.
The JSON records the machine (CPU model and its AVX-512 / AMX flags) and each load's cores busy
by process. What separates its row from `shardyard`'s is the serving path.
`shardyard-in-process-plain-linears`: the same with the linear weights unpacked (the BLAS's
product instead of oneDNN's over packed weights, serve/executor/packed_linear.py);
`shardyard-in-process-compiled`: with its decode steps compiled (serve/executor/compiled_decode.py), timed
after one load that compiled them. `-one-thread` after either: on one OpenMP thread instead of the
engine core's two (what a step of each size costs on one core against two).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from common import print_table, write_json
from shardyard.serve.engine.decoding import PHASES
from shardyard.spec import apply_override
from helpers.vllm_bench import VLLM, bench, model_directory

PROMPT_TOKENS, OUTPUT_TOKENS, SHARED_PREFIX_TOKENS, CONTEXT = 128, 64, 1000, 2048
# `vllm serve` on a CPU: its max_num_seqs (the API server's default there; 256 is the LLM class's), and
# the VLLM_CPU_KVCACHE_SPACE this benchmark gives it.
VLLM_MAX_NUM_SEQS, VLLM_KV_GIB = 128, 2
SHARDYARD = Path(sys.executable).parent / "shardyard"  # the command README serves with
SHARED_PREFIX_STREAMS = 16
APP_SETTINGS: dict = {}  # --app-set: more settings for shardyard's app (ServeConfig keys)


def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):  # not up yet, or Serve holds it for a starting replica
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def request_count(concurrency: int, prompts: int) -> int:
    """At least four waves of requests at each concurrency, so that a row is the steady state and
    not how one burst of requests arriving at once gets in; at one stream fewer, for time."""
    return max(prompts, 4 * concurrency) if concurrency > 1 else max(8, prompts // 4)


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far, by pid, with a name that says what it is: Ray's and
    vLLM's process titles (`ray::ProxyActor`, `VLLM::EngineCore`), else the program and its first
    argument (`vllm serve`'s API server shows as `python3 vllm`)."""
    import psutil

    seen = {}
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        command, times = process.info["cmdline"] or [], process.info["cpu_times"]
        if command and times:
            name = command[0] if "::" in command[0] else " ".join(Path(c).name for c in command[:2])
            seen[process.pid] = (name, times.user + times.system)
    return seen


def cpu_spent(before: dict[int, tuple[str, float]], seconds: float) -> dict[str, float]:
    """Cores each kind of process kept busy since `before`, over `seconds` of load (those over 0.01;
    a process that has ended, such as the client, is not counted)."""
    spent: dict[str, float] = {}
    for pid, (name, total) in cpu_seconds().items():
        spent[name] = spent.get(name, 0.0) + total - before.get(pid, (name, 0.0))[1]
    return {name: round(s / seconds, 2) for name, s in sorted(spent.items(), key=lambda kv: -kv[1])
            if s / seconds > 0.01}


def engine_counters(url: str) -> dict[str, float]:
    """The built-in engine's iterations and seconds by phase so far, from the app's /metrics
    (summed over replicas), once Ray's metrics agent has exported the last of them: read until two
    reads a few seconds apart agree."""
    def read() -> dict[str, float]:
        totals: dict[str, float] = {}
        for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("ray_shardyard_engine_iterations_total"):
                totals["iterations"] = totals.get("iterations", 0.0) + float(value)
            elif name.startswith("ray_shardyard_engine_phase_seconds_total") and 'phase="' in name:
                phase = name.split('phase="', 1)[1].split('"', 1)[0]
                totals[phase] = totals.get(phase, 0.0) + float(value)
        return totals

    last, deadline = read(), time.monotonic() + 90
    while time.monotonic() < deadline:
        time.sleep(6)  # longer than the agent's export period
        now = read()
        if now == last:
            return now
        last = now
    return last


def step_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per engine iteration in each phase over a load (the iterations' own count
    too), from two reads of engine_counters."""
    steps = after.get("iterations", 0.0) - before.get("iterations", 0.0)
    if steps <= 0:
        return {}
    ms = {phase: round(1000 * (after[phase] - before.get(phase, 0.0)) / steps, 3) for phase in PHASES if phase in after}
    return {"iterations": int(steps), **ms, "total": round(sum(ms.values()), 3)}


def measure(server: str, url: str, directory: Path, out: Path, concurrencies: list[int], prompts: int,
            prefix_tokens: int = 0) -> list[dict]:
    """Each load's figures, the cores each kind of the server's processes kept busy during it
    (where a server's time goes on a machine of two) and, for shardyard's built-in engine, the
    milliseconds of an iteration by phase."""
    rows = []
    phases = server.startswith("shardyard") and "vllm" not in server
    counted = engine_counters(url) if phases else {}  # each load's end is the next one's start
    for concurrency in concurrencies:
        count = request_count(concurrency, prompts)
        before, started = cpu_seconds(), time.perf_counter()
        result = bench(url, directory, out / server, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                       prompts=count, concurrency=concurrency, prefix_tokens=prefix_tokens)
        cores = cpu_spent(before, time.perf_counter() - started)
        rows.append({"server": server, "load": "shared prefix" if prefix_tokens else "random",
                     "streams": concurrency, "requests": count, "failed": result["failed"],
                     "output_tok_per_s": result["output_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
                     "tpot_p50_ms": result["median_tpot_ms"], "itl_p99_ms": result["p99_itl_ms"],
                     "cores_busy": cores})
        if phases:
            now = engine_counters(url)
            rows[-1]["step_ms"], counted = step_ms(counted, now), now
        print(rows[-1], flush=True)
    return rows


def loads(server: str, url: str, directory: Path, out: Path, concurrencies: list[int], prompts: int,
          random_load: bool = True) -> list[dict]:
    """The random load at each concurrency (unless not `random_load`), then the shared-prefix load
    (unless SHARDYARD_BENCH_NO_SHARED_PREFIX is set: `--no-shared-prefix`)."""
    rows = measure(server, url, directory, out, concurrencies, prompts) if random_load else []
    if os.environ.get("SHARDYARD_BENCH_NO_SHARED_PREFIX"):
        return rows
    return rows + measure(server, url, directory, out, [SHARED_PREFIX_STREAMS], prompts, SHARED_PREFIX_TOKENS)


def shardyard_rows(directory: Path, out: Path, concurrencies: list[int], prompts: int, dtype: str,
                   prefix_caching: bool = True, engine: str = "builtin", shards: int = 1,
                   threads: int | None = None, compiled: bool = False) -> list[dict]:
    """The loads against README's serving path as a user runs it: `shardyard serve DIRECTORY`
    (its own local Ray, Serve behind HAProxy with the header deadline, one replica, the app's
    defaults), stopped with Ctrl-C after. `threads`: the engine core's OpenMP threads
    (`engine.cpu_threads`) instead of the default; `compiled`: its decode steps compiled."""
    from shardyard.localdist import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    limits = vllm_limits(directory, dtype) if engine == "vllm" else {}
    if shards > 1:  # as serve_apps/config.yaml split it before 2026-11-29: pipeline shards of 0.75 CPUs
        limits.update({"engine.num_shards": shards, "engine.cpus_per_shard": 1.5 / shards})
    if threads:
        limits["engine.cpu_threads"] = threads
    if compiled:
        limits["engine.enforce_eager"] = False
    settings = {"limits.max_tokens_limit": 256, "limits.max_prompt_chars": 65536, "limits.max_body_bytes": 262144,
                "engine.prefix_caching": prefix_caching, **limits, **APP_SETTINGS}
    command = [str(SHARDYARD), "serve", str(directory), "--port", str(port), "--dtype", dtype, "--engine", engine,
               *(item for key, value in settings.items() for item in ("--set", f"{key}={value}"))]
    log = (out / f"shardyard_serve_{port}.log").open("w")
    # engine: vllm's KV cache on vLLM's CPU build: the GiB vllm_rows gives vLLM alone.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB)}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_ready(url, process)
        if requests.get(f"{url}/healthz", timeout=30).json()["engine"] != engine:
            raise RuntimeError(f"engine: {engine} asked for, another serves (see {log.name})")
        if engine == "vllm":
            return loads("shardyard, engine: vllm", url, directory, out, concurrencies, prompts)
        if shards > 1:
            return loads(f"shardyard, {shards} pipeline shards", url, directory, out, concurrencies, prompts)
        if threads:
            return loads(f"shardyard, engine core on {threads} thread{'s' if threads > 1 else ''}", url, directory,
                         out, concurrencies, prompts)
        if compiled:
            return loads("shardyard, decode steps compiled", url, directory, out, concurrencies, prompts)
        if prefix_caching:
            return loads("shardyard", url, directory, out, concurrencies, prompts)
        return loads("shardyard, no prefix caching", url, directory, out, concurrencies, prompts,
                     random_load=False)
    finally:
        process.send_signal(signal.SIGINT)  # the user's Ctrl-C: the command stops Serve and its Ray
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def vllm_limits(directory: Path, dtype: str) -> dict:
    """`engine: vllm`'s app settings that give its engine vLLM standalone's limits: as many
    sequences at once, as many KV-cache positions as its GiB hold."""
    from shardyard.planner import kv_bytes_per_token
    from shardyard.spec import HFSpec

    import torch

    per_position = kv_bytes_per_token(HFSpec(path=str(directory)), getattr(torch, dtype))
    return {"batching.max_batch_size": VLLM_MAX_NUM_SEQS, "engine.max_kv_tokens": VLLM_KV_GIB * 2**30 // per_position}


def in_process_rows(directory: Path, out: Path, concurrencies: list[int], prompts: int, dtype: str,
                    packed: bool = True, compiled: bool = False, threads: int | None = None) -> list[dict]:
    """The built-in engine driven directly, in this process, by the random load; `packed`: its
    linear weights packed for oneDNN, as the app serves them on a CPU (else multiplied by the BLAS
    from the plain weights, `SHARDYARD_PACKED_LINEAR=0`); `compiled`: its decode steps compiled
    (`enforce_eager: false`), measured after a load that compiles them; `threads`: its OpenMP threads
    (default: the engine core's, as the app sets them)."""
    import asyncio
    import random
    from unittest.mock import patch

    import torch

    from shardyard.serve.engine.builtin import model_threads
    from shardyard.serve.engine.batching import prefill_budget
    from shardyard.serve.engine.decoding import DecodingEngine
    from shardyard.serve.generation import Completion
    from shardyard.serve.executor.local_model import LocalModel
    from shardyard.serve.executor.packed_linear import ENV
    from shardyard.serve.resolved import load_config
    from shardyard.serve.sampling import Sampling

    cfg = load_config({"checkpoint": str(directory), "batching.max_batch_size": 16}, use_gpu=False)
    team, one_row = (threads, threads) if threads else model_threads(cfg)  # the engine core's
    torch.set_num_threads(team)
    with patch.dict(os.environ, {ENV: "1" if packed else "0"}):  # read as the model loads
        model = LocalModel(cfg.checkpoint, False, cfg.cache_blocks, dtype=getattr(torch, dtype),
                           compile_for=cfg.batching.max_batch_size if compiled else 0, one_row_threads=one_row)
    name = ("shardyard engine, in process" + ("" if packed else ", plain linears") + (", compiled" if compiled else "")
            + (f", {threads} thread{'s' if threads > 1 else ''}" if threads else ""))
    budget = prefill_budget(model.forward, CONTEXT, cfg.batching.max_batch_size, cfg.batching.token_latency_target_ms / 1000)
    spent = {"decode": 0.0, "prefill": 0.0}

    def forward(tokens: torch.Tensor, step, draws):  # the model's passes, timed by kind
        started = time.perf_counter()
        try:
            return model.forward(tokens, step, draws)
        finally:
            spent["decode" if tokens.shape[1] == 1 else "prefill"] += time.perf_counter() - started  # packed: prefill

    async def load(concurrency: int, count: int) -> dict:
        engine = DecodingEngine(forward, cfg.batching.max_batch_size, CONTEXT, cfg.cache_blocks, budget, lambda: None, (),
                                packs=model.cache_attends, executor=model.executor, times=model.times)
        rng, gate, ttft, tpot = random.Random(concurrency), asyncio.Semaphore(concurrency), [], []
        vocabulary = model.model.hf.config.vocab_size

        async def one() -> int:
            async with gate:
                prompt = [rng.randrange(vocabulary) for _ in range(PROMPT_TOKENS)]
                started, times = time.perf_counter(), []
                async for _ in engine.tokens(engine.submit(Completion(prompt, OUTPUT_TOKENS,
                                                                      Sampling(ignore_eos=True)))):
                    times.append(time.perf_counter())
                ttft.append(times[0] - started)
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
                return len(times)

        spent.update(decode=0.0, prefill=0.0)
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(count))))
        wall = time.perf_counter() - started
        return {"server": name, "load": "random", "streams": concurrency,
                "requests": count, "failed": 0, "output_tok_per_s": tokens / wall,
                "ttft_p50_ms": statistics.median(ttft) * 1000, "tpot_p50_ms": statistics.median(tpot) * 1000,
                "itl_p99_ms": None, "decode_passes_s": spent["decode"], "prefill_passes_s": spent["prefill"],
                "engine_s": wall - spent["decode"] - spent["prefill"],
                "step_ms": step_ms({}, {"iterations": engine.stats.iterations, **engine.stats.phases})}

    rows = []
    for concurrency in concurrencies:
        if compiled:  # the compiler's work (every row count, every width the load reaches) before the clock
            asyncio.run(load(concurrency, request_count(concurrency, prompts)))
        rows.append(asyncio.run(load(concurrency, request_count(concurrency, prompts))))
        print(rows[-1], flush=True)
    model.close()
    return rows


def vllm_rows(directory: Path, out: Path, concurrencies: list[int], prompts: int, dtype: str) -> list[dict]:
    from shardyard.localdist import free_port

    port = free_port()
    log = (out / "vllm_serve.log").open("w")
    process = subprocess.Popen([str(VLLM), "serve", str(directory), "--served-model-name", "llama", "--dtype",
                                dtype, "--max-model-len", str(CONTEXT), "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB), "HF_HUB_OFFLINE": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process)
        return loads("vllm", url, directory, out, concurrencies, prompts)
    finally:
        process.terminate()
        process.wait(60)


SERVERS = {"shardyard": shardyard_rows,
           "shardyard-no-prefix-caching": lambda *a: shardyard_rows(*a, prefix_caching=False),
           "shardyard-vllm-engine": lambda *a: shardyard_rows(*a, engine="vllm"),
           "shardyard-two-shards": lambda *a: shardyard_rows(*a, shards=2),
           "shardyard-one-thread": lambda *a: shardyard_rows(*a, threads=1),
           "shardyard-two-threads": lambda *a: shardyard_rows(*a, threads=2),
           "shardyard-compiled": lambda *a: shardyard_rows(*a, compiled=True),
           "shardyard-in-process": in_process_rows,
           "shardyard-in-process-plain-linears": lambda *a: in_process_rows(*a, packed=False),
           "shardyard-in-process-compiled": lambda *a: in_process_rows(*a, compiled=True),
           "shardyard-in-process-one-thread": lambda *a: in_process_rows(*a, threads=1),
           "shardyard-in-process-compiled-one-thread": lambda *a: in_process_rows(*a, compiled=True, threads=1),
           "vllm": vllm_rows}


# The Llamas served: 8 layers of hidden 512, random weights, float32, a 2,048-token context, with
# vocabularies of 4,096 and 32,000 tokens (the head's product grows with it: at 32,000 it is a
# third of a decode step's weights), head_dim 64 or 128; and the 320-token vocabulary earlier
# figures were measured on, which keeps the head to 1% of the weights.
SHAPES = {"v320": dict(hidden=512, layers=8, heads=8, vocab_size=320),
          "v4096": dict(hidden=512, layers=8, heads=8, vocab_size=4096),
          "v32000": dict(hidden=512, layers=8, heads=8, vocab_size=32000),
          "v4096-hd128": dict(hidden=512, layers=8, heads=4, vocab_size=4096)}


RATIOS = {"tok_per_s_vs_vllm": "output_tok_per_s", "ttft_vs_vllm": "ttft_p50_ms", "tpot_vs_vllm": "tpot_p50_ms"}


def with_ratios(rows: list[dict]) -> list[dict]:
    """A round's rows, each of shardyard's with its ratios to vLLM's row of the same load in that
    round (minutes apart on the same machine, so a drift of the machine's speed cancels out)."""
    by = {(r["model"], r["server"], r["load"], r["streams"]): r for r in rows}
    for ours in rows:
        theirs = by.get((ours["model"], "vllm", ours["load"], ours["streams"]))
        if ours["server"] != "vllm" and theirs:
            ours.update({ratio: ours[figure] / theirs[figure] for ratio, figure in RATIOS.items()})
    return rows


def medians(rounds: list[list[dict]]) -> list[dict]:
    """One row per server and load: the median over rounds of each figure, ratio and process's
    cores (failed requests: the sum), with every round's ratio of tokens/s beside it (how far the
    rounds spread)."""
    rows = []
    for same in zip(*rounds):
        row = dict(same[0])
        for key, value in row.items():
            if key == "failed":
                row[key] = sum(r[key] for r in same)
            elif isinstance(value, float):
                row[key] = statistics.median(r[key] for r in same)
        for nested in ("cores_busy", "step_ms"):
            if nested in row:
                names = dict.fromkeys(name for r in same for name in r.get(nested, {}))  # any round's
                row[nested] = {name: statistics.median(r.get(nested, {}).get(name, 0.0) for r in same)
                               for name in names}
        if len(same) > 1 and "tok_per_s_vs_vllm" in row:
            row["tok_per_s_vs_vllm_by_round"] = [round(r["tok_per_s_vs_vllm"], 3) for r in same]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every server this many times, in turn; rows are the medians")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES)[1:],
                        help="the model shapes to serve (every server on each); default: all but v320")
    parser.add_argument("--no-shared-prefix", action="store_true", help="the random load only")
    parser.add_argument("--app-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of shardyard's app (repeatable), e.g. engine.cpus_per_shard=0.5")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="every server's weights and KV cache (vLLM's default on a CPU with AVX-512 BF16: "
                             "bfloat16)")
    parser.add_argument("--name", default="serve_vs_vllm", help="the JSON's name in benchmarks/results/")
    args = parser.parse_args()
    for item in args.app_set:
        apply_override(APP_SETTINGS, item)
    if args.no_shared_prefix:
        os.environ["SHARDYARD_BENCH_NO_SHARED_PREFIX"] = "1"
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        directories = {shape: model_directory(out / shape, context=CONTEXT, **SHAPES[shape]) for shape in args.shapes}
        for number in range(args.rounds):
            print(f"round {number + 1} of {args.rounds}", flush=True)
            rounds.append(with_ratios([{"model": shape, **row} for shape, directory in directories.items()
                                       for server in args.servers
                                       for row in SERVERS[server](directory, out, args.concurrency, args.prompts,
                                                                  args.dtype)]))
    rows = medians(rounds)
    first = args.shapes[0]
    by = {(r["model"], r["server"], r["load"], r["streams"]): r for r in rows}
    on, off = (by.get((first, server, "shared prefix", SHARED_PREFIX_STREAMS))
               for server in ("shardyard", "shardyard, no prefix caching"))
    summary = {"prefix_caching_ttft_cut": off["ttft_p50_ms"] / on["ttft_p50_ms"]} if on and off else {}
    how = f"{PROMPT_TOKENS} tokens in, {OUTPUT_TOKENS} out, vllm bench serve"
    if args.rounds > 1:
        how += f", medians of {args.rounds} rounds"
    print_table(f"shardyard against vLLM ({how})", [{k: v for k, v in r.items() if k not in ("cores_busy", "step_ms")}
                                                    for r in rows])
    steps = [{"model": r["model"], "server": r["server"], "load": r["load"], "streams": r["streams"], **r["step_ms"]}
             for r in rows if r.get("step_ms")]
    if steps:
        print_table("where an engine iteration's time goes (ms per iteration; "
                    "serve/engine/decoding.py names the phases)", steps)
    if "vllm" in args.servers and len(args.servers) > 1:  # a figure is a side-by-side comparison, or nothing
        write_json(args.name, {"dtype": args.dtype, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                               "shared_prefix_tokens": SHARED_PREFIX_TOKENS, "rounds": args.rounds, "rows": rows,
                               **({"rows_by_round": rounds} if args.rounds > 1 else {}), **summary})
    if summary:
        print(f"prefix caching cuts TTFT p50 on the shared-prefix load {summary['prefix_caching_ttft_cut']:.1f}x")


if __name__ == "__main__":
    main()
