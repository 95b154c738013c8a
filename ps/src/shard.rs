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

mod apply;
mod handoff;
mod replication;
mod service;
mod store;

pub use apply::*;
use handoff::*;
pub use replication::*;
pub use service::*;
pub use store::*;

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

mod metrics;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
