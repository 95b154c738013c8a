"""A PyTorch model on Fashion-MNIST, trained elastically through EDL.

    python worker/python/examples/torch_fashion_mnist.py            # a local job with churn

launches a job (a coordinator and a shard server as processes; the job file written from the
module by `edl.torch.job_from_module`) and trains it with PyTorch workers that join and leave
while it runs: two start, a third joins, one is drained, one is killed with SIGKILL and a new
one replaces it. At the end it prints test accuracy, samples/s and the data ledger (exactly
once: no duplicates, nothing missing).

    --workers N --no-churn     N workers from start to end, nothing else
    --rust                     the same model and settings trained by the Rust example worker
                               (worker/examples/two_layer.rs, deploy/jobs/two-layer.toml), for
                               comparison; needs `cargo build --release --example two_layer`

Started with EDL_COORDINATOR set (`edl.local.Cluster.spawn` sets it) it is one worker.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import edl
import edl.data
import edl.torch

HIDDEN = 128


class Net(nn.Module):
    """784-128-10 with ReLU: the model of deploy/jobs/two-layer.toml."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def work() -> None:
    """One worker: the standard PyTorch loop, with EDL leasing the data and holding the
    parameters."""
    torch.set_num_threads(1)
    x, y = (torch.from_numpy(a) for a in edl.data.fashion_mnist("train"))
    model = Net()
    job = edl.Job.from_env()
    params = edl.torch.Parameters(model, job)
    steps, seen = 0, 0
    with job.join() as session:
        t0 = time.monotonic()
        print(f"joined as worker {session.worker}", flush=True)
        for batch in session.batches():
            params.pull(session)
            loss = F.cross_entropy(model(x[batch.indices]), y[batch.indices])
            params.zero_grad()
            loss.backward()
            params.push(session, batch)
            session.commit(batch, loss.item() * len(batch))
            steps, seen = steps + 1, seen + len(batch)
        dt = time.monotonic() - t0
    print(f"{os.environ.get('EDL_NAME', 'worker')}: {steps} steps, {seen} samples, "
          f"{seen / max(dt, 1e-9):.0f} samples/s", flush=True)


def accuracy(job: edl.Job) -> float:
    tx, ty = (torch.from_numpy(a) for a in edl.data.fashion_mnist("t10k"))
    model = Net()
    if "fc1.weight" in job.spec and job.spec["fc1.weight"].shape == (784, HIDDEN):
        # The Rust example's layout: weights [in, out].
        p = job.pull()
        s = job.spec
        with torch.no_grad():
            for name in ("fc1", "fc2"):
                getattr(model, name).weight.copy_(torch.from_numpy(s[f"{name}.weight"].of(p).T))
                getattr(model, name).bias.copy_(torch.from_numpy(s[f"{name}.bias"].of(p)))
    else:
        edl.torch.Parameters(model, job).pull(job)
    with torch.no_grad():
        out = model(tx)
        acc = (out.argmax(1) == ty).float().mean().item()
        loss = torch.nn.functional.cross_entropy(out, ty.long()).item()
    # `edlctl status` and the coordinator's dashboard show the latest evaluation.
    job.report_evaluation(acc, loss, len(ty))
    return acc


def launch(args) -> None:
    import edl.local

    repo = Path(__file__).resolve().parents[3]
    if args.rust:
        job_file = repo / "deploy" / "jobs" / "two-layer.toml"
        worker = [edl.local.find_binary("examples/two_layer")]
    else:
        job_file = Path(tempfile.mkdtemp(prefix="edl-torch-")) / "job.toml"
        edl.torch.job_from_module(
            Net(), job_file, samples=60000, optimizer="sgd", lr=0.1, consistency="ssp:2",
            batch_size=64, epochs=args.epochs,
            train=str(edl.data.FASHION_MNIST / "train"), test=str(edl.data.FASHION_MNIST / "t10k"),
        )
        worker = [sys.executable, __file__]
    with edl.local.Cluster(job_file) as cluster:
        print(f"job {job_file} at {cluster.coordinator}, state in {cluster.state_dir}")
        admin = cluster.admin()
        total = admin.status()["samples_total"]
        n = 0
        workers = {}

        def spawn():
            nonlocal n
            name = f"w{n}"
            n += 1
            workers[name] = cluster.spawn(worker + ([name] if args.rust else []), name)
            return name

        for _ in range(args.workers):
            spawn()
        while admin.status()["samples_done"] == 0:
            cluster.check(admin)  # a worker that cannot start says why, instead of a hang
            time.sleep(0.05)
        t0 = time.monotonic()
        plan = [] if args.no_churn else [(0.2, "join"), (0.45, "drain"), (0.65, "kill")]
        while not (st := admin.status())["finished"]:
            done = st["samples_done"] / total
            if plan and done >= plan[0][0]:
                _, what = plan.pop(0)
                active = [w for w in st["workers"] if w[2] == "Active"]
                if what == "join":
                    print(f"{done:.0%}: {spawn()} joins", flush=True)
                elif what == "drain":
                    wid, name = active[0][0], active[0][1]
                    admin.drain(wid)
                    print(f"{done:.0%}: worker {wid} ({name}) drained", flush=True)
                elif what == "kill":
                    victim = next(nm for nm, p in workers.items() if p.poll() is None)
                    workers[victim].send_signal(signal.SIGKILL)
                    print(f"{done:.0%}: {victim} killed (SIGKILL); {spawn()} replaces it",
                          flush=True)
            cluster.check(admin)
            time.sleep(0.1)
        wall = time.monotonic() - t0
        for name, p in workers.items():
            try:
                p.wait(timeout=60)
            except Exception:
                p.kill()
            last = cluster.log(name).strip().splitlines()
            print(f"  {name}: exit {p.returncode}; {last[-1] if last else ''}")
        print(f"trained {total} samples in {wall:.1f} s: {total / wall:.0f} samples/s")
        print(f"test accuracy {accuracy(admin):.4f}")
        for row in admin.ledgers():
            print("ledger", row)


def main() -> None:
    if "EDL_COORDINATOR" in os.environ:
        return work()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="workers at the start (default 2)")
    ap.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    ap.add_argument("--no-churn", action="store_true", help="no joins, drains or kills")
    ap.add_argument("--rust", action="store_true", help="Rust example workers instead")
    launch(ap.parse_args())


if __name__ == "__main__":
    main()
