//! The shard side of the coordinator's state: which shard servers the job has, and the plans
//! that reshape the shard map (add, remove, rebalance, move a range). Executing a plan is the
//! service layer's job (`coordinator/reshard.rs`): one move at a time, each publishing the
//! next map epoch through [`CoordinatorState::commit_move`].

use std::time::Instant;

use edl_shared::proto::ids::{Key, MapEpoch, ShardId};
use edl_shared::proto::msg::{MoveReport, ShardEntry, ShardRole};
use edl_shared::proto::{ErrorCode, ShardMap};

use super::{CoordinatorState, Refusal};

/// One planned move: keys `[start, end)` from one shard to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Move {
    /// First key.
    pub start: u64,
    /// One past the last key.
    pub end: u64,
    /// The shard that holds the keys.
    pub from: ShardId,
    /// The shard that takes them.
    pub to: ShardId,
}

impl Move {
    /// The report of this move done, published with map `epoch`, without the measurements a
    /// source makes (bytes and times are 0): a move found done after the fact.
    pub fn report(self, epoch: MapEpoch) -> MoveReport {
        MoveReport {
            t_ms: 0,
            start: self.start,
            end: self.end,
            from: self.from,
            to: self.to,
            epoch,
            bytes: 0,
            millis: 0.0,
            hold_ms: 0.0,
        }
    }
}

impl From<(u64, u64, ShardId, ShardId)> for Move {
    fn from((start, end, from, to): (u64, u64, ShardId, ShardId)) -> Self {
        Move {
            start,
            end,
            from,
            to,
        }
    }
}

fn not_ready() -> Refusal {
    (
        ErrorCode::NotReady,
        "the shard map is not formed yet".into(),
    )
}

fn invalid(msg: String) -> Refusal {
    (ErrorCode::InvalidRequest, msg)
}

impl CoordinatorState {
    fn formed(&self) -> Result<&ShardMap, Refusal> {
        self.map.as_ref().ok_or_else(not_ready)
    }

    /// Every shard server the job has had, with its role, in id order (ids follow names, not
    /// the order in which the shards happened to join).
    pub fn shard_list(&self) -> Vec<ShardEntry> {
        let mut list: Vec<ShardEntry> = self
            .shards
            .iter()
            .zip(&self.shard_names)
            .map(|(info, name)| {
                let in_map = self
                    .map
                    .as_ref()
                    .is_some_and(|m| m.ranges.iter().any(|r| r.shard == info.id));
                ShardEntry {
                    id: info.id,
                    name: name.clone(),
                    addr: info.addr.clone(),
                    role: if self.retired.contains(&info.id) {
                        ShardRole::Retired
                    } else if in_map {
                        ShardRole::Active
                    } else {
                        ShardRole::Standby
                    },
                }
            })
            .collect();
        list.sort_by_key(|e| e.id);
        list
    }

    /// The shard an operator named: by its name (`--name`, the name in its certificate),
    /// else by its address. Shard names are unique in a job, and a shard named `sN` has id
    /// `sN` unless that id was taken first, so the name is what operators use.
    pub fn resolve_shard(&self, name: &str) -> Result<ShardId, Refusal> {
        let by_name = self.shard_index(name).map(|i| self.shards[i].id);
        by_name
            .or_else(|| self.shards.iter().find(|s| s.addr == name).map(|s| s.id))
            .ok_or_else(|| {
                let known = self.shard_names.join(", ");
                invalid(format!(
                    "no shard named {name:?} has joined this job (shards: {known})"
                ))
            })
    }

    /// The id a newly joining shard named `name` gets: `N` for a name `sN` whose id is free,
    /// else one past the highest id in use (which leaves the low ids to the conventional
    /// names `s0`, `s1`, ... that may still join).
    pub(super) fn new_shard_id(&self, name: &str) -> ShardId {
        let taken = |id: u32| self.shards.iter().any(|s| s.id.0 == id);
        let wanted = name
            .strip_prefix('s')
            .filter(|n| !n.starts_with('0') || n.len() == 1)
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| !taken(*n));
        let next = self
            .shards
            .iter()
            .map(|s| s.id.0.saturating_add(1))
            .max()
            .unwrap_or(0)
            .max(self.shards_expected);
        ShardId(wanted.unwrap_or(next))
    }

    fn usable(&self, id: ShardId) -> Result<(), Refusal> {
        if !self.shards.iter().any(|s| s.id == id) {
            return Err(invalid(format!("no shard {id} has joined this job")));
        }
        if self.retired.contains(&id) {
            return Err(invalid(format!("{id} was removed from the job")));
        }
        Ok(())
    }

    /// The floats per key, the weight of a rebalance by size.
    pub fn key_sizes(&self) -> Vec<f64> {
        self.job
            .layout()
            .spans()
            .iter()
            .map(|s| f64::from(s.len))
            .collect()
    }

    /// Moves that give the standby shard `id` its share of the keys (by size).
    pub fn plan_add(&self, id: ShardId) -> Result<Vec<Move>, Refusal> {
        let map = self.formed()?;
        self.unreplicated()?;
        self.usable(id)?;
        let mut targets = map.owners_in_order();
        if targets.contains(&id) {
            return Err(invalid(format!("{id} already holds keys")));
        }
        targets.push(id);
        Ok(map
            .plan_balance(&targets, &self.key_sizes())
            .into_iter()
            .map(Move::from)
            .collect())
    }

    /// Moves that hand every key of `id` to the other active shards, rebalanced by size.
    pub fn plan_remove(&self, id: ShardId) -> Result<Vec<Move>, Refusal> {
        let map = self.formed()?;
        self.unreplicated()?;
        self.usable(id)?;
        let mut targets = map.owners_in_order();
        targets.retain(|s| *s != id);
        if targets.is_empty() {
            return Err(invalid(format!(
                "{id} is the only shard holding keys; add another first"
            )));
        }
        Ok(map
            .plan_balance(&targets, &self.key_sizes())
            .into_iter()
            .map(Move::from)
            .collect())
    }

    /// Moves that rebalance the keys over every shard of the job that is not retired (those
    /// that hold keys now, then the standby ones), by `weight` per key.
    pub fn plan_rebalance(&self, weight: &[f64]) -> Result<Vec<Move>, Refusal> {
        let map = self.formed()?;
        self.unreplicated()?;
        let mut targets = map.owners_in_order();
        for (id, _) in self.live_shards() {
            if !targets.contains(&id) {
                targets.push(id);
            }
        }
        Ok(map
            .plan_balance(&targets, weight)
            .into_iter()
            .map(Move::from)
            .collect())
    }

    /// Moves that bring keys `[start, end)` to `to`: one per current owner other than `to`.
    pub fn plan_move(&self, start: u64, end: u64, to: ShardId) -> Result<Vec<Move>, Refusal> {
        let map = self.formed()?;
        self.unreplicated()?;
        self.usable(to)?;
        if start >= end || end > map.num_keys() {
            return Err(invalid(format!(
                "keys {start}..{end} are not a range of this job's {} keys",
                map.num_keys()
            )));
        }
        Ok(map
            .ranges
            .iter()
            .filter(|r| r.shard != to)
            .filter_map(|r| {
                let (a, b) = (r.start.max(start), r.end.min(end));
                (a < b).then_some(Move {
                    start: a,
                    end: b,
                    from: r.shard,
                    to,
                })
            })
            .collect())
    }

    /// The map after `mv`, one epoch on; refused unless the current map places the whole
    /// range on `mv.from`.
    pub fn map_after(&self, mv: Move) -> Result<ShardMap, Refusal> {
        let map = self.formed()?;
        let whole = (mv.start..mv.end).all(|k| map.owner(Key(k)) == Some(mv.from));
        if mv.start >= mv.end || !whole {
            return Err(invalid(format!(
                "{} does not hold all of keys {}..{} (map {})",
                mv.from, mv.start, mv.end, map.epoch
            )));
        }
        let Some(to) = self.shards.iter().find(|s| s.id == mv.to) else {
            return Err(invalid(format!("no shard {} has joined this job", mv.to)));
        };
        Ok(map.with_move(mv.start, mv.end, to))
    }

    /// The map after `mv` at a fresh epoch, above every map this coordinator sent out before,
    /// recorded as sent: the source adopts it when it gives the range up, whether or not the
    /// move completes, so no later map may have its epoch.
    /// The move stays pending (in the durable state) until it is published or given up.
    pub fn begin_move(&mut self, mv: Move) -> Result<ShardMap, Refusal> {
        let map = self.issue(self.map_after(mv)?);
        self.pending = Some((mv, map.clone()));
        Ok(map)
    }

    /// The move under way, with its map, if one is: begun and neither published nor given up.
    pub fn pending_move(&self) -> Option<(Move, ShardMap)> {
        self.pending.clone()
    }

    /// Gives the pending move up: the current map stands.
    pub fn drop_pending(&mut self) {
        self.pending = None;
    }

    /// The pending move's placement at a fresh epoch: a move found done after all (its
    /// destination holds the range) is published with it, above any map sent since.
    pub fn pending_done(&mut self) -> Option<ShardMap> {
        let (_, map) = self.pending.clone()?;
        Some(self.issue(map))
    }

    /// After a move that did not happen: the current placement again, published at a fresh
    /// epoch, so that whoever adopted the move's map (the source refused requests with it
    /// while it held the range out) adopts this one over it.
    pub fn republish(&mut self) -> Option<ShardMap> {
        let map = self.issue(self.map.clone()?);
        self.map = Some(map.clone());
        Some(map)
    }

    /// `map` at an epoch above the current map's and every one issued before, recorded as
    /// issued.
    fn issue(&mut self, mut map: ShardMap) -> ShardMap {
        let current = self.map.as_ref().map_or(MapEpoch(0), |m| m.epoch);
        map.epoch = MapEpoch(current.max(self.issued).0 + 1);
        self.issued = map.epoch;
        map
    }

    /// Publishes the map a completed move produced, and records the move.
    pub fn commit_move(&mut self, map: ShardMap, mut report: MoveReport, began: Instant) {
        report.t_ms = self.ms(began);
        self.map = Some(map);
        self.pending = None;
        super::push_capped(
            &mut self.moves,
            report,
            super::MAX_MOVE_RECORDS,
            &mut self.dropped.2,
        );
    }

    /// A replicated job's shard `dead` was found dead: the map without it at a fresh epoch
    /// (each key it was the primary of goes to its first backup not in `avoid`, shards that
    /// may be dead too; its backup copies are dropped), published as the current map. `None`
    /// if that changes nothing.
    pub fn promote(&mut self, dead: ShardId, avoid: &[ShardId]) -> Option<ShardMap> {
        let map = self.map.as_ref()?.without(dead, avoid)?;
        let map = self.issue(map);
        self.map = Some(map.clone());
        Some(map)
    }

    /// A replicated job's first run of keys with fewer copies than the job keeps, and the shard
    /// to seed a new backup of it on: of the live shards (those in `live`) that hold no copy of
    /// it, the one holding the fewest keys (the lowest id among equals). `None` if every key
    /// has its copies, or no shard can take one.
    pub fn under_replicated(&self, live: &[ShardId]) -> Option<(u64, u64, ShardId)> {
        let map = self.map.as_ref()?;
        let want = self.job.replicas as usize;
        if want <= 1 || self.pending.is_some() {
            return None;
        }
        let copies = |k: u64| -> Vec<ShardId> {
            map.owner(Key(k))
                .into_iter()
                .chain(map.backups_of(Key(k)))
                .collect()
        };
        let n = map.num_keys();
        let short = (0..n).find(|k| copies(*k).len() < want)?;
        let holders = copies(short);
        let end = (short..n).find(|k| copies(*k) != holders).unwrap_or(n);
        let load = |s: ShardId| -> u64 {
            map.ranges
                .iter()
                .chain(&map.backups)
                .filter(|r| r.shard == s)
                .map(|r| r.end - r.start)
                .sum()
        };
        let to = live
            .iter()
            .copied()
            .filter(|s| !holders.contains(s) && !self.retired.contains(s))
            .min_by_key(|s| (load(*s), s.0))?;
        Some((short, end, to))
    }

    /// The map with `to` a new backup of keys `[start, end)`, at a fresh epoch recorded as
    /// issued (the primary adopts it when it copies the keys, whether or not the seeding
    /// completes).
    pub fn begin_copy(&mut self, start: u64, end: u64, to: ShardId) -> Result<ShardMap, Refusal> {
        let map = self.formed()?;
        let Some(info) = self.shards.iter().find(|s| s.id == to) else {
            return Err(invalid(format!("no shard {to} has joined this job")));
        };
        let map = map.with_backup(start, end, info);
        Ok(self.issue(map))
    }

    /// The primary `from` cannot reach its backup `backup`: the map without `backup` as the
    /// backup of `from`'s ranges, at a fresh epoch, published. `None` if it is the backup of
    /// none of them.
    pub fn drop_backup(&mut self, from: ShardId, backup: ShardId) -> Option<ShardMap> {
        let map = self.map.as_ref()?.without_backup(from, backup)?;
        let map = self.issue(map);
        self.map = Some(map.clone());
        Some(map)
    }

    /// Publishes the map of a completed seeding; false (nothing published) if a newer map
    /// was published meanwhile (a shard died during the seeding): the seeding is void.
    pub fn commit_copy(&mut self, map: ShardMap) -> bool {
        if self.map.as_ref().is_some_and(|m| m.epoch >= map.epoch) {
            return false;
        }
        self.map = Some(map);
        true
    }

    /// Refuses a resharding of a replicated job: moving a range with its backups is not
    /// supported yet.
    pub fn unreplicated(&self) -> Result<(), Refusal> {
        if self.job.replicas > 1 {
            return Err(invalid(format!(
                "this job keeps {} copies of every key range; moving ranges between shards \
                 (shard add, shard remove, reshard, move) is not supported for replicated jobs \
                 yet",
                self.job.replicas
            )));
        }
        Ok(())
    }

    /// Marks `id` removed from the job.
    pub fn retire_shard(&mut self, id: ShardId) {
        if !self.retired.contains(&id) {
            self.retired.push(id);
        }
    }

    /// The addresses of the shards that are not retired and that `map` places keys or copies
    /// on: those a map is sent to.
    pub fn placed_shards(&self, map: &ShardMap) -> Vec<(ShardId, String)> {
        let mut shards = self.live_shards();
        shards.retain(|(id, _)| map.places(*id));
        shards
    }

    /// The addresses of the shards that are not retired.
    pub fn live_shards(&self) -> Vec<(ShardId, String)> {
        self.shards
            .iter()
            .filter(|s| !self.retired.contains(&s.id))
            .map(|s| (s.id, s.addr.clone()))
            .collect()
    }
}
