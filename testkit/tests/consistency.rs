//! Consistency-model tests on an in-process cluster: BSP with one worker equals local SGD,
//! SSP bounds how far a fast worker runs ahead of a slow one, a silent worker is dropped
//! without hanging the others, and concurrent pushes lose no update.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edl_shared::proto::msg::WorkerState;
use edl_shared::proto::{Clock, Consistency, Key, OptimizerSpec};
use edl_testkit::{TestCluster, counter_job, mlp_job};
use edl_worker::ClientError;
use edl_worker::backend::{Backend, CpuBackend};
use edl_worker::model::Mlp;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bsp_with_one_worker_equals_local_sgd() -> anyhow::Result<()> {
    let layers = [64u32, 32, 10];
    let lr = 0.1f32;
    let mut job = mlp_job(
        &layers,
        Consistency::Bsp,
        OptimizerSpec::sgd(f64::from(lr)),
        64,
        1,
    );
    // Small chunks so that the model spans many keys on both shards.
    job.chunk_size = 300;
    let cluster = TestCluster::start(job, 2).await?;
    let mut session = cluster.connect("w").await?.register("w").await?;

    let mlp = Mlp::new(layers.iter().map(|&l| l as usize).collect())?;
    let n = mlp.param_count();
    let mut rng = StdRng::seed_from_u64(11);
    let batches: Vec<(Vec<f32>, Vec<u8>)> = (0..8)
        .map(|_| {
            let x = (0..32 * 64)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let y = (0..32).map(|_| rng.random_range(0..10u8)).collect();
            (x, y)
        })
        .collect();

    let mut local = vec![0f32; n];
    session.pull(&mut local).await?;
    assert!(
        local.iter().any(|&v| v != 0.0),
        "weights must be initialized"
    );
    let initial = local.clone();
    let mut backend = CpuBackend::new();
    let mut remote = vec![0f32; n];
    let mut grads = vec![0f32; n];
    for (x, y) in &batches {
        session.pull(&mut remote).await?;
        backend.forward_backward(&mlp, &remote, x, y, &mut grads)?;
        session.push_step(&grads).await?;
        session.advance(0, y.len() as u32, 0.0).await?;
        // The same step, locally.
        let mut g = vec![0f32; n];
        backend.forward_backward(&mlp, &local, x, y, &mut g)?;
        for (p, g) in local.iter_mut().zip(&g) {
            *p -= lr * g;
        }
    }
    session.pull(&mut remote).await?;
    let max_diff = remote
        .iter()
        .zip(&local)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff <= 1e-6, "BSP differs from local SGD by {max_diff}");
    // The run really moved the parameters.
    let moved = remote.iter().zip(&initial).filter(|(a, b)| a != b).count();
    assert!(moved > n / 2, "only {moved} of {n} parameters changed");
    session.leave().await?;
    Ok(())
}

/// (when, who, clock, minimum clock granted with it).
type ClockEvent = (Instant, &'static str, u64, u64);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_never_lets_a_worker_run_more_than_s_clocks_ahead() -> anyhow::Result<()> {
    const S: u64 = 2;
    const STEPS: u64 = 25;
    let cluster = TestCluster::start(
        counter_job(
            64,
            16,
            Consistency::Ssp {
                staleness: S as u32,
            },
        ),
        2,
    )
    .await?;
    // Every event: (time, worker, clock). The slow worker logs the clock it is about to report
    // before sending it, which can only overstate its progress; the fast worker logs the clock
    // it was allowed to start from after the grant arrives.
    let log: Arc<Mutex<Vec<ClockEvent>>> = Arc::default();

    let mut slow = cluster.connect("slow").await?.register("slow").await?;
    let mut fast = cluster.connect("fast").await?.register("fast").await?;
    let grads = vec![0.0f32; 64];
    let slow_log = log.clone();
    let slow_task = tokio::spawn(async move {
        for _ in 0..STEPS {
            tokio::time::sleep(Duration::from_millis(15)).await;
            slow.push_step(&grads).await?;
            slow_log
                .lock()
                .expect("log")
                .push((Instant::now(), "slow", slow.clock().0 + 1, 0));
            slow.advance(0, 1, 0.0).await?;
        }
        slow.leave().await?;
        anyhow::Ok(())
    });
    let grads = vec![0.0f32; 64];
    for _ in 0..STEPS {
        fast.push_step(&grads).await?;
        let min = fast.advance(0, 1, 0.0).await?;
        log.lock()
            .expect("log")
            .push((Instant::now(), "fast", fast.clock().0, min.0));
    }
    fast.leave().await?;
    slow_task.await??;

    let log = log.lock().expect("log");
    let mut slow_clock = 0;
    let mut waited = false;
    for &(_, who, clock, min) in log.iter() {
        if who == "slow" {
            slow_clock = clock;
            continue;
        }
        assert!(
            clock <= slow_clock + S,
            "fast worker started from clock {clock} while the slow one had reported at most {slow_clock}"
        );
        assert!(clock <= min + S, "grant at clock {clock} with min {min}");
        waited |= clock == slow_clock + S;
    }
    assert!(
        waited,
        "the fast worker never hit the bound: the test did not exercise SSP"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_is_dropped_and_the_others_do_not_hang() -> anyhow::Result<()> {
    let mut job = counter_job(32, 8, Consistency::Bsp);
    job.lease_ms = 400;
    let cluster = TestCluster::start(job, 1).await?;
    let mut alive = cluster.connect("alive").await?.register("alive").await?;
    let mut silent = cluster.connect("silent").await?.register("silent").await?;
    let silent_id = silent.worker();
    let grads = vec![-1.0f32; 32];
    // Both do step 0; then the silent one stops heartbeating and never reports again.
    silent.push_step(&grads).await?;
    alive.push_step(&grads).await?;
    let both = tokio::join!(alive.advance(0, 1, 0.0), silent.advance(0, 1, 0.0));
    both.0?;
    both.1?;
    silent.stop_heartbeat();
    let started = Instant::now();
    for _ in 0..10 {
        alive.push_step(&grads).await?;
        tokio::time::timeout(Duration::from_secs(5), alive.advance(0, 1, 0.0)).await??;
    }
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(3),
        "the live worker waited {waited:?}"
    );
    let status = cluster.coordinator.status();
    let s = status
        .workers
        .iter()
        .find(|w| w.id == silent_id)
        .expect("listed");
    assert_eq!(s.state, WorkerState::Dead);
    // The dropped worker learns it was dropped.
    let err = silent.advance(0, 1, 0.0).await.expect_err("dropped");
    assert!(matches!(err, ClientError::Dropped(_)), "{err}");
    // BSP applied every step: 2 pushes at step 0 (mean 1), then 1 per step for 10 steps.
    let mut v = vec![0f32; 32];
    alive.pull(&mut v).await?;
    assert!(v.iter().all(|&x| x == 11.0), "{v:?}");
    alive.leave().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pushes_lose_no_update() -> anyhow::Result<()> {
    const CLIENTS: usize = 8;
    const PUSHES: usize = 50;
    let cluster = TestCluster::start(counter_job(1000, 128, Consistency::Asp), 2).await?;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..CLIENTS {
        let session = cluster
            .connect(&format!("c{i}"))
            .await?
            .register("c")
            .await?;
        tasks.spawn(async move {
            // Each client adds (i + 1) to every counter per push.
            let grads = vec![-(i as f32 + 1.0); 1000];
            for _ in 0..PUSHES {
                session.push_step(&grads).await?;
            }
            session.leave().await?;
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let mut v = vec![0f32; 1000];
    cluster
        .connect("reader")
        .await?
        .pull_all(&mut v, edl_shared::proto::Clock(0))
        .await?;
    let want = (PUSHES * CLIENTS * (CLIENTS + 1) / 2) as f32;
    for (i, x) in v.iter().enumerate() {
        assert_eq!(*x, want, "counter {i}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_pushes_and_pulls_touch_only_their_keys() -> anyhow::Result<()> {
    // 1000 counters in 8 keys of 128 (the last 104) over 2 shards.
    let cluster = TestCluster::start(counter_job(1000, 128, Consistency::Asp), 2).await?;
    let session = cluster.connect("sparse").await?.register("sparse").await?;
    let (k1, k6, k7) = (Key(1), Key(6), Key(7));
    session
        .push_keys(&[(k6, &[-2.0; 128]), (k1, &[-1.0; 128]), (k7, &[-3.0; 104])])
        .await?;
    let reader = cluster.connect("reader").await?;
    let got = reader.pull_keys(&[k7, Key(0), k1, k6], Clock(0)).await?;
    let keys: Vec<Key> = got.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        keys,
        [k7, Key(0), k1, k6],
        "answers come in the order asked"
    );
    assert_eq!(got[0].1, vec![3.0; 104]);
    assert_eq!(got[1].1, vec![0.0; 128], "an untouched key");
    assert_eq!(got[2].1, vec![1.0; 128]);
    assert_eq!(got[3].1, vec![2.0; 128]);
    assert!(
        reader.pull_keys(&[Key(8)], Clock(0)).await.is_err(),
        "no key 8 in the job"
    );
    let mut all = vec![0f32; 1000];
    reader.pull_all(&mut all, Clock(0)).await?;
    assert_eq!(all.iter().sum::<f32>(), 128.0 + 2.0 * 128.0 + 3.0 * 104.0);
    session.leave().await?;
    Ok(())
}
