"""A test worker: joins the job from its environment (edl.local.Cluster.spawn, the process
contract), pushes a small deterministic gradient for every batch, and writes one line per
committed step to $EDL_STEPS_FILE when set. argv[1], if given, is seconds to sleep between pull
and push (a step long enough to be killed in the middle of). $EDL_TEST_LOAD_S: seconds of
"loading data" between connecting and joining; $EDL_TEST_NOTICE: the preemption notice
SIGUSR1 gives."""

import os
import signal
import sys
import time

import numpy as np

import edl

# Python's own Ctrl-C handling even when started from a shell that ignores SIGINT (a background
# job of a non-interactive shell passes SIGINT on ignored, and Python then keeps ignoring it).
signal.signal(signal.SIGINT, signal.default_int_handler)

pause = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
steps_file = os.environ.get("EDL_STEPS_FILE")
log = open(steps_file, "a", buffering=1) if steps_file else None
job = edl.Job.from_env(preempt_notice=float(os.environ.get("EDL_TEST_NOTICE", "30")))
load_s = float(os.environ.get("EDL_TEST_LOAD_S", "0"))
if load_s:
    print("loading", flush=True)
    time.sleep(load_s)
params = np.zeros(job.param_count, np.float32)
grads = np.full(job.param_count, 1e-3, np.float32)
n = 0
with job.join() as session:
    print(f"joined as worker {session.worker}", flush=True)
    for batch in session.batches():
        session.pull(params)
        time.sleep(pause)
        session.push(batch, grads)
        session.commit(batch, 0.1 * len(batch))
        n += 1
        if log:
            log.write(f"{batch.epoch} {batch.clock}\n")
print(f"done: {n} steps", flush=True)
