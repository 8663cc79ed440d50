"""shardyard's built-in engine against vLLM, on the same model directory and the same load, both
measured by vLLM's own client (`vllm bench serve`: random prompts, 128 tokens in, 64 out, at 1 and
16 concurrent streams).

    python benchmarks/serve_vs_vllm.py [--concurrency 1 16] [--prompts 64]

The model: a Llama directory of about 27M parameters (8 layers, hidden 512, head_dim 64, which
vLLM's CPU attention needs), random weights, float32. shardyard serves it as README's app does
(one replica, continuous batching, 16 requests at once, one shard here: a 2-core machine) on a
local Ray of 2 CPUs, with chunked prefill (the default) and without; then `vllm serve` (its CPU
build, 2 GiB of KV cache) serves it alone. Needs
vLLM's environment (make_vllm_env.sh). Reported: output tokens/s, time to first token and time per
output token (p50), inter-token latency (p99), and shardyard's ratio to vLLM for each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from common import print_table, write_json
from vllm_bench import VLLM, bench, model_directory

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64


def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def measure(server: str, url: str, directory: Path, out: Path, concurrencies: list[int], prompts: int) -> list[dict]:
    rows = []
    for concurrency in concurrencies:
        count = prompts if concurrency > 1 else max(8, prompts // 4)  # one stream: fewer, for time
        result = bench(url, directory, out / server, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                       prompts=count, concurrency=concurrency)
        rows.append({"server": server, "streams": concurrency, "requests": count, "failed": result["failed"],
                     "output_tok_per_s": result["output_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
                     "tpot_p50_ms": result["median_tpot_ms"], "itl_p99_ms": result["p99_itl_ms"]})
        print(rows[-1], flush=True)
    return rows


def shardyard_rows(directory: Path, out: Path, concurrencies: list[int], prompts: int,
                   chunked_prefill: bool = True) -> list[dict]:
    import ray
    from ray import serve

    from shardyard.localdist import free_port
    from shardyard.serve.app import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"checkpoint": str(directory), "max_batch_size": 16, "max_tokens_limit": 256,
                             "max_prompt_chars": 16384, "max_body_bytes": 65536, "chunked_prefill": chunked_prefill}),
                  name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, None)
        name = "shardyard" if chunked_prefill else "shardyard (whole prefills)"
        return measure(name, url, directory, out, concurrencies, prompts)
    finally:
        serve.shutdown()
        ray.shutdown()


def vllm_rows(directory: Path, out: Path, concurrencies: list[int], prompts: int) -> list[dict]:
    from shardyard.localdist import free_port

    port = free_port()
    log = (out / "vllm_serve.log").open("w")
    process = subprocess.Popen([str(VLLM), "serve", str(directory), "--served-model-name", "llama", "--dtype",
                                "float32", "--max-model-len", "1024", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2",
                                                                          "HF_HUB_OFFLINE": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process)
        return measure("vllm", url, directory, out, concurrencies, prompts)
    finally:
        process.terminate()
        process.wait(60)


SERVERS = {"shardyard": shardyard_rows,
           "shardyard-whole-prefills": lambda *a: shardyard_rows(*a, chunked_prefill=False),
           "vllm": vllm_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        directory = model_directory(out / "llama", hidden=512, layers=8, heads=8, context=1024)
        rows = [row for server in args.servers
                for row in SERVERS[server](directory, out, args.concurrency, args.prompts)]
    by = {(r["server"], r["streams"]): r for r in rows}
    for ours in [r for r in rows if r["server"] != "vllm"] if "vllm" in args.servers else []:
        theirs = by[("vllm", ours["streams"])]
        ours["tok_per_s_vs_vllm"] = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
        ours["ttft_vs_vllm"] = ours["ttft_p50_ms"] / theirs["ttft_p50_ms"]
        ours["tpot_vs_vllm"] = ours["tpot_p50_ms"] / theirs["tpot_p50_ms"]
    print_table(f"Built-in engine against vLLM ({PROMPT_TOKENS} tokens in, {OUTPUT_TOKENS} out, "
                "vllm bench serve)", rows)
    if set(args.servers) == set(SERVERS):  # a figure is a side-by-side comparison, or nothing
        write_json("serve_vs_vllm", {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "rows": rows})


if __name__ == "__main__":
    main()
