"""A job's servers on this machine, for examples, tests and experiments: the coordinator and
shard servers (`edl-ps`) as real processes with a development PKI in a state directory, and
Python workers started and stopped as processes of their own.

    with edl.local.Cluster("job.toml", shards=2) as cluster:
        w = cluster.spawn([sys.executable, "train.py"], name="py1")   # EDL_* in its env
        ...
        print(cluster.admin().ledgers())

The `edl-ps` binary is found in $EDL_BIN_DIR, on $PATH, or in the checkout's target/release or
target/debug.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from . import Job


def find_binary(name: str) -> Path:
    """An EDL binary: $EDL_BIN_DIR, then $PATH, then this checkout's target/{release,debug}."""
    env = os.environ.get("EDL_BIN_DIR")
    candidates = [Path(env) / name] if env else []
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    here = Path(__file__).resolve()
    for root in [Path.cwd(), *here.parents]:
        candidates += [root / "target" / "release" / name, root / "target" / "debug" / name]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        f"{name} not found: set EDL_BIN_DIR, or build it (cargo build --release -p edl-ps)"
    )


def _wait_for_file(path: Path, proc: subprocess.Popen, what: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen within {timeout} s")


class Cluster:
    """A coordinator and `shards` shard servers for the job file `job`, in `state_dir` (a new
    temporary directory by default, removed on `stop`). `coordinator_args` are added to
    `edl-ps coordinator`'s command line."""

    def __init__(
        self,
        job,
        shards: int = 1,
        state_dir=None,
        coordinator_args=(),
        log_dir=None,
    ):
        self._tmp = None if state_dir else tempfile.mkdtemp(prefix="edl-py-")
        self.state_dir = Path(state_dir or self._tmp)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir) if log_dir else self.state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.job_file = Path(job)
        self.shards = shards
        self.coordinator_args = list(coordinator_args)
        self.procs: dict[str, subprocess.Popen] = {}
        self.coordinator: str | None = None

    def _start(self, name: str, args: list, env=None) -> subprocess.Popen:
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was started already in this cluster")
        log = open(self.log_dir / f"{name}.log", "wb")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = p
        return p

    def start(self, timeout: float = 30.0) -> "Cluster":
        try:
            return self._start_servers(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_servers(self, timeout: float) -> "Cluster":
        ps = str(find_binary("edl-ps"))
        for old in self.state_dir.glob("*.addr"):
            old.unlink()  # a reused state directory's: the servers write their own
        sd = ["--state-dir", str(self.state_dir)]
        addr = self.state_dir / "coordinator.addr"
        c = self._start(
            "coordinator",
            [ps, "coordinator", "--listen", "127.0.0.1:0", "--addr-file", str(addr),
             "--shards", str(self.shards), "--job", str(self.job_file), "--no-persist", *sd,
             *self.coordinator_args],
        )
        self.coordinator = _wait_for_file(addr, c, "the coordinator", timeout)
        for i in range(self.shards):
            name = f"s{i}"
            a = self.state_dir / f"{name}.addr"
            s = self._start(
                name,
                [ps, "shard", "--listen", "127.0.0.1:0", "--addr-file", str(a), "--name", name,
                 "--coordinator", self.coordinator, "--no-checkpoint", *sd],
            )
            _wait_for_file(a, s, f"shard {name}", timeout)
        return self

    def env(self, name: str) -> dict:
        """The environment a worker process gets: EDL_COORDINATOR, EDL_STATE_DIR, EDL_NAME."""
        inherited = {k: v for k, v in os.environ.items()
                      if k not in ("EDL_CERT", "EDL_KEY", "EDL_CA")}
        return {
            **inherited,
            "EDL_COORDINATOR": self.coordinator,
            "EDL_STATE_DIR": str(self.state_dir),
            "EDL_NAME": name,
        }

    def spawn(self, args: list, name: str, env: dict | None = None) -> subprocess.Popen:
        """Starts a worker process (any command; `Job.from_env()` connects it), logging to
        LOG_DIR/NAME.log; `env` adds to its environment."""
        return self._start(name, [str(a) for a in args], env={**self.env(name), **(env or {})})

    def job(self, name: str, role: str = "worker", reconnect: float | None = 30.0) -> Job:
        """A client of the job with the certificate ROLE/NAME from the state directory; it
        gives up on a server unreachable for `reconnect` seconds (None: never)."""
        return Job(self.coordinator, state_dir=self.state_dir, name=name, role=role,
                   reconnect=reconnect)

    def admin(self) -> Job:
        """An admin client (status, ledgers, drain)."""
        return self.job("py-admin", role="admin")

    def wait_finished(self, timeout: float, admin: Job | None = None) -> dict:
        """Waits for the job's data to be done; returns the last status."""
        admin = admin or self.admin()
        deadline = time.monotonic() + timeout
        while True:
            st = admin.status()
            if st["finished"]:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish within {timeout} s: {st}")
            time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stops every process (SIGTERM, then SIGKILL after 5 s) and removes a temporary
        state directory."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
