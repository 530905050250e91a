#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (README "GPU compute"): the tests in tests/gpu
# and tools.bench.gpu, logs and JSON figures under $OUT (or ./gpu-out).
#
# The device machine has Python, torch (CUDA), numpy, numba, pytest and pytest-timeout, but not the
# rest of our dependencies and no network. Where they are needed, build them here first as one
# tarball of a site directory for the device's Python (tools/device/build_site.sh) and carry
# it as .gpu/site.tgz: this script unpacks it into /tmp/site and puts it first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ -f .gpu/site.tgz ]; then
    mkdir -p /tmp/site && tar xzf .gpu/site.tgz -C /tmp/site || exit 2
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 UCX_LOG_LEVEL=error UCX_WARN_UNUSED_ENV_VARS=n
py=${PYTHON:-python3}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $py - <<'PY'
import importlib
for m in ("torch", "numpy", "numba", "msgspec", "ucxx", "rmm"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # a missing package is reported, the tests then skip or fail by name
        print(m, "MISSING:", type(e).__name__, e)
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
} 2>&1 | tee "$out/env.txt"
timeout "${TEST_TIMEOUT_S:-330}" $py -m pytest -p no:cacheprovider tests/gpu -m gpu -v -rA --timeout 240 \
    ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT_S:-200}" $py -m tools.bench.gpu --json ${BENCH_ARGS:-} > "$out/gpu-bench.json" 2> "$out/gpu-bench.err"
bench_rc=$?
cat "$out/gpu-bench.json"
tail -5 "$out/gpu-bench.err"
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
