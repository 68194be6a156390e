#!/usr/bin/env bash
# Checks kepler-bridge against nvidia-smi on a machine with an NVIDIA GPU and its driver
# (README "Check on a real GPU"): `kepler-bridge collect` and 30 s of `kepler-bridge serve`,
# each read between two `nvidia-smi --query-gpu` reads, printed as one table.
#
# READ-ONLY: it never changes the card's settings. It runs no `nvidia-smi -pm/-pl/-mig/-ac/-rac/
# -lgc/-rgc/-r` and no NVML call that sets clocks, power, MIG or persistence mode;
# scripts/gpu_check.py refuses any nvidia-smi argument that is not a query.
#
# Runs offline: from the bundle (`make gpu-check-bundle` builds dist/gpu-check/, this script
# included) it unpacks the wheels that fit this Python into a temporary folder; from a checkout
# it runs the checkout's code with dist/gpu-check/wheels if built, else with $PYTHON's packages.
# PYTHON (default python3) picks the interpreter; GPU_CHECK_WHEELS overrides the wheel folder
# ("" for none). Arguments go to gpu_check.py: --serve-seconds S (30; 0: collect only),
# --scrapes N (6). Exit 0: all agree; 1: something disagrees; 2: nothing could be checked here.
set -euo pipefail
# Builtins only up to the Python check, so that its message comes even with a bare PATH.
script=${BASH_SOURCE[0]}
[[ $script == */* ]] || script=./$script
here=$(cd "${script%/*}" && pwd)
if [ -d "$here/wheels" ]; then
    source_tree=
    default_wheels=$here/wheels
else
    source_tree=${here%/*}
    default_wheels=$source_tree/dist/gpu-check/wheels
    [ -d "$default_wheels" ] || default_wheels=
fi
wheels=${GPU_CHECK_WHEELS-$default_wheels}
exec "${PYTHON:-python3}" "$here/gpu_check.py" --wheels "$wheels" --source-tree "$source_tree" "$@"
