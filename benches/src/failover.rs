//! `edl-bench failover`: how long a job's workers pause when its coordinator is killed.
//!
//! Real processes on loopback: the coordinator(s) and 2 shards are `edl-ps` processes, the
//! workers run in this process (the client library over QUIC, each with its own certificate),
//! every one looping push and commit on a counter job under ASP. Then the coordinator is
//! killed with SIGKILL `kills` times, `gap` of steady training apart:
//!
//! - `etcd`: two coordinators share a 3-member etcd started on loopback for the run, one
//!   leading; the leader is killed (found by asking the coordinators) and restarted at once at
//!   its address, as a supervisor would, where it stands by;
//! - `wal`: one coordinator with the embedded store, restarted at once on its state
//!   directory and address.
//!
//! A kill's failover time is from the SIGKILL until *every* worker has completed a commit
//! after it (the slowest worker's next step), which includes the client noticing the dead
//! coordinator, the election or restart, the restore and the worker's retry.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_ps::admin::{Admin, CoordinatorRole};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_testkit::batch_span;
use edl_testkit::etcd::EtcdCluster;
use edl_testkit::procs::{Proc, free_port, spawn_from};
use edl_worker::{ClientConfig, Job};
use serde::Serialize;

/// Where the coordinator keeps its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailStore {
    /// Two coordinators and a 3-member etcd.
    Etcd,
    /// One coordinator and its embedded write-ahead log.
    Wal,
}

impl std::str::FromStr for FailStore {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "etcd" => Ok(FailStore::Etcd),
            "wal" => Ok(FailStore::Wal),
            _ => Err(format!("unknown store {s:?}: etcd or wal")),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The store.
    pub store: FailStore,
    /// Kills.
    pub kills: usize,
    /// Workers.
    pub workers: usize,
    /// The leader's etcd lease (`--leader-ttl`).
    pub ttl: Duration,
    /// Steady training before each kill.
    pub gap: Duration,
    /// Where `edl-ps` is [default: beside edl-bench].
    pub bin_dir: Option<PathBuf>,
    /// Restart a killed coordinator at once (a supervisor on its machine), rather than only
    /// once the failover was measured (its machine lost).
    pub restart_at_once: bool,
}

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The store.
    pub store: FailStore,
    /// Workers.
    pub workers: usize,
    /// Whether a killed coordinator was restarted at once.
    pub restart_at_once: bool,
    /// The leader's etcd lease, ms (etcd only).
    pub ttl_ms: Option<u64>,
    /// Each kill's failover time, ms: from the SIGKILL to every worker's next commit.
    pub failover_ms: Vec<u64>,
    /// Their median.
    pub median_ms: u64,
    /// Their maximum.
    pub max_ms: u64,
    /// Commits over the run, all workers.
    pub commits: u64,
}

/// Floats of the counter and per key (2 keys, one per shard).
const FLOATS: u32 = 4;
const CHUNK: u32 = 2;
/// Samples per partition and per batch.
pub(crate) const PARTITION: u32 = 64;
pub(crate) const BATCH: u32 = 4;
/// How long one failover may take before the run fails.
const FAILOVER_LIMIT: Duration = Duration::from_secs(60);

/// A coordinator's command line.
fn coordinator_args(plan: &Plan, listen: &str, meta: Option<&str>) -> Vec<String> {
    let mut args: Vec<String> = [
        "coordinator",
        "--listen",
        listen,
        "--counter",
        &FLOATS.to_string(),
        "--chunk-size",
        &CHUNK.to_string(),
        "--shards",
        "2",
        "--consistency",
        "asp",
        // More samples than the run can train: it ends when the kills are done.
        "--train-samples",
        "100000000",
        "--partition-size",
        &PARTITION.to_string(),
        "--batch-size",
        &BATCH.to_string(),
        "--epochs",
        "1",
        "--lease-ms",
        "5000",
    ]
    .map(String::from)
    .to_vec();
    if let Some(url) = meta {
        let ttl = format!("{}ms", plan.ttl.as_millis());
        args.extend(["--meta", url, "--leader-ttl", &ttl].map(String::from));
    }
    args
}

fn spawn(ps: &Path, args: &[String], state: &Path, log: &str) -> anyhow::Result<Proc> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    spawn_from(ps, &args, state, log).with_context(|| format!("starting {}", ps.display()))
}

/// Runs `plan`.
pub async fn run(plan: &Plan) -> anyhow::Result<Report> {
    let ps = crate::load::cluster::locate_ps(plan.bin_dir.as_deref())?;
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    pki.ensure(Role::Coordinator, "coordinator")?;
    let etcd = match plan.store {
        FailStore::Etcd => Some(EtcdCluster::start(3, &state.join("etcd"))?),
        FailStore::Wal => None,
    };
    let meta = etcd.as_ref().map(EtcdCluster::url);
    let n = if etcd.is_some() { 2 } else { 1 };
    let addrs: Vec<String> = (0..n)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let list = addrs.join(",");
    let mut starts = 0;
    let mut start = |i: usize| {
        starts += 1;
        let args = coordinator_args(plan, &addrs[i], meta.as_deref());
        spawn(&ps, &args, state, &format!("c{i}-{starts}.log"))
    };
    let mut coords: Vec<Proc> = (0..n).map(&mut start).collect::<anyhow::Result<_>>()?;
    let _shards: Vec<Proc> = (0..2)
        .map(|i| {
            let name = format!("s{i}");
            pki.ensure(Role::Shard, &name)?;
            let args = [
                "shard",
                "--coordinator",
                &list,
                "--listen",
                "127.0.0.1:0",
                "--name",
                &name,
            ]
            .map(String::from);
            spawn(&ps, &args, state, &format!("{name}.log"))
        })
        .collect::<anyhow::Result<_>>()?;
    let admin = Admin::connect(
        &list,
        &pki.ensure(Role::Admin, "bench")?,
        TransportSettings::default(),
    )
    .await?;
    // Every worker's commit times.
    let commits: Vec<Arc<Mutex<Vec<Step>>>> = (0..plan.workers).map(|_| Arc::default()).collect();
    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, times) in commits.iter().enumerate() {
        let cfg = ClientConfig {
            coordinator: list.clone(),
            identity: pki.ensure(Role::Worker, &format!("w{i}"))?,
            settings: TransportSettings::default(),
        };
        let (times, stop) = (times.clone(), stop.clone());
        tasks.spawn(async move { train(cfg, (i, FLOATS as usize), times, stop).await });
    }
    let first_commits = Instant::now();
    while commits
        .iter()
        .any(|c| c.lock().map_or(true, |t| t.is_empty()))
    {
        anyhow::ensure!(
            first_commits.elapsed() < FAILOVER_LIMIT,
            "the workers did not start training"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut failover_ms = Vec::new();
    for k in 0..plan.kills {
        tokio::time::sleep(plan.gap).await;
        if let Some(r) = tasks.try_join_next() {
            r??;
            anyhow::bail!("a worker stopped before the kills were done");
        }
        let victim = match plan.store {
            FailStore::Wal => 0,
            FailStore::Etcd => {
                let lead = leader(&admin).await.context("no coordinator leads")?;
                addrs
                    .iter()
                    .position(|a| *a == lead)
                    .context("an unknown leader")?
            }
        };
        let killed = Instant::now();
        coords[victim].0.kill()?;
        coords[victim].0.wait()?;
        // A supervisor restarts it at once: a standby under etcd, the coordinator itself
        // (from its log) with the embedded store. Or its machine is lost: it comes back only
        // after the failover.
        let at_once = plan.restart_at_once || plan.store == FailStore::Wal;
        if at_once {
            coords[victim] = start(victim)?;
        }
        let next = loop {
            let next: Option<Vec<Instant>> = commits
                .iter()
                .map(|c| {
                    // The first step begun after the kill: one begun before may have been
                    // answered by the killed coordinator (its answer in flight at the kill),
                    // which measures no failover (it made this 0 ms under load).
                    let steps = c.lock().ok()?;
                    steps
                        .iter()
                        .rev()
                        .take_while(|s| s.0 > killed)
                        .last()
                        .map(|s| s.1)
                })
                .collect();
            if let Some(next) = next {
                break next;
            }
            anyhow::ensure!(
                killed.elapsed() < FAILOVER_LIMIT,
                "kill {k}: the workers did not all commit within {FAILOVER_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if !at_once {
            coords[victim] = start(victim)?;
        }
        let each: Vec<u64> = next
            .iter()
            .map(|t| t.duration_since(killed).as_millis() as u64)
            .collect();
        let ms = each.iter().copied().max().unwrap_or(0);
        eprintln!(
            "failover: kill {} of {}: {ms} ms (each worker's next commit: {each:?} ms)",
            k + 1,
            plan.kills
        );
        failover_ms.push(ms);
    }
    stop.cancel();
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let (median_ms, max_ms) = crate::stats::median_max(&failover_ms);
    Ok(Report {
        store: plan.store,
        workers: plan.workers,
        restart_at_once: plan.restart_at_once || plan.store == FailStore::Wal,
        ttl_ms: etcd.as_ref().map(|_| plan.ttl.as_millis() as u64),
        median_ms,
        max_ms,
        failover_ms,
        commits: commits
            .iter()
            .map(|c| c.lock().map_or(0, |t| t.len() as u64))
            .sum(),
    })
}

/// The coordinator that says it leads.
async fn leader(admin: &Admin) -> Option<String> {
    let deadline = Instant::now() + FAILOVER_LIMIT;
    while Instant::now() < deadline {
        if let Some((a, _)) = admin
            .coordinators()
            .await
            .into_iter()
            .find(|(_, r)| *r == Ok(CoordinatorRole::Leader))
        {
            return Some(a);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// One step of a worker: when its push began, and when its commit completed.
pub(crate) type Step = (Instant, Instant);

/// One worker of a counter job of `floats` floats: push and commit batches of [`BATCH`]
/// until `stop`, recording each step's times; then leaves.
pub(crate) async fn train(
    cfg: ClientConfig,
    (i, floats): (usize, usize),
    times: Arc<Mutex<Vec<Step>>>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let job = Job::connect(&cfg).await?;
    let mut s = job.register(&format!("w{i}")).await?;
    let grads = vec![-1.0f32; floats];
    'run: while let Some(p) = s.next_partition().await? {
        let mut at = p.start;
        while at < p.start + p.len {
            if stop.is_cancelled() {
                break 'run;
            }
            let span = batch_span(&p, at, BATCH);
            let began = Instant::now();
            s.push_span(&grads, span).await?;
            s.commit_span(span, 0.0).await?;
            if let Ok(mut t) = times.lock() {
                t.push((began, Instant::now()));
            }
            at = span.end;
        }
    }
    s.leave().await?;
    Ok(())
}

/// The report as a markdown table row set.
pub fn table(r: &Report) -> String {
    let store = match r.store {
        FailStore::Etcd => format!(
            "etcd (3 members), 2 coordinators, --leader-ttl {} ms, the killed one restarted {}",
            r.ttl_ms.unwrap_or(0),
            if r.restart_at_once {
                "at once"
            } else {
                "after the failover"
            }
        ),
        FailStore::Wal => "embedded log, 1 coordinator restarted at once".into(),
    };
    format!(
        "| store | workers | kills | median ms | max ms | every kill, ms |\n|---|---|---|---|---|---|\n\
         | {store} | {} | {} | {} | {} | {:?} |",
        r.workers,
        r.failover_ms.len(),
        r.median_ms,
        r.max_ms,
        r.failover_ms
    )
}
