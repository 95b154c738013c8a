//! A worker program started by a placer: its connection from the process contract's
//! environment ([`edl_shared::contract`]) and its signals (SIGTERM or SIGINT drains, SIGUSR1
//! is a preemption notice).

use std::time::Duration;

use edl_shared::Role;
use edl_shared::contract::{Credentials, WorkerEnv};
use edl_shared::pki::{PkiDir, load_identity};
use edl_shared::transport::TransportSettings;
use tokio::signal::unix::{SignalKind, signal};

use crate::{ClientConfig, ClientError, Job, Session};

impl ClientConfig {
    /// How to reach the job the contract's environment names: its first coordinator, with
    /// the worker's certificate files or the state directory's certificate for
    /// `worker/EDL_NAME`.
    pub fn from_contract(env: &WorkerEnv) -> Result<ClientConfig, ClientError> {
        let identity = match &env.credentials {
            Credentials::Files { ca, cert, key } => load_identity(ca, cert, key),
            Credentials::StateDir(dir) => {
                PkiDir::new(dir).member(Role::Worker, &env.name, edl_shared::pki::DEFAULT_JOB)
            }
        }
        .map_err(|e| ClientError::Setup(format!("the worker's credentials: {e}")))?;
        Ok(ClientConfig {
            coordinator: env.coordinators.first().cloned().unwrap_or_default(),
            identity,
            settings: TransportSettings::default(),
        })
    }
}

impl Job {
    /// Connects as a placer's environment says (`EDL_COORDINATOR`, `EDL_CERT`/`EDL_KEY`/
    /// `EDL_CA` or `EDL_STATE_DIR`, `EDL_NAME`) and names the placement it was started for
    /// (`EDL_PLACEMENT`), so that replacements and migrations of this worker work as for
    /// `edl-worker`.
    pub async fn from_env() -> Result<Job, ClientError> {
        let env = WorkerEnv::from_env().map_err(|e| ClientError::Setup(e.to_string()))?;
        let cfg = ClientConfig::from_contract(&env)?;
        Ok(Job::connect(&cfg).await?.for_placement(env.placement))
    }
}

impl Session {
    /// Honours the contract's signals from now on, on the current tokio runtime: SIGTERM or
    /// SIGINT asks the worker to leave after its current step ([`Session::drain_requested`]
    /// turns true), SIGUSR1 is a preemption notice of length `notice` (the coordinator is told,
    /// see [`crate::Notices::preempt`]). The training loop checks `drain_requested` after each
    /// step and calls [`Session::leave`].
    pub fn leave_on_signals(&self, notice: Duration) -> Result<(), ClientError> {
        let setup = |kind, what| {
            signal(kind).map_err(|e| ClientError::Setup(format!("listening for {what}: {e}")))
        };
        let mut term = setup(SignalKind::terminate(), "SIGTERM")?;
        let mut int = setup(SignalKind::interrupt(), "SIGINT")?;
        let mut usr1 = setup(SignalKind::user_defined1(), "SIGUSR1")?;
        let notices = self.notices();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    Some(()) = term.recv() => notices.state.tell(true, None),
                    Some(()) = int.recv() => notices.state.tell(true, None),
                    Some(()) = usr1.recv() => {
                        if let Err(e) = notices.preempt(notice).await {
                            tracing::warn!(error = %e, "cannot pass the preemption notice on");
                        }
                    }
                    else => return,
                }
            }
        });
        Ok(())
    }
}
