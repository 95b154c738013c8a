//! A replicated job's shards watched: the coordinator asks every shard the map places keys on
//! whether it is there, several times a second, and promotes the backups of one found dead.
//!
//! A shard is found dead in one of two ways: silent for [`SILENT`] and its host answers a
//! datagram to its address with "port unreachable" (its process is gone; the probe of
//! `probe.rs`, which a live process, stopped or busy, never causes), or silent for
//! [`DEAD_AFTER`] (its machine lost, or cut off). Its ranges then go to their first backups
//! and its copies are dropped, in a map published at a fresh epoch like a resharding's: made
//! durable, then sent to every shard in it. A shard wrongly taken for dead loses its ranges
//! but acknowledges nothing more: its pushes need its backups' acknowledgements, and the
//! promoted backup refuses them with the new map, which it then adopts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edl_shared::proto::{ErrorCode, MapEpoch, Parts, Request, Response, ShardId, ShardMap};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::CallError;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{Coordinator, probe, reshard};

/// How often each shard is asked.
const EVERY: Duration = Duration::from_millis(100);
/// How long one question may take.
const ASK: Duration = Duration::from_secs(1);
/// A shard silent this long is probed for its socket.
const SILENT: Duration = Duration::from_millis(250);
/// A shard silent this long is dead, its socket found gone or not.
pub const DEAD_AFTER: Duration = Duration::from_secs(3);
/// A shard silent for [`DEAD_AFTER`] is dead only if another shard answered within this
/// long.
const HEARD: Duration = Duration::from_secs(1);
/// How long a shard a primary could not reach, or whose seeding failed, is not picked for a
/// new backup (a cut link heals in its own time; meanwhile other shards are tried).
const AVOID: Duration = Duration::from_secs(30);

impl Coordinator {
    /// Watches the shards of a replicated job until `stop`, promoting the backups of those
    /// found dead, and seeding new backups (one range at a time) where a range has fewer
    /// copies than the job keeps, on shards that answer. (`edl-ps coordinator` runs it for a
    /// replicated job; the simulation runs it on its coordinators, whose addresses are not
    /// sockets: there only silence finds a shard dead.)
    pub async fn watch_shards(self: &Arc<Self>, stop: CancellationToken) {
        let Some(caller) = self.caller.get().cloned() else {
            return;
        };
        let mut heard: HashMap<ShardId, Instant> = HashMap::new();
        let mut answered: HashMap<ShardId, Instant> = HashMap::new();
        let mut seeding: Option<tokio::task::JoinHandle<()>> = None;
        // Questions in flight, per shard: a new one every tick even while older ones wait (up
        // to `ASK / EVERY`), so that what is known of a shard is never older than a tick once
        // it answers again (one question at a time, a question sent while the coordinator was
        // cut off would hide for its whole timeout that the shard answers again).
        let mut asking: HashMap<ShardId, u32> = HashMap::new();
        let most = (ASK.as_millis() / EVERY.as_millis()).max(1) as u32;
        // Shards the map does not place that still held copies, and the epoch sent to them.
        let mut told: HashMap<ShardId, MapEpoch> = HashMap::new();
        let mut answers = tokio::task::JoinSet::new();
        let mut prober = probe::Prober::<ShardId>::default();
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_tick = Instant::now();
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let Some(map) = self.lock().map() else {
                continue;
            };
            let now = Instant::now();
            // A coordinator that did not run for half of DEAD_AFTER (stopped, starved) heard
            // no shard meanwhile: a shard's silence is measured only while it runs.
            let gap = now.saturating_duration_since(last_tick);
            last_tick = now;
            if gap > DEAD_AFTER / 2 {
                warn!(
                    "the coordinator did not run for {:.1} s: the shards' silence counts again \
                     from now",
                    gap.as_secs_f64()
                );
                for t in heard.values_mut() {
                    *t = (*t).max(now);
                }
            }
            let mut stale = Vec::new();
            while let Some(Ok((id, at, answer))) = answers.try_join_next() {
                if let Some(n) = asking.get_mut(&id) {
                    *n = n.saturating_sub(1);
                }
                if let Some(holds) = answer {
                    heard.insert(id, at);
                    answered.insert(id, at);
                    // One replaced (taken for dead while cut off, say) learns that it was:
                    // it drops its copies and serves nothing stale.
                    if holds && !map.places(id) && told.get(&id) != Some(&map.epoch) {
                        stale.push(id);
                    }
                }
            }
            let placed: Vec<(ShardId, String)> = map
                .shards
                .iter()
                .filter(|s| map.places(s.id))
                .map(|s| (s.id, s.addr.clone()))
                .collect();
            // Standby shards are asked too: one that answers can take a new backup.
            let live = self.lock().live_shards();
            let stale: Vec<(ShardId, String)> = live
                .iter()
                .filter(|(id, _)| stale.contains(id))
                .cloned()
                .collect();
            // As every map sent, only once it is durable (a deposed coordinator sends none).
            if !stale.is_empty() && self.durable().await {
                for (id, _) in &stale {
                    info!(shard = %id, epoch = %map.epoch, "a shard the map does not place \
                        holds copies: sending it the map");
                    told.insert(*id, map.epoch);
                }
                reshard::announce(&caller, &map, stale, &[], self.term());
            }
            heard.retain(|id, _| placed.iter().any(|(p, _)| p == id));
            for (id, addr) in &live {
                if placed.iter().any(|(p, _)| p == id) {
                    heard.entry(*id).or_insert(now);
                }
                let pending = asking.entry(*id).or_default();
                if *pending < most {
                    *pending += 1;
                    let (caller, id, addr) = (caller.clone(), *id, addr.clone());
                    answers.spawn(async move {
                        let ask = caller.call(&addr, Request::ShardStats, Parts::default());
                        let answered = match tokio::time::timeout(ASK, ask).await {
                            Ok(Ok(Response::ShardStats(s))) => {
                                Some(!s.ranges.is_empty() || !s.backups.is_empty())
                            }
                            // Any answer is an answer: the process is there.
                            Ok(Ok(_) | Err(CallError::Remote { .. })) => Some(false),
                            _ => None,
                        };
                        (id, Instant::now(), answered)
                    });
                }
            }
            let silent = |after: Duration| {
                placed
                    .iter()
                    .filter(|(id, _)| heard.get(id).is_some_and(|t| now - *t >= after))
                    .cloned()
                    .collect::<Vec<_>>()
            };
            let quiet = silent(SILENT);
            let mut dead: Vec<(ShardId, String)> = prober
                .check(&quiet)
                .into_iter()
                .map(|(id, addr)| (id, format!("its socket at {addr} is gone")))
                .collect();
            // Silence alone condemns a shard only while another shard is heard: when none
            // is, the coordinator is the one cut off (a blip of its own network must not
            // take every shard for dead).
            let others_heard = |id: ShardId| {
                answered
                    .iter()
                    .any(|(o, t)| *o != id && now.saturating_duration_since(*t) < HEARD)
            };
            for (id, _) in silent(DEAD_AFTER) {
                if !dead.iter().any(|(d, _)| *d == id) && others_heard(id) {
                    dead.push((id, format!("silent for {DEAD_AFTER:?}")));
                }
            }
            *self.silent.lock().unwrap_or_else(|p| p.into_inner()) =
                quiet.into_iter().map(|(id, _)| id).collect();
            // A dead shard the map still places (a key whose backups are silent too stays on
            // it) stays silent to the watch: its backups take its place once they answer.
            for (id, why) in dead {
                self.promote(id, &why, true).await;
            }
            if seeding.as_ref().is_none_or(|s| s.is_finished()) {
                let avoid = self.avoided(now);
                let up: Vec<ShardId> = answered
                    .iter()
                    .filter(|(id, t)| {
                        now.saturating_duration_since(**t) < SILENT * 4 && !avoid.contains(id)
                    })
                    .map(|(id, _)| *id)
                    .collect();
                let short = self.lock().under_replicated(&up);
                seeding = short.map(|(start, end, to)| {
                    let c = self.clone();
                    tokio::spawn(async move { c.seed_backup(start, end, to).await })
                });
            }
        }
    }

    /// Seeds a new backup of keys `[start, end)` on shard `to`: the map that lists it is made
    /// durable and sent to their primary with the order to copy them (`CopyOut`); once `to`
    /// holds the copy the map is published to the other shards. If the seeding fails, or a
    /// shard died meanwhile, the current map is published again at a fresh epoch, over the one
    /// the primary adopted.
    async fn seed_backup(&self, start: u64, end: u64, to: ShardId) {
        let Some(caller) = self.caller.get().cloned() else {
            return;
        };
        let t0 = Instant::now();
        let (map, primary) = {
            let mut st = self.lock();
            let Some(primary) = st
                .map()
                .and_then(|m| m.owner(edl_shared::proto::Key(start)))
                .and_then(|p| st.live_shards().into_iter().find(|(id, _)| *id == p))
            else {
                return;
            };
            match st.begin_copy(start, end, to) {
                Ok(map) => (map, primary),
                Err((_, e)) => {
                    warn!(error = %e, "cannot seed a new backup");
                    return;
                }
            }
        };
        self.bump();
        if !self.durable().await {
            return;
        }
        info!(start, end, %to, from = %primary.0, epoch = %map.epoch,
            "seeding a new backup");
        let req = Request::CopyOut {
            start,
            end,
            to,
            map: map.clone(),
            term: self.term(),
        };
        let answer = caller.call(&primary.1, req, Parts::default()).await;
        let seeded = match &answer {
            Ok(Response::Moved(report)) => {
                let done = self.lock().commit_copy(map.clone());
                if done {
                    info!(start, end, %to, bytes = report.bytes, millis = report.millis,
                        handed_ms = report.hold_ms,
                        total_ms = t0.elapsed().as_secs_f64() * 1000.0, "backup seeded");
                }
                done
            }
            Ok(other) => {
                warn!(answer = ?other, "unexpected answer to a seeding");
                false
            }
            Err(e) => {
                warn!(start, end, %to, error = %e, "seeding a new backup failed");
                // Not reaching the new backup (not a refusal of the primary's) keeps it from
                // being picked for a while.
                if e.code() == Some(ErrorCode::Internal) {
                    self.avoid(to);
                }
                false
            }
        };
        let (map, skip) = if seeded {
            (map, vec![primary.0, to])
        } else {
            match self.lock().republish() {
                Some(m) => (m, Vec::new()),
                None => return,
            }
        };
        self.bump();
        if !self.durable().await {
            return;
        }
        let shards = self.lock().placed_shards(&map);
        reshard::announce(&caller, &map, shards, &skip, self.term());
    }

    /// The shard that sent `peer`'s request, a primary, cannot reach its backup `backup`:
    /// publishes the map without `backup` as the backup of its ranges (made durable first).
    /// The two may both be alive (their link cut): the primary then goes on alone, and the
    /// ranges get a new backup seeded as soon as a shard can take it.
    pub(super) async fn backup_lost(&self, peer: &edl_shared::Peer, backup: ShardId) -> Response {
        let Some(caller) = self.caller.get().cloned() else {
            return Response::error(ErrorCode::NotReady, "the coordinator has no shard link yet");
        };
        let (from, map, shards) = {
            let mut st = self.lock();
            let from = match st.resolve_shard(&peer.name) {
                Ok(id) => id,
                Err((code, msg)) => return Response::error(code, msg),
            };
            let Some(map) = st.drop_backup(from, backup) else {
                return Response::Ack;
            };
            // The dropped backup learns it too: it drops its copies.
            let mut shards = st.placed_shards(&map);
            if !map.places(backup) {
                shards.extend(st.live_shards().into_iter().filter(|(id, _)| *id == backup));
            }
            (from, map, shards)
        };
        self.bump();
        if !self.durable().await {
            return Response::NotLeader { leader: None };
        }
        self.avoid(backup);
        warn!(primary = %from, %backup, epoch = %map.epoch, "the primary cannot reach its \
            backup: dropped as the backup of its ranges");
        reshard::announce(&caller, &map, shards, &[], self.term());
        Response::Ack
    }

    /// A shard of a replicated job that the map places joined again: its process restarted,
    /// so the copies it held are gone (a checkpoint is older than its backups' copies). If
    /// every range it is the primary of has a backup, it is replaced by its backups as a dead
    /// shard is, and rejoins as a standby; a range of which it held the only copy stays on it
    /// (it restores what its checkpoint holds).
    pub(super) async fn restarted(&self, id: ShardId) {
        let backed = {
            let st = self.lock();
            let replicated = st.job().replicas > 1;
            let Some(map) = st.map().filter(|m| replicated && m.places(id)) else {
                return;
            };
            map.ranges_of(id).all(|r| {
                map.backups_of(edl_shared::proto::Key(r.start))
                    .next()
                    .is_some()
            })
        };
        if !backed {
            warn!(shard = %id, "a restarted shard held the only copy of some keys: it restores \
                them from its checkpoint");
            return;
        }
        // Any backup, silent or not, is better than a checkpoint of what it held.
        self.promote(id, "it restarted: its copies are gone", false)
            .await;
    }

    /// Picks no new backups on `shard` for a while ([`AVOID`]).
    fn avoid(&self, shard: ShardId) {
        let mut avoid = self.avoid.lock().unwrap_or_else(|p| p.into_inner());
        avoid.insert(shard, Instant::now() + AVOID);
    }

    /// The shards not to seed new backups on at `now`.
    fn avoided(&self, now: Instant) -> Vec<ShardId> {
        let mut avoid = self.avoid.lock().unwrap_or_else(|p| p.into_inner());
        avoid.retain(|_, until| *until > now);
        avoid.keys().copied().collect()
    }

    /// Replaces the dead shard `dead` by its backups: publishes the map without it (made
    /// durable first) and sends it to the shards in it. With `wary` (`dead` may be only cut
    /// off), a key's backup silent now does not take its place (it may be dead too: the key
    /// stays on `dead`, whose copy may be the last). The published map, if it changed anything.
    pub(super) async fn promote(&self, dead: ShardId, why: &str, wary: bool) -> Option<ShardMap> {
        let caller = self.caller.get().cloned()?;
        let t0 = Instant::now();
        let avoid: Vec<ShardId> = match wary {
            true => self
                .silent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            false => Vec::new(),
        };
        let (map, shards) = {
            let mut st = self.lock();
            let map = st.promote(dead, &avoid)?;
            let shards = st.placed_shards(&map);
            (map, shards)
        };
        self.bump();
        if !self.durable().await {
            return None;
        }
        warn!(shard = %dead, epoch = %map.epoch, "shard declared dead ({why}): its backups \
            take its place");
        let orphaned: Vec<_> = map.ranges_of(dead).map(|r| (r.start, r.end)).collect();
        if !orphaned.is_empty() {
            warn!(shard = %dead, ranges = ?orphaned, "these keys had no live backup: they wait \
                for the shard to come back");
        }
        reshard::announce(&caller, &map, shards, &[dead], self.term());
        info!(epoch = %map.epoch, millis = t0.elapsed().as_secs_f64() * 1000.0,
            "map without the dead shard published");
        Some(map)
    }
}
