//! Starting EDL's processes: where the binaries are, and the command lines of a coordinator,
//! a shard server and a worker ([`worker_spawn`]: `edl-worker`, or the program of the job
//! file's `[worker]` table, with the process contract's environment). `edl-local` and the
//! cluster scheduler's placers (`edl-sched`) all start their processes from these.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use edl_shared::contract::{self, Credentials, WorkerEnv};
use edl_shared::jobfile::WorkerSpec;
use edl_shared::proto::StragglerSettings;

use crate::procs::Spawn;

/// The programs a launcher starts.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// `edl-ps` (coordinator and shard servers).
    pub ps: PathBuf,
    /// `edl-worker`.
    pub worker: PathBuf,
}

impl Binaries {
    /// Finds `edl-ps` and `edl-worker` in `dir`, or next to the running executable.
    pub fn locate(dir: Option<&Path>) -> anyhow::Result<Binaries> {
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

/// Removes `file` (an address file left by an earlier run, which must not pass for the new
/// process's); a file that is not there is fine.
pub fn remove_stale(file: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(file) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", file.display())),
    }
}

/// A process's credentials given as files (a job's certificates signed by a cluster CA).
/// Without them a process reads the PKI of its state directory.
#[derive(Clone, Debug)]
pub struct Creds {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The process's certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

fn push_common(args: &mut Vec<OsString>, state_dir: &Path, creds: Option<&Creds>) {
    args.extend(["--state-dir".into(), state_dir.as_os_str().to_owned()]);
    if let Some(c) = creds {
        args.extend([
            "--ca".into(),
            c.ca.as_os_str().to_owned(),
            "--cert".into(),
            c.cert.as_os_str().to_owned(),
            "--key".into(),
            c.key.as_os_str().to_owned(),
        ]);
    }
}

/// The flags that make a process serve `/metrics` on an ephemeral loopback port and write
/// the address to `STATE_DIR/metrics/NAME.addr`.
pub fn metrics_args(state_dir: &Path, name: &str) -> [OsString; 4] {
    [
        "--metrics".into(),
        "127.0.0.1:0".into(),
        "--metrics-file".into(),
        metrics_file(state_dir, name).into_os_string(),
    ]
}

/// Where the process `name` writes its metrics address (see [`metrics_args`]).
pub fn metrics_file(state_dir: &Path, name: &str) -> std::path::PathBuf {
    state_dir.join("metrics").join(format!("{name}.addr"))
}

/// `edl-ps`'s arguments for a coordinator listening on an ephemeral loopback port that writes
/// its address to `addr_file`; the caller appends the job (`--job FILE`, or its flags).
pub fn coordinator_args(
    state_dir: &Path,
    addr_file: &Path,
    shards: u32,
    stragglers: &StragglerSettings,
    creds: Option<&Creds>,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "coordinator".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--addr-file".into(),
        addr_file.as_os_str().to_owned(),
        "--shards".into(),
        shards.to_string().into(),
    ];
    args.extend(
        edl_shared::cli::StragglerArgs::args_for(stragglers)
            .into_iter()
            .map(OsString::from),
    );
    push_common(&mut args, state_dir, creds);
    args
}

/// `edl-ps`'s arguments for the shard server `name` of the job at `coordinator`, listening on
/// `listen` and writing its address to `addr_file`.
pub fn shard_args(
    coordinator: &SocketAddr,
    name: &str,
    listen: &str,
    state_dir: &Path,
    addr_file: &Path,
    creds: Option<&Creds>,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "shard".into(),
        "--listen".into(),
        listen.into(),
        "--coordinator".into(),
        coordinator.to_string().into(),
        "--name".into(),
        name.into(),
        "--addr-file".into(),
        addr_file.as_os_str().to_owned(),
    ];
    push_common(&mut args, state_dir, creds);
    args
}

/// `edl-worker`'s arguments for the worker `name` of the job at `coordinator` (the evaluator
/// with `evaluate`), reading Fashion-MNIST from `data_dir` unless the job names its data.
pub fn worker_args(
    coordinator: &str,
    name: &str,
    data_dir: &Path,
    state_dir: &Path,
    creds: Option<&Creds>,
    evaluate: bool,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    if evaluate {
        args.push("--evaluate".into());
    }
    args.extend([
        "--coordinator".into(),
        coordinator.into(),
        "--name".into(),
        name.into(),
        "--data-dir".into(),
        data_dir.as_os_str().to_owned(),
    ]);
    push_common(&mut args, state_dir, creds);
    args
}

impl Creds {
    /// The credential files of `role/name` in the PKI of the state directory `dir` (where a
    /// launcher issues a job's certificates).
    pub fn in_dir(dir: &Path, role: edl_shared::Role, name: &str) -> Creds {
        let pki = edl_shared::pki::PkiDir::new(dir);
        Creds {
            ca: pki.ca_cert(),
            cert: pki.node_cert(role, name),
            key: pki.node_key(role, name),
        }
    }

    /// The credentials as the process contract gives them.
    pub fn contract(&self) -> Credentials {
        Credentials::Files {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// What a placer knows of one worker it starts.
#[derive(Clone, Debug)]
pub struct WorkerLaunch<'a> {
    /// What the job's workers run.
    pub spec: &'a WorkerSpec,
    /// The job file's folder: a command's working directory.
    pub workdir: &'a Path,
    /// The contract's environment (coordinator, credentials, names, placement, devices).
    pub env: WorkerEnv,
    /// `edl-worker`'s data directory when the job names no data.
    pub data_dir: &'a Path,
    /// `edl-worker`'s state directory (its dev PKI, when the credentials are not files).
    pub state_dir: &'a Path,
    /// Extra `edl-worker` arguments (the cluster's `worker_args`, edl-local's flags); not
    /// given to a job's own command.
    pub worker_args: &'a [OsString],
}

/// How to start a worker: `edl-worker` with its flags, or the job's command in the job file's
/// folder; both get the contract's environment and the job's `[worker] env`. `name` names it
/// in messages and `log` receives its output.
pub fn worker_spawn(bins: &Binaries, w: &WorkerLaunch<'_>, name: String, log: PathBuf) -> Spawn {
    let mut env: Vec<(String, OsString)> = w
        .env
        .vars()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    env.extend(
        w.spec
            .env
            .iter()
            .map(|(k, v)| (k.clone(), OsString::from(v))),
    );
    let (program, args, dir) = match w.spec.command.split_first() {
        None => {
            let (state_dir, creds) = match &w.env.credentials {
                Credentials::StateDir(d) => (d.as_path(), None),
                Credentials::Files { ca, cert, key } => (
                    w.state_dir,
                    Some(Creds {
                        ca: ca.clone(),
                        cert: cert.clone(),
                        key: key.clone(),
                    }),
                ),
            };
            // edl-worker takes one coordinator.
            let coordinator = w.env.coordinators.first().map_or("", String::as_str);
            let mut args = worker_args(
                coordinator,
                &w.env.name,
                w.data_dir,
                state_dir,
                creds.as_ref(),
                false,
            );
            if let Some(p) = w.env.placement {
                args.extend(["--placement".into(), p.to_string().into()]);
            }
            args.extend(w.worker_args.iter().cloned());
            (bins.worker.clone(), args, None)
        }
        Some((program, rest)) => (
            contract::resolve_program(program, w.workdir),
            rest.iter().map(OsString::from).collect(),
            Some(w.workdir.to_path_buf()),
        ),
    };
    Spawn {
        name,
        program,
        args,
        log,
        capture_stdout: false,
        env,
        dir,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(credentials: Credentials) -> WorkerEnv {
        WorkerEnv {
            coordinators: vec!["127.0.0.1:7070".into()],
            credentials,
            job: "j1".into(),
            name: "p4".into(),
            placement: Some(4),
            devices: None,
        }
    }

    fn bins() -> Binaries {
        Binaries {
            ps: "/bin/edl-ps".into(),
            worker: "/bin/edl-worker".into(),
        }
    }

    fn get<'a>(s: &'a Spawn, var: &str) -> Option<&'a OsString> {
        s.env.iter().find(|(k, _)| k == var).map(|(_, v)| v)
    }

    #[test]
    fn a_builtin_worker_gets_flags_and_the_contract() {
        let spec = WorkerSpec::default();
        let extra = ["--max-steps".into(), "5".into()];
        let w = WorkerLaunch {
            spec: &spec,
            workdir: Path::new("/jobs/a"),
            env: env(Credentials::StateDir("/state".into())),
            data_dir: Path::new("/data"),
            state_dir: Path::new("/ignored"),
            worker_args: &extra,
        };
        let s = worker_spawn(&bins(), &w, "j1/p4".into(), "/logs/p4.log".into());
        assert_eq!(s.program, Path::new("/bin/edl-worker"));
        let args: Vec<String> = s.args.iter().map(|a| a.to_string_lossy().into()).collect();
        let want = [
            "--coordinator",
            "127.0.0.1:7070",
            "--name",
            "p4",
            "--data-dir",
            "/data",
            "--state-dir",
            "/state",
            "--placement",
            "4",
            "--max-steps",
            "5",
        ];
        assert_eq!(args, want);
        assert_eq!(s.dir, None);
        assert_eq!(get(&s, contract::PLACEMENT), Some(&OsString::from("4")));
    }

    #[test]
    fn a_job_command_runs_in_the_job_folder_with_the_contract() {
        let mut spec = WorkerSpec {
            command: vec!["./train.sh".into(), "--lr".into(), "0.1".into()],
            ..WorkerSpec::default()
        };
        spec.env.insert("OMP_NUM_THREADS".into(), "1".into());
        let creds = Creds {
            ca: "/pki/ca.pem".into(),
            cert: "/pki/p4.pem".into(),
            key: "/pki/p4.key".into(),
        };
        let w = WorkerLaunch {
            spec: &spec,
            workdir: Path::new("/jobs/a"),
            env: env(creds.contract()),
            data_dir: Path::new("/data"),
            state_dir: Path::new("/state"),
            worker_args: &["--max-steps".into()],
        };
        let s = worker_spawn(&bins(), &w, "j1/p4".into(), "/logs/p4.log".into());
        assert_eq!(s.program, Path::new("/jobs/a/./train.sh"));
        assert_eq!(s.args, [OsString::from("--lr"), OsString::from("0.1")]);
        assert_eq!(s.dir.as_deref(), Some(Path::new("/jobs/a")));
        assert_eq!(get(&s, "OMP_NUM_THREADS"), Some(&OsString::from("1")));
        assert_eq!(
            get(&s, contract::CERT),
            Some(&OsString::from("/pki/p4.pem"))
        );
        assert_eq!(get(&s, contract::NAME), Some(&OsString::from("p4")));
        assert_eq!(get(&s, contract::JOB), Some(&OsString::from("j1")));
        assert_eq!(get(&s, contract::STATE_DIR), None);
    }
}
