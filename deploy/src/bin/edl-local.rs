//! `edl-local`: runs a whole EDL training job on this machine (coordinator, shards and workers
//! as separate processes), evaluates the result and reports it.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use edl_deploy::local::RESTART_NOTE;
use edl_deploy::{ElasticConfig, LocalConfig, ObserveConfig, Scenario, ScenarioFile};
use edl_shared::cli::StragglerArgs;
use edl_shared::jobfile::defaults;
use edl_shared::proto::{Consistency, LrSchedule, OptimizerSpec};
use edl_shared::{shutdown, telemetry};
use edl_worker::data::DEFAULT_DATA_DIR;

/// Run an EDL job locally: a coordinator, shard servers and workers as separate processes,
/// then an evaluation of the trained model on the test set (Fashion-MNIST's unless --data-dir
/// or the job file names other data).
#[derive(Parser, Debug)]
#[command(name = "edl-local", version)]
struct Cli {
    /// Run this job file (TOML; examples in deploy/jobs/) instead of an MLP job described by
    /// the flags below: its model, optimizer, consistency, batch size, epochs, samples and
    /// data. Its workers run the file's [worker] command (in the file's folder, with the
    /// process contract's EDL_* environment) or else edl-worker, which trains mlp and logreg.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "epochs", "consistency", "optimizer", "schedule", "batch_size", "train_samples", "lease_ms",
        "layers", "seed",
    ])]
    job: Option<PathBuf>,
    /// Number of shard servers holding the model.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    shards: u32,
    /// Number of training workers.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Passes over the training data.
    #[arg(long, default_value_t = defaults::EPOCHS, value_parser = clap::value_parser!(u32).range(1..))]
    epochs: u32,
    /// Consistency model: asp, ssp:S (bounded staleness S) or bsp.
    #[arg(long, default_value_t = defaults::CONSISTENCY)]
    consistency: Consistency,
    /// Server-side optimizer, torch.optim's: KIND[:LR][,KEY=VALUE...] with KIND sgd, momentum,
    /// adam, adamw, adagrad, rmsprop or adadelta and its arguments, e.g.
    /// sgd:0.1,momentum=0.9,nesterov=true or adamw:0.001,weight_decay=0.05.
    #[arg(long, default_value_t = defaults::OPTIMIZER)]
    optimizer: OptimizerSpec,
    /// Learning-rate schedule, torch.optim.lr_scheduler's: KIND[,KEY=VALUE...] with KIND
    /// constant, step, multistep, exponential, cosine, linear or onecycle and its arguments,
    /// `by=step|epoch` (what it counts) and `scale=none|linear|sqrt` (BSP: times the workers
    /// an update averages), e.g. step,step_size=1,gamma=0.7,by=epoch or
    /// cosine,T_max=5000,eta_min=0.0001.
    #[arg(long, default_value = "constant")]
    schedule: LrSchedule,
    /// Samples per mini-batch.
    #[arg(long, default_value_t = defaults::BATCH_SIZE, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,
    /// Training samples used per epoch (the first N of the training set).
    #[arg(long, default_value_t = defaults::SAMPLES, value_parser = clap::value_parser!(u32).range(1..))]
    train_samples: u32,
    /// Worker heartbeat lease in milliseconds; silent workers are dropped after it.
    #[arg(long, default_value_t = defaults::LEASE_MS)]
    lease_ms: u32,
    /// Copies of every key range: a primary and REPLICAS - 1 backups on other shards, so that
    /// a shard killed for good loses nothing (at most --shards; over a job file's
    /// `[training] replicas`). [default: 1, no copies]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=8))]
    replicas: Option<u32>,
    /// How pushes and pulls travel: f32 (exact), bf16 or fp16 (half the bytes; the shards
    /// keep f32), or topk:FRACTION (each push sends the largest FRACTION of every chunk, e.g.
    /// topk:0.01, and each worker adds what it held back to its next push; +bf16 or +fp16
    /// sends those at 16 bits). Over a job file's `[training] wire` (tensors its
    /// `[[tensor]]` tables give a wire of their own keep theirs). [default: f32]
    #[arg(long)]
    wire: Option<edl_shared::proto::WireSpec>,
    /// MLP layer widths, input to classes.
    #[arg(long, value_delimiter = ',', default_value = "784,256,128,10")]
    layers: Vec<u32>,
    /// Seed for initialization and data order.
    #[arg(long, default_value_t = defaults::SEED)]
    seed: u64,
    /// Directory with the training and test images as idx files (gzip or not; Fashion-MNIST's
    /// by default, or any set in its format: `train-images-idx3-ubyte`, ...).
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Serve the coordinator's live dashboard (membership, throughput, loss and accuracy,
    /// shards, stragglers, events) and its JSON API at http://ADDR/; the address is printed
    /// at the start. Plain HTTP: keep it on loopback.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    http: std::net::SocketAddr,
    /// Do not serve the dashboard.
    #[arg(long, conflicts_with = "http")]
    no_http: bool,
    /// Draw the run into DIR/run.png: throughput, active workers, training loss and test
    /// accuracy over time with membership, resharding and shard events marked, and each
    /// event's stall.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Write a JSON report of the run to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write the coordinator's raw trace (membership events, key-range moves and the time of
    /// every step) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// State directory for the PKI, the coordinator's address file and one log per process
    /// [default: a new edl-local-<timestamp> directory in the system's temporary directory].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Directory holding the edl-ps and edl-worker binaries [default: this program's
    /// directory].
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Give up (and stop every process) when training makes no progress for this many
    /// seconds; 0 waits forever. A warning comes after 30 s either way.
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    stall_timeout: u64,
    /// Do not draw a progress bar; print one line per finished epoch instead (also the
    /// behaviour when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// Replay the timed events of this TOML file while the job trains: worker membership
    /// changes (add, drain, kill, term, preempt, migrate), a worker's speed (slow, a test
    /// aid) and shard events (shard_add, shard_remove, move,
    /// kill_shard, restart_shard); see deploy/scenarios/. Times count from the first admitted
    /// worker; worker names are w0.. for the initial workers and shard names s0.. for the
    /// initial shards, and both continue for added ones. The file is checked before anything
    /// starts.
    #[arg(long, value_name = "FILE")]
    scenario: Option<PathBuf>,
    /// The classic baseline: carry out every worker membership change of the scenario by
    /// checkpointing, stopping all workers and starting the new number afresh. Shard events
    /// are carried out as without this flag.
    #[arg(long, requires = "scenario", long_help = format!(
        "{RESTART_NOTE} \
         The report lists each restart with its checkpoint, stop and start times, and the \
         events' stalls include the whole restart."
    ))]
    restart_on_change: bool,
    #[command(flatten)]
    stragglers: StragglerArgs,
    /// Worker slots on this machine, slot0 to slot{N-1} [default: twice the most workers the
    /// run starts, at least 4]. Every worker runs in one; workers the coordinator asks for
    /// (replacements of stragglers and preempted workers, `edlctl migrate --to SLOT`,
    /// `edlctl scale`, `edlctl profile`) start only in free ones. On one machine a slot is a
    /// CPU stand-in for a GPU: a label, nothing is pinned.
    #[arg(long, value_name = "N")]
    slots: Option<u32>,
    /// The notice a worker gets from SIGUSR1 (the scenario's `preempt`, or `kill -USR1` by
    /// hand): it leaves within it, abandoning its step if it cannot finish in time.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    preempt_notice: Duration,
}

impl Cli {
    fn into_config(self) -> anyhow::Result<LocalConfig> {
        self.schedule
            .check(self.consistency, [&self.optimizer])
            .map_err(|e| anyhow::anyhow!("--schedule: {e}"))?;
        let scenario = match self.scenario {
            Some(path) => Some(ScenarioFile {
                scenario: Scenario::load_with(
                    &path,
                    self.workers,
                    self.shards,
                    self.replicas.unwrap_or(1),
                )
                .with_context(|| format!("--scenario {}", path.display()))?,
                path,
            }),
            None => None,
        };
        let cfg = LocalConfig {
            shards: self.shards,
            workers: self.workers,
            epochs: self.epochs,
            consistency: self.consistency,
            optimizer: self.optimizer,
            schedule: self.schedule,
            batch_size: self.batch_size,
            train_samples: self.train_samples,
            lease_ms: self.lease_ms,
            replicas: self.replicas,
            wire: self.wire,
            layers: self.layers,
            seed: self.seed,
            data_dir: self.data_dir,
            report: self.report,
            trace: self.trace,
            state_dir: self.state_dir,
            bin_dir: self.bin_dir,
            progress_bar: !self.no_progress && std::io::stderr().is_terminal(),
            stall_timeout: (self.stall_timeout > 0)
                .then(|| Duration::from_secs(self.stall_timeout)),
            scenario,
            restart_on_change: self.restart_on_change,
            job: None,
            elastic: ElasticConfig {
                stragglers: self.stragglers.settings().map_err(anyhow::Error::msg)?,
                slots: self.slots.unwrap_or(0),
                preempt_notice: self.preempt_notice,
            },
            observe: ObserveConfig {
                http: (!self.no_http).then_some(self.http),
                plot: self.plot,
            },
        };
        match &self.job {
            Some(file) => cfg.from_job_file(file),
            None => Ok(cfg),
        }
    }
}

// One thread is plenty: the launcher mostly waits, and the cores belong to the children.
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    telemetry::init("warn");
    let cfg = Cli::parse().into_config()?;
    let report = edl_deploy::run(&cfg, shutdown::on_signals()).await?;
    println!("{report}");
    if let Some(path) = &cfg.report {
        println!("  report: {}", path.display());
    }
    if let Some(dir) = &cfg.observe.plot {
        println!("  plot: {}", dir.join("run.png").display());
    }
    Ok(())
}
