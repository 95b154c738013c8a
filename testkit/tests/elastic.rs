//! Elasticity on an in-process cluster: a worker that dies after its push reached only some
//! shards has that push applied exactly once everywhere, and a drained worker leaves after its
//! step with its partition finished by someone else. The shards' ledgers must show every sample
//! applied once: no duplicates, no misses.

use std::time::Duration;

use edl_shared::Role;
use edl_shared::proto::frame::f32s_to_bytes;
use edl_shared::proto::ids::{Clock, Key};
use edl_shared::proto::msg::{ChunkRef, DataSpan, EventKind, Partition, WorkerState};
use edl_shared::proto::{Consistency, JobConfig, Request};
use edl_shared::transport::{self, Conn, TransportSettings};
use edl_testkit::{TestCluster, assert_exactly_once, counter_job, event_kinds};
use edl_worker::{ClientConfig, Job, Session};

/// 16 samples in two partitions of 8, batches of 4; one 64-float counter tensor on 2 shards.
fn job() -> JobConfig {
    let mut job = counter_job(64, 16, Consistency::Asp);
    job.train_samples = 16;
    job.partition_size = 8;
    job.batch_size = 4;
    job.lease_ms = 400;
    job
}

fn span(p: &Partition, start: u32) -> DataSpan {
    edl_testkit::batch_span(p, start, 4)
}

/// Pushes -1 for every counter for each batch of `p`, committing each.
async fn finish(s: &mut Session, p: &Partition) -> anyhow::Result<()> {
    edl_testkit::push_counter_batches(s, p, p.start, 4, 64).await
}

async fn admin(cluster: &TestCluster) -> anyhow::Result<Job> {
    Ok(Job::connect(&ClientConfig {
        coordinator: cluster.coordinator_addr.to_string(),
        identity: cluster.identity(Role::Admin, "operator")?,
        settings: TransportSettings::default(),
    })
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_that_reached_some_shards_before_death_is_applied_once() -> anyhow::Result<()> {
    let cluster = TestCluster::start(job(), 2).await?;
    let mut a = cluster.connect("a").await?.register("a").await?;
    let pa = a.next_partition().await?.expect("data");
    // a commits its first batch, then dies in the middle of pushing the second: the push
    // reaches the shard that holds key 0 and not the other.
    let first = span(&pa, pa.start);
    a.push_span(&[-1.0; 64], first).await?;
    a.commit_span(first, 0.0).await?;
    let second = span(&pa, first.end);
    let map = a.job().map().clone();
    let owner = map.owner(Key(0)).expect("placed");
    let range = map.ranges_of(owner).next().expect("a range");
    // The raw push goes out under a's own certificate, id and token, as a's process would.
    let id = cluster.identity(Role::Worker, "a")?;
    let settings = TransportSettings::default();
    let ep = transport::client_endpoint(&id, &settings, false)?;
    let conn = Conn::connect(&ep, map.addr_of(owner).expect("addr"), "a-raw", &settings).await?;
    let chunks: Vec<ChunkRef> = (range.start..range.end)
        .map(|k| ChunkRef::new(Key(k), 16))
        .collect();
    let floats = vec![-1.0f32; chunks.len() * 16];
    conn.call(
        Request::Push {
            epoch: map.epoch,
            worker: a.worker(),
            clock: a.clock(),
            chunks,
            span: Some(second),
            covers: Vec::new(),
            token: a.token(),
        },
        f32s_to_bytes(&floats),
    )
    .await?;
    a.stop_heartbeat();

    // b trains; once a's lease expires it gets the rest of a's partition, from `second`.
    let mut b = cluster.connect("b").await?.register("b").await?;
    let mut reissued = None;
    while let Some(p) = tokio::time::timeout(Duration::from_secs(10), b.next_partition()).await?? {
        if p.index == pa.index {
            reissued = Some(p);
        }
        finish(&mut b, &p).await?;
    }
    let reissued = reissued.expect("a's partition was re-issued");
    assert_eq!(
        reissued.start, second.start,
        "re-issued from the committed position"
    );

    // Four spans of 4 samples, each applied exactly once on each shard: every counter is 4.
    let reader = cluster.connect("reader").await?;
    let mut v = vec![0f32; 64];
    reader.pull_all(&mut v, Clock(0)).await?;
    assert!(v.iter().all(|&x| x == 4.0), "{v:?}");
    assert_exactly_once(&reader, 16).await?;
    let skipped: u64 = reader
        .ledgers()
        .await?
        .iter()
        .flat_map(|(_, l)| l.iter().map(|e| e.skipped_pushes))
        .sum();
    assert_eq!(
        skipped, 1,
        "the shard that had the dead worker's push skipped its re-issue"
    );
    let status = reader.status().await?;
    assert_eq!(status.epochs[0].samples, 16);
    assert!(status.finished);
    let dead = status
        .workers
        .iter()
        .find(|w| w.id == a.worker())
        .expect("a");
    assert_eq!(dead.state, WorkerState::Dead);
    b.leave().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_worker_leaves_after_its_step_and_its_data_is_finished_by_another()
-> anyhow::Result<()> {
    let cluster = TestCluster::start(job(), 2).await?;
    let op = admin(&cluster).await?;
    let mut a = cluster.connect("a").await?.register("a").await?;
    let pa = a.next_partition().await?.expect("data");
    let first = span(&pa, pa.start);
    a.push_span(&[-1.0; 64], first).await?;
    assert!(!a.drain_requested());
    // The operator drains a mid-step: the step completes, and its grant tells a to go.
    op.drain(a.worker()).await?;
    a.commit_span(first, 0.0).await?;
    assert!(a.drain_requested());
    let a_id = a.worker();
    a.leave().await?;

    let mut b = cluster.connect("b").await?.register("b").await?;
    let mut got = Vec::new();
    while let Some(p) = b.next_partition().await? {
        got.push(p);
        finish(&mut b, &p).await?;
    }
    assert!(
        got.iter()
            .any(|p| p.index == pa.index && p.start == first.end),
        "the drained worker's partition was finished from where it stopped: {got:?}"
    );
    b.leave().await?;
    let mut v = vec![0f32; 64];
    op.pull_all(&mut v, Clock(0)).await?;
    assert!(v.iter().all(|&x| x == 4.0), "{v:?}");
    assert_exactly_once(&op, 16).await?;
    let trace = op.trace().await?;
    assert_eq!(
        event_kinds(&trace, a_id),
        [EventKind::Join, EventKind::Drain, EventKind::Leave]
    );
    assert_eq!(trace.steps.iter().filter(|s| s.worker == a_id).count(), 1);
    // Only operators may drain.
    let err = b_cannot_drain(&cluster, a_id).await;
    assert!(err, "a worker was allowed to drain another");
    Ok(())
}

async fn b_cannot_drain(cluster: &TestCluster, target: edl_shared::proto::WorkerId) -> bool {
    let Ok(job) = cluster.connect("rogue").await else {
        return false;
    };
    job.drain(target).await.is_err()
}
