"""PyTorch on EDL: a module's parameters live in the job, a standard loop trains them.

Write the job file from the module (once, before the job starts)::

    open("job.toml", "w").write(edl.torch.job_from_module(model, samples=60000, lr=0.1))

Train (any number of these processes, joining and leaving while the job runs)::

    job = edl.Job(coordinator, cert=..., key=..., ca=...)
    params = edl.torch.Parameters(model, job)        # parameters and gradients now live in
    with job.join() as session:                      # two flat buffers EDL reads and writes
        for batch in session.batches():
            params.pull(session)                     # straight into model's parameters
            x, y = dataset[batch.indices]
            loss = F.cross_entropy(model(x), y)
            params.zero_grad()
            loss.backward()                          # into the flat gradient buffer
            params.push(session, batch)              # straight from it
            session.commit(batch, loss.item() * len(batch))

With a `DataLoader` over a map-style dataset, `ElasticSampler(session)` is the batch sampler
and its `.batch` the batch being trained; `sampler.loader(dataset, num_workers=2)` loads
batches ahead in worker processes, and `sampler.epochs()` gives the loop its epochs::

    sampler = edl.torch.ElasticSampler(session)
    loader = sampler.loader(train_set, num_workers=2)
    for epoch in sampler.epochs():
        for x, y in loader:                          # one epoch's pass
            batch = sampler.batch
            ...
"""

from __future__ import annotations

import math
import os
import socket
from collections import deque
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from . import Batch, Session, Spec

__all__ = [
    "ElasticLoader", "ElasticSampler", "Parameters", "job_from_module", "optimizer_table",
    "schedule_table",
]


def _fan_in(shape) -> int:
    """PyTorch's fan-in of a weight: input features times the kernel's size."""
    return shape[1] * math.prod(shape[2:]) if len(shape) >= 2 else shape[0]


def _init_line(name: str, p: torch.Tensor, params: dict) -> str:
    """A job-file init for `p` that draws from PyTorch's own default distribution: uniform in
    +-1/sqrt(fan_in) for weights (kaiming_uniform with a=sqrt(5), as Linear and ConvNd) and for a
    bias (with its layer's fan-in); a constant where the module holds one (norm layers)."""
    flat = p.detach().reshape(-1)
    if flat.numel() > 0 and bool((flat == flat[0]).all()):
        v = float(flat[0])
        return 'init = "zeros"' if v == 0.0 else f'init = "constant"\nvalue = {v!r}'
    if p.dim() >= 2:
        fan = _fan_in(p.shape)
    else:
        weight = params.get(name.rsplit(".", 1)[0] + ".weight") if "." in name else None
        fan = _fan_in(weight.shape) if weight is not None and weight.dim() >= 2 else p.shape[0]
    return f'init = "uniform"\nscale = {1.0 / math.sqrt(fan)!r}'


# torch.optim's classes EDL's shards apply, with the arguments each maps: (kind, [keys]).
_OPTIMIZERS = {
    "SGD": ("sgd", ["momentum", "dampening", "nesterov", "weight_decay"]),
    "Adam": ("adam", ["betas", "eps", "weight_decay", "amsgrad"]),
    "AdamW": ("adamw", ["betas", "eps", "weight_decay", "amsgrad"]),
    "Adagrad": ("adagrad", ["lr_decay", "weight_decay", "initial_accumulator_value", "eps"]),
    "RMSprop": ("rmsprop", ["alpha", "eps", "weight_decay", "momentum", "centered"]),
    "Adadelta": ("adadelta", ["rho", "eps", "weight_decay"]),
}


# torch.optim.lr_scheduler's classes EDL's shards evaluate: (kind, [arguments]).
_SCHEDULERS = {
    "StepLR": ("step", ["step_size", "gamma"]),
    "MultiStepLR": ("multistep", ["milestones", "gamma"]),
    "ExponentialLR": ("exponential", ["gamma"]),
    "CosineAnnealingLR": ("cosine", ["T_max", "eta_min"]),
    "LinearLR": ("linear", ["start_factor", "end_factor", "total_iters"]),
    "OneCycleLR": ("onecycle", []),
}


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(float(v))


def _one_cycle_settings(sched) -> dict:
    """OneCycleLR's arguments, read back from what it stored (it keeps some only per group,
    and `pct_start` only as its first phase's end)."""
    groups = sched.optimizer.param_groups
    first = sched._schedule_phases[0]["end_step"]
    per_group = []
    for g in groups:
        keys = {"div_factor": g["max_lr"] / g["initial_lr"],
                "final_div_factor": g["initial_lr"] / g["min_lr"]}
        if sched.cycle_momentum:
            keys.update(base_momentum=g["base_momentum"], max_momentum=g["max_momentum"])
        per_group.append(keys)
    for i, keys in enumerate(per_group[1:], 1):
        for k, v in keys.items():
            if not math.isclose(v, per_group[0][k], rel_tol=1e-12):
                raise ValueError(f"OneCycleLR's {k} differs between parameter groups 0 and {i}: "
                                 "EDL's schedule is one for the job (max_lr may differ)")
    return {
        "total_steps": sched.total_steps,
        "pct_start": (first + 1) / sched.total_steps,
        "anneal_strategy": "cos" if sched.anneal_func.__name__ == "_annealing_cos" else "linear",
        **per_group[0],
        "three_phase": len(sched._schedule_phases) == 3,
        "cycle_momentum": bool(sched.cycle_momentum),
    }


def schedule_table(scheduler, by: str, scale: str = "none") -> str:
    """The `[schedule]` table of a job file for a `torch.optim.lr_scheduler` scheduler, counted
    `by` "step" (your loop calls `scheduler.step()` after each `optimizer.step()`) or "epoch"
    (after each epoch). `scale` is "none", or under BSP "linear" or "sqrt" in the workers whose
    gradients a step averages. Raises ValueError, naming what, for a scheduler the shards cannot
    evaluate (another class, one already stepped)."""
    name = type(scheduler).__name__
    if name not in _SCHEDULERS:
        raise ValueError(
            f"torch.optim.lr_scheduler.{name} has no counterpart on EDL's shards; use one of "
            + ", ".join(f"torch.optim.lr_scheduler.{k}" for k in _SCHEDULERS)
        )
    if by not in ("step", "epoch"):
        raise ValueError(f'scheduler_by={by!r}: say what your loop steps the scheduler after, '
                         '"step" (each optimizer.step()) or "epoch"')
    if getattr(scheduler, "last_epoch", 0) != 0:
        raise ValueError(f"torch.optim.lr_scheduler.{name} has been stepped "
                         f"{scheduler.last_epoch} times: map it before training")
    kind, keys = _SCHEDULERS[name]
    settings = (_one_cycle_settings(scheduler) if kind == "onecycle"
                else {k: getattr(scheduler, k) for k in keys})
    if kind == "multistep":
        settings["milestones"] = sorted(scheduler.milestones.elements())
    out = ["[schedule]", f'kind = "{kind}"']
    out += [f"{k} = {_value(v)}" for k, v in settings.items()]
    out += [f'by = "{by}"', f'scale = "{scale}"']
    return "\n".join(out)


def _base_lrs(scheduler) -> list[float] | None:
    """The learning rate each group's schedule starts from: OneCycleLR's `max_lr`, any other's
    `base_lrs` (a scheduler sets the group's `lr` to its value at step 0 already)."""
    if scheduler is None:
        return None
    if type(scheduler).__name__ == "OneCycleLR":
        return [g["max_lr"] for g in scheduler.optimizer.param_groups]
    return list(scheduler.base_lrs)


def _settings(kind_keys, group, lr=None) -> list[str]:
    out = [f"lr = {float(group['lr'] if lr is None else lr)!r}"]
    for key in kind_keys:
        value = group[key]
        if key == "betas":
            out += [f"beta1 = {float(value[0])!r}", f"beta2 = {float(value[1])!r}"]
        elif isinstance(value, bool):
            out.append(f"{key} = {'true' if value else 'false'}")
        else:
            out.append(f"{key} = {float(value)!r}")
    return out


def optimizer_table(optimizer, names=None, lrs=None) -> str:
    """The `[optimizer]` table of a job file for a `torch.optim` optimizer: its kind and its
    arguments, and a `[[optimizer.group]]` per further parameter group (its tensors by name:
    `names` maps a parameter's `id` to its name, as `job_from_module` gives it). `lrs`, when
    given, are the groups' learning rates (a scheduler's base ones). Raises
    ValueError, naming what, for what the shards cannot apply: another class, `maximize`, a
    learning rate that is a tensor, or groups without `names`."""
    name = type(optimizer).__name__
    if name not in _OPTIMIZERS:
        raise ValueError(
            f"torch.optim.{name} has no counterpart on EDL's shards; use one of "
            + ", ".join(f"torch.optim.{k}" for k in _OPTIMIZERS)
        )
    kind, keys = _OPTIMIZERS[name]
    groups = optimizer.param_groups
    for g in groups:
        if g.get("maximize"):
            raise ValueError(f"torch.optim.{name}(maximize=True) is not supported")
        if not isinstance(g["lr"], (int, float)):
            raise ValueError(f"torch.optim.{name}'s lr is a {type(g['lr']).__name__}, not a number")
    lrs = lrs or [None] * len(groups)
    out = ["[optimizer]", f'kind = "{kind}"'] + _settings(keys, groups[0], lrs[0])
    for i, g in enumerate(groups[1:], 1):
        if names is None:
            raise ValueError(f"torch.optim.{name} has {len(groups)} parameter groups: name "
                             "their tensors (job_from_module does)")
        missing = [p for p in g["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"parameter group {i} holds a tensor that is not the module's")
        tensors = ", ".join(f'"{names[id(p)]}"' for p in g["params"])
        out += ["", "[[optimizer.group]]", f"tensors = [{tensors}]"] + _settings(keys, g, lrs[i])
    return "\n".join(out)


def job_from_module(
    model: torch.nn.Module,
    path=None,
    *,
    samples: int,
    optimizer="sgd",
    lr: float = 0.01,
    momentum: float | None = None,
    scheduler=None,
    scheduler_by: str | None = None,
    lr_scale: str = "none",
    consistency: str = "ssp:2",
    batch_size: int = 64,
    epochs: int = 1,
    partition_size: int | None = None,
    seed: int = 1,
    train: str | None = None,
    test: str | None = None,
    data_format: str = "idx",
) -> str:
    """The job file (TOML) for `model`: one tensor per trainable parameter, named and shaped as
    in `model.named_parameters()`, initialized from PyTorch's default distributions. `samples`
    is the training set's size; `train`/`test` name the data (for `data_format`) if the job
    should record it. `optimizer` is a kind (`"sgd"`, with `lr` and `momentum`) or a
    `torch.optim` optimizer, whose class, settings and parameter groups the shards then
    apply exactly (see `optimizer_table`; `lr` and `momentum` are then not used). `scheduler`
    is a `torch.optim.lr_scheduler` scheduler of that optimizer, evaluated on the shards by
    `scheduler_by` "step" or "epoch" (what your loop calls `scheduler.step()` after; see
    `schedule_table`); `lr_scale` ("none", or under BSP "linear" or "sqrt") grows the learning
    rate with the workers a step averages. Written to `path` when given; returned either way."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("the module has no trainable parameters")
    out = ['# Written by edl.torch.job_from_module', "", "[model]", 'kind = "custom"', ""]
    if scheduler is not None:
        if isinstance(optimizer, str):
            raise ValueError("a scheduler needs the torch.optim optimizer it schedules: pass "
                             "optimizer=torch.optim.X(...) too")
        if scheduler.optimizer is not optimizer:
            raise ValueError(f"the {type(scheduler).__name__} schedules another optimizer than "
                             "the one given")
        if scheduler_by is None:
            raise ValueError('say what your loop calls scheduler.step() after: scheduler_by='
                             '"step" (each optimizer.step()) or "epoch"')
        # Checked (and refused by name) before anything reads its learning rates.
        schedule = schedule_table(scheduler, scheduler_by, lr_scale)
    elif lr_scale != "none":
        schedule = f'[schedule]\nscale = "{lr_scale}"'
    else:
        schedule = None
    if isinstance(optimizer, str):
        out += ["[optimizer]", f'kind = "{optimizer}"', f"lr = {lr!r}"]
        if momentum is not None:
            out.append(f"momentum = {momentum!r}")
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        out += optimizer_table(optimizer, names, _base_lrs(scheduler)).split("\n")
    if schedule is not None:
        out += [""] + schedule.split("\n")
    out += ["", "[training]", f'consistency = "{consistency}"', f"batch_size = {batch_size}"]
    out += [f"epochs = {epochs}", f"samples = {samples}", f"seed = {seed}"]
    if partition_size is not None:
        out.append(f"partition_size = {partition_size}")
    if train is not None:
        out += ["", "[data]", f'format = "{data_format}"', f'train = "{train}"']
        if test is not None:
            out.append(f'test = "{test}"')
    for name, p in named.items():
        if p.dtype != torch.float32:
            raise TypeError(f"parameter {name} is {p.dtype}; EDL trains float32 tensors")
        shape = ", ".join(str(d) for d in p.shape) if p.dim() else "1"
        out += ["", "[[tensor]]", f'name = "{name}"', f"shape = [{shape}]"]
        out.append(_init_line(name, p, named))
    text = "\n".join(out) + "\n"
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


class Parameters:
    """Binds a module's parameters to the job's tensors (matched by name and shape).

    The parameters' storage becomes views into one flat float32 vector laid out as the job's,
    and their `.grad` views into a second one, so `pull` writes the model in place and `push`
    sends the gradients autograd accumulated, with no copy in between. `source` is an
    `edl.Job` or an `edl.Session` (anything with a `.spec`).
    """

    def __init__(self, model: torch.nn.Module, source):
        spec: Spec = source.spec
        named = dict(model.named_parameters())
        missing = [t.name for t in spec if t.name not in named]
        if missing:
            raise KeyError(f"the module has no parameter for the job's tensors {missing}")
        extra = [n for n, p in named.items() if p.requires_grad and n not in spec]
        if extra:
            raise KeyError(f"the job has no tensor for the module's parameters {extra}")
        self.spec = spec
        self.flat = torch.zeros(spec.param_count, dtype=torch.float32)
        self.grad = torch.zeros(spec.param_count, dtype=torch.float32)
        self._params = []
        with torch.no_grad():
            for t in spec:
                p = named[t.name]
                if tuple(p.shape) != t.shape and not (p.dim() == 0 and t.size == 1):
                    raise ValueError(
                        f"{t.name}: the module's shape {tuple(p.shape)} is not the job's {t.shape}"
                    )
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise TypeError(f"{t.name} must be a CPU float32 parameter")
                view = self.flat[t.offset : t.offset + t.size].view(p.shape)
                view.copy_(p)
                p.data = view
                p.grad = self.grad[t.offset : t.offset + t.size].view(p.shape)
                self._params.append((p, t))

    def pull(self, source) -> None:
        """Pulls the job's parameters into the module, in place (`source`: the session, or
        the job for evaluation)."""
        source.pull(self.flat)

    def zero_grad(self) -> None:
        """Zeroes the gradients (use instead of `optimizer.zero_grad()`; EDL's shards apply the
        optimizer)."""
        self._rebind_grads()
        self.grad.zero_()

    def push(self, session: Session, batch: Batch) -> None:
        """Pushes the gradients of `batch`, straight from the flat gradient buffer."""
        self._rebind_grads()
        session.push(batch, self.grad)

    def _rebind_grads(self) -> None:
        """Puts back gradient views something replaced (a `zero_grad(set_to_none=True)`, or
        autograd allocating a fresh tensor), copying what it holds."""
        base = self.grad.data_ptr()
        for p, t in self._params:
            g = p.grad
            want = base + 4 * t.offset
            if g is not None and g.data_ptr() == want:
                continue
            view = self.grad[t.offset : t.offset + t.size].view(p.shape)
            with torch.no_grad():
                view.copy_(g) if g is not None else view.zero_()
            p.grad = view


class _Entry:
    """A batch handed to the loader: its span and indices, and the leased batch once the
    session handed it out (None while it is only the leased partition's next span)."""

    __slots__ = ("span", "indices", "batch")

    def __init__(self, span, indices: list[int], batch: Batch | None):
        self.span = tuple(span)
        self.indices = indices
        self.batch = batch


class ElasticSampler(Sampler):
    """A batch sampler over the data the job leases to this worker, for a `DataLoader` over
    any map-style dataset; `.batch` is the batch of the samples the loader gave last (push and
    commit it before the next).

    With `num_workers > 0` use the loader it makes, `sampler.loader(dataset, num_workers=2,
    ...)` (an `ElasticLoader`, a `DataLoader`); with `num_workers=0` a plain
    `DataLoader(dataset, batch_sampler=sampler)` does too. A per-epoch loop::

        sampler = edl.torch.ElasticSampler(session)
        loader = sampler.loader(train_set, num_workers=2)
        for epoch in sampler.epochs():            # until the data is done or the worker
            for x, y in loader:                   # should leave; one pass = one epoch
                batch = sampler.batch
                ...                               # pull, step, push(batch), commit(batch)
            test(epoch)

    The loader's workers load batches ahead: the sampler hands out the leased partition's
    next batches before the ones before them are committed (their spans and indices are
    known: the epoch's order over the partition, as `session.upcoming()` gives them); each is
    handed out by the session, and so pushed and committed, strictly in order, when the loop
    takes it (`.batch`). A new partition is leased only once everything handed out is
    committed, as a lease may wait for data that others hold; the `ElasticLoader` then starts
    its workers on the next partition without ending the pass (the first batch after a
    partition's end is loaded while the loop waits). A worker killed with batches loaded ahead
    leaves them uncommitted: the rest of its partition returns to the pool from the last
    commit, exactly once as always; so does a drain or SIGTERM, after which no more batches are
    given out.

    A pass ends where the next batch belongs to a later epoch (a span re-issued from an earlier
    epoch, after another worker died, joins the pass under way), so `epoch` is the pass's
    epoch. `len()` is the job's batches per epoch, all workers together: one worker's exact
    count when it trains alone, an upper bound when it shares the job.
    """

    def __init__(self, session: Session, ahead: bool = True):
        self.session = session
        #: Hand out the leased partition's next batches before the ones before them are
        #: committed (for a loader with workers); False: one at a time.
        self.ahead = ahead
        #: The epoch of the pass under way (or about to start), None before the first lease.
        self.epoch: int | None = None
        #: True once the job's data is done.
        self.done = False
        self._queue: deque[_Entry] = deque()  # handed to the loader, not yet committed
        self._ahead: deque[_Entry] = deque()  # the leased partition's next spans
        self._held: Batch | None = None  # leased, opening the next pass
        self._last: Batch | None = None
        self._paused = False
        self._wrapped = False

    def __len__(self) -> int:
        cfg = self.session.config
        samples, part = int(cfg["samples"]), int(cfg["partition_size"]) or int(cfg["samples"])
        size = max(1, int(cfg["batch_size"]))
        full, rest = divmod(samples, part)
        return full * -(-part // size) + -(-rest // size)

    def loader(self, dataset, **kwargs) -> "ElasticLoader":
        """A `DataLoader` of `dataset` over this sampler (`kwargs`: DataLoader's, e.g.
        `num_workers`, `pin_memory`, `collate_fn`), which resumes its workers at partition
        boundaries."""
        return ElasticLoader(dataset, self, **kwargs)

    def _drop_committed(self) -> None:
        while self._queue and self._queue[0].batch is not None and self._queue[0].batch.committed:
            self._last = self._queue.popleft().batch

    def _uncommitted(self) -> bool:
        self._drop_committed()
        return bool(self._queue)

    def _requeue(self) -> None:
        """Spans given to a loader that dropped them (a pass left early): handed out again
        first."""
        unhanded = [e for e in self._queue if e.batch is None]
        if unhanded:
            self._queue = deque(e for e in self._queue if e.batch is not None)
            self._ahead.extendleft(reversed(unhanded))

    def _lease(self) -> Batch | None:
        """The next batch from a new lease (nothing may be uncommitted), None when the data
        is done or the worker should leave."""
        b = self.session.next_batch()
        if b is None and not self.session.should_leave:
            self.done = True
        return b

    def _next_epoch(self) -> int | None:
        """The epoch of the next pass, leasing its first batch if need be."""
        if self._held is None and not self._ahead:
            if self._uncommitted():
                raise RuntimeError(_COMMIT_FIRST)
            self._held = self._lease()
        if self._held is not None:
            return self._held.epoch
        return self._ahead[0].span[0] if self._ahead else None

    def epochs(self) -> Iterator[int]:
        """The epoch of each pass to come, until the job's data is done or this worker should
        leave (drained, stopped, preempted): iterate the loader once per epoch yielded."""
        while not (self.done or self.session.should_leave):
            self._requeue()
            epoch = self._next_epoch()
            if epoch is None:
                return
            self.epoch = epoch
            yield epoch

    def __iter__(self) -> Iterator[list[int]]:
        self._requeue()
        if not self._paused:  # a new pass, not one resumed after a partition's end
            self.epoch = (self._held.epoch if self._held is not None
                          else self._ahead[0].span[0] if self._ahead else None)
        self._paused = False
        while not self.session.should_leave:
            if self._ahead:
                e = self._ahead.popleft()
                self._queue.append(e)
                yield e.indices
                continue
            if self._uncommitted():
                # Everything leased is handed out and some of it is not committed yet: a lease
                # now could wait for data while holding it (at the job's end, forever).
                if not self._wrapped:
                    raise RuntimeError(_COMMIT_FIRST)
                self._paused = True
                return
            b, self._held = (self._held or self._lease()), None
            if b is None:
                return
            if self.epoch is None:
                self.epoch = b.epoch
            elif b.epoch > self.epoch:
                self._held = b  # opens the next pass
                return
            self._queue.append(_Entry(b.span, b._b.indices, b))
            if self.ahead:
                self._ahead.extend(_Entry(span, idx, None) for span, idx in self.session.upcoming())
            yield self._queue[-1].indices

    @property
    def batch(self) -> Batch | None:
        """The batch of the samples the loader gave last, to push and commit: the first one
        handed to the loader and not committed yet (once all are, the last committed)."""
        self._drop_committed()
        if not self._queue:
            return self._last
        e = self._queue[0]
        if e.batch is None:
            # The session hands it out now that the one before is committed: the leased
            # partition's next span, which the loader's samples came from.
            b = self.session.next_batch(force=True)
            if b is None or tuple(b.span) != e.span:
                raise RuntimeError(
                    f"the session handed out {None if b is None else tuple(b.span)}, not the "
                    f"span {e.span} the loader was given"
                )
            e.batch = b
        return e.batch


class _LoaderInit:
    """A loader process's start: closes the UDP sockets it inherited from the worker (its QUIC
    endpoints; a forked process shares them), then runs the user's `worker_init_fn`. A worker
    process killed with SIGKILL is then gone with its socket, so the coordinator's probe finds
    it dead at once, instead of once its loader processes notice and exit."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
            try:
                s = socket.socket(fileno=int(name))
            except (OSError, ValueError):
                continue  # not a socket (or the listing's own descriptor, closed by now)
            if s.type == socket.SOCK_DGRAM and s.family in (socket.AF_INET, socket.AF_INET6):
                s.close()
            else:
                s.detach()
        if self.then is not None:
            self.then(worker_id)


_COMMIT_FIRST = (
    "the batches handed out are not all committed: commit each batch before the loader's next "
    "one; with DataLoader(num_workers > 0) iterate sampler.loader(dataset, num_workers=N) (an "
    "ElasticLoader), which waits for the commits at a partition's end"
)


class ElasticLoader(DataLoader):
    """A `DataLoader` over an `ElasticSampler` (`sampler.loader(dataset, ...)`): one epoch per
    iteration, its workers (`num_workers`, kept across passes) loading the leased partition's
    batches ahead; at a partition's end it waits until the loop has committed what it was given,
    leases the next partition and goes on, within the same pass. It stops handing out batches
    once the worker should leave (drained, SIGTERM, preempted)."""

    def __init__(self, dataset, sampler: ElasticSampler, **kwargs):
        for k in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if k in kwargs:
                raise TypeError(f"ElasticLoader takes no {k}: the job's data decides it")
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("persistent_workers", True)
            kwargs["worker_init_fn"] = _LoaderInit(kwargs.get("worker_init_fn"))
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        sampler._wrapped = True

    def __iter__(self):
        sampler: ElasticSampler = self.batch_sampler
        while True:
            for item in super().__iter__():
                yield item
                if sampler.session.should_leave:
                    return
            if not sampler._paused:
                return
            if sampler._uncommitted():
                raise RuntimeError(_COMMIT_FIRST)
