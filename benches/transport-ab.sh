#!/bin/bash
# Two edl-bench binaries (say, before and after a transport change) in alternating rounds over
# a veth pair at MTU 1500 and 9000 and on loopback: 16 MiB push+pull, 1 client x 1 shard,
# EDL, bare quinn and TCP. As root (network namespaces). Prints one line per run. Both binaries
# must have `transport --netns` (EDL from commit 242eab4 on); to measure a transport from before
# it, build the benchmark of this tree against that transport.
#
#   benches/transport-ab.sh BEFORE_BIN AFTER_BIN [ROUNDS]
set -euo pipefail
before=${1:?usage: $0 BEFORE_BIN AFTER_BIN [ROUNDS]}
after=${2:?usage: $0 BEFORE_BIN AFTER_BIN [ROUNDS]}
rounds=${3:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { # name bin json args...
  local name=$1 bin=$2 json=$3; shift 3
  "$bin" --json "$json" "$@" --sizes 16M --points 1x1 --systems edl,quinn,tcp > /dev/null
  python3 - "$name" "$json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
d = {x["system"]: x for x in r["rows"]}
e, q, t = d["edl"], d["quinn"], d["tcp"]
g = lambda x: x["gbps"] * 8
print(f"{name:28} EDL {g(e):5.1f} quinn {g(q):5.1f} TCP {g(t):5.1f} Gbit/s  EDL/TCP "
      f"{e['gbps'] / t['gbps']:.2f}  p50 ms {e['p50_us'] / 1e3:.1f} / {q['p50_us'] / 1e3:.1f} / "
      f"{t['p50_us'] / 1e3:.1f}  datagram {q.get('datagram')}")
PY
}
for round in $(seq 1 "$rounds"); do
  for mtu in 1500 9000; do
    for side in before after; do
      bin=$before; [ "$side" = after ] && bin=$after
      run "$side mtu $mtu round $round" "$bin" "$out/r.json" transport --netns --mtu "$mtu"
    done
  done
  for side in before after; do
    bin=$before; [ "$side" = after ] && bin=$after
    run "$side loopback round $round" "$bin" "$out/r.json" transport
  done
done
