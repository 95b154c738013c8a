//! Deterministic simulation of a job (`edl-dst`): the coordinator and shard services, and
//! workers running the client's loop (register, lease, push, commit, wait for their clock,
//! leave), in one thread on virtual time, over a simulated network of named nodes that delays,
//! reorders, loses and duplicates requests and answers, cuts nodes off (partitions) and drops
//! messages by kind (filters), while workers join, drain and crash, key ranges move between
//! shards (workers re-route on the shards' refusals), shards crash and restart from their
//! checkpoints, and the coordinator crashes and comes back from the state it saved last. Every
//! run is a pure function of its seed; a run is checked for the consistency model at every
//! grant (against the clocks the counting workers sent: a check that a wrong membership count
//! at the coordinator fails, tried), map epochs that only grow, one map per epoch,
//! exactly-once data on every shard, a model of the batches applied to each key (none twice;
//! every acknowledged one held, unless a shard crash lost it) that the counters equal to the
//! float, and liveness (the job finishes once the faults stop).
//!
//! The coordinator and the shards are the real services ([`Coordinator`], [`ShardService`]):
//! every request is their `Service::handle`, the code a QUIC connection calls, run as a task
//! on a tokio runtime whose time is paused, so long polls wait on state changes and time out
//! after 60 s of virtual time, a hand-off retries within its window, and their clock
//! ([`edl_shared::clock`]) is the simulation's. The coordinator saves to memory
//! ([`StateStore::Memory`]) as its persister would; the shards write their checkpoints to
//! memory ([`CheckpointStore::Memory`]) where the service writes them, and every second as
//! their periodic writer does. Both reach shards through `SimLink`, so an operator's move runs
//! the real resharding and hand-off code. A crash aborts the node's tasks; a restart is
//! [`Coordinator::restored`] from what it saved last, or a shard [`ShardState::restore`]d from
//! its last checkpoint. A push's task watches its keys' counters around each step of the
//! shard service, so the model learns which keys the push was applied to as it happens.
//! Workers are a model of the client's loop: they route with their own map, adopt a newer one
//! from a refusal and otherwise ask the coordinator, as the client does. With
//! `Scenario::clients` (`edl-dst --clients`) they are the client library itself, its `Session`
//! in the trainer's loop, over in-process connections (`Dialer::Local`) whose calls the
//! simulation delivers, delays or fails; those runs include BSP (the model does not pull, so
//! it runs ASP and SSP only). With `Options::replicas` (`edl-dst --replicas N`) the job keeps
//! copies of its key ranges: the coordinator's watch over the shards
//! ([`Coordinator::watch_shards`]) runs on virtual time, a crashed shard restarts by joining
//! the coordinator (a standby once its backups replaced it), shards crash at each [`Point`] of
//! a push's replication and of a new backup's seeding, and the model follows each copy,
//! primary and backup: a copy applies no batch twice, an acknowledged push is held by its
//! primary's copy and by the backups the primary's map lists, and at the end every copy is
//! exact to the float, whatever crashed. The transport itself, and shard crashes in the middle
//! of a move (`Options::mid_move`, off by default: known to break) are not covered.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use edl_proto::frame::{Frame, Parts};
use edl_proto::msg::{ChunkRef, DataSpan, JobTrace, Partition};
use edl_proto::{
    Clock, Consistency, ErrorCode, JobConfig, Key, MapEpoch, Request, Response, ShardId, ShardMap,
    StragglerSettings, Token, WorkerId,
};
use edl_ps::checkpoint::ShardCheckpoint;
use edl_ps::coordinator::{Coordinator, CoordinatorConfig, LinkFuture, MemoryStore, ShardLink};
use edl_ps::shard::{CheckpointStore, ShardService, ShardState};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{BoxFuture, CallError, Dialer, LocalConn, LocalNet};
use edl_shared::{Peer, Role, Service};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Until this virtual time faults are injected; after it the network delivers everything
/// promptly and the job must finish.
const FAULTS_END_MS: u64 = 15_000;
/// More deliveries than this (a job needs a few thousand) is a livelock.
const MAX_EVENTS: u64 = 1_000_000;
/// A job not finished by this virtual time is a liveness failure.
const DEADLINE_MS: u64 = 300_000;
/// The coordinator's sweeper period (lease expiry).
const TICK_MS: u64 = 100;
/// How long a worker takes to notice that its connection failed.
const CONNECTION_TIMEOUT_MS: u64 = 1000;
/// How often the coordinator saves its state (as `edl-ps coordinator` does while it changes).
const SAVE_MS: u64 = 500;
/// How often shards write their checkpoints (`edl-ps shard --checkpoint-every`).
const CHECKPOINT_MS: u64 = 1000;
/// How long the placer takes to start a worker.
const PLACE_MS: u64 = 300;

/// One run's scenario, drawn from its seed.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Shard servers.
    pub shards: u32,
    /// Workers at the start.
    pub workers: u32,
    /// The consistency model (ASP or SSP).
    pub consistency: Consistency,
    /// Samples per epoch, partition size and batch size.
    pub data: (u32, u32, u32),
    /// Chance that a request, or an answer, is lost.
    pub loss: f64,
    /// Chance that a request is delivered twice.
    pub duplicate: f64,
    /// Largest network delay in milliseconds (messages overtake each other within it).
    pub max_delay_ms: u64,
    /// Scripted events: `(virtual ms, what)`.
    pub script: Vec<(u64, Scripted)>,
    /// A worker's compute time per batch in milliseconds, between the grant of its clock
    /// (or its lease) and its push (0 in the seeds' scenarios).
    pub step_ms: u64,
    /// The coordinator's straggler detector and policy (a placer in the simulation starts a
    /// worker for every placement the coordinator asks for).
    pub stragglers: StragglerSettings,
    /// The workers are the real client library (`edl_client`: its `Session` in the trainer's
    /// loop) over in-process connections of the simulated network, instead of the
    /// simulation's model of the client's loop.
    pub clients: bool,
    /// Copies of every key range (the job's `replicas`; 1 in the seeds' scenarios, more with
    /// `Options::replicas`).
    pub replicas: u32,
    /// The job has two coordinators, one leading and one standing by, and the real clients
    /// are given both addresses (`--failover --clients`): a call to the standby is answered
    /// with the leader it names (the one it saw last: a lost leader until the next is
    /// elected), and the leader may be lost in the ways [`Loss`] lists.
    pub standby: bool,
}

/// A scripted membership change or fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scripted {
    /// A new worker starts.
    Join,
    /// An operator drains the n-th registered worker (modulo their number).
    Drain(usize),
    /// The n-th live worker (modulo their number) crashes: it stops, its messages in flight
    /// still arrive.
    Crash(usize),
    /// The coordinator crashes (its connections fail) and comes back this many milliseconds
    /// later from the state it saved last.
    CoordinatorCrash(u64),
    /// With a standby and real clients (`--failover --clients`), the leader is lost for this
    /// many milliseconds, as [`Loss`] says; meanwhile the standby names it as the leader
    /// still (its etcd lease has not run out).
    LeaderLost(u64, Loss),
    /// A resharding move: keys drawn from `n` go from their shard to another (`m`), their
    /// state streamed while workers keep pushing.
    Move(usize, usize),
    /// A node is cut off from every other for this many milliseconds: what it sends and what
    /// is sent to it is lost (its callers' connections time out).
    Partition(Target, u64),
    /// For this many milliseconds every request of a kind (or, with `answers`, every answer to
    /// one) is lost, as tikv's `RegionPacketFilter` drops messages by kind.
    Filter {
        /// The kind of request.
        kind: Kind,
        /// Drop the answers instead of the requests.
        answers: bool,
        /// For how long.
        ms: u64,
    },
    /// The n-th shard (modulo their number) crashes and restarts this many milliseconds later
    /// from its last checkpoint (written periodically and after every move), with the
    /// coordinator's current map; what it applied since is lost.
    ShardCrash(usize, u64),
    /// The n-th live worker (modulo their number) computes this many times slower from now on
    /// (1: at its normal speed again).
    Slow(usize, u32),
    /// A replicated job's shard crashes at the `n`-th time (from now) a push's replication, or
    /// a new backup's seeding, reaches `Point`, and restarts this many milliseconds later (as a
    /// standby, once the coordinator replaced it). A crash that would take the last live copy
    /// of a key range waits for the next time.
    CrashAt(Point, u32, u64),
}

/// How a leading coordinator is lost ([`Scripted::LeaderLost`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// Cut off from the store, not from the workers: it serves on until the standby leads
    /// (its writes then refused), as in `--failover`'s crashes.
    CutOff,
    /// Paused (SIGSTOP, a long stall): cut off from the store as [`Loss::CutOff`], and its
    /// clients' calls and new connections to it time out, until the standby leads; its tasks
    /// then run on, to be refused.
    Paused,
    /// Killed: calls to its address fail and new connections to it time out until it is
    /// started again, when it wins the election (`true`: back at the same address while the
    /// standby named it all along) or the standby does (`false`).
    Killed(bool),
}

/// A step of a push's replication, or of a new backup's seeding, at which a shard crashes
/// ([`Scripted::CrashAt`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Point {
    /// A worker's push reaches its primary, which crashes before applying it.
    Pushed,
    /// The primary applied a push and sends it to a backup, then crashes (what it sent
    /// arrives).
    Forwarded,
    /// A forwarded push reaches the backup, which crashes before applying it.
    AtBackup,
    /// The backup's acknowledgement reaches the primary, which crashes before it answers the
    /// worker.
    BackupAcked,
    /// The primary answered the worker that its push is applied, and crashes.
    Acked,
    /// A primary sends a new backup its copy of a range, then crashes (the copy arrives).
    CopySent,
    /// A copy reaches its new backup, which crashes before taking it.
    CopyArrives,
}

impl Point {
    /// Every point.
    pub const ALL: [Point; 7] = [
        Point::Pushed,
        Point::Forwarded,
        Point::AtBackup,
        Point::BackupAcked,
        Point::Acked,
        Point::CopySent,
        Point::CopyArrives,
    ];
}

/// A node a fault names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The n-th live worker (modulo their number) when the fault begins.
    Worker(usize),
    /// The n-th shard (modulo their number).
    Shard(usize),
    /// The coordinator.
    Coordinator,
}

/// A kind of request, with its answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `Register` and `Registered`.
    Register,
    /// `NextPartition` and `Partition`.
    Lease,
    /// `Clock` and `ClockGranted`.
    Clock,
    /// `Heartbeat` and `Beat`.
    Heartbeat,
    /// `Leave` and its acknowledgement.
    Leave,
    /// `Push` and its acknowledgement or `StaleEpoch` refusal.
    Push,
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Register,
        Kind::Lease,
        Kind::Clock,
        Kind::Heartbeat,
        Kind::Leave,
        Kind::Push,
    ];
}

impl Scenario {
    /// The scenario of `seed`.
    pub fn of(seed: u64) -> Scenario {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_d57d_57d5_eed5);
        let consistency = match rng.random_range(0..4) {
            0 => Consistency::Asp,
            s => Consistency::Ssp { staleness: s - 1 },
        };
        let mut script = Vec::new();
        for _ in 0..rng.random_range(0..4) {
            script.push((rng.random_range(0..FAULTS_END_MS), Scripted::Join));
        }
        for _ in 0..rng.random_range(0..3) {
            let n = rng.random_range(0..8);
            script.push((rng.random_range(0..FAULTS_END_MS), Scripted::Drain(n)));
        }
        for _ in 0..rng.random_range(0..4) {
            let n = rng.random_range(0..8);
            script.push((rng.random_range(0..FAULTS_END_MS), Scripted::Crash(n)));
        }
        for _ in 0..rng.random_range(0..5) {
            let (n, m) = (rng.random_range(0..1024), rng.random_range(0..8));
            script.push((rng.random_range(0..FAULTS_END_MS), Scripted::Move(n, m)));
        }
        for _ in 0..rng.random_range(0..3) {
            let down = rng.random_range(50..2000);
            let at = rng.random_range(0..FAULTS_END_MS);
            script.push((at, Scripted::CoordinatorCrash(down)));
        }
        let mut scenario = Scenario {
            shards: rng.random_range(2..=4),
            workers: rng.random_range(2..=8),
            consistency,
            data: (
                rng.random_range(64..=256),
                rng.random_range(8..=32),
                rng.random_range(2..=8),
            ),
            loss: rng.random_range(0.0..0.08),
            duplicate: rng.random_range(0.0..0.04),
            max_delay_ms: rng.random_range(1..=40),
            script,
            step_ms: 0,
            stragglers: StragglerSettings::default(),
            clients: false,
            replicas: 1,
            standby: false,
        };
        // Drawn after the rest, so that adding them left each seed's other choices alone.
        let script = &mut scenario.script;
        for _ in 0..rng.random_range(0..3) {
            let target = match rng.random_range(0..4) {
                0 | 1 => Target::Worker(rng.random_range(0..8)),
                2 => Target::Shard(rng.random_range(0..4)),
                _ => Target::Coordinator,
            };
            // A shard may be cut off past the 10 s in which a hand-off to it is retried.
            let ms = match target {
                Target::Shard(_) => rng.random_range(100..12_000),
                _ => rng.random_range(100..3000),
            };
            script.push((
                rng.random_range(0..FAULTS_END_MS),
                Scripted::Partition(target, ms),
            ));
        }
        for _ in 0..rng.random_range(0..3) {
            let kind = Kind::ALL[rng.random_range(0..Kind::ALL.len())];
            let (answers, ms) = (rng.random_bool(0.5), rng.random_range(100..2000));
            let at = rng.random_range(0..FAULTS_END_MS);
            script.push((at, Scripted::Filter { kind, answers, ms }));
        }
        for _ in 0..rng.random_range(0..3) {
            let (n, down) = (rng.random_range(0..4), rng.random_range(50..2000));
            let at = rng.random_range(0..FAULTS_END_MS);
            script.push((at, Scripted::ShardCrash(n, down)));
        }
        // Some moves run into a partition of a shard longer than a hand-off is retried: if it
        // is the source or the destination, the source takes the range back.
        let moves: Vec<u64> = (script.iter())
            .filter(|(_, s)| matches!(s, Scripted::Move(..)))
            .map(|(t, _)| *t)
            .collect();
        for t in moves {
            if rng.random_bool(0.3) {
                let (n, ms) = (rng.random_range(0..4), rng.random_range(10_500..12_000));
                let at = t + rng.random_range(1..60);
                script.push((at, Scripted::Partition(Target::Shard(n), ms)));
            }
        }
        script.sort_by_key(|(t, _)| *t);
        scenario
    }

    /// The job: a zero-initialized counter of two chunks per shard, SGD at learning rate 1,
    /// two epochs.
    fn job(&self) -> JobConfig {
        let (samples, partition, batch) = self.data;
        JobConfig {
            epochs: 2,
            train_samples: samples,
            partition_size: partition,
            batch_size: batch,
            // A real client's heartbeat waits for a call that failed (a lost message here)
            // until its connection times out, a second: its lease must outlast a few.
            lease_ms: if self.clients { 5000 } else { 1000 },
            replicas: self.replicas,
            ..crate::counter_job(8 * self.shards, 4, self.consistency)
        }
    }
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// A hash of every delivered message and timer, in order (FNV-1a).
    pub digest: u64,
    /// Messages and timers delivered.
    pub events: u64,
    /// Virtual milliseconds until the job finished.
    pub virtual_ms: u64,
    /// Workers started, crashed, declared dead by the coordinator, drained.
    pub workers: (u32, u32, u32, u32),
    /// Requests and answers the network lost, and requests it delivered twice.
    pub lost: u64,
    /// Requests delivered twice.
    pub duplicated: u64,
    /// Coordinator restarts from its saved state.
    pub restarts: u32,
    /// Shard crashes (each restarted from its checkpoint).
    pub shard_crashes: u32,
    /// With `Options::failover`: leaders cut off and replaced; of them those that found
    /// themselves deposed (a write refused after the new leader's election); and their orders
    /// the shards refused for their term.
    pub failovers: (u32, u32, u32),
    /// With a standby (`Scenario::standby`): leaders killed, and of them those that came back
    /// at their own address and won the next election while the standby named them.
    pub leaders_killed: (u32, u32),
    /// With a standby: leaders paused ([`Loss::Paused`]).
    pub leaders_paused: u32,
    /// Real clients that ended because the coordinator dropped them (declared them dead).
    pub dropped: u32,
    /// Workers that left once the coordinator acknowledged it (the others crashed or were
    /// dropped).
    pub left: u32,
    /// Partitions and message filters.
    pub cuts: u32,
    /// Key ranges moved between shards, and pushes refused with a newer map and routed again.
    pub moves: (u32, u64),
    /// Moves whose source took the range back (its hand-off failed) or refused them.
    pub taken_back: u32,
    /// With `verbose`, every event of the run.
    pub log: Vec<String>,
    /// With `Options::trace`, the coordinator's trace: every step and membership event, at
    /// virtual milliseconds since it (last) started.
    pub trace: Option<JobTrace>,
    /// The id each worker (by the order they started) registered with last, if it did.
    pub ids: Vec<Option<WorkerId>>,
    /// The consistency model it ran.
    pub consistency: Consistency,
    /// A replicated job's shards replaced by their backups (the coordinator's maps that
    /// dropped a shard), new backups seeded, and the shard crashes at each replication
    /// [`Point`] (in the order of [`Point::ALL`]).
    pub replication: (u32, u32, [u32; 7]),
}

/// A failed run: what broke, when, and the history up to it.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// Virtual milliseconds when it was found.
    pub at_ms: u64,
    /// The broken invariant.
    pub what: String,
    /// The last events before it (with `verbose`, all of them).
    pub log: Vec<String>,
    /// How it was run.
    pub options: Options,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {} failed at {} ms: {}",
            self.seed, self.at_ms, self.what
        )?;
        for line in &self.log {
            writeln!(f, "  {line}")?;
        }
        let o = &self.options;
        let flag = |on: bool, name: &'static str| if on { name } else { "" };
        write!(
            f,
            "replay: edl-dst --seed {}{}{}{}{}{} --verbose",
            self.seed,
            flag(o.give_up, " --give-up"),
            flag(o.mid_move, " --mid-move"),
            flag(o.failover, " --failover"),
            flag(o.clients, " --clients"),
            if o.replicas > 1 {
                format!(" --replicas {}", o.replicas)
            } else {
                String::new()
            },
        )
    }
}

/// How a run is driven besides its seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Keep the whole event log for a failure (otherwise its last 40 lines).
    pub verbose: bool,
    /// Workers give up on a coordinator call whose connection failed and exit (a client whose
    /// `TransportSettings::reconnect` is a short limit) instead of repeating it on a new
    /// connection until the coordinator answers (the client's default, under which the
    /// coordinator may serve a call twice).
    pub give_up: bool,
    /// Let crashes of the coordinator and of shards fall in the middle of a move, and
    /// partitions lose a shard's answer to the coordinator (so a move's outcome may be unknown
    /// to it). Off by default: a shard crashing during its own hand-off is known to break
    /// (see docs/src/simulation.md).
    pub mid_move: bool,
    /// Return the coordinator's trace (steps and events, in its clock) in the report.
    pub trace: bool,
    /// The seed's workers are real clients (`Scenario::clients`).
    pub clients: bool,
    /// Coordinator crashes are failovers as etcd runs them: the leader is cut off from the
    /// store and from the workers (their calls to it fail) but not killed: its tasks run on,
    /// and its calls to the shards still arrive, late. The standby, restored from the store,
    /// takes the lead when the crash's time is up, at the next term; the old leader's writes
    /// are refused from then on, and the shards refuse its orders once the new leader's
    /// reached them.
    pub failover: bool,
    /// Keep this many copies of every key range (at most the seed's shards; 0 and 1: one).
    /// The coordinator watches the shards as `edl-ps coordinator` does (silence finds a dead
    /// one: the simulation has no sockets to probe), and shards crash at every step of a
    /// push's replication and of a seeding (1 to 3 [`Scripted::CrashAt`], drawn from the seed
    /// apart from its other choices).
    pub replicas: u32,
}

/// Runs seed `seed`, on a runtime of its own whose time is paused.
pub fn run(seed: u64, options: Options) -> Result<Report, Box<Failure>> {
    let mut scenario = Scenario {
        clients: options.clients,
        ..Scenario::of(seed)
    };
    // Real clients pull every step, so the seeds that draw SSP(0) run BSP with them (the same
    // barrier at the coordinator, and shards that stage a step's gradients until it is
    // pulled). Coordinator crashes included: what it acknowledged is durable, so a restarted
    // coordinator's clocks are never older than the steps the shards applied (with a state
    // saved every half second instead, seeds 69, 363 and 585 stalled: every worker that
    // joined pushed a step already applied, was refused with `StaleClock` and exited).
    if scenario.clients && scenario.consistency == (Consistency::Ssp { staleness: 0 }) {
        scenario.consistency = Consistency::Bsp;
    }
    if options.failover && options.clients {
        scenario.standby = true;
        // Drawn apart, so that a seed's other choices are those it makes without a standby:
        // a third of the leaders lost are cut off from the store (and serve on), the others
        // killed (for up to 8 s, longer than a worker's lease), half of those coming back at
        // their own address to win the next election while the standby named them.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x57a0_db1e_1ead_e400);
        // Half the leaders cut off are paused instead (drawn apart again).
        let mut pauses = StdRng::seed_from_u64(seed ^ 0x9a05_ed1e_ade7_0001);
        for (_, what) in scenario.script.iter_mut() {
            if let Scripted::CoordinatorCrash(down) = *what {
                *what = match rng.random_range(0..3) {
                    0 if pauses.random_bool(0.5) => Scripted::LeaderLost(down, Loss::Paused),
                    0 => Scripted::LeaderLost(down, Loss::CutOff),
                    k => Scripted::LeaderLost(rng.random_range(50..8000), Loss::Killed(k == 1)),
                };
            }
        }
    }
    if options.replicas > 1 {
        scenario.replicas = options.replicas.min(scenario.shards);
        // Drawn apart, so that a seed's other choices are those it makes without replicas.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7e91_1ca5_0f5e_ed00);
        for _ in 0..rng.random_range(1..=3) {
            let point = Point::ALL[rng.random_range(0..Point::ALL.len())];
            let n = rng.random_range(1..=5);
            // Back before the coordinator finds it dead (it rejoins, and is replaced then), or
            // after.
            let down = match rng.random_bool(0.5) {
                true => rng.random_range(50..2000),
                false => rng.random_range(3500..6000),
            };
            let at = rng.random_range(0..FAULTS_END_MS);
            scenario
                .script
                .push((at, Scripted::CrashAt(point, n, down)));
        }
        scenario.script.sort_by_key(|(t, _)| *t);
    }
    run_scenario(seed, scenario, options)
}

/// Runs `scenario` (a test's own, or a seed's with changes), its network's delays and losses
/// drawn from `seed`.
pub fn run_scenario(
    seed: u64,
    scenario: Scenario,
    options: Options,
) -> Result<Report, Box<Failure>> {
    let failed = |what: String| {
        Box::new(Failure {
            seed,
            at_ms: 0,
            what,
            log: Vec::new(),
            options,
        })
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| failed(format!("no runtime: {e}")))?;
    rt.block_on(async {
        if scenario.consistency == Consistency::Bsp && !scenario.clients {
            return Err(failed(
                "BSP needs real clients (Scenario::clients): the model of the client does not \
                 pull"
                    .into(),
            ));
        }
        let (mut sim, mut inbox) = Sim::new(seed, scenario, options.verbose)
            .await
            .map_err(failed)?;
        sim.give_up = options.give_up;
        sim.mid_move = options.mid_move;
        sim.failover = options.failover;
        match sim.run(&mut inbox).await {
            Ok(()) => {
                let mut report = sim.report();
                if options.trace {
                    report.trace = Some(sim.coordinator.inspect(|st| {
                        let mut trace = st.trace(0);
                        while trace.more {
                            let page = st.trace(trace.next_step);
                            trace.steps.extend(page.steps);
                            (trace.next_step, trace.more) = (page.next_step, page.more);
                        }
                        trace
                    }));
                }
                if options.verbose {
                    report.log = sim.log.iter().cloned().collect();
                }
                Ok(report)
            }
            Err(what) => {
                let log = sim.log.iter().cloned().collect();
                Err(Box::new(Failure {
                    seed,
                    at_ms: sim.now,
                    what,
                    log,
                    options,
                }))
            }
        }
    })
}

/// Where a message goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Coordinator,
    Shard(usize),
    Worker(usize),
}

/// A message or a timer.
#[derive(Clone, Debug)]
enum Body {
    Register,
    NextPartition(WorkerId),
    Clock {
        id: WorkerId,
        clock: Clock,
        span: DataSpan,
    },
    Heartbeat(WorkerId),
    Leave(WorkerId),
    Push {
        id: WorkerId,
        clock: Clock,
        span: DataSpan,
        epoch: MapEpoch,
        chunks: Vec<ChunkRef>,
    },
    Registered {
        id: WorkerId,
        clock: Clock,
        map: Box<ShardMap>,
        token: Token,
    },
    Leased {
        part: Option<Partition>,
        clock: Clock,
    },
    Granted {
        drain: bool,
    },
    Beat {
        drain: bool,
    },
    Pushed {
        keys: Vec<Key>,
        span: DataSpan,
    },
    /// A worker asks the coordinator for its map (a shard refused a push with an older one).
    GetMap,
    /// The coordinator's map.
    FreshMap(Box<ShardMap>),
    /// A push refused with the shard's map: route again.
    Moved {
        span: DataSpan,
        map: Box<ShardMap>,
    },
    /// A server's request (the coordinator's, or a shard's hand-off) reaches a shard
    /// (`links[id]`).
    Call(u64),
    /// A shard's answer to a server's request (`links[id]`) reaches the caller.
    LinkReply(u64),
    Refused(String),
    /// The coordinator's long poll timed out: ask again.
    NotReady,
    Left,
    Retry,
    /// A worker of a replicated job routes its push again (with the map it has now): its
    /// retry after a failed push asks the coordinator for the map first.
    Route,
    ConnectionLost,
    HeartbeatDue,
    Tick,
    Restart,
    /// A worker's compute for its batch is done: it pushes.
    Computed,
    /// The placer starts a worker for placement `id`.
    Place(u64),
    /// A crashed shard starts again from its checkpoint.
    ShardRestart,
    Script(Scripted),
}

impl Body {
    /// The kind of request a message is or answers, and whether it is an answer.
    fn kind(&self) -> Option<(Kind, bool)> {
        Some(match self {
            Body::Register => (Kind::Register, false),
            Body::Registered { .. } => (Kind::Register, true),
            Body::NextPartition(_) => (Kind::Lease, false),
            Body::Leased { .. } => (Kind::Lease, true),
            Body::Clock { .. } => (Kind::Clock, false),
            Body::Granted { .. } => (Kind::Clock, true),
            Body::Heartbeat(_) => (Kind::Heartbeat, false),
            Body::Beat { .. } => (Kind::Heartbeat, true),
            Body::Leave(_) => (Kind::Leave, false),
            Body::Left => (Kind::Leave, true),
            Body::Push { .. } => (Kind::Push, false),
            Body::Pushed { .. } | Body::Moved { .. } => (Kind::Push, true),
            _ => return None,
        })
    }
}

/// One delivery: to whom, from which worker (for answers and worker timers), the request it
/// belongs to, and what.
#[derive(Clone, Debug)]
struct Envelope {
    to: Node,
    worker: usize,
    seq: u64,
    body: Body,
}

/// A worker's place in the client's loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Registering,
    Leasing,
    Pushing,
    Committing,
    Leaving,
    Done,
    Crashed,
}

/// A simulated worker.
#[derive(Debug)]
struct Worker {
    id: Option<WorkerId>,
    phase: Phase,
    /// The request awaited (answers to older ones are stale).
    seq: u64,
    clock: Clock,
    part: Option<(Partition, u32)>,
    span: Option<DataSpan>,
    /// The keys that acknowledged the current batch's push.
    acks: BTreeSet<Key>,
    /// The shard map the worker routes with.
    map: ShardMap,
    drain: bool,
    /// What its pushes prove their sender with (from its registration).
    token: Option<Token>,
    /// The placement it was started for.
    placement: Option<u64>,
    /// How many times slower than the scenario's step it computes.
    slow: u32,
    /// A real client's task, and how it ended (with `Scenario::clients`).
    client: Option<(tokio::task::JoinHandle<()>, Outcome)>,
}

/// How a real client's task ended, once it did.
type Outcome = Arc<std::sync::Mutex<Option<String>>>;

/// A coordinator call's answer, from the task that served it.
#[derive(Debug)]
struct Answer {
    call: u64,
    /// The worker slot that asked ([`ADMIN`] for an operator).
    worker: usize,
    seq: u64,
    /// The clock a `Clock` request committed.
    clock: Clock,
    resp: Response,
}

/// The caller slot of an operator's requests.
const ADMIN: usize = usize::MAX;
/// The caller slot of a call over the network (its request number is the call's id).
const LINK: usize = usize::MAX - 1;
/// The request number of an operator's drain and move requests.
const DRAIN: u64 = 0;
const MOVE: u64 = 1;
/// The coordinator's settling of a move after a restart (a task of its own, no answer).
const RESUME: u64 = 2;
/// A restarted shard of a replicated job joining the coordinator.
const JOIN: u64 = 3;

/// A call over a connection of the simulated network: a server's to a shard (the
/// coordinator's, or a shard's hand-off) through [`SimLink`], or a real client's to the
/// coordinator or a shard through [`SimNet`].
struct LinkCall {
    /// The caller and the server.
    from: Node,
    to: Node,
    req: Request,
    payload: Parts,
    /// Where the answer goes (gone if the caller crashed since).
    reply: ReplyTo,
    /// The answer, once the server gave it, travelling back.
    answer: Option<Answered>,
}

/// A server's answer as its caller gets it.
type Answered = Result<Frame<Response, Parts>, CallError>;

/// A server's way to the shards in the simulation: each call is a message the simulation
/// delivers (or loses) and answers.
struct SimLink {
    from: Node,
    calls: tokio::sync::mpsc::UnboundedSender<Outgoing>,
}

/// Where a shard's answer to a server goes.
type ReplyTo = tokio::sync::oneshot::Sender<Answered>;

/// A server's call to a shard as it leaves the server: the caller, the shard's address, the
/// request and its payload, where the answer goes.
type Outgoing = (Node, String, Request, Parts, ReplyTo);

impl ShardLink for SimLink {
    fn answers<'a>(&'a self, addr: &'a str) -> LinkFuture<'a, bool> {
        Box::pin(async move {
            self.call(addr, Request::GetMap, Parts::default())
                .await
                .is_ok()
        })
    }

    fn call<'a>(
        &'a self,
        addr: &'a str,
        req: Request,
        payload: Parts,
    ) -> LinkFuture<'a, Result<Response, CallError>> {
        Box::pin(async move {
            let frame = call(&self.calls, self.from, addr, req, payload).await?;
            CallError::answered(frame.msg)
        })
    }
}

/// One call through the simulated network, answered when the simulation delivers the answer.
async fn call(
    calls: &tokio::sync::mpsc::UnboundedSender<Outgoing>,
    from: Node,
    addr: &str,
    req: Request,
    payload: Parts,
) -> Answered {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let gone = || CallError::Address(format!("{addr}: the simulation ended"));
    calls
        .send((from, addr.to_string(), req, payload, tx))
        .map_err(|_| gone())?;
    rx.await.map_err(|_| gone())?
}

/// A real client's way to the servers in the simulation: its connections pass each call as a
/// message the simulation delivers (or loses, as a connection that fails).
#[derive(Debug)]
struct SimNet {
    from: Node,
    calls: tokio::sync::mpsc::UnboundedSender<Outgoing>,
    /// Addresses whose process is down ([`Standby::down`]).
    down: Option<Arc<std::sync::Mutex<BTreeSet<String>>>>,
}

/// A connection of [`SimNet`].
#[derive(Debug)]
struct SimConn {
    from: Node,
    addr: String,
    calls: tokio::sync::mpsc::UnboundedSender<Outgoing>,
}

impl LocalNet for SimNet {
    fn connect<'a>(
        &'a self,
        addr: &'a str,
        _name: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn LocalConn>, CallError>> {
        let conn = SimConn {
            from: self.from,
            addr: addr.to_string(),
            calls: self.calls.clone(),
        };
        let down = (self.down.as_ref())
            .is_some_and(|d| d.lock().unwrap_or_else(|p| p.into_inner()).contains(addr));
        Box::pin(async move {
            // A handshake with an address no process listens at times out.
            if down {
                tokio::time::sleep(Duration::from_millis(CONNECTION_TIMEOUT_MS)).await;
                return Err(CallError::Connection(quinn::ConnectionError::TimedOut));
            }
            Ok(Arc::new(conn) as Arc<dyn LocalConn>)
        })
    }
}

impl LocalConn for SimConn {
    fn call(&self, req: Request, payload: Parts) -> BoxFuture<'_, Answered> {
        Box::pin(call(&self.calls, self.from, &self.addr, req, payload))
    }
}

/// The kind of a client's request, for filters.
fn kind_of(req: &Request) -> Option<Kind> {
    Some(match req {
        Request::Register { .. } => Kind::Register,
        Request::NextPartition { .. } => Kind::Lease,
        Request::Clock { .. } => Kind::Clock,
        Request::Heartbeat { .. } => Kind::Heartbeat,
        Request::Leave { .. } => Kind::Leave,
        Request::Push { .. } => Kind::Push,
        _ => return None,
    })
}

/// A real client in the trainer's loop: pull, compute (a sleep of `step`), push gradients of
/// -1 everywhere, commit; leaves when there is no data left or it is asked to drain. Returns
/// its steps.
async fn client_loop(
    cfg: edl_worker::ClientConfig,
    dialer: Dialer,
    placement: Option<u64>,
    step: Duration,
) -> Result<u64, edl_worker::ClientError> {
    let job = edl_worker::Job::connect_with(&cfg, dialer)
        .await?
        .for_placement(placement);
    let mut session = job.register(&cfg.identity.name).await?;
    let n = session.spec().param_count();
    let (mut params, grads) = (vec![0.0f32; n], vec![-1.0f32; n]);
    let mut steps = 0;
    while let Some(batch) = session.next_batch().await? {
        session.pull(&mut params).await?;
        if !step.is_zero() {
            tokio::time::sleep(step).await;
        }
        session.push(&batch, &grads).await?;
        session.commit(batch, 0.0).await?;
        steps += 1;
        if session.drain_requested() {
            break;
        }
    }
    session.leave().await?;
    Ok(steps)
}

/// The coordinator's address in the simulation.
const COORDINATOR: &str = "sim:coordinator";

/// The addresses of a job with a standby coordinator (`Scenario::standby`); either may lead.
const COORDINATORS: [&str; 2] = [COORDINATOR, "sim:standby"];

/// A job's two coordinators as its real clients reach them: one leads, the other stands by
/// and names the leader it saw last. (Servers reach the leader whatever address they use.)
struct Standby {
    /// The address that leads ([`COORDINATORS`]), or led until it was lost: the one the
    /// standby names.
    leads: usize,
    /// Addresses whose process is down: a new connection to one times out.
    down: Arc<std::sync::Mutex<BTreeSet<String>>>,
}

impl Standby {
    fn down(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.down.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The leader's process stops answering (killed or paused); returns its address.
    fn leader_down(&self) -> &'static str {
        let at = COORDINATORS[self.leads];
        self.down().insert(at.to_string());
        at
    }

    /// Whether the leader's process does not answer now.
    fn leader_is_down(&self) -> bool {
        self.down().contains(COORDINATORS[self.leads])
    }
}

/// A shard server: the real service, over its state.
struct SimShard {
    service: Arc<ShardService>,
    state: Arc<ShardState>,
    /// Its disk, as its periodic checkpoints reach it.
    store: CheckpointStore,
    /// The requests it is serving and its checkpoint writes, by id: a crash aborts them.
    tasks: BTreeMap<u64, (Serving, tokio::task::JoinHandle<()>)>,
    /// Until when it is down, if it is.
    down: Option<u64>,
    /// Stops what the service runs in the background (a hand-off still offering its range).
    stop: CancellationToken,
}

/// What a shard's task serves.
#[derive(Clone, Debug)]
enum Serving {
    /// A worker's push: the worker's slot and request, and what it pushed.
    Push {
        slot: usize,
        seq: u64,
        id: WorkerId,
        span: DataSpan,
        keys: Vec<Key>,
    },
    /// A server's call (`links[id]`).
    Link(u64),
    Checkpoint,
}

/// What the simulation's tasks give back: the coordinator's answers, the servers' calls to
/// shards, the shards' answers.
struct Inbox {
    answers: tokio::sync::mpsc::UnboundedReceiver<Answer>,
    links: tokio::sync::mpsc::UnboundedReceiver<Outgoing>,
    shards: tokio::sync::mpsc::UnboundedReceiver<ShardAnswer>,
}

/// A shard's answer, from the task that served it.
struct ShardAnswer {
    shard: usize,
    task: u64,
    frame: Frame<Response, Parts>,
}

/// A batch of data, as `(epoch, first sample)`.
type Batch = (u32, u32);

/// The shards' disks and the model of their keys, written by the shards' tasks as they apply
/// pushes and take checkpoints (on the runtime's one thread, so a checkpoint holds exactly the
/// batches the model says it does).
#[derive(Default)]
struct Disk {
    /// Per shard, its last checkpoint.
    checkpoints: Vec<Option<ShardCheckpoint>>,
    /// The model: per key, the batches applied to it (and not lost since).
    model: BTreeMap<Key, BTreeSet<Batch>>,
    /// Per shard, the model of its keys when it wrote its checkpoint.
    modelled: Vec<BTreeMap<Key, BTreeSet<Batch>>>,
    /// A batch applied to a key that held it already.
    twice: Option<String>,
    /// A replicated job's model, per copy: the batches shard `s`'s copy of a key (primary or
    /// backup) holds; `None` once what it holds is not known (a new backup's copy taken
    /// while pushes were on their way to it, a restore, a BSP step).
    copies: BTreeMap<(usize, Key), Option<BTreeSet<Batch>>>,
    /// What the model of the copies learnt, for the log.
    notes: Vec<String>,
}

impl Disk {
    /// Shard `s` writes a checkpoint; the model of its keys is kept beside it.
    fn save(&mut self, s: usize, ckpt: ShardCheckpoint) {
        self.modelled[s] = (ckpt.chunks.iter())
            .map(|c| {
                let k = Key(c.key);
                (k, self.model.get(&k).cloned().unwrap_or_default())
            })
            .collect();
        self.checkpoints[s] = Some(ckpt);
    }

    /// A task of shard `s` changed its copies from `before` to `after` (by key: whether the
    /// copy is a backup, and its counter): a copy that appeared, or a primary's that a backup
    /// copy replaced, is a new backup's copy from shard `source` (its batches those of the
    /// source's copy if their number is the copy's count, else not known) or not known; a
    /// backup copy that became the primary's is the same copy; a counter one up applied
    /// `batch` (a batch it held already is applied twice); a copy gone is forgotten.
    fn changed(
        &mut self,
        s: usize,
        (before, after): (&[Copy], &[Copy]),
        batch: Option<Batch>,
        source: Option<usize>,
    ) {
        for (k, (b, a)) in before.iter().zip(after).enumerate() {
            if b == a {
                continue;
            }
            let key = Key(k as u64);
            match (*b, *a) {
                (Some((false, _)), Some((true, v))) | (None, Some((_, v))) => {
                    let from = source.and_then(|p| self.copies.get(&(p, key)).cloned().flatten());
                    let line = match (source, &from) {
                        (Some(p), Some(h)) => {
                            format!("from shard {p}, whose copy holds {}", h.len())
                        }
                        (Some(p), None) => format!("from shard {p}, whose batches are not known"),
                        (None, _) => "from no copy".into(),
                    };
                    self.notes
                        .push(format!("shard {s} takes a copy of {key} at {v} {line}"));
                    let held = from.filter(|h| h.len() as f32 == v);
                    self.copies.insert((s, key), held);
                }
                (Some((_, b)), Some((_, a))) if a == b => {}
                (Some((_, b)), Some((_, a))) if a == b + 1.0 && batch.is_some() => {
                    let Some(batch) = batch else { continue };
                    if let Some(Some(held)) = self.copies.get_mut(&(s, key))
                        && !held.insert(batch)
                        && self.twice.is_none()
                    {
                        self.twice = Some(format!(
                            "exactly-once: shard {s} applied batch {batch:?} to its copy of \
                             {key} twice"
                        ));
                    }
                }
                (Some((_, b)), Some((_, a))) => {
                    self.notes
                        .push(format!("shard {s}'s copy of {key} goes from {b} to {a}"));
                    self.copies.insert((s, key), None);
                }
                (Some(_), None) => {
                    self.notes
                        .push(format!("shard {s} drops its copy of {key}"));
                    self.copies.remove(&(s, key));
                }
                (None, None) => {}
            }
        }
    }

    /// A push applied `batch` to `key`.
    fn applied(&mut self, s: usize, key: Key, batch: Batch) {
        if !self.model.entry(key).or_default().insert(batch) && self.twice.is_none() {
            self.twice = Some(format!(
                "exactly-once: shard {s} applied batch {batch:?} to {key} twice"
            ));
        }
    }
}

/// A shard's copy of a key as the model watches it: whether it is a backup copy, and its
/// counter.
type Copy = Option<(bool, f32)>;

/// Locks the disks (a task that panicked holding it is a failed run anyway).
fn lock_disk(d: &std::sync::Mutex<Disk>) -> std::sync::MutexGuard<'_, Disk> {
    d.lock().unwrap_or_else(|p| p.into_inner())
}

struct Sim {
    seed: u64,
    scenario: Scenario,
    rng: StdRng,
    /// Virtual time zero.
    t0: tokio::time::Instant,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    pending: BTreeMap<u64, Envelope>,
    coordinator: Arc<Coordinator>,
    config: CoordinatorConfig,
    /// Calls the coordinator is serving: `(worker slot, request seq, task)`.
    calls: BTreeMap<u64, (usize, u64, tokio::task::JoinHandle<()>)>,
    answers: tokio::sync::mpsc::UnboundedSender<Answer>,
    /// What the coordinator saved last (its disk), and until when it is down.
    store: MemoryStore,
    /// The servers' way to the shards, given to each coordinator and shard that starts.
    link: tokio::sync::mpsc::UnboundedSender<Outgoing>,
    /// Where the shards' tasks put their answers.
    shard_answers: tokio::sync::mpsc::UnboundedSender<ShardAnswer>,
    /// The key the coordinator signs worker tokens with (given to the shards as they join).
    token_key: Token,
    down_until: Option<u64>,
    restarts: u32,
    moved: u32,
    taken_back: u32,
    /// Placements the placer started a worker for.
    placed: BTreeSet<u64>,
    rerouted: u64,
    shards: Vec<SimShard>,
    /// The map the coordinator published last.
    map: ShardMap,
    /// Every key as a chunk reference.
    keys: Vec<ChunkRef>,
    /// The servers' calls to shards, by id.
    links: BTreeMap<u64, LinkCall>,
    /// Every map some node adopted, by epoch: one map per epoch, or two nodes disagree.
    maps: BTreeMap<MapEpoch, ShardMap>,
    /// Crashes may hit the coordinator and the shards in the middle of a move.
    mid_move: bool,
    /// Coordinator crashes are failovers (`Options::failover`).
    failover: bool,
    /// The store as the leading coordinator writes it (its term).
    lead: MemoryStore,
    /// Calls a deposed coordinator still serves: their answers are lost.
    orphans: BTreeSet<u64>,
    /// Coordinators cut off by a failover, their tasks still running.
    old_leaders: Vec<Arc<Coordinator>>,
    /// The job's two coordinators as real clients reach them (`Scenario::standby`).
    standby: Option<Standby>,
    /// While a leader killed by [`Loss::Killed`] is down: whether it wins the next election.
    killed: Option<bool>,
    /// Leaders paused.
    leaders_paused: u32,
    /// Leaders killed, and of them those that won the next election at their own address.
    leaders_killed: (u32, u32),
    /// Real clients the coordinator dropped.
    dropped: u32,
    /// Orders of a deposed leader the shards refused for their term.
    orders_refused: u32,
    /// Nodes partitioned from the others until a time; filters `(kind, answers, until)`.
    cuts: Vec<(Node, u64)>,
    filters: Vec<(Kind, bool, u64)>,
    /// The shards' checkpoints and the model of the keys.
    disk: Arc<std::sync::Mutex<Disk>>,
    shard_crashes: u32,
    workers: Vec<Worker>,
    digest: u64,
    events: u64,
    lost: u64,
    duplicated: u64,
    crashed: u32,
    dead: u32,
    drained: u32,
    left: u32,
    verbose: bool,
    /// Coordinator calls whose connection failed end the worker instead of being repeated.
    give_up: bool,
    log: std::collections::VecDeque<String>,
    /// A replicated job's crashes armed at replication points: `(point, in how many times,
    /// down for)`.
    traps: Vec<(Point, u32, u64)>,
    /// Crashes at each point, in the order of `Point::ALL`.
    hits: [u32; 7],
    /// Shards replaced by their backups, and new backups seeded.
    promotions: u32,
    seedings: u32,
    /// The watches over a replicated job's shards, the current coordinator's last.
    watches: Vec<CancellationToken>,
    /// Restarted shards' joins to the coordinator, by call.
    joining: BTreeMap<u64, usize>,
}

impl Sim {
    async fn new(seed: u64, scenario: Scenario, verbose: bool) -> Result<(Sim, Inbox), String> {
        let (answers, answered) = tokio::sync::mpsc::unbounded_channel();
        let (link, links) = tokio::sync::mpsc::unbounded_channel();
        let (shard_answers, shards_answered) = tokio::sync::mpsc::unbounded_channel();
        let mut inbox = Inbox {
            answers: answered,
            links,
            shards: shards_answered,
        };
        let job = scenario.job();
        let config = CoordinatorConfig {
            job: job.clone(),
            shards: scenario.shards,
            state_file: None,
            stragglers: scenario.stragglers,
            probe_sockets: false,
        };
        let store = MemoryStore::default();
        let lead = store.elect();
        let coordinator = Coordinator::new(config.clone())
            .map_err(|e| format!("coordinator: {e}"))?
            .with_store(Arc::new(lead.clone()));
        coordinator.set_shard_link(Arc::new(SimLink {
            from: Node::Coordinator,
            calls: link.clone(),
        }));
        let coordinator = Arc::new(coordinator);
        // The shards join through the service; each is answered once all have joined.
        for s in 0..scenario.shards {
            let peer = Peer::in_process(Role::Shard, &format!("s{s}"), JOB, addr(1, s as usize));
            let (c, tx) = (coordinator.clone(), answers.clone());
            tokio::spawn(async move {
                let req = Request::ShardJoin {
                    addr: format!("sim:{s}"),
                };
                let resp = c.handle(&peer, req, Parts::default()).await.msg;
                let _ = tx.send(Answer {
                    call: 0,
                    worker: ADMIN,
                    seq: 0,
                    clock: Clock(0),
                    resp,
                });
            });
        }
        let mut assigned = None;
        for _ in 0..scenario.shards {
            match inbox.answers.recv().await.map(|a| a.resp) {
                Some(Response::ShardAssigned { map, token_key, .. }) => {
                    assigned = Some((map, token_key));
                }
                other => return Err(format!("a shard's join was answered {other:?}")),
            }
        }
        let (map, token_key) = assigned.ok_or("no shard")?;
        let layout = job.layout();
        let n = scenario.shards as usize;
        let disk = Arc::new(std::sync::Mutex::new(Disk {
            checkpoints: vec![None; n],
            modelled: vec![BTreeMap::new(); n],
            ..Disk::default()
        }));
        let keys = layout
            .spans()
            .iter()
            .enumerate()
            .map(|(k, span)| ChunkRef::new(Key(k as u64), span.len))
            .collect();
        // As its persister would within half a second.
        coordinator.save_changes().await;
        let mut sim = Sim {
            store,
            lead,
            failover: false,
            orphans: BTreeSet::new(),
            old_leaders: Vec::new(),
            standby: scenario.standby.then(|| Standby {
                leads: 0,
                down: Default::default(),
            }),
            killed: None,
            leaders_paused: 0,
            leaders_killed: (0, 0),
            dropped: 0,
            orders_refused: 0,
            link,
            shard_answers,
            token_key,
            down_until: None,
            restarts: 0,
            moved: 0,
            taken_back: 0,
            placed: BTreeSet::new(),
            rerouted: 0,
            seed,
            rng: StdRng::seed_from_u64(seed),
            t0: tokio::time::Instant::now(),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            pending: BTreeMap::new(),
            coordinator,
            config,
            calls: BTreeMap::new(),
            answers,
            shards: Vec::new(),
            map: map.clone(),
            keys,
            links: BTreeMap::new(),
            maps: BTreeMap::new(),
            mid_move: false,
            cuts: Vec::new(),
            filters: Vec::new(),
            disk,
            shard_crashes: 0,
            workers: Vec::new(),
            digest: 0xcbf2_9ce4_8422_2325,
            events: 0,
            lost: 0,
            duplicated: 0,
            crashed: 0,
            dead: 0,
            drained: 0,
            left: 0,
            verbose,
            give_up: false,
            log: std::collections::VecDeque::new(),
            traps: Vec::new(),
            hits: [0; 7],
            promotions: 0,
            seedings: 0,
            watches: Vec::new(),
            joining: BTreeMap::new(),
            scenario,
        };
        for s in 0..n {
            let state = ShardState::new(ShardId(s as u32), job.clone(), map.clone());
            let shard = sim.shard_server(s, state);
            sim.shards.push(shard);
            // Its first checkpoint, as the shard writes it before it serves.
            sim.checkpoint(s);
        }
        if sim.replicated() {
            // Every copy starts with no batch applied.
            let mut d = lock_disk(&sim.disk);
            for (s, shard) in sim.shards.iter().enumerate() {
                for c in &sim.keys {
                    if shard.state.param(c.key, 0).is_some()
                        || shard.state.backup_param(c.key, 0).is_some()
                    {
                        d.copies.insert((s, c.key), Some(BTreeSet::new()));
                    }
                }
            }
            drop(d);
            sim.watch();
        }
        for _ in 0..sim.scenario.workers {
            sim.start_worker(None);
        }
        for (t, what) in sim.scenario.script.clone() {
            sim.at(t, Node::Coordinator, 0, 0, Body::Script(what));
        }
        sim.at(TICK_MS, Node::Coordinator, 0, 0, Body::Tick);
        Ok((sim, inbox))
    }

    /// A shard server over `state`: the real service, reaching the other shards through the
    /// simulated network and keeping its checkpoints on the simulated disk.
    fn shard_server(&self, s: usize, state: ShardState) -> SimShard {
        let disk = self.disk.clone();
        let store = CheckpointStore::Memory(Arc::new(move |ckpt| {
            lock_disk(&disk).save(s, ckpt);
        }));
        let link = SimLink {
            from: Node::Shard(s),
            calls: self.link.clone(),
        };
        let stop = CancellationToken::new();
        let service = ShardService::new(Arc::new(link), Some(store.clone()), stop.clone());
        service.trust(&self.token_key, JOB);
        // A primary reports a backup it cannot reach to the coordinator.
        service.report_to(COORDINATOR);
        let state = Arc::new(state);
        service.assign(state.clone());
        SimShard {
            service: Arc::new(service),
            state,
            store,
            tasks: BTreeMap::new(),
            down: None,
            stop,
        }
    }

    fn faulty(&self) -> bool {
        self.now < FAULTS_END_MS
    }

    /// Whether the job keeps more than one copy of its key ranges.
    fn replicated(&self) -> bool {
        self.scenario.replicas > 1
    }

    /// The current coordinator watches the shards of a replicated job, as `edl-ps
    /// coordinator` does (the watch of one that crashed stops with it).
    fn watch(&mut self) {
        if !self.replicated() {
            return;
        }
        let stop = CancellationToken::new();
        let c = self.coordinator.clone();
        let token = stop.clone();
        tokio::spawn(async move { c.watch_shards(token).await });
        self.watches.push(stop);
    }

    /// Schedules a delivery at virtual time `t`.
    fn at(&mut self, t: u64, to: Node, worker: usize, seq: u64, body: Body) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.pending.insert(
            self.seq,
            Envelope {
                to,
                worker,
                seq,
                body,
            },
        );
    }

    /// Sends over the network: delayed (so messages overtake each other), maybe lost, maybe
    /// (a push) delivered twice. QUIC streams neither lose nor repeat a message: a loss is the
    /// connection failing, which the worker notices after a timeout, and then repeats the
    /// call on a new connection, as the client does by default (with `give_up`, a
    /// coordinator call lost so ends the worker instead: it exits and its lease expires).
    fn send(&mut self, from: Node, to: Node, worker: usize, seq: u64, body: Body) {
        let faulty = self.faulty();
        let push = matches!(
            body,
            Body::Push { .. }
                | Body::Pushed { .. }
                | Body::Moved { .. }
                | Body::GetMap
                | Body::FreshMap(_)
        );
        let heartbeat = matches!(body, Body::Heartbeat(_) | Body::Beat { .. });
        let cut = self.cut(from) || self.cut(to) || self.filtered(&body);
        if cut || (faulty && self.rng.random_bool(self.scenario.loss)) {
            self.lost += 1;
            let why = if cut { "cut" } else { "lost" };
            self.note(format!("{why} {to:?} <- w{worker} {body:?}"));
            // A heartbeat's connection failing is noticed at the next call.
            if !heartbeat {
                let then = if push {
                    Body::Retry
                } else {
                    Body::ConnectionLost
                };
                self.at(
                    self.now + CONNECTION_TIMEOUT_MS,
                    Node::Worker(worker),
                    worker,
                    seq,
                    then,
                );
            }
            return;
        }
        let copies = if faulty && push && self.rng.random_bool(self.scenario.duplicate) {
            self.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = self.rng.random_range(1..=self.scenario.max_delay_ms.max(1));
            self.at(self.now + delay, to, worker, seq, body.clone());
        }
    }

    /// Whether `node` is partitioned from the others, or (a shard) down, now.
    fn cut(&self, node: Node) -> bool {
        let now = self.now;
        self.cuts.iter().any(|&(n, until)| n == node && now < until)
            || matches!(node, Node::Shard(s) if self.shards[s].down.is_some())
    }

    /// Whether a filter drops `body` now.
    fn filtered(&self, body: &Body) -> bool {
        let Some((kind, answer)) = body.kind() else {
            return false;
        };
        let now = self.now;
        self.filters
            .iter()
            .any(|&(k, answers, until)| k == kind && answers == answer && now < until)
    }

    fn note(&mut self, line: String) {
        let line = format!("{:>7} ms  {line}", self.now);
        self.log.push_back(line);
        if !self.verbose && self.log.len() > 40 {
            self.log.pop_front();
        }
    }

    /// A worker starts (for a placement the coordinator asked for, if `placement`).
    fn start_worker(&mut self, placement: Option<u64>) {
        let slot = self.workers.len();
        self.workers.push(Worker {
            id: None,
            phase: Phase::Registering,
            seq: 0,
            clock: Clock(0),
            part: None,
            span: None,
            acks: BTreeSet::new(),
            map: self.map.clone(),
            drain: false,
            token: None,
            placement,
            slow: 1,
            client: None,
        });
        if self.scenario.clients {
            self.start_client(slot, placement);
        } else {
            self.request(slot, Body::Register);
        }
    }

    /// Worker `slot` is a real client: the client library's `Session`, in the trainer's loop
    /// (pull, compute, push, commit; leave when out of data or drained), over the simulated
    /// network.
    fn start_client(&mut self, slot: usize, placement: Option<u64>) {
        let name = format!("w{slot}");
        let cfg = edl_worker::ClientConfig {
            coordinator: match &self.standby {
                Some(_) => COORDINATORS.join(","),
                None => COORDINATOR.to_string(),
            },
            identity: edl_shared::Identity::unsigned(Role::Worker, &name, JOB),
            settings: edl_shared::transport::TransportSettings::default(),
        };
        let net = SimNet {
            from: Node::Worker(slot),
            calls: self.link.clone(),
            down: self.standby.as_ref().map(|s| s.down.clone()),
        };
        let step = Duration::from_millis(self.scenario.step_ms);
        let outcome = Arc::new(std::sync::Mutex::new(None));
        let ended = outcome.clone();
        let task = tokio::spawn(async move {
            let r = client_loop(cfg, Dialer::Local(Arc::new(net)), placement, step).await;
            let line = match r {
                Ok(steps) => format!("left after {steps} steps"),
                Err(e) => format!("exited: {e}"),
            };
            *ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(line);
        });
        self.workers[slot].phase = Phase::Pushing;
        self.workers[slot].client = Some((task, outcome));
    }

    /// Real clients whose task ended are done.
    fn clients_ended(&mut self) {
        for slot in 0..self.workers.len() {
            let w = &mut self.workers[slot];
            let Some((task, outcome)) = &w.client else {
                continue;
            };
            if w.phase == Phase::Pushing && task.is_finished() {
                w.phase = Phase::Done;
                let line = outcome.lock().unwrap_or_else(|p| p.into_inner()).take();
                if line.as_deref().is_some_and(|l| l.starts_with("left")) {
                    self.left += 1;
                }
                if line
                    .as_deref()
                    .is_some_and(|l| l.contains("dropped by the coordinator"))
                {
                    self.dropped += 1;
                }
                self.note(format!("w{slot} {}", line.unwrap_or_default()));
            }
        }
    }

    /// A worker's next request to the coordinator, awaited.
    fn request(&mut self, slot: usize, body: Body) {
        self.seq += 1;
        let seq = self.seq;
        self.workers[slot].seq = seq;
        self.send(Node::Worker(slot), Node::Coordinator, slot, seq, body);
    }

    /// The current batch's pushes to the shards that have not acknowledged it.
    fn push(&mut self, slot: usize) {
        self.seq += 1;
        let seq = self.seq;
        let w = &mut self.workers[slot];
        w.seq = seq;
        let (Some(id), Some(span)) = (w.id, w.span) else {
            return;
        };
        let clock = w.clock;
        let mut by_shard: BTreeMap<ShardId, Vec<ChunkRef>> = BTreeMap::new();
        for c in self.keys.iter().filter(|c| !w.acks.contains(&c.key)) {
            if let Some(owner) = w.map.owner(c.key) {
                by_shard.entry(owner).or_default().push(*c);
            }
        }
        let epoch = w.map.epoch;
        for (shard, chunks) in by_shard {
            let body = Body::Push {
                id,
                clock,
                span,
                epoch,
                chunks,
            };
            let to = Node::Shard(shard.0 as usize);
            self.send(Node::Worker(slot), to, slot, seq, body);
        }
    }

    /// Delivers events in virtual-time order, and the coordinator's answers as its tasks give
    /// them; the runtime's clock jumps to whichever comes next.
    async fn run(&mut self, inbox: &mut Inbox) -> Result<(), String> {
        loop {
            let next = self.queue.peek().map(|Reverse((t, _))| *t);
            let until = self.t0 + Duration::from_millis(next.unwrap_or(DEADLINE_MS + 1));
            tokio::select! {
                biased;
                Some(a) = inbox.answers.recv() => {
                    self.catch_up();
                    self.runaway()?;
                    self.answered(a)?;
                    self.check_now()?;
                    continue;
                }
                Some((from, addr, req, payload, reply)) = inbox.links.recv() => {
                    self.catch_up();
                    self.runaway()?;
                    self.link_call(from, &addr, req, payload, reply)?;
                    continue;
                }
                Some(a) = inbox.shards.recv() => {
                    self.catch_up();
                    self.runaway()?;
                    self.shard_answered(a)?;
                    self.check_now()?;
                    continue;
                }
                () = tokio::time::sleep_until(until) => {}
            }
            let Some(Reverse((t, n))) = self.queue.pop() else {
                break;
            };
            let Some(env) = self.pending.remove(&n) else {
                continue;
            };
            self.now = t;
            if self.now > DEADLINE_MS {
                let status = self.coordinator.status();
                return Err(format!(
                    "liveness: the job did not finish by {DEADLINE_MS} ms ({} of {} samples \
                     done; workers: {:?})",
                    status.samples_done,
                    status.samples_total,
                    self.workers.iter().map(|w| w.phase).collect::<Vec<_>>()
                ));
            }
            self.runaway()?;
            let line = format!(
                "{:?} <- w{} #{} {:?}",
                env.to, env.worker, env.seq, env.body
            );
            mix(&mut self.digest, format!("{t} {line}").as_bytes());
            self.note(line);
            match env.to {
                Node::Coordinator => self.at_coordinator(env)?,
                Node::Shard(s) => self.at_shard(s, env)?,
                Node::Worker(slot) => self.at_worker(slot, env)?,
            }
            self.check_now()?;
            self.clients_ended();
            // The job is over once its data is and every worker is gone, and no move is
            // still under way.
            if self.finished()
                && !self.moving()
                && !self.replicating()
                && self
                    .workers
                    .iter()
                    .all(|w| matches!(w.phase, Phase::Done | Phase::Crashed))
            {
                break;
            }
        }
        for watch in &self.watches {
            watch.cancel();
        }
        if !self.finished() {
            return Err("liveness: no event left and the job is not finished".into());
        }
        // Deliver what is still in flight to the shards (late pushes of crashed workers: none
        // may count), and let a crashed coordinator come back (a restarting shard waits for it).
        while let Some(Reverse((t, n))) = self.queue.pop() {
            let Some(env) = self.pending.remove(&n) else {
                continue;
            };
            self.now = t;
            match (env.to, &env.body) {
                (Node::Shard(s), _) => {
                    self.runaway()?;
                    self.at_shard(s, env)?;
                }
                (Node::Coordinator, Body::Restart) => self.at_coordinator(env)?,
                _ => {}
            }
        }
        for (_, (_, _, task)) in std::mem::take(&mut self.calls) {
            task.abort();
        }
        // The shards finish what reached them (a late push may wait for a map a while); a call
        // to another shard finds none now.
        loop {
            for shard in &mut self.shards {
                shard.tasks.retain(|_, (_, t)| !t.is_finished());
            }
            if self.shards.iter().all(|s| s.tasks.is_empty()) {
                break;
            }
            tokio::select! {
                Some((.., reply)) = inbox.links.recv() => {
                    let _ = reply.send(Err(CallError::Address("the run is over".into())));
                }
                Some(_) = inbox.shards.recv() => {}
                Some(_) = inbox.answers.recv() => {}
                () = tokio::time::sleep(Duration::from_millis(TICK_MS)) => {}
            }
            self.check_now()?;
        }
        self.check_end()
    }

    /// Counts a delivery; a run that makes far more than any job needs is a livelock.
    fn runaway(&mut self) -> Result<(), String> {
        self.events += 1;
        if self.events > MAX_EVENTS {
            return Err(format!(
                "liveness: {MAX_EVENTS} deliveries by {} ms: a livelock",
                self.now
            ));
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.coordinator.inspect(|st| st.finished())
    }

    /// Virtual time as the runtime's clock has it (a coordinator task just gave something).
    fn catch_up(&mut self) {
        let elapsed = (tokio::time::Instant::now() - self.t0).as_millis();
        self.now = self.now.max(elapsed as u64);
    }

    /// A move is under way: an operator's move request not answered yet, a range on its way
    /// between shards, or a move the coordinator has not settled.
    fn moving(&self) -> bool {
        let moves =
            |c: &LinkCall| matches!(c.req, Request::MoveOut { .. } | Request::MoveIn { .. });
        self.links.values().any(moves)
            || (self.shards.iter()).any(|s| s.down.is_none() && !s.state.ranges_out().is_empty())
            || self.coordinator.inspect(|st| st.pending_move().is_some())
            || self.calls.values().any(|&(w, seq, ref task)| {
                w == ADMIN && (seq == MOVE || (seq == RESUME && !task.is_finished()))
            })
    }

    /// A replicated job is not back to its copies: a key has fewer than the job keeps (or
    /// than there are shards), a shard is down, one the map does not place still holds copies
    /// (replaced while cut off, it must learn that it was), or a copy is on its way to a new
    /// backup.
    fn replicating(&self) -> bool {
        if !self.replicated() {
            return false;
        }
        let want = self.scenario.replicas.min(self.scenario.shards) as usize;
        let short = (self.keys.iter()).any(|c| {
            self.map.owner(c.key).is_some() as usize + self.map.backups_of(c.key).count() < want
        });
        let copying =
            |c: &LinkCall| matches!(c.req, Request::CopyOut { .. } | Request::CopyIn { .. });
        let stale = (self.shards.iter()).any(|s| {
            let st = s.state.stats();
            !self.map.places(st.shard) && (!st.ranges.is_empty() || !st.backups.is_empty())
        });
        short
            || stale
            || self.shards.iter().any(|s| s.down.is_some())
            || self.links.values().any(copying)
    }

    /// What must hold after every step: map epochs only grow, through coordinator restarts
    /// too; no two nodes hold different maps of one epoch; no key was applied a batch twice.
    fn check_now(&mut self) -> Result<(), String> {
        // Every answer waited for its changes to be durable: a restarted coordinator never
        // meets a report of something it acknowledged and forgot.
        let lost = self.coordinator.inspect(|st| st.lost_acks());
        if lost > 0 {
            return Err(format!(
                "durability: {lost} acknowledged changes were missing after a restart"
            ));
        }
        // A leader cut off from the store (`--failover`) holds in memory what it could not
        // write; nobody learns it (maps go out only once durable), and the standby that
        // takes over never had it: the maps that count are the leader's while it can write.
        let cut_off = self.failover && self.down_until.is_some();
        if let Some(map) = self.coordinator.inspect(|st| st.map()).filter(|_| !cut_off) {
            if map.epoch < self.map.epoch {
                return Err(format!(
                    "map epochs: the coordinator went back from {} to {}",
                    self.map.epoch, map.epoch
                ));
            }
            self.saw_map(&map)?;
            if map.epoch > self.map.epoch {
                let runs = |rs: &[edl_proto::job::RangeOwner]| {
                    rs.iter()
                        .map(|r| format!("{}..{} s{}", r.start, r.end, r.shard.0))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                self.note(format!(
                    "the coordinator's map {}: {}; backups {}",
                    map.epoch,
                    runs(&map.ranges),
                    runs(&map.backups)
                ));
            }
            if self.replicated() && map.epoch > self.map.epoch {
                let dropped = (self.map.shards.iter())
                    .filter(|s| self.map.places(s.id) && !map.places(s.id))
                    .count();
                self.promotions += dropped as u32;
                let backed = |m: &ShardMap| m.backups.iter().map(|r| r.end - r.start).sum::<u64>();
                if backed(&map) > backed(&self.map) {
                    self.seedings += 1;
                }
            }
            self.map = map;
        }
        for s in 0..self.shards.len() {
            let map = self.shards[s].state.read_map();
            self.saw_map(&map)?;
        }
        let (twice, notes) = {
            let mut d = lock_disk(&self.disk);
            // A copy dropped outside the shard's served requests (a primary's forward that
            // learnt a newer map from its backup) is forgotten too.
            let shards = &self.shards;
            d.copies.retain(|(s, k), _| {
                let st = &shards[*s].state;
                st.param(*k, 0).is_some() || st.backup_param(*k, 0).is_some()
            });
            (d.twice.take(), std::mem::take(&mut d.notes))
        };
        for line in notes {
            self.note(line);
        }
        match twice {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records a map some node adopted: one map per epoch.
    fn saw_map(&mut self, map: &ShardMap) -> Result<(), String> {
        match self.maps.get(&map.epoch) {
            Some(known) if known != map => Err(format!(
                "maps: two different maps of epoch {}: {known:?} and {map:?}",
                map.epoch
            )),
            Some(_) => Ok(()),
            None => {
                self.maps.insert(map.epoch, map.clone());
                Ok(())
            }
        }
    }

    /// A call over the network: the request travels (or its connection fails). Every map a
    /// call carries is one some node adopts. A real client's call may be lost, its answer too,
    /// at random while faults last, and is dropped by a filter of its kind.
    fn link_call(
        &mut self,
        from: Node,
        addr: &str,
        req: Request,
        payload: Parts,
        reply: ReplyTo,
    ) -> Result<(), String> {
        self.seq += 1;
        let id = self.seq;
        // A client's call to the address that does not lead is the standby's to answer.
        let standby = match (&self.standby, from) {
            (Some(sb), Node::Worker(_)) => (COORDINATORS.iter().position(|a| *a == addr))
                .filter(|&i| i != sb.leads)
                .map(|_| COORDINATORS[sb.leads].to_string()),
            _ => None,
        };
        let to = match addr.strip_prefix("sim:") {
            Some("coordinator" | "standby") => Some(Node::Coordinator),
            Some(n) => (n.parse::<usize>().ok())
                .filter(|&n| n < self.shards.len())
                .map(Node::Shard),
            None => None,
        };
        let line = match &req {
            Request::SetMap { map, .. }
            | Request::CopyOut { map, .. }
            | Request::CopyIn { map, .. }
            | Request::MoveOut { map, .. }
            | Request::MoveIn { map, .. } => {
                format!(
                    "{from:?} calls {addr} #{id}: {} ({})",
                    req.name(),
                    map.epoch
                )
            }
            _ => format!("{from:?} calls {addr} #{id}: {}", req.name()),
        };
        mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
        self.note(line);
        let Some(to) = to else {
            let _ = reply.send(Err(CallError::Address(format!("no server at {addr}"))));
            return Ok(());
        };
        if let Request::SetMap { map, .. }
        | Request::MoveOut { map, .. }
        | Request::MoveIn { map, .. }
        | Request::CopyOut { map, .. }
        | Request::CopyIn { map, .. } = &req
        {
            self.saw_map(map)?;
        }
        // A primary sending a push to a backup, or a copy to a new backup, may crash as soon
        // as it sent it.
        let sent = match (&req, from) {
            (Request::Replicate { .. }, Node::Shard(p)) => Some((Point::Forwarded, p)),
            (Request::CopyIn { .. }, Node::Shard(p)) => Some((Point::CopySent, p)),
            _ => None,
        };
        let lost = self.lost_call(from, &req, false);
        self.links.insert(
            id,
            LinkCall {
                from,
                to,
                req,
                payload,
                reply,
                answer: None,
            },
        );
        // A paused leader answers no client (a killed one's calls fail where it is served).
        let paused = standby.is_none()
            && self.killed.is_none()
            && matches!(from, Node::Worker(_))
            && self.standby.as_ref().is_some_and(Standby::leader_is_down);
        if lost || paused || self.cut(from) || self.cut(to) {
            self.link_failed(id);
        } else if let Some(leader) = standby {
            let answer = Response::NotLeader {
                leader: Some(leader),
            };
            self.answer_link(id, Ok(Frame::new(answer)));
        } else {
            let delay = self.delay();
            self.at(self.now + delay, to, 0, id, Body::Call(id));
        }
        if let Some((point, p)) = sent {
            self.trap(point, p);
        }
        Ok(())
    }

    /// Whether a real client's call (or, with `answer`, its answer) is lost: at random while
    /// faults last, or by a filter of its kind.
    fn lost_call(&mut self, from: Node, req: &Request, answer: bool) -> bool {
        if !matches!(from, Node::Worker(_)) {
            return false;
        }
        let now = self.now;
        let filtered = kind_of(req).is_some_and(|kind| {
            (self.filters.iter()).any(|&(k, a, until)| k == kind && a == answer && now < until)
        });
        filtered || (self.faulty() && self.rng.random_bool(self.scenario.loss))
    }

    /// The call `id` fails with its connection, after the timeout.
    fn link_failed(&mut self, id: u64) {
        if let Some(call) = self.links.get_mut(&id)
            && call.answer.is_none()
        {
            let why = format!("{:?} did not answer", call.to);
            call.answer = Some(Err(CallError::Connection(quinn::ConnectionError::TimedOut)));
            let (t, to) = (self.now + CONNECTION_TIMEOUT_MS, call.from);
            self.at(t, to, 0, id, Body::LinkReply(id));
            self.lost += 1;
            self.note(format!("call #{id} fails: {why}"));
        }
    }

    /// A server answers call `id`: the answer travels back.
    fn answer_link(&mut self, id: u64, answer: Answered) {
        let Some((from, to, req)) = (self.links.get(&id)).map(|c| (c.from, c.to, c.req.clone()))
        else {
            return;
        };
        // With `mid_move`, a server's answer across a partition is lost: the caller does not
        // learn what the shard did (a move's outcome unknown to it). A client's always is.
        let across = self.cut(from) || self.cut(to);
        let client = matches!(from, Node::Worker(_));
        if (across && (self.mid_move || client)) || self.lost_call(from, &req, true) {
            self.link_failed(id);
            return;
        }
        if self.links.get(&id).is_some_and(|c| c.answer.is_none()) {
            let delay = self.delay();
            if let Some(call) = self.links.get_mut(&id) {
                call.answer = Some(answer);
            }
            self.at(self.now + delay, from, 0, id, Body::LinkReply(id));
        }
    }

    /// The answer to call `id` reaches its caller (if the caller's task is still there).
    fn link_reply(&mut self, id: u64) {
        if let Some(call) = self.links.remove(&id) {
            let answer = call
                .answer
                .unwrap_or_else(|| Err(CallError::Address("no answer".into())));
            let _ = call.reply.send(answer);
        }
    }

    /// The consistency model, checked from the workers' side: no worker the coordinator
    /// counts (registered, active, holding data) has sent a clock below `clock - s` when
    /// worker `slot` is granted `clock`. The coordinator knows no clock of a worker above the
    /// last it sent, so a worker behind that bound means a grant the model forbids, whatever
    /// clock the coordinator answered with.
    fn check_grant(&self, slot: usize, clock: Clock, s: u64) -> Result<(), String> {
        let now = edl_shared::clock::now();
        // By id and name: a restarted coordinator may hand an id out again.
        let active: BTreeSet<(WorkerId, String)> = self.coordinator.inspect(|st| {
            st.members(now)
                .into_iter()
                .filter(|m| m.state == edl_proto::msg::WorkerState::Active)
                .map(|m| (m.id, m.name))
                .collect()
        });
        for (other, w) in self.workers.iter().enumerate() {
            let counting = other != slot
                && matches!(w.phase, Phase::Pushing | Phase::Committing)
                && w.id
                    .is_some_and(|id| active.contains(&(id, format!("w{other}"))));
            let sent = w.clock.0 + u64::from(w.phase == Phase::Committing);
            if counting && sent + s < clock.0 {
                return Err(format!(
                    "consistency: w{slot} granted clock {} while w{other} has sent no clock past \
                     {sent}, {}",
                    clock.0, self.scenario.consistency
                ));
            }
        }
        Ok(())
    }

    /// A network delay.
    fn delay(&mut self) -> u64 {
        self.rng.random_range(1..=self.scenario.max_delay_ms.max(1))
    }

    /// The coordinator's process ends, or (`orphan`) it is deposed and runs on: the calls it
    /// was serving fail with their connections, their tasks aborted or their answers lost.
    fn end_calls(&mut self, orphan: bool) {
        for (call, (worker, seq, task)) in std::mem::take(&mut self.calls) {
            // A restarted shard's join fails with the connection: it joins again.
            if let Some(s) = self.joining.remove(&call) {
                self.at(self.now + TICK_MS, Node::Shard(s), 0, 0, Body::ShardRestart);
            }
            if orphan {
                self.orphans.insert(call);
            } else {
                task.abort();
            }
            if worker == LINK {
                self.link_failed(seq);
            } else if worker != ADMIN {
                let t = self.now + CONNECTION_TIMEOUT_MS;
                self.at(t, Node::Worker(worker), worker, seq, Body::ConnectionLost);
            }
        }
    }

    /// A worker's (or with [`ADMIN`], an operator's) call to the coordinator: its service
    /// serves it in a task of its own, which reports the answer when it has one.
    fn call(&mut self, worker: usize, seq: u64, clock: Clock, req: Request) {
        let peer = if worker == ADMIN {
            Peer::in_process(Role::Admin, "operator", JOB, addr(2, 0))
        } else {
            Peer::in_process(Role::Worker, &format!("w{worker}"), JOB, addr(0, worker))
        };
        self.seq += 1;
        let call = self.seq;
        let (c, tx) = (self.coordinator.clone(), self.answers.clone());
        let task = tokio::spawn(async move {
            let resp = c.handle(&peer, req, Parts::default()).await.msg;
            let _ = tx.send(Answer {
                call,
                worker,
                seq,
                clock,
                resp,
            });
        });
        self.calls.insert(call, (worker, seq, task));
    }

    /// A real client's call (or a shard's: a primary reporting a backup it cannot reach)
    /// reaches the coordinator: its service serves it in a task of its own, which reports the
    /// answer when it has one.
    fn serve_coordinator(&mut self, id: u64) {
        let Some(call) = self.links.get(&id).filter(|c| c.answer.is_none()) else {
            return;
        };
        let peer = match call.from {
            Node::Worker(slot) => {
                Peer::in_process(Role::Worker, &format!("w{slot}"), JOB, addr(0, slot))
            }
            Node::Shard(n) => Peer::in_process(Role::Shard, &format!("s{n}"), JOB, addr(1, n)),
            Node::Coordinator => return,
        };
        let (req, payload) = (call.req.clone(), call.payload.clone());
        self.seq += 1;
        let n = self.seq;
        let (c, tx) = (self.coordinator.clone(), self.answers.clone());
        let task = tokio::spawn(async move {
            let resp = if c.allowed(peer.role, &req) {
                c.handle(&peer, req, payload).await.msg
            } else {
                Response::error(ErrorCode::Forbidden, "not allowed")
            };
            let _ = tx.send(Answer {
                call: n,
                worker: LINK,
                seq: id,
                clock: Clock(0),
                resp,
            });
        });
        self.calls.insert(n, (LINK, id, task));
    }

    /// An answer from the coordinator goes back over the network; a grant is checked against
    /// the consistency model first.
    fn answered(&mut self, a: Answer) -> Result<(), String> {
        self.calls.remove(&a.call);
        if self.orphans.remove(&a.call) {
            self.note(format!(
                "a deposed coordinator's answer to call {} is lost",
                a.call
            ));
            return Ok(());
        }
        if a.worker == LINK {
            let line = format!("coordinator answers call #{}", a.seq);
            mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
            self.note(line);
            // SSP(s): a worker at clock c goes on only while the slowest counting worker is at
            // c - s or later (a draining one leaves instead).
            let asked = self.links.get(&a.seq).map(|c| &c.req);
            if let (
                Some(Request::Clock { clock, worker, .. }),
                Response::ClockGranted { min_clock, drain },
            ) = (asked, &a.resp)
            {
                let bound = self.scenario.consistency.staleness();
                if bound.is_some_and(|s| !drain && min_clock.0.saturating_add(s) < clock.0) {
                    return Err(format!(
                        "consistency: {worker} granted clock {} with the slowest at {}, {}",
                        clock.0, min_clock.0, self.scenario.consistency
                    ));
                }
            }
            self.answer_link(a.seq, Ok(Frame::new(a.resp)));
            return Ok(());
        }
        let line = format!("coordinator answers w{} #{}", a.worker, a.seq);
        mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
        self.note(line);
        if a.worker == ADMIN {
            if let Some(s) = self.joining.remove(&a.call) {
                return self.rejoined(s, a.resp);
            }
            match a.resp {
                Response::Ack => self.drained += 1,
                Response::Resharded { moves, map } => {
                    self.moved += moves.len() as u32;
                    self.note(format!("operator: moved, map {}", map.epoch));
                }
                Response::Error { message, .. } => self.note(format!("operator: {message}")),
                _ => {}
            }
            return Ok(());
        }
        let body = match a.resp {
            Response::Registered {
                worker,
                map,
                clock,
                token,
                ..
            } => Body::Registered {
                id: worker,
                clock,
                map: Box::new(map),
                token,
            },
            Response::Partition { partition, clock } => Body::Leased {
                part: partition,
                clock,
            },
            Response::ClockGranted { min_clock, drain } => {
                // SSP(s): a worker at clock c goes on only while the slowest counting worker
                // is at c - s or later (a draining one leaves instead).
                let bound = self.scenario.consistency.staleness();
                if bound.is_some_and(|s| !drain && min_clock.0.saturating_add(s) < a.clock.0) {
                    return Err(format!(
                        "consistency: w{} granted clock {} with the slowest at {}, {}",
                        a.worker, a.clock.0, min_clock.0, self.scenario.consistency
                    ));
                }
                if let Some(s) = bound.filter(|_| !drain) {
                    self.check_grant(a.worker, a.clock, s)?;
                }
                Body::Granted { drain }
            }
            Response::Beat { drain, .. } => Body::Beat { drain },
            Response::Map(map) => Body::FreshMap(Box::new(map)),
            Response::Ack => Body::Left,
            Response::Error { code, .. }
                if ErrorCode::from_u16(code) == Some(ErrorCode::NotReady) =>
            {
                Body::NotReady
            }
            Response::Error { message, .. } => Body::Refused(message),
            other => return Err(format!("the coordinator answered {other:?}")),
        };
        self.send(
            Node::Coordinator,
            Node::Worker(a.worker),
            a.worker,
            a.seq,
            body,
        );
        Ok(())
    }

    fn at_coordinator(&mut self, env: Envelope) -> Result<(), String> {
        let (slot, seq) = (env.worker, env.seq);
        // Faults of the network and the shards, and the shards' periodic checkpoints, do not
        // depend on the coordinator.
        match env.body {
            Body::Script(
                f @ (Scripted::Partition(..)
                | Scripted::Filter { .. }
                | Scripted::ShardCrash(..)
                | Scripted::CrashAt(..)),
            ) => return self.fault(f),
            // A shard's answer reaches the coordinator's task (gone if it crashed since).
            Body::LinkReply(id) => {
                self.link_reply(id);
                return Ok(());
            }
            Body::Script(Scripted::Slow(n, factor)) => {
                if let Some(slot) = self.live_worker(n) {
                    self.note(format!("w{slot} computes {factor} times slower"));
                    self.workers[slot].slow = factor;
                }
                return Ok(());
            }
            Body::Place(id) => {
                self.note(format!("the placer starts a worker for placement {id}"));
                self.start_worker(Some(id));
                return Ok(());
            }
            Body::Tick if self.now.is_multiple_of(CHECKPOINT_MS) => {
                for s in 0..self.shards.len() {
                    // Finished tasks are forgotten.
                    self.shards[s].tasks.retain(|_, (_, t)| !t.is_finished());
                    if self.shards[s].down.is_none() {
                        self.checkpoint(s);
                    }
                }
            }
            _ => {}
        }
        // A leader cut off from the store serves on until the standby leads.
        let serving = self.failover && self.killed.is_none() && !matches!(env.body, Body::Restart);
        if self.down_until.is_some() && !serving {
            match env.body {
                Body::Restart => {
                    if self.failover {
                        // The clients find the old leader deposed and move to the new one.
                        self.end_calls(true);
                    }
                    let saved = self.store.latest().map_err(|e| e.to_string())?;
                    let restored = match saved {
                        Some(snap) => Coordinator::restored(snap, self.config.clone()),
                        None => Coordinator::new(self.config.clone()),
                    }
                    .map_err(|e| format!("the coordinator cannot restore its state: {e}"))?;
                    // A new leader, at the next term: whoever led before writes no more. (A
                    // leader cut off reaches the store again now, to be refused.)
                    self.lead.reconnect();
                    self.lead = self.store.elect();
                    // With a standby: a killed leader back at its address wins, or the
                    // standby does (always, for a leader cut off: it still runs where it led).
                    let killed = self.killed.take();
                    if let Some(sb) = &mut self.standby {
                        sb.down().clear();
                        if killed != Some(true) {
                            sb.leads = 1 - sb.leads;
                        }
                        let at = COORDINATORS[sb.leads];
                        self.note(format!("the coordinator at {at} is elected"));
                    }
                    let restored = restored.with_store(Arc::new(self.lead.clone()));
                    restored.set_shard_link(Arc::new(SimLink {
                        from: Node::Coordinator,
                        calls: self.link.clone(),
                    }));
                    self.coordinator = Arc::new(restored);
                    // As `edl-ps coordinator` does on start: settle a move left in its middle.
                    let c = self.coordinator.clone();
                    let task = tokio::spawn(async move { c.resume().await });
                    self.seq += 1;
                    self.calls.insert(self.seq, (ADMIN, RESUME, task));
                    self.down_until = None;
                    self.restarts += 1;
                    self.note("coordinator restarted from its saved state".into());
                    self.watch();
                }
                Body::Tick => self.at(self.now + TICK_MS, Node::Coordinator, 0, 0, Body::Tick),
                Body::Script(Scripted::Join) => self.start_worker(None),
                Body::Script(Scripted::Crash(n)) => self.crash_worker(n),
                // An operator's drain fails; a crashed coordinator cannot crash again.
                Body::Script(_) => {}
                // A call to a coordinator that is down fails with its connection.
                Body::Call(id) => self.link_failed(id),
                Body::Heartbeat(_) => {}
                Body::GetMap => {
                    let t = self.now + CONNECTION_TIMEOUT_MS;
                    self.at(t, Node::Worker(slot), slot, seq, Body::Retry);
                }
                _ => self.at(
                    self.now + CONNECTION_TIMEOUT_MS,
                    Node::Worker(slot),
                    slot,
                    seq,
                    Body::ConnectionLost,
                ),
            }
            return Ok(());
        }
        match env.body {
            // The coordinator drives a move to its end before it may crash (moves across a
            // coordinator crash are not simulated yet).
            Body::Script(Scripted::CoordinatorCrash(_)) if !self.mid_move && self.moving() => {}
            // A leader already cut off is not cut off again.
            Body::Script(Scripted::CoordinatorCrash(_)) if self.down_until.is_some() => {}
            Body::Script(Scripted::LeaderLost(..))
                if self.down_until.is_some() || (!self.mid_move && self.moving()) => {}
            Body::Script(Scripted::LeaderLost(down, loss @ (Loss::CutOff | Loss::Paused))) => {
                if loss == Loss::Paused
                    && let Some(sb) = &self.standby
                {
                    let at = sb.leader_down();
                    self.leaders_paused += 1;
                    self.note(format!(
                        "the leading coordinator at {at} is paused for {down} ms"
                    ));
                }
                self.at(
                    self.now,
                    Node::Coordinator,
                    0,
                    0,
                    Body::Script(Scripted::CoordinatorCrash(down)),
                );
            }
            Body::Script(Scripted::LeaderLost(down, Loss::Killed(wins))) => {
                self.down_until = Some(self.now + down);
                self.at(self.now + down, Node::Coordinator, 0, 0, Body::Restart);
                self.killed = Some(wins);
                self.leaders_killed.0 += 1;
                self.leaders_killed.1 += u32::from(wins);
                if let Some(sb) = &self.standby {
                    let at = sb.leader_down();
                    let next = if wins { at } else { COORDINATORS[1 - sb.leads] };
                    self.note(format!(
                        "the leading coordinator at {at} is killed for {down} ms (the standby \
                         names it still); {next} leads next"
                    ));
                }
                self.lead.cut_off();
                self.end_calls(false);
                if let Some(watch) = self.watches.last() {
                    watch.cancel();
                }
            }
            Body::Script(Scripted::CoordinatorCrash(down)) => {
                self.down_until = Some(self.now + down);
                self.at(self.now + down, Node::Coordinator, 0, 0, Body::Restart);
                if self.failover {
                    // Cut off from the store, not from the workers: it serves on, and what it
                    // must write first waits, until a standby leads.
                    self.note(format!(
                        "the leading coordinator is cut off from the store; a standby leads in \
                         {down} ms"
                    ));
                    self.lead.cut_off();
                    self.old_leaders.push(self.coordinator.clone());
                    return Ok(());
                }
                self.note(format!("the coordinator crashes for {down} ms"));
                self.end_calls(false);
                if let Some(watch) = self.watches.last() {
                    watch.cancel();
                }
            }
            Body::Script(Scripted::Move(n, m)) => self.operator_move(n, m),
            Body::Tick => {
                // A placer: a worker for every placement the coordinator asks for, started
                // a moment later.
                let placements = self.coordinator.inspect(|st| st.placements());
                for p in placements.iter().filter(|p| p.is_pending()) {
                    if self.placed.insert(p.id) {
                        self.at(
                            self.now + PLACE_MS,
                            Node::Coordinator,
                            0,
                            0,
                            Body::Place(p.id),
                        );
                    }
                }
                if self.now.is_multiple_of(SAVE_MS) {
                    let c = self.coordinator.clone();
                    tokio::spawn(async move { c.save_changes().await });
                }
                let dead = self.coordinator.sweep(edl_shared::clock::now());
                if dead > 0 {
                    self.dead += dead as u32;
                    self.note(format!("coordinator: {dead} declared dead"));
                }
                if !self.faulty()
                    && !self
                        .workers
                        .iter()
                        .any(|w| !matches!(w.phase, Phase::Done | Phase::Crashed))
                    && !self.finished()
                {
                    self.note("no worker left: a new one starts".into());
                    self.start_worker(None);
                }
                self.at(self.now + TICK_MS, Node::Coordinator, 0, 0, Body::Tick);
            }
            Body::Script(Scripted::Join) => self.start_worker(None),
            Body::Script(Scripted::Drain(n)) => {
                let mut ids: Vec<WorkerId> = self.workers.iter().filter_map(|w| w.id).collect();
                if self.scenario.clients {
                    let now = edl_shared::clock::now();
                    ids = self
                        .coordinator
                        .inspect(|st| st.members(now).into_iter().map(|m| m.id).collect());
                }
                if !ids.is_empty() {
                    let worker = ids[n % ids.len()];
                    self.call(ADMIN, DRAIN, Clock(0), Request::Drain { worker });
                }
            }
            Body::Script(Scripted::Crash(n)) => self.crash_worker(n),
            Body::Register => {
                let req = Request::Register {
                    name: format!("w{slot}"),
                    placement: self.workers[slot].placement,
                };
                self.call(slot, seq, Clock(0), req);
            }
            Body::NextPartition(worker) => {
                self.call(slot, seq, Clock(0), Request::NextPartition { worker });
            }
            Body::Clock { id, clock, span } => {
                let req = Request::Clock {
                    worker: id,
                    clock,
                    epoch: span.epoch,
                    samples: span.len(),
                    loss_sum: 0.0,
                    span: Some(span),
                    last: false,
                    bytes_pushed: 0,
                    bytes_pulled: 0,
                };
                self.call(slot, seq, clock, req);
            }
            Body::Heartbeat(worker) => {
                self.call(slot, seq, Clock(0), Request::Heartbeat { worker })
            }
            Body::Leave(worker) => self.call(slot, seq, Clock(0), Request::Leave { worker }),
            Body::Call(id) => self.serve_coordinator(id),
            Body::GetMap => self.call(slot, seq, Clock(0), Request::GetMap),
            other => return Err(format!("the coordinator got {other:?}")),
        }
        Ok(())
    }

    /// Shard `s` writes its checkpoint, as its periodic writer does (a task of its own, on the
    /// runtime's one thread: its disk is memory).
    fn checkpoint(&mut self, s: usize) {
        let shard = &self.shards[s];
        let (state, store) = (shard.state.clone(), shard.store.clone());
        let task = tokio::spawn(async move {
            let _ = store.write(&state).await;
        });
        self.seq += 1;
        let id = self.seq;
        self.shards[s].tasks.insert(id, (Serving::Checkpoint, task));
    }

    /// Begins a fault of the network or a shard.
    fn fault(&mut self, what: Scripted) -> Result<(), String> {
        match what {
            Scripted::Partition(target, ms) => {
                let node = match target {
                    Target::Coordinator => Node::Coordinator,
                    Target::Shard(n) => Node::Shard(n % self.shards.len()),
                    Target::Worker(n) => match self.live_worker(n) {
                        Some(slot) => Node::Worker(slot),
                        None => return Ok(()),
                    },
                };
                self.note(format!("{node:?} is partitioned for {ms} ms"));
                self.cuts.push((node, self.now + ms));
            }
            Scripted::Filter { kind, answers, ms } => {
                self.note(format!(
                    "{kind:?} {} are dropped for {ms} ms",
                    if answers { "answers" } else { "requests" }
                ));
                self.filters.push((kind, answers, self.now + ms));
            }
            // A shard does not crash in the middle of a move (not simulated yet).
            Scripted::ShardCrash(_, _) if !self.mid_move && self.moving() => {}
            Scripted::ShardCrash(n, down) => {
                self.crash_shard(n % self.shards.len(), down);
            }
            Scripted::CrashAt(point, n, down) => {
                self.note(format!("a shard crashes at {point:?} #{n}"));
                self.traps.push((point, n, down));
            }
            other => return Err(format!("{other:?} is not a fault")),
        }
        Ok(())
    }

    /// Shard `s` crashes, to restart `down` ms later; false if it is down already, or if it
    /// holds the last live copy of some keys of a replicated job (what replicas promise to
    /// survive is fewer failures than copies, and a shard cut off long enough is taken for a
    /// failed one: its copies do not count, until the coordinator can have heard it again, a
    /// question's timeout and a tick after the cut heals).
    fn crash_shard(&mut self, s: usize, down: u64) -> bool {
        if self.shards[s].down.is_some() {
            return false;
        }
        if self.replicated() {
            let me = ShardId(s as u32);
            let heard_again = self.now.saturating_sub(CONNECTION_TIMEOUT_MS + 2 * TICK_MS);
            let cut = |n: Node| (self.cuts.iter()).any(|&(c, until)| c == n && heard_again < until);
            let up = |id: ShardId| {
                id != me
                    && !cut(Node::Shard(id.0 as usize))
                    && self
                        .shards
                        .get(id.0 as usize)
                        .is_some_and(|sh| sh.down.is_none())
            };
            let last = self.keys.iter().any(|c| {
                let copies: Vec<ShardId> = (self.map.owner(c.key).into_iter())
                    .chain(self.map.backups_of(c.key))
                    .collect();
                copies.contains(&me) && !copies.into_iter().any(up)
            });
            if last {
                self.note(format!(
                    "shard {s} holds the last live copy of some keys: no crash"
                ));
                return false;
            }
        }
        self.note(format!("shard {s} crashes for {down} ms"));
        self.shards[s].down = Some(self.now + down);
        self.shards[s].stop.cancel();
        self.shard_crashes += 1;
        // Its process ends: what it was serving fails with the connections, and what it was
        // doing (a hand-off, a checkpoint, a push's forwards) stops where it was.
        for (_, (serving, task)) in std::mem::take(&mut self.shards[s].tasks) {
            task.abort();
            if let Serving::Push { slot, seq, .. } = serving {
                let t = self.now + CONNECTION_TIMEOUT_MS;
                self.at(t, Node::Worker(slot), slot, seq, Body::Retry);
            }
        }
        let serving: Vec<u64> = (self.links.iter())
            .filter(|(_, c)| c.to == Node::Shard(s) && c.answer.is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in serving {
            self.link_failed(id);
        }
        self.at(self.now + down, Node::Shard(s), 0, 0, Body::ShardRestart);
        true
    }

    /// Shard `s` reached `point` of a replication: a crash armed there goes off if it is the
    /// time (and the shard may crash); true if it crashed.
    fn trap(&mut self, point: Point, s: usize) -> bool {
        let Some(i) = self.traps.iter().position(|t| t.0 == point) else {
            return false;
        };
        if self.traps[i].1 > 1 {
            self.traps[i].1 -= 1;
            return false;
        }
        let down = self.traps[i].2;
        self.note(format!("shard {s} at {point:?}"));
        if !self.crash_shard(s, down) {
            return false;
        }
        self.traps.remove(i);
        if let Some(n) = Point::ALL.iter().position(|p| *p == point) {
            self.hits[n] += 1;
        }
        true
    }

    /// The n-th live worker (modulo their number), if any is.
    fn live_worker(&self, n: usize) -> Option<usize> {
        let live: Vec<usize> = (0..self.workers.len())
            .filter(|&s| !matches!(self.workers[s].phase, Phase::Done | Phase::Crashed))
            .collect();
        live.get(n % live.len().max(1)).copied()
    }

    /// The n-th live worker (modulo their number) stops.
    fn crash_worker(&mut self, n: usize) {
        if let Some(s) = self.live_worker(n) {
            self.workers[s].phase = Phase::Crashed;
            self.crashed += 1;
            self.note(format!("w{s} crashes"));
            // A real client's process ends: its tasks stop, and nothing more of it is heard.
            if let Some((task, _)) = &self.workers[s].client {
                task.abort();
                self.cuts.push((Node::Worker(s), u64::MAX));
            }
        }
    }

    fn at_shard(&mut self, s: usize, env: Envelope) -> Result<(), String> {
        // A shard's answer reaches the server that called (gone if it crashed since); a
        // primary may crash as its backup's acknowledgement of a push arrives.
        if let Body::LinkReply(id) = env.body {
            let acked = self.links.get(&id).is_some_and(|c| {
                matches!(c.req, Request::Replicate { .. })
                    && matches!(&c.answer, Some(Ok(f)) if matches!(f.msg, Response::Ack))
            });
            if acked && self.shards[s].down.is_none() {
                self.trap(Point::BackupAcked, s);
            }
            self.link_reply(id);
            return Ok(());
        }
        // A push reaching its primary, a forwarded push its backup, a copy its new backup.
        let point = match &env.body {
            Body::Push { .. } => Some(Point::Pushed),
            Body::Call(id) => match self.links.get(id).map(|c| &c.req) {
                Some(Request::Push { .. }) => Some(Point::Pushed),
                Some(Request::Replicate { .. }) => Some(Point::AtBackup),
                Some(Request::CopyIn { .. }) => Some(Point::CopyArrives),
                _ => None,
            },
            _ => None,
        };
        if let Some(point) = point.filter(|_| self.shards[s].down.is_none())
            && self.trap(point, s)
        {
            return self.at_shard(s, env);
        }
        if self.shards[s].down.is_some() {
            match env.body {
                // It starts again from its checkpoint and the map the coordinator gives it
                // when it joins (once the coordinator is up).
                Body::ShardRestart if self.down_until.is_some() => {
                    self.at(self.now + TICK_MS, Node::Shard(s), 0, 0, Body::ShardRestart);
                }
                Body::ShardRestart => self.restart_shard(s)?,
                // What reaches a dead process fails with the connection.
                Body::Push { .. } => {
                    let (w, seq) = (env.worker, env.seq);
                    let t = self.now + CONNECTION_TIMEOUT_MS;
                    self.at(t, Node::Worker(w), w, seq, Body::Retry);
                }
                Body::Call(id) => self.link_failed(id),
                other => return Err(format!("shard {s} got {other:?} while down")),
            }
            return Ok(());
        }
        match env.body {
            Body::Push {
                id,
                clock,
                span,
                epoch,
                chunks,
            } => self.serve_push(s, (env.worker, env.seq), (id, clock, span, epoch), chunks),
            Body::Call(id) => self.serve_link(s, id),
            other => return Err(format!("shard {s} got {other:?}")),
        }
        Ok(())
    }

    /// Shard `s` restarts from its last checkpoint with the coordinator's map; the model forgets,
    /// as the shard does, what came after the checkpoint.
    fn restart_shard(&mut self, s: usize) -> Result<(), String> {
        if self.replicated() {
            self.rejoin(s);
            return Ok(());
        }
        let (job, map) = self.coordinator.inspect(|st| (st.job().clone(), st.map()));
        let map = map.ok_or("the coordinator has no map")?;
        let ckpt = {
            let mut d = lock_disk(&self.disk);
            let ckpt = d.checkpoints[s]
                .clone()
                .ok_or("a shard without a checkpoint")?;
            for c in &ckpt.chunks {
                let kept = d.modelled[s].get(&Key(c.key)).cloned();
                d.model.insert(Key(c.key), kept.unwrap_or_default());
            }
            ckpt
        };
        let state = ShardState::restore(ShardId(s as u32), job, map, ckpt)
            .map_err(|e| format!("shard {s} cannot restore its checkpoint: {e}"))?;
        self.shards[s] = self.shard_server(s, state);
        self.note(format!("shard {s} restarted from its checkpoint"));
        Ok(())
    }

    /// Restarted shard `s` of a replicated job joins the coordinator, as `edl-ps shard` does
    /// (the coordinator first replaces it by its backups if its map still places it); it
    /// serves once answered ([`Sim::rejoined`]).
    fn rejoin(&mut self, s: usize) {
        let peer = Peer::in_process(Role::Shard, &format!("s{s}"), JOB, addr(1, s));
        self.seq += 1;
        let call = self.seq;
        let (c, tx) = (self.coordinator.clone(), self.answers.clone());
        let task = tokio::spawn(async move {
            let req = Request::ShardJoin {
                addr: format!("sim:{s}"),
            };
            let resp = c.handle(&peer, req, Parts::default()).await.msg;
            let _ = tx.send(Answer {
                call,
                worker: ADMIN,
                seq: JOIN,
                clock: Clock(0),
                resp,
            });
        });
        self.calls.insert(call, (ADMIN, JOIN, task));
        self.joining.insert(call, s);
    }

    /// Shard `s` of a replicated job joined again: a standby if the map gives it nothing (its
    /// checkpoint not used), else restored from its checkpoint; the model forgets its copies.
    fn rejoined(&mut self, s: usize, resp: Response) -> Result<(), String> {
        let Response::ShardAssigned { job, map, .. } = resp else {
            return Err(format!("shard {s}'s join was answered {resp:?}"));
        };
        let id = ShardId(s as u32);
        let standby = ShardState::rejoins_as_standby(&job, &map, id);
        let state = if standby {
            ShardState::new(id, job, map)
        } else {
            let ckpt = lock_disk(&self.disk).checkpoints[s].clone();
            let ckpt = ckpt.ok_or("a shard without a checkpoint")?;
            ShardState::restore(id, job, map.clone(), ckpt).map_err(|e| {
                format!("shard {s} cannot restore its checkpoint with map {map:?}: {e}")
            })?
        };
        let mut d = lock_disk(&self.disk);
        d.copies.retain(|(on, _), _| *on != s);
        for c in &self.keys {
            if state.param(c.key, 0).is_some() {
                d.copies.insert((s, c.key), None);
            }
        }
        drop(d);
        self.shards[s] = self.shard_server(s, state);
        let how = if standby {
            "as a standby"
        } else {
            "from its checkpoint"
        };
        self.note(format!("shard {s} rejoined {how}"));
        Ok(())
    }

    /// A worker's push reaches shard `s` (the simulation's own worker's).
    fn serve_push(
        &mut self,
        s: usize,
        (slot, seq): (usize, u64),
        (id, clock, span, epoch): (WorkerId, Clock, DataSpan, MapEpoch),
        chunks: Vec<ChunkRef>,
    ) {
        let Some(token) = self.workers[slot].token else {
            return;
        };
        let floats: u32 = chunks.iter().map(|c| c.len).sum();
        let payload: Vec<u8> = (0..floats).flat_map(|_| (-1.0f32).to_le_bytes()).collect();
        let keys: Vec<Key> = chunks.iter().map(|c| c.key).collect();
        let req = Request::Push {
            epoch,
            worker: id,
            clock,
            chunks,
            span: Some(span),
            covers: Vec::new(),
            token,
        };
        let serving = Serving::Push {
            slot,
            seq,
            id,
            span,
            keys,
        };
        let payload = Parts(vec![Bytes::from(payload)]);
        self.serve(s, Node::Worker(slot), req, payload, serving);
    }

    /// A call over the network reaches shard `s`.
    fn serve_link(&mut self, s: usize, id: u64) {
        // A request whose connection failed (the shard restarted since) was never served.
        let Some(call) = self.links.get(&id).filter(|c| c.answer.is_none()) else {
            return;
        };
        let (from, req, payload) = (call.from, call.req.clone(), call.payload.clone());
        self.serve(s, from, req, payload, Serving::Link(id));
    }

    /// Shard `s`'s service serves `req` from `from` in a task of its own. A push's task
    /// watches the pushed keys' counters around each step of the service, so the model learns,
    /// as it happens, which keys the push was applied to.
    fn serve(&mut self, s: usize, from: Node, req: Request, payload: Parts, serving: Serving) {
        let peer = match from {
            Node::Worker(slot) => {
                Peer::in_process(Role::Worker, &format!("w{slot}"), JOB, addr(0, slot))
            }
            Node::Shard(n) => Peer::in_process(Role::Shard, &format!("s{n}"), JOB, addr(1, n)),
            Node::Coordinator => {
                Peer::in_process(Role::Coordinator, "coordinator", JOB, addr(3, 0))
            }
        };
        let pushed = match &req {
            Request::Push {
                chunks,
                span: Some(span),
                ..
            } => Some((chunks.iter().map(|c| c.key).collect::<Vec<Key>>(), *span)),
            _ => None,
        };
        // A replicated job's model follows every copy: any request may change one.
        let copies = self.replicated().then(|| {
            let batch = match &req {
                Request::Push {
                    span: Some(span), ..
                }
                | Request::Replicate {
                    span: Some(span), ..
                } => Some((span.epoch, span.start)),
                _ => None,
            };
            let source = match (&req, from) {
                (Request::CopyIn { .. }, Node::Shard(p)) => Some(p),
                _ => None,
            };
            (batch, source, self.keys.len() as u64)
        });
        self.seq += 1;
        let task_id = self.seq;
        let shard = &self.shards[s];
        let (service, state, disk) = (
            shard.service.clone(),
            shard.state.clone(),
            self.disk.clone(),
        );
        let tx = self.shard_answers.clone();
        let task = tokio::spawn(async move {
            let frame = if !service.allowed(peer.role, &req) {
                Frame::new(Response::error(ErrorCode::Forbidden, "not allowed"))
            } else if let Some((batch, source, keys)) = copies {
                let values = |st: &ShardState| -> Vec<Copy> {
                    (0..keys)
                        .map(|k| {
                            let primary = st.param(Key(k), 0).map(|v| (false, v));
                            primary.or_else(|| st.backup_param(Key(k), 0).map(|v| (true, v)))
                        })
                        .collect()
                };
                let mut serving = std::pin::pin!(service.handle(&peer, req, payload));
                std::future::poll_fn(|cx| {
                    let before = values(&state);
                    let step = serving.as_mut().poll(cx);
                    let after = values(&state);
                    if before != after {
                        lock_disk(&disk).changed(s, (&before, &after), batch, source);
                    }
                    step
                })
                .await
            } else if let Some((keys, span)) = pushed {
                let batch = (span.epoch, span.start);
                let counters = |st: &ShardState| -> Vec<Option<f32>> {
                    keys.iter().map(|&k| st.param(k, 0)).collect()
                };
                let mut serving = std::pin::pin!(service.handle(&peer, req, payload));
                std::future::poll_fn(|cx| {
                    let before = counters(&state);
                    let step = serving.as_mut().poll(cx);
                    let after = counters(&state);
                    for ((k, b), a) in keys.iter().zip(before).zip(after) {
                        if b.is_some() && a != b {
                            lock_disk(&disk).applied(s, *k, batch);
                        }
                    }
                    step
                })
                .await
            } else {
                service.handle(&peer, req, payload).await
            };
            let _ = tx.send(ShardAnswer {
                shard: s,
                task: task_id,
                frame,
            });
        });
        self.shards[s].tasks.insert(task_id, (serving, task));
    }

    /// Whether the job runs BSP (only with real clients: they pull each step).
    fn bsp(&self) -> bool {
        self.scenario.consistency == Consistency::Bsp
    }

    /// An acknowledged push: every key of it holds its batch (applied now or before), unless a
    /// shard crash lost it since.
    fn acknowledged(
        &mut self,
        s: usize,
        id: WorkerId,
        span: DataSpan,
        keys: &[Key],
    ) -> Result<(), String> {
        // Under BSP an acknowledged push is staged, applied at its step's first pull.
        if self.bsp() {
            return Ok(());
        }
        if self.replicated() {
            return self.acknowledged_by_copies(s, id, span, keys);
        }
        let batch = (span.epoch, span.start);
        let d = lock_disk(&self.disk);
        let lost: Vec<Key> = (keys.iter())
            .filter(|k| !d.model.get(k).is_some_and(|b| b.contains(&batch)))
            .copied()
            .collect();
        drop(d);
        if !lost.is_empty() {
            let what = format!(
                "shard {s} acknowledged {id}'s {span:?} for {lost:?}, which do not hold it"
            );
            if self.shard_crashes == 0 {
                return Err(format!("exactly-once: {what}"));
            }
            self.note(format!("{what} (lost with a crash)"));
        }
        Ok(())
    }

    /// A replicated job's acknowledged push: the primary's copy of every key of it holds its
    /// batch, and so does every backup copy its map lists (whose batches are known, that keeps
    /// no push for a copy on its way: it may be one of them, and whose map is as new as the
    /// primary's: an older one's copy may be a stale one a new copy is on its way to replace),
    /// crashes or not.
    fn acknowledged_by_copies(
        &mut self,
        s: usize,
        id: WorkerId,
        span: DataSpan,
        keys: &[Key],
    ) -> Result<(), String> {
        let batch = (span.epoch, span.start);
        let map = self.shards[s].state.read_map();
        let d = lock_disk(&self.disk);
        for &k in keys {
            let copies =
                std::iter::once(s).chain((map.backups_of(k).map(|b| b.0 as usize)).filter(|b| {
                    let st = &self.shards[*b].state;
                    st.kept_pushes() == 0 && st.map_epoch() >= map.epoch
                }));
            for (n, on) in copies.enumerate() {
                if let Some(Some(held)) = d.copies.get(&(on, k))
                    && !held.contains(&batch)
                {
                    let copy = if n == 0 { "its copy" } else { "its backup's" };
                    return Err(format!(
                        "exactly-once: shard {s} acknowledged {id}'s {span:?}, but {copy} of {k} \
                         on shard {on} does not hold it"
                    ));
                }
            }
        }
        Ok(())
    }

    /// A shard's task answered: a worker's push (acknowledged, or refused with the shard's
    /// map), or a call over the network.
    fn shard_answered(&mut self, a: ShardAnswer) -> Result<(), String> {
        let Some((serving, _)) = self.shards[a.shard].tasks.remove(&a.task) else {
            return Ok(());
        };
        let (slot, seq, id, span, keys) = match serving {
            Serving::Link(id) => {
                let line = format!("shard {} answers call #{id}", a.shard);
                mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
                self.note(line);
                let failed = matches!(a.frame.msg, Response::Error { .. });
                if let Response::Error { code, .. } = &a.frame.msg
                    && ErrorCode::from_u16(*code) == Some(ErrorCode::Deposed)
                {
                    self.note(format!(
                        "shard {} refuses a deposed leader's order",
                        a.shard
                    ));
                    self.orders_refused += 1;
                }
                let req = self.links.get(&id).map(|c| c.req.clone());
                let mut acked = false;
                match req {
                    Some(Request::MoveOut { .. }) if failed => self.taken_back += 1,
                    Some(Request::Push {
                        worker,
                        chunks,
                        span: Some(span),
                        ..
                    }) if matches!(a.frame.msg, Response::Ack) => {
                        let keys: Vec<Key> = chunks.iter().map(|c| c.key).collect();
                        self.acknowledged(a.shard, worker, span, &keys)?;
                        acked = true;
                    }
                    _ => {}
                }
                self.answer_link(id, Ok(a.frame));
                if acked {
                    self.trap(Point::Acked, a.shard);
                }
                return Ok(());
            }
            Serving::Checkpoint => return Ok(()),
            Serving::Push {
                slot,
                seq,
                id,
                span,
                keys,
            } => (slot, seq, id, span, keys),
        };
        let line = format!("shard {} answers w{slot} #{seq}", a.shard);
        mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
        self.note(line);
        let answer = match CallError::answered(a.frame.msg) {
            Ok(Response::Ack) => {
                self.acknowledged(a.shard, id, span, &keys)?;
                Body::Pushed { keys, span }
            }
            Err(CallError::Remote {
                code: Some(ErrorCode::StaleEpoch),
                map: Some(map),
                ..
            }) => Body::Moved { span, map },
            Err(e) => {
                return Err(format!(
                    "shard {} refused {id}'s push of {span:?}: {e}",
                    a.shard
                ));
            }
            Ok(other) => return Err(format!("shard {} answered a push {other:?}", a.shard)),
        };
        let acked = matches!(answer, Body::Pushed { .. });
        self.send(Node::Shard(a.shard), Node::Worker(slot), slot, seq, answer);
        if acked {
            self.trap(Point::Acked, a.shard);
        }
        Ok(())
    }

    /// An operator asks the coordinator to move a range `Scripted::Move(n, m)` names (from its
    /// map now) to another shard.
    fn operator_move(&mut self, n: usize, m: usize) {
        let Some(map) = self.coordinator.inspect(|st| st.map()) else {
            return;
        };
        let shards = self.shards.len();
        let Some(r) = map.ranges.get(n % map.ranges.len().max(1)).copied() else {
            return;
        };
        let to = (r.shard.0 as usize + 1 + m % (shards - 1).max(1)) % shards;
        let len = r.end - r.start;
        let start = r.start + (n as u64 / 7) % len;
        let end = (start + 1 + (n as u64 / 3) % len).min(r.end);
        self.note(format!("operator: move {start}..{end} to s{to}"));
        let req = Request::MoveRange {
            start,
            end,
            to: format!("s{to}"),
        };
        self.call(ADMIN, MOVE, Clock(0), req);
    }

    fn at_worker(&mut self, slot: usize, env: Envelope) -> Result<(), String> {
        // An answer to a real client's call reaches it (if its task is still there).
        if let Body::LinkReply(id) = env.body {
            self.link_reply(id);
            return Ok(());
        }
        let phase = self.workers[slot].phase;
        if matches!(phase, Phase::Done | Phase::Crashed) {
            return Ok(());
        }
        let current = env.seq == self.workers[slot].seq;
        match env.body {
            // A replicated job's worker whose push failed asks for the map first: a backup may
            // have taken the place of a dead primary (the client follows maps as they change).
            Body::Retry if current && phase == Phase::Pushing && self.replicated() => {
                let seq = self.workers[slot].seq;
                self.send(
                    Node::Worker(slot),
                    Node::Coordinator,
                    slot,
                    seq,
                    Body::GetMap,
                );
            }
            // A retry of an older round of pushes is stale: the current round carries its keys.
            Body::Retry | Body::Route if current && phase == Phase::Pushing => self.push(slot),
            Body::Computed if current && phase == Phase::Pushing => self.push(slot),
            // A map asked for while pushing (a refusal's, a replicated job's retry) is asked
            // again with the push, as when its message is lost.
            Body::ConnectionLost if current && phase == Phase::Pushing => {
                self.at(self.now, Node::Worker(slot), slot, env.seq, Body::Retry);
            }
            Body::ConnectionLost if current && !self.give_up => self.repeat(slot),
            Body::ConnectionLost if current => {
                self.note(format!(
                    "w{slot} exits: its connection to the coordinator failed"
                ));
                self.workers[slot].phase = Phase::Crashed;
            }
            Body::HeartbeatDue => {
                if let Some(id) = self.workers[slot].id {
                    self.seq += 1;
                    let seq = self.seq;
                    let body = Body::Heartbeat(id);
                    self.send(Node::Worker(slot), Node::Coordinator, slot, seq, body);
                    self.heartbeat_later(slot);
                }
            }
            Body::Beat { drain } => self.workers[slot].drain |= drain,
            // The long poll timed out: the client asks again at once.
            Body::NotReady if current => self.repeat(slot),
            Body::Refused(m) if current || phase == Phase::Pushing => {
                // The client gives up: a worker the coordinator dropped exits.
                self.note(format!("w{slot} exits: {m}"));
                self.workers[slot].phase = Phase::Done;
            }
            Body::Registered {
                id,
                clock,
                map,
                token,
            } if current && phase == Phase::Registering => {
                let w = &mut self.workers[slot];
                w.id = Some(id);
                w.token = Some(token);
                w.clock = clock;
                w.map = *map;
                w.phase = Phase::Leasing;
                self.heartbeat_later(slot);
                self.request(slot, Body::NextPartition(id));
            }
            Body::Leased { part, clock } if current && phase == Phase::Leasing => {
                self.workers[slot].clock = clock;
                match part {
                    Some(p) => {
                        self.workers[slot].part = Some((p, p.start));
                        self.next_batch(slot);
                    }
                    None => self.leave(slot),
                }
            }
            Body::Moved { span, map } if phase == Phase::Pushing => {
                self.rerouted += 1;
                let w = &mut self.workers[slot];
                if w.span == Some(span) {
                    let seq = w.seq;
                    if map.epoch > w.map.epoch {
                        // Route again with the newer map.
                        w.map = *map;
                        let again = self.route();
                        self.at(self.now, Node::Worker(slot), slot, seq, again);
                    } else {
                        // The refusing shard is behind: ask the coordinator for its map, as
                        // the client does.
                        self.send(
                            Node::Worker(slot),
                            Node::Coordinator,
                            slot,
                            seq,
                            Body::GetMap,
                        );
                    }
                }
            }
            Body::FreshMap(map) if current && phase == Phase::Pushing => {
                let w = &mut self.workers[slot];
                // The newer map at once; otherwise again after a moment (a destination may
                // still be waiting for the keys).
                let after = if map.epoch > w.map.epoch {
                    w.map = *map;
                    0
                } else {
                    20
                };
                let again = self.route();
                self.at(self.now + after, Node::Worker(slot), slot, env.seq, again);
            }
            Body::Pushed { keys, span } if phase == Phase::Pushing => {
                let w = &mut self.workers[slot];
                if w.span == Some(span) {
                    w.acks.extend(keys);
                    if w.acks.len() == self.keys.len()
                        && let Some(id) = w.id
                    {
                        w.phase = Phase::Committing;
                        let clock = Clock(w.clock.0 + 1);
                        self.request(slot, Body::Clock { id, clock, span });
                    }
                }
            }
            Body::Granted { drain } if current && phase == Phase::Committing => {
                let w = &mut self.workers[slot];
                w.clock = Clock(w.clock.0 + 1);
                w.span = None;
                if drain || w.drain {
                    self.leave(slot);
                } else {
                    self.next_batch(slot);
                }
            }
            Body::Left if current && phase == Phase::Leaving => {
                self.workers[slot].phase = Phase::Done;
                self.left += 1;
            }
            // A stale answer (to a request repeated since) or a stale timer.
            _ => {}
        }
        Ok(())
    }

    /// What routes a worker's push again at once (a replicated job's worker asks for the map
    /// first only after a push failed).
    fn route(&self) -> Body {
        if self.replicated() {
            Body::Route
        } else {
            Body::Retry
        }
    }

    /// Schedules a worker's next heartbeat, four to a lease.
    fn heartbeat_later(&mut self, slot: usize) {
        let every = u64::from(self.coordinator.inspect(|st| st.job().lease_ms)) / 4;
        self.at(
            self.now + every,
            Node::Worker(slot),
            slot,
            0,
            Body::HeartbeatDue,
        );
    }

    /// Repeats the awaited coordinator request on a new connection.
    fn repeat(&mut self, slot: usize) {
        let w = &self.workers[slot];
        let body = match (w.phase, w.id, w.span) {
            (Phase::Registering, _, _) => Body::Register,
            (Phase::Leasing, Some(id), _) => Body::NextPartition(id),
            (Phase::Committing, Some(id), Some(span)) => Body::Clock {
                id,
                clock: Clock(w.clock.0 + 1),
                span,
            },
            (Phase::Leaving, Some(id), _) => Body::Leave(id),
            _ => return,
        };
        self.request(slot, body);
    }

    /// The next batch of the worker's partition, or the next lease.
    fn next_batch(&mut self, slot: usize) {
        let batch = self.scenario.data.2;
        let w = &mut self.workers[slot];
        let Some(id) = w.id else {
            return;
        };
        match w.part {
            Some((p, next)) if next < p.start + p.len => {
                let span = crate::batch_span(&p, next, batch);
                w.part = Some((p, span.end));
                w.span = Some(span);
                w.acks.clear();
                w.phase = Phase::Pushing;
                let compute = self.scenario.step_ms * u64::from(w.slow);
                if compute == 0 {
                    self.push(slot);
                } else {
                    let seq = w.seq;
                    self.at(
                        self.now + compute,
                        Node::Worker(slot),
                        slot,
                        seq,
                        Body::Computed,
                    );
                }
            }
            _ => {
                w.part = None;
                if w.drain {
                    self.leave(slot);
                } else {
                    w.phase = Phase::Leasing;
                    self.request(slot, Body::NextPartition(id));
                }
            }
        }
    }

    fn leave(&mut self, slot: usize) {
        let w = &mut self.workers[slot];
        w.phase = Phase::Leaving;
        if let Some(id) = w.id {
            self.request(slot, Body::Leave(id));
        }
    }

    /// The end: every sample of every epoch applied exactly once on every shard, and every
    /// counter float equal to the number of batches of the job.
    fn check_end(&mut self) -> Result<(), String> {
        let epochs = self.coordinator.inspect(|st| st.job().epochs);
        let (samples, partition, batch) = self.scenario.data;
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = &shard.state;
            let report = shard.ledger_report();
            if shard.num_keys() == 0 {
                continue;
            }
            if report.len() != epochs as usize {
                return Err(format!("shard {s} reports {} epochs", report.len()));
            }
            for e in report {
                // A shard that crashed lost what it applied after its checkpoint (by design,
                // until replicas): then at most once.
                // With replicas it loses nothing.
                let exact = (e.applied, e.duplicates, e.missing) == (u64::from(samples), 0, 0);
                let at_most_once = e.duplicates == 0 && e.applied <= u64::from(samples);
                let lossy = self.shard_crashes > 0 && !self.replicated();
                if !exact && (!lossy || !at_most_once) {
                    return Err(format!("exactly-once: shard {s}, {e:?}"));
                }
            }
        }
        // Batches per epoch: every partition cut from its start (a re-issued one resumes at
        // a batch boundary, so the cut is the same).
        let mut per_epoch = 0u64;
        let mut start = 0;
        while start < samples {
            let len = partition.min(samples - start);
            per_epoch += u64::from(len.div_ceil(batch));
            start += len;
        }
        let want = (per_epoch * u64::from(epochs)) as f32;
        // Every key is held by one shard: the one the final map names.
        for c in &self.keys {
            let holders: Vec<usize> = (0..self.shards.len())
                .filter(|&s| self.shards[s].state.holds(std::iter::once(c.key)))
                .collect();
            let owner = self.map.owner(c.key).map(|o| o.0 as usize);
            if holders.len() != 1 || owner != holders.first().copied() {
                return Err(format!(
                    "placement: {} is held by shards {holders:?}, the map names {owner:?}",
                    c.key
                ));
            }
        }
        if self.replicated() {
            return self.check_copies(want);
        }
        let model = std::mem::take(&mut lock_disk(&self.disk).model);
        for (s, shard) in self.shards.iter().enumerate() {
            let mut chunks = shard.state.snapshot().chunks;
            chunks.sort_by_key(|c| c.key);
            for c in chunks {
                // The final state is part of the history's digest.
                for v in &c.params {
                    mix(&mut self.digest, &v.to_bits().to_le_bytes());
                }
                // Under BSP a counter counts the steps applied (a step's gradients are averaged
                // and applied when a pull asks for it), which the model does not follow: the
                // ledgers above account for the data.
                if self.bsp() {
                    continue;
                }
                // Each counter holds one per batch the model says the key holds: every batch of
                // the job, unless a shard crash lost some.
                let modelled = model.get(&Key(c.key)).map_or(0, BTreeSet::len) as f32;
                if self.shard_crashes == 0 && modelled != want {
                    return Err(format!(
                        "model: key {} was applied {modelled} batches, not {want}",
                        c.key
                    ));
                }
                if let Some(v) = c.params.iter().find(|v| **v != modelled) {
                    return Err(format!(
                        "counters: shard {s} key {} holds {v}, not {modelled} (one per batch \
                         applied to it and kept)",
                        c.key
                    ));
                }
            }
        }
        Ok(())
    }

    /// A replicated job's end: every key has its copies (as many as the job keeps, or as there
    /// are shards), each counter of every copy, primary and backup, holds one per batch of the
    /// job (under BSP: equals its primary's), and the model of each copy whose batches are known
    /// holds every batch.
    fn check_copies(&mut self, want: f32) -> Result<(), String> {
        let copies = self.scenario.replicas.min(self.scenario.shards) as usize;
        let (bsp, mut digest) = (self.bsp(), self.digest);
        let disk = self.disk.clone();
        let d = lock_disk(&disk);
        for c in &self.keys {
            let Some(owner) = self.map.owner(c.key) else {
                return Err(format!("placement: {} has no primary", c.key));
            };
            let backups: Vec<ShardId> = self.map.backups_of(c.key).collect();
            if 1 + backups.len() != copies {
                return Err(format!(
                    "replicas: {} has a primary and {} backups at the end, not {copies} copies",
                    c.key,
                    backups.len()
                ));
            }
            let primary = &self.shards[owner.0 as usize].state;
            let value = |st: &ShardState, backup: bool, i: usize| {
                if backup {
                    st.backup_param(c.key, i)
                } else {
                    st.param(c.key, i)
                }
            };
            let wanted = |i: usize| {
                if bsp {
                    primary.param(c.key, i)
                } else {
                    Some(want)
                }
            };
            let on = std::iter::once((owner, false)).chain(backups.iter().map(|b| (*b, true)));
            for (shard, backup) in on {
                let st = &self.shards[shard.0 as usize].state;
                for i in 0..c.len as usize {
                    let v = value(st, backup, i);
                    mix(&mut digest, &v.unwrap_or(f32::NAN).to_bits().to_le_bytes());
                    if v.is_none() || v != wanted(i) {
                        let modelled = match d.copies.get(&(shard.0 as usize, c.key)) {
                            Some(Some(held)) => {
                                format!("the model of it holds {} batches", held.len())
                            }
                            Some(None) => "the model does not know its batches".into(),
                            None => "the model has no such copy".into(),
                        };
                        return Err(format!(
                            "counters: {} of shard {shard}'s {} copy of {} holds {v:?}, not {:?} \
                             ({modelled})",
                            i,
                            if backup { "backup" } else { "primary" },
                            c.key,
                            wanted(i)
                        ));
                    }
                }
                if bsp {
                    continue;
                }
                if let Some(Some(held)) = d.copies.get(&(shard.0 as usize, c.key))
                    && held.len() as f32 != want
                {
                    return Err(format!(
                        "model: shard {shard}'s copy of {} was applied {} batches, not {want}",
                        c.key,
                        held.len()
                    ));
                }
            }
        }
        self.digest = digest;
        Ok(())
    }

    fn report(&self) -> Report {
        Report {
            seed: self.seed,
            digest: self.digest,
            events: self.events,
            virtual_ms: self.now,
            workers: (
                self.workers.len() as u32,
                self.crashed,
                self.dead,
                self.drained,
            ),
            lost: self.lost,
            duplicated: self.duplicated,
            restarts: self.restarts,
            shard_crashes: self.shard_crashes,
            failovers: (
                self.old_leaders.len() as u32,
                self.old_leaders
                    .iter()
                    .filter(|c| c.deposed().is_cancelled())
                    .count() as u32,
                self.orders_refused,
            ),
            leaders_killed: self.leaders_killed,
            leaders_paused: self.leaders_paused,
            dropped: self.dropped,
            left: self.left,
            cuts: (self.cuts.len() + self.filters.len()) as u32,
            moves: (self.moved, self.rerouted),
            taken_back: self.taken_back,
            log: Vec::new(),
            trace: None,
            ids: self.workers.iter().map(|w| w.id).collect(),
            consistency: self.scenario.consistency,
            replication: (self.promotions, self.seedings, self.hits),
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        let (started, crashed, dead, drained) = self.workers;
        let _ = write!(
            s,
            "seed {}: finished at {} ms virtual, {} events; {started} workers started, {crashed} \
             crashed, {dead} declared dead, {drained} drained; {} messages lost, {} duplicated; \
             {} coordinator restarts, {} shard crashes, {} partitions or filters; {} ranges \
             moved, {} taken back; {} pushes routed again",
            self.seed,
            self.virtual_ms,
            self.events,
            self.lost,
            self.duplicated,
            self.restarts,
            self.shard_crashes,
            self.cuts,
            self.moves.0,
            self.taken_back,
            self.moves.1
        );
        let (killed, back) = self.leaders_killed;
        if killed + self.leaders_paused > 0 {
            let _ = write!(
                s,
                "; {killed} leaders killed, {back} of them elected again at their own address; \
                 {} leaders paused",
                self.leaders_paused
            );
        }
        let (promoted, seeded, hits) = self.replication;
        if promoted + seeded + hits.iter().sum::<u32>() > 0 {
            let _ = write!(
                s,
                "; {promoted} shards replaced by their backups, {seeded} backups seeded, crashes \
                 at {:?}: {hits:?}",
                Point::ALL
            );
        }
        f.write_str(&s)
    }
}

/// The job the simulated certificates name.
const JOB: &str = edl_shared::pki::DEFAULT_JOB;

/// A simulated node's address: workers in 10.0.x.x, shards in 10.1.x.x, operators in 10.2.x.x.
fn addr(kind: u8, n: usize) -> SocketAddr {
    SocketAddr::from(([10, kind, (n >> 8) as u8, n as u8], 7000))
}

/// Adds bytes to a digest (FNV-1a).
fn mix(digest: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *digest = (*digest ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
}
