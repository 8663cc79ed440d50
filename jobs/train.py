"""`ray job submit` entrypoint: train from a job spec on the cluster this job runs in.

    ray job submit --working-dir . -- python jobs/train.py --config jobs/configs/gpt_ddp.yaml \
        --set optim.lr=3e-4

Inside a submitted job RAY_ADDRESS names the cluster; run by hand on a machine with a running
cluster it attaches to that one, and with none it starts a local Ray instance.
"""

from __future__ import annotations

import argparse
import sys

try:
    from shardyard.cli.train import add_train_arguments, run_train
except ImportError:
    sys.exit("shardyard is not installed in this Python: run `pip install -e .` in the checkout "
             "(on a cluster, cluster.yaml's setup_commands do this on every node)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser, config_flag=True)
    args = parser.parse_args()
    return run_train(args.config, args.overrides, attach_to_running=True, take_over=args.take_over,
                     print_config=args.print_config)


if __name__ == "__main__":
    sys.exit(main())
