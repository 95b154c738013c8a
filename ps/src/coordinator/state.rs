//! The coordinator's state machine: shards, the shard map, the worker registry with leases,
//! clocks and the consistency rule, data partitions and per-epoch progress. No I/O, no async:
//! every method is a synchronous step that the service layer calls under a lock.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use edl_shared::proto::ids::{Clock, MapEpoch, ShardId, Token, WorkerId};
use edl_shared::proto::job::ShardInfo;
use edl_shared::proto::msg::{
    DataSpan, EpochStats, EvalRecord, EventKind, EventRecord, JobHistory, JobStatus, JobTrace,
    Judgement, MoveReport, Partition, StepRecord, WorkerInfo, WorkerState, WorkerStatus,
};
use edl_shared::proto::place::{Placement, StragglerSettings};
use edl_shared::proto::{ErrorCode, JobConfig, ShardMap};

use super::data::DataPlan;
use elastic::Pace;
use history::History;
pub use history::{BUCKET_MS, kind_name};

/// The outcome of one step of a long-polling request.
#[derive(Debug)]
pub enum Poll<T> {
    /// Answer now.
    Ready(T),
    /// Wait for the next state change and try again.
    Pending,
    /// Answer with an error.
    Failed(ErrorCode, String),
}

/// A worker as persisted.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WorkerSnap {
    id: WorkerId,
    name: String,
    addr: String,
    state: WorkerState,
    clock: Clock,
    leased: Vec<(Partition, u32)>,
    draining: bool,
    samples: u64,
}

/// The coordinator's durable state: what it needs to come back after a crash. The event and
/// step trace and the lease timers are not kept: restored workers get a fresh lease.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct CoordinatorSnap {
    job: JobConfig,
    shards_expected: u32,
    shards: Vec<ShardInfo>,
    shard_names: Vec<String>,
    map: Option<ShardMap>,
    issued: MapEpoch,
    pending: Option<(shards::Move, ShardMap)>,
    retired: Vec<ShardId>,
    workers: Vec<WorkerSnap>,
    next_worker: u64,
    floor: Clock,
    cursor: (u32, u32),
    returned: Vec<Partition>,
    completed: Vec<u32>,
    epochs: Vec<EpochStats>,
    samples_done: u64,
    token_key: Token,
    placements: Vec<Placement>,
    next_placement: u64,
}

impl CoordinatorSnap {
    /// Samples whose training the workers committed.
    pub fn samples_done(&self) -> u64 {
        self.samples_done
    }
}

/// An error answer: a stable code and a message.
pub type Refusal = (ErrorCode, String);

#[derive(Debug)]
struct Worker {
    name: String,
    addr: String,
    samples: u64,
    state: WorkerState,
    clock: Clock,
    last_seen: Instant,
    /// Partitions leased and not yet completed.
    leased: Vec<Lease>,
    /// Waiting for data: not counted by the consistency model until it gets a partition.
    idle: bool,
    /// Asked to leave after its current step.
    draining: bool,
    /// Restored after a coordinator restart and not heard from since: its clock and committed
    /// positions may lag what it did before the crash, so its next report may jump ahead.
    restored: bool,
    /// Its recent step times, straggler flag, preemption notice and placement.
    pace: Pace,
}

/// A partition leased to a worker, with the position up to which its samples are committed
/// (their gradients acknowledged by every shard).
#[derive(Debug, Clone, Copy)]
struct Lease {
    part: Partition,
    committed: u32,
}

impl Lease {
    fn end(&self) -> u32 {
        self.part.start + self.part.len
    }
}

impl Worker {
    fn counts(&self) -> bool {
        self.state == WorkerState::Active && !self.idle
    }
}

/// Everything the coordinator knows about a job.
#[derive(Debug)]
pub struct CoordinatorState {
    job: JobConfig,
    shards_expected: u32,
    shards: Vec<ShardInfo>,
    /// Certificate names of the shards, by index.
    shard_names: Vec<String>,
    map: Option<ShardMap>,
    /// The highest map epoch ever sent to a shard (a move's map goes out before it is
    /// published, and may never be): every new map takes a higher one.
    issued: MapEpoch,
    /// A move begun (its map sent to the source) and neither published nor given up: after a
    /// crash, or an unanswered `MoveOut`, the coordinator finds out where the range is.
    pending: Option<(shards::Move, ShardMap)>,
    /// Shards removed from the job by an operator.
    retired: Vec<ShardId>,
    workers: BTreeMap<WorkerId, Worker>,
    next_worker: u64,
    /// The minimum clock last seen while some worker was active, so that a worker joining an
    /// idle job enters where the job left off.
    floor: Clock,
    data: DataPlan,
    epochs: Vec<EpochStats>,
    samples_done: u64,
    /// The key worker tokens are signed with (see `edl_shared::token`).
    token_key: Token,
    /// Time zero of the trace.
    started: Instant,
    events: VecDeque<EventRecord>,
    steps: VecDeque<StepRecord>,
    moves: VecDeque<MoveReport>,
    /// Trace records dropped by the caps: events, steps, moves.
    dropped: (u64, u64, u64),
    /// How stragglers are found and handled.
    stragglers: StragglerSettings,
    /// Requests for a placer to start workers: pending ones and the latest finished ones.
    placements: VecDeque<Placement>,
    next_placement: u64,
    /// What the state machine decided on its own since the service layer last looked.
    news: Vec<String>,
    /// Progress over time, evaluations, event counts and live stalls.
    history: History,
    /// Reports that showed an acknowledged change missing from the state restored: a clock
    /// or a commit past the saved one, a commit of a lease unknown. Zero while every answer
    /// waits for its changes to be durable (nonzero only for a state written otherwise).
    lost_acks: u64,
}

/// What a restored worker is given on top of its lease to reach the restored coordinator: a
/// client's connection to a dead coordinator times out after 6 s (the transport's idle
/// timeout), then it reconnects with backoff.
pub const RESTORE_GRACE: Duration = Duration::from_secs(10);

/// Step records kept for the trace; older ones are dropped.
const MAX_STEP_RECORDS: usize = 1 << 20;
/// Membership events kept for the trace; older ones are dropped.
const MAX_EVENT_RECORDS: usize = 10_000;
/// Range moves kept for the trace; older ones are dropped.
const MAX_MOVE_RECORDS: usize = 1_000;
/// Steps in one page of the trace (24 bytes each: well under the header limit with the
/// events and moves).
pub const TRACE_PAGE: usize = 65_536;
/// Departed (left or dead) workers kept in the registry; older ones are forgotten.
const MAX_DEPARTED: usize = 10_000;

/// Appends `item` to a capped record queue, dropping (and counting) the oldest past `cap`.
fn push_capped<T>(q: &mut VecDeque<T>, item: T, cap: usize, dropped: &mut u64) {
    while q.len() >= cap {
        q.pop_front();
        *dropped += 1;
    }
    q.push_back(item);
}

fn unknown(worker: WorkerId) -> Refusal {
    (
        ErrorCode::UnknownWorker,
        format!("worker {worker} is not registered (dropped or left); register again"),
    )
}

impl CoordinatorState {
    /// A job waiting for `shards` shard servers, started at `now` (the state machine never
    /// reads a clock: every time it knows comes from its caller).
    pub fn new(job: JobConfig, shards: u32, now: Instant) -> Self {
        let data = DataPlan::new(job.epochs, job.train_samples, job.partition_size);
        let epochs = (0..job.epochs)
            .map(|epoch| EpochStats {
                epoch,
                samples: 0,
                loss_sum: 0.0,
                bytes_pushed: 0,
                bytes_pulled: 0,
            })
            .collect();
        CoordinatorState {
            job,
            shards_expected: shards.max(1),
            shards: Vec::new(),
            shard_names: Vec::new(),
            map: None,
            issued: MapEpoch(0),
            pending: None,
            retired: Vec::new(),
            workers: BTreeMap::new(),
            next_worker: 1,
            floor: Clock(0),
            data,
            epochs,
            samples_done: 0,
            token_key: edl_shared::token::new_key(),
            started: now,
            events: VecDeque::new(),
            steps: VecDeque::new(),
            moves: VecDeque::new(),
            dropped: (0, 0, 0),
            stragglers: StragglerSettings::default(),
            placements: VecDeque::new(),
            next_placement: 1,
            news: Vec::new(),
            history: History::default(),
            lost_acks: 0,
        }
    }

    /// Reports that showed an acknowledged change missing from the restored state (see
    /// `lost_acks`); the simulation requires zero.
    pub fn lost_acks(&self) -> u64 {
        self.lost_acks
    }

    /// Counts an acknowledged change found missing, and says so.
    fn lost_ack(&mut self, what: String) {
        self.lost_acks += 1;
        self.news.push(format!(
            "{what}: an acknowledged change is missing from the restored state"
        ));
    }

    /// The key worker tokens are signed with.
    pub fn token_key(&self) -> Token {
        self.token_key
    }

    /// Refuses a request about `worker` from a certificate other than the one it registered
    /// with. Unknown workers pass: the request itself then answers `UnknownWorker`.
    pub fn check_owner(&self, worker: WorkerId, identity: &str) -> Result<(), Refusal> {
        match self.workers.get(&worker) {
            Some(w) if w.name != identity => Err((
                ErrorCode::IdentityMismatch,
                format!("{worker} belongs to another identity; {identity:?} may not act for it"),
            )),
            _ => Ok(()),
        }
    }

    /// The durable part of the state.
    pub fn snapshot(&self) -> CoordinatorSnap {
        let (cursor, returned, completed) = self.data.snapshot();
        CoordinatorSnap {
            job: self.job.clone(),
            shards_expected: self.shards_expected,
            shards: self.shards.clone(),
            shard_names: self.shard_names.clone(),
            map: self.map.clone(),
            issued: self.issued,
            pending: self.pending.clone(),
            retired: self.retired.clone(),
            workers: self
                .workers
                .iter()
                .map(|(id, w)| WorkerSnap {
                    id: *id,
                    name: w.name.clone(),
                    addr: w.addr.clone(),
                    state: w.state,
                    clock: w.clock,
                    leased: w.leased.iter().map(|l| (l.part, l.committed)).collect(),
                    draining: w.draining,
                    samples: w.samples,
                })
                .collect(),
            next_worker: self.next_worker,
            floor: self.floor,
            cursor,
            returned,
            completed,
            epochs: self.epochs.clone(),
            samples_done: self.samples_done,
            token_key: self.token_key,
            placements: self.placements.iter().cloned().collect(),
            next_placement: self.next_placement,
        }
    }

    /// The state saved in `snap`, for the job `job` (they must be the same job). Active
    /// workers get a fresh lease from `now` plus [`RESTORE_GRACE`]: those that do not come
    /// back are dropped by it.
    pub fn restore(
        snap: CoordinatorSnap,
        job: &JobConfig,
        shards: u32,
        now: Instant,
    ) -> Result<Self, String> {
        if snap.job != *job || snap.shards_expected != shards.max(1) {
            return Err(
                "the saved state belongs to another job configuration; use another state directory"
                    .into(),
            );
        }
        let data = DataPlan::restore(
            job.epochs,
            job.train_samples,
            job.partition_size,
            snap.cursor,
            snap.returned,
            snap.completed,
        )?;
        let mut st = CoordinatorState::new(snap.job, snap.shards_expected, now);
        st.shards = snap.shards;
        st.shard_names = snap.shard_names;
        st.map = snap.map;
        st.issued = snap.issued;
        st.pending = snap.pending;
        st.retired = snap.retired;
        st.next_worker = snap.next_worker;
        st.floor = snap.floor;
        st.data = data;
        st.epochs = snap.epochs;
        st.samples_done = snap.samples_done;
        st.token_key = snap.token_key;
        st.placements = snap.placements.into();
        st.next_placement = snap.next_placement;
        for w in snap.workers {
            st.workers.insert(
                w.id,
                Worker {
                    name: w.name,
                    addr: w.addr,
                    samples: w.samples,
                    state: w.state,
                    clock: w.clock,
                    // Their lease runs from the restore, after a grace: a worker learns that
                    // its coordinator is gone only when its connection times out, and then
                    // finds the new one (the restarted process, or the standby that took the
                    // lead).
                    last_seen: now + RESTORE_GRACE,
                    leased: w
                        .leased
                        .into_iter()
                        .map(|(part, committed)| Lease { part, committed })
                        .collect(),
                    idle: false,
                    draining: w.draining,
                    restored: true,
                    pace: Pace {
                        busy_since: None,
                        ..Pace::admitted(
                            now,
                            Duration::from_millis(u64::from(st.stragglers.warmup_ms)),
                        )
                    },
                },
            );
        }
        Ok(st)
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.started).as_millis() as u64
    }

    /// Records an event at `now`, caused by what happened at `requested`.
    fn event(&mut self, kind: EventKind, worker: WorkerId, requested: Instant, now: Instant) {
        self.event_with(kind, worker, (requested, now), String::new());
    }

    /// Records an event with the evidence for it: `(requested, now)` as for
    /// [`CoordinatorState::event`].
    fn event_with(
        &mut self,
        kind: EventKind,
        worker: WorkerId,
        (requested, now): (Instant, Instant),
        detail: String,
    ) {
        let name = self
            .workers
            .get(&worker)
            .map(|w| w.name.clone())
            .unwrap_or_default();
        let others = self.workers.iter().map(|(id, w)| (*id, w.state));
        self.history.event(self.ms(now), kind, worker, others);
        let record = EventRecord {
            t_ms: self.ms(now),
            requested_ms: self.ms(requested.min(now)),
            kind,
            worker,
            name,
            detail,
        };
        push_capped(
            &mut self.events,
            record,
            MAX_EVENT_RECORDS,
            &mut self.dropped.0,
        );
    }

    /// The membership events and moves kept, and one page of step times: those numbered
    /// `from_step` on (steps are numbered in arrival order from 0; dropped ones are gone).
    pub fn trace(&self, from_step: u64) -> JobTrace {
        let first_kept = self.dropped.1;
        let first = from_step.max(first_kept);
        let skip = usize::try_from(first - first_kept).unwrap_or(usize::MAX);
        let steps: Vec<StepRecord> = self
            .steps
            .iter()
            .skip(skip)
            .take(TRACE_PAGE)
            .copied()
            .collect();
        let next_step = first + steps.len() as u64;
        JobTrace {
            events: self.events.iter().cloned().collect(),
            more: next_step < first_kept + self.steps.len() as u64,
            first_step: first,
            next_step,
            steps,
            moves: self.moves.iter().cloned().collect(),
            dropped: self.dropped,
        }
    }

    /// Asks a worker to leave after its current step. A worker waiting for data leaves at once.
    pub fn drain(&mut self, worker: WorkerId, now: Instant) -> Result<(), Refusal> {
        let w = self.active(worker)?;
        if !w.draining {
            w.draining = true;
            self.event(EventKind::Drain, worker, now, now);
        }
        Ok(())
    }

    /// The job configuration.
    pub fn job(&self) -> &JobConfig {
        &self.job
    }

    /// The shard map, once formed.
    pub fn map(&self) -> Option<ShardMap> {
        self.map.clone()
    }

    /// The index in `shards` of the shard named `name`, if one with that name has joined.
    fn shard_index(&self, name: &str) -> Option<usize> {
        self.shard_names.iter().position(|n| n == name)
    }

    /// The address of the shard named `name`, if one with that name has joined.
    pub fn shard_addr_by_name(&self, name: &str) -> Option<String> {
        Some(self.shards[self.shard_index(name)?].addr.clone())
    }

    /// Shard servers joined, and how many the job waits for before forming the map.
    pub fn shards_joined(&self) -> (u32, u32) {
        (self.shards.len() as u32, self.shards_expected)
    }

    /// A shard announces itself. A shard that rejoins under the same certificate name (after
    /// a restart) keeps its id and ranges; if its address changed, the map's address is
    /// updated (ownership did not change, so the map epoch stays). The service layer refuses
    /// a rejoin from another address while the shard at the old one still answers. A new
    /// shard gets the id its name asks for (see `new_shard_id`); one that joins once the map
    /// is formed stands by, holding nothing, until an operator adds it (`edlctl shard add`).
    pub fn shard_join(&mut self, name: &str, addr: &str) -> Result<ShardId, Refusal> {
        if let Some(i) = self.shard_index(name) {
            let id = self.shards[i].id;
            if self.shards[i].addr != addr {
                self.shards[i].addr = addr.to_string();
                if let Some(map) = &mut self.map {
                    for s in map.shards.iter_mut().filter(|s| s.id == id) {
                        s.addr = addr.to_string();
                    }
                }
            }
            return Ok(id);
        }
        let id = self.new_shard_id(name);
        self.shard_names.push(name.to_string());
        self.shards.push(ShardInfo {
            id,
            addr: addr.to_string(),
        });
        if self.map.is_none() && self.shards.len() as u32 == self.shards_expected {
            // In id order, so that the first layout does not depend on which shard joined
            // first (s0 holds the first keys).
            let mut shards = self.shards.clone();
            shards.sort_by_key(|s| s.id);
            self.map = Some(ShardMap::replicated(
                MapEpoch(1),
                shards,
                &self.job.layout(),
                self.job.replicas,
            ));
        }
        Ok(id)
    }

    /// A joined shard's assignment, once all shards have joined.
    pub fn assignment(&self, _shard: ShardId) -> Poll<(JobConfig, ShardMap)> {
        match &self.map {
            Some(map) => Poll::Ready((self.job.clone(), map.clone())),
            None => Poll::Pending,
        }
    }

    fn min_active_clock(&self) -> Option<Clock> {
        self.workers
            .values()
            .filter(|w| w.counts())
            .map(|w| w.clock)
            .min()
    }

    /// Admits a worker once the shard map exists. It enters at the current minimum clock.
    /// `requested` is when the admission request arrived, for the join latency.
    pub fn register(
        &mut self,
        name: &str,
        addr: &str,
        requested: Instant,
        now: Instant,
    ) -> Poll<(WorkerId, JobConfig, ShardMap, Clock)> {
        let Some(map) = self.map.clone() else {
            return Poll::Pending;
        };
        let id = WorkerId(self.next_worker);
        self.next_worker += 1;
        let clock = self.min_active_clock().unwrap_or(self.floor);
        self.workers.insert(
            id,
            Worker {
                name: name.to_string(),
                addr: addr.to_string(),
                samples: 0,
                state: WorkerState::Active,
                clock,
                last_seen: now,
                leased: Vec::new(),
                idle: false,
                draining: false,
                restored: false,
                pace: Pace::admitted(
                    now,
                    Duration::from_millis(u64::from(self.stragglers.warmup_ms)),
                ),
            },
        );
        self.event(EventKind::Join, id, requested, now);
        Poll::Ready((id, self.job.clone(), map, clock))
    }

    fn active(&mut self, worker: WorkerId) -> Result<&mut Worker, Refusal> {
        match self.workers.get_mut(&worker) {
            Some(w) if w.state == WorkerState::Active => Ok(w),
            _ => Err(unknown(worker)),
        }
    }

    /// Renews a worker's lease.
    pub fn heartbeat(&mut self, worker: WorkerId, now: Instant) -> Result<(), Refusal> {
        self.beat(worker, now).map(|_| ())
    }

    /// Forgets the oldest departed workers past [`MAX_DEPARTED`]: they hold no data and no
    /// clock, and a request naming one is answered `UnknownWorker` as for a departed one.
    fn prune_departed(&mut self) {
        let departed: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| w.state != WorkerState::Active)
            .map(|(id, _)| *id)
            .collect();
        let excess = departed.len().saturating_sub(MAX_DEPARTED);
        for id in departed.into_iter().take(excess) {
            self.workers.remove(&id);
        }
    }

    fn retire(&mut self, worker: WorkerId, state: WorkerState) {
        if let Some(min) = self.min_active_clock() {
            self.floor = self.floor.max(min);
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.state = state;
            // The uncommitted rest of each lease goes back to the pool, starting exactly where
            // the committed samples end. Shards skip spans they already applied, so a push that
            // reached some shards before the worker died is not applied twice there.
            for l in std::mem::take(&mut w.leased) {
                self.data.give_back(Partition {
                    start: l.committed,
                    len: l.end() - l.committed,
                    ..l.part
                });
            }
        }
    }

    /// A worker leaves gracefully; its unfinished partitions return to the pool.
    pub fn leave(&mut self, worker: WorkerId, now: Instant) -> Result<(), Refusal> {
        self.active(worker)?;
        self.retire(worker, WorkerState::Left);
        self.event(EventKind::Leave, worker, now, now);
        self.prune_departed();
        Ok(())
    }

    /// Starts every active worker's lease again from `now` (where it runs out sooner);
    /// returns how many workers that is.
    pub fn renew_leases(&mut self, now: Instant) -> usize {
        let mut n = 0;
        for w in self.workers.values_mut() {
            if w.state == WorkerState::Active && w.last_seen < now {
                w.last_seen = now;
                n += 1;
            }
        }
        n
    }

    /// Declares dead every active worker silent for longer than the lease.
    pub fn expire_leases(&mut self, now: Instant) -> Vec<WorkerId> {
        let lease = Duration::from_millis(u64::from(self.job.lease_ms));
        let dead: Vec<(WorkerId, Duration)> = self
            .workers
            .iter()
            .filter(|(_, w)| w.state == WorkerState::Active)
            .map(|(id, w)| (*id, now.saturating_duration_since(w.last_seen)))
            .filter(|(_, silent)| *silent > lease)
            .collect();
        for (id, silent) in &dead {
            let detail = format!(
                "lease expired: silent for {:.1} s (lease {:.1} s)",
                silent.as_secs_f32(),
                lease.as_secs_f32()
            );
            self.declare_dead(*id, now, detail);
        }
        dead.into_iter().map(|(id, _)| id).collect()
    }

    /// Declares an active worker dead now, for the reason given: it stops counting at once
    /// and the uncommitted rest of its partitions returns to the pool. False if it was not
    /// active.
    pub fn declare_dead(&mut self, worker: WorkerId, now: Instant, detail: String) -> bool {
        if self.active(worker).is_err() {
            return false;
        }
        self.retire(worker, WorkerState::Dead);
        self.event_with(EventKind::Dead, worker, (now, now), detail);
        self.prune_departed();
        true
    }

    /// The active workers not heard from for longer than `after`, with the address each
    /// registered from: whose sockets the service layer checks for.
    pub fn silent(&self, now: Instant, after: Duration) -> Vec<(WorkerId, String)> {
        self.workers
            .iter()
            .filter(|(_, w)| {
                w.state == WorkerState::Active && now.saturating_duration_since(w.last_seen) > after
            })
            .map(|(id, w)| (*id, w.addr.clone()))
            .collect()
    }

    /// Marks a worker as waiting for data: it stops counting in the consistency model, so
    /// workers that still train never wait on one that has nothing to train on.
    pub fn set_idle(&mut self, worker: WorkerId) -> Result<(), Refusal> {
        self.active(worker)?.idle = true;
        Ok(())
    }

    /// Leases the next partition to an idle worker; `Ready(None)` once all data of all epochs is
    /// done, `Pending` while the rest is leased to others (it may come back if they fail). The
    /// worker re-enters the consistency model at the current minimum clock, as a joiner does.
    /// A worker that still holds a lease gets it again, from its committed position: asking
    /// again is idempotent.
    pub fn next_partition(
        &mut self,
        worker: WorkerId,
        now: Instant,
    ) -> Poll<(Option<Partition>, Clock)> {
        let min = self.min_active_clock();
        let finished = self.data.finished();
        let w = match self.workers.get_mut(&worker) {
            Some(w) if w.state == WorkerState::Active => w,
            _ => {
                let (code, msg) = unknown(worker);
                return Poll::Failed(code, msg);
            }
        };
        w.last_seen = now;
        if w.draining {
            return Poll::Ready((None, w.clock));
        }
        // A worker asks for data once it committed all of its partition, so a lease it still
        // holds is one whose answer it never got (the call was repeated on a new connection):
        // it gets that lease again, from where it is committed, rather than a second one
        // that would strand the first with a worker that does not know it holds it.
        let held = w
            .leased
            .iter()
            .find(|l| l.committed < l.end())
            .map(|l| Partition {
                start: l.committed,
                len: l.end() - l.committed,
                ..l.part
            });
        if let Some(p) = held.or_else(|| self.data.lease_next()) {
            if held.is_none() {
                w.leased.push(Lease {
                    part: p,
                    committed: p.start,
                });
            }
            if w.idle {
                w.idle = false;
                w.clock = w.clock.max(min.unwrap_or(self.floor));
            }
            // Waiting for data is neither work nor a stall.
            w.pace.busy_since = Some(now);
            w.pace.progressed = Some(now);
            w.pace.stalled = false;
            return Poll::Ready((Some(p), w.clock));
        }
        if finished {
            Poll::Ready((None, w.clock))
        } else {
            Poll::Pending
        }
    }

    /// A worker finished a step: records its clock and progress, and commits the step's data
    /// span. A span must continue its lease exactly where the committed samples end.
    /// `traffic` is the payload bytes (pushed, pulled) the worker reported with the step,
    /// counted once (a repeated report adds nothing).
    #[allow(clippy::too_many_arguments)]
    pub fn advance(
        &mut self,
        worker: WorkerId,
        clock: Clock,
        epoch: u32,
        samples: u32,
        loss_sum: f64,
        span: Option<DataSpan>,
        traffic: (u64, u64),
        now: Instant,
    ) -> Result<(), Refusal> {
        if !loss_sum.is_finite() {
            return Err((ErrorCode::NonFinite, "reported loss is not finite".into()));
        }
        let Some(stats) = self.epochs.get_mut(epoch as usize) else {
            return Err((
                ErrorCode::InvalidRequest,
                format!("no epoch {epoch} in this job"),
            ));
        };
        let w = match self.workers.get_mut(&worker) {
            Some(w) if w.state == WorkerState::Active => w,
            _ => return Err(unknown(worker)),
        };
        if clock == w.clock {
            // A retry of a report that already arrived (its long poll timed out): the step was
            // counted once, so only the wait is repeated.
            return Ok(());
        }
        // A restored worker may report past the saved clock: steps whose reports were lost
        // with the coordinator's crash.
        let jumped = w.restored && clock.0 > w.clock.0.saturating_add(1);
        if Some(clock.0) != w.clock.0.checked_add(1) && !jumped {
            return Err((
                ErrorCode::InvalidRequest,
                format!(
                    "{worker} is at clock {}, cannot advance to {}",
                    w.clock.0, clock.0
                ),
            ));
        }
        let mut lost = jumped.then(|| format!("{worker} reported clock {clock} past {}", w.clock));
        let lease = match span {
            None => None,
            Some(span) => {
                let at = (w.leased.iter())
                    .position(|l| l.part.epoch == span.epoch && l.part.index == span.partition);
                let Some(i) = at else {
                    let msg = format!(
                        "partition {}/{} is not leased to {worker}",
                        span.epoch, span.partition
                    );
                    // A restored worker's lease was acknowledged before the crash.
                    if w.restored {
                        self.lost_ack(msg.clone());
                    }
                    return Err((ErrorCode::LeaseUnknown, msg));
                };
                let l = &w.leased[i];
                // A restored worker's span may start past the saved position: those samples
                // were pushed and committed (the shards' ledgers have them), but the commit
                // was lost with the crash.
                let start_ok = span.start == l.committed
                    || (w.restored && span.start > l.committed && span.start <= l.end());
                if span.epoch != epoch
                    || span.len() != samples
                    || !start_ok
                    || span.end > l.end()
                    || span.is_empty()
                {
                    return Err((
                        ErrorCode::InvalidRequest,
                        format!(
                            "span {}..{} of {}/{} does not continue the lease at {} (ends {})",
                            span.start,
                            span.end,
                            span.epoch,
                            span.partition,
                            l.committed,
                            l.end()
                        ),
                    ));
                }
                // Count the lost commits now, so that the progress counters come back exact
                // (their losses are unknown: they count as samples only).
                let skipped = u64::from(span.start - l.committed);
                if skipped > 0 {
                    lost = Some(format!(
                        "{worker} committed {}/{} from {} past {}",
                        span.epoch, span.partition, span.start, l.committed
                    ));
                }
                w.samples += skipped;
                stats.samples += skipped;
                self.samples_done += skipped;
                Some((i, span.end))
            }
        };
        if let Some((i, end)) = lease {
            w.leased[i].committed = end;
            if end == w.leased[i].end() {
                let done = w.leased.swap_remove(i);
                self.data.complete(&done.part);
            }
        }
        w.clock = clock;
        w.last_seen = now;
        w.restored = false;
        w.samples += u64::from(samples);
        let t_ms = now.saturating_duration_since(self.started).as_millis() as u64;
        let step = StepRecord {
            t_ms,
            worker,
            clock,
        };
        push_capped(&mut self.steps, step, MAX_STEP_RECORDS, &mut self.dropped.1);
        stats.samples += u64::from(samples);
        stats.loss_sum += loss_sum;
        stats.bytes_pushed = stats.bytes_pushed.saturating_add(traffic.0);
        stats.bytes_pulled = stats.bytes_pulled.saturating_add(traffic.1);
        self.samples_done += u64::from(samples);
        let active = self
            .workers
            .values()
            .filter(|w| w.state == WorkerState::Active)
            .count() as u32;
        self.history
            .step(t_ms, worker, u64::from(samples), loss_sum, active);
        self.paced(worker, now);
        if let Some(what) = lost {
            self.lost_ack(what);
        }
        Ok(())
    }

    /// Whether `worker` may start its next step: under SSP(s) (BSP is s = 0) only while the
    /// slowest active worker is at least at its clock minus s. Answers with the minimum clock.
    /// Answers with the minimum clock and whether the worker is asked to leave.
    pub fn may_proceed(&self, worker: WorkerId) -> Poll<(Clock, bool)> {
        let w = match self.workers.get(&worker) {
            Some(w) if w.state == WorkerState::Active => w,
            _ => {
                let (code, msg) = unknown(worker);
                return Poll::Failed(code, msg);
            }
        };
        let min = self.min_active_clock().unwrap_or(w.clock);
        match self.job.consistency.staleness() {
            // A draining worker leaves after this step: it need not wait for anyone.
            _ if w.draining => Poll::Ready((min, true)),
            None => Poll::Ready((min, false)),
            Some(s) if min.0.saturating_add(s) >= w.clock.0 => Poll::Ready((min, false)),
            Some(_) => Poll::Pending,
        }
    }

    /// The slowest counting worker's clock (where the job left off if none counts).
    pub fn min_clock(&self) -> Clock {
        self.min_active_clock().unwrap_or(self.floor)
    }

    /// True when every partition of every epoch is complete.
    pub fn finished(&self) -> bool {
        self.data.finished()
    }

    /// Every worker in detail.
    pub fn members(&self, now: Instant) -> Vec<WorkerInfo> {
        let window_ms = 10_000;
        let since = self.ms(now).saturating_sub(window_ms);
        let span_s = (self.ms(now) - since).max(1) as f64 / 1000.0;
        self.workers
            .iter()
            .map(|(id, w)| {
                let recent = self
                    .steps
                    .iter()
                    .rev()
                    .take_while(|s| s.t_ms >= since)
                    .filter(|s| s.worker == *id)
                    .count();
                WorkerInfo {
                    id: *id,
                    name: w.name.clone(),
                    addr: w.addr.clone(),
                    state: w.state,
                    clock: w.clock,
                    idle_ms: now.saturating_duration_since(w.last_seen).as_millis() as u64,
                    draining: w.draining,
                    steps_per_s: recent as f64 / span_s,
                    samples: w.samples,
                    step_ms: f64::from(w.pace.median),
                    others_ms: f64::from(w.pace.others),
                    straggler_score: w.pace.score,
                    straggler: w.pace.flagged,
                    judged: if w.counts() && !w.draining {
                        w.pace.judgement()
                    } else {
                        Judgement::Unjudged
                    },
                    stalled_ms: self.stalled_for(*id, now),
                    staleness: if w.counts() { self.staleness(*id) } else { 0 },
                    notice_ms: w
                        .pace
                        .notice
                        .filter(|_| w.state == WorkerState::Active)
                        .map(|d| d.saturating_duration_since(now).as_millis() as u64),
                    placement: w.pace.placement,
                }
            })
            .collect()
    }

    /// A snapshot for status requests.
    pub fn status(&self, now: Instant) -> JobStatus {
        let (shards_joined, shards_expected) = self.shards_joined();
        let (samples_per_s, loss) = self.history.recent(self.ms(now));
        JobStatus {
            t_ms: self.ms(now),
            shards_joined,
            shards_expected,
            samples_total: self.data.samples_total(),
            samples_done: self.samples_done,
            epochs: self.epochs.clone(),
            workers: self
                .workers
                .iter()
                .map(|(id, w)| WorkerStatus {
                    id: *id,
                    name: w.name.clone(),
                    state: w.state,
                    clock: w.clock,
                    idle_ms: now.saturating_duration_since(w.last_seen).as_millis() as u64,
                    draining: w.draining,
                })
                .collect(),
            min_clock: self.min_clock(),
            finished: self.data.finished(),
            samples_per_s,
            loss,
            evaluation: self.history.latest_evaluation().cloned(),
        }
    }

    /// An evaluator named `name` reports the model's quality at `clock`.
    pub fn evaluation(
        &mut self,
        name: &str,
        clock: Clock,
        accuracy: f64,
        loss: f64,
        samples: u64,
        now: Instant,
    ) -> Result<(), Refusal> {
        if !(0.0..=1.0).contains(&accuracy) || !loss.is_finite() || loss < 0.0 {
            return Err((
                ErrorCode::NonFinite,
                format!(
                    "an evaluation needs an accuracy in [0, 1] and a finite loss >= 0, \
                     not {accuracy} and {loss}"
                ),
            ));
        }
        if samples == 0 {
            return Err((
                ErrorCode::InvalidRequest,
                "an evaluation of 0 samples".into(),
            ));
        }
        self.history.evaluation(EvalRecord {
            t_ms: self.ms(now),
            name: name.to_string(),
            clock,
            accuracy,
            loss,
            samples,
        });
        Ok(())
    }

    /// The training history from `from_ms` on.
    pub fn history(&self, from_ms: u64) -> JobHistory {
        self.history.history(from_ms)
    }

    /// Membership events by kind since the coordinator started.
    pub fn event_counts(&self) -> Vec<(&'static str, u64)> {
        self.history
            .event_counts()
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// The stalls measured since the last call: event kind and milliseconds.
    pub fn take_stalls(&mut self) -> Vec<(EventKind, f64)> {
        self.history.take_stalls()
    }
}

mod elastic;
mod history;
pub mod shards;

#[cfg(test)]
mod proptests;
#[cfg(test)]
pub(crate) mod tests;
