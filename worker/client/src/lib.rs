//! The EDL client library: join an elastic training job, lease its data exactly once, pull
//! parameters and push gradients. It trains any model whose parameters are a list of named
//! `f32` tensors; the trainer, the built-in models and the compute backends live elsewhere
//! (`edl-worker`).
//!
//! A training loop, with the model's own forward and backward pass in `compute`:
//!
//! ```no_run
//! # async fn run(cfg: edl_client::ClientConfig) -> Result<(), edl_client::ClientError> {
//! # fn compute(params: &[f32], indices: &[u32], grads: &mut [f32]) -> f64 { 0.0 }
//! use edl_client::{Gradients, Job};
//!
//! let job = Job::connect(&cfg).await?;          // authenticate, fetch the job and shard map
//! let spec = job.spec().clone();                // named tensors over one flat vector
//! let fc1 = spec.require("fc1.weight")?;        // offset and shape of one tensor
//! let mut params = vec![0f32; spec.param_count()];
//! let mut grads = Gradients::zeros(spec.param_count()); // pushed as it lies, no copy
//! let mut session = job.join().await?;          // prepared first, then admitted (stop-free)
//! while let Some(batch) = session.next_batch().await? {
//!     session.pull(&mut params).await?;         // straight into params; SSP/BSP may wait
//!     let loss_sum = compute(&params, batch.indices(), grads.as_mut_slice());
//!     let _ = fc1.of(&params);                  // the first layer's weights, by name
//!     session.push_gradients(&batch, &grads).await?; // the gradient of exactly these samples
//!     session.commit(batch, loss_sum).await?;   // the samples are done; next step
//!     if session.drain_requested() {
//!         break;                                // an operator asked this worker to leave
//!     }
//! }
//! session.leave().await?;                       // uncommitted data returns to the pool
//! # Ok(()) }
//! ```
//!
//! Exactly once by construction: a [`Batch`] can only come from [`Session::next_batch`], a
//! push needs the batch it belongs to, and committing consumes it. The batch's sample indices
//! are the epoch's order ([`edl_shared::proto::order`], a specified permutation) over the
//! batch's data span, so a span re-issued after a worker died has the same indices. Callers
//! that are not async use [`blocking`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use edl_shared::Identity;
use edl_shared::leader::Coordinators;
use edl_shared::proto::ids::{Clock, ShardId, WorkerId};
use edl_shared::proto::msg::{EpochLedger, JobHistory, JobStatus, JobTrace};
use edl_shared::proto::{
    ErrorCode, Frame, JobConfig, KeyLayout, Parts, Request, Response, ShardMap,
};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{
    CallError, Conn, Dialer, Release, Sink, TransportSettings, client_endpoint,
};
use thiserror::Error;

pub mod blocking;
mod contract;
mod coord;
mod grads;
mod notice;
mod routing;
mod session;
mod spec;
mod topk;

use coord::{CoordLink, FAILOVER_IDLE, Net, connect_any};
pub use grads::Gradients;
pub use notice::Notices;
use routing::Routing;
pub use session::{Batch, BatchState, Holdings, RowGrads, Session};
pub use spec::{JobSpec, TensorView};

/// Why a client operation failed.
#[derive(Debug, Error)]
pub enum ClientError {
    /// A call failed (transport, TLS, or an error answered by the server).
    #[error(transparent)]
    Call(#[from] CallError),
    /// The coordinator no longer knows this worker (its lease expired, or it left).
    #[error("worker {0} was dropped by the coordinator")]
    Dropped(WorkerId),
    /// A server answered with data that does not fit the job.
    #[error("inconsistent answer from {from}: {what}")]
    Inconsistent {
        /// Who answered.
        from: String,
        /// What was wrong.
        what: String,
    },
    /// A gradient holds NaN or infinity; no shard applied any of it.
    #[error("gradient value at float {index} is not finite; nothing was applied")]
    NonFinite {
        /// Position of the first bad value.
        index: usize,
    },
    /// A finite gradient value does not fit the job's 16-bit wire (binary16 ends at 65,504);
    /// no shard applied any of it.
    #[error(
        "gradient value {value} at float {index} does not fit the job's {wire} wire (fp16 ends \
         at 65,504; bf16 keeps f32's range); nothing was applied"
    )]
    OutOfRange {
        /// Position of the first such value.
        index: usize,
        /// The value.
        value: f32,
        /// The job's wire precision.
        wire: edl_shared::proto::Wire,
    },
    /// The caller passed a buffer of the wrong size.
    #[error("buffer has {got} floats, the model has {want}")]
    BufferSize {
        /// Floats expected.
        want: u64,
        /// Floats given.
        got: usize,
    },
    /// The job has no tensor of this name.
    #[error("the job has no tensor {0:?}")]
    UnknownTensor(String),
    /// A row index is outside its tensor.
    #[error("row {row} is outside tensor {tensor:?}, which has {rows} rows")]
    RowOutOfRange {
        /// The tensor.
        tensor: String,
        /// The row asked for.
        row: u32,
        /// Rows the tensor has.
        rows: usize,
    },
    /// Rows and their values do not fit together.
    #[error("{what}")]
    RowShape {
        /// What is wrong.
        what: String,
    },
    /// A batch was used out of turn (pushed or committed twice, or a new one asked for
    /// before the last was committed); nothing was sent.
    #[error("batch misuse: {0}")]
    Batch(String),
    /// The blocking client could not start its runtime.
    #[error("cannot start the client runtime: {0}")]
    Runtime(String),
    /// The worker's set-up failed: the process contract's environment, its credentials or its
    /// signal handlers.
    #[error("{0}")]
    Setup(String),
}

impl ClientError {
    /// The error code a server answered with, when this is a server's refusal.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Call(c) => c.code(),
            _ => None,
        }
    }
}

/// Bytes this client has sent to and received from the shards (payloads only: gradients out,
/// parameters in), and the requests that carried them.
#[derive(Debug, Default)]
pub struct Traffic {
    sent: AtomicU64,
    received: AtomicU64,
    requests: AtomicU64,
    /// Bytes sent and received not yet reported to the coordinator with a step.
    unreported: [AtomicU64; 2],
}

/// A reading of [`Traffic`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficCount {
    /// Payload bytes sent (gradients).
    pub sent: u64,
    /// Payload bytes received (parameters).
    pub received: u64,
    /// Shard requests.
    pub requests: u64,
}

impl Traffic {
    fn sent(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
        self.unreported[0].fetch_add(bytes as u64, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn received(&self, bytes: usize) {
        self.received.fetch_add(bytes as u64, Ordering::Relaxed);
        self.unreported[1].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The bytes (sent, received) since the last call, to report with a step: each byte is
    /// reported once, whichever of the job's sessions reports next.
    fn take_unreported(&self) -> (u64, u64) {
        let [s, r] = &self.unreported;
        (s.swap(0, Ordering::Relaxed), r.swap(0, Ordering::Relaxed))
    }

    /// Puts back bytes taken for a report that was not counted.
    fn unreport(&self, (sent, received): (u64, u64)) {
        self.unreported[0].fetch_add(sent, Ordering::Relaxed);
        self.unreported[1].fetch_add(received, Ordering::Relaxed);
    }
}

/// Bytes taken for a step report ([`Traffic::take_unreported`]), put back when dropped unless
/// `counted`: a report refused, failed or abandoned midway (its future dropped) reports them
/// again with the next.
pub(crate) struct Unreported {
    traffic: Arc<Traffic>,
    /// (sent, received).
    pub(crate) bytes: (u64, u64),
    /// Set once the report was answered.
    pub(crate) counted: bool,
}

impl Unreported {
    pub(crate) fn take(traffic: &Arc<Traffic>) -> Unreported {
        Unreported {
            traffic: traffic.clone(),
            bytes: traffic.take_unreported(),
            counted: false,
        }
    }
}

impl Drop for Unreported {
    fn drop(&mut self) {
        if !self.counted {
            self.traffic.unreport(self.bytes);
        }
    }
}

impl Traffic {
    fn read(&self) -> TrafficCount {
        TrafficCount {
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }
}

/// How to reach a job.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The coordinator's address.
    pub coordinator: String,
    /// This client's credentials.
    pub identity: Identity,
    /// Transport settings.
    pub settings: TransportSettings,
}

/// A connection to a job: the coordinator, the shards, the job config and the shard map in
/// use (replaced when a request is refused with a newer one; see `client/routing.rs`).
#[derive(Clone, Debug)]
pub struct Job {
    coordinator: CoordLink,
    net: Arc<Net>,
    routing: Arc<std::sync::RwLock<Arc<Routing>>>,
    /// One connection per shard, kept across map changes.
    conns: Arc<tokio::sync::Mutex<HashMap<ShardId, Arc<Mutex<Conn>>>>>,
    job: JobConfig,
    layout: KeyLayout,
    /// How each tensor travels ([`JobConfig::wires`]).
    wires: Arc<[edl_shared::proto::WireSpec]>,
    spec: Arc<JobSpec>,
    traffic: Arc<Traffic>,
    /// The placement this worker was started for, named when it registers.
    placement: Option<u64>,
    /// Woken whenever a newer map is adopted.
    remapped: Arc<tokio::sync::Notify>,
    /// A replicated job's long poll for new maps (a primary that dies is replaced in a map the
    /// coordinator publishes, and calls to it are moved on at once); stopped when the last
    /// handle that shares it is dropped.
    _map_watch: Option<Arc<MapWatch>>,
}

/// Aborts a job's map watch when dropped.
#[derive(Debug)]
struct MapWatch(tokio::task::JoinHandle<()>);

impl Drop for MapWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The server a call goes to, as its log lines name it (formatted only when one is logged,
/// not on every call).
#[derive(Clone, Copy)]
pub(crate) enum Server<'a> {
    Coordinator(&'a str),
    Shard(ShardId),
    At(&'a str),
}

impl std::fmt::Display for Server<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Server::Coordinator(addr) => write!(f, "the coordinator at {addr}"),
            Server::Shard(id) => write!(f, "shard {id}"),
            Server::At(addr) => write!(f, "the server at {addr}"),
        }
    }
}

/// One outage of a server as a client sees it: its start and its end are logged once each,
/// not once per attempt (once for every call sharing one, see [`Outage::shared`]), and the
/// attempts back off up to [`MAX_BACKOFF`].
pub(crate) struct Outage<'a> {
    what: Server<'a>,
    limit: Option<Duration>,
    since: Option<tokio::time::Instant>,
    delay: Duration,
    /// The outage the calls of one link share: its start, set by the first call that saw it.
    shared: Option<&'a Mutex<Option<tokio::time::Instant>>>,
    /// Said that the outage outlasted something (the lease): said once.
    past: bool,
}

/// Pauses between attempts of a request a server refused as over its budget (`Busy`), which
/// is never applied, so it is always safe to repeat; the first refusal is logged.
#[derive(Default)]
pub(crate) struct Busy {
    delay: Duration,
}

impl Busy {
    pub(crate) async fn pause(&mut self, what: Server<'_>, err: &CallError) {
        if self.delay.is_zero() {
            tracing::info!(error = %err, "{what} is busy; retrying");
            self.delay = Duration::from_millis(20);
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(Duration::from_secs(1));
    }
}

/// The longest pause between two attempts to reach a server.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

impl<'a> Outage<'a> {
    pub(crate) fn new(what: Server<'a>, limit: Option<Duration>) -> Self {
        Outage {
            what,
            limit,
            since: None,
            delay: Duration::from_millis(100),
            shared: None,
            past: false,
        }
    }

    /// This outage is one that every call sharing `start` is in: logged by the first call
    /// that meets it and ended by the first that gets an answer.
    pub(crate) fn shared(self, start: &'a Mutex<Option<tokio::time::Instant>>) -> Self {
        Outage {
            shared: Some(start),
            ..self
        }
    }

    /// Records a failed attempt: gives the error back once the outage has lasted past the
    /// limit (measured from this call's first failure), else waits before the next attempt.
    pub(crate) async fn failed(&mut self, err: CallError) -> Result<(), CallError> {
        self.record(err)?;
        self.pause(None).await;
        Ok(())
    }

    /// Records a failed attempt, without waiting: logs the outage's start if no call sharing
    /// it did, and gives the error back once it has lasted past the limit.
    pub(crate) fn record(&mut self, err: CallError) -> Result<(), CallError> {
        let now = tokio::time::Instant::now();
        // A shared outage starts now unless a call sharing it met it already; this call's
        // first failure logs it unless so.
        let met_first = self.shared.is_none_or(|start| {
            *start
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(now)
                == now
        });
        let first = self.since.is_none() && met_first;
        let since = *self.since.get_or_insert(now);
        if first {
            match self.limit {
                Some(l) => {
                    tracing::warn!(error = %err, "{} is unreachable; retrying for up to {:?}", self.what, l)
                }
                None => {
                    tracing::warn!(error = %err, "{} is unreachable; retrying until it answers", self.what)
                }
            }
        }
        if self.limit.is_some_and(|l| now.duration_since(since) >= l) {
            tracing::error!(
                "giving up on {} after {:?}",
                self.what,
                now.duration_since(since)
            );
            return Err(err);
        }
        tracing::debug!(error = %err, "{}: retrying", self.what);
        Ok(())
    }

    /// Waits before the next attempt: `every` if given (while coordinators elect a leader,
    /// which a standby finds within a fraction of a second of the old lease's end), else a
    /// delay that doubles up to [`MAX_BACKOFF`].
    pub(crate) async fn pause(&mut self, every: Option<Duration>) {
        match every {
            Some(every) => tokio::time::sleep(every).await,
            None => {
                tokio::time::sleep(self.delay).await;
                self.delay = (self.delay * 2).min(MAX_BACKOFF);
            }
        }
    }

    /// Logs once, as `why`, that the outage has lasted longer than `bound`.
    pub(crate) fn warn_past(&mut self, bound: Duration, why: &str) {
        let since = match self.shared {
            Some(start) => *start.lock().unwrap_or_else(|p| p.into_inner()),
            None => self.since,
        };
        let Some(since) = since else { return };
        let lasted = since.elapsed();
        if !self.past && lasted > bound {
            self.past = true;
            tracing::warn!(
                "{} has not answered for {:.1} s, {why} ({:.1} s)",
                self.what,
                lasted.as_secs_f64(),
                bound.as_secs_f64()
            );
        }
    }

    /// The server answered: logs the end of the outage, if there was one (and no other call
    /// sharing it logged it already).
    pub(crate) fn over(&mut self) {
        let mine = self.since.take();
        // Any answer ends an outage the calls share, whichever call met it (one that met it
        // may have been dropped since).
        let since = match self.shared {
            Some(start) => start.lock().unwrap_or_else(|p| p.into_inner()).take(),
            None => mine,
        };
        if let Some(since) = since {
            tracing::warn!(
                "{} answers again after {:.1} s",
                self.what,
                since.elapsed().as_secs_f64()
            );
        }
    }
}

/// True for failures of the connection itself, after which a retry on a new connection may
/// succeed; false for answers (errors the server sent, malformed replies).
fn is_connection_failure(e: &CallError) -> bool {
    e.connection_failed()
}

impl Job {
    /// Calls a shard, its answer's payload going to `sink`; with `retry`, a failed connection
    /// is replaced (the shard's address is read again from the coordinator's map) and the
    /// call repeated for as long as the transport settings' `reconnect` allows (by default
    /// until the shard answers). Each attempt is completed only once `release` allows it.
    /// Only idempotent requests may be retried: pulls, and pushes that carry a data span (a
    /// shard skips a span it applied). A request that was never sent (no stream could be
    /// opened) is retried whatever it is. A shard that is no longer in the coordinator's map
    /// (it was removed) answers for itself: `StaleEpoch` with that map, so the caller
    /// re-routes.
    async fn call_shard<S: Sink<Response>>(
        &self,
        (id, conn): (ShardId, Arc<Mutex<Conn>>),
        (req, payload): (Request, Parts),
        retry: bool,
        release: &impl Release,
        sink: &mut S,
    ) -> Result<Response, CallError> {
        let net = &self.net;
        let what = Server::Shard(id);
        let mut outage = Outage::new(what, net.settings.reconnect);
        let mut busy = Busy::default();
        // In a replicated job, a call that can be repeated (a pull, a push with its span) to a
        // shard the coordinator replaced is moved on at once: a dead process answers nothing,
        // and its connection would only time out.
        let movable = retry && self.job.replicas > 1;
        loop {
            let current = conn.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let call = current.call_released(req.clone(), payload.clone(), release, &mut *sink);
            let answer = if movable {
                tokio::select! {
                    biased;
                    r = call => r,
                    map = self.unplaced(id) => Err(replaced(id, map)),
                }
            } else {
                call.await
            };
            let err = match answer {
                Err(e @ CallError::NotSent(_)) => e,
                // Nothing of a request refused for the server's budget was done: send it again.
                Err(e) if e.code() == Some(ErrorCode::Busy) => {
                    busy.pause(what, &e).await;
                    continue;
                }
                Err(e) if retry && is_connection_failure(&e) => e,
                other => {
                    outage.over();
                    return other;
                }
            };
            if movable {
                // A shard found dead is replaced within about a second: move on as soon as
                // the new map comes, not after the next backoff.
                tokio::select! {
                    biased;
                    map = self.unplaced(id) => return Err(replaced(id, map)),
                    r = outage.failed(err) => r?,
                }
            } else {
                outage.failed(err).await?;
            }
            outage.warn_past(
                Duration::from_millis(u64::from(self.job.lease_ms)),
                "longer than the job's lease: this worker makes no progress meanwhile; still \
                 trying",
            );
            let map = match self.coordinator.call(Request::GetMap, Bytes::new()).await {
                Ok(Frame {
                    msg: Response::Map(m),
                    ..
                }) => m,
                _ => continue,
            };
            let Some(addr) = map.addr_of(id).map(str::to_string) else {
                return Err(CallError::Remote {
                    code: Some(ErrorCode::StaleEpoch),
                    message: format!("{id} is no longer in the shard map"),
                    map: Some(Box::new(map)),
                });
            };
            if let Ok(c) = Conn::dial(&net.dialer, &addr, &net.name, &net.settings).await {
                *conn.lock().unwrap_or_else(|p| p.into_inner()) = c;
            }
        }
    }
}

/// The refusal of a call to shard `id`, which `map` no longer places anything on: the caller
/// routes the call again under `map`.
fn replaced(id: ShardId, map: ShardMap) -> CallError {
    CallError::Remote {
        code: Some(ErrorCode::StaleEpoch),
        message: format!("{id} was replaced in shard map {}", map.epoch),
        map: Some(Box::new(map)),
    }
}

/// Retries `f` while the server answers `NotReady`, up to `tries` times.
async fn retry_not_ready<T, F, Fut>(tries: u32, mut f: F) -> Result<T, CallError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, CallError>>,
{
    let mut delay = Duration::from_millis(20);
    let mut n = 0;
    loop {
        match f().await {
            Err(e) if e.code() == Some(ErrorCode::NotReady) && n + 1 < tries => {
                n += 1;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(500));
            }
            other => return other,
        }
    }
}

impl Job {
    /// Connects to the coordinator, waits for the shard map and connects to every shard.
    pub async fn connect(cfg: &ClientConfig) -> Result<Job, ClientError> {
        let mut settings = cfg.settings.clone();
        // With standbys to fail over to, a leader that died is noticed sooner: its connection
        // is given up after FAILOVER_IDLE of silence instead of the default 6 s (keep-alives
        // keep live connections, long polls included, open).
        if Coordinators::parse(&cfg.coordinator).is_ok_and(|c| c.all().len() > 1) {
            settings.idle_timeout = settings.idle_timeout.min(FAILOVER_IDLE);
            settings.keep_alive = settings.keep_alive.min(FAILOVER_IDLE / 4);
        }
        let ep = client_endpoint(&cfg.identity, &settings, false)?;
        Job::connect_with(cfg, Dialer::Quic(ep)).await
    }

    /// [`Job::connect`] through `dialer` (the simulation's in-process connections, say),
    /// as the identity's name.
    pub async fn connect_with(cfg: &ClientConfig, dialer: Dialer) -> Result<Job, ClientError> {
        let name = &cfg.identity.name;
        let mut addrs = Coordinators::parse(&cfg.coordinator).map_err(ClientError::Setup)?;
        let conn = connect_any(&dialer, &mut addrs, name, &cfg.settings).await?;
        let net = Net {
            dialer,
            settings: cfg.settings.clone(),
            name: name.to_string(),
        };
        let coordinator = CoordLink::new(addrs, conn, net);
        let map = wait_for_map(&coordinator).await?;
        let job = fetch_job(&coordinator).await?;
        coordinator.set_lease(Duration::from_millis(u64::from(job.lease_ms)));
        Job::with_map(coordinator, job, map).await
    }

    async fn with_map(
        coordinator: CoordLink,
        job: JobConfig,
        map: ShardMap,
    ) -> Result<Job, ClientError> {
        let layout = job.layout();
        let empty = Routing {
            map: ShardMap {
                shards: Vec::new(),
                ranges: Vec::new(),
                ..map.clone()
            },
            links: Vec::new(),
        };
        let job = Job {
            net: coordinator.net.clone(),
            coordinator,
            routing: Arc::new(std::sync::RwLock::new(Arc::new(empty))),
            conns: Arc::new(tokio::sync::Mutex::new(HashMap::new())),
            spec: Arc::new(JobSpec::of(&job)),
            wires: job.wires().into(),
            job,
            layout,
            traffic: Arc::new(Traffic::default()),
            placement: None,
            remapped: Arc::new(tokio::sync::Notify::new()),
            _map_watch: None,
        };
        job.adopt(map).await?;
        if job.job.replicas <= 1 {
            return Ok(job);
        }
        // The task holds a handle without the watch, so that dropping the caller's handles
        // stops it.
        let watcher = job.clone();
        let task = tokio::spawn(async move { watcher.watch_maps().await });
        Ok(Job {
            _map_watch: Some(Arc::new(MapWatch(task))),
            ..job
        })
    }

    /// Follows the coordinator's map with a long poll, adopting each newer one.
    async fn watch_maps(&self) {
        loop {
            let after = self.routing().map.epoch;
            let asked = self
                .coordinator
                .call(Request::WaitMap { after }, Bytes::new())
                .await;
            match asked {
                Ok(Frame {
                    msg: Response::Map(map),
                    ..
                }) => {
                    if let Err(e) = self.adopt(map).await {
                        tracing::debug!(error = %e, "adopting a new map failed");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                // A long poll that timed out is asked again at once.
                Err(e) if e.code() == Some(ErrorCode::NotReady) => {}
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Resolves once the map in use places nothing on `id`, with that map: a replicated job's
    /// shard found dead and replaced.
    async fn unplaced(&self, id: ShardId) -> ShardMap {
        loop {
            let changed = self.remapped.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let routing = self.routing();
            if !routing.map.places(id) {
                return routing.map.clone();
            }
            changed.await;
        }
    }

    /// Names the placement this worker was started for (a placer such as `edl-local` passes
    /// it): once admitted, the coordinator counts the placement done and drains the worker
    /// it replaces, if any.
    pub fn for_placement(mut self, placement: Option<u64>) -> Job {
        self.placement = placement;
        self
    }

    /// The job configuration.
    pub fn config(&self) -> &JobConfig {
        &self.job
    }

    /// The shard map in use.
    pub fn map(&self) -> ShardMap {
        self.routing().map.clone()
    }

    /// The model's tensors: names, shapes and places in the flat parameter vector.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// Payload bytes exchanged with the shards so far, by this job handle and every session
    /// made from it.
    pub fn traffic(&self) -> TrafficCount {
        self.traffic.read()
    }

    /// The key layout.
    pub fn layout(&self) -> &KeyLayout {
        &self.layout
    }

    /// Number of floats in the model.
    pub fn param_count(&self) -> usize {
        self.layout.total_len() as usize
    }

    /// Pulls the parameters as they stand, for evaluation, without joining. Pending BSP steps
    /// are closed only once the job has finished (through every step); while it runs, only
    /// through the slowest active worker's clock, so evaluating never applies a step still
    /// being pushed.
    ///
    /// Returns the status the pull went by (its `min_clock` and `finished` say what the
    /// parameters hold).
    pub async fn pull_current(&self, out: &mut [f32]) -> Result<JobStatus, ClientError> {
        let status = self.status().await?;
        let through = if status.finished {
            Clock(u64::MAX)
        } else {
            status.min_clock
        };
        // Evaluated exact, whatever the job's wire precision.
        self.pull_all_in(out, through, edl_shared::proto::Wire::F32)
            .await?;
        Ok(status)
    }

    /// Reports an evaluation of the parameters pulled through `clock` to the coordinator
    /// (`edlctl status` and the dashboard show the latest).
    pub async fn report_evaluation(
        &self,
        clock: Clock,
        accuracy: f64,
        loss: f64,
        samples: u64,
    ) -> Result<(), ClientError> {
        let req = Request::Evaluation {
            clock,
            accuracy,
            loss,
            samples,
        };
        match self.coordinator.call(req, Bytes::new()).await?.msg {
            Response::Ack => Ok(()),
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// The coordinator's training history from `from_ms` on (progress per second, evaluations).
    pub async fn history(&self, from_ms: u64) -> Result<JobHistory, ClientError> {
        let req = Request::History { from_ms };
        match self.coordinator.call(req, Bytes::new()).await?.msg {
            Response::History(h) => Ok(h),
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// Asks the coordinator for a status snapshot.
    pub async fn status(&self) -> Result<JobStatus, ClientError> {
        match self
            .coordinator
            .call(Request::Status, Bytes::new())
            .await?
            .msg
        {
            Response::Status(s) => Ok(s),
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// The coordinator's membership events and step times: every page of steps it keeps,
    /// joined.
    pub async fn trace(&self) -> Result<JobTrace, ClientError> {
        let mut whole = self.trace_page(0).await?;
        while whole.more {
            let page = self.trace_page(whole.next_step).await?;
            if page.more && page.next_step <= whole.next_step {
                return Err(
                    self.inconsistent("coordinator", "a trace page that does not advance".into())
                );
            }
            // Events and moves come whole with every page: keep the latest.
            whole.steps.extend(page.steps);
            whole.events = page.events;
            whole.moves = page.moves;
            whole.next_step = page.next_step;
            whole.dropped = page.dropped;
            whole.more = page.more;
        }
        Ok(whole)
    }

    /// One page of the coordinator's trace: its steps from `from_step` on.
    async fn trace_page(&self, from_step: u64) -> Result<JobTrace, ClientError> {
        match self
            .coordinator
            .call(Request::Trace { from_step }, Bytes::new())
            .await?
            .msg
        {
            Response::Trace(t) => Ok(t),
            other => Err(CallError::unexpected(&other).into()),
        }
    }

    /// Asks a worker to leave gracefully after its current step (admin role).
    pub async fn drain(&self, worker: WorkerId) -> Result<(), ClientError> {
        self.coordinator
            .call(Request::Drain { worker }, Bytes::new())
            .await?;
        Ok(())
    }

    /// Every shard's per-epoch data ledger.
    pub async fn ledgers(&self) -> Result<Vec<(ShardId, Vec<EpochLedger>)>, ClientError> {
        // Ask the shards that hold keys now: ranges may have moved since this client connected.
        self.refresh_map().await?;
        let mut out = Vec::new();
        for s in &self.routing().links {
            match s.current().call(Request::Ledger, Bytes::new()).await?.msg {
                Response::Ledger(l) => out.push((s.id, l)),
                other => return Err(CallError::unexpected(&other).into()),
            }
        }
        Ok(out)
    }

    /// Joins the job as a worker, stop-free: the connections to every shard are warmed (one
    /// pull of the model) before the coordinator is asked to admit this worker, so the others
    /// never wait on this worker's set-up. Do the application's own slow set-up (loading
    /// data, building the model) before calling this. The worker is registered under its
    /// certificate's name.
    pub async fn join(self) -> Result<Session, ClientError> {
        let mut warm = vec![0f32; self.param_count()];
        self.pull_all(&mut warm, Clock(0)).await?;
        drop(warm);
        let name = self.net.name.clone();
        self.register(&name).await
    }

    /// Registers as a worker, at once (see [`Job::join`] for the stop-free way). `name` is a
    /// label for logs; the coordinator knows the worker by its certificate's name. The
    /// session heartbeats in the background until it is dropped or leaves.
    pub async fn register(self, name: &str) -> Result<Session, ClientError> {
        let resp = retry_not_ready(600, || {
            self.coordinator.call(
                Request::Register {
                    name: name.to_string(),
                    placement: self.placement,
                },
                Bytes::new(),
            )
        })
        .await?;
        let (worker, clock, token) = match resp.msg {
            Response::Registered {
                worker,
                clock,
                token,
                ..
            } => (worker, clock, token),
            other => return Err(CallError::unexpected(&other).into()),
        };
        let stop = CancellationToken::new();
        let lost = Arc::new(AtomicBool::new(false));
        let notice = Arc::new(notice::NoticeState::default());
        let period =
            Duration::from_millis(u64::from(self.job.lease_ms) / 4).max(Duration::from_millis(10));
        tokio::spawn(heartbeat(
            self.coordinator.clone(),
            worker,
            period,
            stop.clone(),
            lost.clone(),
            notice.clone(),
        ));
        Ok(Session {
            job: self,
            worker,
            token,
            clock,
            granted: clock,
            stop,
            lost,
            notice,
            feed: session::Feed::default(),
            residual: Default::default(),
        })
    }

    fn check_len(&self, got: usize) -> Result<(), ClientError> {
        if got as u64 != self.layout.total_len() {
            return Err(ClientError::BufferSize {
                want: self.layout.total_len(),
                got,
            });
        }
        Ok(())
    }

    fn inconsistent(&self, from: &str, what: String) -> ClientError {
        ClientError::Inconsistent {
            from: from.to_string(),
            what,
        }
    }
}

fn check_finite(values: &[f32]) -> Result<(), ClientError> {
    match edl_shared::proto::frame::first_non_finite(values) {
        Some(index) => Err(ClientError::NonFinite { index }),
        None => Ok(()),
    }
}

/// Why `values[i]` (at float `offset + i` of the model) was refused at `wire`: not finite, or
/// past the 16-bit range.
pub(crate) fn refused_at(
    values: &[f32],
    i: usize,
    offset: usize,
    wire: edl_shared::proto::Wire,
) -> ClientError {
    let index = offset + i;
    match values.get(i) {
        Some(&value) if value.is_finite() => ClientError::OutOfRange { index, value, wire },
        _ => ClientError::NonFinite { index },
    }
}

/// Waits, without a deadline, until the coordinator has a shard map (every shard it waits
/// for has joined), saying once what it waits for.
async fn wait_for_map(coordinator: &CoordLink) -> Result<ShardMap, CallError> {
    let mut said = false;
    loop {
        match coordinator.call(Request::GetMap, Bytes::new()).await {
            Ok(Frame {
                msg: Response::Map(m),
                ..
            }) => {
                if said {
                    tracing::info!("the shard map is formed; joining");
                }
                return Ok(m);
            }
            Ok(other) => return Err(CallError::unexpected(&other.msg)),
            Err(CallError::Remote {
                code: Some(ErrorCode::NotReady),
                message,
                ..
            }) => {
                if !said {
                    tracing::info!(coordinator = %coordinator.addrs(), "waiting for the shard map: {message}");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Fetches the job configuration.
async fn fetch_job(coordinator: &CoordLink) -> Result<JobConfig, ClientError> {
    match retry_not_ready(600, || coordinator.call(Request::GetJob, Bytes::new()))
        .await?
        .msg
    {
        Response::Job(job) => Ok(job),
        other => Err(CallError::unexpected(&other).into()),
    }
}

pub(crate) fn unreachable(tried: Vec<String>, cause: CallError) -> CallError {
    CallError::Unreachable {
        tried,
        cause: Box::new(cause),
    }
}

async fn connect_retry(
    dialer: &Dialer,
    addr: &str,
    name: &str,
    settings: &TransportSettings,
) -> Result<Conn, ClientError> {
    let mut outage = Outage::new(Server::At(addr), settings.reconnect);
    loop {
        match Conn::dial(dialer, addr, name, settings).await {
            Ok(c) => {
                outage.over();
                return Ok(c);
            }
            // A server that does not answer may be starting up, or down for a while: keep
            // trying. Anything else (a refused certificate, a wrong version) is final.
            Err(e @ CallError::Connection(quinn::ConnectionError::TimedOut)) => {
                outage.failed(e).await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn heartbeat(
    conn: CoordLink,
    worker: WorkerId,
    period: Duration,
    stop: CancellationToken,
    lost: Arc<AtomicBool>,
    notice: Arc<notice::NoticeState>,
) {
    let mut tick = tokio::time::interval(period);
    loop {
        // Biased: a stopped session sends no heartbeat even when one is due, and the choice
        // does not depend on chance (the simulation replays it).
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A heartbeat has its own bound, below the lease: a connection that died silently
        // would keep it waiting for the transport's idle timeout (6 s, longer than the
        // lease), and the worker would lose its lease with no outage at all. Past the bound
        // the connection is closed (the calls on it are repeated on a new one) and the next
        // beat dials anew.
        let beat = tokio::time::timeout(
            period * 2,
            conn.call(Request::Heartbeat { worker }, Bytes::new()),
        );
        let Ok(answer) = beat.await else {
            // Whichever connection is in use now (the beat may have dialled one itself) is
            // closed: a live one costs a redial of milliseconds and the repeat of the calls it
            // carried, a dead one would cost the lease.
            conn.missed(period * 2);
            continue;
        };
        match answer {
            Ok(Frame {
                msg: Response::Beat { drain, notice_ms },
                ..
            }) => notice.tell(drain, notice_ms.map(Duration::from_millis)),
            Ok(_) => {}
            // A heartbeat that was in flight while the worker left (repeated through a
            // failover, say) finds it gone: no news.
            Err(e) if e.code() == Some(ErrorCode::UnknownWorker) && stop.is_cancelled() => return,
            Err(e) if e.code() == Some(ErrorCode::UnknownWorker) => {
                tracing::warn!(%worker, "coordinator dropped this worker");
                lost.store(true, Ordering::SeqCst);
                return;
            }
            Err(e) => tracing::debug!(%worker, error = %e, "heartbeat failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_taken_for_a_report_go_back_unless_it_was_answered() {
        let traffic = Arc::new(Traffic::default());
        traffic.sent(100);
        traffic.received(300);
        // A report abandoned midway (its future dropped) or refused: the bytes go with the
        // next one.
        {
            let taken = Unreported::take(&traffic);
            assert_eq!(taken.bytes, (100, 300));
            assert_eq!(traffic.take_unreported(), (0, 0));
        }
        traffic.sent(5);
        let mut answered = Unreported::take(&traffic);
        assert_eq!(answered.bytes, (105, 300));
        answered.counted = true;
        drop(answered);
        assert_eq!(traffic.take_unreported(), (0, 0));
        // The totals count every byte once, whatever was reported.
        assert_eq!((traffic.read().sent, traffic.read().received), (105, 300));
    }
}
