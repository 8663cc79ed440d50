"""A checkpoint's commit record: the one source of truth for which checkpoints a run has.

A checkpoint directory `checkpoint_step_<step:08d>/` counts only once its `COMMITTED` file holds a
valid record: the step, the world size and format that wrote it, and every file of the checkpoint
with its size and CRC-32C, computed as the file was written. The record is written last, after
every file is durable, so a crash leaves the old checkpoint committed or the new one, never half.

Readers trust nothing else: a record that is missing means "not committed"; one that is empty,
torn or inconsistent (a field of the wrong type, a file named outside its checkpoint), or files
that are missing, of another size or another checksum, make the checkpoint bad. `newest_good`
names each bad one in a warning and falls back to the next older. A record that lists no files
(version 1, from before files were listed) is bad too: nothing in it can be verified.

A record also names the lease generation of the launch that wrote it: a stale writer's commit,
landing after another launch took the run over, is no part of the run (generations.py), and the
record is made only if none has its name yet, so it never replaces the new holder's.

On an object store (no rename, no compare-and-delete) each writer's record has a key of its own,
`COMMITTED.<generation>-<attempt>`, made only if absent: no commit deletes or replaces another's
record, whatever the timing, and readers take the valid record of the newest writer (a stale
writer is always an older generation or worker group than the one it lost the run to).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable, Collection, Iterator
from pathlib import PurePosixPath
from typing import Any

import crc32c

from shardyard.checkpoint.generations import Lineage
from shardyard.storage.store import CHECKPOINT_NAME, DIR_PREFIX, RunStorage

log = logging.getLogger("shardyard")

COMMIT_FILE = "COMMITTED"
RECORD_VERSION = 2
_CHUNK = 8 << 20

FileEntry = dict[str, int]  # {"size": bytes, "crc32c": checksum}


class BadCheckpoint(Exception):
    """A checkpoint whose commit record or files cannot be trusted; the message says which."""


def checkpoint_name(step: int) -> str:
    return f"{DIR_PREFIX}{step:08d}"


def step_of(name: str) -> int:
    match = CHECKPOINT_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint name")
    return int(match.group(1))


def entry(data: bytes) -> FileEntry:
    return {"size": len(data), "crc32c": crc32c.crc32c(data)}


class Checksum:
    """Size and CRC-32C of bytes as they pass by (a file being written)."""

    def __init__(self) -> None:
        self.size = 0
        self.value = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.value = crc32c.crc32c(view, self.value)
        self.size += view.nbytes

    def entry(self) -> FileEntry:
        return {"size": self.size, "crc32c": self.value}


def file_entry(storage: RunStorage, *parts: str) -> FileEntry:
    """Size and checksum of a stored file, read back (for files another library wrote)."""
    checksum = Checksum()
    with storage.fs.open(storage.path(*parts), "rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
    return checksum.entry()


def make_record(step: int, world_size: int, fmt: str, files: dict[str, FileEntry], time: float,
                generation: int = 0, base_step: int | None = None, attempt: int | None = None) -> dict[str, Any]:
    """`base_step`: the step the writing launch started from (-1: none), so that the records
    alone state which commits a later launch made stale; `attempt`: the worker group of that
    launch which wrote it (generations.py)."""
    record = {"version": RECORD_VERSION, "step": step, "world_size": world_size, "format": fmt,
              "generation": generation, "time": time, "files": dict(sorted(files.items()))}
    for key, value in (("base_step", base_step), ("attempt", attempt)):
        if value is not None:
            record[key] = value
    return record


class CommitRefused(Exception):
    """Another launch's record already commits this checkpoint and is not stale."""


ATTEMPT_MARK = ".attempt-"  # `<name>.attempt-<generation>-<worker group>-<random>`: one save's own directory


def attempt_name(name: str, generation: int, group: int | None = None) -> str:
    """Where one save of checkpoint `name` is written: a directory no other save ever uses, so no
    writer deletes or overwrites another's files, whatever their timing."""
    return f"{name}{ATTEMPT_MARK}{generation}-{group or 0}-{secrets.token_hex(6)}"


def attempt_generation(directory: str) -> tuple[int, int] | None:
    """The lease generation and worker group of the save that writes `directory` (None: not a
    save's directory)."""
    base, mark, rest = directory.partition(ATTEMPT_MARK)
    parts = rest.split("-")
    if not (mark and CHECKPOINT_NAME.match(base) and len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def is_save_of(directory: Any, name: str | None) -> bool:
    """Whether `directory` is a save's directory (attempt_name) of checkpoint `name` (of any
    checkpoint when None)."""
    return isinstance(directory, str) and "/" not in directory and attempt_generation(directory) is not None \
        and (name is None or directory.partition(ATTEMPT_MARK)[0] == name)


def files_at(name: str, record: dict[str, Any]) -> str:
    """The directory that holds the files `record` lists: the checkpoint's own (renamed into place
    at commit) or, on an object store, the save's directory the record names."""
    return record.get("files_at", name)


def writer_of(record: dict[str, Any]) -> tuple[int, int]:
    """Who made `record`: its launch's lease generation and worker group (0: a launch's driver, or
    a record from before groups were recorded); later writers compare greater."""
    return record.get("generation", 0), record.get("attempt") or 0


def record_key(record: dict[str, Any]) -> str:
    """A record's key on an object store: its writer's own."""
    generation, attempt = writer_of(record)
    return f"{COMMIT_FILE}.{generation:08d}-{attempt:06d}"


def record_keys(storage: RunStorage, name: str) -> list[str]:
    """The record files checkpoint `name` holds: `COMMITTED` (a file system's commit, or an
    object store's from earlier versions) and each object-store writer's key, which a copy of
    such a run on a file system (a sync of the bucket) holds too."""
    return [key for key in storage.list(name) if key == COMMIT_FILE or key.startswith(COMMIT_FILE + ".")]


def has_record(storage: RunStorage, name: str) -> bool:
    """Whether `name` holds any record file, valid or not."""
    return bool(record_keys(storage, name))


def saves_named(storage: RunStorage, name: str) -> set[str]:
    """The save directories `name`'s records on an object store name as where their files are,
    whatever the records' worth (for removing the checkpoint whole)."""
    saves = set()
    for key in record_keys(storage, name):
        try:
            record = json.loads(storage.read_bytes(name, key))
        except (FileNotFoundError, ValueError):
            continue
        if isinstance(record, dict) and is_save_of(record.get("files_at"), name):
            saves.add(record["files_at"])
    return saves


def commit(storage: RunStorage, written: str, name: str, record: dict[str, Any],
           fence: Callable[[], None] = lambda: None) -> None:
    """Commit the checkpoint written under `written` (attempt_name) as `name`: its files made
    durable, then the record. Locally the record goes into `written`, which is renamed to `name`
    in one step, refused while `name` holds anything; on an object store the record is created
    under this writer's own key at `name`, naming `written` as where its files are, beside any
    other writer's (nothing there is ever deleted). A valid record already at `name` raises
    CommitRefused. Locally, what else holds the name (a stale writer's commit, a write an older
    version cut short) is set aside first, `fence` checked right before; and if what was moved
    turns out valid after all (committed between the look and the move), it is put back and the
    commit refused: no valid commit is ever removed."""
    storage.sync(written)
    if storage.remote:
        _refuse_if_valid(storage, name)
        fence()
        if not storage.create_exclusive(json.dumps({**record, "files_at": written}).encode(), name, record_key(record)):
            raise CommitRefused(f"{storage.url(name, record_key(record))} was made by this writer already")
        return
    storage.write_bytes(json.dumps(record).encode(), written, COMMIT_FILE)
    for _ in range(3):
        if storage.place(written, name):
            return
        _refuse_if_valid(storage, name)
        fence()
        aside = storage.set_aside(name, "stale")
        try:
            _refuse_if_valid(storage, aside, step_of(name))
        except CommitRefused:
            storage.place(aside, name)  # committed meanwhile: back where it was
            raise
        storage.delete(aside)
    raise CommitRefused(f"{storage.url(name)} keeps being made by another writer")


def valid_record(storage: RunStorage, directory: str, step: int | None = None,
                 judged: bool = True) -> dict[str, Any] | None:
    """`read_record`, with a record that cannot be trusted (torn, or a stale writer's when
    `judged`) read as none."""
    try:
        return read_record(storage, directory, step=step, judged=judged)
    except BadCheckpoint:
        return None


def _refuse_if_valid(storage: RunStorage, directory: str, step: int | None = None) -> None:
    """CommitRefused if `directory` holds a valid commit record (of `step`: its own by default)."""
    there = valid_record(storage, directory, step)
    if there is not None:
        raise CommitRefused(f"{storage.url(directory, COMMIT_FILE)} was committed by lease generation "
                            f"{there.get('generation', 0)} meanwhile; this launch's commit is refused")


def read_record(storage: RunStorage, name: str, lineage: Lineage | None = None,
                step: int | None = None, judged: bool = True) -> dict[str, Any] | None:
    """The commit record of checkpoint `name` (on an object store, the newest writer's valid one);
    None while it has none (not committed). Raises BadCheckpoint for a record that exists but
    cannot be trusted, or that a stale writer made (judged by `lineage`, the run's lease
    generations; read now if not given)."""
    found, problems = [], []
    for key in record_keys(storage, name):
        try:
            data = storage.read_bytes(name, key)
        except FileNotFoundError:
            continue
        where = storage.url(name, key)
        if not data.strip():
            problems.append(f"{where} is empty (a commit cut off before its data reached the disk)")
            continue
        try:
            record = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            problems.append(f"{where} is not a valid commit record (torn or overwritten)")
            continue
        problem = record_problem(record, step_of(name) if step is None else step, name)
        if problem is None and judged:  # `judged`: whether a stale writer's record is refused here too
            lineage = lineage or Lineage.of(storage)
            problem = lineage.stale(record)
        if problem:
            problems.append(f"{where} {problem}")
        else:
            found.append(record)
    if found:
        return max(found, key=writer_of)
    if problems:
        raise BadCheckpoint(problems[-1])
    return None


def record_problem(record: Any, step: int, name: str | None = None) -> str | None:
    """What makes a JSON-valid record untrustworthy for the checkpoint of `step` (None: nothing):
    a missing or mistyped field, another step, no file list, a file named outside the checkpoint,
    files said to be anywhere but a save's directory of this checkpoint (`name`)."""
    if not isinstance(record, dict) or not {"step", "world_size", "format"} <= record.keys():
        return "lacks the step, world size or format of its checkpoint"
    if not all(_is_int(record.get(key, 0)) for key in ("step", "world_size", "generation")) \
            or not isinstance(record["format"], str):
        return "holds a step, world size, generation or format of the wrong type (not written by shardyard)"
    if record["step"] != step:
        return f"records step {record['step']}, not the step its directory names"
    at = record.get("files_at")
    if at is not None and not is_save_of(at, name):
        return f"says its files are in {at!r}, not a save's directory of this checkpoint"
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no files (a record from before files were listed, or cut short): nothing can be verified"
    for relative, expected in files.items():
        parts = PurePosixPath(relative).parts
        if not relative or relative.startswith("/") or "\\" in relative or ".." in parts or COMMIT_FILE in parts:
            return f"names a file outside its checkpoint ({relative!r})"
        if not isinstance(expected, dict) or not all(_is_int(expected.get(key)) for key in ("size", "crc32c")):
            return f"gives {relative!r} no integer size and checksum"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def verify(storage: RunStorage, name: str, record: dict[str, Any], checksums: bool = True) -> None:
    """Every file the record lists is there with its size and (`checksums`: read whole) its
    checksum; raises BadCheckpoint naming the first that is not."""
    directory = files_at(name, record)
    root = None if storage.remote else os.path.realpath(storage.path(directory))
    for relative, expected in record["files"].items():
        where = storage.url(directory, relative)
        # Resolved, not only read as a name: a symbolic link inside the checkpoint (to a folder of
        # another run, say) passes any check of the name and reads files from elsewhere.
        if root is not None and not os.path.realpath(storage.path(directory, relative)).startswith(root + os.sep):
            raise BadCheckpoint(f"{where} leads outside its checkpoint through a symbolic link")
        try:
            size = storage.size(directory, relative)
        except FileNotFoundError:
            raise BadCheckpoint(f"{where} is missing") from None
        check_file(where, expected, size)
        if checksums:
            check_file(where, expected, size, file_entry(storage, directory, relative)["crc32c"])


def check_file(where: str, expected: FileEntry, size: int, checksum: int | None = None) -> None:
    """A file's size and (when given) checksum are the ones its commit record lists; raises
    BadCheckpoint naming `where` if not."""
    if size != expected["size"]:
        raise BadCheckpoint(f"{where} holds {size} bytes, its commit record says {expected['size']}")
    if checksum is not None and checksum != expected["crc32c"]:
        raise BadCheckpoint(f"{where} does not match its checksum (corrupted)")


def committed(storage: RunStorage, lineage: Lineage | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, record) of each checkpoint with a readable commit record, newest first; a bad
    record, or a stale writer's (by `lineage`, read now if not given), is skipped with a warning
    naming it."""
    found = []
    for name in reversed(storage.checkpoint_names()):
        try:
            record = read_record(storage, name, judged=False)
        except BadCheckpoint as err:
            log.warning("skipping checkpoint %s: %s", storage.url(name), err)
            continue
        if record is not None:
            found.append((name, record))
    # The lease's lineage and what the records state of it: enough without lease files too.
    lineage = (lineage or Lineage.of(storage)).with_records(record for _, record in found)
    for name, record in found:
        problem = lineage.stale(record)
        if problem:
            log.warning("skipping checkpoint %s: %s %s", storage.url(name), storage.url(name, COMMIT_FILE), problem)
            continue
        yield name, record


def newest_good(storage: RunStorage, check_files: bool = True, passing_over: Collection[str] = (),
                checksums: Callable[[dict[str, Any]], bool] = lambda record: True,
                found_bad: list[str] | None = None) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint whose record is valid and (`check_files`) whose files match it, not
    one of `passing_over`; each one passed over is named in a warning, and those whose files do
    not match their record are added to `found_bad`. `checksums(record)`: whether to read a
    checkpoint's files here for their checksums (not where the loader checks them as it reads;
    their presence and sizes are checked either way). None when the run has none."""
    for name, record in committed(storage):
        if name in passing_over:
            continue
        if check_files:
            try:
                verify(storage, name, record, checksums(record))
            except BadCheckpoint as err:
                log.warning("skipping checkpoint %s: %s; falling back to an older one", storage.url(name), err)
                if found_bad is not None:
                    found_bad.append(name)
                continue
        return name, record
    return None


def record_generations(storage: RunStorage) -> set[int]:
    """The lease generations the run's readable commit records name."""
    records = (valid_record(storage, name, judged=False) for name in storage.checkpoint_names())
    return {record.get("generation", 0) for record in records if record is not None}


def newest_name(storage: RunStorage, check_files: bool = True) -> str | None:
    """The name of the newest good checkpoint (`newest_good`), or None."""
    found = newest_good(storage, check_files)
    return found[0] if found else None


def newest_step(storage: RunStorage) -> int:
    """The step a new launch or worker group resumes from: the newest good checkpoint's (0: none,
    it starts from the beginning)."""
    found = newest_good(storage)
    return found[1]["step"] if found else 0
