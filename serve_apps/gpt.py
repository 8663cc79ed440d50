"""Serve a shardyard checkpoint over HTTP (completions from the GPT, a Hugging Face model or a
custom language model; or MLP predictions), or a Hugging Face model directory as it is.

    serve run serve_apps.gpt:app                                  # the default job's latest checkpoint
    serve run serve_apps.gpt:app checkpoint=runs/my_run num_shards=2
    serve run serve_apps.gpt:app checkpoint=runs/llama_fsdp engine.num_shards=2 engine.sharding=tensor
    serve deploy serve_apps/config.yaml                           # on a running cluster

`app` is a Serve application builder: the `key=value` arguments (or `args:` in a Serve config
file) are shardyard.serve.config.ServeConfig fields, validated before anything starts.
"""

from __future__ import annotations

import sys
from typing import Any

import ray
from ray import serve

try:
    from shardyard.serve.app.deployment import build_app
    from shardyard.spec import SpecError
except ImportError:
    sys.exit("shardyard is not installed in this Python: run `pip install -e .` in the checkout")


def app(args: dict[str, Any]) -> serve.Application:
    try:
        return build_app(args)
    except SpecError as err:  # a message, not a traceback: no checkpoint yet, a misspelled key
        if ray.is_initialized() and ray.get_runtime_context().get_task_id() is not None:
            # Built by Serve's controller in a task (a config file's app): exiting would kill the
            # worker, Ray would retry the build and report only a crash; an error carries the reason.
            raise ValueError(f"shardyard: {err}") from None
        sys.exit(f"shardyard: {err}")
