"""EDL from Python: join an elastic training job, lease its data exactly once, pull parameters
into and push gradients from your own NumPy arrays or CPU torch tensors.

A training loop::

    import numpy as np, edl

    job = edl.Job.from_env()                  # as a placer starts it (see below)
    params = np.zeros(job.param_count, np.float32)
    grads = np.zeros_like(params)
    with job.join() as session:               # prepared first, then admitted (stop-free)
        for batch in session.batches():       # leased spans, exactly once per epoch
            session.pull(params)              # into params, no new array
            loss_sum = my_step(params, batch.indices, grads)
            session.push(batch, grads)        # the gradient of exactly these samples
            session.commit(batch, loss_sum)   # the samples are done
    # leaving the `with` (also on Ctrl-C, SIGTERM or an exception) leaves the job: uncommitted
    # data returns to the pool for another worker

`batch.indices` is an int64 NumPy array, which indexes NumPy arrays and torch tensors alike
(`x[batch.indices]`). `edl.torch` maps a `torch.nn.Module` onto the job's tensors and feeds a
`DataLoader` (see its docstring); `edl.local` runs a job's servers on this machine.

The process contract
--------------------

A placer (`edl-local`, `edl-sched` with local processes or Kubernetes) starts any worker program
the same way, and `Job.from_env()` reads what it is given:

- `EDL_COORDINATOR`: the coordinator's address (`host:port`); a comma-separated list once
  coordinators are replicated (today the first entry is used).
- `EDL_CERT`, `EDL_KEY`, `EDL_CA`: the worker's certificate, its key and the job's CA (PEM
  files, all three); or else `EDL_STATE_DIR` with `EDL_NAME`: a development state directory
  whose PKI issues the certificate `worker/EDL_NAME` on demand.
- `EDL_JOB`: the job's name; the certificate must belong to it (a development certificate is
  issued for it).
- `EDL_NAME`: the worker's name (its certificate's).
- `EDL_PLACEMENT`: the placement the worker was started for, if any. It is named when the
  worker registers: once admitted, the worker it replaces (a straggler, a preempted or
  migrated worker) is drained, so the job never runs short.
- `CUDA_VISIBLE_DEVICES`: the devices of its slot (PyTorch sees only those).
- The working directory is the job file's folder; the job file's `[worker] env` is added.

Signals, which `Job.from_env()` handles from then on (`honour_signals` for a program that
builds its `Job` otherwise):

- SIGTERM drains: the step under way finishes and commits, the session leaves, and the program
  goes on after its `with` block (and exits 0 at its end). `session.batches()`, `edl.torch`'s
  loaders and `session.next_batch()` stop handing out batches, one waiting for data at once.
  The step and the leave must be done within the grace period (by default the job's lease);
  a call still waiting at its end is abandoned with `EdlError` (kind `"Overrun"`), and a leave
  that cannot finish raises `EdlError` (kind `"Unreturned"`) naming what the coordinator still
  holds. Before the worker joined (loading data, connecting) or after it left, SIGTERM ends the
  program at once with status 0: it holds nothing. A second SIGTERM exits at once (status 143)
  after an immediate leave.
- SIGUSR1 is a spot-preemption notice: the worker must be gone within `preempt_notice`
  seconds (30 by default). The coordinator is told at once; under the `replace` policy it asks
  the placer for a substitute and drains this worker once the substitute is admitted, otherwise
  it drains it at once. Either way the worker leaves after its step, and before the notice
  runs out. A notice that comes before the worker joined is passed on once it has.

Processes forked from the worker (a `DataLoader`'s workers) die of SIGTERM as usual and ignore
SIGUSR1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from . import _edl
from ._edl import EdlError

__all__ = ["Batch", "EdlError", "Job", "Session", "Spec", "Tensor", "honour_signals"]

#: The preemption notice a SIGUSR1 gives by default (seconds), as `edl-worker --preempt-notice`.
PREEMPT_NOTICE = 30.0


class Tensor(NamedTuple):
    """One of the job's tensors: its place in the flat parameter vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    size: int

    def of(self, flat):
        """This tensor's view of a flat parameter (or gradient) vector, shaped."""
        return flat[self.offset : self.offset + self.size].reshape(self.shape)


class Spec:
    """The job's tensors, by name and in order."""

    def __init__(self, tensors: Sequence[tuple[str, Sequence[int], int, int]]):
        self.tensors = [Tensor(n, tuple(s), o, k) for n, s, o, k in tensors]
        self._by_name = {t.name: t for t in self.tensors}
        self.param_count = sum(t.size for t in self.tensors)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"the job has no tensor {name!r}; it has {self.names}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def __repr__(self) -> str:
        rows = ", ".join(f"{t.name}{list(t.shape)}" for t in self.tensors)
        return f"Spec({rows}; {self.param_count} floats)"


def _buffer(x, what: str):
    """A buffer-protocol view of `x` without a copy: NumPy arrays as they are, CPU torch
    tensors through `.numpy()` (which shares the tensor's memory)."""
    if type(x).__module__.split(".")[0] == "torch":
        if x.device.type != "cpu":
            raise ValueError(f"{what} is on {x.device}; EDL reads and writes CPU memory")
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        return x.detach().numpy()
    return x


class Span(NamedTuple):
    """Where a batch lies in the job's data: its epoch, partition and positions start..end
    in the epoch's order."""

    epoch: int
    partition: int
    start: int
    end: int


class Batch:
    """A mini-batch leased to this worker. Push its gradient once, then commit it once."""

    __slots__ = ("_b", "_indices")

    def __init__(self, b: _edl.Batch):
        self._b = b
        self._indices = None

    @property
    def indices(self) -> np.ndarray:
        """The sample indices in the training set, in the epoch's order: an int64 array, which
        NumPy arrays and torch tensors both take as an index (`x[batch.indices]`)."""
        if self._indices is None:
            self._indices = np.array(self._b.indices, dtype=np.int64)
        return self._indices

    @property
    def epoch(self) -> int:
        return self._b.epoch

    @property
    def span(self) -> Span:
        return Span(*self._b.span)

    @property
    def clock(self) -> int:
        return self._b.clock

    @property
    def committed(self) -> bool:
        return self._b.committed

    def __len__(self) -> int:
        return len(self._b)

    def __repr__(self) -> str:
        return repr(self._b)


def _first_address(coordinator) -> str:
    """The address to use of `coordinator`: one address, a comma-separated list, or a
    sequence (the first entry, until coordinators are replicated)."""
    if isinstance(coordinator, str):
        coordinator = coordinator.split(",")
    addrs = [str(a).strip() for a in coordinator if str(a).strip()]
    if not addrs:
        raise ValueError("the coordinator's address is empty")
    return addrs[0]


class Job:
    """A connection to a running job.

    Either with a certificate signed by the job's CA::

        edl.Job("10.0.0.5:7070", cert="worker.pem", key="worker.key", ca="ca.pem")

    or with a local run's development PKI (the state directory of `edl-local` or of
    `edl-ps --state-dir`; the certificate `ROLE/NAME` is created there if missing)::

        edl.Job("127.0.0.1:7070", state_dir="edl-state", name="py1")

    or as a placer started the program: `edl.Job.from_env()`.

    Waits until the coordinator answers (at most `reconnect` seconds when given) and the shard
    map is ready. Ctrl-C interrupts the wait. `datagram` fixes QUIC's datagram size (65000 on
    loopback, as `edl.local` passes it; by default `EDL_DATAGRAM`'s, else QUIC's own). `job`
    is the job's name the certificate must belong to; `placement` the placement this worker
    was started for (see the process contract in the module's docstring).
    """

    def __init__(
        self,
        coordinator,
        cert=None,
        key=None,
        ca=None,
        *,
        state_dir=None,
        name: str | None = None,
        role: str = "worker",
        reconnect: float | None = None,
        datagram: int | None = None,
        job: str | None = None,
        placement: int | None = None,
    ):
        coordinator = _first_address(coordinator)
        if state_dir is not None:
            if name is None:
                raise ValueError("a state_dir needs the certificate's name (name=...)")
            self._job = _edl.Job.local(coordinator, str(state_dir), name, role, reconnect,
                                       datagram, job)
        elif cert is None or key is None or ca is None:
            raise ValueError("give cert, key and ca (PEM files), or state_dir and name")
        else:
            self._job = _edl.Job(coordinator, str(cert), str(key), str(ca), reconnect, datagram,
                                 job)
        self.coordinator = coordinator
        self.placement = placement
        if placement is not None:
            self._job.for_placement(int(placement))
        self.spec = Spec(self._job.tensors())
        self._config = None

    @classmethod
    def from_env(
        cls,
        name: str | None = None,
        role: str = "worker",
        reconnect=None,
        *,
        signals: bool = True,
        preempt_notice: float = PREEMPT_NOTICE,
        grace: float | None = None,
    ) -> "Job":
        """Connects as a placer says (the process contract, in this module's docstring):
        EDL_COORDINATOR (default 127.0.0.1:7070; of a list, the first), EDL_CERT, EDL_KEY and
        EDL_CA, or else EDL_STATE_DIR (default edl-state) with the name `name` or EDL_NAME;
        EDL_JOB, the job the certificate must belong to; EDL_PLACEMENT, the placement the
        worker was started for.

        With `signals` (the default) and on the main thread it first installs the contract's
        handlers: SIGTERM drains (grace: `grace` seconds, by default the job's lease), SIGUSR1
        is a preemption notice of `preempt_notice` seconds (see `honour_signals`)."""
        env = os.environ
        if signals and threading.current_thread() is threading.main_thread():
            honour_signals(preempt_notice=preempt_notice, grace=grace)
        coordinator = _first_address(env.get("EDL_COORDINATOR") or "127.0.0.1:7070")
        job = env.get("EDL_JOB") or None
        placement = env.get("EDL_PLACEMENT") or None
        if placement is not None:
            try:
                placement = int(placement)
            except ValueError:
                raise ValueError(f"EDL_PLACEMENT: {placement!r} is not a placement id") from None
        files = {v: env.get(v) for v in ("EDL_CERT", "EDL_KEY", "EDL_CA") if env.get(v)}
        if len(files) == 3:
            return cls(coordinator, files["EDL_CERT"], files["EDL_KEY"], files["EDL_CA"],
                       reconnect=reconnect, job=job, placement=placement)
        if files:
            raise ValueError("EDL_CA, EDL_CERT and EDL_KEY go together: set all three "
                             f"(only {', '.join(sorted(files))} is set)")
        name = name or env.get("EDL_NAME")
        if not name:
            raise ValueError("set EDL_NAME (or EDL_CERT, EDL_KEY and EDL_CA), or pass name=")
        return cls(coordinator, state_dir=env.get("EDL_STATE_DIR") or "edl-state", name=name,
                   role=role, reconnect=reconnect, job=job, placement=placement)

    @property
    def param_count(self) -> int:
        return self.spec.param_count

    @property
    def job_name(self) -> str:
        """The job this client's certificate belongs to (`default` without one named)."""
        return self._job.job

    def config(self) -> dict:
        """The job's settings (model, optimizer, consistency, batch_size, epochs, samples,
        partition_size, seed, lease_ms...)."""
        if self._config is None:
            self._config = self._job.config()
        return dict(self._config)

    def status(self) -> dict:
        """The coordinator's progress report (samples_done, samples_total, finished...)."""
        return self._job.status()

    def ledgers(self) -> list[dict]:
        """Every shard's per-epoch data ledger (applied, duplicates, missing)."""
        return self._job.ledgers()

    def drain(self, worker: int) -> None:
        """Asks a worker to leave after its current step (needs an admin certificate)."""
        self._job.drain(worker)

    def pull(self, out=None):
        """The whole model as it stands (for evaluation), into `out` if given; without
        joining."""
        if out is None:
            out = np.empty(self.param_count, np.float32)
        self._pulled_clock = self._job.pull(_buffer(out, "out"))
        return out

    def report_evaluation(
        self, accuracy: float, loss: float, samples: int, clock: int | None = None
    ) -> None:
        """Reports an evaluation to the coordinator (`edlctl status` and the dashboard show
        the latest): accuracy in [0, 1], mean loss, samples evaluated, and the clock the
        parameters were pulled through (by default that of the last `pull`)."""
        if clock is None:
            clock = getattr(self, "_pulled_clock", 0)
        self._job.report_evaluation(int(clock), float(accuracy), float(loss), int(samples))

    def join(self) -> "Session":
        """Joins the job as a worker and returns the session; do slow set-up (loading data,
        building the model) before, so the other workers never wait for it. The Job cannot be
        used afterwards."""
        config = self.config()
        contract = _SIGNALS
        if contract is not None:
            contract.joining += 1
        try:
            s = self._job.join()
        finally:
            if contract is not None:
                contract.joining -= 1
        return Session(s, self.spec, config, contract)


class Session:
    """A worker's membership in a job. Use it in a `with` block, which leaves the job at its
    end (on an exception or Ctrl-C too): uncommitted data then returns to the pool."""

    def __init__(self, s: _edl.Session, spec: Spec, config: dict | None = None,
                 contract: "_Signals | None" = None):
        self._s = s
        self.spec = spec
        #: The job's settings, as `Job.config()`.
        self.config = dict(config or {})
        if contract is not None:
            contract.attach(self)

    @property
    def worker(self) -> int:
        """This worker's id."""
        return self._s.worker

    @property
    def clock(self) -> int:
        """Steps completed."""
        return self._s.clock

    @property
    def param_count(self) -> int:
        return self._s.param_count

    @property
    def drain_requested(self) -> bool:
        """True once an operator, the scheduler or a replacement asked this worker to leave."""
        return self._s.drain_requested

    @property
    def stopping(self) -> bool:
        """True once `stop` was called (SIGTERM under the process contract)."""
        return self._s.stopping

    @property
    def deadline(self) -> float | None:
        """Seconds left before this worker must be gone (a stop's grace period or a
        preemption notice), or None."""
        return self._s.deadline

    @property
    def should_leave(self) -> bool:
        """True once the worker should leave after its step: drained, stopped, or within half a
        second of its deadline."""
        d = self._s.deadline
        return self._s.drain_requested or self._s.stopping or (d is not None and d <= 0.5)

    @property
    def left(self) -> bool:
        return self._s.left

    def traffic(self) -> tuple[int, int, int]:
        """Payload bytes (sent, received) and shard requests so far."""
        return self._s.traffic()

    def stop(self, grace: float | None = None) -> None:
        """Asks this session to leave within `grace` seconds (None: no deadline): no batch is
        handed out from now on (a `next_batch` waiting for data returns None at once), the
        step under way finishes, and its calls are abandoned past the deadline. Safe from a
        signal handler: SIGTERM calls it under the process contract."""
        self._s.stop(grace)

    def preempt(self, notice: float = PREEMPT_NOTICE) -> None:
        """A preemption notice: the worker must be gone within `notice` seconds. Tells the
        coordinator in the background (see the process contract); `preempted` says how that
        went."""
        self._s.preempt(float(notice))

    @property
    def preempted(self):
        """None while no notice was passed on (or it is on its way), True once the coordinator
        has it, else the reason it could not be told."""
        return self._s.preempted

    def next_batch(self, force: bool = False) -> Batch | None:
        """The next leased batch, or None when the job's data is done or the session is asked
        to leave. `force` hands out the leased partition's next batch even then."""
        b = self._s.next_batch(force)
        return None if b is None else Batch(b)

    def upcoming(self) -> list[tuple[Span, list[int]]]:
        """The batches the leased partition holds after the one handed out last, as
        `next_batch` will hand them out: (span, indices) each. Nothing is leased or sent; empty
        once the partition is used up."""
        return [(Span(*span), indices) for span, indices in self._s.upcoming()]

    def batches(self) -> Iterator[Batch]:
        """Leased batches until the data is done or this worker should leave (drained,
        stopped, preempted). Commit each one before the loop asks for the next."""
        while not self.should_leave:
            b = self.next_batch()
            if b is None:
                return
            yield b
            if not b.committed:
                raise RuntimeError(
                    "a batch must be committed (session.commit(batch, loss_sum)) before the "
                    "next one is leased"
                )

    def pull(self, out):
        """Pulls every parameter into `out` (float32, `param_count` floats, writable),
        waiting only as the consistency requires. Returns `out`; allocates no array."""
        self._s.pull(_buffer(out, "out"))
        return out

    def push(self, batch: Batch, grads) -> None:
        """Pushes the gradient of `batch` from `grads` (float32, `param_count` floats). NaN or
        infinity refuses the push: EdlError with kind "NonFinite", nothing sent."""
        self._s.push(batch._b, _buffer(grads, "grads"))

    def pull_rows(self, tensor: str, rows, out):
        """Pulls some rows of one tensor into `out` (len(rows) x row length floats)."""
        self._s.pull_rows(tensor, [int(r) for r in rows], _buffer(out, "out"))
        return out

    def push_rows(self, batch: Batch, tensor: str, rows, values) -> None:
        """Pushes the gradient of `batch` for some rows of one tensor only."""
        self._s.push_rows(batch._b, tensor, [int(r) for r in rows], _buffer(values, "values"))

    def commit(self, batch: Batch, loss_sum: float = 0.0) -> int:
        """Marks `batch`'s samples done (`loss_sum`: the sum of their losses) and waits for the
        next step as the consistency requires. Returns the new clock."""
        return self._s.commit(batch._b, float(loss_sum))

    def report_evaluation(self, accuracy: float, loss: float, samples: int,
                          clock: int | None = None) -> None:
        """Reports an evaluation (accuracy in [0, 1], mean loss, samples evaluated) of the
        parameters this worker pulled last (at `clock`, by default the session's)."""
        clock = self.clock if clock is None else clock
        self._s.report_evaluation(int(clock), float(accuracy), float(loss), int(samples))

    def leave(self) -> None:
        """Leaves the job gracefully; uncommitted data returns to the pool. Idempotent."""
        self._s.leave()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.leave()


class _Signals:
    """The process contract's signals for this process's sessions (see the module's
    docstring): SIGTERM stops them, SIGUSR1 passes a preemption notice on."""

    def __init__(self, preempt_notice: float, grace: float | None):
        self.pid = os.getpid()
        self.preempt_notice = preempt_notice
        self.grace = grace
        self.sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.joining = 0
        self.terminated = False
        #: A preemption deadline (time.monotonic) that came before any session joined.
        self.notice_until: float | None = None

    def _grace(self, s: Session) -> float | None:
        if self.grace is not None:
            return self.grace
        lease_ms = s.config.get("lease_ms")
        return None if lease_ms is None else lease_ms / 1000.0

    def attach(self, s: Session) -> None:
        """A session that joined: stopped at once if a SIGTERM came during its join, told
        of a preemption notice that came before."""
        self.sessions.add(s)
        if self.terminated:
            s.stop(self._grace(s))
        if self.notice_until is not None:
            s.preempt(max(0.0, self.notice_until - time.monotonic()))

    def _live(self) -> list[Session]:
        return [s for s in self.sessions if not s.left]

    def on_term(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # A forked process (a DataLoader's worker): the default action, death.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.terminated:
            print("edl: second SIGTERM: leaving at once", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.terminated = True
        live = self._live()
        if not live and not self.joining:
            # Not admitted, or left already: nothing to hand back.
            raise SystemExit(0)
        print("edl: SIGTERM: leaving after this step", file=sys.stderr, flush=True)
        for s in live:
            s.stop(self._grace(s))

    def on_usr1(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            return
        live = self._live()
        print(f"edl: SIGUSR1: preemption notice, leaving within {self.preempt_notice:g} s",
              file=sys.stderr, flush=True)
        if not live:
            self.notice_until = time.monotonic() + self.preempt_notice
        for s in live:
            s.preempt(self.preempt_notice)


_SIGNALS: _Signals | None = None


def honour_signals(preempt_notice: float = PREEMPT_NOTICE, grace: float | None = None) -> None:
    """Handles SIGTERM and SIGUSR1 as the process contract says (module docstring) for every
    session this process joins from now on: SIGTERM drains (the step finishes and commits, the
    session leaves; the step and the leave get `grace` seconds, by default the job's lease),
    SIGUSR1 is a preemption notice of `preempt_notice` seconds. `Job.from_env()` calls it.
    Python runs signal handlers on the main thread only, so call it from there."""
    global _SIGNALS
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("honour_signals() must be called on the main thread")
    if _SIGNALS is None or _SIGNALS.pid != os.getpid():
        _SIGNALS = _Signals(preempt_notice, grace)
    else:
        _SIGNALS.preempt_notice, _SIGNALS.grace = preempt_notice, grace
    signal.signal(signal.SIGTERM, _SIGNALS.on_term)
    signal.signal(signal.SIGUSR1, _SIGNALS.on_usr1)
