"""Prepared data at scale: how fast `shardyard prepare` tokenizes, whether the shard reader keeps up
with training, and whether a rank's memory follows the shards it touches or the dataset's size.

1. Preparation: the standard library's .py sources (JSON Lines, one document per file) tokenized
   by a byte-level BPE (trained once, given as tokenizer.path) with 1 and then 2 Ray Data tasks at
   once, after a warm-up job; tokens/s of each run (reading, tokenizing, writing) and the ratio.
2. Reader beside training: samples/s of the shard reader fetching random global batches of the
   default job (32 samples of 65 tokens) beside samples/s of the default model's training steps
   (single process, the default job's shape); the ratio says how far the reader is from being the
   bottleneck.
3. Memory: each of 2 DDP ranks training the default GPT for STEPS steps on a generated dataset of
   4 GB and on one of 40 MB (random tokens, 64 MB shards): its private (anonymous) memory, which
   should not depend on the dataset, beside the shard pages it has mapped (clean page cache the
   kernel can drop; each random sample maps the large page-cache folio around it, so this grows
   with the samples read, up to the shards' size) and the peak resident size, which counts both.

    python benchmarks/data.py [--big-gb 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts the package on sys.path)
import numpy as np
import torch

from common import print_table, write_json
from shardyard.data.prepare import SplitWriter, load_prepare_spec, prepare
from shardyard.data.shards import open_split, read_index, write_index
from shardyard.data.tokenizer import train_bpe
from shardyard.localdist import run_distributed
from shardyard.spec import load_spec

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "gpt_ddp.yaml"
SHARD_TOKENS = 1 << 25  # 64 MB of uint16


def stdlib_jsonl(path: Path) -> int:
    """The standard library's .py files as JSON Lines; returns the number of documents."""
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")
                   if "site-packages" not in p.parts and p.is_file())
    with path.open("w") as f:
        for file in files:
            f.write(json.dumps({"text": file.read_text(errors="replace")}) + "\n")
    return len(files)


def preparation(work: Path) -> list[dict]:
    source = work / "stdlib.jsonl"
    documents = stdlib_jsonl(source)
    texts = (json.loads(line)["text"] for line in source.open())
    _, tokenizer = train_bpe(texts, vocab_size=8192)
    tokenizer.save_pretrained(work / "tokenizer")
    # Warm-up: the first Ray Data job starts Ray's worker processes; neither measured run pays it.
    warm = work / "warm.jsonl"
    warm.write_text("".join(line for _, line in zip(range(50), source.open())))
    prepare(load_prepare_spec(None, [f"source.path={warm}", "source.format=jsonl", f"output.path={work / 'warm'}",
                                     f"tokenizer.path={work / 'tokenizer'}", "workers=2"]))
    rows = []
    for workers in (1, 2):
        spec = load_prepare_spec(None, [f"source.path={source}", "source.format=jsonl",
                                        f"tokenizer.path={work / 'tokenizer'}", f"output.path={work / f'out{workers}'}",
                                        f"workers={workers}"])
        start = time.perf_counter()
        summary = prepare(spec)
        elapsed = time.perf_counter() - start
        rows.append({"ray data tasks": workers, "documents": documents, "tokens": summary["tokens"],
                     "seconds": elapsed, "tokens_per_s": summary["tokens"] / elapsed})
    rows[1]["vs 1 task"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def generated(path: Path, tokens: int, vocab: int = 256) -> Path:
    """`tokens` random ids in 64 MB shards, with an index, as `prepare` lays them out."""
    path.mkdir(parents=True, exist_ok=True)
    writer = SplitWriter(path, "train", np.dtype("<u2"), SHARD_TOKENS)
    rng = np.random.default_rng(0)
    for start in range(0, tokens, SHARD_TOKENS):
        writer.add(rng.integers(0, vocab, min(SHARD_TOKENS, tokens - start), dtype=np.uint32))
    write_index(path, np.dtype("<u2"), vocab, {"train": writer.close()})
    return path


def reader_vs_training(data: Path, steps: int) -> list[dict]:
    spec = load_spec(DEFAULT_JOB)
    windows = open_split(str(data), "train", spec.model.block_size)
    batch = spec.batch.global_batch_size
    rng = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(steps * 10):
        windows.batch(torch.randint(len(windows), (batch,), generator=rng))
    reader = steps * 10 * batch / (time.perf_counter() - start)
    training = run_distributed(train_and_measure, 1, str(data), steps, str(data.parent / "runs-reader"))[0]
    return [{"what": "shard reader (random global batches)", "samples_per_s": reader},
            {"what": "training, default GPT, 1 process", "samples_per_s": training["samples_per_s"]},
            {"what": "reader / training", "samples_per_s": reader / training["samples_per_s"]}]


def train_and_measure(rank: int, world: int, data: str, steps: int, storage: str) -> dict:
    """The default job on the shards for `steps` steps; this rank's samples/s and peak memory."""
    from shardyard.train.trainer import Trainer

    spec = load_spec(DEFAULT_JOB, [
        "data.name=shards", f"data.path={data}", f"scaling.num_workers={world}", f"run.steps={steps}",
        f"run.log_every={steps}", f"checkpoint.every_n_steps={steps}", f"checkpoint.storage_path={storage}",
        "batch.micro_batch_size=16" if world == 2 else "batch.micro_batch_size=32"])
    torch.set_num_threads(2 // world)
    start = time.perf_counter()
    Trainer.build(spec, rank, world, torch.device("cpu")).train()
    samples_per_s = steps * spec.batch.global_batch_size / (time.perf_counter() - start)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {"samples_per_s": samples_per_s, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "anon_mb": int(status["RssAnon"].split()[0]) / 1024, "file_mb": int(status["RssFile"].split()[0]) / 1024}


def memory(work: Path, big_gb: float, steps: int) -> list[dict]:
    rows = []
    for label, gigabytes in (("40 MB", 0.04), (f"{big_gb:g} GB", big_gb)):
        data = generated(work / label.replace(" ", ""), int(gigabytes * 1e9 / 2))
        ranks = run_distributed(train_and_measure, 2, str(data), steps, str(work / f"runs-{label.replace(' ', '')}"))
        rows.append({"dataset": label, "tokens": read_index(str(data))["splits"]["train"]["tokens"],
                     "private MB (rank 0, 1)": f"{ranks[0]['anon_mb']:.0f}, {ranks[1]['anon_mb']:.0f}",
                     "mapped file MB": f"{ranks[0]['file_mb']:.0f}, {ranks[1]['file_mb']:.0f}",
                     "peak RSS MB": f"{ranks[0]['peak_rss_mb']:.0f}, {ranks[1]['peak_rss_mb']:.0f}",
                     "ranks": ranks})
        shutil.rmtree(data)
    rows[1]["private vs 40 MB"] = rows[1]["ranks"][0]["anon_mb"] / rows[0]["ranks"][0]["anon_mb"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-gb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardyard-data-bench-") as tmp:
        work = Path(tmp)
        prep = preparation(work)
        print_table("shardyard prepare: stdlib sources, BPE 8192", prep)
        reader = reader_vs_training(generated(work / "reader", 50_000_000), args.steps)
        print_table("shard reader beside training (default job)", reader)
        mem = memory(work, args.big_gb, args.steps)
        print_table(f"memory per rank, DDP x 2, {args.steps} steps", [{k: v for k, v in r.items() if k != "ranks"}
                                                                         for r in mem])
    write_json("data", {"preparation": prep, "reader_vs_training": reader, "memory": mem,
                        "steps": args.steps, "shard_tokens": SHARD_TOKENS})


if __name__ == "__main__":
    main()
