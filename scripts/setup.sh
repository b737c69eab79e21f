#!/usr/bin/env bash
# Installs what moed needs from Debian (only what is missing), builds Release into build/ and
# installs the Python package with pip into .venv, a virtual environment that also sees
# Debian's packages and holds the pinned ones of scripts/venv-requirements.txt (torch 2.13):
# .venv/bin/python is the interpreter that imports moed.
# Usage: scripts/setup.sh [extra cmake args]
# MOED_BUILD_DIR: the build directory (default build); MOED_BUILD_TARGET: build only that target.
set -euo pipefail
cd "$(dirname "$0")/.."

# Why each package is here: see README.md, "Dependencies".
packages=(cmake ninja-build g++ libgtest-dev libgmock-dev libfmt-dev
          nlohmann-json3-dev libcli11-dev libopenmpi-dev openmpi-bin libgloo-dev libopenblas-dev
          python3-numpy clang libclang-rt-14-dev iproute2 nftables
          python3-torch pybind11-dev python3-dev python3-pytest python3-mpi4py python3-hypothesis
          python3-venv python3-pip python3-setuptools python3-wheel)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "moed setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The virtual environment, before CMake configures: tests/python/CMakeLists.txt runs the Python
# suites on its interpreter (torch 2.13) and again on Debian's python3 (torch 1.13). pip runs
# only when scripts/venv-requirements.txt changed since .venv last installed it.
[ -x .venv/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv
if ! cmp -s scripts/venv-requirements.txt .venv/moed-requirements.txt; then
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/venv-requirements.txt
  cp scripts/venv-requirements.txt .venv/moed-requirements.txt
fi

build_dir=${MOED_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build_dir" -j "$(nproc)" ${MOED_BUILD_TARGET:+--target "$MOED_BUILD_TARGET"}

# The Python package (when this build has it; only the Release build in build/, not a
# sanitizer build's): pip builds it from this build directory (setup.py), so nothing is
# compiled twice. NOTE: Debian's own python3 refuses pip installs (PEP 668), hence the virtual
# environment.
if [ "$build_dir" = build ] && ls "$build_dir"/python/moed/_C*.so >/dev/null 2>&1; then
  MOED_BUILD_DIR="$(cd "$build_dir" && pwd)" .venv/bin/pip install --quiet --no-build-isolation .
fi
