"""Python workers as real processes: killed with SIGKILL mid-step, interrupted with Ctrl-C,
and training beside a Rust worker in one job; the ledgers stay exact."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
import edl
import edl.data
import edl.local
from conftest import HERE, exact, job_text, require_data, spawn_worker

EXAMPLES = HERE.parent / "examples"


def example(name: str):
    """An example script, imported as a module (its `__main__` part does not run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wait_until(what, cond, timeout=60.0, every=0.05):
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(every)
    return v


def test_a_worker_killed_mid_step_loses_no_data_and_applies_none_twice(make_cluster, tmp_path):
    samples, epochs = 2048, 2
    c = make_cluster(
        job_text(samples=samples, epochs=epochs, batch=16, partition=128, lease_ms=1000)
    )
    admin = c.admin()
    steps = tmp_path / "a.steps"
    # A step of 20 ms between pull and push: the kill lands inside one.
    a = spawn_worker(c, "a", "0.02", env={"EDL_STEPS_FILE": str(steps)})
    wait_until("a commits 30 steps", lambda: steps.exists() and
               len(steps.read_text().splitlines()) >= 30)
    a.send_signal(signal.SIGKILL)
    assert a.wait(timeout=10) == -signal.SIGKILL
    done = admin.status()["samples_done"]
    assert 0 < done < samples * epochs
    b = spawn_worker(c, "b")
    c.wait_finished(timeout=120, admin=admin)
    assert b.wait(timeout=30) == 0, c.log("b")
    st = admin.status()  # after b has left
    states = {name: state for _, name, state, _ in st["workers"]}
    assert states == {"a": "Dead", "b": "Left"}, st["workers"]
    exact(admin.ledgers(), samples, epochs)


def test_ctrl_c_leaves_cleanly_and_returns_the_data(make_cluster, tmp_path):
    # A long lease: only a clean leave (not its expiry) can free the data in time.
    samples = 512
    c = make_cluster(job_text(samples=samples, batch=16, partition=64, lease_ms=60_000))
    admin = c.admin()
    steps = tmp_path / "a.steps"
    a = spawn_worker(c, "a", "0.05", env={"EDL_STEPS_FILE": str(steps)})
    wait_until("a trains", lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3)
    a.send_signal(signal.SIGINT)
    assert a.wait(timeout=10) != 0
    assert "KeyboardInterrupt" in c.log("a")
    st = admin.status()
    assert [(n, s) for _, n, s, _ in st["workers"]] == [("a", "Left")]
    b = spawn_worker(c, "b")
    c.wait_finished(timeout=60, admin=admin)  # well before a's 60 s lease
    assert b.wait(timeout=30) == 0
    exact(admin.ledgers(), samples, 1)


def test_ctrl_c_interrupts_a_call_that_waits(tmp_path):
    # Nobody listens at the coordinator's address: connecting retries until interrupted.
    # Python's own Ctrl-C handling even if this runs where SIGINT is ignored (see worker.py).
    # The cluster's CA, which issues the client its certificate.
    subprocess.run([str(edl.local.find_binary("edl-ps")), "ca", "init", "--state-dir",
                    str(tmp_path)], check=True, capture_output=True)
    code = (
        "import edl, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "print('connecting', flush=True)\n"
        f"edl.Job('127.0.0.1:9', state_dir={str(tmp_path)!r}, name='w')\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "connecting"
    time.sleep(1.0)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=10)
    assert time.monotonic() - t < 2.0
    assert "KeyboardInterrupt" in err, err


def test_a_python_worker_and_a_rust_worker_share_one_job(make_cluster):
    # EDL's built-in MLP: the Rust edl-worker trains it, and so does the NumPy example.
    data = edl.data.FASHION_MNIST
    require_data(data / "train-images-idx3-ubyte")
    samples, epochs = 12288, 2
    text = (
        '[model]\nkind = "mlp"\nlayers = [784, 32, 10]\n\n[optimizer]\nkind = "sgd"\nlr = 0.1\n\n'
        f'[training]\nconsistency = "ssp:2"\nbatch_size = 32\nepochs = {epochs}\n'
        f"samples = {samples}\npartition_size = 256\n"
    )
    c = make_cluster(text)
    admin = c.admin()
    # The Python worker first (it is the slower to load the data), its steps at most 50 a
    # second so that it cannot finish the job alone (at least 15 s) before the Rust one,
    # started once the Python one trains, has joined.
    py = c.spawn([sys.executable, EXAMPLES / "numpy_logreg.py"], "py",
                 env={"EDL_EXAMPLE_STEP_SLEEP": "0.02"})
    wait_until("py trains", lambda: admin.status()["samples_done"] > 0, timeout=60)
    rust = c.spawn(
        [edl.local.find_binary("edl-worker"), "--coordinator", c.coordinator, "--name", "rust",
         "--data-dir", data, "--state-dir", c.state_dir],
        "rust",
    )
    st = c.wait_finished(timeout=300, admin=admin)
    assert py.wait(timeout=30) == 0, c.log("py")
    assert rust.wait(timeout=30) == 0, c.log("rust")
    clocks = {name: clock for _, name, _, clock in st["workers"]}
    print("steps per worker", clocks)
    # Both trained a real share of the job.
    total_steps = samples * epochs // 32
    assert clocks["py"] > total_steps // 10 and clocks["rust"] > total_steps // 10, clocks
    exact(admin.ledgers(), samples, epochs)
    # And the model they trained together is a model: well above chance (0.10).
    step = example("numpy_logreg").step
    tx, ty = edl.data.fashion_mnist("t10k")
    _, correct = step(admin.spec, admin.pull(), tx, ty)
    assert correct / len(ty) > 0.6, correct / len(ty)
