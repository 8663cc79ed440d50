"""Holds on the checkpoints a replica serves and reads: training does not prune a checkpoint
under the model that reads it now and may read it again (a rebuild, a swap back).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from shardyard.checkpoint.reader_holds import holding
from shardyard.checkpoint.loaders import committed_record, servable
from shardyard.checkpoint.published import Published

def hold_served(source: str, fallback: str, hold: ExitStack) -> str:
    """Find what to serve (a run directory's newest committed checkpoint, or the checkpoint as
    given; `fallback` if `source` has none now) and hold it in `hold` until that closes: training
    does not prune it under the model that reads it now and may read it again (a rebuild)."""
    while True:
        found = servable(source) or Path(fallback)
        if committed_record(found) is None:  # a Hugging Face model directory: not training's to prune
            return str(found)
        hold.enter_context(holding(str(found.parent), found.name))
        if committed_record(found) is not None:  # still there once held: pruning now keeps it
            return str(found)
        hold.close()  # pruned between finding and holding it: find the newest again


class CheckpointHolds:
    """The served checkpoint's hold and, while a candidate is read beside it (prepare), the
    candidate's: they change places with the weights, so training prunes neither while either
    may be read again (a rebuild, a swap back)."""

    def __init__(self) -> None:
        self.served, self.staged = ExitStack(), ExitStack()
        self.staged_dir = ""

    def stage(self, source: str | Published) -> str | Published:
        """Hold the candidate checkpoint (letting go of the one held before); published weights
        are in the object store, nothing to hold."""
        self.staged.close()
        self.staged_dir = source if isinstance(source, Published) else hold_served(source, source, self.staged)
        return self.staged_dir

    def swap(self, served_dir: str | Published) -> str | Published:
        """The candidate is served and `served_dir` becomes the candidate; returns the served one."""
        self.served, self.staged = self.staged, self.served
        served, self.staged_dir = self.staged_dir, served_dir
        return served

    def drop(self) -> None:
        self.staged.close()
        self.staged_dir = ""

    def close(self) -> None:
        self.drop()
        self.served.close()
