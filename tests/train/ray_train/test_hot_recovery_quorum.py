"""The Lighthouse as `scaling.recovery: hot` configures it, on torchft's real server: replicas that
are behind must not form a quorum without a live replica that is ahead of them.

The scenario a CI run hit: of three replicas, one dies while another heals from it; the healer
(still at the old step) and Ray Train's replacement ask for a quorum while the third replica,
alive and a step ahead, is still failing out of its collective on the dead peer. Formed without
it, the quorum runs that step again on the old state and the replicas go on from two states.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torchft._torchft import LighthouseClient, LighthouseServer

from shardyard.spec import load_spec
from shardyard.train.ray_train.config import torch_config
from helpers.repo import DEFAULT_JOB as CONFIG
STRAGGLER_LATE_S = 1.0


def ask_quorum(client: LighthouseClient, store: dist.TCPStore, replica: str, step: int) -> list[str] | str:
    """The replicas of the quorum `replica` is given, or why it got none."""
    try:
        quorum = client.quorum(replica_id=replica, address="localhost", store_address=f"localhost:{store.port}",
                               step=step, world_size=1, shrink_only=False, timeout=timedelta(seconds=10))
    except TimeoutError as err:
        return f"no quorum: {err}"
    return sorted(member.replica_id for member in quorum.participants)


def start_asking(clients: dict[str, LighthouseClient], store: dist.TCPStore, names: tuple[str, ...], step: int,
                 answers: dict[str, list[str] | str]) -> list[threading.Thread]:
    """Each of `names` asks for a quorum at `step` at once, in a thread; its answer lands in `answers`."""
    threads = [threading.Thread(target=lambda n=name: answers.update({n: ask_quorum(clients[n], store, n, step)}))
               for name in names]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.timeout(60)
def test_a_live_replica_that_is_ahead_is_waited_for(tmp_path) -> None:
    spec = load_spec(CONFIG, ["scaling.recovery=hot", "scaling.min_workers=null", "scaling.max_workers=null",
                              "scaling.num_workers=2", f"checkpoint.storage_path={tmp_path}"])
    lighthouse = LighthouseServer(bind="[::]:0", **torch_config(spec).lighthouse_kwargs)
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    clients = {name: LighthouseClient(addr=lighthouse.address(), connect_timeout=timedelta(seconds=5))
               for name in ("healer", "ahead", "replacement")}
    stop = threading.Event()

    def heartbeat(name: str) -> None:
        while not stop.is_set():
            clients[name].heartbeat(name)
            time.sleep(0.1)

    try:
        for name in ("healer", "ahead"):
            clients[name].heartbeat(name)
        first: dict[str, list[str] | str] = {}
        for thread in start_asking(clients, store, ("healer", "ahead"), 25, first):
            thread.join()
        assert first["healer"] == ["ahead", "healer"]

        beats = [threading.Thread(target=heartbeat, args=(name,), daemon=True)
                 for name in ("healer", "ahead", "replacement")]
        for thread in beats:
            thread.start()
        # The healer and the replacement (both at step 26) ask; the replica at step 27 asks late.
        second: dict[str, list[str] | str] = {}
        behind = start_asking(clients, store, ("healer", "replacement"), 26, second)
        time.sleep(STRAGGLER_LATE_S)
        formed_without_it = dict(second)
        second["ahead"] = ask_quorum(clients["ahead"], store, "ahead", 27)
        for thread in behind:
            thread.join()
    finally:
        stop.set()
        lighthouse.shutdown()
    assert not formed_without_it, f"a quorum formed without the live replica ahead: {formed_without_it}"
    assert second == {name: ["ahead", "healer", "replacement"] for name in ("healer", "replacement", "ahead")}
