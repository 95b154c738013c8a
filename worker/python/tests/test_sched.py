"""A Python job on the cluster scheduler: `edl-sched` on 4 slots runs a job whose `[worker]`
command is a Python program (tests/worker.py, NumPy arrays through the `edl` package, joined
by the process contract) beside a built-in `edl-worker` MLP job, every process real. Under the
elastic policy both are resized, one Python worker is SIGKILLed and another migrated; the same
pair without churn (a long built-in job, then a short Python one) runs under elastic and under
static FIFO; every ledger is exact and no slot is ever held twice. The jobs' completion times
under both policies are printed (run with -s to see them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKER, job_text

BINS = Path(os.environ["EDL_BIN_DIR"])
DATA = Path("/usr/share/datasets/fashion-mnist")
LIMIT_S = 300


def have_data() -> bool:
    if any((DATA / f"train-images-idx3-ubyte{z}").exists() for z in ("", ".gz")):
        return True
    assert os.environ.get("EDL_REQUIRE_DATA") != "1", "Fashion-MNIST is not installed"
    return False


class Sched:
    """An edl-sched process on 4 slots under `policy`, driven with edlctl."""

    def __init__(self, tmp: Path, policy: str):
        self.state = tmp / f"state-{policy}"
        cluster = tmp / f"cluster-{policy}.toml"
        cluster.write_text(
            f'policy = "{policy}"\nslots = 4\nshards = 1\nresize_interval = "1s"\n'
            'resize_overhead = 1.0\nworker_args = ["--slowdown", "10"]\n'
        )
        addr_file = tmp / f"sched-{policy}.addr"
        self.log = open(tmp / f"sched-{policy}.log", "w")
        self.proc = subprocess.Popen(
            [BINS / "edl-sched", "--cluster", cluster, "--state-dir", self.state,
             "--listen", "127.0.0.1:0", "--addr-file", addr_file, "--bin-dir", BINS,
             "--stop-jobs-on-exit"],
            stderr=self.log, stdout=self.log,
        )
        deadline = time.monotonic() + 30
        while not addr_file.exists():
            assert time.monotonic() < deadline, "edl-sched did not start"
            assert self.proc.poll() is None, "edl-sched exited"
            time.sleep(0.02)
        self.addr = addr_file.read_text().strip()

    def edlctl(self, *args: str) -> str:
        out = subprocess.run(
            [BINS / "edlctl", "--scheduler", self.addr, "--state-dir", self.state, *args],
            capture_output=True, text=True,
        )
        assert out.returncode == 0, f"edlctl {args}: {out.stderr}"
        return out.stdout

    def submit(self, file: Path, name: str, workers: int) -> None:
        self.edlctl("job", "submit", str(file), "--job", name, "--workers", str(workers),
                    "--min", "1", "--max", str(workers))

    def jobs(self) -> dict[str, dict]:
        return {j["name"]: j for j in json.loads(self.edlctl("--json", "job", "list"))}

    def wait(self, what: str, until) -> dict[str, dict]:
        deadline = time.monotonic() + LIMIT_S
        while True:
            jobs = self.jobs()
            if until(jobs):
                return jobs
            assert time.monotonic() < deadline, f"{what}: {jobs}"
            time.sleep(0.2)

    def workers(self, job: str) -> list[tuple[str, int]]:
        """The job's worker processes as the scheduler saved them: (name, pid)."""
        saved = json.loads((self.state / "sched.json").read_text())
        for j in saved["jobs"]:
            if j["name"] == job:
                return [(p["name"], p["pid"]) for p in j["procs"] if p.get("slot")]
        return []

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.log.close()


def check_slots(events_file: Path) -> int:
    """Replays the scheduler's event log: no slot is taken while held. Returns the most held."""
    held: dict[str, str] = {}
    most = 0
    for i, line in enumerate(events_file.read_text().splitlines()):
        e = json.loads(line)
        slot, worker = e.get("slot"), e.get("worker")
        if slot is None or worker is None:
            continue
        if e["event"] == "take":
            by = held.get(slot)
            assert by is None, f"event {i}: {e['job']}/{worker} took {slot}, held by {by}"
            held[slot] = f"{e['job']}/{worker}"
        elif e["event"] == "release":
            assert held.pop(slot, None) is not None, f"event {i}: {slot} released but not held"
        most = max(most, len(held))
    return most


def until_true(what: str, f, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not f():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def run_pattern(
    tmp: Path, policy: str, *, builtin_samples: int, python_samples: int, python_workers: int,
    churn: bool,
) -> dict[str, float]:
    """The built-in job asks for all 4 slots; once it trains, the Python job asks for
    `python_workers`. With `churn`, one Python worker is migrated and another SIGKILLed.
    Returns the jobs' completion times."""
    tmp = tmp / f"{policy}-{'churn' if churn else 'plain'}"
    tmp.mkdir()
    sched = Sched(tmp, policy)
    try:
        builtin = tmp / "builtin.toml"
        builtin.write_text(
            '[model]\nkind = "mlp"\nlayers = [784, 32, 10]\n\n[optimizer]\nkind = "sgd"\n'
            'lr = 0.05\n\n[training]\nconsistency = "asp"\n'
            f"samples = {builtin_samples}\nepochs = 1\n"
            "batch_size = 32\npartition_size = 256\nlease_ms = 2000\n"
        )
        python = tmp / "python.toml"
        python.write_text(
            job_text(samples=python_samples, batch=16, partition=256, lease_ms=2000)
            + f"\n[worker]\ncommand = [{json.dumps(sys.executable)}, {json.dumps(str(WORKER))}, "
            '"0.03"]\nenv = { PYTHONUNBUFFERED = "1" }\n'
        )
        sched.submit(builtin, "builtin", 4)
        sched.wait("the built-in job did not train",
                   lambda j: j.get("builtin", {}).get("samples", 0) > 0)
        sched.submit(python, "python", python_workers)
        sched.wait("the Python job did not train",
                   lambda j: j.get("python", {}).get("samples", 0) > 0)
        shown = sched.edlctl("job", "show", "python")
        assert "workers run" in shown and "worker.py" in shown, shown
        if churn:
            # Migrate one through the job's coordinator, with the owner's certificate.
            row = sched.jobs()["python"]
            moved = sched.workers("python")[0][0]
            pki = Path(row["dir"]) / "pki"
            out = subprocess.run(
                [BINS / "edlctl", "--coordinator", row["coordinator"], "--ca", pki / "ca.pem",
                 "--cert", pki / "admin-edlctl.pem", "--key", pki / "admin-edlctl.key",
                 "migrate", moved, "--wait", "60s"],
                capture_output=True, text=True,
            )
            assert out.returncode == 0, f"migrate {moved}: {out.stdout}{out.stderr}"
            until_true(f"{moved} did not leave after its migration",
                       lambda: moved not in [n for n, _ in sched.workers("python")])
            # SIGKILL another: the scheduler frees its slot and starts a replacement.
            before = sched.workers("python")
            victim, pid = before[0]
            os.kill(pid, signal.SIGKILL)
            until_true(
                f"no replacement for the killed {victim}",
                lambda: (now := [n for n, _ in sched.workers("python")])
                and victim not in now
                and any(n not in [b for b, _ in before] for n in now),
            )
        jobs = sched.wait(
            "the jobs did not end",
            lambda j: all(x["state"] not in ("queued", "running") for x in j.values()),
        )
        for name, j in jobs.items():
            assert j["state"] == "finished", f"{policy} {name}: {j}"
            ledger = j["ledger"]
            assert (ledger["applied"], ledger["duplicates"], ledger["missing"]) == (
                j["samples_total"], 0, 0), f"{policy} {name}: {j}"
            if churn:
                assert j["resizes"] >= 1, f"{name} was never resized: {j}"
        assert check_slots(sched.state / "events.jsonl") <= 4
        return {name: j["jct_s"] for name, j in jobs.items()}
    finally:
        sched.stop()


def test_a_python_job_beside_a_builtin_one_under_elastic_and_fifo(tmp_path):
    if not have_data():
        pytest.skip("Fashion-MNIST is not installed")
    for b in ("edl-sched", "edlctl", "edl-ps", "edl-worker"):
        assert (BINS / b).exists(), f"{b} is not in {BINS}: build the workspace"
    # Both jobs resized, a Python worker migrated and one killed, under elastic.
    run_pattern(tmp_path, "elastic", builtin_samples=16000, python_samples=12000,
                python_workers=4, churn=True)
    # The same pair without churn, a long built-in job and a short Python one, under both
    # policies: what sharing the slots elastically does to their completion times.
    sizes = dict(builtin_samples=32000, python_samples=6000, python_workers=2, churn=False)
    elastic = run_pattern(tmp_path, "elastic", **sizes)
    fifo = run_pattern(tmp_path, "fifo", **sizes)
    for name, label in (("python", "Python job"), ("builtin", "built-in job")):
        print(f"{label}: completion {elastic[name]:.1f} s elastic, {fifo[name]:.1f} s fifo")
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    print(f"mean completion: elastic {mean(elastic):.1f} s, fifo {mean(fifo):.1f} s "
          f"({mean(elastic) / mean(fifo):.2f} of fifo)")
