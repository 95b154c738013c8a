//! No single point of failure in the control plane, with real processes: two coordinators of
//! one job keep its state in a real 3-member etcd on loopback, one leading, the other standing
//! by. Killing the leader with SIGKILL (three times, each restarted as a standby) costs a
//! pause, not a worker and not a sample: the dead leader's lease is revoked (by the standby,
//! whose probes it no longer answers, or by its restarted process), a standby takes the lead
//! and restores the state etcd holds, and the worker, given both addresses, follows it. With
//! all of etcd down, training goes on: the leader acknowledges training reports from memory
//! while its lease surely holds, and writes them once etcd is back.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use edl_ps::admin::{Admin, CoordinatorRole};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::DataSpan;
use edl_shared::proto::{Key, ShardId};
use edl_shared::transport::TransportSettings;
use edl_testkit::etcd::{EtcdCluster, have_etcd};
use edl_testkit::procs::{Proc, bin, free_port, shards, spawn};
use edl_worker::{ClientConfig, Job};

/// Samples of the job: a 4-4 MLP (20 floats) under SGD at rate 1, batches of 4.
const SAMPLES: u32 = 192;

/// A coordinator of the job listening on `listen`, its state in `meta`.
fn coordinator(listen: &str, meta: &str, state: &Path, log: &str) -> Proc {
    let samples = SAMPLES.to_string();
    spawn(
        &[
            "coordinator",
            "--listen",
            listen,
            "--meta",
            meta,
            // Longer than the etcd outage below, which training rides out; a dead leader is
            // found by the standby's probes (--leader-dead-after, 1 s).
            "--leader-ttl",
            "30s",
            "--shards",
            "2",
            "--layers",
            "4,4",
            "--chunk-size",
            "4",
            "--optimizer",
            "sgd:1",
            "--consistency",
            "ssp:1",
            "--train-samples",
            &samples,
            "--partition-size",
            "16",
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--lease-ms",
            "5000",
        ],
        state,
        log,
    )
}

/// Which of `addrs` leads, as the coordinators themselves say.
async fn leader(admin: &Admin) -> Option<String> {
    admin
        .coordinators()
        .await
        .into_iter()
        .find(|(_, r)| *r == Ok(CoordinatorRole::Leader))
        .map(|(a, _)| a)
}

/// The job's two coordinators under a supervisor that restarts an exited one at once (as
/// systemd's `Restart=always` would): a killed or deposed coordinator comes back as a standby.
struct Coordinators {
    addrs: [String; 2],
    meta: String,
    state: PathBuf,
    procs: std::sync::Mutex<[Option<Proc>; 2]>,
    /// Exits seen, by coordinator: its log file and exit status.
    exits: std::sync::Mutex<Vec<(usize, String, std::process::ExitStatus)>>,
    starts: std::sync::atomic::AtomicUsize,
}

impl Coordinators {
    fn start(&self, i: usize) -> String {
        let n = self
            .starts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let log = format!("c{i}-{n}.log");
        let p = coordinator(&self.addrs[i], &self.meta, &self.state, &log);
        self.procs.lock().expect("procs")[i] = Some(p);
        log
    }

    /// Restarts every coordinator that exited; records how it exited.
    fn supervise(&self, logs: &mut [String; 2]) {
        for i in 0..2 {
            let exited = {
                let mut procs = self.procs.lock().expect("procs");
                match procs[i].as_mut().map(|p| p.0.try_wait()) {
                    Some(Ok(Some(status))) => {
                        procs[i] = None;
                        Some(status)
                    }
                    _ => None,
                }
            };
            if let Some(status) = exited {
                self.exits
                    .lock()
                    .expect("exits")
                    .push((i, logs[i].clone(), status));
                logs[i] = self.start(i);
            }
        }
    }

    fn pid(&self, i: usize) -> i32 {
        self.procs.lock().expect("procs")[i]
            .as_ref()
            .map_or(0, |p| p.0.id() as i32)
    }
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig)?;
    Ok(())
}

/// The samples the coordinator's state in etcd counts, once it counts them all (within 30 s).
async fn written(url: &str) -> anyhow::Result<u64> {
    let endpoints = edl_ps::coordinator::etcd::parse_url(url).map_err(anyhow::Error::msg)?;
    let meta = edl_ps::coordinator::etcd::EtcdMeta::connect(
        endpoints,
        edl_shared::pki::DEFAULT_JOB,
        "coordinator",
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let done = match meta.load().await {
            Ok(Some(record)) => edl_ps::coordinator::meta::decode(&record)?.samples_done(),
            _ => 0,
        };
        if done >= u64::from(SAMPLES) || Instant::now() > deadline {
            return Ok(done);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until one of the coordinators other than `not` leads; returns it.
async fn new_leader(admin: &Admin, not: &str, limit: Duration) -> anyhow::Result<String> {
    let start = Instant::now();
    loop {
        if let Some(l) = leader(admin).await.filter(|l| l != not) {
            return Ok(l);
        }
        anyhow::ensure!(
            start.elapsed() < limit,
            "no other coordinator took the lead within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every failure the issue names, in one run of one worker that pushes and commits 48
/// batches: one etcd member killed and restarted; the leading coordinator killed with SIGKILL
/// three times (the second right after it acknowledged a resharding move); the leader stopped (SIGSTOP, as a partition or a long pause would cut it off)
/// until the standby leads, then let go on: it must change nothing and exit, deposed; and all
/// of etcd stopped for 20 s. A supervisor restarts every coordinator that exits, as a
/// standby. Through all of it the worker never fails, and the ledgers and counters are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_survives_coordinator_and_etcd_failures() -> anyhow::Result<()> {
    if !have_etcd() {
        return Ok(());
    }
    anyhow::ensure!(
        bin("edl-ps").exists(),
        "{} is missing: run the tests with cargo test --workspace",
        bin("edl-ps").display()
    );
    let dir = tempfile::tempdir()?;
    let run = tokio::spawn(failures(dir.path().to_path_buf())).await;
    if !matches!(run, Ok(Ok(()))) {
        eprintln!("{}", edl_testkit::procs::log_tails(dir.path(), 80));
    }
    match run {
        Ok(result) => result,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// The run of [`the_control_plane_survives_coordinator_and_etcd_failures`], its processes'
/// logs in `state`.
async fn failures(state: PathBuf) -> anyhow::Result<()> {
    let state = state.as_path();
    // The worker's side of each failover, in the output of a failed run.
    edl_shared::telemetry::init("info");
    let etcd = std::sync::Arc::new(std::sync::Mutex::new(EtcdCluster::start(
        3,
        &state.join("etcd"),
    )?));
    let meta = etcd.lock().expect("etcd").url();
    let meta_url = meta.clone();
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    for (role, name) in [
        (Role::Coordinator, "coordinator"),
        (Role::Shard, "s0"),
        (Role::Shard, "s1"),
    ] {
        pki.ensure(role, name)?;
    }
    let coords = std::sync::Arc::new(Coordinators {
        addrs: [
            format!("127.0.0.1:{}", free_port()),
            format!("127.0.0.1:{}", free_port()),
        ],
        meta,
        state: state.to_path_buf(),
        procs: std::sync::Mutex::new([None, None]),
        exits: std::sync::Mutex::new(Vec::new()),
        starts: std::sync::atomic::AtomicUsize::new(0),
    });
    let list = coords.addrs.join(",");
    let mut logs = [coords.start(0), coords.start(1)];
    let supervisor = {
        let (coords, stop) = (coords.clone(), tokio_util::sync::CancellationToken::new());
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            while !stopped.is_cancelled() {
                coords.supervise(&mut logs);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        (task, stop)
    };
    let _shards = shards(&list, 2, state);
    let admin = Admin::connect(
        &list,
        &pki.ensure(Role::Admin, "op")?,
        TransportSettings::default(),
    )
    .await?;
    let cfg = ClientConfig {
        coordinator: list.clone(),
        identity: pki.ensure(Role::Worker, "w")?,
        settings: TransportSettings::default(),
    };
    let job = Job::connect(&cfg).await?;
    let mut w = job.clone().register("w").await?;
    let kills_at = [10, 18, 26];
    let mut commits = 0;
    let mut failovers = Vec::new();
    let mut killed_at: Option<Instant> = None;
    let mut stopped: Option<(usize, String)> = None;
    let mut etcd_outage: Option<tokio::task::JoinHandle<anyhow::Result<Instant>>> = None;
    let mut outage_began = None;
    let mut commit_times = Vec::new();
    let mut moved: Option<(u64, u64)> = None;
    let mut part = w.next_partition().await?;
    while let Some(p) = part {
        let mut at = p.start;
        while at < p.start + p.len {
            let span = DataSpan {
                epoch: 0,
                partition: p.index,
                start: at,
                end: at + 4,
            };
            at += 4;
            w.push_span(&[-1.0; 20], span).await?;
            tokio::time::timeout(Duration::from_secs(90), w.commit_span(span, 0.0))
                .await
                .map_err(|_| anyhow::anyhow!("commit {} took over 90 s", commits + 1))??;
            commits += 1;
            commit_times.push(Instant::now());
            if let Some(k) = killed_at.take() {
                failovers.push(k.elapsed());
            }
            match commits {
                // One etcd member down changes nothing; it comes back.
                4 => etcd.lock().expect("etcd").kill(0),
                8 => {
                    let mut e = etcd.lock().expect("etcd");
                    e.restart(0)?;
                    e.wait_healthy(Duration::from_secs(30))?;
                }
                n if kills_at.contains(&n) => {
                    if n == kills_at[1] {
                        // A resharding step the leader acknowledges right before it dies: the
                        // first key of s0 goes to s1.
                        let map = admin.map().await?;
                        let key = map
                            .ranges_of(ShardId(0))
                            .map(|r| r.start)
                            .min()
                            .expect("s0 holds keys");
                        let view = admin.move_range(key, key + 1, "s1").await?;
                        anyhow::ensure!(view.moves.len() == 1, "one move: {:?}", view.moves);
                        moved = Some((key, view.epoch));
                    }
                    let lead = leader(&admin).await.expect("a coordinator leads");
                    let i = coords.addrs.iter().position(|a| *a == lead).expect("ours");
                    signal(coords.pid(i), nix::sys::signal::Signal::SIGKILL)?;
                    killed_at = Some(Instant::now());
                }
                // The leader cut off: stopped until the other leads (its lease runs out).
                32 => {
                    let lead = leader(&admin).await.expect("a coordinator leads");
                    let i = coords.addrs.iter().position(|a| *a == lead).expect("ours");
                    signal(coords.pid(i), nix::sys::signal::Signal::SIGSTOP)?;
                    new_leader(&admin, &lead, Duration::from_secs(30)).await?;
                    stopped = Some((i, lead));
                }
                // It goes on: it must find itself deposed and exit, having changed nothing.
                36 => {
                    let (i, _) = stopped.clone().expect("stopped at 32");
                    signal(coords.pid(i), nix::sys::signal::Signal::SIGCONT)?;
                }
                // All of etcd down for 20 s: training goes on.
                40 => {
                    etcd.lock().expect("etcd").stop_all();
                    outage_began = Some(Instant::now());
                    let etcd = etcd.clone();
                    etcd_outage = Some(tokio::task::spawn_blocking(move || {
                        std::thread::sleep(Duration::from_secs(20));
                        let back = Instant::now();
                        etcd.lock().expect("etcd").start_all()?;
                        Ok(back)
                    }));
                }
                _ => {}
            }
        }
        part = w.next_partition().await?;
    }
    assert_eq!(commits, SAMPLES / 4);
    // The move acknowledged before the leader's death was neither lost nor done again: the
    // key is on s1 in a map at least as new as the move's, and s0 holds the rest of its keys
    // as before.
    let (key, epoch) = moved.expect("a move was made");
    let map = admin.map().await?;
    assert!(
        map.epoch.0 >= epoch,
        "the map went back: {} < {epoch}",
        map.epoch.0
    );
    assert_eq!(map.owner(Key(key)), Some(ShardId(1)), "{map:?}");
    assert!(
        map.ranges_of(ShardId(0)).all(|r| r.start > key),
        "s0 still holds key {key}: {map:?}"
    );
    let status = job.status().await?;
    assert!(status.finished, "{status:?}");
    assert_eq!(
        status.epochs[0].samples,
        u64::from(SAMPLES),
        "the counters are exact"
    );
    for (shard, ledgers) in job.ledgers().await? {
        let l = &ledgers[0];
        assert_eq!(
            (l.applied, l.missing, l.duplicates),
            (u64::from(SAMPLES), 0, 0),
            "shard {shard}"
        );
    }
    // The rest of the job trained while etcd was down: the leader acknowledged its commits
    // from memory, its lease surely holding, and wrote them once etcd was back.
    let began = outage_began.expect("etcd was stopped");
    let back = etcd_outage.expect("etcd was stopped").await??;
    let during = commit_times
        .iter()
        .filter(|t| **t > began && **t < back)
        .count();
    assert_eq!(
        during,
        (SAMPLES / 4 - 40) as usize,
        "the commits after etcd stopped did not all complete while it was down"
    );
    // Once etcd is back, the state it holds is exact: the leader wrote what it acknowledged.
    let held = written(&meta_url).await?;
    assert_eq!(held, u64::from(SAMPLES), "the counters etcd holds");
    // The stopped leader, let go on, found itself deposed and exited.
    let (i, _) = stopped.expect("the leader was stopped");
    let deadline = Instant::now() + Duration::from_secs(60);
    let deposed = loop {
        let exits = coords.exits.lock().expect("exits").clone();
        let deposed = exits.iter().any(|(j, log, status)| {
            *j == i
                && !status.success()
                && std::fs::read_to_string(state.join(log)).is_ok_and(|t| t.contains("deposed"))
        });
        if deposed || Instant::now() > deadline {
            break (deposed, exits);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        deposed.0,
        "the stopped leader did not exit deposed: {:?}",
        deposed.1
    );
    supervisor.1.cancel();
    let _ = supervisor.0.await;
    // Both coordinators answer: one leads, one stands by.
    let roles = admin.coordinators().await;
    let leads = roles
        .iter()
        .filter(|(_, r)| *r == Ok(CoordinatorRole::Leader))
        .count();
    assert_eq!(leads, 1, "{roles:?}");
    let mut ms: Vec<u128> = failovers.iter().map(Duration::as_millis).collect();
    ms.sort_unstable();
    eprintln!(
        "failover (SIGKILL of the leader to the worker's next commit), ms: {ms:?}; commits \
         while etcd was stopped for 20 s: {during}"
    );
    w.leave().await?;
    Ok(())
}
