"""How each engine's checkpoint is written and read: DCP's sharded files for every strategy but
ZeRO (dcp.py), DeepSpeed's own files for ZeRO (zero.py). The manager (checkpoint/manager.py)
commits, prunes and picks; a format only writes and reads."""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from shardyard.checkpoint.collective import Written
from shardyard.checkpoint.formats.dcp import DCPFormat
from shardyard.checkpoint.formats.zero import DeepSpeedFormat
from shardyard.parallel import Engine
from shardyard.spec import JobSpec
from shardyard.storage.store import RunStorage


class CheckpointFormat(Protocol):
    name: str

    def save(self, engine: Engine, storage: RunStorage, name: str, group: dist.ProcessGroup | None) -> Written: ...

    def load(self, engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
             load_optimizer: bool) -> None: ...


FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (DCPFormat(), DeepSpeedFormat())}
