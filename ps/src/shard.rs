//! A shard server: owns key ranges of the model, holds their parameters and optimizer state,
//! applies pushed gradients with the server-side optimizer, and enforces BSP aggregation.
//!
//! Each chunk sits behind its own lock (a `DashMap` entry), so concurrent pushes to the same
//! chunk serialize and none is lost, while pushes to different chunks run in parallel.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use dashmap::DashMap;
use edl_shared::proto::frame::bytes_to_f32s;
use edl_shared::proto::ids::{Clock, Key, MapEpoch, ShardId, WorkerId};
use edl_shared::proto::msg::{ChunkRef, DataSpan, EpochLedger, KeyRange, ShardStats};
use edl_shared::proto::{
    Consistency, ErrorCode, Frame, Init, JobConfig, OptimizerSpec, Request, Response, ShardMap,
};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{CallError, Conn, TransportSettings, client_endpoint, server_endpoint};
use edl_shared::{Identity, Peer, Role, Service};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::sync::watch;
use tracing::info;

use crate::checkpoint::{self, CheckpointError, ChunkSnap, ShardCheckpoint};
use crate::ledger::{Claim, DataLedger};
use crate::optimizer::OptState;

/// One chunk of parameters with its optimizer state.
#[derive(Debug)]
struct Chunk {
    params: Vec<f32>,
    opt: OptState,
    /// BSP: summed gradients per step, waiting for the step's barrier.
    pending: BTreeMap<u64, (Vec<f32>, u32)>,
    /// BSP: every step before this clock has been applied.
    applied_through: u64,
}

/// The state of one shard once the coordinator has assigned its ranges.
#[derive(Debug)]
pub struct ShardState {
    id: ShardId,
    job: JobConfig,
    map: ShardMap,
    chunks: DashMap<Key, Chunk>,
    ledger: Mutex<DataLedger>,
    load: Load,
    /// Pushes hold it shared while they apply; a checkpoint holds it exclusively while it
    /// copies the state, so it never sees half a push.
    gate: RwLock<()>,
}

/// Request counters for operators.
#[derive(Debug, Default)]
struct Load {
    pushes: AtomicU64,
    pulls: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

/// A refused request: a stable code, a message and, for a stale epoch, the current map.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// The wire code.
    pub code: ErrorCode,
    /// What was wrong.
    pub message: String,
    /// With [`ErrorCode::StaleEpoch`]: the current map.
    pub map: Option<Box<ShardMap>>,
}

impl Refusal {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Refusal {
            code,
            message: message.into(),
            map: None,
        }
    }
}

impl From<Refusal> for Response {
    fn from(r: Refusal) -> Response {
        Response::Error {
            code: r.code.as_u16(),
            message: r.message,
            map: r.map.map(|m| *m),
        }
    }
}

impl ShardState {
    /// Initializes the chunks `map` places on `id`, seeded per key so that values do not depend
    /// on placement.
    pub fn new(id: ShardId, job: JobConfig, map: ShardMap) -> Self {
        let layout = job.layout();
        let chunks = DashMap::new();
        for r in map.ranges_of(id) {
            for k in r.start..r.end {
                let Some(span) = layout.span(Key(k)) else {
                    continue;
                };
                let len = span.len as usize;
                let params = match job.tensors.get(span.tensor).map(|t| &t.init) {
                    Some(Init::Uniform { limit }) if *limit > 0.0 => {
                        let mut rng =
                            StdRng::seed_from_u64(job.seed ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                        (0..len)
                            .map(|_| rng.random_range(-limit..=*limit))
                            .collect()
                    }
                    _ => vec![0.0; len],
                };
                chunks.insert(
                    Key(k),
                    Chunk {
                        opt: OptState::new(&job.optimizer, len),
                        params,
                        pending: BTreeMap::new(),
                        applied_through: 0,
                    },
                );
            }
        }
        ShardState {
            id,
            ledger: Mutex::new(DataLedger::new(&job)),
            load: Load::default(),
            gate: RwLock::new(()),
            job,
            map,
            chunks,
        }
    }

    /// A shard with the state of a checkpoint. The checkpoint must come from this shard of
    /// this job and hold exactly the keys the map places here.
    pub fn restore(
        id: ShardId,
        job: JobConfig,
        map: ShardMap,
        ckpt: ShardCheckpoint,
    ) -> Result<Self, CheckpointError> {
        let mismatch = |what: String| CheckpointError::Mismatch(what);
        if ckpt.shard != id.0 {
            return Err(mismatch(format!(
                "checkpoint of shard {} offered to shard {id}",
                ckpt.shard
            )));
        }
        if ckpt.job_fingerprint != checkpoint::fingerprint(&job) {
            return Err(mismatch(
                "the checkpoint belongs to another job configuration".into(),
            ));
        }
        let fresh = ShardState::new(id, job, map);
        if ckpt.chunks.len() != fresh.chunks.len() {
            return Err(mismatch(format!(
                "checkpoint holds {} keys, the shard map places {} here",
                ckpt.chunks.len(),
                fresh.chunks.len()
            )));
        }
        for snap in ckpt.chunks {
            let Some(mut chunk) = fresh.chunks.get_mut(&Key(snap.key)) else {
                return Err(mismatch(format!("key {} is not placed on {id}", snap.key)));
            };
            let n = chunk.params.len();
            let opt = match (&fresh.job.optimizer, snap.m.len(), snap.v.len()) {
                (OptimizerSpec::Sgd { .. }, 0, 0) => OptState::Sgd,
                (OptimizerSpec::Momentum { .. }, m, 0) if m == n => {
                    OptState::Momentum { v: snap.m }
                }
                (OptimizerSpec::Adam { .. }, m, v) if m == n && v == n => OptState::Adam {
                    m: snap.m,
                    v: snap.v,
                    t: snap.t,
                },
                _ => {
                    return Err(mismatch(format!(
                        "optimizer state of key {} does not fit",
                        snap.key
                    )));
                }
            };
            if snap.params.len() != n || snap.pending.iter().any(|(_, s, _)| s.len() != n) {
                return Err(mismatch(format!("key {} has the wrong length", snap.key)));
            }
            chunk.params = snap.params;
            chunk.opt = opt;
            chunk.pending = snap
                .pending
                .into_iter()
                .map(|(c, s, k)| (c, (s, k)))
                .collect();
            chunk.applied_through = snap.applied_through;
        }
        let ledger = DataLedger::restore(&fresh.job, &ckpt.ledger).map_err(mismatch)?;
        *fresh.ledger() = ledger;
        Ok(fresh)
    }

    /// A consistent copy of the state, for a checkpoint.
    pub fn snapshot(&self) -> ShardCheckpoint {
        let _gate = self.gate.write().unwrap_or_else(|p| p.into_inner());
        let mut chunks: Vec<ChunkSnap> = self
            .chunks
            .iter()
            .map(|c| {
                let (m, v, t) = match &c.opt {
                    OptState::Sgd => (Vec::new(), Vec::new(), 0),
                    OptState::Momentum { v } => (v.clone(), Vec::new(), 0),
                    OptState::Adam { m, v, t } => (m.clone(), v.clone(), *t),
                };
                ChunkSnap {
                    key: c.key().0,
                    params: c.params.clone(),
                    m,
                    v,
                    t,
                    pending: c
                        .pending
                        .iter()
                        .map(|(k, (s, n))| (*k, s.clone(), *n))
                        .collect(),
                    applied_through: c.applied_through,
                }
            })
            .collect();
        chunks.sort_unstable_by_key(|c| c.key);
        ShardCheckpoint {
            shard: self.id.0,
            job_fingerprint: checkpoint::fingerprint(&self.job),
            chunks,
            ledger: self.ledger().snapshot(),
        }
    }

    /// This shard's id.
    pub fn id(&self) -> ShardId {
        self.id
    }

    /// Number of keys held.
    pub fn num_keys(&self) -> usize {
        self.chunks.len()
    }

    fn check_epoch(&self, epoch: MapEpoch) -> Result<(), Refusal> {
        if epoch != self.map.epoch {
            return Err(Refusal {
                code: ErrorCode::StaleEpoch,
                message: format!(
                    "request routed with shard map {epoch}, current is {}",
                    self.map.epoch
                ),
                map: Some(Box::new(self.map.clone())),
            });
        }
        Ok(())
    }

    fn bsp(&self) -> bool {
        self.job.consistency == Consistency::Bsp
    }

    /// Reads the chunks in `ranges`, applying due BSP updates first.
    pub fn pull(
        &self,
        epoch: MapEpoch,
        ranges: &[KeyRange],
        apply_through: Clock,
    ) -> Result<Frame<Response>, Refusal> {
        self.check_epoch(epoch)?;
        let mut keys = Vec::new();
        for r in ranges {
            // A shard never holds more keys than it has chunks, which also bounds what a
            // request with many or huge ranges can make it allocate.
            if r.end < r.start || r.end - r.start + keys.len() as u64 > self.chunks.len() as u64 {
                return Err(Refusal::new(
                    ErrorCode::UnknownKey,
                    format!("range {}..{} is not held by {}", r.start, r.end, self.id),
                ));
            }
            keys.extend((r.start..r.end).map(Key));
        }
        let mut refs = Vec::with_capacity(keys.len());
        let mut out = BytesMut::new();
        for key in keys {
            let Some(mut chunk) = self.chunks.get_mut(&key) else {
                return Err(Refusal::new(
                    ErrorCode::UnknownKey,
                    format!("{key} is not held by {}", self.id),
                ));
            };
            if self.bsp() {
                apply_due(&self.job, &mut chunk, apply_through.0);
            }
            out.reserve(chunk.params.len() * 4);
            for v in &chunk.params {
                out.extend_from_slice(&v.to_le_bytes());
            }
            refs.push(ChunkRef {
                key,
                len: chunk.params.len() as u32,
            });
        }
        self.load.pulls.fetch_add(1, Ordering::Relaxed);
        self.load
            .bytes_out
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(Frame::with_payload(
            Response::Pulled { chunks: refs },
            out.freeze(),
        ))
    }

    /// Applies (ASP, SSP) or stages (BSP) a push. Everything is validated before any state
    /// changes, so a bad push changes nothing. A push whose data span this shard has applied
    /// already is acknowledged and skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &self,
        epoch: MapEpoch,
        worker: WorkerId,
        clock: Clock,
        chunks: &[ChunkRef],
        payload: &[u8],
        span: Option<&DataSpan>,
    ) -> Result<Claim, Refusal> {
        self.check_epoch(epoch)?;
        let bad = |(code, msg): (ErrorCode, String)| {
            Refusal::new(code, format!("push from {worker}: {msg}"))
        };
        let total: u64 = chunks.iter().map(|c| u64::from(c.len)).sum();
        if total * 4 != payload.len() as u64 {
            return Err(bad((
                ErrorCode::ShapeMismatch,
                format!("{} payload bytes for {total} floats", payload.len()),
            )));
        }
        let mut grads = vec![0f32; total as usize];
        bytes_to_f32s(payload, &mut grads)
            .map_err(|e| bad((ErrorCode::Malformed, e.to_string())))?;
        if let Some(i) = grads.iter().position(|g| !g.is_finite()) {
            return Err(bad((
                ErrorCode::NonFinite,
                format!("gradient value {} at float {i} is not finite", grads[i]),
            )));
        }
        for c in chunks {
            match self.chunks.get(&c.key) {
                None => {
                    return Err(bad((
                        ErrorCode::UnknownKey,
                        format!("{} is not held by {}", c.key, self.id),
                    )));
                }
                Some(chunk) if chunk.params.len() != c.len as usize => {
                    return Err(bad((
                        ErrorCode::ShapeMismatch,
                        format!(
                            "{} has {} floats, push has {}",
                            c.key,
                            chunk.params.len(),
                            c.len
                        ),
                    )));
                }
                Some(chunk) if self.bsp() && clock.0 < chunk.applied_through => {
                    return Err(bad((
                        ErrorCode::StaleClock,
                        format!("step {} of {} was already applied", clock.0, c.key),
                    )));
                }
                Some(_) => {}
            }
        }
        // From the claim to the last chunk, a checkpoint must not cut this push in two.
        let _gate = self.gate.read().unwrap_or_else(|p| p.into_inner());
        // Claim the span last: once it is recorded, the chunks below are updated.
        if let Some(span) = span {
            let claim = self.ledger().claim(span).map_err(bad)?;
            if claim == Claim::AlreadyApplied {
                tracing::debug!(%worker, epoch = span.epoch, partition = span.partition,
                    start = span.start, "span already applied here; skipped");
                return Ok(Claim::AlreadyApplied);
            }
        }
        self.load.pushes.fetch_add(1, Ordering::Relaxed);
        self.load
            .bytes_in
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        let mut offset = 0;
        for c in chunks {
            let g = &grads[offset..offset + c.len as usize];
            offset += c.len as usize;
            let Some(mut chunk) = self.chunks.get_mut(&c.key) else {
                continue;
            };
            let chunk = &mut *chunk;
            if self.bsp() {
                // Re-check under the chunk lock: a pull may have applied this step meanwhile.
                if clock.0 < chunk.applied_through {
                    return Err(bad((
                        ErrorCode::StaleClock,
                        format!("step {} closed", clock.0),
                    )));
                }
                let slot = chunk
                    .pending
                    .entry(clock.0)
                    .or_insert_with(|| (vec![0.0; g.len()], 0));
                for (s, g) in slot.0.iter_mut().zip(g) {
                    *s += g;
                }
                slot.1 += 1;
            } else {
                chunk
                    .opt
                    .apply(&self.job.optimizer, &mut chunk.params, g, 1.0);
            }
        }
        Ok(Claim::Apply)
    }

    fn ledger(&self) -> MutexGuard<'_, DataLedger> {
        // The ledger is only ever updated whole under the lock; keep serving if a holder panicked.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holdings and load.
    pub fn stats(&self) -> ShardStats {
        let mut floats = 0u64;
        let mut state_bytes = 0u64;
        for c in self.chunks.iter() {
            let n = c.params.len() as u64;
            floats += n;
            let opt = match &c.opt {
                OptState::Sgd => 0,
                OptState::Momentum { v } => v.len() as u64,
                OptState::Adam { m, v, .. } => (m.len() + v.len()) as u64,
            };
            state_bytes += 4 * (n + opt);
        }
        ShardStats {
            shard: self.id,
            ranges: self
                .map
                .ranges_of(self.id)
                .map(|r| KeyRange {
                    start: r.start,
                    end: r.end,
                })
                .collect(),
            keys: self.chunks.len() as u64,
            floats,
            state_bytes,
            pushes: self.load.pushes.load(Ordering::Relaxed),
            pulls: self.load.pulls.load(Ordering::Relaxed),
            bytes_in: self.load.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.load.bytes_out.load(Ordering::Relaxed),
        }
    }

    /// The per-epoch data ledger.
    pub fn ledger_report(&self) -> Vec<EpochLedger> {
        self.ledger().report()
    }
}

/// Applies, in step order, every pending BSP update of a step before `through`.
fn apply_due(job: &JobConfig, chunk: &mut Chunk, through: u64) {
    while let Some(entry) = chunk.pending.first_entry() {
        if *entry.key() >= through {
            break;
        }
        let (sum, n) = entry.remove();
        let Chunk { params, opt, .. } = chunk;
        opt.apply(&job.optimizer, params, &sum, 1.0 / n.max(1) as f32);
    }
    chunk.applied_through = chunk.applied_through.max(through);
}

/// The shard service: waits for its assignment, then serves pulls and pushes.
pub struct ShardService {
    state: watch::Receiver<Option<Arc<ShardState>>>,
    checkpoint: Option<PathBuf>,
}

impl ShardService {
    async fn ready(&self) -> Option<Arc<ShardState>> {
        let mut rx = self.state.clone();
        let wait = rx.wait_for(|s| s.is_some());
        match tokio::time::timeout(Duration::from_secs(30), wait).await {
            Ok(Ok(s)) => s.clone(),
            _ => None,
        }
    }
}

impl Service for ShardService {
    fn allowed(&self, role: Role, req: &Request) -> bool {
        match req {
            Request::Push { .. } => role == Role::Worker,
            Request::Checkpoint => role == Role::Admin,
            _ => true,
        }
    }

    async fn handle(&self, _peer: &Peer, req: Request, payload: Bytes) -> Frame<Response> {
        let Some(st) = self.ready().await else {
            return Frame::new(Response::error(
                ErrorCode::NotReady,
                "shard has no assignment yet",
            ));
        };
        let out = match req {
            Request::Pull {
                epoch,
                ranges,
                apply_through,
            } => st
                .pull(epoch, &ranges, apply_through)
                .map_err(Response::from),
            Request::Push {
                epoch,
                worker,
                clock,
                chunks,
                span,
            } => st
                .push(epoch, worker, clock, &chunks, &payload, span.as_ref())
                .map(|_| Frame::new(Response::Ack))
                .map_err(Response::from),
            Request::Ledger => Ok(Frame::new(Response::Ledger(st.ledger_report()))),
            Request::ShardStats => Ok(Frame::new(Response::ShardStats(st.stats()))),
            Request::Checkpoint => match &self.checkpoint {
                None => Err(Response::error(
                    ErrorCode::InvalidRequest,
                    "this shard runs without a checkpoint path",
                )),
                Some(path) => {
                    let (st, path) = (st.clone(), path.clone());
                    // Copying is quick; writing and syncing block, so keep them off the runtime.
                    let written = tokio::task::spawn_blocking(move || {
                        write_checkpoint(&st, &path).map(|r| (r, path))
                    })
                    .await;
                    match written {
                        Ok(Ok(((bytes, millis), path))) => Ok(Frame::new(Response::Checkpointed {
                            path: path.display().to_string(),
                            bytes,
                            millis,
                        })),
                        Ok(Err(e)) => Err(Response::error(ErrorCode::Internal, e.to_string())),
                        Err(e) => Err(Response::error(ErrorCode::Internal, e.to_string())),
                    }
                }
            },
            Request::GetMap => Ok(Frame::new(Response::Map(st.map.clone()))),
            other => Err(Response::error(
                ErrorCode::InvalidRequest,
                format!("a shard does not serve {}", other.name()),
            )),
        };
        out.unwrap_or_else(Frame::new)
    }
}

/// Where a shard listens and how it finds the coordinator.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    /// The coordinator's address.
    pub coordinator: String,
    /// The address to bind.
    pub listen: SocketAddr,
    /// The address to announce to workers (defaults to the bound address).
    pub advertise: Option<String>,
    /// Where this shard keeps its checkpoint; `None` disables checkpoints.
    pub checkpoint: Option<PathBuf>,
    /// Write a checkpoint this often (and on demand, and at shutdown).
    pub checkpoint_every: Option<Duration>,
}

/// Writes a checkpoint of `state` to `path`; returns (bytes, milliseconds).
pub fn write_checkpoint(state: &ShardState, path: &Path) -> Result<(u64, f64), CheckpointError> {
    let t = std::time::Instant::now();
    let bytes = checkpoint::write(path, &state.snapshot())?;
    Ok((bytes, t.elapsed().as_secs_f64() * 1000.0))
}

/// Runs a shard until `shutdown`: binds, joins the coordinator, initializes its ranges, serves.
pub async fn run(
    config: ShardConfig,
    identity: Identity,
    settings: TransportSettings,
    shutdown: CancellationToken,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    let endpoint = server_endpoint(config.listen, &identity, &settings)?;
    let addr = endpoint.local_addr()?;
    if let Some(tx) = bound {
        let _ = tx.send(addr);
    }
    let (tx, rx) = watch::channel(None);
    let service = Arc::new(ShardService {
        state: rx,
        checkpoint: config.checkpoint.clone(),
    });
    let server = tokio::spawn(edl_shared::serve(
        endpoint,
        service,
        settings.limits,
        shutdown.clone(),
    ));
    let advertise = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    let joined = tokio::select! {
        _ = shutdown.cancelled() => None,
        r = join(&config.coordinator, &advertise, &identity, &settings) => Some(r?),
    };
    let Some((id, job, map)) = joined else {
        server.await?;
        return Ok(());
    };
    let state = match config.checkpoint.as_deref().filter(|p| p.exists()) {
        Some(path) => {
            let t = std::time::Instant::now();
            let restored = checkpoint::read(path)
                .and_then(|ckpt| ShardState::restore(id, job, map, ckpt))
                .map_err(|e| anyhow::anyhow!("restoring {}: {e}", path.display()))?;
            info!(shard = %id, path = %path.display(), keys = restored.num_keys(),
                millis = t.elapsed().as_secs_f64() * 1000.0, "restored from checkpoint");
            restored
        }
        None => ShardState::new(id, job, map),
    };
    let state = Arc::new(state);
    info!(shard = %id, %addr, keys = state.num_keys(), "shard serving");
    let _ = tx.send(Some(state.clone()));
    let periodic = match (&config.checkpoint, config.checkpoint_every) {
        (Some(path), Some(every)) => {
            let (state, path, stop) = (state.clone(), path.clone(), shutdown.clone());
            Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    let (st, p) = (state.clone(), path.clone());
                    match tokio::task::spawn_blocking(move || write_checkpoint(&st, &p)).await {
                        Ok(Ok((bytes, ms))) => tracing::debug!(bytes, ms, "checkpoint written"),
                        Ok(Err(e)) => tracing::error!(error = %e, "checkpoint failed"),
                        Err(e) => tracing::error!(error = %e, "checkpoint task failed"),
                    }
                }
            }))
        }
        _ => None,
    };
    server.await?;
    if let Some(p) = periodic {
        let _ = p.await;
    }
    // A clean shutdown leaves a checkpoint of the final state.
    if let Some(path) = &config.checkpoint {
        match write_checkpoint(&state, path) {
            Ok((bytes, ms)) => info!(bytes, ms, path = %path.display(), "final checkpoint written"),
            Err(e) => tracing::error!(error = %e, "final checkpoint failed"),
        }
    }
    Ok(())
}

/// Joins the coordinator, retrying while it is not reachable or not ready.
async fn join(
    coordinator: &str,
    advertise: &str,
    identity: &Identity,
    settings: &TransportSettings,
) -> anyhow::Result<(ShardId, JobConfig, ShardMap)> {
    let ep = client_endpoint(identity, settings, false)?;
    let mut delay = Duration::from_millis(50);
    loop {
        let attempt = async {
            let conn = Conn::connect(&ep, coordinator, &identity.name, settings).await?;
            let resp = conn
                .call(
                    Request::ShardJoin {
                        addr: advertise.to_string(),
                    },
                    Bytes::new(),
                )
                .await?;
            match resp.msg {
                Response::ShardAssigned { shard, job, map } => Ok((shard, job, map)),
                other => Err(CallError::unexpected(&other)),
            }
        };
        match attempt.await {
            Ok(v) => return Ok(v),
            Err(e @ CallError::Remote { .. }) if e.code() != Some(ErrorCode::NotReady) => {
                return Err(e.into());
            }
            Err(e) => {
                tracing::debug!(error = %e, "coordinator not ready; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

#[cfg(test)]
mod tests;
