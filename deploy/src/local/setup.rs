//! Setting up a run before any process starts: the state directory, every certificate, and
//! the binaries to start.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use edl_shared::Role;
use edl_shared::pki::PkiDir;

use super::{COORDINATOR_NAME, EVALUATOR_NAME, LAUNCHER_NAME, LocalConfig};
use crate::scenario::{shard_name, worker_name};

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
pub(super) fn issue_certificates(
    state_dir: &Path,
    cfg: &LocalConfig,
) -> anyhow::Result<edl_shared::Identity> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use edl_launch::launch::Binaries;
    use edl_shared::proto::Consistency;

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
            schedule: Default::default(),
            batch_size: 64,
            train_samples: 1000,
            lease_ms: 3000,
            replicas: None,
            wire: None,
            layers: vec![784, 10],
            seed: 1,
            data_dir: dir.path().into(),
            report: None,
            trace: None,
            state_dir: None,
            bin_dir: None,
            progress_bar: false,
            stall_timeout: None,
            scenario: None,
            restart_on_change: false,
            elastic: Default::default(),
            observe: Default::default(),
            job: None,
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
