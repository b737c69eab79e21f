#!/usr/bin/env bash
# Installs what moed needs from Debian (only what is missing) and builds Release into build/.
# Usage: scripts/setup.sh [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."

# Why each package is here: see README.md, "Dependencies".
packages=(cmake ninja-build g++ libgtest-dev libgmock-dev libfmt-dev
          nlohmann-json3-dev libcli11-dev libopenmpi-dev openmpi-bin libgloo-dev libopenblas-dev
          python3-numpy clang libclang-rt-14-dev iproute2 nftables
          python3-torch pybind11-dev python3-dev python3-pytest python3-mpi4py)
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

# The Python package (when built): a .pth file in Debian's dist-packages points /usr/bin/python3
# at the build tree's package, so `import moed` works from any directory without PYTHONPATH.
if ls "$build_dir"/python/moed/_C*.so >/dev/null 2>&1; then
  site_dir=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  pth_line=$(cd "$build_dir/python" && pwd)
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  if [ "$(cat "$site_dir/moed.pth" 2>/dev/null)" != "$pth_line" ]; then
    $sudo_cmd mkdir -p "$site_dir"
    echo "$pth_line" | $sudo_cmd tee "$site_dir/moed.pth" >/dev/null
    echo "moed setup: $site_dir/moed.pth -> $pth_line"
  fi
fi
