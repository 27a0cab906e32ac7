#!/usr/bin/env bash
# The GPU check as the device tool runs it (docs/gpu-verification.md has the call): install the carried
# wheels (bench/gpu_wheels.sh) and the project, then bench/gpu_check.py; its log and JSON land in $OUT.
#
#   bash bench/gpu_run.sh [gpu_check.py options]      e.g. --dry-run, --only speed
#
# Nothing can be downloaded on the device machine: the wheels in ./.whl (carried) go to /tmp/site, put
# first on PYTHONPATH; the project is installed editable without build isolation (no download), or,
# where that fails, its folders are put on the path as the `multilane` namespace the package declares.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
    echo "== $(date -u '+%F %T UTC') on $(hostname): $("$PY" -V 2>&1) at $(command -v "$PY")"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --find-links .whl --no-compile --no-cache-dir --upgrade \
            --target /tmp/site pydantic tomli-w setproctitle 2>&1 | grep -v -e "dependency resolver" -e "requires" \
            && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/ here: run bench/gpu_wheels.sh where pip can download, and name .whl in carry"
    fi
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/multilane-install.log 2>&1; then
        echo "editable install failed offline ($(grep -m1 -i 'error:' /tmp/multilane-install.log)); using the source folders"
        mkdir -p /tmp/multilane-src/multilane
        ln -sfn "$PWD/engine" /tmp/multilane-src/multilane/engine
        ln -sfn "$PWD/assets" /tmp/multilane-src/multilane/assets
        export PYTHONPATH=/tmp/multilane-src${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -c "import multilane.engine as m, pydantic, torch; print('multilane', m.__file__, '| pydantic', pydantic.VERSION, '| torch', torch.__version__)"
    timeout -k 10 330 "$PY" bench/gpu_check.py "$@"
    echo "== exit $? ; results: $OUT/gpu_check.json"
} 2>&1 | tee "$OUT/gpu_check.log"
