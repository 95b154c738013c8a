"""The Python binding's cost per step: pull + push of one model of 1 MiB and of 16 MiB, from
Python (NumPy arrays through the buffer protocol) and from Rust (the same loop inside the
extension, `Session._bench_native`), alternating in one session against the same local job.

    python worker/python/examples/bench_binding.py [--steps 40] [--rounds 3]

Prints, per size, the median pull+push time of each and their difference (the binding's
overhead per step). Build the package in release mode for this (`pip install ./worker/python`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import edl
import edl.local


def job_file(floats: int, samples: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="edl-bench-")) / "job.toml"
    path.write_text(
        '[model]\nkind = "custom"\n\n[optimizer]\nkind = "sgd"\nlr = 0.01\n\n'
        f'[training]\nconsistency = "asp"\nbatch_size = 1\nepochs = 1\nsamples = {samples}\n'
        f"partition_size = 64\n\n"
        f'[[tensor]]\nname = "x"\nshape = [{floats}]\ninit = "zeros"\n'
    )
    return path


def python_steps(session: edl.Session, params, grads, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        batch = session.next_batch()
        t = time.perf_counter()
        session.pull(params)
        session.push(batch, grads)
        times.append(time.perf_counter() - t)
        session.commit(batch, 0.0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per round and side")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = ap.parse_args()
    print(f"{'size':>7} {'python p50':>11} {'rust p50':>9} {'overhead':>9} {'ratio':>6}")
    for mib in (1, 16):
        floats = mib * 1024 * 1024 // 4
        samples = 2 * args.rounds * args.steps + 16
        with edl.local.Cluster(job_file(floats, samples)) as cluster:
            job = cluster.job("bench")
            params = np.zeros(floats, np.float32)
            grads = np.zeros(floats, np.float32)
            py, rs = [], []
            with job.join() as s:
                python_steps(s, params, grads, 4)  # warm-up
                for _ in range(args.rounds):
                    py += python_steps(s, params, grads, args.steps)
                    rs += s._s._bench_native(params, args.steps)
            p, r = statistics.median(py) * 1e3, statistics.median(rs) * 1e3
            print(f"{mib:>4} MiB {p:>9.2f}ms {r:>7.2f}ms {p - r:>7.3f}ms {p / r:>6.3f}",
                  flush=True)


if __name__ == "__main__":
    # Loopback: large UDP datagrams, as edl-local sets them (docs/src/benchmarks.md).
    os.environ.setdefault("EDL_DATAGRAM", "65000")
    main()
