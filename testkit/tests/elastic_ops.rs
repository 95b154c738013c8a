//! What cheap elasticity buys one job, on an in-process cluster with synthetic compute (a
//! step sleeps a set time, so throughput ratios do not depend on how busy the machine is):
//! a straggler under BSP is replaced and the job gets back to speed (what an ignored one costs
//! is measured on virtual time in `dst.rs`); profiling finds a known scaling limit; a preemption notice shorter than a step abandons the step and loses
//! nothing. Every worker is the real trainer; the placer starts workers in threads.

use std::time::Duration;

use edl_ps::profile::{ProfileOptions, profile};
use edl_shared::proto::ids::WorkerId;
use edl_shared::proto::msg::{EventKind, JobTrace};
use edl_shared::proto::{Consistency, StragglerPolicy, StragglerSettings};
use edl_shared::shutdown::CancellationToken;
use edl_testkit::synthetic::{SleepModel, Units, run_placer, spawn_worker, synthetic_job};
use edl_testkit::traces::{StragglerRun, fewest_active, first_event_since, rate};
use edl_testkit::{TestCluster, assert_exactly_once, until};
use edl_worker::Job;
use edl_worker::trainer::{Slowdown, TrainSummary};

type Worker = std::thread::JoinHandle<anyhow::Result<TrainSummary>>;

/// These tests measure time: one at a time, so that they do not load each other's cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Waits for every worker thread (off the runtime, which the servers need meanwhile).
async fn join_all(handles: Vec<Worker>) -> anyhow::Result<Vec<TrainSummary>> {
    let mut out = Vec::new();
    for h in handles {
        let r = tokio::task::spawn_blocking(move || h.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a worker thread panicked"))?;
        out.push(r?);
    }
    Ok(out)
}

fn first_event(trace: &JobTrace, kind: EventKind, worker: WorkerId) -> Option<u64> {
    first_event_since(trace, kind, worker, 0)
}

const STEP: Duration = Duration::from_millis(20);
const WORKERS: usize = 4;
const SAMPLES: u32 = 24_000;

/// Four synthetic workers under BSP; after 4 s one becomes `factor` times slower. With
/// `policy`, waits for the flag (and, under `replace`, for the straggler to leave), measures
/// 5 s more, then restores the straggler's speed and lets the job finish.
async fn straggler_run(policy: StragglerPolicy, factor: f64) -> anyhow::Result<StragglerRun> {
    let job = synthetic_job(SAMPLES, 1, Consistency::Bsp);
    let batch = job.batch_size;
    let cluster = TestCluster::start(job, 2).await?;
    let admin = cluster.admin().await?;
    admin
        .stragglers(|s: &mut StragglerSettings| s.policy = policy)
        .await?;
    let model = SleepModel {
        step: STEP,
        units: None,
    };
    let (workers, stop) = (CancellationToken::new(), CancellationToken::new());
    let slow = Slowdown::default();
    let mut handles: Vec<Worker> = (0..WORKERS)
        .map(|i| {
            let cfg = cluster.client_config(&format!("w{i}"))?;
            let s = if i == 2 {
                slow.clone()
            } else {
                Slowdown::default()
            };
            Ok(spawn_worker(
                cfg,
                None,
                model.clone(),
                SAMPLES as usize,
                s,
                workers.clone(),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let observer = cluster.connect("observer").await?;
    let body = async {
        let r = run(&observer, policy, &slow, factor).await;
        stop.cancel();
        r
    };
    let (placed, measured) = tokio::join!(
        run_placer(
            &cluster,
            &admin,
            model.clone(),
            SAMPLES as usize,
            workers.clone(),
            stop.clone()
        ),
        body
    );
    handles.extend(placed?);
    let (slowed, flagged, left, _straggler) = measured?;
    join_all(handles).await?;
    assert_exactly_once(&observer, u64::from(SAMPLES)).await?;
    let trace = observer.trace().await?;
    // Active workers after each membership change from the slowdown to the end of the
    // window after: the count the job ran with.
    let end = left.unwrap_or(flagged) + 6_000;
    let fewest = fewest_active(&trace, slowed, end);
    let recovered = left.unwrap_or(flagged);
    Ok(StragglerRun {
        before: rate(&trace, batch, slowed.saturating_sub(3_000), slowed),
        after: rate(&trace, batch, recovered + 1_000, recovered + 5_000),
        detect_ms: flagged.saturating_sub(slowed),
        recover_ms: left.map(|l| l.saturating_sub(slowed)),
        fewest_active: fewest,
    })
}

/// The timed part of a straggler run: (slowed, flagged, left, the straggler's id), in the
/// coordinator's clock.
async fn run(
    observer: &Job,
    policy: StragglerPolicy,
    slow: &Slowdown,
    factor: f64,
) -> anyhow::Result<(u64, u64, Option<u64>, WorkerId)> {
    let straggler = until(Duration::from_secs(60), || async {
        let st = observer.status().await?;
        let all_stepping = st.workers.len() == WORKERS && st.min_clock.0 >= 1;
        Ok(all_stepping
            .then(|| st.workers.iter().find(|w| w.name == "w2").map(|w| w.id))
            .flatten())
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    slow.set(factor);
    let slowed = observer.status().await?.t_ms;
    let flagged = until(Duration::from_secs(20), || async {
        Ok(first_event_since(
            &observer.trace().await?,
            EventKind::Straggler,
            straggler,
            slowed,
        ))
    })
    .await?;
    let left = match policy {
        StragglerPolicy::Replace | StragglerPolicy::Drop => Some(
            until(Duration::from_secs(20), || async {
                let t = observer.trace().await?;
                Ok(first_event(&t, EventKind::Leave, straggler))
            })
            .await?,
        ),
        StragglerPolicy::Ignore => None,
    };
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    slow.set(1.0);
    Ok((slowed, flagged, left, straggler))
}

/// The real trainer over QUIC under BSP: a 3x straggler is flagged and replaced, and the job
/// is back to speed. (What an ignored straggler costs, and the detector's 2x target, are
/// measured on virtual time in `dst.rs`: `a_straggler_in_lockstep_costs_throughput_until_it_is_
/// replaced` and `a_worker_slowed_twofold_is_flagged_within_five_seconds`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_straggler_under_bsp_is_replaced_and_the_job_is_back_to_speed() -> anyhow::Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let replaced = straggler_run(StragglerPolicy::Replace, 3.0).await?;
    println!("replace: {replaced:?}");
    // Replaced, the job is back within 15% of its speed before the slowdown, within a
    // bounded time, and never ran with fewer than its 4 workers.
    assert!(
        replaced.after >= 0.85 * replaced.before,
        "after the replacement the job should be back to speed: {replaced:?}"
    );
    let recover = replaced.recover_ms.expect("the straggler left");
    assert!(recover < 15_000, "recovery took {recover} ms");
    // The detector's target: a 3x straggler is flagged within 2 s of its slowdown.
    assert!(
        replaced.detect_ms < 2_000,
        "a 3x straggler was flagged after {} ms",
        replaced.detect_ms
    );
    assert!(
        replaced.fewest_active >= WORKERS as i64,
        "the worker count dipped: {replaced:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiling_finds_a_known_scaling_limit() -> anyhow::Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    // Three compute units: more than three workers only queue for them.
    const LIMIT: usize = 3;
    let samples = 1_000_000u32;
    let cluster = TestCluster::start(synthetic_job(samples, 1, Consistency::Asp), 2).await?;
    let admin = cluster.admin().await?;
    let model = SleepModel {
        step: STEP,
        units: Some(Units::new(LIMIT)),
    };
    let (workers, stop) = (CancellationToken::new(), CancellationToken::new());
    let first = spawn_worker(
        cluster.client_config("w0")?,
        None,
        model.clone(),
        samples as usize,
        Slowdown::default(),
        workers.clone(),
    );
    until(Duration::from_secs(60), || async {
        Ok((admin.status().await?.min_clock.0 >= 1).then_some(()))
    })
    .await?;
    let opts = ProfileOptions {
        sizes: vec![1, 2, 3, 4, 5],
        warmup: Duration::from_millis(1_500),
        measure: Duration::from_millis(2_500),
        min_gain: 0.5,
        settle: Duration::from_secs(60),
    };
    let body = async {
        let r = profile(&admin, &opts, |line| println!("profile: {line}")).await;
        stop.cancel();
        r
    };
    let (placed, curve) = tokio::join!(
        run_placer(
            &cluster,
            &admin,
            model.clone(),
            samples as usize,
            workers.clone(),
            stop.clone()
        ),
        body
    );
    workers.cancel();
    let mut handles = placed?;
    handles.push(first);
    join_all(handles).await?;
    let curve = curve?;
    println!("{}", serde_json::to_string_pretty(&curve)?);
    assert_eq!(curve.knee, LIMIT as u32, "{curve:?}");
    let at = |n: u32| {
        curve
            .points
            .iter()
            .find(|p| p.workers == n)
            .map(|p| p.samples_per_s)
            .expect("measured")
    };
    assert!(at(3) > 2.4 * at(1), "{curve:?}");
    assert!(at(5) < 1.15 * at(3), "{curve:?}");
    assert_eq!(curve.restored_to, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_shorter_than_a_step_abandons_it_and_loses_nothing() -> anyhow::Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let samples = 2_048u32;
    // A worker learns of an operator's notice from its next heartbeat: a quarter of the
    // lease, here 250 ms.
    let mut job = synthetic_job(samples, 1, Consistency::Asp);
    job.lease_ms = 1_000;
    let cluster = TestCluster::start(job, 2).await?;
    let admin = cluster.admin().await?;
    admin
        .stragglers(|s: &mut StragglerSettings| s.policy = StragglerPolicy::Replace)
        .await?;
    let model = SleepModel {
        step: STEP,
        units: None,
    };
    let (workers, stop) = (CancellationToken::new(), CancellationToken::new());
    // w0 takes about 3 s a step (its wait after pushing, which a notice can cut short).
    let slow = spawn_worker(
        cluster.client_config("w0")?,
        None,
        model.clone(),
        samples as usize,
        Slowdown::new(150.0),
        workers.clone(),
    );
    let observer = cluster.connect("observer").await?;
    let body = async {
        let r = async {
            let w0 = until(Duration::from_secs(60), || async {
                let st = observer.status().await?;
                Ok(st.workers.iter().find(|w| w.name == "w0").map(|w| w.id))
            })
            .await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let notice = Duration::from_millis(2_000);
            let sent = std::time::Instant::now();
            let at = observer.status().await?.t_ms;
            let placement = admin.preempt(w0, notice).await?.expect("policy replace");
            let gone = until(Duration::from_secs(10), || async {
                let t = observer.trace().await?;
                Ok(first_event(&t, EventKind::Leave, w0))
            })
            .await?;
            let took = sent.elapsed();
            anyhow::ensure!(
                took < notice,
                "w0 left {took:?} after a {notice:?} notice (coordinator: {} ms)",
                gone.saturating_sub(at)
            );
            let done = admin
                .wait_placement(placement.id, Duration::from_secs(30))
                .await?
                .expect("placed");
            Ok((took, done))
        }
        .await;
        stop.cancel();
        r
    };
    let (placed, r) = tokio::join!(
        run_placer(
            &cluster,
            &admin,
            model.clone(),
            samples as usize,
            workers.clone(),
            stop.clone()
        ),
        body
    );
    let (took, done) = r?;
    println!("w0 left {took:?} after its notice; placement: {done:?}");
    assert!(matches!(
        done.state,
        edl_shared::proto::PlacementState::Done { .. }
    ));
    let preempted = join_all(vec![slow]).await?;
    assert_eq!(preempted[0].abandoned, 1, "{:?}", preempted[0]);
    // The substitute finishes the job; every sample once, including w0's abandoned batch.
    join_all(placed?).await?;
    assert_exactly_once(&observer, u64::from(samples)).await?;
    Ok(())
}
