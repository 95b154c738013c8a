//! End-to-end training on real Fashion-MNIST data in an in-process cluster: three workers and
//! two shards under SSP reach a clear accuracy bar on the 10,000 test images.
//!
//! The dataset comes from Debian's `dataset-fashion-mnist`; CI installs it. Without it the test
//! says it was skipped, unless `EDL_REQUIRE_DATA=1` (set by CI) makes that a failure.

use std::path::Path;
use std::sync::Arc;

use edl_shared::proto::{Consistency, OptimizerSpec};
use edl_shared::shutdown::CancellationToken;
use edl_testkit::{TestCluster, have_fashion_mnist, mlp_job};
use edl_worker::backend::{Backend, CpuBackend};
use edl_worker::data::{DEFAULT_DATA_DIR, ImageSet, Split};
use edl_worker::trainer::{self, TrainOptions};
use edl_worker::workload::MlpModel;

fn datasets() -> anyhow::Result<Option<(ImageSet, ImageSet)>> {
    if !have_fashion_mnist() {
        return Ok(None);
    }
    let dir = Path::new(DEFAULT_DATA_DIR);
    Ok(Some((
        ImageSet::load(dir, Split::Train)?,
        ImageSet::load(dir, Split::Test)?,
    )))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_two_shards_reach_the_accuracy_bar() -> anyhow::Result<()> {
    let Some((mut train, test)) = datasets()? else {
        return Ok(());
    };
    const SAMPLES: u32 = 30_000;
    train.truncate(SAMPLES as usize);
    let train = Arc::new(train);
    let job = mlp_job(
        &[784, 128, 10],
        Consistency::Ssp { staleness: 2 },
        OptimizerSpec::adam(0.001),
        SAMPLES,
        2,
    );
    let cluster = TestCluster::start(job, 2).await?;
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..3 {
        let job = cluster.connect(&format!("w{i}")).await?;
        let train = train.clone();
        workers.spawn(async move {
            let mut backend = CpuBackend::new();
            let mut model = MlpModel::new(trainer::model_of(job.config())?, &mut backend);
            trainer::train(
                job,
                &mut model,
                &*train,
                TrainOptions::default(),
                CancellationToken::new(),
            )
            .await
        });
    }
    let mut samples = 0;
    let mut busy = 0;
    while let Some(r) = workers.join_next().await {
        let s = r??;
        samples += s.samples;
        busy += u32::from(s.steps > 0);
    }
    assert_eq!(
        samples,
        u64::from(SAMPLES) * 2,
        "every sample of both epochs was used"
    );
    assert!(busy >= 2, "only {busy} worker(s) trained");
    let status = cluster.coordinator.status();
    assert!(status.finished);
    for e in &status.epochs {
        assert_eq!(e.samples, u64::from(SAMPLES));
    }
    // Training loss fell from the first epoch to the second.
    let loss = |i: usize| status.epochs[i].loss_sum / status.epochs[i].samples as f64;
    assert!(
        loss(1) < loss(0),
        "loss went from {} to {}",
        loss(0),
        loss(1)
    );

    let eval = cluster.connect("eval").await?;
    // Every shard applied every sample of every epoch exactly once.
    for (shard, ledgers) in eval.ledgers().await? {
        for l in ledgers {
            assert_eq!(
                (l.applied, l.duplicates, l.missing),
                (u64::from(SAMPLES), 0, 0),
                "shard {shard}, epoch {}",
                l.epoch
            );
        }
    }
    let mut backend = CpuBackend::new();
    let name = backend.name();
    let mut model = MlpModel::new(trainer::model_of(eval.config())?, &mut backend);
    let (stats, _) = trainer::evaluate(&eval, &mut model, &test).await?;
    assert_eq!(stats.samples, 10_000);
    eprintln!("test accuracy {:.4} ({name})", stats.accuracy());
    assert!(
        stats.accuracy() >= 0.80,
        "test accuracy {}",
        stats.accuracy()
    );
    Ok(())
}
