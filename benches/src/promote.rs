//! `edl-bench promote`: what a shard's death costs a job that keeps two copies of every key
//! range: how long its workers pause, and how long until every range has its two copies
//! again.
//!
//! Real processes on loopback: a coordinator and 3 shards are `edl-ps` processes
//! (`--replicas 2`); the workers run in this process (the client library over QUIC), each
//! looping push and commit on an MLP job of the size asked for under ASP (gradients of -1: the
//! model's quality does not matter here). Then the primary
//! of key 0 is killed with SIGKILL `kills` times; before each kill every range has its two
//! copies, and after it the killed shard is restarted on its address (where it rejoins as a
//! standby, and may be seeded in turn).
//!
//! - The *pause* of a kill is from the SIGKILL until every worker has completed a step begun
//!   after it (its push acknowledged by the promoted backup, and committed): detection (the
//!   socket probe), the published map, the clients' re-routing and the retried push.
//! - The *re-seed* time is from the map without the killed shard (as a client sees it) until a
//!   map with two copies of every key: new backups of the ranges left with one copy, seeded
//!   one range at a time while the workers go on.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::{Key, ShardMap};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_testkit::procs::{Proc, free_port, spawn_from, spawn_shard};
use edl_worker::{ClientConfig, Job};
use serde::Serialize;

use crate::failover::{BATCH, PARTITION, Step, train};
use crate::stats::median_max;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Kills.
    pub kills: usize,
    /// Workers.
    pub workers: usize,
    /// The MLP's layer widths.
    pub layers: Vec<u32>,
    /// Floats per key.
    pub chunk: u32,
    /// The shards' optimizer (its state is copied with the parameters).
    pub optimizer: String,
    /// Steady training before each kill.
    pub gap: Duration,
    /// Where `edl-ps` is [default: beside edl-bench].
    pub bin_dir: Option<PathBuf>,
}

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Model bytes (parameters).
    pub model_bytes: u64,
    /// The optimizer.
    pub optimizer: String,
    /// Workers.
    pub workers: usize,
    /// Each kill's pause, ms: from the SIGKILL until every worker completed a step begun after
    /// it.
    pub pause_ms: Vec<u64>,
    /// Each kill's re-seed time, ms: from the map without the killed shard to two copies of
    /// every key.
    pub reseed_ms: Vec<u64>,
    /// Commits over the run, all workers.
    pub commits: u64,
}

/// How long one kill may take to recover before the run fails.
const LIMIT: Duration = Duration::from_secs(120);

/// Whether every key of `map` has two copies.
fn copied(map: &ShardMap) -> bool {
    (0..map.num_keys()).all(|k| map.backups_of(Key(k)).count() == 1)
}

fn shard(
    ps: &Path,
    coordinator: &str,
    port: u16,
    i: usize,
    state: &Path,
    log: &str,
) -> anyhow::Result<Proc> {
    let (listen, name) = (format!("127.0.0.1:{port}"), format!("s{i}"));
    spawn_shard(ps, (coordinator, &listen, &name), state, log)
        .with_context(|| format!("starting {}", ps.display()))
}

/// Runs `plan`.
pub async fn run(plan: &Plan) -> anyhow::Result<Report> {
    let ps = crate::load::cluster::locate_ps(plan.bin_dir.as_deref())?;
    let mut dir = tempfile::tempdir()?;
    // The processes' logs, kept for a look where asked.
    if std::env::var_os("EDL_BENCH_KEEP").is_some() {
        dir.disable_cleanup(true);
        eprintln!("promote: state and logs kept in {}", dir.path().display());
    }
    let state = dir.path();
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    pki.ensure(Role::Coordinator, "coordinator")?;
    let coordinator = format!("127.0.0.1:{}", free_port());
    let floats: u64 = plan
        .layers
        .windows(2)
        .map(|w| u64::from(w[0]) * u64::from(w[1]) + u64::from(w[1]))
        .sum();
    let layers: Vec<String> = plan.layers.iter().map(u32::to_string).collect();
    let (layers, chunk) = (layers.join(","), plan.chunk.to_string());
    let (partition, batch) = (PARTITION.to_string(), BATCH.to_string());
    let args = [
        "coordinator",
        "--listen",
        &coordinator,
        "--layers",
        &layers,
        "--chunk-size",
        &chunk,
        "--optimizer",
        &plan.optimizer,
        "--shards",
        "3",
        "--replicas",
        "2",
        "--consistency",
        "asp",
        // An epoch the size of Fashion-MNIST's: the ranges' data ledgers are copied with them.
        "--train-samples",
        "60000",
        "--partition-size",
        &partition,
        "--batch-size",
        &batch,
        "--epochs",
        "1000",
        "--lease-ms",
        "20000",
    ];
    let _coordinator = spawn_from(&ps, &args, state, "coordinator.log")?;
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut shards: Vec<Option<Proc>> = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        pki.ensure(Role::Shard, &format!("s{i}"))?;
        shards.push(Some(shard(
            &ps,
            &coordinator,
            *port,
            i,
            state,
            &format!("s{i}.log"),
        )?));
    }
    let client = |name: &str| -> anyhow::Result<ClientConfig> {
        Ok(ClientConfig {
            coordinator: coordinator.clone(),
            identity: pki.ensure(Role::Worker, name)?,
            settings: TransportSettings::default(),
        })
    };
    let observer = Job::connect(&client("observer")?).await?;
    let commits: Vec<Arc<Mutex<Vec<Step>>>> = (0..plan.workers).map(|_| Arc::default()).collect();
    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, times) in commits.iter().enumerate() {
        let cfg = client(&format!("w{i}"))?;
        let (times, stop, floats) = (times.clone(), stop.clone(), floats as usize);
        tasks.spawn(async move { train(cfg, (i, floats), times, stop).await });
    }
    let mut pause_ms = Vec::new();
    let mut reseed_ms = Vec::new();
    for k in 0..plan.kills {
        let ready = Instant::now();
        while !copied(&observer.map())
            || commits
                .iter()
                .any(|c| c.lock().map_or(true, |t| t.is_empty()))
        {
            anyhow::ensure!(
                ready.elapsed() < LIMIT,
                "kill {k}: the copies never came back"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(plan.gap).await;
        if let Some(r) = tasks.try_join_next() {
            r??;
            anyhow::bail!("a worker stopped before the kills were done");
        }
        let map = observer.map();
        let victim = map.owner(Key(0)).context("key 0 placed")?;
        let addr = map.addr_of(victim).context("its address")?.to_string();
        let i = ports
            .iter()
            .position(|p| addr.ends_with(&format!(":{p}")))
            .context("a shard of ours")?;
        let mut dead = shards[i].take().context("running")?;
        let killed = Instant::now();
        dead.0.kill()?;
        dead.0.wait()?;
        let (mut paused, mut promoted) = (None, None);
        let reseeded = loop {
            let map = observer.map();
            if promoted.is_none() && !map.places(victim) {
                promoted = Some(Instant::now());
            }
            if paused.is_none() {
                // Each worker's first step begun after the kill, done: its push went to the
                // promoted backup.
                let next: Option<Vec<Instant>> = commits
                    .iter()
                    .map(|c| {
                        let steps = c.lock().ok()?;
                        steps.iter().find(|(began, _)| *began > killed).map(|s| s.1)
                    })
                    .collect();
                paused = next.and_then(|n| n.into_iter().max());
            }
            if let (Some(_), Some(_)) = (paused, promoted)
                && copied(&map)
            {
                break Instant::now();
            }
            anyhow::ensure!(
                killed.elapsed() < LIMIT,
                "kill {k}: no recovery within {LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let pause = paused.map_or(0, |t| t.duration_since(killed).as_millis() as u64);
        let reseed = promoted.map_or(0, |t| reseeded.duration_since(t).as_millis() as u64);
        eprintln!(
            "promote: kill {} of {}: pause {pause} ms, back to two copies {reseed} ms later",
            k + 1,
            plan.kills
        );
        pause_ms.push(pause);
        reseed_ms.push(reseed);
        shards[i] = Some(shard(
            &ps,
            &coordinator,
            ports[i],
            i,
            state,
            &format!("s{i}-{k}.log"),
        )?);
    }
    stop.cancel();
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(Report {
        model_bytes: floats * 4,
        optimizer: plan.optimizer.clone(),
        workers: plan.workers,
        pause_ms,
        reseed_ms,
        commits: commits
            .iter()
            .map(|c| c.lock().map_or(0, |t| t.len() as u64))
            .sum(),
    })
}

/// The report as a markdown table.
pub fn table(r: &Report) -> String {
    let (pm, px) = median_max(&r.pause_ms);
    let (rm, rx) = median_max(&r.reseed_ms);
    format!(
        "| model | optimizer | workers | kills | pause median / max ms | back to 2 copies median / max ms |\n\
         |---|---|---|---|---|---|\n\
         | {} | {} | {} | {} | {pm} / {px} | {rm} / {rx} |\n\nevery pause, ms: {:?}; every re-seed, ms: {:?}",
        edl_shared::units::human_bytes(r.model_bytes),
        r.optimizer,
        r.workers,
        r.pause_ms.len(),
        r.pause_ms,
        r.reseed_ms
    )
}
