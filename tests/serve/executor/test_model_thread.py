"""A model decoded in the replica runs on one thread, whoever calls it, and staging other weights
beside it takes no intra-op threads from it (serve/executor/model_thread.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from shardyard.serve.executor.model_thread import ModelThread, one_intra_op_thread


@pytest.mark.timeout(60)
def test_staging_on_another_thread_leaves_the_model_thread_its_intra_op_threads() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model_thread = ModelThread()
    try:
        with one_intra_op_thread():
            assert torch.get_num_threads() == 1
            assert model_thread.run(torch.get_num_threads) == 2
        assert torch.get_num_threads() == 2
    finally:
        model_thread.close()
        torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_a_model_in_the_replica_loads_and_decodes_on_its_own_thread_whoever_calls(tmp_path: Path) -> None:
    from shardyard.serve.executor.local_model import LocalModel
    from helpers.models import LLAMA, save_llama
    model = LocalModel(str(save_llama(tmp_path / "llama")))
    ran_on: list[int] = []
    forward = model.model.forward

    def recorded(*args: object, **kwargs: object) -> object:
        ran_on.append(threading.get_ident())
        return forward(*args, **kwargs)

    model.model.forward = recorded
    try:
        tokens = torch.randint(0, LLAMA["vocab_size"], (1, 5))
        here = model.forward(tokens)
        with ThreadPoolExecutor(2) as callers:
            there = [f.result() for f in [callers.submit(model.forward, tokens) for _ in range(4)]]
        assert all(torch.equal(logits, here) for logits in there)
        assert len(ran_on) == 5 and len(set(ran_on)) == 1
        assert ran_on[0] == model.thread.run(threading.get_ident) != threading.get_ident()
    finally:
        model.close()
