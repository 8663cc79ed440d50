"""The local launcher's rendezvous: ranks of one launch find each other whatever else runs on the machine."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from shardyard import localdist
from shardyard.localdist import run_distributed


def summed_rank(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(120)
def test_a_launch_does_not_lose_its_rendezvous_port_to_another_process(monkeypatch) -> None:
    """What failed a CI run: a port found free, then taken by another process before rank 0 bound it
    (EADDRINUSE). Here the port the launcher would have found is taken at once; the launch must not
    depend on it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(localdist, "free_port", lambda: taken.getsockname()[1])
        assert run_distributed(summed_rank, 2) == [1.0, 1.0]
