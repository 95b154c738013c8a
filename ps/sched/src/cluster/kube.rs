use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::fmt::Debug;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_launch::Signal;
use edl_launch::launch::{self, Binaries, Creds, WorkerLaunch};
use edl_launch::{Exit, JobLaunch, LOCAL_HOST, Placer, ProcRecord, STOP_GRACE, Slot};
use edl_shared::Role;
use edl_shared::contract::WorkerEnv;
use edl_shared::jobfile::WorkerSpec;
use edl_shared::proto::StragglerSettings;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    PersistentVolumeClaimVolumeSource, Pod, PodSpec, ResourceRequirements, Secret,
    SecretVolumeSource, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

mod objects;

pub use objects::*;

/// The Kubernetes version of the API types (`k8s-openapi` feature `v1_37`).
pub const K8S_VERSION: &str = "1.37.0";
/// The coordinator's port (UDP).
pub const COORDINATOR_PORT: u16 = 7070;
/// A shard server's port (UDP).
pub const SHARD_PORT: u16 = 7071;
/// The program serving coordinators and shards, on the image's `PATH`.
pub const PS_PROGRAM: &str = "edl-ps";
/// The worker program of built-in models, on the image's `PATH`.
pub const WORKER_PROGRAM: &str = "edl-worker";
/// Where a pod's Secret is mounted: `ca.pem`, `cert.pem`, `key.pem`.
pub const PKI_DIR: &str = "/etc/edl/pki";
/// Where the coordinator's job file is mounted (`job.toml`).
pub const JOB_DIR: &str = "/etc/edl/job";
/// A pod's state directory (an `emptyDir`).
pub const STATE_DIR: &str = "/var/lib/edl";
/// How long a worker asked to leave may take before it is killed.
pub const WORKER_GRACE: Duration = Duration::from_secs(60);

/// The label every object of this placer carries (`app=edl`).
const APP: (&str, &str) = ("app", "edl");
/// The label naming an object's job.
const JOB_LABEL: &str = "edl/job";
/// The label naming a pod's role: coordinator, shard or worker.
const ROLE_LABEL: &str = "edl/role";
/// The label naming an object's process in its job (`coordinator`, `s0`, `p3`).
const NAME_LABEL: &str = "edl/name";
/// The label naming a worker's slot.
const SLOT_LABEL: &str = "edl/slot";
/// The field manager of server-side apply.
const MANAGER: &str = "edl-sched";
/// The longest job (or slot) part of a name, leaving room for suffixes in 63 characters.
const MAX_LABEL: usize = 40;
/// How long the coordinator's pod may take to run (image pulls included).
const COORDINATOR_START: Duration = Duration::from_secs(120);
/// How long the API server may take to give a Service its ClusterIP.
const CLUSTER_IP: Duration = Duration::from_secs(30);
/// How often a pod or Service is looked at while waiting for it.
const WAIT_STEP: Duration = Duration::from_millis(500);
/// The least time between two listings of the pods by [`KubePlacer::exited`].
const POLL: Duration = Duration::from_secs(1);
/// How long [`KubePlacer::stop_job`] waits for pods to go after their grace period.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// Why a pod in phase `Failed` failed: its container's exit, and the pod's reason.
fn failure(pod: &Pod, ns: &str) -> String {
    let mut parts = Vec::new();
    let status = pod.status.as_ref();
    let terminated = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    if let Some(t) = terminated {
        parts.push(format!("exit code {}", t.exit_code));
        parts.extend(t.reason.clone());
        parts.extend(t.message.clone());
    }
    if let Some(s) = status {
        parts.extend(s.reason.clone());
        parts.extend(s.message.clone());
    }
    let what = if parts.is_empty() {
        "failed".to_string()
    } else {
        format!("failed ({})", parts.join("; "))
    };
    format!("{what}; see `kubectl logs -n {ns} {}`", pod.name_any())
}

/// A pod this placer started or took back, until it is reported ended.
#[derive(Debug)]
struct Tracked {
    job: String,
    name: String,
    /// It was asked to leave.
    stopping: bool,
    /// An earlier scheduler started it.
    adopted: bool,
}

/// The pods started or taken back, by pod name, and the ends found and not yet reported.
#[derive(Debug, Default)]
struct Pods {
    tracked: HashMap<String, Tracked>,
    exits: Vec<Exit>,
    last_poll: Option<Instant>,
}

impl Pods {
    fn end(&mut self, pod: &str, ok: bool, what: impl FnOnce(&Tracked) -> String) {
        if let Some(t) = self.tracked.remove(pod) {
            let what = what(&t);
            self.exits.push(Exit {
                job: t.job,
                name: t.name,
                ok,
                what,
                // A pod's exit code is in its status, not a process's wait status.
                status: None,
            });
        }
    }

    /// Records what a listing of the tracked pods found: those in phase `Succeeded` or
    /// `Failed`, and those gone.
    fn listed(&mut self, pods: &[Pod], ns: &str) {
        let mut seen = HashSet::new();
        for pod in pods {
            let name = pod.name_any();
            match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some("Succeeded") => self.end(&name, true, |_| "exited".into()),
                Some("Failed") => self.end(&name, false, |_| failure(pod, ns)),
                _ => {}
            }
            seen.insert(name);
        }
        let gone: Vec<String> = self
            .tracked
            .keys()
            .filter(|n| !seen.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            let ok = self
                .tracked
                .get(&name)
                .is_some_and(|t| t.stopping || t.adopted);
            self.end(&name, ok, |t| {
                if t.stopping {
                    "stopped (its pod was deleted)".into()
                } else if t.adopted {
                    "exited (status unknown: adopted, its pod is gone)".into()
                } else {
                    "its pod is gone (deleted or evicted)".into()
                }
            });
        }
    }
}

/// Runs jobs as pods in one namespace of a Kubernetes cluster.
///
/// Pods have no process id: the [`ProcRecord`]s it returns carry pid 0, and it knows pods by
/// name (`<job>-<name>`).
pub struct KubePlacer {
    client: Client,
    settings: KubeSettings,
    pods: Pods,
}

impl Debug for KubePlacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubePlacer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl KubePlacer {
    /// A placer creating objects through `client` as `settings` say.
    pub fn new(client: Client, settings: KubeSettings) -> KubePlacer {
        KubePlacer {
            client,
            settings,
            pods: Pods::default(),
        }
    }

    /// A placer with the client of the environment: the pod's service account inside a
    /// cluster, else the current kubeconfig context.
    pub async fn from_env(settings: KubeSettings) -> anyhow::Result<KubePlacer> {
        let client = Client::try_default()
            .await
            .context("cannot configure a Kubernetes client")?;
        Ok(KubePlacer::new(client, settings))
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.settings.namespace)
    }

    fn track(&mut self, job: &str, name: &str, adopted: bool) {
        self.pods.tracked.insert(
            pod_name(job, name),
            Tracked {
                job: job.to_string(),
                name: name.to_string(),
                stopping: false,
                adopted,
            },
        );
    }

    /// Lists the pods matching `selector`.
    async fn list(&self, selector: &str) -> anyhow::Result<Vec<Pod>> {
        let list = self
            .api::<Pod>()
            .list(&ListParams::default().labels(selector))
            .await
            .with_context(|| format!("listing the pods of {selector}"))?;
        Ok(list.items)
    }

    /// The ClusterIP of Service `name`, once the API server has given it one.
    async fn cluster_ip(&self, svc: Service, name: &str) -> anyhow::Result<IpAddr> {
        let api = self.api::<Service>();
        let deadline = Instant::now() + CLUSTER_IP;
        let mut svc = svc;
        loop {
            let ip = svc.spec.as_ref().and_then(|s| s.cluster_ip.as_deref());
            match ip {
                Some("None") => anyhow::bail!("Service {name} is headless"),
                Some(ip) if !ip.is_empty() => {
                    return ip
                        .parse()
                        .with_context(|| format!("Service {name}'s ClusterIP {ip:?}"));
                }
                _ => {}
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "Service {name} got no ClusterIP within {} s",
                CLUSTER_IP.as_secs()
            );
            tokio::time::sleep(WAIT_STEP).await;
            svc = api.get(name).await?;
        }
    }

    /// Waits until pod `name` runs; fails if it ends first.
    async fn wait_running(&self, name: &str, limit: Duration) -> anyhow::Result<()> {
        let api = self.api::<Pod>();
        let deadline = Instant::now() + limit;
        loop {
            let pod = api.get(name).await?;
            match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some("Running") => return Ok(()),
                Some("Failed" | "Succeeded") => {
                    anyhow::bail!("pod {name} {}", failure(&pod, &self.settings.namespace))
                }
                _ => {}
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "pod {name} did not run within {} s; see `kubectl describe pod -n {} {name}`",
                limit.as_secs(),
                self.settings.namespace
            );
            tokio::time::sleep(WAIT_STEP).await;
        }
    }

    /// The Secret of process `name`, from its credentials in `job`'s directory.
    fn secret_of(&self, job: &JobLaunch, role: Role, name: &str) -> anyhow::Result<Secret> {
        let c = job.creds(role, name);
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        Ok(self.settings.pki_secret(
            &job.name,
            name,
            &read(&c.ca)?,
            &read(&c.cert)?,
            &read(&c.key)?,
        ))
    }
}

/// Creates or updates `obj` by server-side apply.
async fn apply<K>(api: &Api<K>, obj: &K) -> anyhow::Result<K>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
    K::DynamicType: Default,
{
    let name = obj.name_any();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
    .with_context(|| format!("applying {} {name}", K::kind(&Default::default())))
}

/// Creates `pod`. Pods are created, not applied: a pod left over with the same name must not
/// pass for a new one.
async fn create_pod(api: &Api<Pod>, pod: &Pod) -> anyhow::Result<()> {
    api.create(&PostParams::default(), pod)
        .await
        .with_context(|| format!("creating pod {}", pod.name_any()))?;
    Ok(())
}

/// Deletes every `K` matching `selector` (one by one: not every kind takes a collection
/// delete); returns how many were found.
async fn delete_all<K>(api: &Api<K>, selector: &str, dp: &DeleteParams) -> anyhow::Result<usize>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let list = api.list(&ListParams::default().labels(selector)).await?;
    for o in &list.items {
        match api.delete(&o.name_any(), dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(list.items.len())
}

/// Deletes the pods matching `selector` with a grace period of [`STOP_GRACE`] and waits for
/// them to go; kills those still there [`STOP_WAIT`] after it.
async fn delete_pods(api: &Api<Pod>, selector: &str) -> anyhow::Result<()> {
    let grace = DeleteParams::default().grace_period(STOP_GRACE.as_secs() as u32);
    delete_all(api, selector, &grace).await?;
    let deadline = Instant::now() + STOP_GRACE + STOP_WAIT;
    loop {
        let left = api.list(&ListParams::default().labels(selector)).await?;
        if left.items.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                selector,
                pods = left.items.len(),
                "pods still there; killing them"
            );
            delete_all(api, selector, &DeleteParams::default().grace_period(0)).await?;
            return Ok(());
        }
        tokio::time::sleep(WAIT_STEP).await;
    }
}

/// Deletes object `name` after `grace` (for a pod, Kubernetes sends SIGTERM at once and
/// SIGKILL after it); one already gone is no error.
async fn delete_one<K>(api: Api<K>, name: String, grace: Duration)
where
    K: Resource + Clone + DeserializeOwned + Debug,
    K::DynamicType: Default,
{
    let dp = DeleteParams::default().grace_period(grace.as_secs() as u32);
    match api.delete(&name, &dp).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => {
            let kind = K::kind(&Default::default()).into_owned();
            tracing::warn!(kind, name, error = %e, "cannot delete");
        }
    }
}

impl Placer for KubePlacer {
    async fn start_servers(
        &mut self,
        job: &JobLaunch,
    ) -> anyhow::Result<(SocketAddr, Vec<ProcRecord>)> {
        let s = self.settings.clone();
        let job_toml = std::fs::read_to_string(job.job_file())
            .with_context(|| format!("reading {}", job.job_file().display()))?;
        apply(&self.api(), &s.job_config_map(&job.name, &job_toml)).await?;
        let mut servers = vec![("coordinator".to_string(), Role::Coordinator)];
        servers.extend((0..job.shards).map(|i| (format!("s{i}"), Role::Shard)));
        let mut coordinator_svc = None;
        let mut records = Vec::new();
        for (name, role) in servers {
            apply(&self.api(), &self.secret_of(job, role, &name)?).await?;
            let (port, pod) = match role {
                Role::Coordinator => (COORDINATOR_PORT, s.coordinator_pod(&job.name, job.shards)),
                _ => (SHARD_PORT, s.shard_pod(&job.name, &name)),
            };
            let svc = apply(&self.api(), &s.server_service(&job.name, &name, port)).await?;
            if role == Role::Coordinator {
                coordinator_svc = Some(svc);
            }
            create_pod(&self.api(), &pod).await?;
            self.track(&job.name, &name, false);
            records.push(ProcRecord {
                name,
                pid: 0,
                slot: None,
            });
        }
        let svc = coordinator_svc.context("no coordinator Service")?;
        let name = pod_name(&job.name, "coordinator");
        let ip = self.cluster_ip(svc, &name).await?;
        self.wait_running(&name, COORDINATOR_START).await?;
        Ok((SocketAddr::new(ip, COORDINATOR_PORT), records))
    }

    /// Creates the worker's Secret and pod (pid 0). The worker reaches the coordinator by its
    /// Service's DNS name, not by `coordinator`.
    async fn start_worker(
        &mut self,
        job: &JobLaunch,
        _coordinator: &SocketAddr,
        name: &str,
        slot: &Slot,
        placement: Option<u64>,
    ) -> anyhow::Result<ProcRecord> {
        let secret = self.secret_of(job, Role::Worker, name)?;
        let pod = self
            .settings
            .worker_pod(&job.name, name, &job.worker, slot, placement);
        apply(&self.api(), &secret).await?;
        if let Err(e) = create_pod(&self.api(), &pod).await {
            delete_one(self.api::<Secret>(), secret.name_any(), Duration::ZERO).await;
            return Err(e);
        }
        self.track(&job.name, name, false);
        Ok(ProcRecord {
            name: name.to_string(),
            pid: 0,
            slot: Some(slot.name.clone()),
        })
    }

    /// Deletes the worker's pod with a grace period of [`WORKER_GRACE`]: Kubernetes sends
    /// SIGTERM, the worker finishes its step and leaves.
    async fn stop_worker(&mut self, job: &str, name: &str) {
        if let Err(e) = self.signal(job, name, Signal::SIGTERM).await {
            tracing::warn!(job, name, error = %format!("{e:#}"), "cannot stop a worker");
        }
    }

    /// SIGTERM is a deletion with [`WORKER_GRACE`] (once: a pod already being stopped is
    /// left to it), SIGKILL one with none; a pod cannot be sent other signals from outside.
    async fn signal(&mut self, job: &str, name: &str, signal: Signal) -> anyhow::Result<bool> {
        let pod = pod_name(job, name);
        let Some(t) = self.pods.tracked.get_mut(&pod) else {
            return Ok(false);
        };
        let grace = match signal {
            Signal::SIGTERM => WORKER_GRACE,
            Signal::SIGKILL => Duration::ZERO,
            other => anyhow::bail!(
                "the Kubernetes placer cannot send {other} to {job}/{name}: a pod takes \
                 SIGTERM and SIGKILL only (as deletions)"
            ),
        };
        if std::mem::replace(&mut t.stopping, true) && signal == Signal::SIGTERM {
            return Ok(true);
        }
        delete_one(self.api::<Pod>(), pod, grace).await;
        Ok(true)
    }

    /// The pods found ended: lists the tracked jobs' pods (at most once a second).
    async fn exited(&mut self) -> Vec<Exit> {
        let due = self.pods.last_poll.is_none_or(|t| t.elapsed() >= POLL);
        if due && !self.pods.tracked.is_empty() {
            self.pods.last_poll = Some(Instant::now());
            let jobs: HashSet<String> = self
                .pods
                .tracked
                .values()
                .map(|t| dns_label(&t.job))
                .collect();
            let jobs: Vec<String> = jobs.into_iter().collect();
            let selector = format!("{}={},{JOB_LABEL} in ({})", APP.0, APP.1, jobs.join(","));
            match self.list(&selector).await {
                Ok(pods) => self.pods.listed(&pods, &self.settings.namespace),
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "cannot list the jobs' pods"),
            }
        }
        std::mem::take(&mut self.pods.exits)
    }

    /// Deletes the job's pods, workers first, then servers, each with a grace period of
    /// [`STOP_GRACE`] and waited for; then its Services, Secrets and ConfigMap.
    async fn stop_job(&mut self, job: &str) {
        self.pods.tracked.retain(|_, t| t.job != job);
        let all = job_selector(job);
        let workers = format!("{all},{ROLE_LABEL}={}", Role::Worker);
        let pods = self.api::<Pod>();
        for selector in [&workers, &all] {
            if let Err(e) = delete_pods(&pods, selector).await {
                tracing::warn!(job, error = %format!("{e:#}"), "cannot delete the job's pods");
            }
        }
        let dp = DeleteParams::default();
        let rest = [
            delete_all(&self.api::<Service>(), &all, &dp).await,
            delete_all(&self.api::<Secret>(), &all, &dp).await,
            delete_all(&self.api::<ConfigMap>(), &all, &dp).await,
        ];
        for e in rest.into_iter().filter_map(Result::err) {
            tracing::warn!(job, error = %format!("{e:#}"), "cannot delete the job's objects");
        }
    }

    /// Takes the job's pods back: returns the names of those that are gone or ended (all of
    /// them when the pods cannot be listed: the scheduler then fails the job).
    async fn adopt(&mut self, job: &str, procs: &[ProcRecord]) -> Vec<String> {
        let pods = match self.list(&job_selector(job)).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(job, error = %format!("{e:#}"), "cannot take the job's pods back");
                return procs.iter().map(|p| p.name.clone()).collect();
            }
        };
        let mut gone = Vec::new();
        for p in procs {
            let name = pod_name(job, &p.name);
            let running = pods.iter().any(|pod| {
                pod.name_any() == name
                    && !matches!(
                        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Succeeded" | "Failed")
                    )
            });
            if running {
                self.track(job, &p.name, true);
            } else {
                gone.push(p.name.clone());
            }
        }
        gone
    }

    /// Does nothing: pods run on without the scheduler.
    fn detach_all(&mut self) {}
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use serde_json::{Value, json};

    use super::*;

    fn settings() -> KubeSettings {
        KubeSettings {
            namespace: "edl".into(),
            image: "registry.example/edl:1".into(),
            gpus: true,
            data_dir: "/data/fashion-mnist".into(),
            data_claim: Some("datasets".into()),
            worker_args: vec!["--give-up-after".into(), "600".into()],
        }
    }

    /// A job's own program: a command in its own image, with its env and two GPUs.
    fn program() -> WorkerSpec {
        WorkerSpec {
            command: vec![
                "python3".into(),
                "train.py".into(),
                "--lr".into(),
                "0.1".into(),
            ],
            env: [("OMP_NUM_THREADS".to_string(), "1".to_string())].into(),
            image: Some("registry.example/edl-torch:1".into()),
            gpus: Some(2),
        }
    }

    fn slot(host: &str) -> Slot {
        Slot {
            name: "gpu0".into(),
            host: host.into(),
            devices: None,
        }
    }

    fn to_json(o: &impl Serialize) -> Value {
        serde_json::to_value(o).expect("serialize")
    }

    fn is_dns_1035(s: &str) -> bool {
        s.len() <= 63
            && s.starts_with(|c: char| c.is_ascii_lowercase())
            && s.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    }

    /// The value after `flag` in `args`, checking that the flag appears once.
    fn flag<'a>(args: &'a Value, flag: &str) -> &'a str {
        let args = args.as_array().expect("args");
        let at: Vec<usize> = (0..args.len()).filter(|&i| args[i] == flag).collect();
        assert_eq!(at.len(), 1, "{flag} in {args:?}");
        args[at[0] + 1].as_str().expect("a string")
    }

    #[test]
    fn names_are_dns_labels() {
        assert_eq!(dns_label("j1"), "j1");
        assert_eq!(pod_name("j1", "p3"), "j1-p3");
        let odd = [
            "My_Job.v2",
            "a_b",
            "a.b",
            "1job",
            "-x-",
            "A",
            &"n".repeat(64),
        ];
        for s in odd {
            let l = dns_label(s);
            assert!(is_dns_1035(&l) && l.len() <= MAX_LABEL, "{s:?} -> {l:?}");
            assert_eq!(l, dns_label(s), "stable");
        }
        assert_ne!(dns_label("a_b"), dns_label("a-b"));
        assert_ne!(dns_label("a_b"), dns_label("a.b"));
        assert_ne!(dns_label("A"), dns_label("a"));
        // The longest names still fit a Service name (63).
        let job = "J".repeat(64);
        assert!(is_dns_1035(&pod_name(&job, "coordinator")));
        assert!(is_dns_1035(&pod_name(&job, &format!("p{}", u64::MAX))));
    }

    #[test]
    fn coordinator_pod_and_service() {
        let s = settings();
        let pod = to_json(&s.coordinator_pod("j1", 2));
        assert_eq!(pod["apiVersion"], "v1");
        assert_eq!(pod["kind"], "Pod");
        assert_eq!(pod["metadata"]["name"], "j1-coordinator");
        assert_eq!(pod["metadata"]["namespace"], "edl");
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels["app"], "edl");
        assert_eq!(labels["edl/job"], "j1");
        assert_eq!(labels["edl/role"], "coordinator");
        let spec = &pod["spec"];
        assert_eq!(spec["restartPolicy"], "Never");
        assert_eq!(spec["automountServiceAccountToken"], false);
        let c = &spec["containers"][0];
        assert_eq!(c["image"], "registry.example/edl:1");
        assert_eq!(c["command"], json!(["edl-ps"]));
        assert_eq!(c["args"][0], "coordinator");
        assert_eq!(flag(&c["args"], "--listen"), "0.0.0.0:7070");
        assert_eq!(flag(&c["args"], "--shards"), "2");
        assert_eq!(flag(&c["args"], "--job"), "/etc/edl/job/job.toml");
        assert_eq!(flag(&c["args"], "--state-dir"), "/var/lib/edl");
        assert_eq!(flag(&c["args"], "--ca"), "/etc/edl/pki/ca.pem");
        assert_eq!(flag(&c["args"], "--cert"), "/etc/edl/pki/cert.pem");
        assert_eq!(flag(&c["args"], "--key"), "/etc/edl/pki/key.pem");
        assert_eq!(
            c["ports"],
            json!([{"name": "quic", "containerPort": 7070, "protocol": "UDP"}])
        );
        assert_eq!(
            c["volumeMounts"],
            json!([
                {"name": "pki", "mountPath": "/etc/edl/pki", "readOnly": true},
                {"name": "state", "mountPath": "/var/lib/edl"},
                {"name": "job", "mountPath": "/etc/edl/job", "readOnly": true},
            ])
        );
        assert_eq!(
            spec["volumes"],
            json!([
                {"name": "pki", "secret": {"secretName": "j1-coordinator-pki"}},
                {"name": "state", "emptyDir": {}},
                {"name": "job", "configMap": {"name": "j1-job"}},
            ])
        );
        assert!(c.get("resources").is_none() && spec.get("nodeSelector").is_none());

        let svc = to_json(&s.server_service("j1", "coordinator", COORDINATOR_PORT));
        assert_eq!(svc["kind"], "Service");
        assert_eq!(svc["metadata"]["name"], "j1-coordinator");
        assert_eq!(svc["spec"]["type"], "ClusterIP");
        assert_eq!(
            svc["spec"]["ports"],
            json!([{"name": "quic", "port": 7070, "targetPort": 7070, "protocol": "UDP"}])
        );
        // The selector picks the coordinator's pod, by labels it has.
        let selector = svc["spec"]["selector"].as_object().expect("selector");
        assert_eq!(selector.len(), 4);
        for (k, v) in selector {
            assert_eq!(&labels[k], v, "{k}");
        }
    }

    #[test]
    fn shard_pod_and_service() {
        let s = settings();
        let pod = to_json(&s.shard_pod("j1", "s0"));
        assert_eq!(pod["metadata"]["name"], "j1-s0");
        assert_eq!(pod["metadata"]["labels"]["edl/role"], "shard");
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["command"], json!(["edl-ps"]));
        assert_eq!(c["args"][0], "shard");
        assert_eq!(flag(&c["args"], "--name"), "s0");
        assert_eq!(flag(&c["args"], "--listen"), "0.0.0.0:7071");
        assert_eq!(
            flag(&c["args"], "--coordinator"),
            "j1-coordinator.edl.svc:7070"
        );
        assert_eq!(flag(&c["args"], "--advertise"), "j1-s0.edl.svc:7071");
        assert_eq!(flag(&c["args"], "--key"), "/etc/edl/pki/key.pem");
        assert_eq!(c["ports"][0]["containerPort"], 7071);
        assert_eq!(c["ports"][0]["protocol"], "UDP");
        assert_eq!(
            pod["spec"]["volumes"][0]["secret"]["secretName"],
            "j1-s0-pki"
        );
        let svc = to_json(&s.server_service("j1", "s0", SHARD_PORT));
        assert_eq!(svc["metadata"]["name"], "j1-s0");
        assert_eq!(svc["spec"]["selector"]["edl/name"], "s0");
        assert_eq!(svc["spec"]["selector"]["edl/role"], "shard");
        assert_eq!(svc["spec"]["ports"][0]["port"], 7071);
    }

    #[test]
    fn worker_pod() {
        let s = settings();
        let pod =
            to_json(&s.worker_pod("j1", "p7", &WorkerSpec::default(), &slot("node-a"), Some(7)));
        assert_eq!(pod["metadata"]["name"], "j1-p7");
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels["app"], "edl");
        assert_eq!(labels["edl/job"], "j1");
        assert_eq!(labels["edl/role"], "worker");
        assert_eq!(labels["edl/slot"], "gpu0");
        let spec = &pod["spec"];
        assert_eq!(
            spec["nodeSelector"],
            json!({"kubernetes.io/hostname": "node-a"})
        );
        assert_eq!(spec["terminationGracePeriodSeconds"], 60);
        let c = &spec["containers"][0];
        assert_eq!(c["command"], json!(["edl-worker"]));
        assert_eq!(c["resources"], json!({"limits": {"nvidia.com/gpu": "1"}}));
        assert!(c.get("ports").is_none());
        let args = &c["args"];
        assert_eq!(flag(args, "--coordinator"), "j1-coordinator.edl.svc:7070");
        assert_eq!(flag(args, "--name"), "p7");
        assert_eq!(flag(args, "--placement"), "7");
        assert_eq!(flag(args, "--data-dir"), "/data/fashion-mnist");
        assert_eq!(flag(args, "--cert"), "/etc/edl/pki/cert.pem");
        assert_eq!(flag(args, "--give-up-after"), "600");
        assert_eq!(
            c["volumeMounts"][2],
            json!({"name": "data", "mountPath": "/data/fashion-mnist", "readOnly": true})
        );
        assert_eq!(
            spec["volumes"][2],
            json!({"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": true}})
        );

        // On this host's slots and without GPUs: no node, no GPU.
        let plain = KubeSettings {
            gpus: false,
            data_claim: None,
            ..settings()
        };
        let pod = to_json(&plain.worker_pod(
            "My_Job",
            "p1",
            &WorkerSpec::default(),
            &slot(LOCAL_HOST),
            Some(1),
        ));
        let name = pod["metadata"]["name"].as_str().expect("name");
        assert!(
            name.starts_with("my-job-") && name.ends_with("-p1"),
            "{name}"
        );
        assert!(pod["spec"].get("nodeSelector").is_none());
        assert!(pod["spec"]["containers"][0].get("resources").is_none());
        assert_eq!(pod["spec"]["volumes"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn secret_and_config_map() {
        let s = settings();
        let secret = to_json(&s.pki_secret("j1", "p7", b"CA", b"CERT", b"KEY"));
        assert_eq!(secret["kind"], "Secret");
        assert_eq!(secret["metadata"]["name"], "j1-p7-pki");
        assert_eq!(secret["metadata"]["labels"]["edl/job"], "j1");
        assert_eq!(secret["type"], "Opaque");
        // base64 of the PEM files.
        assert_eq!(
            secret["data"],
            json!({"ca.pem": "Q0E=", "cert.pem": "Q0VSVA==", "key.pem": "S0VZ"})
        );
        let cm = to_json(&s.job_config_map("j1", "[model]\n"));
        assert_eq!(cm["kind"], "ConfigMap");
        assert_eq!(cm["metadata"]["name"], "j1-job");
        assert_eq!(cm["data"]["job.toml"], "[model]\n");
        assert_eq!(job_selector("j1"), "app=edl,edl/job=j1");
    }

    /// Writes every kind of object the placer creates as JSON (into `$EDL_K8S_OBJECTS_DIR`
    /// when it is set, to look at them) and checks them with the offline schema validator
    /// `kubernetes-validate` (PyPI; `$KUBERNETES_VALIDATE` names it if it is not on `PATH`)
    /// against the Kubernetes version the placer is built for, strictly: an unknown field is
    /// an error, and so is a kind it has no schema for. Without the validator the test is
    /// skipped, unless `EDL_REQUIRE_K8S_VALIDATE=1` (CI installs it).
    #[test]
    fn objects_pass_the_offline_schema_validator() {
        let validator =
            std::env::var("KUBERNETES_VALIDATE").unwrap_or_else(|_| "kubernetes-validate".into());
        let found = std::process::Command::new(&validator)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            edl_shared::skip::missing(
                "EDL_REQUIRE_K8S_VALIDATE",
                "",
                &validator,
                "pip install kubernetes-validate",
            );
            return;
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = std::env::var_os("EDL_K8S_OBJECTS_DIR")
            .map_or_else(|| tmp.path().to_path_buf(), PathBuf::from);
        std::fs::create_dir_all(&dir).expect("create the objects directory");
        let s = settings();
        let plain = KubeSettings {
            gpus: false,
            data_claim: None,
            ..settings()
        };
        let pem = b"-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n";
        let objects = [
            (
                "configmap-job",
                to_json(&s.job_config_map("j1", "[model]\n")),
            ),
            (
                "secret-coordinator",
                to_json(&s.pki_secret("j1", "coordinator", pem, pem, pem)),
            ),
            (
                "service-coordinator",
                to_json(&s.server_service("j1", "coordinator", COORDINATOR_PORT)),
            ),
            ("pod-coordinator", to_json(&s.coordinator_pod("j1", 2))),
            (
                "service-shard",
                to_json(&s.server_service("j1", "s0", SHARD_PORT)),
            ),
            ("pod-shard", to_json(&s.shard_pod("j1", "s0"))),
            (
                "pod-worker-gpu",
                to_json(&s.worker_pod(
                    "j1",
                    "p7",
                    &WorkerSpec::default(),
                    &slot("node-a"),
                    Some(7),
                )),
            ),
            (
                "pod-worker-local",
                to_json(&plain.worker_pod(
                    "My_Job.2",
                    "p1",
                    &WorkerSpec::default(),
                    &slot(LOCAL_HOST),
                    Some(1),
                )),
            ),
            (
                "pod-worker-program",
                to_json(&s.worker_pod("j1", "p8", &program(), &slot("node-a"), Some(8))),
            ),
        ];
        let mut files = Vec::new();
        for (name, o) in objects {
            let path = dir.join(format!("{name}.json"));
            let text = serde_json::to_string_pretty(&o).expect("JSON");
            std::fs::write(&path, text).expect("write an object");
            files.push(path);
        }
        let out = std::process::Command::new(&validator)
            .args(["--strict", "-k", K8S_VERSION])
            .args(&files)
            .output()
            .expect("run the validator");
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{report}");
        assert!(out.status.success(), "{report}");
        // It exits 0 for a kind it has no schema for, with a warning: that fails here.
        assert!(
            !report
                .lines()
                .any(|l| l.starts_with("ERROR") || l.starts_with("WARN") || l.starts_with("FATAL")),
            "{report}"
        );
        let passed = report.lines().filter(|l| l.contains("passed")).count();
        assert_eq!(passed, files.len(), "{report}");
    }

    /// A stand-in for the API server: core/v1 objects of one namespace in memory; create,
    /// server-side apply (as a replace), get, list by label selector, delete.
    #[derive(Default)]
    struct Fake {
        /// By (resource, name).
        objects: Mutex<BTreeMap<(String, String), Value>>,
        next_ip: Mutex<u8>,
        /// The names deleted, in order.
        deleted: Mutex<Vec<String>>,
    }

    fn status(code: u16, reason: &str) -> (u16, Value) {
        let s = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": reason, "reason": reason, "code": code});
        (code, s)
    }

    fn decode(q: &str) -> String {
        let b = q.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < b.len() => {
                    let hex = std::str::from_utf8(&b[i + 1..i + 3]).expect("hex");
                    out.push(u8::from_str_radix(hex, 16).expect("hex"));
                    i += 2;
                }
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8(out).expect("utf-8")
    }

    /// Whether `labels` match `selector` (`k=v` and `k in (a,b)` terms, comma-separated).
    fn matches(selector: &str, labels: &Value) -> bool {
        let mut terms = Vec::new();
        let (mut depth, mut start) = (0, 0);
        for (i, c) in selector.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    terms.push(&selector[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        terms.push(&selector[start..]);
        terms.iter().filter(|t| !t.is_empty()).all(|t| {
            if let Some((k, vs)) = t.split_once(" in (") {
                let v = labels[k.trim()].as_str().unwrap_or("");
                vs.trim_end_matches(')').split(',').any(|x| x.trim() == v)
            } else {
                let (k, v) = t.split_once('=').expect("k=v");
                labels[k] == v
            }
        })
    }

    impl Fake {
        fn handle(&self, method: &str, uri: &http::Uri, body: &[u8]) -> (u16, Value) {
            let path: Vec<&str> = uri.path().trim_start_matches('/').split('/').collect();
            let (res, name) = match path.as_slice() {
                ["api", "v1", "namespaces", "edl", res] => (res.to_string(), None),
                ["api", "v1", "namespaces", "edl", res, name] => {
                    (res.to_string(), Some(name.to_string()))
                }
                _ => return status(404, "NotFound"),
            };
            let mut objects = self.objects.lock().expect("lock");
            match (method, name) {
                ("GET", Some(n)) => match objects.get(&(res, n)) {
                    Some(o) => (200, o.clone()),
                    None => status(404, "NotFound"),
                },
                ("GET", None) => {
                    let selector = uri
                        .query()
                        .unwrap_or("")
                        .split('&')
                        .find_map(|kv| kv.strip_prefix("labelSelector="))
                        .map(decode)
                        .unwrap_or_default();
                    let items: Vec<Value> = objects
                        .iter()
                        .filter(|((r, _), o)| {
                            *r == res && matches(&selector, &o["metadata"]["labels"])
                        })
                        .map(|(_, o)| o.clone())
                        .collect();
                    (
                        200,
                        json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items}),
                    )
                }
                ("POST", None) | ("PATCH", Some(_)) => {
                    let mut o: Value = serde_json::from_slice(body).expect("an object");
                    let n = o["metadata"]["name"].as_str().expect("name").to_string();
                    let old = objects.get(&(res.clone(), n.clone()));
                    if method == "POST" && old.is_some() {
                        return status(409, "AlreadyExists");
                    }
                    if res == "services" {
                        let ip = match old {
                            Some(old) => old["spec"]["clusterIP"].clone(),
                            None => {
                                let mut next = self.next_ip.lock().expect("lock");
                                *next += 1;
                                json!(format!("10.96.0.{next}"))
                            }
                        };
                        o["spec"]["clusterIP"] = ip;
                    }
                    if res == "pods" {
                        o["status"] = json!({"phase": "Running"});
                    }
                    objects.insert((res, n), o.clone());
                    (if method == "POST" { 201 } else { 200 }, o)
                }
                ("DELETE", Some(n)) => {
                    self.deleted.lock().expect("lock").push(n.clone());
                    match objects.remove(&(res, n)) {
                        Some(o) => (200, o),
                        None => status(404, "NotFound"),
                    }
                }
                _ => status(405, "MethodNotAllowed"),
            }
        }

        fn names(&self, res: &str) -> Vec<String> {
            let objects = self.objects.lock().expect("lock");
            objects
                .keys()
                .filter(|(r, _)| r == res)
                .map(|(_, n)| n.clone())
                .collect()
        }

        fn set_phase(&self, pod: &str, phase: &str) {
            let mut objects = self.objects.lock().expect("lock");
            let o = objects
                .get_mut(&("pods".to_string(), pod.to_string()))
                .expect("the pod");
            o["status"] = json!({"phase": phase, "containerStatuses": [{
                "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": if phase == "Failed" { 3 } else { 0 }}}
            }]});
        }

        fn remove(&self, res: &str, name: &str) {
            let mut objects = self.objects.lock().expect("lock");
            objects.remove(&(res.to_string(), name.to_string()));
        }
    }

    fn fake_client(fake: Arc<Fake>) -> Client {
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let fake = fake.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect_bytes().await.expect("a request body");
                let (code, v) = fake.handle(parts.method.as_str(), &parts.uri, &body);
                let body = kube::client::Body::from(serde_json::to_vec(&v).expect("JSON"));
                let resp = http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(body)
                    .expect("a response");
                Ok::<_, Infallible>(resp)
            }
        });
        Client::new(service, "edl")
    }

    /// Calls `exited` until `n` exits are reported (at most 10 s).
    async fn exits(placer: &mut KubePlacer, n: usize) -> Vec<Exit> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut out = Vec::new();
        while out.len() < n {
            assert!(Instant::now() < deadline, "only {out:?}");
            out.extend(placer.exited().await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        out
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The placer's calls, against the stand-in API server: servers, workers, ends reported
    /// once, a worker stopped, a pod that cannot be created, pods taken back, a worker stopped
    /// and a job stopped while a pod is being created.
    #[tokio::test]
    async fn placer_against_a_stand_in_api_server() {
        let dir = tempfile::tempdir().expect("tempdir");
        let job = JobLaunch {
            name: "j1".into(),
            dir: dir.path().join("j1"),
            shards: 1,
            worker: WorkerSpec::default(),
            workdir: dir.path().into(),
        };
        std::fs::create_dir_all(job.pki()).expect("pki dir");
        std::fs::write(job.job_file(), "[model]\n").expect("job file");
        std::fs::write(job.pki().join("ca.pem"), "CA").expect("ca");
        let creds = [
            (Role::Coordinator, "coordinator"),
            (Role::Shard, "s0"),
            (Role::Worker, "p1"),
            (Role::Worker, "p2"),
            (Role::Worker, "p3"),
            (Role::Worker, "p4"),
            (Role::Worker, "p5"),
            (Role::Worker, "p6"),
        ];
        for (role, n) in creds {
            let c = job.creds(role, n);
            std::fs::write(&c.cert, format!("CERT {n}")).expect("cert");
            std::fs::write(&c.key, format!("KEY {n}")).expect("key");
        }
        let fake = Arc::new(Fake::default());
        let mut placer = KubePlacer::new(fake_client(fake.clone()), settings());

        let (addr, procs) = placer.start_servers(&job).await.expect("servers");
        assert_eq!(addr, SocketAddr::from(([10, 96, 0, 1], COORDINATOR_PORT)));
        let names: Vec<_> = procs.iter().map(|p| (p.name.as_str(), p.pid)).collect();
        assert_eq!(names, [("coordinator", 0), ("s0", 0)]);
        assert_eq!(fake.names("configmaps"), ["j1-job"]);
        assert_eq!(fake.names("services"), ["j1-coordinator", "j1-s0"]);
        assert_eq!(fake.names("secrets"), ["j1-coordinator-pki", "j1-s0-pki"]);
        assert_eq!(fake.names("pods"), ["j1-coordinator", "j1-s0"]);

        // Workers; one ends, one's pod vanishes.
        for (i, w) in ["p1", "p2", "p3"].into_iter().enumerate() {
            let rec = placer
                .start_worker(&job, &addr, w, &slot("node-a"), Some(i as u64 + 1))
                .await
                .expect("worker");
            assert_eq!((rec.pid, rec.slot.as_deref()), (0, Some("gpu0")));
        }
        assert_eq!(fake.names("pods").len(), 5);
        let secret =
            fake.objects.lock().expect("lock")[&("secrets".into(), "j1-p1-pki".into())].clone();
        assert_eq!(secret["data"]["cert.pem"], "Q0VSVCBwMQ=="); // "CERT p1"
        fake.set_phase("j1-p1", "Succeeded");
        fake.remove("pods", "j1-p2");
        let mut got = exits(&mut placer, 2).await;
        got.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!((got[0].name.as_str(), got[0].ok), ("p1", true));
        assert_eq!((got[1].name.as_str(), got[1].ok), ("p2", false));
        assert!(got[1].what.contains("gone"), "{}", got[1].what);

        // A worker asked to leave: its pod is deleted, then reported stopped.
        placer.stop_worker("j1", "p3").await;
        until("p3 deleted", || {
            !fake.names("pods").contains(&"j1-p3".into())
        })
        .await;
        let got = exits(&mut placer, 1).await;
        assert_eq!((got[0].name.as_str(), got[0].ok), ("p3", true), "{got:?}");

        // A server fails; ends are reported once.
        fake.set_phase("j1-s0", "Failed");
        let got = exits(&mut placer, 1).await;
        assert_eq!((got[0].name.as_str(), got[0].ok), ("s0", false));
        assert!(got[0].what.contains("exit code 3"), "{}", got[0].what);
        tokio::time::sleep(POLL * 2).await;
        let mut again = placer.exited().await;
        again.extend(placer.exited().await);
        assert!(again.is_empty(), "{again:?}");

        // A pod that cannot be created (the name is taken) is an error, and leaves no Secret.
        fake.objects.lock().expect("lock").insert(
            ("pods".into(), "j1-p4".into()),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j1-p4"}}),
        );
        let e = placer
            .start_worker(&job, &addr, "p4", &slot("node-a"), Some(4))
            .await
            .expect_err("the pod's name is taken");
        assert!(format!("{e:#}").contains("creating pod j1-p4"), "{e:#}");
        assert!(!fake.names("secrets").contains(&"j1-p4-pki".into()));
        fake.remove("pods", "j1-p4");

        // Taken back after a restart: a pod that is gone is named at once.
        let mut back = KubePlacer::new(fake_client(fake.clone()), settings());
        let recs = [("coordinator", None), ("p1", Some("gpu0"))].map(|(n, s)| ProcRecord {
            name: n.into(),
            pid: 0,
            slot: s.map(Into::into),
        });
        fake.remove("pods", "j1-p1");
        assert_eq!(back.adopt("j1", &recs).await, ["p1"]);
        assert!(back.exited().await.is_empty(), "the coordinator runs");

        // A job's own program in its own image, with the contract's environment.
        let custom = JobLaunch {
            worker: program(),
            ..job.clone()
        };
        placer
            .start_worker(&custom, &addr, "p5", &slot("node-a"), Some(5))
            .await
            .expect("worker");
        let pod = fake.objects.lock().expect("lock")[&("pods".into(), "j1-p5".into())].clone();
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["image"], "registry.example/edl-torch:1");
        assert_eq!(c["command"], json!(["python3"]));
        assert_eq!(c["args"], json!(["train.py", "--lr", "0.1"]));
        assert_eq!(c["resources"], json!({"limits": {"nvidia.com/gpu": "2"}}));
        let env: BTreeMap<String, String> = c["env"]
            .as_array()
            .expect("env")
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap_or("").into(),
                    v["value"].as_str().unwrap_or("").into(),
                )
            })
            .collect();
        assert_eq!(env["EDL_COORDINATOR"], "j1-coordinator.edl.svc:7070");
        assert_eq!(env["EDL_CERT"], "/etc/edl/pki/cert.pem");
        assert_eq!(
            (env["EDL_JOB"].as_str(), env["EDL_NAME"].as_str()),
            ("j1", "p5")
        );
        assert_eq!(env["EDL_PLACEMENT"], "5");
        assert_eq!(env["OMP_NUM_THREADS"], "1");

        // Asked to leave: its pod is deleted, then reported stopped.
        placer.stop_worker("j1", "p5").await;
        let deleted = || fake.deleted.lock().expect("lock").clone();
        assert!(deleted().contains(&"j1-p5".into()));
        let got = exits(&mut placer, 1).await;
        assert_eq!((got[0].name.as_str(), got[0].ok), ("p5", true), "{got:?}");

        // The job stopped: every object goes.
        placer
            .start_worker(&job, &addr, "p6", &slot("node-a"), Some(6))
            .await
            .expect("worker");
        placer.stop_job("j1").await;
        for res in ["pods", "services", "secrets", "configmaps"] {
            assert!(fake.names(res).is_empty(), "{res}: {:?}", fake.names(res));
        }
    }
}
