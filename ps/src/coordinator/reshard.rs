//! Online resharding, driven by the coordinator: a plan from the state machine
//! ([`super::state::shards`]) is carried out one move at a time. For each move the coordinator
//! computes the next map epoch and asks the source shard to hand the range to the destination
//! (`MoveOut`); the source gives the keys up, streams their state to the destination
//! (`MoveIn`) and answers once the destination holds them. Only then does the coordinator
//! publish the new map (saving its state at once) and tell the other shards. Workers are never
//! stopped: a request for a moving key is refused with the new map, or held by the
//! destination until the keys arrive, and the client library re-routes it.

use std::sync::Arc;
use std::time::Duration;

use edl_shared::proto::ids::Clock;
use edl_shared::proto::ids::ShardId;
use edl_shared::proto::msg::{KeyRange, MoveReport};
use edl_shared::proto::{ErrorCode, Parts, Request, Response, ShardMap};
use edl_shared::transport::CallError;
use tracing::{info, warn};

use super::Coordinator;
use super::state::shards::Move;
use crate::link::ShardLink;

/// Sends `map` to every shard of `shards` but those of `skip`, each in a task of its own (a
/// shard that is down is not waited for).
pub(super) fn announce(
    caller: &Arc<dyn ShardLink>,
    map: &ShardMap,
    shards: Vec<(ShardId, String)>,
    skip: &[ShardId],
    term: u64,
) {
    for (id, addr) in shards.into_iter().filter(|(id, _)| !skip.contains(id)) {
        let req = Request::SetMap {
            map: map.clone(),
            retire: false,
            term,
        };
        let caller = caller.clone();
        tokio::spawn(async move {
            if let Err(e) = caller.call(&addr, req, Parts::default()).await {
                warn!(shard = %id, error = %e, "could not send the new map");
            }
        });
    }
}

/// Why a resharding stopped when the store fenced this coordinator off in its middle: nothing
/// more is sent to the shards.
fn deposed() -> (ErrorCode, String) {
    (
        ErrorCode::Deposed,
        "this coordinator was deposed (another one leads now); ask the leader".into(),
    )
}

/// How many times the coordinator tries to find out where a pending move left its range, and
/// how long it waits between tries.
const RESOLVE_TRIES: u32 = 30;
const RESOLVE_PAUSE: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Finds out where the pending move, if any, left its range (its `MoveOut` failed after the
    /// source gave the range up, or went unanswered, or the coordinator restarted in its
    /// middle), and publishes that. First it fences the
    /// destination: the placement from before the move, at a fresh epoch, which from then on
    /// makes the destination refuse the range. Then it asks the destination for the range.
    /// Held: the move happened, and its placement is published above the fence. Not held: it
    /// never will be, and the placement from before stands (the source keeps the range, or
    /// takes it back when its hand-off is refused). Returns the move's report if it happened.
    /// Gives up after [`RESOLVE_TRIES`] when the destination cannot be reached, leaving the
    /// move pending for the next resharding or restart.
    async fn resolve(
        &self,
        caller: &Arc<dyn ShardLink>,
    ) -> Result<Option<MoveReport>, (ErrorCode, String)> {
        let Some((mv, attempted)) = self.lock().pending_move() else {
            return Ok(None);
        };
        let Some(dest) = attempted.addr_of(mv.to).map(str::to_string) else {
            self.lock().drop_pending();
            return Ok(None);
        };
        let began = edl_shared::clock::now();
        let Some(fence) = self.lock().republish() else {
            return Ok(None);
        };
        self.bump();
        if !self.durable().await {
            return Err(deposed());
        }
        for attempt in 0..RESOLVE_TRIES {
            if attempt > 0 {
                tokio::time::sleep(RESOLVE_PAUSE).await;
            }
            let set = Request::SetMap {
                map: fence.clone(),
                retire: false,
                term: self.term(),
            };
            if caller.call(&dest, set, Parts::default()).await.is_err() {
                continue;
            }
            let probe = Request::Pull {
                epoch: fence.epoch,
                ranges: vec![KeyRange {
                    start: mv.start,
                    end: mv.end,
                }],
                apply_through: Clock(0),
                wire: Default::default(),
            };
            let held = match caller.call(&dest, probe, Parts::default()).await {
                Ok(Response::Pulled { .. }) => true,
                Err(CallError::Remote {
                    code: Some(ErrorCode::StaleEpoch),
                    ..
                }) => false,
                _ => continue,
            };
            let (map, shards, report) = {
                let mut st = self.lock();
                match held.then(|| st.pending_done()).flatten() {
                    Some(map) => {
                        let report = mv.report(map.epoch);
                        st.commit_move(map.clone(), report.clone(), began);
                        (map, st.live_shards(), Some(report))
                    }
                    None => {
                        st.drop_pending();
                        (fence.clone(), st.live_shards(), None)
                    }
                }
            };
            self.spread(caller, &map, shards, &[]).await;
            info!(start = mv.start, end = mv.end, from = %mv.from, to = %mv.to, epoch = %map.epoch,
                moved = report.is_some(), "a move's outcome found out");
            return Ok(report);
        }
        Err((
            ErrorCode::NotReady,
            format!(
                "keys {}..{} were being moved from {} to {}, and {dest} could not be asked \
                 whether it holds them; the move is settled at the next resharding or restart",
                mv.start, mv.end, mv.from, mv.to
            ),
        ))
    }

    /// A map just published: wakes the requests waiting on the state, saves it (a published
    /// map must survive a crash) and sends it to `shards` but those of `skip`. They serve their
    /// own keys meanwhile, so nothing waits for them (nor for one that is down). A coordinator
    /// deposed meanwhile sends nothing.
    async fn spread(
        &self,
        caller: &Arc<dyn ShardLink>,
        map: &ShardMap,
        shards: Vec<(ShardId, String)>,
        skip: &[ShardId],
    ) {
        self.bump();
        if self.durable().await {
            announce(caller, map, shards, skip, self.term());
        }
    }

    /// Settles a move a crash left in its middle (see `resolve`); run once a restarted
    /// coordinator can reach its shards.
    pub async fn resume(&self) {
        let Some(caller) = self.caller.get().cloned() else {
            return;
        };
        let _one = self.resharding.lock().await;
        if let Err((_, msg)) = self.resolve(&caller).await {
            warn!("{msg}");
        }
    }
}

/// What an operator asked for.
#[derive(Clone, Debug)]
pub enum Reshape {
    /// Give a standby shard its share.
    Add(String),
    /// Move everything off a shard (by name or address) and retire it.
    Remove(String),
    /// Rebalance by size, or by recent load.
    Rebalance { by_load: bool },
    /// Bring a key range to a shard (by name or address).
    Move { start: u64, end: u64, to: String },
}

impl Coordinator {
    /// Carries out `op`; answers with the moves made and the map now current, or with the
    /// error that stopped it (moves completed before it stay).
    pub(super) async fn reshape(&self, op: Reshape) -> Response {
        let Some(caller) = self.caller.get().cloned() else {
            return Response::error(
                ErrorCode::InvalidRequest,
                "this coordinator runs without a network identity; it cannot reshard",
            );
        };
        // One resharding at a time: each plan is made against the map the last one left.
        let _one = self.resharding.lock().await;
        // A move left pending (its outcome unknown, or a restart in its middle) first.
        if let Err((code, msg)) = self.resolve(&caller).await {
            return Response::error(code, msg);
        }
        if let Reshape::Remove(name) = &op
            && self.lock().job().replicas > 1
        {
            return self.remove_replicated(&caller, name).await;
        }
        let plan = match self.plan(&caller, &op).await {
            Ok(p) => p,
            Err((code, msg)) => return Response::error(code, msg),
        };
        let removed = match &op {
            Reshape::Remove(name) => self.lock().resolve_shard(name).ok(),
            _ => None,
        };
        let mut moves = Vec::new();
        for mv in plan {
            match self.move_once(&caller, mv).await {
                Ok(r) => {
                    super::metrics::moved(&r);
                    moves.push(r);
                }
                Err((code, msg)) => {
                    let done = moves.len();
                    return Response::error(
                        code,
                        format!("{msg} ({done} earlier move(s) of this request completed)"),
                    );
                }
            }
        }
        if let Some(id) = removed {
            let (map, addr) = {
                let mut st = self.lock();
                st.retire_shard(id);
                (st.map(), st.shard_list().into_iter().find(|s| s.id == id))
            };
            self.bump();
            // A published map must survive a crash: save it now.
            if !self.durable().await {
                let (code, msg) = deposed();
                return Response::error(code, msg);
            }
            if let (Some(map), Some(entry)) = (map, addr) {
                let req = Request::SetMap {
                    map,
                    retire: true,
                    term: self.term(),
                };
                if let Err(e) = caller.call(&entry.addr, req, Parts::default()).await {
                    warn!(shard = %id, error = %e, "could not tell the removed shard to retire");
                }
            }
            info!(shard = %id, "shard removed");
        }
        match self.lock().map() {
            Some(map) => Response::Resharded { moves, map },
            None => Response::error(ErrorCode::NotReady, "the shard map is not formed yet"),
        }
    }

    /// Removes a shard of a replicated job: its ranges go to their first backups (which hold
    /// everything it acknowledged) in a map published before it is told to retire, and new
    /// backups are seeded in the background. Refused while one of its ranges has no backup.
    async fn remove_replicated(&self, caller: &Arc<dyn ShardLink>, name: &str) -> Response {
        let (id, map, shards, addr) = {
            let mut st = self.lock();
            let id = match st.resolve_shard(name) {
                Ok(id) => id,
                Err((code, msg)) => return Response::error(code, msg),
            };
            let Some(current) = st.map() else {
                return Response::error(ErrorCode::NotReady, "the shard map is not formed yet");
            };
            let alone = current.ranges_of(id).find_map(|r| {
                (r.start..r.end).find(|k| {
                    current
                        .backups_of(edl_shared::proto::Key(*k))
                        .next()
                        .is_none()
                })
            });
            if let Some(k) = alone {
                return Response::error(
                    ErrorCode::InvalidRequest,
                    format!(
                        "{id} holds the only copy of key {k}: wait until its range has a backup \
                         again (edlctl shards shows them), then remove it"
                    ),
                );
            }
            let map = st.promote(id, &[]).unwrap_or(current);
            st.retire_shard(id);
            let shards = st.placed_shards(&map);
            let addr = st.shard_list().into_iter().find(|s| s.id == id);
            (id, map, shards, addr)
        };
        self.bump();
        if !self.durable().await {
            let (code, msg) = deposed();
            return Response::error(code, msg);
        }
        announce(caller, &map, shards, &[id], self.term());
        if let Some(entry) = addr {
            let req = Request::SetMap {
                map: map.clone(),
                retire: true,
                term: self.term(),
            };
            if let Err(e) = caller.call(&entry.addr, req, Parts::default()).await {
                warn!(shard = %id, error = %e, "could not tell the removed shard to retire");
            }
        }
        info!(shard = %id, epoch = %map.epoch, "shard removed: its backups took its ranges");
        Response::Resharded {
            moves: Vec::new(),
            map,
        }
    }

    async fn plan(
        &self,
        caller: &Arc<dyn ShardLink>,
        op: &Reshape,
    ) -> Result<Vec<Move>, (ErrorCode, String)> {
        match op {
            Reshape::Add(name) => {
                let st = self.lock();
                let id = st.resolve_shard(name)?;
                st.plan_add(id)
            }
            Reshape::Remove(name) => {
                let st = self.lock();
                st.plan_remove(st.resolve_shard(name)?)
            }
            Reshape::Move { start, end, to } => {
                let st = self.lock();
                st.plan_move(*start, *end, st.resolve_shard(to)?)
            }
            Reshape::Rebalance { by_load: false } => {
                let st = self.lock();
                st.plan_rebalance(&st.key_sizes())
            }
            Reshape::Rebalance { by_load: true } => {
                let (shards, mut weight) = {
                    let st = self.lock();
                    (st.live_shards(), vec![0.0; st.key_sizes().len()])
                };
                for (id, addr) in shards {
                    match caller
                        .call(&addr, Request::KeyLoads, Parts::default())
                        .await
                    {
                        Ok(Response::KeyLoads(loads)) => {
                            for l in loads {
                                if let Some(w) = weight.get_mut(l.key.0 as usize) {
                                    *w += l.load as f64;
                                }
                            }
                        }
                        Ok(other) => {
                            return Err((
                                ErrorCode::Internal,
                                format!("{id}: {}", CallError::unexpected(&other)),
                            ));
                        }
                        Err(e) => return Err((ErrorCode::Internal, format!("{id}: {e}"))),
                    }
                }
                if weight.iter().all(|w| *w == 0.0) {
                    return Err((
                        ErrorCode::InvalidRequest,
                        "no load recorded since the last rebalance; nothing to balance by".into(),
                    ));
                }
                self.lock().plan_rebalance(&weight)
            }
        }
    }

    /// One move: the source hands the range over, then the new map is published.
    async fn move_once(
        &self,
        caller: &Arc<dyn ShardLink>,
        mv: Move,
    ) -> Result<MoveReport, (ErrorCode, String)> {
        let began = edl_shared::clock::now();
        let (map, from_addr) = {
            let mut st = self.lock();
            let addr = map_addr(&st.map(), mv.from);
            let Some(addr) = addr else {
                return Err((ErrorCode::Internal, format!("no address for {}", mv.from)));
            };
            (st.begin_move(mv)?, addr)
        };
        // The move's map epoch is recorded as sent before it goes out, so that no later map
        // (after a crash, too) gets it.
        if !self.durable().await {
            return Err(deposed());
        }
        let req = Request::MoveOut {
            start: mv.start,
            end: mv.end,
            to: mv.to,
            map: map.clone(),
            term: self.term(),
        };
        let what = format!(
            "moving keys {}..{} from {} to {}",
            mv.start, mv.end, mv.from, mv.to
        );
        let report = match caller.call(&from_addr, req, Parts::default()).await {
            Ok(Response::Moved(r)) => r,
            Ok(other) => {
                return Err((
                    ErrorCode::Internal,
                    format!("{what}: {}", CallError::unexpected(&other)),
                ));
            }
            Err(e @ CallError::Remote { .. }) if e.code() != Some(ErrorCode::Internal) => {
                // The source refused the move before giving anything up (a move to itself, a
                // stale map, keys it does not hold): the range stays there. The placement is
                // published again above the move's map all the same.
                let (map, shards) = {
                    let mut st = self.lock();
                    st.drop_pending();
                    (st.republish(), st.live_shards())
                };
                if let Some(map) = map {
                    self.spread(caller, &map, shards, &[]).await;
                }
                let code = e.code().unwrap_or(ErrorCode::Internal);
                return Err((code, format!("{what}: {e}")));
            }
            Err(e) => {
                // The source gave the range up and its destination refused it (the source took
                // it back), or did not answer it (the source offers the range until it does:
                // it may have taken it, its answer lost); or the source did not answer. Either
                // way the destination decides: it is fenced and asked, and where the range is
                // gets published above the move's map (which the source may have refused
                // requests with meanwhile).
                warn!(error = %e, "{what} failed; finding out where the range is");
                return match self.resolve(caller).await? {
                    Some(report) => Ok(report),
                    None => Err((
                        e.code().unwrap_or(ErrorCode::Internal),
                        format!("{what}: {e}; the range stays on {}", mv.from),
                    )),
                };
            }
        };
        let shards = {
            let mut st = self.lock();
            st.commit_move(map.clone(), report.clone(), began);
            st.live_shards()
        };
        // The source and destination know the new map; the others are told, so that what they
        // answer to a stale request is current.
        self.spread(caller, &map, shards, &[mv.from, mv.to]).await;
        info!(start = mv.start, end = mv.end, from = %mv.from, to = %mv.to, epoch = %map.epoch,
            bytes = report.bytes, hold_ms = report.hold_ms, millis = report.millis, "range moved");
        Ok(report)
    }
}

fn map_addr(map: &Option<ShardMap>, id: ShardId) -> Option<String> {
    map.as_ref().and_then(|m| m.addr_of(id)).map(str::to_string)
}
