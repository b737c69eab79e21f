#!/usr/bin/env bash
# Installs what moed needs from Debian (only what is missing) and builds Release into build/.
# Usage: scripts/setup.sh [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."

# Why each package is here: see README.md, "Dependencies".
packages=(cmake ninja-build g++ libgtest-dev libgmock-dev libfmt-dev
          nlohmann-json3-dev libcli11-dev libopenmpi-dev openmpi-bin libopenblas-dev
          python3-numpy clang libclang-rt-14-dev iproute2 nftables)
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

build_dir=${MOED_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build_dir" -j "$(nproc)"
