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

mod check;
mod coord;
mod net;
mod scenario;
mod shards;
mod workers;

use coord::*;
use net::*;
pub use scenario::{Failure, Kind, Loss, Options, Point, Report, Scenario, Scripted, Target};
use shards::*;
use workers::*;

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

/// What the simulation's tasks give back: the coordinator's answers, the servers' calls to
/// shards, the shards' answers.
struct Inbox {
    answers: tokio::sync::mpsc::UnboundedReceiver<Answer>,
    links: tokio::sync::mpsc::UnboundedReceiver<Outgoing>,
    shards: tokio::sync::mpsc::UnboundedReceiver<ShardAnswer>,
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

    fn note(&mut self, line: String) {
        let line = format!("{:>7} ms  {line}", self.now);
        self.log.push_back(line);
        if !self.verbose && self.log.len() > 40 {
            self.log.pop_front();
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
