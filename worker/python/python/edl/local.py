"""A job's servers on this machine, for examples, tests and experiments: the coordinator and
shard servers (`edl-ps`) as real processes with a development PKI in a state directory, and
worker processes started and stopped as a placer would (the process contract of `edl`'s
docstring: `EDL_COORDINATOR`, `EDL_STATE_DIR`, `EDL_NAME`, `EDL_PLACEMENT`, the job file's
folder as working directory; SIGTERM to stop).

    with edl.local.Cluster("job.toml", shards=2) as cluster:
        w = cluster.spawn([sys.executable, "train.py"], name="py1")   # EDL_* in its env
        cluster.wait_finished(timeout=600)
        print(cluster.admin().ledgers())

The job file is checked (`edl-ps job check`) before anything starts, and its own error is
raised (`JobFileError`). Every process talks over loopback with 65000-byte QUIC datagrams, as
`edl-local` runs them (`EDL_DATAGRAM`; QUIC's 1,452-byte datagrams, where path-MTU discovery
used to stop, cost a 1.2M-parameter CNN more than twice the time per pull and push). A run
that fails keeps its logs and says where.

The binaries (`edl-ps`, `edl-worker`, ...) are found in `$EDL_BIN_DIR`, in the package itself
(`edl/_bin/`: the wheel carries them), on `$PATH`, in `$CARGO_HOME/bin` (`~/.cargo/bin`),
where `cargo install` puts them, or in an EDL checkout's `target/release` or `target/debug`
(this package's, or the working directory's); `edl bin-dir` prints where they are found.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import Job

#: The QUIC datagram size for loopback (edl_shared::transport::LOOPBACK_DATAGRAM): what
#: `edl-local` gives its processes through `EDL_DATAGRAM`.
LOOPBACK_DATAGRAM = 65000

#: Where `cargo install --path CRATE` of an EDL checkout builds each binary from.
_CRATES = {"edl-ps": "ps", "edlctl": "ps", "edl-worker": "worker", "edl-local": "deploy",
           "edl-sched": "ps/sched"}


#: Where the wheel carries the programs (`pip install ./worker/python` builds them in).
PACKAGE_BIN = Path(__file__).resolve().parent / "_bin"


class JobFileError(ValueError):
    """A job file `edl-ps job check` refuses; the message is its own (file, line, field)."""


def _search_dirs() -> list[tuple[str, Path]]:
    """Where binaries are looked for, in order, each with how it was found."""
    out: list[tuple[str, Path]] = []
    env = os.environ.get("EDL_BIN_DIR")
    if env:
        out.append(("$EDL_BIN_DIR", Path(env)))
    # The programs the wheel carries (edl_build_backend.py put them there).
    out.append(("the package", PACKAGE_BIN))
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d:
            out.append(("$PATH", Path(d)))
    cargo_home = os.environ.get("CARGO_HOME")
    out.append(("cargo install", Path(cargo_home) / "bin" if cargo_home
                else Path.home() / ".cargo" / "bin"))
    here = Path(__file__).resolve()
    roots = []
    for root in [Path.cwd(), *here.parents]:
        if (root / "target").is_dir() and root not in roots:
            roots.append(root)
    for root in roots:
        for profile in ("release", "debug"):
            out.append(("checkout", root / "target" / profile))
    return out


def find_binary(name: str) -> Path:
    """The EDL binary `name` (e.g. `edl-ps`, or `examples/two_layer` under a target folder):
    from $EDL_BIN_DIR, the package's own (`PACKAGE_BIN`), $PATH, $CARGO_HOME/bin
    (~/.cargo/bin), or this checkout's (or the working directory's) target/release and
    target/debug, in that order. FileNotFoundError
    says where it looked and how to get it."""
    looked = []
    for how, d in _search_dirs():
        c = d / name
        if c.is_file() and os.access(c, os.X_OK):
            return c
        if how != "$PATH":
            looked.append(str(d))
    crate = _CRATES.get(name.split("/")[-1])
    install = (f"`cargo install --path {crate}` from an EDL checkout" if crate
               else "build it in an EDL checkout (cargo build --release)")
    raise FileNotFoundError(
        f"{name} not found on $PATH or in {', '.join(looked) or 'no other place'}: "
        f"{install}, or set EDL_BIN_DIR to the folder that holds it"
    )


def bin_dir() -> Path:
    """The folder `edl-ps` is found in (see `find_binary`)."""
    return find_binary("edl-ps").parent


def _quiet_env() -> dict:
    # A Rust program's error without the backtrace a developer's RUST_BACKTRACE=1 adds.
    return {**os.environ, "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"}


def check_job(path) -> str:
    """Checks a job file with `edl-ps job check` and returns the job it resolves to (the
    tensor table); raises JobFileError with the checker's own message if it is refused."""
    path = Path(path)
    if not path.is_file():
        raise JobFileError(f"{path}: no such job file")
    out = subprocess.run([str(find_binary("edl-ps")), "job", "check", str(path)],
                         capture_output=True, text=True, env=_quiet_env())
    if out.returncode != 0:
        msg = out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}"
        raise JobFileError(msg.removeprefix("Error: "))
    return out.stdout


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    rows = text.rstrip().splitlines()
    return "\n".join(rows[-lines:]) if rows else "(empty log)"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


class Cluster:
    """A coordinator and `shards` shard servers for the job file `job`, in `state_dir` (a new
    temporary directory by default, removed on `stop` unless the run failed: its logs are then
    kept). `coordinator_args` are added to `edl-ps coordinator`'s command line. `datagram`
    is the QUIC datagram size of every process and client of the cluster (None: QUIC's
    default; an `EDL_DATAGRAM` in the environment wins)."""

    def __init__(
        self,
        job,
        shards: int = 1,
        state_dir=None,
        coordinator_args=(),
        log_dir=None,
        datagram: int | None = LOOPBACK_DATAGRAM,
    ):
        self._tmp = None if state_dir else tempfile.mkdtemp(prefix="edl-py-")
        self.state_dir = Path(state_dir or self._tmp)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir) if log_dir else self.state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.job_file = Path(job).resolve()
        self.shards = shards
        self.coordinator_args = list(coordinator_args)
        env_datagram = os.environ.get("EDL_DATAGRAM")
        self.datagram = int(env_datagram) if env_datagram else datagram
        self.procs: dict[str, subprocess.Popen] = {}
        #: The worker processes `spawn` started, by name.
        self.workers: dict[str, subprocess.Popen] = {}
        self.coordinator: str | None = None
        #: True once the run failed (an exception in the `with` block, a server that died):
        #: `stop` then keeps the logs.
        self.failed = False
        self._old_term = None

    def _env(self) -> dict:
        env = dict(os.environ)
        if self.datagram is not None:
            env["EDL_DATAGRAM"] = str(self.datagram)
        return env

    def _start(self, name: str, args: list, env=None, cwd=None) -> subprocess.Popen:
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was started already in this cluster")
        log = open(self.log_dir / f"{name}.log", "wb")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env or self._env(),
                             cwd=cwd, stdin=subprocess.DEVNULL)
        log.close()
        self.procs[name] = p
        return p

    def start(self, timeout: float = 30.0) -> "Cluster":
        """Checks the job file, then starts the servers and waits until they listen."""
        try:
            check_job(self.job_file)
            return self._start_servers(timeout)
        except BaseException:
            self.failed = True
            self.stop()
            raise

    def _wait_listening(self, path: Path, name: str, what: str, timeout: float) -> str:
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            if proc.poll() is not None:
                log = self.log_dir / f"{name}.log"
                raise RuntimeError(
                    f"{what} {_exit_text(proc.returncode)} before listening; the end of its "
                    f"log ({log}):\n{_tail(log)}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"{what} did not listen within {timeout} s")

    def _start_servers(self, timeout: float) -> "Cluster":
        ps = str(find_binary("edl-ps"))
        for old in self.state_dir.glob("*.addr"):
            old.unlink()  # a reused state directory's: the servers write their own
        sd = ["--state-dir", str(self.state_dir)]
        addr = self.state_dir / "coordinator.addr"
        self._start(
            "coordinator",
            [ps, "coordinator", "--listen", "127.0.0.1:0", "--addr-file", str(addr),
             "--shards", str(self.shards), "--job", str(self.job_file), "--no-persist", *sd,
             *self.coordinator_args],
        )
        self.coordinator = self._wait_listening(addr, "coordinator", "the coordinator", timeout)
        for i in range(self.shards):
            name = f"s{i}"
            a = self.state_dir / f"{name}.addr"
            self._start(
                name,
                [ps, "shard", "--listen", "127.0.0.1:0", "--addr-file", str(a), "--name", name,
                 "--coordinator", self.coordinator, "--no-checkpoint", *sd],
            )
            self._wait_listening(a, name, f"shard {name}", timeout)
        return self

    def env(self, name: str, placement: int | None = None) -> dict:
        """The environment a worker process gets, as a placer gives it: EDL_COORDINATOR,
        EDL_STATE_DIR, EDL_NAME, EDL_PLACEMENT when given, EDL_DATAGRAM."""
        inherited = {k: v for k, v in self._env().items()
                     if k not in ("EDL_CERT", "EDL_KEY", "EDL_CA", "EDL_JOB", "EDL_PLACEMENT")}
        env = {
            **inherited,
            "EDL_COORDINATOR": self.coordinator,
            "EDL_STATE_DIR": str(self.state_dir),
            "EDL_NAME": name,
        }
        if placement is not None:
            env["EDL_PLACEMENT"] = str(placement)
        return env

    def spawn(self, args: list, name: str, env: dict | None = None,
              placement: int | None = None, cwd=None) -> subprocess.Popen:
        """Starts a worker process (any command; `Job.from_env()` connects it) in the job file's
        folder (or `cwd`), logging to LOG_DIR/NAME.log; `env` adds to its environment and
        `placement` names the placement it is started for."""
        p = self._start(name, [str(a) for a in args],
                        env={**self.env(name, placement), **(env or {})},
                        cwd=cwd or self.job_file.parent)
        self.workers[name] = p
        return p

    def job(self, name: str, role: str = "worker", reconnect: float | None = 30.0) -> Job:
        """A client of the job with the certificate ROLE/NAME from the state directory; it
        gives up on a server unreachable for `reconnect` seconds (None: never)."""
        return Job(self.coordinator, state_dir=self.state_dir, name=name, role=role,
                   reconnect=reconnect, datagram=self.datagram)

    def admin(self) -> Job:
        """An admin client (status, ledgers, drain)."""
        return self.job("py-admin", role="admin")

    def check(self, admin: Job | None = None) -> None:
        """Raises RuntimeError if the run cannot go on: a server exited, or every worker
        started has exited while the job is not finished (nobody is left to train it). The
        error gives each process's exit and the end of its log."""
        servers = {n: p for n, p in self.procs.items() if n not in self.workers}
        dead = {n: p for n, p in servers.items() if p.poll() is not None}
        if dead:
            self.failed = True
            raise RuntimeError("; ".join(
                f"{n} {_exit_text(p.returncode)}; the end of its log:\n"
                f"{_tail(self.log_dir / f'{n}.log')}" for n, p in dead.items()))
        if not self.workers or any(p.poll() is None for p in self.workers.values()):
            return
        admin = admin or self.admin()
        if admin.status()["finished"]:
            return
        self.failed = True
        rows = [f"{n} {_exit_text(p.returncode)}; the end of its log:\n"
                f"{_tail(self.log_dir / f'{n}.log', 8)}" for n, p in self.workers.items()]
        raise RuntimeError("every worker has exited and the job is not finished:\n"
                           + "\n".join(rows))

    def wait_finished(self, timeout: float, admin: Job | None = None) -> dict:
        """Waits for the job's data to be done; returns the last status. Raises RuntimeError
        as soon as the run cannot finish (see `check`), TimeoutError after `timeout` s."""
        admin = admin or self.admin()
        deadline = time.monotonic() + timeout
        while True:
            st = admin.status()
            if st["finished"]:
                return st
            self.check(admin)
            if time.monotonic() > deadline:
                self.failed = True
                raise TimeoutError(f"the job did not finish within {timeout} s: {st}")
            time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    @staticmethod
    def _end(procs: list[subprocess.Popen], grace: float) -> None:
        """SIGTERM to each, then SIGKILL to those still running after `grace` seconds."""
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop(self, grace: float = 10.0) -> None:
        """Stops the workers first (SIGTERM: they finish their step and leave while the
        servers still answer), then the shards and the coordinator, each group getting `grace`
        seconds before SIGKILL. A temporary state directory is removed; if the run failed its
        logs are kept (the path is printed on stderr)."""
        self._end(list(self.workers.values()), grace)
        servers = [p for n, p in self.procs.items() if n not in self.workers]
        self._end([p for p in servers if p is not self.procs.get("coordinator")], grace)
        self._end([p for p in servers if p is self.procs.get("coordinator")], grace)
        if not self._tmp:
            return
        if self.failed:
            for entry in self.state_dir.iterdir():
                if entry != self.log_dir:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            print(f"edl.local: the run failed; its logs are in {self.log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        # A SIGTERM to this launcher ends the `with` block as an exception, so that its
        # processes are stopped instead of left running.
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            return self.start()
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.failed = True
        try:
            self.stop()
        finally:
            self._restore()


def _raise_terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)
