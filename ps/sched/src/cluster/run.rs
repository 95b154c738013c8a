//! The scheduler's loop: it answers requests, watches every job's processes and progress,
//! asks the policy how many slots each job should hold, resizes jobs stop-free through their
//! coordinators (`Scale`), and starts a worker in a free slot for every placement a
//! coordinator publishes. It saves its state after every change, before the answer that
//! depends on it goes out: to `sched.json`, or with `--meta` to etcd, written only while this
//! scheduler leads (see [`Scheduler::elected`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use edl_ps::admin::Admin;
use edl_ps::coordinator::{MetaStore, StoreError};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::WorkerState;
use edl_shared::proto::sched::{SchedRequest, SchedResponse, SlotRecord, Submission};
use edl_shared::proto::{ErrorCode, PlacementState};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use tokio::sync::mpsc;

use super::config::{Cluster, Slot};
use super::server::Ask;
use super::state::{Event, EventLog, Job, ProcRecord, Saved, State};
use crate::policy::{JobView, Policy, Tiresias};
use crate::speed::Speedup;
use edl_launch::{Exit, JobLaunch, Placer};

/// How often the loop looks at jobs and processes.
const TICK: Duration = Duration::from_millis(250);
/// How long one call to a job's coordinator may take.
const CALL: Duration = Duration::from_secs(5);
/// How long a job's shards may take to join its coordinator.
const SHARDS_JOIN: Duration = Duration::from_secs(60);
/// The scheduler's certificate name in each job.
pub const SCHED_NAME: &str = "sched";
/// The largest job file accepted.
const MAX_JOB_FILE: usize = 1 << 20;
/// The most workers a job may ask for.
const MAX_WORKERS: u32 = 4096;
/// The most jobs kept (finished ones count).
const MAX_JOBS: usize = 100_000;
/// A job fails when this many of its workers fail in a row.
const WORKER_FAILURES: u32 = 3;
/// How long a job's size is asked for again after one of its workers failed: longer than
/// any job's lease (the coordinator counts a dead worker until it expires).
const RESCALE_FOR: Duration = Duration::from_secs(60);

/// Unix milliseconds now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

type Answer = Result<SchedResponse, (ErrorCode, String)>;

fn bad(msg: impl Into<String>) -> (ErrorCode, String) {
    (ErrorCode::InvalidRequest, msg.into())
}

/// The scheduler.
pub struct Scheduler<P: Placer> {
    cluster: Cluster,
    dir: PathBuf,
    pki: PkiDir,
    saved: Saved,
    events: EventLog,
    placer: P,
    policy: Box<dyn Policy + Send + Sync>,
    /// Admin connections to running jobs' coordinators.
    admins: HashMap<String, Admin>,
    /// Jobs whose size must be asked for again until the coordinator places a worker for it,
    /// or until the deadline: a worker of theirs failed, and the coordinator counts a dead
    /// worker until its lease expires, so one request right away would place nothing.
    rescale: HashMap<String, Instant>,
    /// Workers asked to leave because their placement was cancelled (asked once: a second
    /// SIGTERM would end a worker at once).
    stopping: std::collections::HashSet<(String, String)>,
    /// Exits seen while starting a job, for the next [`Scheduler::reap`].
    exits: Vec<Exit>,
    /// Workers of each job that failed in a row (a worker that exits cleanly resets it).
    failures: HashMap<String, u32>,
    /// Each running job's samples trained and active workers at the last poll, and when.
    polled: HashMap<String, (u64, Instant, u32)>,
    /// The speed-up curve of a job not measured yet (the measured tables' typical one).
    typical: Speedup,
    last_tick: Instant,
    /// Where the state is made durable: `sched.json` ([`JsonFile`]), or with an election the
    /// store only the leader may write; the state written last; and cancelled once the lead
    /// may be lost.
    store: Arc<dyn MetaStore>,
    written: Option<Vec<u8>>,
    lost: CancellationToken,
}

/// The longest pause between two attempts to write the state to a store that is unavailable.
const STORE_RETRY_MAX: Duration = Duration::from_secs(1);

impl<P: Placer> Scheduler<P> {
    /// A scheduler keeping its state in `dir`: the cluster CA (`pki/`), `sched.json`,
    /// `events.jsonl` and a directory per job (`jobs/NAME`). Jobs an earlier scheduler left
    /// running are taken back.
    pub async fn new(cluster: Cluster, dir: &Path, placer: P) -> anyhow::Result<Scheduler<P>> {
        Scheduler::open(cluster, dir, placer, None).await
    }

    /// A scheduler that won the lead among several sharing etcd (`edl-sched --meta`): its state
    /// is `record` (the leader's before it, as etcd holds it; `None` the first time, when
    /// `sched.json` in `dir`, if any, is taken over) and it writes the state only to `store`,
    /// whose writes fail once another scheduler leads. `dir` holds the rest as for
    /// [`Scheduler::new`], shared by the schedulers (one machine, or a shared filesystem).
    /// Once `lost` is cancelled (the lead's lease may have expired) it stops changing
    /// anything.
    pub async fn elected(
        cluster: Cluster,
        dir: &Path,
        placer: P,
        record: Option<Vec<u8>>,
        store: Arc<dyn MetaStore>,
        lost: CancellationToken,
    ) -> anyhow::Result<Scheduler<P>> {
        let saved = match record {
            Some(r) => Some(
                serde_json::from_slice::<Saved>(&r)
                    .with_context(|| format!("the scheduler state in {}", store.describe()))?,
            ),
            None => None,
        };
        Scheduler::open(cluster, dir, placer, Some((saved, store, lost))).await
    }

    async fn open(
        cluster: Cluster,
        dir: &Path,
        placer: P,
        elected: Option<(Option<Saved>, Arc<dyn MetaStore>, CancellationToken)>,
    ) -> anyhow::Result<Scheduler<P>> {
        std::fs::create_dir_all(dir.join("jobs"))
            .with_context(|| format!("creating {}", dir.display()))?;
        // Job directories are handed to processes and shown to users: make them absolute.
        let dir = &std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        let pki = PkiDir::new(dir);
        pki.init_ca()
            .with_context(|| format!("creating the cluster CA in {}", dir.display()))?;
        let policy: Box<dyn Policy + Send + Sync> = match cluster.policy.as_str() {
            "fifo" => Box::new(crate::policy::Fifo),
            "tiresias" => Box::new(Tiresias::new(vec![
                cluster.tiresias_threshold.as_secs_f64(),
            ])),
            "elastic" => Box::new(crate::policy::Elastic),
            "goodput" => Box::new(crate::policy::Goodput),
            other => anyhow::bail!("unknown policy {other:?}"),
        };
        let file = dir.join("sched.json");
        let (saved, store, lost) = match elected {
            Some((Some(saved), store, lost)) => (saved, store, lost),
            Some((None, store, lost)) => (Saved::load(&file)?, store, lost),
            None => {
                let store: Arc<dyn MetaStore> = Arc::new(JsonFile(file.clone()));
                (Saved::load(&file)?, store, CancellationToken::new())
            }
        };
        let mut s = Scheduler {
            cluster,
            dir: dir.to_path_buf(),
            pki,
            saved,
            events: EventLog::new(dir.join("events.jsonl")),
            placer,
            policy,
            admins: HashMap::new(),
            rescale: HashMap::new(),
            stopping: Default::default(),
            exits: Vec::new(),
            failures: HashMap::new(),
            polled: HashMap::new(),
            typical: crate::curves::Curves::built_in().typical().clone(),
            last_tick: Instant::now(),
            store,
            written: None,
            lost,
        };
        s.adopt().await;
        anyhow::ensure!(
            s.save().await,
            "another scheduler took the lead while this one started"
        );
        Ok(s)
    }

    fn job_dir(&self, name: &str) -> PathBuf {
        self.dir.join("jobs").join(name)
    }

    /// What a placer needs to know of job `name`: its worker program comes from the job file
    /// the scheduler wrote (counts resolved, so reading it scans no data).
    fn launch(&self, name: &str) -> anyhow::Result<JobLaunch> {
        let dir = self.job_dir(name);
        let file = edl_shared::jobfile::load_file(&dir.join("job.toml"))?;
        let workdir = self
            .saved
            .job(name)
            .map(|j| PathBuf::from(&j.file_dir))
            .unwrap_or_else(|| dir.clone());
        Ok(JobLaunch {
            name: name.to_string(),
            dir,
            shards: self.cluster.shards,
            worker: file.worker,
            workdir,
        })
    }

    /// Makes the state durable: `sched.json`, or the store of an elected scheduler (retried
    /// while it cannot be written, a full or failing disk as an unreachable etcd: what waits on
    /// it waits, and says so; nothing is answered before it holds). False once the store
    /// refused the write because another scheduler leads: this one must change nothing more.
    async fn save(&mut self) -> bool {
        let store = self.store.clone();
        let json = match serde_json::to_vec_pretty(&self.saved) {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode the scheduler's state");
                return true;
            }
        };
        if self.written.as_deref() == Some(&json[..]) {
            return true;
        }
        let record: Arc<[u8]> = json.clone().into();
        let mut pause = Duration::from_millis(50);
        let mut failing_since: Option<Instant> = None;
        loop {
            if self.lost.is_cancelled() {
                return false;
            }
            match store.write(record.clone()).await {
                Ok(()) => break,
                Err(StoreError::Fenced(why)) => {
                    tracing::error!(store = %store.describe(), "{why}: this scheduler was deposed");
                    return false;
                }
                Err(e) => {
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if pause == Duration::from_millis(50) || pause >= STORE_RETRY_MAX {
                        tracing::warn!(
                            store = %store.describe(),
                            waiting_ms = since.elapsed().as_millis() as u64,
                            "{e}; requests to the scheduler wait until its state is written"
                        );
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(STORE_RETRY_MAX);
                }
            }
        }
        if let Some(since) = failing_since {
            tracing::info!(
                waited_ms = since.elapsed().as_millis() as u64,
                "the scheduler's state store is writable again"
            );
        }
        self.written = Some(json);
        true
    }

    /// Leaves the jobs to the scheduler that leads now (it takes them back); an error to end
    /// the process with.
    fn deposed(&mut self) -> anyhow::Result<()> {
        self.placer.detach_all();
        anyhow::bail!(
            "deposed: another scheduler leads now (or may: the lead's etcd lease ran out); this \
             one changes nothing more"
        )
    }

    fn log(
        &self,
        job: &str,
        event: &str,
        slot: Option<&str>,
        worker: Option<&str>,
        alloc: Option<u32>,
    ) {
        let e = Event {
            t_ms: now_ms(),
            job: job.to_string(),
            event: event.to_string(),
            slot: slot.map(str::to_string),
            worker: worker.map(str::to_string),
            alloc,
        };
        if let Err(err) = self.events.append(&e) {
            tracing::error!(error = %format!("{err:#}"), "cannot write the event log");
        }
    }

    /// The names of the running jobs.
    fn running_jobs(&self) -> Vec<String> {
        self.saved
            .jobs
            .iter()
            .filter(|j| j.state == State::Running)
            .map(|j| j.name.clone())
            .collect()
    }

    /// The processes job `name` runs, as recorded.
    fn procs_of(&self, name: &str) -> Vec<ProcRecord> {
        self.saved
            .job(name)
            .map(|j| j.procs.clone())
            .unwrap_or_default()
    }

    /// The scheduler's own (admin) identity in job `job`.
    fn identity_in(&self, job: &str) -> anyhow::Result<edl_shared::Identity> {
        let c = edl_launch::Creds::in_dir(&self.job_dir(job), Role::Admin, SCHED_NAME);
        Ok(edl_shared::pki::load_identity(&c.ca, &c.cert, &c.key)?)
    }

    /// Takes back the running jobs of an earlier scheduler: their processes (by pid) and an
    /// admin connection. A job whose servers are gone has failed.
    async fn adopt(&mut self) {
        for name in self.running_jobs() {
            let procs = self.procs_of(&name);
            let gone = self.placer.adopt(&name, &procs).await;
            for p in procs.iter().filter(|p| gone.contains(&p.name)) {
                self.forget_proc(&name, &p.name);
            }
            let servers_gone = procs
                .iter()
                .any(|p| p.slot.is_none() && gone.contains(&p.name));
            let admin = match self.saved.job(&name).and_then(|j| j.coordinator.clone()) {
                Some(c) if !servers_gone => self.connect(&name, &c).await.ok(),
                _ => None,
            };
            match admin {
                Some(a) => {
                    self.admins.insert(name.clone(), a);
                    self.log(&name, "adopt", None, None, None);
                    tracing::info!(job = %name, "took back a running job");
                }
                None => {
                    self.end_job(
                        &name,
                        State::Failed,
                        "its servers were gone when the scheduler restarted".into(),
                    )
                    .await;
                }
            }
        }
    }

    /// An admin connection to `job`'s coordinator at `addr`, with the scheduler's certificate
    /// for that job.
    async fn connect(&self, job: &str, addr: &str) -> anyhow::Result<Admin> {
        let id = self.identity_in(job)?;
        Ok(tokio::time::timeout(
            CALL,
            Admin::connect(addr, &id, TransportSettings::default()),
        )
        .await
        .context("connecting to the coordinator timed out")??)
    }

    /// Runs until `shutdown`; requests arrive on `rx`, and each is answered once what it
    /// changed is durable. On the way out, jobs keep running (a restarted scheduler takes them
    /// back) unless `stop_jobs` is set. An error if this scheduler was deposed (it leaves the
    /// jobs running to the new leader).
    pub async fn run(
        mut self,
        mut rx: mpsc::Receiver<Ask>,
        shutdown: CancellationToken,
        stop_jobs: bool,
    ) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let lost = self.lost.clone();
        loop {
            tokio::select! {
                biased;
                _ = lost.cancelled() => return self.deposed(),
                _ = shutdown.cancelled() => break,
                Some(ask) = rx.recv() => {
                    let answer = self.answer(ask.req, &ask.who).await;
                    if !self.save().await {
                        return self.deposed();
                    }
                    let _ = ask.reply.send(answer);
                }
                _ = tick.tick() => {
                    self.tick().await;
                    if !self.save().await {
                        return self.deposed();
                    }
                }
            }
        }
        if stop_jobs {
            for name in self.running_jobs() {
                self.end_job(&name, State::Cancelled, "the scheduler stopped".into())
                    .await;
            }
        } else {
            let n = self.running_jobs().len();
            if n > 0 {
                tracing::info!(
                    "leaving {n} running job(s) running; start edl-sched again with the same \
                     --state-dir to take them back"
                );
            }
            self.placer.detach_all();
        }
        self.save().await;
        Ok(())
    }

    async fn answer(&mut self, req: SchedRequest, who: &str) -> Answer {
        match req {
            SchedRequest::Submit(s) => self.submit(s, who),
            SchedRequest::List => Ok(SchedResponse::Jobs(
                self.saved
                    .jobs
                    .iter()
                    .map(|j| j.record(&self.job_dir(&j.name)))
                    .collect(),
            )),
            SchedRequest::Show { job } => {
                let j = self
                    .saved
                    .job(&job)
                    .ok_or((ErrorCode::InvalidRequest, format!("no job {job:?}")))?;
                Ok(SchedResponse::Job(Box::new(j.record(&self.job_dir(&job)))))
            }
            SchedRequest::Cancel { job } => {
                let j = self
                    .saved
                    .job(&job)
                    .ok_or((ErrorCode::InvalidRequest, format!("no job {job:?}")))?;
                if j.owner != who && !self.cluster.operators.iter().any(|o| o == who) {
                    return Err((
                        ErrorCode::Forbidden,
                        format!(
                            "job {job} belongs to {}; only its owner or an operator may cancel it",
                            j.owner
                        ),
                    ));
                }
                if j.state.is_over() {
                    return Err((
                        ErrorCode::Conflict,
                        format!("job {job} is already over ({:?})", j.state),
                    ));
                }
                self.end_job(&job, State::Cancelled, format!("cancelled by {who}"))
                    .await;
                let j = self.saved.job(&job).ok_or(bad("gone"))?;
                Ok(SchedResponse::Job(Box::new(j.record(&self.job_dir(&job)))))
            }
            SchedRequest::Slots => Ok(SchedResponse::Slots(self.slot_records())),
        }
    }

    fn slot_records(&self) -> Vec<SlotRecord> {
        self.cluster
            .slots
            .iter()
            .map(|s| SlotRecord {
                name: s.name.clone(),
                host: s.host.clone(),
                holder: self.holder(&s.name),
            })
            .collect()
    }

    fn holder(&self, slot: &str) -> Option<(String, String)> {
        self.saved.jobs.iter().find_map(|j| {
            j.procs
                .iter()
                .find(|p| p.slot.as_deref() == Some(slot))
                .map(|p| (j.name.clone(), p.name.clone()))
        })
    }

    fn submit(&mut self, s: Submission, who: &str) -> Answer {
        if self.saved.jobs.len() >= MAX_JOBS {
            return Err((
                ErrorCode::Busy,
                format!("the scheduler holds {MAX_JOBS} jobs"),
            ));
        }
        if s.job_file.len() > MAX_JOB_FILE {
            return Err(bad(format!("the job file is over {MAX_JOB_FILE} bytes")));
        }
        if s.workers == 0 || s.workers > MAX_WORKERS {
            return Err(bad(format!(
                "workers {} is not in 1..={MAX_WORKERS}",
                s.workers
            )));
        }
        if s.min_workers == 0 || s.min_workers > s.workers || s.workers > s.max_workers {
            return Err(bad(format!(
                "need 1 <= min ({}) <= workers ({}) <= max ({})",
                s.min_workers, s.workers, s.max_workers
            )));
        }
        let slots = self.cluster.slots.len() as u32;
        if s.min_workers > slots {
            return Err(bad(format!(
                "the job needs at least {} workers; the cluster has {slots} slots",
                s.min_workers
            )));
        }
        let name = if s.name.is_empty() {
            loop {
                self.saved.next_job += 1;
                let n = format!("j{}", self.saved.next_job);
                if self.saved.job(&n).is_none() {
                    break n;
                }
            }
        } else {
            s.name.clone()
        };
        edl_shared::pki::check_label("job name", &name).map_err(|e| bad(e.to_string()))?;
        if name.starts_with('.') || name == edl_shared::pki::DEFAULT_JOB {
            return Err(bad(format!("job name {name:?} is reserved")));
        }
        if self.saved.job(&name).is_some() {
            return Err((ErrorCode::Conflict, format!("a job named {name} exists")));
        }
        // Relative data paths resolve against the submitter's directory; the file the
        // coordinator reads has them absolute.
        let anchor = Path::new(&s.file_dir).join("job.toml");
        let file = edl_shared::jobfile::parse_file(&s.job_file, &anchor)
            .map_err(|e| bad(format!("the job file: {e}")))?;
        if let Some(why) = file.unplaceable() {
            return Err(bad(format!("the job file: {why}")));
        }
        let dir = self.job_dir(&name);
        let written = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(dir.join("job.toml"), file.to_toml()));
        if let Err(e) = written {
            return Err((
                ErrorCode::Internal,
                format!("cannot write {}: {e}", dir.display()),
            ));
        }
        let job = Job::new(
            name.clone(),
            who.to_string(),
            s,
            file.worker.describe(),
            now_ms(),
        );
        let record = job.record(&dir);
        self.saved.jobs.push(job);
        self.log(&name, "submit", None, None, None);
        tracing::info!(job = %name, owner = who, "submitted");
        Ok(SchedResponse::Job(Box::new(record)))
    }

    /// One round: exits, progress, the policy's sizes, placements.
    async fn tick(&mut self) {
        let dt = self.last_tick.elapsed().as_secs_f64();
        self.last_tick = Instant::now();
        for j in &mut self.saved.jobs {
            j.attained_s += f64::from(j.running_workers()) * dt;
        }
        self.reap().await;
        self.progress().await;
        self.allocate().await;
        self.place().await;
    }

    fn forget_proc(&mut self, job: &str, name: &str) {
        let Some(j) = self.saved.job_mut(job) else {
            return;
        };
        let Some(i) = j.procs.iter().position(|p| p.name == name) else {
            return;
        };
        let p = j.procs.remove(i);
        self.stopping.remove(&(job.to_string(), name.to_string()));
        if let Some(slot) = p.slot {
            self.log(job, "release", Some(&slot), Some(name), None);
        }
    }

    /// Frees the slots of workers that exited; a job whose server exited has failed.
    async fn reap(&mut self) {
        let mut exits = std::mem::take(&mut self.exits);
        exits.extend(self.placer.exited().await);
        for e in exits {
            let Some(j) = self.saved.job(&e.job) else {
                continue;
            };
            let is_worker = j.procs.iter().any(|p| p.name == e.name && p.slot.is_some());
            let running = j.state == State::Running;
            self.forget_proc(&e.job, &e.name);
            if !running {
                continue;
            }
            if is_worker {
                if e.ok {
                    self.failures.remove(&e.job);
                } else {
                    let n = self.failures.entry(e.job.clone()).or_default();
                    *n += 1;
                    if *n >= WORKER_FAILURES {
                        let why = format!(
                            "{WORKER_FAILURES} workers in a row failed; the last: {} {}",
                            e.name, e.what
                        );
                        self.end_job(&e.job, State::Failed, why).await;
                        continue;
                    }
                    tracing::warn!(job = %e.job, worker = %e.name, "{}", e.what);
                    if let Some(id) = e.name.strip_prefix('p').and_then(|n| n.parse().ok())
                        && let Some(a) = self.admins.get(&e.job)
                    {
                        let _ = tokio::time::timeout(CALL, a.placement_failed(id, &e.what)).await;
                    }
                    self.rescale
                        .insert(e.job.clone(), Instant::now() + RESCALE_FOR);
                }
            } else {
                self.end_job(&e.job, State::Failed, format!("{} {}", e.name, e.what))
                    .await;
            }
        }
    }

    /// Reads each running job's progress; a finished job's ledger is read and its processes
    /// stopped.
    async fn progress(&mut self) {
        let names: Vec<String> = self.admins.keys().cloned().collect();
        for name in names {
            let Some(a) = self.admins.get(&name) else {
                continue;
            };
            let Ok(Ok(st)) = tokio::time::timeout(CALL, a.status()).await else {
                continue;
            };
            let active = st
                .workers
                .iter()
                .filter(|w| w.state == WorkerState::Active && !w.draining)
                .count() as u32;
            let overhead = self.cluster.resize_overhead;
            let steady = self
                .polled
                .insert(name.clone(), (st.samples_done, Instant::now(), active));
            if let Some(j) = self.saved.job_mut(&name) {
                // Its throughput at a size it held since the last poll (not growing).
                if let Some((before, at, was)) = steady
                    && was == active
                    && j.growing.is_none()
                    && active == j.alloc
                {
                    j.measured(
                        active,
                        st.samples_done.saturating_sub(before),
                        at.elapsed().as_secs_f64(),
                    );
                }
                j.samples = (st.samples_done, st.samples_total);
                // A growth is done once the new workers train: its cost rate-limits the
                // job's next resize.
                if let Some((since, target)) = j.growing
                    && active >= target
                {
                    let cost = now_ms().saturating_sub(since);
                    j.resize_cost_ms = Some(cost);
                    j.resize_after_ms = j
                        .resize_after_ms
                        .max(since + (cost as f64 / overhead) as u64);
                    j.growing = None;
                }
            }
            if st.finished {
                let ledger = self.ledger(&name).await;
                if let Some(j) = self.saved.job_mut(&name) {
                    j.ledger = ledger.as_ref().ok().copied();
                }
                let msg = match ledger {
                    Ok(_) => String::new(),
                    Err(e) => format!("trained, but its ledger could not be read: {e:#}"),
                };
                self.end_job(&name, State::Finished, msg).await;
            }
        }
    }

    /// The finished job's ledger summed over epochs: (applied, duplicates, missing).
    async fn ledger(&self, name: &str) -> anyhow::Result<(u64, u64, u64)> {
        let identity = self.identity_in(name)?;
        let coordinator = self
            .saved
            .job(name)
            .and_then(|j| j.coordinator.clone())
            .context("no coordinator")?;
        let (status, ledgers, samples) = tokio::time::timeout(CALL * 4, async {
            let admin =
                Admin::connect(&coordinator, &identity, TransportSettings::default()).await?;
            let samples = admin.job().await?.train_samples;
            anyhow::Ok((admin.status().await?, admin.ledgers().await?, samples))
        })
        .await
        .context("timed out")??;
        Ok(status
            .epochs
            .iter()
            .map(|e| edl_ps::ledger::worst_case(&ledgers, e.epoch, samples))
            .fold((0, 0, 0), |(a, d, m), e| {
                (a + e.applied, d + e.duplicates, m + e.missing)
            }))
    }

    /// Ends a job: stops its processes, frees its slots, records why.
    async fn end_job(&mut self, name: &str, state: State, message: String) {
        self.admins.remove(name);
        self.failures.remove(name);
        self.polled.remove(name);
        if let Some(i) = self.saved.jobs.iter().position(|j| j.name == name) {
            self.policy.forget(i);
        }
        self.placer.stop_job(name).await;
        for p in self.procs_of(name) {
            self.forget_proc(name, &p.name);
        }
        let Some(j) = self.saved.job_mut(name) else {
            return;
        };
        j.state = state;
        j.alloc = 0;
        j.end_ms = Some(now_ms());
        j.coordinator = None;
        j.message = message.clone();
        let event = match state {
            State::Finished => "finish",
            State::Failed => "fail",
            _ => "cancel",
        };
        self.log(name, event, None, None, None);
        if message.is_empty() {
            tracing::info!(job = name, "{event}");
        } else {
            tracing::info!(job = name, "{event}: {message}");
        }
    }

    /// Asks the policy for every job's size and carries out the changes.
    async fn allocate(&mut self) {
        let now = now_ms();
        let live: Vec<usize> = (0..self.saved.jobs.len())
            .filter(|&i| !self.saved.jobs[i].state.is_over())
            .collect();
        if live.is_empty() {
            return;
        }
        let views: Vec<JobView> = live
            .iter()
            .map(|&i| {
                let j = &self.saved.jobs[i];
                JobView {
                    id: i,
                    speed: Arc::new(j.speed(&self.typical)),
                    submit: j.submit_ms as f64 / 1000.0,
                    requested: j.workers,
                    min: j.min_workers,
                    max: j.max_workers,
                    alloc: j.alloc,
                    attained: j.attained_s,
                    resize_after: j.resize_after_ms as f64 / 1000.0,
                    priority: j.priority,
                }
            })
            .collect();
        let sizes =
            self.policy
                .allocate(now as f64 / 1000.0, self.cluster.slots.len() as u32, &views);
        for (k, &i) in live.iter().enumerate() {
            let name = self.saved.jobs[i].name.clone();
            let (old, state) = (self.saved.jobs[i].alloc, self.saved.jobs[i].state);
            let new = sizes[k];
            if new == old {
                if state == State::Running && self.rescale.contains_key(&name) {
                    self.replace_failed(&name, new).await;
                }
                continue;
            }
            self.rescale.remove(&name);
            if state == State::Queued {
                if new == 0 {
                    continue;
                }
                if let Err(e) = self.start_job(&name).await {
                    self.end_job(&name, State::Failed, format!("cannot start: {e:#}"))
                        .await;
                    continue;
                }
            }
            let Some(admin) = self.admins.get(&name) else {
                continue;
            };
            match tokio::time::timeout(CALL, admin.scale(new)).await {
                Ok(Ok(_)) => {
                    let interval = self.cluster.resize_interval.as_millis() as u64;
                    let j = &mut self.saved.jobs[i];
                    if state == State::Running && new != old {
                        j.resizes += 1;
                    }
                    j.alloc = new;
                    j.resize_after_ms = now_ms() + interval;
                    j.growing = (new > old).then_some((now_ms(), new));
                    let event = if state == State::Queued {
                        "start"
                    } else {
                        "resize"
                    };
                    self.log(&name, event, None, None, Some(new));
                    tracing::info!(job = %name, from = old, to = new, "{event}");
                }
                Ok(Err(e)) => tracing::warn!(job = %name, error = %e, "cannot resize"),
                Err(_) => tracing::warn!(job = %name, "the resize request timed out"),
            }
        }
    }

    /// Asks job `name`'s coordinator for `size` workers again after a worker failed: done
    /// once it places one (the dead worker no longer counts) or [`RESCALE_FOR`] has passed.
    async fn replace_failed(&mut self, name: &str, size: u32) {
        let Some(admin) = self.admins.get(name) else {
            self.rescale.remove(name);
            return;
        };
        let placed = match tokio::time::timeout(CALL, admin.scale(size)).await {
            Ok(Ok(r)) => !r.placed.is_empty(),
            _ => false,
        };
        let expired = self.rescale.get(name).is_none_or(|d| Instant::now() >= *d);
        if placed || expired {
            self.rescale.remove(name);
        }
        if placed {
            tracing::info!(job = %name, workers = size, "a failed worker is being replaced");
        }
    }

    /// Issues the job's certificates and starts its servers; connects to its coordinator.
    async fn start_job(&mut self, name: &str) -> anyhow::Result<()> {
        let l = self.launch(name)?;
        let pki = l.pki();
        std::fs::create_dir_all(&pki).with_context(|| format!("creating {}", pki.display()))?;
        std::fs::copy(self.pki.ca_cert(), pki.join("ca.pem"))
            .with_context(|| format!("copying the CA certificate into {}", pki.display()))?;
        let owner = self
            .saved
            .job(name)
            .map(|j| j.owner.clone())
            .unwrap_or_default();
        let mut nodes = vec![
            (Role::Coordinator, "coordinator".to_string()),
            (Role::Admin, SCHED_NAME.to_string()),
            (Role::Admin, owner),
        ];
        nodes.extend((0..l.shards).map(|i| (Role::Shard, format!("s{i}"))));
        for (role, n) in nodes {
            let c = l.creds(role, &n);
            self.pki
                .issue_to(role, &n, name, &[], &c.cert, &c.key)
                .with_context(|| format!("issuing {role}/{n} of job {name}"))?;
        }
        let (addr, procs) = self.placer.start_servers(&l).await?;
        if let Some(j) = self.saved.job_mut(name) {
            j.state = State::Running;
            j.start_ms = Some(now_ms());
            j.coordinator = Some(addr.to_string());
            j.procs = procs;
        }
        let admin = self.connect(name, &addr.to_string()).await?;
        let deadline = Instant::now() + SHARDS_JOIN;
        loop {
            let st = tokio::time::timeout(CALL, admin.status()).await;
            if let Ok(Ok(st)) = st
                && st.shards_joined >= st.shards_expected
            {
                break;
            }
            let exited = self.placer.exited().await;
            self.exits.extend(exited);
            if let Some(e) = self.exits.iter().find(|e| e.job == name) {
                anyhow::bail!("{} {}", e.name, e.what);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the shards did not join within {} s; see {}",
                SHARDS_JOIN.as_secs(),
                l.logs().display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.admins.insert(name.to_string(), admin);
        Ok(())
    }

    /// Starts a worker in a free slot for every pending placement of every running job.
    async fn place(&mut self) {
        let names: Vec<String> = self.admins.keys().cloned().collect();
        for name in names {
            let Some(a) = self.admins.get(&name) else {
                continue;
            };
            let Ok(Ok(placements)) = tokio::time::timeout(CALL, a.placements()).await else {
                continue;
            };
            for p in placements {
                let worker = format!("p{}", p.id);
                let started = self
                    .saved
                    .job(&name)
                    .is_some_and(|j| j.procs.iter().any(|q| q.name == worker));
                if p.state == PlacementState::Cancelled && started {
                    // Shrunk before its worker registered: the worker is not wanted.
                    if self.stopping.insert((name.clone(), worker.clone())) {
                        tracing::info!(job = %name, worker, "placement cancelled; stopping");
                        self.placer.stop_worker(&name, &worker).await;
                    }
                    continue;
                }
                if p.state != PlacementState::Pending || started {
                    continue;
                }
                let Some(slot) = self.free_slot(p.slot.as_deref()) else {
                    continue;
                };
                if let Err(e) = self.start_worker(&name, &worker, &slot, p.id).await {
                    tracing::warn!(job = %name, worker, error = %format!("{e:#}"), "cannot start");
                    if let Some(a) = self.admins.get(&name) {
                        let _ =
                            tokio::time::timeout(CALL, a.placement_failed(p.id, &format!("{e:#}")))
                                .await;
                    }
                }
            }
        }
    }

    fn free_slot(&self, want: Option<&str>) -> Option<Slot> {
        self.cluster
            .slots
            .iter()
            .filter(|s| want.is_none_or(|w| w == s.name))
            .find(|s| self.holder(&s.name).is_none())
            .cloned()
    }

    async fn start_worker(
        &mut self,
        job: &str,
        worker: &str,
        slot: &Slot,
        id: u64,
    ) -> anyhow::Result<()> {
        let l = self.launch(job)?;
        let c = l.creds(Role::Worker, worker);
        self.pki
            .issue_to(Role::Worker, worker, job, &[], &c.cert, &c.key)
            .with_context(|| format!("issuing worker/{worker} of job {job}"))?;
        let coordinator: SocketAddr = self
            .saved
            .job(job)
            .and_then(|j| j.coordinator.as_deref())
            .context("the job has no coordinator")?
            .parse()
            .context("the coordinator's address")?;
        let rec: ProcRecord = self
            .placer
            .start_worker(&l, &coordinator, worker, slot, Some(id))
            .await?;
        self.log(job, "take", Some(&slot.name), Some(worker), None);
        tracing::info!(job, worker, slot = %slot.name, placement = id, "started a worker");
        if let Some(j) = self.saved.job_mut(job) {
            j.procs.push(rec);
        }
        Ok(())
    }
}

/// The scheduler's state on its own disk, `STATE_DIR/sched.json`: written atomically (a
/// temporary file, fsynced, renamed, the directory fsynced), through the same loop as an
/// elected scheduler's etcd, so that a write that fails is retried and holds up the answers.
struct JsonFile(PathBuf);

impl MetaStore for JsonFile {
    fn write(
        &self,
        record: Arc<[u8]>,
    ) -> edl_shared::transport::BoxFuture<'_, Result<(), StoreError>> {
        let path = self.0.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || edl_shared::pki::write_atomic(&path, &record))
                .await
                .map_err(|e| StoreError::Unavailable(format!("the write did not finish: {e}")))?
                .map_err(|e| StoreError::Unavailable(e.to_string()))
        })
    }

    fn describe(&self) -> String {
        self.0.display().to_string()
    }
}
