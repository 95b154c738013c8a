"""Logistic regression on Fashion-MNIST in NumPy, trained through EDL.

Run it alone and it launches a local job (a coordinator and a shard server as processes) with
two workers of itself, a third joining later, then reports test accuracy and the ledger:

    python worker/python/examples/numpy_logreg.py

Started with EDL_COORDINATOR set (as `edl.local.Cluster.spawn` does, or by hand with EDL_NAME
and EDL_STATE_DIR, or EDL_CERT/EDL_KEY/EDL_CA) it is one worker of a running job. The model is
EDL's built-in `kind = "mlp"` layout (fc0.weight [in, out], fc0.bias, fc1...; ReLU between
layers, softmax cross-entropy), so it also trains `mlp` jobs beside Rust `edl-worker`s; with
`layers = [784, 10]` that is logistic regression.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import edl
import edl.data


def layers(spec: edl.Spec) -> list[tuple[edl.Tensor, edl.Tensor]]:
    out, i = [], 0
    while f"fc{i}.weight" in spec:
        out.append((spec[f"fc{i}.weight"], spec[f"fc{i}.bias"]))
        i += 1
    if not out:
        raise SystemExit(f"not an mlp job: its tensors are {spec.names}")
    return out


def step(spec, params, x, y, grads=None) -> tuple[float, int]:
    """Forward (and, with `grads`, backward: the batch's mean gradient, written into `grads`)
    over samples `x` with labels `y`; returns (loss sum, correct predictions)."""
    net = layers(spec)
    acts = [x]
    for i, (w, b) in enumerate(net):
        z = acts[-1] @ w.of(params) + b.of(params)
        acts.append(np.maximum(z, 0) if i < len(net) - 1 else z)
    z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(np.maximum(p[np.arange(n), y], 1e-12)).sum()
    correct = int((p.argmax(axis=1) == y).sum())
    if grads is not None:
        d = p
        d[np.arange(n), y] -= 1.0
        d /= n
        for i in range(len(net) - 1, -1, -1):
            w, b = net[i]
            w.of(grads)[...] = acts[i].T @ d
            b.of(grads)[...] = d.sum(axis=0)
            if i:
                d = (d @ w.of(params).T) * (acts[i] > 0)
    return float(loss), correct


def work() -> None:
    """One worker of a running job."""
    x, y = edl.data.fashion_mnist("train")
    job = edl.Job.from_env()
    params = np.zeros(job.param_count, np.float32)
    grads = np.zeros_like(params)
    steps, seen, t0 = 0, 0, time.monotonic()
    slow = float(os.environ.get("EDL_EXAMPLE_STEP_SLEEP", "0"))
    with job.join() as session:
        print(f"joined as worker {session.worker}", flush=True)
        for batch in session.batches():
            session.pull(params)
            idx = batch.indices
            loss, _ = step(job.spec, params, x[idx], y[idx], grads)
            if slow:
                time.sleep(slow)
            session.push(batch, grads)
            session.commit(batch, loss)
            steps, seen = steps + 1, seen + len(batch)
    dt = time.monotonic() - t0
    print(f"{os.environ.get('EDL_NAME', 'worker')}: {steps} steps, {seen} samples, "
          f"{seen / max(dt, 1e-9):.0f} samples/s", flush=True)


def launch() -> None:
    """A local job with workers joining while it trains."""
    job_file = Path(tempfile.mkdtemp(prefix="edl-logreg-")) / "logreg.toml"
    job_file.write_text(
        '[model]\nkind = "mlp"\nlayers = [784, 10]\n\n'
        '[optimizer]\nkind = "sgd"\nlr = 0.1\n\n'
        '[training]\nconsistency = "ssp:2"\nbatch_size = 64\nepochs = 2\nsamples = 60000\n'
    )
    me = [sys.executable, __file__]
    with edl.local.Cluster(job_file) as cluster:
        print(f"job at {cluster.coordinator}, state in {cluster.state_dir}")
        workers = {n: cluster.spawn(me, n) for n in ("py0", "py1")}
        admin = cluster.admin()
        while admin.status()["samples_done"] < 20000:
            cluster.check(admin)  # workers that all died say why, instead of a hang
            time.sleep(0.2)
        print("py2 joins")
        workers["py2"] = cluster.spawn(me, "py2")
        cluster.wait_finished(timeout=600, admin=admin)
        for n, p in workers.items():
            p.wait(timeout=60)
            print(cluster.log(n).strip().splitlines()[-1])
        tx, ty = edl.data.fashion_mnist("t10k")
        _, correct = step(admin.spec, admin.pull(), tx, ty)
        print(f"test accuracy {correct / len(ty):.4f}")
        for row in admin.ledgers():
            print("ledger", row)


if __name__ == "__main__":
    import edl.local  # noqa: F401  (launch mode)

    work() if "EDL_COORDINATOR" in os.environ else launch()
