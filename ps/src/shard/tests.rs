//! Unit tests of the shard module.

use super::*;
use edl_shared::proto::job::{RangeOwner, ShardInfo};
use edl_shared::proto::{ModelSpec, OptimizerSpec, TensorSpec};

fn state(consistency: Consistency) -> ShardState {
    let job = JobConfig {
        model: ModelSpec::Custom,
        tensors: vec![TensorSpec {
            name: "c".into(),
            shape: vec![6],
            init: Init::Zeros,
        }],
        chunk_size: 4,
        optimizer: OptimizerSpec::Sgd { lr: 1.0 },
        consistency,
        batch_size: 1,
        epochs: 1,
        partition_size: 1,
        train_samples: 1,
        seed: 0,
        lease_ms: 1000,
    };
    let map = ShardMap {
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
    let mut out = vec![0.0; f.payload.len() / 4];
    bytes_to_f32s(&f.payload, &mut out).expect("floats");
    out
}

const BOTH: [ChunkRef; 2] = [
    ChunkRef {
        key: Key(0),
        len: 4,
    },
    ChunkRef {
        key: Key(1),
        len: 2,
    },
];

#[test]
fn bad_pushes_change_nothing() {
    let st = state(Consistency::Asp);
    let w = WorkerId(1);
    let good = floats(&[-1.0; 6]);
    let mut nan = good.clone();
    nan[20..24].copy_from_slice(&f32::NAN.to_le_bytes());
    let cases: Vec<(MapEpoch, Vec<ChunkRef>, Vec<u8>, ErrorCode)> = vec![
        (MapEpoch(1), BOTH.to_vec(), nan, ErrorCode::NonFinite),
        (
            MapEpoch(1),
            BOTH.to_vec(),
            good[..20].to_vec(),
            ErrorCode::ShapeMismatch,
        ),
        (
            MapEpoch(0),
            BOTH.to_vec(),
            good.clone(),
            ErrorCode::StaleEpoch,
        ),
        (
            MapEpoch(1),
            vec![
                BOTH[0],
                ChunkRef {
                    key: Key(7),
                    len: 2,
                },
            ],
            good.clone(),
            ErrorCode::UnknownKey,
        ),
        (
            MapEpoch(1),
            vec![
                ChunkRef {
                    key: Key(0),
                    len: 3,
                },
                ChunkRef {
                    key: Key(1),
                    len: 3,
                },
            ],
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
