"""The binding against real servers: round trips, the spec, batches exactly once, bad input,
allocation and credentials."""

from __future__ import annotations

import gc
import subprocess
import time
import tracemalloc

import numpy as np
import pytest

import edl
import edl.local
from conftest import job_text, optional


@pytest.fixture
def cluster(make_cluster):
    return make_cluster(job_text(samples=64, epochs=2, batch=8, partition=32, lr=0.5))


def test_spec_and_config_are_the_job_files(cluster):
    job = cluster.job("py1")
    assert job.spec.names == ["w", "b"]
    assert job.spec["w"] == edl.Tensor("w", (256, 4), 0, 1024)
    assert job.spec["b"] == edl.Tensor("b", (4,), 1024, 4)
    assert job.param_count == 1028
    cfg = job.config()
    assert (cfg["batch_size"], cfg["epochs"], cfg["samples"]) == (8, 2, 64)
    assert cfg["optimizer"].startswith("sgd") and cfg["consistency"] == "asp"
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        job.spec["nope"]


def test_push_then_pull_applies_sgd_exactly(cluster):
    job = cluster.job("py1")
    before = job.pull()
    assert before.dtype == np.float32 and np.abs(before).max() > 0  # initialized, not zeros
    g = np.random.default_rng(7).standard_normal(job.param_count).astype(np.float32)
    with job.join() as s:
        b = s.next_batch()
        params = np.empty(job.param_count, np.float32)
        s.pull(params)
        np.testing.assert_array_equal(params, before)
        s.push(b, g)
        assert s.commit(b, 1.0) == 1
        s.pull(params)
        np.testing.assert_allclose(params, before - np.float32(0.5) * g, rtol=0, atol=1e-6)
        # A tensor's view of the flat vector.
        np.testing.assert_array_equal(job.spec["b"].of(params), params[1024:].reshape(4))


def test_torch_tensors_pull_and_push_in_place(cluster):
    torch = optional("torch")
    job = cluster.job("py1")
    with job.join() as s:
        out = torch.zeros(job.param_count)
        ptr = out.data_ptr()
        s.pull(out)
        assert out.data_ptr() == ptr and out.abs().max() > 0
        b = s.next_batch()
        s.push(b, torch.ones(job.param_count))
        s.commit(b)
        before = out.clone()
        s.pull(out)
        torch.testing.assert_close(out, before - 0.5)
        with pytest.raises(TypeError, match="float32"):
            s.pull(torch.zeros(job.param_count, dtype=torch.float64))
        with pytest.raises(ValueError, match="contiguous"):
            s.pull(torch.zeros(job.param_count, 2)[:, 0])


def test_batches_cover_every_epoch_exactly_once(cluster):
    job = cluster.job("py1")
    seen = {0: [], 1: []}
    grads = np.zeros(job.param_count, np.float32)
    with job.join() as s:
        for batch in s.batches():
            assert batch.indices.dtype == np.int64 and len(batch) == 8
            seen[batch.epoch] += batch.indices.tolist()
            s.push(batch, grads)
            s.commit(batch, 0.0)
    for epoch, idx in seen.items():
        assert sorted(idx) == list(range(64)), epoch
    # Each epoch has its own order.
    assert seen[0] != seen[1]
    st = cluster.admin().status()
    assert st["finished"] and st["samples_done"] == 128


def test_bad_input_is_refused_and_loses_nothing(cluster):
    job = cluster.job("py1")
    n = job.param_count
    with job.join() as s:
        params = np.empty(n, np.float32)
        s.pull(params)
        b = s.next_batch()
        bad = np.zeros(n, np.float32)
        bad[5] = np.nan
        with pytest.raises(edl.EdlError) as e:
            s.push(b, bad)
        assert e.value.kind == "NonFinite" and "float 5" in str(e.value)
        bad[5] = np.inf
        with pytest.raises(edl.EdlError, match="not finite"):
            s.push(b, bad)
        with pytest.raises(ValueError, match="has 3 floats, the job's model has 1028"):
            s.push(b, np.zeros(3, np.float32))
        with pytest.raises(TypeError, match="float32"):
            s.push(b, np.zeros(n, np.float64))
        with pytest.raises(TypeError, match="float32"):
            s.pull([0.0] * n)
        ro = np.zeros(n, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            s.pull(ro)
        with pytest.raises(ValueError, match="contiguous"):
            s.pull(np.zeros((n, 2), np.float32)[:, 0])
        with pytest.raises(edl.EdlError) as e:
            s.pull_rows("nope", [0], np.zeros(4, np.float32))
        assert e.value.kind == "UnknownTensor"
        with pytest.raises(edl.EdlError) as e:
            s.pull_rows("w", [256], np.zeros(4, np.float32))
        assert e.value.kind == "RowOutOfRange"
        # Nothing of the above reached the model.
        after = np.empty(n, np.float32)
        s.pull(after)
        np.testing.assert_array_equal(after, params)
        # The batch is still good: push it, commit it; a second commit is refused.
        s.push(b, np.zeros(n, np.float32))
        # Another session's batch is refused without harm to either.
        with cluster.job("py2").join() as other:
            with pytest.raises(edl.EdlError) as e:
                other.commit(b, 0.0)
            assert e.value.kind == "Batch" and not b.committed
        s.commit(b, 0.0)
        assert b.committed
        with pytest.raises(RuntimeError, match="committed already"):
            s.commit(b, 0.0)
        with pytest.raises(RuntimeError, match="committed already"):
            s.push(b, np.zeros(n, np.float32))
    assert s.left
    with pytest.raises(RuntimeError, match="left"):
        s.next_batch()
    with pytest.raises(RuntimeError, match=r"used by join\(\) already"):
        job.join()


def test_sparse_rows_round_trip(cluster):
    job = cluster.job("py1")
    with job.join() as s:
        whole = np.empty(job.param_count, np.float32)
        s.pull(whole)
        rows = [3, 200]
        out = np.empty((2, 4), np.float32)
        s.pull_rows("w", rows, out)
        np.testing.assert_array_equal(out, job.spec["w"].of(whole)[rows])
        b = s.next_batch()
        s.push_rows(b, "w", rows, np.ones((2, 4), np.float32))
        s.commit(b, 0.0)
        s.pull(whole)
        np.testing.assert_allclose(job.spec["w"].of(whole)[rows], out - 0.5, atol=1e-6)


def test_pull_into_a_preallocated_array_allocates_nothing(make_cluster):
    # 1 MiB of parameters: an array-sized allocation would show at once.
    c = make_cluster(job_text(tensors=(("big", (512, 512)),), samples=64, batch=8))
    job = c.job("py1")
    n = job.param_count
    params = np.zeros(n, np.float32)
    with job.join() as s:
        s.pull(params)  # warm: connections, first-call caches
        ptr = params.ctypes.data
        gc.collect()
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            for _ in range(20):
                s.pull(params)
            now, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert params.ctypes.data == ptr
        assert np.abs(params).max() > 0
        # Python-side allocations during 20 pulls of 1 MiB: a few small objects at most.
        assert peak - base < 16 * 1024, (base, peak)
        assert now - base < 4 * 1024, (base, now)
        # The check can fail: a pull into a fresh array does allocate it.
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            s.pull(np.empty(n, np.float32))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak - base >= 4 * n


def test_an_unknown_ca_is_refused(cluster, tmp_path):
    # A state directory without a CA: a client makes none, and says what to give instead.
    with pytest.raises(ValueError, match="no cluster CA"):
        edl.Job(cluster.coordinator, state_dir=tmp_path / "none", name="intruder", reconnect=2)
    assert not (tmp_path / "none" / "pki").exists()
    # A certificate from another CA: the coordinator's TLS refuses it.
    other = tmp_path / "other"
    subprocess.run([str(edl.local.find_binary("edl-ps")), "ca", "init", "--state-dir", str(other)],
                   check=True, capture_output=True)
    with pytest.raises(edl.EdlError) as e:
        edl.Job(cluster.coordinator, state_dir=other, name="intruder", reconnect=2)
    assert e.value.kind == "Call"
    assert "could not connect to" in str(e.value)


def test_credentials_are_checked_before_connecting(cluster, tmp_path):
    with pytest.raises(ValueError, match="cannot load the credentials"):
        edl.Job(cluster.coordinator, cert=tmp_path / "no.pem", key=tmp_path / "no.key",
                ca=tmp_path / "no-ca.pem")
    with pytest.raises(ValueError, match="cert, key and ca"):
        edl.Job(cluster.coordinator, cert="x.pem")
    with pytest.raises(ValueError, match="role"):
        edl.Job(cluster.coordinator, state_dir=tmp_path, name="x", role="root")


def test_an_evaluation_reaches_the_status_and_a_bad_one_is_refused(cluster):
    job = cluster.job("py1")
    job.pull()
    assert job.status()["evaluation"] is None
    job.report_evaluation(0.75, 0.5, 64)
    acc, loss, samples, clock, name = job.status()["evaluation"]
    assert (acc, loss, samples, clock, name) == (0.75, 0.5, 64, 0, "py1")
    with pytest.raises(edl.EdlError) as e:
        job.report_evaluation(float("nan"), 0.5, 64)
    assert e.value.code == "NonFinite"
    assert job.status()["evaluation"][0] == 0.75


def test_a_worker_certificate_may_not_drain(cluster):
    job = cluster.job("py1")
    with pytest.raises(edl.EdlError) as e:
        job.drain(1)
    assert e.value.code == "Forbidden"


def test_a_session_busy_in_one_thread_is_refused_in_another_not_deadlocked(make_cluster):
    import threading

    # BSP with two workers: a's commit of step 0 waits until b has pushed step 0 too.
    c = make_cluster(job_text(samples=64, batch=8, partition=32, consistency="bsp"))
    a_job, b_job = c.job("a"), c.job("b")
    n = a_job.param_count
    a, b = a_job.join(), b_job.join()
    grads = np.zeros(n, np.float32)
    ba, bb = a.next_batch(), b.next_batch()
    a.push(ba, grads)
    clocks = []
    waiting = threading.Thread(target=lambda: clocks.append(a.commit(ba)), daemon=True)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive()  # a waits for b, without the GIL (or b could not run below)
    with pytest.raises(RuntimeError, match="in use by another thread"):
        a.pull(np.zeros(n, np.float32))
    assert not a.drain_requested and a.clock == 0 and a.worker != b.worker
    b.push(bb, grads)
    assert b.commit(bb) == 1
    waiting.join(timeout=10)
    assert not waiting.is_alive() and clocks == [1] and a.clock == 1
    a.leave()
    b.leave()
