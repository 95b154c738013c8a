//! `edl-bench control`: the coordinator's commit throughput and latency with each durable
//! store, against the coordinator without one (its behaviour before durability).
//!
//! Every round of a point starts a fresh in-process cluster over real QUIC on loopback: a
//! coordinator, 2 shard servers and `K` workers, each with its own certificate and
//! connections. The coordinator keeps its state in one of three stores:
//!
//! - `none`: no store (`state_file: None`), so answers wait for nothing;
//! - `wal`: the embedded store, `Coordinator::open`'s [`FileLog`] (a whole-state record
//!   appended to `coordinator/state.wal` with `fdatasync` before the answers that depend on
//!   it go out);
//! - `etcd`: the state in etcd through a conditional transaction, the coordinator elected with
//!   [`run_elected`] (a single candidate) against an etcd given with `--etcd` or, when `etcd`
//!   and `etcdctl` are installed, one member started on loopback ports for the run.
//!
//! The job is a 4-float counter (2 keys, one per shard) under ASP, so that no worker waits on
//! another's clock: each worker leases a partition and loops push (`push_span`, to both
//! shards) and commit (`commit_span`, the coordinator's `Clock` with the span: a state change
//! that must be durable before it is answered), leasing the next partition when one is done.
//! Commits are counted over a window after a warm-up, and each commit's latency (the
//! `commit_span` call) and step's (push and commit) is recorded. The stores take turns in an
//! order rotating by round, so that a stretch where the machine is slow slows all of them
//! alike.
//!
//! Writes to the store are counted too, to show the group commit (concurrent commits share
//! one write): for the log, from its growth (sampled every few milliseconds, across
//! compactions) over its mean record size; for etcd, from its revision (one per transaction
//! that wrote the state; other writers to the same etcd would count too).
//!
//! [`FileLog`]: edl_ps::coordinator::FileLog
//! [`run_elected`]: edl_ps::coordinator::run_elected

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_ps::coordinator::{self, CoordinatorConfig, ElectedConfig, meta::COMPACT_BYTES};
use edl_ps::shard::{self, ShardConfig};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::{Consistency, JobConfig};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_testkit::etcd::EtcdCluster;
use edl_testkit::{batch_span, counter_job};
use edl_worker::{ClientConfig, Job, Session};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::stats::Samples;

/// Floats of the counter tensor.
pub const FLOATS: u32 = 4;
/// Floats per key: 2 keys, one on each shard.
const CHUNK: u32 = 2;
/// Shard servers.
pub const SHARDS: u32 = 2;
/// Samples a commit covers.
pub const BATCH: u32 = 4;
/// Samples per partition: a worker leases a new one every `PARTITION / BATCH` commits.
pub const PARTITION: u32 = 1024;
/// Samples of the job (one epoch): more than any run commits.
const SAMPLES: u32 = 1 << 20;
/// The workers' lease: long, so that a worker starved of CPU on a loaded machine is not
/// declared dead in the middle of a window.
const LEASE_MS: u32 = 10_000;
/// How long connecting, registering and winding down may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the log's length is sampled to count its writes.
const WAL_SAMPLE: Duration = Duration::from_millis(5);
/// Bytes of each write of the raw `fdatasync` probe, about a state record's size.
const PROBE_BYTES: usize = 2048;
/// Writes of the raw `fdatasync` probe.
const PROBE_WRITES: usize = 200;

/// Where the coordinator keeps its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Store {
    /// Nowhere: answers wait for no write (the coordinator before durability).
    None,
    /// The embedded write-ahead log (`state_file`), fdatasync per write.
    Wal,
    /// etcd, through a conditional transaction, the coordinator elected.
    Etcd,
}

impl Store {
    /// Every store, in table order.
    pub const ALL: [Store; 3] = [Store::None, Store::Wal, Store::Etcd];

    /// Its name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Store::None => "none",
            Store::Wal => "wal",
            Store::Etcd => "etcd",
        }
    }
}

impl std::str::FromStr for Store {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Store::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| format!("unknown store {s:?}: none, wal or etcd"))
    }
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Concurrent workers per point.
    pub workers: Vec<usize>,
    /// The stores, measured side by side.
    pub stores: Vec<Store>,
    /// Rounds: each point is measured this many times, the stores' order rotating by round.
    pub rounds: usize,
    /// Commits before the window opens (connections warm, the store's first writes done).
    pub warmup: Duration,
    /// The measured window of each round.
    pub window: Duration,
    /// An etcd to use (`etcd://HOST:PORT,...`); without one, one is started if installed.
    pub etcd: Option<String>,
    /// Where the state (and a started etcd's data) goes; a temporary directory by default.
    pub dir: Option<PathBuf>,
    /// Transport settings of the servers and workers.
    pub settings: TransportSettings,
}

impl Plan {
    /// 1, 4 and 16 workers, every store, 3 rounds of a 2 s window after 0.5 s of warm-up
    /// (about 1.5 minutes); `quick`: 1 and 4 workers, one round of 0.3 s.
    pub fn standard(quick: bool, settings: TransportSettings) -> Plan {
        Plan {
            workers: if quick { vec![1, 4] } else { vec![1, 4, 16] },
            stores: Store::ALL.to_vec(),
            rounds: if quick { 1 } else { 3 },
            warmup: Duration::from_millis(if quick { 200 } else { 500 }),
            window: Duration::from_millis(if quick { 300 } else { 2000 }),
            etcd: None,
            dir: None,
            settings,
        }
    }
}

/// One store at one worker count, over every round.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The store.
    pub store: Store,
    /// Concurrent workers.
    pub workers: usize,
    /// Commits counted, every round.
    pub commits: u64,
    /// Seconds the windows were open, every round.
    pub seconds: f64,
    /// `commits` over `seconds`: commits per second, all workers together.
    pub commits_per_s: f64,
    /// The slowest and the fastest round's commits per second.
    pub round_min: f64,
    /// See `round_min`.
    pub round_max: f64,
    /// `commits_per_s` over that of `none` at the same worker count, if measured.
    pub vs_none: Option<f64>,
    /// A commit's latency (the `commit_span` call), p50 and p99 by nearest rank, µs.
    pub commit_p50_us: f64,
    /// See `commit_p50_us`.
    pub commit_p99_us: f64,
    /// A step's (push to both shards, then commit), p50 and p99, µs.
    pub step_p50_us: f64,
    /// See `step_p50_us`.
    pub step_p99_us: f64,
    /// Writes to the store per second in the windows (none for `none`, or when they could not
    /// be counted).
    pub writes_per_s: Option<f64>,
    /// Commits per write: how many commits a write carried (group commit).
    pub commits_per_write: Option<f64>,
}

/// The raw cost of a durable append on the disk that holds the log.
#[derive(Clone, Debug, Serialize)]
pub struct DiskProbe {
    /// What the state directory is on: file system and device.
    pub disk: String,
    /// Bytes per append.
    pub bytes: usize,
    /// Appends made.
    pub writes: usize,
    /// One append and `fdatasync`, p50 and p99, µs.
    pub p50_us: f64,
    /// See `p50_us`.
    pub p99_us: f64,
}

/// What the run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// The machine, in words.
    pub machine: String,
    /// The disk under the log, and what a bare durable append costs on it.
    pub probe: DiskProbe,
    /// The etcd used, in words (none when etcd was not measured).
    pub etcd: Option<String>,
    /// Stores that were asked for and not measured, and why.
    pub skipped: Vec<String>,
    /// Floats of the counter model.
    pub floats: u32,
    /// Shard servers.
    pub shards: u32,
    /// Samples per commit.
    pub batch: u32,
    /// Samples per partition.
    pub partition: u32,
    /// Rounds per point.
    pub rounds: usize,
    /// Warm-up of each round, seconds.
    pub warmup_s: f64,
    /// Window of each round, seconds.
    pub window_s: f64,
    /// One row per worker count and store.
    pub rows: Vec<Row>,
    /// How long the whole run took, seconds.
    pub seconds: f64,
}

/// What one round measured.
struct Round {
    commits: u64,
    seconds: f64,
    commit: Samples,
    step: Samples,
    writes: Option<u64>,
}

/// An etcd for the run: given, or started here (and stopped when dropped).
struct Etcd {
    endpoints: Vec<String>,
    describe: String,
    _started: Option<EtcdCluster>,
}

/// Runs the plan.
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    anyhow::ensure!(
        !plan.workers.is_empty() && plan.workers.iter().all(|&k| k > 0),
        "worker counts must be 1 or more"
    );
    anyhow::ensure!(plan.rounds > 0, "at least one round");
    let started = Instant::now();
    let temp = match &plan.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            tempfile::tempdir_in(d)?
        }
        None => tempfile::tempdir()?,
    };
    let base = temp.path().to_path_buf();
    let probe = tokio::task::spawn_blocking({
        let base = base.clone();
        move || disk_probe(&base)
    })
    .await??;
    let mut stores = plan.stores.clone();
    let mut skipped = Vec::new();
    let etcd = if stores.contains(&Store::Etcd) {
        match find_etcd(plan.etcd.as_deref(), &base).await? {
            Ok(e) => Some(e),
            Err(why) => {
                eprintln!("control: etcd skipped: {why}");
                skipped.push(format!("etcd: {why}"));
                stores.retain(|s| *s != Store::Etcd);
                None
            }
        }
    } else {
        None
    };
    anyhow::ensure!(!stores.is_empty(), "no store left to measure");
    let job = job();
    let mut rounds: Vec<(Store, usize, Round)> = Vec::new();
    let mut cluster_no = 0;
    for round in 0..plan.rounds {
        for (i, &k) in plan.workers.iter().enumerate() {
            // The order of the stores rotates with the round and the worker count.
            let shift = (round + i) % stores.len();
            let order: Vec<Store> = stores[shift..]
                .iter()
                .chain(&stores[..shift])
                .copied()
                .collect();
            for store in order {
                cluster_no += 1;
                let r = measure(
                    plan,
                    store,
                    k,
                    &job,
                    &base.join(format!("c{cluster_no}")),
                    etcd.as_ref(),
                    cluster_no,
                )
                .await
                .with_context(|| {
                    format!("{} with {k} workers, round {}", store.name(), round + 1)
                })?;
                eprintln!(
                    "control: round {}, {k:>2} workers, {:<4}: {:.0} commits/s, commit p50 {:.0} µs",
                    round + 1,
                    store.name(),
                    r.commits as f64 / r.seconds.max(1e-9),
                    r.commit.quantile(0.5),
                );
                rounds.push((store, k, r));
            }
        }
    }
    let mut rows = Vec::new();
    for &k in &plan.workers {
        for store in Store::ALL.into_iter().filter(|s| stores.contains(s)) {
            rows.push(summarize(store, k, &rounds));
        }
    }
    let none: Vec<(usize, f64)> = rows
        .iter()
        .filter(|r| r.store == Store::None)
        .map(|r| (r.workers, r.commits_per_s))
        .collect();
    for r in &mut rows {
        r.vs_none = none
            .iter()
            .find(|(k, _)| *k == r.workers)
            .map(|(_, base)| r.commits_per_s / base.max(1e-9));
    }
    Ok(Results {
        machine: crate::report::machine(),
        probe,
        etcd: etcd.as_ref().map(|e| e.describe.clone()),
        skipped,
        floats: FLOATS,
        shards: SHARDS,
        batch: BATCH,
        partition: PARTITION,
        rounds: plan.rounds,
        warmup_s: plan.warmup.as_secs_f64(),
        window_s: plan.window.as_secs_f64(),
        rows,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The row of `store` at `k` workers from its rounds.
fn summarize(store: Store, k: usize, rounds: &[(Store, usize, Round)]) -> Row {
    let mine: Vec<&Round> = rounds
        .iter()
        .filter(|(s, w, _)| *s == store && *w == k)
        .map(|(_, _, r)| r)
        .collect();
    let commits: u64 = mine.iter().map(|r| r.commits).sum();
    let seconds: f64 = mine.iter().map(|r| r.seconds).sum();
    let rates: Vec<f64> = mine
        .iter()
        .map(|r| r.commits as f64 / r.seconds.max(1e-9))
        .collect();
    let (mut commit, mut step) = (Samples::default(), Samples::default());
    for r in &mine {
        commit.extend(r.commit.clone());
        step.extend(r.step.clone());
    }
    let writes: Option<u64> = mine.iter().map(|r| r.writes).sum();
    let writes = writes.filter(|_| store != Store::None);
    Row {
        store,
        workers: k,
        commits,
        seconds,
        commits_per_s: commits as f64 / seconds.max(1e-9),
        round_min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        round_max: rates.iter().copied().fold(0.0, f64::max),
        vs_none: None,
        commit_p50_us: commit.quantile(0.5),
        commit_p99_us: commit.quantile(0.99),
        step_p50_us: step.quantile(0.5),
        step_p99_us: step.quantile(0.99),
        writes_per_s: writes.map(|w| w as f64 / seconds.max(1e-9)),
        commits_per_write: writes.map(|w| commits as f64 / (w as f64).max(1.0)),
    }
}

/// The benchmark's job: a 4-float counter over 2 keys, ASP, partitions of [`PARTITION`].
fn job() -> JobConfig {
    let mut job = counter_job(FLOATS, CHUNK, Consistency::Asp);
    job.train_samples = SAMPLES;
    job.partition_size = PARTITION;
    job.batch_size = BATCH;
    job.lease_ms = LEASE_MS;
    job
}

/// The etcd to measure: `given` (an `etcd://` URL), or one member started under `dir` when
/// `etcd` and `etcdctl` are installed. `Ok(Err(why))` when there is none.
async fn find_etcd(given: Option<&str>, dir: &Path) -> anyhow::Result<Result<Etcd, String>> {
    if let Some(url) = given {
        let endpoints = coordinator::etcd::parse_url(url).map_err(anyhow::Error::msg)?;
        return Ok(Ok(Etcd {
            describe: format!("{url} (given)"),
            endpoints,
            _started: None,
        }));
    }
    let version = Command::new("etcd")
        .arg("--version")
        .stderr(Stdio::null())
        .output();
    let ctl = Command::new("etcdctl")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let version = match (version, ctl) {
        (Ok(v), Ok(c)) if v.status.success() && c.success() => {
            let text = String::from_utf8_lossy(&v.stdout).into_owned();
            // `etcd Version: 3.4.23`
            match text.lines().next().and_then(|l| l.rsplit_once(':')) {
                Some((_, v)) => format!("etcd {}", v.trim()),
                None => "etcd".to_string(),
            }
        }
        _ => {
            return Ok(Err(
                "no --etcd given and etcd/etcdctl not installed (apt-get install etcd-server \
                 etcd-client)"
                    .into(),
            ));
        }
    };
    let data = dir.join("etcd");
    let cluster = tokio::task::spawn_blocking(move || EtcdCluster::start(1, &data))
        .await?
        .context("starting etcd")?;
    let endpoints = coordinator::etcd::parse_url(&cluster.url()).map_err(anyhow::Error::msg)?;
    Ok(Ok(Etcd {
        describe: format!(
            "{version}, one member started for the run on loopback, its data on the same disk"
        ),
        endpoints,
        _started: Some(cluster),
    }))
}

/// A cluster of one round: a coordinator with its store and the shard servers, in this
/// process. Dropping it stops them.
struct Cluster {
    addr: SocketAddr,
    pki: PkiDir,
    shutdown: CancellationToken,
    tasks: JoinSet<anyhow::Result<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Cluster {
    /// Starts a coordinator of `job` (the certificates' job `name`) keeping its state in
    /// `store`, and the shard servers. The shard map forms in the background.
    async fn start(
        store: Store,
        job: &JobConfig,
        name: &str,
        dir: &Path,
        etcd: Option<&Etcd>,
        settings: &TransportSettings,
    ) -> anyhow::Result<Cluster> {
        let pki = PkiDir::new(dir);
        pki.init_ca()?;
        let issue = |role: Role, node: &str| -> anyhow::Result<edl_shared::Identity> {
            pki.issue(role, node, name, &[])?;
            Ok(pki.load(role, node)?)
        };
        let identity = issue(Role::Coordinator, "coordinator")?;
        let config = CoordinatorConfig {
            job: job.clone(),
            shards: SHARDS,
            state_file: (store == Store::Wal).then(|| wal_base(dir)),
            stragglers: Default::default(),
            probe_sockets: true,
        };
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let addr = match store {
            Store::None | Store::Wal => {
                let bound = coordinator::bind(config, loopback, &identity, settings.clone())?;
                let addr = bound.addr;
                let stop = shutdown.clone();
                tasks.spawn(async move {
                    bound.run(stop).await;
                    Ok(())
                });
                addr
            }
            Store::Etcd => {
                let etcd = etcd.context("no etcd")?;
                // The address the coordinator advertises in etcd: a free port, bound at once.
                let port = std::net::UdpSocket::bind(loopback)?.local_addr()?.port();
                let listen = SocketAddr::from(([127, 0, 0, 1], port));
                let elected = ElectedConfig {
                    endpoints: etcd.endpoints.clone(),
                    advertise: listen.to_string(),
                    ttl: Duration::from_secs(5),
                    dead_after: Duration::from_secs(1),
                };
                let (tx, rx) = tokio::sync::oneshot::channel();
                let (stop, settings) = (shutdown.clone(), settings.clone());
                tasks.spawn(async move {
                    coordinator::run_elected(
                        config,
                        elected,
                        listen,
                        &identity,
                        settings,
                        stop,
                        |addr| {
                            let _ = tx.send(addr);
                            Ok(())
                        },
                    )
                    .await
                });
                tokio::time::timeout(SETUP_TIMEOUT, rx)
                    .await
                    .context("the elected coordinator did not bind")?
                    .context("the elected coordinator failed to start")?
            }
        };
        for i in 0..SHARDS {
            let identity = issue(Role::Shard, &format!("s{i}"))?;
            let cfg = ShardConfig {
                coordinator: addr.to_string(),
                listen: loopback,
                advertise: None,
                checkpoint: None,
                checkpoint_every: None,
            };
            let (stop, settings) = (shutdown.clone(), settings.clone());
            let (tx, rx) = tokio::sync::oneshot::channel();
            tasks.spawn(async move { shard::run(cfg, identity, settings, stop, Some(tx)).await });
            rx.await.context("a shard server failed to start")?;
        }
        Ok(Cluster {
            addr,
            pki,
            shutdown,
            tasks,
        })
    }

    /// A worker's client settings, with its own certificate of the cluster's job `name`.
    fn client(
        &self,
        worker: &str,
        name: &str,
        settings: &TransportSettings,
    ) -> anyhow::Result<ClientConfig> {
        self.pki.issue(Role::Worker, worker, name, &[])?;
        Ok(ClientConfig {
            coordinator: self.addr.to_string(),
            identity: self.pki.load(Role::Worker, worker)?,
            settings: settings.clone(),
        })
    }

    /// Stops every server and waits for them.
    async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let mut tasks = std::mem::take(&mut self.tasks);
        tokio::time::timeout(SETUP_TIMEOUT, async {
            while let Some(r) = tasks.join_next().await {
                // A server that failed is reported; what the round measured still holds.
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => eprintln!("control: a server stopped with an error: {e:#}"),
                    Err(e) => eprintln!("control: a server task failed: {e}"),
                }
            }
        })
        .await
        .context("the servers did not stop")
    }
}

/// The coordinator's state file under a cluster's directory (its log is beside it).
fn wal_base(dir: &Path) -> PathBuf {
    dir.join("coordinator").join("state.bin")
}

/// One round: a fresh cluster with `store`, `k` workers committing, counted over the window.
async fn measure(
    plan: &Plan,
    store: Store,
    k: usize,
    job: &JobConfig,
    dir: &Path,
    etcd: Option<&Etcd>,
    cluster_no: usize,
) -> anyhow::Result<Round> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // A job name of its own per cluster, so that etcd holds no earlier round's state for it.
    let name = format!("edl-bench-control-{}-{cluster_no}", std::process::id());
    let cluster = Cluster::start(store, job, &name, dir, etcd, &plan.settings).await?;
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut sessions = Vec::new();
    let setup = async {
        for i in 0..k {
            let worker = format!("w{i}");
            let job = Job::connect(&cluster.client(&worker, &name, &plan.settings)?).await?;
            sessions.push(job.register(&worker).await?);
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(SETUP_TIMEOUT, setup)
        .await
        .context("connecting the workers timed out")??;
    let mut set = JoinSet::new();
    for s in sessions {
        set.spawn(work(s, measuring.clone(), stop.clone()));
    }
    tokio::time::sleep(plan.warmup).await;
    let counter = match store {
        Store::None => None,
        Store::Wal => Some(WriteCounter::Wal(wal_base(dir).with_extension("wal"))),
        Store::Etcd => etcd.map(|e| WriteCounter::Etcd(e.endpoints[0].clone())),
    };
    let before = match &counter {
        Some(c) => c.start(measuring.clone()).await,
        None => None,
    };
    measuring.store(true, Ordering::SeqCst);
    let opened = Instant::now();
    tokio::time::sleep(plan.window).await;
    measuring.store(false, Ordering::SeqCst);
    let seconds = opened.elapsed().as_secs_f64();
    let writes = match (&counter, before) {
        (Some(c), Some(b)) => c.finish(b).await,
        _ => None,
    };
    stop.store(true, Ordering::SeqCst);
    let (mut commits, mut commit, mut step) = (0, Samples::default(), Samples::default());
    let joined = tokio::time::timeout(SETUP_TIMEOUT, async {
        while let Some(r) = set.join_next().await {
            let (c, s) = r??;
            commits += c.len() as u64;
            commit.extend(c);
            step.extend(s);
        }
        anyhow::Ok(())
    })
    .await;
    joined.context("the workers did not stop")??;
    cluster.stop().await?;
    anyhow::ensure!(commits > 0, "no commit ended in the window");
    Ok(Round {
        commits,
        seconds,
        commit,
        step,
        writes,
    })
}

/// A worker: leases partitions and loops push, commit until `stop`; records each commit's and
/// step's latency while `measuring`.
async fn work(
    mut s: Session,
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(Samples, Samples)> {
    let grads = vec![-1.0f32; FLOATS as usize];
    let (mut commit, mut step) = (Samples::default(), Samples::default());
    'data: while !stop.load(Ordering::Relaxed) {
        let part = s
            .next_partition()
            .await?
            .context("the job ran out of data")?;
        let mut at = part.start;
        while at < part.start + part.len {
            if stop.load(Ordering::Relaxed) {
                break 'data;
            }
            let span = batch_span(&part, at, BATCH);
            let t0 = Instant::now();
            s.push_span(&grads, span).await?;
            let t1 = Instant::now();
            s.commit_span(span, 0.0).await?;
            if measuring.load(Ordering::Relaxed) {
                commit.push(t1.elapsed());
                step.push(t0.elapsed());
            }
            at = span.end;
        }
    }
    Ok((commit, step))
}

/// Counts a store's writes over a window.
enum WriteCounter {
    /// The log at this path: its growth over its mean record.
    Wal(PathBuf),
    /// etcd's revision at this endpoint (`http://HOST:PORT`).
    Etcd(String),
}

/// Where a count began.
enum Began {
    Wal(tokio::task::JoinHandle<u64>),
    Etcd(i64),
}

impl WriteCounter {
    /// Starts counting (the log: a sampler that runs while `measuring`, once it is set).
    async fn start(&self, measuring: Arc<AtomicBool>) -> Option<Began> {
        match self {
            WriteCounter::Wal(path) => {
                let path = path.clone();
                let mut last = std::fs::metadata(&path).map_or(0, |m| m.len());
                Some(Began::Wal(tokio::spawn(async move {
                    let mut grown = 0;
                    let mut seen_open = false;
                    loop {
                        tokio::time::sleep(WAL_SAMPLE).await;
                        let len = std::fs::metadata(&path).map_or(last, |m| m.len());
                        grown += if len >= last {
                            len - last
                        } else {
                            // Compacted: the log had reached COMPACT_BYTES (within a record),
                            // was folded into the base file and started again.
                            COMPACT_BYTES.saturating_sub(last) + len
                        };
                        last = len;
                        let open = measuring.load(Ordering::SeqCst);
                        if seen_open && !open {
                            return grown;
                        }
                        seen_open |= open;
                    }
                })))
            }
            WriteCounter::Etcd(endpoint) => etcd_revision(endpoint).await.ok().map(Began::Etcd),
        }
    }

    /// The writes since `began`.
    async fn finish(&self, began: Began) -> Option<u64> {
        match (self, began) {
            (WriteCounter::Wal(path), Began::Wal(sampler)) => {
                let grown = sampler.await.ok()?;
                let record = mean_record(path)?;
                Some((grown as f64 / record).round() as u64)
            }
            (WriteCounter::Etcd(endpoint), Began::Etcd(before)) => {
                let after = etcd_revision(endpoint).await.ok()?;
                u64::try_from(after - before).ok()
            }
            _ => None,
        }
    }
}

/// The mean size of the log's records at `path`, with their headers (length, CRC-32).
fn mean_record(path: &Path) -> Option<f64> {
    let bytes = std::fs::read(path).ok()?;
    let (mut at, mut n) = (0usize, 0usize);
    while let Some(header) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if at + 8 + len > bytes.len() {
            break;
        }
        at += 8 + len;
        n += 1;
    }
    (n > 0).then(|| at as f64 / n as f64)
}

/// etcd's current revision, from its JSON gateway at `endpoint` (`http://HOST:PORT`).
async fn etcd_revision(endpoint: &str) -> anyhow::Result<i64> {
    let host = endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    let body = r#"{"key":"AA=="}"#;
    let request = format!(
        "POST /v3/kv/range HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(host).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        anyhow::Ok(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(5), read).await??;
    let key = "\"revision\":\"";
    let from = answer
        .find(key)
        .map(|i| i + key.len())
        .context("no revision in etcd's answer")?;
    let digits: String = answer[from..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Ok(digits.parse()?)
}

/// Appends [`PROBE_WRITES`] records of [`PROBE_BYTES`] to a file in `dir`, each made durable
/// with `fdatasync`, as the log does: the floor a durable commit pays on this disk.
fn disk_probe(dir: &Path) -> anyhow::Result<DiskProbe> {
    use std::io::Write as _;
    let path = dir.join("fdatasync-probe");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    let record = vec![0x5a_u8; PROBE_BYTES];
    let mut lat = Samples::default();
    for _ in 0..PROBE_WRITES {
        let t = Instant::now();
        file.write_all(&record)?;
        file.sync_data()?;
        lat.push(t.elapsed());
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    Ok(DiskProbe {
        disk: disk_of(dir),
        bytes: PROBE_BYTES,
        writes: PROBE_WRITES,
        p50_us: lat.quantile(0.5),
        p99_us: lat.quantile(0.99),
    })
}

/// The file system and device `dir` is on, from `/proc/self/mounts` (the longest mount point
/// that holds it).
fn disk_of(dir: &Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (dev, at, fs) = (f.next()?, f.next()?, f.next()?);
            dir.starts_with(at)
                .then(|| (at.len(), format!("{fs} on {dev}")))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "unknown disk".to_string(), |(_, d)| d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_parse_by_name() {
        for s in Store::ALL {
            assert_eq!(s.name().parse::<Store>(), Ok(s));
        }
        assert!("disk".parse::<Store>().is_err());
    }

    #[test]
    fn the_mean_record_counts_whole_records_with_their_headers() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("state.wal");
        let mut bytes = Vec::new();
        for len in [10u32, 30] {
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(&[0; 4]);
            bytes.extend(std::iter::repeat_n(1u8, len as usize));
        }
        // A torn record at the tail is not counted.
        bytes.extend_from_slice(&100u32.to_le_bytes());
        bytes.extend_from_slice(&[0; 6]);
        std::fs::write(&path, &bytes).expect("write");
        assert_eq!(mean_record(&path), Some(28.0));
    }
}
