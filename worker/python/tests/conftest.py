"""Fixtures: jobs written to a temporary directory, and local clusters of real `edl-ps`
processes (from $EDL_BIN_DIR, default the checkout's target/debug) stopped after each test."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

import edl.local

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
os.environ.setdefault("EDL_BIN_DIR", str(REPO / "target" / "debug"))
WORKER = HERE / "worker.py"


def job_text(
    *,
    samples=64,
    epochs=1,
    batch=8,
    partition=32,
    consistency="asp",
    lr=0.5,
    lease_ms=3000,
    tensors=(("w", (256, 4)), ("b", (4,))),
    model='kind = "custom"',
) -> str:
    out = [f"[model]\n{model}\n", f'[optimizer]\nkind = "sgd"\nlr = {lr}\n']
    out.append(
        f'[training]\nconsistency = "{consistency}"\nbatch_size = {batch}\nepochs = {epochs}\n'
        f"samples = {samples}\npartition_size = {partition}\nlease_ms = {lease_ms}\n"
    )
    for name, shape in tensors:
        out.append(
            f'[[tensor]]\nname = "{name}"\nshape = {list(shape)}\ninit = "uniform"\nscale = 0.1\n'
        )
    return "\n".join(out)


@pytest.fixture
def make_cluster(tmp_path):
    """make_cluster(job_text, shards=1) -> a started edl.local.Cluster."""
    made = []

    def make(text: str, shards: int = 1, **kw) -> edl.local.Cluster:
        path = tmp_path / f"job{len(made)}.toml"
        path.write_text(text)
        c = edl.local.Cluster(path, shards=shards, state_dir=tmp_path / f"state{len(made)}", **kw)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


def spawn_worker(cluster, name, *args, env=None, placement=None):
    """Starts tests/worker.py as worker `name` (args: its pause per step)."""
    return cluster.spawn([sys.executable, WORKER, *args], name, env=env, placement=placement)


def exact(ledgers, samples, epochs):
    """Asserts every shard applied every sample of every epoch exactly once."""
    assert ledgers, "no ledger rows"
    seen = {(r["shard"], r["epoch"]) for r in ledgers}
    shards = {r["shard"] for r in ledgers}
    assert seen == {(s, e) for s in shards for e in range(epochs)}, ledgers
    for r in ledgers:
        assert (r["applied"], r["duplicates"], r["missing"]) == (samples, 0, 0), r


def optional(module: str):
    """Imports `module`, or skips the test where it is not installed, unless
    EDL_REQUIRE_<MODULE>=1 (CI) makes its absence a failure."""
    if os.environ.get(f"EDL_REQUIRE_{module.upper()}") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def require_data(path: Path) -> None:
    """Skips the test when `path` is missing, unless EDL_REQUIRE_DATA=1 (CI)."""
    if not (path.exists() or path.with_name(path.name + ".gz").exists()):
        if os.environ.get("EDL_REQUIRE_DATA") == "1":
            pytest.fail(f"{path} is missing and EDL_REQUIRE_DATA=1")
        pytest.skip(f"{path} is missing (apt-get install dataset-fashion-mnist)")
