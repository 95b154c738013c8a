"""edl.torch: the job file from a module, parameters bound into EDL's buffers, and a standard
DataLoader loop over ElasticSampler."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from conftest import HERE, exact, job_text, optional, require_data  # noqa: E402

torch = optional("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import edl.data  # noqa: E402
import edl.local  # noqa: E402
import edl.torch  # noqa: E402
import torch_worker  # noqa: E402
from test_elastic import wait_until  # noqa: E402

TORCH_WORKER = HERE / "torch_worker.py"


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


def test_a_dataloader_over_elastic_sampler_trains_exactly_once_per_epoch(make_cluster):
    torch.manual_seed(0)
    n, epochs = 600, 4
    x = torch.randn(n, 20)
    y = (x[:, :3].argmax(1)).long()  # learnable: the largest of the first three features
    dataset = TensorDataset(x, y)
    model = Net()
    c = make_cluster(edl.torch.job_from_module(model, samples=n, lr=0.5, batch_size=20,
                                               epochs=epochs, consistency="asp",
                                               partition_size=100))
    job = c.job("py1")
    params = edl.torch.Parameters(model, job)
    seen = {}
    with job.join() as s:
        sampler = edl.torch.ElasticSampler(s)
        assert len(sampler) == 30  # 600 samples in batches of 20
        for epoch in sampler.epochs():  # a per-epoch loop sees each epoch once, in order
            assert epoch not in seen and sampler.epoch == epoch
            seen[epoch] = []
            for xb, yb in DataLoader(dataset, batch_sampler=sampler):
                batch = sampler.batch
                assert batch.epoch == epoch and batch.indices.dtype == np.int64
                assert torch.equal(xb, x[batch.indices])  # torch indexes with the indices
                seen[epoch] += batch.indices.tolist()
                params.pull(s)
                loss = nn.functional.cross_entropy(model(xb), yb)
                params.zero_grad()
                loss.backward()
                params.push(s, batch)
                s.commit(batch, loss.item() * len(yb))
        assert sampler.done
    assert list(seen) == list(range(epochs))
    for e in range(epochs):
        assert sorted(seen[e]) == list(range(n)), e
    st = c.admin().status()
    losses = [loss_sum / samples for _, samples, loss_sum in st["epochs"]]
    assert losses[-1] < 0.6 * losses[0], losses
    exact(c.admin().ledgers(), n, epochs)


def test_a_loader_with_two_workers_trains_each_epoch_exactly_once(make_cluster):
    # The loader's processes load batches ahead (the sampler hands out the leased partition's
    # next spans before the ones before them are committed); the session commits in order.
    n, epochs = 960, 2
    c = make_cluster(job_text(samples=n, epochs=epochs, batch=16, partition=160,
                              tensors=(("0.weight", (16, 20)), ("0.bias", (16,)),
                                       ("2.weight", (3, 16)), ("2.bias", (3,)))))
    job = c.job("py1")
    net = torch_worker.model()
    params = edl.torch.Parameters(net, job)
    seen, depths, passes = {}, [], []
    main = os.getpid()
    with job.join() as s:
        sampler = edl.torch.ElasticSampler(s)
        loader = sampler.loader(Loaded(n), num_workers=2)
        for epoch in sampler.epochs():
            passes.append(epoch)
            for (xb, yb), pids in loader:
                batch = sampler.batch
                depths.append(len(sampler._queue))
                # Loaded in the loader's processes, and the samples of exactly this batch.
                assert main not in pids.tolist()
                want = torch.stack([Loaded(n)[int(i)][0][0] for i in batch.indices])
                assert torch.equal(xb, want)
                seen.setdefault(batch.epoch, []).extend(batch.indices.tolist())
                params.pull(s)
                loss = nn.functional.cross_entropy(net(xb), yb)
                params.zero_grad()
                loss.backward()
                params.push(s, batch)
                s.commit(batch, loss.item() * len(yb))
    assert passes == [0, 1]
    for e in range(epochs):
        assert sorted(seen[e]) == list(range(n)), e  # no duplicates, none missing
    assert max(depths) >= 3, depths  # batches were loaded ahead of their commits
    exact(c.admin().ledgers(), n, epochs)


class Loaded(torch_worker.Data):
    """torch_worker's samples, each with the pid of the process that loaded it."""

    def __getitem__(self, i):
        return super().__getitem__(i), os.getpid()


def test_workers_killed_or_stopped_with_batches_loaded_ahead_lose_nothing(make_cluster,
                                                                          tmp_path):
    # a is SIGKILLed and b is SIGTERMed, each with batches loaded ahead by its loader's
    # processes; c trains the rest. Every sample is applied once per epoch on every shard.
    n, epochs = 2048, 2
    c = make_cluster(job_text(samples=n, epochs=epochs, batch=16, partition=256, lease_ms=60_000,
                              tensors=(("0.weight", (16, 20)), ("0.bias", (16,)),
                                       ("2.weight", (3, 16)), ("2.bias", (3,)))))
    admin = c.admin()
    logs = {w: tmp_path / f"{w}.steps" for w in "abc"}

    def start(name):
        env = {"EDL_STEPS_FILE": str(logs[name]), "EDL_TEST_SAMPLES": str(n)}
        return c.spawn([sys.executable, TORCH_WORKER, "0.001", "0.02"], name, env=env)

    def steps(name):
        return [ln.split() for ln in logs[name].read_text().splitlines()] \
            if logs[name].exists() else []

    def ahead(name):
        return any(int(row[1]) >= 3 for row in steps(name)[5:])

    a = start("a")
    wait_until("a trains with batches loaded ahead", lambda: ahead("a"), timeout=120)
    a.kill()
    assert a.wait(timeout=10) == -signal.SIGKILL
    b = start("b")
    wait_until("b trains with batches loaded ahead", lambda: ahead("b"), timeout=120)
    b.send_signal(signal.SIGTERM)
    assert b.wait(timeout=30) == 0, c.log("b")
    st = admin.status()
    assert {n: s for _, n, s, _ in st["workers"]} == {"a": "Dead", "b": "Left"}, st["workers"]
    assert c.log("b").rstrip().endswith("done"), c.log("b")  # it left its `with` cleanly
    c3 = start("c")
    c.wait_finished(timeout=300, admin=admin)
    assert c3.wait(timeout=60) == 0, c.log("c")
    exact(admin.ledgers(), n, epochs)
    # b and c, which left or finished cleanly, logged each of their commits: none twice.
    for e in range(epochs):
        done = [int(i) for w in "bc" for row in steps(w) if int(row[0]) == e for i in row[2:]]
        assert len(done) == len(set(done)), e


CNN = HERE.parent / "examples" / "fashion_cnn"


def test_the_cnn_examples_job_file_is_its_net_with_a_worker_table():
    require_data(edl.data.FASHION_MNIST / "train-images-idx3-ubyte")
    train = example_module(CNN / "train.py")
    committed = tomllib.loads((CNN / "job.toml").read_text())
    written = tomllib.loads(train.job_text(train.Net()))
    for table in ("model", "optimizer", "schedule", "training", "tensor"):
        assert committed[table] == written[table], table
    assert committed["worker"]["command"][:2] == ["python3", "train.py"]
    # It is a job edl-ps takes, [worker] table included.
    assert "fc1.weight" in edl.local.check_job(CNN / "job.toml")


def test_the_cnn_example_trains_exactly_once_with_two_loader_processes():
    require_data(edl.data.FASHION_MNIST / "train-images-idx3-ubyte")
    out = subprocess.run(
        [sys.executable, CNN / "train.py", "--local", "--samples", "1024", "--num-workers", "2",
         "--no-test"], capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "w0: exit 0" in out.stdout and "ledger: 1 shard-epochs, exact" in out.stdout, out.stdout
    assert "trained 1024 samples" in out.stdout and "test accuracy" in out.stdout, out.stdout


def test_the_ported_mnist_script_reaches_the_single_process_accuracy():
    # pytorch/examples' MNIST script on Fashion-MNIST (Adadelta, StepLR per epoch), on 12,000
    # samples for 3 epochs: as EDL's job with two workers (SSP(2), the optimizer and its
    # schedule on the shard) against the script itself in one process, twice (seeds 1 and 2).
    # The runs differ in initialization, data order, dropout and augmentation draws: seeds
    # alone spread the plain script's accuracy by about 0.015 here (0.794-0.810 over three).
    # EDL's workers draw dropout and augmentation unseeded and train asynchronously, so its
    # runs spread too (0.797-0.804 over eleven here, and one of 0.787 under CI): the mean of
    # two runs is compared, and every run's log printed.
    require_data(edl.data.FASHION_MNIST / "train-images-idx3-ubyte")
    common = ["--samples", "12000", "--epochs", "3", "--num-workers", "0",
              "--log-interval", "100000"]

    def accuracy(*flags):
        out = subprocess.run([sys.executable, CNN / "train.py", *flags, *common],
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout + out.stderr
        found = re.findall(r"^test accuracy ([0-9.]+)", out.stdout, re.M)
        assert found, out.stdout
        return float(found[-1]), out.stdout

    plain = [accuracy("--plain", "--seed", seed)[0] for seed in ("1", "2")]
    ours = []
    for _ in range(2):
        acc, log = accuracy("--local", "--workers", "2", "--no-test")
        print(log)
        assert "ledger: 3 shard-epochs, exact" in log, log
        ours.append(acc)
    print(f"ported script: EDL {ours}, plain PyTorch {plain}")
    assert sum(ours) / len(ours) >= min(plain) - 0.02, (ours, plain)


def example_module(path):
    """An example script, imported as a module (its `__main__` part does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CHURN = """
[[event]]
at_s = 1.0
action = "add"      # w2
count = 1

[[event]]
at_s = 3.0
action = "term"
worker = "w0"

[[event]]
at_s = 5.0
action = "preempt"
worker = "w1"

[[event]]
at_s = 6.0
action = "add"      # w3, w4
count = 2

[[event]]
at_s = 11.0
action = "kill"
worker = "w2"
"""


def test_edl_local_runs_a_python_program_of_the_job_file_through_churn(tmp_path):
    # The placer starts the job file's [worker] program under the process contract: a
    # PyTorch worker with two loader processes; SIGTERM, SIGUSR1 and SIGKILL each land on
    # one with batches loaded ahead. At least 21 s of training (steps of 50 ms, at most 3
    # workers at once), so that w2, started at 1 s, has joined (however slowly) by its kill.
    n = 20480
    job = tmp_path / "job.toml"
    job.write_text(
        job_text(samples=n, epochs=1, batch=16, partition=256,
                 tensors=(("0.weight", (16, 20)), ("0.bias", (16,)), ("2.weight", (3, 16)),
                          ("2.bias", (3,))))
        + f'\n[worker]\ncommand = ["{sys.executable}", "{TORCH_WORKER}", "0.0005", "0.05"]\n'
        + f'env = {{ EDL_TEST_SAMPLES = "{n}", EDL_STEPS_FILE = "steps.log" }}\n'
    )
    scenario = tmp_path / "churn.toml"
    scenario.write_text(CHURN)
    report = tmp_path / "report.json"
    out = subprocess.run(
        [edl.local.find_binary("edl-local"), "--job", job, "--workers", "2", "--scenario",
         scenario, "--report", report, "--state-dir", tmp_path / "state"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "RUST_BACKTRACE": "0"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(report.read_text())
    assert r["finished"] and r["shutdown_problems"] == [], r
    assert [(e["samples"], e["duplicates"], e["missing"]) for e in r["epochs"]] == [(n, 0, 0)]
    fates = {w["name"]: (w["fate"], w["exit_code"], w["signal"]) for w in r["worker_processes"]}
    assert fates == {"w0": ("termed", 0, None), "w1": ("preempted", 0, None),
                     "w2": ("killed", None, 9), "w3": ("none", 0, None),
                     "w4": ("none", 0, None)}, fates
    # Found dead by its socket, which its loader processes no longer hold.
    assert "port unreachable" in r["elastic"]["deaths"][0]["how"], r["elastic"]["deaths"]
    # Every worker ran in the job file's folder and loaded batches ahead of its commits.
    rows = [ln.split() for ln in (tmp_path / "steps.log").read_text().splitlines()]
    assert max(int(row[1]) for row in rows) >= 3
