//! `edl-sched`: the cluster scheduler. It shares a pool of worker slots among many EDL jobs,
//! resizing them stop-free under a policy; `edlctl job` and `edlctl slots` talk to it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use edl_launch::Binaries;
use edl_ps::coordinator::etcd::{EtcdMeta, parse_url};
use edl_sched::cluster::kube::{KubePlacer, KubeSettings};
use edl_sched::cluster::server::SchedService;
use edl_sched::cluster::{Cluster, LocalPlacer, Placer, Scheduler};
use edl_shared::cli::{BudgetArgs, IdentityArgs, MetricsArgs};
use edl_shared::transport::{TransportSettings, server_endpoint};
use edl_shared::{Role, telemetry};

/// Run the cluster scheduler: jobs submitted with `edlctl job submit` share the cluster
/// file's slots; the policy decides each job's size and the scheduler resizes running jobs
/// stop-free. Its state (the cluster CA, jobs, the event log, each job's directory) lives in
/// --state-dir; stopped and started again with the same directory, it takes back the jobs
/// still running. With --meta, several schedulers share the cluster: one leads, the others
/// stand by and one of them takes over (and takes the running jobs back) when it dies.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// The cluster file (TOML): slots, policy, shards per job; see the README.
    #[arg(long)]
    cluster: PathBuf,
    /// Address to listen on (UDP, QUIC) for edlctl.
    #[arg(long, env = "EDL_SCHEDULER_LISTEN", default_value = "127.0.0.1:7080")]
    listen: SocketAddr,
    /// Write the bound address to this file once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Where edl-ps and edl-worker are [default: next to this program].
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Stop every running job when the scheduler stops (they are cancelled). By default they
    /// keep running and a restarted scheduler takes them back.
    #[arg(long)]
    stop_jobs_on_exit: bool,
    /// Where jobs run: `local` (processes on this machine) or `kubernetes` (pods, through the
    /// in-cluster service account or the current kubeconfig context; checked against the API
    /// types and an offline schema validator only, never against a live cluster).
    #[arg(long, default_value = "local", value_parser = ["local", "kubernetes"])]
    placer: String,
    /// Kubernetes: the namespace of every object.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Kubernetes: the container image, with edl-ps and edl-worker on its PATH.
    #[arg(long, default_value = "edl:latest")]
    image: String,
    /// Kubernetes: each worker asks for one GPU (nvidia.com/gpu: 1).
    #[arg(long)]
    gpus: bool,
    /// Kubernetes: a PersistentVolumeClaim with the training data, mounted read-only at the
    /// cluster file's data_dir in workers.
    #[arg(long)]
    data_claim: Option<String>,
    /// Keep the scheduler's state (jobs, their processes, allocations) in etcd
    /// (etcd://HOST:PORT[,HOST:PORT...]) instead of STATE_DIR/sched.json. Several schedulers
    /// may run with the same --meta and the same --state-dir (one machine, or a shared
    /// filesystem: it holds the cluster CA and the jobs' directories): one leads through an
    /// etcd lease, the others stand by and tell edlctl where the leader is, and one of them
    /// takes over within --leader-ttl of the leader's death. Give edlctl every scheduler:
    /// --scheduler A,B.
    #[arg(long, value_name = "URL")]
    meta: Option<String>,
    /// With --meta: the address edlctl and the other schedulers reach this one at [default:
    /// the bound address, when --listen names a specific one].
    #[arg(long, value_name = "ADDR", requires = "meta")]
    advertise: Option<String>,
    /// With --meta: the leader's etcd lease. A leader cut off from etcd this long steps down
    /// (and exits, leaving the jobs running for the next leader); one that died is replaced
    /// after this long where no standby could tell it died (see --leader-dead-after).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration, requires = "meta")]
    leader_ttl: std::time::Duration,
    /// With --meta: a standby takes a leader that does not answer it as the leader for this
    /// long for dead, revokes its lease and campaigns.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration, requires = "meta")]
    leader_dead_after: std::time::Duration,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    identity: IdentityArgs,
    #[command(flatten)]
    budgets: BudgetArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init("info");
    let cli = Cli::parse();
    let cluster = Cluster::load(&cli.cluster)?;
    match cli.placer.as_str() {
        "kubernetes" => {
            let placer = KubePlacer::from_env(KubeSettings {
                namespace: cli.namespace.clone(),
                image: cli.image.clone(),
                gpus: cli.gpus,
                data_dir: cluster.data_dir.clone(),
                data_claim: cli.data_claim.clone(),
                worker_args: cluster.worker_args.clone(),
            })
            .await?;
            serve(&cli, cluster, placer).await
        }
        _ => {
            let bins = Binaries::locate(cli.bin_dir.as_deref())?;
            let placer =
                LocalPlacer::new(bins, cluster.data_dir.clone(), cluster.worker_args.clone());
            serve(&cli, cluster, placer).await
        }
    }
}

/// Serves requests and runs the scheduler with `placer` until a signal.
async fn serve<P: Placer>(cli: &Cli, cluster: Cluster, placer: P) -> anyhow::Result<()> {
    let identity = cli.identity.identity(Role::Coordinator, "scheduler")?;
    let settings = TransportSettings {
        budgets: cli.budgets.budgets(),
        ..TransportSettings::default()
    };
    let slots = cluster.slots.len();
    let policy = cluster.policy.clone();
    let endpoints = match &cli.meta {
        Some(url) => Some(parse_url(url).map_err(anyhow::Error::msg)?),
        None => None,
    };
    // Without an election, the running jobs are taken back before anything is served.
    let (scheduler, elected) = match endpoints {
        None => (
            Some(Scheduler::new(cluster, &cli.identity.state_dir, placer).await?),
            None,
        ),
        Some(e) => (None, Some((e, cluster, placer))),
    };
    let endpoint = server_endpoint(cli.listen, &identity, &settings)
        .with_context(|| format!("listening on {}", cli.listen))?;
    let addr = endpoint.local_addr()?;
    if let Some(f) = &cli.addr_file {
        edl_shared::pki::write_atomic(f, addr.to_string().as_bytes())?;
    }
    let shutdown = edl_shared::shutdown::on_signals();
    cli.metrics.start(shutdown.clone()).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let serve = |service: Arc<SchedService>| {
        let (shutdown, job, settings) = (shutdown.clone(), identity.job.clone(), settings.clone());
        tokio::spawn(async move {
            edl_shared::serve(endpoint, service, &job, &settings, shutdown).await;
        })
    };
    let Some((endpoints, cluster, placer)) = elected else {
        tracing::info!(%addr, slots, policy, state_dir = %cli.identity.state_dir.display(), "edl-sched serving");
        let server = serve(Arc::new(SchedService::new(tx)));
        let out = match scheduler {
            Some(s) => s.run(rx, shutdown, cli.stop_jobs_on_exit).await,
            None => Ok(()),
        };
        let _ = server.await;
        return out;
    };
    let advertise = match &cli.advertise {
        Some(a) => a.clone(),
        None if cli.listen.ip().is_unspecified() => anyhow::bail!(
            "--meta needs the address edlctl reaches this scheduler at: give --advertise \
             HOST:PORT, or --listen with a specific address"
        ),
        None => addr.to_string(),
    };
    let meta = EtcdMeta::connect(endpoints, &identity.job, "sched").await?;
    let (standby, watching) = tokio::sync::watch::channel(None);
    let prober =
        edl_ps::coordinator::etcd::Prober::new(&identity, &settings, cli.leader_dead_after)?;
    let service = Arc::new(SchedService::standby(tx, watching));
    let server = serve(service.clone());
    tracing::info!(%addr, %advertise, etcd = %cli.meta.as_deref().unwrap_or_default(), "edl-sched campaigning for the lead");
    let Some(lead) = meta
        .campaign(
            &advertise,
            cli.leader_ttl,
            &standby,
            &shutdown,
            Some(&prober),
        )
        .await
    else {
        let _ = server.await;
        return Ok(());
    };
    // While it takes the jobs back it names itself: a standby probing it finds it leading.
    standby.send_replace(Some(advertise.clone()));
    let started = async {
        let record = meta
            .load()
            .await
            .map_err(|e| anyhow::anyhow!("etcd: {e}"))?;
        Scheduler::elected(
            cluster,
            &cli.identity.state_dir,
            placer,
            record,
            Arc::new(meta.store(&lead)),
            lead.lost.clone(),
        )
        .await
    };
    let scheduler = match started.await {
        Ok(s) => s,
        Err(e) => {
            meta.resign(&lead).await;
            shutdown.cancel();
            let _ = server.await;
            return Err(e.context("taking the lead"));
        }
    };
    service.lead();
    tracing::info!(term = lead.term, %advertise, slots, policy, state_dir = %cli.identity.state_dir.display(), "edl-sched elected: scheduling");
    match scheduler
        .run(rx, shutdown.clone(), cli.stop_jobs_on_exit)
        .await
    {
        Ok(()) => {
            let _ = server.await;
            meta.resign(&lead).await;
            Ok(())
        }
        Err(e) => {
            // Nothing more is answered or written: the cluster is the new leader's.
            shutdown.cancel();
            let _ = server.await;
            Err(e)
        }
    }
}
