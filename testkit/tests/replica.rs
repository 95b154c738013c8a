//! Replicated key ranges with real processes: a job keeps two copies of every range on three
//! `edl-ps shard` processes; the primary of some keys is killed with SIGKILL while three
//! workers push concurrently, is never restarted, and its backups take over: every
//! acknowledged push is applied exactly once, to the float, and every ledger is exact.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::DataSpan;
use edl_shared::proto::{Clock, Key};
use edl_shared::transport::TransportSettings;
use edl_testkit::procs::{Proc, bin, free_port, spawn, spawn_shard};
use edl_worker::{ClientConfig, Job};

/// Floats of the counter, one per key: two keys per shard.
const FLOATS: usize = 6;
/// Samples of the one epoch, per partition and per push.
const SAMPLES: u32 = 1200;
const PARTITION: u32 = 40;
const BATCH: u32 = 4;

fn wait_for_file(path: &Path) -> anyhow::Result<String> {
    edl_testkit::procs::wait_for_file(path, Duration::from_secs(20))
        .ok_or_else(|| anyhow::anyhow!("{} never appeared", path.display()))
}

/// The times at which pushes were acknowledged (since the start), and how many.
#[derive(Default)]
struct Acks {
    count: AtomicU64,
    times: std::sync::Mutex<Vec<Duration>>,
}

/// One worker: pushes a gradient of -1 for every batch of every partition it leases (so that
/// SGD at rate 1 adds exactly 1 per push to every float) and commits it, until the data runs
/// out.
async fn work(job: Job, name: String, acks: Arc<Acks>, t0: Instant) -> anyhow::Result<u64> {
    let mut w = job.register(&name).await?;
    let mut pushed = 0;
    while let Some(part) = w.next_partition().await? {
        let end = part.start + part.len;
        let mut at = part.start;
        while at < end {
            let span = DataSpan {
                epoch: part.epoch,
                partition: part.index,
                start: at,
                end: (at + BATCH).min(end),
            };
            at = span.end;
            tokio::time::timeout(Duration::from_secs(60), w.push_span(&[-1.0; FLOATS], span))
                .await??;
            acks.count.fetch_add(1, Ordering::Relaxed);
            acks.times
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(t0.elapsed());
            w.commit_span(span, 0.0).await?;
            pushed += 1;
        }
    }
    w.leave().await?;
    Ok(pushed)
}

/// Two workers (`w0`, `w1`) pushing to `cluster`'s job, once they have 20 pushes
/// acknowledged: their acknowledgements, when they started, their tasks.
async fn two_workers(
    cluster: &edl_testkit::TestCluster,
) -> anyhow::Result<(
    Arc<Acks>,
    Instant,
    tokio::task::JoinSet<anyhow::Result<u64>>,
)> {
    let acks = Arc::new(Acks::default());
    let t0 = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for name in ["w0", "w1"] {
        let job = cluster.connect(name).await?;
        workers.spawn(work(job, name.to_string(), acks.clone(), t0));
    }
    while acks.count.load(Ordering::Relaxed) < 20 {
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(60), "no progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok((acks, t0, workers))
}

/// Whether every key of `map` has `copies` copies (its primary and backups).
fn fully_copied(map: &edl_shared::proto::ShardMap, copies: usize) -> bool {
    (0..map.num_keys()).all(|k| 1 + map.backups_of(Key(k)).count() == copies)
}

/// The counter job of `samples` samples an in-process cluster runs: two copies of every key.
fn counter(samples: u32) -> edl_shared::proto::JobConfig {
    let mut job = edl_testkit::counter_job(FLOATS as u32, 1, edl_shared::proto::Consistency::Asp);
    job.train_samples = samples;
    job.partition_size = PARTITION;
    job.batch_size = BATCH;
    job.lease_ms = 20_000;
    job.replicas = 2;
    job
}

/// Waits until `observer`'s map has two copies of every key (up to `limit` from `t0`).
async fn copies_back(
    observer: &Job,
    t0: Instant,
    limit: Duration,
) -> anyhow::Result<edl_shared::proto::ShardMap> {
    loop {
        let map = observer.map();
        if fully_copied(&map, 2) {
            return Ok(map);
        }
        anyhow::ensure!(t0.elapsed() < limit, "the copies never came back: {map:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_loses_no_acknowledged_push() -> anyhow::Result<()> {
    run(1).await
}

/// Three times: the primary of key 0 is killed while the workers push, and restarted on its
/// address, where it rejoins as a standby; the job waits for nothing, and before the next kill
/// every range has its two copies again (a backup seeded on a standby or another shard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_shards_rejoin_as_standbys_and_every_range_gets_its_copies_back()
-> anyhow::Result<()> {
    run(3).await
}

/// Runs the counter job, killing the primary of key 0 `kills` times (each killed shard but the
/// last restarted at once, and every range back to two copies before the next kill), and
/// checks that nothing acknowledged was lost.
async fn run(kills: u32) -> anyhow::Result<()> {
    anyhow::ensure!(
        bin("edl-ps").exists(),
        "{} is missing: run the tests with cargo test --workspace",
        bin("edl-ps").display()
    );
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    pki.ensure(Role::Coordinator, "coordinator")?;
    let addr_file = state.join("coordinator.addr");
    let (floats, samples, partition, batch) = (
        FLOATS.to_string(),
        SAMPLES.to_string(),
        PARTITION.to_string(),
        BATCH.to_string(),
    );
    let _coordinator = spawn(
        &[
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--addr-file",
            addr_file.to_str().expect("utf-8"),
            "--counter",
            &floats,
            "--chunk-size",
            "1",
            "--shards",
            "3",
            "--replicas",
            "2",
            "--consistency",
            "asp",
            "--train-samples",
            &samples,
            "--partition-size",
            &partition,
            "--batch-size",
            &batch,
            "--epochs",
            "1",
            "--lease-ms",
            "5000",
        ],
        state,
        "coordinator.log",
    );
    let coordinator = wait_for_file(&addr_file)?;
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut shards: Vec<Option<Proc>> = Vec::new();
    // Shard `i` on its port, logging to `log`.
    let shard = |i: usize, log: &str| -> anyhow::Result<Proc> {
        let (listen, name) = (format!("127.0.0.1:{}", ports[i]), format!("s{i}"));
        Ok(spawn_shard(
            &bin("edl-ps"),
            (&coordinator, &listen, &name),
            state,
            log,
        )?)
    };
    for i in 0..ports.len() {
        pki.ensure(Role::Shard, &format!("s{i}"))?;
        shards.push(Some(shard(i, &format!("s{i}.log"))?));
    }
    let connect = |name: &str| -> anyhow::Result<ClientConfig> {
        Ok(ClientConfig {
            coordinator: coordinator.clone(),
            identity: pki.ensure(Role::Worker, name)?,
            settings: TransportSettings::default(),
        })
    };
    let observer = Job::connect(&connect("observer")?).await?;
    let map = observer.map();
    anyhow::ensure!(
        map.backups.len() == map.ranges.len(),
        "one backup per range: {map:?}"
    );
    let mut start = vec![0f32; FLOATS];
    observer.pull_all(&mut start, Clock(0)).await?;

    let acks = Arc::new(Acks::default());
    let t0 = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..3 {
        let job = Job::connect(&connect(&format!("w{i}"))?).await?;
        workers.spawn(work(job, format!("w{i}"), acks.clone(), t0));
    }
    // Kill the primary of key 0 a third of the way through (then, with more kills, at even
    // steps after that), restarting it on its address from the second kill on.
    let total = u64::from(SAMPLES / BATCH);
    let mut killed_at = Duration::ZERO;
    let mut victims = Vec::new();
    for round in 0..kills {
        let due = total / 3 + u64::from(round) * total / 2 / u64::from(kills);
        let map = loop {
            let map = observer.map();
            // Before another kill every range has its copies back.
            if acks.count.load(Ordering::Relaxed) >= due && fully_copied(&map, 2) {
                break map;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(90),
                "no progress, or the copies never came back: {map:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let victim = map.owner(Key(0)).expect("placed");
        let victim_addr = map.addr_of(victim).expect("address").to_string();
        let i = ports
            .iter()
            .position(|p| victim_addr.ends_with(&format!(":{p}")))
            .expect("a shard we started");
        let mut killed = shards[i].take().expect("running");
        killed.0.kill()?;
        killed.0.wait()?;
        killed_at = t0.elapsed();
        victims.push(victim);
        if round + 1 < kills {
            // Back on its address: a standby, until a range needs a copy on it.
            shards[i] = Some(shard(i, &format!("s{i}-{round}.log"))?);
        }
    }
    let victim = victims.last().copied().expect("a kill");

    let mut pushed = 0;
    while let Some(done) = workers.join_next().await {
        pushed += done??;
    }
    let want = total;
    assert_eq!(pushed, want, "every batch pushed and committed once");
    // The longest wait for an acknowledgement from the kill on.
    let times = acks.times.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let after: Vec<Duration> = times.iter().copied().filter(|t| *t >= killed_at).collect();
    let first = after.iter().min().copied().unwrap_or_default();
    eprintln!(
        "last primary killed at {killed_at:?}; first acknowledgement after it {:?} later",
        first.saturating_sub(killed_at)
    );

    let mut now = vec![0f32; FLOATS];
    observer.pull_all(&mut now, Clock(0)).await?;
    let map = observer.map();
    assert!(!map.places(victim), "{victim} still placed: {map:?}");
    for k in 0..FLOATS {
        // SGD at rate 1 with a gradient of -1: exactly one more per push, none lost or twice.
        assert_eq!(
            now[k] - start[k],
            want as f32,
            "k{k}: {} pushes acknowledged",
            want
        );
    }
    let ledgers = observer.ledgers().await?;
    assert!(!ledgers.is_empty(), "{ledgers:?}");
    for (shard, ledger) in ledgers {
        let l = &ledger[0];
        assert_eq!(
            (l.applied, l.missing, l.duplicates),
            (u64::from(SAMPLES), 0, 0),
            "{shard}"
        );
    }
    Ok(())
}

/// The primary of key 0 is cut off from its backup (the fault layer drops every datagram
/// between the two, both still reach everyone else) while two workers push: its pushes wait
/// for the backup until it reports it lost, the coordinator drops it as the backup of the
/// primary's ranges, and training goes on; a new backup is seeded where one can be, and once
/// the link heals every range has its two copies. Nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_cut_off_from_its_backup_goes_on_and_the_copies_come_back() -> anyhow::Result<()>
{
    use edl_shared::faults::Faults;
    use edl_testkit::TestCluster;

    let faults = Faults::new(11);
    let cluster = TestCluster::start_with_faults(counter(4 * SAMPLES), 3, faults.clone()).await?;
    let observer = cluster.connect("observer").await?;
    let map = observer.map();
    let primary = map.owner(Key(0)).expect("placed");
    let backup = map.backups_of(Key(0)).next().expect("a backup");
    let (acks, t0, mut workers) = two_workers(&cluster).await?;
    let (p, b) = (format!("s{}", primary.0), format!("s{}", backup.0));
    faults.partition(p.as_str(), b.as_str());
    let cut_at = t0.elapsed();
    // The backup is dropped for the primary's ranges, and pushes go on.
    let dropped = loop {
        let map = observer.map();
        if !map.backups_of(Key(0)).any(|s| s == backup) {
            break acks.count.load(Ordering::Relaxed);
        }
        anyhow::ensure!(
            t0.elapsed() < cut_at + Duration::from_secs(60),
            "{b} was never dropped as {p}'s backup: {map:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let went_on = loop {
        let n = acks.count.load(Ordering::Relaxed);
        if n >= dropped + 20 {
            break n;
        }
        anyhow::ensure!(
            t0.elapsed() < cut_at + Duration::from_secs(90),
            "training stopped after the backup was dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(faults.stats().partitioned > 0, "the cut dropped nothing");
    faults.heal(p.as_str(), b.as_str());
    eprintln!(
        "cut at {cut_at:?}: {b} dropped as {p}'s backup after {dropped} pushes, {went_on} since"
    );
    let mut pushed = 0;
    while let Some(done) = workers.join_next().await {
        pushed += done??;
    }
    let total = u64::from(4 * SAMPLES / BATCH);
    assert_eq!(pushed, total);
    let copied = copies_back(&observer, t0, Duration::from_secs(180)).await?;
    let mut now = vec![0f32; FLOATS];
    observer.pull_all(&mut now, Clock(0)).await?;
    assert!(now.iter().all(|v| *v == total as f32), "{now:?}");
    edl_testkit::assert_exactly_once(&observer, u64::from(4 * SAMPLES)).await?;
    eprintln!("copies back: {copied:?}");
    Ok(())
}

/// An operator removes the primary of key 0 while two workers push: its backups take its
/// ranges at once (nothing is copied first: they hold everything it acknowledged), the
/// shard retires, and the two shards left each get a copy of every range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_primary_hands_its_ranges_to_their_backups() -> anyhow::Result<()> {
    use edl_testkit::TestCluster;

    let cluster = TestCluster::start(counter(SAMPLES), 3).await?;
    let observer = cluster.connect("observer").await?;
    let primary = observer.map().owner(Key(0)).expect("placed");
    let (_, t0, mut workers) = two_workers(&cluster).await?;
    let view = cluster
        .admin()
        .await?
        .shard_remove(&format!("s{}", primary.0))
        .await?;
    eprintln!("removed s{}: {view:?}", primary.0);
    let mut pushed = 0;
    while let Some(done) = workers.join_next().await {
        pushed += done??;
    }
    let total = u64::from(SAMPLES / BATCH);
    assert_eq!(pushed, total);
    let map = copies_back(&observer, t0, Duration::from_secs(120)).await?;
    assert!(!map.places(primary), "{map:?}");
    let mut now = vec![0f32; FLOATS];
    observer.pull_all(&mut now, Clock(0)).await?;
    assert!(now.iter().all(|v| *v == total as f32), "{now:?}");
    let ledgers = edl_testkit::assert_exactly_once(&observer, u64::from(SAMPLES)).await?;
    assert_eq!(ledgers.len(), 2, "{ledgers:?}");
    Ok(())
}
