#!/usr/bin/env bash
# Runs a local elastic training job on this machine: installs Fashion-MNIST (Debian package
# dataset-fashion-mnist) if it is missing and no --data-dir is given, builds EDL, then runs
# edl-local with the arguments given (see `edl-local --help`).
#
# It builds what the job needs in the profile the tests use (dev: dependencies optimized, see
# Cargo.toml), so ./deploy/test.sh afterwards reuses every dependency instead of building them
# a second time in another profile. For production use build with `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/share/datasets/fashion-mnist ] && ! printf '%s\n' "$@" | grep -q -- '--data-dir'; then
  echo "Fashion-MNIST is missing: installing dataset-fashion-mnist" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist
fi

cargo build --locked -p edl-ps -p edl-worker -p edl-deploy
exec target/debug/edl-local "$@"
