#!/usr/bin/env bash
# Fetch here (PyPI reachable) the wheels of scripts/gpu_wheels.txt for a lent GPU machine
# (Python 3.12, x86-64; scripts/gpu_serve.sh installs them there), one bundle at a time: a
# device call carries at most 64 MiB, bundle 1 is about 56 MiB.
#   ./scripts/gpu_wheels.sh [1|2]      # -> .whl/ (emptied first; ignored through .git/info/exclude)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bundle="${1:-1}"
[[ "$bundle" == 1 || "$bundle" == 2 ]] || { echo "usage: $0 [1|2]" >&2; exit 2; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
specs=$(awk -v b="# bundle $bundle" 'index($0, "# bundle ") == 1 {on = index($0, b) == 1; next}
                                    on && !/^#/ {print}' scripts/gpu_wheels.txt)
platforms=()
for n in 17 24 26 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $specs
echo "bundle $bundle: $(ls .whl | wc -l) wheels, $(du -sm .whl | cut -f1) MiB in .whl/"
