//! `edl-ps`: runs an EDL coordinator or shard server, or manages the cluster CA.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use edl_ps::coordinator::{self, CoordinatorConfig};
use edl_ps::shard::{self, ShardConfig};
use edl_shared::cli::{BudgetArgs, IdentityArgs, MetricsArgs, StragglerArgs};
use edl_shared::jobfile::defaults;
use edl_shared::models::Builtin as _;
use edl_shared::pki::PkiDir;
use edl_shared::proto::{
    Consistency, DataFormat, DataSpec, Init, JobConfig, LrSchedule, ModelSection, OptimizerSpec,
    TensorSpec,
};
use edl_shared::transport::TransportSettings;
use edl_shared::{Role, shutdown, telemetry};

/// Large tensors are allocated and freed on every request; mimalloc keeps them off fresh
/// pages (with glibc's allocator, page faults took a tenth of a 16 MiB push+pull).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// EDL parameter-server processes.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the coordinator: job config, worker registry, shard map, data partitions, clocks.
    Coordinator(Box<CoordinatorArgs>),
    /// Run a shard server that holds part of the model.
    Shard(Box<ShardArgs>),
    /// Manage the cluster CA in a state directory.
    #[command(subcommand)]
    Ca(CaCmd),
    /// Work with job files.
    #[command(subcommand)]
    Job(JobCmd),
}

#[derive(Subcommand, Debug)]
enum JobCmd {
    /// Validate a job file and print the job it resolves to: the tensor table, the total
    /// parameters, bytes and keys. Exits non-zero, naming the line and field, if invalid, or
    /// naming the files missing if its `[data]` is not there.
    Check {
        /// The job file (TOML; examples in deploy/jobs/).
        file: PathBuf,
        /// Print the resolved job as a job file instead (`auto` counts filled in).
        #[arg(long)]
        toml: bool,
        /// Do not check that the `[data]` train and test paths exist here (for data that only
        /// the workers' hosts hold).
        #[arg(long)]
        no_data_check: bool,
    },
}

#[derive(clap::Args, Debug)]
struct CoordinatorArgs {
    /// Address to listen on (UDP, QUIC).
    #[arg(long, default_value = "0.0.0.0:7070")]
    listen: SocketAddr,
    /// Write the bound address to this file once listening (useful with port 0).
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Number of shard servers; the shard map forms once they have all joined.
    #[arg(long, default_value_t = 1)]
    shards: u32,
    /// The job file (TOML): the model's tensors, optimizer, consistency, batch size, epochs,
    /// data. Examples in deploy/jobs/; `edl-ps job check FILE` shows what it resolves to.
    /// Without it, the flags below describe an MLP job.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "layers", "counter", "optimizer", "schedule", "consistency", "batch_size", "epochs",
        "partition_size", "train_samples", "chunk_size", "seed", "lease_ms",
    ])]
    job: Option<PathBuf>,
    /// MLP layer widths, input to classes.
    #[arg(long, value_delimiter = ',', default_value = "784,256,128,10")]
    layers: Vec<u32>,
    /// Instead of an MLP, a zero-initialized tensor of FLOATS floats trained by SGD at learning
    /// rate 1 (for load tests: pushes of -1 make every float count the pushes applied to it).
    #[arg(long, value_name = "FLOATS", conflicts_with_all = ["layers", "optimizer"])]
    counter: Option<u32>,
    /// Server-side optimizer, torch.optim's: KIND[:LR][,KEY=VALUE...] with KIND sgd, momentum,
    /// adam, adamw, adagrad, rmsprop or adadelta and its arguments, e.g.
    /// sgd:0.1,momentum=0.9,nesterov=true or adamw:0.001,weight_decay=0.05.
    #[arg(long, default_value_t = defaults::OPTIMIZER)]
    optimizer: OptimizerSpec,
    /// Learning-rate schedule, torch.optim.lr_scheduler's: KIND[,KEY=VALUE...] with KIND
    /// constant, step, multistep, exponential, cosine, linear or onecycle and its arguments,
    /// `by=step|epoch` (what it counts) and `scale=none|linear|sqrt` (BSP: times the workers
    /// an update averages), e.g. step,step_size=1,gamma=0.7,by=epoch or
    /// cosine,T_max=5000,eta_min=0.0001.
    #[arg(long, default_value = "constant", conflicts_with = "counter")]
    schedule: LrSchedule,
    /// Consistency model: asp, ssp:S (bounded staleness S) or bsp.
    #[arg(long, default_value_t = defaults::CONSISTENCY)]
    consistency: Consistency,
    /// Samples per mini-batch.
    #[arg(long, default_value_t = defaults::BATCH_SIZE)]
    batch_size: u32,
    /// Passes over the training data.
    #[arg(long, default_value_t = defaults::EPOCHS)]
    epochs: u32,
    /// Samples per data partition leased to a worker.
    #[arg(long, default_value_t = defaults::PARTITION_SIZE)]
    partition_size: u32,
    /// Training samples used per epoch (the first N of the training set).
    #[arg(long, default_value_t = defaults::SAMPLES)]
    train_samples: u32,
    /// Floats per parameter key; tensors are cut into chunks of this size.
    #[arg(long, default_value_t = defaults::CHUNK_SIZE)]
    chunk_size: u32,
    /// Seed for initialization and data order.
    #[arg(long, default_value_t = defaults::SEED)]
    seed: u64,
    /// Worker heartbeat lease in milliseconds; silent workers are dropped after it.
    #[arg(long, default_value_t = defaults::LEASE_MS)]
    lease_ms: u32,
    /// Copies of every key range: a primary and REPLICAS - 1 backups on other shards. A push
    /// is acknowledged once every live copy holds it; when a primary dies a backup takes its
    /// place within about a second, losing nothing. At most --shards; overrides a job file's
    /// `[training] replicas`. [default: 1, no copies]
    #[arg(long)]
    replicas: Option<u32>,
    /// How pushes and pulls travel: f32 (exact), bf16 or fp16 (half the bytes; shards keep
    /// f32 parameters and optimizer state, and refuse a value that is not finite at 16 bits:
    /// fp16 ends at 65,504), or topk:FRACTION (pushes send only the largest FRACTION of each
    /// chunk's values, e.g. topk:0.01, and each worker adds what it held back to its next
    /// push; topk:FRACTION+bf16 sends them at 16 bits). Overrides a job file's
    /// `[training] wire`; tensors its `[[tensor]]` tables give a wire of their own keep
    /// theirs. [default: f32]
    #[arg(long)]
    wire: Option<edl_shared::proto::WireSpec>,
    /// Keep no durable state. By default the coordinator keeps membership, the shard map, the
    /// job, the data leases and the data progress in STATE_DIR/coordinator (a log,
    /// state.wal, folded into state.bin now and then), makes every change durable before it
    /// answers the request that made it, and restores them on start.
    #[arg(long, conflicts_with = "meta")]
    no_persist: bool,
    /// Declare a worker dead only when its lease expires. By default a worker silent for
    /// 250 ms gets a one-byte UDP datagram at its address every 100 ms, and is declared dead
    /// at once if its host answers "port unreachable" (its process is gone): within a second
    /// of a crash instead of a whole lease. A stopped or slow process still has its socket and
    /// is never declared dead so. Turn it off where a NAT between workers and the coordinator
    /// could answer so for a live worker.
    #[arg(long)]
    no_socket_probe: bool,
    #[command(flatten)]
    election: coordinator::etcd::ElectionArgs,
    /// Serve the live dashboard at http://ADDR/ (membership, throughput, loss and accuracy,
    /// shards, stragglers, events), its JSON API (/api/status, /api/history, /api/shards) and
    /// /metrics (e.g. 127.0.0.1:8080; port 0 picks one). Plain HTTP without authentication:
    /// bind a loopback or cluster-internal address. Off unless given.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// Write the dashboard's address to this file once bound (useful with port 0).
    #[arg(long, value_name = "FILE", requires = "http")]
    http_file: Option<PathBuf>,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    stragglers: StragglerArgs,
    #[command(flatten)]
    identity: IdentityArgs,
    #[command(flatten)]
    budgets: BudgetArgs,
}

#[derive(clap::Args, Debug)]
struct ShardArgs {
    /// The coordinator's address; with several coordinators (--meta), all of them separated
    /// by commas: the shard joins whichever leads.
    #[arg(long, default_value = "127.0.0.1:7070")]
    coordinator: String,
    /// Address to listen on (UDP, QUIC).
    #[arg(long, default_value = "0.0.0.0:7071")]
    listen: SocketAddr,
    /// Address workers should use to reach this shard (defaults to the bound address).
    #[arg(long)]
    advertise: Option<String>,
    /// Name of this shard (its certificate name).
    #[arg(long, default_value = "shard")]
    name: String,
    /// Write the bound address to this file once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Checkpoint file [default: STATE_DIR/shards/NAME.ckpt]. A shard that finds one on start
    /// restores it (it must come from the same shard of the same job).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Write a checkpoint every this many seconds (and on `edlctl checkpoint` and at a clean
    /// shutdown); 0 writes only on demand and at shutdown.
    #[arg(long, default_value_t = 30)]
    checkpoint_every: u64,
    /// Run without checkpoints: a restarted shard starts from fresh parameters.
    #[arg(long, conflicts_with = "checkpoint")]
    no_checkpoint: bool,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    identity: IdentityArgs,
    #[command(flatten)]
    budgets: BudgetArgs,
}

#[derive(Subcommand, Debug)]
enum CaCmd {
    /// Create a cluster CA in the state directory (does nothing if one exists).
    Init {
        /// State directory.
        #[arg(long, default_value = "edl-state")]
        state_dir: PathBuf,
    },
    /// Issue a node certificate signed by the cluster CA.
    Issue {
        /// State directory holding the CA.
        #[arg(long, default_value = "edl-state")]
        state_dir: PathBuf,
        /// Role: coordinator, shard, worker or admin.
        #[arg(long)]
        role: Role,
        /// Node name: a worker registers under it, a shard is known by it (`edlctl` commands
        /// take it). Letters, digits, '-', '_' and '.'.
        #[arg(long)]
        name: String,
        /// The job the certificate belongs to: servers refuse peers of another job, so one CA
        /// can serve several jobs.
        #[arg(long, default_value = edl_shared::pki::DEFAULT_JOB)]
        job: String,
        /// Extra host names or IP addresses the certificate is valid for.
        #[arg(long)]
        host: Vec<String>,
    },
}

fn write_addr(file: &Option<PathBuf>, addr: SocketAddr) -> anyhow::Result<()> {
    if let Some(f) = file {
        edl_shared::pki::write_atomic(f, addr.to_string().as_bytes())?;
    }
    Ok(())
}

/// What is missing of a job's data, as (field, message): the files a worker would look for
/// and not find. An idx path is a prefix, `PREFIX-images-idx3-ubyte` and
/// `PREFIX-labels-idx1-ubyte`, each raw or with `.gz` (as `edl-worker` finds them); a LIBSVM
/// path is the file.
fn missing_data(data: &DataSpec) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    for (field, path) in [("data.train", &data.train), ("data.test", &data.test)] {
        if path.is_empty() {
            continue;
        }
        let path = Path::new(path);
        let why = match data.format {
            DataFormat::LibSvm if path.is_dir() => {
                format!("{} is a directory, not a LIBSVM file", path.display())
            }
            DataFormat::LibSvm if !path.is_file() => {
                format!("LIBSVM file {} not found", path.display())
            }
            DataFormat::LibSvm => continue,
            DataFormat::Idx => {
                let dir = path.parent().unwrap_or(Path::new("."));
                let stem = path.file_name().unwrap_or_default().to_string_lossy();
                let absent: Vec<String> = ["images-idx3-ubyte", "labels-idx1-ubyte"]
                    .iter()
                    .map(|kind| format!("{stem}-{kind}"))
                    .filter(|f| !dir.join(f).is_file() && !dir.join(format!("{f}.gz")).is_file())
                    .map(|f| dir.join(f).display().to_string())
                    .collect();
                if absent.is_empty() {
                    continue;
                }
                let mut why = format!(
                    "{} not found (nor with .gz): the idx prefix {} names \
                     PREFIX-images-idx3-ubyte and PREFIX-labels-idx1-ubyte",
                    absent.join(" and "),
                    path.display()
                );
                if path.is_dir() {
                    why.push_str(&format!(
                        "; {} is a directory: name the files' prefix in it, e.g. {}",
                        path.display(),
                        path.join("train").display()
                    ));
                }
                why
            }
        };
        out.push((field, why));
    }
    out
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init("info");
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Job(JobCmd::Check {
            file,
            toml,
            no_data_check,
        }) => {
            let whole = edl_shared::jobfile::load_file(&file)?;
            let job = &whole.job;
            if let Some(data) = job.data.as_ref().filter(|_| !no_data_check) {
                let text = std::fs::read_to_string(&file).unwrap_or_default();
                let missing: Vec<String> = missing_data(data)
                    .iter()
                    .map(|(field, why)| {
                        let at = match edl_shared::jobfile::line_of(&text, field) {
                            Some(line) => format!("{}:{line}", file.display()),
                            None => file.display().to_string(),
                        };
                        format!("{at}: {field}: {why}")
                    })
                    .collect();
                anyhow::ensure!(missing.is_empty(), "{}", missing.join("\n"));
            }
            if toml {
                print!("{}", whole.to_toml());
            } else {
                println!("{}: valid", file.display());
                print!("{}", edl_shared::jobfile::describe(job));
                match whole.unplaceable() {
                    Some(why) => println!(
                        "workers: none named for edl-local or edl-sched ({why}); or start your \
                         program by hand"
                    ),
                    None => println!("workers run: {}", whole.worker.describe()),
                }
            }
        }
        Cmd::Coordinator(a) => {
            let identity = a.identity.identity(Role::Coordinator, "coordinator")?;
            let (model, tensors, optimizer) = match a.counter {
                Some(floats) => (
                    ModelSection::custom(),
                    vec![TensorSpec {
                        name: "counter".into(),
                        shape: vec![floats],
                        init: Init::Zeros,
                    }],
                    OptimizerSpec::sgd(1.0),
                ),
                None => {
                    let mlp = edl_shared::models::Mlp {
                        layers: a.layers.clone(),
                    };
                    (mlp.section(), mlp.tensors(), a.optimizer)
                }
            };
            let job = match &a.job {
                Some(file) => edl_shared::jobfile::load(file)?,
                None => JobConfig {
                    tensors,
                    model,
                    chunk_size: a.chunk_size,
                    optimizer,
                    optimizer_groups: Vec::new(),
                    schedule: a.schedule.clone(),
                    consistency: a.consistency,
                    batch_size: a.batch_size,
                    epochs: a.epochs,
                    partition_size: a.partition_size,
                    train_samples: a.train_samples,
                    seed: a.seed,
                    lease_ms: a.lease_ms,
                    replicas: 1,
                    wire: Default::default(),
                    tensor_wires: Vec::new(),
                    data: None,
                },
            };
            let mut job = job;
            if let Some(r) = a.replicas {
                job.replicas = r;
            }
            if let Some(w) = a.wire {
                job.wire = w;
            }
            if !(1..=a.shards.min(edl_shared::jobfile::MAX_REPLICAS)).contains(&job.replicas) {
                anyhow::bail!(
                    "--replicas {} must be 1 to {} (at most --shards {}: every copy of a range \
                     needs a shard of its own)",
                    job.replicas,
                    a.shards.min(edl_shared::jobfile::MAX_REPLICAS),
                    a.shards
                );
            }
            job.check_schedule().map_err(anyhow::Error::msg)?;
            let state_file =
                (!a.no_persist).then(|| a.identity.state_dir.join("coordinator").join("state.bin"));
            let cfg = CoordinatorConfig {
                job,
                shards: a.shards,
                state_file,
                stragglers: a.stragglers.settings().map_err(anyhow::Error::msg)?,
                probe_sockets: !a.no_socket_probe,
            };
            let settings = TransportSettings {
                budgets: a.budgets.budgets(),
                ..TransportSettings::default()
            };
            let elected = a.election.elected(|| {
                anyhow::ensure!(
                    !a.listen.ip().is_unspecified() && a.listen.port() != 0,
                    "--meta needs the address clients reach this coordinator at: give \
                     --advertise HOST:PORT, or --listen with a specific address and port"
                );
                Ok(a.listen.to_string())
            })?;
            if let Some(elected) = elected {
                anyhow::ensure!(
                    a.http.is_none(),
                    "--http is not served with --meta yet: read the leader's status with edlctl"
                );
                let stop = shutdown::on_signals();
                a.metrics.start(stop.clone()).await?;
                let addr_file = a.addr_file.clone();
                return coordinator::run_elected(
                    cfg,
                    elected,
                    a.listen,
                    &identity,
                    settings,
                    stop,
                    |addr| write_addr(&addr_file, addr),
                )
                .await;
            }
            let bound = coordinator::bind(cfg, a.listen, &identity, settings)
                .context("starting the coordinator")?;
            write_addr(&a.addr_file, bound.addr)?;
            let stop = shutdown::on_signals();
            a.metrics.start(stop.clone()).await?;
            if let Some(http) = a.http {
                let at = bound.serve_http(http, stop.clone()).await?;
                write_addr(&a.http_file, at)?;
            }
            bound.run(stop).await;
        }
        Cmd::Shard(a) => {
            let identity = a.identity.identity(Role::Shard, &a.name)?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let checkpoint = (!a.no_checkpoint).then(|| {
                a.checkpoint.clone().unwrap_or_else(|| {
                    a.identity
                        .state_dir
                        .join("shards")
                        .join(format!("{}.ckpt", a.name))
                })
            });
            let cfg = ShardConfig {
                coordinator: a.coordinator,
                listen: a.listen,
                advertise: a.advertise,
                checkpoint,
                checkpoint_every: (a.checkpoint_every > 0)
                    .then(|| std::time::Duration::from_secs(a.checkpoint_every)),
            };
            let settings = TransportSettings {
                budgets: a.budgets.budgets(),
                ..TransportSettings::default()
            };
            let stop = shutdown::on_signals();
            a.metrics.start(stop.clone()).await?;
            let run = tokio::spawn(shard::run(cfg, identity, settings, stop, Some(tx)));
            if let Ok(addr) = rx.await {
                write_addr(&a.addr_file, addr)?;
            }
            run.await??;
        }
        Cmd::Ca(CaCmd::Init { state_dir }) => {
            let pki = PkiDir::new(&state_dir);
            if pki.init_ca()? {
                println!("created cluster CA {}", pki.ca_cert().display());
            } else {
                println!("cluster CA already exists: {}", pki.ca_cert().display());
            }
        }
        Cmd::Ca(CaCmd::Issue {
            state_dir,
            role,
            name,
            job,
            host,
        }) => {
            let pki = PkiDir::new(&state_dir);
            pki.issue(role, &name, &job, &host)?;
            println!(
                "issued {} and {}",
                pki.node_cert(role, &name).display(),
                pki.node_key(role, &name).display()
            );
        }
    }
    Ok(())
}
