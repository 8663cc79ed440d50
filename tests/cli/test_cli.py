"""The `shardyard` command's own surface, as a user first meets it: help, version, the plan's
summary line, and a bad spec as a message with exit status 2. No Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardyard.cli import main
from shardyard.cli.plan import count
from helpers.repo import REPO

pytestmark = pytest.mark.timeout(60)


def test_help_lists_each_command_on_its_own_line_and_version_answers(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for command in ("train", "prepare", "export", "plan", "serve"):
        assert any(line.strip().startswith(f"shardyard {command} ") for line in lines), command
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("shardyard ")
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    text = capsys.readouterr().out
    assert "data spec" in text and "optim." not in text  # its own example, not training's


def test_plan_names_a_small_models_size_and_a_bad_spec_is_status_2(capsys, tmp_path: Path) -> None:
    assert (count(834_000), count(12_300_000), count(7.24e9), count(512)) == ("834K", "12.3M", "7.24B", "512")
    main(["plan", str(REPO / "jobs" / "configs" / "gpt_ddp.yaml")])
    assert "model gpt (8" in capsys.readouterr().out  # the default GPT: hundreds of thousands, not "0.00B"
    main(["plan", str(REPO / "jobs" / "configs" / "gpt_ddp.yaml"), "--gpus", "8"])  # README's command
    out = capsys.readouterr().out
    assert out.startswith("8 GPUs on 1 node(s), 80.0 GiB each") and "recommended:" in out
    (tmp_path / "bad.yaml").write_text("model:\n  name: gpt\n  n_layr: 2\n")
    assert main(["train", str(tmp_path / "bad.yaml")]) == 2
    assert "did you mean 'n_layer'?" in capsys.readouterr().err
    # The plan's own arguments: a size that is not one, and counts below their least, are a message.
    assert main(["plan", str(REPO / "jobs" / "configs" / "gpt_ddp.yaml"), "--gpus", "8", "--gpu-memory", "80XB"]) == 2
    assert "'80XB' is not a size" in capsys.readouterr().err
    for bad in (["--gpus", "-3"], ["--nodes", "0"]):
        with pytest.raises(SystemExit):
            main(["plan", str(REPO / "jobs" / "configs" / "gpt_ddp.yaml"), *bad])
        assert "shardyard plan: error: argument" in capsys.readouterr().err


def test_print_config_shows_the_resolved_spec_and_schema_is_json_schema(capsys) -> None:
    import json

    import yaml

    assert main(["train", str(REPO / "jobs" / "configs" / "llama_fsdp.yaml"), "--set", "run.steps=3",
                 "--print-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"]["name"] == "hf" and resolved["optim"]["warmup_steps"] == 20  # from its base
    assert resolved["run"]["steps"] == 3 and "base" not in resolved
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "JobSpec" and "parallelism" in schema["properties"]
    assert main(["schema", "--serve"]) == 0
    assert {"engine", "batching", "limits", "auth", "follow"} <= set(json.loads(capsys.readouterr().out)["properties"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", ["llama3_8b_fsdp", "qwen2_5_7b_fsdp_tp"])
def test_the_docs_show_what_plan_says_of_the_real_model_configs(capsys, config: str) -> None:
    main(["plan", str(REPO / "jobs" / "configs" / f"{config}.yaml"), "--gpus", "8", "--gpu-memory", "80GB"])
    out = capsys.readouterr().out.rstrip()
    assert out.splitlines()[0].startswith("8 GPUs on 1 node(s), 80.0 GiB each; model hf (")
    # A stale page fails here: regenerate its blocks with the command they show.
    assert out in (REPO / "docs" / "models.md").read_text()


@pytest.mark.timeout(30)
def test_a_cluster_recorded_on_this_machine_is_attached_to_only_while_it_answers(
        capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray start` records its cluster's address where `ray.init()` without one looks; a cluster
    killed without `ray stop` leaves the record, and Ray then waits for it without end (README's
    serve command did, after the test suite's cluster was killed). shardyard attaches only to a
    recorded cluster whose GCS port takes a connection, else starts its own."""
    import socket

    from shardyard.cluster import cluster_record, running_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    record = cluster_record()
    assert record == tmp_path / "ray" / "ray_current_cluster"
    assert running_cluster() is None  # no record
    record.parent.mkdir()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        record.write_text(address)
        assert running_cluster() == address
        # A record another user could have written (Ray's folder is writable by everyone) is
        # never followed: it could name a GCS of theirs, which would get this user's Ray token.
        for path, change in ((record.parent, lambda: record.parent.chmod(0o777)),
                             (record, lambda: record.chmod(0o666)),
                             (record, lambda: os.chown(record, 65534, -1))):
            change()
            assert running_cluster() is None
            assert f"not attaching to the Ray cluster recorded in {record}: {path}" in capsys.readouterr().err
            record.parent.chmod(0o755)
            record.chmod(0o644)
            os.chown(record, os.getuid(), -1)
        assert running_cluster() == address
    assert running_cluster() is None  # closed: gone, and said so
    assert "does not answer" in capsys.readouterr().err


def test_the_ray_token_file_of_a_local_instance_is_made_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray writes ~/.ray/auth_token at the umask: readable by every local user where home
    directories can be entered, and the token runs jobs as its owner."""
    from shardyard.cluster import keep_ray_token_private

    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("a-token")
    token.chmod(0o644)
    keep_ray_token_private()
    assert token.stat().st_mode & 0o777 == 0o600
