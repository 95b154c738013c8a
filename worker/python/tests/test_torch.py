"""edl.torch: the job file from a module, parameters bound into EDL's buffers, and a standard
DataLoader loop over ElasticSampler."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from conftest import optional  # noqa: E402

torch = optional("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import edl.local  # noqa: E402
import edl.torch  # noqa: E402


class Net(nn.Module):
    def __init__(self, d=20, h=16, c=3):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, c)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def test_job_from_module_is_a_valid_job_with_torchs_initialization(tmp_path):
    path = tmp_path / "net.toml"
    text = edl.torch.job_from_module(Net(), path, samples=300, lr=0.5, consistency="bsp",
                                     epochs=4, batch_size=10)
    assert path.read_text() == text
    out = subprocess.run([edl.local.find_binary("edl-ps"), "job", "check", path],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    table = out.stdout
    for name, shape in [("fc1.weight", "[16, 20]"), ("fc1.bias", "[16]"),
                        ("norm.weight", "[16]"), ("norm.bias", "[16]"),
                        ("fc2.weight", "[3, 16]"), ("fc2.bias", "[3]")]:
        line = next(ln for ln in table.splitlines() if ln.startswith(name + " "))
        assert shape in line, line
    # PyTorch's defaults: Linear uniform(+-1/sqrt(fan_in)) for weight and bias; LayerNorm 1, 0.
    assert f'scale = {1 / np.sqrt(20)!r}' in text and f'scale = {1 / np.sqrt(16)!r}' in text
    assert 'init = "constant"\nvalue = 1.0' in text
    with pytest.raises(ValueError, match="no trainable parameters"):
        edl.torch.job_from_module(nn.ReLU(), samples=1)


def test_parameters_live_in_edls_buffers(make_cluster, tmp_path):
    model = Net()
    c = make_cluster(edl.torch.job_from_module(model, samples=40, lr=0.5, batch_size=10,
                                               consistency="asp"))
    job = c.job("py1")
    params = edl.torch.Parameters(model, job)
    with job.join() as s:
        params.pull(s)
        # The module's parameters are the pulled values, in place.
        flat = params.flat.clone()
        w = job.spec["fc1.weight"]
        assert torch.equal(model.fc1.weight.detach().reshape(-1), flat[w.offset:w.offset + w.size])
        assert model.fc1.weight.data_ptr() == params.flat.data_ptr() + 4 * w.offset
        b = s.next_batch()
        x = torch.randn(len(b), 20)
        loss = nn.functional.cross_entropy(model(x), torch.zeros(len(b), dtype=torch.long))
        params.zero_grad()
        loss.backward()
        # Autograd accumulated into the flat gradient buffer.
        assert model.fc2.weight.grad.data_ptr() == params.grad.data_ptr() + 4 * job.spec[
            "fc2.weight"].offset
        assert params.grad.abs().sum() > 0
        g = params.grad.clone()
        params.push(s, b)
        s.commit(b, loss.item() * len(b))
        params.pull(s)
        torch.testing.assert_close(params.flat, flat - 0.5 * g)
        # A zero_grad(set_to_none=True) in user code: the gradients are put back in place.
        b = s.next_batch()
        model.zero_grad(set_to_none=True)
        loss = model(torch.randn(len(b), 20)).sum()
        loss.backward()
        assert model.fc1.weight.grad.data_ptr() != params.grad.data_ptr() + 4 * w.offset
        want = model.fc1.weight.grad.clone()
        params.push(s, b)
        assert torch.equal(w.of(params.grad).view(16, 20), want)
        s.commit(b)


def test_a_mismatched_module_is_refused(make_cluster):
    c = make_cluster(edl.torch.job_from_module(Net(), samples=10))
    job = c.job("py1")
    with pytest.raises(KeyError, match="no parameter for the job's tensors"):
        edl.torch.Parameters(nn.Linear(20, 16), job)
    with pytest.raises(ValueError, match="shape"):
        edl.torch.Parameters(Net(d=21), job)


def test_a_dataloader_over_elastic_sampler_trains_exactly_once(make_cluster):
    torch.manual_seed(0)
    n, epochs = 600, 4
    x = torch.randn(n, 20)
    y = (x[:, :3].argmax(1)).long()  # learnable: the largest of the first three features
    dataset = TensorDataset(x, y)
    model = Net()
    c = make_cluster(edl.torch.job_from_module(model, samples=n, lr=0.5, batch_size=20,
                                               epochs=epochs, consistency="asp"))
    job = c.job("py1")
    params = edl.torch.Parameters(model, job)
    seen = {e: [] for e in range(epochs)}
    with job.join() as s:
        sampler = edl.torch.ElasticSampler(s)
        for xb, yb in DataLoader(dataset, batch_sampler=sampler):
            batch = sampler.batch
            assert torch.equal(xb, x[torch.from_numpy(batch.indices.astype(np.int64))])
            seen[batch.epoch] += batch.indices.tolist()
            params.pull(s)
            loss = nn.functional.cross_entropy(model(xb), yb)
            params.zero_grad()
            loss.backward()
            params.push(s, batch)
            s.commit(batch, loss.item() * len(yb))
    for e in range(epochs):
        assert sorted(seen[e]) == list(range(n)), e
    st = c.admin().status()
    losses = [loss_sum / samples for _, samples, loss_sum in st["epochs"]]
    assert losses[-1] < 0.6 * losses[0], losses
    exact_rows = c.admin().ledgers()
    assert all((r["applied"], r["duplicates"], r["missing"]) == (n, 0, 0) for r in exact_rows)
