//! A shard server: owns key ranges of the model, holds their parameters and optimizer state,
//! applies pushed gradients with the server-side optimizer, and enforces BSP aggregation.
//!
//! Each chunk sits behind its own lock (a `DashMap` entry), so concurrent pushes to the same
//! chunk serialize and none is lost, while pushes to different chunks run in parallel.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use dashmap::DashMap;
use edl_shared::proto::coded::{self, Coded};
use edl_shared::proto::frame::{
    F32Run, LeF32s, bytes_to_f32s, f32s_in_place, f32s_to_bytes, first_non_finite,
};
use edl_shared::proto::ids::{Clock, Key, MapEpoch, ShardId, Token, WorkerId};
use edl_shared::proto::msg::{
    ChunkRef, DataSpan, EpochLedger, KeyLoad, KeyRange, MoveReport, ShardStats,
};
use edl_shared::proto::wire::{Wire, encode_finite};
use edl_shared::proto::{
    Consistency, ErrorCode, Frame, Init, JobConfig, KeyLayout, OptimizerSpec, Parts, ProtoError,
    Request, Response, ScheduleUnit, ShardMap,
};
use edl_shared::shutdown::CancellationToken;
use edl_shared::token::Signer;
use edl_shared::transport::{CallError, Conn, TransportSettings, client_endpoint, server_endpoint};
use edl_shared::{Identity, Peer, Role, Service};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::sync::watch;
use tracing::info;

use crate::checkpoint::{self, CheckpointError, ChunkSnap, RangeExport, ShardCheckpoint};
use crate::ledger::{Claim, Ledgers};
use crate::link::{ShardCaller, ShardLink};
use crate::optimizer::OptState;

/// Pushes of at least this many bytes are applied on two cores (ASP and SSP) where one is
/// spare (see [`SPLIT_BESIDE`]). At 16 MiB this took the update from about 2 ms to 1.2 ms of
/// a push+pull pair on an Intel Xeon (`edl-bench transport`, edl against edl-noopt); on an AMD
/// EPYC (Zen 3) VM it made no difference beyond the noise at 4 and 16 MiB. The threshold
/// itself was not measured, only chosen so that starting a thread is small beside the update
/// it shares.
const PARALLEL_APPLY_BYTES: u64 = 4 << 20;

/// The share of a two-core update (numerator, denominator) that the request's own thread
/// applies: the other thread starts ~130 µs later (a new thread; measured at 16 MiB), so it
/// gets less. At 16 MiB, 55% took the update's p50 from 1.16-1.20 ms (halves) to 1.02-1.14 ms.
const HERE_SHARE: (u64, u64) = (11, 20);

/// A large push is applied on two cores only when the shard's server has at most this many
/// bytes in flight beside it (its header, small requests): with other pushes arriving or being
/// applied, the second core is busy with them already, and a thread of the push's own only
/// competes with them. Measured with `edl-bench scale --shards 1 --workers 1,6,8 --consistency
/// asp` (4 MiB pushes; AMD EPYC Zen 3 VM, 2 cores), two runs each, the ceiling worked out from
/// the load column: splitting every large push, a transport ceiling of about 222 steps/s and
/// 76-78% efficiency at 8 workers; splitting only beside nothing else, about 260 steps/s and
/// 79-88%; never splitting, about 270 steps/s and 86-87%.
const SPLIT_BESIDE: u64 = 64 << 10;

/// The cores this process may use (read once: finding out reads the cgroup's files).
static CORES: std::sync::LazyLock<usize> =
    std::sync::LazyLock::new(|| std::thread::available_parallelism().map_or(1, |n| n.get()));

/// The floats of `chunks`.
fn floats_in(chunks: &[ChunkRef]) -> u64 {
    chunks.iter().map(|c| u64::from(c.len)).sum()
}

/// A chunk's parameters as the payload of a pull answer: on little-endian machines, the values
/// as they lie in memory, shared until quinn has sent them (the next update then writes into
/// a copy); elsewhere, a little-endian copy.
fn wire_params(params: &Arc<Vec<f32>>) -> Bytes {
    /// Owns a reference to parameters while a pull answer is being sent.
    struct Shared(Arc<Vec<f32>>);
    impl AsRef<[u8]> for Shared {
        fn as_ref(&self) -> &[u8] {
            bytemuck::cast_slice(self.0.as_slice())
        }
    }
    if cfg!(target_endian = "little") {
        Bytes::from_owner(Shared(params.clone()))
    } else {
        f32s_to_bytes(params)
    }
}

/// A chunk of f32 parameters (as [`wire_params`] made it) in a 16-bit `wire`, or `None` if a
/// value does not fit it. The parameters are read where they lie (a copy only on a
/// big-endian machine).
fn narrowed(chunk: &Bytes, wire: Wire) -> Option<Bytes> {
    let copy;
    let values = match f32s_in_place(chunk) {
        Some(v) => v,
        None => {
            let mut c = vec![0.0; chunk.len() / 4];
            bytes_to_f32s(chunk, &mut c).ok()?;
            copy = c;
            &copy[..]
        }
    };
    let mut b = BytesMut::with_capacity(values.len() * wire.value_bytes());
    encode_finite(&mut b, values, wire).ok()?;
    Some(b.freeze())
}

/// Why a push whose payload does not hold its chunks as they say is refused.
fn coded_refusal(e: ProtoError, bytes: u64, chunks: &[ChunkRef]) -> (ErrorCode, String) {
    match e {
        ProtoError::NonFinite { index } => (
            ErrorCode::NonFinite,
            format!("gradient value at float {index} is not finite; nothing was applied"),
        ),
        ProtoError::Truncated { .. } | ProtoError::Trailing(_) => (
            ErrorCode::ShapeMismatch,
            format!(
                "{bytes} payload bytes for the values of {} chunks of {} floats",
                chunks.len(),
                floats_in(chunks)
            ),
        ),
        other => (ErrorCode::Malformed, other.to_string()),
    }
}

/// A draw from the standard normal distribution (Box-Muller).
fn standard_normal(rng: &mut StdRng) -> f32 {
    // 1 - u lies in (0, 1], so the logarithm is finite.
    let u: f64 = 1.0 - rng.random::<f64>();
    let v: f64 = rng.random();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// BSP: one step's gradients for a chunk, summed while they wait for the step's barrier.
#[derive(Debug)]
struct Staged {
    /// The sum.
    sum: Vec<f32>,
    /// Gradients in it (the update applies their mean).
    pushes: u32,
    /// The latest epoch of their samples (what an epoch schedule counts).
    epoch: u32,
}

/// One chunk of parameters with its optimizer state.
#[derive(Debug)]
struct Chunk {
    /// Shared with the pull answers still being sent: an update writes in place, or into a
    /// copy while a pull still holds the values (`Arc::make_mut`).
    params: Arc<Vec<f32>>,
    opt: OptState,
    /// BSP: summed gradients per step, waiting for the step's barrier.
    pending: BTreeMap<u64, Staged>,
    /// BSP: every step before this clock has been applied.
    applied_through: u64,
    /// The ledger segment this key belongs to (see [`Ledgers`]).
    segment: u32,
    /// Floats read and written since the last rebalance.
    load: u64,
    /// The parameter group of its tensor, looked up once ([`JobConfig::group_of`]): the
    /// optimizer that updates it is [`JobConfig::group_optimizer`]'s.
    group: Option<usize>,
}

impl Chunk {
    /// A fresh chunk of `key`, initialized from the job seed and the key.
    fn fresh(job: &JobConfig, key: Key, tensor: usize, len: usize) -> Chunk {
        let rng = || StdRng::seed_from_u64(job.seed ^ key.0.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let params = match job.tensors.get(tensor).map(|t| &t.init) {
            Some(Init::Uniform { limit }) if *limit > 0.0 => {
                let mut rng = rng();
                (0..len)
                    .map(|_| rng.random_range(-limit..=*limit))
                    .collect()
            }
            Some(Init::Normal { std }) if *std > 0.0 => {
                let mut rng = rng();
                (0..len).map(|_| std * standard_normal(&mut rng)).collect()
            }
            Some(Init::Constant { value }) => vec![*value; len],
            _ => vec![0.0; len],
        };
        Chunk {
            opt: OptState::new(job.optimizer_of(tensor), len),
            group: job.group_of(tensor),
            params: Arc::new(params),
            pending: BTreeMap::new(),
            applied_through: 0,
            segment: 0,
            load: 0,
        }
    }

    /// A chunk from its snapshot, checked against the layout and the optimizer.
    fn from_snap(job: &JobConfig, layout: &KeyLayout, snap: ChunkSnap) -> Result<Chunk, String> {
        let Some(span) = layout.span(Key(snap.key)).copied() else {
            return Err(format!("key {} is not part of the job", snap.key));
        };
        let n = span.len as usize;
        let opt = OptState {
            t: snap.t,
            bufs: snap.state,
        };
        let optimizer = job.optimizer_of(span.tensor);
        if !opt.fits(optimizer, n) {
            return Err(format!(
                "optimizer state of key {} does not fit {optimizer}",
                snap.key
            ));
        }
        if snap.params.len() != n || snap.pending.iter().any(|(_, s, ..)| s.len() != n) {
            return Err(format!("key {} has the wrong length", snap.key));
        }
        if first_non_finite(&snap.params).is_some() {
            return Err(format!("key {} holds non-finite parameters", snap.key));
        }
        Ok(Chunk {
            params: Arc::new(snap.params),
            opt,
            group: job.group_of(span.tensor),
            pending: snap
                .pending
                .into_iter()
                .map(|(c, sum, pushes, epoch)| {
                    let staged = Staged { sum, pushes, epoch };
                    (c, staged)
                })
                .collect(),
            applied_through: snap.applied_through,
            segment: snap.segment,
            load: snap.load,
        })
    }

    fn snap(&self, key: Key) -> ChunkSnap {
        ChunkSnap {
            key: key.0,
            params: self.params.to_vec(),
            state: self.opt.bufs.clone(),
            t: self.opt.t,
            pending: self
                .pending
                .iter()
                .map(|(k, s)| (*k, s.sum.clone(), s.pushes, s.epoch))
                .collect(),
            applied_through: self.applied_through,
            segment: self.segment,
            load: self.load,
        }
    }
}

/// The state of one shard once the coordinator has assigned its ranges.
#[derive(Debug)]
pub struct ShardState {
    id: ShardId,
    job: JobConfig,
    /// The job's keys and their lengths.
    layout: KeyLayout,
    /// The newest map this shard knows; it changes when ranges move.
    map: watch::Sender<Arc<ShardMap>>,
    /// Wakes the requests routed with a newer map than this shard's when it learns one, in
    /// the order they began to wait (a `watch` wakes in a random order, which made the
    /// simulation's runs differ).
    map_changed: tokio::sync::Notify,
    /// The chunks this shard is the primary of (it serves their pulls and pushes).
    chunks: DashMap<Key, Chunk>,
    ledgers: Mutex<Ledgers>,
    /// Replicated jobs: the backup copies this shard holds for other shards' ranges, with
    /// ledgers of their own; a primary's forwarded pushes update them, and a map that makes
    /// this shard the primary of their keys promotes them.
    backup_chunks: DashMap<Key, Chunk>,
    backup_ledgers: Mutex<Ledgers>,
    /// Forwards of pushes to backups (one per push and backup) not acknowledged yet (how far
    /// the backups lag).
    forwarding: AtomicU64,
    /// A primary: the backups it is seeding (`CopyOut` under way), with their ranges; pushes
    /// forwarded to them say so.
    seeding: Mutex<Vec<(ShardId, u64, u64)>>,
    /// A new backup: pushes forwarded before the copy of their keys arrived, applied once it
    /// has (see [`ShardState::keep_or_replicate`]).
    incoming: Mutex<Vec<Kept>>,
    load: Load,
    /// Pushes and pulls hold it shared while they check that they hold their keys and use
    /// them; a checkpoint holds it exclusively while it copies the state, so it never sees
    /// half a push, and a range move holds it exclusively while keys leave or arrive.
    gate: RwLock<()>,
    /// Held from a checkpoint's snapshot to its rename, so that checkpoints (periodic, on
    /// demand, after a move, at shutdown) reach the disk one at a time and in snapshot order.
    saving: Mutex<()>,
    /// The latest epoch of any push's samples: what an epoch schedule counts for a push
    /// that names none.
    epoch_seen: AtomicU32,
    /// Ranges given up for a hand-off and neither taken by their destination nor taken back.
    out: Mutex<Vec<(u64, u64)>>,
    /// The ranges this shard took from others, with their moves' map epochs (the latest
    /// [`IMPORTS_KEPT`]; since it started): an offer of one again is acknowledged even after
    /// the range moved on, so that its source does not take it back.
    imported: Mutex<std::collections::VecDeque<(u64, u64, MapEpoch)>>,
    /// The highest coordinator term this shard has taken orders from: orders of a lower
    /// term come from a deposed leader and are refused.
    term: AtomicU64,
}

/// Imports a shard remembers.
const IMPORTS_KEPT: usize = 1024;

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

fn read_lock<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write_lock<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

fn lock<T>(l: &Mutex<T>) -> MutexGuard<'_, T> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

impl ShardState {
    /// Initializes the chunks `map` places on `id`, seeded per key so that values do not depend
    /// on placement.
    pub fn new(id: ShardId, job: JobConfig, map: ShardMap) -> Self {
        let layout = job.layout();
        let fresh = |ranges: &mut dyn Iterator<Item = &edl_shared::proto::job::RangeOwner>| {
            let chunks = DashMap::new();
            for k in ranges.flat_map(|r| r.start..r.end) {
                if let Some(span) = layout.span(Key(k)) {
                    let chunk = Chunk::fresh(&job, Key(k), span.tensor, span.len as usize);
                    chunks.insert(Key(k), chunk);
                }
            }
            chunks
        };
        let chunks = fresh(&mut map.ranges_of(id));
        let backup_chunks = fresh(&mut map.backed_by(id));
        let ledgers = Ledgers::new(&job, !chunks.is_empty());
        // Backup copies of different primaries' keys get a segment each: each primary forwards
        // a span's push of its own keys, so one ledger over both would take the second
        // primary's forward of a span for a repeat of the first's.
        let mut primaries: Vec<Option<ShardId>> = Vec::new();
        for k in map.backed_by(id).flat_map(|r| r.start..r.end) {
            let primary = map.owner(Key(k));
            let segment = match primaries.iter().position(|p| *p == primary) {
                Some(i) => i,
                None => {
                    primaries.push(primary);
                    primaries.len() - 1
                }
            };
            if let Some(mut c) = backup_chunks.get_mut(&Key(k)) {
                c.segment = segment as u32;
            }
        }
        let backup_ledgers = Ledgers::segments(&job, primaries.len() as u32);
        ShardState {
            id,
            layout,
            backup_chunks,
            backup_ledgers: Mutex::new(backup_ledgers),
            forwarding: AtomicU64::new(0),
            seeding: Mutex::new(Vec::new()),
            incoming: Mutex::new(Vec::new()),
            map: watch::Sender::new(Arc::new(map)),
            ledgers: Mutex::new(ledgers),
            load: Load::default(),
            gate: RwLock::new(()),
            saving: Mutex::new(()),
            epoch_seen: AtomicU32::new(0),
            out: Mutex::new(Vec::new()),
            map_changed: tokio::sync::Notify::new(),
            imported: Mutex::new(std::collections::VecDeque::new()),
            term: AtomicU64::new(0),
            job,
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
        let placed: u64 = map.ranges_of(id).map(|r| r.end - r.start).sum();
        if ckpt.chunks.len() as u64 != placed {
            return Err(mismatch(format!(
                "checkpoint holds {} keys, the shard map places {placed} here",
                ckpt.chunks.len(),
            )));
        }
        if map.backed_by(id).next().is_some() {
            return Err(mismatch(format!(
                "the map gives {id} backup copies, which a checkpoint does not hold: a shard of a \
                 replicated job rejoins as a standby instead"
            )));
        }
        let st = ShardState::new(
            id,
            job,
            ShardMap {
                ranges: Vec::new(),
                ..map.clone()
            },
        );
        st.map.send_replace(Arc::new(map));
        let ledgers = Ledgers::restore(&st.job, &ckpt.ledgers).map_err(mismatch)?;
        let segments = ledgers.ids();
        for snap in ckpt.chunks {
            let key = Key(snap.key);
            if st.read_map().owner(key) != Some(id) {
                return Err(mismatch(format!("{key} is not placed on {id}")));
            }
            let chunk = Chunk::from_snap(&st.job, &st.layout, snap).map_err(mismatch)?;
            if !segments.contains(&chunk.segment) {
                return Err(mismatch(format!("{key} belongs to no ledger segment")));
            }
            st.chunks.insert(key, chunk);
        }
        *st.ledgers() = ledgers;
        Ok(st)
    }

    /// A consistent copy of the state, for a checkpoint.
    pub fn snapshot(&self) -> ShardCheckpoint {
        let _gate = write_lock(&self.gate);
        let mut chunks: Vec<ChunkSnap> = self.chunks.iter().map(|c| c.snap(*c.key())).collect();
        chunks.sort_unstable_by_key(|c| c.key);
        ShardCheckpoint {
            shard: self.id.0,
            job_fingerprint: checkpoint::fingerprint(&self.job),
            chunks,
            ledgers: self.ledgers().snapshot(),
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

    /// The newest map this shard knows.
    pub fn read_map(&self) -> Arc<ShardMap> {
        self.map.borrow().clone()
    }

    /// The epoch of the newest map this shard knows.
    pub fn map_epoch(&self) -> MapEpoch {
        self.map.borrow().epoch
    }

    /// Takes an order (a map, a move) from a coordinator of `term`: refused if a coordinator
    /// of a later term has given orders here (the sender was deposed), else remembered as the
    /// highest term seen.
    pub fn admit_term(&self, term: u64) -> Result<(), Refusal> {
        let seen = self.term.fetch_max(term, Ordering::AcqRel);
        if term < seen {
            return Err(Refusal::new(
                ErrorCode::Deposed,
                format!(
                    "{}: an order of coordinator term {term}, but the coordinator of term {seen} \
                     leads now; the sender was deposed",
                    self.id
                ),
            ));
        }
        Ok(())
    }

    /// Adopts `map` if it is newer than the one held; true if it was.
    pub fn install_map(&self, map: &ShardMap) -> bool {
        let newer = self.set_map(map);
        if newer {
            self.map_changed.notify_waiters();
        }
        newer
    }

    fn set_map(&self, map: &ShardMap) -> bool {
        self.map.send_if_modified(|held| {
            let newer = map.epoch > held.epoch;
            if newer {
                *held = Arc::new(map.clone());
            }
            newer
        })
    }

    /// Whether this shard's job keeps backup copies of its key ranges.
    pub fn replicated(&self) -> bool {
        self.job.replicas > 1
    }

    /// Adopts a map the coordinator (or a backup) sent, if it is newer than the one held; true
    /// if it was. In a replicated job this shard's holdings follow it at once, under the gate:
    /// backup copies of keys it now places here as their primary are promoted (with their
    /// ledgers), and keys it no longer places here (as primary, or as backup) are dropped: a
    /// shard the coordinator took for dead and replaced keeps nothing it could serve.
    pub fn adopt_map(&self, map: &ShardMap) -> bool {
        if !self.replicated() {
            return self.install_map(map);
        }
        let newer = {
            let _gate = write_lock(&self.gate);
            let newer = self.set_map(map);
            if newer {
                self.follow(map);
            }
            newer
        };
        if newer {
            self.map_changed.notify_waiters();
        }
        newer
    }

    /// Makes the holdings agree with `map` (see [`ShardState::adopt_map`]). The caller holds
    /// the gate exclusively.
    fn follow(&self, map: &ShardMap) {
        let me = self.id;
        let promoted = self
            .backup_chunks
            .iter()
            .map(|c| c.key().0)
            .filter(|k| map.owner(Key(*k)) == Some(me) && !self.chunks.contains_key(&Key(*k)))
            .collect::<Vec<u64>>();
        for r in KeyRange::runs(promoted.into_iter()) {
            let export = take_out(
                &self.backup_chunks,
                &self.backup_ledgers,
                (r.start..r.end).map(Key),
            );
            match self.take_in(r.start, r.end, export) {
                Ok(()) => info!(shard = %me, start = r.start, end = r.end, epoch = %map.epoch,
                    "promoted: now the primary of these keys"),
                Err(e) => tracing::error!(shard = %me, start = r.start, end = r.end,
                    error = %e.message, "promoting backup copies failed"),
            }
        }
        let not_primary: Vec<Key> = self
            .chunks
            .iter()
            .map(|c| *c.key())
            .filter(|k| map.owner(*k) != Some(me))
            .collect();
        if !not_primary.is_empty() {
            tracing::warn!(shard = %me, keys = not_primary.len(), epoch = %map.epoch,
                "the map places keys held here on other shards: dropping them");
            drop(take_out(
                &self.chunks,
                &self.ledgers,
                not_primary.into_iter(),
            ));
        }
        // Pushes kept for a copy on its way go with a map that does not list this shard as
        // their keys' backup, unless they came with a newer one (that seeding's: this map,
        // older, arrived late).
        lock(&self.incoming).retain(|p| {
            p.epoch > map.epoch || p.keys().all(|k| map.backups_of(k).any(|s| s == me))
        });
        let not_backed: Vec<Key> = self
            .backup_chunks
            .iter()
            .map(|c| *c.key())
            .filter(|k| !map.backups_of(*k).any(|s| s == me))
            .collect();
        if !not_backed.is_empty() {
            drop(take_out(
                &self.backup_chunks,
                &self.backup_ledgers,
                not_backed.into_iter(),
            ));
        }
    }

    /// True if every key in `keys` is held here.
    pub fn holds(&self, mut keys: impl Iterator<Item = Key>) -> bool {
        keys.all(|k| self.chunks.contains_key(&k))
    }

    /// Parameter `i` of `key`, if this shard holds it: what a test watches to see an update
    /// land.
    pub fn param(&self, key: Key, i: usize) -> Option<f32> {
        self.chunks.get(&key)?.params.get(i).copied()
    }

    /// Parameter `i` of this shard's backup copy of `key`, if it holds one.
    pub fn backup_param(&self, key: Key, i: usize) -> Option<f32> {
        self.backup_chunks.get(&key)?.params.get(i).copied()
    }

    /// Forwarded pushes this new backup keeps until the copy of their keys arrives.
    pub fn kept_pushes(&self) -> usize {
        lock(&self.incoming).len()
    }

    /// Whether shard `id` of a replicated job, joining with `map`, rejoins as a standby: the
    /// map gives it nothing, so its checkpoint is not used (the live copies on the other shards
    /// hold everything acknowledged since).
    pub fn rejoins_as_standby(job: &JobConfig, map: &ShardMap, id: ShardId) -> bool {
        job.replicas > 1 && !map.places(id)
    }

    /// Waits (up to `limit`) until this shard knows a map of at least `epoch`: a request
    /// routed with a map newer than this shard's may concern keys that are on their way here.
    pub async fn wait_for_epoch(&self, epoch: MapEpoch, limit: Duration) {
        let learnt = async {
            loop {
                let changed = self.map_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if self.map_epoch() >= epoch {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(limit, learnt).await;
    }

    /// Why `key` cannot be used here: it is not part of the job, or (a key of the job this
    /// shard does not hold) the request was routed with an old map, refused with the current
    /// one. Called under the gate, so the answer holds for the whole request.
    fn missing(&self, key: Key) -> Refusal {
        if key.0 >= self.layout.num_keys() {
            return Refusal::new(
                ErrorCode::UnknownKey,
                format!("{key} is not part of the job"),
            );
        }
        let map = self.read_map();
        Refusal {
            code: ErrorCode::StaleEpoch,
            message: format!(
                "{key} is not held by {} (its map is {}); route with the new map",
                self.id, map.epoch
            ),
            map: Some(Box::new((*map).clone())),
        }
    }

    fn bsp(&self) -> bool {
        self.job.consistency == Consistency::Bsp
    }

    /// Reads the chunks in `ranges`, applying due BSP updates first. The map epoch the client
    /// routed with does not matter as long as this shard holds every key asked for.
    pub fn pull(
        &self,
        epoch: MapEpoch,
        ranges: &[KeyRange],
        apply_through: Clock,
    ) -> Result<Frame<Response, Parts>, Refusal> {
        self.pull_in(epoch, ranges, apply_through, Some(Wire::F32))
    }

    /// [`ShardState::pull`], the values in `wire` (`None`: each chunk in its tensor's, as the
    /// job says): f32 as they lie, a 16-bit precision converted; a chunk at f32 if one of its
    /// parameters does not fit it (binary16 ends at 65,504). Each chunk names its precision.
    pub fn pull_in(
        &self,
        _epoch: MapEpoch,
        ranges: &[KeyRange],
        apply_through: Clock,
        wire: Option<Wire>,
    ) -> Result<Frame<Response, Parts>, Refusal> {
        let mut count = 0u64;
        for r in ranges {
            // Bounds what a request with many or huge ranges can make this shard allocate.
            if r.end < r.start
                || r.end > self.layout.num_keys()
                || count + (r.end - r.start) > self.layout.num_keys()
            {
                return Err(Refusal::new(
                    ErrorCode::UnknownKey,
                    format!("range {}..{} is not part of the job", r.start, r.end),
                ));
            }
            count += r.end - r.start;
        }
        let _gate = read_lock(&self.gate);
        // Refused whole, before any key changes: a pull that names a key this shard does not
        // hold must not apply BSP steps to, or count load on, the keys before it.
        if let Some(key) = ranges
            .iter()
            .flat_map(|r| (r.start..r.end).map(Key))
            .find(|k| !self.chunks.contains_key(k))
        {
            return Err(self.missing(key));
        }
        let mut refs = Vec::with_capacity(count as usize);
        let mut out = Vec::with_capacity(count as usize);
        let mut bytes = 0u64;
        for key in ranges.iter().flat_map(|r| (r.start..r.end).map(Key)) {
            let Some(mut chunk) = self.chunks.get_mut(&key) else {
                return Err(self.missing(key));
            };
            if self.bsp() {
                apply_due(&self.job, &mut chunk, apply_through.0);
            }
            chunk.load += chunk.params.len() as u64;
            let (held, len) = (wire_params(&chunk.params), chunk.params.len() as u32);
            drop(chunk);
            let want = wire.unwrap_or_else(|| {
                let tensor = self.layout.span(key).map_or(0, |s| s.tensor);
                self.job.wire_of(tensor).values
            });
            // At 16 bits if every value fits, else (fp16 past 65,504) at f32.
            let (wire, values) = match want {
                Wire::F32 => (Wire::F32, held),
                _ => match narrowed(&held, want) {
                    Some(narrow) => (want, narrow),
                    None => (Wire::F32, held),
                },
            };
            bytes += values.len() as u64;
            refs.push(ChunkRef::new(key, len).coded(wire, false));
            out.push(values);
        }
        self.load.pulls.fetch_add(1, Ordering::Relaxed);
        (self.load.bytes_out).fetch_add(bytes, Ordering::Relaxed);
        Ok(Frame::with_payload(
            Response::Pulled { chunks: refs },
            Parts(out),
        ))
    }

    /// Applies (ASP, SSP) or stages (BSP) a push. Everything is validated before any state
    /// changes, so a bad push changes nothing. Keys whose ledger segment has applied the
    /// push's data span already are skipped (acknowledged, not applied again). The gradients
    /// must be finite: `read_frame` checks them as they arrive, so that this needs no second
    /// pass over them.
    pub fn push(
        &self,
        epoch: MapEpoch,
        worker: WorkerId,
        clock: Clock,
        chunks: &[ChunkRef],
        payload: &[u8],
        span: Option<&DataSpan>,
    ) -> Result<Claim, Refusal> {
        let parts = [Bytes::copy_from_slice(payload)];
        self.push_covering(epoch, worker, clock, chunks, &parts, span, &[], 0)
    }

    /// [`ShardState::push`] of a payload in the parts it arrived in, read where they lie
    /// (no reassembly), and of a sparse push: the span also counts for the keys in `covers`,
    /// whose gradient is zero (none of it travels). `in_flight`: the bytes in flight on the
    /// shard's server, this push's included (0 where unknown); a large update is applied on two
    /// cores only if nothing else is (see [`SPLIT_BESIDE`]).
    #[allow(clippy::too_many_arguments)]
    pub fn push_covering(
        &self,
        epoch: MapEpoch,
        worker: WorkerId,
        clock: Clock,
        chunks: &[ChunkRef],
        payload: &[Bytes],
        span: Option<&DataSpan>,
        covers: &[KeyRange],
        in_flight: u64,
    ) -> Result<Claim, Refusal> {
        let push = (epoch, worker, clock, chunks, payload, span, covers);
        self.push_in(Side::Primary, push, in_flight, &mut || {})
    }

    /// [`ShardState::push_covering`] of a primary that forwards the push to its backups:
    /// `valid` runs once the push was found valid, before any chunk changes (also when its
    /// span was applied here already: the backups may not have it yet).
    pub fn push_forwarding(
        &self,
        push: PushRef<'_>,
        in_flight: u64,
        valid: &mut dyn FnMut(),
    ) -> Result<Claim, Refusal> {
        self.push_in(Side::Primary, push, in_flight, valid)
    }

    /// Applies a push a primary forwarded to this backup's copies, through their ledgers.
    pub fn replicate(&self, push: PushRef<'_>) -> Result<Claim, Refusal> {
        self.push_in(Side::Backup, push, 0, &mut || {})
    }

    /// The chunks and ledgers of one side.
    fn side(&self, side: Side) -> (&DashMap<Key, Chunk>, &Mutex<Ledgers>) {
        match side {
            Side::Primary => (&self.chunks, &self.ledgers),
            Side::Backup => (&self.backup_chunks, &self.backup_ledgers),
        }
    }

    fn push_in(
        &self,
        side: Side,
        (_epoch, worker, clock, chunks, payload, span, covers): PushRef<'_>,
        in_flight: u64,
        valid: &mut dyn FnMut(),
    ) -> Result<Claim, Refusal> {
        let (held, ledgers) = self.side(side);
        let bad = |(code, msg): (ErrorCode, String)| {
            Refusal::new(code, format!("push from {worker}: {msg}"))
        };
        let total = floats_in(chunks);
        let bytes: u64 = payload.iter().map(|p| p.len() as u64).sum();
        self.check_payload(chunks, payload).map_err(bad)?;
        // From the check of the keys to the last chunk, neither a checkpoint nor a range move
        // may cut this push in two.
        let _gate = read_lock(&self.gate);
        let missing = |key: Key| {
            let r = self.missing(key);
            Refusal {
                message: format!("push from {worker}: {}", r.message),
                ..r
            }
        };
        let mut segments = BTreeSet::new();
        for c in chunks {
            let chunk = held.get(&c.key).ok_or_else(|| missing(c.key))?;
            if chunk.params.len() != c.len as usize {
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
            if self.bsp() && clock.0 < chunk.applied_through {
                return Err(bad((
                    ErrorCode::StaleClock,
                    format!("step {} of {} was already applied", clock.0, c.key),
                )));
            }
            // Staging is bounded by what BSP can need: no worker is granted a step more than
            // one past the slowest, so steps far ahead of the applied one are not real.
            if self.bsp() && clock.0 >= chunk.applied_through.saturating_add(MAX_STAGED_AHEAD) {
                return Err(bad((
                    ErrorCode::InvalidRequest,
                    format!(
                        "step {} is {MAX_STAGED_AHEAD} or more steps ahead of the applied step \
                         {} of {}",
                        clock.0, chunk.applied_through, c.key
                    ),
                )));
            }
            segments.insert(chunk.segment);
        }
        if !covers.is_empty() && span.is_none() {
            return Err(bad((
                ErrorCode::InvalidRequest,
                "a push that covers further keys must carry a data span".into(),
            )));
        }
        // A range past the job's keys stops at the first such key (`UnknownKey`).
        for r in covers {
            for k in r.start..r.end {
                let chunk = held.get(&Key(k)).ok_or_else(|| missing(Key(k)))?;
                segments.insert(chunk.segment);
            }
        }
        // Claim the span last: once it is recorded, the chunks below are updated.
        let claims = match span {
            None => None,
            Some(span) => {
                let claims = lock(ledgers).claim(span, &segments).map_err(bad)?;
                if claims.values().all(|c| *c == Claim::AlreadyApplied) {
                    valid();
                    tracing::debug!(%worker, epoch = span.epoch, partition = span.partition,
                        start = span.start, "span already applied here; skipped");
                    return Ok(Claim::AlreadyApplied);
                }
                Some(claims)
            }
        };
        valid();
        self.load.pushes.fetch_add(1, Ordering::Relaxed);
        self.load.bytes_in.fetch_add(bytes, Ordering::Relaxed);
        let claims = claims.as_ref();
        // The epoch an epoch schedule counts: the samples', or the latest seen (no other
        // update reads it).
        let schedule = &self.job.schedule;
        let epoch = match span {
            _ if schedule.is_constant() || schedule.by != ScheduleUnit::Epoch => 0,
            Some(s) => {
                self.epoch_seen.fetch_max(s.epoch, Ordering::Relaxed);
                s.epoch
            }
            None => self.epoch_seen.load(Ordering::Relaxed),
        };
        // A large ASP/SSP update is applied on two cores where one is spare, each taking a
        // contiguous part of the chunks (no key is in both). BSP staging stays on one: it may
        // refuse mid-way.
        let spare_core = in_flight <= bytes + SPLIT_BESIDE;
        if !self.bsp()
            && spare_core
            && bytes >= PARALLEL_APPLY_BYTES
            && *CORES > 1
            && chunks.len() > 1
        {
            let mut floats = 0u64;
            let mine = chunks
                .iter()
                .take_while(|c| {
                    floats += u64::from(c.len);
                    floats * HERE_SHARE.1 < total * HERE_SHARE.0
                })
                .count()
                .clamp(1, chunks.len() - 1);
            let (first, second) = chunks.split_at(mine);
            let mut rest = Coded::new(payload);
            // Within the payload, which was checked to hold the chunks above.
            for c in first {
                rest.skip(c)
                    .map_err(|e| bad(coded_refusal(e, bytes, chunks)))?;
            }
            let at = (worker, clock, epoch);
            return std::thread::scope(|scope| {
                let other = scope.spawn(|| self.apply_chunks(held, at, second, rest, claims));
                let here = self.apply_chunks(held, at, first, Coded::new(payload), claims);
                let there = other
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p));
                here.and(there)
            });
        }
        self.apply_chunks(
            held,
            (worker, clock, epoch),
            chunks,
            Coded::new(payload),
            claims,
        )
    }

    /// Checks that `payload` holds the values of `chunks` as they say they travel. A plain f32
    /// push was checked for NaN and infinity on receipt (`read_frame`): only its length is
    /// checked here. One with 16-bit or sparse chunks is read whole (`coded::check`), once its
    /// chunks were found to be keys of the job at their lengths (a sparse record is spread
    /// over a chunk of that length) and, where any is sparse, distinct and in ascending
    /// order (a sparse chunk costs 4 bytes: named over and over, it would have the shard
    /// apply the whole model many times for a few bytes each).
    fn check_payload(
        &self,
        chunks: &[ChunkRef],
        payload: &[Bytes],
    ) -> Result<(), (ErrorCode, String)> {
        let total = floats_in(chunks);
        let bytes: u64 = payload.iter().map(|p| p.len() as u64).sum();
        if chunks.iter().all(ChunkRef::is_plain) {
            if total * 4 != bytes {
                return Err((
                    ErrorCode::ShapeMismatch,
                    format!("{bytes} payload bytes for {total} floats"),
                ));
            }
            debug_assert!(
                {
                    let mut scan = edl_shared::proto::frame::FiniteScan::default();
                    payload.iter().for_each(|p| scan.part(p));
                    scan.result().is_ok()
                },
                "unchecked push payload"
            );
            return Ok(());
        }
        if let Some(c) = chunks
            .iter()
            .find(|c| self.layout.span(c.key).is_none_or(|s| s.len != c.len))
        {
            let code = match self.layout.span(c.key) {
                None => ErrorCode::UnknownKey,
                Some(_) => ErrorCode::ShapeMismatch,
            };
            let message = format!("{} of {} floats is not one of the job's keys", c.key, c.len);
            return Err((code, message));
        }
        if chunks.iter().any(|c| c.sparse) && chunks.windows(2).any(|w| w[0].key >= w[1].key) {
            return Err((
                ErrorCode::Malformed,
                "a sparse push's chunks must be distinct keys in ascending order".into(),
            ));
        }
        coded::check(payload, chunks).map_err(|e| coded_refusal(e, bytes, chunks))
    }

    /// Applies (ASP, SSP) or stages (BSP) the gradients of `chunks`, read from `grads` (each
    /// converted to f32 block by block as it is applied), for the keys whose ledger segment
    /// `claims` says to apply (all without a span): a push of `worker` at `clock` of samples
    /// of `epoch`. The push was validated.
    fn apply_chunks(
        &self,
        held: &DashMap<Key, Chunk>,
        (worker, clock, epoch): (WorkerId, Clock, u32),
        chunks: &[ChunkRef],
        mut grads: Coded<'_>,
        claims: Option<&BTreeMap<u32, Claim>>,
    ) -> Result<Claim, Refusal> {
        // The push was checked whole: a payload that does not hold its chunks now is a bug.
        let broken = |e: ProtoError| {
            Refusal::new(
                ErrorCode::Internal,
                format!("push from {worker}: a checked payload did not read back: {e}"),
            )
        };
        for c in chunks {
            let len = c.len as usize;
            let chunk = held.get_mut(&c.key);
            let skip = match (&chunk, claims) {
                (None, _) => true,
                (Some(chunk), Some(cl)) => cl.get(&chunk.segment) != Some(&Claim::Apply),
                (Some(_), None) => false,
            };
            let Some(mut chunk) = chunk.filter(|_| !skip) else {
                // Past this key's gradient.
                grads.skip(c).map_err(broken)?;
                continue;
            };
            let chunk = &mut *chunk;
            chunk.load += u64::from(c.len);
            if self.bsp() {
                // Re-check under the chunk lock: a pull may have applied this step meanwhile.
                if clock.0 < chunk.applied_through {
                    return Err(Refusal::new(
                        ErrorCode::StaleClock,
                        format!("push from {worker}: step {} closed", clock.0),
                    ));
                }
                // A worker pushes step `c` only once it was granted `c`: every counting worker
                // has pushed every step before `c`, so those can be applied now (a pull would
                // do the same). This keeps staging to a step or two even for a client that
                // pushes without pulling.
                apply_due(&self.job, chunk, clock.0);
                let slot = chunk.pending.entry(clock.0).or_insert_with(|| Staged {
                    sum: vec![0.0; len],
                    pushes: 0,
                    epoch,
                });
                slot.epoch = slot.epoch.max(epoch);
                grads
                    .take(c, |at, g| {
                        let sums = slot.sum[at..].iter_mut();
                        match g {
                            F32Run::Values(v) => sums.zip(v).for_each(|(s, g)| *s += g),
                            F32Run::Le(b) => sums.zip(LeF32s(b).iter()).for_each(|(s, g)| *s += g),
                        }
                    })
                    .map_err(broken)?;
                slot.pushes += 1;
            } else {
                let optimizer = scheduled(&self.job, chunk, epoch, 1);
                let optimizer = optimizer.as_ref();
                let params = Arc::make_mut(&mut chunk.params).as_mut_slice();
                chunk.opt.start(optimizer, len);
                let opt = &mut chunk.opt;
                grads
                    .take(c, |at, g| opt.apply_run(optimizer, params, at, g, 1.0))
                    .map_err(broken)?;
            }
        }
        Ok(Claim::Apply)
    }

    fn ledgers(&self) -> MutexGuard<'_, Ledgers> {
        // The ledger is only ever updated whole under the lock; keep serving if a holder panicked.
        self.ledgers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives up keys `[start, end)`: removes their state (with copies of their segments'
    /// ledgers) and adopts `map`, the map after the move, so requests for them are refused
    /// from here on with that map. Fails, changing nothing, unless every key is held here and
    /// `map` is newer than this shard's (an older one is a move superseded since: a request
    /// that arrived late).
    pub fn export(&self, start: u64, end: u64, map: &ShardMap) -> Result<RangeExport, Refusal> {
        let _gate = write_lock(&self.gate);
        let held = self.map_epoch();
        if map.epoch <= held {
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!(
                    "a move with map {} is stale: {} has map {held}",
                    map.epoch, self.id
                ),
            ));
        }
        if start >= end || !self.holds((start..end).map(Key)) {
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!("{} does not hold all of keys {start}..{end}", self.id),
            ));
        }
        let export = take_out(&self.chunks, &self.ledgers, (start..end).map(Key));
        self.install_map(map);
        lock(&self.out).push((start, end));
        Ok(export)
    }

    /// The ranges this shard gave up for hand-offs that have not ended yet (their destination
    /// has not taken them, nor refused them so that they came back here).
    pub fn ranges_out(&self) -> Vec<(u64, u64)> {
        lock(&self.out).clone()
    }

    /// The destination took keys `[start, end)`: they are no longer out.
    pub fn handed_over(&self, start: u64, end: u64) {
        lock(&self.out).retain(|r| *r != (start, end));
    }

    /// Takes keys `[start, end)` from another shard and adopts `map`. Repeating an import that
    /// succeeded (the sender did not hear the answer) is acknowledged and changes nothing, even
    /// once the keys moved on. Fails, changing nothing, if the export does not hold exactly
    /// those keys with state that fits the job, if some of them are held here already, or if
    /// this shard has a map as new as `map` without them and never took them: the coordinator
    /// gave up on the move and published the old placement again, and taking them now would
    /// leave them where no map points.
    pub fn import(
        &self,
        start: u64,
        end: u64,
        map: &ShardMap,
        export: RangeExport,
    ) -> Result<(), Refusal> {
        let _gate = write_lock(&self.gate);
        exactly(start, end, &export)?;
        let held = self.map_epoch();
        if held >= map.epoch {
            let took = lock(&self.imported).contains(&(start, end, map.epoch));
            if took || self.holds((start..end).map(Key)) {
                return Ok(());
            }
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!(
                    "a move with map {} was superseded: {} has map {held}",
                    map.epoch, self.id
                ),
            ));
        }
        self.take_in(start, end, export)?;
        self.install_map(map);
        let mut imported = lock(&self.imported);
        if imported.len() == IMPORTS_KEPT {
            imported.pop_front();
        }
        imported.push_back((start, end, map.epoch));
        Ok(())
    }

    /// Takes back keys whose hand-off to map `attempted` failed, with the map from before the
    /// move (unless a newer map than the move's came meanwhile: the coordinator's, which
    /// places them here again).
    pub fn reinstate(
        &self,
        start: u64,
        end: u64,
        before: &ShardMap,
        attempted: MapEpoch,
        export: RangeExport,
    ) -> Result<(), Refusal> {
        {
            let _gate = write_lock(&self.gate);
            self.take_in(start, end, export)?;
            if self.map_epoch() <= attempted {
                self.map.send_replace(Arc::new(before.clone()));
                self.map_changed.notify_waiters();
            }
        }
        self.handed_over(start, end);
        Ok(())
    }

    /// Inserts the keys of `export` (the caller checked they are exactly `[start, end)`), none
    /// held yet.
    /// The caller holds the gate exclusively.
    fn take_in(&self, start: u64, end: u64, export: RangeExport) -> Result<(), Refusal> {
        self.take_in_to(Side::Primary, start, end, export)
    }

    /// [`ShardState::take_in`] to `side`.
    fn take_in_to(
        &self,
        side: Side,
        start: u64,
        end: u64,
        export: RangeExport,
    ) -> Result<(), Refusal> {
        let (held, ledgers) = self.side(side);
        let refuse = |m: String| Refusal::new(ErrorCode::InvalidRequest, m);
        if end > self.layout.num_keys() {
            return Err(refuse(format!(
                "keys {start}..{end} are not part of the job"
            )));
        }
        if let Some(k) = (start..end).find(|k| held.contains_key(&Key(*k))) {
            return Err(refuse(format!("{} holds k{k} already", self.id)));
        }
        let mut fresh = Vec::with_capacity(export.chunks.len());
        for snap in export.chunks {
            let key = Key(snap.key);
            let chunk = Chunk::from_snap(&self.job, &self.layout, snap).map_err(refuse)?;
            fresh.push((key, chunk));
        }
        if let Some((key, _)) = fresh
            .iter()
            .find(|(_, c)| !export.ledgers.iter().any(|(s, _)| *s == c.segment))
        {
            return Err(refuse(format!("{key} arrived without its ledger")));
        }
        let ids = lock(ledgers)
            .import(&self.job, &export.ledgers)
            .map_err(refuse)?;
        for (key, mut chunk) in fresh {
            chunk.segment = ids.get(&chunk.segment).copied().unwrap_or_default();
            held.insert(key, chunk);
        }
        Ok(())
    }

    /// A primary's copy of keys `[start, end)` for their new backup `to`, which `map` (newer
    /// than this shard's) lists: taken under the gate, where this shard adopts `map`, so that
    /// every push is either in the copy or forwarded to the new backup (marked as seeding
    /// until [`ShardState::seeded`]).
    pub fn copy(
        &self,
        (start, end, to): (u64, u64, ShardId),
        map: &ShardMap,
    ) -> Result<RangeExport, Refusal> {
        let export = {
            let _gate = write_lock(&self.gate);
            let held = self.map_epoch();
            if map.epoch <= held {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "a copy with map {} is stale: {} has map {held}",
                        map.epoch, self.id
                    ),
                ));
            }
            // The map may also be the first news of a promotion here (the coordinator's
            // announcement of it still on its way): adopted first, it promotes the backup
            // copies it makes primary here.
            self.set_map(map);
            self.follow(map);
            if start >= end
                || !self.holds((start..end).map(Key))
                || (start..end).any(|k| map.owner(Key(k)) != Some(self.id))
            {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "{} is not the primary of all of keys {start}..{end}",
                        self.id
                    ),
                ));
            }
            let mut chunks = Vec::with_capacity((end - start) as usize);
            let mut segments = BTreeSet::new();
            for k in start..end {
                if let Some(c) = self.chunks.get(&Key(k)) {
                    segments.insert(c.segment);
                    chunks.push(c.snap(Key(k)));
                }
            }
            let ledgers = self.ledgers().export(&segments);
            lock(&self.seeding).push((to, start, end));
            RangeExport { chunks, ledgers }
        };
        self.map_changed.notify_waiters();
        Ok(export)
    }

    /// The seeding of `to` with keys `[start, end)` ended (taken, or given up).
    pub fn seeded(&self, to: ShardId, start: u64, end: u64) {
        lock(&self.seeding).retain(|s| *s != (to, start, end));
    }

    /// A new backup's handling of a push its primary forwarded while seeding it: applied if the
    /// copy of its keys is here already, else kept (acknowledged: held in memory, applied once
    /// the copy arrives, [`ShardState::seed`]). `None` if it was neither: more is kept than
    /// [`KEPT_BYTES`] (the caller waits for the copy instead).
    pub fn keep_or_replicate(&self, push: Kept) -> Option<Result<Claim, Refusal>> {
        let mut kept = lock(&self.incoming);
        // The copy is here once this shard adopted the seeding's map (the primary's when it
        // forwarded, or older): a copy held under an older map is a stale one, replaced when
        // the copy arrives.
        let arrived = self.map_epoch() >= push.epoch;
        if arrived && push.keys().all(|k| self.backup_chunks.contains_key(&k)) {
            drop(kept);
            return Some(self.replicate(push.as_ref()));
        }
        // Kept only once found whole: it is acknowledged now, and applied when the copy comes.
        if let Err((code, message)) = self.check_payload(&push.chunks, &push.payload) {
            return Some(Err(Refusal::new(code, message)));
        }
        if kept.iter().map(Kept::bytes).sum::<u64>() + push.bytes() > KEPT_BYTES {
            return None;
        }
        kept.push(push);
        Some(Ok(Claim::Apply))
    }

    /// Takes the copy of keys `[start, end)` a primary made for this shard as their new backup
    /// (`map` lists it), and adopts `map`. A copy taken already is acknowledged again.
    pub fn seed(
        &self,
        start: u64,
        end: u64,
        map: &ShardMap,
        export: RangeExport,
    ) -> Result<(), Refusal> {
        exactly(start, end, &export)?;
        {
            let _gate = write_lock(&self.gate);
            let keys = || (start..end).map(Key);
            if let Some(k) = (start..end).find(|k| !map.backups_of(Key(*k)).any(|s| s == self.id)) {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "map {} does not make {} a backup of k{k}",
                        map.epoch, self.id
                    ),
                ));
            }
            // Taken already if this shard adopted the map (a repeated offer); a copy held
            // under an older map (it was a backup before, and was dropped while cut off) is
            // stale: replaced.
            let taken = self.map_epoch() >= map.epoch
                && keys().all(|k| self.backup_chunks.contains_key(&k));
            if !taken {
                let stale: Vec<Key> = keys()
                    .filter(|k| self.backup_chunks.contains_key(k))
                    .collect();
                drop(take_out(
                    &self.backup_chunks,
                    &self.backup_ledgers,
                    stale.into_iter(),
                ));
                self.take_in_to(Side::Backup, start, end, export)?;
            }
            if self.set_map(map) {
                self.follow(map);
            }
        }
        self.map_changed.notify_waiters();
        // The pushes forwarded while the copy was on its way, now that it is here.
        let ready: Vec<Kept> = {
            let mut kept = lock(&self.incoming);
            let (ready, wait) = std::mem::take(&mut *kept)
                .into_iter()
                .partition(|p| p.keys().all(|k| self.backup_chunks.contains_key(&k)));
            *kept = wait;
            ready
        };
        for push in ready {
            if let Err(r) = self.replicate(push.as_ref()) {
                tracing::error!(shard = %self.id, error = %r.message,
                    "a push kept for a copy could not be applied to it");
            }
        }
        Ok(())
    }

    /// Holdings and load.
    pub fn stats(&self) -> ShardStats {
        let mut floats = 0u64;
        let mut state_bytes = 0u64;
        for c in self.chunks.iter() {
            let n = c.params.len() as u64;
            floats += n;
            let opt: u64 = c.opt.bufs.iter().map(|b| b.len() as u64).sum();
            state_bytes += 4 * (n + opt);
        }
        ShardStats {
            shard: self.id,
            ranges: KeyRange::runs(self.chunks.iter().map(|c| c.key().0)),
            keys: self.chunks.len() as u64,
            floats,
            state_bytes,
            pushes: self.load.pushes.load(Ordering::Relaxed),
            pulls: self.load.pulls.load(Ordering::Relaxed),
            bytes_in: self.load.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.load.bytes_out.load(Ordering::Relaxed),
            backups: KeyRange::runs(self.backup_chunks.iter().map(|c| c.key().0)),
            lag: self.forwarding.load(Ordering::Relaxed),
        }
    }

    /// The backups of a push's keys under this shard's map, each with the part of the push it
    /// holds copies of: a `Replicate` request and its payload (slices of the push's parts,
    /// not copies). Empty without backups.
    pub fn forwards(&self, push: PushRef<'_>) -> Vec<Forward> {
        let map = self.read_map();
        if map.backups.is_empty() {
            return Vec::new();
        }
        let (_, worker, clock, chunks, payload, span, covers) = push;
        // A backup being seeded with some of the keys gets their part apart (it keeps that
        // part until the copy arrives) from the part of the keys it holds already (applied at
        // once): were they one push, it would keep all of it, and a seeding that fails would
        // take with it what the keys it holds already were acknowledged.
        // Held while the forwards are planned (not copied on every push).
        let seeding = lock(&self.seeding);
        let seeded = |b: ShardId, k: u64| {
            seeding
                .iter()
                .any(|(to, a, e)| *to == b && *a <= k && k < *e)
        };
        type Part = (Vec<ChunkRef>, Vec<(usize, usize)>, Vec<u64>);
        let mut by: BTreeMap<(ShardId, bool), Part> = BTreeMap::new();
        let mut at = 0usize;
        // The push was checked: its chunks' bytes are there (a 16-bit chunk's are half an f32
        // one's, a sparse record's as long as its count says).
        let sizes = coded::sizes(payload, chunks);
        for (i, c) in chunks.iter().enumerate() {
            let len = sizes.get(i).copied().unwrap_or(0);
            for b in map.backups_of(c.key) {
                let (refs, bytes, _) = by.entry((b, seeded(b, c.key.0))).or_default();
                refs.push(*c);
                match bytes.last_mut() {
                    Some(last) if last.1 == at => last.1 = at + len,
                    _ => bytes.push((at, at + len)),
                }
            }
            at += len;
        }
        for r in covers {
            for k in r.start..r.end {
                for b in map.backups_of(Key(k)) {
                    by.entry((b, seeded(b, k))).or_default().2.push(k);
                }
            }
        }
        by.into_iter()
            .filter_map(|((shard, seeding), (refs, bytes, covered))| {
                let addr = map.addr_of(shard)?.to_string();
                let mut keys: Vec<Key> = refs.iter().map(|c| c.key).collect();
                keys.extend(covered.iter().map(|k| Key(*k)));
                let req = Request::Replicate {
                    epoch: map.epoch,
                    worker,
                    clock,
                    chunks: refs,
                    span: span.cloned(),
                    covers: KeyRange::runs(covered.into_iter()),
                    seeding,
                };
                Some(Forward {
                    shard,
                    addr,
                    keys,
                    req,
                    payload: Parts(slices(payload, &bytes)),
                })
            })
            .collect()
    }

    /// Per key, the floats read and written since the last call; the counters restart.
    pub fn take_key_loads(&self) -> Vec<KeyLoad> {
        let mut out: Vec<KeyLoad> = self
            .chunks
            .iter_mut()
            .map(|mut c| KeyLoad {
                key: *c.key(),
                load: std::mem::take(&mut c.load),
            })
            .collect();
        out.sort_unstable_by_key(|l| l.key);
        out
    }

    /// The per-epoch data ledger (the worst of its segments); empty without keys.
    pub fn ledger_report(&self) -> Vec<EpochLedger> {
        self.ledgers().report()
    }
}

/// The most payload bytes a new backup keeps for the copy it waits for; past it, a forwarded
/// push waits for the copy instead of being kept.
const KEPT_BYTES: u64 = 1 << 30;

/// A forwarded push a new backup keeps until the copy of its keys arrives.
#[derive(Debug)]
pub struct Kept {
    epoch: MapEpoch,
    worker: WorkerId,
    clock: Clock,
    chunks: Vec<ChunkRef>,
    payload: Vec<Bytes>,
    span: Option<DataSpan>,
    covers: Vec<KeyRange>,
}

impl Kept {
    /// A push as a `Replicate` request carries it.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        epoch: MapEpoch,
        worker: WorkerId,
        clock: Clock,
        chunks: Vec<ChunkRef>,
        payload: Vec<Bytes>,
        span: Option<DataSpan>,
        covers: Vec<KeyRange>,
    ) -> Kept {
        Kept {
            epoch,
            worker,
            clock,
            chunks,
            payload,
            span,
            covers,
        }
    }

    fn as_ref(&self) -> PushRef<'_> {
        (
            self.epoch,
            self.worker,
            self.clock,
            &self.chunks,
            &self.payload,
            self.span.as_ref(),
            &self.covers,
        )
    }

    fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        let covered = self.covers.iter().flat_map(|r| (r.start..r.end).map(Key));
        self.chunks.iter().map(|c| c.key).chain(covered)
    }

    fn bytes(&self) -> u64 {
        self.payload.iter().map(|p| p.len() as u64).sum()
    }
}

/// The byte ranges `ranges` (in order, not overlapping) of a payload that lies in `parts`, as
/// slices of those parts.
fn slices(parts: &[Bytes], ranges: &[(usize, usize)]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut offset = 0usize;
    let mut next = ranges.iter().peekable();
    for part in parts {
        let end = offset + part.len();
        while let Some(&&(a, b)) = next.peek() {
            let (from, to) = (a.max(offset), b.min(end));
            if from < to {
                out.push(part.slice(from - offset..to - offset));
            }
            if b > end {
                break;
            }
            next.next();
        }
        offset = end;
    }
    out
}

/// A push on its way from a primary to one of its backups.
pub struct Forward {
    /// The backup.
    shard: ShardId,
    /// Its address in the map the push was planned with.
    addr: String,
    /// The keys it holds copies of that the push names (chunks and covered keys).
    keys: Vec<Key>,
    /// The `Replicate` request and its payload.
    req: Request,
    payload: Parts,
}

/// How long a primary keeps offering a push to a backup that refuses it for keys it does not
/// hold (a backup behind the map, or one the coordinator is about to drop) before it gives up
/// on the push.
const BACKUP_REFUSALS: Duration = Duration::from_secs(30);

/// Hands `fwd` to its backup until it acknowledges it, or until this shard's map no longer
/// lists it as a backup of the keys (the coordinator dropped a dead or cut-off backup: the
/// push does not wait for it). Refused if the map no longer makes this shard their primary
/// (it learned from a backup that another shard was promoted in its place).
/// A backup that has not acknowledged a push this long after it was first offered is
/// reported to the coordinator as lost (see [`Request::BackupLost`]).
const BACKUP_LOST_AFTER: Duration = Duration::from_secs(5);

async fn forward(
    st: &ShardState,
    link: &dyn ShardLink,
    fwd: Forward,
    coordinator: Option<&str>,
) -> Result<(), Response> {
    let mut delay = Duration::from_millis(20);
    let mut warned = false;
    let mut refused_since: Option<tokio::time::Instant> = None;
    let lost_at = tokio::time::sleep(BACKUP_LOST_AFTER);
    tokio::pin!(lost_at);
    let mut reported = coordinator.is_none();
    loop {
        let changed = st.map_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let map = st.read_map();
        if let Some(k) = fwd.keys.iter().find(|k| map.owner(**k) != Some(st.id)) {
            return Err(Response::from(st.missing(*k)));
        }
        if !fwd
            .keys
            .iter()
            .any(|k| map.backups_of(*k).any(|s| s == fwd.shard))
        {
            if warned {
                info!(shard = %st.id, backup = %fwd.shard, epoch = %map.epoch,
                    "the map no longer lists the backup: the push goes on without it");
            }
            return Ok(());
        }
        let addr = map.addr_of(fwd.shard).unwrap_or(&fwd.addr).to_string();
        let call = link.call(&addr, fwd.req.clone(), fwd.payload.clone());
        tokio::pin!(call);
        let err = loop {
            tokio::select! {
                biased;
                r = &mut call => break match r {
                    Ok(Response::Ack) => return Ok(()),
                    Ok(other) => CallError::unexpected(&other),
                    Err(e) => e,
                },
                () = &mut changed => break CallError::Withdrawn,
                // Still unacknowledged: the backup is cut off or stuck. The call goes on.
                () = &mut lost_at, if !reported => {
                    reported = true;
                    report_lost(link, coordinator.unwrap_or_default(), st.id, fwd.shard).await;
                }
            }
        };
        if matches!(err, CallError::Withdrawn) {
            // The map changed: check again whether the backup still needs the push.
            continue;
        }
        match err {
            CallError::Remote {
                code: Some(ErrorCode::StaleEpoch),
                map: Some(theirs),
                ..
            } if theirs.epoch > map.epoch => {
                st.adopt_map(&theirs);
                continue;
            }
            CallError::Remote {
                code: Some(ErrorCode::StaleEpoch),
                message,
                ..
            } => {
                let since = *refused_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= BACKUP_REFUSALS {
                    return Err(Response::error(
                        ErrorCode::Internal,
                        format!(
                            "{}'s backup {} refuses the push: {message}",
                            st.id, fwd.shard
                        ),
                    ));
                }
            }
            CallError::Remote { code, message, map } => {
                tracing::error!(shard = %st.id, backup = %fwd.shard, %message,
                    "a backup refused a push its primary took");
                return Err(Response::Error {
                    code: code.unwrap_or(ErrorCode::Internal).as_u16(),
                    message: format!("backup {}: {message}", fwd.shard),
                    map: map.map(|m| *m),
                });
            }
            e => {
                if !warned {
                    tracing::warn!(shard = %st.id, backup = %fwd.shard, error = %e,
                        "backup unreachable: pushes wait for it until it answers or the \
                         coordinator drops it");
                    warned = true;
                }
            }
        }
        tokio::select! {
            biased;
            () = &mut changed => {}
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_millis(500));
    }
}

/// Tells the coordinator (at one of the comma-separated `coordinator` addresses, or the leader
/// a standby names) that primary `me` cannot reach its backup `backup`.
async fn report_lost(link: &dyn ShardLink, coordinator: &str, me: ShardId, backup: ShardId) {
    tracing::warn!(shard = %me, %backup, "a backup has not acknowledged a push for \
        {BACKUP_LOST_AFTER:?}: asking the coordinator to drop it");
    let mut addrs: Vec<String> = coordinator.split(',').map(str::to_string).collect();
    let mut i = 0;
    while let Some(addr) = addrs.get(i).cloned() {
        i += 1;
        match link
            .call(&addr, Request::BackupLost { backup }, Parts::default())
            .await
        {
            Ok(Response::Ack) => return,
            Ok(Response::NotLeader { leader: Some(l) })
            | Err(CallError::NotLeader { leader: Some(l) })
                if !addrs.contains(&l) =>
            {
                addrs.push(l)
            }
            Ok(_) | Err(_) => {}
        }
    }
    tracing::error!(shard = %me, %backup, "no coordinator took the report of a lost backup");
}

/// Which copies a push goes to: the keys this shard is the primary of, or its backup copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Primary,
    Backup,
}

/// A push as a shard takes it: the map epoch it was routed with, the worker, its step, its
/// chunks and their gradients (in the parts they arrived in), its span and covered ranges.
pub type PushRef<'a> = (
    MapEpoch,
    WorkerId,
    Clock,
    &'a [ChunkRef],
    &'a [Bytes],
    Option<&'a DataSpan>,
    &'a [KeyRange],
);

/// Removes `keys` from `held` (those it holds) with copies of their segments' ledgers, and
/// forgets the segments no key left in `held` belongs to. The caller holds the gate
/// exclusively.
fn take_out(
    held: &DashMap<Key, Chunk>,
    ledgers: &Mutex<Ledgers>,
    keys: impl Iterator<Item = Key>,
) -> RangeExport {
    let mut chunks = Vec::new();
    let mut segments = BTreeSet::new();
    for k in keys {
        if let Some((key, chunk)) = held.remove(&k) {
            segments.insert(chunk.segment);
            chunks.push(chunk.snap(key));
        }
    }
    let mut ledgers = lock(ledgers);
    let export = RangeExport {
        chunks,
        ledgers: ledgers.export(&segments),
    };
    let used: BTreeSet<u32> = held.iter().map(|c| c.segment).collect();
    ledgers.retain(&used);
    export
}

/// Checks that `export` holds exactly keys `[start, end)`, in order.
fn exactly(start: u64, end: u64, export: &RangeExport) -> Result<(), Refusal> {
    let in_order = start < end
        && export.chunks.len() as u64 == end - start
        && export
            .chunks
            .iter()
            .zip(start..end)
            .all(|(c, k)| c.key == k);
    if !in_order {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            format!("the export does not hold exactly keys {start}..{end}"),
        ));
    }
    Ok(())
}

/// Applies, in step order, every pending BSP update of a step before `through`.
fn apply_due(job: &JobConfig, chunk: &mut Chunk, through: u64) {
    while let Some(entry) = chunk.pending.first_entry() {
        if *entry.key() >= through {
            break;
        }
        let staged = entry.remove();
        let optimizer = scheduled(job, chunk, staged.epoch, staged.pushes);
        opt_apply(chunk, optimizer.as_ref(), &staged);
    }
    chunk.applied_through = chunk.applied_through.max(through);
}

/// Applies the mean of a staged BSP step to `chunk` with `optimizer`.
fn opt_apply(chunk: &mut Chunk, optimizer: &OptimizerSpec, staged: &Staged) {
    chunk.opt.apply(
        optimizer,
        Arc::make_mut(&mut chunk.params).as_mut_slice(),
        &staged.sum,
        1.0 / staged.pushes.max(1) as f32,
    );
}

/// The optimizer of `chunk`'s group as it applies the chunk's next update (of samples of
/// `epoch`, averaging `workers` gradients): the job's schedule evaluated at the chunk's
/// applied updates or at the epoch ([`edl_shared::proto::LrSchedule`]).
fn scheduled<'a>(
    job: &'a JobConfig,
    chunk: &Chunk,
    epoch: u32,
    workers: u32,
) -> Cow<'a, OptimizerSpec> {
    let spec = job.group_optimizer(chunk.group);
    let schedule = &job.schedule;
    if schedule.is_constant() {
        return Cow::Borrowed(spec);
    }
    let n = match schedule.by {
        ScheduleUnit::Step => chunk.opt.t,
        ScheduleUnit::Epoch => u64::from(epoch),
    };
    Cow::Owned(schedule.apply_to(spec, n, workers))
}

/// How many steps ahead of a key's applied step a BSP push may be. Under BSP a worker is
/// granted step `c` only once every counting worker finished `c - 1`, and its pull or push
/// applies every step before that, so one or two steps are pending at most; a push far
/// ahead is not a real step, and is refused rather than staged.
const MAX_STAGED_AHEAD: u64 = 16;

/// How long a request routed with a newer map than a shard's waits for the shard to learn it.
const EPOCH_WAIT: Duration = Duration::from_secs(5);
/// What a shard answers (with `NotReady`) before the coordinator gave it its assignment.
const UNASSIGNED: &str = "shard has no assignment yet";
/// How long a retired shard keeps answering before it stops.
const RETIRE_GRACE: Duration = Duration::from_secs(2);
/// How long a shard tries to hand a range to its destination before it answers the
/// coordinator (and goes on trying in the background).
const HANDOFF_WINDOW: Duration = Duration::from_secs(10);

/// A range on its way to another shard.
struct HandOff {
    addr: String,
    /// The `MoveIn`, and the range's state.
    req: Request,
    payload: Bytes,
    range: (u64, u64),
    /// The map from before the move, and the move's map epoch.
    before: ShardMap,
    attempted: MapEpoch,
    export: RangeExport,
}

/// How an offer of a range ended.
enum Handed {
    /// The destination took it.
    Taken,
    /// The destination refused it: it does not have it and never will.
    Refused(String),
    /// No answer within the window: the destination may have taken it.
    Unanswered(String),
}

impl HandOff {
    fn new(
        addr: String,
        (start, end): (u64, u64),
        before: &ShardMap,
        map: &ShardMap,
        payload: Bytes,
        export: RangeExport,
    ) -> HandOff {
        HandOff {
            addr,
            req: Request::MoveIn {
                start,
                end,
                map: map.clone(),
            },
            payload,
            range: (start, end),
            before: before.clone(),
            attempted: map.epoch,
            export,
        }
    }

    /// Offers the range to its destination, again on connection failures (an import is
    /// idempotent), until it answers or `window` (if any) ends.
    async fn offer(&self, link: &dyn ShardLink, window: Option<Duration>) -> Handed {
        let payload = Parts(vec![self.payload.clone()]);
        offer(link, &self.addr, &self.req, payload, window).await
    }

    /// Takes the range back (its destination refused it) and writes a checkpoint: one written
    /// while the range was out must not be what a restart finds.
    async fn take_back(
        self,
        st: &Arc<ShardState>,
        store: Option<&CheckpointStore>,
    ) -> Result<(), Refusal> {
        let (start, end) = self.range;
        st.reinstate(start, end, &self.before, self.attempted, self.export)?;
        if let Some(Err(e)) = checkpoint_to(store, st).await {
            tracing::error!(error = %e, "checkpoint after a failed hand-off failed");
        }
        Ok(())
    }

    /// Offers the range until the destination answers: taken, or refused and taken back.
    async fn finish(
        self,
        st: &Arc<ShardState>,
        link: &dyn ShardLink,
        store: Option<&CheckpointStore>,
    ) {
        let (start, end) = self.range;
        match self.offer(link, None).await {
            Handed::Taken => {
                st.handed_over(start, end);
                if let Some(Err(e)) = checkpoint_to(store, st).await {
                    tracing::error!(error = %e, "checkpoint after a move failed");
                }
                info!(shard = %st.id(), start, end, "range handed off after all");
            }
            Handed::Refused(e) | Handed::Unanswered(e) => {
                info!(shard = %st.id(), start, end, error = %e,
                    "hand-off refused; taking the range back");
                if let Err(r) = self.take_back(st, store).await {
                    tracing::error!(shard = %st.id(), start, end, error = %r.message,
                        "taking a range back failed");
                }
            }
        }
    }
}

/// The answer to a hand-off or a seeding of keys `[start, end)` from `from` to `to` with the
/// map of `epoch`: `bytes` sent, begun at `t0`, the keys held for `hold_ms`.
fn moved(
    from: ShardId,
    (start, end, to): (u64, u64, ShardId),
    epoch: MapEpoch,
    bytes: u64,
    (t0, hold_ms): (std::time::Instant, f64),
) -> Frame<Response, Parts> {
    Frame::new(Response::Moved(MoveReport {
        t_ms: 0,
        start,
        end,
        from,
        to,
        epoch,
        bytes,
        millis: t0.elapsed().as_secs_f64() * 1000.0,
        hold_ms,
    }))
}

/// Offers `req` with `payload` (a range's state) to the shard at `addr`, again on connection
/// failures (taking a range is idempotent), until it answers or `window` (if any) ends.
async fn offer(
    link: &dyn ShardLink,
    addr: &str,
    req: &Request,
    payload: Parts,
    window: Option<Duration>,
) -> Handed {
    let deadline = window.map(|w| tokio::time::Instant::now() + w);
    let mut delay = Duration::from_millis(50);
    loop {
        let err = match link.call(addr, req.clone(), payload.clone()).await {
            Ok(Response::Ack) => return Handed::Taken,
            Ok(other) => return Handed::Refused(CallError::unexpected(&other).to_string()),
            Err(e @ CallError::Remote { .. }) => return Handed::Refused(e.to_string()),
            Err(e) => e,
        };
        if deadline.is_some_and(|d| tokio::time::Instant::now() + delay >= d) {
            return Handed::Unanswered(err.to_string());
        }
        tracing::debug!(%addr, error = %err, "hand-off: retrying");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// Writes a checkpoint of `st` to `store`, if there is one.
async fn checkpoint_to(
    store: Option<&CheckpointStore>,
    st: &Arc<ShardState>,
) -> Option<Result<(String, u64, f64), String>> {
    Some(store?.write(st).await)
}

/// Where a shard keeps its checkpoint.
#[derive(Clone)]
pub enum CheckpointStore {
    /// A file, written off the runtime (`edl-ps shard --checkpoint`).
    File(PathBuf),
    /// Handed to a function on the runtime as it is taken: the deterministic simulation's
    /// disk, which it restarts a crashed shard from.
    Memory(Arc<dyn Fn(ShardCheckpoint) + Send + Sync>),
}

impl CheckpointStore {
    /// Writes a checkpoint of `st`: returns where, its bytes (0 in memory) and milliseconds.
    pub async fn write(&self, st: &Arc<ShardState>) -> Result<(String, u64, f64), String> {
        match self {
            CheckpointStore::File(path) => {
                let (st, path) = (st.clone(), path.clone());
                let written = tokio::task::spawn_blocking(move || {
                    write_checkpoint(&st, &path).map(|r| (r, path))
                })
                .await;
                match written {
                    Ok(Ok(((bytes, millis), path))) => {
                        Ok((path.display().to_string(), bytes, millis))
                    }
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            CheckpointStore::Memory(keep) => {
                let _one = st.saving.lock().unwrap_or_else(|p| p.into_inner());
                keep(st.snapshot());
                Ok(("memory".to_string(), 0, 0.0))
            }
        }
    }
}

/// The shard service: waits for its assignment, then serves pulls and pushes, and moves key
/// ranges when the coordinator asks.
pub struct ShardService {
    /// The shard's state, once the coordinator assigned its ranges.
    state: watch::Sender<Option<Arc<ShardState>>>,
    checkpoint: Option<CheckpointStore>,
    /// For handing ranges to other shards (as this shard).
    link: Arc<dyn ShardLink>,
    /// Checks worker tokens: the coordinator's key (learned when this shard joins) and the job
    /// in this shard's certificate.
    tokens: std::sync::OnceLock<Signer>,
    /// Cancelled when the coordinator retires this shard.
    retire: CancellationToken,
    /// The coordinators' addresses (comma-separated), for a primary's report of a backup it
    /// cannot reach; none in the simulation.
    coordinator: std::sync::OnceLock<String>,
}

impl ShardService {
    /// A service with no assignment yet: it answers `NotReady` until [`ShardService::trust`]
    /// and [`ShardService::assign`]. It reaches other shards through `link`, keeps its
    /// checkpoints in `checkpoint` (none if `None`), and cancels `retire` when the coordinator
    /// retires it.
    pub fn new(
        link: Arc<dyn ShardLink>,
        checkpoint: Option<CheckpointStore>,
        retire: CancellationToken,
    ) -> ShardService {
        ShardService {
            state: watch::Sender::new(None),
            checkpoint,
            link,
            tokens: std::sync::OnceLock::new(),
            retire,
            coordinator: std::sync::OnceLock::new(),
        }
    }

    /// Reports backups it cannot reach to the coordinators at `addrs` (comma-separated).
    pub fn report_to(&self, addrs: &str) {
        let _ = self.coordinator.set(addrs.to_string());
    }

    /// Accepts the tokens the coordinator signs with `key` for job `job` (given when this
    /// shard joins; the first key given stays).
    pub fn trust(&self, key: &Token, job: &str) {
        let _ = self.tokens.set(Signer::new(key, job));
    }

    /// Serves `state`, the shard's ranges, from now on.
    pub fn assign(&self, state: Arc<ShardState>) {
        self.state.send_replace(Some(state));
    }

    async fn ready(&self) -> Option<Arc<ShardState>> {
        let mut rx = self.state.subscribe();
        let wait = rx.wait_for(|s| s.is_some());
        match tokio::time::timeout(Duration::from_secs(30), wait).await {
            Ok(Ok(s)) => s.clone(),
            _ => None,
        }
    }

    /// Writes a checkpoint, if this shard keeps one.
    async fn checkpoint_now(
        &self,
        st: &Arc<ShardState>,
    ) -> Option<Result<(String, u64, f64), String>> {
        checkpoint_to(self.checkpoint.as_ref(), st).await
    }

    /// Hands keys `[start, end)` to shard `to`: gives them up here (requests for them are
    /// refused with the new map from then on), streams their state to `to`, and answers once
    /// `to` took them. If `to` refuses them, they are taken back. If `to` does not answer within
    /// [`HANDOFF_WINDOW`], it may have taken them all the same (its answer lost), so they are
    /// not taken back: a task keeps offering them until `to` answers one way or the other, and
    /// the coordinator is answered with an error at once, on which it fences `to` and asks it
    /// where the range is.
    async fn move_out(
        &self,
        st: &Arc<ShardState>,
        (start, end, to): (u64, u64, ShardId),
        map: ShardMap,
    ) -> Result<Frame<Response, Parts>, Response> {
        let t0 = edl_shared::clock::now();
        let invalid = |m: String| Response::error(ErrorCode::InvalidRequest, m);
        if to == st.id() {
            return Err(invalid(format!("{to} cannot move keys to itself")));
        }
        if map.owner(Key(start)) != Some(to) || map.owner(Key(end.saturating_sub(1))) != Some(to) {
            return Err(invalid(format!(
                "the new map does not place {start}..{end} on {to}"
            )));
        }
        let Some(addr) = map.addr_of(to).map(str::to_string) else {
            return Err(invalid(format!("the new map has no address for {to}")));
        };
        let before = st.read_map();
        let export = st.export(start, end, &map).map_err(Response::from)?;
        let held = edl_shared::clock::now();
        let payload = match export.encode() {
            Ok(p) => p,
            Err(e) => {
                // Nothing left: the range goes back at once.
                let never = HandOff::new(addr, (start, end), &before, &map, Bytes::new(), export);
                never.take_back(st, self.checkpoint.as_ref()).await?;
                return Err(Response::error(
                    ErrorCode::Internal,
                    format!(
                        "encoding keys {start}..{end}: {e}; they stay on {}",
                        st.id()
                    ),
                ));
            }
        };
        let bytes = payload.len() as u64;
        let offer = HandOff::new(addr, (start, end), &before, &map, payload, export);
        match offer.offer(&*self.link, Some(HANDOFF_WINDOW)).await {
            Handed::Taken => {}
            Handed::Refused(e) => {
                offer.take_back(st, self.checkpoint.as_ref()).await?;
                tracing::warn!(shard = %st.id(), %to, start, end, error = %e,
                    "hand-off refused; the range stays here");
                return Err(Response::error(
                    ErrorCode::Internal,
                    format!(
                        "handing keys {start}..{end} to {to} failed ({e}); they stay on {}",
                        st.id()
                    ),
                ));
            }
            Handed::Unanswered(e) => {
                tracing::warn!(shard = %st.id(), %to, start, end, error = %e,
                    "hand-off unanswered; offering the range until the destination answers");
                let (st, link, store) = (st.clone(), self.link.clone(), self.checkpoint.clone());
                let stop = self.retire.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        biased;
                        _ = stop.cancelled() => {}
                        () = offer.finish(&st, &*link, store.as_ref()) => {}
                    }
                });
                return Err(Response::error(
                    ErrorCode::Internal,
                    format!(
                        "{to} did not answer the hand-off of keys {start}..{end} within \
                         {HANDOFF_WINDOW:?} ({e}); they are held at neither end until it does"
                    ),
                ));
            }
        }
        st.handed_over(start, end);
        let hold_ms = held.elapsed().as_secs_f64() * 1000.0;
        // The checkpoint on disk must agree with the new placement, or a restart would fail.
        if let Some(Err(e)) = self.checkpoint_now(st).await {
            tracing::error!(error = %e, "checkpoint after a move failed");
        }
        info!(shard = %st.id(), %to, start, end, bytes, hold_ms, "range handed off");
        Ok(moved(
            st.id(),
            (start, end, to),
            map.epoch,
            bytes,
            (t0, hold_ms),
        ))
    }

    /// Seeds a new backup of keys `[start, end)` on shard `to`, which `map` lists: copies them
    /// under the gate (adopting `map`, so pushes from then on are forwarded to `to`) and hands
    /// the copy to `to`, which takes it before it applies them. Answered once `to` took it,
    /// or with an error (the coordinator then publishes a map without `to` as their backup).
    async fn copy_out(
        &self,
        st: &Arc<ShardState>,
        (start, end, to): (u64, u64, ShardId),
        map: ShardMap,
    ) -> Result<Frame<Response, Parts>, Response> {
        let t0 = edl_shared::clock::now();
        let invalid = |m: String| Response::error(ErrorCode::InvalidRequest, m);
        if to == st.id() || !(start..end).all(|k| map.backups_of(Key(k)).any(|s| s == to)) {
            return Err(invalid(format!(
                "the new map does not make {to} a backup of {start}..{end}"
            )));
        }
        let Some(addr) = map.addr_of(to).map(str::to_string) else {
            return Err(invalid(format!("the new map has no address for {to}")));
        };
        let export = st.copy((start, end, to), &map).map_err(Response::from)?;
        let held = edl_shared::clock::now();
        let result = self.hand_copy((start, end, to), &addr, &map, export).await;
        st.seeded(to, start, end);
        let bytes = result.inspect_err(|e| {
            tracing::warn!(shard = %st.id(), %to, start, end, error = ?e,
                "seeding a backup failed");
        })?;
        let hold_ms = held.elapsed().as_secs_f64() * 1000.0;
        info!(shard = %st.id(), %to, start, end, bytes, "backup seeded");
        Ok(moved(
            st.id(),
            (start, end, to),
            map.epoch,
            bytes,
            (t0, hold_ms),
        ))
    }

    /// Hands the copy `export` of keys `[start, end)` to their new backup `to` at `addr`
    /// (`CopyIn`, with `map`), offered once (see [`offer`]); the copy's bytes once `to` took
    /// it.
    async fn hand_copy(
        &self,
        (start, end, to): (u64, u64, ShardId),
        addr: &str,
        map: &ShardMap,
        export: RangeExport,
    ) -> Result<u64, Response> {
        let payload = export.encode().map_err(|e| {
            Response::error(
                ErrorCode::Internal,
                format!("encoding keys {start}..{end}: {e}"),
            )
        })?;
        let req = Request::CopyIn {
            start,
            end,
            map: map.clone(),
        };
        let bytes = payload.len() as u64;
        // Offered once: the new backup acknowledged the pushes forwarded since the copy was
        // taken while it kept them in memory, so a copy that did not reach it at once may
        // reach a restarted process that never saw them (the seeding is given up instead, and
        // the coordinator seeds a backup again).
        let offered = offer(
            &*self.link,
            addr,
            &req,
            Parts(vec![payload]),
            Some(Duration::ZERO),
        );
        match offered.await {
            Handed::Taken => Ok(bytes),
            Handed::Refused(e) | Handed::Unanswered(e) => Err(Response::error(
                ErrorCode::Internal,
                format!("seeding {to} with keys {start}..{end} failed: {e}"),
            )),
        }
    }

    /// Takes keys handed over by another shard, and makes the checkpoint agree before
    /// acknowledging.
    async fn move_in(
        &self,
        st: &Arc<ShardState>,
        (start, end): (u64, u64),
        map: ShardMap,
        payload: &[u8],
    ) -> Result<Frame<Response, Parts>, Response> {
        let export = RangeExport::decode(payload)
            .map_err(|e| Response::error(ErrorCode::Malformed, format!("range export: {e}")))?;
        st.import(start, end, &map, export)
            .map_err(Response::from)?;
        if let Some(Err(e)) = self.checkpoint_now(st).await {
            tracing::error!(error = %e, "checkpoint after a move failed");
        }
        info!(shard = %st.id(), start, end, epoch = %map.epoch, "range taken over");
        Ok(Frame::new(Response::Ack))
    }

    /// Applies a worker's push here and, in a replicated job, hands it to the backups of its
    /// keys at the same time; acknowledged once it is applied here and every backup the map
    /// lists acknowledged it (see [`forward`]). A push found already applied here is still
    /// handed to the backups, which may not have it yet.
    async fn push_replicated(
        &self,
        st: &Arc<ShardState>,
        push: PushRef<'_>,
        in_flight: u64,
    ) -> Result<Frame<Response, Parts>, Response> {
        if !st.replicated() {
            return st
                .push_forwarding(push, in_flight, &mut || {})
                .map(|_| Frame::new(Response::Ack))
                .map_err(Response::from);
        }
        let mut started = Vec::new();
        // The backups are read under the gate the push holds, so that a new backup's copy
        // (taken under the gate) either holds this push or is sent it.
        let claim = st.push_forwarding(push, in_flight, &mut || {
            for fwd in st.forwards(push) {
                let (st, link) = (st.clone(), self.link.clone());
                let coordinator = self.coordinator.get().cloned();
                let stop = self.retire.clone();
                st.forwarding.fetch_add(1, Ordering::Relaxed);
                started.push(tokio::spawn(async move {
                    // A forward ends with the shard's process (a retirement, a shutdown).
                    let r = tokio::select! {
                        biased;
                        () = stop.cancelled() => Err(Response::error(
                            ErrorCode::NotReady,
                            format!("{} is shutting down", st.id),
                        )),
                        r = forward(&st, &*link, fwd, coordinator.as_deref()) => r,
                    };
                    st.forwarding.fetch_sub(1, Ordering::Relaxed);
                    r
                }));
            }
        });
        // Forwards run to their end even if the worker goes away meanwhile.
        let mut refused = None;
        for handle in started {
            match handle.await {
                Ok(Ok(())) => {}
                Ok(Err(r)) => {
                    refused.get_or_insert(r);
                }
                Err(e) => {
                    refused.get_or_insert(Response::error(ErrorCode::Internal, e.to_string()));
                }
            }
        }
        claim.map_err(Response::from)?;
        match refused {
            Some(r) => Err(r),
            None => Ok(Frame::new(Response::Ack)),
        }
    }

    /// The refusal of a push whose token was not issued to `worker` for the pushing
    /// certificate, if it is one.
    fn bad_token(&self, peer: &Peer, worker: WorkerId, token: &Token) -> Option<Response> {
        let Some(tokens) = self.tokens.get() else {
            return Some(Response::error(ErrorCode::NotReady, UNASSIGNED));
        };
        if tokens.verify(worker, &peer.name, token) {
            return None;
        }
        tracing::warn!(%worker, peer = %peer.name, addr = %peer.addr,
            "push refused: no valid token for this worker and certificate");
        Some(Response::error(
            ErrorCode::IdentityMismatch,
            format!(
                "push for {worker} refused: its token was not issued to {:?} (register first, \
                 and push only for the worker id the coordinator gave you)",
                peer.name
            ),
        ))
    }
}

impl Service for ShardService {
    fn allowed(&self, role: Role, req: &Request) -> bool {
        match req {
            Request::Push { .. } => role == Role::Worker,
            Request::Checkpoint => role == Role::Admin,
            Request::SetMap { .. } | Request::MoveOut { .. } | Request::CopyOut { .. } => {
                role == Role::Coordinator
            }
            Request::MoveIn { .. } | Request::Replicate { .. } | Request::CopyIn { .. } => {
                role == Role::Shard
            }
            Request::KeyLoads => matches!(role, Role::Coordinator | Role::Admin),
            _ => true,
        }
    }

    async fn handle(&self, peer: &Peer, req: Request, payload: Parts) -> Frame<Response, Parts> {
        if let Request::Push { worker, token, .. } = &req
            && let Some(refused) = self.bad_token(peer, *worker, token)
        {
            return Frame::new(refused);
        }
        // A request for the shard's keys may have raced its start, so it waits a while for
        // the assignment; an operator asking how the shard stands is told at once that it has
        // none yet (a shard that joined before the map formed waits for the others to join).
        let st = match req {
            Request::ShardStats => self.state.borrow().clone(),
            _ => self.ready().await,
        };
        let Some(st) = st else {
            return Frame::new(Response::error(ErrorCode::NotReady, UNASSIGNED));
        };
        // A coordinator's orders carry its term: a deposed leader's are refused.
        if let Request::SetMap { term, .. }
        | Request::MoveOut { term, .. }
        | Request::CopyOut { term, .. } = &req
            && let Err(refused) = st.admit_term(*term)
        {
            tracing::warn!("{}", refused.message);
            return Frame::new(Response::from(refused));
        }
        let out = match req {
            Request::Pull {
                epoch,
                ranges,
                apply_through,
                wire,
            } => {
                let keys = || ranges.iter().flat_map(|r| (r.start..r.end).map(Key));
                if epoch > st.map_epoch() && !st.holds(keys()) {
                    st.wait_for_epoch(epoch, EPOCH_WAIT).await;
                }
                st.pull_in(epoch, &ranges, apply_through, wire)
                    .map_err(Response::from)
            }
            Request::Push {
                epoch,
                worker,
                clock,
                chunks,
                span,
                covers,
                token: _,
            } => {
                let keys = || {
                    let covered = covers.iter().flat_map(|r| (r.start..r.end).map(Key));
                    chunks.iter().map(|c| c.key).chain(covered)
                };
                if epoch > st.map_epoch() && !st.holds(keys()) {
                    st.wait_for_epoch(epoch, EPOCH_WAIT).await;
                }
                let push = (
                    epoch,
                    worker,
                    clock,
                    &chunks[..],
                    &payload.0[..],
                    span.as_ref(),
                    &covers[..],
                );
                self.push_replicated(&st, push, peer.server.in_flight())
                    .await
            }
            Request::Replicate {
                epoch,
                worker,
                clock,
                chunks,
                span,
                covers,
                seeding,
            } => {
                let kept = seeding
                    .then(|| {
                        let push = Kept::new(
                            epoch,
                            worker,
                            clock,
                            chunks.clone(),
                            payload.0.clone(),
                            span,
                            covers.clone(),
                        );
                        st.keep_or_replicate(push)
                    })
                    .flatten();
                if let Some(done) = kept {
                    return Frame::new(match done {
                        Ok(_) => Response::Ack,
                        Err(r) => Response::from(r),
                    });
                }
                if epoch > st.map_epoch() {
                    st.wait_for_epoch(epoch, EPOCH_WAIT).await;
                }
                let push = (
                    epoch,
                    worker,
                    clock,
                    &chunks[..],
                    &payload.0[..],
                    span.as_ref(),
                    &covers[..],
                );
                st.replicate(push)
                    .map(|_| Frame::new(Response::Ack))
                    .map_err(Response::from)
            }
            Request::Ledger => Ok(Frame::new(Response::Ledger(st.ledger_report()))),
            Request::ShardStats => Ok(Frame::new(Response::ShardStats(st.stats()))),
            Request::KeyLoads => Ok(Frame::new(Response::KeyLoads(st.take_key_loads()))),
            Request::Checkpoint => match self.checkpoint_now(&st).await {
                None => Err(Response::error(
                    ErrorCode::InvalidRequest,
                    "this shard runs without a checkpoint path",
                )),
                Some(Ok((path, bytes, millis))) => Ok(Frame::new(Response::Checkpointed {
                    path,
                    bytes,
                    millis,
                })),
                Some(Err(e)) => Err(Response::error(ErrorCode::Internal, e)),
            },
            Request::GetMap => Ok(Frame::new(Response::Map((*st.read_map()).clone()))),
            Request::SetMap { map, retire, .. } => {
                st.adopt_map(&map);
                if retire && st.num_keys() == 0 {
                    info!(shard = %st.id(), "removed from the job; retiring");
                    // Linger a moment, answering requests routed with an old map with the
                    // new one, so that clients re-route instead of finding it gone.
                    let retire = self.retire.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(RETIRE_GRACE).await;
                        retire.cancel();
                    });
                }
                Ok(Frame::new(Response::Ack))
            }
            Request::MoveOut {
                start,
                end,
                to,
                map,
                ..
            } => self.move_out(&st, (start, end, to), map).await,
            Request::MoveIn { start, end, map } => {
                self.move_in(&st, (start, end), map, &payload.to_bytes())
                    .await
            }
            Request::CopyOut {
                start,
                end,
                to,
                map,
                ..
            } => self.copy_out(&st, (start, end, to), map).await,
            Request::CopyIn { start, end, map } => match RangeExport::decode(&payload.to_bytes()) {
                Err(e) => Err(Response::error(
                    ErrorCode::Malformed,
                    format!("range copy: {e}"),
                )),
                Ok(export) => match st.seed(start, end, &map, export) {
                    Err(r) => Err(Response::from(r)),
                    Ok(()) => {
                        info!(shard = %st.id(), start, end, epoch = %map.epoch,
                            "seeded: now a backup of these keys");
                        Ok(Frame::new(Response::Ack))
                    }
                },
            },
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
    /// The coordinators' addresses (one, or several separated by commas: the job's leader
    /// and standbys).
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
    let _one = state.saving.lock().unwrap_or_else(|p| p.into_inner());
    let t = std::time::Instant::now();
    let bytes = checkpoint::write(path, &state.snapshot())?;
    let millis = t.elapsed().as_secs_f64() * 1000.0;
    metrics::checkpointed(bytes, millis);
    Ok((bytes, millis))
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
    // Stopping the shard: a signal (the parent token) or retirement by the coordinator.
    let shutdown = shutdown.child_token();
    let service = Arc::new(ShardService::new(
        Arc::new(ShardCaller::new(&identity, &settings)?),
        config.checkpoint.clone().map(CheckpointStore::File),
        shutdown.clone(),
    ));
    let server = {
        let (service, settings, stop, job) = (
            service.clone(),
            settings.clone(),
            shutdown.clone(),
            identity.job.clone(),
        );
        tokio::spawn(async move {
            edl_shared::serve(endpoint, service, &job, &settings, stop).await;
        })
    };
    let advertise = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    let joined = tokio::select! {
        _ = shutdown.cancelled() => None,
        r = join(&config.coordinator, &advertise, &identity, &settings) => Some(r?),
    };
    let Some((id, job, map, token_key)) = joined else {
        server.await?;
        return Ok(());
    };
    service.trust(&token_key, &identity.job);
    service.report_to(&config.coordinator);
    // A shard of a replicated job that the map gives nothing rejoins as a standby: the live
    // copies on the other shards hold everything acknowledged since its checkpoint.
    let standby = ShardState::rejoins_as_standby(&job, &map, id);
    if standby && config.checkpoint.as_deref().is_some_and(Path::exists) {
        info!(shard = %id, "rejoining a replicated job as a standby: its checkpoint is not \
            used (the live copies are newer)");
    }
    let state = match config
        .checkpoint
        .as_deref()
        .filter(|p| p.exists() && !standby)
    {
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
    metrics::watch(&state);
    info!(shard = %id, %addr, keys = state.num_keys(), aes_gcm = settings.aead.name(),
        "shard serving");
    service.assign(state.clone());
    let periodic = match (&config.checkpoint, config.checkpoint_every) {
        (Some(path), Some(every)) => {
            let store = CheckpointStore::File(path.clone());
            let (state, stop) = (state.clone(), shutdown.clone());
            Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    match store.write(&state).await {
                        Ok((_, bytes, ms)) => tracing::debug!(bytes, ms, "checkpoint written"),
                        Err(e) => tracing::error!(error = %e, "checkpoint failed"),
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
) -> anyhow::Result<(ShardId, JobConfig, ShardMap, Token)> {
    let ep = client_endpoint(identity, settings, false)?;
    let mut coordinators =
        edl_shared::leader::Coordinators::parse(coordinator).map_err(anyhow::Error::msg)?;
    let mut delay = Duration::from_millis(50);
    loop {
        let at = coordinators.current().to_string();
        let attempt = async {
            let conn = Conn::connect(&ep, &at, &identity.name, settings).await?;
            let resp = conn
                .call(
                    Request::ShardJoin {
                        addr: advertise.to_string(),
                    },
                    Bytes::new(),
                )
                .await?;
            match resp.msg {
                Response::ShardAssigned {
                    shard,
                    job,
                    map,
                    token_key,
                } => Ok((shard, job, map, token_key)),
                other => Err(CallError::unexpected(&other)),
            }
        };
        match attempt.await {
            Ok(v) => return Ok(v),
            Err(e @ CallError::Remote { .. }) if e.code() != Some(ErrorCode::NotReady) => {
                return Err(e.into());
            }
            // A standby: join the leader it names.
            Err(CallError::NotLeader { leader: Some(l) }) => {
                tracing::info!(leader = %l, "the coordinator at {at} stands by: joining the leader");
                coordinators.follow(Some(&l));
            }
            Err(e) => {
                tracing::debug!(error = %e, "coordinator at {at} not ready; retrying");
                coordinators.advance();
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

mod metrics;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
