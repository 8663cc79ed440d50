"""Checks done on the driver before any worker starts that need this machine, the cluster or the run's
storage (the spec's own checks need none of them): the data, the tokenizer a run adopts, and what a
resumed run may change."""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
from typing import Any

from shardyard.checkpoint.layout import SPEC_FILE, stored_spec
from shardyard.checkpoint.record import newest_good
from shardyard.data.corpus import corpus_files
from shardyard.data.shards import TOKENIZER_DIR, open_split, read_index, tokenizer_files, validation_source
from shardyard.spec import ZERO_STAGES, JobSpec, SpecError
from shardyard.storage.events import Event, log_event
from shardyard.storage.store import RunStorage


def preflight(spec: JobSpec) -> None:
    """Checks that need this machine, the cluster or the run's storage, done before any worker
    starts."""
    check_resume(spec)
    if spec.data.name == "corpus":
        try:
            corpus_files(spec.data.path)
        except FileNotFoundError as err:
            raise SpecError(str(err)) from None
    if spec.data.name == "corpus" and getattr(spec.model, "vocab_size", 256) < 256:
        raise SpecError("data.name 'corpus' is byte-level: model.vocab_size must be at least 256")
    if spec.data.name == "shards":
        check_shards(spec)


def check_shards(spec: JobSpec) -> None:
    """The prepared directory's index is readable, matches its shards (local ones: their sizes)
    and its tokenizer's ids fit the model's embedding."""
    path = spec.data.path
    try:
        index = read_index(path)
        open_split(path, "train", spec.model.block_size, spec.data.cache_dir, spec.data.cache_bytes)
    except ValueError as err:  # ShardIndexError, or too few tokens for one sample
        raise SpecError(f"data.path {path!r}: {err}") from None
    if spec.eval.every_n_steps is not None:
        try:
            where, split = validation_source(path, spec.data.validation_path)
            validation = open_split(where, split, spec.model.block_size, spec.data.cache_dir, spec.data.cache_bytes)
        except ValueError as err:
            raise SpecError(f"eval.every_n_steps: {err}") from None
        if len(validation) < spec.batch.global_batch_size:
            raise SpecError(f"eval.every_n_steps: {where}'s {split} split holds {len(validation)} samples of "
                            f"{spec.model.block_size + 1} tokens, fewer than one global batch "
                            f"({spec.batch.global_batch_size}): prepare with a larger output.validation_fraction")
    vocab = getattr(spec.model, "vocab_size", None)
    if vocab is not None and index["vocab_size"] > vocab:
        raise SpecError(f"data.path {path!r} was tokenized with {index['vocab_size']} ids, more than "
                        f"model.vocab_size ({vocab}): set model.vocab_size to at least {index['vocab_size']}")
    adopt_tokenizer(spec)


ADOPTED = "ADOPTED.json"  # in the run's tokenizer/: each adopted file's digest


def adopt_tokenizer(spec: JobSpec) -> None:
    """The data's tokenizer goes into the run directory (`tokenizer/`) at the run's first launch:
    serving and exports find it there, wherever the data goes later. A later launch on data of
    another tokenizer is refused: the model's ids would mean other text.

    The run has adopted a tokenizer once `tokenizer/ADOPTED.json` lists every file's digest; it is
    written last (locally the folder appears whole: it is written aside and renamed into place),
    so a launch cut off part way is completed by the next, never taken for adopted."""
    try:
        files = tokenizer_files(spec.data.path)
    except ValueError as err:  # ShardIndexError: an index that names another folder
        raise SpecError(f"data.path {spec.data.path!r}: {err}") from None
    if not files:
        return
    storage = RunStorage(spec.run_uri)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())}
    refusal = SpecError(f"run '{spec.run.name}' was trained with the tokenizer in {storage.url(TOKENIZER_DIR)}; "
                        f"data.path {spec.data.path!r} was tokenized with another: use another run.name")
    manifest = json.dumps(digests, indent=1).encode()
    if storage.exists(TOKENIZER_DIR, ADOPTED):
        if json.loads(storage.read_bytes(TOKENIZER_DIR, ADOPTED)) != digests:
            raise refusal
        return
    if storage.exists(TOKENIZER_DIR, "tokenizer.json"):  # adopted before the list was kept, or cut short
        if storage.read_bytes(TOKENIZER_DIR, "tokenizer.json") != files.get("tokenizer.json"):
            raise refusal
    elif not storage.remote and not storage.exists(TOKENIZER_DIR):
        aside = f"{TOKENIZER_DIR}.adopting-{secrets.token_hex(4)}"
        for name, data in {**files, ADOPTED: manifest}.items():
            storage.write_bytes(data, aside, name)
        if storage.place(aside, TOKENIZER_DIR):
            return
        storage.delete(aside)  # another launch placed one meanwhile: judged below like any other
        return adopt_tokenizer(spec)
    for name, data in files.items():
        storage.write_bytes(data, TOKENIZER_DIR, name)
    if not storage.create_exclusive(manifest, TOKENIZER_DIR, ADOPTED):
        adopt_tokenizer(spec)  # another launch listed its files first: theirs must be these


# What a resumed run may not change: the stored weights, or the stored data position (a place in
# one seed's order over one dataset), would then mean something else.
FIXED_ON_RESUME = ("model.", "data.name", "data.path", "data.max_bytes", "data.num_samples", "run.seed")


def spec_changes(stored: JobSpec, spec: JobSpec) -> dict[str, list[Any]]:
    """Every setting whose value differs, by dotted key (`optim.lr`), as [stored, new]."""
    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): value}

    old, new = flat(stored.model_dump(mode="json")), flat(spec.model_dump(mode="json"))
    return {key: [old.get(key), new.get(key)] for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)}


def check_resume(spec: JobSpec) -> None:
    """A run that resumes is compared with the spec of its newest committed checkpoint before any
    worker starts: a change that cannot apply (model, data source, seed) is refused naming each
    key; the rest (steps, lr and schedule, world size, strategy, cadence...) apply and are recorded
    in the run's events. Optimizer state must be loadable unless the spec leaves it behind."""
    storage = RunStorage(spec.run_uri)
    found = newest_good(storage)
    if found is None:
        return
    name, record = found
    where = storage.url(name)
    stored = stored_spec(storage.read_bytes(name, SPEC_FILE))
    changes = spec_changes(stored, spec)
    fixed = [key for key in changes if key.startswith(FIXED_ON_RESUME)]
    if fixed:
        listed = ", ".join(f"{key} ({changes[key][0]!r} -> {changes[key][1]!r})" for key in fixed)
        raise SpecError(f"run '{spec.run.name}' resumes from {where}, which was trained with other settings that "
                        f"cannot change on resume: {listed}. Set them back, or use another run.name (or "
                        f"storage path) for a new run")
    if changes:
        log_event(spec.run_uri, Event.SPEC_CHANGED, checkpoint=name, changes=changes)
    if spec.checkpoint.load_optimizer:
        check_optimizer_resumes(spec, stored, record["world_size"], where)
    # The user relaunching sees where the run picks up and what their command changed, before Ray's output.
    changed = "".join(f"; {key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
    workers = f"{record['world_size']} worker{'s' if record['world_size'] != 1 else ''}"
    print(f"shardyard: run '{spec.run.name}' resumes from {where} (step {record['step']}, "
          f"{stored.parallelism.strategy} on {workers}){changed}", file=sys.stderr, flush=True)


def check_optimizer_resumes(spec: JobSpec, stored: JobSpec, written_at: int, where: str) -> None:
    """The stored optimizer state loads into the optimizer and strategy `spec` names."""
    same_zero = stored.parallelism.strategy == spec.parallelism.strategy and spec.scaling.num_workers == written_at
    if stored.parallelism.strategy in ZERO_STAGES and stored.optim.name == "sgd" and stored.optim.momentum \
            and not same_zero:
        raise SpecError(f"run '{spec.run.name}' resumes from {where}, a ZeRO checkpoint with SGD momentum: "
                        f"DeepSpeed reshards or converts Adam's state only, so the momentum cannot follow to "
                        f"another strategy or world size. Set checkpoint.load_optimizer=false to resume with "
                        f"the weights, LR schedule and data position only")
    if stored.optim.name != spec.optim.name:
        raise SpecError(f"run '{spec.run.name}' resumes from {where}, trained with optim.name "
                        f"'{stored.optim.name}': its optimizer state cannot be loaded into '{spec.optim.name}'. "
                        f"Set checkpoint.load_optimizer=false to resume with the weights, LR schedule and "
                        f"data position only")
