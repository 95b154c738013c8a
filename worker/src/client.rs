//! The client library: connect to a job, register, pull and push parameters (fanned out to the
//! shards in parallel), advance the clock, lease data, heartbeat in the background, leave.
//!
//! ```text
//! let job = Job::connect(&cfg).await?;          // authenticate, fetch the shard map
//! let mut s = job.register("w1").await?;        // admitted at the current minimum clock
//! s.pull(&mut params).await?;                   // all keys, from every shard at once
//! s.push(&grads).await?;                        // gradients for the current step
//! s.advance(epoch, samples, loss_sum).await?;   // waits only as SSP/BSP requires
//! s.leave().await?;
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use edl_shared::Identity;
use edl_shared::proto::frame::{bytes_to_f32s, f32s_to_bytes};
use edl_shared::proto::ids::{Clock, Key, ShardId, WorkerId};
use edl_shared::proto::msg::{ChunkRef, DataSpan, EpochLedger, JobStatus, JobTrace, KeyRange};
use edl_shared::proto::{ErrorCode, Frame, JobConfig, KeyLayout, Request, Response, ShardMap};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{CallError, Conn, TransportSettings, client_endpoint};
use thiserror::Error;
use tokio::task::JoinSet;

mod session;

pub use session::Session;

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
    /// A gradient holds NaN or infinity; nothing was sent.
    #[error("gradient value at float {index} is not finite; nothing was pushed")]
    NonFinite {
        /// Position of the first bad value.
        index: usize,
    },
    /// The caller passed a buffer of the wrong size.
    #[error("buffer has {got} floats, the model has {want}")]
    BufferSize {
        /// Floats expected.
        want: u64,
        /// Floats given.
        got: usize,
    },
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

/// A connection to one shard and the contiguous flat range of parameters it holds.
#[derive(Clone, Debug)]
struct ShardLink {
    id: ShardId,
    /// Replaced when the shard restarts and the client reconnects.
    conn: Arc<Mutex<Conn>>,
    ranges: Vec<KeyRange>,
    /// For each range: its flat float offset and length.
    flat: Vec<(usize, usize)>,
    /// The chunks of a full push to this shard, in payload order (fixed by the map).
    chunks: Vec<ChunkRef>,
}

impl ShardLink {
    fn current(&self) -> Conn {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A connection to a job: the coordinator, every shard, the job config and the shard map.
#[derive(Clone, Debug)]
pub struct Job {
    coordinator: CoordLink,
    net: Arc<Net>,
    shards: Vec<ShardLink>,
    job: JobConfig,
    map: ShardMap,
    layout: KeyLayout,
}

/// The connection to the coordinator, replaced when the coordinator restarts.
#[derive(Clone, Debug)]
struct CoordLink {
    addr: String,
    conn: Arc<Mutex<Conn>>,
    net: Arc<Net>,
}

impl CoordLink {
    /// Calls the coordinator; a failed connection is replaced and the call repeated until
    /// [`RECONNECT_WINDOW`] ends. Every coordinator request can be repeated: a repeated clock
    /// report or leave is recognized, and a partition leased twice returns to the pool when
    /// the worker leaves.
    async fn call(&self, req: Request, payload: Bytes) -> Result<Frame<Response>, CallError> {
        let deadline = tokio::time::Instant::now() + RECONNECT_WINDOW;
        let mut delay = Duration::from_millis(100);
        loop {
            let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let err = match conn.call(req.clone(), payload.clone()).await {
                Err(e) if is_connection_failure(&e) => e,
                other => return other,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(err);
            }
            tracing::warn!(error = %err, "coordinator unreachable; reconnecting");
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
            let net = &self.net;
            if let Ok(c) = Conn::connect(&net.endpoint, &self.addr, &net.name, &net.settings).await
            {
                *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = c;
            }
        }
    }
}

/// What a client needs to reconnect.
#[derive(Debug)]
struct Net {
    endpoint: quinn::Endpoint,
    settings: TransportSettings,
    name: String,
}

/// How long a client keeps trying to reach a shard that went away (a restart).
const RECONNECT_WINDOW: Duration = Duration::from_secs(60);

/// True for failures of the connection itself, after which a retry on a new connection may
/// succeed; false for answers (errors the server sent, malformed replies).
fn is_connection_failure(e: &CallError) -> bool {
    matches!(
        e,
        CallError::Connect(_)
            | CallError::Connection(_)
            | CallError::Read(_)
            | CallError::ReadChunk(_)
            | CallError::Write(_)
            | CallError::Closed(_)
    )
}

/// Calls a shard; with `retry`, a failed connection is replaced (the shard's address is read
/// again from the coordinator's map) and the call repeated until [`RECONNECT_WINDOW`] ends.
/// Only idempotent requests may be retried: pulls, and pushes that carry a data span (a shard
/// skips a span it applied).
async fn call_shard(
    link: ShardLink,
    net: Arc<Net>,
    coordinator: CoordLink,
    req: Request,
    payload: Bytes,
    retry: bool,
) -> Result<Frame<Response>, CallError> {
    let deadline = tokio::time::Instant::now() + RECONNECT_WINDOW;
    let mut delay = Duration::from_millis(100);
    loop {
        let err = match link.current().call(req.clone(), payload.clone()).await {
            Err(e) if retry && is_connection_failure(&e) => e,
            other => return other,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(err);
        }
        tracing::warn!(shard = %link.id, error = %err, "shard unreachable; reconnecting");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(2));
        let addr = match coordinator.call(Request::GetMap, Bytes::new()).await {
            Ok(Frame {
                msg: Response::Map(m),
                ..
            }) => m.addr_of(link.id).map(str::to_string),
            _ => None,
        };
        let Some(addr) = addr else { continue };
        if let Ok(c) = Conn::connect(&net.endpoint, &addr, &net.name, &net.settings).await {
            *link.conn.lock().unwrap_or_else(|p| p.into_inner()) = c;
        }
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
        let ep = client_endpoint(&cfg.identity, &cfg.settings, false)?;
        let name = &cfg.identity.name;
        let conn = connect_retry(&ep, &cfg.coordinator, name, &cfg.settings).await?;
        let coordinator = CoordLink {
            addr: cfg.coordinator.clone(),
            conn: Arc::new(Mutex::new(conn)),
            net: Arc::new(Net {
                endpoint: ep.clone(),
                settings: cfg.settings.clone(),
                name: name.to_string(),
            }),
        };
        let map = retry_not_ready(600, || async {
            match coordinator.call(Request::GetMap, Bytes::new()).await?.msg {
                Response::Map(m) => Ok(m),
                other => Err(CallError::unexpected(&other)),
            }
        })
        .await?;
        let job = fetch_job(&coordinator).await?;
        Job::with_map(ep, coordinator, job, map, &cfg.settings, name).await
    }

    async fn with_map(
        ep: quinn::Endpoint,
        coordinator: CoordLink,
        job: JobConfig,
        map: ShardMap,
        settings: &TransportSettings,
        name: &str,
    ) -> Result<Job, ClientError> {
        let layout = job.layout();
        let mut shards = Vec::new();
        for info in &map.shards {
            let ranges: Vec<KeyRange> = map
                .ranges_of(info.id)
                .map(|r| KeyRange {
                    start: r.start,
                    end: r.end,
                })
                .collect();
            let mut flat = Vec::new();
            for r in &ranges {
                let first = layout.span(Key(r.start));
                let last = layout.span(Key(r.end.saturating_sub(1)));
                match (first, last) {
                    (Some(a), Some(b)) if r.end > r.start => {
                        let end = b.offset + u64::from(b.len);
                        flat.push((a.offset as usize, (end - a.offset) as usize));
                    }
                    _ => {
                        return Err(ClientError::Inconsistent {
                            from: "coordinator".into(),
                            what: format!(
                                "shard map range {}..{} is outside the job",
                                r.start, r.end
                            ),
                        });
                    }
                }
            }
            let chunks = ranges
                .iter()
                .flat_map(|r| r.start..r.end)
                .filter_map(|k| layout.span(Key(k)))
                .map(|span| ChunkRef {
                    key: span.key,
                    len: span.len,
                })
                .collect();
            let conn = connect_retry(&ep, &info.addr, name, settings).await?;
            shards.push(ShardLink {
                id: info.id,
                conn: Arc::new(Mutex::new(conn)),
                ranges,
                flat,
                chunks,
            });
        }
        Ok(Job {
            net: coordinator.net.clone(),
            coordinator,
            shards,
            job,
            map,
            layout,
        })
    }

    /// The job configuration.
    pub fn config(&self) -> &JobConfig {
        &self.job
    }

    /// The shard map in use.
    pub fn map(&self) -> &ShardMap {
        &self.map
    }

    /// The key layout.
    pub fn layout(&self) -> &KeyLayout {
        &self.layout
    }

    /// Number of floats in the model.
    pub fn param_count(&self) -> usize {
        self.layout.total_len() as usize
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

    /// The coordinator's membership events and step times.
    pub async fn trace(&self) -> Result<JobTrace, ClientError> {
        match self
            .coordinator
            .call(Request::Trace, Bytes::new())
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
        let mut out = Vec::new();
        for s in &self.shards {
            match s.current().call(Request::Ledger, Bytes::new()).await?.msg {
                Response::Ledger(l) => out.push((s.id, l)),
                other => return Err(CallError::unexpected(&other).into()),
            }
        }
        Ok(out)
    }

    /// Registers as a worker. The session heartbeats in the background until it is dropped or
    /// leaves.
    pub async fn register(self, name: &str) -> Result<Session, ClientError> {
        let resp = retry_not_ready(600, || {
            self.coordinator.call(
                Request::Register {
                    name: name.to_string(),
                },
                Bytes::new(),
            )
        })
        .await?;
        let (worker, clock) = match resp.msg {
            Response::Registered { worker, clock, .. } => (worker, clock),
            other => return Err(CallError::unexpected(&other).into()),
        };
        let stop = CancellationToken::new();
        let lost = Arc::new(AtomicBool::new(false));
        let period =
            Duration::from_millis(u64::from(self.job.lease_ms) / 4).max(Duration::from_millis(10));
        tokio::spawn(heartbeat(
            self.coordinator.clone(),
            worker,
            period,
            stop.clone(),
            lost.clone(),
        ));
        Ok(Session {
            job: self,
            worker,
            clock,
            granted: clock,
            stop,
            lost,
            drain: false,
        })
    }

    /// Pulls every parameter into `out` (the flat vector), from all shards in parallel.
    /// `apply_through` closes BSP steps before that clock first.
    pub async fn pull_all(&self, out: &mut [f32], apply_through: Clock) -> Result<(), ClientError> {
        self.check_len(out.len())?;
        let mut set = JoinSet::new();
        for (i, s) in self.shards.iter().enumerate() {
            let req = Request::Pull {
                epoch: self.map.epoch,
                ranges: s.ranges.clone(),
                apply_through,
            };
            let call = call_shard(
                s.clone(),
                self.net.clone(),
                self.coordinator.clone(),
                req,
                Bytes::new(),
                true,
            );
            set.spawn(async move { (i, call.await) });
        }
        while let Some(joined) = set.join_next().await {
            let Ok((i, resp)) = joined else {
                return Err(self.inconsistent("client", "pull task failed".into()));
            };
            let resp = resp?;
            let link = &self.shards[i];
            let Response::Pulled { chunks } = resp.msg else {
                return Err(CallError::unexpected(&resp.msg).into());
            };
            self.scatter(link, &chunks, &resp.payload, out)?;
        }
        Ok(())
    }

    fn scatter(
        &self,
        link: &ShardLink,
        chunks: &[ChunkRef],
        payload: &[u8],
        out: &mut [f32],
    ) -> Result<(), ClientError> {
        let mut at = 0usize;
        for c in chunks {
            let span = self
                .layout
                .span(c.key)
                .filter(|s| s.len == c.len)
                .ok_or_else(|| {
                    self.inconsistent(
                        &link.id.to_string(),
                        format!(
                            "chunk {} of {} floats does not fit the layout",
                            c.key, c.len
                        ),
                    )
                })?;
            let n = c.len as usize;
            let bytes = payload.get(at..at + n * 4).ok_or_else(|| {
                self.inconsistent(
                    &link.id.to_string(),
                    "payload shorter than its chunks".into(),
                )
            })?;
            let off = span.offset as usize;
            bytes_to_f32s(bytes, &mut out[off..off + n])
                .map_err(|e| self.inconsistent(&link.id.to_string(), e.to_string()))?;
            at += n * 4;
        }
        if at != payload.len() {
            return Err(self.inconsistent(
                &link.id.to_string(),
                "payload longer than its chunks".into(),
            ));
        }
        Ok(())
    }

    /// Pulls only `keys` (a sparse read), one request per shard that holds any of them;
    /// returns each key's floats, in the order asked.
    pub async fn pull_keys(
        &self,
        keys: &[Key],
        apply_through: Clock,
    ) -> Result<Vec<(Key, Vec<f32>)>, ClientError> {
        if let Some(k) = keys.iter().find(|k| self.map.owner(**k).is_none()) {
            return Err(self.inconsistent("client", format!("{k} is not in the shard map")));
        }
        let mut got: Vec<(Key, Vec<f32>)> = Vec::with_capacity(keys.len());
        for s in &self.shards {
            let ranges: Vec<KeyRange> = keys
                .iter()
                .filter(|k| self.map.owner(**k) == Some(s.id))
                .map(|k| KeyRange {
                    start: k.0,
                    end: k.0 + 1,
                })
                .collect();
            if ranges.is_empty() {
                continue;
            }
            let req = Request::Pull {
                epoch: self.map.epoch,
                ranges,
                apply_through,
            };
            let resp = call_shard(
                s.clone(),
                self.net.clone(),
                self.coordinator.clone(),
                req,
                Bytes::new(),
                true,
            )
            .await?;
            let Response::Pulled { chunks } = &resp.msg else {
                return Err(CallError::unexpected(&resp.msg).into());
            };
            let mut at = 0usize;
            for c in chunks {
                let n = self
                    .layout
                    .span(c.key)
                    .filter(|sp| sp.len == c.len)
                    .map(|sp| sp.len as usize)
                    .ok_or_else(|| {
                        self.inconsistent(
                            &s.id.to_string(),
                            format!("chunk {} does not fit", c.key),
                        )
                    })?;
                let bytes = resp.payload.get(at..at + n * 4).ok_or_else(|| {
                    self.inconsistent(&s.id.to_string(), "payload shorter than its chunks".into())
                })?;
                let mut v = vec![0.0; n];
                bytes_to_f32s(bytes, &mut v)
                    .map_err(|e| self.inconsistent(&s.id.to_string(), e.to_string()))?;
                got.push((c.key, v));
                at += n * 4;
            }
        }
        keys.iter()
            .map(|k| {
                got.iter()
                    .find(|(g, _)| g == k)
                    .cloned()
                    .ok_or_else(|| self.inconsistent("shards", format!("{k} was not returned")))
            })
            .collect()
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

    /// Pushes the flat gradient vector `grads` for step `clock`, to all shards in parallel.
    async fn push_all(
        &self,
        worker: WorkerId,
        clock: Clock,
        grads: &[f32],
        span: Option<DataSpan>,
    ) -> Result<(), ClientError> {
        self.check_len(grads.len())?;
        // Shards refuse non-finite values too, but each sees only its part: checking here keeps
        // a bad gradient from being applied on some shards and refused on others.
        check_finite(grads)?;
        let mut set = JoinSet::new();
        for s in &self.shards {
            // A shard's ranges are contiguous runs of keys, hence contiguous runs of floats.
            let payload = if s.flat.len() == 1 {
                let (off, len) = s.flat[0];
                f32s_to_bytes(&grads[off..off + len])
            } else {
                let parts: Vec<f32> = s
                    .flat
                    .iter()
                    .flat_map(|&(o, l)| grads[o..o + l].iter().copied())
                    .collect();
                f32s_to_bytes(&parts)
            };
            let req = Request::Push {
                epoch: self.map.epoch,
                worker,
                clock,
                chunks: s.chunks.clone(),
                span,
            };
            let call = call_shard(
                s.clone(),
                self.net.clone(),
                self.coordinator.clone(),
                req,
                payload,
                span.is_some(),
            );
            set.spawn(call);
        }
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok(r) => {
                    r?;
                }
                Err(_) => return Err(self.inconsistent("client", "push task failed".into())),
            }
        }
        Ok(())
    }

    /// Pushes `(key, values)` pairs for step `clock` (a sparse write).
    pub async fn push_keys(
        &self,
        worker: WorkerId,
        clock: Clock,
        chunks: &[(Key, &[f32])],
    ) -> Result<(), ClientError> {
        for (_, v) in chunks {
            check_finite(v)?;
        }
        for s in &self.shards {
            let mine: Vec<&(Key, &[f32])> = chunks
                .iter()
                .filter(|(k, _)| self.map.owner(*k) == Some(s.id))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let refs = mine
                .iter()
                .map(|(k, v)| ChunkRef {
                    key: *k,
                    len: v.len() as u32,
                })
                .collect();
            let floats: Vec<f32> = mine.iter().flat_map(|(_, v)| v.iter().copied()).collect();
            let req = Request::Push {
                epoch: self.map.epoch,
                worker,
                clock,
                chunks: refs,
                span: None,
            };
            s.current().call(req, f32s_to_bytes(&floats)).await?;
        }
        Ok(())
    }
}

fn check_finite(values: &[f32]) -> Result<(), ClientError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(ClientError::NonFinite { index }),
        None => Ok(()),
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

async fn connect_retry(
    ep: &quinn::Endpoint,
    addr: &str,
    name: &str,
    settings: &TransportSettings,
) -> Result<Conn, ClientError> {
    let mut attempt = 0;
    loop {
        match Conn::connect(ep, addr, name, settings).await {
            Ok(c) => return Ok(c),
            // A server that does not answer may be starting up: retry a few times. Anything
            // else (a refused certificate, a wrong version) is final.
            Err(e @ CallError::Connection(quinn::ConnectionError::TimedOut)) if attempt < 3 => {
                tracing::debug!(%addr, error = %e, "connect timed out; retrying");
                attempt += 1;
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
) {
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match conn.call(Request::Heartbeat { worker }, Bytes::new()).await {
            Ok(_) => {}
            Err(e) if e.code() == Some(ErrorCode::UnknownWorker) => {
                tracing::warn!(%worker, "coordinator dropped this worker");
                lost.store(true, Ordering::SeqCst);
                return;
            }
            Err(e) => tracing::debug!(%worker, error = %e, "heartbeat failed"),
        }
    }
}
