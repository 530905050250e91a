#!/usr/bin/env bash
# Build .gpu/site.tgz: the dependencies a lent GPU machine lacks (it has Python 3.12, torch, numpy,
# numba, pytest, but no msgspec, cryptography, pytest-asyncio, ucxx and no network), as one
# compressed site directory for its Python, trimmed of static libraries, headers and UCX's test
# tools so that it travels under the device tool's 64 MiB limit (about 20 MB). Run here (needs PyPI),
# then on the device: `bash tools/device/gpu_check.sh` with `.gpu` carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Versions as this tree's venv resolves them (ucxx 0.52 needs rmm 26.10 and cuda-bindings 12.9).
pkgs=(msgspec==0.22.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pytest-asyncio==1.5.0
      ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 rmm-cu12==26.10.0 librmm-cu12==26.10.0
      rapids-logger==0.3.0 cuda-bindings==12.9.10 cuda-pathfinder==1.9.1)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$py" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --target "$site" "${pkgs[@]}"
find "$site" \( -name '*.a' -o -name '*.h' -o -name '*.hpp' -o -name '*.pyx' -o -name '*.pxd' \) -delete
find "$site" -type d -name include -prune -exec rm -rf {} +
rm -rf "$site"/libucx/bin "$site"/libucx/lib/ucx/libucx_perftest*
# The wheels hold three copies of every UCX library (name.so, .so.0, .so.0.0.0): keep one, link the rest.
( cd "$site/libucx/lib"
  for f in *.so.0.0.0 ucx/*.so.0.0.0; do
      [ -e "$f" ] || continue
      b=${f%.0.0}; rm -f "$b" "${b%.0}"; ln -s "$(basename "$f")" "$b"; ln -s "$(basename "$f")" "${b%.0}"
  done )
mkdir -p .gpu
tar czf .gpu/site.tgz -C "$site" .
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
ls -la .gpu/site.tgz
