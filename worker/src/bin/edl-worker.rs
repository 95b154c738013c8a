//! `edl-worker`: trains the job's model on Fashion-MNIST as one elastic worker, or evaluates
//! the current parameters on the test set.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use edl_shared::cli::IdentityArgs;
use edl_shared::transport::TransportSettings;
use edl_shared::{Role, shutdown, telemetry};
use edl_worker::backend::{self, Device};
use edl_worker::data::{DEFAULT_DATA_DIR, Dataset, Split};
use edl_worker::trainer::{self, TrainOptions};
use edl_worker::{ClientConfig, Job};

/// Large tensors are allocated and freed on every request; mimalloc keeps them off fresh
/// pages (with glibc's allocator, page faults took a tenth of a 16 MiB push+pull).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An EDL training worker.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// The coordinator's address.
    #[arg(long, default_value = "127.0.0.1:7070")]
    coordinator: String,
    /// This worker's name (its certificate name).
    #[arg(long, default_value = "worker")]
    name: String,
    /// Directory with the Fashion-MNIST idx files (gzip or not).
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Do not train: pull the current parameters, evaluate them on the 10,000 test images and
    /// print one JSON line.
    #[arg(long)]
    evaluate: bool,
    /// Leave after this many steps.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Compute device: auto (the first CUDA GPU when one is usable, else the CPU), cpu, cuda
    /// (= cuda:0) or cuda:N.
    #[arg(long, env = "EDL_DEVICE", default_value = "auto")]
    device: Device,
    /// Give up when the coordinator or a shard has been unreachable this many seconds. By
    /// default a worker waits out any outage (retrying with capped backoff, logging once
    /// when it starts and once when it ends) and ends only when the job ends or the
    /// coordinator drops it.
    #[arg(long, value_name = "SECS")]
    give_up_after: Option<u64>,
    #[command(flatten)]
    identity: IdentityArgs,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    telemetry::init("info");
    let cli = Cli::parse();
    let shutdown = shutdown::on_signals();
    let identity = cli.identity.identity(Role::Worker, &cli.name)?;
    // Slow preparation first: backend (for a GPU: context, kernels) and data are ready before
    // the worker asks to join.
    let mut backend = backend::open(cli.device).with_context(|| {
        format!(
            "cannot use --device {} (--device auto falls back to the CPU)",
            cli.device
        )
    })?;
    let split = if cli.evaluate {
        Split::Test
    } else {
        Split::Train
    };
    let data = Dataset::load(&cli.data_dir, split).context("loading Fashion-MNIST")?;
    let cfg = ClientConfig {
        coordinator: cli.coordinator.clone(),
        identity,
        settings: TransportSettings {
            reconnect: cli.give_up_after.map(std::time::Duration::from_secs),
            ..TransportSettings::default()
        },
    };
    let job = tokio::select! {
        r = Job::connect(&cfg) => r.context("connecting to the job")?,
        // Not admitted yet: nothing to hand back, so a signal simply ends the process.
        _ = shutdown.cancelled() => return Ok(()),
    };
    if cli.evaluate {
        let stats = trainer::evaluate(&job, &data, &mut *backend).await?;
        let line = serde_json::json!({
            "test_accuracy": stats.accuracy(),
            "test_loss": stats.mean_loss(),
            "test_samples": stats.samples,
        });
        println!("{line}");
        return Ok(());
    }
    let opts = TrainOptions {
        max_steps: cli.max_steps,
    };
    tracing::info!(backend = backend.name(), "worker prepared; asking to join");
    let s = trainer::train(job, &cli.name, &data, &mut *backend, opts, shutdown).await?;
    tracing::info!(
        steps = s.steps,
        samples = s.samples,
        mean_loss = s.loss_sum / s.samples.max(1) as f64,
        wall_s = s.wall.as_secs_f64(),
        "worker done"
    );
    Ok(())
}
