#!/usr/bin/env bash
# Builds the folder that scripts/gpu-check.sh needs on a GPU machine that cannot download
# (README "Check on a real GPU"): gpu-check.sh and its modules, kepler-bridge's wheel and the
# wheels of its requirements (setup.cfg) for CPython $GPU_CHECK_PYTHONS (default 3.12) on x86_64
# and aarch64. grpcio is left out: it is large and such machines have it (set GPU_CHECK_GRPCIO=1
# to carry it too). Needs PyPI. Usage: scripts/gpu-check-bundle.sh [OUT, default dist/gpu-check]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/dist/gpu-check}
py=${PYTHON:-python3}
rm -rf "$out"
mkdir -p "$out/wheels"
"$py" -m pip wheel -q --no-deps -w "$out/wheels" "$root"
mapfile -t requirements < <("$py" - "$root/setup.cfg" "${GPU_CHECK_GRPCIO:-0}" <<'PY'
import configparser
import sys

setup = configparser.ConfigParser()
setup.read(sys.argv[1])
for line in setup["options"]["install_requires"].splitlines():
    requirement = line.split("#")[0].strip()
    if requirement and (sys.argv[2] == "1" or not requirement.startswith("grpcio")):
        print(requirement)
PY
)
for version in ${GPU_CHECK_PYTHONS:-3.12}; do
    for machine in x86_64 aarch64; do
        platforms=()
        for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_28 manylinux_2_34; do
            platforms+=(--platform "${tag}_$machine")
        done
        "$py" -m pip download -q --only-binary=:all: --implementation cp \
            --python-version "$version" "${platforms[@]}" -d "$out/wheels" "${requirements[@]}"
    done
done
cp "$root"/scripts/gpu-check.sh "$root"/scripts/gpu_check*.py "$out/"
echo "$out: $(du -sh "$out" | cut -f1), $(ls "$out/wheels" | wc -l) wheels"
