//! `edl-bench load`: a real cluster (a coordinator and shard servers, each its own `edl-ps`
//! process) under many concurrent clients for a set time, optionally with a hostile client
//! beside them ([`hostile`]).
//!
//! Each client is a registered worker with its own certificate and connections, all in this
//! process's runtime, looping pull, push, advance under ASP (nobody waits on clocks, so the
//! figures are the servers'). The job is a counter: one zero-initialized tensor trained by SGD
//! at learning rate 1, and every push is -1 in every float, so each float ends equal to the
//! number of pushes applied to it. Afterwards every float is read back and compared with the
//! pushes the clients saw acknowledged: one that falls short is a lost update. A push that
//! failed may or may not have been applied (on some shards and not others, even), so the
//! floats may exceed the acknowledged count by at most the failed pushes.

pub(crate) mod cluster;
pub mod hostile;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_shared::Role;
use edl_shared::proto::{Clock, ErrorCode};
use edl_shared::transport::{CallError, TransportSettings};
use edl_worker::{ClientError, Job, Session};
use serde::Serialize;
use tokio::task::JoinSet;

pub use cluster::{ServerMemory, Spec};

use crate::stats::Samples;
use cluster::Cluster;

/// How long one client operation may take before it counts as failed ("timed out").
const OP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client may take to connect and register.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// The pause after a failed operation, so that a refusing server is not hammered.
const BACKOFF: Duration = Duration::from_millis(20);
/// How long the clients may take to finish their last operation and leave.
const WIND_DOWN: Duration = Duration::from_secs(60);
/// The largest count an f32 holds exactly: past it the check could not be exact.
const EXACT_F32: u64 = 1 << 24;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Concurrent clients.
    pub clients: usize,
    /// How long they run.
    pub duration: Duration,
    /// The servers.
    pub spec: Spec,
    /// The hostile client, if any.
    pub hostile: Option<hostile::Plan>,
    /// Transport settings of the clients.
    pub settings: TransportSettings,
}

impl Plan {
    /// 64 clients for 60 s on a 64 Ki-float counter over 2 shards; with `hostile`, 256
    /// half-sent frames and 256 idle connections. `quick`: 4 clients for 3 s, 16 of each.
    pub fn standard(quick: bool, hostile: bool, settings: TransportSettings) -> Plan {
        let held = if quick { 16 } else { 256 };
        Plan {
            clients: if quick { 4 } else { 64 },
            duration: Duration::from_secs(if quick { 3 } else { 60 }),
            spec: Spec {
                shards: 2,
                floats: 64 << 10,
                bin_dir: None,
            },
            hostile: hostile.then_some(hostile::Plan {
                frames: held,
                idle: held,
            }),
            settings,
        }
    }
}

/// Latencies of one kind of operation.
#[derive(Clone, Debug, Serialize)]
pub struct OpStats {
    /// `pull`, `push` or `advance`.
    pub op: String,
    /// Completed successfully.
    pub ok: u64,
    /// Per second of the run, all clients together.
    pub per_s: f64,
    /// Median latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
}

/// The check of every float against the acknowledged pushes.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// Pushes acknowledged to the clients.
    pub acknowledged: u64,
    /// Pushes that failed (timed out, refused, connection lost): applied or not.
    pub failed: u64,
    /// The smallest float read back.
    pub min: f64,
    /// The largest float read back.
    pub max: f64,
    /// Acknowledged pushes missing from some float (`acknowledged - min`, or 0).
    pub lost_updates: u64,
    /// Floats holding fewer than the acknowledged pushes.
    pub floats_short: u64,
    /// Updates beyond every push sent, acknowledged or failed (`max - acknowledged - failed`,
    /// or 0): an update applied twice.
    pub extra_updates: u64,
}

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// Clients asked for.
    pub clients: usize,
    /// Clients that connected, registered and ran.
    pub clients_running: usize,
    /// Shard servers.
    pub shards: u32,
    /// Floats of the counter tensor.
    pub floats: u32,
    /// Keys the tensor is cut into.
    pub keys: u64,
    /// The measured run, seconds.
    pub seconds: f64,
    /// Pull, push and advance.
    pub ops: Vec<OpStats>,
    /// Failed operations by `op: kind`.
    pub errors: BTreeMap<String, u64>,
    /// Clients registered again after the coordinator dropped them.
    pub reregistered: u64,
    /// Every float against the acknowledged pushes.
    pub check: Check,
    /// Each server's memory.
    pub servers: Vec<ServerMemory>,
    /// What the hostile client did, if there was one.
    pub hostile: Option<hostile::Report>,
}

impl Results {
    /// The figures of one operation.
    pub fn op(&self, op: &str) -> Option<&OpStats> {
        self.ops.iter().find(|o| o.op == op)
    }

    /// Why the run failed its own checks, if it did: lost or extra updates, a server that did
    /// not stop cleanly.
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.check.lost_updates > 0 {
            out.push(format!(
                "{} acknowledged pushes are missing from {} floats",
                self.check.lost_updates, self.check.floats_short
            ));
        }
        if self.check.extra_updates > 0 {
            out.push(format!(
                "{} updates more than were ever pushed",
                self.check.extra_updates
            ));
        }
        for s in &self.servers {
            if let Some(p) = &s.problem {
                out.push(format!("{}: {p}", s.name));
            }
        }
        out
    }
}

/// Runs the plan: starts the cluster (and the hostile client), connects and registers the
/// clients, lets them run for the plan's duration, stops them, checks every float, and stops
/// the servers. The state directory, with every server's log, is removed unless the run
/// failed.
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    anyhow::ensure!(plan.clients > 0, "at least one client");
    let mut cluster = Cluster::start(&plan.spec).await?;
    eprintln!(
        "load: cluster up (state and logs in {})",
        cluster.state_dir().display()
    );
    let outcome = drive(plan, &mut cluster).await;
    let state_dir = cluster.state_dir().to_path_buf();
    let servers = cluster.stop().await;
    let mut results = outcome.with_context(|| {
        format!(
            "the servers' logs are in {}",
            state_dir.join("logs").display()
        )
    })?;
    results.servers = servers;
    if results.failures().is_empty() {
        let _ = std::fs::remove_dir_all(&state_dir);
    } else {
        eprintln!(
            "load: the servers' logs are in {}",
            state_dir.join("logs").display()
        );
    }
    Ok(results)
}

/// Everything between starting the servers and stopping them.
async fn drive(plan: &Plan, cluster: &mut Cluster) -> anyhow::Result<Results> {
    let addrs = cluster.addrs();
    let attacker = match &plan.hostile {
        Some(h) => Some(hostile::Hostile::start(
            *h,
            &cluster.identity(Role::Worker, "hostile")?,
            &plan.settings,
            addrs.get(1..).unwrap_or_default(),
            &addrs,
        )?),
        None => None,
    };
    let mut connecting = JoinSet::new();
    for i in 0..plan.clients {
        let name = format!("w{i}");
        let cfg = cluster.client_config(&name, &plan.settings)?;
        connecting.spawn(async move {
            let joined = tokio::time::timeout(CONNECT_TIMEOUT, async {
                let job = Job::connect(&cfg).await?;
                let session = job.clone().register(&name).await?;
                Ok::<_, ClientError>((job, session))
            })
            .await;
            (name, joined)
        });
    }
    let mut ready = Vec::new();
    let mut tally = Tally::default();
    while let Some(joined) = connecting.join_next().await {
        match joined? {
            (name, Ok(Ok((job, session)))) => ready.push((name, job, session)),
            (_, Ok(Err(e))) => tally.error("connect", Failure::Client(e).kind()),
            (_, Err(_)) => tally.error("connect", Failure::TimedOut(CONNECT_TIMEOUT).kind()),
        }
    }
    anyhow::ensure!(
        !ready.is_empty(),
        "no client could connect and register: {:?}",
        tally.errors
    );
    let clients_running = ready.len();
    let keys = ready[0].1.layout().num_keys();
    let floats = ready[0].1.param_count();
    eprintln!(
        "load: {clients_running} clients registered; running for {:.0} s",
        plan.duration.as_secs_f64()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let mut running = JoinSet::new();
    for (name, job, session) in ready {
        running.spawn(client(name, job, session, floats, stop.clone()));
    }
    let started = Instant::now();
    tokio::time::sleep(plan.duration).await;
    stop.store(true, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    let hostile_report = attacker.as_ref().map(hostile::Hostile::report);
    let wound_down = tokio::time::timeout(WIND_DOWN, async {
        while let Some(t) = running.join_next().await {
            tally.merge(t?);
        }
        anyhow::Ok(())
    })
    .await;
    if let Some(h) = attacker {
        h.stop().await;
    }
    wound_down.map_err(|_| anyhow::anyhow!("the clients did not stop within {WIND_DOWN:?}"))??;
    cluster.check()?;

    let check = check(cluster, plan, floats, &tally).await?;
    let ops = [
        ("pull", tally.pulls, &tally.pull),
        ("push", tally.pushes, &tally.push),
        ("advance", tally.steps, &tally.advance),
    ]
    .into_iter()
    .map(|(op, ok, lat)| OpStats {
        op: op.into(),
        ok,
        per_s: ok as f64 / seconds.max(1e-9),
        p50_us: lat.quantile(0.5),
        p99_us: lat.quantile(0.99),
    })
    .collect();
    Ok(Results {
        clients: plan.clients,
        clients_running,
        shards: plan.spec.shards,
        floats: plan.spec.floats,
        keys,
        seconds,
        ops,
        errors: tally.errors,
        reregistered: tally.reregistered,
        check,
        servers: Vec::new(),
        hostile: hostile_report,
    })
}

/// Reads every float back with a fresh client and compares it with the pushes counted.
async fn check(
    cluster: &Cluster,
    plan: &Plan,
    floats: usize,
    tally: &Tally,
) -> anyhow::Result<Check> {
    let (acked, failed) = (tally.pushes, tally.failed_pushes);
    anyhow::ensure!(
        acked + failed < EXACT_F32,
        "{} pushes: more than an f32 counts exactly; run shorter or with fewer clients",
        acked + failed
    );
    let job = Job::connect(&cluster.client_config("verify", &plan.settings)?)
        .await
        .context("connecting to read the counter back")?;
    let mut values = vec![0.0f32; floats];
    job.pull_all(&mut values, Clock(0))
        .await
        .context("reading the counter back")?;
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut floats_short = 0;
    for &v in &values {
        let v = f64::from(v);
        min = min.min(v);
        max = max.max(v);
        floats_short += u64::from(v < acked as f64);
    }
    Ok(Check {
        acknowledged: acked,
        failed,
        min,
        max,
        lost_updates: (acked as f64 - min).max(0.0).ceil() as u64,
        floats_short,
        extra_updates: (max - (acked + failed) as f64).max(0.0).ceil() as u64,
    })
}

/// What one client (and then all of them) counted.
#[derive(Debug, Default)]
struct Tally {
    pulls: u64,
    pushes: u64,
    failed_pushes: u64,
    steps: u64,
    reregistered: u64,
    pull: Samples,
    push: Samples,
    advance: Samples,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn error(&mut self, op: &str, kind: String) {
        *self.errors.entry(format!("{op}: {kind}")).or_default() += 1;
    }

    fn merge(&mut self, o: Tally) {
        self.pulls += o.pulls;
        self.pushes += o.pushes;
        self.failed_pushes += o.failed_pushes;
        self.steps += o.steps;
        self.reregistered += o.reregistered;
        self.pull.extend(o.pull);
        self.push.extend(o.push);
        self.advance.extend(o.advance);
        for (k, n) in o.errors {
            *self.errors.entry(k).or_default() += n;
        }
    }
}

/// Why a client operation failed.
#[derive(Debug)]
enum Failure {
    Client(ClientError),
    TimedOut(Duration),
}

impl Failure {
    fn kind(&self) -> String {
        match self {
            Failure::Client(ClientError::Call(e)) => call_kind(e),
            Failure::Client(ClientError::Dropped(_)) => "dropped by the coordinator".into(),
            Failure::Client(ClientError::Inconsistent { .. }) => "inconsistent answer".into(),
            Failure::Client(ClientError::NonFinite { .. }) => "non-finite gradient".into(),
            Failure::Client(ClientError::BufferSize { .. }) => "buffer size".into(),
            Failure::Client(other) => format!("client error: {other}"),
            Failure::TimedOut(d) => format!("no answer within {} s", d.as_secs()),
        }
    }
}

/// Runs `op` with [`OP_TIMEOUT`].
async fn timed<T>(op: impl Future<Output = Result<T, ClientError>>) -> Result<T, Failure> {
    match tokio::time::timeout(OP_TIMEOUT, op).await {
        Ok(r) => r.map_err(Failure::Client),
        Err(_) => Err(Failure::TimedOut(OP_TIMEOUT)),
    }
}

/// One client: pull, push, advance until `stop`, then leave. A failed operation is counted
/// and the loop starts over after [`BACKOFF`]; a client the coordinator dropped (its lease ran
/// out under load) registers again.
async fn client(
    name: String,
    job: Job,
    session: Session,
    floats: usize,
    stop: Arc<AtomicBool>,
) -> Tally {
    let mut t = Tally::default();
    let mut params = vec![0.0f32; floats];
    let grads = vec![-1.0f32; floats];
    let mut session = Some(session);
    while !stop.load(Ordering::Relaxed) {
        let s = match &mut session {
            Some(s) => s,
            None => match timed(job.clone().register(&name)).await {
                Ok(s) => {
                    t.reregistered += 1;
                    session.insert(s)
                }
                Err(e) => {
                    t.error("register", e.kind());
                    tokio::time::sleep(BACKOFF).await;
                    continue;
                }
            },
        };
        if let Err((op, e)) = step(s, &mut params, &grads, &mut t).await {
            t.error(op, e.kind());
            if matches!(e, Failure::Client(ClientError::Dropped(_))) {
                session = None;
            }
            tokio::time::sleep(BACKOFF).await;
        }
    }
    if let Some(s) = session
        && let Err(e) = timed(s.leave()).await
    {
        t.error("leave", e.kind());
    }
    t
}

/// One step of a client, timed operation by operation.
async fn step(
    s: &mut Session,
    params: &mut [f32],
    grads: &[f32],
    t: &mut Tally,
) -> Result<(), (&'static str, Failure)> {
    let at = Instant::now();
    timed(s.pull(params)).await.map_err(|e| ("pull", e))?;
    t.pull.push(at.elapsed());
    t.pulls += 1;
    let at = Instant::now();
    if let Err(e) = timed(s.push_step(grads)).await {
        t.failed_pushes += 1;
        return Err(("push", e));
    }
    t.push.push(at.elapsed());
    t.pushes += 1;
    let at = Instant::now();
    timed(s.advance(0, 1, 0.0))
        .await
        .map_err(|e| ("advance", e))?;
    t.advance.push(at.elapsed());
    t.steps += 1;
    Ok(())
}

/// A short name for a stable error code number.
fn code_name(code: u64) -> String {
    match u16::try_from(code).ok().and_then(ErrorCode::from_u16) {
        Some(c) => format!("{c:?}"),
        None => format!("code {code}"),
    }
}

/// A short name for how a connection ended.
fn connection_kind(e: &quinn::ConnectionError) -> String {
    use quinn::ConnectionError as E;
    match e {
        E::ApplicationClosed(c) => format!(
            "closed by the server ({})",
            code_name(c.error_code.into_inner())
        ),
        E::ConnectionClosed(c) => format!("transport close ({})", c.error_code),
        E::TimedOut => "idle timeout".into(),
        E::Reset => "reset".into(),
        E::LocallyClosed => "closed locally".into(),
        E::VersionMismatch => "version mismatch".into(),
        E::TransportError(t) => format!("transport error ({})", t.code),
        E::CidsExhausted => "connection ids exhausted".into(),
    }
}

/// A short name for why a call failed: the error code the server answered with, or what
/// became of the connection or stream.
fn call_kind(e: &CallError) -> String {
    match e {
        CallError::Remote { code: Some(c), .. } => format!("{c:?}"),
        CallError::Remote { code: None, .. } => "unknown error code".into(),
        CallError::Connection(c) | CallError::NotSent(c) => connection_kind(c),
        CallError::Read(quinn::ReadExactError::ReadError(r)) | CallError::ReadChunk(r) => {
            read_kind(r)
        }
        CallError::Read(quinn::ReadExactError::FinishedEarly(_)) => "answer cut short".into(),
        CallError::Write(quinn::WriteError::Stopped(c)) => {
            format!("stream stopped ({})", code_name(c.into_inner()))
        }
        CallError::Write(quinn::WriteError::ConnectionLost(c)) => connection_kind(c),
        CallError::Write(_) => "write failed".into(),
        CallError::Connect(_) | CallError::Unreachable { .. } => "cannot connect".into(),
        CallError::Closed(_) => "stream closed".into(),
        CallError::TimedOut(_) => "timed out".into(),
        CallError::Proto(p) => format!("bad frame ({:?})", p.code()),
        CallError::Unexpected(_) | CallError::Refused(_) => "unexpected answer".into(),
        CallError::Withdrawn => "withdrawn".into(),
        CallError::NotLeader { .. } => "not the leader".into(),
        CallError::Bind(_) | CallError::Address(_) | CallError::Pki(_) => "set-up".into(),
    }
}

fn read_kind(e: &quinn::ReadError) -> String {
    match e {
        quinn::ReadError::Reset(c) => format!("stream reset ({})", code_name(c.into_inner())),
        quinn::ReadError::ConnectionLost(c) => connection_kind(c),
        _ => "read failed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kinds_are_short_and_stable() {
        let remote = CallError::Remote {
            code: Some(ErrorCode::Busy),
            message: "bytes in flight: 123 of 100".into(),
            map: None,
        };
        assert_eq!(call_kind(&remote), "Busy");
        assert_eq!(code_name(13), "HandshakeRequired");
        assert_eq!(code_name(60_000), "code 60000");
        assert_eq!(
            Failure::TimedOut(Duration::from_secs(30)).kind(),
            "no answer within 30 s"
        );
    }
}
