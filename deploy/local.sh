#!/usr/bin/env bash
# Runs a local elastic training job on this machine: installs Fashion-MNIST (Debian package
# dataset-fashion-mnist) if it is missing and no --data-dir is given, builds EDL, then runs
# edl-local with the arguments given (see `edl-local --help`).
#
# The build is the one the tests use (`cargo test --workspace`: the dev profile, whose
# dependencies are optimized, see Cargo.toml), so ./deploy/test.sh afterwards reuses it instead
# of building everything a second time. For production use build with `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/share/datasets/fashion-mnist ] && ! printf '%s\n' "$@" | grep -q -- '--data-dir'; then
  echo "Fashion-MNIST is missing: installing dataset-fashion-mnist" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist
fi

# Every binary of the workspace, with the features `cargo test --workspace` unifies: exactly
# the artifacts the tests build.
cargo build --locked --workspace --bins
exec target/debug/edl-local "$@"
