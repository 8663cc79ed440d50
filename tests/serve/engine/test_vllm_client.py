"""vLLM's own load client, `vllm bench serve`, unmodified, against the app: what people use to
compare LLM servers must complete every request (it sends vLLM's sampling extensions:
`repetition_penalty` always, `ignore_eos` on random prompts), on the completions and the chat
endpoint, for a Hugging Face model directory and for a training run. And `engine: vllm`'s own
tests (test_vllm_engine.py), run under vLLM's python.

vLLM (its CPU build, about 3.5 GB) lives in an environment of its own:
`benchmarks/make_vllm_env.sh` (part of README's test command) makes it and links it at
`.vllm-env` (or where SHARDYARD_VLLM_ENV points). Without it these tests are skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from helpers.repo import REPO
from helpers.vllm_bench import VLLM, VLLM_ENV, bench, model_directory

pytestmark = pytest.mark.skipif(not VLLM.exists(), reason=f"no vLLM environment at {VLLM_ENV}: make it with "
                                                          f"benchmarks/make_vllm_env.sh")


@pytest.mark.timeout(900)
def test_vllms_bench_client_completes_every_request_against_a_model_directory_and_a_run(
        serving, tmp_path: Path, default_job_run: Path) -> None:
    """The run's model reads UTF-8 bytes, not the client's tokens: its prompts are kept short
    (6 of the client's tokens) so that prompt and output fit the 64-byte context."""
    directory = model_directory(tmp_path / "llama")
    apps = {"hf": (serving("hf", {"checkpoint": str(directory), "batching.max_batch_size": 8,
                                  "engine.cpus_per_shard": 0.5}), 32),
            "run": (serving("run", {"checkpoint": str(default_job_run), "batching.max_batch_size": 8,
                                    "engine.cpus_per_shard": 0.5}), 6)}
    for name, (url, prompt_tokens) in apps.items():
        for backend in ("openai", "openai-chat"):
            result = bench(url, directory, tmp_path / name, backend=backend, prompt_tokens=prompt_tokens)
            # Every request completed, each with its 16 tokens (ignore_eos: none ended early).
            assert (result["completed"], result["failed"]) == (24, 0), (name, backend, result.get("errors"))
            assert result["total_output_tokens"] == 24 * 16, (name, backend, result["total_output_tokens"])


@pytest.mark.ray  # its session starts a Ray cluster of its own
@pytest.mark.timeout(1800)
def test_the_engine_vllm_tests_pass_under_the_vllm_environments_python(tmp_path: Path) -> None:
    """`engine: vllm` decodes in the replica's process, so its tests need vLLM importable by the
    interpreter that runs them: they run here as a session of their own under the vLLM
    environment's python (with a Ray cluster of its own), and every one must pass, none skipped."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vLLM: tests/serve/engine/test_vllm_engine.py runs in this session")
    done = subprocess.run([str(VLLM_ENV / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=-ra",  # one session of its own: not split over workers as this one is
                           f"--basetemp={tmp_path}", "tests/serve/engine/test_vllm_engine.py"],
                          # This session's own options (PYTEST_ADDOPTS: its workers, say) are not that one's.
                          env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                          cwd=REPO, capture_output=True, text=True, timeout=1750)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "skipped" not in summary, done.stdout[-6000:] + done.stderr[-3000:]
