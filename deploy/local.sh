#!/usr/bin/env bash
# Runs a local elastic training job on this machine: installs Fashion-MNIST (Debian package
# dataset-fashion-mnist) if it is missing and no --data-dir is given, builds EDL, then runs
# edl-local with the arguments given (see `edl-local --help`).
#
# It builds the workspace's binaries in the profile the tests use (dev: dependencies optimized,
# see Cargo.toml) and with the same features, which are exactly the artifacts `cargo test
# --workspace` needs: ./deploy/test.sh afterwards builds only the test targets on top, instead
# of everything a second time in another profile. (Building only the job's three packages is
# faster by a few minutes here, but their features differ and the tests then rebuild about a
# hundred crates.) For production use, build with `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/share/datasets/fashion-mnist ] && ! printf '%s\n' "$@" | grep -q -- '--data-dir'; then
  echo "Fashion-MNIST is missing: installing dataset-fashion-mnist" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist
fi

cargo build --locked --workspace --bins
exec target/debug/edl-local "$@"
