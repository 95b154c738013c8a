//! `edl-bench tta`: time to a test accuracy (0.85) on Fashion-MNIST, for 1, 2 and 4 workers
//! under each consistency model, with real training (`edl_worker::trainer`, CPU backend); or
//! of a job file's model (an MLP or the sparse logistic regression, on the file's data).
//!
//! Each run is a fresh in-process cluster; every worker runs on its own OS thread with its own
//! runtime, as a worker process would. While they train, a snapshot task pulls the parameters
//! every [`Plan::snapshot_every`] (a pull costs about a millisecond) and, every
//! [`Plan::check_every`], evaluates the latest snapshot on the test set (Fashion-MNIST's
//! 10,000 images) to decide whether to stop. After the run every snapshot is evaluated: the time to accuracy is the
//! time of the first snapshot at or above the target, counted from the moment the workers
//! were started (cluster up, data in memory).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_deploy::costs::median;
use edl_shared::faults::{Faults, LinkFaults};
use edl_shared::models::{self, Builtin};
use edl_shared::proto::msg::EpochStats;
use edl_shared::proto::{Clock, Consistency, DataFormat, JobConfig, OptimizerSpec, WireSpec};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_testkit::{TestCluster, mlp_job};
use edl_worker::backend::{Backend, CpuBackend};
use edl_worker::data::{DEFAULT_DATA_DIR, ImageSet, Split};
use edl_worker::logreg::LogReg;
use edl_worker::model::Mlp;
use edl_worker::trainer::{self, TrainOptions, TrainSummary};
use edl_worker::workload::{MlpModel, Model, SparseSet};
use edl_worker::{ClientConfig, Job};
use serde::Serialize;

use crate::transport::Side;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Worker counts.
    pub workers: Vec<usize>,
    /// Consistency models.
    pub modes: Vec<Consistency>,
    /// Shards.
    pub shards: usize,
    /// The test accuracy to reach.
    pub target: f64,
    /// MLP layer widths.
    pub layers: Vec<u32>,
    /// The server-side optimizer.
    pub optimizer: OptimizerSpec,
    /// Samples per mini-batch.
    pub batch: u32,
    /// Training samples per epoch (the first N).
    pub train_samples: u32,
    /// Epochs at most: a run that has not reached the target by then reports none.
    pub max_epochs: u32,
    /// Runs per worker count and consistency model, each with its own seed (initialization
    /// and data order): the accuracy near the target is noisy, the median is not.
    pub repeats: u32,
    /// How often the parameters are snapshotted.
    pub snapshot_every: Duration,
    /// How often the latest snapshot is evaluated to decide whether to stop.
    pub check_every: Duration,
    /// Where the Fashion-MNIST idx files are.
    pub data_dir: PathBuf,
    /// How pushes and pulls travel: one series per wire.
    pub wires: Vec<WireSpec>,
    /// Transport settings.
    pub settings: TransportSettings,
    /// Every training socket's uplink in bits per second, in the fault layer ([`Plan::limit`]).
    pub rate: Option<u64>,
    /// Where the servers (and the evaluator) run: on loopback, or behind a veth link.
    pub side: Side,
    /// The link, for reports, when it is not loopback's.
    pub link: Option<String>,
    /// A job file's job, trained instead of the MLP of `layers` on Fashion-MNIST in
    /// `data_dir` ([`Plan::with_job`]): its model (`mlp` or `logreg`), data, chunks and
    /// partitions. The plan sets its consistency, seed, wire, epochs, optimizer, batch size
    /// and samples.
    pub job: Option<JobConfig>,
}

impl Plan {
    /// `edl-local`'s default job (784-256-128-10, Adam at 0.001, batches of 64, 2 shards) to
    /// 0.85, for 1, 2 and 4 workers under ASP, SSP(2) and BSP, five seeds each, at most 6
    /// epochs; `quick`: one worker under ASP on 6,000 samples for one epoch.
    pub fn standard(quick: bool, settings: TransportSettings) -> Plan {
        Plan {
            workers: if quick { vec![1] } else { vec![1, 2, 4] },
            modes: if quick {
                vec![Consistency::Asp]
            } else {
                vec![
                    Consistency::Asp,
                    Consistency::Ssp { staleness: 2 },
                    Consistency::Bsp,
                ]
            },
            shards: 2,
            target: 0.85,
            layers: vec![784, 256, 128, 10],
            optimizer: OptimizerSpec::adam(0.001),
            batch: 64,
            train_samples: if quick { 6000 } else { 60_000 },
            max_epochs: if quick { 1 } else { 6 },
            repeats: if quick { 1 } else { 5 },
            snapshot_every: Duration::from_millis(100),
            check_every: Duration::from_secs(1),
            data_dir: DEFAULT_DATA_DIR.into(),
            wires: vec![WireSpec::default()],
            settings,
            side: Side::default(),
            link: None,
            rate: None,
            job: None,
        }
    }

    /// Trains `job` (a job file's) instead of the MLP: its optimizer, batch size and samples
    /// become the plan's (a later change to the plan's wins).
    pub fn with_job(&mut self, job: JobConfig) {
        self.optimizer = job.optimizer.clone();
        self.batch = job.batch_size;
        self.train_samples = job.train_samples;
        self.job = Some(job);
    }

    /// The job of one run, before its consistency, seed and wire are set.
    fn base_job(&self) -> JobConfig {
        let mut job = match &self.job {
            Some(job) => job.clone(),
            None => mlp_job(
                &self.layers,
                Consistency::Asp,
                self.optimizer.clone(),
                self.train_samples,
                self.max_epochs,
            ),
        };
        job.optimizer = self.optimizer.clone();
        job.batch_size = self.batch;
        job.train_samples = self.train_samples;
        job.epochs = self.max_epochs;
        job
    }

    /// Puts every socket of the training (shards, workers) behind an uplink of `bits_per_s`
    /// (the fault layer's rate, [`edl_shared::faults::Rate`]); the evaluator's snapshots
    /// cross clean links, so that watching the run costs the link nothing.
    pub fn limit(&mut self, bits_per_s: u64) {
        self.rate = Some(bits_per_s);
        let rate = LinkFaults::clean().with_rate(bits_per_s).rate;
        self.link = rate.map(|r| format!("every socket's uplink at {r} (fault layer)"));
    }

    /// The transport settings of one run: with a rate, a fault plan of its own (a plan names
    /// the evaluator's sockets by address, and a later run's socket may get an earlier
    /// evaluator's port).
    fn run_settings(&self) -> TransportSettings {
        let mut settings = self.settings.clone();
        if let Some(bits_per_s) = self.rate {
            let faults = Faults::new(0);
            faults.set_default(LinkFaults::clean().with_rate(bits_per_s));
            faults.set_link(EVAL, "*", LinkFaults::clean());
            faults.set_link("*", EVAL, LinkFaults::clean());
            settings.faults = Some(faults);
        }
        settings
    }
}

/// The evaluator's name (its certificate's, and its sockets' in the fault plan).
const EVAL: &str = "eval";

/// One evaluated snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Seconds since the workers were started.
    pub t_s: f64,
    /// Samples trained on by then (all workers).
    pub samples: u64,
    /// Test accuracy.
    pub accuracy: f64,
}

/// One run.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// Workers.
    pub workers: usize,
    /// The consistency model.
    pub consistency: String,
    /// How pushes and pulls travelled.
    pub wire: String,
    /// The job's seed.
    pub seed: u64,
    /// Seconds to the target; `None` when it was not reached.
    pub tta_s: Option<f64>,
    /// Epochs trained (samples over the epoch size) by then.
    pub epochs_to_target: Option<f64>,
    /// The best test accuracy seen.
    pub best_accuracy: f64,
    /// Training wall time, seconds.
    pub wall_s: f64,
    /// Samples per second over the run, all workers.
    pub samples_per_s: f64,
    /// Payload bytes pushed per sample (the coordinator's count).
    pub pushed_per_sample: f64,
    /// Payload bytes pulled per sample.
    pub pulled_per_sample: f64,
    /// Datagrams the fault layer's rate-limited uplinks dropped at a full queue.
    pub overflowed: u64,
    /// Every evaluated snapshot.
    pub curve: Vec<Point>,
}

/// What the run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// The target accuracy.
    pub target: f64,
    /// The model and its data (e.g. `MLP 784-256-128-10`).
    pub model: String,
    /// The optimizer, as `edl-local` writes it.
    pub optimizer: String,
    /// Samples per mini-batch.
    pub batch: u32,
    /// Training samples per epoch.
    pub train_samples: u32,
    /// Shards.
    pub shards: usize,
    /// Every socket's uplink, when limited.
    pub link: Option<String>,
    /// Per consistency model, wire and worker count, over the seeds.
    pub summary: Vec<Cell>,
    /// Every run.
    pub runs: Vec<Run>,
}

/// The runs of one consistency model and worker count.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// The consistency model.
    pub consistency: String,
    /// The wire.
    pub wire: String,
    /// Workers.
    pub workers: usize,
    /// Runs.
    pub runs: usize,
    /// Runs that reached the target.
    pub reached: usize,
    /// Median time to the target over the runs that reached it, seconds.
    pub median_tta_s: Option<f64>,
    /// Fastest.
    pub min_tta_s: Option<f64>,
    /// Slowest.
    pub max_tta_s: Option<f64>,
    /// Median epochs to the target.
    pub median_epochs: Option<f64>,
    /// Median training throughput, samples per second.
    pub samples_per_s: f64,
    /// Median payload bytes pushed per sample.
    pub pushed_per_sample: f64,
    /// Median payload bytes pulled per sample.
    pub pulled_per_sample: f64,
}

fn summarize(runs: &[Run]) -> Vec<Cell> {
    let mut cells: Vec<Cell> = Vec::new();
    for r in runs {
        let same =
            |x: &Run| x.consistency == r.consistency && x.workers == r.workers && x.wire == r.wire;
        if cells
            .iter()
            .any(|c| c.consistency == r.consistency && c.workers == r.workers && c.wire == r.wire)
        {
            continue;
        }
        let of: Vec<&Run> = runs.iter().filter(|x| same(x)).collect();
        let mut pushed: Vec<f64> = of.iter().map(|x| x.pushed_per_sample).collect();
        let mut pulled: Vec<f64> = of.iter().map(|x| x.pulled_per_sample).collect();
        let mut tta: Vec<f64> = of.iter().filter_map(|x| x.tta_s).collect();
        let mut epochs: Vec<f64> = of.iter().filter_map(|x| x.epochs_to_target).collect();
        let mut rate: Vec<f64> = of.iter().map(|x| x.samples_per_s).collect();
        cells.push(Cell {
            consistency: r.consistency.clone(),
            wire: r.wire.clone(),
            workers: r.workers,
            runs: of.len(),
            reached: tta.len(),
            min_tta_s: tta.iter().copied().reduce(f64::min),
            max_tta_s: tta.iter().copied().reduce(f64::max),
            median_tta_s: median(&mut tta),
            median_epochs: median(&mut epochs),
            samples_per_s: median(&mut rate).unwrap_or(0.0),
            pushed_per_sample: median(&mut pushed).unwrap_or(0.0),
            pulled_per_sample: median(&mut pulled).unwrap_or(0.0),
        });
    }
    cells
}

/// The model a run trains, with its training and test data, loaded once for every run.
#[derive(Clone)]
enum Workload {
    /// An MLP on images (Fashion-MNIST's, or a job file's idx data).
    Mlp {
        mlp: Mlp,
        train: Arc<ImageSet>,
        test: Arc<ImageSet>,
    },
    /// The sparse logistic regression on a job file's LIBSVM data.
    LogReg {
        features: u32,
        train: Arc<SparseSet>,
        test: Arc<SparseSet>,
    },
}

impl Workload {
    /// The plan's model and data: a job file's, or the MLP of `layers` on Fashion-MNIST.
    fn load(plan: &Plan, job: &JobConfig) -> anyhow::Result<Workload> {
        let data = job.data.as_ref();
        match job.model.kind.as_str() {
            models::Mlp::KIND => {
                let (mut train, test) = match data {
                    Some(d) if d.format == DataFormat::Idx && !d.test.is_empty() => (
                        ImageSet::load_prefix(d.train.as_ref())?,
                        ImageSet::load_prefix(d.test.as_ref())?,
                    ),
                    Some(d) => anyhow::bail!(
                        "the job's {:?} data {:?} (test {:?}) is not an idx training and test set",
                        d.format,
                        d.train,
                        d.test
                    ),
                    None => {
                        let dir = &plan.data_dir;
                        let load = |split| {
                            ImageSet::load(dir, split).with_context(|| {
                                format!(
                                    "loading Fashion-MNIST from {} (apt-get install \
                                     dataset-fashion-mnist)",
                                    dir.display()
                                )
                            })
                        };
                        (load(Split::Train)?, load(Split::Test)?)
                    }
                };
                train.truncate(plan.train_samples as usize);
                Ok(Workload::Mlp {
                    mlp: trainer::model_of(job)?,
                    train: Arc::new(train),
                    test: Arc::new(test),
                })
            }
            models::LogReg::KIND => {
                let m = models::LogReg::from_section(&job.model).map_err(anyhow::Error::msg)?;
                let Some(d) = data.filter(|d| d.format == DataFormat::LibSvm && !d.test.is_empty())
                else {
                    anyhow::bail!("a logreg job needs LIBSVM training and test data ([data])");
                };
                let load = |path: &str| {
                    SparseSet::load(path.as_ref()).with_context(|| format!("loading {path}"))
                };
                Ok(Workload::LogReg {
                    features: m.features,
                    train: Arc::new(load(&d.train)?),
                    test: Arc::new(load(&d.test)?),
                })
            }
            other => anyhow::bail!("edl-bench tta trains an mlp or a logreg job, not {other:?}"),
        }
    }

    /// The model and its data, for reports.
    fn describe(&self, job: &JobConfig) -> String {
        let file = |path: Option<&str>| {
            path.and_then(|p| std::path::Path::new(p).file_name())
                .map_or(String::new(), |f| format!(" ({})", f.to_string_lossy()))
        };
        let train = job.data.as_ref().map(|d| d.train.as_str());
        match self {
            Workload::Mlp { mlp, .. } => {
                let layers: Vec<String> = mlp.layers().iter().map(usize::to_string).collect();
                format!("MLP {}{}", layers.join("-"), file(train))
            }
            Workload::LogReg { features, .. } => {
                format!(
                    "logistic regression over {features} features{}",
                    file(train)
                )
            }
        }
    }

    /// Test accuracy of `params`.
    fn accuracy(&self, params: &[f32]) -> anyhow::Result<f64> {
        Ok(match self {
            Workload::Mlp { mlp, test, .. } => {
                let mut b = CpuBackend::new();
                b.evaluate(mlp, params, test.images(), test.labels())?
                    .accuracy()
            }
            Workload::LogReg { features, test, .. } => {
                LogReg::new(*features).evaluate(params, test)?.accuracy()
            }
        })
    }

    /// Trains on the training data as one worker until it runs out or `stop` fires.
    async fn train(&self, job: Job, stop: CancellationToken) -> anyhow::Result<TrainSummary> {
        let opts = TrainOptions::default();
        Ok(match self {
            Workload::Mlp { mlp, train, .. } => {
                let mut backend = CpuBackend::new();
                let mut model = MlpModel::new(mlp.clone(), &mut backend);
                trainer::train(job, &mut model, train, opts, stop).await?
            }
            Workload::LogReg {
                features, train, ..
            } => trainer::train(job, &mut LogReg::new(*features), train, opts, stop).await?,
        })
    }
}

/// Loads the data and runs every worker count under every consistency model.
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    let job = plan.base_job();
    let (p, j) = (plan.clone(), job.clone());
    let work = tokio::task::spawn_blocking(move || Workload::load(&p, &j)).await??;
    let mut runs = Vec::new();
    for &consistency in &plan.modes {
        for &workers in &plan.workers {
            for &wire in &plan.wires {
                for seed in (0..u64::from(plan.repeats)).map(|i| FIRST_SEED + i) {
                    let r = run_one(plan, &work, workers, consistency, wire, seed)
                        .await
                        .with_context(|| {
                            format!("{workers} workers, {consistency}, {wire}, seed {seed}")
                        })?;
                    eprintln!(
                        "tta: {workers} workers, {consistency}, {wire}, seed {seed}: {} (best \
                         {:.4}, {:.1} s, {:.0} bytes pushed per sample, {} datagrams dropped \
                         at a full queue)",
                        r.tta_s
                            .map_or("not reached".into(), |t| format!("{t:.1} s")),
                        r.best_accuracy,
                        r.wall_s,
                        r.pushed_per_sample,
                        r.overflowed
                    );
                    runs.push(r);
                }
            }
        }
    }
    Ok(Results {
        target: plan.target,
        model: work.describe(&job),
        optimizer: plan.optimizer.to_string(),
        batch: plan.batch,
        train_samples: plan.train_samples,
        shards: plan.shards,
        link: plan.link.clone(),
        summary: summarize(&runs),
        runs,
    })
}

/// The seed of the first run of each cell (then +1, +2, ...).
const FIRST_SEED: u64 = 1;

/// A snapshot of the parameters.
struct Snapshot {
    t: Duration,
    samples: u64,
    params: Vec<f32>,
}

async fn run_one(
    plan: &Plan,
    work: &Workload,
    workers: usize,
    consistency: Consistency,
    wire: WireSpec,
    seed: u64,
) -> anyhow::Result<Run> {
    let mut job = plan.base_job();
    job.consistency = consistency;
    job.seed = seed;
    job.wire = wire;
    let run_settings = plan.run_settings();
    let faults = run_settings.faults.clone();
    let (shards, settings, ip) = (plan.shards as u32, run_settings.clone(), plan.side.ip);
    let cluster = (plan.side)
        .run(TestCluster::start_on(job, shards, settings, ip))
        .await?;
    let config = |name: &str| -> anyhow::Result<ClientConfig> {
        let mut cfg = cluster.client_config(name)?;
        cfg.settings = run_settings.clone();
        cfg.settings.faults = cfg.settings.faults.map(|f| f.labelled(name));
        Ok(cfg)
    };
    // The evaluator runs beside the servers: its snapshots do not cross the link.
    let eval_config = config(EVAL)?;
    let eval = (plan.side)
        .run(async move { Ok(Job::connect(&eval_config).await?) })
        .await?;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let mut threads = Vec::new();
    for i in 0..workers {
        let name = format!("w{i}");
        let (cfg, work, stop) = (config(&name)?, work.clone(), shutdown.clone());
        threads.push(
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || worker(cfg, &name, &work, stop))?,
        );
    }
    let snaps = snapshots(plan, &eval, work, started, &shutdown).await;
    shutdown.cancel();
    let mut samples = 0;
    for t in threads {
        let s = tokio::task::spawn_blocking(move || t.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a worker thread panicked"))??;
        samples += s.samples;
    }
    let wall = started.elapsed();
    let snaps = snaps?;
    let status = eval.status().await?;
    let per_sample = |bytes: fn(&EpochStats) -> u64| {
        let done: u64 = status.epochs.iter().map(|e| e.samples).sum();
        let sum: u64 = status.epochs.iter().map(bytes).sum();
        sum as f64 / done.max(1) as f64
    };
    drop(eval);
    plan.side
        .run(async move {
            cluster.stop().await;
            Ok(())
        })
        .await?;
    let curve = evaluate_all(snaps, work).await?;
    let reached = curve.iter().find(|p| p.accuracy >= plan.target);
    Ok(Run {
        workers,
        consistency: consistency.to_string(),
        wire: wire.to_string(),
        seed,
        tta_s: reached.map(|p| p.t_s),
        epochs_to_target: reached.map(|p| p.samples as f64 / f64::from(plan.train_samples)),
        best_accuracy: curve.iter().map(|p| p.accuracy).fold(0.0, f64::max),
        wall_s: wall.as_secs_f64(),
        samples_per_s: samples as f64 / wall.as_secs_f64().max(1e-9),
        overflowed: faults.map_or(0, |f| f.stats().overflowed),
        pushed_per_sample: per_sample(|e| e.bytes_pushed),
        pulled_per_sample: per_sample(|e| e.bytes_pulled),
        curve,
    })
}

/// One worker on its own thread and runtime: connect, train until the data runs out or
/// `stop` fires, leave.
fn worker(
    cfg: ClientConfig,
    name: &str,
    work: &Workload,
    stop: CancellationToken,
) -> anyhow::Result<TrainSummary> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let job = Job::connect(&cfg).await?;
        // The worker registers under its certificate's name, `name`.
        debug_assert_eq!(cfg.identity.name, name);
        work.train(job, stop).await
    })
}

/// Snapshots the parameters until the job finishes or a checked snapshot reaches the target.
async fn snapshots(
    plan: &Plan,
    eval: &Job,
    work: &Workload,
    started: Instant,
    shutdown: &CancellationToken,
) -> anyhow::Result<Vec<Snapshot>> {
    let mut out: Vec<Snapshot> = Vec::new();
    let mut tick = tokio::time::interval(plan.snapshot_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checked = Instant::now();
    loop {
        tick.tick().await;
        let status = eval.status().await?;
        // As trainer::evaluate does: only steps every counting worker has passed are applied.
        let through = if status.finished {
            Clock(u64::MAX)
        } else {
            status.min_clock
        };
        let mut params = vec![0f32; eval.param_count()];
        eval.pull_all(&mut params, through).await?;
        out.push(Snapshot {
            t: started.elapsed(),
            samples: status.samples_done,
            params,
        });
        if status.finished || shutdown.is_cancelled() {
            return Ok(out);
        }
        if checked.elapsed() >= plan.check_every {
            checked = Instant::now();
            let params = out.last().map(|s| s.params.clone()).unwrap_or_default();
            let acc = accuracy(work, params).await?;
            if acc >= plan.target {
                return Ok(out);
            }
        }
    }
}

/// Test accuracy of `params`, on a blocking thread.
async fn accuracy(work: &Workload, params: Vec<f32>) -> anyhow::Result<f64> {
    let work = work.clone();
    tokio::task::spawn_blocking(move || work.accuracy(&params)).await?
}

/// Evaluates every snapshot, in order.
async fn evaluate_all(snaps: Vec<Snapshot>, work: &Workload) -> anyhow::Result<Vec<Point>> {
    let mut curve = Vec::with_capacity(snaps.len());
    for s in snaps {
        curve.push(Point {
            t_s: s.t.as_secs_f64(),
            samples: s.samples,
            accuracy: accuracy(work, s.params).await?,
        });
    }
    Ok(curve)
}
