"""Publishing a run's weights to a serving app on the same cluster (`checkpoint.publish_to`), for
evaluation while training and on-policy rollouts: every `publish_every_n_steps` (and at the last
step) the whole model is gathered to rank 0's memory (Engine.full_state_dict: torch.distributed's
state-dict API for DDP, FSDP and tensor parallelism, DeepSpeed's gathering for ZeRO), put once in
Ray's object store, and its reference handed to the app's AppWeights. The app's shards each
take their own part of it (serve/, checkpoint/published.py): no storage is written or read on the
way. The weights live as long as the worker that put them (rank 0); the run's checkpoints remain
what outlives it. An app that is not there, or not answering, is reported once; training goes on.
"""

from __future__ import annotations

import time

import ray
from ray import serve

from shardyard.checkpoint.lease import LeaseLost
from shardyard.checkpoint.published import APP_WEIGHTS, Published
from shardyard.train.trainer import Callback, Trainer

PUT_TIMEOUT_S = 30.0


class WeightsPublisher(Callback):
    def __init__(self, app: str, every: int) -> None:
        self.app, self.every = app, every
        self.reported = False

    def on_step_end(self, trainer: Trainer) -> None:
        step = trainer.state.step
        if step % self.every and step != trainer.spec.run.steps:
            return
        state = trainer.engine.full_state_dict()  # collective: rank 0 gets the whole model, on the CPU
        if trainer.rank != 0:
            return
        started = time.perf_counter()
        fence = trainer.guard.fence
        try:  # fenced as a commit is: a launch that lost the run publishes nothing more
            if fence is not None:
                fence()
        except (LeaseLost, OSError) as err:
            print(f"shardyard: not publishing step {step}: {err}", flush=True)
            return
        try:
            app_weights = serve.get_deployment_handle(APP_WEIGHTS, app_name=self.app)
            published = Published(trainer.spec.run.name, step, trainer.spec.model, [ray.put(state)],
                                  generation=getattr(fence, "generation", 0), attempt=getattr(fence, "attempt", None) or 0)
            app_weights.put.remote(published).result(timeout_s=PUT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - serving's trouble must not stop training
            if not self.reported:
                print(f"shardyard: could not publish step {step} to the Serve app '{self.app}' "
                      f"({type(err).__name__}: {err}); training goes on, and will try again", flush=True)
                self.reported = True
            return
        self.reported = False
        print(f"shardyard: published step {step} to '{self.app}' in {time.perf_counter() - started:.2f} s",
              flush=True)
