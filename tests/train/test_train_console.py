"""The training command's console filter (train/console.py), fed the lines Ray's driver prints
for a worker that failed: what stays on the console, what goes to the run's Ray log; and Ray
Train's last error put in the line the console ends with (train/outcomes.py)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from shardyard.train.console import RayConsole, RayLog
from shardyard.train.outcomes import failure_summary

WORKER, CONTROLLER = "\x1b[36m(RayTrainWorker pid=11)\x1b[0m ", "\x1b[36m(TrainController pid=7)\x1b[0m "


@pytest.mark.timeout(30)
def test_a_failures_tracebacks_go_to_the_log_and_the_console_keeps_shardyards_and_the_users_lines(
        tmp_path: Path) -> None:
    console = io.StringIO()
    log = RayLog(tmp_path / "ray_output.log", console)
    stream = RayConsole(console, log)
    lines = [
        WORKER + "step 20/40 | loss 4.0286 | 19,828 tok/s | 309.8 samples/s | world 2",
        CONTROLLER + "[2026-12-05 02:08:04,938 E 3431 3459] core_worker.cc:2465: Actor with class name: "
                     "'PreemptionWatcher' and ID: '74' has constructor arguments in the object store and "
                     "max_restarts > 0. If the arguments ...",
        WORKER + "Error in training function:",
        WORKER + "Traceback (most recent call last):",
        WORKER + '  File "/x/manager.py", line 307, in _fenced_everywhere',
        WORKER + "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer",
        "shardyard: worker lost (rank 1: WorkerHealthCheckFailedError); restarting from step 10 (1 of 3)",
        CONTROLLER + "Graceful shutdown of backend failed. This is expected if one of the workers has crashed.",
        CONTROLLER + "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
        WORKER + "step 30/40 | loss 3.2452",  # a line of shardyard's ends the worker's burst at once
        "\x1b[36m(RayTrainWorker pid=12)\x1b[0m loading my tokenizer",  # a user's own print
    ]
    for line in lines:
        print(line, file=stream)  # as Ray's driver does: the text, then the newline apart
    stream.write("\rtrain: 3/40")  # a progress bar's redraw is not held back for a newline
    stream.end()
    log.close()
    shown = console.getvalue()
    logged = (tmp_path / "ray_output.log").read_text()
    assert shown.split("\n") == [
        lines[0], f"shardyard: Ray's tracebacks of this launch go to {tmp_path / 'ray_output.log'}", lines[6],
        lines[9], lines[10], "\rtrain: 3/40"], shown
    for gone in ("PreemptionWatcher", "Traceback", "Connection closed by peer", "Graceful shutdown", "ActorDiedError"):
        assert gone in logged and gone not in shown
    assert "\x1b[" not in logged and "(TrainController pid=7) ray.exceptions.ActorDiedError" in logged


@pytest.mark.timeout(30)
def test_ray_trains_last_error_in_a_line_names_a_controllers_cause() -> None:
    """Ray Train's ControllerError says on its first line only that the controller failed; the
    cause is its second (a CI run's summary read `controller error:` and nothing more)."""
    from ray.train import ControllerError, WorkerGroupError

    stopped = ControllerError(TimeoutError("the State API did not answer\nin 10 s"))
    assert failure_summary(stopped) == "Ray Train's controller failed: TimeoutError: the State API did not answer"
    workers = WorkerGroupError("2 workers failed", {1: RuntimeError("Connection closed by peer\n..."),
                                                   0: ValueError("bad batch")})
    assert failure_summary(workers) == "rank 0: ValueError: bad batch; rank 1: RuntimeError: Connection closed by peer"


@pytest.mark.timeout(30)
def test_a_worker_actor_lost_under_ray_trains_controller_is_launched_again_and_nothing_else_is() -> None:
    """Ray Train's controller does not retry a worker actor that died while it started the group
    (its placement-group cleaner removed a live run's group once Ray's state API missed the
    controller: the run's workers died with it); the launch starts the group again. The training
    code's errors and the controller's own are not retried."""
    from ray.exceptions import ActorDiedError
    from ray.train import ControllerError, WorkerGroupError

    from shardyard.train.ray_train.run import lost_a_worker_actor

    assert lost_a_worker_actor(ControllerError(ActorDiedError()))
    assert not lost_a_worker_actor(ControllerError(TimeoutError("the State API did not answer")))
    assert not lost_a_worker_actor(WorkerGroupError("1 worker failed", {0: ValueError("bad batch")}))
