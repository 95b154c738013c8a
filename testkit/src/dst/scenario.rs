//! A run's scenario drawn from its seed, the options that drive it, and its report.

use super::*;

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
    pub(super) fn job(&self) -> JobConfig {
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
