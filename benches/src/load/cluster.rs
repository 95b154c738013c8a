//! The cluster `edl-bench load` measures: a coordinator and shard servers started as separate
//! `edl-ps` processes on loopback, as a real deployment runs them (and as `edl-local` does,
//! with its process handling from [`edl_launch::procs`]), so that each server's memory can be
//! read from `/proc` and nothing the load generator does shares their runtime.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use edl_deploy::local::fresh_state_dir;
use edl_launch::procs::{Proc, Spawn, Stopped};
use edl_shared::pki::PkiDir;
use edl_shared::transport::TransportSettings;
use edl_shared::{Identity, Role};
use edl_worker::ClientConfig;
use serde::Serialize;

/// How long a server may take to start listening.
const START_LIMIT: Duration = Duration::from_secs(30);
/// How often a starting server's address file is looked for.
const START_POLL: Duration = Duration::from_millis(10);
/// How long a server gets to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// The coordinator's certificate name (the one `edl-ps coordinator` loads).
const COORDINATOR: &str = "coordinator";

/// Starts a program with its pid written to a file first. The shell `exec`s the program, so
/// the pid is the server's own: what `/proc/PID/status` is read for, and what [`Proc`] signals.
/// `$0` is the pid file and `$@` the command line, so nothing is quoted by hand.
const WITH_PID_FILE: &str = "echo $$ > \"$0\" && exec \"$@\"";

/// What the servers run.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Shard servers.
    pub shards: u32,
    /// Floats of the counter tensor.
    pub floats: u32,
    /// Where `edl-ps` is; `None` means next to the running executable.
    pub bin_dir: Option<PathBuf>,
}

/// One server process and what it is.
#[derive(Debug)]
struct Server {
    proc: Proc,
    pid: u32,
    addr: SocketAddr,
    rss_start_kib: u64,
}

/// A running cluster: its state directory (certificates, logs, the servers' state) and its
/// processes, coordinator first.
#[derive(Debug)]
pub struct Cluster {
    state_dir: PathBuf,
    pki: PkiDir,
    servers: Vec<Server>,
}

/// The memory of one server process, in KiB as the kernel counts it.
#[derive(Clone, Debug, Serialize)]
pub struct ServerMemory {
    /// `coordinator`, `s0`, `s1`, ...
    pub name: String,
    /// Its process id.
    pub pid: u32,
    /// Resident set once the cluster was up, before any load.
    pub rss_start_kib: u64,
    /// The peak resident set over the whole run (`VmHWM`).
    pub rss_peak_kib: u64,
    /// Resident set at the end of the run, before the servers were stopped.
    pub rss_end_kib: u64,
    /// How the process ended, when that was not a clean exit on SIGTERM.
    pub problem: Option<String>,
}

impl Cluster {
    /// Starts the coordinator of a counter job under ASP, then the shards, each once the one
    /// before is listening; the shard map forms when the last joins. Certificates for the
    /// servers are issued first; clients get theirs from [`Cluster::identity`].
    pub async fn start(spec: &Spec) -> anyhow::Result<Cluster> {
        let ps = locate_ps(spec.bin_dir.as_deref())?;
        let state_dir = fresh_state_dir(&std::env::temp_dir())?;
        let logs = state_dir.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let pki = PkiDir::new(&state_dir);
        pki.init_ca().context("creating the cluster CA")?;
        pki.ensure(Role::Coordinator, COORDINATOR)
            .context("issuing the coordinator's certificate")?;
        let mut cluster = Cluster {
            state_dir,
            pki,
            servers: Vec::new(),
        };
        let floats = spec.floats.to_string();
        let shards = spec.shards.to_string();
        let coordinator = cluster
            .spawn(
                &ps,
                COORDINATOR,
                &[
                    "coordinator",
                    "--listen",
                    "127.0.0.1:0",
                    "--shards",
                    &shards,
                    "--counter",
                    &floats,
                    "--consistency",
                    "asp",
                ],
            )
            .await?;
        let coordinator = coordinator.to_string();
        for i in 0..spec.shards {
            let name = format!("s{i}");
            cluster
                .pki
                .ensure(Role::Shard, &name)
                .with_context(|| format!("issuing the certificate of shard/{name}"))?;
            cluster
                .spawn(
                    &ps,
                    &name,
                    &[
                        "shard",
                        "--listen",
                        "127.0.0.1:0",
                        "--coordinator",
                        &coordinator,
                        "--name",
                        &name,
                    ],
                )
                .await?;
        }
        for s in &mut cluster.servers {
            s.rss_start_kib = proc_status_kib(s.pid, "VmRSS").unwrap_or(0);
        }
        Ok(cluster)
    }

    /// Starts `edl-ps ARGS` as `name` with its state, certificates and address file in the
    /// state directory, and waits until it listens.
    async fn spawn(&mut self, ps: &Path, name: &str, args: &[&str]) -> anyhow::Result<SocketAddr> {
        let addr_file = self.state_dir.join(format!("{name}.addr"));
        let pid_file = self.state_dir.join(format!("{name}.pid"));
        let mut argv: Vec<OsString> = vec![
            "-c".into(),
            WITH_PID_FILE.into(),
            pid_file.clone().into(),
            ps.into(),
        ];
        argv.extend(args.iter().map(OsString::from));
        argv.extend([
            "--state-dir".into(),
            self.state_dir.clone().into(),
            "--addr-file".into(),
            addr_file.clone().into(),
        ]);
        let mut proc = Proc::spawn(Spawn {
            name: name.to_string(),
            program: "/bin/sh".into(),
            args: argv,
            log: self.state_dir.join("logs").join(format!("{name}.log")),
            ..Spawn::default()
        })?;
        // The pid is written before the server starts, so it is there once the address is.
        let addr = proc
            .wait_for_addr(&addr_file, START_LIMIT, START_POLL)
            .await?;
        let pid = std::fs::read_to_string(&pid_file)
            .with_context(|| format!("reading {}", pid_file.display()))?
            .trim()
            .parse()
            .with_context(|| format!("{} holds no pid", pid_file.display()))?;
        self.servers.push(Server {
            proc,
            pid,
            addr,
            rss_start_kib: 0,
        });
        Ok(addr)
    }

    /// The state directory (certificates, logs, the servers' state).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The coordinator's address.
    pub fn coordinator(&self) -> anyhow::Result<SocketAddr> {
        self.servers
            .first()
            .map(|s| s.addr)
            .ok_or_else(|| anyhow!("the cluster has no coordinator"))
    }

    /// Every server's address, coordinator first.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.servers.iter().map(|s| s.addr).collect()
    }

    /// The identity of `role/name`, issued by the cluster CA on first use.
    pub fn identity(&self, role: Role, name: &str) -> anyhow::Result<Identity> {
        self.pki
            .ensure(role, name)
            .with_context(|| format!("issuing the certificate of {role}/{name}"))
    }

    /// How a worker named `name` reaches the job.
    pub fn client_config(
        &self,
        name: &str,
        settings: &TransportSettings,
    ) -> anyhow::Result<ClientConfig> {
        Ok(ClientConfig {
            coordinator: self.coordinator()?.to_string(),
            identity: self.identity(Role::Worker, name)?,
            settings: settings.clone(),
        })
    }

    /// Fails, quoting its log, if a server has exited: the run's figures would mean nothing.
    pub fn check(&mut self) -> anyhow::Result<()> {
        for s in &mut self.servers {
            if let Some(status) = s.proc.try_exit()? {
                bail!("{}", s.proc.failure("exited during the run", status));
            }
        }
        Ok(())
    }

    /// Reads every server's memory, then stops them: shards first, then the coordinator.
    pub async fn stop(mut self) -> Vec<ServerMemory> {
        let mut out: Vec<ServerMemory> = self
            .servers
            .iter()
            .map(|s| ServerMemory {
                name: s.proc.name().to_string(),
                pid: s.pid,
                rss_start_kib: s.rss_start_kib,
                rss_peak_kib: proc_status_kib(s.pid, "VmHWM").unwrap_or(0),
                rss_end_kib: proc_status_kib(s.pid, "VmRSS").unwrap_or(0),
                problem: None,
            })
            .collect();
        for (s, mem) in self.servers.iter_mut().zip(&mut out).rev() {
            mem.problem = match s.proc.terminate(STOP_GRACE).await {
                Ok(Stopped::OnTerm(st)) if st.success() => None,
                Ok(Stopped::OnTerm(st)) => Some(format!("exited with {st} on SIGTERM")),
                Ok(Stopped::Before(st)) => Some(format!("had already exited with {st}")),
                Ok(Stopped::Killed) => Some("ignored SIGTERM and was killed".into()),
                Err(e) => Some(format!("{e:#}")),
            };
        }
        out
    }
}

/// Finds `edl-ps` in `dir`, or next to the running executable.
pub(crate) fn locate_ps(dir: Option<&Path>) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the running executable")?;
    let dir = dir.or(exe.parent()).context("edl-bench has no directory")?;
    let ps = dir.join("edl-ps");
    anyhow::ensure!(
        ps.is_file(),
        "edl-ps not found in {}: build it with `cargo build --release -p edl-ps` or pass \
         --bin-dir",
        dir.display()
    );
    Ok(ps)
}

/// A `kB` field of `/proc/PID/status` (`VmRSS`, `VmHWM`), in KiB; `None` once the process is
/// gone.
fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| {
        l.strip_prefix(field)?
            .strip_prefix(':')?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_memory_is_read() {
        let me = std::process::id();
        let rss = proc_status_kib(me, "VmRSS").expect("VmRSS");
        let peak = proc_status_kib(me, "VmHWM").expect("VmHWM");
        assert!(rss > 0 && peak >= rss, "rss {rss} peak {peak}");
        assert_eq!(proc_status_kib(me, "NoSuchField"), None);
    }
}
