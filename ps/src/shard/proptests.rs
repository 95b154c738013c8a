//! Property tests of the shard state: random sequences of pushes (valid and not) and pulls
//! under ASP and BSP with SGD, checked after every request against an exact model of the
//! parameters, the BSP staging and the data ledger.

use std::collections::BTreeMap;

use edl_shared::proto::job::{RangeOwner, ShardInfo};
use edl_shared::proto::{ModelSection, OptimizerSpec, TensorSpec};
use proptest::prelude::*;

use super::*;
use edl_shared::proto::frame::bytes_to_f32s;

/// Floats in the one tensor: keys of 4, 4 and 2 floats.
const FLOATS: u32 = 10;
const CHUNK: u32 = 4;
const NUM_KEYS: u64 = 3;
/// The shard under test holds keys 1 and 2; key 0 lives on another shard.
const HELD: std::ops::Range<u64> = 1..3;
const EPOCHS: u32 = 2;
const SAMPLES: u32 = 8;
const PARTITION: u32 = 4;
/// Whether the generated pulls include ones refused at a key after keys they could read (a
/// refused pull once applied due BSP steps to the keys before the refused one: see the
/// regression test `a_refused_pull_changes_nothing`).
const MIXED_REFUSED_PULLS: bool = true;

/// A counter job (zero init, SGD with lr 1) with data enough for a few partitions.
fn job(consistency: Consistency) -> JobConfig {
    JobConfig {
        model: ModelSection::custom(),
        tensors: vec![TensorSpec {
            name: "counter".into(),
            shape: vec![FLOATS],
            init: Init::Zeros,
        }],
        chunk_size: CHUNK,
        optimizer: OptimizerSpec::sgd(1.0),
        optimizer_groups: Vec::new(),
        schedule: Default::default(),
        consistency,
        batch_size: 1,
        epochs: EPOCHS,
        partition_size: PARTITION,
        train_samples: SAMPLES,
        seed: 0,
        lease_ms: 2000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
    }
}

fn map() -> ShardMap {
    let info = |i: u32| ShardInfo {
        id: ShardId(i),
        addr: format!("s{i}"),
    };
    ShardMap {
        backups: Vec::new(),
        epoch: MapEpoch(1),
        shards: vec![info(0), info(1)],
        ranges: vec![
            RangeOwner {
                start: 0,
                end: HELD.start,
                shard: ShardId(1),
            },
            RangeOwner {
                start: HELD.start,
                end: HELD.end,
                shard: ShardId(0),
            },
        ],
    }
}

/// The length a chunk reference claims, against its key's real length.
#[derive(Clone, Debug)]
enum Len {
    Right,
    Off(i8),
}

/// The gradient values of a push.
#[derive(Clone, Debug)]
enum Grads {
    /// -1 per float: each application adds 1 to every parameter.
    Counter,
    /// Small integers.
    Ints,
    /// Any finite floats of moderate size.
    Floats,
}

/// A clock relative to the applied BSP step of the keys involved, or any.
#[derive(Clone, Debug)]
enum ClockPick {
    Applied(i8),
    /// At least [`MAX_STAGED_AHEAD`] steps ahead.
    Far(u8),
    Raw(u64),
}

#[derive(Clone, Debug)]
enum SpanPick {
    None,
    /// Continues the partition where this shard's ledger has it.
    Next {
        partition: u32,
        len: u32,
    },
    /// Inside a partition, anywhere.
    Within {
        epoch: u32,
        partition: u32,
        from: u32,
        len: u32,
    },
    /// Any span at all, including ones outside their partition or the data.
    Raw(DataSpan),
}

#[derive(Clone, Debug)]
enum Op {
    Push {
        worker: u64,
        /// The map epoch the request was routed with (ignored by the shard).
        routed: u64,
        chunks: Vec<(u64, Len)>,
        /// Bytes added to (or taken from) the right payload length.
        extra: i8,
        grads: Grads,
        values: Vec<f32>,
        clock: ClockPick,
        span: SpanPick,
    },
    Pull {
        ranges: Vec<(u64, u64)>,
        through: ClockPick,
    },
    /// The shard restarts from a checkpoint of its state.
    Restart,
}

fn len_pick() -> impl Strategy<Value = Len> {
    prop_oneof![
        12 => Just(Len::Right),
        1 => prop_oneof![-2i8..0, 1i8..3].prop_map(Len::Off),
    ]
}

fn clock_pick() -> impl Strategy<Value = ClockPick> {
    // Raw clocks stay small; clocks near `u64::MAX` (where the staging bound once
    // overflowed) are the regression test `a_clock_near_the_largest_does_not_panic`.
    prop_oneof![
        12 => (-2i8..3).prop_map(ClockPick::Applied),
        1 => (0u8..4).prop_map(ClockPick::Far),
        1 => (0u64..40).prop_map(ClockPick::Raw),
    ]
}

fn span_pick(consistent: bool) -> BoxedStrategy<SpanPick> {
    let next = (0..SAMPLES / PARTITION, 1u32..4)
        .prop_map(|(partition, len)| SpanPick::Next { partition, len });
    let within = (0..EPOCHS, 0..SAMPLES / PARTITION, 0..PARTITION, 1u32..5).prop_map(
        |(epoch, partition, from, len)| SpanPick::Within {
            epoch,
            partition,
            from,
            len,
        },
    );
    let raw = (0u32..3, 0u32..4, 0u32..10, 0u32..10).prop_map(|(epoch, partition, start, end)| {
        SpanPick::Raw(DataSpan {
            epoch,
            partition,
            start,
            end,
        })
    });
    if consistent {
        prop_oneof![2 => Just(SpanPick::None), 6 => next, 2 => within].boxed()
    } else {
        prop_oneof![2 => Just(SpanPick::None), 6 => next, 2 => within, 2 => raw].boxed()
    }
}

fn push(grads: BoxedStrategy<Grads>, consistent: bool) -> impl Strategy<Value = Op> {
    let chunks = prop_oneof![
        1 => Just(Vec::new()),
        12 => prop::collection::vec(
            (prop_oneof![8 => HELD, 1 => 0..NUM_KEYS + 2], len_pick()),
            1..4,
        ),
    ];
    (
        (0u64..4, 0u64..4),
        chunks,
        prop_oneof![12 => Just(0i8), 1 => -6i8..7],
        grads,
        prop::collection::vec(-100f32..100f32, 16),
        clock_pick(),
        span_pick(consistent),
    )
        .prop_map(
            |((worker, routed), chunks, extra, grads, values, clock, span)| Op::Push {
                worker,
                routed,
                chunks,
                extra,
                grads,
                values,
                clock,
                span,
            },
        )
}

fn op(grads: BoxedStrategy<Grads>, consistent: bool) -> impl Strategy<Value = Op> {
    let range = prop_oneof![
        4 => (0..NUM_KEYS + 1, 0u64..3).prop_map(|(start, len)| (start, start + len)),
        1 => (0..NUM_KEYS + 2, 0..NUM_KEYS + 2),
    ];
    let ranges = prop::collection::vec(range, 0..3);
    prop_oneof![
        10 => push(grads, consistent),
        4 => (ranges, clock_pick()).prop_map(|(ranges, through)| Op::Pull { ranges, through }),
        1 => Just(Op::Restart),
    ]
}

fn any_grads() -> BoxedStrategy<Grads> {
    prop_oneof![Just(Grads::Counter), Just(Grads::Ints), Just(Grads::Floats)].boxed()
}

/// The ledger as the shard should keep it, one segment (no key moves here).
#[derive(Debug)]
struct LedgerModel {
    progress: BTreeMap<(u32, u32), u32>,
    counts: Vec<Vec<u32>>,
    folded: Vec<Option<u64>>,
    skipped: Vec<u64>,
}

impl LedgerModel {
    fn new() -> Self {
        LedgerModel {
            progress: BTreeMap::new(),
            counts: vec![vec![0; SAMPLES as usize]; EPOCHS as usize],
            folded: vec![None; EPOCHS as usize],
            skipped: vec![0; EPOCHS as usize],
        }
    }

    fn check(&self, s: &DataSpan) -> Result<Claim, ErrorCode> {
        if s.epoch >= EPOCHS || s.start >= s.end || s.end > SAMPLES {
            return Err(ErrorCode::InvalidRequest);
        }
        // A span must lie inside the partition it names.
        let first = s.partition * PARTITION;
        if s.start < first || s.end > first + PARTITION {
            return Err(ErrorCode::InvalidRequest);
        }
        if self.folded[s.epoch as usize].is_some() {
            return Ok(Claim::AlreadyApplied);
        }
        match self.progress.get(&(s.epoch, s.partition)) {
            Some(&done) if s.end <= done => Ok(Claim::AlreadyApplied),
            Some(&done) if s.start < done => Err(ErrorCode::InvalidRequest),
            _ => Ok(Claim::Apply),
        }
    }

    fn claim(&mut self, s: &DataSpan) {
        let e = s.epoch as usize;
        self.progress.insert((s.epoch, s.partition), s.end);
        for c in &mut self.counts[e][s.start as usize..s.end as usize] {
            *c += 1;
        }
        if self.counts[e].iter().all(|&c| c > 0) {
            self.folded[e] = Some(self.counts[e].iter().filter(|&&c| c > 1).count() as u64);
            self.progress.retain(|(epoch, _), _| *epoch != s.epoch);
        }
    }

    fn report(&self) -> Vec<EpochLedger> {
        (0..EPOCHS)
            .map(|epoch| {
                let e = epoch as usize;
                let counts = &self.counts[e];
                let (applied, duplicates) = match self.folded[e] {
                    Some(duplicates) => (u64::from(SAMPLES), duplicates),
                    None => (
                        counts.iter().filter(|&&c| c > 0).count() as u64,
                        counts.iter().filter(|&&c| c > 1).count() as u64,
                    ),
                };
                EpochLedger {
                    epoch,
                    applied,
                    duplicates,
                    missing: u64::from(SAMPLES) - applied,
                    skipped_pushes: self.skipped[e],
                }
            })
            .collect()
    }
}

/// One held key as the shard should have it.
#[derive(Debug, Clone)]
struct KeyModel {
    params: Vec<f32>,
    pending: BTreeMap<u64, (Vec<f32>, u32)>,
    through: u64,
    /// Applications of counter gradients (ASP only).
    touches: u64,
}

impl KeyModel {
    /// Applies the staged steps before `through`, in step order, as their mean.
    fn apply_due(&mut self, through: u64) {
        while let Some(entry) = self.pending.first_entry() {
            if *entry.key() >= through {
                break;
            }
            let (sum, n) = entry.remove();
            let k = 1.0 * (1.0 / n.max(1) as f32);
            for (p, g) in self.params.iter_mut().zip(&sum) {
                *p -= k * g;
            }
        }
        self.through = self.through.max(through);
    }
}

struct Harness {
    st: ShardState,
    job: JobConfig,
    bsp: bool,
    keys: BTreeMap<u64, KeyModel>,
    ledger: LedgerModel,
    /// Set once a push with other than counter gradients was applied.
    not_counter: bool,
}

/// A checkpoint with the load counters cleared.
fn without_load(mut snap: ShardCheckpoint) -> ShardCheckpoint {
    for c in &mut snap.chunks {
        c.load = 0;
    }
    snap
}

/// `payload` cut as QUIC might deliver it: parts of a length that varies with `seed`, most
/// starting at an address not aligned for f32, some cutting a value in two.
fn parts_of(payload: &[u8], seed: u64) -> Vec<Bytes> {
    skewed_parts(payload, 5 + (seed % 11) as usize * 3)
}

/// `payload` in parts of `size` bytes (the last shorter), each starting at an address one byte
/// later, modulo 4, than the last.
fn skewed_parts(payload: &[u8], size: usize) -> Vec<Bytes> {
    payload
        .chunks(size)
        .enumerate()
        .map(|(i, c)| {
            let skew = i % 4;
            let mut b = vec![0u8; skew];
            b.extend_from_slice(c);
            Bytes::from(b).slice(skew..)
        })
        .collect()
}

fn floats_of(payload: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; payload.len() / 4];
    bytes_to_f32s(payload, &mut out).expect("whole floats");
    out
}

impl Harness {
    fn new(consistency: Consistency) -> Self {
        let job = job(consistency);
        let st = ShardState::new(ShardId(0), job.clone(), map());
        let layout = job.layout();
        let keys = HELD
            .map(|k| {
                let len = layout.span(Key(k)).expect("a key of the job").len as usize;
                let model = KeyModel {
                    params: vec![0.0; len],
                    pending: BTreeMap::new(),
                    through: 0,
                    touches: 0,
                };
                (k, model)
            })
            .collect();
        Harness {
            st,
            job,
            bsp: consistency == Consistency::Bsp,
            keys,
            ledger: LedgerModel::new(),
            not_counter: false,
        }
    }

    fn len_of(&self, key: u64) -> u32 {
        self.job.layout().span(Key(key)).map_or(CHUNK, |s| s.len)
    }

    fn clock(&self, pick: &ClockPick, base: u64) -> u64 {
        match pick {
            ClockPick::Applied(off) => base.saturating_add_signed(i64::from(*off)),
            ClockPick::Far(k) => base + MAX_STAGED_AHEAD + u64::from(*k),
            ClockPick::Raw(c) => *c,
        }
    }

    fn span(&self, pick: &SpanPick) -> Option<DataSpan> {
        match *pick {
            SpanPick::None => None,
            SpanPick::Next { partition, len } => {
                let epoch = (0..EPOCHS)
                    .find(|e| self.ledger.folded[*e as usize].is_none())
                    .unwrap_or(0);
                let start = self
                    .ledger
                    .progress
                    .get(&(epoch, partition))
                    .copied()
                    .unwrap_or(partition * PARTITION);
                Some(DataSpan {
                    epoch,
                    partition,
                    start,
                    end: (start + len).min((partition + 1) * PARTITION),
                })
            }
            SpanPick::Within {
                epoch,
                partition,
                from,
                len,
            } => {
                let start = partition * PARTITION + from;
                Some(DataSpan {
                    epoch,
                    partition,
                    start,
                    end: (start + len).min((partition + 1) * PARTITION),
                })
            }
            SpanPick::Raw(span) => Some(span),
        }
    }

    /// What the shard should answer a push with.
    fn predict_push(
        &self,
        chunks: &[ChunkRef],
        bytes: usize,
        clock: u64,
        span: Option<&DataSpan>,
    ) -> Result<Claim, ErrorCode> {
        let total: u64 = chunks.iter().map(|c| u64::from(c.len)).sum();
        if total * 4 != bytes as u64 {
            return Err(ErrorCode::ShapeMismatch);
        }
        for c in chunks {
            let Some(key) = self.keys.get(&c.key.0) else {
                return Err(if c.key.0 >= NUM_KEYS {
                    ErrorCode::UnknownKey
                } else {
                    ErrorCode::StaleEpoch
                });
            };
            if key.params.len() != c.len as usize {
                return Err(ErrorCode::ShapeMismatch);
            }
            if self.bsp && clock < key.through {
                return Err(ErrorCode::StaleClock);
            }
            if self.bsp && clock >= key.through + MAX_STAGED_AHEAD {
                return Err(ErrorCode::InvalidRequest);
            }
        }
        match span {
            None => Ok(Claim::Apply),
            // Without chunks no ledger segment is involved: nothing to claim or to skip.
            Some(_) if chunks.is_empty() => Ok(Claim::AlreadyApplied),
            Some(span) => self.ledger.check(span),
        }
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Push {
                worker,
                routed,
                chunks,
                extra,
                grads,
                values,
                clock,
                span,
            } => {
                let chunks: Vec<ChunkRef> = chunks
                    .iter()
                    .map(|(key, len)| {
                        let right = self.len_of(*key);
                        let len = match len {
                            Len::Right => right,
                            Len::Off(d) => right.saturating_add_signed(i32::from(*d)),
                        };
                        ChunkRef::new(Key(*key), len)
                    })
                    .collect();
                let base = chunks
                    .iter()
                    .find_map(|c| self.keys.get(&c.key.0))
                    .map_or(0, |k| k.through);
                let clock = self.clock(clock, base);
                let total: usize = chunks.iter().map(|c| c.len as usize).sum();
                let values: Vec<f32> = (0..total + 2)
                    .map(|i| {
                        let v = values[i % values.len()];
                        match grads {
                            Grads::Counter => -1.0,
                            Grads::Ints => (v / 25.0).round(),
                            Grads::Floats => v,
                        }
                    })
                    .collect();
                let mut payload: Vec<u8> = values.iter().flat_map(|g| g.to_le_bytes()).collect();
                let bytes = (total * 4).saturating_add_signed(isize::from(*extra));
                payload.truncate(bytes);
                let span = self.span(span);
                self.push(
                    *worker,
                    *routed,
                    clock,
                    &chunks,
                    &payload,
                    span.as_ref(),
                    matches!(grads, Grads::Counter),
                );
            }
            Op::Pull { ranges, through } => {
                let ranges: Vec<KeyRange> = ranges
                    .iter()
                    .map(|&(start, end)| KeyRange { start, end })
                    .collect();
                let base = self.keys.values().map(|k| k.through).min().unwrap_or(0);
                let through = self.clock(through, base);
                self.pull(&ranges, through);
            }
            Op::Restart => {
                let snap = self.st.snapshot();
                self.st = ShardState::restore(ShardId(0), self.job.clone(), map(), snap)
                    .expect("restore");
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        worker: u64,
        routed: u64,
        clock: u64,
        chunks: &[ChunkRef],
        payload: &[u8],
        span: Option<&DataSpan>,
        counter: bool,
    ) {
        let want = self.predict_push(chunks, payload.len(), clock, span);
        let before = self.st.snapshot();
        let report = self.st.ledger_report();
        let got = self
            .st
            .push_covering(
                MapEpoch(routed),
                WorkerId(worker),
                Clock(clock),
                chunks,
                &parts_of(payload, clock),
                span,
                &[],
                0,
            )
            .map_err(|r| r.code);
        assert_eq!(got, want, "push of {chunks:?} at {clock} with {span:?}");
        match got {
            Err(_) => {
                assert_eq!(
                    self.st.snapshot(),
                    before,
                    "a refused push changed the state"
                );
                assert_eq!(self.st.ledger_report(), report);
            }
            Ok(Claim::AlreadyApplied) => {
                if let (Some(span), false) = (span, chunks.is_empty()) {
                    self.ledger.skipped[span.epoch as usize] += 1;
                }
            }
            Ok(Claim::Apply) => {
                if let Some(span) = span {
                    self.ledger.claim(span);
                }
                let grads = floats_of(payload);
                let mut offset = 0;
                for c in chunks {
                    let g = &grads[offset..offset + c.len as usize];
                    offset += c.len as usize;
                    let key = self.keys.get_mut(&c.key.0).expect("validated");
                    if self.bsp {
                        key.apply_due(clock);
                        let slot = key
                            .pending
                            .entry(clock)
                            .or_insert_with(|| (vec![0.0; g.len()], 0));
                        for (s, g) in slot.0.iter_mut().zip(g) {
                            *s += g;
                        }
                        slot.1 += 1;
                    } else {
                        for (p, g) in key.params.iter_mut().zip(g) {
                            *p -= 1.0 * g;
                        }
                        key.touches += 1;
                    }
                }
                self.not_counter |= !counter && !chunks.is_empty();
            }
        }
    }

    /// What the shard should answer a pull with: the keys it reads, or why it refuses.
    fn predict_pull(&self, ranges: &[KeyRange]) -> Result<Vec<u64>, (ErrorCode, bool)> {
        let mut count = 0;
        for r in ranges {
            if r.end < r.start || r.end > NUM_KEYS || count + (r.end - r.start) > NUM_KEYS {
                return Err((ErrorCode::UnknownKey, false));
            }
            count += r.end - r.start;
        }
        let keys: Vec<u64> = ranges.iter().flat_map(|r| r.start..r.end).collect();
        match keys.iter().position(|k| !self.keys.contains_key(k)) {
            // Whether keys before the refused one were read.
            Some(i) => Err((ErrorCode::StaleEpoch, i > 0)),
            None => Ok(keys),
        }
    }

    fn pull(&mut self, ranges: &[KeyRange], through: u64) {
        let want = self.predict_pull(ranges);
        if let Err((_, true)) = want
            && !MIXED_REFUSED_PULLS
        {
            return;
        }
        let before = self.st.snapshot();
        let got = self.st.pull(MapEpoch(1), ranges, Clock(through));
        match (got, want) {
            (Ok(frame), Ok(keys)) => {
                let mut expected = Vec::new();
                for k in &keys {
                    let key = self.keys.get_mut(k).expect("held");
                    if self.bsp {
                        key.apply_due(through);
                    }
                    expected.extend_from_slice(&key.params);
                }
                let Response::Pulled { chunks, .. } = &frame.msg else {
                    panic!("a pull answered {:?}", frame.msg);
                };
                let refs: Vec<(u64, u32)> = chunks.iter().map(|c| (c.key.0, c.len)).collect();
                let lens: Vec<(u64, u32)> = keys.iter().map(|k| (*k, self.len_of(*k))).collect();
                assert_eq!(refs, lens);
                assert_eq!(floats_of(&frame.payload.concat()), expected);
            }
            (Err(r), Err((code, _))) => {
                assert_eq!(r.code, code, "{}", r.message);
                assert_eq!(r.map.is_some(), code == ErrorCode::StaleEpoch);
                assert_eq!(
                    without_load(self.st.snapshot()),
                    without_load(before.clone()),
                    "a refused pull changed the parameters, the staging or the ledger"
                );
                assert_eq!(
                    self.st.snapshot(),
                    before,
                    "a refused pull changed the load"
                );
            }
            (got, want) => panic!("pull of {ranges:?}: got {got:?}, want {want:?}"),
        }
    }

    /// The invariants that hold between any two requests.
    fn check(&self) {
        let snap = self.st.snapshot();
        let held: Vec<u64> = snap.chunks.iter().map(|c| c.key).collect();
        assert_eq!(held, HELD.collect::<Vec<u64>>());
        for c in &snap.chunks {
            let key = &self.keys[&c.key];
            assert_eq!(c.params, key.params, "parameters of k{}", c.key);
            let pending: Vec<(u64, Vec<f32>, u32)> = key
                .pending
                .iter()
                .map(|(step, (sum, n))| (*step, sum.clone(), *n))
                .collect();
            // The model keeps no epochs (this job's schedule is constant).
            let staged: Vec<(u64, Vec<f32>, u32)> = c
                .pending
                .iter()
                .map(|(step, sum, n, _)| (*step, sum.clone(), *n))
                .collect();
            assert_eq!(staged, pending, "staging of k{}", c.key);
            assert_eq!(c.applied_through, key.through);
            // A push closes the steps before its own, so staging holds a step or two at most,
            // never one already applied nor one far ahead.
            assert!(c.pending.len() <= 2, "k{} stages {:?}", c.key, c.pending);
            for (step, ..) in &c.pending {
                assert!((c.applied_through..c.applied_through + MAX_STAGED_AHEAD).contains(step));
            }
            if !self.bsp && !self.not_counter {
                // The counter: each float counts the pushes applied to its key.
                assert!(c.params.iter().all(|p| *p == key.touches as f32));
            }
        }
        assert_eq!(self.st.ledger_report(), self.ledger.report());

        // A checkpoint brings the same state back.
        let restored = ShardState::restore(ShardId(0), self.job.clone(), map(), snap.clone())
            .expect("restore");
        assert_eq!(restored.snapshot(), snap);
        assert_eq!(restored.ledger_report(), self.st.ledger_report());
    }
}

fn run(consistency: Consistency, ops: &[Op]) -> Harness {
    let mut h = Harness::new(consistency);
    h.check();
    for op in ops {
        h.apply(op);
        h.check();
    }
    h
}

fn consistency() -> impl Strategy<Value = Consistency> {
    prop_oneof![Just(Consistency::Asp), Just(Consistency::Bsp)]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_pushes_and_pulls_keep_the_shard_invariants(
        consistency in consistency(),
        ops in prop::collection::vec(op(any_grads(), false), 1..60),
    ) {
        run(consistency, &ops);
    }

    #[test]
    fn asp_counter_counts_the_applied_pushes(
        ops in prop::collection::vec(op(Just(Grads::Counter).boxed(), false), 1..60),
    ) {
        let h = run(Consistency::Asp, &ops);
        prop_assert!(!h.not_counter);
    }

    #[test]
    fn spans_claimed_once_are_applied_once(
        consistency in consistency(),
        ops in prop::collection::vec(op(any_grads(), true), 1..60),
    ) {
        let h = run(consistency, &ops);
        for e in h.st.ledger_report() {
            prop_assert_eq!(e.duplicates, 0, "epoch {}", e.epoch);
        }
    }
}

/// The little-endian bytes of `n` gradients of -1.
fn counter_grads(n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| (-1f32).to_le_bytes()).collect()
}

const KEY1: [ChunkRef; 1] = [ChunkRef::new(Key(1), 4)];

/// Found by `random_pushes_and_pulls_keep_the_shard_invariants` (with
/// `MIXED_REFUSED_PULLS`): a pull refused at a key it does not hold has already applied the
/// due BSP steps of the keys before it, so a step can close, and later pushes to it be refused
/// as stale, on a request that was refused.
#[test]
fn a_refused_pull_changes_nothing() {
    let st = ShardState::new(ShardId(0), job(Consistency::Bsp), map());
    st.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &KEY1,
        &counter_grads(4),
        None,
    )
    .expect("worker 1 pushes step 0");
    let before = st.snapshot();
    let ranges = [KeyRange { start: 1, end: 2 }, KeyRange { start: 0, end: 1 }];
    let refused = st
        .pull(MapEpoch(1), &ranges, Clock(1))
        .expect_err("key 0 is held by another shard");
    assert_eq!(refused.code, ErrorCode::StaleEpoch);
    assert_eq!(without_load(st.snapshot()), without_load(before));
    st.push(
        MapEpoch(1),
        WorkerId(2),
        Clock(0),
        &KEY1,
        &counter_grads(4),
        None,
    )
    .expect("step 0 is still open for worker 2");
}

/// Found with `MIXED_REFUSED_PULLS` as well, under ASP: the load counters (which resharding by
/// load reads) count the keys a refused pull read before the one it was refused at.
#[test]
fn a_refused_pull_counts_no_load() {
    let st = ShardState::new(ShardId(0), job(Consistency::Asp), map());
    let before = st.snapshot();
    let ranges = [KeyRange { start: 1, end: 2 }, KeyRange { start: 0, end: 1 }];
    st.pull(MapEpoch(1), &ranges, Clock(0))
        .expect_err("key 0 is held by another shard");
    assert_eq!(st.snapshot(), before);
}

/// A pull may name any step to apply through; the staging bound `applied + 16` then
/// overflows on the next push near `u64::MAX` (a panic in a debug build).
#[test]
fn a_clock_near_the_largest_does_not_panic() {
    let st = ShardState::new(ShardId(0), job(Consistency::Bsp), map());
    let near = u64::MAX - 1;
    st.pull(MapEpoch(1), &[KeyRange { start: 1, end: 2 }], Clock(near))
        .expect("pull");
    let got = st.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(near),
        &KEY1,
        &counter_grads(4),
        None,
    );
    assert_eq!(got, Ok(Claim::Apply));
}

/// Partitions are fixed ranges of positions, so a span whose positions lie outside the
/// partition it names cannot come from a lease; the ledger keeps its progress per partition
/// and accepts it, and a sample is then applied twice on this shard.
#[test]
fn a_span_outside_its_partition_is_refused() {
    let st = ShardState::new(ShardId(0), job(Consistency::Asp), map());
    let span = |partition| DataSpan {
        epoch: 0,
        partition,
        start: 0,
        end: 2,
    };
    let grads = counter_grads(4);
    let first = st.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &KEY1,
        &grads,
        Some(&span(0)),
    );
    assert_eq!(first, Ok(Claim::Apply));
    let second = st.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(1),
        &KEY1,
        &grads,
        Some(&span(1)),
    );
    assert_eq!(second.map_err(|r| r.code), Err(ErrorCode::InvalidRequest));
    assert_eq!(st.ledger_report()[0].duplicates, 0);
}

/// A push large enough to be applied on two cores (`PARALLEL_APPLY_BYTES`) leaves the
/// parameters and optimizer state exactly as applying it key by key does, with chunks of
/// uneven length and the payload in misaligned parts of QUIC's sizes.
#[test]
fn a_large_push_applied_on_two_cores_equals_the_update_key_by_key() {
    const CHUNK: u32 = 50_000;
    let floats = (PARALLEL_APPLY_BYTES / 4) as u32 + 3 * CHUNK + 123;
    for optimizer in crate::optimizer::one_of_each() {
        let mut job = job(Consistency::Asp);
        job.tensors[0].shape = vec![floats];
        job.tensors[0].init = Init::Constant { value: 0.25 };
        job.chunk_size = CHUNK;
        job.optimizer = optimizer.clone();
        let layout = job.layout();
        let keys = layout.num_keys();
        let map = ShardMap {
            backups: Vec::new(),
            epoch: MapEpoch(1),
            shards: vec![ShardInfo {
                id: ShardId(0),
                addr: "s0".into(),
            }],
            ranges: vec![RangeOwner {
                start: 0,
                end: keys,
                shard: ShardId(0),
            }],
        };
        let st = ShardState::new(ShardId(0), job.clone(), map);
        let grads: Vec<f32> = (0..floats)
            .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
            .collect();
        let payload = f32s_to_bytes(&grads);
        // Parts of about 64 KiB, as QUIC delivers large datagrams.
        let parts = skewed_parts(&payload, 65_001);
        let chunks: Vec<ChunkRef> = (0..keys)
            .map(|k| ChunkRef::new(Key(k), layout.span(Key(k)).expect("a key").len))
            .collect();
        for clock in 0..2 {
            st.push_covering(
                MapEpoch(1),
                WorkerId(1),
                Clock(clock),
                &chunks,
                &parts,
                None,
                &[],
                0,
            )
            .expect("a valid push");
        }
        let snap = st.snapshot();
        for c in &chunks {
            let span = layout.span(c.key).expect("a key");
            let g = &grads[span.offset as usize..][..c.len as usize];
            let mut p = vec![0.25f32; c.len as usize];
            let mut opt = OptState::new(&optimizer, p.len());
            for _ in 0..2 {
                opt.start(&optimizer, p.len());
                opt.apply_at(&optimizer, &mut p, 0, g, 1.0);
            }
            let got = snap
                .chunks
                .iter()
                .find(|s| s.key == c.key.0)
                .expect("the key's snapshot");
            assert_eq!(got.params, p, "{optimizer:?}, {}", c.key);
            assert_eq!((&got.state, got.t), (&opt.bufs, opt.t), "{optimizer:?}");
        }
    }
}
