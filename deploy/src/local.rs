//! A whole EDL job on this machine: certificates for every process, a coordinator, shard and
//! worker processes, progress from the coordinator's status, an evaluation of the final model
//! and an orderly shutdown.
//!
//! Every process is a separate OS process started from the `edl-ps` and `edl-worker` binaries,
//! exactly as on a real cluster, so a local run exercises the same code paths (QUIC, mutual TLS,
//! leases) and leaves one log per process in the state directory.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::JobStatus;
use edl_shared::proto::{Consistency, OptimizerSpec};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_worker::data::{Dataset, Split};
use edl_worker::{ClientConfig, Job};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::procs::{Proc, Spawn, Stopped, failure_message};
use crate::progress::{Progress, StallWatch, active_workers, worker_states};
use crate::report::{Evaluation, Report, epoch_reports, throughput};

/// The coordinator's certificate name; `edl-ps coordinator` always uses it.
const COORDINATOR_NAME: &str = "coordinator";
/// The evaluator's certificate name.
const EVALUATOR_NAME: &str = "eval";
/// The launcher's own (admin) certificate name.
const LAUNCHER_NAME: &str = "launcher";
/// How long the coordinator may take to start listening.
const COORDINATOR_START: Duration = Duration::from_secs(30);
/// How often child processes are checked for an exit.
const CHILD_CHECK: Duration = Duration::from_millis(50);
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
    /// Samples per mini-batch.
    pub batch_size: u32,
    /// Training samples per epoch.
    pub train_samples: u32,
    /// Worker heartbeat lease in milliseconds.
    pub lease_ms: u32,
    /// MLP layer widths, input to classes.
    pub layers: Vec<u32>,
    /// Seed for initialization and data order.
    pub seed: u64,
    /// Where the Fashion-MNIST idx files are.
    pub data_dir: PathBuf,
    /// Where to write the JSON report, if anywhere.
    pub report: Option<PathBuf>,
    /// The state directory; `None` creates a fresh one under the system's temporary directory.
    pub state_dir: Option<PathBuf>,
    /// Where `edl-ps` and `edl-worker` are; `None` means next to the running executable.
    pub bin_dir: Option<PathBuf>,
    /// Show a live progress bar (plain per-epoch lines otherwise).
    pub progress_bar: bool,
    /// Give up when the sample count has not moved for this long; `None` waits forever.
    pub stall_timeout: Option<Duration>,
}

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
    let data_dir = cfg.data_dir.clone();
    tokio::task::spawn_blocking(move || Dataset::load(&data_dir, Split::Test))
        .await
        .context("the Fashion-MNIST check did not finish")?
        .context("checking the Fashion-MNIST data")?;
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

    let mut run = Launch {
        cfg,
        bins,
        state_dir: state_dir.clone(),
        logs,
        progress: Progress::new(cfg.progress_bar)?,
        coordinator: None,
        shards: Vec::new(),
        workers: Vec::new(),
        poller: None,
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
    let train_wall_s = trained.train_wall.as_secs_f64();
    let report = Report {
        test_accuracy: trained.evaluation.test_accuracy,
        test_loss: trained.evaluation.test_loss,
        test_samples: trained.evaluation.test_samples,
        epochs: epoch_reports(&trained.status),
        samples,
        finished: trained.status.finished,
        throughput_samples_per_s: throughput(samples, train_wall_s),
        wall_s: started.elapsed().as_secs_f64(),
        train_wall_s,
        shards: cfg.shards,
        workers: cfg.workers,
        consistency: cfg.consistency.to_string(),
        optimizer: cfg.optimizer.to_string(),
        layers: cfg.layers.clone(),
        batch_size: cfg.batch_size,
        train_samples: cfg.train_samples,
        seed: cfg.seed,
        state_dir,
        shutdown_problems: problems,
    };
    if let Some(path) = &cfg.report {
        report.write_json(path)?;
    }
    Ok(report)
}

/// Creates a new directory `edl-local-<unix seconds>` under `parent`, with a counter appended
/// when runs start within the same second.
pub fn fresh_state_dir(parent: &Path) -> anyhow::Result<PathBuf> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    for n in 0..1000 {
        let name = match n {
            0 => format!("edl-local-{secs}"),
            n => format!("edl-local-{secs}-{n}"),
        };
        let dir = parent.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot create state directory {}", dir.display()));
            }
        }
    }
    bail!(
        "cannot find a free name for a state directory in {}",
        parent.display()
    )
}

/// Creates the CA and every certificate of the run before any process starts, so that the
/// children only load credentials and never race each other to create a CA. Returns the
/// launcher's own identity.
fn issue_certificates(state_dir: &Path, cfg: &LocalConfig) -> anyhow::Result<edl_shared::Identity> {
    let pki = PkiDir::new(state_dir);
    pki.init_ca()
        .with_context(|| format!("creating the cluster CA in {}", state_dir.display()))?;
    let mut nodes = vec![
        (Role::Coordinator, COORDINATOR_NAME.to_string()),
        (Role::Worker, EVALUATOR_NAME.to_string()),
    ];
    nodes.extend((0..cfg.shards).map(|i| (Role::Shard, shard_name(i))));
    nodes.extend((0..cfg.workers).map(|i| (Role::Worker, worker_name(i))));
    for (role, name) in nodes {
        pki.ensure(role, &name)
            .with_context(|| format!("issuing the certificate of {role}/{name}"))?;
    }
    pki.ensure(Role::Admin, LAUNCHER_NAME)
        .context("issuing the launcher's certificate")
}

fn shard_name(i: u32) -> String {
    format!("s{i}")
}

fn worker_name(i: u32) -> String {
    format!("w{i}")
}

/// The programs the launcher starts.
#[derive(Clone, Debug)]
struct Binaries {
    ps: PathBuf,
    worker: PathBuf,
}

impl Binaries {
    /// Finds `edl-ps` and `edl-worker` in `dir`, or next to the running executable.
    fn locate(dir: Option<&Path>) -> anyhow::Result<Binaries> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => {
                let exe = std::env::current_exe().context("cannot find the running executable")?;
                exe.parent()
                    .map(Path::to_path_buf)
                    .with_context(|| format!("{} has no parent directory", exe.display()))?
            }
        };
        let find = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(anyhow!(
                    "{name} not found in {}: build it with `cargo build --release -p edl-ps \
                     -p edl-worker` or pass --bin-dir",
                    dir.display()
                ))
            }
        };
        Ok(Binaries {
            ps: find("edl-ps")?,
            worker: find("edl-worker")?,
        })
    }
}

/// What the training phase produced.
#[derive(Debug)]
struct Trained {
    status: JobStatus,
    evaluation: Evaluation,
    train_wall: Duration,
}

/// What the status poller tells the launcher.
#[derive(Debug)]
enum Polled {
    /// Connected to the job; the handle serves the final status.
    Connected(Job),
    /// A status snapshot and when it arrived.
    Status(JobStatus, Instant),
}

/// One run in progress: its configuration and every process it started.
struct Launch<'a> {
    cfg: &'a LocalConfig,
    bins: Binaries,
    state_dir: PathBuf,
    logs: PathBuf,
    progress: Progress,
    coordinator: Option<Proc>,
    shards: Vec<Proc>,
    workers: Vec<Proc>,
    poller: Option<JoinHandle<()>>,
}

impl Launch<'_> {
    /// Starts the cluster, trains, evaluates. Leaves stopping the servers to [`Launch::stop`].
    async fn drive(&mut self, launcher: edl_shared::Identity) -> anyhow::Result<Trained> {
        let coordinator = self.start_coordinator().await?;
        self.start_shards(&coordinator)?;
        self.start_workers(&coordinator)?;
        let workers_started = Instant::now();
        self.progress.println(&format!(
            "edl-local: coordinator at {coordinator}, {} shards and {} workers started",
            self.cfg.shards, self.cfg.workers
        ));

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
                    Some(Polled::Connected(j)) => job = Some(j),
                    Some(Polled::Status(st, at)) => {
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
                    // run goes on without live progress.
                    None => polling = false,
                },
                _ = tick.tick() => {
                    self.check_servers()?;
                    if let Some(at) = self.check_workers()? {
                        break at;
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

        let job = match job {
            Some(j) => j,
            None => {
                let client = ClientConfig {
                    coordinator: coordinator.to_string(),
                    identity: launcher,
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
        self.progress.finish(&status);
        self.progress
            .println("edl-local: training done; evaluating on the test set");
        let evaluation = self.evaluate(&coordinator).await?;
        Ok(Trained {
            status,
            evaluation,
            train_wall,
        })
    }

    /// Starts the coordinator and waits until it has written its address.
    async fn start_coordinator(&mut self) -> anyhow::Result<SocketAddr> {
        let cfg = self.cfg;
        let addr_file = self.state_dir.join("coordinator.addr");
        // A state directory can be reused; an address left by an earlier run must not be
        // mistaken for this coordinator's.
        match std::fs::remove_file(&addr_file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("cannot remove {}", addr_file.display()));
            }
        }
        let layers = cfg
            .layers
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut args = args(&["coordinator", "--listen", "127.0.0.1:0"]);
        args.extend([
            "--addr-file".into(),
            addr_file.clone().into_os_string(),
            "--shards".into(),
            cfg.shards.to_string().into(),
            "--layers".into(),
            layers.into(),
            "--optimizer".into(),
            cfg.optimizer.to_string().into(),
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
            "--state-dir".into(),
            self.state_dir.clone().into_os_string(),
        ]);
        let proc = self.coordinator.insert(Proc::spawn(Spawn {
            name: COORDINATOR_NAME.into(),
            program: self.bins.ps.clone(),
            args,
            log: self.logs.join("coordinator.log"),
            capture_stdout: false,
        })?);

        let deadline = Instant::now() + COORDINATOR_START;
        loop {
            // The file is written atomically, so once it exists it holds the whole address.
            if let Ok(text) = std::fs::read_to_string(&addr_file) {
                return text.trim().parse().with_context(|| {
                    format!("{} holds {text:?}, not an address", addr_file.display())
                });
            }
            if let Some(status) = proc.try_exit()? {
                bail!("{}", proc.failure("exited before it was listening", status));
            }
            if Instant::now() > deadline {
                bail!(
                    "the coordinator did not write {} within {} s; its log is {}",
                    addr_file.display(),
                    COORDINATOR_START.as_secs(),
                    proc.log().display()
                );
            }
            tokio::time::sleep(CHILD_CHECK).await;
        }
    }

    fn start_shards(&mut self, coordinator: &SocketAddr) -> anyhow::Result<()> {
        for i in 0..self.cfg.shards {
            let name = shard_name(i);
            let mut args = args(&["shard", "--listen", "127.0.0.1:0"]);
            args.extend([
                "--coordinator".into(),
                coordinator.to_string().into(),
                "--name".into(),
                name.clone().into(),
                "--state-dir".into(),
                self.state_dir.clone().into_os_string(),
            ]);
            self.shards.push(Proc::spawn(Spawn {
                log: self.logs.join(format!("{name}.log")),
                name,
                program: self.bins.ps.clone(),
                args,
                capture_stdout: false,
            })?);
        }
        Ok(())
    }

    fn start_workers(&mut self, coordinator: &SocketAddr) -> anyhow::Result<()> {
        for i in 0..self.cfg.workers {
            let name = worker_name(i);
            self.workers.push(Proc::spawn(Spawn {
                log: self.logs.join(format!("{name}.log")),
                args: self.worker_args(coordinator, &name, false),
                name,
                program: self.bins.worker.clone(),
                capture_stdout: false,
            })?);
        }
        Ok(())
    }

    fn worker_args(&self, coordinator: &SocketAddr, name: &str, evaluate: bool) -> Vec<OsString> {
        let mut args = Vec::new();
        if evaluate {
            args.push("--evaluate".into());
        }
        args.extend([
            "--coordinator".into(),
            coordinator.to_string().into(),
            "--name".into(),
            name.into(),
            "--data-dir".into(),
            self.cfg.data_dir.clone().into_os_string(),
            "--state-dir".into(),
            self.state_dir.clone().into_os_string(),
        ]);
        args
    }

    /// Fails if the coordinator or a shard has exited: training cannot go on without them.
    fn check_servers(&mut self) -> anyhow::Result<()> {
        for p in self.coordinator.iter_mut().chain(self.shards.iter_mut()) {
            if let Some(status) = p.try_exit()? {
                bail!("{}", p.failure("exited during training", status));
            }
        }
        Ok(())
    }

    /// Fails if a worker has exited with an error; returns the time of the check that found
    /// every worker gone.
    fn check_workers(&mut self) -> anyhow::Result<Option<Instant>> {
        let mut running = 0;
        for w in &mut self.workers {
            match w.try_exit()? {
                None => running += 1,
                Some(status) if status.success() => {}
                Some(status) => bail!("{}", w.failure("failed", status)),
            }
        }
        Ok((running == 0).then(Instant::now))
    }

    /// Runs the evaluator on the final parameters and reads its verdict.
    async fn evaluate(&mut self, coordinator: &SocketAddr) -> anyhow::Result<Evaluation> {
        let eval = Proc::spawn(Spawn {
            name: EVALUATOR_NAME.into(),
            program: self.bins.worker.clone(),
            args: self.worker_args(coordinator, EVALUATOR_NAME, true),
            log: self.logs.join("eval.log"),
            capture_stdout: true,
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
        let mut problems = Vec::new();
        for w in &mut self.workers {
            // A worker that is still running here is one the failed run no longer needs; how
            // it stops is not news.
            if let Err(e) = w.terminate(STOP_GRACE).await {
                problems.push(format!("{e:#}"));
            }
        }
        let servers = self.shards.iter_mut().chain(self.coordinator.iter_mut());
        for p in servers {
            match p.terminate(STOP_GRACE).await {
                Ok(Stopped::OnTerm(s)) | Ok(Stopped::Before(s)) if s.success() => {}
                Ok(Stopped::OnTerm(s)) => problems.push(format!(
                    "{} exited with {s} on SIGTERM; see {}",
                    p.name(),
                    p.log().display()
                )),
                Ok(Stopped::Before(s)) => problems.push(format!(
                    "{} had already exited with {s}; see {}",
                    p.name(),
                    p.log().display()
                )),
                Ok(Stopped::Killed) => problems.push(format!(
                    "{} did not stop within {} s of SIGTERM and was killed; see {}",
                    p.name(),
                    STOP_GRACE.as_secs(),
                    p.log().display()
                )),
                Err(e) => problems.push(format!("{e:#}")),
            }
        }
        problems
    }
}

fn args(list: &[&str]) -> Vec<OsString> {
    list.iter().map(OsString::from).collect()
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
    if tx.send(Polled::Connected(job.clone())).await.is_err() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_state_dirs_do_not_collide() {
        let parent = tempfile::tempdir().expect("tempdir");
        let a = fresh_state_dir(parent.path()).expect("first");
        let b = fresh_state_dir(parent.path()).expect("second");
        assert_ne!(a, b);
        assert!(a.is_dir() && b.is_dir());
        let name = a.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        assert!(name.starts_with("edl-local-"), "{name}");
    }

    #[test]
    fn missing_binaries_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Binaries::locate(Some(dir.path())).expect_err("empty dir");
        let msg = err.to_string();
        assert!(msg.contains("edl-ps not found"), "{msg}");
        assert!(msg.contains("--bin-dir"), "{msg}");
    }

    #[test]
    fn certificates_cover_every_process() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = LocalConfig {
            shards: 2,
            workers: 3,
            epochs: 1,
            consistency: Consistency::Bsp,
            optimizer: "sgd:0.1".parse().expect("optimizer"),
            batch_size: 64,
            train_samples: 1000,
            lease_ms: 3000,
            layers: vec![784, 10],
            seed: 1,
            data_dir: dir.path().into(),
            report: None,
            state_dir: None,
            bin_dir: None,
            progress_bar: false,
            stall_timeout: None,
        };
        let launcher = issue_certificates(dir.path(), &cfg).expect("issue");
        assert_eq!(
            (launcher.role, launcher.name.as_str()),
            (Role::Admin, "launcher")
        );
        let pki = PkiDir::new(dir.path());
        for (role, name) in [
            (Role::Coordinator, "coordinator"),
            (Role::Shard, "s0"),
            (Role::Shard, "s1"),
            (Role::Worker, "w0"),
            (Role::Worker, "w2"),
            (Role::Worker, "eval"),
        ] {
            let id = pki.load(role, name).expect("load");
            assert_eq!((id.role, id.name.as_str()), (role, name));
        }
        assert!(pki.load(Role::Worker, "w3").is_err());
    }
}
