"""Prepared data: `shardyard prepare` (a Ray Data job) on each source kind, the shard format and
its reader against the tokens read directly, a trained BPE tokenizer, object storage through a
bounded cache, bad input refused with the file named, and training on shards resumed at another
world size with every sample used exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardyard.data.corpus import corpus_windows
from shardyard.data.prepare import PrepareError, SplitWriter, load_prepare_spec, prepare
from shardyard.data.shards import ShardIndexError, open_split, read_index, write_index
from shardyard.data.tokenizer import encode_documents, train_bpe

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # é{'z' * (i % 7)}\n" * (1 + i % 5) for i in range(60)]


def write_sources(root: Path) -> dict[str, Path]:
    """The same documents as a folder of text files, a JSON Lines file, a Parquet file and a
    Hugging Face dataset saved to disk."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "text").mkdir()
    for i, text in enumerate(TEXTS):
        (root / "text" / f"doc{i:03d}.txt").write_text(text)
    with (root / "docs.jsonl").open("w") as f:
        for text in TEXTS:
            f.write(json.dumps({"body": text, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": TEXTS}), root / "docs.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(root / "dataset")
    return {"text": root / "text", "jsonl": root / "docs.jsonl", "parquet": root / "docs.parquet",
            "hf": root / "dataset"}


def stream(path: Path, split: str = "train") -> np.ndarray:
    """A split's tokens read straight from its shard files, in order."""
    index = read_index(str(path))
    return np.concatenate([np.fromfile(path / s["name"], dtype=index["dtype"])
                           for s in index["splits"][split]["shards"]])


# ----------------------------------------------------------------------------- without Ray


@pytest.mark.timeout(60)
def test_windows_over_shards_equal_the_tokens_read_directly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 50_000, rng.integers(1, 700)).astype(np.uint32) for _ in range(80)]
    writer = SplitWriter(tmp_path, "train", np.dtype("<u2"), shard_tokens=1000)  # documents cross shards
    for doc in documents:
        writer.add(doc)
    split = writer.close()
    write_index(tmp_path, np.dtype("<u2"), 50_000, {"train": split})
    whole = np.concatenate(documents)
    assert split["tokens"] == len(whole) and len(split["shards"]) == -(-len(whole) // 1000)
    assert all(s["tokens"] == 1000 for s in split["shards"][:-1])
    starts = np.concatenate([np.load(tmp_path / s["name"].replace(".bin", ".docs.npy")) + 1000 * k
                             for k, s in enumerate(split["shards"])])
    assert starts.tolist() == np.cumsum([0] + [len(d) for d in documents[:-1]]).tolist()
    windows = open_split(str(tmp_path), "train", block_size=37)
    assert len(windows) == (len(whole) - 1) // 37
    ids = torch.tensor([0, len(windows) - 1, 26, 27, 5, 100])
    x, y = windows.batch(ids)
    for row, i in enumerate(ids.tolist()):
        expected = torch.from_numpy(whole[i * 37: i * 37 + 38].astype(np.int64))
        assert torch.equal(x[row], expected[:-1]) and torch.equal(y[row], expected[1:])


@pytest.mark.timeout(60)
def test_the_corpus_reads_its_bytes_through_the_same_windows(tmp_path: Path) -> None:
    text = "".join(TEXTS).encode()
    (tmp_path / "a.txt").write_bytes(text)
    windows = corpus_windows(str(tmp_path / "a.txt"), block_size=16, max_bytes=len(text))
    x, y = windows.batch(torch.tensor([3]))
    assert bytes(x[0].tolist()) == text[48:64] and bytes(y[0].tolist()) == text[49:65]


@pytest.mark.timeout(120)
def test_a_trained_bpe_round_trips_text_and_compresses_it() -> None:
    info, tokenizer = train_bpe(iter(TEXTS), vocab_size=300)
    assert info.vocab_size <= 300 and info.eos_id is not None
    ids = encode_documents(info, TEXTS[:5])
    for text, doc in zip(TEXTS[:5], ids):
        assert doc[-1] == info.eos_id  # each document ends with the end-of-text id
        assert tokenizer.decode(doc[:-1].tolist()) == text
        assert len(doc) < len(text.encode())  # merges learned: fewer ids than bytes


@pytest.mark.timeout(60)
def test_shards_in_object_storage_are_read_through_a_bounded_cache(tmp_path: Path) -> None:
    import fsspec

    from shardyard.data.prepare import _publish

    writer = SplitWriter(tmp_path, "train", np.dtype("<u2"), shard_tokens=1024)
    whole = np.arange(10_000) % 4000
    writer.add(whole.astype(np.uint32))
    write_index(tmp_path, np.dtype("<u2"), 4000, {"train": writer.close()})
    _publish(tmp_path, "memory://bucket/prepared")
    cache = tmp_path / "cache"
    windows = open_split("memory://bucket/prepared", "train", 63, cache_dir=str(cache), cache_bytes=3 * 2048)
    x, _ = windows.batch(torch.arange(len(windows)))  # every shard, in order
    assert torch.equal(x.flatten(), torch.from_numpy(whole[: len(windows) * 63].astype(np.int64)))
    held = [p for p in cache.rglob("*.bin")]
    assert 0 < len(held) <= 3, held  # the cap: least recently used shards went
    fsspec.filesystem("memory").rm("/bucket", recursive=True)


@pytest.mark.timeout(60)
def test_an_index_that_does_not_match_its_shards_is_named(tmp_path: Path) -> None:
    writer = SplitWriter(tmp_path, "train", np.dtype("<u2"), shard_tokens=1024)
    writer.add(np.arange(3000, dtype=np.uint32))
    write_index(tmp_path, np.dtype("<u2"), 4000, {"train": writer.close()})
    (tmp_path / "train-00001.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ShardIndexError, match=r"train-00001\.bin has 100 bytes; the index says 1024"):
        open_split(str(tmp_path), "train", 16)
    with pytest.raises(ShardIndexError, match="does not exist"):
        open_split(str(tmp_path / "nowhere"), "train", 16)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt, field, message", [
    ("jsonl", "text", r"docs\.jsonl: the first record has no field 'text'"),
    ("parquet", "text", r"docs\.parquet: no column 'text'"),
    ("text", "text", r"matches no text files"),
    ("parquet-damaged", "text", r"docs\.parquet cannot be read as parquet"),
    ("hf", "text", r"dataset: no column 'text' \(it has \['body'\]\)"),
])
def test_bad_sources_are_refused_naming_the_file_before_ray(tmp_path: Path, fmt: str, field: str,
                                                            message: str) -> None:
    sources = write_sources(tmp_path)
    path = sources[fmt] if fmt in ("jsonl", "parquet", "hf") else tmp_path / "empty"
    (tmp_path / "empty").mkdir()
    if fmt == "parquet-damaged":
        fmt, path = "parquet", sources["parquet"]
        path.write_bytes(b"not parquet at all")
    spec = load_prepare_spec(None, [f"source.path={path}", f"source.format={fmt}", f"source.field={field}",
                                    f"output.path={tmp_path / 'out'}"])
    with pytest.raises(PrepareError, match=message):
        prepare(spec)


def train_with_ledger(rank: int, world: int, raw: dict, attempt: float, until: int | None = None) -> None:
    """The Trainer as a Ray Train worker group runs it with `run.sample_ledger` (attempt: which
    worker group this is)."""
    from shardyard.spec import parse_spec
    from shardyard.train.callbacks import LedgerCallback
    from shardyard.train.trainer import Trainer

    spec = parse_spec(raw)
    callbacks = [LedgerCallback(spec.run_uri, f"rank{rank}", attempt)]
    Trainer.build(spec, rank, world, torch.device("cpu"), callbacks=callbacks).train(until)


@pytest.mark.timeout(240)
def test_training_on_shards_resumes_at_another_world_size_using_each_sample_once(tmp_path: Path) -> None:
    """DDP on 2 ranks for 2 steps, resumed on 3 for 4 more, over shards that samples cross: every
    sample of the completed epoch exactly once (the ledger's audit; it failed before the audit
    placed a step's ids in global order), and the parameters of one process trained on the same
    shards (plain SGD)."""
    from shardyard.data.ledger import audit
    from shardyard.localdist import run_distributed
    from shardyard.checkpoint.loaders import find_latest, load_model
    from helpers.oracle import PARAM_TOL, SGD, job, train

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    writer = SplitWriter(data, "train", np.dtype("<u2"), shard_tokens=1024)
    for _ in range(12):
        writer.add(rng.integers(0, 256, rng.integers(50, 300)).astype(np.uint32))
    write_index(data, np.dtype("<u2"), 256, {"train": writer.close()})
    num_samples = len(open_split(str(data), "train", 16))
    raw = job({"strategy": "ddp"}, 2, 2, SGD)
    raw |= {"data": {"name": "shards", "path": str(data)}, "batch": {"global_batch_size": 24, "micro_batch_size": 2},
            "scaling": {"min_workers": 2, "max_workers": 3},
            "checkpoint": {"every_n_steps": 2, "storage_path": str(tmp_path / "runs")},
            "run": {**raw["run"], "steps": 6, "name": "run", "sample_ledger": True}}
    assert 24 * 6 > num_samples > 24 * 2  # the run crosses into a second epoch after the resize
    run_distributed(train_with_ledger, 2, raw, 1.0, 2)  # attempt 1, stopped after its checkpoint of step 2
    run_distributed(train_with_ledger, 3, raw, 2.0)

    report = audit(tmp_path / "runs" / "run", num_samples)
    assert report.world_sizes == [2, 2, 3, 3, 3, 3] and report.complete_epochs == 1 and report.exact, report
    single = raw | {"batch": {"global_batch_size": 24, "micro_batch_size": 24}, "scaling": {"num_workers": 1},
                    "checkpoint": {**raw["checkpoint"], "storage_path": str(tmp_path / "single")}}
    run_distributed(train, 1, single)
    expected = load_model(find_latest(tmp_path / "single" / "run")).state_dict()
    got = load_model(find_latest(tmp_path / "runs" / "run")).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_TOL, msg=name)


@pytest.mark.timeout(60)
def test_shards_whose_tokenizer_outgrows_the_model_are_refused_before_training(tmp_path: Path) -> None:
    from shardyard.spec import SpecError, load_spec
    from shardyard.train.preflight import preflight

    writer = SplitWriter(tmp_path, "train", np.dtype("<u2"), shard_tokens=1024)
    writer.add(np.arange(3000, dtype=np.uint32) % 320)
    write_index(tmp_path, np.dtype("<u2"), 320, {"train": writer.close()})
    spec = load_spec(None, ["data.name=shards", f"data.path={tmp_path}", f"checkpoint.storage_path={tmp_path}/runs"])
    with pytest.raises(SpecError, match=r"tokenized with 320 ids, more than model.vocab_size \(256\)"):
        preflight(spec)
    with pytest.raises(SpecError, match="no 'validation' split"):
        preflight(load_spec(None, ["data.name=shards", f"data.path={tmp_path}", "model.vocab_size=320",
                                   "eval.every_n_steps=5", f"checkpoint.storage_path={tmp_path}/runs"]))


@pytest.mark.timeout(60)
def test_a_runs_tokenizer_is_adopted_whole_and_judged_by_every_file(tmp_path: Path) -> None:
    """The run keeps its data's tokenizer: written whole (never a folder half full for serving to
    read), judged by every file's digest (not by tokenizer.json alone), a launch cut off part way
    completed by the next; an index that sends the read to another folder is refused."""
    from shardyard.spec import SpecError, load_spec
    from shardyard.train.preflight import ADOPTED, adopt_tokenizer

    def prepared(name: str, config: str, folder: str = "tokenizer") -> Path:
        data = tmp_path / name
        (data / "tokenizer").mkdir(parents=True)
        writer = SplitWriter(data, "train", np.dtype("<u2"), shard_tokens=1024)
        writer.add(np.arange(3000, dtype=np.uint32) % 256)
        write_index(data, np.dtype("<u2"), 256, {"train": writer.close()}, tokenizer={"kind": "hf", "dir": folder})
        (data / "tokenizer" / "tokenizer.json").write_text('{"model": "bpe"}')
        (data / "tokenizer" / "tokenizer_config.json").write_text(config)
        return data

    def spec_of(data: Path, run: str):
        return load_spec(None, ["data.name=shards", f"data.path={data}", f"run.name={run}",
                                f"checkpoint.storage_path={tmp_path}/runs"])

    data, other = prepared("data", '{"eos": "<e>"}'), prepared("other", '{"eos": "</s>"}')
    adopt_tokenizer(spec_of(data, "first"))
    kept = tmp_path / "runs" / "first"
    assert sorted(p.name for p in kept.iterdir()) == ["tokenizer"]  # nothing left aside
    assert sorted(p.name for p in (kept / "tokenizer").iterdir()) == [ADOPTED, "tokenizer.json", "tokenizer_config.json"]
    adopt_tokenizer(spec_of(data, "first"))  # the same data again: nothing to do
    with pytest.raises(SpecError, match="was tokenized with another"):  # the same tokenizer.json, not the same tokenizer
        adopt_tokenizer(spec_of(other, "first"))

    cut = tmp_path / "runs" / "cut" / "tokenizer"  # a launch stopped after its first file
    cut.mkdir(parents=True)
    (cut / "tokenizer.json").write_text('{"model": "bpe"}')
    adopt_tokenizer(spec_of(data, "cut"))
    assert (cut / "tokenizer_config.json").read_text() == '{"eos": "<e>"}' and (cut / ADOPTED).is_file()

    with pytest.raises(SpecError, match="names the tokenizer's folder '../data/tokenizer'"):
        adopt_tokenizer(spec_of(prepared("elsewhere", "{}", folder="../data/tokenizer"), "third"))


# ----------------------------------------------------------------------------- with Ray Data


@pytest.mark.timeout(300)
def test_prepare_reads_each_source_kind_into_the_same_tokens(ray_cluster, tmp_path: Path) -> None:
    """Text files, JSON Lines and Parquet holding the same documents prepare to the same token
    stream, with 2 Ray Data workers; a rerun is a no-op; a changed file is seen."""
    sources = write_sources(tmp_path)
    streams = {}

    def spec_of(fmt: str):
        return load_prepare_spec(None, [f"source.path={sources[fmt]}", f"source.format={fmt}", "source.field=body",
                                        f"output.path={tmp_path / f'out-{fmt}'}", "output.shard_tokens=1024",
                                        "workers=2"])

    for fmt in sources:
        out = tmp_path / f"out-{fmt}"
        summary = prepare(spec_of(fmt))
        assert summary["documents"] == len(TEXTS) and summary["shards"] > 1
        streams[fmt] = stream(out)
    expected = np.concatenate([np.frombuffer(t.encode(), dtype=np.uint8) for t in TEXTS])
    for fmt, tokens in streams.items():
        assert np.array_equal(tokens, expected), fmt
    spec = spec_of("text")
    assert prepare(spec) == {"output": str(tmp_path / "out-text"), "up to date": True}
    (sources["text"] / "doc000.txt").write_text("changed\n")
    assert prepare(spec)["documents"] == len(TEXTS)
    assert stream(tmp_path / "out-text")[:8].tolist() == list(b"changed\n")

    # A model's own tokenizer, from its directory.
    info, tokenizer = train_bpe(iter(TEXTS), vocab_size=300)
    tokenizer.save_pretrained(tmp_path / "model_tokenizer")
    out = tmp_path / "out-model-tokenizer"
    prepare(load_prepare_spec(None, [f"source.path={sources['parquet']}", "source.format=parquet",
                                     "source.field=body", f"tokenizer.path={tmp_path / 'model_tokenizer'}",
                                     f"output.path={out}", "workers=2"]))
    assert np.array_equal(stream(out), np.concatenate(encode_documents(info, TEXTS)))


@pytest.mark.timeout(420)
def test_prepared_text_trains_validates_and_serves_with_its_tokenizer(ray_cluster, tmp_path: Path) -> None:
    """The whole path, as a user runs it: `shardyard prepare` (a BPE trained on the data, a
    validation split, 2 Ray Data workers) on the cluster; training on the shards with validation
    on Ray Train workers; the run keeps the tokenizer, and the served model speaks its ids."""
    import os
    import subprocess
    import sys

    import requests
    from ray import serve
    from transformers import AutoTokenizer

    from shardyard.localdist import free_port
    from shardyard.serve.app.deployment import build_app
    from shardyard.spec import load_spec
    from shardyard.checkpoint.loaders import find_latest, load_model
    from shardyard.train.launcher import launch
    from shardyard.train.metrics import read_metrics

    sources = write_sources(tmp_path)
    out = tmp_path / "prepared"
    (tmp_path / "data.yaml").write_text(
        f"source: {{path: {sources['jsonl']}, format: jsonl, field: body}}\n"
        f"tokenizer: {{train: {{vocab_size: 320}}}}\n"
        f"output: {{path: {out}, validation_fraction: 0.3}}\n")
    prepared = subprocess.run(
        [str(Path(sys.executable).with_name("shardyard")), "prepare", str(tmp_path / "data.yaml"), "--set", "workers=2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address})
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "shardyard prepare" in prepared.stdout and "tokens/s" in prepared.stdout
    index = read_index(str(out))
    assert index["dtype"] == "<u2" and index["vocab_size"] <= 320
    assert 0 < index["splits"]["validation"]["documents"] < len(TEXTS) / 2
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")  # saved beside the shards
    train_tokens = stream(out)
    documents = np.split(train_tokens, np.flatnonzero(train_tokens == index["eos_id"]) + 1)[:-1]
    decoded = {tokenizer.decode(d[:-1].tolist()) for d in documents}
    assert len(decoded) == index["splits"]["train"]["documents"] and decoded <= set(TEXTS)

    spec = load_spec(None, [
        "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "model.vocab_size=320",
        "data.name=shards", f"data.path={out}", "eval.every_n_steps=3", "eval.batches=1",
        "batch.global_batch_size=8", "batch.micro_batch_size=4", "run.steps=6", "run.log_every=3",
        f"checkpoint.storage_path={tmp_path / 'runs'}", "run.name=bpe"])
    result = launch(spec)
    rows = read_metrics(result.run_dir)
    assert [r["step"] for r in rows] == [3, 6] and all("val_loss" in r for r in rows)
    assert result.summary["val_loss"] == rows[-1]["val_loss"]
    kept = result.run_dir / "tokenizer" / "tokenizer.json"
    assert kept.read_bytes() == (out / "tokenizer" / "tokenizer.json").read_bytes()

    final = find_latest(result.run_dir)
    model = load_model(final).eval()
    prompt = TEXTS[3][:20]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"checkpoint": str(final), "engine": {"num_shards": 1, "cpus_per_shard": 0.5}}),
                  name="bpe_app", route_prefix="/bpe")
        answer = requests.post(f"http://127.0.0.1:{port}/bpe/v1/completions", timeout=60,
                               json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))  # the run's ids, not bytes
        generated = ids[len(tokenizer.encode(prompt)):]
        if index["eos_id"] in generated:  # the tokenizer's end-of-text stops a completion
            generated = generated[:generated.index(index["eos_id"])]
        assert body["choices"][0]["text"] == tokenizer.decode(generated)
    finally:
        serve.shutdown()

def prepared_with_validation(root: Path) -> Path:
    """Shards of random bytes with a validation split, as `prepare` lays them out."""
    rng = np.random.default_rng(2)
    splits = {}
    for split, documents in (("train", 12), ("validation", 6)):
        writer = SplitWriter(root, split, np.dtype("<u2"), shard_tokens=1024)
        for _ in range(documents):
            writer.add(rng.integers(0, 256, rng.integers(100, 300)).astype(np.uint32))
        splits[split] = writer.close()
    write_index(root, np.dtype("<u2"), 256, splits)
    return root


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallelism", [
    pytest.param({"strategy": "ddp"}, id="ddp"), pytest.param({"strategy": "pipeline", "pp": 2}, id="pipeline"),
    pytest.param({"strategy": "zero3"}, id="zero3", marks=pytest.mark.slow)])  # DeepSpeed's launch: 30 s
def test_validation_loss_equals_one_process_evaluating_the_checkpoint(tmp_path: Path, parallelism: dict) -> None:
    from shardyard.localdist import run_distributed
    from shardyard.checkpoint.loaders import find_latest, load_model
    from shardyard.train.metrics import read_metrics
    from helpers.oracle import job, train

    (tmp_path / "data").mkdir()
    data = prepared_with_validation(tmp_path / "data")
    raw = job(parallelism, 2, 2, tie=False)
    raw |= {"data": {"name": "shards", "path": str(data)}, "eval": {"every_n_steps": 2, "batches": 2},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "checkpoint": {"every_n_steps": 4, "storage_path": str(tmp_path / "runs")},
            "run": {**raw["run"], "steps": 4, "name": "run", "log_every": 1}}
    run_distributed(train, 2, raw)

    rows = read_metrics(tmp_path / "runs" / "run")
    assert [("val_loss" in r) for r in rows] == [False, True, False, True]
    final = find_latest(tmp_path / "runs" / "run")
    model = load_model(final).eval()
    validation = open_split(str(data), "validation", 16)
    x, y = validation.batch(torch.arange(2 * 8))  # eval.batches global batches, in order
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert rows[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert rows[-1]["val_perplexity"] == pytest.approx(np.exp(expected), rel=1e-5)
    assert rows[1]["val_loss"] != rows[-1]["val_loss"]  # evaluated on the weights of its own step


@pytest.mark.timeout(60)
def test_each_epoch_is_a_permutation_computed_without_storing_one() -> None:
    from shardyard.data.sampler import GlobalSampleOrder

    for n in (1, 2, 3, 7, 100, 4097):
        order = GlobalSampleOrder(n, seed=5)
        epochs = [order.ids(e * n, n).tolist() for e in range(3)]
        assert all(sorted(e) == list(range(n)) for e in epochs), n
        if n >= 100:
            assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(n))  # shuffled, anew each epoch
    # A dataset of 31 billion samples (4 TB of 64-token samples): any position, in microseconds,
    # with no per-epoch array (which would need 248 GB).
    ids = GlobalSampleOrder(31_000_000_000, seed=1).ids(123_456_789_000, 64)
    assert len(set(ids.tolist())) == 64 and int(ids.max()) < 31_000_000_000
