#!/usr/bin/env bash
# The main job: set up, build, and run an MoE layer across threads-as-ranks, checked against
# the single-process reference. Extra arguments go to `moed run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/bin/moed run "$@"
