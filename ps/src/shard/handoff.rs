//! Moving key ranges between shards: the export of a range, its hand-off (the window in
//! which the old owner forwards to the new), the import, and taking a range back.

use super::*;

/// How long a request routed with a newer map than a shard's waits for the shard to learn it.
pub(super) const EPOCH_WAIT: Duration = Duration::from_secs(5);

/// What a shard answers (with `NotReady`) before the coordinator gave it its assignment.
pub(super) const UNASSIGNED: &str = "shard has no assignment yet";

/// How long a retired shard keeps answering before it stops.
pub(super) const RETIRE_GRACE: Duration = Duration::from_secs(2);

/// How long a shard tries to hand a range to its destination before it answers the
/// coordinator (and goes on trying in the background).
pub(super) const HANDOFF_WINDOW: Duration = Duration::from_secs(10);

/// A range on its way to another shard.
pub(super) struct HandOff {
    pub(super) addr: String,
    /// The `MoveIn`, and the range's state.
    pub(super) req: Request,
    pub(super) payload: Bytes,
    pub(super) range: (u64, u64),
    /// The map from before the move, and the move's map epoch.
    pub(super) before: ShardMap,
    pub(super) attempted: MapEpoch,
    pub(super) export: RangeExport,
}

/// How an offer of a range ended.
pub(super) enum Handed {
    /// The destination took it.
    Taken,
    /// The destination refused it: it does not have it and never will.
    Refused(String),
    /// No answer within the window: the destination may have taken it.
    Unanswered(String),
}

impl HandOff {
    pub(super) fn new(
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
    pub(super) async fn offer(&self, link: &dyn ShardLink, window: Option<Duration>) -> Handed {
        let payload = Parts(vec![self.payload.clone()]);
        offer(link, &self.addr, &self.req, payload, window).await
    }

    /// Takes the range back (its destination refused it) and writes a checkpoint: one written
    /// while the range was out must not be what a restart finds.
    pub(super) async fn take_back(
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
    pub(super) async fn finish(
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
pub(super) fn moved(
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
pub(super) async fn offer(
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

impl ShardState {
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
    pub(super) fn take_in(&self, start: u64, end: u64, export: RangeExport) -> Result<(), Refusal> {
        self.take_in_to(Side::Primary, start, end, export)
    }

    /// [`ShardState::take_in`] to `side`.
    pub(super) fn take_in_to(
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
}

impl ShardService {
    /// Hands keys `[start, end)` to shard `to`: gives them up here (requests for them are
    /// refused with the new map from then on), streams their state to `to`, and answers once
    /// `to` took them. If `to` refuses them, they are taken back. If `to` does not answer within
    /// [`HANDOFF_WINDOW`], it may have taken them all the same (its answer lost), so they are
    /// not taken back: a task keeps offering them until `to` answers one way or the other, and
    /// the coordinator is answered with an error at once, on which it fences `to` and asks it
    /// where the range is.
    pub(super) async fn move_out(
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

    /// Takes keys handed over by another shard, and makes the checkpoint agree before
    /// acknowledging.
    pub(super) async fn move_in(
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
}
