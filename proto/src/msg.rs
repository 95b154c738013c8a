//! Request and response headers. Tensor data never travels inside a header: it follows the
//! header as a raw little-endian f32 payload, described by the header's [`ChunkRef`] list.

use crate::ids::{Clock, Key, MapEpoch, ShardId, Token, WorkerId};
use crate::job::{JobConfig, ShardMap};

/// One chunk in a tensor payload: `len` values of `key`, in list order, and how they travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ChunkRef {
    /// The key.
    pub key: Key,
    /// Number of values (the chunk's floats).
    pub len: u32,
    /// The precision its values travel at.
    pub wire: crate::Wire,
    /// The payload holds a sparse record for it ([`crate::sparse`]): only some of its values,
    /// with their positions; the others are zero. Pushes only.
    pub sparse: bool,
}

impl ChunkRef {
    /// `len` values of `key` at f32, dense.
    pub const fn new(key: Key, len: u32) -> ChunkRef {
        ChunkRef {
            key,
            len,
            wire: crate::Wire::F32,
            sparse: false,
        }
    }

    /// The chunk travelling at `wire`, sparse or dense.
    pub const fn coded(self, wire: crate::Wire, sparse: bool) -> ChunkRef {
        ChunkRef {
            wire,
            sparse,
            ..self
        }
    }

    /// Whether its values travel as f32, dense (as shards hold them).
    pub fn is_plain(&self) -> bool {
        self.wire == crate::Wire::F32 && !self.sparse
    }
}

/// A half-open key range `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct KeyRange {
    /// First key.
    pub start: u64,
    /// One past the last key.
    pub end: u64,
}

impl KeyRange {
    /// The fewest ranges that cover exactly `keys` (in any order, repeats allowed), sorted.
    /// Key `u64::MAX` cannot be in a half-open range and is left out (no job has that many
    /// keys).
    pub fn runs(keys: impl Iterator<Item = u64>) -> Vec<KeyRange> {
        let mut keys: Vec<u64> = keys.filter(|&k| k < u64::MAX).collect();
        keys.sort_unstable();
        keys.dedup();
        let mut out: Vec<KeyRange> = Vec::new();
        for k in keys {
            match out.last_mut() {
                Some(r) if r.end == k => r.end = k + 1,
                _ => out.push(KeyRange {
                    start: k,
                    end: k + 1,
                }),
            }
        }
        out
    }
}

/// A slice of one epoch's sample order leased to a worker: positions `[start, start + len)` of
/// the epoch's permutation (derived from the job seed and the epoch number).
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Partition {
    /// The epoch, counted from 0.
    pub epoch: u32,
    /// The partition's index within its epoch.
    pub index: u32,
    /// First position in the epoch's permutation.
    pub start: u32,
    /// Number of samples.
    pub len: u32,
}

/// The samples a push used: positions `[start, end)` of epoch `epoch`'s sample order, inside
/// partition `partition`. Shards use it to apply each sample's gradient exactly once; the
/// coordinator uses it to commit the worker's data progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct DataSpan {
    /// The epoch, counted from 0.
    pub epoch: u32,
    /// The partition's index within its epoch.
    pub partition: u32,
    /// First position.
    pub start: u32,
    /// One past the last position.
    pub end: u32,
}

impl DataSpan {
    /// Number of samples.
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// True when the span holds no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One shard's account of an epoch: how often each sample's gradient was applied there.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EpochLedger {
    /// The epoch, counted from 0.
    pub epoch: u32,
    /// Samples applied at least once.
    pub applied: u64,
    /// Samples applied more than once (each counted once).
    pub duplicates: u64,
    /// Samples never applied.
    pub missing: u64,
    /// Pushes refused as already applied (a re-issued span that this shard had applied).
    pub skipped_pushes: u64,
}

/// Training progress of one epoch, as reported by workers.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EpochStats {
    /// The epoch, counted from 0.
    pub epoch: u32,
    /// Samples whose gradients were pushed.
    pub samples: u64,
    /// Sum of per-sample training losses.
    pub loss_sum: f64,
    /// Payload bytes the workers pushed (gradients) for this epoch's steps, as they reported
    /// them with their steps.
    pub bytes_pushed: u64,
    /// Payload bytes the workers pulled (parameters) for this epoch's steps, likewise.
    pub bytes_pulled: u64,
}

/// Where a worker stands in its life cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum WorkerState {
    /// Registered and counted by the consistency model.
    Active,
    /// Left gracefully.
    Left,
    /// Declared dead: its lease expired, its socket was found gone, or it was dropped for
    /// holding the others up (the event's detail says which).
    Dead,
}

/// What happened to a worker, for the event trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum EventKind {
    /// Admitted to the job.
    Join,
    /// Asked by an operator to leave after its current step.
    Drain,
    /// Left gracefully.
    Leave,
    /// Declared dead: its lease expired, its socket was found gone, or it was dropped for
    /// holding the others up (the event's detail says which).
    Dead,
    /// Flagged as a straggler (its step time against the others' passed the factor).
    Straggler,
    /// No longer a straggler.
    Recovered,
    /// Given a preemption notice.
    Preempt,
    /// A replacement for it was requested from the placer.
    ReplaceRequested,
    /// It holds the minimum clock that others wait on (SSP, BSP) and has not finished a step
    /// for longer than the job allows (idle, or stuck in its own code).
    Stalled,
}

/// One membership event.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EventRecord {
    /// Milliseconds since the coordinator started.
    pub t_ms: u64,
    /// For a join: when the admission request arrived (otherwise equal to `t_ms`).
    pub requested_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// To whom.
    pub worker: WorkerId,
    /// The worker's name.
    pub name: String,
    /// Why, where the event is a decision: a straggler's and the others' step times, how a
    /// death was found, what a stalled worker holds up (empty otherwise).
    pub detail: String,
}

/// One completed step: when the coordinator received a worker's clock report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct StepRecord {
    /// Milliseconds since the coordinator started.
    pub t_ms: u64,
    /// The worker.
    pub worker: WorkerId,
    /// Its clock after the step.
    pub clock: Clock,
}

/// The job's membership events and step times, from which a run computes what each event
/// cost the other workers. Served in pages of steps: each answer carries every event and
/// move kept, and the steps from the one asked for.
#[derive(Clone, Debug, Default, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct JobTrace {
    /// Membership events in time order (the oldest are dropped past a cap).
    pub events: Vec<EventRecord>,
    /// Steps in time order (the oldest are dropped past a cap).
    pub steps: Vec<StepRecord>,
    /// Key-range moves in time order (the oldest are dropped past a cap).
    pub moves: Vec<MoveReport>,
    /// The sequence number of `steps[0]` (steps are numbered from 0 in arrival order).
    pub first_step: u64,
    /// The sequence number to ask for next; `more` says whether steps remain after this page.
    pub next_step: u64,
    /// More steps follow this page.
    pub more: bool,
    /// Records dropped by the caps so far: events, steps, moves.
    pub dropped: (u64, u64, u64),
}

/// One key-range move between shards (online resharding).
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct MoveReport {
    /// Milliseconds since the coordinator started, when the move began.
    pub t_ms: u64,
    /// First key.
    pub start: u64,
    /// One past the last key.
    pub end: u64,
    /// The shard that held the range.
    pub from: ShardId,
    /// The shard that holds it now.
    pub to: ShardId,
    /// The map epoch the move published.
    pub epoch: MapEpoch,
    /// Bytes of state streamed (parameters, optimizer state, staged steps, data ledger).
    pub bytes: u64,
    /// Milliseconds from the start of the move to its publication.
    pub millis: f64,
    /// Milliseconds during which the range could be neither read nor written: from the
    /// source giving it up to the destination holding it.
    pub hold_ms: f64,
}

/// Where a shard server stands in the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ShardRole {
    /// Holds key ranges in the current map.
    Active,
    /// Joined, holds nothing yet (`edlctl shard add` gives it ranges).
    Standby,
    /// Removed from the job (`edlctl shard remove`).
    Retired,
}

/// A shard server the coordinator knows.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShardEntry {
    /// Its id.
    pub id: ShardId,
    /// The name in its certificate.
    pub name: String,
    /// Its address.
    pub addr: String,
    /// Where it stands.
    pub role: ShardRole,
}

/// How much traffic one key drew since the last rebalance (floats pulled plus pushed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct KeyLoad {
    /// The key.
    pub key: Key,
    /// Floats read and written.
    pub load: u64,
}

/// One worker as the coordinator sees it.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WorkerStatus {
    /// Its id.
    pub id: WorkerId,
    /// The name it registered with.
    pub name: String,
    /// Its state.
    pub state: WorkerState,
    /// Steps completed.
    pub clock: Clock,
    /// Milliseconds since its last heartbeat or request.
    pub idle_ms: u64,
    /// Asked to leave after its current step.
    pub draining: bool,
}

/// One worker in detail, for operators.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WorkerInfo {
    /// Its id.
    pub id: WorkerId,
    /// The name in its certificate.
    pub name: String,
    /// The address it registered from.
    pub addr: String,
    /// Its state.
    pub state: WorkerState,
    /// Steps completed.
    pub clock: Clock,
    /// Milliseconds since its last heartbeat or request.
    pub idle_ms: u64,
    /// Asked to leave after its current step.
    pub draining: bool,
    /// Steps per second over the last ten seconds.
    pub steps_per_s: f64,
    /// Samples it committed.
    pub samples: u64,
    /// Median busy time of its recent steps in milliseconds (from the grant of one step to
    /// the report of the next: its own work, not the consistency wait); 0 before any.
    pub step_ms: f64,
    /// The median of the other judged workers' median step times over the same window, in
    /// milliseconds (0 while unknown): what its own is compared against.
    pub others_ms: f64,
    /// Its median step time over the median of the other workers' (0 while unknown).
    pub straggler_score: f64,
    /// Flagged as a straggler.
    pub straggler: bool,
    /// Where the straggler detector stands on it.
    pub judged: Judgement,
    /// Milliseconds it has held the minimum clock others wait on without finishing a step,
    /// once that is past the job's stall report time.
    pub stalled_ms: Option<u64>,
    /// Steps behind the most advanced counting worker (what its gradients lag under ASP).
    pub staleness: u64,
    /// Milliseconds left of a preemption notice, if it got one.
    pub notice_ms: Option<u64>,
    /// The placement it was started for, if any.
    pub placement: Option<u64>,
}

/// Where the straggler detector stands on a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Judgement {
    /// Within its warm-up after admission, or without enough steps in the window yet.
    Warming,
    /// Judged, and not slow.
    Ok,
    /// Judged slow, not yet for long enough to be flagged.
    Suspect,
    /// Flagged as a straggler.
    Flagged,
    /// Not training (left, dead, waiting for data, or no other worker to compare with).
    Unjudged,
}

impl std::fmt::Display for Judgement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Warming => "warming",
            Self::Ok => "ok",
            Self::Suspect => "suspect",
            Self::Flagged => "straggler",
            Self::Unjudged => "-",
        })
    }
}

/// One shard's holdings and load, for operators.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShardStats {
    /// Its id.
    pub shard: ShardId,
    /// The key ranges it holds.
    pub ranges: Vec<KeyRange>,
    /// Keys held.
    pub keys: u64,
    /// Parameter floats held.
    pub floats: u64,
    /// Bytes of parameters and optimizer state.
    pub state_bytes: u64,
    /// Pushes applied or staged.
    pub pushes: u64,
    /// Pulls served.
    pub pulls: u64,
    /// Payload bytes received.
    pub bytes_in: u64,
    /// Payload bytes sent.
    pub bytes_out: u64,
    /// Replicated jobs: the key ranges it holds backup copies of.
    pub backups: Vec<KeyRange>,
    /// Replicated jobs: forwards of pushes to its backups (one per push and backup) not
    /// acknowledged yet (how far they lag; the pushes wait for them).
    pub lag: u64,
}

/// One evaluation of the model on held-out data, reported by an evaluator.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EvalRecord {
    /// Milliseconds since the coordinator started, when the report arrived.
    pub t_ms: u64,
    /// The name in the evaluator's certificate.
    pub name: String,
    /// The job's minimum clock when the parameters were pulled (the status's `min_clock`:
    /// every step through it of every worker training then was in them). The coordinator
    /// raises a lower one to the previous evaluation's, so that it never goes backwards (once
    /// no worker trains, the status's minimum is the last one seen while some did, which can
    /// be older).
    pub clock: Clock,
    /// Fraction of the samples classified right (0 to 1).
    pub accuracy: f64,
    /// Mean loss over them.
    pub loss: f64,
    /// Samples evaluated.
    pub samples: u64,
}

/// Training progress over one window of time (of [`JobHistory::bucket_ms`]).
#[derive(Clone, Copy, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HistoryPoint {
    /// The window's start, in milliseconds since the coordinator started.
    pub t_ms: u64,
    /// Samples committed in the window.
    pub samples: u64,
    /// Sum of their training losses.
    pub loss_sum: f64,
    /// Steps reported in the window.
    pub steps: u32,
    /// Active workers at the window's end.
    pub workers: u32,
}

/// The job's training history: progress per window of time and the evaluations, for plots
/// and the dashboard. Membership events and moves are in the [`JobTrace`].
#[derive(Clone, Debug, Default, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct JobHistory {
    /// The width of a window in milliseconds.
    pub bucket_ms: u64,
    /// Windows in time order, from the one asked for (windows without a step are left out;
    /// the oldest are dropped past a cap).
    pub points: Vec<HistoryPoint>,
    /// Evaluations in time order (the oldest are dropped past a cap).
    pub evaluations: Vec<EvalRecord>,
}

/// A snapshot of the job for launchers and operators.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct JobStatus {
    /// Shard servers that have joined, removed ones included (the shard list says which are
    /// active, standby or retired); the map forms when it reaches `shards_expected`.
    pub shards_joined: u32,
    /// Shard servers the job waits for before it forms its shard map.
    pub shards_expected: u32,
    /// Samples the whole run will process (epochs x train samples).
    pub samples_total: u64,
    /// Samples processed so far.
    pub samples_done: u64,
    /// Per-epoch progress.
    pub epochs: Vec<EpochStats>,
    /// All workers ever registered.
    pub workers: Vec<WorkerStatus>,
    /// The slowest training worker's clock; while no worker trains (all wait for data or
    /// have left), a floor kept from earlier, which can lag the clocks the workers reached.
    pub min_clock: Clock,
    /// True once every partition of every epoch has been completed.
    pub finished: bool,
    /// The coordinator's clock when it answered, in the trace's time base (milliseconds since
    /// it started), so that a client can place its own events on the trace.
    pub t_ms: u64,
    /// Samples per second over the last [`RECENT_MS`] milliseconds.
    pub samples_per_s: f64,
    /// Mean training loss per sample over the same window (`None` without samples in it).
    pub loss: Option<f64>,
    /// The latest evaluation, if an evaluator reported one.
    pub evaluation: Option<EvalRecord>,
}

/// The window over which [`JobStatus`] reports the recent rate and loss.
pub const RECENT_MS: u64 = 10_000;

/// A request header.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Request {
    /// The first request on every connection.
    Hello {
        /// The client's [`crate::PROTOCOL_VERSION`].
        version: u32,
        /// A human-readable name for logs.
        name: String,
    },
    /// A shard server announces itself and waits for its assignment.
    ShardJoin {
        /// The address workers should use to reach it.
        addr: String,
    },
    /// A worker asks to join; answered once the shard map is ready. It is registered under
    /// the name in its certificate; `name` is only a label for logs.
    Register {
        /// A human-readable label.
        name: String,
        /// The placement this worker was started for, if any (see [`crate::place`]): once
        /// it is admitted the placement is done, and a worker it replaces is drained.
        placement: Option<u64>,
    },
    /// Renews a worker's lease.
    Heartbeat {
        /// The worker.
        worker: WorkerId,
    },
    /// A worker leaves gracefully.
    Leave {
        /// The worker.
        worker: WorkerId,
    },
    /// A worker asks for data. Partitions complete as their spans are committed by `Clock`.
    NextPartition {
        /// The worker.
        worker: WorkerId,
    },
    /// A worker finished a step; answered when the consistency model lets it go on.
    Clock {
        /// The worker.
        worker: WorkerId,
        /// Its clock after the step.
        clock: Clock,
        /// The epoch of the step's samples.
        epoch: u32,
        /// Samples in the step.
        samples: u32,
        /// Sum of their training losses.
        loss_sum: f64,
        /// The samples of the step, now applied on every shard: commits the data progress.
        span: Option<DataSpan>,
        /// The worker leaves after this step: record it and answer at once, without waiting
        /// for the consistency model.
        last: bool,
        /// Payload bytes of the pushes the worker sent to shards since its previous report
        /// (counted per request sent: one refused and sent again under a newer map counts
        /// twice, one resent within a call after a lost connection once).
        bytes_pushed: u64,
        /// Payload bytes it pulled from shards since its previous report.
        bytes_pulled: u64,
    },
    /// Asks for a job status snapshot.
    Status,
    /// Asks for the current shard map.
    GetMap,
    /// Asks for the job configuration.
    GetJob,
    /// Gives a worker a preemption notice: it finishes its step, commits and leaves before
    /// `notice_ms` run out (abandoning the step if it cannot finish in time). An admin may
    /// give any worker one; a worker may give itself one (a spot notice it received).
    Preempt {
        /// The worker.
        worker: WorkerId,
        /// Milliseconds until the worker must be gone.
        notice_ms: u64,
    },
    /// An operator moves a worker: a placer starts a new one (in `slot`, if given), and once
    /// it is admitted the old one is drained.
    Migrate {
        /// The worker to move.
        worker: WorkerId,
        /// Where the new worker should run, in the placer's slot names.
        slot: Option<String>,
    },
    /// An operator resizes the job to `workers` active workers: placements for the missing
    /// ones, drains (newest first) for the extra ones; 0 suspends the job (every worker
    /// drains, the servers keep its state).
    Scale {
        /// The worker count wanted.
        workers: u32,
    },
    /// Reads the placement requests (a placer polls them).
    Placements,
    /// A placer could not start a worker for a placement.
    PlacementFailed {
        /// The placement.
        id: u64,
        /// Why.
        reason: String,
    },
    /// Reads the straggler and stall settings, replacing them first when `set` is given.
    Stragglers {
        /// The new settings (checked by the coordinator).
        set: Option<crate::place::StragglerSettings>,
    },
    /// Reads parameters. The payload of the response holds the chunks in `Pulled` order.
    Pull {
        /// The shard-map epoch the client routed with.
        epoch: MapEpoch,
        /// The key ranges wanted from this shard.
        ranges: Vec<KeyRange>,
        /// BSP: apply every pending aggregated update of steps before this clock first.
        apply_through: Clock,
        /// The precision the answer's values travel at: every chunk at this one, or with
        /// `None` each at its tensor's ([`crate::JobConfig::wire_of`]).
        wire: Option<crate::Wire>,
    },
    /// Sends gradients; the request payload holds the chunks in `chunks` order.
    Push {
        /// The shard-map epoch the client routed with.
        epoch: MapEpoch,
        /// The pushing worker.
        worker: WorkerId,
        /// The step these gradients belong to (the clock before the step completed).
        clock: Clock,
        /// The chunks in the payload, each saying how its values travel: a shard refuses a
        /// value that is not finite in its precision, and applies the values as f32.
        chunks: Vec<ChunkRef>,
        /// The samples the gradients came from; a span this shard already applied is skipped.
        span: Option<DataSpan>,
        /// A sparse push's further keys: their gradient is zero (nothing of them travels) but
        /// the span counts for them too, so that the span is recorded for every key the
        /// worker's map places here. Every key in these ranges must be held by the shard.
        covers: Vec<KeyRange>,
        /// The token the coordinator issued to `worker` at registration, bound to the name
        /// in the sender's certificate: a shard refuses a push without a valid one.
        token: Token,
    },
    /// Asks a shard for its per-epoch data ledger.
    Ledger,
    /// An operator asks a worker to leave gracefully after its current step.
    Drain {
        /// The worker.
        worker: WorkerId,
    },
    /// Asks the coordinator for its event trace, with the steps from sequence number
    /// `from_step` on (one page).
    Trace {
        /// The first step wanted.
        from_step: u64,
    },
    /// Asks the coordinator for every worker in detail.
    Members,
    /// Asks a shard for its holdings and load.
    ShardStats,
    /// Asks a shard to write a checkpoint now.
    Checkpoint,
    /// The coordinator tells a shard the current map (a shard that is no longer in it and
    /// holds nothing retires).
    SetMap {
        /// The map.
        map: ShardMap,
        /// The shard was removed from the job: once it holds nothing, it stops.
        retire: bool,
        /// The sending coordinator's term (see [`Request::MoveOut`]'s).
        term: u64,
    },
    /// The coordinator asks a shard to hand keys `[start, end)` to shard `to`; `map` is the
    /// map after the move.
    MoveOut {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
        /// The receiving shard.
        to: ShardId,
        /// The map after the move.
        map: ShardMap,
        /// The sending coordinator's term: its lead's number, increasing from leader to leader
        /// (0 for a coordinator with no election). A shard refuses orders of a term below the
        /// highest it has seen ([`crate::ErrorCode::Deposed`]).
        term: u64,
    },
    /// A shard hands keys `[start, end)` to another: the payload is the range's state (an
    /// rkyv-encoded export: parameters, optimizer state, staged steps, data ledger).
    MoveIn {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
        /// The map after the move.
        map: ShardMap,
    },
    /// Asks a shard for its per-key load since the last rebalance.
    KeyLoads,
    /// Every shard server the coordinator knows, with its role.
    ShardList,
    /// An operator adds the (joined, standby) shard at `addr` and rebalances onto it.
    ShardAdd {
        /// The shard's advertised address, or its id as `sN`.
        addr: String,
    },
    /// An operator removes a shard: its ranges move to the others, then it retires.
    ShardRemove {
        /// The shard's name (as given with `--name`), or its address.
        shard: String,
    },
    /// An operator rebalances the key ranges over the active shards.
    Reshard {
        /// Balance by recent load instead of by size.
        by_load: bool,
    },
    /// An operator moves keys `[start, end)` to shard `to`.
    MoveRange {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
        /// The receiving shard's name (as given with `--name`), or its address.
        to: String,
    },
    /// A request to the cluster scheduler (`edl-sched`); job servers refuse it.
    Sched(crate::sched::SchedRequest),
    /// An evaluator reports the model's quality on held-out data.
    Evaluation {
        /// The job's minimum clock when the evaluated parameters were pulled (see
        /// [`EvalRecord::clock`]).
        clock: Clock,
        /// Fraction classified right (0 to 1).
        accuracy: f64,
        /// Mean loss.
        loss: f64,
        /// Samples evaluated.
        samples: u64,
    },
    /// Asks the coordinator for its training history from `from_ms` on.
    History {
        /// The first window wanted (milliseconds since the coordinator started).
        from_ms: u64,
    },
    /// A primary hands a push it took to a backup of its keys (replicated jobs): the same
    /// gradients (the payload, in `chunks` order), span and covered ranges, applied to the
    /// backup's copies through its own ledger. The primary acknowledges the worker only once
    /// every backup of the keys acknowledged this.
    Replicate {
        /// The primary's map epoch when it forwarded.
        epoch: MapEpoch,
        /// The pushing worker.
        worker: WorkerId,
        /// The push's step.
        clock: Clock,
        /// The chunks in the payload (the ones this backup holds copies of).
        chunks: Vec<ChunkRef>,
        /// The push's samples.
        span: Option<DataSpan>,
        /// The push's covered ranges this backup holds copies of.
        covers: Vec<KeyRange>,
        /// The primary is seeding this backup with the keys (`CopyIn`): one that does not
        /// hold them yet keeps the push until the copy arrives, and acknowledges it at once.
        seeding: bool,
    },
    /// A long poll for the shard map: answered with `Map` once the coordinator's map is newer
    /// than `after` (or with the current one when the poll times out).
    WaitMap {
        /// The epoch the asker routes with.
        after: MapEpoch,
    },
    /// The coordinator asks the primary of keys `[start, end)` to seed a new backup of them on
    /// shard `to`; `map` is the map that lists it (answered with `Moved`).
    CopyOut {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
        /// The new backup.
        to: ShardId,
        /// The map with the new backup.
        map: ShardMap,
        /// The sending coordinator's term (see [`Request::MoveOut`]'s).
        term: u64,
    },
    /// A primary tells the coordinator that it has not reached its backup `backup` for a
    /// while (their link is cut, or the backup is stuck): the coordinator drops `backup` as
    /// the backup of every range the sender is the primary of, so that pushes stop waiting
    /// for it (a new backup is seeded once one can be).
    BackupLost {
        /// The backup it cannot reach.
        backup: ShardId,
    },
    /// A primary seeds a new backup of keys `[start, end)`: the payload is their state as a
    /// range export (see [`Request::MoveIn`]); the backup applies the pushes forwarded from
    /// then on over it.
    CopyIn {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
        /// The map that lists the new backup.
        map: ShardMap,
    },
}

impl Request {
    /// A short name of the request, for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Hello { .. } => "Hello",
            Self::ShardJoin { .. } => "ShardJoin",
            Self::Register { .. } => "Register",
            Self::Heartbeat { .. } => "Heartbeat",
            Self::Leave { .. } => "Leave",
            Self::NextPartition { .. } => "NextPartition",
            Self::Clock { .. } => "Clock",
            Self::Status => "Status",
            Self::GetMap => "GetMap",
            Self::GetJob => "GetJob",
            Self::Preempt { .. } => "Preempt",
            Self::Migrate { .. } => "Migrate",
            Self::Scale { .. } => "Scale",
            Self::Placements => "Placements",
            Self::PlacementFailed { .. } => "PlacementFailed",
            Self::Stragglers { .. } => "Stragglers",
            Self::Pull { .. } => "Pull",
            Self::Push { .. } => "Push",
            Self::Ledger => "Ledger",
            Self::Drain { .. } => "Drain",
            Self::Trace { .. } => "Trace",
            Self::Members => "Members",
            Self::ShardStats => "ShardStats",
            Self::Checkpoint => "Checkpoint",
            Self::SetMap { .. } => "SetMap",
            Self::MoveOut { .. } => "MoveOut",
            Self::MoveIn { .. } => "MoveIn",
            Self::KeyLoads => "KeyLoads",
            Self::ShardList => "ShardList",
            Self::ShardAdd { .. } => "ShardAdd",
            Self::ShardRemove { .. } => "ShardRemove",
            Self::Reshard { .. } => "Reshard",
            Self::MoveRange { .. } => "MoveRange",
            Self::Sched(_) => "Sched",
            Self::Evaluation { .. } => "Evaluation",
            Self::History { .. } => "History",
            Self::Replicate { .. } => "Replicate",
            Self::WaitMap { .. } => "WaitMap",
            Self::CopyOut { .. } => "CopyOut",
            Self::CopyIn { .. } => "CopyIn",
            Self::BackupLost { .. } => "BackupLost",
        }
    }
}

/// A response header.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Response {
    /// Handshake accepted.
    Hello {
        /// The server's protocol version.
        version: u32,
        /// The role the server read from the client's certificate.
        role: String,
    },
    /// This coordinator stands by (another one of the job leads, elected through the job's
    /// metadata store): ask the leader, at `leader` if known (unknown during an election).
    NotLeader {
        /// The leader's address, as it advertises it.
        leader: Option<String>,
    },
    /// Done, nothing to report.
    Ack,
    /// A heartbeat's answer: whether the worker is asked to leave, and by when.
    Beat {
        /// Leave after the current step.
        drain: bool,
        /// A preemption notice: milliseconds left until the worker must be gone.
        notice_ms: Option<u64>,
    },
    /// The placement requests, oldest first (pending ones and the latest finished ones).
    Placements(Vec<crate::place::Placement>),
    /// A placement made.
    Placed(crate::place::Placement),
    /// What a resize did.
    Scaled(crate::place::Resize),
    /// The straggler settings now in force.
    Stragglers(crate::place::StragglerSettings),
    /// A shard's assignment.
    ShardAssigned {
        /// Its id.
        shard: ShardId,
        /// The job.
        job: JobConfig,
        /// The shard map.
        map: ShardMap,
        /// The key with which the coordinator signs worker tokens, so that the shard can
        /// check that a push comes from the worker it names.
        token_key: Token,
    },
    /// A worker's admission.
    Registered {
        /// Its id.
        worker: WorkerId,
        /// The job.
        job: JobConfig,
        /// The shard map.
        map: ShardMap,
        /// The clock it enters at (the current minimum).
        clock: Clock,
        /// Proof, for the shards, that this worker id belongs to the caller's certificate:
        /// every push carries it.
        token: Token,
    },
    /// The next partition, or `None` when no data is left.
    Partition {
        /// The partition.
        partition: Option<Partition>,
        /// The worker's clock from here on. A worker that waited for data did not count in the
        /// consistency model meanwhile; it re-enters at the current minimum clock, like a join.
        clock: Clock,
    },
    /// The worker may start its next step.
    ClockGranted {
        /// The slowest active worker's clock.
        min_clock: Clock,
        /// The worker is asked to leave now (an operator drained it).
        drain: bool,
    },
    /// The event trace.
    Trace(JobTrace),
    /// Every worker in detail.
    Members(Vec<WorkerInfo>),
    /// A shard's holdings and load.
    ShardStats(ShardStats),
    /// A checkpoint was written.
    Checkpointed {
        /// Its path on the shard's machine.
        path: String,
        /// Bytes written.
        bytes: u64,
        /// Milliseconds spent (copying the state, writing and syncing).
        millis: f64,
    },
    /// A status snapshot.
    Status(JobStatus),
    /// The current shard map.
    Map(ShardMap),
    /// The job configuration.
    Job(JobConfig),
    /// A shard's per-epoch data ledger.
    Ledger(Vec<EpochLedger>),
    /// Parameters; the payload holds the chunks in this order.
    Pulled {
        /// The chunks in the payload, each at the precision asked for, or at f32 where one of
        /// its parameters does not fit it (past binary16's 65,504).
        chunks: Vec<ChunkRef>,
    },
    /// A key range moved.
    Moved(MoveReport),
    /// A resharding finished: the moves made and the map epoch now current.
    Resharded {
        /// The moves, in order.
        moves: Vec<MoveReport>,
        /// The map now current.
        map: ShardMap,
    },
    /// A shard's per-key load.
    KeyLoads(Vec<KeyLoad>),
    /// Every shard server the coordinator knows.
    ShardList(Vec<ShardEntry>),
    /// The cluster scheduler's answer.
    Sched(crate::sched::SchedResponse),
    /// The training history.
    History(JobHistory),
    /// A failure, with a stable code.
    Error {
        /// An [`crate::ErrorCode`] number.
        code: u16,
        /// What went wrong, for humans.
        message: String,
        /// With [`crate::ErrorCode::StaleEpoch`]: the current map.
        map: Option<ShardMap>,
    },
}

impl Response {
    /// An error response.
    pub fn error(code: crate::ErrorCode, message: impl Into<String>) -> Self {
        Response::Error {
            code: code.as_u16(),
            message: message.into(),
            map: None,
        }
    }
}
