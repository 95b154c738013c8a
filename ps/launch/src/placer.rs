//! The seam between a launcher and where processes run. A launcher (the cluster scheduler
//! `edl-sched`, the tests) decides which job gets how many slots, issues the certificates and
//! resizes jobs through their coordinators; a [`Placer`] starts and stops the processes:
//! [`LocalPlacer`] on this machine, `edl-sched`'s Kubernetes placer as pods. Workers run what
//! their job file's `[worker]` table says ([`crate::launch::worker_spawn`]), with the process
//! contract's environment ([`edl_shared::contract`]).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use edl_shared::Role;
use edl_shared::contract::WorkerEnv;
use edl_shared::jobfile::WorkerSpec;
use edl_shared::proto::StragglerSettings;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::launch::{self, Binaries, Creds, WorkerLaunch};
use crate::procs::{Proc, Spawn, Stopped};

/// How long a coordinator may take to write its address.
const COORDINATOR_START: Duration = Duration::from_secs(30);
/// How often the address file is looked for.
const ADDR_CHECK: Duration = Duration::from_millis(5);
/// How long a process gets after SIGTERM before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(5);
/// The host name of slots on the launcher's own machine.
pub const LOCAL_HOST: &str = "localhost";

/// A worker slot: a GPU, or a CPU stand-in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Its name, unique in the cluster.
    pub name: String,
    /// The host it is on.
    pub host: String,
    /// The devices it stands for (`CUDA_VISIBLE_DEVICES` of its worker); `None` for a CPU
    /// stand-in.
    pub devices: Option<Vec<u32>>,
}

/// A process a placer started for a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcRecord {
    /// Its name in the job (`coordinator`, `s0`, `p3`).
    pub name: String,
    /// Its process id (to take it back after a launcher restart); 0 for a pod.
    pub pid: u32,
    /// The slot a worker holds; servers hold none.
    pub slot: Option<String>,
}

/// What a placer needs to know of a job.
#[derive(Clone, Debug)]
pub struct JobLaunch {
    /// The job's name (its certificates' job).
    pub name: String,
    /// Its directory: state, logs, certificates (`pki/`), the job file.
    pub dir: PathBuf,
    /// Shard servers.
    pub shards: u32,
    /// What its workers run.
    pub worker: WorkerSpec,
    /// The folder of the job file as submitted: a worker command's working directory.
    pub workdir: PathBuf,
}

impl JobLaunch {
    /// The job file the coordinator reads.
    pub fn job_file(&self) -> PathBuf {
        self.dir.join("job.toml")
    }

    /// The job's certificate directory.
    pub fn pki(&self) -> PathBuf {
        self.dir.join("pki")
    }

    /// The credential files of `role/name` in the job's certificate directory (the layout
    /// of a state directory's PKI).
    pub fn creds(&self, role: Role, name: &str) -> Creds {
        Creds::in_dir(&self.dir, role, name)
    }

    /// The log directory.
    pub fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }

    /// The contract's environment of worker `name` in `slot` for `placement`, reaching the
    /// coordinator at `coordinator`, with its certificate from the job's directory.
    pub fn worker_env(
        &self,
        coordinator: String,
        name: &str,
        slot: &Slot,
        placement: u64,
    ) -> WorkerEnv {
        WorkerEnv {
            coordinators: vec![coordinator],
            credentials: self.creds(Role::Worker, name).contract(),
            job: self.name.clone(),
            name: name.to_string(),
            placement: Some(placement),
            devices: slot.devices.clone(),
        }
    }
}

/// A process that ended.
#[derive(Clone, Debug)]
pub struct Exit {
    /// Its job.
    pub job: String,
    /// Its name in the job.
    pub name: String,
    /// Whether it exited with success.
    pub ok: bool,
    /// What happened, with its log's tail when it failed.
    pub what: String,
}

/// Starts and stops a job's processes.
pub trait Placer: Send {
    /// Starts the coordinator and the shard servers of `job`; returns the coordinator's
    /// address and the processes started.
    fn start_servers(
        &mut self,
        job: &JobLaunch,
    ) -> impl Future<Output = anyhow::Result<(SocketAddr, Vec<ProcRecord>)>> + Send;

    /// Starts worker `name` of `job` (at `coordinator`) in `slot` for placement `placement`,
    /// running what the job's `[worker]` table says; returns once it is started (or, for a
    /// pod, created).
    fn start_worker(
        &mut self,
        job: &JobLaunch,
        coordinator: &SocketAddr,
        name: &str,
        slot: &Slot,
        placement: u64,
    ) -> impl Future<Output = anyhow::Result<ProcRecord>> + Send;

    /// Asks worker `name` of `job` to leave (SIGTERM: it finishes its step, or, not admitted
    /// yet, simply ends); it is reported by [`Placer::exited`] once gone.
    fn stop_worker(&mut self, job: &str, name: &str) -> impl Future<Output = ()> + Send;

    /// The processes that ended since the last call.
    fn exited(&mut self) -> impl Future<Output = Vec<Exit>> + Send;

    /// Stops every process of `job` (SIGTERM, then SIGKILL after a grace period).
    fn stop_job(&mut self, job: &str) -> impl Future<Output = ()> + Send;

    /// Takes back the processes of `job` that an earlier launcher started; returns the
    /// names of those no longer running.
    fn adopt(
        &mut self,
        job: &str,
        procs: &[ProcRecord],
    ) -> impl Future<Output = Vec<String>> + Send;

    /// Lets every process run on after the launcher exits.
    fn detach_all(&mut self);
}

/// A process of a local job: started by this scheduler, or by an earlier one.
#[derive(Debug)]
enum Handle {
    Child(Box<Proc>),
    Adopted { pid: i32, name: String },
}

#[derive(Debug)]
struct Local {
    job: String,
    name: String,
    handle: Handle,
}

/// Whether `pid` still runs process `name` of `job`: `edl-ps` or `edl-worker`, or a worker
/// program started with the contract's `EDL_JOB` and `EDL_NAME` (a pid reused by another
/// program does not count).
fn alive(pid: i32, job: &str, name: &str) -> bool {
    use edl_shared::contract;
    if kill(Pid::from_raw(pid), None).is_err() {
        return false;
    }
    // edl-worker too: one an earlier scheduler started before workers got the contract's
    // environment.
    let server = std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
        let c = String::from_utf8_lossy(&c);
        c.contains("edl-ps") || c.contains("edl-worker")
    });
    let markers = [
        format!("{}={job}", contract::JOB),
        format!("{}={name}", contract::NAME),
    ];
    server
        || std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| {
            markers
                .iter()
                .all(|m| e.split(|&b| b == 0).any(|var| var == m.as_bytes()))
        })
}

/// Runs jobs as processes on this machine.
#[derive(Debug)]
pub struct LocalPlacer {
    bins: Binaries,
    data_dir: PathBuf,
    worker_args: Vec<std::ffi::OsString>,
    stragglers: StragglerSettings,
    procs: Vec<Local>,
}

impl LocalPlacer {
    /// A placer starting `bins`; `edl-worker` workers read `data_dir` unless their job names
    /// its data, and get `worker_args` on top.
    pub fn new(bins: Binaries, data_dir: PathBuf, worker_args: Vec<String>) -> LocalPlacer {
        LocalPlacer {
            bins,
            data_dir,
            worker_args: worker_args.into_iter().map(Into::into).collect(),
            // Stragglers are the scheduler's concern only through slots: flag, never act.
            stragglers: StragglerSettings::default(),
            procs: Vec::new(),
        }
    }

    fn spawn(&mut self, job: &JobLaunch, name: &str, spawn: Spawn) -> anyhow::Result<u32> {
        let proc = Proc::spawn(spawn)?;
        let pid = proc
            .pid()
            .with_context(|| format!("{name} exited at once"))?;
        self.procs.push(Local {
            job: job.name.clone(),
            name: name.to_string(),
            handle: Handle::Child(Box::new(proc)),
        });
        Ok(pid)
    }
}

fn log_of(job: &JobLaunch, name: &str) -> PathBuf {
    job.logs().join(format!("{name}.log"))
}

impl Placer for LocalPlacer {
    async fn start_servers(
        &mut self,
        job: &JobLaunch,
    ) -> anyhow::Result<(SocketAddr, Vec<ProcRecord>)> {
        std::fs::create_dir_all(job.logs())
            .with_context(|| format!("creating {}", job.logs().display()))?;
        let addr_file = job.dir.join("coordinator.addr");
        launch::remove_stale(&addr_file)?;
        let mut args = launch::coordinator_args(
            &job.dir,
            &addr_file,
            job.shards,
            &self.stragglers,
            Some(&job.creds(Role::Coordinator, "coordinator")),
        );
        args.extend(["--job".into(), job.job_file().into_os_string()]);
        let pid = self.spawn(
            job,
            "coordinator",
            Spawn {
                name: format!("{}/coordinator", job.name),
                program: self.bins.ps.clone(),
                args,
                log: log_of(job, "coordinator"),
                ..Spawn::default()
            },
        )?;
        let mut records = vec![ProcRecord {
            name: "coordinator".into(),
            pid,
            slot: None,
        }];
        let Some(Local {
            handle: Handle::Child(proc),
            ..
        }) = self.procs.last_mut()
        else {
            anyhow::bail!("the coordinator's handle is gone");
        };
        let addr = proc
            .wait_for_addr(&addr_file, COORDINATOR_START, ADDR_CHECK)
            .await?;
        for i in 0..job.shards {
            let name = format!("s{i}");
            let addr_file = job.dir.join(format!("{name}.addr"));
            launch::remove_stale(&addr_file)?;
            let args = launch::shard_args(
                &addr,
                &name,
                "127.0.0.1:0",
                &job.dir,
                &addr_file,
                Some(&job.creds(Role::Shard, &name)),
            );
            let pid = self.spawn(
                job,
                &name,
                Spawn {
                    name: format!("{}/{name}", job.name),
                    program: self.bins.ps.clone(),
                    args,
                    log: log_of(job, &name),
                    ..Spawn::default()
                },
            )?;
            records.push(ProcRecord {
                name,
                pid,
                slot: None,
            });
        }
        Ok((addr, records))
    }

    async fn start_worker(
        &mut self,
        job: &JobLaunch,
        coordinator: &SocketAddr,
        name: &str,
        slot: &Slot,
        placement: u64,
    ) -> anyhow::Result<ProcRecord> {
        let w = WorkerLaunch {
            spec: &job.worker,
            workdir: &job.workdir,
            env: job.worker_env(coordinator.to_string(), name, slot, placement),
            data_dir: &self.data_dir,
            state_dir: &job.dir,
            worker_args: &self.worker_args,
        };
        let spawn = launch::worker_spawn(
            &self.bins,
            &w,
            format!("{}/{name}", job.name),
            log_of(job, name),
        );
        let pid = self.spawn(job, name, spawn)?;
        Ok(ProcRecord {
            name: name.to_string(),
            pid,
            slot: Some(slot.name.clone()),
        })
    }

    async fn stop_worker(&mut self, job: &str, name: &str) {
        let Some(p) = self
            .procs
            .iter_mut()
            .find(|p| p.job == job && p.name == name)
        else {
            return;
        };
        let sent = match &mut p.handle {
            Handle::Child(proc) => proc.signal(Signal::SIGTERM).map_err(|e| format!("{e:#}")),
            Handle::Adopted { pid, .. } => kill(Pid::from_raw(*pid), Signal::SIGTERM)
                .map(|()| true)
                .map_err(|e| e.to_string()),
        };
        if let Err(e) = sent {
            tracing::warn!(job, name, error = %e, "cannot stop a worker");
        }
    }

    async fn exited(&mut self) -> Vec<Exit> {
        let mut out = Vec::new();
        self.procs.retain_mut(|p| {
            let ended = match &mut p.handle {
                Handle::Child(proc) => match proc.try_exit() {
                    Ok(Some(status)) if status.success() => Some((true, "exited".to_string())),
                    Ok(Some(status)) => Some((false, proc.failure("exited", status))),
                    Ok(None) => None,
                    Err(e) => Some((false, format!("{e:#}"))),
                },
                Handle::Adopted { pid, name } => (!alive(*pid, &p.job, name))
                    .then(|| (true, "exited (status unknown: adopted)".into())),
            };
            match ended {
                Some((ok, what)) => {
                    out.push(Exit {
                        job: p.job.clone(),
                        name: p.name.clone(),
                        ok,
                        what,
                    });
                    false
                }
                None => true,
            }
        });
        out
    }

    async fn stop_job(&mut self, job: &str) {
        let (mine, rest): (Vec<Local>, Vec<Local>) = std::mem::take(&mut self.procs)
            .into_iter()
            .partition(|p| p.job == job);
        self.procs = rest;
        // Workers first, then shards, then the coordinator: the reverse of starting.
        for mut p in mine.into_iter().rev() {
            match &mut p.handle {
                Handle::Child(proc) => match proc.terminate(STOP_GRACE).await {
                    Ok(Stopped::Killed) => {
                        tracing::warn!(job, name = %p.name, "did not stop on SIGTERM; killed")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(job, name = %p.name, error = %e, "cannot stop"),
                },
                Handle::Adopted { pid, name } => {
                    let pid = *pid;
                    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
                    let deadline = tokio::time::Instant::now() + STOP_GRACE;
                    while alive(pid, job, name) && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    if alive(pid, job, name) {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
            }
        }
    }

    async fn adopt(&mut self, job: &str, procs: &[ProcRecord]) -> Vec<String> {
        let mut gone = Vec::new();
        for p in procs {
            match i32::try_from(p.pid) {
                Ok(pid) if alive(pid, job, &p.name) => self.procs.push(Local {
                    job: job.to_string(),
                    name: p.name.clone(),
                    handle: Handle::Adopted {
                        pid,
                        name: p.name.clone(),
                    },
                }),
                _ => gone.push(p.name.clone()),
            }
        }
        gone
    }

    fn detach_all(&mut self) {
        for p in self.procs.drain(..) {
            if let Handle::Child(proc) = p.handle {
                (*proc).detach();
            }
        }
    }
}
