//! The cluster scheduler's messages (`edl-sched`): jobs submitted to a pool of worker slots,
//! their state, and the slots. Job servers (coordinators, shards) refuse them.

/// A job handed to the scheduler.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Submission {
    /// The job's name (a label: letters, digits, `-`, `_`, `.`), or empty to let the scheduler
    /// name it `jN`.
    pub name: String,
    /// The job file's text (TOML, as `edl-ps coordinator --job` reads it).
    pub job_file: String,
    /// The directory the job file was read from: relative data paths resolve against it.
    pub file_dir: String,
    /// Workers asked for (what a non-elastic policy gives the job).
    pub workers: u32,
    /// Fewest workers the job runs with (elastic policies shrink it no further).
    pub min_workers: u32,
    /// Most workers the job can use (elastic policies grow it no further).
    pub max_workers: u32,
    /// Higher runs first; ties go by arrival.
    pub priority: i32,
}

/// Where a job is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum JobState {
    /// Waiting for slots.
    Queued,
    /// Its servers run; it holds slots (or held them and was shrunk to none).
    Running,
    /// Trained to the end.
    Finished,
    /// Its servers failed; `message` says why.
    Failed,
    /// Cancelled by its owner or an operator.
    Cancelled,
}

impl JobState {
    /// Whether the job is over.
    pub fn is_over(self) -> bool {
        matches!(
            self,
            JobState::Finished | JobState::Failed | JobState::Cancelled
        )
    }

    /// Its name in tables.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// The data ledger of a finished job, summed over its epochs (worst shard per epoch).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct LedgerSummary {
    /// Sample positions applied.
    pub applied: u64,
    /// Sample positions applied more than once.
    pub duplicates: u64,
    /// Sample positions never applied.
    pub missing: u64,
}

/// A job as the scheduler reports it.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct JobRecord {
    /// The job's name; its certificates carry it as their job.
    pub name: String,
    /// Who submitted it: the name in the submitter's certificate.
    pub owner: String,
    /// What was asked for.
    pub workers: u32,
    /// Fewest workers.
    pub min_workers: u32,
    /// Most workers.
    pub max_workers: u32,
    /// Priority.
    pub priority: i32,
    /// Where it is.
    pub state: JobState,
    /// Slots the policy gives it now.
    pub alloc: u32,
    /// Worker processes it runs now (drained ones count until they exit).
    pub running: u32,
    /// Resizes carried out (growing or shrinking a running job).
    pub resizes: u32,
    /// The latest growth's measured cost: milliseconds from the resize to the admission of
    /// the last new worker (slots given but not yet training).
    pub resize_cost_ms: Option<u64>,
    /// Submitted, unix milliseconds.
    pub submit_ms: u64,
    /// First given slots, unix milliseconds.
    pub start_ms: Option<u64>,
    /// Finished, failed or cancelled, unix milliseconds.
    pub end_ms: Option<u64>,
    /// Slot-seconds held so far.
    pub attained_s: f64,
    /// Samples trained, and the run's total.
    pub samples: (u64, u64),
    /// The coordinator's address while the job runs.
    pub coordinator: Option<String>,
    /// The job's directory on the scheduler's host: state, logs and the owner's admin
    /// certificate (`pki/`).
    pub dir: String,
    /// The data ledger once the job finished.
    pub ledger: Option<LedgerSummary>,
    /// Why it failed or was cancelled; empty otherwise.
    pub message: String,
    /// What its workers run: the job file's `[worker]` command, or `edl-worker`.
    pub runs: String,
}

/// A worker slot (a GPU, or a CPU stand-in) and who holds it.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SlotRecord {
    /// Its name.
    pub name: String,
    /// The host it is on.
    pub host: String,
    /// The job and worker holding it.
    pub holder: Option<(String, String)>,
}

/// A request to the scheduler.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum SchedRequest {
    /// Submits a job.
    Submit(Submission),
    /// Every job.
    List,
    /// One job.
    Show {
        /// Its name.
        job: String,
    },
    /// Cancels a job (its owner, or an operator): its processes are stopped.
    Cancel {
        /// Its name.
        job: String,
    },
    /// Every slot.
    Slots,
}

/// The scheduler's answer.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum SchedResponse {
    /// One job (submitted, shown or cancelled).
    Job(Box<JobRecord>),
    /// Jobs.
    Jobs(Vec<JobRecord>),
    /// Slots.
    Slots(Vec<SlotRecord>),
}
