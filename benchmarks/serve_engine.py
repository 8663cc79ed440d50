"""The decoding engine (KV cache, continuous batching) beside static batching and no batching, in
one run, over HTTP with streaming clients, as LLM servers are measured.

For each app (`none`: one request at a time; `adaptive`: static batches, the previous default;
`continuous`: the engine), C clients each stream a completion of MAX_TOKENS tokens, wait for the
end, and send the next, for a fixed time. Reported per point: tokens/s over all streams, and over
requests the p50/p95/p99 of time to first token (TTFT) and of inter-token latency (a request's
time from first to last token over its tokens after the first; a streamed piece can hold
several bytes of one character, so per-chunk gaps would not be per token).

Then, outside HTTP, one decode step of a GPT with a 1024-token context at positions 16, 256 and
1024: with the engine's KV cache, and recomputing the sequence as static batching does.

The peer (generate_peer.py): transformers' own `generate` with static batches, behind the same
Serve proxy, route and streaming chunks, against the engine serving the same model: a GPT-2 of the
default GPT's size (4 layers x 128, 4 heads, 64-token context, byte vocabulary) saved by
transformers, untrained (the tokens do not matter here; every request runs to MAX_TOKENS).

Targets: the engine at >= 5x no batching's tokens/s at 32 streams, its p95 inter-token
latency no worse than no batching's at 1 stream plus one decode step of the batch; ahead of the
`generate` peer's tokens/s; a cached decode step at 1024 within 2x of the one at 16.

    python benchmarks/serve_engine.py [--duration 5] [--streams 1 8 32 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
from ray import serve

from common import print_table, write_json
from generate_peer import peer_app
from serve_load import local_serve, percentile

MAX_TOKENS = 32
# The apps on the default GPT, then the engine and the peer on the same Hugging Face GPT-2.
APPS: dict[str, dict[str, Any]] = {
    "none": {"batching": "none"},
    "adaptive": {"batching": "adaptive"},
    "continuous": {"batching": "continuous"},
    "continuous-hf": {"batching": "continuous"},
    "generate-peer": {},
}
BASE = {"engine.num_shards": 1, "batching.max_batch_size": 64, "limits.max_queued_requests": 256,
        "limits.request_timeout_s": 120.0}
PEER_MODEL = {"n_embd": 128, "n_layer": 4, "n_head": 4, "vocab_size": 256, "n_positions": 64,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}


async def one_stream(session: aiohttp.ClientSession, url: str, rng: random.Random) -> dict[str, float] | None:
    body = {"prompt": "def " + "x" * rng.randrange(1, 24), "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, last, tokens = time.perf_counter(), None, None, 0
    async with session.post(url, json=body) as answer:
        if answer.status != 200:
            return None
        async for raw in answer.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    if first is None or tokens < 2:
        return None
    return {"ttft": first - start, "itl": (last - first) / (tokens - 1), "tokens": tokens}


async def streams(url: str, concurrency: int, duration: float) -> tuple[list[dict[str, float]], float]:
    done: list[dict[str, float]] = []
    end = time.perf_counter() + duration
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < end:
                if (result := await one_stream(session, url, rng)) is not None:
                    done.append(result)

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done, time.perf_counter() - started


def point(app: str, concurrency: int, results: list[dict[str, float]], elapsed: float) -> dict[str, Any]:
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(r["itl"] for r in results)
    row: dict[str, Any] = {"app": app, "streams": concurrency, "requests": len(results),
                           "tokens_per_s": sum(r["tokens"] for r in results) / elapsed}
    for q in (50, 95, 99):
        row[f"ttft_p{q}_ms"] = percentile(ttft, q)
    for q in (50, 95, 99):
        row[f"itl_p{q}_ms"] = percentile(itl, q)
    return row


def save_peer_model(out: Path) -> str:
    """The GPT-2 both the engine and the peer serve, as transformers saves it."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(**PEER_MODEL)).save_pretrained(out)
    return str(out)


def application(app: str, checkpoint_dir: str, hf_dir: str) -> serve.Application:
    from shardyard.serve.app.deployment import build_app

    if app == "generate-peer":
        return peer_app(hf_dir, BASE["batching.max_batch_size"])
    model = hf_dir if app.endswith("-hf") else checkpoint_dir
    return build_app({"checkpoint": model, **BASE, **APPS[app]})


async def greedy_text(url: str, prompt: str) -> str:
    """One streamed greedy completion's text: the engine and the peer serving the same model must
    agree on it, or they are not decoding the same thing."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    pieces = []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
        async for raw in answer.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                pieces += [c["text"] for c in chunk["choices"]]
    return "".join(pieces)


def sweep(app: str, application: serve.Application, port: int, duration: float, concurrencies: list[int],
          texts: dict[str, str]) -> list[dict]:
    serve.run(application, name=app, route_prefix=f"/{app}")
    url = f"http://127.0.0.1:{port}/{app}/v1/completions"
    texts[app] = asyncio.run(greedy_text(url, "def main():"))
    asyncio.run(streams(url, 2, 1.0))  # warm-up
    rows = []
    for concurrency in concurrencies:
        rows.append(point(app, concurrency, *asyncio.run(streams(url, concurrency, duration))))
        print_table(app, rows[-1:])
    serve.delete(app)
    return rows


def decode_steps(batch: int, repeats: int = 20) -> list[dict[str, Any]]:
    """One decode step at each context length: cached (the engine) and recomputed (static)."""
    from shardyard.models.gpt import GPT
    from shardyard.models.kv_cache import KVCache
    from shardyard.models.kv_layout import BLOCK_TOKENS, CacheStep
    from shardyard.serve.executor.model_pass import run_model
    from shardyard.spec import GPTSpec

    torch.manual_seed(0)
    model = GPT(GPTSpec(name="gpt", n_layer=4, n_head=4, n_embd=128, block_size=1024)).eval()
    rows = []
    with torch.no_grad():
        for context in (16, 256, 1024):
            per_row = 1024 // BLOCK_TOKENS
            cache = KVCache(batch * per_row)
            tables = [tuple(range(row * per_row, (row + 1) * per_row)) for row in range(batch)]
            for table in tables:
                run_model(model, torch.randint(0, 256, (1, context - 1)), CacheStep((table,), (0,)), cache)
            cached = []
            for _ in range(repeats):  # every step at the same position
                start = time.perf_counter()
                run_model(model, torch.randint(0, 256, (batch, 1)), CacheStep(tuple(tables), (context - 1,) * batch),
                          cache)
                cached.append(time.perf_counter() - start)
            tokens = torch.randint(0, 256, (batch, context))
            recomputed = []
            for _ in range(max(3, repeats // 4)):
                start = time.perf_counter()
                model(tokens)
                recomputed.append(time.perf_counter() - start)
            rows.append({"batch": batch, "context": context, "cached_step_ms": 1000 * statistics.median(cached),
                         "recomputed_step_ms": 1000 * statistics.median(recomputed)})
    for row in rows:
        row["cached_vs_context_16"] = row["cached_step_ms"] / rows[0]["cached_step_ms"]
        # What attention's linear term must read per step: every row's cached keys and values.
        row["kv_read_mb"] = batch * row["context"] * 2 * 4 * 128 * 4 / 1e6
    return rows


def targets(rows: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def at(app: str, n: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["app"] == app and r["streams"] == n), None)

    out = []
    engine, none32, none1 = at("continuous", 32), at("none", 32), at("none", 1)
    if engine and none32:
        out.append({"target": "engine tokens/s at 32 streams >= 5x no batching",
                    "measured": f"{engine['tokens_per_s'] / none32['tokens_per_s']:.2f}x"})
    static = at("adaptive", 32)
    if engine and static:
        out.append({"target": "engine vs static (adaptive) batching, tokens/s at 32 streams",
                    "measured": f"{engine['tokens_per_s'] / static['tokens_per_s']:.2f}x"})
    for n in (1, 8, 32, 64):
        hf, peer = at("continuous-hf", n), at("generate-peer", n)
        if hf and peer and peer["tokens_per_s"]:
            out.append({"target": f"engine vs the generate peer (same GPT-2), tokens/s at {n} streams",
                        "measured": f"{hf['tokens_per_s'] / peer['tokens_per_s']:.2f}x"})
    if engine and none1:
        step = next((s["cached_step_ms"] for s in steps if s["context"] == 16 and s["batch"] == 32), 0.0)
        bound = none1["itl_p95_ms"] + step
        out.append({"target": "engine p95 ITL at 32 streams <= none's at 1 stream + a batch-32 step",
                    "measured": f"{engine['itl_p95_ms']:.1f} ms vs {bound:.1f} ms "
                                f"({none1['itl_p95_ms']:.1f} + {step:.1f})"})
    for late in (s for s in steps if s["context"] == 1024):
        out.append({"target": f"cached decode step at 1024 within 2x of at 16, batch {late['batch']}",
                    "measured": f"{late['cached_vs_context_16']:.2f}x"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per load point")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--apps", nargs="+", default=list(APPS), choices=list(APPS))
    args = parser.parse_args()

    with local_serve() as (port, checkpoint_dir), tempfile.TemporaryDirectory() as tmp:
        hf_dir = save_peer_model(Path(tmp, "gpt2"))
        texts: dict[str, str] = {}
        rows = [row for app in args.apps
                for row in sweep(app, application(app, checkpoint_dir, hf_dir), port, args.duration, args.streams,
                                 texts)]
    if {"continuous-hf", "generate-peer"} <= texts.keys():
        print(f"the engine and the peer decode the same greedy text: {texts['continuous-hf'] == texts['generate-peer']}")
    steps = [row for batch in (1, 8, 32) for row in decode_steps(batch)]

    print_table(f"streaming load ({MAX_TOKENS} tokens per completion; latencies in ms)", rows)
    print_table("one decode step (GPT 4 x 128, 1024-token context)", steps)
    summary = targets(rows, steps)
    print_table("targets", summary)
    write_json("serve_engine", {"max_tokens": MAX_TOKENS, "duration_s": args.duration, "base_config": BASE,
                                "apps": {a: APPS[a] for a in args.apps}, "peer_model": PEER_MODEL,
                                "greedy_texts": texts, "rows": rows, "decode_steps": steps,
                                "targets": summary})


if __name__ == "__main__":
    main()
