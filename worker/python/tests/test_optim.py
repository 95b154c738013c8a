"""The shards' optimizers against torch.optim itself: the same gradients, fed to a real shard
through the client and to torch.optim, give the same parameters after 200 steps."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import optional

torch = optional("torch")
import edl.torch  # noqa: E402

STEPS = 200

# Every class, and the settings that add a buffer or a branch.
OPTIMIZERS = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.01, amsgrad=True)),
    ("AdamW", dict(lr=0.01)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True, eps=1e-6)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
    ("RMSprop", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, centered=True, momentum=0.9, weight_decay=0.01)),
    ("Adadelta", dict(lr=1.0)),
    ("Adadelta", dict(lr=0.5, rho=0.95, weight_decay=0.01)),
    # Parameter groups: the bias with its own learning rate and no weight decay.
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01, groups=dict(lr=0.2, weight_decay=0))),
    ("AdamW", dict(lr=0.01, groups=dict(weight_decay=0, betas=(0.5, 0.9)))),
]


class Two(torch.nn.Module):
    """Two tensors on two shards: a weight and a bias."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(40, 7)


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_the_shards_apply_torch_optim_exactly(tmp_path, make_cluster, name, kw):
    model = Two()
    kw = dict(kw)
    bias = kw.pop("groups", None)
    params = model.parameters() if bias is None else [
        {"params": [model.fc.weight]}, {"params": [model.fc.bias], **bias}]
    reference = getattr(torch.optim, name)(params, **kw)
    text = edl.torch.job_from_module(model, samples=STEPS, optimizer=reference,
                                     consistency="asp", batch_size=1, partition_size=8)
    cluster = make_cluster(text, shards=2)
    job = cluster.job("py1")
    flat = job.pull()
    binding = edl.torch.Parameters(model, job)
    binding.flat[:] = torch.from_numpy(flat)
    start = flat.copy()
    rng = np.random.default_rng(3)
    with job.join() as s:
        for _ in range(STEPS):
            batch = s.next_batch()
            g = (rng.standard_normal(job.param_count) * rng.uniform(0.1, 3.0)).astype(np.float32)
            s.push(batch, g)
            s.commit(batch, 0.0)
            binding.grad[:] = torch.from_numpy(g)
            reference.step()
        s.pull(flat)
    ours, theirs = flat, binding.flat.numpy()
    # Relative to the parameters as a vector: element by element, a parameter that crosses
    # zero has no relative scale, and PyTorch's CPU kernels fuse some multiply-adds (its
    # vectorized `add(alpha=)` is an FMA) where the shards round twice, so single elements
    # differ in their last bits while the trajectories agree to float32's precision.
    diff = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    of_change = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs - start))
    print(f"{name}({kw}): {diff:.2g} of the parameters' norm, {of_change:.2g} of their change")
    assert diff <= 1e-6, f"{name}({kw}): off by {diff:.3g} of the parameters' norm"
    assert of_change <= 1e-5, f"{name}({kw}): off by {of_change:.3g} of the change"


def test_what_the_shards_cannot_apply_is_refused_by_name():
    model = Two()
    for opt, why in [
        (torch.optim.Adamax(model.parameters()), "torch.optim.Adamax has no counterpart"),
        (torch.optim.SGD(model.parameters(), lr=0.1, maximize=True), "maximize=True"),
        (torch.optim.SGD([{"params": [model.fc.weight]},
                          {"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=0.1),
         "group 1 holds a tensor that is not the module's"),
    ]:
        with pytest.raises(ValueError, match=why):
            edl.torch.job_from_module(model, samples=10, optimizer=opt)
