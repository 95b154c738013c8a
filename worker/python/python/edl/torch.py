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
and its `.batch` the batch being trained.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler

from . import Batch, Session, Spec

__all__ = ["ElasticSampler", "Parameters", "job_from_module"]


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


def job_from_module(
    model: torch.nn.Module,
    path=None,
    *,
    samples: int,
    optimizer: str = "sgd",
    lr: float = 0.01,
    momentum: float | None = None,
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
    should record it. Written to `path` when given; returned either way."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("the module has no trainable parameters")
    out = ['# Written by edl.torch.job_from_module', "", "[model]", 'kind = "custom"', ""]
    out += ["[optimizer]", f'kind = "{optimizer}"', f"lr = {lr!r}"]
    if momentum is not None:
        out.append(f"momentum = {momentum!r}")
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


class ElasticSampler(Sampler):
    """A batch sampler for `DataLoader(dataset, batch_sampler=ElasticSampler(session))`: the
    loader yields the samples of each batch the job leases to this worker, and `.batch` is that
    batch (push and commit it). Keep `num_workers=0`: loader processes would lease batches
    ahead, before the current one is committed."""

    def __init__(self, session: Session):
        self.session = session
        self.batch: Batch | None = None

    def __iter__(self) -> Iterator[list[int]]:
        for b in self.session.batches():
            self.batch = b
            yield b.indices.tolist()
