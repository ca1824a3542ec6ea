#!/usr/bin/env bash
# The peers the benchmarks compare against, installed into ./.venv (after scripts/setup.sh):
# llama-cpp-python built from source with the SIMD of the CPU it runs on, as a user of
# llama.cpp on that machine would run it. PyPI has only its source; the build takes ~20 min
# on 2 cores. mlx-lm, the other peer, is already a dependency.
#
# On x86-64 Linux the flags come from /proc/cpuinfo, one by one, rather than
# -DGGML_NATIVE=ON: on a VM that reports AMX, -march=native also turns on ggml's AMX kernels,
# and the first matmul then crashes (SIGSEGV in ggml_backend_amx_mul_mat: the VM does not
# grant AMX tile state). Spelling out only what the CPU has keeps the AVX-512 weight
# repacking llama.cpp uses on CPUs without AMX, and never asks for an instruction the CPU
# lacks (a hard-coded AVX-VNNI died with "Illegal instruction" on a Xeon and an EPYC
# without it). Elsewhere (Apple silicon, ARM Linux) -DGGML_NATIVE=ON is right.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

cpu_flags() {
  # The CPU's feature flags, one per line (empty where /proc/cpuinfo has none).
  if [ -r /proc/cpuinfo ]; then grep -m1 -E '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n'; fi
}

simd_flags() {
  # -DGGML_<X>=ON/OFF for each SIMD extension ggml can use, from the CPU's own flags.
  local have out="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  have=" $(cpu_flags | tr '\n' ' ') "
  local pair cpu ggml
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    cpu=${pair%%:*} ggml=${pair##*:}
    if [[ "$have" == *" $cpu "* ]]; then out="$out -DGGML_$ggml=ON"; else out="$out -DGGML_$ggml=OFF"; fi
  done
  echo "$out"
}

if [ "$(uname -m)" = "x86_64" ] && [ -r /proc/cpuinfo ]; then
  FLAGS="$(simd_flags)"
else
  FLAGS="-DGGML_NATIVE=ON"
fi
echo "llama.cpp build flags for this CPU: $FLAGS"
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null || [ "${REBUILD:-}" = 1 ]; then
  # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would hand back another build
  CMAKE_ARGS="$FLAGS" .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
  .venv/bin/python -m pip install -q --disable-pip-version-check "llama-cpp-python==0.3.36"
fi
.venv/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
