"""A PyTorch test worker (edl.local.Cluster.spawn, the process contract): a small network over
a synthetic dataset, fed by `ElasticSampler.loader(num_workers=$EDL_TEST_LOADERS)`. For every
committed step it writes a line to $EDL_STEPS_FILE: the epoch, how many batches the loader had
been given and not committed (the prefetch depth), and the batch's indices. argv[1]: seconds
each sample takes to load (in the loader's processes), argv[2]: seconds each step sleeps."""

import os
import sys
import time

import torch
from torch import nn

import edl
import edl.torch

D = 20


class Data(torch.utils.data.Dataset):
    """Deterministic samples, each taking `load_s` to load (a decoder's or augmentation's
    work), computed from the index alone so that every process sees the same ones."""

    def __init__(self, n: int = 2048, load_s: float = 0.0):
        self.n, self.load_s = n, load_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.load_s:
            time.sleep(self.load_s)
        g = torch.Generator().manual_seed(int(i))
        x = torch.randn(D, generator=g)
        return x, int(x[:3].argmax())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3))


if __name__ == "__main__":
    n = int(os.environ.get("EDL_TEST_SAMPLES", "2048"))
    load_s = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    step_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    torch.set_num_threads(1)
    net = model()
    job = edl.Job.from_env()
    params = edl.torch.Parameters(net, job)
    log = open(os.environ["EDL_STEPS_FILE"], "a", buffering=1)
    with job.join() as session:
        print(f"joined as worker {session.worker}", flush=True)
        sampler = edl.torch.ElasticSampler(session)
        loaders = int(os.environ.get("EDL_TEST_LOADERS", "2"))
        loader = sampler.loader(Data(n, load_s), num_workers=loaders)
        for _epoch in sampler.epochs():
            for x, y in loader:
                batch = sampler.batch
                depth = len(sampler._queue)
                params.pull(session)
                loss = nn.functional.cross_entropy(net(x), y)
                params.zero_grad()
                loss.backward()
                time.sleep(step_s)
                params.push(session, batch)
                session.commit(batch, loss.item() * len(y))
                log.write(f"{batch.epoch} {depth} {' '.join(map(str, batch.indices))}\n")
    print("done", flush=True)
