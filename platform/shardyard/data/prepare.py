"""`shardyard prepare DATA_SPEC.yaml`: raw text to token shards (data/shards.py's format).

A Ray Data job: reading and tokenizing are Ray Data tasks (on a cluster every node takes a share),
and this process writes their output, in source order, as fixed-size shards with the index last
(a directory without its index is not a prepared one). A document goes to the validation split
by a hash of its text, so the split does not depend on order or on the number of workers.
Rerunning with the same source files (paths, sizes, modification times) and settings is a no-op;
a changed input changes the fingerprint and the data is prepared again.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from shardyard.data.corpus import TEXT_SUFFIXES
from shardyard.data.shards import (INDEX_FILE, TOKENIZER_DIR, docs_name, is_remote, shard_name, token_dtype,
                                   write_index)
from shardyard.data.tokenizer import BYTES, TokenizerInfo, encode_documents, from_directory, train_bpe
from shardyard.spec import Section, read_yaml, validate

SUFFIXES = {"text": TEXT_SUFFIXES, "jsonl": {".jsonl", ".json"}, "parquet": {".parquet"}}


class SourceSpec(Section):
    path: str = Field(description="a file, folder or glob; local or object storage (s3://, gs://, ...); "
                                  "`hf`: a local dataset directory")
    format: Literal["text", "jsonl", "parquet", "hf"] = "text"
    field: str = Field("text", description="the JSON field, Parquet or dataset column holding the text")
    split: str = Field("train", description="`hf`: the dataset's split to read")


class TrainTokenizerSpec(Section):
    vocab_size: int = Field(ge=257, le=2**32, description="byte-level BPE: 256 bytes, merges, <|endoftext|>")


class TokenizerSpec(Section):
    name: Literal["bytes"] | None = None
    path: str | None = Field(None, description="a local Hugging Face tokenizer directory (a model's own)")
    train: TrainTokenizerSpec | None = None

    @model_validator(mode="after")
    def _one_tokenizer(self) -> TokenizerSpec:
        given = [k for k in ("name", "path", "train") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of tokenizer.name, tokenizer.path, tokenizer.train, not {given}")
        return self


class OutputSpec(Section):
    path: str = Field(description="the prepared directory; local or object storage")
    shard_tokens: int = Field(1 << 24, ge=1024, description="tokens per shard (the last one of a split may hold fewer)")
    validation_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of documents for validation")


class PrepareSpec(Section):
    source: SourceSpec
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    output: OutputSpec
    workers: int | None = Field(None, ge=1, description="Ray Data tasks tokenizing at once (default: all CPUs)")


class PrepareError(ValueError):
    """Input that cannot be prepared; the message names the file and what is wrong."""


def load_prepare_spec(path: str | Path | None, overrides: list[str]) -> PrepareSpec:
    return validate(PrepareSpec, read_yaml(path, overrides, "data spec"), "invalid data spec")


# ----------------------------------------------------------------------------- the source


def source_files(source: SourceSpec) -> list[tuple[str, int, float]]:
    """(url or path, size, modification time) of every input file, in a fixed order; the
    fingerprint is made of these (for a Hugging Face dataset directory, every file in it)."""
    import fsspec

    if source.format == "hf" and (is_remote(source.path) or not Path(source.path).is_dir()):
        raise PrepareError(f"source.path {source.path!r}: source.format 'hf' reads a local dataset directory")
    fs, _, _ = fsspec.get_fs_token_paths(source.path)
    protocol = source.path.split("://")[0] + "://" if is_remote(source.path) else ""
    matches = fs.glob(source.path) if any(c in source.path for c in "*?[") else [source.path]
    files: list[str] = []
    for match in matches:
        if fs.isdir(match):
            files += [f for f in fs.find(match)
                      if source.format == "hf" or Path(f).suffix in SUFFIXES[source.format]]
        elif fs.isfile(match):
            files.append(match)
    if not files:
        kinds = "files" if source.format == "hf" else \
            f"{source.format} files ({', '.join(sorted(SUFFIXES[source.format]))})"
        raise PrepareError(f"source.path {source.path!r} matches no {kinds}")
    out = []
    for f in sorted(set(files)):
        info = fs.info(f)
        mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
        out.append((protocol + f if protocol and not f.startswith(protocol) else f, int(info["size"]),
                    float(mtime.timestamp() if hasattr(mtime, "timestamp") else mtime)))
    return out


def hf_dataset(source: SourceSpec):
    """The split of a local dataset directory, as Hugging Face `datasets` reads it: one saved with
    `save_to_disk`, or a dataset repository's files (`load_dataset`). Memory-mapped Arrow."""
    import datasets

    try:
        if (Path(source.path) / "state.json").is_file() or (Path(source.path) / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(source.path)
        else:
            loaded = datasets.load_dataset(source.path, split=source.split)
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise PrepareError(f"{source.path}: no split {source.split!r} (it has {sorted(loaded)})")
            loaded = loaded[source.split]
    except PrepareError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; the user needs the message
        raise PrepareError(f"{source.path} cannot be read by Hugging Face datasets: {err}") from None
    if source.field not in loaded.column_names:
        raise PrepareError(f"{source.path}: no column {source.field!r} (it has {loaded.column_names})")
    return loaded


def check_readable(files: list[str], source: SourceSpec) -> None:
    """Each file opens and holds the field: a clear error before any Ray work starts."""
    import fsspec

    if source.format == "hf":
        hf_dataset(source)
        return
    for f in files:
        try:
            with fsspec.open(f, "rb") as handle:
                if source.format == "parquet":
                    import pyarrow.parquet as pq

                    columns = pq.read_schema(handle).names
                    if source.field not in columns:
                        raise PrepareError(f"{f}: no column {source.field!r} (it has {columns})")
                elif source.format == "jsonl":
                    first = handle.readline()
                    if first.strip():
                        record = json.loads(first)
                        if not isinstance(record, dict) or source.field not in record:
                            raise PrepareError(f"{f}: the first record has no field {source.field!r}")
                else:
                    handle.read(1)
        except PrepareError:
            raise
        except (OSError, ValueError) as err:
            raise PrepareError(f"{f} cannot be read as {source.format}: {err}") from None


def read_documents(files: list[str], source: SourceSpec):
    """A Ray Dataset of rows {text, path}: one per file (text), record (jsonl) or row (parquet)."""
    import ray.data

    if source.format == "text":
        return ray.data.read_binary_files(files, include_paths=True).map_batches(_decode, batch_format="numpy")
    if source.format == "hf":
        ds = ray.data.from_huggingface(hf_dataset(source).select_columns([source.field]))
        return ds.map_batches(_pick_field, fn_kwargs={"field": source.field, "path": source.path},
                              batch_format="numpy")
    if source.format == "jsonl":
        ds = ray.data.read_json(files, lines=True, include_paths=True)
    else:
        ds = ray.data.read_parquet(files, include_paths=True).select_columns([source.field, "path"])
    return ds.map_batches(_pick_field, fn_kwargs={"field": source.field}, batch_format="numpy")


def _decode(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    texts = [b.decode("utf-8", errors="replace") for b in batch["bytes"]]
    return {"text": np.array(texts, dtype=object), "path": batch["path"]}


def _pick_field(batch: dict[str, np.ndarray], field: str, path: str | None = None) -> dict[str, np.ndarray]:
    """`path`: where every row comes from, for sources whose rows carry no path (a dataset)."""
    if field not in batch:
        raise PrepareError(f"{path or batch['path'][0]}: no field {field!r}")
    texts = batch[field]
    paths = batch["path"] if path is None else np.full(len(texts), path, dtype=object)
    for text, where in zip(texts, paths):
        if not isinstance(text, str):
            raise PrepareError(f"{where}: a record's {field!r} is {type(text).__name__}, not text")
    return {"text": texts, "path": paths}


def validation_share(text: str) -> float:
    """A number in [0, 1) from the document's text alone: its split never depends on order."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") / 2**64


def _tokenize(batch: dict[str, np.ndarray], info: TokenizerInfo, fraction: float) -> dict[str, np.ndarray]:
    texts = list(batch["text"])
    tokens = encode_documents(info, texts)
    return {"tokens": np.array([t.tobytes() for t in tokens], dtype=object),
            "validation": np.array([validation_share(t) < fraction for t in texts], dtype=bool)}


# ----------------------------------------------------------------------------- the shards


class SplitWriter:
    """One split's shards: tokens appended document by document, a shard written each time
    `shard_tokens` have gathered."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_docs: list[int] = []  # document starts within the pending tokens
        self.pending_tokens = 0
        self.shards: list[dict[str, Any]] = []
        self.documents = 0

    def add(self, tokens: np.ndarray) -> None:
        self.pending_docs.append(self.pending_tokens)
        self.pending.append(tokens.astype(self.dtype))
        self.pending_tokens += len(tokens)
        self.documents += 1
        while self.pending_tokens >= self.shard_tokens:
            self._write(self.shard_tokens)

    def close(self) -> dict[str, Any]:
        if self.pending_tokens:
            self._write(self.pending_tokens)
        return {"tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents, "shards": self.shards}

    def _write(self, count: int) -> None:
        stream = np.concatenate(self.pending)
        starts = np.array([d for d in self.pending_docs if d < count], dtype=np.int64)
        name = shard_name(self.split, len(self.shards))
        stream[:count].tofile(self.out / name)
        np.save(self.out / docs_name(name), starts)
        self.shards.append({"name": name, "tokens": count, "documents": len(starts)})
        rest = stream[count:]
        # A document cut at the shard's end carries on in the next one (no start there).
        self.pending_docs = [d - count for d in self.pending_docs if d >= count]
        self.pending, self.pending_tokens = ([rest] if len(rest) else []), len(rest)


def fingerprint(spec: PrepareSpec, files: list[tuple[str, int, float]]) -> str:
    settings = spec.model_dump(exclude={"workers"}, mode="json")
    settings["output"].pop("path")
    return hashlib.sha256(json.dumps([settings, files], sort_keys=True).encode()).hexdigest()


def existing_fingerprint(output: str) -> str | None:
    from shardyard.data.shards import ShardIndexError, read_index

    try:
        return read_index(output)["source"]["fingerprint"]
    except ShardIndexError:
        return None


def prepare(spec: PrepareSpec) -> dict[str, Any]:
    """Prepare the data (or find it prepared); return the summary it printed."""
    files = source_files(spec.source)
    digest = fingerprint(spec, files)
    if existing_fingerprint(spec.output.path) == digest:
        summary = {"output": spec.output.path, "up to date": True}
        print(f"shardyard prepare: {spec.output.path} is up to date (same source files and settings)")
        return summary
    check_readable([f for f, _, _ in files], spec.source)
    _start_ray(spec.workers)
    start = time.perf_counter()
    ds = read_documents([f for f, _, _ in files], spec.source)
    info, hf_tokenizer = _tokenizer(spec, ds)
    dtype = token_dtype(info.vocab_size)
    with tempfile.TemporaryDirectory(prefix="shardyard-prepare-") as staging:
        out = Path(staging)
        writers = {split: SplitWriter(out, split, dtype, spec.output.shard_tokens) for split in ("train", "validation")}
        tokenized = ds.map_batches(_tokenize, fn_kwargs={"info": info, "fraction": spec.output.validation_fraction},
                                   batch_format="numpy", concurrency=spec.workers)
        try:
            for batch in tokenized.iter_batches(batch_format="numpy", batch_size=None):
                for tokens, held_out in zip(batch["tokens"], batch["validation"]):
                    writers["validation" if held_out else "train"].add(np.frombuffer(tokens, dtype=np.uint32))
        except Exception as err:  # noqa: BLE001 - Ray wraps a worker's PrepareError; show its message
            raise _user_error(err) from None
        splits = {split: w.close() for split, w in writers.items() if w.documents or split == "train"}
        if not splits["train"]["tokens"]:
            raise PrepareError(f"source.path {spec.source.path!r}: no text in the train split")
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(out / TOKENIZER_DIR)
        write_index(out, dtype, info.vocab_size, splits, eos_id=info.eos_id,
                    tokenizer={"kind": info.kind, "dir": TOKENIZER_DIR if hf_tokenizer is not None else None},
                    source={**spec.source.model_dump(), "files": len(files), "fingerprint": digest})
        _publish(out, spec.output.path)
    elapsed = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in splits.values())
    summary = {"output": spec.output.path, "documents": sum(s["documents"] for s in splits.values()),
               "tokens": tokens, "shards": sum(len(s["shards"]) for s in splits.values()),
               **{f"{split} tokens": s["tokens"] for split, s in splits.items()},
               "tokenizer": f"{info.kind} ({info.vocab_size} ids)", "tokens/s": round(tokens / elapsed)}
    from shardyard.tables import format_table

    print(format_table("shardyard prepare", summary), flush=True)
    return summary


def _tokenizer(spec: PrepareSpec, ds) -> tuple[TokenizerInfo, object | None]:
    chosen = spec.tokenizer
    if chosen.path is not None:
        if is_remote(chosen.path) or not Path(chosen.path).is_dir():
            raise PrepareError(f"tokenizer.path {chosen.path!r} is not a local directory")
        return from_directory(chosen.path)
    if chosen.train is not None:
        texts = (row["text"] for row in ds.iter_rows())  # one streaming pass over the documents
        return train_bpe(texts, chosen.train.vocab_size)
    return BYTES, None


def _start_ray(workers: int | None) -> None:
    from ray.data import DataContext

    from shardyard.cluster import connect_ray

    connect_ray(workers or 1)  # RAY_ADDRESS names a cluster; else a local instance, as `shardyard train`
    # The shards hold the documents in source order: reruns and any worker count give the same bytes.
    DataContext.get_current().execution_options.preserve_order = True


def _publish(staging: Path, output: str) -> None:
    """Shards first, the index last: a reader sees the old index, none, or the new complete one."""
    import fsspec

    fs, _, (root,) = fsspec.get_fs_token_paths(output)
    if fs.exists(f"{root}/{INDEX_FILE}"):
        fs.rm(f"{root}/{INDEX_FILE}")  # the old data stops being a prepared directory first
    fs.makedirs(root, exist_ok=True)
    # An object store has no empty directories: a prefix with nothing under it yet does not exist.
    for old in fs.ls(root, detail=False) if fs.exists(root) else []:
        if Path(old).name.startswith(("train-", "validation-")) or Path(old).name == TOKENIZER_DIR:
            fs.rm(old, recursive=True)
    for item in sorted(staging.iterdir()):
        if item.name != INDEX_FILE:
            fs.put(str(item), f"{root}/{item.name}", recursive=item.is_dir())
    fs.put(str(staging / INDEX_FILE), f"{root}/{INDEX_FILE}")


def _user_error(err: BaseException) -> Exception:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, PrepareError):
            return PrepareError(str(seen))
        for line in str(seen).splitlines()[::-1]:
            if "PrepareError: " in line:
                return PrepareError(line.split("PrepareError: ", 1)[1])
        seen = seen.__cause__ or seen.__context__
    return err if isinstance(err, Exception) else RuntimeError(str(err))
