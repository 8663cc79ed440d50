"""What the serving tests share: a checkpoint training wrote, made once for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardyard.localdist import run_distributed

from helpers.serving import train_and_save


@pytest.fixture(scope="session")
def ddp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-block GPT trained 2 steps with DDP on 2 ranks, as training writes it."""
    out = tmp_path_factory.mktemp("checkpoint")
    run_distributed(train_and_save, 2, str(out), ("ddp",))
    return out / "ddp" / "run" / "checkpoint_step_00000002"
