#!/usr/bin/env bash
# Make .whl/ for the lent GPU machine (Python 3.12, no package index there): the wheels its
# image lacks, this checkout's own wheel, and benchmarks/gpu_setup.sh to source there.
#   bash benchmarks/gpu_wheels.sh     # on this machine, in the project's root
# Then each device call carries ".whl" and starts with "source .whl/gpu_setup.sh".
set -euo pipefail
# the project's environment (its setuptools builds the wheel); python3 where there is none
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/extra
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
get() { $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --implementation cp $plat -d "$1" "${@:2}"; }
# zarr 3.4 needs msgspec and a newer typing_extensions than the image's
get .whl zarr numcodecs google-crc32c donfig msgspec typing_extensions packaging hydra-core omegaconf
get .whl/extra lineax  # installed there only where the image lacks it
$PY -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
# pdefit.systems and pdefit.conf live in systems/ and conf/: only the built wheel lays them out
$PY -m pip wheel -q --no-deps --no-build-isolation -w .whl .
cp benchmarks/gpu_setup.sh .whl/
ls .whl
