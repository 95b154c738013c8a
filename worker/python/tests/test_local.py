"""edl.local outside and inside a run: finding the binaries, the `edl` command, job files checked
before anything starts, servers that die early, launchers whose workers all died, the order of
a stop, the loopback datagram size, and what a failed run leaves behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import edl.local
from conftest import job_text, spawn_worker
from test_elastic import wait_until

BAD_OPTIMIZER = job_text().replace('kind = "sgd"', 'kind = "lamb"')


def edl_command() -> Path:
    """The `edl` console script pip installed beside this Python."""
    return Path(sys.executable).parent / "edl"


def test_binaries_are_found_where_cargo_install_puts_them(tmp_path, monkeypatch):
    real = edl.local.find_binary("edl-ps")
    cargo = tmp_path / "cargo"
    (cargo / "bin").mkdir(parents=True)
    (cargo / "bin" / "edl-ps").symlink_to(real)
    monkeypatch.delenv("EDL_BIN_DIR")
    monkeypatch.setattr(edl.local, "PACKAGE_BIN", tmp_path / "no-programs")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("CARGO_HOME", str(cargo))
    assert edl.local.find_binary("edl-ps") == cargo / "bin" / "edl-ps"
    assert edl.local.bin_dir() == cargo / "bin"
    # EDL_BIN_DIR comes first.
    monkeypatch.setenv("EDL_BIN_DIR", str(real.parent))
    assert edl.local.find_binary("edl-ps") == real


def test_a_missing_binary_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(edl.local, "_search_dirs", lambda: [("$EDL_BIN_DIR", Path("/nowhere"))])
    with pytest.raises(FileNotFoundError) as e:
        edl.local.find_binary("edl-ps")
    msg = str(e.value)
    assert "cargo install --path ps" in msg and "EDL_BIN_DIR" in msg and "/nowhere" in msg, msg
    out = subprocess.run([edl_command(), "bin-dir"], capture_output=True, text=True,
                         env={**os.environ, "EDL_BIN_DIR": "/nowhere", "PATH": "/usr/bin:/bin",
                              "CARGO_HOME": "/nowhere"}, cwd="/")
    # Run from / with nothing else on the way: the programs the package carries.
    assert out.returncode == 0 and Path(out.stdout.strip()) == edl.local.PACKAGE_BIN, out


def test_the_installed_package_carries_its_programs(tmp_path):
    # A venv with the wheel and nothing else: no EDL_BIN_DIR, no checkout on the way, another
    # folder; the example job file's check and a job's servers come from the package's own.
    for name in ("edl-ps", "edlctl", "edl-worker", "edl-local", "edl-sched"):
        out = subprocess.run([edl.local.PACKAGE_BIN / name, "--version"], capture_output=True,
                             text=True)
        assert out.returncode == 0 and name in out.stdout, (name, out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDL_")}
    env.update(PATH="/usr/bin:/bin", CARGO_HOME=str(tmp_path / "nowhere"))
    out = subprocess.run([sys.executable, "-m", "edl", "bin-dir"], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0 and Path(out.stdout.strip()) == edl.local.PACKAGE_BIN, out


def test_the_edl_command_checks_job_files_and_finds_the_binaries(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(job_text())
    bad.write_text(BAD_OPTIMIZER)
    out = subprocess.run([edl_command(), "bin-dir"], capture_output=True, text=True)
    assert out.returncode == 0 and Path(out.stdout.strip()) == edl.local.bin_dir(), out
    out = subprocess.run([edl_command(), "check", good], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith(edl.local.check_job(good)[:40]), out
    assert "w " in out.stdout and "[256, 4]" in out.stdout, out.stdout
    out = subprocess.run([edl_command(), "check", bad], capture_output=True, text=True)
    assert out.returncode == 1, out
    assert 'unknown optimizer "lamb"' in out.stderr and "backtrace" not in out.stderr, out
    # `python -m edl` is the same command, from any folder.
    out = subprocess.run([sys.executable, "-m", "edl", "check", good], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0 and "[256, 4]" in out.stdout, out


def test_a_refused_job_file_raises_the_checkers_own_message(make_cluster, tmp_path):
    with pytest.raises(edl.local.JobFileError, match=r'job0.toml:\d+: optimizer.kind: unknown '
                                                     r'optimizer "lamb"'):
        make_cluster(BAD_OPTIMIZER)
    # Refused before anything started.
    assert not (tmp_path / "state0" / "coordinator.addr").exists()


def test_a_server_that_exits_early_shows_its_log_which_is_kept(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(job_text())
    c = edl.local.Cluster(job, coordinator_args=["--no-such-flag"])
    with pytest.raises(RuntimeError) as e:
        with c:
            pass
    msg = str(e.value)
    assert "the coordinator exited with 2 before listening" in msg, msg
    assert "--no-such-flag" in msg, msg  # the end of its log
    # A failed run keeps its logs (and only them).
    assert c.log("coordinator") and "--no-such-flag" in c.log("coordinator")
    assert [p.name for p in c.state_dir.iterdir()] == ["logs"]
    shutil.rmtree(c.state_dir)  # kept for the user; the test leaves nothing behind


def test_a_launcher_whose_workers_all_died_is_told_and_cleans_up(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(job_text())
    c = edl.local.Cluster(job)
    with pytest.raises(RuntimeError) as e:
        with c:
            c.spawn([sys.executable, "-c", "import sys; print('no data here'); sys.exit(3)"],
                    "w0")
            c.wait_finished(timeout=300)
    msg = str(e.value)
    assert "every worker has exited and the job is not finished" in msg, msg
    assert "w0 exited with 3" in msg and "no data here" in msg, msg
    assert [p.name for p in c.state_dir.iterdir()] == ["logs"]
    assert all(p.poll() is not None for p in c.procs.values())
    shutil.rmtree(c.state_dir)


def test_a_successful_run_removes_its_state_directory(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(job_text(samples=64, batch=8))
    with edl.local.Cluster(job) as c:
        w = spawn_worker(c, "w0")
        c.wait_finished(timeout=60)
        assert w.wait(timeout=30) == 0
    assert not c.state_dir.exists()


def test_stop_lets_the_workers_leave_before_the_servers_stop(make_cluster, tmp_path):
    c = make_cluster(job_text(samples=100_000, batch=8, partition=1024, lease_ms=60_000))
    steps = tmp_path / "a.steps"
    a = spawn_worker(c, "a", "0.02", env={"EDL_STEPS_FILE": str(steps)})
    wait_until("a trains", lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3)
    c.stop()
    # SIGTERM first to the worker, which left while its servers still answered.
    assert a.returncode == 0, c.log("a")
    assert "done:" in c.log("a")
    assert all(p.returncode is not None for p in c.procs.values())


def test_every_process_uses_the_loopback_datagram(make_cluster, monkeypatch):
    c = make_cluster(job_text())
    assert c.datagram == edl.local.LOOPBACK_DATAGRAM == 65000
    coord = Path(f"/proc/{c.procs['coordinator'].pid}/environ").read_bytes().split(b"\0")
    assert b"EDL_DATAGRAM=65000" in coord
    show = [sys.executable, "-c", "import os; print('datagram', os.environ['EDL_DATAGRAM'])"]
    p = c.spawn(show, "show")
    assert p.wait(timeout=30) == 0
    assert "datagram 65000" in c.log("show")
    # A client of the cluster's works with it (every test's does; here explicitly).
    assert c.job("w1").param_count == 1028
    # An EDL_DATAGRAM of the user's wins.
    monkeypatch.setenv("EDL_DATAGRAM", "1200")
    d = make_cluster(job_text())
    assert d.datagram == 1200
    p = d.spawn(show, "show")
    assert p.wait(timeout=30) == 0 and "datagram 1200" in d.log("show")
