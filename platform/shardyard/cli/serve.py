"""`shardyard serve SOURCE`: the serving application (the same one `serve run
serve_apps/config.yaml` runs) on this machine's Ray, or on the cluster RAY_ADDRESS names, with
vLLM's flag names where they mean the same thing. Ctrl-C stops it.

    shardyard serve runs/gpt_ddp
    shardyard serve ./my-llama --tensor-parallel-size 2 --max-num-seqs 32 --api-key-file ~/.shardyard/serve_token
    SHARDYARD_API_KEY=... shardyard serve runs/gpt_ddp     # the token from the environment
    shardyard serve runs/llama_fsdp --served-model-name llama --port 8080 --set limits.max_tokens_limit=512
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from contextlib import ExitStack
from typing import Any

from shardyard import exit_codes
from shardyard.serve.app.ingress import DEFAULT_HEADER_TIMEOUT_S
from shardyard.serve.app.logs import ray_logs, serve_log_levels
from shardyard.spec import SpecError, apply_override

API_KEY_ENV = "SHARDYARD_API_KEY"  # the token from the environment (inherited by the replicas of a Ray started here)
APP_NAME = "shardyard"


HELP = "serve a run, a checkpoint or a Hugging Face model directory over HTTP (OpenAI API), with vLLM's flag names"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a run directory (its newest checkpoint), a checkpoint, or a Hugging "
                                       "Face model directory")
    parser.add_argument("--tensor-parallel-size", type=int, help="shards, each with a slice of every layer")
    parser.add_argument("--pipeline-parallel-size", type=int, help="shards, each with a contiguous run of layers")
    parser.add_argument("--max-num-seqs", type=int, help="requests decoded at once (max_batch_size)")
    parser.add_argument("--served-model-name", help="the model id clients name (default: the run's name or the "
                                                    "directory's)")
    parser.add_argument("--engine", choices=("builtin", "vllm"), help="vllm: vLLM decodes (needs vLLM installed)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the weights' and KV cache's dtype (default auto: float32 on CPUs, the checkpoint's "
                             "16-bit type on GPUs)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="every pass eager (default: decode steps compiled on GPUs, eager on CPUs)")
    key = parser.add_mutually_exclusive_group()
    # Kept only to refuse it with the way to do it: a token on the command line is in `ps` for every user.
    key.add_argument("--api-key", help=argparse.SUPPRESS)
    key.add_argument("--api-key-file", help="a file holding the bearer token requests need (only you may read it: "
                     f"chmod 600), at that path on every node; or set {API_KEY_ENV} (on this machine's Ray only)")
    parser.add_argument("--admin-token-file", help="a file holding the operator's token, the only one /admin/rollback "
                        "and /admin/promote take (without it they are off)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--header-timeout", type=positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S,
                        metavar="SECONDS",
                        help="a connection that has not sent a request's headers within this gets 408 and is closed; "
                             "one that pauses that long while sending a body or reading an answer is closed too "
                             "(when this command starts Ray itself: a cluster's ingress is set as it starts)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="any other serving setting, e.g. --set limits.max_tokens_limit=512 (repeatable)")


def positive_seconds(text: str) -> int:
    """Whole seconds, at least 1 (HAProxy's timeouts here are whole seconds)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds, at least 1")
    return int(text)


def serve_config(args: argparse.Namespace) -> dict[str, Any]:
    """The application's arguments from the command line (ServeConfig keys; vLLM's names where
    the config takes them too)."""
    if not os.path.isdir(args.source):  # before Ray starts, in the command's own words
        raise SpecError(f"{args.source!r} is not a directory here: shardyard serves a run, a checkpoint or a Hugging "
                        f"Face model directory on this machine's disk (a hub model: download it first, e.g. "
                        f"`huggingface-cli download {args.source} --local-dir DIR`, then serve DIR)")
    config: dict[str, Any] = {"checkpoint": args.source}
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "served_model_name"):
        if getattr(args, flag) is not None:
            config[flag] = getattr(args, flag)
    for flag, key in (("engine", "engine.backend"), ("dtype", "engine.dtype"), ("enforce_eager", "engine.enforce_eager")):
        if getattr(args, flag) is not None:
            config[key] = getattr(args, flag)
    if args.api_key is not None:
        raise SpecError(f"--api-key puts the token in the process list, where every user of this machine reads it; "
                        f"put it in a file only you can read (--api-key-file FILE, chmod 600) or in the environment "
                        f"variable {API_KEY_ENV}")
    if args.api_key_file:
        config["auth.bearer_token_file"] = os.path.abspath(args.api_key_file)
    elif os.environ.get(API_KEY_ENV):
        if os.environ.get("RAY_ADDRESS"):  # a cluster's replicas do not get this process's environment
            raise SpecError(f"{API_KEY_ENV} reaches the replicas of a Ray started here only; on a cluster "
                            "(RAY_ADDRESS is set) use --api-key-file with a path every node has")
        config["auth.bearer_token_env"] = API_KEY_ENV  # inherited by the local Ray's workers, not shown by Serve
    if args.admin_token_file:
        config["auth.admin_token_file"] = os.path.abspath(args.admin_token_file)
    for item in args.overrides:
        apply_override(config, item)
    if config.get("engine.backend") == "vllm" and not os.environ.get("RAY_ADDRESS") \
            and importlib.util.find_spec("vllm") is None:  # a local Ray's replicas run this Python
        raise SpecError(f"--engine vllm: vLLM is not installed in this Python ({sys.executable}): "
                        f"pip install 'shardyard[vllm]' (on a CPU, vLLM's CPU build: benchmarks/make_vllm_env.sh), "
                        f"or serve with the built-in engine (--engine builtin)")
    return config


def run(args: argparse.Namespace) -> int:
    """Validate, start (or join) Ray and Serve, run the application until Ctrl-C or SIGTERM."""
    try:
        config = serve_config(args)
    except SpecError as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.REFUSED
    import ray
    from ray import serve

    from shardyard.cluster import address_to_join, join, keep_ray_token_private, local_runtime_env, quiet_token_notice
    from shardyard.serve.app.deployment import build_app
    from shardyard.serve.app.ingress import haproxy_ingress
    from shardyard.serve.app.port_holder import claim

    address = address_to_join()
    own = address == "local"  # a Ray instance of this command's: HAProxy takes HTTP, with a header deadline
    taken = claim(args.host, args.port) if own else None  # an HAProxy orphan of a killed serve is stopped
    if taken is not None:
        print(f"shardyard: {taken}", file=sys.stderr)
        return exit_codes.REFUSED
    with ExitStack() as instance:
        if own:
            instance.enter_context(haproxy_ingress(args.header_timeout))
        try:
            if own:
                keep_ray_token_private()
                quiet_token_notice()
                ray.init(address=address, log_to_driver=True, runtime_env=local_runtime_env())
                keep_ray_token_private()  # Ray makes it at the umask when there was none
            else:
                join(address, log_to_driver=True)  # a cluster that cannot be joined: a SpecError
            instance.callback(ray.shutdown)
            app = build_app(config)
        except SpecError as err:
            print(f"shardyard: {err}", file=sys.stderr)
            return exit_codes.REFUSED
        serve_logging, app_logging = serve_log_levels(own)
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=serve_logging)
        if own:
            print(f"shardyard: Ray's and Serve's logs: {ray_logs()}", flush=True)
        return run_until_stopped(app, f"http://{args.host}:{args.port}/v1", app_logging)


def run_until_stopped(app: Any, url: str, logging_config: dict[str, Any] | None = None) -> int:
    """Run the application until Ctrl-C or SIGTERM, then delete it (on a shared cluster the other
    applications stay). `logging_config`: Serve's for the application's replicas."""
    from ray import serve

    # A list, not a threading.Event: a second Ctrl-C runs the handler again inside the first,
    # and Event.set taking its lock twice there hung the command for good.
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config=logging_config)
    except RuntimeError as err:  # a replica that could not start: Serve's reason, not a traceback
        print(f"shardyard: the application did not start: {err}", file=sys.stderr)
        return exit_codes.NOT_STARTED
    print(f"shardyard: serving on {url} (OpenAI API; Ctrl-C stops)", flush=True)
    while not stopping:
        time.sleep(0.2)
    serve.delete(APP_NAME)
    return exit_codes.DONE
