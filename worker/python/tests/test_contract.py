"""The process contract from Python: the environment `edl.Job.from_env()` reads, SIGTERM (drain)
and SIGUSR1 (a preemption notice) to real worker processes, and EDL_PLACEMENT naming the
placement a replacement was started for. The ledgers stay exact throughout."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

import edl
import edl.local
from conftest import exact, job_text, spawn_worker
from test_elastic import wait_until


def steps_of(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def states(admin) -> dict:
    return {name: state for _, name, state, _ in admin.status()["workers"]}


def test_sigterm_drains_a_python_worker_which_exits_0(make_cluster, tmp_path):
    # A lease far longer than the test: only a clean leave frees the data in time.
    samples = 1024
    c = make_cluster(job_text(samples=samples, batch=16, partition=128, lease_ms=60_000))
    admin = c.admin()
    steps = tmp_path / "a.steps"
    a = spawn_worker(c, "a", "0.05", env={"EDL_STEPS_FILE": str(steps)})
    wait_until("a trains", lambda: steps_of(steps) >= 3)
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=20) == 0, c.log("a")
    log = c.log("a")
    assert "SIGTERM: leaving after this step" in log and "done:" in log, log
    st = admin.status()
    a_row = next(w for w in st["workers"] if w[1] == "a")
    # Left, not dead; every step it took was committed and counted: its last step finished.
    assert a_row[2] == "Left", st["workers"]
    assert a_row[3] == steps_of(steps), (a_row, steps_of(steps))
    assert st["samples_done"] == 16 * steps_of(steps)
    b = spawn_worker(c, "b")
    c.wait_finished(timeout=60, admin=admin)  # well before a's 60 s lease
    assert b.wait(timeout=30) == 0, c.log("b")
    exact(admin.ledgers(), samples, 1)


def test_sigterm_ends_a_wait_for_data_at_once(make_cluster, tmp_path):
    # One partition: while a trains it (1 s a step, 8 steps) b can only wait for data.
    samples = 64
    c = make_cluster(job_text(samples=samples, batch=8, partition=64, lease_ms=60_000))
    admin = c.admin()
    steps = tmp_path / "a.steps"
    a = spawn_worker(c, "a", "1.0", env={"EDL_STEPS_FILE": str(steps)})
    wait_until("a trains", lambda: steps_of(steps) >= 1)
    b = spawn_worker(c, "b")
    wait_until("b joins", lambda: "joined as worker" in c.log("b"), timeout=60)
    time.sleep(0.5)  # b asks for data (a slower b only makes the test weaker, not wrong)
    t = time.monotonic()
    b.send_signal(signal.SIGTERM)
    assert b.wait(timeout=20) == 0, c.log("b")
    # Long before a's partition (at least 6 s more) could come free.
    assert time.monotonic() - t < 4.0
    assert states(admin)["b"] == "Left"
    assert "done: 0 steps" in c.log("b")
    c.wait_finished(timeout=60, admin=admin)
    assert a.wait(timeout=30) == 0, c.log("a")
    exact(admin.ledgers(), samples, 1)


def test_sigterm_before_joining_exits_0_at_once(make_cluster):
    c = make_cluster(job_text())
    admin = c.admin()
    a = spawn_worker(c, "a", env={"EDL_TEST_LOAD_S": "60"})
    wait_until("a loads", lambda: "loading" in c.log("a"), timeout=60)
    t = time.monotonic()
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=10) == 0, c.log("a")
    assert time.monotonic() - t < 5.0
    assert "a" not in states(admin)  # it never registered


def placements(c) -> list[dict]:
    out = subprocess.run(
        [edl.local.find_binary("edlctl"), "--coordinator", c.coordinator, "--state-dir",
         c.state_dir, "--json", "placements"],
        capture_output=True, text=True, env={**c.env("edlctl"), "RUST_BACKTRACE": "0"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_sigusr1_passes_the_notice_on_and_the_placement_replaces_the_worker(make_cluster,
                                                                              tmp_path):
    # Under `replace` a preempted worker trains on until a substitute, started for the
    # placement the coordinator asks for, is admitted; then it is drained.
    samples = 2048
    c = make_cluster(job_text(samples=samples, batch=16, partition=128, lease_ms=60_000),
                     coordinator_args=["--stragglers", "replace"])
    admin = c.admin()
    a_steps, b_steps = tmp_path / "a.steps", tmp_path / "b.steps"
    a = spawn_worker(c, "a", "0.05",
                     env={"EDL_STEPS_FILE": str(a_steps), "EDL_TEST_NOTICE": "60"})
    wait_until("a trains", lambda: steps_of(a_steps) >= 3)
    a.send_signal(signal.SIGUSR1)
    pending = wait_until("a placement for a's substitute",
                         lambda: [p for p in placements(c) if p["state"] == "pending"],
                         timeout=30)
    assert len(pending) == 1, pending
    placement = pending[0]["id"]
    at_notice = steps_of(a_steps)
    # b names the placement, as a placer starts it: EDL_PLACEMENT.
    b = spawn_worker(c, "b", "0.05", env={"EDL_STEPS_FILE": str(b_steps)}, placement=placement)
    # a is drained once b is admitted, and leaves cleanly (exit 0, Left).
    assert a.wait(timeout=60) == 0, c.log("a")
    assert "SIGUSR1: preemption notice" in c.log("a")
    assert steps_of(a_steps) > at_notice  # it trained on until its substitute came
    assert states(admin)["a"] == "Left"
    done = [p for p in placements(c) if p["id"] == placement]
    # Done by b, the worker started for it.
    assert len(done) == 1 and done[0]["state"].startswith("done: b ("), done
    c.wait_finished(timeout=120, admin=admin)
    assert b.wait(timeout=30) == 0, c.log("b")
    exact(admin.ledgers(), samples, 1)


def test_from_env_reads_the_contract(cluster_env, monkeypatch):
    c, env = cluster_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # A list of coordinators: the first is used.
    monkeypatch.setenv("EDL_COORDINATOR", f"{c.coordinator},127.0.0.1:9")
    job = edl.Job.from_env(signals=False)
    assert job.coordinator == c.coordinator and job.job_name == "default"
    assert job.placement is None
    monkeypatch.setenv("EDL_JOB", "default")
    monkeypatch.setenv("EDL_PLACEMENT", "7")
    job = edl.Job.from_env(signals=False)
    assert job.placement == 7
    monkeypatch.setenv("EDL_PLACEMENT", "x")
    with pytest.raises(ValueError, match="EDL_PLACEMENT: 'x' is not a placement id"):
        edl.Job.from_env(signals=False)
    monkeypatch.delenv("EDL_PLACEMENT")
    # The certificate belongs to job "default": another EDL_JOB is refused before connecting.
    monkeypatch.setenv("EDL_JOB", "mnist-7")
    with pytest.raises(ValueError, match='belongs to job "default", not to job "mnist-7"'):
        edl.Job.from_env(signals=False)
    monkeypatch.delenv("EDL_JOB")
    monkeypatch.setenv("EDL_CERT", "w.pem")
    with pytest.raises(ValueError, match="EDL_CA, EDL_CERT and EDL_KEY go together"):
        edl.Job.from_env(signals=False)


@pytest.fixture
def cluster_env(make_cluster):
    c = make_cluster(job_text())
    c.job("w1")  # issues worker/w1 in the state directory (job "default")
    env = {k: v for k, v in c.env("w1").items() if k.startswith("EDL_")}
    return c, env


def test_a_stop_that_cannot_leave_in_its_grace_says_what_it_holds(make_cluster, tmp_path):
    # The coordinator is gone: the step's commit cannot finish, nor can the leave. The worker
    # gives up after its grace period (the job's lease, 2 s) and names what it still holds.
    c = make_cluster(job_text(samples=100_000, batch=16, partition=1024, lease_ms=2000))
    steps = tmp_path / "a.steps"
    a = spawn_worker(c, "a", "0.05", env={"EDL_STEPS_FILE": str(steps)})
    wait_until("a trains", lambda: steps_of(steps) >= 3)
    c.procs["coordinator"].kill()
    c.procs["coordinator"].wait()
    t = time.monotonic()
    a.send_signal(signal.SIGTERM)
    code = a.wait(timeout=30)
    took = time.monotonic() - t
    log = c.log("a")
    assert code == 1, log
    assert "could not leave by the deadline" in log and "registration" in log, log
    assert "leased and not committed" in log, log
    assert 1.5 < took < 10, took  # its grace (2 s), not the transport's timeouts
