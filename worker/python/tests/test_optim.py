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


# Every scheduler class, each with an optimizer it meets in practice: (optimizer, its
# arguments, scheduler, its arguments, what the loop steps it after).
SCHEDULERS = [
    ("SGD", dict(lr=0.05, momentum=0.9), "StepLR", dict(step_size=30, gamma=0.5), "step"),
    ("Adam", dict(lr=0.01), "MultiStepLR", dict(milestones=[50, 120, 120], gamma=0.3), "step"),
    ("RMSprop", dict(lr=0.01), "ExponentialLR", dict(gamma=0.99), "step"),
    # Past T_max the cosine climbs again.
    ("AdamW", dict(lr=0.01), "CosineAnnealingLR", dict(T_max=80, eta_min=1e-4), "step"),
    ("SGD", dict(lr=0.05), "LinearLR", dict(start_factor=0.1, total_iters=50), "step"),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True), "OneCycleLR",
     dict(max_lr=0.1, total_steps=STEPS), "step"),
    ("Adam", dict(lr=0.01), "OneCycleLR",
     dict(max_lr=0.01, total_steps=STEPS, three_phase=True, anneal_strategy="linear"), "step"),
    ("RMSprop", dict(lr=0.01), "OneCycleLR",
     dict(max_lr=0.01, total_steps=STEPS, pct_start=0.1, cycle_momentum=False), "step"),
    # pytorch/examples' MNIST: Adadelta, StepLR stepped once per epoch (10 epochs of 20).
    ("Adadelta", dict(lr=1.0), "StepLR", dict(step_size=1, gamma=0.7), "epoch"),
    ("AdamW", dict(lr=0.01), "CosineAnnealingLR", dict(T_max=6), "epoch"),
    # Groups: each schedules from its own learning rate (OneCycleLR: its own max_lr).
    ("SGD", dict(lr=0.05, momentum=0.9, groups=dict(lr=0.2, weight_decay=0.01)),
     "LinearLR", dict(start_factor=0.25, total_iters=40), "step"),
    ("AdamW", dict(lr=0.01, groups=dict(weight_decay=0)), "OneCycleLR",
     dict(max_lr=[0.01, 0.03], total_steps=STEPS), "step"),
]


def _params(model, bias):
    return model.parameters() if bias is None else [
        {"params": [model.fc.weight]}, {"params": [model.fc.bias], **bias}]


def _compare(make_cluster, model, reference, scheduler=None, by=None, epoch=STEPS):
    """Feeds the same gradients to a two-shard job and to `reference` (stepping `scheduler`
    after each step, or after each `epoch` steps); the parameters after STEPS steps."""
    text = edl.torch.job_from_module(model, samples=epoch, epochs=STEPS // epoch,
                                     optimizer=reference, scheduler=scheduler, scheduler_by=by,
                                     consistency="asp", batch_size=1, partition_size=4)
    cluster = make_cluster(text, shards=2)
    job = cluster.job("py1")
    flat = job.pull()
    binding = edl.torch.Parameters(model, job)
    binding.flat[:] = torch.from_numpy(flat)
    start = flat.copy()
    rng = np.random.default_rng(3)
    with job.join() as s:
        for i in range(STEPS):
            batch = s.next_batch()
            assert batch.epoch == i // epoch
            g = (rng.standard_normal(job.param_count) * rng.uniform(0.1, 3.0)).astype(np.float32)
            s.push(batch, g)
            s.commit(batch, 0.0)
            binding.grad[:] = torch.from_numpy(g)
            reference.step()
            if scheduler is not None and (by == "step" or (i + 1) % epoch == 0):
                scheduler.step()
        s.pull(flat)
    return flat, binding.flat.numpy(), start


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_the_shards_apply_torch_optim_exactly(tmp_path, make_cluster, name, kw):
    model = Two()
    kw = dict(kw)
    bias = kw.pop("groups", None)
    reference = getattr(torch.optim, name)(_params(model, bias), **kw)
    ours, theirs, start = _compare(make_cluster, model, reference)
    _agree(f"{name}({kw})", ours, theirs, start)


@pytest.mark.parametrize("name,kw,sched,skw,by", SCHEDULERS,
                         ids=[f"{s[2]}-{s[0]}-by-{s[4]}" for s in SCHEDULERS])
def test_the_shards_follow_torch_schedulers_exactly(make_cluster, name, kw, sched, skw, by):
    model = Two()
    kw = dict(kw)
    bias = kw.pop("groups", None)
    reference = getattr(torch.optim, name)(_params(model, bias), **kw)
    scheduler = getattr(torch.optim.lr_scheduler, sched)(reference, **skw)
    epoch = 20 if by == "epoch" else STEPS
    ours, theirs, start = _compare(make_cluster, model, reference, scheduler, by, epoch)
    _agree(f"{sched}({skw}) of {name}({kw})", ours, theirs, start)


def _agree(what, ours, theirs, start):
    # Relative to the parameters as a vector: element by element, a parameter that crosses
    # zero has no relative scale, and PyTorch's CPU kernels fuse some multiply-adds (its
    # vectorized `add(alpha=)` is an FMA) where the shards round twice, so single elements
    # differ in their last bits while the trajectories agree to float32's precision.
    diff = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    of_change = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs - start))
    print(f"{what}: {diff:.2g} of the parameters' norm, {of_change:.2g} of their change")
    assert diff <= 1e-6, f"{what}: off by {diff:.3g} of the parameters' norm"
    assert of_change <= 1e-5, f"{what}: off by {of_change:.3g} of the change"


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


def test_what_the_shards_cannot_schedule_is_refused_by_name():
    model = Two()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler
    stepped = sched.StepLR(opt, step_size=3)
    opt.step()
    stepped.step()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    grouped = torch.optim.SGD(_params(model, dict(lr=0.2)), lr=0.1, momentum=0.9)
    for s, kw, why in [
        (sched.LambdaLR(opt, lambda e: 0.9 ** e), {}, "LambdaLR has no counterpart"),
        (sched.ReduceLROnPlateau(opt), {}, "ReduceLROnPlateau has no counterpart"),
        (sched.CyclicLR(other, 0.01, 0.1), {}, "schedules another optimizer"),
        (sched.OneCycleLR(grouped, max_lr=0.1, total_steps=10, base_momentum=[0.8, 0.85]),
         dict(optimizer=grouped), "base_momentum differs between parameter groups 0 and 1"),
        (stepped, {}, "has been stepped 1 times"),
        (sched.ExponentialLR(opt, gamma=0.9), dict(by=None), "say what your loop"),
        (sched.ExponentialLR(opt, gamma=0.9), dict(by="batch"), "scheduler_by='batch'"),
        (sched.ExponentialLR(opt, gamma=0.9), dict(optimizer="sgd"), "needs the torch.optim"),
    ]:
        args = dict(optimizer=kw.get("optimizer", opt), scheduler=s,
                    scheduler_by=kw.get("by", "step"))
        with pytest.raises(ValueError, match=why):
            edl.torch.job_from_module(model, samples=10, **args)
