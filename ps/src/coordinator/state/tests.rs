//! Unit tests of the state module.

use super::*;
use edl_shared::proto::{Consistency, ModelSpec, OptimizerSpec};

fn job(consistency: Consistency) -> JobConfig {
    JobConfig {
        model: ModelSpec::Custom,
        tensors: ModelSpec::mlp_tensors(&[4, 3]),
        chunk_size: 4,
        optimizer: OptimizerSpec::Sgd { lr: 0.1 },
        consistency,
        batch_size: 2,
        epochs: 1,
        partition_size: 4,
        train_samples: 8,
        seed: 1,
        lease_ms: 1000,
    }
}

fn ready<T: std::fmt::Debug>(p: Poll<T>) -> T {
    match p {
        Poll::Ready(v) => v,
        other => panic!("expected Ready, got {other:?}"),
    }
}

#[test]
fn ssp_bound_holds_and_dead_workers_stop_counting() {
    let mut st = CoordinatorState::new(job(Consistency::Ssp { staleness: 1 }), 1);
    let t0 = Instant::now();
    assert!(matches!(st.register("a", "x", t0, t0), Poll::Pending));
    st.shard_join("s0", "127.0.0.1:1").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let (b, ..) = ready(st.register("b", "x", t0, t0));
    st.advance(a, Clock(1), 0, 2, 1.0, None, t0)
        .expect("advance");
    assert!(matches!(st.may_proceed(a), Poll::Ready((Clock(0), false))));
    st.advance(a, Clock(2), 0, 2, 1.0, None, t0)
        .expect("advance");
    // a is two clocks ahead of b with s = 1: it must wait.
    assert!(matches!(st.may_proceed(a), Poll::Pending));
    // b never heartbeats: once its lease expires it stops counting.
    st.heartbeat(a, t0 + Duration::from_millis(900))
        .expect("hb");
    let dead = st.expire_leases(t0 + Duration::from_millis(1500));
    assert_eq!(dead, vec![b]);
    assert!(matches!(st.may_proceed(a), Poll::Ready((Clock(2), false))));
    assert!(st.heartbeat(b, t0).is_err());
    // A newcomer enters at the current minimum clock.
    let (_, _, _, c) = ready(st.register("c", "x", t0, t0));
    assert_eq!(c, Clock(2));
}

#[test]
fn partitions_of_a_dead_worker_are_reissued_from_the_committed_position() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1);
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let (b, ..) = ready(st.register("b", "x", t0, t0));
    let pa = ready(st.next_partition(a, t0)).0.expect("partition");
    let pb = ready(st.next_partition(b, t0)).0.expect("partition");
    assert!(matches!(st.next_partition(b, t0), Poll::Pending));
    let span = |p: Partition, start: u32, end: u32| {
        Some(DataSpan {
            epoch: p.epoch,
            partition: p.index,
            start,
            end,
        })
    };
    let (b0, b1) = (pb.start, pb.start + 2);
    st.advance(b, Clock(1), 0, 2, 1.0, span(pb, b0, b1), t0)
        .expect("commit");
    // A span that does not continue the lease is refused and changes nothing.
    let gap = st.advance(b, Clock(2), 0, 1, 1.0, span(pb, b1 + 1, b1 + 2), t0);
    assert!(gap.is_err());
    let foreign = st.advance(b, Clock(2), 0, 2, 1.0, span(pa, pa.start, pa.start + 2), t0);
    assert!(foreign.is_err(), "a span of another worker's lease");
    st.advance(b, Clock(2), 0, 2, 1.0, span(pb, b1, b1 + 2), t0)
        .expect("commit the rest");
    // a commits half of its partition, then goes silent.
    st.advance(a, Clock(1), 0, 2, 1.0, span(pa, pa.start, pa.start + 2), t0)
        .expect("commit");
    st.heartbeat(b, t0 + Duration::from_millis(1100))
        .expect("hb");
    assert_eq!(st.expire_leases(t0 + Duration::from_millis(1200)), vec![a]);
    let again = ready(st.next_partition(b, t0)).0.expect("reissued");
    assert_eq!(
        again,
        Partition {
            start: pa.start + 2,
            len: 2,
            ..pa
        }
    );
    assert!(!st.finished());
    st.advance(
        b,
        Clock(3),
        0,
        2,
        1.0,
        span(again, again.start, again.start + 2),
        t0,
    )
    .expect("commit");
    assert!(st.finished());
    assert_eq!(st.status(t0).epochs[0].samples, 8);
    assert_eq!(ready(st.next_partition(b, t0)).0, None);
}

#[test]
fn a_worker_waiting_for_data_does_not_hold_back_the_others() {
    let mut st = CoordinatorState::new(job(Consistency::Bsp), 1);
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let (b, ..) = ready(st.register("b", "x", t0, t0));
    st.set_idle(a).expect("idle");
    let pa = ready(st.next_partition(a, t0)).0.expect("partition");
    st.set_idle(b).expect("idle");
    let pb = ready(st.next_partition(b, t0)).0.expect("partition");
    for (c, start) in [(1, pa.start), (2, pa.start + 2)] {
        let span = DataSpan {
            epoch: 0,
            partition: pa.index,
            start,
            end: start + 2,
        };
        st.advance(a, Clock(c), 0, 2, 1.0, Some(span), t0)
            .expect("commit");
    }
    st.set_idle(a).expect("idle");
    assert!(matches!(st.next_partition(a, t0), Poll::Pending));
    // Under BSP, b would wait for a at every step if a still counted.
    for c in 1..=3 {
        st.advance(b, Clock(c), 0, 2, 1.0, None, t0)
            .expect("advance");
        assert!(
            matches!(st.may_proceed(b), Poll::Ready(_)),
            "b blocked at {c}"
        );
    }
    // b dies; its partition returns and a re-enters at the clock b reached.
    st.heartbeat(a, t0 + Duration::from_millis(900))
        .expect("hb");
    assert_eq!(st.expire_leases(t0 + Duration::from_millis(1100)), vec![b]);
    let (p, clock) = ready(st.next_partition(a, t0));
    assert_eq!(p, Some(pb));
    assert_eq!(clock, Clock(3));
    st.advance(a, Clock(4), 0, 2, 1.0, None, t0)
        .expect("advance from the re-entry clock");
}

#[test]
fn bad_reports_change_nothing() {
    let mut st = CoordinatorState::new(job(Consistency::Bsp), 1);
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    assert!(st.advance(a, Clock(1), 0, 2, f64::NAN, None, t0).is_err());
    assert!(st.advance(a, Clock(1), 7, 2, 1.0, None, t0).is_err());
    assert!(st.advance(a, Clock(5), 0, 2, 1.0, None, t0).is_err());
    assert!(
        st.advance(WorkerId(99), Clock(1), 0, 2, 1.0, None, t0)
            .is_err()
    );
    assert_eq!(st.status(t0).samples_done, 0);
}
