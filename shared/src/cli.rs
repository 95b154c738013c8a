//! Command-line pieces shared by every EDL binary: where credentials and state live.

use std::path::PathBuf;

use crate::pki::{Identity, PkiDir, PkiError, Role, load_identity};
use crate::server::Budgets;

/// Credential and state flags.
#[derive(Clone, Debug, clap::Args)]
pub struct IdentityArgs {
    /// State directory. Holds the cluster PKI under `pki/` unless --ca/--cert/--key are given;
    /// if no CA exists there, a dev CA and this node's certificate are created (local runs).
    #[arg(long, env = "EDL_STATE_DIR", default_value = "edl-state")]
    pub state_dir: PathBuf,
    /// Cluster CA certificate (PEM). Peers must present certificates signed by it.
    #[arg(long, requires_all = ["cert", "key"])]
    pub ca: Option<PathBuf>,
    /// This node's certificate (PEM), signed by the cluster CA, subject CN `ROLE/NAME`.
    #[arg(long, requires_all = ["ca", "key"])]
    pub cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, requires_all = ["ca", "cert"])]
    pub key: Option<PathBuf>,
}

impl IdentityArgs {
    /// Loads the explicit certificate files, or the state directory's certificate for
    /// `role/name` (issuing it, and a dev CA, if missing).
    pub fn identity(&self, role: Role, name: &str) -> Result<Identity, PkiError> {
        match (&self.ca, &self.cert, &self.key) {
            (Some(ca), Some(cert), Some(key)) => {
                let id = load_identity(ca, cert, key)?;
                if id.role != role {
                    return Err(PkiError::BadSubject(format!(
                        "certificate {} is for role {}, this process needs {role}",
                        cert.display(),
                        id.role
                    )));
                }
                Ok(id)
            }
            _ => PkiDir::new(&self.state_dir).ensure(role, name),
        }
    }
}

/// A server's budgets (see [`Budgets`]): what any one peer, and all of them together, may make
/// it hold. Each flag also reads an environment variable; the defaults are
/// `Budgets::default()`'s.
#[derive(Clone, Debug, clap::Args)]
pub struct BudgetArgs {
    /// MiB of request frames one connection may have in flight (announced sizes, charged
    /// before anything is allocated); a frame past it is refused with `Busy`. At least the
    /// largest frame a client sends.
    #[arg(long, env = "EDL_BUDGET_CONN_MIB", default_value_t = Budgets::default().conn_bytes >> 20)]
    pub budget_conn_mib: u64,
    /// MiB of request frames the whole server may have in flight; a frame past it is refused
    /// with `Busy` (clients retry it after a pause).
    #[arg(long, env = "EDL_BUDGET_SERVER_MIB", default_value_t = Budgets::default().server_bytes >> 20)]
    pub budget_server_mib: u64,
    /// Requests in flight per connection (QUIC streams).
    #[arg(long, env = "EDL_MAX_STREAMS", default_value_t = Budgets::default().streams)]
    pub max_streams: u32,
    /// Connections one identity (role and certificate name) may hold at once.
    #[arg(long, env = "EDL_MAX_CONNS_PER_IDENTITY", default_value_t = Budgets::default().conns_per_identity)]
    pub max_conns_per_identity: u32,
    /// Connections the server holds at once in all.
    #[arg(long, env = "EDL_MAX_CONNS", default_value_t = Budgets::default().conns)]
    pub max_conns: u32,
    /// Seconds a new connection has to complete TLS and the version handshake.
    #[arg(long, env = "EDL_HELLO_TIMEOUT_S", default_value_t = Budgets::default().hello_timeout.as_secs())]
    pub hello_timeout_s: u64,
    /// Seconds a request frame has to arrive in full once it started.
    #[arg(long, env = "EDL_FRAME_TIMEOUT_S", default_value_t = Budgets::default().frame_timeout.as_secs())]
    pub frame_timeout_s: u64,
    /// Seconds without a request after which a connection is closed (clients reconnect).
    #[arg(long, env = "EDL_IDLE_TIMEOUT_S", default_value_t = Budgets::default().idle_timeout.as_secs())]
    pub idle_timeout_s: u64,
}

impl BudgetArgs {
    /// The budgets these flags set.
    pub fn budgets(&self) -> Budgets {
        use std::time::Duration;
        Budgets {
            conn_bytes: self.budget_conn_mib.saturating_mul(1 << 20),
            server_bytes: self.budget_server_mib.saturating_mul(1 << 20),
            streams: self.max_streams.max(1),
            conns_per_identity: self.max_conns_per_identity.max(1),
            conns: self.max_conns.max(1),
            hello_timeout: Duration::from_secs(self.hello_timeout_s.max(1)),
            frame_timeout: Duration::from_secs(self.frame_timeout_s.max(1)),
            idle_timeout: Duration::from_secs(self.idle_timeout_s.max(1)),
        }
    }
}

/// How the coordinator finds stragglers and what it does about them.
#[derive(Clone, Debug, clap::Args)]
pub struct StragglerArgs {
    /// What to do with a straggler: `ignore` (flag it only), `drop` (drain it) or `replace`
    /// (ask the placer, e.g. edl-local, for a new worker, admit it, then drain the straggler;
    /// preemption notices get a replacement too). Changeable at run time with `edlctl
    /// stragglers`.
    #[arg(long = "stragglers", default_value = "ignore", value_name = "POLICY")]
    pub policy: edl_proto::StragglerPolicy,
    /// A worker is a straggler when its median step time over the window is more than this
    /// many times the median of the other workers'. A step's time is the worker's own work
    /// (pull, compute, push), not its wait for slower workers.
    #[arg(long, default_value_t = edl_proto::StragglerSettings::FACTOR, value_name = "X")]
    pub straggler_factor: f32,
    /// Steps in the window a worker is judged over.
    #[arg(long, default_value_t = edl_proto::StragglerSettings::WINDOW, value_name = "STEPS")]
    pub straggler_window: u32,
}

impl StragglerArgs {
    /// The settings, checked.
    pub fn settings(&self) -> Result<edl_proto::StragglerSettings, String> {
        let s = edl_proto::StragglerSettings {
            policy: self.policy,
            factor: self.straggler_factor,
            window: self.straggler_window,
        };
        s.check()?;
        Ok(s)
    }
}

/// Where a process serves its Prometheus metrics.
#[derive(Clone, Debug, clap::Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9100; port 0 picks one).
    /// Plain HTTP without authentication: bind a loopback or cluster-internal address. Off
    /// unless given.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Write the metrics address to this file once bound (useful with port 0).
    #[arg(long, value_name = "FILE", requires = "metrics")]
    pub metrics_file: Option<PathBuf>,
}

#[cfg(feature = "observe")]
impl MetricsArgs {
    /// Starts serving `/metrics` if asked to, until `shutdown`; writes the address file.
    pub async fn start(
        &self,
        shutdown: crate::shutdown::CancellationToken,
    ) -> std::io::Result<Option<std::net::SocketAddr>> {
        let bound = crate::http::serve_metrics(self.metrics, shutdown).await?;
        if let (Some(addr), Some(file)) = (bound, &self.metrics_file) {
            if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            crate::pki::write_atomic(file, addr.to_string().as_bytes())
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Ok(bound)
    }
}
