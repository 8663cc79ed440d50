"""README's quick start as a user on this 2-core machine runs it: `shardyard train
jobs/configs/gpt_ddp.yaml` from the checkout with no Ray cluster running, so the command starts a
local Ray instance with this machine's CPUs. Only the run's length and storage are overridden
(`--set`, as README documents), to keep the test short and the checkout clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.user_shell import ray_files_of_their_own, user_environment
from shardyard.storage.events import read_events
from shardyard.checkpoint.layout import serving_spec
from shardyard.checkpoint.loaders import find_latest
from shardyard.checkpoint.record import checkpoint_name
from shardyard.train.metrics import LOSS_PLOT, read_metrics
from helpers.repo import REPO, SHARDYARD



@pytest.mark.ray
@pytest.mark.timeout(900)
def test_readme_default_job_trains_on_a_local_ray_it_starts_and_continues_twice_after_pruning(
        tmp_path: Path, ray_cluster) -> None:
    """The quick start (beside another Ray on the machine: the session's), then the same command
    launched again longer, twice, the second time with README's spec override (`--set
    optim.lr=3e-4 --set scaling.num_workers=4`: 4 workers on this machine's 2 cores): the default
    job's `checkpoint.keep: 2` prunes on every launch, and each launch goes on where the last ended
    (a pruned run once could not be launched again). Then `shardyard export` of the run."""
    def default_job(steps: int, *overrides: str) -> list[str]:
        return [SHARDYARD, "train", "jobs/configs/gpt_ddp.yaml", *(a for o in overrides for a in ("--set", o)),
                "--set", f"run.steps={steps}", "--set", "run.log_every=4", "--set", "checkpoint.every_n_steps=4",
                "--set", f"checkpoint.storage_path={tmp_path}"]

    run_dir = tmp_path / "gpt_ddp"
    readme_override = ("optim.lr=3e-4", "scaling.num_workers=4")
    for previous, steps, overrides in ((None, 12, ()), (12, 16, ()), (16, 20, readme_override)):
        with ray_files_of_their_own() as ray_tmp:
            done = subprocess.run(default_job(steps, *overrides), cwd=REPO, env=user_environment(ray_tmp),
                                  capture_output=True, text=True, timeout=400)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        assert f"step {steps}/{steps}" in output and "shardyard run 'gpt_ddp'" in output, output[-4000:]
        # Each progress line once (Ray Train's print patch once doubled them), and no warning from
        # Ray Train's placement-group cleaner, which warned every second without the dashboard.
        assert output.count(f"step {steps}/{steps} |") == 1, output[-4000:]
        # A relaunch says where it picks up and what the command changed.
        if previous is None:
            assert "resumes from" not in output, output[-4000:]
        else:
            changed = "; optim.lr 0.001 -> 0.0003" if overrides else ""
            changed += f"; run.steps {previous} -> {steps}" + ("; scaling.num_workers 2 -> 4" if overrides else "")
            assert (f"shardyard: run 'gpt_ddp' resumes from {run_dir / checkpoint_name(previous)} "
                    f"(step {previous}, ddp on 2 workers){changed}\n") in output, output[-4000:]
        assert "Ray Train Controller actor state" not in output, output[-4000:]
        # The session's cluster runs beside the command's own Ray (`ray_cluster`): Ray Train's
        # placement-group cleaner once asked that one about the run's controller, found none, quit.
        assert "Found multiple active Ray instances" not in output, output[-4000:]
        assert "Failed to register placement group with cleaner" not in output, output[-4000:]
        assert "Token authentication is enabled" not in output, output[-4000:]  # Ray's notice at every start
        assert "PreemptionWatcher" not in output, output[-4000:]  # Ray's note on its own actor, at every start
        assert find_latest(run_dir).name == checkpoint_name(steps)
        assert len(list(run_dir.glob("checkpoint_step_*"))) == 2  # checkpoint.keep: 2 pruned the rest
    # The same command once more: the run is already there, said at once, nothing launched.
    launches = [e for e in read_events(run_dir) if e["event"] == "launch"]
    with ray_files_of_their_own() as ray_tmp:
        again = subprocess.run(default_job(20), cwd=REPO, env=user_environment(ray_tmp), capture_output=True,
                               text=True, timeout=120)
    assert again.returncode == 0 and "run 'gpt_ddp' is already at step 20 (run.steps=20): nothing to train" \
        in again.stderr, again.stdout + again.stderr
    assert [e for e in read_events(run_dir) if e["event"] == "launch"] == launches
    rows = read_metrics(run_dir)
    assert [(row["step"], row["world_size"]) for row in rows] == [(4, 2), (8, 2), (12, 2), (16, 2), (20, 4)], rows
    assert rows[-1]["lr"] <= 3e-4
    assert (run_dir / LOSS_PLOT).stat().st_size > 0
    export = subprocess.run([SHARDYARD, "export", str(run_dir), str(tmp_path / "model.safetensors")], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0 and (tmp_path / "model.safetensors").stat().st_size > 0, export.stderr[-4000:]


def run_as_user(command: list[str], ray_tmp: str) -> str:
    """One README command from the checkout, as the user's shell runs it; its output, checked ok."""
    done = subprocess.run(command, cwd=REPO, env=user_environment(ray_tmp), capture_output=True, text=True,
                          timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_readme_model_commands_pretrain_a_llama_and_export_it_for_transformers(tmp_path: Path) -> None:
    """README's "Bringing a model": `shardyard train jobs/configs/llama_fsdp.yaml` (FSDP2 on 2
    workers of this machine's own Ray), then `shardyard export RUN --format hf OUT`, which
    transformers loads with the trained model's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardyard.checkpoint.loaders import load_model

    with ray_files_of_their_own() as ray_tmp:
        output = run_as_user([SHARDYARD, "train", "jobs/configs/llama_fsdp.yaml", "--set", "run.steps=4",
                              "--set", "run.log_every=2", "--set", f"checkpoint.storage_path={tmp_path}"], ray_tmp)
    assert "step 4/4" in output and "shardyard run 'llama_fsdp' (fsdp)" in output, output[-4000:]
    run_dir = tmp_path / "llama_fsdp"
    assert {row["world_size"] for row in read_metrics(run_dir)} == {2}
    # Trained on 64-token samples, served over the model's 256 positions.
    assert serving_spec(find_latest(run_dir)).model.block_size == 256
    export = subprocess.run([SHARDYARD, "export", str(run_dir), "--format", "hf", str(tmp_path / "out" / "llama")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-4000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "llama")
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, load_model(find_latest(run_dir))(tokens),
                                   rtol=0, atol=1e-5)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_readme_data_commands_prepare_shards_and_train_on_them(tmp_path: Path) -> None:
    """`shardyard prepare jobs/configs/data_bpe.yaml` (a Ray Data job on a local Ray it starts:
    this checkout's sources, a BPE trained on them) and `shardyard train jobs/configs/gpt_shards.yaml`
    on those shards; only where they write and the run's length are overridden."""
    data = tmp_path / "data"
    with ray_files_of_their_own() as ray_tmp:
        run_as_user([SHARDYARD, "prepare", "jobs/configs/data_bpe.yaml", "--set", f"output.path={data}"], ray_tmp)
    with ray_files_of_their_own() as ray_tmp:
        output = run_as_user([SHARDYARD, "train", "jobs/configs/gpt_shards.yaml", "--set", f"data.path={data}",
                              "--set", "run.steps=4", "--set", "run.log_every=2",
                              "--set", f"checkpoint.storage_path={tmp_path / 'runs'}"], ray_tmp)
    assert "step 4/4" in output, output[-4000:]
    run_name = next((tmp_path / "runs").iterdir()).name
    assert find_latest(tmp_path / "runs" / run_name).name == "checkpoint_step_00000004"


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_readme_default_job_on_a_one_gpu_machine_trains_at_once_and_says_where(tmp_path: Path) -> None:
    """README's command on a machine with one GPU (a local Ray given one fake GPU resource, as Ray
    reads it from RAY_OVERRIDE_RESOURCES): two workers cannot share it and the instance cannot
    grow, so the job trains on CPU, saying so, instead of waiting forever for a second GPU."""
    with ray_files_of_their_own() as ray_tmp:
        done = subprocess.run([SHARDYARD, "train", "jobs/configs/gpt_ddp.yaml", "--set", "run.steps=2",
                               "--set", f"checkpoint.storage_path={tmp_path}"], cwd=REPO, capture_output=True,
                              text=True, timeout=110,
                              env={**user_environment(ray_tmp), "RAY_OVERRIDE_RESOURCES": '{"GPU": 1}'})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert ("shardyard: 1 GPU cannot hold 2 workers and this machine's Ray instance cannot grow, so training "
            "runs on CPU; --set scaling.num_workers=1 trains on the GPU") in output, output[-4000:]
    assert "waiting for it to scale up" not in output and "step 2/2" in output, output[-4000:]


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_a_task_of_the_users_own_trains_from_their_directory_and_python_continues_it_under_fsdp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """jobs/vision.py's image classifier as a user's own module, dataset and loss in their own
    directory, run there without PYTHONPATH (the spec's check on the driver and the Ray Train
    workers of the local Ray started for it import it from there): `shardyard train` with DDP on 2
    workers to step 2, then the same run continued from Python (`shardyard.api.fit`, the functions
    passed as objects) under FSDP on 1 worker to step 4, then exported with `shardyard export`.
    Every sample once (the ledger), and the exported parameters those of one process trained on
    the whole batch (plain SGD)."""
    import shutil

    import torch

    from safetensors.torch import load_file
    from shardyard.data.ledger import audit
    from shardyard.models import build_model
    from shardyard.parallel import single_process
    from shardyard.spec import load_spec
    from helpers.oracle import steps

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "jobs" / "vision.py", project / "vision.py")
    (project / "job.yaml").write_text(
        f"base: {REPO / 'jobs' / 'configs' / 'vision_ddp.yaml'}\n"
        "model: {factory: 'vision:small_cnn', options: {channels: 4, size: 8}}\n"
        "data: {factory: 'vision:SyntheticImages', options: {num_samples: 96, size: 8}}\n"
        "loss: {factory: 'vision:cross_entropy'}\n"
        "metrics: {factory: 'vision:accuracy'}\n"
        "optim: {name: sgd, lr: 0.2, grad_clip: 0.0, schedule: constant}\n"  # a schedule spans run.steps
        "batch: {global_batch_size: 16, micro_batch_size: 4}\n"
        f"checkpoint: {{storage_path: {tmp_path / 'runs'}, every_n_steps: 2}}\n"
        "run: {log_every: 1, sample_ledger: true}\n")
    (project / "train_more.py").write_text(
        "from shardyard.api import fit, job\n"
        "from vision import SyntheticImages, cross_entropy, small_cnn\n"
        "spec = job('job.yaml', ['run.steps=4', 'parallelism.strategy=fsdp', 'scaling.num_workers=1'])\n"
        "result = fit(spec, model=small_cnn, data=SyntheticImages, loss=cross_entropy)\n"
        "print('trained to', result.checkpoint)\n")
    run_dir = tmp_path / "runs" / "vision_ddp"
    for command, steps_ in (([SHARDYARD, "train", "job.yaml", "--set", "run.steps=2"], 2),
                            ([sys.executable, "train_more.py"], 4)):
        with ray_files_of_their_own() as ray_tmp:
            environment = {k: v for k, v in user_environment(ray_tmp).items() if k != "PYTHONPATH"}
            done = subprocess.run(command, cwd=project, env=environment, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and f"step {steps_}/{steps_}" in output, output[-4000:]
        assert "val accuracy" in output, output[-4000:]  # validated at each launch's last step (metrics.factory)
    assert f"trained to {run_dir / checkpoint_name(4)}" in output, output[-4000:]
    report = audit(run_dir, 96)
    assert report.steps == 4 and report.exact and report.world_sizes == [2, 2, 1, 1], report

    monkeypatch.syspath_prepend(str(project))  # the oracle imports the user's module as the run did
    spec = load_spec(project / "job.yaml", ["scaling.num_workers=1", "batch.micro_batch_size=16", "run.steps=4"])
    torch.manual_seed(spec.run.seed)
    oracle = single_process(spec, build_model(spec.model), torch.device("cpu"))
    steps(oracle, spec, 0, 4)
    # Exported at the end as the user would, from their directory: the weights as one file, the
    # factory imported only once named.
    exported = tmp_path / "model.safetensors"
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    export = [SHARDYARD, "export", str(run_dir), str(exported)]
    refused = subprocess.run(export, cwd=project, env=environment, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--trust-factory vision:small_cnn" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not exported.exists(), refused.stderr
    done = subprocess.run([*export, "--trust-factory", "vision:small_cnn"], cwd=project, env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    trained = load_file(exported)
    for name, value in oracle.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5, msg=name)
