//! `edl-sched`: the cluster scheduler. It shares a pool of worker slots among many EDL jobs,
//! resizing them stop-free under a policy; `edlctl job` and `edlctl slots` talk to it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use edl_launch::Binaries;
use edl_ps::coordinator::etcd::EtcdMeta;
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
    /// The cluster file (TOML): slots, policy, shards per job; see docs/src/scheduler.md.
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
    /// With --meta, the scheduler's state (jobs, their processes, allocations) is in etcd
    /// instead of STATE_DIR/sched.json. Schedulers sharing a --meta share the --state-dir too
    /// (one machine, or a shared filesystem: it holds the cluster CA and the jobs'
    /// directories). Give edlctl every scheduler: --scheduler A,B.
    #[command(flatten)]
    election: edl_ps::coordinator::etcd::ElectionArgs,
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
    // Without an election, the running jobs are taken back before anything is served.
    let (scheduler, elected) = match &cli.election.meta {
        None => (
            Some(Scheduler::new(cluster, &cli.identity.state_dir, placer).await?),
            None,
        ),
        Some(_) => (None, Some((cluster, placer))),
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
    let Some((cluster, placer)) = elected else {
        tracing::info!(%addr, slots, policy, state_dir = %cli.identity.state_dir.display(), "edl-sched serving");
        let server = serve(Arc::new(SchedService::new(tx)));
        let out = match scheduler {
            Some(s) => s.run(rx, shutdown, cli.stop_jobs_on_exit).await,
            None => Ok(()),
        };
        let _ = server.await;
        return out;
    };
    let Some(elected) = cli.election.elected(|| {
        anyhow::ensure!(
            !cli.listen.ip().is_unspecified(),
            "--meta needs the address edlctl reaches this scheduler at: give --advertise \
             HOST:PORT, or --listen with a specific address"
        );
        Ok(addr.to_string())
    })?
    else {
        anyhow::bail!("--meta without an election");
    };
    let advertise = elected.advertise.clone();
    let meta = EtcdMeta::connect(elected.endpoints, &identity.job, "sched").await?;
    let (standby, watching) = tokio::sync::watch::channel(None);
    let prober = edl_ps::coordinator::etcd::Prober::new(&identity, &settings, elected.dead_after)?;
    let service = Arc::new(SchedService::standby(tx, watching));
    let server = serve(service.clone());
    tracing::info!(%addr, %advertise, etcd = %cli.election.meta.as_deref().unwrap_or_default(), "edl-sched campaigning for the lead");
    let led = meta
        .lead(
            &advertise,
            elected.ttl,
            &prober,
            &standby,
            &shutdown,
            async |lead, record| {
                let store = Arc::new(meta.store(lead));
                let dir = &cli.identity.state_dir;
                Scheduler::elected(cluster, dir, placer, record, store, lead.lost.clone()).await
            },
        )
        .await;
    let (lead, scheduler) = match led {
        Ok(Some(led)) => led,
        Ok(None) => {
            let _ = server.await;
            return Ok(());
        }
        Err(e) => {
            shutdown.cancel();
            let _ = server.await;
            return Err(e);
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
