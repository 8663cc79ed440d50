"""Under hot recovery, a worker tells a replacement of lost replicas from a group start by the
run's event log: what `RunEvents` logs (`replica_start` or the group's `start`) depends on it."""

from __future__ import annotations

import pytest

from shardyard.train.callbacks import replaces_lost_replicas


def events(*kinds: str | tuple[str, list[int]]) -> list[dict]:
    return [{"event": k[0], "ranks": k[1]} if isinstance(k, tuple) else {"event": k} for k in kinds]


@pytest.mark.parametrize("history, replaces", [
    (events("launch"), False),  # the group's first start
    (events("launch", "start", ("failure", [0])), True),  # rank 0 lost, its peers train on
    (events("launch", "start", ("failure", [1]), ("failure", [0, 1, 2])), False),  # all lost: the group restarts
    (events("launch", "start", ("failure", [0, 1, 2]), "start", ("failure", [2])), True),
    # A new launch of the run after one whose replica was lost: its group starts afresh.
    (events("launch", "start", ("failure", [0]), "launch"), False),
], ids=["first start", "rank 0 lost", "all lost", "lost after a restart", "a new launch"])
def test_a_replacement_is_told_from_a_group_start(history: list[dict], replaces: bool) -> None:
    assert replaces_lost_replicas(history, world_size=3) is replaces
