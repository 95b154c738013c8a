#!/usr/bin/env bash
# Profiles EDL's push+pull pairs (1 client, 1 shard, 65000-byte datagrams) of each size given
# and prints, per size, where the CPU time goes by category (benches/profile/breakdown.py), as
# Markdown. `edl-bench all` puts benches/profile/transport.md into BENCHMARKS.md:
#   benches/profile/run.sh 1M:3000 16M:300 > benches/profile/transport.md
# (SIZE:PAIRS; enough pairs that setting up the cluster is a small part of the samples.)
# Needs `perf` (Debian: linux-perf) and a release build: cargo build --release -p edl-benches
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bench=${EDL_BENCH:-$here/../../target/release/edl-bench}
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
for arg in "${@:?sizes, e.g. 1M:2000 16M:200}"; do
  size=${arg%%:*}
  pairs=${arg#*:}
  [ "$pairs" = "$arg" ] && pairs=100
  perf record -q -F 997 --call-graph dwarf,16384 -o "$data/perf.data" -- \
    "$bench" --datagram 65000 transport --points 1x1 --sizes "$size" --systems edl \
    --pairs "$pairs" >/dev/null 2>&1
  echo "#### $size, $pairs pairs"
  echo
  perf script -i "$data/perf.data" 2>/dev/null | python3 "$here/breakdown.py"
  echo
done
