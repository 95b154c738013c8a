"""EDL from Python: join an elastic training job, lease its data exactly once, pull parameters
into and push gradients from your own NumPy arrays or CPU torch tensors.

A training loop::

    import numpy as np, edl

    job = edl.Job("127.0.0.1:7070", cert="w1.pem", key="w1.key", ca="ca.pem")
    params = np.zeros(job.param_count, np.float32)
    grads = np.zeros_like(params)
    with job.join() as session:               # prepared first, then admitted (stop-free)
        for batch in session.batches():       # leased spans, exactly once per epoch
            session.pull(params)              # into params, no new array
            loss_sum = my_step(params, batch.indices, grads)
            session.push(batch, grads)        # the gradient of exactly these samples
            session.commit(batch, loss_sum)   # the samples are done
    # leaving the `with` (also on Ctrl-C or an exception) leaves the job: uncommitted data
    # returns to the pool for another worker

`edl.torch` maps a `torch.nn.Module` onto the job's tensors (see its docstring).
"""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from . import _edl
from ._edl import EdlError

__all__ = ["Batch", "EdlError", "Job", "Session", "Spec", "Tensor"]


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


class Batch:
    """A mini-batch leased to this worker. Push its gradient once, then commit it once."""

    __slots__ = ("_b", "_indices")

    def __init__(self, b: _edl.Batch):
        self._b = b
        self._indices = None

    @property
    def indices(self) -> np.ndarray:
        """The sample indices (uint32) in the training set, in the epoch's order."""
        if self._indices is None:
            self._indices = np.asarray(self._b.indices, dtype=np.uint32)
        return self._indices

    @property
    def epoch(self) -> int:
        return self._b.epoch

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


class Job:
    """A connection to a running job.

    Either with a certificate signed by the job's CA::

        edl.Job("10.0.0.5:7070", cert="worker.pem", key="worker.key", ca="ca.pem")

    or with a local run's development PKI (the state directory of `edl-local` or of
    `edl-ps --state-dir`; the certificate `ROLE/NAME` is created there if missing)::

        edl.Job("127.0.0.1:7070", state_dir="edl-state", name="py1")

    Waits until the coordinator answers (at most `reconnect` seconds when given) and the shard
    map is ready. Ctrl-C interrupts the wait.
    """

    def __init__(
        self,
        coordinator: str,
        cert=None,
        key=None,
        ca=None,
        *,
        state_dir=None,
        name: str | None = None,
        role: str = "worker",
        reconnect: float | None = None,
    ):
        if state_dir is not None:
            if name is None:
                raise ValueError("a state_dir needs the certificate's name (name=...)")
            self._job = _edl.Job.local(coordinator, str(state_dir), name, role, reconnect)
        elif cert is None or key is None or ca is None:
            raise ValueError("give cert, key and ca (PEM files), or state_dir and name")
        else:
            self._job = _edl.Job(coordinator, str(cert), str(key), str(ca), reconnect)
        self.spec = Spec(self._job.tensors())

    @classmethod
    def from_env(cls, name: str | None = None, role: str = "worker", reconnect=None) -> "Job":
        """Connects as the environment says: EDL_COORDINATOR (default 127.0.0.1:7070), and
        EDL_CERT, EDL_KEY and EDL_CA, or else EDL_STATE_DIR (default edl-state) with the name
        `name` or EDL_NAME (as `edl.local.Cluster.spawn` sets them)."""
        env = os.environ
        coordinator = env.get("EDL_COORDINATOR", "127.0.0.1:7070")
        if "EDL_CERT" in env:
            return cls(coordinator, env["EDL_CERT"], env["EDL_KEY"], env["EDL_CA"],
                       reconnect=reconnect)
        name = name or env.get("EDL_NAME")
        if not name:
            raise ValueError("set EDL_NAME (or EDL_CERT, EDL_KEY and EDL_CA), or pass name=")
        return cls(coordinator, state_dir=env.get("EDL_STATE_DIR", "edl-state"), name=name,
                   role=role, reconnect=reconnect)

    @property
    def param_count(self) -> int:
        return self.spec.param_count

    def config(self) -> dict:
        """The job's settings (model, optimizer, consistency, batch_size, epochs, samples...)."""
        return self._job.config()

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
        return Session(self._job.join(), self.spec)


class Session:
    """A worker's membership in a job. Use it in a `with` block, which leaves the job at its
    end (on an exception or Ctrl-C too): uncommitted data then returns to the pool."""

    def __init__(self, s: _edl.Session, spec: Spec):
        self._s = s
        self.spec = spec

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
        """True once an operator or the scheduler asked this worker to leave."""
        return self._s.drain_requested

    @property
    def left(self) -> bool:
        return self._s.left

    def traffic(self) -> tuple[int, int, int]:
        """Payload bytes (sent, received) and shard requests so far."""
        return self._s.traffic()

    def next_batch(self) -> Batch | None:
        """The next leased batch, or None when the job's data is done."""
        b = self._s.next_batch()
        return None if b is None else Batch(b)

    def batches(self) -> Iterator[Batch]:
        """Leased batches until the data is done or this worker is asked to leave. Commit each
        one before the loop asks for the next."""
        while not self._s.drain_requested:
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

    def leave(self) -> None:
        """Leaves the job gracefully; uncommitted data returns to the pool. Idempotent."""
        self._s.leave()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.leave()
