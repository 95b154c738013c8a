//! The seam between a launcher and where processes run. A launcher (the cluster scheduler
//! `edl-sched`, the tests) decides which job gets how many slots, issues the certificates and
//! resizes jobs through their coordinators; a [`Placer`] starts and stops the processes:
//! [`LocalPlacer`] on this machine, `edl-sched`'s Kubernetes placer as pods. Workers run what
//! their job file's `[worker]` table says ([`crate::launch::worker_spawn`]), with the process
//! contract's environment ([`edl_shared::contract`]).

use std::ffi::OsString;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitStatus;
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

    /// The log file of process `name`.
    pub fn log(&self, name: &str) -> PathBuf {
        self.logs().join(format!("{name}.log"))
    }

    /// The contract's environment of worker `name` in `slot` for `placement`, reaching the
    /// coordinator at `coordinator`, with its certificate from the job's directory.
    pub fn worker_env(
        &self,
        coordinator: String,
        name: &str,
        slot: &Slot,
        placement: Option<u64>,
    ) -> WorkerEnv {
        WorkerEnv {
            coordinators: vec![coordinator],
            credentials: self.creds(Role::Worker, name).contract(),
            job: self.name.clone(),
            name: name.to_string(),
            placement,
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
    /// Its exit status, where the placer knows it (a process it started, not one it adopted,
    /// a pod or a thread).
    pub status: Option<ExitStatus>,
}

/// Starts and stops a job's processes.
pub trait Placer: Send {
    /// Starts the coordinator and the shard servers of `job`; returns the coordinator's
    /// address and the processes started.
    fn start_servers(
        &mut self,
        job: &JobLaunch,
    ) -> impl Future<Output = anyhow::Result<(SocketAddr, Vec<ProcRecord>)>> + Send;

    /// Starts worker `name` of `job` (at `coordinator`) in `slot`, for the coordinator's
    /// placement `placement` if it asked for this worker, running what the job's `[worker]`
    /// table says; returns once it is started (or, for a pod, created).
    fn start_worker(
        &mut self,
        job: &JobLaunch,
        coordinator: &SocketAddr,
        name: &str,
        slot: &Slot,
        placement: Option<u64>,
    ) -> impl Future<Output = anyhow::Result<ProcRecord>> + Send;

    /// Asks worker `name` of `job` to leave (SIGTERM: it finishes its step, or, not admitted
    /// yet, simply ends); it is reported by [`Placer::exited`] once gone.
    fn stop_worker(&mut self, job: &str, name: &str) -> impl Future<Output = ()> + Send;

    /// Sends `signal` to worker `name` of `job`, as the process contract defines them:
    /// SIGTERM drains, SIGUSR1 is a preemption notice, SIGKILL kills, SIGSTOP and SIGCONT
    /// pause and resume. `Ok(false)` when the worker had already exited (or is unknown); an
    /// error when this placer cannot deliver that signal (a pod takes SIGTERM and SIGKILL
    /// only, as deletions).
    fn signal(
        &mut self,
        job: &str,
        name: &str,
        signal: Signal,
    ) -> impl Future<Output = anyhow::Result<bool>> + Send;

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

/// Flags an `edl-worker` worker gets on top of the placer's, by job and worker name.
type WorkerExtras = Box<dyn Fn(&JobLaunch, &str) -> Vec<OsString> + Send + Sync>;

/// Runs jobs as processes on this machine.
pub struct LocalPlacer {
    bins: Binaries,
    data_dir: PathBuf,
    worker_args: Vec<OsString>,
    extras: Option<WorkerExtras>,
    stragglers: StragglerSettings,
    procs: Vec<Local>,
}

impl fmt::Debug for LocalPlacer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalPlacer")
            .field("bins", &self.bins)
            .field("data_dir", &self.data_dir)
            .field("worker_args", &self.worker_args)
            .field("procs", &self.procs)
            .finish_non_exhaustive()
    }
}

impl LocalPlacer {
    /// A placer starting `bins`; `edl-worker` workers read `data_dir` unless their job names
    /// its data, and get `worker_args` on top.
    pub fn new(bins: Binaries, data_dir: PathBuf, worker_args: Vec<String>) -> LocalPlacer {
        LocalPlacer {
            bins,
            data_dir,
            worker_args: worker_args.into_iter().map(Into::into).collect(),
            extras: None,
            // Stragglers are the scheduler's concern only through slots: flag, never act.
            stragglers: StragglerSettings::default(),
            procs: Vec::new(),
        }
    }

    /// Gives each `edl-worker` worker the flags `extras` returns for its job and name, on top
    /// of the placer's (`edl-local`'s per-worker metrics file, preemption notice and
    /// slowdown file). A job's own `[worker]` program gets none.
    pub fn with_worker_extras(
        mut self,
        extras: impl Fn(&JobLaunch, &str) -> Vec<OsString> + Send + Sync + 'static,
    ) -> LocalPlacer {
        self.extras = Some(Box::new(extras));
        self
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
                log: job.log("coordinator"),
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
                    log: job.log(&name),
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
        placement: Option<u64>,
    ) -> anyhow::Result<ProcRecord> {
        let mut worker_args = self.worker_args.clone();
        if let Some(extras) = &self.extras {
            worker_args.extend(extras(job, name));
        }
        let w = WorkerLaunch {
            spec: &job.worker,
            workdir: &job.workdir,
            env: job.worker_env(coordinator.to_string(), name, slot, placement),
            data_dir: &self.data_dir,
            state_dir: &job.dir,
            worker_args: &worker_args,
        };
        let spawn = launch::worker_spawn(
            &self.bins,
            &w,
            format!("{}/{name}", job.name),
            job.log(name),
        );
        let pid = self.spawn(job, name, spawn)?;
        Ok(ProcRecord {
            name: name.to_string(),
            pid,
            slot: Some(slot.name.clone()),
        })
    }

    async fn stop_worker(&mut self, job: &str, name: &str) {
        if let Err(e) = self.signal(job, name, Signal::SIGTERM).await {
            tracing::warn!(job, name, error = %format!("{e:#}"), "cannot stop a worker");
        }
    }

    async fn signal(&mut self, job: &str, name: &str, signal: Signal) -> anyhow::Result<bool> {
        let Some(p) = self
            .procs
            .iter_mut()
            .find(|p| p.job == job && p.name == name)
        else {
            return Ok(false);
        };
        match &mut p.handle {
            Handle::Child(proc) => proc.signal(signal),
            Handle::Adopted { pid, name } => {
                if !alive(*pid, job, name) {
                    return Ok(false);
                }
                kill(Pid::from_raw(*pid), signal)
                    .with_context(|| format!("sending {signal} to {job}/{name}"))?;
                Ok(true)
            }
        }
    }

    async fn exited(&mut self) -> Vec<Exit> {
        let mut out = Vec::new();
        self.procs.retain_mut(|p| {
            let ended = match &mut p.handle {
                Handle::Child(proc) => match proc.try_exit() {
                    Ok(Some(status)) if status.success() => {
                        Some((true, "exited".to_string(), Some(status)))
                    }
                    Ok(Some(status)) => Some((false, proc.failure("exited", status), Some(status))),
                    Ok(None) => None,
                    Err(e) => Some((false, format!("{e:#}"), None)),
                },
                Handle::Adopted { pid, name } => (!alive(*pid, &p.job, name))
                    .then(|| (true, "exited (status unknown: adopted)".into(), None)),
            };
            match ended {
                Some((ok, what, status)) => {
                    out.push(Exit {
                        job: p.job.clone(),
                        name: p.name.clone(),
                        ok,
                        what,
                        status,
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

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn slot() -> Slot {
        Slot {
            name: "slot0".into(),
            host: LOCAL_HOST.into(),
            devices: None,
        }
    }

    fn job(dir: &std::path::Path, command: &[&str]) -> anyhow::Result<JobLaunch> {
        let job = JobLaunch {
            name: "j1".into(),
            dir: dir.to_path_buf(),
            shards: 0,
            worker: WorkerSpec {
                command: command.iter().map(|s| s.to_string()).collect(),
                ..WorkerSpec::default()
            },
            workdir: dir.to_path_buf(),
        };
        std::fs::create_dir_all(job.logs())?;
        Ok(job)
    }

    fn placer(dir: &std::path::Path) -> LocalPlacer {
        let bins = Binaries {
            ps: "/bin/false".into(),
            worker: dir.join("edl-worker"),
        };
        LocalPlacer::new(bins, dir.to_path_buf(), Vec::new())
    }

    /// The exits of `names`, waited for up to 10 s.
    async fn exits_of(p: &mut LocalPlacer, names: &[&str]) -> Vec<Exit> {
        let mut out: Vec<Exit> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while names.iter().any(|n| !out.iter().any(|e| e.name == *n))
            && tokio::time::Instant::now() < deadline
        {
            out.extend(p.exited().await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    #[tokio::test]
    async fn the_contract_s_signals_reach_a_worker_and_its_exit_status_comes_back()
    -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        // A program that drains on SIGTERM (exits 0) and otherwise runs until killed.
        let job = job(
            dir.path(),
            &[
                "sh",
                "-c",
                "trap 'exit 0' TERM; touch ready-$EDL_NAME; while :; do sleep 0.02; done",
            ],
        )?;
        let mut p = placer(dir.path());
        let coordinator: SocketAddr = "127.0.0.1:9".parse()?;
        let w0 = p
            .start_worker(&job, &coordinator, "w0", &slot(), None)
            .await?;
        p.start_worker(&job, &coordinator, "w1", &slot(), Some(3))
            .await?;
        assert!(w0.pid > 0);
        // Signalled once its trap is set.
        for name in ["w0", "w1"] {
            let ready = dir.path().join(format!("ready-{name}"));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while !ready.exists() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert!(p.signal("j1", "w0", Signal::SIGSTOP).await?);
        assert!(p.signal("j1", "w0", Signal::SIGCONT).await?);
        assert!(p.signal("j1", "w0", Signal::SIGKILL).await?);
        p.stop_worker("j1", "w1").await;
        let exits = exits_of(&mut p, &["w0", "w1"]).await;
        assert_eq!(exits.len(), 2, "{exits:?}");
        let (killed, drained) = (&exits[0], &exits[1]);
        assert!(!killed.ok, "{killed:?}");
        assert_eq!(
            killed.status.and_then(|s| s.signal()),
            Some(9),
            "{killed:?}"
        );
        assert!(drained.ok, "{drained:?}");
        assert_eq!(
            drained.status.and_then(|s| s.code()),
            Some(0),
            "{drained:?}"
        );
        // Gone, or never there: nothing to signal.
        assert!(!p.signal("j1", "w0", Signal::SIGTERM).await?);
        assert!(!p.signal("j1", "nobody", Signal::SIGTERM).await?);
        Ok(())
    }

    #[tokio::test]
    async fn per_worker_extras_go_to_edl_worker_only() -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        // A stand-in edl-worker that writes its arguments beside itself.
        let fake = dir.path().join("edl-worker");
        std::fs::write(
            &fake,
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$(dirname \"$0\")/args-$EDL_NAME\"\n",
        )?;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755))?;
        let mut p = placer(dir.path())
            .with_worker_extras(|job, name| vec![format!("--extra={}/{name}", job.name).into()]);
        let coordinator: SocketAddr = "127.0.0.1:9".parse()?;
        let builtin = job(dir.path(), &[])?;
        p.start_worker(&builtin, &coordinator, "w0", &slot(), Some(1))
            .await?;
        let program = job(
            dir.path(),
            &[
                "sh",
                "-c",
                "printf '%s\\n' \"$@\" > args-$EDL_NAME",
                "sh",
                "given",
            ],
        )?;
        p.start_worker(&program, &coordinator, "w1", &slot(), None)
            .await?;
        let exits = exits_of(&mut p, &["w0", "w1"]).await;
        assert!(exits.len() == 2 && exits.iter().all(|e| e.ok), "{exits:?}");
        let w0 = std::fs::read_to_string(dir.path().join("args-w0"))?;
        let w0: Vec<&str> = w0.lines().collect();
        assert!(w0.contains(&"--extra=j1/w0"), "{w0:?}");
        assert!(w0.windows(2).any(|a| a == ["--placement", "1"]), "{w0:?}");
        let w1 = std::fs::read_to_string(dir.path().join("args-w1"))?;
        assert_eq!(w1, "given\n");
        Ok(())
    }
}
