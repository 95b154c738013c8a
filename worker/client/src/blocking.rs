//! The client for callers that are not async (scripts, the Python binding): the same job and
//! session, each call waiting for its answer. It owns a small runtime whose thread keeps the
//! session's heartbeats going while the caller computes.
//!
//! ```no_run
//! # fn run(cfg: edl_client::ClientConfig) -> Result<(), edl_client::ClientError> {
//! use edl_client::blocking::Job;
//!
//! let job = Job::connect(&cfg)?;
//! let n = job.spec().param_count();
//! let (mut params, grads) = (vec![0f32; n], vec![0f32; n]);
//! let mut session = job.join()?;
//! while let Some(batch) = session.next_batch()? {
//!     session.pull(&mut params)?;
//!     // forward and backward over batch.indices() into grads
//!     session.push(&batch, &grads)?;
//!     session.commit(batch, 0.0)?;
//! }
//! session.leave()?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use edl_shared::proto::JobConfig;
use edl_shared::proto::ids::{Clock, WorkerId};
use edl_shared::proto::msg::JobStatus;
use tokio::runtime::Runtime;

use crate::{Batch, ClientConfig, ClientError, JobSpec, RowGrads, TrafficCount};

/// A connection to a job (see [`crate::Job`]).
#[derive(Debug)]
pub struct Job {
    rt: Arc<Runtime>,
    inner: crate::Job,
}

/// A registered worker's session (see [`crate::Session`]).
#[derive(Debug)]
pub struct Session {
    rt: Arc<Runtime>,
    inner: crate::Session,
}

fn runtime() -> Result<Runtime, ClientError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("edl-client")
        .enable_all()
        .build()
        .map_err(|e| ClientError::Runtime(e.to_string()))
}

impl Job {
    /// Connects to the coordinator, waits for the shard map and connects to every shard.
    pub fn connect(cfg: &ClientConfig) -> Result<Job, ClientError> {
        let rt = Arc::new(runtime()?);
        let inner = rt.block_on(crate::Job::connect(cfg))?;
        Ok(Job { rt, inner })
    }

    /// The model's tensors.
    pub fn spec(&self) -> &JobSpec {
        self.inner.spec()
    }

    /// The job configuration.
    pub fn config(&self) -> &JobConfig {
        self.inner.config()
    }

    /// The coordinator's status snapshot.
    pub fn status(&self) -> Result<JobStatus, ClientError> {
        self.rt.block_on(self.inner.status())
    }

    /// Pulls the whole model as it stands (for evaluation), without joining.
    pub fn pull(&self, out: &mut [f32]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.pull_all(out, Clock(0)))
    }

    /// Payload bytes exchanged with the shards so far.
    pub fn traffic(&self) -> TrafficCount {
        self.inner.traffic()
    }

    /// Joins the job as a worker, stop-free (see [`crate::Job::join`]).
    pub fn join(self) -> Result<Session, ClientError> {
        let inner = self.rt.block_on(self.inner.join())?;
        Ok(Session { rt: self.rt, inner })
    }
}

impl Session {
    /// This worker's id.
    pub fn worker(&self) -> WorkerId {
        self.inner.worker()
    }

    /// The model's tensors.
    pub fn spec(&self) -> &JobSpec {
        self.inner.spec()
    }

    /// Steps completed.
    pub fn clock(&self) -> Clock {
        self.inner.clock()
    }

    /// True once an operator asked this worker to leave.
    pub fn drain_requested(&self) -> bool {
        self.inner.drain_requested()
    }

    /// Payload bytes exchanged with the shards so far.
    pub fn traffic(&self) -> TrafficCount {
        self.inner.job().traffic()
    }

    /// The next mini-batch, or `None` when the data is done (see [`crate::Session::next_batch`]).
    pub fn next_batch(&mut self) -> Result<Option<Batch>, ClientError> {
        self.rt.block_on(self.inner.next_batch())
    }

    /// Pulls every parameter into `out`.
    pub fn pull(&self, out: &mut [f32]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.pull(out))
    }

    /// Pulls some rows of one tensor (see [`crate::Session::pull_rows`]).
    pub fn pull_rows(
        &self,
        tensor: &str,
        rows: &[u32],
        out: &mut [f32],
    ) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.pull_rows(tensor, rows, out))
    }

    /// Pushes the gradient of `batch` (see [`crate::Session::push`]).
    pub fn push(&mut self, batch: &Batch, grads: &[f32]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.push(batch, grads))
    }

    /// Pushes sparse gradients of `batch` (see [`crate::Session::push_rows`]).
    pub fn push_rows(&mut self, batch: &Batch, grads: &[RowGrads<'_>]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.push_rows(batch, grads))
    }

    /// Commits `batch` and waits for the next step (see [`crate::Session::commit`]).
    pub fn commit(&mut self, batch: Batch, loss_sum: f64) -> Result<Clock, ClientError> {
        self.rt.block_on(self.inner.commit(batch, loss_sum))
    }

    /// Leaves gracefully: uncommitted data returns to the pool.
    pub fn leave(self) -> Result<(), ClientError> {
        let Session { rt, inner } = self;
        rt.block_on(inner.leave())
    }
}
