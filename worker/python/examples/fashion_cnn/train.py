"""A PyTorch CNN on Fashion-MNIST as an EDL job: pytorch/examples' MNIST script (two 3x3
convolutions, max-pooling, dropout, two linear layers, log-softmax; Adadelta with StepLR
stepped per epoch) ported to EDL. The loop is PyTorch's own; EDL leases the data (exactly once
per epoch, elastically), holds the parameters and applies the optimizer and its schedule on its
shards.

As a job's worker, started by a placer in this folder (`job.toml`'s `[worker]` table:
`edl-local --job job.toml`, `edlctl job submit job.toml`), it follows the process contract
(`edl.Job.from_env()`: the environment, SIGTERM drains, SIGUSR1 is a preemption notice):

    python3 train.py [--num-workers 2] [--no-test]

Without a placer, on this machine (a coordinator and a shard as processes, N workers of this
script; prints samples/s, the test accuracy and the data ledger):

    python3 train.py --local [--workers 1] [--epochs 1] [--samples 60000] [--num-workers 2]

The same training as pytorch/examples' script itself, in one process without EDL, to compare
with (the same net, data, Adadelta and per-epoch StepLR; prints the test accuracy):

    python3 train.py --plain [--epochs 1] [--samples 60000]

The job's net halves pytorch/examples' widths (16 and 32 channels, 64 hidden: 300k
parameters, a third of the time per step on a CPU); `--full` in `--local` runs the original
(32, 64, 128: 1.2M parameters). A worker builds its net from the job's tensor shapes, so the
same script trains either. `job.toml` is `job_text(Net())` with the `[worker]` table added
(`python3 train.py --print-job`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import edl
import edl.data
import edl.torch

HERE = Path(__file__).resolve().parent
#: Fashion-MNIST's training pixel mean and deviation (ToTensor's [0, 1] scale).
MEAN, STD = 0.2860, 0.3530


class Net(nn.Module):
    """pytorch/examples' MNIST net, its widths as given (the original: 32, 64, 128)."""

    def __init__(self, c1: int = 16, c2: int = 32, hidden: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, 1)
        self.conv2 = nn.Conv2d(c1, c2, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(c2 * 12 * 12, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    @classmethod
    def of(cls, spec: edl.Spec) -> "Net":
        """The net whose tensors the job holds."""
        return cls(spec["conv1.weight"].shape[0], spec["conv2.weight"].shape[0],
                   spec["fc1.weight"].shape[0])

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def optimizer_of(model: nn.Module):
    """pytorch/examples' optimizer and schedule: Adadelta at 1.0, the rate times 0.7 each
    epoch."""
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def job_text(model: nn.Module, samples: int = 60000, epochs: int = 2) -> str:
    """The job file of `model` (the [worker] table aside): pytorch/examples' Adadelta and
    StepLR on the shards (the schedule stepped per epoch), SSP(2), batches of 64, partitions of
    1024 samples."""
    data = edl.data.fashion_mnist_dir()
    optimizer, scheduler = optimizer_of(model)
    return edl.torch.job_from_module(
        model, samples=samples, optimizer=optimizer, scheduler=scheduler, scheduler_by="epoch",
        consistency="ssp:2", batch_size=64, epochs=epochs, partition_size=1024,
        train=str(data / "train"), test=str(data / "t10k"),
    )


class FashionMNIST(Dataset):
    """Fashion-MNIST as pytorch/examples loads MNIST: each image made a float tensor in [0, 1]
    and normalized as it is loaded (torchvision's ToTensor and Normalize); for training also a
    random crop after 2 pixels of padding and a random horizontal flip (`augment`)."""

    def __init__(self, split: str, augment: bool):
        images, labels = edl.data.load_idx_bytes(edl.data.fashion_mnist_dir() / split)
        self.images, self.labels = torch.from_numpy(images), torch.from_numpy(labels)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(0)
        if self.augment:
            x = F.pad(x, (2, 2, 2, 2))
            dy, dx = torch.randint(0, 5, (2,)).tolist()
            x = x[:, dy:dy + 28, dx:dx + 28]
            if torch.rand(()) < 0.5:
                x = x.flip(2)
        return x, self.labels[i]


def evaluate(model: nn.Module, data: FashionMNIST) -> tuple[float, float]:
    """(accuracy, mean loss) of `model` on all of `data`."""
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for at in range(0, len(data), 1000):
            x = torch.stack([data[i][0] for i in range(at, min(at + 1000, len(data)))])
            y = data.labels[at:at + len(x)]
            out = model(x)
            loss += F.nll_loss(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum())
    model.train()
    return correct / len(data), loss / len(data)


def work(args) -> None:
    """One worker: pytorch/examples' train() and test(), EDL leasing the data and holding the
    parameters."""
    torch.set_num_threads(args.threads)
    job = edl.Job.from_env()  # the process contract: environment and signals
    model = Net.of(job.spec)
    params = edl.torch.Parameters(model, job)  # the parameters live in EDL's buffers now
    train = FashionMNIST("train", augment=not args.no_augment)
    test = None if args.no_test else FashionMNIST("t10k", augment=False)
    name = os.environ.get("EDL_NAME", "worker")
    with job.join() as session:
        sampler = edl.torch.ElasticSampler(session)
        loader = sampler.loader(train, num_workers=args.num_workers)
        for epoch in sampler.epochs():
            t0, seen = time.monotonic(), 0
            for i, (x, y) in enumerate(loader):
                batch = sampler.batch
                params.pull(session)  # the job's parameters, into the model in place
                loss = F.nll_loss(model(x), y)
                params.zero_grad()
                loss.backward()
                params.push(session, batch)  # the gradient of exactly these samples
                session.commit(batch, loss.item() * len(y))
                seen += len(y)
                if i % args.log_interval == 0:
                    print(f"{name}: epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f}",
                          flush=True)
            dt = time.monotonic() - t0
            print(f"{name}: epoch {epoch}: {seen} samples in {dt:.1f} s, "
                  f"{seen / max(dt, 1e-9):.0f} samples/s", flush=True)
            if test is not None and not session.should_leave:  # leaving: within its grace
                params.pull(session)
                acc, test_loss = evaluate(model, test)
                session.report_evaluation(acc, test_loss, len(test))
                print(f"{name}: epoch {epoch}: test accuracy {acc:.4f}, loss {test_loss:.4f}",
                      flush=True)
    print(f"{name}: done", flush=True)


def plain(args) -> None:
    """pytorch/examples' script itself, in one process without EDL: the same net, data,
    optimizer and schedule on the first `--samples` training samples, for `--epochs`."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    widths = (32, 64, 128) if args.full else (16, 32, 64)
    model = Net(*widths)
    optimizer, scheduler = optimizer_of(model)
    train = torch.utils.data.Subset(FashionMNIST("train", augment=not args.no_augment),
                                    range(args.samples))
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True,
                                         num_workers=args.num_workers)
    test = FashionMNIST("t10k", augment=False)
    t0 = time.monotonic()
    for epoch in range(args.epochs):
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if i % args.log_interval == 0:
                print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f}", flush=True)
        scheduler.step()
    wall = time.monotonic() - t0
    total = args.samples * args.epochs
    print(f"trained {total} samples in {wall:.1f} s: {total / wall:.0f} samples/s")
    acc, test_loss = evaluate(model, test)
    print(f"test accuracy {acc:.4f}, loss {test_loss:.4f}")


def local(args) -> None:
    """A job on this machine: its servers and `--workers` workers of this script."""
    import edl.local

    widths = (32, 64, 128) if args.full else (16, 32, 64)
    folder = Path(tempfile.mkdtemp(prefix="edl-cnn-"))
    job_file = folder / "job.toml"
    job_file.write_text(job_text(Net(*widths), samples=args.samples, epochs=args.epochs))
    worker = [sys.executable, HERE / "train.py", "--num-workers", str(args.num_workers),
              "--threads", str(args.threads)]
    worker += ["--no-test"] * args.no_test + ["--no-augment"] * args.no_augment
    try:
        with edl.local.Cluster(job_file, shards=args.shards) as cluster:
            print(f"job {job_file}: {args.samples} samples x {args.epochs} epochs, net "
                  f"{widths}; {args.workers} worker(s), DataLoader num_workers="
                  f"{args.num_workers}", flush=True)
            admin = cluster.admin()
            total = admin.status()["samples_total"]
            procs = [cluster.spawn(worker, f"w{i}") for i in range(args.workers)]
            while admin.status()["samples_done"] == 0:
                cluster.check(admin)
                time.sleep(0.05)
            t0 = time.monotonic()
            cluster.wait_finished(timeout=24 * 3600, admin=admin)
            wall = time.monotonic() - t0
            for i, p in enumerate(procs):
                p.wait(timeout=600)
                lines = cluster.log(f"w{i}").strip().splitlines()
                print(f"  w{i}: exit {p.returncode}; {lines[-2] if len(lines) > 1 else ''}")
            print(f"trained {total} samples in {wall:.1f} s: {total / wall:.0f} samples/s")
            model = Net(*widths)
            edl.torch.Parameters(model, admin).pull(admin)
            acc, test_loss = evaluate(model, FashionMNIST("t10k", augment=False))
            admin.report_evaluation(acc, test_loss, 10000)
            print(f"test accuracy {acc:.4f}, loss {test_loss:.4f}")
            rows = admin.ledgers()
            bad = [r for r in rows
                   if (r["applied"], r["duplicates"], r["missing"]) != (args.samples, 0, 0)]
            print(f"ledger: {len(rows)} shard-epochs, {'exact' if not bad else bad}")
            if bad:
                sys.exit(1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-workers", type=int, default=2,
                    help="DataLoader processes loading batches ahead (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--no-test", action="store_true", help="no test after each epoch")
    ap.add_argument("--no-augment", action="store_true", help="no random crops and flips")
    ap.add_argument("--log-interval", type=int, default=100, help="batches between lines")
    ap.add_argument("--local", action="store_true", help="run a job on this machine")
    ap.add_argument("--workers", type=int, default=1, help="--local: workers (default 1)")
    ap.add_argument("--shards", type=int, default=1, help="--local: shards (default 1)")
    ap.add_argument("--epochs", type=int, default=1, help="--local: epochs (default 1)")
    ap.add_argument("--samples", type=int, default=60000, help="--local: samples per epoch")
    ap.add_argument("--full", action="store_true",
                    help="--local, --plain: pytorch/examples' widths")
    ap.add_argument("--plain", action="store_true",
                    help="pytorch/examples' loop in this process, without EDL (--epochs, "
                         "--samples, --full as for --local), to compare with")
    ap.add_argument("--seed", type=int, default=1, help="--plain: torch's seed (default 1)")
    ap.add_argument("--print-job", action="store_true", help="print the job file and exit")
    args = ap.parse_args()
    if args.print_job:
        print(job_text(Net()), end="")
    elif args.local:
        local(args)
    elif args.plain:
        plain(args)
    else:
        work(args)


if __name__ == "__main__":
    main()
