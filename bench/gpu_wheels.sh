#!/usr/bin/env bash
# Fetch into ./.whl/ the wheels the GPU machine lacks, for bench/gpu_run.sh to install there offline.
#
#   bash bench/gpu_wheels.sh            # here, with network; then carry .whl in the device call
#
# The device machine's image (/work/.library/device/KINDS.md) has torch, numpy, psutil, nvidia-ml-py,
# rich, filelock, scikit-learn and matplotlib, and no pydantic, tomli-w or setproctitle (a ddp rank's
# process title, engine/distributed/rank_start.py): those three and everything they need (pydantic-core,
# annotated-types, typing-inspection, typing-extensions), at the versions this checkout's environment uses. Its Python is 3.12 as last seen; pydantic-core is built per Python, so
# its wheel is fetched for 3.11, 3.12 and 3.13 and pip picks the one that fits there. /.whl/ is in
# .gitignore: the wheels travel only when the device call names .whl in carry (about 15 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
version() {  # the version this checkout runs, so that the GPU run tests the same code
    "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true
}
reqs=()
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions tomli-w setproctitle; do
    v=$(version "$pkg")
    reqs+=("$pkg${v:+==$v}")
done
mkdir -p .whl
for py in ${PYTHONS:-3.11 3.12 3.13}; do
    "$PY" -m pip download -q --only-binary=:all: --implementation cp --python-version "$py" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${reqs[@]}"
done
ls -1 .whl
du -sh .whl
