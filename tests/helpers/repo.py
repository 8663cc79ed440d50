"""Where things are: the checkout, the commands this environment installed, README's default job."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
SHARDYARD = str(Path(sys.executable).with_name("shardyard"))
DEFAULT_JOB = REPO / "jobs" / "configs" / "gpt_ddp.yaml"  # README's default training job
VISION_JOB = REPO / "jobs" / "configs" / "vision_ddp.yaml"  # the example of a task of the user's own
