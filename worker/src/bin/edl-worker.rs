//! `edl-worker`: trains the job's built-in model (the MLP on idx images, or logistic
//! regression on LIBSVM rows) as one elastic worker, or evaluates the current parameters on
//! the test set.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use edl_shared::cli::{IdentityArgs, MetricsArgs};
use edl_shared::models::{self, Builtin};
use edl_shared::proto::DataFormat;
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_shared::{Role, shutdown, telemetry};
use edl_worker::backend::{self, Device};
use edl_worker::data::{DEFAULT_DATA_DIR, ImageSet, Split};
use edl_worker::logreg::LogReg;
use edl_worker::trainer::{self, Slowdown, TrainOptions, TrainSummary};
use edl_worker::workload::{MlpModel, Model, SparseSet};
use edl_worker::{ClientConfig, Job};

/// The exit status of a worker whose shutdown grace period ran out before it could leave.
const EXIT_NOT_LEFT: i32 = 3;

/// Large tensors are allocated and freed on every request; mimalloc keeps them off fresh
/// pages (with glibc's allocator, page faults took a tenth of a 16 MiB push+pull).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An EDL training worker.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// The coordinator's address; with several coordinators of a job (`edl-ps coordinator
    /// --meta`), all of them separated by commas: the worker follows whichever leads.
    /// [default: the address in STATE_DIR/coordinator.addr (a local run's), else
    /// 127.0.0.1:7070]
    #[arg(long)]
    coordinator: Option<String>,
    /// This worker's name (its certificate name).
    #[arg(long, default_value = "worker")]
    name: String,
    /// Directory with the idx files (gzip or not: `train-images-idx3-ubyte`, ...), for an MLP
    /// job whose job file names no data [default: /usr/share/datasets/fashion-mnist, where
    /// Debian's dataset-fashion-mnist puts Fashion-MNIST].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The data to read instead of the job file's `[data]`: an idx prefix (e.g.
    /// `DIR/train` for `DIR/train-images-idx3-ubyte`) or a LIBSVM file. With --evaluate,
    /// the test data.
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// Do not train: pull the current parameters, evaluate them on the test data, report the
    /// result to the coordinator (`edlctl status` and the dashboard show it) and print one
    /// JSON line. With --every, keep doing so until the job finishes (a last evaluation of
    /// the final parameters included).
    #[arg(long)]
    evaluate: bool,
    /// With --evaluate: evaluate this often (e.g. 30s) until the job finishes.
    #[arg(long, requires = "evaluate", value_parser = humantime::parse_duration, value_name = "DURATION")]
    every: Option<std::time::Duration>,
    /// Log a progress line (clock, samples/s, loss) this often while training; 0s logs none.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    progress_every: std::time::Duration,
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
    /// The notice a SIGUSR1 gives (as a cloud agent sends on a spot-instance warning): the
    /// worker tells the coordinator, finishes its step, commits and leaves within it,
    /// abandoning the step if it cannot finish in time.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    preempt_notice: std::time::Duration,
    /// How long a SIGTERM or SIGINT may take: the worker finishes its step, commits and
    /// leaves within it, even when the coordinator or a shard does not answer (a step that
    /// cannot finish in time is abandoned; its data returns to the pool). If it cannot leave
    /// in time, it exits with status 3 and says on stderr what it could not hand back: its
    /// registration, its leased and uncommitted data, whether its last commit arrived (the
    /// coordinator returns them when the worker's lease expires). A second signal exits at
    /// once (status 130). [default: the job's lease]
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    grace: Option<std::time::Duration>,
    /// The placement this worker was started for (placers such as edl-local pass it): once
    /// admitted, the worker it replaces, if any, is drained.
    #[arg(long, value_name = "ID")]
    placement: Option<u64>,
    /// Test aid: make every step FACTOR times slower (the worker sleeps FACTOR-1 times each
    /// step's work before committing), to play a straggler.
    #[arg(long, default_value_t = 1.0, value_name = "FACTOR")]
    slowdown: f64,
    /// Test aid: every step takes at least this long (the worker waits out the rest after
    /// its work), as on a device whose step time is fixed, so that a job's speed follows its
    /// workers rather than how busy this machine's cores are.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    step_time: Option<std::time::Duration>,
    /// Test aid: re-read the slowdown factor from this file (at most every 250 ms) while
    /// training; edl-local's scenario event `slow` writes it.
    #[arg(long, value_name = "FILE")]
    slowdown_file: Option<PathBuf>,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    identity: IdentityArgs,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    telemetry::init("info");
    let cli = Cli::parse();
    let shutdown = shutdown::on_signals();
    // Listening for spot notices from the start: an early SIGUSR1 must not end the process.
    let spot = spot_notices(cli.preempt_notice)?;
    cli.metrics.start(shutdown.clone()).await?;
    // Slow preparation first: backend (for a GPU: context, kernels) and data are ready before
    // the worker asks to join.
    let mut backend = backend::open(cli.device).with_context(|| {
        format!(
            "cannot use --device {} (--device auto falls back to the CPU)",
            cli.device
        )
    })?;
    // Data named on the command line is checked before anything else: a typo is one clear
    // message, not a worker that waits for its coordinator first.
    for (flag, path) in [("--data-dir", &cli.data_dir), ("--data", &cli.data)] {
        if let Some(p) = path
            && !p.exists()
        {
            let hint = if p.starts_with(DEFAULT_DATA_DIR) {
                "; install Fashion-MNIST with `apt-get install dataset-fashion-mnist`"
            } else {
                ""
            };
            anyhow::bail!("{flag} {} not found{hint}", p.display());
        }
    }
    let data_dir = cli
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    // The credentials after the local checks: a worker given no cluster's state directory
    // says first what it can tell without one.
    let identity = cli.identity.identity(Role::Worker, &cli.name)?;
    let cfg = ClientConfig {
        coordinator: cli.identity.coordinator(cli.coordinator.as_deref()),
        identity,
        settings: TransportSettings {
            reconnect: cli.give_up_after.map(std::time::Duration::from_secs),
            ..TransportSettings::default()
        },
    };
    let job = tokio::select! {
        r = Job::connect(&cfg) => r.context("connecting to the job")?.for_placement(cli.placement),
        // Not admitted yet: nothing to hand back, so a signal simply ends the process.
        _ = shutdown.cancelled() => return Ok(()),
    };
    let spec = job.config().clone();
    let data_path = |format: DataFormat| -> anyhow::Result<PathBuf> {
        if let Some(p) = &cli.data {
            return Ok(p.clone());
        }
        match &spec.data {
            Some(d) if d.format == format => {
                let p = if cli.evaluate { &d.test } else { &d.train };
                anyhow::ensure!(
                    !p.is_empty(),
                    "the job file names no test data; pass --data"
                );
                Ok(PathBuf::from(p))
            }
            Some(d) => anyhow::bail!("the job's data is {}, its model needs {format}", d.format),
            None if format == DataFormat::Idx => {
                let split = if cli.evaluate {
                    Split::Test
                } else {
                    Split::Train
                };
                Ok(data_dir.join(split.prefix()))
            }
            None => anyhow::bail!("the job names no {format} data: pass --data FILE"),
        }
    };
    let run = Run {
        job,
        evaluate: cli.evaluate,
        every: cli.every,
        opts: TrainOptions {
            progress: (!cli.progress_every.is_zero()).then_some(cli.progress_every),
            max_steps: cli.max_steps,
            slowdown: match &cli.slowdown_file {
                Some(f) => Slowdown::new(cli.slowdown).with_file(f.clone()),
                None => Slowdown::new(cli.slowdown),
            },
            step_time: cli.step_time,
            spot: Some(spot),
            grace: cli.grace,
        },
        shutdown,
        backend: backend.name(),
    };
    // The training half of each built-in model (the registry, edl_shared::models, holds the
    // other half: its settings and tensors); see trainer::TRAINED_KINDS.
    match spec.model.kind.as_str() {
        models::Mlp::KIND => {
            let path = data_path(DataFormat::Idx)?;
            let data = ImageSet::load_prefix(&path)
                .with_context(|| format!("loading the idx images {}", path.display()))?;
            let mut model = MlpModel::new(trainer::model_of(&spec)?, &mut *backend);
            run.go(&mut model, &data).await
        }
        models::LogReg::KIND => {
            let m = models::LogReg::from_section(&spec.model).map_err(anyhow::Error::msg)?;
            let path = data_path(DataFormat::LibSvm)?;
            let data = SparseSet::load(&path)?;
            run.go(&mut LogReg::new(m.features), &data).await
        }
        _ if spec.model.is_custom() => anyhow::bail!(
            "this job's model is defined by its application (a custom model): edl-worker \
             trains the built-in models ({}); run the application's own worker",
            trainer::TRAINED_KINDS.join(", ")
        ),
        other => anyhow::bail!(
            "this job's model is {other:?}, which this edl-worker does not train (it trains {}): \
             is the coordinator newer than this worker?",
            trainer::TRAINED_KINDS.join(", ")
        ),
    }
}

/// Spot notices: each SIGUSR1 is one, of length `notice`.
fn spot_notices(
    notice: std::time::Duration,
) -> anyhow::Result<tokio::sync::mpsc::UnboundedReceiver<std::time::Duration>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut usr1 = signal(SignalKind::user_defined1()).context("listening for SIGUSR1")?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            if tx.send(notice).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

impl Run {
    /// Evaluates the current parameters (every `every` until the job finishes, or once),
    /// reporting each result to the coordinator and printing it as a JSON line.
    async fn evaluations<M: Model>(&self, model: &mut M, data: &M::Data) -> anyhow::Result<()> {
        loop {
            // An evaluator holds nothing of the job: a signal ends it at once, whatever it
            // waits for (a coordinator or shard that is gone, say).
            let (stats, status) = tokio::select! {
                r = trainer::evaluate(&self.job, model, data) => r?,
                _ = self.shutdown.cancelled() => return Ok(()),
            };
            let (accuracy, loss) = (stats.accuracy(), stats.mean_loss());
            let line = serde_json::json!({
                "test_accuracy": accuracy,
                "test_loss": loss,
                "test_samples": stats.samples,
                "clock": status.min_clock.0,
                "finished": status.finished,
            });
            println!("{line}");
            let clock = status.min_clock;
            let samples = stats.samples as u64;
            let report = self.job.report_evaluation(clock, accuracy, loss, samples);
            let reported = tokio::select! {
                r = report => r,
                _ = self.shutdown.cancelled() => return Ok(()),
            };
            if let Err(e) = reported {
                tracing::warn!(error = %e, "could not report the evaluation to the coordinator");
            }
            let Some(every) = self.every.filter(|_| !status.finished) else {
                return Ok(());
            };
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.shutdown.cancelled() => return Ok(()),
            }
        }
    }
}

/// A worker's run, once the job and the data are known.
struct Run {
    job: Job,
    evaluate: bool,
    every: Option<std::time::Duration>,
    opts: TrainOptions,
    shutdown: CancellationToken,
    backend: &'static str,
}

impl Run {
    async fn go<M: Model>(self, model: &mut M, data: &M::Data) -> anyhow::Result<()> {
        if self.evaluate {
            return self.evaluations(model, data).await;
        }
        tracing::info!(backend = self.backend, "worker prepared; asking to join");
        let s: TrainSummary =
            match trainer::train(self.job, model, data, self.opts, self.shutdown).await {
                Ok(s) => s,
                Err(e) if e.grace_ran_out() => {
                    // Exits at once: nothing is left to wait for, and the runtime's shutdown
                    // must not wait on the calls that did not return.
                    eprintln!("edl-worker: exiting with status {EXIT_NOT_LEFT}: {e}");
                    std::process::exit(EXIT_NOT_LEFT);
                }
                Err(e) => return Err(e.into()),
            };
        tracing::info!(
            steps = s.steps,
            samples = s.samples,
            mean_loss = s.loss_sum / s.samples.max(1) as f64,
            wall_s = s.wall.as_secs_f64(),
            abandoned = s.abandoned,
            "worker done"
        );
        Ok(())
    }
}
