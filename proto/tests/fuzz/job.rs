//! The job side: the key layout, the shard map (placement, lookups, moves, balance plans), key
//! runs, data spans and the text forms of the consistency model and the optimizer.

use std::collections::BTreeSet;

use edl_proto::job::{RangeOwner, ShardInfo};
use edl_proto::msg::{DataSpan, KeyRange};
use edl_proto::{
    Consistency, Init, Key, KeyLayout, MapEpoch, OptimizerSpec, ShardId, ShardMap, TensorSpec,
};
use proptest::collection::{btree_set, vec};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

use crate::config;
use crate::strategies::{any_shard_map, consistency};

/// Up to six small tensors, some of them empty (a zero in the shape) or scalars (no shape).
fn tensors() -> impl Strategy<Value = Vec<TensorSpec>> {
    let spec = vec(0u32..16, 0..=3).prop_map(|shape| TensorSpec {
        name: String::new(),
        shape,
        init: Init::Zeros,
    });
    vec(spec, 0..6)
}

/// Chunk sizes including 0 (treated as 1) and one larger than any tensor.
fn chunk_size() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), 1u32..8, 1u32..200, Just(u32::MAX)]
}

/// Distinct shards in any order.
fn shard_infos(max: usize) -> impl Strategy<Value = Vec<ShardInfo>> {
    btree_set(0u32..16, 0..max)
        .prop_map(|ids| ids.into_iter().map(info).collect::<Vec<_>>())
        .prop_shuffle()
}

fn info(id: u32) -> ShardInfo {
    ShardInfo {
        id: ShardId(id),
        addr: format!("10.0.0.{id}:4000"),
    }
}

/// The owner of `key` found by looking at every range.
fn scan_owner(map: &ShardMap, key: u64) -> Option<ShardId> {
    map.ranges
        .iter()
        .find(|r| r.start <= key && key < r.end)
        .map(|r| r.shard)
}

/// Checks that `map` places every key of `[0, keys)` on exactly one shard, in sorted ranges
/// without gaps, overlaps or empty ranges (the one empty map of no keys aside), and that
/// `owner` agrees with a scan of the ranges.
fn check_covers(map: &ShardMap, keys: u64) -> Result<(), TestCaseError> {
    prop_assert_eq!(map.num_keys(), keys);
    let mut next = 0;
    for r in &map.ranges {
        prop_assert_eq!(r.start, next, "ranges {:?}", map.ranges);
        prop_assert!(
            r.end > r.start || keys == 0,
            "empty range in {:?}",
            map.ranges
        );
        next = r.end;
    }
    prop_assert_eq!(next, keys);
    for k in 0..keys {
        let owner = map.owner(Key(k));
        prop_assert!(owner.is_some(), "key {} has no owner", k);
        prop_assert_eq!(owner, scan_owner(map, k));
    }
    prop_assert_eq!(map.owner(Key(keys)), None);
    prop_assert_eq!(map.owner(Key(u64::MAX)), None);
    Ok(())
}

/// A finite float that is not negative, at any magnitude.
fn non_negative() -> impl Strategy<Value = f32> {
    use proptest::num::f32;
    f32::POSITIVE | f32::ZERO | f32::NORMAL | f32::SUBNORMAL
}

/// A weight as a load report may give it: mostly ordinary, sometimes zero, negative, infinite
/// or NaN (all of which the planner must survive).
fn weight() -> impl Strategy<Value = f64> {
    prop_oneof![
        8 => 0.0..100.0f64,
        1 => Just(0.0),
        1 => Just(-1.0),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NAN),
    ]
}

proptest! {
    #![proptest_config(config(256))]

    /// The layout cuts every tensor into full chunks and one shorter last chunk, numbered in
    /// order, tiling the flat vector without gaps or overlaps.
    #[test]
    fn layout_tiles_the_tensors(tensors in tensors(), chunk in chunk_size()) {
        let layout = KeyLayout::new(&tensors, chunk);
        let chunk = u64::from(chunk.max(1));
        let total: u64 = tensors.iter().map(TensorSpec::len).sum();
        prop_assert_eq!(layout.total_len(), total);
        prop_assert_eq!(layout.num_keys(), layout.spans().len() as u64);
        let mut offset = 0;
        let mut tensor = 0;
        for (k, s) in layout.spans().iter().enumerate() {
            prop_assert_eq!(s.key, Key(k as u64));
            prop_assert_eq!(layout.span(Key(k as u64)), Some(s));
            prop_assert_eq!(s.offset, offset);
            prop_assert!(s.len >= 1 && u64::from(s.len) <= chunk);
            prop_assert!(s.tensor >= tensor && s.tensor < tensors.len());
            tensor = s.tensor;
            offset += u64::from(s.len);
        }
        prop_assert_eq!(offset, total);
        for (t, spec) in tensors.iter().enumerate() {
            let mine: Vec<u64> = layout
                .spans()
                .iter()
                .filter(|s| s.tensor == t)
                .map(|s| u64::from(s.len))
                .collect();
            prop_assert_eq!(mine.iter().sum::<u64>(), spec.len());
            prop_assert_eq!(mine.len() as u64, spec.len().div_ceil(chunk));
            if let Some((_, full)) = mine.split_last() {
                prop_assert!(full.iter().all(|&n| n == chunk));
            }
        }
        prop_assert_eq!(layout.span(Key(layout.num_keys())), None);
        prop_assert_eq!(layout.span(Key(u64::MAX)), None);
    }

    /// A balanced map places every key exactly once, gives each shard at most one range in
    /// the order the shards were listed, and no shard much more than its share of floats.
    #[test]
    fn balanced_map_covers_every_key_once(
        tensors in tensors(),
        chunk in chunk_size(),
        shards in shard_infos(8),
        epoch in any::<u64>(),
    ) {
        let layout = KeyLayout::new(&tensors, chunk);
        let map = ShardMap::balanced(MapEpoch(epoch), shards.clone(), &layout);
        prop_assert_eq!(map.epoch, MapEpoch(epoch));
        prop_assert_eq!(&map.shards, &shards);
        if shards.is_empty() {
            prop_assert!(map.ranges.is_empty());
            prop_assert_eq!(map.owner(Key(0)), None);
            return Ok(());
        }
        check_covers(&map, layout.num_keys())?;

        let position = |id: ShardId| shards.iter().position(|s| s.id == id);
        let mut last = None;
        for r in &map.ranges {
            let p = position(r.shard);
            prop_assert!(p.is_some() && p > last, "shard order broken: {:?}", map.ranges);
            last = p;
        }

        let n = shards.len() as u64;
        let share = layout.total_len().max(1).div_ceil(n);
        let longest = layout.spans().iter().map(|s| u64::from(s.len)).max().unwrap_or(0);
        for r in &map.ranges {
            let floats: u64 = (r.start..r.end)
                .filter_map(|k| layout.span(Key(k)))
                .map(|s| u64::from(s.len))
                .sum();
            prop_assert!(
                floats <= share + longest,
                "range {:?} holds {} floats, share {} + chunk {}", r, floats, share, longest
            );
        }
    }

    /// A move gives `[start, end)` to the receiver and leaves every other key where it was,
    /// one epoch later, with ranges merged and the shard list trimmed to the owners.
    #[test]
    fn moves_reassign_exactly_the_range(
        tensors in tensors(),
        chunk in chunk_size(),
        shards in shard_infos(6),
        (a, b) in (any::<Index>(), any::<Index>()),
        to in 0u32..20,
        epoch in 0..u64::MAX,
    ) {
        let layout = KeyLayout::new(&tensors, chunk);
        let map = ShardMap::balanced(MapEpoch(epoch), shards, &layout);
        let keys = layout.num_keys();
        if map.ranges.is_empty() || keys == 0 {
            return Ok(());
        }
        let (a, b) = (a.index(keys as usize + 1) as u64, b.index(keys as usize + 1) as u64);
        let (start, end) = (a.min(b), a.max(b));
        let moved = map.with_move(start, end, &info(to));
        prop_assert_eq!(moved.epoch, MapEpoch(epoch + 1));
        check_covers(&moved, keys)?;
        for k in 0..keys {
            let want = if (start..end).contains(&k) {
                Some(ShardId(to))
            } else {
                map.owner(Key(k))
            };
            prop_assert_eq!(moved.owner(Key(k)), want);
        }
        for w in moved.ranges.windows(2) {
            prop_assert!(w[0].shard != w[1].shard, "unmerged ranges {:?}", moved.ranges);
        }
        let owners: BTreeSet<ShardId> = moved.ranges.iter().map(|r| r.shard).collect();
        let listed: Vec<ShardId> = moved.shards.iter().map(|s| s.id).collect();
        prop_assert_eq!(listed.len(), owners.len());
        prop_assert_eq!(listed.iter().copied().collect::<BTreeSet<_>>(), owners);
        for s in &moved.shards {
            prop_assert_eq!(moved.addr_of(s.id), Some(s.addr.as_str()));
            prop_assert_eq!(moved.ranges_of(s.id).count() > 0, true);
        }
    }

    /// A balance plan, carried out move by move, leaves contiguous ranges over the targets in
    /// their order, every target holding a key when there are enough keys; planning again
    /// asks for nothing.
    #[test]
    fn balance_plans_reach_their_targets(
        tensors in tensors(),
        chunk in chunk_size(),
        shards in shard_infos(6),
        targets in btree_set(0u32..12, 1..6)
            .prop_map(|t| t.into_iter().collect::<Vec<_>>())
            .prop_shuffle(),
        pool in vec(weight(), 0..8),
    ) {
        let layout = KeyLayout::new(&tensors, chunk);
        let map = ShardMap::balanced(MapEpoch(1), shards, &layout);
        let keys = map.num_keys();
        let targets: Vec<ShardId> = targets.into_iter().map(ShardId).collect();
        let weights: Vec<f64> = (0..keys as usize)
            .map(|k| pool.get(k % pool.len().max(1)).copied().unwrap_or(1.0))
            .collect();
        if let Some((_, fewer)) = weights.split_last() {
            prop_assert!(map.plan_balance(&targets, fewer).is_empty());
        }
        let plan = map.plan_balance(&targets, &weights);
        let mut after = map.clone();
        let mut done = 0;
        for &(a, b, from, to) in &plan {
            prop_assert!(a < b && a >= done && b <= keys, "moves out of order: {:?}", plan);
            prop_assert!(from != to);
            for k in a..b {
                prop_assert_eq!(after.owner(Key(k)), Some(from));
            }
            after = after.with_move(a, b, &info(to.0));
            done = b;
        }
        if keys == 0 {
            prop_assert!(plan.is_empty());
            return Ok(());
        }
        check_covers(&after, keys)?;
        let mut last = 0;
        for k in 0..keys {
            let owner = after.owner(Key(k));
            let p = targets.iter().position(|t| Some(*t) == owner);
            let p = p.ok_or_else(|| {
                TestCaseError::fail(format!("key {k} on {owner:?}, not a target"))
            })?;
            prop_assert!(p >= last, "targets out of order at key {}", k);
            last = p;
        }
        if keys >= targets.len() as u64 {
            for t in &targets {
                prop_assert!(after.ranges_of(*t).count() > 0, "target {} got nothing", t);
            }
        }
        prop_assert_eq!(after.plan_balance(&targets, &weights), vec![]);
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// `owner` agrees with a scan on any sorted map with gaps, at and around every boundary.
    #[test]
    fn owner_matches_a_scan(
        base in prop_oneof![Just(0u64), any::<u64>(), Just(u64::MAX - 200)],
        parts in vec((0u64..4, 1u64..6, 0u32..4), 0..8),
        probes in vec(any::<u64>(), 0..8),
    ) {
        let base = base.min(u64::MAX - 200);
        let mut ranges = Vec::new();
        let mut at = base;
        for (gap, len, shard) in parts {
            let start = at + gap;
            ranges.push(RangeOwner { start, end: start + len, shard: ShardId(shard) });
            at = start + len;
        }
        let map = ShardMap { epoch: MapEpoch(1), shards: Vec::new(), ranges, backups: Vec::new() };
        let edges = map.ranges.iter().flat_map(|r| [r.start, r.end]);
        for k in probes.into_iter().chain(edges.flat_map(|e| [e.wrapping_sub(1), e, e + 1])) {
            prop_assert_eq!(map.owner(Key(k)), scan_owner(&map, k), "key {}", k);
        }
    }

    /// Lookups on any map as it may arrive (unsorted, overlapping) never panic, and an owner
    /// they name does hold the key.
    #[test]
    fn lookups_on_any_map(map in any_shard_map(), probes in vec(any::<u64>(), 0..8)) {
        let edges = map.ranges.iter().flat_map(|r| [r.start, r.end.wrapping_sub(1)]);
        for k in probes.into_iter().chain(edges) {
            if let Some(s) = map.owner(Key(k)) {
                prop_assert!(map.ranges.iter().any(|r| r.shard == s && r.start <= k && k < r.end));
            }
        }
        let _ = map.num_keys();
        for s in map.owners_in_order() {
            prop_assert!(map.ranges_of(s).count() > 0);
        }
        for s in &map.shards {
            prop_assert!(map.addr_of(s.id).is_some());
        }
    }

    /// The runs of any keys cover exactly those keys, sorted, with a gap between runs (so no
    /// fewer runs could cover them).
    #[test]
    fn runs_cover_exactly_the_keys(
        // Key u64::MAX cannot end a half-open range: see `regressions::runs_of_the_last_key`.
        base in prop_oneof![Just(0u64), any::<u64>(), Just(u64::MAX - 100)],
        offsets in vec(0u64..64, 0..40),
    ) {
        let base = base.min(u64::MAX - 100);
        let keys: Vec<u64> = offsets.iter().map(|o| base + o).collect();
        let runs = KeyRange::runs(keys.iter().copied());
        let covered: Vec<u64> = runs.iter().flat_map(|r| r.start..r.end).collect();
        let want: Vec<u64> = keys.iter().copied().collect::<BTreeSet<_>>().into_iter().collect();
        prop_assert_eq!(covered, want);
        for r in &runs {
            prop_assert!(r.start < r.end);
        }
        for w in runs.windows(2) {
            prop_assert!(w[0].end < w[1].start, "adjacent runs {:?}", runs);
        }
    }

    /// A tensor's length is the product of its shape, saturating where that overflows.
    #[test]
    fn tensor_lengths(shape in vec(prop_oneof![any::<u32>(), 0u32..4, Just(u32::MAX)], 0..6)) {
        let product = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(u64::from(d)));
        let spec = TensorSpec { name: String::new(), shape, init: Init::Zeros };
        let len = spec.len();
        match product {
            Some(n) => prop_assert_eq!(len, n),
            // A zero dimension after the overflow still makes the tensor empty.
            None if spec.shape.contains(&0) => prop_assert_eq!(len, 0),
            None => prop_assert_eq!(len, u64::MAX),
        }
        prop_assert_eq!(spec.is_empty(), len == 0);
    }

    /// A data span's length never underflows.
    #[test]
    fn span_lengths(span in crate::strategies::data_span()) {
        let len = span.len();
        prop_assert_eq!(len, span.end.saturating_sub(span.start));
        prop_assert_eq!(span.is_empty(), len == 0);
        let DataSpan { start, end, .. } = span;
        prop_assert!(len == 0 || u64::from(start) + u64::from(len) == u64::from(end));
    }

    /// The text forms of settings (flags and config files) never panic on any input, and what
    /// they accept prints back to itself.
    #[test]
    fn settings_text(
        s in prop_oneof![
            ".{0,16}",
            "(sgd|momentum|adam|adamw|adagrad|rmsprop|adadelta|asp|bsp|ssp|x)?(:[-+0-9.eEinfaN]{0,8}){0,3}(,(momentum|nesterov|eps|beta1|rho|centered|x)=(true|false|[-+0-9.eEinfaN]{0,8})){0,3}",
        ],
    ) {
        if let Ok(c) = s.parse::<Consistency>() {
            prop_assert_eq!(c.to_string().parse::<Consistency>(), Ok(c));
        }
        if let Ok(o) = s.parse::<OptimizerSpec>() {
            prop_assert!(o.lr().is_finite() && o.lr() >= 0.0, "{:?}", o);
            prop_assert_eq!(o.check(), Ok(()));
            prop_assert_eq!(o.to_string().parse::<OptimizerSpec>(), Ok(o));
        }
    }

    /// Every consistency model and every optimizer setting the parser can give survives
    /// printing and parsing.
    #[test]
    fn settings_print_and_parse(
        c in consistency(),
        (lr, momentum) in (non_negative(), non_negative()),
    ) {
        prop_assert_eq!(c.to_string().parse::<Consistency>(), Ok(c));
        for kind in OptimizerSpec::KINDS {
            let mut o = OptimizerSpec::defaults(kind).expect("a kind");
            o.set_number("lr", f64::from(lr)).expect("lr");
            let _ = o.set_number("momentum", f64::from(momentum));
            prop_assert_eq!(o.to_string().parse::<OptimizerSpec>(), Ok(o));
        }
    }
}
