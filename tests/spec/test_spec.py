"""Job spec validation: every kind of bad spec is refused before any Ray worker starts, with a
message that names the key and the valid choices."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardyard.layout.world_size import at_world_size, grad_accum_steps
from shardyard.cli import main
from shardyard.spec import JobSpec, SpecError, load_spec
from helpers.repo import REPO, SHARDYARD

DEFAULT_JOB = REPO / "jobs" / "configs" / "gpt_ddp.yaml"


def write(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_default_job_is_valid() -> None:
    spec = load_spec(DEFAULT_JOB)
    assert spec.parallelism.strategy == "ddp"
    assert spec.scaling.num_workers == 2
    assert grad_accum_steps(spec, 2) == 2
    assert Path(spec.checkpoint.storage_path).is_absolute()


def test_a_relative_storage_path_in_a_submitted_jobs_copy_is_refused(tmp_path: Path, monkeypatch) -> None:
    """In Ray's copy of a job's --working-dir a relative storage path would put the run there;
    anywhere else it resolves against the current directory, and absolute paths and URIs pass."""
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    with pytest.raises(SpecError, match=r"storage_path 'runs' is relative.*Ray's copy.*\$PWD/runs"):
        load_spec(DEFAULT_JOB)
    assert load_spec(DEFAULT_JOB, [f"checkpoint.storage_path={tmp_path}/runs"]).checkpoint.storage_path == \
        str(tmp_path / "runs")
    assert load_spec(DEFAULT_JOB, ["checkpoint.storage_path=s3://bucket/runs"]).checkpoint.storage_path == \
        "s3://bucket/runs"
    monkeypatch.chdir(tmp_path)
    assert load_spec(DEFAULT_JOB).checkpoint.storage_path == str(tmp_path / "runs")


def test_the_served_context_is_every_position_a_model_has_up_to_a_sliding_window() -> None:
    """A Hugging Face run trained on 64-token samples serves the model's 256 positions; no wider
    than a sliding window its layers attend through; a GPT's learnt positions stop at block_size."""
    from shardyard.checkpoint.layout import serving_context

    llama = REPO / "jobs" / "configs" / "llama_fsdp.yaml"
    assert serving_context(load_spec(llama).model) == 256
    sliding = ["model.config.architecture=mistral", "model.config.sliding_window=128"]
    assert serving_context(load_spec(llama, sliding).model) == 128
    assert serving_context(load_spec(llama, ["model.block_size=256"]).model) == 256
    assert serving_context(load_spec(DEFAULT_JOB).model) == 64


def test_overrides_parse_values_and_nest() -> None:
    spec = load_spec(DEFAULT_JOB, ["optim.lr=3e-4", "scaling.num_workers=4", "run.name=other"])
    assert spec.optim.lr == pytest.approx(3e-4)
    assert spec.scaling.num_workers == 4
    assert spec.run.name == "other"
    assert grad_accum_steps(spec, 4) == 1


def test_missing_sections_take_defaults() -> None:
    spec = load_spec(None, ["model.n_layer=2"])
    assert isinstance(spec, JobSpec) and spec.model.name == "gpt" and spec.model.n_layer == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim.lrr=1"], ["unknown key 'optim.lrr'", "lr", "warmup_steps"]),
        (["model.n_layr=2"], ["unknown key 'model.n_layr' (did you mean 'n_layer'?)"]),
        (["trainer.steps=2"], ["unknown key 'trainer'", "parallelism", "scaling"]),
        (["parallelism.strategy=ddpp"], ["parallelism.strategy", "(got 'ddpp'; did you mean 'ddp'?)"]),
        (["model.name=bert"], ["model", "'gpt'", "'mlp'"]),
        (["model.name=gtp"], ["(got 'gtp'; did you mean 'gpt'?)"]),
        (["run.steps=ten"], ["run.steps", "integer", "'ten'"]),
        (["run.steps=0"], ["run.steps", "greater than or equal to 1"]),
        (["scaling.use_gpu=maybe"], ["scaling.use_gpu", "'auto'"]),
        (["batch.global_batch_size=30"],
         ["batch.global_batch_size (30)", "batch.micro_batch_size", "world size 2", "8 x 2 = 16"]),
        (["scaling.num_workers=3"], ["world size 3", "8 x 3 = 24"]),
        (["scaling.num_workers=null", "scaling.min_workers=2", "scaling.max_workers=4"],
         ["world size 3", "8 x 3 = 24"]),
        (["scaling.min_workers=2", "scaling.max_workers=4"], ["either scaling.num_workers"]),
        (["scaling.num_workers=null", "scaling.min_workers=4", "scaling.max_workers=2"],
         ["scaling.min_workers (4) exceeds scaling.max_workers (2)"]),
        (["scaling.num_workers=null", "scaling.min_workers=2"], ["both scaling.min_workers"]),
        (["model.n_head=3"], ["model.n_embd (128)", "model.n_head (3)"]),
        (["model.name=mlp", "model.n_head=2"], ["unknown key 'model.n_head'", "hidden_dim"]),
        (["checkpoint.every_n_steps=0"], ["checkpoint.every_n_steps"]),
        (["run.name=../escape"], ["run.name: must be one directory name"]),
        (["run.name=.."], ["run.name: must be one directory name", "not only dots"]),
        (["optim"], ["override 'optim' must look like section.key=value"]),
        # parallelism: mesh shapes, schedules, models that cannot be split
        (["parallelism.strategy=fsdp", "parallelism.tp=2", "scaling.num_workers=3"],
         ["world size 3 is not a multiple of parallelism.pp x parallelism.tp = 1 x 2"]),
        (["parallelism.strategy=pipeline", "parallelism.pp=2", "model.tie_weights=false",
          "parallelism.schedule=zigzag"], ["parallelism.schedule", "'gpipe'", "'1f1b'", "'interleaved_1f1b'"]),
        (["parallelism.strategy=pipeline", "parallelism.pp=2"], ["set model.tie_weights=false"]),
        (["parallelism.strategy=pipeline", "parallelism.pp=2", "model.tie_weights=false",
          "parallelism.schedule=interleaved_1f1b", "parallelism.stages_per_rank=4",
          "model.n_layer=6"], ["the model's 6 blocks cannot be split into 8 pipeline stages"]),
        (["parallelism.strategy=pipeline", "parallelism.pp=2", "model.tie_weights=false",
          "parallelism.split_points=[4]"], ["parallelism.split_points must be 1 increasing", "got [4]"]),
        (["parallelism.strategy=pipeline", "parallelism.pp=2", "model.tie_weights=false",
          "parallelism.schedule=interleaved_1f1b"], ["'interleaved_1f1b' goes with", "stages_per_rank >= 2"]),
        (["parallelism.strategy=pipeline"], ["'pipeline' needs parallelism.pp >= 2"]),
        (["parallelism.strategy=pipeline", "parallelism.pp=2", "model.tie_weights=false",
          "batch.micro_batch_size=32"], ["'1f1b' needs at least parallelism.pp (2) micro-batches", "is 1"]),
        (["parallelism.strategy=tensor", "parallelism.tp=2", "scaling.num_workers=4"],
         ["parallelism.tp (2) must equal the world size"]),
        (["parallelism.strategy=fsdp", "parallelism.tp=2", "model.n_head=3", "model.n_embd=96"],
         ["model.n_head (3) must be divisible by parallelism.tp (2)"]),
        (["parallelism.strategy=zero2", "parallelism.tp=2"], ["'zero2' is pure data parallel"]),
        (["parallelism.strategy=zero2", "scaling.resize=in_place"],
         ["scaling.resize 'in_place'", "not strategy 'zero2'", "DeepSpeed reshards ZeRO's state only through a checkpoint",
          "leave scaling.resize at 'restart'"]),
        (["parallelism.strategy=fsdp", "parallelism.tp=2", "scaling.resize=in_place"],
         ["scaling.resize 'in_place'", "with pp 1 and tp 2"]),
        (["scaling.resize=inplace"], ["scaling.resize", "(got 'inplace'; did you mean 'in_place'?)"]),
        (["scaling.num_workers=null", "scaling.min_workers=2", "scaling.max_workers=5",
          "batch.micro_batch_size=2", "batch.global_batch_size=24"],
         ["not for world size 5 (2 x 5 = 10)", "batch.allow_global_batch_change=true"]),
        (["parallelism.strategy=fsdp", "parallelism.tp=2", "scaling.num_workers=null",
          "scaling.min_workers=2", "scaling.max_workers=3"],
         ["world size 3 is not a multiple of parallelism.tp (2)"]),
        (["parallelism.strategy=zero4"], ["parallelism.strategy", "'zero3'", "'fsdp'"]),
        # asynchronous strategies
        (["parallelism.strategy=ddp", "parallelism.sync_every=4"], ["sync_every applies to strategy 'local_sgd'"]),
        (["parallelism.strategy=local_sgd", "parallelism.sync_every=3"],
         ["checkpoint.every_n_steps (50) must be a multiple of parallelism.sync_every (3)"]),
        (["parallelism.max_staleness=2"], ["num_servers and max_staleness apply to strategy 'parameter_server'"]),
        (["parallelism.strategy=parameter_server", "scaling.num_workers=null", "scaling.min_workers=2",
          "scaling.max_workers=3", "batch.allow_global_batch_change=true"],
         ["batch.global_batch_size (32) into one batch per worker slot (3", "micro_batch_size (8)"]),
        (["parallelism.strategy=parameter_server", "parallelism.max_staleness=-1"],
         ["parallelism.max_staleness", "greater than or equal to 0"]),
        (["parallelism.strategy=parameter_server", "scaling.recovery=hot"], ["runs its own actors"]),
        (["parallelism.strategy=fsdp", "parallelism.tp=2", "scaling.num_workers=4",
          "batch.global_batch_size=24", "batch.micro_batch_size=16"],
         ["batch.global_batch_size (24)", "world size 4 (16 x 2 = 32)"]),
        # prepared data and validation
        (["data.name=shards"], ["data.name 'shards' needs data.path"]),
        (["eval.every_n_steps=10"], ["eval.every_n_steps needs data.name 'shards'"]),
        (["data.name=shards", "data.path=/d", "eval.every_n_steps=10", "parallelism.strategy=parameter_server"],
         ["not supported with parallelism.strategy 'parameter_server'"]),
        (["data.validation_path=/v"], ["data.validation_path applies to data.name 'shards' only"]),
        (["eval.batchez=2"], ["unknown key 'eval.batchez'", "every_n_steps"]),
        # publishing to a serving app
        (["checkpoint.publish_to=app", "parallelism.strategy=local_sgd"],
         ["checkpoint.publish_to", "not parallelism.strategy 'local_sgd'"]),
        (["checkpoint.publish_to=app", "parallelism.strategy=fsdp", "parallelism.pp=2"], ["with pp 2"]),
        (["checkpoint.publish_to=my app"], ["checkpoint.publish_to", "pattern"]),
        (["checkpoint.publish_every_n_steps=0"], ["checkpoint.publish_every_n_steps", "greater than or equal to 1"]),
    ],
)
def test_bad_specs_are_named(overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(DEFAULT_JOB, overrides)
    for fragment in expected:
        assert fragment in str(err.value), f"{fragment!r} not in:\n{err.value}"


ELASTIC = ["scaling.num_workers=null", "scaling.min_workers=2", "scaling.max_workers=4"]


def test_elastic_pipeline_is_replanned_when_world_size_does_not_fit() -> None:
    spec = load_spec(DEFAULT_JOB, [*ELASTIC, "parallelism.strategy=pipeline", "parallelism.pp=2",
                                   "model.tie_weights=false", "batch.micro_batch_size=4",
                                   "batch.global_batch_size=48"])
    # 4 and 2 keep two stages (fewer data-parallel replicas); 3 cannot, and runs without a pipeline.
    assert at_world_size(spec, 4) is spec and at_world_size(spec, 2) is spec
    three = at_world_size(spec, 3).parallelism
    assert (three.strategy, three.pp, three.dp_size(3)) == ("ddp", 1, 3)
    fsdp_pp = load_spec(DEFAULT_JOB, [*ELASTIC, "scaling.max_workers=6", "parallelism.strategy=fsdp",
                                      "parallelism.pp=3", "model.tie_weights=false",
                                      "batch.micro_batch_size=2", "batch.global_batch_size=120"])
    assert (at_world_size(fsdp_pp, 4).parallelism.pp, at_world_size(fsdp_pp, 4).parallelism.strategy) == (2, "fsdp")


def test_global_batch_change_only_when_allowed() -> None:
    overrides = [*ELASTIC, "batch.micro_batch_size=4", "batch.global_batch_size=32"]
    with pytest.raises(SpecError, match="not for world size 3"):
        load_spec(DEFAULT_JOB, overrides)
    spec = load_spec(DEFAULT_JOB, [*overrides, "batch.allow_global_batch_change=true"])
    assert at_world_size(spec, 4).batch.global_batch_size == 32
    assert at_world_size(spec, 3).batch.global_batch_size == 36  # nearest multiple of 4 x 3
    assert grad_accum_steps(at_world_size(spec, 3), 3) == 3


def test_mlp_needs_synthetic_data() -> None:
    with pytest.raises(SpecError, match="'mlp' trains on data.name 'synthetic'"):
        load_spec(None, ["model.name=mlp"])
    assert load_spec(None, ["model.name=mlp", "data.name=synthetic"]).model.hidden_dim == 64


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML") as err:
        load_spec(bad)
    assert f'in "{bad}", line 2' in str(err.value)  # YAML's own pointer names the file
    bad.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(bad)




def run_entrypoint(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entrypoint", [[SHARDYARD, "train"], [sys.executable, "jobs/train.py", "--config"]],
                         ids=["shardyard-cli", "job-entrypoint"])
@pytest.mark.parametrize(
    "overrides, message",
    [(["optim.lrr=1"], "unknown key 'optim.lrr'"),
     (["batch.global_batch_size=30"], "batch.global_batch_size (30)"),
     (["data.path=/nonexistent/corpus"], "data.path '/nonexistent/corpus' does not exist")],
)
def test_entrypoints_refuse_bad_specs_before_ray(entrypoint: list[str], overrides: list[str],
                                                 message: str, tmp_path: Path) -> None:
    """As a user runs them: exit 2, one clear message, no traceback, and Ray never started. The
    runs go to storage of the test's own: the checkout's runs/ holds the user's quick start."""
    overrides = [*overrides, f"checkpoint.storage_path={tmp_path}"]
    proc = run_entrypoint([*entrypoint, str(DEFAULT_JOB), *[a for o in overrides for a in ("--set", o)]])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert message in proc.stderr
    assert "Traceback" not in output
    assert "Ray instance" not in output and "Connecting to existing Ray cluster" not in output


def test_cli_main_returns_2_on_bad_spec(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, {"batch": {"global_batch_size": 30}, "data": {"name": "synthetic"}})
    assert main(["train", str(path)]) == 2
    assert "batch.global_batch_size (30)" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["source.path=/x", "output.path=/o", "source.fromat=jsonl"], "unknown key 'source.fromat'"),
    (["source.path=/x"], "output"),
    (["source.path=/x", "output.path=/o", "tokenizer.name=bytes", "tokenizer.train.vocab_size=500"],
     "give one of tokenizer.name, tokenizer.path, tokenizer.train"),
    (["source.path=/x", "output.path=/o", "source.format=csv"], "'parquet'"),
    (["source.path=/x", "output.path=/o", "output.validation_fraction=1.5"], "output.validation_fraction"),
])
def test_bad_data_specs_are_named(overrides: list[str], message: str) -> None:
    from shardyard.data.prepare import load_prepare_spec

    with pytest.raises(SpecError, match=re.escape(message)):
        load_prepare_spec(None, overrides)


@pytest.mark.timeout(120)
def test_prepare_refuses_bad_input_with_exit_2_and_no_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "data.yaml"
    spec.write_text(f"source: {{path: {tmp_path / 'missing'}}}\noutput: {{path: {tmp_path / 'out'}}}\n")
    done = run_entrypoint([SHARDYARD, "prepare", str(spec)])
    assert done.returncode == 2 and "matches no text files" in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = run_entrypoint([SHARDYARD, "prepare", str(spec), "--set", "output.shard_tokens=5"])
    assert done.returncode == 2 and "output.shard_tokens" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_config_extends_another_section_by_section(tmp_path: Path) -> None:
    """`base:` merges a file's sections over another's (a model of another kind replaces the
    base's whole), overrides come last, and a loop or a missing base is named."""
    (tmp_path / "base.yaml").write_text("model: {name: gpt, n_layer: 2, n_head: 2}\noptim: {lr: 0.01, warmup_steps: 5}\n"
                                        "run: {name: base, steps: 7}\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\noptim: {lr: 0.02}\nrun: {name: top}\n")
    spec = load_spec(tmp_path / "top.yaml", ["run.steps=9"])
    assert (spec.model.n_layer, spec.optim.lr, spec.optim.warmup_steps, spec.run.name, spec.run.steps) == \
        (2, 0.02, 5, "top", 9)
    (tmp_path / "hf.yaml").write_text("base: base.yaml\nmodel: {name: mlp, in_dim: 4}\ndata: {name: synthetic}\n")
    assert load_spec(tmp_path / "hf.yaml").model.in_dim == 4  # no GPT keys carried into the MLP
    (tmp_path / "loop.yaml").write_text("base: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(SpecError, match="extends itself"):
        load_spec(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(SpecError, match="does not exist \\(the base of"):
        load_spec(tmp_path / "orphan.yaml")
    for name in ("gpt_shards", "llama_fsdp"):  # the shipped configs extend the default job
        assert load_spec(REPO / "jobs" / "configs" / f"{name}.yaml").optim.warmup_steps == 20
