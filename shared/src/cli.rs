//! Command-line pieces shared by every EDL binary: where credentials and state live.

use std::path::PathBuf;

use crate::pki::{Identity, PkiDir, PkiError, Role, load_identity};
use crate::server::Budgets;

/// Credential and state flags.
#[derive(Clone, Debug, clap::Args)]
pub struct IdentityArgs {
    /// State directory. Holds the cluster PKI under `pki/` unless --ca/--cert/--key are given.
    /// A server (coordinator, shard, scheduler) creates a dev CA there if none exists (local
    /// runs); a client (worker, edlctl) never does, and is issued its certificate by the CA
    /// there if its key is there too.
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
    /// `role/name` (issuing it if missing, and for a server a dev CA too: see
    /// [`PkiDir::ensure`] and [`PkiDir::member`]).
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
            _ => {
                let pki = PkiDir::new(&self.state_dir);
                match role {
                    Role::Worker | Role::Admin => pki.member(role, name, crate::pki::DEFAULT_JOB),
                    Role::Coordinator | Role::Shard => pki.ensure(role, name),
                }
            }
        }
    }
}

/// The file of a state directory where a coordinator started with it (by `edl-local`, or
/// `edl-ps coordinator --addr-file STATE/coordinator.addr`) writes the address it listens on.
pub const COORDINATOR_ADDR_FILE: &str = "coordinator.addr";

/// Where a client finds the coordinator when not told: 127.0.0.1:7070, `edl-ps
/// coordinator`'s default.
pub const DEFAULT_COORDINATOR: &str = "127.0.0.1:7070";

impl IdentityArgs {
    /// The coordinator a client asks: `given` (a flag or variable) if any, else the address a
    /// coordinator wrote in this state directory ([`COORDINATOR_ADDR_FILE`]: a local run's),
    /// else [`DEFAULT_COORDINATOR`].
    pub fn coordinator(&self, given: Option<&str>) -> String {
        if let Some(addr) = given {
            return addr.to_string();
        }
        std::fs::read_to_string(self.state_dir.join(COORDINATOR_ADDR_FILE))
            .ok()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| DEFAULT_COORDINATOR.to_string())
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

/// How the coordinator finds stragglers and stalled workers and what it does about them.
#[derive(Clone, Debug, clap::Args)]
pub struct StragglerArgs {
    /// What to do with a straggler: `ignore` (flag it only), `drop` (drain it) or `replace`
    /// (ask the placer, e.g. edl-local, for a new worker, admit it, then drain the straggler;
    /// preemption notices get a replacement too). Changeable at run time with `edlctl
    /// stragglers`.
    #[arg(long = "stragglers", default_value = "ignore", value_name = "POLICY")]
    pub policy: edl_proto::StragglerPolicy,
    /// A worker is a straggler when its median step time over the window stays more than this
    /// many times the median of the other workers' (for a fifth of the window). A step's time
    /// is the worker's own work (pull, compute, push), not its wait for slower workers.
    #[arg(long, default_value_t = edl_proto::StragglerSettings::FACTOR, value_name = "X")]
    pub straggler_factor: f32,
    /// The stretch of time whose steps a worker is judged on, the same for every worker, so
    /// that a machine slowing everyone down slows the reference too (at least its last 3
    /// steps however old).
    #[arg(long, default_value = "1500ms", value_parser = humantime::parse_duration, value_name = "TIME")]
    pub straggler_window: std::time::Duration,
    /// A straggler's median must also exceed the others' by this much: scheduling noise of a
    /// busy machine on short steps is not a straggler.
    #[arg(long, default_value = "2ms", value_parser = humantime::parse_duration, value_name = "TIME")]
    pub straggler_min_gap: std::time::Duration,
    /// A worker's steps are judged only from this long after its admission.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration, value_name = "TIME")]
    pub straggler_warmup: std::time::Duration,
    /// Report a worker (log, event, `edlctl workers`) that holds the minimum clock others
    /// wait on (SSP, BSP) without finishing a step for this long.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, value_name = "TIME")]
    pub stall_report: std::time::Duration,
    /// Drop such a worker once it has held the others up this long (its data returns to the
    /// pool, as a dead worker's). `never` (the default) waits for it however long it takes.
    #[arg(long, default_value = "never", value_name = "TIME")]
    pub stall_drop: Never,
}

/// A duration, or `never` (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Never(pub Option<std::time::Duration>);

impl std::str::FromStr for Never {
    type Err = String;
    fn from_str(s: &str) -> Result<Never, String> {
        match s.trim() {
            "never" => Ok(Never(None)),
            d => humantime::parse_duration(d)
                .map(|d| Never(Some(d)))
                .map_err(|e| format!("{e} (a duration such as 60s, or never)")),
        }
    }
}

/// Milliseconds of a duration, saturated to `u32` (as the straggler settings keep them).
pub fn ms(d: std::time::Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

impl StragglerArgs {
    /// The settings, checked.
    pub fn settings(&self) -> Result<edl_proto::StragglerSettings, String> {
        let s = edl_proto::StragglerSettings {
            policy: self.policy,
            factor: self.straggler_factor,
            window_ms: ms(self.straggler_window),
            min_gap_ms: self.straggler_min_gap.as_secs_f32() * 1000.0,
            warmup_ms: ms(self.straggler_warmup),
            stall_ms: ms(self.stall_report),
            stall_drop_ms: self.stall_drop.0.map_or(0, ms),
        };
        s.check()?;
        Ok(s)
    }

    /// The flags that give `s` (for a launcher passing its settings on to a coordinator).
    pub fn args_for(s: &edl_proto::StragglerSettings) -> Vec<String> {
        let mut args = vec![
            "--stragglers".into(),
            s.policy.to_string(),
            "--straggler-factor".into(),
            s.factor.to_string(),
            "--straggler-window".into(),
            format!("{}ms", s.window_ms),
            "--straggler-min-gap".into(),
            format!("{}us", (s.min_gap_ms * 1000.0).round() as u64),
            "--straggler-warmup".into(),
            format!("{}ms", s.warmup_ms),
            "--stall-report".into(),
            format!("{}ms", s.stall_ms),
            "--stall-drop".into(),
        ];
        args.push(match s.stall_drop_ms {
            0 => "never".into(),
            d => format!("{d}ms"),
        });
        args
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        stragglers: StragglerArgs,
    }

    fn parse(args: &[String]) -> Result<edl_proto::StragglerSettings, String> {
        let argv = std::iter::once("edl".to_string()).chain(args.iter().cloned());
        Flags::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .stragglers
            .settings()
    }

    #[test]
    fn straggler_flags_round_trip_through_args_for() {
        let defaults = parse(&[]).expect("defaults");
        assert_eq!(defaults, edl_proto::StragglerSettings::default());
        let s = edl_proto::StragglerSettings {
            policy: edl_proto::StragglerPolicy::Replace,
            factor: 1.8,
            window_ms: 2_500,
            min_gap_ms: 0.5,
            warmup_ms: 0,
            stall_ms: 4_000,
            stall_drop_ms: 30_000,
        };
        assert_eq!(parse(&StragglerArgs::args_for(&s)), Ok(s));
        let waits = edl_proto::StragglerSettings {
            stall_drop_ms: 0,
            ..s
        };
        assert_eq!(parse(&StragglerArgs::args_for(&waits)), Ok(waits));
        let early = ["--stall-report", "10s", "--stall-drop", "5s"].map(String::from);
        assert!(
            parse(&early)
                .expect_err("a drop before the report")
                .contains("before it is reported")
        );
        let bad = ["--stall-drop", "soon"].map(String::from);
        assert!(
            parse(&bad)
                .expect_err("not a duration")
                .contains("or never")
        );
    }
}
