//! Unit tests of the shard module.

use super::*;
use edl_shared::proto::frame::{Payload, bytes_to_f32s};
use edl_shared::proto::job::{RangeOwner, ShardInfo};
use edl_shared::proto::{LrSchedule, ModelSection, OptimizerSpec, TensorSpec};

fn state(consistency: Consistency) -> ShardState {
    state_with(consistency, LrSchedule::default())
}

/// A 6-float tensor in keys of 4, trained by SGD at rate 1, 3 epochs of one sample.
fn job_with(consistency: Consistency, schedule: LrSchedule) -> JobConfig {
    JobConfig {
        model: ModelSection::custom(),
        tensors: vec![TensorSpec {
            name: "c".into(),
            shape: vec![6],
            init: Init::Zeros,
        }],
        chunk_size: 4,
        optimizer: OptimizerSpec::sgd(1.0),
        optimizer_groups: Vec::new(),
        schedule,
        consistency,
        batch_size: 1,
        epochs: 3,
        partition_size: 1,
        train_samples: 1,
        seed: 0,
        lease_ms: 1000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
    }
}

fn state_with(consistency: Consistency, schedule: LrSchedule) -> ShardState {
    let job = job_with(consistency, schedule);
    let map = ShardMap {
        backups: Vec::new(),
        epoch: MapEpoch(1),
        shards: vec![ShardInfo {
            id: ShardId(0),
            addr: "x".into(),
        }],
        ranges: vec![RangeOwner {
            start: 0,
            end: 2,
            shard: ShardId(0),
        }],
    };
    ShardState::new(ShardId(0), job, map)
}

fn floats(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read(st: &ShardState, through: u64) -> Vec<f32> {
    let f = st
        .pull(
            MapEpoch(1),
            &[KeyRange { start: 0, end: 2 }],
            Clock(through),
        )
        .expect("pull");
    let payload = f.payload.concat();
    let mut out = vec![0.0; payload.len() / 4];
    bytes_to_f32s(&payload, &mut out).expect("floats");
    out
}

const BOTH: [ChunkRef; 2] = [ChunkRef::new(Key(0), 4), ChunkRef::new(Key(1), 2)];

/// The values `v` as a 16-bit push's payload, in parts cut at odd offsets (as QUIC may cut
/// a stream).
fn narrow(v: &[f32], wire: Wire) -> Parts {
    let mut b = BytesMut::new();
    encode_finite(&mut b, v, wire).expect("finite");
    let b = b.freeze();
    Parts(vec![b.slice(..3), b.slice(3..7), b.slice(7..)])
}

/// A push of `parts` (`chunks` coded as they say) from worker 1 at step 0.
fn push_coded(st: &ShardState, chunks: &[ChunkRef], parts: Parts) -> Result<Claim, Refusal> {
    let push = (
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        chunks,
        &parts.0[..],
        None,
        &[][..],
    );
    st.push_in(Side::Primary, push, 0, &mut || {})
}

/// `BOTH` coded at `wire`, sparse or dense.
fn both_at(wire: Wire, sparse: bool) -> [ChunkRef; 2] {
    BOTH.map(|c| c.coded(wire, sparse))
}

#[test]
fn sixteen_bit_pushes_apply_their_values_and_pulls_answer_at_sixteen_bits() {
    let st = state(Consistency::Asp);
    // 1/3 is not a bfloat16: the shard applies the value the worker's encoding rounded to.
    let g = [1.0 / 3.0, -2.0, 0.5, 1e-8, 7.0, -0.25];
    for wire in [Wire::Bf16, Wire::F16] {
        push_coded(&st, &both_at(wire, false), narrow(&g, wire)).expect("push");
    }
    let rounded = |wire| edl_shared::proto::wire::round_trip(&g, wire).expect("finite");
    let (b, h) = (rounded(Wire::Bf16), rounded(Wire::F16));
    assert_ne!(b[0], g[0]);
    let want: Vec<f32> = (0..6).map(|i| -b[i] - h[i]).collect();
    assert_eq!(read(&st, 0), want);
    // Bytes in count what travelled: 12 of each 16-bit push.
    assert_eq!(st.stats().bytes_in, 24);
    // A pull at 16 bits: half the bytes, the parameters rounded once.
    for wire in [Wire::Bf16, Wire::F16] {
        let f = st
            .pull_in(
                MapEpoch(1),
                &[KeyRange { start: 0, end: 2 }],
                Clock(0),
                Some(wire),
            )
            .expect("pull");
        let payload = f.payload.concat();
        assert_eq!(payload.len(), 6 * 2, "{wire}");
        let mut got = vec![0.0; 6];
        edl_shared::proto::wire::decode(&payload, wire, &mut got).expect("decodes");
        let once = edl_shared::proto::wire::round_trip(&want, wire).expect("finite");
        assert_eq!(got, once, "{wire}");
    }
}

#[test]
fn chunks_of_one_push_at_different_codings_each_apply_their_values() {
    let st = state(Consistency::Asp);
    // The first key at bf16, the second sparse at f32 (its first value did not travel).
    let chunks = [
        BOTH[0].coded(Wire::Bf16, false),
        BOTH[1].coded(Wire::F32, true),
    ];
    let mut b = BytesMut::new();
    encode_finite(&mut b, &[1.0 / 3.0, 2.0, -3.0, 0.5], Wire::Bf16).expect("finite");
    let mut acc = [0.125f32, -6.0];
    edl_shared::proto::sparse::encode_topk(&mut b, &mut acc, 1, Wire::F32, &mut Vec::new())
        .expect("finite");
    let b = b.freeze();
    // Cut inside the second bf16 value and inside the sparse record.
    let parts = Parts(vec![b.slice(..3), b.slice(3..11), b.slice(11..)]);
    push_coded(&st, &chunks, parts).expect("push");
    let third = edl_shared::proto::wire::round_trip(&[1.0 / 3.0], Wire::Bf16).expect("finite");
    assert_eq!(read(&st, 0), [-third[0], -2.0, 3.0, -0.5, 0.0, 6.0]);
}

#[test]
fn bad_sixteen_bit_pushes_and_pulls_are_refused() {
    let st = state(Consistency::Asp);
    // A bfloat16 infinity at value 4 (bytes 8 and 9), and a NaN at value 1 in binary16.
    for (wire, at, bits) in [(Wire::Bf16, 4, 0x7f80u16), (Wire::F16, 1, 0x7e00)] {
        let mut b = BytesMut::new();
        encode_finite(&mut b, &[1.0; 6], wire).expect("finite");
        b[at * 2..at * 2 + 2].copy_from_slice(&bits.to_le_bytes());
        let err =
            push_coded(&st, &both_at(wire, false), Parts(vec![b.freeze()])).expect_err("refused");
        assert_eq!(err.code, ErrorCode::NonFinite, "{}", err.message);
        assert!(
            err.message.contains(&format!("float {at}")),
            "{}",
            err.message
        );
    }
    // Bytes for five values where the chunks hold six, and for seven.
    for n in [5, 7] {
        let e = push_coded(
            &st,
            &both_at(Wire::Bf16, false),
            narrow(&vec![1.0; n], Wire::Bf16),
        )
        .expect_err("wrong length");
        assert_eq!(e.code, ErrorCode::ShapeMismatch, "{}", e.message);
    }
    assert_eq!(read(&st, 0), vec![0.0; 6], "nothing was applied");
    // A parameter past binary16's range: its chunk is answered at f32, exact, the other at
    // the precision asked for.
    st.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &BOTH,
        &floats(&[-1e5, 0.0, 0.0, 0.0, 0.5, 0.5]),
        None,
    )
    .expect("push");
    let range = [KeyRange { start: 0, end: 2 }];
    for (asked, answered, bytes) in [
        (Wire::F16, [Wire::F32, Wire::F16], 20),
        (Wire::Bf16, [Wire::Bf16, Wire::Bf16], 12),
        (Wire::F32, [Wire::F32, Wire::F32], 24),
    ] {
        let f = st
            .pull_in(MapEpoch(1), &range, Clock(0), Some(asked))
            .expect("pull");
        let Response::Pulled { chunks } = f.msg else {
            panic!("{:?}", f.msg)
        };
        let wires: Vec<Wire> = chunks.iter().map(|c| c.wire).collect();
        assert_eq!(
            (&wires[..], f.payload.byte_len()),
            (&answered[..], bytes),
            "{asked}"
        );
    }
    assert_eq!(read(&st, 0), vec![1e5, 0.0, 0.0, 0.0, -0.5, -0.5]);
}

/// `chunks` (each a chunk's values) as a sparse push keeping `k` of each, in two parts cut
/// inside a record.
fn sparse(chunks: &[&[f32]], k: usize) -> Parts {
    let mut b = BytesMut::new();
    for c in chunks {
        let mut acc = c.to_vec();
        edl_shared::proto::sparse::encode_topk(&mut b, &mut acc, k, Wire::F32, &mut Vec::new())
            .expect("finite");
    }
    let b = b.freeze();
    Parts(vec![b.slice(..6), b.slice(6..)])
}

#[test]
fn sparse_pushes_apply_what_travelled_and_nothing_else() {
    let st = state(Consistency::Asp);
    let parts = sparse(&[&[0.5, -4.0, 1.0, 3.0], &[0.25, 2.0]], 2);
    push_coded(&st, &both_at(Wire::F32, true), parts).expect("push");
    // SGD at rate 1 from zeros: minus what travelled (-4 and 3 of the first key, both of the
    // second), zero elsewhere.
    assert_eq!(read(&st, 0), [0.0, 4.0, 0.0, -3.0, -0.25, -2.0]);
}

#[test]
fn bad_sparse_pushes_are_refused_before_anything_is_applied() {
    let st = state(Consistency::Asp);
    let refused = |chunks: &[ChunkRef], payload: Parts| {
        push_coded(&st, chunks, payload).expect_err("refused")
    };
    let sparse_at = |c: ChunkRef| c.coded(Wire::F32, true);
    // A chunk that is not one of the job's keys, or not at its length: refused before
    // anything is read for it (a claim of 4 billion floats costs nothing).
    for (c, code) in [
        (ChunkRef::new(Key(2), 4), ErrorCode::UnknownKey),
        (ChunkRef::new(Key(0), u32::MAX), ErrorCode::ShapeMismatch),
    ] {
        let e = refused(&[sparse_at(c)], sparse(&[&[1.0]], 1));
        assert_eq!(e.code, code, "{}", e.message);
    }
    // Chunks claimed with fewer bytes than their records take.
    let both = both_at(Wire::F32, true);
    let e = refused(&both, Parts(vec![Bytes::from_static(&[0, 0, 0, 0])]));
    assert_eq!(e.code, ErrorCode::ShapeMismatch, "{}", e.message);
    assert!(e.message.contains("2 chunks of 6 floats"), "{}", e.message);
    // A position past its chunk, and a record cut short.
    let mut b = BytesMut::new();
    for x in [1u32, 4, 1.0f32.to_bits(), 0] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    let e = refused(&both, Parts(vec![b.freeze()]));
    assert_eq!(e.code, ErrorCode::Malformed, "{}", e.message);
    let whole = sparse(&[&[1.0; 4], &[1.0; 2]], 1).concat();
    let e = refused(
        &both,
        Parts(vec![Bytes::copy_from_slice(&whole[..whole.len() - 1])]),
    );
    assert_eq!(e.code, ErrorCode::ShapeMismatch, "{}", e.message);
    // A NaN, named by its float in the push: the second key's first value is float 4.
    let mut b = BytesMut::from(&whole[..]);
    let at = b.len() - 4;
    b[at..].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = refused(&both, Parts(vec![b.freeze()]));
    assert_eq!(e.code, ErrorCode::NonFinite, "{}", e.message);
    assert!(e.message.contains("float 4"), "{}", e.message);
    assert_eq!(read(&st, 0), vec![0.0; 6], "nothing was applied");
}

#[test]
fn bad_pushes_change_nothing() {
    let st = state(Consistency::Asp);
    let w = WorkerId(1);
    let good = floats(&[-1.0; 6]);
    // Non-finite gradients are refused on receipt, by `read_frame` (tests/security.rs).
    let cases: Vec<(MapEpoch, Vec<ChunkRef>, Vec<u8>, ErrorCode)> = vec![
        (
            MapEpoch(1),
            BOTH.to_vec(),
            good[..20].to_vec(),
            ErrorCode::ShapeMismatch,
        ),
        (
            MapEpoch(1),
            vec![BOTH[0], ChunkRef::new(Key(7), 2)],
            good.clone(),
            ErrorCode::UnknownKey,
        ),
        (
            MapEpoch(1),
            vec![ChunkRef::new(Key(0), 3), ChunkRef::new(Key(1), 3)],
            good.clone(),
            ErrorCode::ShapeMismatch,
        ),
    ];
    for (epoch, chunks, payload, want) in cases {
        let err = st
            .push(epoch, w, Clock(0), &chunks, &payload, None)
            .expect_err("must fail");
        assert_eq!(err.code, want, "{}", err.message);
    }
    assert_eq!(read(&st, 0), vec![0.0; 6]);
    st.push(MapEpoch(1), w, Clock(0), &BOTH, &good, None)
        .expect("good push");
    assert_eq!(read(&st, 0), vec![1.0; 6]);
}

#[test]
fn a_pull_answer_in_flight_keeps_its_values_while_pushes_apply() {
    // A pull's payload shares the parameters until it is sent: a push applied meanwhile must
    // write into a copy, never into the bytes still going out.
    let st = state(Consistency::Asp);
    let w = WorkerId(1);
    let all = [KeyRange { start: 0, end: 2 }];
    st.push(MapEpoch(1), w, Clock(0), &BOTH, &floats(&[-1.0; 6]), None)
        .expect("push");
    let held = st.pull(MapEpoch(1), &all, Clock(0)).expect("pull");
    st.push(MapEpoch(1), w, Clock(1), &BOTH, &floats(&[-2.0; 6]), None)
        .expect("push while a pull is held");
    assert_eq!(
        held.payload.concat(),
        floats(&[1.0; 6]),
        "held answer changed"
    );
    assert_eq!(read(&st, 0), vec![3.0; 6]);
    drop(held);
    // Nothing holds the values now: the next update writes in place, and reads see it.
    st.push(MapEpoch(1), w, Clock(2), &BOTH, &floats(&[-1.0; 6]), None)
        .expect("push");
    assert_eq!(read(&st, 0), vec![4.0; 6]);
}

#[test]
fn a_span_applied_before_is_skipped_not_applied_twice() {
    let st = state(Consistency::Asp);
    let span = DataSpan {
        epoch: 0,
        partition: 0,
        start: 0,
        end: 1,
    };
    let g = floats(&[-1.0; 6]);
    let first = st.push(MapEpoch(1), WorkerId(1), Clock(0), &BOTH, &g, Some(&span));
    assert_eq!(first, Ok(Claim::Apply));
    // The worker died before committing; its successor pushes the same span.
    let again = st.push(MapEpoch(1), WorkerId(2), Clock(0), &BOTH, &g, Some(&span));
    assert_eq!(again, Ok(Claim::AlreadyApplied));
    assert_eq!(read(&st, 0), vec![1.0; 6]);
    let r = st.ledger_report();
    assert_eq!(
        (r[0].applied, r[0].duplicates, r[0].skipped_pushes),
        (1, 0, 1)
    );
}

#[test]
fn bsp_applies_the_mean_once_the_step_closes() {
    let st = state(Consistency::Bsp);
    st.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &BOTH,
        &floats(&[-1.0; 6]),
        None,
    )
    .expect("push");
    st.push(
        MapEpoch(1),
        WorkerId(2),
        Clock(0),
        &BOTH,
        &floats(&[-3.0; 6]),
        None,
    )
    .expect("push");
    // Step 0 is not closed until a pull says so.
    assert_eq!(read(&st, 0), vec![0.0; 6]);
    assert_eq!(read(&st, 1), vec![2.0; 6]);
    // A late push to a closed step is refused.
    let late = st.push(
        MapEpoch(1),
        WorkerId(3),
        Clock(0),
        &BOTH,
        &floats(&[-1.0; 6]),
        None,
    );
    assert!(late.is_err());
    assert_eq!(read(&st, 1), vec![2.0; 6]);
}

/// Under BSP the scaled learning rate is the schedule's times the gradients the step
/// averages (`k`), or its square root: the mean of `k` pushes at `lr * k` is their sum at `lr`.
#[test]
fn bsp_scales_the_learning_rate_with_the_gradients_a_step_averages() {
    for (scale, k, want) in [
        ("none", 2, 2.0),
        ("linear", 2, 4.0),
        ("linear", 3, 6.0),
        ("sqrt", 4, 2.0 * 2.0),
    ] {
        let schedule = format!("constant,scale={scale}").parse().expect("schedule");
        let st = state_with(Consistency::Bsp, schedule);
        for w in 0..k {
            // Gradients -1 and -3 alternately: with k = 4 their mean is still -2.
            let g = if w % 2 == 0 { -1.0 } else { -3.0 };
            let g = if k == 3 && w == 2 { -2.0 } else { g };
            st.push(
                MapEpoch(1),
                WorkerId(w + 1),
                Clock(0),
                &BOTH,
                &floats(&[g; 6]),
                None,
            )
            .expect("push");
        }
        assert_eq!(read(&st, 1), vec![want as f32; 6], "scale={scale}, k={k}");
    }
}

/// An epoch schedule counts the epoch of the samples a push carries, under ASP at once and
/// under BSP once the step closes.
#[test]
fn an_epoch_schedule_counts_the_epoch_of_the_pushed_samples() {
    let span = |epoch, start| DataSpan {
        epoch,
        partition: 0,
        start,
        end: start + 1,
    };
    for consistency in [Consistency::Asp, Consistency::Bsp] {
        let schedule = "step,step_size=1,gamma=0.5,by=epoch"
            .parse()
            .expect("schedule");
        let st = state_with(consistency, schedule);
        // Epoch 0 at lr 1, epoch 1 at 0.5, epoch 2 at 0.25: each a gradient of -1.
        for (clock, epoch) in [(0, 0), (1, 1), (2, 2)] {
            st.push(
                MapEpoch(1),
                WorkerId(1),
                Clock(clock),
                &BOTH,
                &floats(&[-1.0; 6]),
                Some(&span(epoch, 0)),
            )
            .expect("push");
        }
        assert_eq!(read(&st, 3), vec![1.75; 6], "{consistency}");
    }
}

/// A job of three keys of 4 floats, on `s0` (all keys) and `s1` (none, standing by).
fn two_shards() -> (ShardState, ShardState, ShardMap) {
    two_shards_with(OptimizerSpec::sgd(1.0), Vec::new(), LrSchedule::default())
}

fn two_shards_with(
    optimizer: OptimizerSpec,
    optimizer_groups: Vec<edl_shared::proto::OptimizerGroup>,
    schedule: LrSchedule,
) -> (ShardState, ShardState, ShardMap) {
    let job = JobConfig {
        model: ModelSection::custom(),
        tensors: vec![TensorSpec {
            name: "c".into(),
            shape: vec![12],
            init: Init::Zeros,
        }],
        chunk_size: 4,
        optimizer,
        optimizer_groups,
        schedule,
        consistency: Consistency::Asp,
        batch_size: 1,
        epochs: 1,
        partition_size: 4,
        train_samples: 4,
        seed: 0,
        lease_ms: 1000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
    };
    let info = |i: u32| ShardInfo {
        id: ShardId(i),
        addr: format!("s{i}"),
    };
    let map = ShardMap {
        backups: Vec::new(),
        epoch: MapEpoch(1),
        shards: vec![info(0)],
        ranges: vec![RangeOwner {
            start: 0,
            end: 3,
            shard: ShardId(0),
        }],
    };
    let a = ShardState::new(ShardId(0), job.clone(), map.clone());
    let b = ShardState::new(ShardId(1), job, map.clone());
    let moved = map.with_move(1, 3, &info(1));
    (a, b, moved)
}

fn chunks(keys: std::ops::Range<u64>) -> Vec<ChunkRef> {
    keys.map(|k| ChunkRef::new(Key(k), 4)).collect()
}

fn pull_range(st: &ShardState, start: u64, end: u64) -> Result<Vec<f32>, Refusal> {
    let f = st.pull(MapEpoch(1), &[KeyRange { start, end }], Clock(0))?;
    let payload = f.payload.concat();
    let mut out = vec![0.0; payload.len() / 4];
    bytes_to_f32s(&payload, &mut out).expect("floats");
    Ok(out)
}

#[test]
fn moved_keys_carry_their_state_and_their_ledger() {
    let (a, b, moved) = two_shards();
    assert_eq!(b.num_keys(), 0);
    assert!(
        b.ledger_report().is_empty(),
        "a shard without keys has no account"
    );
    let span = |start, end| DataSpan {
        epoch: 0,
        partition: 0,
        start,
        end,
    };
    let w = WorkerId(1);
    a.push(
        MapEpoch(1),
        w,
        Clock(0),
        &chunks(0..3),
        &floats(&[-1.0; 12]),
        Some(&span(0, 2)),
    )
    .expect("push");

    let export = a.export(1, 3, &moved).expect("export");
    assert_eq!(a.num_keys(), 1);
    assert_eq!(a.read_map().epoch, MapEpoch(2));
    // A request for a key that left is refused with the new map and changes nothing.
    let refused = a
        .push(
            MapEpoch(1),
            w,
            Clock(1),
            &chunks(0..2),
            &floats(&[-5.0; 8]),
            None,
        )
        .expect_err("key 1 left");
    assert_eq!(refused.code, ErrorCode::StaleEpoch);
    assert_eq!(refused.map.as_deref(), Some(&moved));
    assert_eq!(pull_range(&a, 0, 1).expect("pull"), vec![1.0; 4]);
    assert_eq!(
        pull_range(&a, 1, 2).expect_err("gone").code,
        ErrorCode::StaleEpoch
    );

    b.import(1, 3, &moved, export.clone()).expect("import");
    // A repeated import (the answer was lost) is acknowledged and changes nothing.
    b.import(1, 3, &moved, export).expect("repeat");
    assert_eq!(b.read_map().epoch, MapEpoch(2));
    assert_eq!(pull_range(&b, 1, 3).expect("pull"), vec![1.0; 8]);

    // The span applied before the move is skipped on the moved keys too.
    let again = b.push(
        MapEpoch(2),
        w,
        Clock(0),
        &chunks(1..3),
        &floats(&[-1.0; 8]),
        Some(&span(0, 2)),
    );
    assert_eq!(again, Ok(Claim::AlreadyApplied));
    // A new span applies once on each side.
    a.push(
        MapEpoch(2),
        w,
        Clock(1),
        &chunks(0..1),
        &floats(&[-1.0; 4]),
        Some(&span(2, 4)),
    )
    .expect("push a");
    b.push(
        MapEpoch(2),
        w,
        Clock(1),
        &chunks(1..3),
        &floats(&[-1.0; 8]),
        Some(&span(2, 4)),
    )
    .expect("push b");
    assert_eq!(pull_range(&a, 0, 1).expect("pull"), vec![2.0; 4]);
    assert_eq!(pull_range(&b, 1, 3).expect("pull"), vec![2.0; 8]);
    for st in [&a, &b] {
        let r = st.ledger_report();
        assert_eq!((r[0].applied, r[0].duplicates, r[0].missing), (4, 0, 0));
    }

    // Keys that are not exactly the range, or already held, are refused.
    let back = b
        .export(
            1,
            2,
            &moved.with_move(
                1,
                2,
                &ShardInfo {
                    id: ShardId(0),
                    addr: "s0".into(),
                },
            ),
        )
        .expect("export");
    assert!(b.import(2, 3, &moved, back.clone()).is_err(), "wrong range");
    assert!(a.import(0, 1, &moved, back.clone()).is_err(), "wrong keys");
    // A failed hand-off leaves the keys where they were, with the map from before.
    b.reinstate(1, 2, &moved, MapEpoch(3), back)
        .expect("reinstate");
    assert_eq!(b.read_map().epoch, MapEpoch(2));
    assert_eq!(pull_range(&b, 1, 3).expect("pull"), vec![2.0; 8]);
}

/// Found by `edl-dst` (seed 120): a move whose hand-off failed left its map's epoch to the
/// next move's different map. Now the coordinator publishes the placement again above it, and
/// the shards fence what a superseded move would still do.
#[test]
fn a_superseded_move_is_refused_at_both_ends_and_a_take_back_keeps_the_newer_map() {
    let (a, b, moved) = two_shards();
    let first = a.export(1, 3, &moved).expect("export");
    b.import(1, 3, &moved, first).expect("import");
    let s0 = ShardInfo {
        id: ShardId(0),
        addr: "s0".into(),
    };
    // A move to a map no newer than the shard's is a late request: refused, nothing given up.
    let err = b.export(1, 2, &moved).expect_err("stale");
    assert!(err.message.contains("stale"), "{}", err.message);
    assert!(b.holds([Key(1)].into_iter()));
    // The source gives the range up for map 3 ...
    let attempt = moved.with_move(1, 2, &s0);
    let out = b.export(1, 2, &attempt).expect("export");
    // ... the coordinator gives up on it and publishes the placement again, at 4: the
    // destination, told so, refuses the range when it arrives late.
    let again = ShardMap {
        epoch: MapEpoch(4),
        ..moved.clone()
    };
    a.install_map(&again);
    let err = a
        .import(1, 2, &attempt, out.clone())
        .expect_err("superseded");
    assert!(err.message.contains("superseded"), "{}", err.message);
    assert!(!a.holds([Key(1)].into_iter()));
    // The source takes the range back and keeps the coordinator's newer map.
    b.install_map(&again);
    b.reinstate(1, 2, &moved, attempt.epoch, out)
        .expect("reinstate");
    assert_eq!(b.read_map().epoch, MapEpoch(4));
    assert!(b.holds([Key(1)].into_iter()));
}

/// Found by `edl-dst --mid-move` (seed 1014): a destination took a range, its answer was
/// lost, the coordinator found the range there and moved it on; the source, offering it again,
/// was refused as superseded and took it back: two shards held it. A destination acknowledges
/// an offer of a range it took before, wherever the range is now.
#[test]
fn an_offer_of_a_range_taken_before_is_acknowledged_after_it_moved_on() {
    let (a, b, moved) = two_shards();
    // a hands keys 1..3 to b for map 2; b takes them, but a does not hear it.
    let out = a.export(1, 3, &moved).expect("export");
    b.import(1, 3, &moved, out.clone()).expect("import");
    assert_eq!(a.ranges_out(), vec![(1, 3)]);
    // The range moves on from b to a for map 3.
    let s0 = ShardInfo {
        id: ShardId(0),
        addr: "s0".into(),
    };
    let on = moved.with_move(1, 3, &s0);
    let again = b.export(1, 3, &on).expect("export");
    a.import(1, 3, &on, again).expect("import");
    assert!(!b.holds([Key(1)].into_iter()));
    // a offers the first hand-off again: b took it, so it is acknowledged, and nothing changes.
    b.import(1, 3, &moved, out.clone()).expect("taken before");
    assert!(!b.holds([Key(1)].into_iter()));
    // An offer of the range that b never took, for a map it has seen, is still refused.
    let other = ShardMap {
        epoch: on.epoch,
        ..moved.clone()
    };
    let err = b.import(1, 3, &other, out).expect_err("superseded");
    assert!(err.message.contains("superseded"), "{}", err.message);
}

#[test]
fn a_checkpoint_after_moves_restores_the_moved_keys_and_ledgers() {
    let (a, b, moved) = two_shards();
    let span = DataSpan {
        epoch: 0,
        partition: 0,
        start: 0,
        end: 4,
    };
    a.push(
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &chunks(0..3),
        &floats(&[-3.0; 12]),
        Some(&span),
    )
    .expect("push");
    b.import(1, 3, &moved, a.export(1, 3, &moved).expect("export"))
        .expect("import");
    let job = b.job.clone();
    let restored =
        ShardState::restore(ShardId(1), job.clone(), moved.clone(), b.snapshot()).expect("restore");
    assert_eq!(pull_range(&restored, 1, 3).expect("pull"), vec![3.0; 8]);
    assert_eq!(restored.ledger_report(), b.ledger_report());
    // The old placement does not fit the checkpoint any more.
    let old = ShardMap {
        epoch: MapEpoch(1),
        ..a.read_map().as_ref().clone()
    };
    let old = old.with_move(
        0,
        3,
        &ShardInfo {
            id: ShardId(0),
            addr: "s0".into(),
        },
    );
    assert!(ShardState::restore(ShardId(1), job, old, b.snapshot()).is_err());
}

/// Every optimizer's trajectory goes on unchanged across a range move and a checkpoint and
/// restore of both shards in the middle of a run: the parameters and the optimizer state
/// equal, bit for bit, those of a shard that was never interrupted.
#[test]
fn optimizer_state_survives_a_move_and_a_restore_mid_run() {
    let grads = |step: usize| -> Vec<u8> {
        let g: Vec<f32> = (0..12)
            .map(|j| ((step * 7 + j) % 11) as f32 / 8.0 - 0.6)
            .collect();
        floats(&g)
    };
    let mut cases: Vec<_> = crate::optimizer::one_of_each()
        .into_iter()
        .map(|o| (o, Vec::new(), LrSchedule::default()))
        .collect();
    // A parameter group: the same tensor's keys all follow it.
    let group = vec![edl_shared::proto::OptimizerGroup {
        tensors: vec![0],
        optimizer: "adamw:0.05,amsgrad=true".parse().expect("adamw"),
    }];
    cases.push((
        OptimizerSpec::adam(0.01),
        group.clone(),
        LrSchedule::default(),
    ));
    // Schedules by step count the updates a key carries with it: a learning rate (and a
    // momentum) that change every step follow the move and the restore.
    for (optimizer, schedule) in [
        ("adam:0.01", "onecycle,total_steps=6"),
        ("sgd:0.1,momentum=0.9", "cosine,T_max=4,eta_min=0.01"),
        (
            "rmsprop:0.01,momentum=0.5",
            "onecycle,total_steps=5,three_phase=true",
        ),
    ] {
        let optimizer = optimizer.parse().expect("optimizer");
        let schedule = schedule.parse().expect("schedule");
        let groups = if cases.len() % 2 == 0 {
            group.clone()
        } else {
            Vec::new()
        };
        cases.push((optimizer, groups, schedule));
    }
    for (optimizer, groups, schedule) in cases {
        let (reference, _, _) =
            two_shards_with(optimizer.clone(), groups.clone(), schedule.clone());
        let (a, b, moved) = two_shards_with(optimizer.clone(), groups.clone(), schedule);
        let whole = |st: &ShardState, step: usize| {
            st.push(
                MapEpoch(1),
                WorkerId(1),
                Clock(0),
                &chunks(0..3),
                &grads(step),
                None,
            )
            .expect("push");
        };
        (0..6).for_each(|step| whole(&reference, step));
        (0..3).for_each(|step| whole(&a, step));
        b.import(1, 3, &moved, a.export(1, 3, &moved).expect("export"))
            .expect("import");
        let job = a.job.clone();
        let a = ShardState::restore(ShardId(0), job.clone(), moved.clone(), a.snapshot())
            .expect("restore a");
        let b =
            ShardState::restore(ShardId(1), job, moved.clone(), b.snapshot()).expect("restore b");
        for step in 3..6 {
            let g = grads(step);
            a.push(
                moved.epoch,
                WorkerId(1),
                Clock(0),
                &chunks(0..1),
                &g[..16],
                None,
            )
            .expect("push a");
            b.push(
                moved.epoch,
                WorkerId(1),
                Clock(0),
                &chunks(1..3),
                &g[16..],
                None,
            )
            .expect("push b");
        }
        let mut got = pull_range(&a, 0, 1).expect("pull a");
        got.extend(pull_range(&b, 1, 3).expect("pull b"));
        let want = pull_range(&reference, 0, 3).expect("pull");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{optimizer}");
        let state = |snaps: Vec<crate::checkpoint::ChunkSnap>| -> Vec<_> {
            snaps.into_iter().map(|c| (c.key, c.state, c.t)).collect()
        };
        let mut moved_state = state(a.snapshot().chunks);
        moved_state.extend(state(b.snapshot().chunks));
        moved_state.sort_by_key(|c| c.0);
        assert_eq!(
            moved_state,
            state(reference.snapshot().chunks),
            "{optimizer}"
        );
    }
}

#[test]
fn a_covering_push_records_its_span_for_keys_it_does_not_carry() {
    let st = state(Consistency::Asp);
    let span = DataSpan {
        epoch: 0,
        partition: 0,
        start: 0,
        end: 1,
    };
    let key1 = [ChunkRef::new(Key(1), 2)];
    let g = floats(&[-1.0; 2]);
    let all = [KeyRange { start: 0, end: 2 }];
    let push = |chunks: &[ChunkRef], payload: &[u8], covers: &[KeyRange], span| {
        st.push_covering(
            MapEpoch(1),
            WorkerId(1),
            Clock(0),
            chunks,
            &[Bytes::copy_from_slice(payload)],
            span,
            covers,
            0,
        )
    };
    // Covering needs a span; a range past the job's keys is refused.
    let no_span = push(&key1, &g, &all, None).expect_err("covers without a span");
    assert_eq!(no_span.code, ErrorCode::InvalidRequest);
    let past = push(
        &key1,
        &g,
        &[KeyRange {
            start: 0,
            end: u64::MAX,
        }],
        Some(&span),
    );
    assert_eq!(past.expect_err("past the keys").code, ErrorCode::UnknownKey);
    assert_eq!(st.ledger_report()[0].applied, 0, "refusals record nothing");
    // No gradient travels at all, yet the span counts for the covered keys' ledger.
    assert_eq!(push(&[], &[], &all, Some(&span)), Ok(Claim::Apply));
    assert_eq!(read(&st, 0), vec![0.0; 6]);
    assert_eq!(st.ledger_report()[0].applied, 1);
    // A later push of the span, with a gradient, is skipped: the samples were applied.
    assert_eq!(
        push(&key1, &g, &all, Some(&span)),
        Ok(Claim::AlreadyApplied)
    );
    assert_eq!(read(&st, 0), vec![0.0; 6]);
}

#[test]
fn orders_of_a_deposed_coordinators_term_are_refused() {
    let st = state(Consistency::Asp);
    // No election (term 0) is always taken, until a later term has given an order.
    st.admit_term(0).expect("term 0");
    st.admit_term(0).expect("term 0 again");
    st.admit_term(7).expect("a new leader's term");
    st.admit_term(7).expect("the same leader again");
    let refused = st.admit_term(5).expect_err("a deposed leader");
    assert_eq!(refused.code, ErrorCode::Deposed);
    assert!(refused.message.contains("term 5"), "{}", refused.message);
    assert!(
        refused.message.contains("term 7 leads"),
        "{}",
        refused.message
    );
    st.admit_term(0).expect_err("term 0 after an elected one");
    st.admit_term(9).expect("a later leader");
}

/// A replicated job of one 6-float tensor in 3 keys of 2 over shards s0 and s1, two copies of
/// every key; and a standby s2.
fn replicated() -> (JobConfig, ShardMap, [ShardInfo; 3]) {
    let job = JobConfig {
        chunk_size: 2,
        epochs: 1,
        partition_size: 4,
        train_samples: 4,
        replicas: 2,
        wire: Default::default(),
        ..job_with(Consistency::Asp, LrSchedule::default())
    };
    let info = |i: u32| ShardInfo {
        id: ShardId(i),
        addr: format!("s{i}"),
    };
    let map = ShardMap::replicated(MapEpoch(1), vec![info(0), info(1)], &job.layout(), 2);
    (job, map, [info(0), info(1), info(2)])
}

/// `push` forwarded by `primary` to its one backup, `to`, as a `Replicate` of the push's
/// chunks and its bytes as they came (`bytes`, whatever its parts), not as seeding; the primary
/// then applies it. The forward's chunks and payload.
fn forwarded_once(
    primary: &ShardState,
    push: PushRef<'_>,
    to: ShardId,
    bytes: &Bytes,
) -> (Vec<ChunkRef>, Parts) {
    let plan = primary.forwards(push);
    assert_eq!(plan.len(), 1, "one backup");
    let fwd = &plan[0];
    assert_eq!(fwd.shard, to);
    let Request::Replicate {
        chunks, seeding, ..
    } = &fwd.req
    else {
        panic!("not a Replicate: {:?}", fwd.req);
    };
    assert_eq!((&chunks[..], *seeding), (push.3, false));
    assert_eq!(&fwd.payload.to_bytes(), bytes, "the push as it came");
    assert_eq!(
        primary.push_forwarding(push, 0, &mut || {}),
        Ok(Claim::Apply)
    );
    (chunks.clone(), Parts(fwd.payload.0.clone()))
}

/// The map of [`replicated`], s0 and its backup s1 in it, and s0's keys.
fn primary_and_backup() -> (ShardMap, ShardState, ShardState, Vec<Key>) {
    let (job, map, _) = replicated();
    let primary = ShardState::new(ShardId(0), job.clone(), map.clone());
    let backup = ShardState::new(ShardId(1), job, map.clone());
    let keys = (map.ranges_of(ShardId(0)))
        .flat_map(|r| r.start..r.end)
        .map(Key)
        .collect();
    (map, primary, backup, keys)
}

/// `push` with `chunks` and `payload` instead of its own.
fn carrying<'a>(push: PushRef<'a>, chunks: &'a [ChunkRef], payload: &'a [Bytes]) -> PushRef<'a> {
    let (epoch, worker, clock, _, _, samples, covers) = push;
    (epoch, worker, clock, chunks, payload, samples, covers)
}

#[test]
fn a_backup_applies_forwarded_pushes_once_and_its_promoted_copy_holds_them() {
    let (map, primary, backup, keys) = primary_and_backup();
    let (s0, s1) = (ShardId(0), ShardId(1));
    let mine: Vec<ChunkRef> = keys.iter().map(|k| ChunkRef::new(*k, 2)).collect();
    assert!(!mine.is_empty());
    let grads: Vec<f32> = (0..mine.len() * 2).map(|i| -(i as f32) - 1.0).collect();
    // The payload in two parts, cut inside a chunk.
    let bytes = Bytes::from(floats(&grads));
    let parts = [bytes.slice(..3), bytes.slice(3..)];
    let span = DataSpan {
        epoch: 0,
        partition: 0,
        start: 0,
        end: 2,
    };
    let push = (
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &mine[..],
        &parts[..],
        Some(&span),
        &[][..],
    );
    // The forwarded payload is the push's, whatever its parts.
    let (chunks, payload) = forwarded_once(&primary, push, s1, &bytes);
    let forwarded = carrying(push, &chunks, &payload.0);
    assert_eq!(backup.replicate(forwarded), Ok(Claim::Apply));
    // Forwarded again (the worker repeated its push after a failure): applied once.
    assert_eq!(backup.replicate(forwarded), Ok(Claim::AlreadyApplied));
    // The same span on s1's own keys (a worker's push covers every shard's).
    let theirs: Vec<ChunkRef> = map
        .ranges_of(s1)
        .flat_map(|r| r.start..r.end)
        .map(|k| ChunkRef::new(Key(k), 2))
        .collect();
    let g = floats(&vec![-1.0; theirs.len() * 2]);
    let own = backup.push(MapEpoch(1), WorkerId(1), Clock(0), &theirs, &g, Some(&span));
    assert_eq!(own, Ok(Claim::Apply));
    // The backup does not serve the keys it holds copies of...
    assert!(backup.param(mine[0].key, 0).is_none());
    // ...until a map without s0 promotes them, with their ledger.
    assert!(backup.adopt_map(&map.without(s0, &[]).expect("s0 held keys")));
    for c in &mine {
        for i in 0..2 {
            assert_eq!(backup.param(c.key, i), primary.param(c.key, i), "{}", c.key);
        }
    }
    assert_eq!(primary.param(mine[0].key, 0), Some(1.0));
    // Both its segments (its own keys', the promoted ones') hold the span once; the repeated
    // forward was skipped.
    let r = backup.ledger_report();
    assert_eq!(
        (r[0].applied, r[0].duplicates, r[0].skipped_pushes),
        (2, 0, 1),
        "{r:?}"
    );
    assert_eq!(backup.stats().backups, Vec::new());
}

#[test]
fn a_backup_is_forwarded_a_coded_push_as_it_came_and_applies_the_same_values() {
    let (map, primary, backup, keys) = primary_and_backup();
    let (s0, s1) = (ShardId(0), ShardId(1));
    assert!(keys.len() >= 2, "{keys:?}");
    // The first key at bf16, every other sparse (one value of its two travels).
    let mut b = BytesMut::new();
    let mut mine = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let g = [1.0 / 3.0 + i as f32, -2.0 - i as f32];
        if i == 0 {
            encode_finite(&mut b, &g, Wire::Bf16).expect("finite");
            mine.push(ChunkRef::new(*k, 2).coded(Wire::Bf16, false));
        } else {
            let mut acc = g;
            edl_shared::proto::sparse::encode_topk(&mut b, &mut acc, 1, Wire::F32, &mut Vec::new())
                .expect("finite");
            mine.push(ChunkRef::new(*k, 2).coded(Wire::F32, true));
        }
    }
    let bytes = b.freeze();
    let parts = [bytes.slice(..5), bytes.slice(5..)];
    let push = (
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &mine[..],
        &parts[..],
        None,
        &[][..],
    );
    let (chunks, payload) = forwarded_once(&primary, push, s1, &bytes);
    let forwarded = carrying(push, &chunks, &payload.0);
    assert_eq!(backup.replicate(forwarded), Ok(Claim::Apply));
    assert!(backup.adopt_map(&map.without(s0, &[]).expect("s0 held keys")));
    for k in &keys {
        for i in 0..2 {
            assert_eq!(backup.param(*k, i), primary.param(*k, i), "{k}");
        }
    }
    assert_ne!(primary.param(keys[0], 0), Some(0.0));
    // A sparse push whose chunks name a key twice is refused, by a primary and a backup alike.
    let twice = [mine[1], mine[1]];
    let mut b = BytesMut::new();
    for _ in 0..2 {
        let mut acc = [1.0f32, 2.0];
        edl_shared::proto::sparse::encode_topk(&mut b, &mut acc, 1, Wire::F32, &mut Vec::new())
            .expect("finite");
    }
    let parts = [b.freeze()];
    let push = (
        MapEpoch(1),
        WorkerId(1),
        Clock(1),
        &twice[..],
        &parts[..],
        None,
        &[][..],
    );
    let e = (primary.push_forwarding(push, 0, &mut || {})).expect_err("a key twice");
    assert_eq!(e.code, ErrorCode::Malformed, "{}", e.message);
    let e = backup.replicate(push).expect_err("a key twice");
    assert!(
        matches!(e.code, ErrorCode::Malformed | ErrorCode::UnknownKey),
        "{}",
        e.message
    );
}

#[test]
fn a_new_backup_keeps_the_pushes_sent_before_its_copy_and_applies_them_after_it() {
    let (job, map, [_, _, s2]) = replicated();
    let s0 = ShardId(0);
    let primary = ShardState::new(s0, job.clone(), map.clone());
    let standby = ShardState::new(s2.id, job, map.clone());
    let r = map.ranges_of(s0).next().copied().expect("a range");
    let chunks: Vec<ChunkRef> = (r.start..r.end).map(|k| ChunkRef::new(Key(k), 2)).collect();
    let grads = floats(&vec![-1.0; chunks.len() * 2]);
    let span = |start| DataSpan {
        epoch: 0,
        partition: 0,
        start,
        end: start + 1,
    };
    // One push before the copy, applied on the primary only.
    let parts = [Bytes::from(grads.clone())];
    let before = (
        MapEpoch(1),
        WorkerId(1),
        Clock(0),
        &chunks[..],
        &parts[..],
        Some(&span(0)),
        &[][..],
    );
    assert_eq!(
        primary.push_covering(
            before.0, before.1, before.2, before.3, before.4, before.5, before.6, 0
        ),
        Ok(Claim::Apply)
    );
    // The coordinator's map with s2 a new backup of the range; the primary copies it.
    let seeded = map.with_backup(r.start, r.end, &s2);
    let copy = primary
        .copy((r.start, r.end, s2.id), &seeded)
        .expect("copied");
    // A push after the copy is forwarded to s2, marked as seeding; s2 keeps it.
    let after = (
        MapEpoch(2),
        WorkerId(1),
        Clock(1),
        &chunks[..],
        &parts[..],
        Some(&span(1)),
        &[][..],
    );
    let plan = primary.forwards(after);
    let to_s2 = plan
        .iter()
        .find(|f| f.shard == s2.id)
        .expect("forwarded to s2");
    assert!(matches!(
        to_s2.req,
        Request::Replicate { seeding: true, .. }
    ));
    primary
        .push_forwarding(after, 0, &mut || {})
        .expect("applied");
    let kept = Kept::new(
        MapEpoch(2),
        WorkerId(1),
        Clock(1),
        chunks.clone(),
        to_s2.payload.0.clone(),
        Some(span(1)),
        Vec::new(),
    );
    // A push that does not hold its chunks as they say (bf16 values, one cut off) is refused
    // before it is kept, not acknowledged and found bad when the copy comes.
    let bad = Kept::new(
        MapEpoch(2),
        WorkerId(1),
        Clock(1),
        chunks.iter().map(|c| c.coded(Wire::Bf16, false)).collect(),
        vec![Bytes::from(vec![0u8; floats_in(&chunks) as usize * 2 - 2])],
        Some(span(1)),
        Vec::new(),
    );
    let refused = standby.keep_or_replicate(bad);
    assert!(
        matches!(&refused, Some(Err(r)) if r.code == ErrorCode::ShapeMismatch),
        "{refused:?}"
    );
    assert_eq!(standby.keep_or_replicate(kept), Some(Ok(Claim::Apply)));
    assert_eq!(standby.stats().backups, Vec::new(), "nothing held yet");
    // The copy arrives: the kept push is applied over it.
    standby.seed(r.start, r.end, &seeded, copy).expect("seeded");
    primary.seeded(s2.id, r.start, r.end);
    assert_eq!(
        standby.stats().backups,
        vec![KeyRange {
            start: r.start,
            end: r.end
        }]
    );
    // Promoted (s0 and then s1 gone), s2's copy equals the primary's: both pushes, each once.
    let promoted = seeded
        .without(s0, &[])
        .and_then(|m| m.without(ShardId(1), &[]))
        .expect("s0 and s1 held keys");
    assert!(standby.adopt_map(&promoted));
    for c in &chunks {
        assert_eq!(standby.param(c.key, 0), Some(2.0), "{}", c.key);
        assert_eq!(standby.param(c.key, 0), primary.param(c.key, 0));
    }
    let ledger = standby.ledger_report();
    assert_eq!(
        (ledger[0].applied, ledger[0].duplicates),
        (2, 0),
        "{ledger:?}"
    );
}
