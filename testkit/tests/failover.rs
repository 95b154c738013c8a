//! The failover drill, with real processes and a real 3-member etcd on loopback: two
//! coordinators of one job (A and B, `--meta`), 2 shards and 3 `edl-worker` processes given
//! both addresses, training with the default 3 s lease. The coordinator at A is killed with
//! SIGKILL and restarted at once at its address (as a supervisor would), then B, then A again,
//! 6 s apart; or the leader is stopped (SIGSTOP) for 5 s and let go on; or both are killed
//! and started again 5 s later (no coordinator leads for longer than the lease). Every worker must
//! finish the job (exit 0, never dropped), the ledgers must be exact, each term one more than
//! the last (terms count elections), and each drill ends within its bound.
//!
//! `EDL_FAILOVER_DRILLS=N` runs N drills of each kind (default 1); each prints one line: the
//! workers stranded or dropped, the longest outage a worker logged, the longest the job made
//! no progress, and the terms elected.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use edl_ps::admin::{Admin, CoordinatorRole};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::transport::TransportSettings;
use edl_testkit::etcd::{EtcdCluster, have_etcd};
use edl_testkit::have_fashion_mnist;
use edl_testkit::procs::{Proc, bin, free_port, shards, spawn};
use edl_worker::{ClientConfig, Job};

/// Samples of the job: at 3 workers x 16 samples per 50 ms step, about 25 s of training.
const SAMPLES: u32 = 24_000;
/// The longest a drill may take, from the first kill until every worker has exited.
const DRILL_BOUND: Duration = Duration::from_secs(150);

/// How a drill loses the leader.
#[derive(Clone, Copy, Debug)]
enum Drill {
    /// SIGKILL the coordinator at A, then B, then A, 6 s apart, each restarted at once.
    Kills,
    /// SIGSTOP the leader for 5 s, then SIGCONT.
    Stop,
    /// SIGKILL both coordinators, and start them again 5 s later: no coordinator leads for
    /// longer than the lease, which must cost no worker.
    Outage,
}

/// What one drill saw.
#[derive(Debug)]
struct Outcome {
    /// Workers that did not exit 0, or were dropped by the coordinator.
    stranded: usize,
    /// The longest outage of the coordinator a worker logged, in seconds.
    worst_stall: f64,
    /// The longest time, from the first fault on, that the job's samples done did not grow
    /// (sampled every 100 ms from the state in etcd), in seconds.
    job_stall: f64,
    /// The terms elected, in order.
    terms: Vec<u64>,
    /// Seconds from the first fault until every worker exited.
    took: f64,
}

fn coordinator(listen: &str, meta: &str, state: &Path, log: &str) -> Proc {
    let samples = SAMPLES.to_string();
    spawn(
        &[
            "coordinator",
            "--listen",
            listen,
            "--meta",
            meta,
            "--shards",
            "2",
            "--layers",
            "784,16,10",
            "--optimizer",
            "sgd:0.05",
            "--consistency",
            "ssp:2",
            "--train-samples",
            &samples,
            "--partition-size",
            "480",
            "--batch-size",
            "16",
            "--epochs",
            "1",
        ],
        state,
        log,
    )
}

fn worker(list: &str, name: &str, state: &Path) -> anyhow::Result<Child> {
    let log = std::fs::File::create(state.join(format!("{name}.log")))?;
    Ok(Command::new(bin("edl-worker"))
        .args([
            "--coordinator",
            list,
            "--name",
            name,
            "--step-time",
            "50ms",
            "--progress-every",
            "0s",
            "--device",
            "cpu",
        ])
        .arg("--state-dir")
        .arg(state)
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?)
}

fn pid_of(p: &Option<Proc>) -> u32 {
    p.as_ref().map_or(0, |p| p.0.id())
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)?;
    Ok(())
}

/// Which coordinator leads, as they say themselves.
async fn leader(admin: &Admin, addrs: &[String; 2]) -> Option<usize> {
    let lead = admin
        .coordinators()
        .await
        .into_iter()
        .find(|(_, r)| *r == Ok(CoordinatorRole::Leader))
        .map(|(a, _)| a)?;
    addrs.iter().position(|a| *a == lead)
}

/// The numbers in `text` after `key=` on lines that contain `marker`.
fn numbers_after(text: &str, marker: &str, key: &str) -> Vec<f64> {
    text.lines()
        .filter(|l| l.contains(marker))
        .filter_map(|l| {
            let rest = &l[l.find(key)? + key.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            rest[..end].parse().ok()
        })
        .collect()
}

/// One drill in `state`, its processes' logs there.
async fn drill(state: &Path, kind: Drill) -> anyhow::Result<Outcome> {
    let etcd = EtcdCluster::start(3, &state.join("etcd"))?;
    let meta = etcd.url();
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    pki.ensure(Role::Coordinator, "coordinator")?;
    let addrs = [
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    ];
    let list = addrs.join(",");
    let mut starts = 0;
    let start = |i: usize, starts: &mut usize| {
        *starts += 1;
        coordinator(&addrs[i], &meta, state, &format!("c{i}-{starts}.log"))
    };
    let mut coords = [Some(start(0, &mut starts)), Some(start(1, &mut starts))];
    let _shards = shards(&list, 2, state);
    let mut workers = (0..3)
        .map(|i| {
            let name = format!("w{i}");
            pki.ensure(Role::Worker, &name)?;
            worker(&list, &name, state)
        })
        .collect::<anyhow::Result<Vec<Child>>>()?;
    let admin = Admin::connect(
        &list,
        &pki.ensure(Role::Admin, "op")?,
        TransportSettings::default(),
    )
    .await?;
    // Training is under way: some samples are done.
    let began = Instant::now();
    loop {
        let done = admin.status().await.map(|s| s.samples_done).unwrap_or(0);
        if done > 0 {
            break;
        }
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(60),
            "no training within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The job's progress, sampled from the first fault until it finishes.
    // The job's progress as etcd holds it (every acknowledged commit is written there first,
    // whichever coordinator leads), sampled every 100 ms from the first fault until the job
    // has every sample.
    let store = edl_ps::coordinator::etcd::EtcdMeta::connect(
        edl_ps::coordinator::etcd::parse_url(&meta).map_err(anyhow::Error::msg)?,
        edl_shared::pki::DEFAULT_JOB,
        "coordinator",
    )
    .await?;
    let progress = tokio::spawn(async move {
        let (mut last, mut since, mut worst) = (0, Instant::now(), Duration::ZERO);
        loop {
            if let Ok(Some(record)) = store.load().await
                && let Ok(snap) = edl_ps::coordinator::meta::decode(&record)
            {
                let (done, now) = (snap.samples_done(), Instant::now());
                if done > last {
                    worst = worst.max(now - since);
                    (last, since) = (done, now);
                }
                if done >= u64::from(SAMPLES) {
                    return worst;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // The faults, each coordinator that exits restarted at once at its address.
    let first = Instant::now();
    let supervise = |coords: &mut [Option<Proc>; 2], starts: &mut usize| {
        for (i, slot) in coords.iter_mut().enumerate() {
            let exited = slot
                .as_mut()
                .is_some_and(|p| matches!(p.0.try_wait(), Ok(Some(_))));
            if exited {
                *slot = Some(start(i, starts));
            }
        }
    };
    let pid = |coords: &[Option<Proc>; 2], i: usize| pid_of(&coords[i]);
    match kind {
        Drill::Kills => {
            for (n, i) in [0usize, 1, 0].into_iter().enumerate() {
                if n > 0 {
                    let until = Instant::now() + Duration::from_secs(6);
                    while Instant::now() < until {
                        supervise(&mut coords, &mut starts);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                signal(pid(&coords, i), nix::sys::signal::Signal::SIGKILL)?;
                if let Some(mut p) = coords[i].take() {
                    let _ = p.0.wait();
                }
                coords[i] = Some(start(i, &mut starts));
            }
        }
        Drill::Stop => {
            let i = leader(&admin, &addrs).await.unwrap_or(0);
            signal(pid(&coords, i), nix::sys::signal::Signal::SIGSTOP)?;
            tokio::time::sleep(Duration::from_secs(5)).await;
            signal(pid(&coords, i), nix::sys::signal::Signal::SIGCONT)?;
        }
        Drill::Outage => {
            for slot in coords.iter_mut() {
                signal(pid_of(slot), nix::sys::signal::Signal::SIGKILL)?;
                if let Some(mut p) = slot.take() {
                    let _ = p.0.wait();
                }
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
            for (i, slot) in coords.iter_mut().enumerate() {
                *slot = Some(start(i, &mut starts));
            }
        }
    }
    // Every worker exits, within the bound.
    let mut codes = vec![None; workers.len()];
    while codes.iter().any(Option::is_none) {
        anyhow::ensure!(
            first.elapsed() < DRILL_BOUND,
            "workers still running {:?} after the first fault (exited: {codes:?})",
            DRILL_BOUND
        );
        for (w, code) in workers.iter_mut().zip(codes.iter_mut()) {
            if code.is_none() {
                *code = w.try_wait()?.map(|s| s.code());
            }
        }
        supervise(&mut coords, &mut starts);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = first.elapsed().as_secs_f64();
    let job_stall = tokio::time::timeout(Duration::from_secs(30), progress)
        .await
        .map_err(|_| anyhow::anyhow!("the job did not finish within 30 s of its workers' exit"))??
        .as_secs_f64();
    let mut stranded = codes.iter().filter(|c| **c != Some(Some(0))).count();
    let mut worst_stall = 0f64;
    for (i, code) in codes.iter().enumerate() {
        let log = std::fs::read_to_string(state.join(format!("w{i}.log")))?;
        if log.contains("dropped by the coordinator") && *code == Some(Some(0)) {
            stranded += 1;
        }
        for s in numbers_after(&log, "answers again after", "after ") {
            worst_stall = worst_stall.max(s);
        }
    }
    // The job is done, exactly.
    let status = admin.status().await?;
    anyhow::ensure!(status.finished, "the job did not finish: {status:?}");
    anyhow::ensure!(
        status.samples_done == u64::from(SAMPLES),
        "samples done {} of {SAMPLES}",
        status.samples_done
    );
    let observer = Job::connect(&ClientConfig {
        coordinator: list.clone(),
        identity: pki.ensure(Role::Worker, "observer")?,
        settings: TransportSettings::default(),
    })
    .await?;
    for (shard, ledgers) in observer.ledgers().await? {
        let l = &ledgers[0];
        anyhow::ensure!(
            (l.applied, l.missing, l.duplicates) == (u64::from(SAMPLES), 0, 0),
            "shard {shard}: applied {}, missing {}, duplicates {}",
            l.applied,
            l.missing,
            l.duplicates
        );
    }
    // Terms, from every coordinator's log, in the order they were won.
    let mut terms = Vec::new();
    for n in 1..=starts {
        for i in 0..2 {
            if let Ok(log) = std::fs::read_to_string(state.join(format!("c{i}-{n}.log"))) {
                terms.extend(
                    numbers_after(&log, "coordinator elected", "term=")
                        .iter()
                        .map(|t| *t as u64),
                );
            }
        }
    }
    terms.sort_unstable();
    Ok(Outcome {
        stranded,
        worst_stall,
        job_stall,
        terms,
        took,
    })
}

async fn drills(kind: Drill) -> anyhow::Result<()> {
    let n: usize = std::env::var("EDL_FAILOVER_DRILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for k in 0..n {
        let dir = tempfile::tempdir()?;
        let outcome = drill(dir.path(), kind).await;
        match &outcome {
            Ok(o) => eprintln!(
                "drill {kind:?} {k}: {} stranded or dropped, worst outage a worker logged {:.1} \
                 s, longest the job made no progress {:.1} s, terms {:?}, {:.1} s from the \
                 first fault to the last exit",
                o.stranded, o.worst_stall, o.job_stall, o.terms, o.took
            ),
            Err(_) => eprintln!("{}", edl_testkit::procs::log_tails(dir.path(), 60)),
        }
        let o = outcome?;
        assert_eq!(
            o.stranded, 0,
            "drill {kind:?} {k}: workers stranded or dropped"
        );
        let consecutive: Vec<u64> = (1..=o.terms.len() as u64).collect();
        assert_eq!(
            o.terms, consecutive,
            "drill {kind:?} {k}: terms move only with elections"
        );
        assert!(
            o.terms.len() >= 2,
            "drill {kind:?} {k}: no failover: terms {:?}",
            o.terms
        );
    }
    Ok(())
}

/// The drills one after the other (each starts its own etcd and job; at once they would share
/// two cores).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_strand_no_worker() -> anyhow::Result<()> {
    if !have_etcd() || !have_fashion_mnist() {
        return Ok(());
    }
    edl_shared::telemetry::init("info");
    drills(Drill::Kills).await?;
    drills(Drill::Stop).await?;
    drills(Drill::Outage).await
}

/// A worker and an evaluator (`--evaluate --every 1s`) whose only coordinator is killed for
/// good: each waits it out, logging the outage, until SIGTERM, and then ends within its
/// bound: the evaluator at once (it holds nothing), the worker within its grace period (the
/// default, the job's lease) with status 3, saying what it could not hand back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_coordinator_is_gone_exits_within_its_bound() -> anyhow::Result<()> {
    if !have_fashion_mnist() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    let run = bounded_exits(state).await;
    if run.is_err() {
        eprintln!("{}", edl_testkit::procs::log_tails(state, 40));
    }
    run
}

async fn bounded_exits(state: &Path) -> anyhow::Result<()> {
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    pki.ensure(Role::Coordinator, "coordinator")?;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut coordinator = spawn(
        &[
            "coordinator",
            "--listen",
            &addr,
            "--shards",
            "1",
            "--layers",
            "784,16,10",
            "--train-samples",
            "60000",
            "--batch-size",
            "16",
            "--epochs",
            "1",
        ],
        state,
        "coordinator.log",
    );
    let _shard = shards(&addr, 1, state);
    let admin = edl_testkit::until(Duration::from_secs(30), || async {
        let op = pki.ensure(Role::Admin, "op")?;
        Ok(Admin::connect(&addr, &op, TransportSettings::default())
            .await
            .ok())
    })
    .await?;
    for name in ["w0", "eval"] {
        pki.ensure(Role::Worker, name)?;
    }
    let mut trainer = worker(&addr, "w0", state)?;
    let log = std::fs::File::create(state.join("eval.log"))?;
    let mut evaluator = Command::new(bin("edl-worker"))
        .args([
            "--coordinator",
            &addr,
            "--name",
            "eval",
            "--evaluate",
            "--every",
            "1s",
        ])
        .arg("--state-dir")
        .arg(state)
        .env("NO_COLOR", "1")
        .stdout(std::fs::File::create(state.join("eval.out"))?)
        .stderr(log)
        .spawn()?;
    // Training and evaluating are under way (an evaluation printed); then the coordinator is
    // gone for good.
    edl_testkit::until(Duration::from_secs(60), || async {
        let done = admin.status().await?.samples_done;
        let evaluated = std::fs::read_to_string(state.join("eval.out"))?;
        Ok((done > 0 && evaluated.contains("test_accuracy")).then_some(()))
    })
    .await?;
    coordinator.0.kill()?;
    coordinator.0.wait()?;
    // Both wait it out (no --give-up-after): still running 4 s later.
    tokio::time::sleep(Duration::from_secs(4)).await;
    anyhow::ensure!(
        evaluator.try_wait()?.is_none(),
        "the evaluator ended on its own"
    );
    anyhow::ensure!(trainer.try_wait()?.is_none(), "the worker ended on its own");
    let exit_within = |child: &mut Child, limit: Duration| -> anyhow::Result<(i32, f64)> {
        let sent = Instant::now();
        signal(child.id(), nix::sys::signal::Signal::SIGTERM)?;
        loop {
            if let Some(s) = child.try_wait()? {
                return Ok((s.code().unwrap_or(-1), sent.elapsed().as_secs_f64()));
            }
            anyhow::ensure!(
                sent.elapsed() < limit,
                "still running {limit:?} after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let (code, took) = exit_within(&mut evaluator, Duration::from_secs(2))?;
    anyhow::ensure!(code == 0, "the evaluator exited with {code}");
    eprintln!("the evaluator ended {took:.2} s after SIGTERM");
    // The worker's grace is the job's lease (3 s); a second of slack.
    let (code, took) = exit_within(&mut trainer, Duration::from_secs(4))?;
    let log = std::fs::read_to_string(state.join("w0.log"))?;
    anyhow::ensure!(code == 3, "the worker exited with {code}: {log}");
    anyhow::ensure!(log.contains("not handed back"), "{log}");
    anyhow::ensure!(
        log.contains("did not answer a heartbeat") || log.contains("is unreachable"),
        "no outage logged: {log}"
    );
    eprintln!("the worker ended {took:.2} s after SIGTERM, with status 3");
    Ok(())
}
