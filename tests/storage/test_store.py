"""Run storage on a local path, against another process still writing in it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardyard.storage.store import RunStorage

# A launch taken over, finishing a save: each file written under a temporary name, then renamed.
WRITER = r"""
import os, sys
save, files = sys.argv[1], int(sys.argv[2])
print("writing", flush=True)
i = 0
while os.path.isdir(save):
    try:
        os.rename(f"{save}/part{i % files}.partial", f"{save}/part{i % files}")
    except FileNotFoundError:
        pass
    i += 1
"""


@pytest.mark.timeout(60)
def test_a_save_is_deleted_while_the_launch_it_was_taken_from_still_renames_files_in_it(tmp_path: Path) -> None:
    """The new holder's restore deletes the saves earlier launches never committed; a launch just
    taken over may still be finishing one (it learns of the takeover at its next fence check).
    The deletion must finish (before: FileNotFoundError from the middle of shutil.rmtree, in
    every one of 20 tries here, and the restore failed)."""
    storage = RunStorage(tmp_path / "run")
    for attempt in range(5):
        name = f"checkpoint_step_00000007.save-gen{attempt}"
        save = Path(storage.path(name))
        save.mkdir(parents=True)
        for i in range(300):
            (save / f"part{i}.partial").write_bytes(b"x")
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(save), "300"], stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline() == "writing\n"
            storage.delete(name)
        finally:
            writer.kill()
            writer.wait()
        assert not os.path.lexists(save)
        assert name not in storage.list()
