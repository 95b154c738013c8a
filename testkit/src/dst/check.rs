//! The checks: the consistency model at every grant, the maps, the batches acknowledged
//! against what each copy holds, and the job's end.

use super::*;

impl Sim {
    /// What must hold after every step: map epochs only grow, through coordinator restarts
    /// too; no two nodes hold different maps of one epoch; no key was applied a batch twice.
    pub(super) fn check_now(&mut self) -> Result<(), String> {
        // Every answer waited for its changes to be durable: a restarted coordinator never
        // meets a report of something it acknowledged and forgot.
        let lost = self.coordinator.inspect(|st| st.lost_acks());
        if lost > 0 {
            return Err(format!(
                "durability: {lost} acknowledged changes were missing after a restart"
            ));
        }
        // A leader cut off from the store (`--failover`) holds in memory what it could not
        // write; nobody learns it (maps go out only once durable), and the standby that
        // takes over never had it: the maps that count are the leader's while it can write.
        let cut_off = self.failover && self.down_until.is_some();
        if let Some(map) = self.coordinator.inspect(|st| st.map()).filter(|_| !cut_off) {
            if map.epoch < self.map.epoch {
                return Err(format!(
                    "map epochs: the coordinator went back from {} to {}",
                    self.map.epoch, map.epoch
                ));
            }
            self.saw_map(&map)?;
            if map.epoch > self.map.epoch {
                let runs = |rs: &[edl_proto::job::RangeOwner]| {
                    rs.iter()
                        .map(|r| format!("{}..{} s{}", r.start, r.end, r.shard.0))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                self.note(format!(
                    "the coordinator's map {}: {}; backups {}",
                    map.epoch,
                    runs(&map.ranges),
                    runs(&map.backups)
                ));
            }
            if self.replicated() && map.epoch > self.map.epoch {
                let dropped = (self.map.shards.iter())
                    .filter(|s| self.map.places(s.id) && !map.places(s.id))
                    .count();
                self.promotions += dropped as u32;
                let backed = |m: &ShardMap| m.backups.iter().map(|r| r.end - r.start).sum::<u64>();
                if backed(&map) > backed(&self.map) {
                    self.seedings += 1;
                }
            }
            self.map = map;
        }
        for s in 0..self.shards.len() {
            let map = self.shards[s].state.read_map();
            self.saw_map(&map)?;
        }
        let (twice, notes) = {
            let mut d = lock_disk(&self.disk);
            // A copy dropped outside the shard's served requests (a primary's forward that
            // learnt a newer map from its backup) is forgotten too.
            let shards = &self.shards;
            d.copies.retain(|(s, k), _| {
                let st = &shards[*s].state;
                st.param(*k, 0).is_some() || st.backup_param(*k, 0).is_some()
            });
            (d.twice.take(), std::mem::take(&mut d.notes))
        };
        for line in notes {
            self.note(line);
        }
        match twice {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records a map some node adopted: one map per epoch.
    pub(super) fn saw_map(&mut self, map: &ShardMap) -> Result<(), String> {
        match self.maps.get(&map.epoch) {
            Some(known) if known != map => Err(format!(
                "maps: two different maps of epoch {}: {known:?} and {map:?}",
                map.epoch
            )),
            Some(_) => Ok(()),
            None => {
                self.maps.insert(map.epoch, map.clone());
                Ok(())
            }
        }
    }

    /// The consistency model, checked from the workers' side: no worker the coordinator
    /// counts (registered, active, holding data) has sent a clock below `clock - s` when
    /// worker `slot` is granted `clock`. The coordinator knows no clock of a worker above the
    /// last it sent, so a worker behind that bound means a grant the model forbids, whatever
    /// clock the coordinator answered with.
    pub(super) fn check_grant(&self, slot: usize, clock: Clock, s: u64) -> Result<(), String> {
        let now = edl_shared::clock::now();
        // By id and name: a restarted coordinator may hand an id out again.
        let active: BTreeSet<(WorkerId, String)> = self.coordinator.inspect(|st| {
            st.members(now)
                .into_iter()
                .filter(|m| m.state == edl_proto::msg::WorkerState::Active)
                .map(|m| (m.id, m.name))
                .collect()
        });
        for (other, w) in self.workers.iter().enumerate() {
            let counting = other != slot
                && matches!(w.phase, Phase::Pushing | Phase::Committing)
                && w.id
                    .is_some_and(|id| active.contains(&(id, format!("w{other}"))));
            let sent = w.clock.0 + u64::from(w.phase == Phase::Committing);
            if counting && sent + s < clock.0 {
                return Err(format!(
                    "consistency: w{slot} granted clock {} while w{other} has sent no clock past \
                     {sent}, {}",
                    clock.0, self.scenario.consistency
                ));
            }
        }
        Ok(())
    }

    /// Whether the job runs BSP (only with real clients: they pull each step).
    pub(super) fn bsp(&self) -> bool {
        self.scenario.consistency == Consistency::Bsp
    }

    /// An acknowledged push: every key of it holds its batch (applied now or before), unless a
    /// shard crash lost it since.
    pub(super) fn acknowledged(
        &mut self,
        s: usize,
        id: WorkerId,
        span: DataSpan,
        keys: &[Key],
    ) -> Result<(), String> {
        // Under BSP an acknowledged push is staged, applied at its step's first pull.
        if self.bsp() {
            return Ok(());
        }
        if self.replicated() {
            return self.acknowledged_by_copies(s, id, span, keys);
        }
        let batch = (span.epoch, span.start);
        let d = lock_disk(&self.disk);
        let lost: Vec<Key> = (keys.iter())
            .filter(|k| !d.model.get(k).is_some_and(|b| b.contains(&batch)))
            .copied()
            .collect();
        drop(d);
        if !lost.is_empty() {
            let what = format!(
                "shard {s} acknowledged {id}'s {span:?} for {lost:?}, which do not hold it"
            );
            if self.shard_crashes == 0 {
                return Err(format!("exactly-once: {what}"));
            }
            self.note(format!("{what} (lost with a crash)"));
        }
        Ok(())
    }

    /// A replicated job's acknowledged push: the primary's copy of every key of it holds its
    /// batch, and so does every backup copy its map lists (whose batches are known, that keeps
    /// no push for a copy on its way: it may be one of them, and whose map is as new as the
    /// primary's: an older one's copy may be a stale one a new copy is on its way to replace),
    /// crashes or not.
    pub(super) fn acknowledged_by_copies(
        &mut self,
        s: usize,
        id: WorkerId,
        span: DataSpan,
        keys: &[Key],
    ) -> Result<(), String> {
        let batch = (span.epoch, span.start);
        let map = self.shards[s].state.read_map();
        let d = lock_disk(&self.disk);
        for &k in keys {
            let copies =
                std::iter::once(s).chain((map.backups_of(k).map(|b| b.0 as usize)).filter(|b| {
                    let st = &self.shards[*b].state;
                    st.kept_pushes() == 0 && st.map_epoch() >= map.epoch
                }));
            for (n, on) in copies.enumerate() {
                if let Some(Some(held)) = d.copies.get(&(on, k))
                    && !held.contains(&batch)
                {
                    let copy = if n == 0 { "its copy" } else { "its backup's" };
                    return Err(format!(
                        "exactly-once: shard {s} acknowledged {id}'s {span:?}, but {copy} of {k} \
                         on shard {on} does not hold it"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The end: every sample of every epoch applied exactly once on every shard, and every
    /// counter float equal to the number of batches of the job.
    pub(super) fn check_end(&mut self) -> Result<(), String> {
        let epochs = self.coordinator.inspect(|st| st.job().epochs);
        let (samples, partition, batch) = self.scenario.data;
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = &shard.state;
            let report = shard.ledger_report();
            if shard.num_keys() == 0 {
                continue;
            }
            if report.len() != epochs as usize {
                return Err(format!("shard {s} reports {} epochs", report.len()));
            }
            for e in report {
                // A shard that crashed lost what it applied after its checkpoint (by design,
                // until replicas): then at most once.
                // With replicas it loses nothing.
                let exact = (e.applied, e.duplicates, e.missing) == (u64::from(samples), 0, 0);
                let at_most_once = e.duplicates == 0 && e.applied <= u64::from(samples);
                let lossy = self.shard_crashes > 0 && !self.replicated();
                if !exact && (!lossy || !at_most_once) {
                    return Err(format!("exactly-once: shard {s}, {e:?}"));
                }
            }
        }
        // Batches per epoch: every partition cut from its start (a re-issued one resumes at
        // a batch boundary, so the cut is the same).
        let mut per_epoch = 0u64;
        let mut start = 0;
        while start < samples {
            let len = partition.min(samples - start);
            per_epoch += u64::from(len.div_ceil(batch));
            start += len;
        }
        let want = (per_epoch * u64::from(epochs)) as f32;
        // Every key is held by one shard: the one the final map names.
        for c in &self.keys {
            let holders: Vec<usize> = (0..self.shards.len())
                .filter(|&s| self.shards[s].state.holds(std::iter::once(c.key)))
                .collect();
            let owner = self.map.owner(c.key).map(|o| o.0 as usize);
            if holders.len() != 1 || owner != holders.first().copied() {
                return Err(format!(
                    "placement: {} is held by shards {holders:?}, the map names {owner:?}",
                    c.key
                ));
            }
        }
        if self.replicated() {
            return self.check_copies(want);
        }
        let model = std::mem::take(&mut lock_disk(&self.disk).model);
        for (s, shard) in self.shards.iter().enumerate() {
            let mut chunks = shard.state.snapshot().chunks;
            chunks.sort_by_key(|c| c.key);
            for c in chunks {
                // The final state is part of the history's digest.
                for v in &c.params {
                    mix(&mut self.digest, &v.to_bits().to_le_bytes());
                }
                // Under BSP a counter counts the steps applied (a step's gradients are averaged
                // and applied when a pull asks for it), which the model does not follow: the
                // ledgers above account for the data.
                if self.bsp() {
                    continue;
                }
                // Each counter holds one per batch the model says the key holds: every batch of
                // the job, unless a shard crash lost some.
                let modelled = model.get(&Key(c.key)).map_or(0, BTreeSet::len) as f32;
                if self.shard_crashes == 0 && modelled != want {
                    return Err(format!(
                        "model: key {} was applied {modelled} batches, not {want}",
                        c.key
                    ));
                }
                if let Some(v) = c.params.iter().find(|v| **v != modelled) {
                    return Err(format!(
                        "counters: shard {s} key {} holds {v}, not {modelled} (one per batch \
                         applied to it and kept)",
                        c.key
                    ));
                }
            }
        }
        Ok(())
    }

    /// A replicated job's end: every key has its copies (as many as the job keeps, or as there
    /// are shards), each counter of every copy, primary and backup, holds one per batch of the
    /// job (under BSP: equals its primary's), and the model of each copy whose batches are known
    /// holds every batch.
    pub(super) fn check_copies(&mut self, want: f32) -> Result<(), String> {
        let copies = self.scenario.replicas.min(self.scenario.shards) as usize;
        let (bsp, mut digest) = (self.bsp(), self.digest);
        let disk = self.disk.clone();
        let d = lock_disk(&disk);
        for c in &self.keys {
            let Some(owner) = self.map.owner(c.key) else {
                return Err(format!("placement: {} has no primary", c.key));
            };
            let backups: Vec<ShardId> = self.map.backups_of(c.key).collect();
            if 1 + backups.len() != copies {
                return Err(format!(
                    "replicas: {} has a primary and {} backups at the end, not {copies} copies",
                    c.key,
                    backups.len()
                ));
            }
            let primary = &self.shards[owner.0 as usize].state;
            let value = |st: &ShardState, backup: bool, i: usize| {
                if backup {
                    st.backup_param(c.key, i)
                } else {
                    st.param(c.key, i)
                }
            };
            let wanted = |i: usize| {
                if bsp {
                    primary.param(c.key, i)
                } else {
                    Some(want)
                }
            };
            let on = std::iter::once((owner, false)).chain(backups.iter().map(|b| (*b, true)));
            for (shard, backup) in on {
                let st = &self.shards[shard.0 as usize].state;
                for i in 0..c.len as usize {
                    let v = value(st, backup, i);
                    mix(&mut digest, &v.unwrap_or(f32::NAN).to_bits().to_le_bytes());
                    if v.is_none() || v != wanted(i) {
                        let modelled = match d.copies.get(&(shard.0 as usize, c.key)) {
                            Some(Some(held)) => {
                                format!("the model of it holds {} batches", held.len())
                            }
                            Some(None) => "the model does not know its batches".into(),
                            None => "the model has no such copy".into(),
                        };
                        return Err(format!(
                            "counters: {} of shard {shard}'s {} copy of {} holds {v:?}, not {:?} \
                             ({modelled})",
                            i,
                            if backup { "backup" } else { "primary" },
                            c.key,
                            wanted(i)
                        ));
                    }
                }
                if bsp {
                    continue;
                }
                if let Some(Some(held)) = d.copies.get(&(shard.0 as usize, c.key))
                    && held.len() as f32 != want
                {
                    return Err(format!(
                        "model: shard {shard}'s copy of {} was applied {} batches, not {want}",
                        c.key,
                        held.len()
                    ));
                }
            }
        }
        self.digest = digest;
        Ok(())
    }
}
