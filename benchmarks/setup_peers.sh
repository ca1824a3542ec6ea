#!/usr/bin/env bash
# The peers the benchmarks compare against, installed into ./.venv (after scripts/setup.sh):
# llama-cpp-python built from source with this CPU's SIMD (AVX2, AVX-512 with VNNI/VBMI/BF16),
# as a user of llama.cpp on this machine would run it. PyPI has only its source; the build
# takes ~20 min on 2 cores. mlx-lm, the other peer, is already a dependency.
#
# Not -DGGML_NATIVE=ON: on this machine -march=native also turns on ggml's AMX kernels,
# and the first matmul then crashes (SIGSEGV in ggml_backend_amx_mul_mat: the VM does not
# grant AMX tile state). The same SIMD flags without AMX, spelled out, keep the AVX-512
# weight repacking that llama.cpp uses on CPUs without AMX.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
FLAGS="$FLAGS -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON"
FLAGS="$FLAGS -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null || [ "${REBUILD:-}" = 1 ]; then
  # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would hand back another build
  CMAKE_ARGS="$FLAGS" .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
  .venv/bin/python -m pip install -q --disable-pip-version-check "llama-cpp-python==0.3.36"
fi
.venv/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
