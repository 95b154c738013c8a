//! Training under network faults, injected in process under quinn (`edl_shared::faults`): a
//! job finishes with exact ledgers over lossy, slow links, and a worker cut off from everyone
//! for longer than its lease is declared dead, its data finished by another worker, and its
//! late push after the partition heals changes nothing.

use std::time::{Duration, Instant};

use edl_shared::TransportSettings;
use edl_shared::faults::{Faults, LinkFaults};
use edl_shared::proto::ids::Clock;
use edl_shared::proto::msg::{DataSpan, EventKind, Partition, WorkerState};
use edl_shared::proto::{Consistency, JobConfig};
use edl_testkit::{TestCluster, counter_job};
use edl_worker::{Job, Session};

const LEN: usize = 64;

/// `samples` samples in partitions of 8, batches of 4; one 64-float counter on 2 shards.
fn job(samples: u32, epochs: u32, lease_ms: u32) -> JobConfig {
    let mut job = counter_job(LEN as u32, 16, Consistency::Asp);
    job.train_samples = samples;
    job.epochs = epochs;
    job.partition_size = 8;
    job.batch_size = 4;
    job.lease_ms = lease_ms;
    job
}

fn span(p: &Partition, start: u32) -> DataSpan {
    edl_testkit::batch_span(p, start, 4)
}

/// Pushes -1 for every counter for each batch of `p`, committing each.
async fn finish(s: &mut Session, p: &Partition) -> anyhow::Result<()> {
    edl_testkit::push_counter_batches(s, p, p.start, 4, LEN).await
}

/// Trains until no data is left; returns the partitions trained.
async fn train(mut s: Session) -> anyhow::Result<Vec<Partition>> {
    let mut got = Vec::new();
    while let Some(p) = tokio::time::timeout(Duration::from_secs(30), s.next_partition()).await?? {
        finish(&mut s, &p).await?;
        got.push(p);
    }
    s.leave().await?;
    Ok(got)
}

/// Every shard applied every sample of every epoch exactly once, and every counter holds one
/// -1 per batch of every epoch.
async fn assert_exact(reader: &Job, samples: u32, epochs: u32) -> anyhow::Result<()> {
    let ledgers = edl_testkit::assert_exactly_once(reader, u64::from(samples)).await?;
    assert_eq!(ledgers.len(), 2, "two shards");
    for (shard, ledgers) in ledgers {
        assert_eq!(ledgers.len(), epochs as usize, "shard {shard}: {ledgers:?}");
    }
    let mut v = vec![0f32; LEN];
    reader.pull_all(&mut v, Clock(0)).await?;
    let batches = (samples / 4 * epochs) as f32;
    assert!(v.iter().all(|&x| x == batches), "{v:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_over_lossy_slow_links_finishes_with_exact_ledgers() -> anyhow::Result<()> {
    let t = Instant::now();
    let faults = Faults::new(2);
    faults.set_default(
        LinkFaults::clean()
            .with_loss(0.02)
            .with_delay(Duration::from_millis(50), Duration::ZERO),
    );
    let (samples, epochs) = (32, 2);
    let cluster =
        TestCluster::start_with_faults(job(samples, epochs, 2000), 2, faults.clone()).await?;
    let mut workers = tokio::task::JoinSet::new();
    for name in ["w0", "w1"] {
        let s = cluster.connect(name).await?.register(name).await?;
        workers.spawn(train(s));
    }
    let mut partitions = 0;
    while let Some(r) = workers.join_next().await {
        partitions += r??.len();
    }
    assert!(partitions >= (samples / 8 * epochs) as usize);
    let reader = cluster.connect("reader").await?;
    assert_exact(&reader, samples, epochs).await?;
    assert!(reader.status().await?.finished);
    let s = faults.stats();
    assert!(
        s.dropped > 0 && s.delayed > 0 && s.partitioned == 0,
        "{s:?}"
    );
    eprintln!("lossy, slow links: {:?}, {s:?}", t.elapsed());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_partitioned_past_its_lease_is_dead_and_its_data_reissued() -> anyhow::Result<()> {
    let t = Instant::now();
    let faults = Faults::new(3);
    let (samples, lease_ms) = (16, 500);
    let cluster =
        TestCluster::start_with_faults(job(samples, 1, lease_ms), 2, faults.clone()).await?;
    let mut a = cluster.connect("a").await?.register("a").await?;
    let a_id = a.worker();
    let pa = a.next_partition().await?.expect("data");
    let first = span(&pa, pa.start);
    a.push_span(&[-1.0; LEN], first).await?;
    a.commit_span(first, 0.0).await?;

    // Cut a off from everyone, then let it try its next step: it cannot reach anyone.
    faults.isolate("a");
    let second = span(&pa, first.end);
    let late = tokio::spawn(async move {
        a.push_span(&[-1.0; LEN], second).await?;
        a.commit_span(second, 0.0).await?;
        anyhow::Ok(())
    });

    // b gets the rest of a's partition once a's lease expired, from where a committed.
    let b = cluster.connect("b").await?.register("b").await?;
    let got = train(b).await?;
    let reissued = got
        .iter()
        .find(|p| p.index == pa.index)
        .expect("a's partition was re-issued");
    assert_eq!(
        reissued.start, second.start,
        "re-issued from the committed position"
    );
    let dropped = faults.stats().partitioned;
    assert!(dropped > 0);

    // Heal: a's push, held since the partition, may now arrive; it must change nothing, and
    // its commit must be refused.
    faults.heal("a", "*");
    let late = match tokio::time::timeout(Duration::from_secs(20), late).await {
        Ok(Ok(Ok(()))) => panic!("the dead worker's step was committed"),
        Ok(Ok(Err(e))) => format!("refused: {e:#}"),
        Ok(Err(e)) => format!("task failed: {e}"),
        Err(_) => "still trying after 20 s".to_string(),
    };

    let reader = cluster.connect("reader").await?;
    assert_exact(&reader, samples, 1).await?;
    let status = reader.status().await?;
    assert!(status.finished);
    let dead = status.workers.iter().find(|w| w.id == a_id).expect("a");
    assert_eq!(dead.state, WorkerState::Dead);
    let trace = reader.trace().await?;
    assert_eq!(
        edl_testkit::event_kinds(&trace, a_id),
        [EventKind::Join, EventKind::Dead]
    );
    eprintln!(
        "partitioned worker: {:?}, {dropped} datagrams partitioned, late step {late}",
        t.elapsed()
    );
    Ok(())
}

/// Trains until no data is left, waiting as long as it takes (a shard may be unreachable for
/// minutes); returns the partitions trained and when the slowest step ended.
async fn train_patiently(mut s: Session) -> anyhow::Result<(Vec<Partition>, Duration)> {
    let mut got = Vec::new();
    let mut slowest = Duration::ZERO;
    while let Some(p) = s.next_partition().await? {
        let mut start = p.start;
        while start < p.start + p.len {
            let sp = span(&p, start);
            let t = Instant::now();
            s.push_span(&[-1.0; LEN], sp).await?;
            s.commit_span(sp, 0.0).await?;
            slowest = slowest.max(t.elapsed());
            start = sp.end;
        }
        got.push(p);
    }
    s.leave().await?;
    Ok((got, slowest))
}

/// The real transport across a shard outage longer than its idle timeout (6 s): the workers'
/// connections to the shard die and are made again once it is back. The same outage at 90 s,
/// and at any length, runs on virtual time in `dst.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_partitioned_past_the_idle_timeout_then_healed_loses_nothing() -> anyhow::Result<()>
{
    const OUTAGE: Duration = Duration::from_secs(10);
    assert!(OUTAGE > TransportSettings::default().idle_timeout);
    let t = Instant::now();
    let faults = Faults::new(4);
    // Enough data that training is still going when the shard disappears.
    let (samples, epochs) = (4096, 2);
    // Leases well under the outage: the workers must stay alive by heartbeating the
    // coordinator while the shard is gone.
    let cluster =
        TestCluster::start_with_faults(job(samples, epochs, 1000), 2, faults.clone()).await?;
    let mut workers = tokio::task::JoinSet::new();
    for name in ["w0", "w1"] {
        let s = cluster.connect(name).await?.register(name).await?;
        workers.spawn(train_patiently(s));
    }
    // Once training has started, cut shard s0 off from everyone for the outage (a fixed wait
    // could outlast the whole job on a fast machine).
    let observer = cluster.connect("observer").await?;
    let before = loop {
        let st = observer.status().await?;
        if st.samples_done > 0 || st.finished {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert!(!before.finished, "the job ended before the outage began");
    faults.isolate("s0");
    tokio::time::sleep(OUTAGE).await;
    let cut = faults.stats().partitioned;
    faults.heal("s0", "*");
    let mut partitions = 0;
    let mut slowest = Duration::ZERO;
    while let Some(r) = workers.join_next().await {
        // No worker gave up: each trained to the end and left.
        let (got, slow) = r??;
        partitions += got.len();
        slowest = slowest.max(slow);
    }
    assert!(partitions >= (samples / 8 * epochs) as usize);
    assert!(cut > 0, "the partition dropped nothing");
    assert!(
        slowest >= OUTAGE - Duration::from_secs(1),
        "no step waited out the outage ({slowest:?}): was the shard ever needed?"
    );
    let reader = cluster.connect("reader").await?;
    assert_exact(&reader, samples, epochs).await?;
    let status = reader.status().await?;
    assert!(status.finished);
    assert!(
        status.workers.iter().all(|w| w.state == WorkerState::Left),
        "{:?}",
        status.workers
    );
    eprintln!(
        "shard partitioned for {OUTAGE:?}: {:?} in all, slowest step {slowest:?}, {cut} datagrams cut",
        t.elapsed()
    );
    Ok(())
}
