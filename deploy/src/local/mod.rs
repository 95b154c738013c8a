//! A whole EDL job on this machine: certificates for every process, a coordinator, shard and
//! worker processes, progress from the coordinator's status, an evaluation of the final model
//! and an orderly shutdown.
//!
//! Every process is a separate OS process started from the `edl-ps` and `edl-worker` binaries,
//! exactly as on a real cluster, so a local run exercises the same code paths (QUIC, mutual TLS,
//! leases) and leaves one log per process in the state directory.
//!
//! With a scenario ([`crate::scenario`]) the launcher also changes the membership while the job
//! trains (module `play`): elastically, or with the stop-everything restarts of the
//! `--restart-on-change` baseline; and it reshapes the shard servers online in both modes
//! (module `shards`), and kills and restarts the coordinator (module `coordinator`).
//! Afterwards it reads the coordinator's trace, the shards' ledgers and the final shard
//! layout, so the report says what every event and key-range move cost and whether each
//! sample was applied exactly once.

mod coordinator;
mod place;
mod play;
mod setup;
mod shards;
mod workers;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use edl_shared::Role;
use edl_shared::jobfile::WorkerSpec;
use edl_shared::models::Builtin as _;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::{EpochLedger, JobHistory, JobStatus, JobTrace};
use edl_shared::proto::{Consistency, LrSchedule, OptimizerSpec, ShardId};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_worker::data::{ImageSet, Split};
use edl_worker::{ClientConfig, Job};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::costs::{
    ShardAction, epoch_reports, event_costs, kind_summaries, shard_costs, shard_quiet_spans,
    stall_noise,
};
use crate::progress::{Progress, StallWatch, active_workers, worker_states};
use crate::report::{
    Evaluation, Report, RestartReport, ShardLayout, SkippedEvent, TraceDump, Traffic, throughput,
};
use crate::scenario::{Scenario, worker_name};
use edl_launch::procs::{Proc, Spawn, Stopped, failure_message};
use edl_ps::admin::Admin;
use play::Player;
use shards::Shards;
use workers::{Fate, WorkerProc, Workers};

use edl_launch::launch::{self as launch, Binaries};
use edl_launch::{JobLaunch, LOCAL_HOST, LocalPlacer, Placer as _, Slot};
pub use setup::fresh_state_dir;
use setup::issue_certificates;

/// The coordinator's certificate name; `edl-ps coordinator` always uses it.
const COORDINATOR_NAME: &str = "coordinator";
/// The evaluator's certificate name.
const EVALUATOR_NAME: &str = "eval";
/// The launcher's own (admin) certificate name.
const LAUNCHER_NAME: &str = "launcher";
/// How long the coordinator may take to start listening.
const COORDINATOR_START: Duration = Duration::from_secs(30);
/// How often child processes are checked for an exit (and scenario events for being due).
const CHILD_CHECK: Duration = Duration::from_millis(50);
/// How often the launcher looks for the coordinator's address file.
const ADDR_CHECK: Duration = Duration::from_millis(2);
/// How often the coordinator is asked for its status.
const STATUS_PERIOD: Duration = Duration::from_millis(250);
/// How long one status call may take before it is given up (the next one is tried).
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting for the final status may take.
const FINAL_STATUS_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the evaluator may take; it pulls the model once and scores 10,000 images.
const EVALUATOR_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the sample count may stand still before the launcher warns that training stalled.
const STALL_WARNING: Duration = Duration::from_secs(30);
/// How long a server (or a leftover worker) gets to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// What to run, already parsed into valid types.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Shard servers.
    pub shards: u32,
    /// Training workers.
    pub workers: u32,
    /// Passes over the training data.
    pub epochs: u32,
    /// The consistency model.
    pub consistency: Consistency,
    /// The server-side optimizer.
    pub optimizer: OptimizerSpec,
    /// Its learning-rate schedule.
    pub schedule: LrSchedule,
    /// Samples per mini-batch.
    pub batch_size: u32,
    /// Training samples per epoch.
    pub train_samples: u32,
    /// Worker heartbeat lease in milliseconds.
    pub lease_ms: u32,
    /// Copies of every key range (`--replicas`), over the job file's; `None`: the job's (1
    /// without a job file).
    pub replicas: Option<u32>,
    /// How pushes and pulls travel (`--wire`: a precision, or top-k pushes), over the job
    /// file's; `None`: the job's (f32 without a job file).
    pub wire: Option<edl_shared::proto::WireSpec>,
    /// MLP layer widths, input to classes.
    pub layers: Vec<u32>,
    /// Seed for initialization and data order.
    pub seed: u64,
    /// Where the idx files are (for an MLP job without a job file's `[data]`; Fashion-MNIST's
    /// by default).
    pub data_dir: PathBuf,
    /// The job file the coordinator runs, instead of an MLP job from the fields above (which
    /// then only label the report). Set it with [`LocalConfig::from_job_file`], which checks
    /// the file and fills those fields from it.
    pub job: Option<PathBuf>,
    /// Where to write the JSON report, if anywhere.
    pub report: Option<PathBuf>,
    /// Where to write the coordinator's raw trace as JSON, if anywhere.
    pub trace: Option<PathBuf>,
    /// The state directory; `None` creates a fresh one under the system's temporary directory.
    pub state_dir: Option<PathBuf>,
    /// Where `edl-ps` and `edl-worker` are; `None` means next to the running executable.
    pub bin_dir: Option<PathBuf>,
    /// Show a live progress bar (plain per-epoch lines otherwise).
    pub progress_bar: bool,
    /// Give up when the sample count has not moved for this long; `None` waits forever.
    pub stall_timeout: Option<Duration>,
    /// Membership changes to replay while the job trains.
    pub scenario: Option<ScenarioFile>,
    /// Carry out each membership change of the scenario by checkpointing, stopping every
    /// worker and starting the new number afresh (the classic baseline), instead of
    /// elastically.
    pub restart_on_change: bool,
    /// Stragglers, preemption notices and slots.
    pub elastic: ElasticConfig,
    /// The dashboard and the plots of the run.
    pub observe: ObserveConfig,
}

/// What a run shows of itself besides its report (every process serves `/metrics` on a
/// loopback port regardless; the addresses are in `STATE_DIR/metrics/`).
#[derive(Clone, Debug, Default)]
pub struct ObserveConfig {
    /// Where the coordinator serves its dashboard, if anywhere (port 0 picks one).
    pub http: Option<SocketAddr>,
    /// Draw the run's plots (throughput, loss and accuracy over time with membership and
    /// resharding events and their stalls) into this directory.
    pub plot: Option<PathBuf>,
}

/// What the launcher does for the coordinator's elastic decisions.
#[derive(Clone, Debug)]
pub struct ElasticConfig {
    /// How the coordinator finds and handles stragglers.
    pub stragglers: edl_shared::proto::StragglerSettings,
    /// Worker slots on this machine (`slot0`..): each worker process runs in one, and
    /// placements (replacements, migrations, resizes) start workers only in free ones. 0
    /// means twice the most workers the run starts, at least 4. On one machine a slot is a
    /// CPU stand-in for a GPU: a label, nothing is pinned.
    pub slots: u32,
    /// The notice a worker gets with SIGUSR1 (the scenario's `preempt`).
    pub preempt_notice: Duration,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        ElasticConfig {
            stragglers: Default::default(),
            slots: 0,
            preempt_notice: Duration::from_secs(30),
        }
    }
}

impl LocalConfig {
    /// Runs the job file `file` instead of an MLP job: the fields that describe the job
    /// (epochs, consistency, optimizer, schedule, batch size, samples, lease, layers, seed) are taken
    /// from it, so that the report says what ran.
    pub fn from_job_file(mut self, file: &Path) -> anyhow::Result<LocalConfig> {
        let whole = edl_shared::jobfile::load_file(file)?;
        if let Some(why) = whole.unplaceable() {
            bail!("{}: {why}", file.display());
        }
        let job = whole.job;
        self.epochs = job.epochs;
        self.consistency = job.consistency;
        self.optimizer = job.optimizer.clone();
        self.schedule = job.schedule.clone();
        self.batch_size = job.batch_size;
        self.train_samples = job.train_samples;
        self.lease_ms = job.lease_ms;
        self.seed = job.seed;
        self.layers = edl_shared::models::Mlp::from_section(&job.model)
            .map(|m| m.layers)
            .unwrap_or_default();
        // The coordinator may run elsewhere than here: give it the file's absolute path.
        self.job = Some(std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf()));
        Ok(self)
    }
}

/// A checked scenario and the file it came from.
#[derive(Clone, Debug)]
pub struct ScenarioFile {
    /// The file.
    pub path: PathBuf,
    /// Its events, checked against the run's initial workers.
    pub scenario: Scenario,
}

/// What `--restart-on-change` does, for `--help` readers and the report alike.
pub const RESTART_NOTE: &str = "The classic stop-everything baseline, for comparison: at \
    each membership change of the scenario the launcher checkpoints (an admin client pulls \
    every parameter and writes them to <state>/checkpoint-N.bin, timed) while the old workers \
    still train, then stops every worker with SIGTERM (each finishes its in-flight step and \
    leaves) and waits for them, then starts the new number of workers as fresh processes with \
    new names. The parameter servers keep running and keep the parameters, so the new \
    workers' first pull is the restore; the checkpoint file is written but never read back. A \
    kill is SIGKILL to the victim first, then the same restart with one worker fewer; as in \
    elastic mode, the coordinator counts the victim until its lease expires. Shard and \
    coordinator events (shard_add, shard_remove, move, kill_shard, restart_shard, \
    kill_coordinator, restart_coordinator) change no worker: they are carried out online, \
    exactly as in elastic mode.";

/// What elastic membership means, for the report.
const ELASTIC_NOTE: &str = "Workers are added, drained, sent SIGTERM or killed while \
    the others keep training; the coordinator re-issues a departed worker's uncommitted data \
    from where its committed samples end. Shards are added, removed and killed, and key \
    ranges moved between them, while the workers keep training and re-route.";

/// Runs the job described by `cfg` to the end and returns its report, written to
/// `cfg.report` as well when that is set.
///
/// Cancelling `shutdown` (SIGINT, SIGTERM) stops every child process and returns an error.
/// Whatever happens, every child is asked to stop and, failing that, killed before this returns.
pub async fn run(cfg: &LocalConfig, shutdown: CancellationToken) -> anyhow::Result<Report> {
    let started = Instant::now();
    let bins = Binaries::locate(cfg.bin_dir.as_deref())?;
    // The cheap test split is enough to prove the files are there and readable; loading it
    // before anything starts turns a missing dataset into one clear message, not three worker
    // failures.
    // A job file was checked when it was read (`LocalConfig::from_job_file`), its data
    // counted where it says `auto`.
    if cfg.job.is_none() {
        let data_dir = cfg.data_dir.clone();
        tokio::task::spawn_blocking(move || ImageSet::load(&data_dir, Split::Test))
            .await
            .context("the data check did not finish")?
            .with_context(|| format!("checking the idx data in {}", cfg.data_dir.display()))?;
    }
    let state_dir = match &cfg.state_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create state directory {}", dir.display()))?;
            dir.clone()
        }
        None => fresh_state_dir(&std::env::temp_dir())?,
    };
    let logs = state_dir.join("logs");
    std::fs::create_dir_all(&logs)
        .with_context(|| format!("cannot create log directory {}", logs.display()))?;
    let launcher = issue_certificates(&state_dir, cfg)?;
    // What the workers run: the job file's [worker] table (checked with the file), or
    // edl-worker.
    let worker = match &cfg.job {
        Some(file) => edl_shared::jobfile::load_worker(file)?,
        None => WorkerSpec::default(),
    };
    // Workers start through the local placer that edl-sched uses: a job file's [worker]
    // program in the file's folder, or edl-worker with this run's flags on top.
    let job = JobLaunch {
        name: edl_shared::pki::DEFAULT_JOB.to_string(),
        dir: state_dir.clone(),
        shards: cfg.shards,
        worker,
        workdir: cfg
            .job
            .as_deref()
            .and_then(Path::parent)
            .unwrap_or(Path::new("."))
            .to_path_buf(),
    };
    let notice = cfg.elastic.preempt_notice;
    let procs = LocalPlacer::new(bins.clone(), cfg.data_dir.clone(), Vec::new())
        .with_worker_extras(move |job, name| {
            // edl-worker's own flags: /metrics, the preemption notice, the scenario's slowdown.
            let mut extra: Vec<OsString> = launch::metrics_args(&job.dir, name).into();
            extra.extend([
                "--preempt-notice".into(),
                humantime::format_duration(notice).to_string().into(),
                "--slowdown-file".into(),
                place::slowdown_file(&job.dir, name).into_os_string(),
            ]);
            extra
        });

    let mut run = Launch {
        cfg,
        bins,
        pki: PkiDir::new(&state_dir),
        state_dir: state_dir.clone(),
        logs,
        progress: Progress::new(cfg.progress_bar)?,
        coordinator: None,
        coordinator_addr: None,
        coordinator_run: coordinator::CoordinatorRun::default(),
        identity: None,
        shards: Shards::default(),
        workers: Workers::default(),
        poller: None,
        admin: None,
        shard_actions: Vec::new(),
        clock: None,
        placer: place::Placer::new(cfg),
        procs,
        job,
    };
    run.progress.println(&format!(
        "edl-local: state and logs in {}",
        state_dir.display()
    ));
    let outcome = tokio::select! {
        biased;
        _ = shutdown.cancelled() => Err(anyhow!("interrupted")),
        r = run.drive(launcher) => r,
    };
    if outcome.is_err() {
        run.progress.abandon();
    }
    let problems = run.stop().await;
    // The cause comes first and the way to the logs after it, as the person reading wants;
    // trouble stopping the servers is worth knowing too, but it is rarely the cause.
    let trained = outcome.map_err(|e| {
        let mut msg = format!("{e:#}");
        for p in &problems {
            msg.push_str(&format!("\nwhile stopping: {p}"));
        }
        anyhow!(
            "{msg}\nthe logs of every process are in {}",
            run.logs.display()
        )
    })?;

    let samples: u64 = trained.status.epochs.iter().map(|e| e.samples).sum();
    let mut events = event_costs(&trained.trace);
    events.extend(shard_costs(
        &trained.trace,
        &trained.shard_names,
        &trained.shard_actions,
    ));
    events.sort_by_key(|e| e.t_ms);
    let train_wall_s = trained.train_wall.as_secs_f64();
    let elastic = crate::elastic::ElasticReport::of(
        &trained.trace,
        &trained.worker_processes,
        trained.actions,
        trained.placements,
        cfg.batch_size,
    );
    let epochs = epoch_reports(&trained.status, &trained.ledgers, cfg.train_samples);
    let traffic = Traffic::of(&epochs, samples);
    let report = Report {
        elastic,
        test_accuracy: trained.evaluation.test_accuracy,
        test_loss: trained.evaluation.test_loss,
        test_samples: trained.evaluation.test_samples,
        epochs,
        samples,
        finished: trained.status.finished,
        throughput_samples_per_s: throughput(samples, train_wall_s),
        traffic,
        wall_s: started.elapsed().as_secs_f64(),
        train_wall_s,
        shards: cfg.shards,
        workers: cfg.workers,
        consistency: cfg.consistency.to_string(),
        optimizer: cfg.optimizer.to_string(),
        schedule: cfg.schedule.to_string(),
        layers: cfg.layers.clone(),
        batch_size: cfg.batch_size,
        train_samples: cfg.train_samples,
        seed: cfg.seed,
        scenario: cfg.scenario.as_ref().map(|s| s.path.clone()),
        membership: if cfg.restart_on_change {
            "restart-on-change"
        } else {
            "elastic"
        }
        .into(),
        membership_note: if cfg.restart_on_change {
            RESTART_NOTE
        } else {
            ELASTIC_NOTE
        }
        .into(),
        event_summary: kind_summaries(&events),
        stall_noise: stall_noise(
            &trained.trace,
            &shard_quiet_spans(&trained.trace, &trained.shard_actions),
        ),
        events,
        restarts: trained.restarts,
        scenario_skipped: trained.skipped,
        worker_processes: trained.worker_processes,
        shard_layout: trained.shard_layout,
        state_dir,
        shutdown_problems: problems,
    };
    if let Some(path) = &cfg.report {
        report.write_json(path)?;
    }
    if let Some(path) = &cfg.trace {
        TraceDump::of(&trained.trace).write_json(path)?;
    }
    if let Some(dir) = &cfg.observe.plot {
        crate::plot::draw(dir, &trained.history, &report.events)
            .with_context(|| format!("drawing the plots in {}", dir.display()))?;
    }
    Ok(report)
}

/// What the training phase produced.
#[derive(Debug)]
struct Trained {
    status: JobStatus,
    trace: JobTrace,
    history: JobHistory,
    ledgers: Vec<(ShardId, Vec<EpochLedger>)>,
    evaluation: Evaluation,
    train_wall: Duration,
    restarts: Vec<RestartReport>,
    skipped: Vec<SkippedEvent>,
    worker_processes: Vec<crate::report::WorkerProcess>,
    shard_layout: Vec<ShardLayout>,
    shard_names: BTreeMap<ShardId, String>,
    shard_actions: Vec<ShardAction>,
    actions: Vec<crate::elastic::LauncherAction>,
    placements: Vec<edl_shared::proto::Placement>,
}

/// What the status poller tells the launcher.
#[derive(Debug)]
enum Polled {
    /// Connected to the job; the handle serves the final status.
    Connected(Box<Job>),
    /// A status snapshot and when it arrived.
    Status(JobStatus, Instant),
}

/// One run in progress: its configuration and every process it started.
struct Launch<'a> {
    cfg: &'a LocalConfig,
    bins: Binaries,
    pki: PkiDir,
    state_dir: PathBuf,
    logs: PathBuf,
    progress: Progress,
    /// The coordinator process now (a killed one until its restart).
    coordinator: Option<Proc>,
    coordinator_addr: Option<SocketAddr>,
    /// How the coordinator was started, whether it is down, and its clock across restarts.
    coordinator_run: coordinator::CoordinatorRun,
    /// The launcher's own identity, for connecting again after a coordinator restart.
    identity: Option<edl_shared::Identity>,
    shards: Shards,
    workers: Workers,
    poller: Option<JoinHandle<()>>,
    /// The launcher's admin connection to the coordinator (shard events, the final layout).
    admin: Option<Admin>,
    /// The shard events carried out so far.
    shard_actions: Vec<ShardAction>,
    /// The coordinator's clock as of the latest status, and when that status arrived: in
    /// milliseconds since the first coordinator started (a restarted coordinator's clock
    /// starts at 0 again; [`coordinator::CoordinatorRun::offset_ms`] is added).
    clock: Option<(u64, Instant)>,
    /// Slots, placements fulfilled and the elastic actions carried out.
    placer: place::Placer,
    /// What starts, signals and reaps the worker processes.
    procs: LocalPlacer,
    /// The job as the placer sees it: its name, state directory and what its workers run.
    job: JobLaunch,
}

impl Launch<'_> {
    /// Starts the cluster, trains (replaying the scenario, if any), evaluates. Leaves stopping
    /// the servers to [`Launch::stop`].
    async fn drive(&mut self, launcher: edl_shared::Identity) -> anyhow::Result<Trained> {
        let coordinator = self.start_coordinator().await?;
        self.identity = Some(launcher.clone());
        let admin = Admin::connect(
            &coordinator.to_string(),
            &launcher,
            TransportSettings::default(),
        )
        .await
        .context("connecting to the coordinator as an admin")?;
        // The time base of the report: the first coordinator's clock.
        self.coordinator_run.first_zero = Some(coordinator::clock_zero(&admin).await?.0);
        self.admin = Some(admin);
        self.start_shards().await?;
        self.start_workers().await?;
        let workers_started = Instant::now();
        self.progress.println(&format!(
            "edl-local: coordinator at {coordinator}, {} shards and {} workers started",
            self.cfg.shards, self.cfg.workers
        ));
        let mut player = self.cfg.scenario.as_ref().map(|s| {
            self.progress.println(&format!(
                "edl-local: replaying {} ({} events, {}); its times count from the first \
                 admitted worker",
                s.path.display(),
                s.scenario.events.len(),
                if self.cfg.restart_on_change {
                    "restart on every change"
                } else {
                    "elastic"
                }
            ));
            Player::new(&s.scenario, self.cfg.restart_on_change)
        });

        let (tx, mut rx) = mpsc::channel(4);
        let client = ClientConfig {
            coordinator: coordinator.to_string(),
            identity: launcher.clone(),
            settings: TransportSettings::default(),
        };
        self.poller = Some(tokio::spawn(poll_status(client, tx)));

        let mut polling = true;
        let mut job = None;
        let mut first_active = None;
        let mut stall = StallWatch::new(STALL_WARNING);
        let mut tick = tokio::time::interval(CHILD_CHECK);
        let last_exit = loop {
            tokio::select! {
                polled = rx.recv(), if polling => match polled {
                    Some(Polled::Connected(j)) => {
                        // The job's keys are known now: a move outside them is refused
                        // before any event is replayed.
                        if let Some(s) = &self.cfg.scenario {
                            s.scenario
                                .check_keys(j.layout().num_keys())
                                .with_context(|| format!("--scenario {}", s.path.display()))?;
                        }
                        job = Some(*j);
                    }
                    Some(Polled::Status(st, at)) => {
                        self.clock = Some((st.t_ms + self.coordinator_run.offset_ms, at));
                        if first_active.is_none() && active_workers(&st) > 0 {
                            first_active = Some(at);
                        }
                        self.progress.update(&st, at);
                        if let Some(warning) = stall.check(&st, at) {
                            self.progress.println(&warning);
                        }
                        if let Some(limit) = self.cfg.stall_timeout
                            && stall.stalled_for(at) > limit
                        {
                            bail!(
                                "training made no progress for {} s (--stall-timeout): {}",
                                limit.as_secs(),
                                worker_states(&st)
                            );
                        }
                    }
                    // The poller only stops when it cannot connect, and it has said why; the
                    // run goes on without live progress (and without its scenario).
                    None => polling = false,
                },
                _ = tick.tick() => {
                    self.check_servers()?;
                    self.workers.refresh(&mut self.procs).await;
                    if let Some(now) = self.coordinator_now() {
                        self.workers.note_exits(now);
                    }
                    if let Some(at) = self.workers.check()? {
                        break at;
                    }
                    self.place_due().await?;
                    if let (Some(p), Some(zero), Some(j)) = (player.as_mut(), first_active, &job) {
                        self.play_due(p, zero, j).await?;
                    }
                }
            }
        };
        if let Some(p) = self.poller.take() {
            p.abort();
        }
        // Without a status showing an active worker (a very short run), the clock starts when
        // the workers were started, which includes their data loading.
        let train_wall = last_exit.duration_since(first_active.unwrap_or(workers_started));
        let (restarts, skipped) = match player {
            Some(mut p) => {
                let elapsed = first_active.map(|z| last_exit.duration_since(z));
                p.finish(elapsed);
                for s in &p.skipped {
                    self.progress.println(&format!(
                        "edl-local: skipped scenario event at {:.1} s ({}): {}",
                        s.at_s, s.action, s.reason
                    ));
                }
                (p.restarts, p.skipped)
            }
            None => (Vec::new(), Vec::new()),
        };

        let job = match job {
            Some(j) => j,
            None => {
                let client = ClientConfig {
                    coordinator: coordinator.to_string(),
                    identity: launcher.clone(),
                    settings: TransportSettings::default(),
                };
                tokio::time::timeout(FINAL_STATUS_TIMEOUT, Job::connect(&client))
                    .await
                    .context("connecting to the coordinator timed out")?
                    .context("connecting to the coordinator")?
            }
        };
        let status = tokio::time::timeout(FINAL_STATUS_TIMEOUT, job.status())
            .await
            .context("the final status request timed out")?
            .context("asking the coordinator for the final status")?;
        let mut trace = tokio::time::timeout(FINAL_STATUS_TIMEOUT, job.trace())
            .await
            .context("the trace request timed out")?
            .context("asking the coordinator for its event trace")?;
        // A restarted coordinator dates from its own start: the report, from the first's.
        coordinator::shift_trace(&mut trace, self.coordinator_run.offset_ms);
        // `job`'s connections may be to shards that were killed and restarted since (a dead
        // connection fails the call rather than reconnecting): a fresh client reads the
        // ledgers of the shards that hold keys now (a retired shard holds none).
        let ledgers = tokio::time::timeout(FINAL_STATUS_TIMEOUT, async {
            let now = Job::connect(&ClientConfig {
                coordinator: coordinator.to_string(),
                identity: launcher.clone(),
                settings: TransportSettings::default(),
            })
            .await?;
            now.ledgers().await
        })
        .await
        .context("the ledger requests timed out")?
        .context("asking the shards for their data ledgers")?;
        let (shard_layout, shard_names) = self.shard_layout().await?;
        let shard_actions = std::mem::take(&mut self.shard_actions);
        let placements = match &self.admin {
            Some(a) => tokio::time::timeout(FINAL_STATUS_TIMEOUT, a.placements())
                .await
                .context("the placements request timed out")?
                .context("asking the coordinator for its placements")?,
            None => Vec::new(),
        };
        self.progress.finish(&status);
        if self.job.worker.is_builtin() {
            self.progress
                .println("edl-local: training done; evaluating on the test set");
        }
        let evaluation = if self.job.worker.is_builtin() {
            self.evaluate(&coordinator).await?
        } else {
            // edl-worker cannot evaluate the job's own model: the run reports the latest
            // evaluation the job's program sent, if any.
            status.evaluation.as_ref().map_or(
                Evaluation {
                    test_accuracy: 0.0,
                    test_loss: 0.0,
                    test_samples: 0,
                },
                |e| Evaluation {
                    test_accuracy: e.accuracy,
                    test_loss: e.loss,
                    test_samples: e.samples,
                },
            )
        };
        // After the evaluation, so that the history holds it.
        let mut history = tokio::time::timeout(FINAL_STATUS_TIMEOUT, job.history(0))
            .await
            .context("the history request timed out")?
            .context("asking the coordinator for its history")?;
        coordinator::shift_history(&mut history, self.coordinator_run.offset_ms);
        Ok(Trained {
            status,
            trace,
            history,
            ledgers,
            evaluation,
            train_wall,
            restarts,
            skipped,
            worker_processes: self.workers.report(),
            shard_layout,
            shard_names,
            shard_actions,
            actions: std::mem::take(&mut self.placer.actions),
            placements,
        })
    }

    /// Starts the coordinator and waits until it has written its address.
    async fn start_coordinator(&mut self) -> anyhow::Result<SocketAddr> {
        let cfg = self.cfg;
        let addr_file = self.coordinator_addr_file();
        let layers = cfg
            .layers
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut args = launch::coordinator_args(
            &self.state_dir,
            &addr_file,
            cfg.shards,
            &cfg.elastic.stragglers,
            None,
        );
        args.extend(launch::metrics_args(&self.state_dir, COORDINATOR_NAME));
        if let Some(http) = cfg.observe.http {
            args.extend([
                "--http".into(),
                http.to_string().into(),
                "--http-file".into(),
                self.dashboard_addr_file().into_os_string(),
            ]);
        }
        if let Some(r) = cfg.replicas {
            args.extend(["--replicas".into(), r.to_string().into()]);
        }
        if let Some(w) = cfg.wire {
            args.extend(["--wire".into(), w.to_string().into()]);
        }
        if let Some(job) = &cfg.job {
            args.extend(["--job".into(), job.clone().into_os_string()]);
        } else {
            args.extend([
                "--layers".into(),
                layers.into(),
                "--optimizer".into(),
                cfg.optimizer.to_string().into(),
                "--schedule".into(),
                cfg.schedule.to_string().into(),
                "--consistency".into(),
                cfg.consistency.to_string().into(),
                "--batch-size".into(),
                cfg.batch_size.to_string().into(),
                "--epochs".into(),
                cfg.epochs.to_string().into(),
                "--train-samples".into(),
                cfg.train_samples.to_string().into(),
                "--seed".into(),
                cfg.seed.to_string().into(),
                "--lease-ms".into(),
                cfg.lease_ms.to_string().into(),
            ]);
        }
        // A restart runs the same arguments, on the address this start gets.
        self.coordinator_run.args = args.clone();
        let addr = self.spawn_coordinator(args, "coordinator.log").await?;
        self.progress.println(&format!(
            "edl-local: every process serves Prometheus metrics; addresses in {}",
            self.state_dir.join("metrics").display()
        ));
        self.coordinator_addr = Some(addr);
        Ok(addr)
    }

    async fn start_workers(&mut self) -> anyhow::Result<()> {
        for i in 0..self.cfg.workers {
            let name = worker_name(i);
            self.spawn_worker(&name, &name, None).await?;
        }
        Ok(())
    }

    /// The coordinator's clock now, as far as the latest status tells.
    fn coordinator_now(&self) -> Option<u64> {
        self.clock
            .map(|(t_ms, at)| t_ms + at.elapsed().as_millis() as u64)
    }

    /// Starts a worker process named `name` that stands for the scenario's worker
    /// `stands_for`, in a free slot (the one `placement` asks for, if it names one),
    /// issuing its certificate first if it has none yet. A worker started for a placement
    /// names it when it registers.
    async fn spawn_worker(
        &mut self,
        name: &str,
        stands_for: &str,
        placement: Option<(u64, Option<&str>)>,
    ) -> anyhow::Result<()> {
        let coordinator = self
            .coordinator_addr
            .context("workers cannot start before the coordinator")?;
        self.workers.refresh(&mut self.procs).await;
        let busy = self.workers.busy_slots();
        let slot = self
            .placer
            .free_slot(&busy, placement.and_then(|(_, s)| s))
            .map_err(anyhow::Error::msg)?;
        self.pki
            .ensure(Role::Worker, name)
            .with_context(|| format!("issuing the certificate of worker/{name}"))?;
        let placement = placement.map(|(id, _)| id);
        let record = self
            .procs
            .start_worker(
                &self.job,
                &coordinator,
                name,
                &Slot {
                    name: slot.clone(),
                    host: LOCAL_HOST.into(),
                    devices: None,
                },
                placement,
            )
            .await?;
        self.workers.push(WorkerProc {
            name: name.to_string(),
            pid: record.pid,
            log: self.job.log(name),
            stands_for: stands_for.to_string(),
            slot,
            placement,
            exited_ms: None,
            fate: Fate::Trains,
            exit: None,
        });
        Ok(())
    }

    /// Fails if the coordinator or a shard has exited, unless it was the coordinator or a
    /// shard the launcher killed, or a shard the coordinator removed (see [`Shards::check`]):
    /// training cannot go on without them.
    fn check_servers(&mut self) -> anyhow::Result<()> {
        if !self.coordinator_run.down
            && let Some(p) = self.coordinator.as_mut()
            && let Some(status) = p.try_exit()?
        {
            bail!("{}", p.failure("exited during training", status));
        }
        self.shards.check()
    }

    /// Runs the evaluator on the final parameters and reads its verdict.
    async fn evaluate(&mut self, coordinator: &SocketAddr) -> anyhow::Result<Evaluation> {
        let eval = Proc::spawn(Spawn {
            name: EVALUATOR_NAME.into(),
            program: self.bins.worker.clone(),
            args: [
                launch::worker_args(
                    &coordinator.to_string(),
                    EVALUATOR_NAME,
                    &self.cfg.data_dir,
                    &self.state_dir,
                    None,
                    true,
                ),
                launch::metrics_args(&self.state_dir, EVALUATOR_NAME).into(),
            ]
            .concat(),
            log: self.logs.join("eval.log"),
            capture_stdout: true,
            ..Spawn::default()
        })?;
        let log = eval.log().to_path_buf();
        // Dropping the evaluator's handle on a timeout kills it.
        let (status, stdout) = tokio::time::timeout(EVALUATOR_TIMEOUT, eval.output())
            .await
            .with_context(|| {
                format!(
                    "the evaluator did not finish within {} s; its log is {}",
                    EVALUATOR_TIMEOUT.as_secs(),
                    log.display()
                )
            })??;
        if !status.success() {
            bail!(
                "{}",
                failure_message("the evaluator", &log, "failed", status)
            );
        }
        Evaluation::parse(&stdout).with_context(|| format!("see {}", log.display()))
    }

    /// Stops everything still running: leftover workers first (only after a failure), then
    /// the shards, then the coordinator, each with SIGTERM and a grace period. Returns the
    /// problems worth reporting: abnormal exits and processes that had to be killed.
    async fn stop(&mut self) -> Vec<String> {
        if let Some(p) = self.poller.take() {
            p.abort();
        }
        // A worker still running here is one a failed run no longer needs; how it stops is
        // not news (the placer warns of one it had to kill).
        self.procs.stop_job(&self.job.name).await;
        let mut problems = self.shards.stop(STOP_GRACE).await;
        if let Some(p) = self.coordinator.as_mut() {
            let problem = stop_server(p, STOP_GRACE).await;
            // A coordinator the scenario killed (the run failed before its restart) died as
            // it was meant to.
            if !self.coordinator_run.down {
                problems.extend(problem);
            }
        }
        problems
    }
}

/// Stops a server with SIGTERM and `grace`; returns the problem worth reporting, if any: an
/// abnormal exit, or having had to kill it.
async fn stop_server(p: &mut Proc, grace: Duration) -> Option<String> {
    match p.terminate(grace).await {
        Ok(Stopped::OnTerm(s)) | Ok(Stopped::Before(s)) if s.success() => None,
        Ok(Stopped::OnTerm(s)) => Some(format!(
            "{} exited with {s} on SIGTERM; see {}",
            p.name(),
            p.log().display()
        )),
        Ok(Stopped::Before(s)) => Some(format!(
            "{} had already exited with {s}; see {}",
            p.name(),
            p.log().display()
        )),
        Ok(Stopped::Killed) => Some(format!(
            "{} did not stop within {} s of SIGTERM and was killed; see {}",
            p.name(),
            grace.as_secs(),
            p.log().display()
        )),
        Err(e) => Some(format!("{e:#}")),
    }
}

/// Connects to the job as the launcher and sends a status snapshot every [`STATUS_PERIOD`]
/// until the receiver goes away. A failed status call is skipped, not fatal: the coordinator
/// may be busy, and the next one will tell.
async fn poll_status(client: ClientConfig, tx: mpsc::Sender<Polled>) {
    let job = match Job::connect(&client).await {
        Ok(j) => j,
        Err(e) => {
            tracing::warn!(error = %e, "cannot connect to the job for progress; continuing without");
            return;
        }
    };
    if tx
        .send(Polled::Connected(Box::new(job.clone())))
        .await
        .is_err()
    {
        return;
    }
    let mut tick = tokio::time::interval(STATUS_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match tokio::time::timeout(STATUS_TIMEOUT, job.status()).await {
            Ok(Ok(st)) => {
                if tx.send(Polled::Status(st, Instant::now())).await.is_err() {
                    return;
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "status request failed"),
            Err(_) => tracing::debug!("status request timed out"),
        }
    }
}
