//! An in-process EDL cluster for integration tests: a coordinator and N shard servers on
//! `127.0.0.1:0` with a fresh PKI in a temporary directory, plus helpers to connect clients.
//!
//! ```text
//! let cluster = TestCluster::start(job, 2).await?;
//! let job = cluster.connect("w1").await?;      // a worker-role client
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use edl_ps::admin::Admin;
use edl_ps::coordinator::{self, Coordinator, CoordinatorConfig};
use edl_ps::shard::{self, ShardConfig};
use edl_shared::faults::Faults;
use edl_shared::models::{Builtin, Mlp};
use edl_shared::pki::PkiDir;
use edl_shared::proto::ids::{ShardId, WorkerId};
use edl_shared::proto::msg::{DataSpan, EpochLedger, EventKind, JobTrace, Partition};
use edl_shared::proto::{Consistency, Init, JobConfig, ModelSection, OptimizerSpec, TensorSpec};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_shared::{Identity, Role};
use edl_worker::{ClientConfig, Job, Session};
use tokio::task::JoinSet;

pub mod dst;
pub mod etcd;
pub mod placer;
pub mod procs;
pub mod synthetic;
pub mod tenants;
pub mod traces;

/// A running in-process cluster. Dropping it stops every server.
pub struct TestCluster {
    /// The coordinator, for inspecting its state directly.
    pub coordinator: Arc<Coordinator>,
    /// The coordinator's address.
    pub coordinator_addr: SocketAddr,
    /// The shard servers' addresses, in shard-id order of start (not of join).
    pub shard_addrs: Vec<SocketAddr>,
    settings: TransportSettings,
    pki: PkiDir,
    dir: tempfile::TempDir,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl TestCluster {
    /// Starts a coordinator for `job` and `shards` shard servers, and waits until the shard map
    /// has formed.
    pub async fn start(job: JobConfig, shards: u32) -> anyhow::Result<TestCluster> {
        Self::start_with(job, shards, TransportSettings::default()).await
    }

    /// [`TestCluster::start`] with every server and client sending through `faults`. Each
    /// node's addresses are named in the plan: `coordinator`, the shards `s0`, `s1`, ..., and
    /// clients by the name given to [`TestCluster::connect`] (`test-admin` for
    /// [`TestCluster::admin`]), so a test can say `faults.isolate("w1")`.
    pub async fn start_with_faults(
        job: JobConfig,
        shards: u32,
        faults: Faults,
    ) -> anyhow::Result<TestCluster> {
        let settings = TransportSettings {
            faults: Some(faults),
            ..TransportSettings::default()
        };
        Self::start_with(job, shards, settings).await
    }

    /// [`TestCluster::start`] with explicit transport settings for the servers (clients pick
    /// theirs in [`TestCluster::client_config`]'s result).
    pub async fn start_with(
        job: JobConfig,
        shards: u32,
        settings: TransportSettings,
    ) -> anyhow::Result<TestCluster> {
        Self::start_on(job, shards, settings, Ipv4Addr::LOCALHOST.into()).await
    }

    /// [`TestCluster::start_with`] with every server listening on `ip` (an address of this
    /// host, or of the network namespace the calling runtime's threads are in) instead of
    /// loopback.
    pub async fn start_on(
        job: JobConfig,
        shards: u32,
        settings: TransportSettings,
        ip: IpAddr,
    ) -> anyhow::Result<TestCluster> {
        edl_shared::telemetry::init("warn");
        let dir = tempfile::tempdir()?;
        let pki = PkiDir::new(dir.path());
        pki.init_ca()?;
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let id = pki.ensure(Role::Coordinator, "coordinator")?;
        let bound = coordinator::bind(
            in_memory_coordinator(job, shards),
            SocketAddr::new(ip, 0),
            &id,
            labelled(&settings, "coordinator"),
        )?;
        let coordinator = bound.coordinator.clone();
        let coordinator_addr = bound.addr;
        tasks.spawn(bound.run(shutdown.clone()));
        let mut cluster = TestCluster {
            coordinator,
            coordinator_addr,
            shard_addrs: Vec::new(),
            settings,
            pki,
            dir,
            shutdown,
            tasks,
        };
        for i in 0..shards {
            cluster.spawn_shard(&format!("s{i}")).await?;
        }
        // Connecting waits for the shard map, so the cluster is fully formed on return.
        cluster.connect("probe").await?;
        Ok(cluster)
    }

    /// Starts a shard server `name` in the cluster's task set (no checkpoints) and records its
    /// address once it listens.
    async fn spawn_shard(&mut self, name: &str) -> anyhow::Result<SocketAddr> {
        let id = self.pki.ensure(Role::Shard, name)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut cfg = loopback_shard(&self.coordinator_addr);
        cfg.listen.set_ip(self.coordinator_addr.ip());
        let (stop, settings) = (self.shutdown.clone(), labelled(&self.settings, name));
        self.tasks.spawn(async move {
            if let Err(e) = shard::run(cfg, id, settings, stop, Some(tx)).await {
                tracing::error!(error = %e, "test shard failed");
            }
        });
        let addr = rx.await?;
        self.shard_addrs.push(addr);
        Ok(addr)
    }

    /// Starts one more shard server, `name`; it joins the running job and stands by (holding
    /// nothing) until an operator adds it. Returns its address.
    pub async fn add_shard(&mut self, name: &str) -> anyhow::Result<SocketAddr> {
        let addr = self.spawn_shard(name).await?;
        // The shard joins in the background; wait until the coordinator lists it.
        let admin = self.admin().await?;
        for _ in 0..200 {
            let rows = admin.shard_stats().await?;
            if rows.iter().any(|(r, _)| r.addr == addr.to_string()) {
                return Ok(addr);
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        anyhow::bail!("shard {name} at {addr} did not join")
    }

    /// An operator's client (admin role).
    pub async fn admin(&self) -> anyhow::Result<Admin> {
        let id = self.identity(Role::Admin, "test-admin")?;
        Ok(Admin::connect(
            &self.coordinator_addr.to_string(),
            &id,
            self.node_settings("test-admin"),
        )
        .await?)
    }

    /// The PKI directory (for tests that forge or omit certificates).
    pub fn state_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Credentials for `role/name`, signed by the cluster CA.
    pub fn identity(&self, role: Role, name: &str) -> anyhow::Result<Identity> {
        Ok(self.pki.ensure(role, name)?)
    }

    /// Client settings for a worker named `name`.
    pub fn client_config(&self, name: &str) -> anyhow::Result<ClientConfig> {
        Ok(ClientConfig {
            coordinator: self.coordinator_addr.to_string(),
            identity: self.identity(Role::Worker, name)?,
            settings: self.node_settings(name),
        })
    }

    /// Default client settings for node `name`, sending through the cluster's fault plan (if
    /// any) under that name.
    pub fn node_settings(&self, name: &str) -> TransportSettings {
        TransportSettings {
            faults: self.settings.faults.as_ref().map(|f| f.labelled(name)),
            ..TransportSettings::default()
        }
    }

    /// The fault plan that every server and client of the cluster sends through, if any.
    pub fn faults(&self) -> Option<&Faults> {
        self.settings.faults.as_ref()
    }

    /// Connects a worker-role client.
    pub async fn connect(&self, name: &str) -> anyhow::Result<Job> {
        Ok(Job::connect(&self.client_config(name)?).await?)
    }

    /// Stops every server and waits for them.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// `settings` with their fault plan (if any) labelled `name`, so the plan can name the node.
/// A coordinator of `job` over `shards` shard servers that keeps its state in memory, as the
/// tests' in-process clusters run it.
pub(crate) fn in_memory_coordinator(job: JobConfig, shards: u32) -> CoordinatorConfig {
    CoordinatorConfig {
        job,
        shards,
        state_file: None,
        stragglers: Default::default(),
        probe_sockets: true,
    }
}

/// A shard server of the job at `coordinator` on a loopback port, without checkpoints.
pub(crate) fn loopback_shard(coordinator: &SocketAddr) -> ShardConfig {
    ShardConfig {
        coordinator: coordinator.to_string(),
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        advertise: None,
        checkpoint: None,
        checkpoint_every: None,
    }
}

fn labelled(settings: &TransportSettings, name: &str) -> TransportSettings {
    TransportSettings {
        faults: settings.faults.as_ref().map(|f| f.labelled(name)),
        ..settings.clone()
    }
}

/// A job training an MLP on the first `train_samples` Fashion-MNIST images.
pub fn mlp_job(
    layers: &[u32],
    consistency: Consistency,
    optimizer: OptimizerSpec,
    train_samples: u32,
    epochs: u32,
) -> JobConfig {
    let mlp = Mlp {
        layers: layers.to_vec(),
    };
    JobConfig {
        model: mlp.section(),
        tensors: mlp.tensors(),
        chunk_size: 8192,
        optimizer,
        optimizer_groups: Vec::new(),
        schedule: Default::default(),
        consistency,
        batch_size: 64,
        epochs,
        partition_size: 512,
        train_samples,
        seed: 7,
        lease_ms: 2000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
    }
}

/// A job with one zero-initialized tensor of `len` floats cut into chunks of `chunk`, trained
/// with SGD at learning rate 1, so that pushing a gradient of -1 adds exactly 1.
pub fn counter_job(len: u32, chunk: u32, consistency: Consistency) -> JobConfig {
    JobConfig {
        model: ModelSection::custom(),
        tensors: vec![TensorSpec {
            name: "counter".into(),
            shape: vec![len],
            init: Init::Zeros,
        }],
        chunk_size: chunk,
        optimizer: OptimizerSpec::sgd(1.0),
        optimizer_groups: Vec::new(),
        schedule: Default::default(),
        consistency,
        batch_size: 1,
        epochs: 1,
        partition_size: 1,
        train_samples: 1,
        seed: 0,
        lease_ms: 2000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
    }
}

/// The batch of partition `p` that starts at position `start`: `batch` samples, or what is
/// left of the partition.
pub fn batch_span(p: &Partition, start: u32, batch: u32) -> DataSpan {
    DataSpan {
        epoch: p.epoch,
        partition: p.index,
        start,
        end: (start + batch).min(p.start + p.len),
    }
}

/// Trains the rest of partition `p` on a counter job: for each batch of `batch` samples from
/// `from`, pushes -1 for each of the `floats` counters and commits the batch.
pub async fn push_counter_batches(
    s: &mut Session,
    p: &Partition,
    from: u32,
    batch: u32,
    floats: usize,
) -> anyhow::Result<()> {
    let grads = vec![-1.0f32; floats];
    let mut start = from;
    while start < p.start + p.len {
        let sp = batch_span(p, start, batch);
        s.push_span(&grads, sp).await?;
        s.commit_span(sp, 0.0).await?;
        start = sp.end;
    }
    Ok(())
}

/// Asserts that every shard applied each of `samples` samples exactly once in every epoch it
/// reports, and returns the shards' ledgers for further checks.
pub async fn assert_exactly_once(
    job: &Job,
    samples: u64,
) -> anyhow::Result<Vec<(ShardId, Vec<EpochLedger>)>> {
    let all = job.ledgers().await?;
    for (shard, ledgers) in &all {
        for l in ledgers {
            assert_eq!(
                (l.applied, l.duplicates, l.missing),
                (samples, 0, 0),
                "shard {shard} epoch {}",
                l.epoch
            );
        }
    }
    Ok(all)
}

/// The kinds of the membership events of `worker` in `trace`, in order.
pub fn event_kinds(trace: &JobTrace, worker: WorkerId) -> Vec<EventKind> {
    trace
        .events
        .iter()
        .filter(|e| e.worker == worker)
        .map(|e| e.kind)
        .collect()
}

/// Writes `dir/custom.toml`: one epoch of `samples` of the two-layer network of
/// `worker/examples/two_layer.rs` (hidden width 32, SGD, batches of 64) whose `[worker]`
/// program is `bin_dir`'s `edl-test-worker`, pausing `step_ms` before each step. `training`
/// adds lines to its `[training]` table (consistency, partition size, lease).
///
/// # Panics
/// When `edl-test-worker` is not built or the file cannot be written.
pub fn test_worker_job(
    dir: &Path,
    bin_dir: &Path,
    samples: u32,
    step_ms: u32,
    training: &str,
) -> std::path::PathBuf {
    let program = bin_dir.join("edl-test-worker");
    assert!(
        program.is_file(),
        "{} is missing: build the workspace",
        program.display()
    );
    let text = format!(
        "[model]\nkind = \"custom\"\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n\n[training]\n\
         samples = {samples}\nepochs = 1\nbatch_size = 64\n{training}\n\n\
         [[tensor]]\nname = \"fc1.weight\"\nshape = [784, 32]\ninit = \"glorot_uniform\"\n\n\
         [[tensor]]\nname = \"fc1.bias\"\nshape = [32]\ninit = \"zeros\"\n\n\
         [[tensor]]\nname = \"fc2.weight\"\nshape = [32, 10]\ninit = \"glorot_uniform\"\n\n\
         [[tensor]]\nname = \"fc2.bias\"\nshape = [10]\ninit = \"zeros\"\n\n\
         [worker]\ncommand = [{:?}]\nenv = {{ EDL_TEST_STEP_MS = \"{step_ms}\" }}\n",
        program.display().to_string()
    );
    let path = dir.join("custom.toml");
    std::fs::write(&path, text).expect("write the job file");
    path
}

/// True when Debian's `dataset-fashion-mnist` is installed. Without it a test says it was
/// skipped (and returns), unless `EDL_REQUIRE_DATA=1` (set by CI) makes that a failure.
///
/// # Panics
/// When the data is missing and `EDL_REQUIRE_DATA=1`.
pub fn have_fashion_mnist() -> bool {
    if Path::new(edl_worker::data::DEFAULT_DATA_DIR).exists() {
        return true;
    }
    edl_shared::skip::missing(
        "EDL_REQUIRE_DATA",
        "",
        edl_worker::data::DEFAULT_DATA_DIR,
        "apt-get install dataset-fashion-mnist",
    );
    false
}

/// Polls `f` every 20 ms until it gives a value, for up to `limit`: waiting for an event with
/// a deadline, never a fixed sleep.
pub async fn until<T, F, Fut>(limit: std::time::Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f().await? {
            return Ok(v);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "gave up after {limit:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
