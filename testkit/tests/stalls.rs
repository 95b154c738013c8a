//! No silent waits: a worker that joined and takes no batches (alive and heartbeating) holds
//! the SSP minimum. The coordinator names it, with whom it holds up, within the set time; the
//! others wait while the job's policy is `wait`, and go on once the policy drops it, with
//! every sample still applied exactly once.

use std::time::{Duration, Instant};

use edl_shared::proto::msg::{EventKind, WorkerState};
use edl_shared::proto::{Consistency, StragglerSettings};
use edl_shared::shutdown::CancellationToken;
use edl_testkit::synthetic::{SleepModel, spawn_worker, synthetic_job};
use edl_testkit::{TestCluster, assert_exactly_once, until};
use edl_worker::trainer::Slowdown;

const SAMPLES: u32 = 2_048;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_under_ssp_is_named_then_dropped_by_the_timeout_policy()
-> anyhow::Result<()> {
    let cluster = TestCluster::start(
        synthetic_job(SAMPLES, 1, Consistency::Ssp { staleness: 2 }),
        2,
    )
    .await?;
    let admin = cluster.admin().await?;
    let observer = cluster.connect("observer").await?;
    admin
        .stragglers(|s: &mut StragglerSettings| {
            s.stall_ms = 1_000;
            s.stall_drop_ms = 0;
        })
        .await?;
    // The idle session joins first, so it holds the minimum clock from the start.
    let idle = cluster.connect("idle").await?.register("idle").await?;
    let joined = Instant::now();
    let stop = CancellationToken::new();
    let model = SleepModel {
        step: Duration::from_millis(5),
        units: None,
    };
    let worker = spawn_worker(
        cluster.client_config("w0")?,
        None,
        model,
        SAMPLES as usize,
        Slowdown::default(),
        stop.clone(),
    );
    // Named within the set time (1 s) and a sweep or two, with whom it holds up.
    let stalled = until(Duration::from_secs(10), || async {
        let trace = observer.trace().await?;
        Ok(trace
            .events
            .into_iter()
            .find(|e| e.kind == EventKind::Stalled && e.worker == idle.worker()))
    })
    .await?;
    let named_after = joined.elapsed();
    assert!(
        named_after >= Duration::from_millis(1_000) && named_after < Duration::from_millis(2_500),
        "named after {named_after:?}"
    );
    assert!(
        stalled.detail.contains("minimum clock 0") && stalled.detail.contains("(w0)"),
        "{}",
        stalled.detail
    );
    // `edlctl workers` shows it stalled; under policy `wait` the other worker waits at the
    // staleness bound and the idle one stays.
    let members = admin.members().await?;
    let row = members
        .iter()
        .find(|m| m.id == idle.worker())
        .expect("idle");
    assert!(row.stalled_ms.is_some_and(|ms| ms >= 1_000), "{row:?}");
    assert_eq!(row.state, WorkerState::Active);
    let busy = members.iter().find(|m| m.name == "w0").expect("w0");
    assert_eq!(
        busy.clock.0, 3,
        "w0 waits at clock 3 (ssp:2 over the idle one's 0)"
    );
    assert_eq!(busy.stalled_ms, None);
    // The policy changed at run time: drop after 2 s. The idle session is dropped as dead
    // (its data, none, returns to the pool) and the worker trains the job to its end.
    admin
        .stragglers(|s: &mut StragglerSettings| s.stall_drop_ms = 2_000)
        .await?;
    let dead = until(Duration::from_secs(10), || async {
        let trace = observer.trace().await?;
        Ok(trace
            .events
            .into_iter()
            .find(|e| e.kind == EventKind::Dead && e.worker == idle.worker()))
    })
    .await?;
    assert!(dead.detail.starts_with("dropped"), "{}", dead.detail);
    let summary = tokio::task::spawn_blocking(move || worker.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the worker thread panicked"))??;
    assert_eq!(summary.samples, u64::from(SAMPLES));
    assert_exactly_once(&observer, u64::from(SAMPLES)).await?;
    // The dropped session learns it on its next call.
    assert!(
        idle.leave().await.is_ok(),
        "leaving after a drop is not an error"
    );
    stop.cancel();
    Ok(())
}
