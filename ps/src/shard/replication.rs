//! Copies of key ranges: what a primary keeps of its pushes until its backups hold them,
//! the forwards to the backups, a new backup's seeding, and a backup's view of its copies.

use super::*;

/// The most payload bytes a new backup keeps for the copy it waits for; past it, a forwarded
/// push waits for the copy instead of being kept.
pub(super) const KEPT_BYTES: u64 = 1 << 30;

/// A forwarded push a new backup keeps until the copy of its keys arrives.
#[derive(Debug)]
pub struct Kept {
    pub(super) epoch: MapEpoch,
    pub(super) worker: WorkerId,
    pub(super) clock: Clock,
    pub(super) chunks: Vec<ChunkRef>,
    pub(super) payload: Vec<Bytes>,
    pub(super) span: Option<DataSpan>,
    pub(super) covers: Vec<KeyRange>,
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

    pub(super) fn as_ref(&self) -> PushRef<'_> {
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

    pub(super) fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        let covered = self.covers.iter().flat_map(|r| (r.start..r.end).map(Key));
        self.chunks.iter().map(|c| c.key).chain(covered)
    }

    pub(super) fn bytes(&self) -> u64 {
        self.payload.iter().map(|p| p.len() as u64).sum()
    }
}

/// The byte ranges `ranges` (in order, not overlapping) of a payload that lies in `parts`, as
/// slices of those parts.
pub(super) fn slices(parts: &[Bytes], ranges: &[(usize, usize)]) -> Vec<Bytes> {
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
    pub(super) shard: ShardId,
    /// Its address in the map the push was planned with.
    pub(super) addr: String,
    /// The keys it holds copies of that the push names (chunks and covered keys).
    pub(super) keys: Vec<Key>,
    /// The `Replicate` request and its payload.
    pub(super) req: Request,
    pub(super) payload: Parts,
}

/// How long a primary keeps offering a push to a backup that refuses it for keys it does not
/// hold (a backup behind the map, or one the coordinator is about to drop) before it gives up
/// on the push.
pub(super) const BACKUP_REFUSALS: Duration = Duration::from_secs(30);

/// Hands `fwd` to its backup until it acknowledges it, or until this shard's map no longer
/// lists it as a backup of the keys (the coordinator dropped a dead or cut-off backup: the
/// push does not wait for it). Refused if the map no longer makes this shard their primary
/// (it learned from a backup that another shard was promoted in its place).
/// A backup that has not acknowledged a push this long after it was first offered is
/// reported to the coordinator as lost (see [`Request::BackupLost`]).
pub(super) const BACKUP_LOST_AFTER: Duration = Duration::from_secs(5);

pub(super) async fn forward(
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
pub(super) async fn report_lost(
    link: &dyn ShardLink,
    coordinator: &str,
    me: ShardId,
    backup: ShardId,
) {
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

impl ShardState {
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
}

impl ShardService {
    /// Seeds a new backup of keys `[start, end)` on shard `to`, which `map` lists: copies them
    /// under the gate (adopting `map`, so pushes from then on are forwarded to `to`) and hands
    /// the copy to `to`, which takes it before it applies them. Answered once `to` took it,
    /// or with an error (the coordinator then publishes a map without `to` as their backup).
    pub(super) async fn copy_out(
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
    pub(super) async fn hand_copy(
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

    /// Applies a worker's push here and, in a replicated job, hands it to the backups of its
    /// keys at the same time; acknowledged once it is applied here and every backup the map
    /// lists acknowledged it (see [`forward`]). A push found already applied here is still
    /// handed to the backups, which may not have it yet.
    pub(super) async fn push_replicated(
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
}
