#!/usr/bin/env bash
# The tests: the Rust workspace (`cargo nextest run`, or `cargo test` without nextest), then
# the Python package's (worker/python/tests, pytest), which drive the binaries that build just
# made. Installs what the Python tests need if it is missing: Debian's python3-venv, NumPy,
# pytest and PyTorch (CPU); the package itself is built from this checkout into a venv under
# target/ (reusing the test build: no second build of the client crate). Every test binary and
# the Python tests run even where some fail; the failures, and the tests that were skipped here
# (no dataset, GPU, browser...), are listed at the end, and the exit status is 1 if anything
# failed.
set -euo pipefail
cd "$(dirname "$0")/.."

failed=()
# Rust tests that cannot run here append a line to this file (edl_shared::skip): `cargo test`
# itself shows them as `ok`.
mkdir -p target
export EDL_SKIP_LOG="$PWD/target/skipped-tests.log"
: > "$EDL_SKIP_LOG"
# Temporary files of the tests (and of the processes they start) go under target/, emptied at
# each run: a run the tests keep on purpose (a failed run's logs) does not pile up in /tmp.
export TMPDIR="$PWD/target/test-tmp"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
# The failover tests run Debian's etcd; the etcd client's generated code is checked against
# ps/proto/etcd.proto with protoc (the build itself needs neither).
if ! command -v protoc >/dev/null || ! command -v etcd >/dev/null; then
  echo "the failover tests need etcd and the etcd code check protoc: installing etcd-server and protobuf-compiler" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq protobuf-compiler etcd-server
fi
# With cargo-nextest installed, every test runs in a process of its own and tests of different
# binaries side by side (.config/nextest.toml keeps the suites of whole real jobs one at a
# time, and kills a test still running after 10 minutes); doc tests run apart (nextest does not
# run them). Without it, `cargo test`.
# The book's Python chapter (deploy/tests/book.rs) runs in the venv made below, after the
# Python tests.
book_python='binary(book) & test(=python)'
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --locked --workspace --no-fail-fast -E "not ($book_python)" \
    || failed+=("cargo nextest run (the failing tests are named above)")
  cargo test --locked --workspace --doc || failed+=("cargo test --doc")
else
  cargo test --locked --workspace --no-fail-fast || failed+=("cargo test (the failing binaries are named above)")
fi

py=/usr/bin/python3
need=()
[ -x "$py" ] && "$py" -c "import ensurepip" 2>/dev/null || need+=(python3 python3-venv)
"$py" -c "import numpy" 2>/dev/null || need+=(python3-numpy)
"$py" -c "import pytest" 2>/dev/null || need+=(python3-pytest)
"$py" -c "import torch" 2>/dev/null || need+=(python3-torch)
# Without OpenBLAS, Debian's PyTorch and NumPy use the reference BLAS (docs/src/python.md).
dpkg -s libopenblas0 >/dev/null 2>&1 || need+=(libopenblas0)
if [ ${#need[@]} -gt 0 ]; then
  echo "the Python tests need ${need[*]}: installing" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# A venv that sees Debian's NumPy, pytest and PyTorch; maturin (PyPI) builds the package.
venv=target/py
[ -x "$venv/bin/pip" ] || { rm -rf "$venv" && "$py" -m venv --system-site-packages "$venv"; }
"$venv/bin/python" -c "import maturin" 2>/dev/null || "$venv/bin/pip" install -q "maturin>=1.7,<2"
# (maturin's build backend runs the `maturin` program: the venv's bin goes first on PATH.)
# The wheel carries the programs the tests just built (edl_build_backend.py: EDL_WHEEL_BINS).
PATH="$PWD/$venv/bin:$PATH" MATURIN_PEP517_ARGS="--profile dev" EDL_WHEEL_BINS="$PWD/target/debug" \
  "$venv/bin/pip" install -q --no-build-isolation --force-reinstall --no-deps ./worker/python
EDL_BIN_DIR="$PWD/target/debug" "$venv/bin/python" -m pytest -q -rs --durations=10 worker/python/tests \
  || failed+=("pytest worker/python/tests")
# The book's Python chapter, its .venv this venv.
if cargo nextest --version >/dev/null 2>&1; then
  EDL_BOOK_VENV="$venv" cargo nextest run --locked --workspace --no-fail-fast -E "$book_python" \
    || failed+=("the book's Python chapter (deploy/tests/book.rs)")
else
  EDL_BOOK_VENV="$venv" cargo test --locked --workspace --test book -- --exact python \
    || failed+=("the book's Python chapter (deploy/tests/book.rs)")
fi

left=$(find "$TMPDIR" -mindepth 1 -maxdepth 1 | wc -l)
[ "$left" -eq 0 ] || echo "the tests left $left entries in $TMPDIR (removed at the next run)"
if [ -s "$EDL_SKIP_LOG" ]; then
  echo "Rust tests skipped on this machine ($(wc -l < "$EDL_SKIP_LOG")):"
  sed 's/^/  /' "$EDL_SKIP_LOG"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all tests passed"
