//! Starting EDL's processes: where the binaries are, and the command lines of a coordinator,
//! a shard server and a worker. `edl-local` and the cluster scheduler's local placer
//! (`edl-sched`) both start their processes from these.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use edl_shared::proto::StragglerSettings;

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
    coordinator: &SocketAddr,
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
        coordinator.to_string().into(),
        "--name".into(),
        name.into(),
        "--data-dir".into(),
        data_dir.as_os_str().to_owned(),
    ]);
    push_common(&mut args, state_dir, creds);
    args
}
