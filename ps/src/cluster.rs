//! The cluster scheduler's client (`edl-sched`), for `edlctl job ...` and `edlctl slots`: the
//! same admin connection as a job's, to the scheduler's address, and serializable rows of
//! what it answers.

use edl_shared::proto::sched::{
    JobRecord, LedgerSummary, SchedRequest, SchedResponse, SlotRecord, Submission,
};
use edl_shared::proto::{Request, Response};
use edl_shared::transport::CallError;
use serde::Serialize;

use crate::admin::Admin;

impl Admin {
    async fn sched(&self, req: SchedRequest) -> Result<SchedResponse, CallError> {
        match self.ask(Request::Sched(req)).await? {
            Response::Sched(r) => Ok(r),
            other => Err(CallError::unexpected(&other)),
        }
    }

    async fn sched_job(&self, req: SchedRequest) -> Result<JobRecord, CallError> {
        match self.sched(req).await? {
            SchedResponse::Job(j) => Ok(*j),
            other => Err(CallError::unexpected(&Response::Sched(other))),
        }
    }

    /// Submits a job to the scheduler.
    pub async fn submit_job(&self, job: Submission) -> Result<JobRecord, CallError> {
        self.sched_job(SchedRequest::Submit(job)).await
    }

    /// Every job the scheduler knows.
    pub async fn jobs(&self) -> Result<Vec<JobRecord>, CallError> {
        match self.sched(SchedRequest::List).await? {
            SchedResponse::Jobs(j) => Ok(j),
            other => Err(CallError::unexpected(&Response::Sched(other))),
        }
    }

    /// One job.
    pub async fn show_job(&self, job: &str) -> Result<JobRecord, CallError> {
        self.sched_job(SchedRequest::Show { job: job.into() }).await
    }

    /// Cancels a job.
    pub async fn cancel_job(&self, job: &str) -> Result<JobRecord, CallError> {
        self.sched_job(SchedRequest::Cancel { job: job.into() })
            .await
    }

    /// Every slot and its holder.
    pub async fn slots(&self) -> Result<Vec<SlotRecord>, CallError> {
        match self.sched(SchedRequest::Slots).await? {
            SchedResponse::Slots(s) => Ok(s),
            other => Err(CallError::unexpected(&Response::Sched(other))),
        }
    }
}

/// A job as `edlctl job` prints it.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct JobRow {
    /// Its name.
    pub name: String,
    /// Its owner.
    pub owner: String,
    /// queued, running, finished, failed or cancelled.
    pub state: String,
    /// Workers asked for, and the min..max range.
    pub workers: u32,
    /// Fewest workers.
    pub min_workers: u32,
    /// Most workers.
    pub max_workers: u32,
    /// Priority.
    pub priority: i32,
    /// Slots given now.
    pub alloc: u32,
    /// Worker processes running now.
    pub running: u32,
    /// Resizes so far.
    pub resizes: u32,
    /// The latest growth's cost: seconds from the resize to the last new worker training.
    pub resize_cost_s: Option<f64>,
    /// Samples trained.
    pub samples: u64,
    /// Samples in the whole run.
    pub samples_total: u64,
    /// Seconds from submission to the first slot (so far, while queued).
    pub queued_s: f64,
    /// Seconds from submission to the end (job completion time).
    pub jct_s: Option<f64>,
    /// Slot-seconds held.
    pub attained_s: f64,
    /// Submitted, unix milliseconds.
    pub submit_ms: u64,
    /// Started, unix milliseconds.
    pub start_ms: Option<u64>,
    /// Ended, unix milliseconds.
    pub end_ms: Option<u64>,
    /// The coordinator while it runs.
    pub coordinator: Option<String>,
    /// The job's directory on the scheduler's host.
    pub dir: String,
    /// The data ledger once finished.
    pub ledger: Option<LedgerRow>,
    /// Why it failed or was cancelled.
    pub message: String,
    /// What its workers run: the job file's `[worker]` command, or `edl-worker`.
    #[serde(default)]
    pub runs: String,
}

/// A finished job's data ledger.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct LedgerRow {
    /// Sample positions applied.
    pub applied: u64,
    /// Applied more than once.
    pub duplicates: u64,
    /// Never applied.
    pub missing: u64,
}

impl From<LedgerSummary> for LedgerRow {
    fn from(l: LedgerSummary) -> Self {
        LedgerRow {
            applied: l.applied,
            duplicates: l.duplicates,
            missing: l.missing,
        }
    }
}

impl JobRow {
    /// The row of `j` as of `now_ms` (unix milliseconds).
    pub fn new(j: &JobRecord, now_ms: u64) -> JobRow {
        let secs = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1000.0;
        JobRow {
            name: j.name.clone(),
            owner: j.owner.clone(),
            state: j.state.as_str().into(),
            workers: j.workers,
            min_workers: j.min_workers,
            max_workers: j.max_workers,
            priority: j.priority,
            alloc: j.alloc,
            running: j.running,
            resizes: j.resizes,
            resize_cost_s: j.resize_cost_ms.map(|ms| ms as f64 / 1000.0),
            samples: j.samples.0,
            samples_total: j.samples.1,
            queued_s: secs(j.submit_ms, j.start_ms.or(j.end_ms).unwrap_or(now_ms)),
            jct_s: j.end_ms.map(|e| secs(j.submit_ms, e)),
            attained_s: j.attained_s,
            submit_ms: j.submit_ms,
            start_ms: j.start_ms,
            end_ms: j.end_ms,
            coordinator: j.coordinator.clone(),
            dir: j.dir.clone(),
            ledger: j.ledger.map(LedgerRow::from),
            message: j.message.clone(),
            runs: j.runs.clone(),
        }
    }
}

/// A slot as `edlctl slots` prints it.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct SlotRow {
    /// Its name.
    pub slot: String,
    /// Its host.
    pub host: String,
    /// The job holding it.
    pub job: Option<String>,
    /// The worker holding it.
    pub worker: Option<String>,
}

impl From<&SlotRecord> for SlotRow {
    fn from(s: &SlotRecord) -> Self {
        SlotRow {
            slot: s.name.clone(),
            host: s.host.clone(),
            job: s.holder.as_ref().map(|h| h.0.clone()),
            worker: s.holder.as_ref().map(|h| h.1.clone()),
        }
    }
}
