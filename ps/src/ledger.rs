//! A shard's data ledger: which samples' gradients this shard has applied, per epoch.
//!
//! Every push that carries a [`DataSpan`] claims its span here before any chunk changes. Per
//! partition the ledger keeps the position up to which spans were applied; a span at or below
//! it was applied already (its worker died after pushing, and the coordinator re-issued the
//! uncommitted rest) and is skipped, so no sample's gradient is applied twice on this shard.
//! Independently of that rule, the ledger counts applications per sample position, which is
//! what a run reports as duplicates and misses. An epoch whose every sample was applied is
//! folded to its counts: its per-sample and per-partition records are freed, and any later
//! span of it is skipped (applying it would apply its samples twice), so a long run's ledger
//! stays the size of the epochs in progress.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use edl_shared::proto::msg::{DataSpan, EpochLedger};
use edl_shared::proto::{ErrorCode, JobConfig};

use crate::checkpoint::LedgerSnap;

/// What a push should do with its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// New samples: apply the push.
    Apply,
    /// Already applied here: acknowledge without applying.
    AlreadyApplied,
}

/// Per-epoch application counts and per-partition progress of one shard.
#[derive(Debug)]
pub struct DataLedger {
    epochs: u32,
    samples: u32,
    /// Samples per partition: partition `i` holds positions `[i * size, (i + 1) * size)`.
    partition_size: u32,
    /// Applied-up-to position per (epoch, partition).
    progress: HashMap<(u32, u32), u32>,
    /// Applications per sample position, per epoch (allocated on first use).
    counts: Vec<Vec<u8>>,
    /// Per epoch, the positions of `counts` applied at least once: the epoch folds when this
    /// reaches the sample count, without a pass over `counts` per push.
    covered: Vec<u32>,
    /// Spans skipped as already applied, per epoch.
    skipped: Vec<u64>,
    /// Per epoch, once every sample was applied: its duplicates (it is folded).
    folded: Vec<Option<u64>>,
}

impl DataLedger {
    /// An empty ledger for `job`.
    pub fn new(job: &JobConfig) -> Self {
        DataLedger {
            epochs: job.epochs,
            samples: job.train_samples,
            partition_size: job.partition_size.max(1),
            progress: HashMap::new(),
            counts: vec![Vec::new(); job.epochs as usize],
            covered: vec![0; job.epochs as usize],
            skipped: vec![0; job.epochs as usize],
            folded: vec![None; job.epochs as usize],
        }
    }

    /// Folds epoch `e` to its counts if every sample of it has been applied.
    fn fold_if_complete(&mut self, e: u32) {
        if self.covered[e as usize] < self.samples {
            return;
        }
        let counts = &self.counts[e as usize];
        let duplicates = counts.iter().filter(|&&c| c > 1).count() as u64;
        self.folded[e as usize] = Some(duplicates);
        self.counts[e as usize] = Vec::new();
        self.progress.retain(|(epoch, _), _| *epoch != e);
    }

    /// Checks a span without recording it.
    pub fn check(&self, span: &DataSpan) -> Result<Claim, (ErrorCode, String)> {
        if span.epoch >= self.epochs || span.start >= span.end || span.end > self.samples {
            return Err((
                ErrorCode::InvalidRequest,
                format!(
                    "span {}..{} of epoch {} is outside the job ({} epochs of {} samples)",
                    span.start, span.end, span.epoch, self.epochs, self.samples
                ),
            ));
        }
        // A span must lie in the partition it names, or the same sample could be claimed
        // under two partitions and applied twice.
        let first = u64::from(span.partition) * u64::from(self.partition_size);
        let last = first + u64::from(self.partition_size);
        if u64::from(span.start) < first || u64::from(span.end) > last {
            return Err((
                ErrorCode::InvalidRequest,
                format!(
                    "span {}..{} is outside partition {}/{} ({first}..{last})",
                    span.start, span.end, span.epoch, span.partition
                ),
            ));
        }
        if self.folded[span.epoch as usize].is_some() {
            return Ok(Claim::AlreadyApplied);
        }
        match self.progress.get(&(span.epoch, span.partition)) {
            Some(&done) if span.end <= done => Ok(Claim::AlreadyApplied),
            // A span that starts inside applied samples would apply some of them twice.
            Some(&done) if span.start < done => Err((
                ErrorCode::InvalidRequest,
                format!(
                    "span {}..{} overlaps partition {}/{}, applied up to {done}",
                    span.start, span.end, span.epoch, span.partition
                ),
            )),
            // A span past the applied position leaves a gap: this shard lost those samples'
            // updates (restored from an older checkpoint). They count as missing.
            _ => Ok(Claim::Apply),
        }
    }

    /// Checks a span and, if it is new, records it as applied.
    pub fn claim(&mut self, span: &DataSpan) -> Result<Claim, (ErrorCode, String)> {
        let claim = self.check(span)?;
        let e = span.epoch as usize;
        match claim {
            Claim::AlreadyApplied => self.skipped[e] += 1,
            Claim::Apply => {
                self.progress.insert((span.epoch, span.partition), span.end);
                let counts = &mut self.counts[e];
                if counts.is_empty() {
                    counts.resize(self.samples as usize, 0);
                }
                let mut fresh = 0;
                for c in &mut counts[span.start as usize..span.end as usize] {
                    fresh += u32::from(*c == 0);
                    *c = c.saturating_add(1);
                }
                self.covered[e] += fresh;
                self.fold_if_complete(span.epoch);
            }
        }
        Ok(claim)
    }

    /// The ledger's state, for a checkpoint.
    pub fn snapshot(&self) -> LedgerSnap {
        let mut progress: Vec<(u32, u32, u32)> = self
            .progress
            .iter()
            .map(|(&(e, p), &done)| (e, p, done))
            .collect();
        progress.sort_unstable();
        LedgerSnap {
            progress,
            counts: self.counts.clone(),
            skipped: self.skipped.clone(),
            folded: self
                .folded
                .iter()
                .enumerate()
                .filter_map(|(e, d)| d.map(|d| (e as u32, d)))
                .collect(),
        }
    }

    /// A ledger for `job` with the state of a checkpoint.
    pub fn restore(job: &JobConfig, snap: &LedgerSnap) -> Result<Self, String> {
        let mut l = DataLedger::new(job);
        if snap.counts.len() != l.counts.len()
            || snap.skipped.len() != l.skipped.len()
            || snap
                .counts
                .iter()
                .any(|c| !c.is_empty() && c.len() != job.train_samples as usize)
        {
            return Err("the checkpoint's data ledger does not fit the job".into());
        }
        l.counts = snap.counts.clone();
        l.covered = l
            .counts
            .iter()
            .map(|c| c.iter().filter(|&&n| n > 0).count() as u32)
            .collect();
        l.skipped = snap.skipped.clone();
        for &(e, duplicates) in &snap.folded {
            let slot = l
                .folded
                .get_mut(e as usize)
                .ok_or("the checkpoint's data ledger folds an epoch the job does not have")?;
            *slot = Some(duplicates);
        }
        l.progress = snap
            .progress
            .iter()
            .map(|&(e, p, done)| ((e, p), done))
            .collect();
        Ok(l)
    }

    /// The per-epoch account.
    pub fn report(&self) -> Vec<EpochLedger> {
        (0..self.epochs)
            .map(|epoch| {
                let skipped_pushes = self.skipped[epoch as usize];
                if let Some(duplicates) = self.folded[epoch as usize] {
                    return EpochLedger {
                        epoch,
                        applied: u64::from(self.samples),
                        duplicates,
                        missing: 0,
                        skipped_pushes,
                    };
                }
                let counts = &self.counts[epoch as usize];
                let applied = counts.iter().filter(|&&c| c >= 1).count() as u64;
                EpochLedger {
                    epoch,
                    applied,
                    duplicates: counts.iter().filter(|&&c| c > 1).count() as u64,
                    missing: u64::from(self.samples) - applied,
                    skipped_pushes,
                }
            })
            .collect()
    }
}

/// A shard's ledgers, one per *segment*: a set of keys that share one history of applied
/// spans. A shard starts with one segment for all its keys. When a key range moves to another
/// shard, the ledger of each segment it touches travels with it (a copy: the keys left behind
/// keep theirs), so the receiving shard knows exactly which spans its new keys have seen, and a
/// re-issued span is still skipped on those keys and only those.
#[derive(Debug)]
pub struct Ledgers {
    segments: BTreeMap<u32, DataLedger>,
    next: u32,
}

impl Ledgers {
    /// Segment 0, empty, for a shard that starts with keys; none for one that starts empty.
    pub fn new(job: &JobConfig, with_keys: bool) -> Self {
        let mut segments = BTreeMap::new();
        if with_keys {
            segments.insert(0, DataLedger::new(job));
        }
        Ledgers { segments, next: 1 }
    }

    /// Segments `0..n`, empty (a backup's: one per primary whose keys it copies).
    pub fn segments(job: &JobConfig, n: u32) -> Self {
        let segments = (0..n).map(|s| (s, DataLedger::new(job))).collect();
        Ledgers {
            segments,
            next: n.max(1),
        }
    }

    /// Checks `span` against every segment in `segs`, then, if none refuses it, claims it in
    /// each; per segment whether its keys apply the push.
    pub fn claim(
        &mut self,
        span: &DataSpan,
        segs: &BTreeSet<u32>,
    ) -> Result<BTreeMap<u32, Claim>, (ErrorCode, String)> {
        for s in segs {
            let Some(l) = self.segments.get(s) else {
                return Err((ErrorCode::Internal, format!("no ledger for segment {s}")));
            };
            l.check(span)?;
        }
        let mut out = BTreeMap::new();
        for s in segs {
            if let Some(l) = self.segments.get_mut(s) {
                out.insert(*s, l.claim(span)?);
            }
        }
        Ok(out)
    }

    /// Copies of the ledgers of `segs`, to travel with keys that move.
    pub fn export(&self, segs: &BTreeSet<u32>) -> Vec<(u32, LedgerSnap)> {
        segs.iter()
            .filter_map(|s| self.segments.get(s).map(|l| (*s, l.snapshot())))
            .collect()
    }

    /// Adds ledgers that arrived with moved keys, under fresh segment ids; returns the id each
    /// sender's segment has here.
    pub fn import(
        &mut self,
        job: &JobConfig,
        snaps: &[(u32, LedgerSnap)],
    ) -> Result<BTreeMap<u32, u32>, String> {
        let mut fresh = Vec::with_capacity(snaps.len());
        for (id, snap) in snaps {
            fresh.push((*id, DataLedger::restore(job, snap)?));
        }
        let mut ids = BTreeMap::new();
        for (theirs, l) in fresh {
            let mine = self.next;
            self.next += 1;
            self.segments.insert(mine, l);
            ids.insert(theirs, mine);
        }
        Ok(ids)
    }

    /// Drops the ledgers of segments no key uses any more.
    pub fn retain(&mut self, used: &BTreeSet<u32>) {
        self.segments.retain(|s, _| used.contains(s));
    }

    /// The segment ids in use.
    pub fn ids(&self) -> BTreeSet<u32> {
        self.segments.keys().copied().collect()
    }

    /// Every segment's state, for a checkpoint.
    pub fn snapshot(&self) -> Vec<(u32, LedgerSnap)> {
        self.segments
            .iter()
            .map(|(s, l)| (*s, l.snapshot()))
            .collect()
    }

    /// Ledgers with the state of a checkpoint.
    pub fn restore(job: &JobConfig, snaps: &[(u32, LedgerSnap)]) -> Result<Self, String> {
        let mut segments = BTreeMap::new();
        for (id, snap) in snaps {
            segments.insert(*id, DataLedger::restore(job, snap)?);
        }
        let next = segments.keys().next_back().map_or(0, |s| s + 1);
        Ok(Ledgers { segments, next })
    }

    /// The per-epoch account of the shard: for every epoch the worst over its segments (the
    /// fewest samples applied, the most duplicates and misses). Empty for a shard without keys.
    pub fn report(&self) -> Vec<EpochLedger> {
        let mut out: Vec<EpochLedger> = Vec::new();
        for l in self.segments.values() {
            for (i, e) in l.report().into_iter().enumerate() {
                match out.get_mut(i) {
                    None => out.push(e),
                    Some(w) => {
                        w.applied = w.applied.min(e.applied);
                        w.duplicates = w.duplicates.max(e.duplicates);
                        w.missing = w.missing.max(e.missing);
                        w.skipped_pushes = w.skipped_pushes.max(e.skipped_pushes);
                    }
                }
            }
        }
        out
    }
}

/// The worst case over the shards' ledgers of `epoch`: the fewest samples applied, the most
/// duplicates, misses and skipped pushes. A shard without an entry for it counts as having
/// applied none of its `train_samples`.
pub fn worst_case(
    ledgers: &[(edl_shared::proto::ShardId, Vec<EpochLedger>)],
    epoch: u32,
    train_samples: u32,
) -> EpochLedger {
    let none = EpochLedger {
        epoch,
        applied: 0,
        duplicates: 0,
        missing: u64::from(train_samples),
        skipped_pushes: 0,
    };
    let per_shard: Vec<EpochLedger> = ledgers
        .iter()
        .map(|(_, l)| {
            l.iter()
                .find(|x| x.epoch == epoch)
                .cloned()
                .unwrap_or_else(|| none.clone())
        })
        .collect();
    if per_shard.is_empty() {
        return none;
    }
    EpochLedger {
        epoch,
        applied: per_shard.iter().map(|l| l.applied).min().unwrap_or(0),
        duplicates: per_shard.iter().map(|l| l.duplicates).max().unwrap_or(0),
        missing: per_shard.iter().map(|l| l.missing).max().unwrap_or(0),
        skipped_pushes: per_shard
            .iter()
            .map(|l| l.skipped_pushes)
            .max()
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::{Consistency, ModelSection, OptimizerSpec};

    fn ledger() -> DataLedger {
        DataLedger::new(&job())
    }

    fn job() -> JobConfig {
        JobConfig {
            model: ModelSection::custom(),
            tensors: vec![],
            chunk_size: 1,
            optimizer: OptimizerSpec::sgd(1.0),
            optimizer_groups: Vec::new(),
            schedule: Default::default(),
            consistency: Consistency::Asp,
            batch_size: 2,
            epochs: 2,
            partition_size: 4,
            train_samples: 8,
            seed: 0,
            lease_ms: 1000,
            replicas: 1,
            wire: Default::default(),
            tensor_wires: Vec::new(),
            data: None,
        }
    }

    fn span(epoch: u32, partition: u32, start: u32, end: u32) -> DataSpan {
        DataSpan {
            epoch,
            partition,
            start,
            end,
        }
    }

    #[test]
    fn reissued_spans_are_skipped_and_gaps_refused() {
        let mut l = ledger();
        assert_eq!(l.claim(&span(0, 0, 0, 2)), Ok(Claim::Apply));
        assert_eq!(l.claim(&span(0, 0, 2, 4)), Ok(Claim::Apply));
        // The coordinator re-issued from 2 (the worker died before committing 2..4).
        assert_eq!(l.claim(&span(0, 0, 2, 4)), Ok(Claim::AlreadyApplied));
        assert!(l.claim(&span(0, 1, 4, 6)).is_ok());
        assert!(l.claim(&span(0, 1, 5, 7)).is_err(), "a misaligned overlap");
        assert!(l.claim(&span(2, 0, 0, 2)).is_err(), "no such epoch");
        assert!(l.claim(&span(0, 1, 6, 9)).is_err(), "past the data");
        // A gap (updates lost with a shard's state) is accepted and shows as missing.
        assert_eq!(l.claim(&span(0, 1, 7, 8)), Ok(Claim::Apply));
        let r = l.report();
        assert_eq!(r[0].applied, 7);
        assert_eq!(r[0].missing, 1);
        assert_eq!(r[0].duplicates, 0);
        assert_eq!(r[0].skipped_pushes, 1);
        assert_eq!(r[1].missing, 8);
    }

    #[test]
    fn a_complete_epoch_folds_to_its_counts_and_survives_a_checkpoint() {
        let mut l = ledger();
        for (p, start) in [(0, 0), (0, 2), (1, 4), (1, 6)] {
            assert_eq!(l.claim(&span(0, p, start, start + 2)), Ok(Claim::Apply));
        }
        // Every sample of epoch 0 applied: its per-sample and per-partition records are gone.
        assert!(l.counts[0].is_empty());
        assert!(l.progress.keys().all(|(e, _)| *e != 0));
        assert_eq!(l.folded[0], Some(0));
        // A late span of the folded epoch is skipped, not applied twice.
        assert_eq!(l.claim(&span(0, 1, 6, 8)), Ok(Claim::AlreadyApplied));
        assert_eq!(l.claim(&span(1, 0, 0, 2)), Ok(Claim::Apply));
        let want = l.report();
        assert_eq!(
            (
                want[0].applied,
                want[0].duplicates,
                want[0].missing,
                want[0].skipped_pushes
            ),
            (8, 0, 0, 1)
        );
        let back = DataLedger::restore(&job(), &l.snapshot()).expect("restore");
        assert_eq!(back.report(), want);
        assert_eq!(back.check(&span(0, 0, 0, 2)), Ok(Claim::AlreadyApplied));
    }
}
