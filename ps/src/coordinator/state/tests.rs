//! Unit tests of the state module.

use super::*;
use edl_shared::proto::{Consistency, ModelSection, OptimizerSpec};

/// A small job: 8 samples in partitions of 4, one epoch, a 1 s lease.
pub(crate) fn job(consistency: Consistency) -> JobConfig {
    JobConfig {
        model: ModelSection::custom(),
        tensors: edl_shared::models::Builtin::tensors(&edl_shared::models::Mlp {
            layers: vec![4, 3],
        }),
        chunk_size: 4,
        optimizer: OptimizerSpec::sgd(0.1),
        optimizer_groups: Vec::new(),
        schedule: Default::default(),
        consistency,
        batch_size: 2,
        epochs: 1,
        partition_size: 4,
        train_samples: 8,
        seed: 1,
        lease_ms: 1000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
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
    let mut st = CoordinatorState::new(job(Consistency::Ssp { staleness: 1 }), 1, Instant::now());
    let t0 = Instant::now();
    assert!(matches!(st.register("a", "x", t0, t0), Poll::Pending));
    st.shard_join("s0", "127.0.0.1:1").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let (b, ..) = ready(st.register("b", "x", t0, t0));
    st.advance(a, Clock(1), 0, 2, 1.0, None, (0, 0), t0)
        .expect("advance");
    assert!(matches!(st.may_proceed(a), Poll::Ready((Clock(0), false))));
    st.advance(a, Clock(2), 0, 2, 1.0, None, (0, 0), t0)
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

/// A coordinator that did not run (stopped, starved) renews every lease on waking: a worker
/// it could not hear meanwhile is not dropped for the coordinator's own absence, and one that
/// stays silent afterwards is dropped a whole lease later.
#[test]
fn leases_start_again_after_the_coordinator_did_not_run() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1, Instant::now());
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let (b, ..) = ready(st.register("b", "x", t0, t0));
    st.leave(b, t0).expect("leave");
    // Stopped for 5 s (the lease is 1 s): on waking, before the sweep, leases start again.
    let woke = t0 + Duration::from_secs(5);
    assert_eq!(st.renew_leases(woke), 1, "only the active worker");
    assert!(st.expire_leases(woke).is_empty());
    assert!(
        st.expire_leases(woke + Duration::from_millis(900))
            .is_empty()
    );
    assert_eq!(
        st.expire_leases(woke + Duration::from_millis(1100)),
        vec![a]
    );
}

#[test]
fn partitions_of_a_dead_worker_are_reissued_from_the_committed_position() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1, Instant::now());
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let (b, ..) = ready(st.register("b", "x", t0, t0));
    let pa = ready(st.next_partition(a, t0)).0.expect("partition");
    let pb = ready(st.next_partition(b, t0)).0.expect("partition");
    // Asking again (an answer lost with its connection) gives the same lease, not a second.
    assert_eq!(ready(st.next_partition(b, t0)).0, Some(pb));
    let span = |p: Partition, start: u32, end: u32| {
        Some(DataSpan {
            epoch: p.epoch,
            partition: p.index,
            start,
            end,
        })
    };
    let (b0, b1) = (pb.start, pb.start + 2);
    st.advance(b, Clock(1), 0, 2, 1.0, span(pb, b0, b1), (0, 0), t0)
        .expect("commit");
    // A span that does not continue the lease is refused and changes nothing.
    let gap = st.advance(b, Clock(2), 0, 1, 1.0, span(pb, b1 + 1, b1 + 2), (0, 0), t0);
    assert!(gap.is_err());
    let foreign = st.advance(
        b,
        Clock(2),
        0,
        2,
        1.0,
        span(pa, pa.start, pa.start + 2),
        (0, 0),
        t0,
    );
    assert!(foreign.is_err(), "a span of another worker's lease");
    // Half committed, the lease is asked for again: the rest of it comes back.
    let rest = ready(st.next_partition(b, t0)).0;
    assert_eq!(
        rest,
        Some(Partition {
            start: b1,
            len: 2,
            ..pb
        })
    );
    st.advance(b, Clock(2), 0, 2, 1.0, span(pb, b1, b1 + 2), (0, 0), t0)
        .expect("commit the rest");
    assert!(
        matches!(st.next_partition(b, t0), Poll::Pending),
        "no data is left"
    );
    // a commits half of its partition, then goes silent.
    st.advance(
        a,
        Clock(1),
        0,
        2,
        1.0,
        span(pa, pa.start, pa.start + 2),
        (0, 0),
        t0,
    )
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
        (0, 0),
        t0,
    )
    .expect("commit");
    assert!(st.finished());
    assert_eq!(st.status(t0).epochs[0].samples, 8);
    assert_eq!(ready(st.next_partition(b, t0)).0, None);
}

#[test]
fn a_worker_waiting_for_data_does_not_hold_back_the_others() {
    let mut st = CoordinatorState::new(job(Consistency::Bsp), 1, Instant::now());
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
        st.advance(a, Clock(c), 0, 2, 1.0, Some(span), (0, 0), t0)
            .expect("commit");
    }
    st.set_idle(a).expect("idle");
    assert!(matches!(st.next_partition(a, t0), Poll::Pending));
    // Under BSP, b would wait for a at every step if a still counted.
    for c in 1..=3 {
        st.advance(b, Clock(c), 0, 2, 1.0, None, (0, 0), t0)
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
    st.advance(a, Clock(4), 0, 2, 1.0, None, (0, 0), t0)
        .expect("advance from the re-entry clock");
}

#[test]
fn bad_reports_change_nothing() {
    let mut st = CoordinatorState::new(job(Consistency::Bsp), 1, Instant::now());
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    assert!(
        st.advance(a, Clock(1), 0, 2, f64::NAN, None, (0, 0), t0)
            .is_err()
    );
    assert!(
        st.advance(a, Clock(1), 7, 2, 1.0, None, (0, 0), t0)
            .is_err()
    );
    assert!(
        st.advance(a, Clock(5), 0, 2, 1.0, None, (0, 0), t0)
            .is_err()
    );
    assert!(
        st.advance(WorkerId(99), Clock(1), 0, 2, 1.0, None, (0, 0), t0)
            .is_err()
    );
    assert_eq!(st.status(t0).samples_done, 0);
}

#[test]
fn shards_are_known_by_the_names_operators_gave_them() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 3, Instant::now());
    // Join order is not name order: ids follow the names.
    let s1 = st.shard_join("s1", "127.0.0.1:2").expect("join");
    let gpu = st.shard_join("gpu-a", "127.0.0.1:9").expect("join");
    let s0 = st.shard_join("s0", "127.0.0.1:1").expect("join");
    assert_eq!((s0, s1), (ShardId(0), ShardId(1)));
    assert_eq!(
        gpu,
        ShardId(3),
        "a name without a number gets an id past the expected ones"
    );
    assert_eq!(st.resolve_shard("s0"), Ok(ShardId(0)));
    assert_eq!(st.resolve_shard("gpu-a"), Ok(ShardId(3)));
    assert_eq!(st.resolve_shard("127.0.0.1:2"), Ok(ShardId(1)));
    let err = st.resolve_shard("s2").expect_err("no shard is named s2");
    assert!(
        err.1.contains("\"s2\"") && err.1.contains("gpu-a"),
        "{err:?}"
    );
    // A name whose id is taken gets one past the highest.
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1, Instant::now());
    st.shard_join("s1", "a").expect("join");
    st.shard_join("x", "a2").expect("join");
    assert_eq!(st.shard_join("s1-b", "b"), Ok(ShardId(3)));
    assert_eq!(st.resolve_shard("x"), Ok(ShardId(2)));
    let listed = st.shard_list();
    let named = listed.iter().find(|e| e.id == ShardId(3)).expect("listed");
    assert_eq!(named.name, "s1-b");
}

#[test]
fn a_rebalance_spreads_keys_over_standby_shards_too() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 2, Instant::now());
    st.shard_join("s0", "a").expect("join");
    st.shard_join("s1", "b").expect("join");
    let s2 = st.shard_join("s2", "c").expect("join");
    let t0 = Instant::now();
    // Everything moves to s2; s0 and s1 stand by.
    let keys = st.map().expect("formed").num_keys();
    for mv in st.plan_move(0, keys, s2).expect("plan") {
        let map = st.map_after(mv).expect("map");
        let report = mv.report(map.epoch);
        st.commit_move(map, report, t0);
    }
    assert_eq!(st.map().expect("map").owners_in_order(), vec![s2]);
    let plan = st.plan_rebalance(&st.key_sizes()).expect("plan");
    let targets: std::collections::BTreeSet<ShardId> = plan.iter().map(|m| m.to).collect();
    assert_eq!(
        targets,
        [ShardId(0), ShardId(1)].into_iter().collect(),
        "{plan:?}"
    );
}

#[test]
fn maps_never_share_an_epoch_and_a_pending_move_survives_a_restart() {
    let t0 = Instant::now();
    let mut st = CoordinatorState::new(job(Consistency::Asp), 2, t0);
    st.shard_join("s0", "a").expect("join");
    let s1 = st.shard_join("s1", "b").expect("join");
    let formed = st.map().expect("formed");
    let mv = st.plan_move(0, 1, s1).expect("plan")[0];
    // A move's map is above the current one and recorded as pending, across a restart.
    let attempted = st.begin_move(mv).expect("begin");
    assert!(attempted.epoch > formed.epoch);
    let job = st.job().clone();
    let mut st = CoordinatorState::restore(st.snapshot(), &job, 2, t0).expect("restore");
    assert_eq!(st.pending_move(), Some((mv, attempted.clone())));
    // Given up: the placement again, above the attempted map, and nothing pending.
    let again = st.republish().expect("republish");
    st.drop_pending();
    assert!(again.epoch > attempted.epoch);
    assert_eq!(again.ranges, formed.ranges);
    assert_eq!(st.map().expect("map"), again);
    // The next move's map is above both, and its commit clears it.
    let next = st.begin_move(mv).expect("begin");
    assert!(next.epoch > again.epoch);
    st.commit_move(next.clone(), mv.report(next.epoch), t0);
    assert_eq!(st.pending_move(), None);
    assert_eq!(st.map().expect("map"), next);
}

#[test]
fn the_trace_is_served_in_pages_and_capped() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1, Instant::now());
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let steps = TRACE_PAGE as u64 + 10;
    for c in 1..=steps {
        st.advance(a, Clock(c), 0, 0, 0.0, None, (0, 0), t0)
            .expect("advance");
    }
    let first = st.trace(0);
    assert_eq!(first.steps.len(), TRACE_PAGE);
    assert!(first.more);
    let second = st.trace(first.next_step);
    assert_eq!(second.first_step, TRACE_PAGE as u64);
    assert_eq!(second.steps.len(), 10);
    assert!(!second.more);
    assert_eq!(second.steps.last().map(|s| s.clock), Some(Clock(steps)));
    // Departed workers past the cap are forgotten, oldest first.
    for i in 0..MAX_DEPARTED + 5 {
        let (w, ..) = ready(st.register(&format!("w{i}"), "x", t0, t0));
        st.leave(w, Instant::now()).expect("leave");
    }
    let departed = st
        .workers
        .values()
        .filter(|w| w.state != WorkerState::Active)
        .count();
    assert_eq!(departed, MAX_DEPARTED);
    assert!(st.events.len() <= MAX_EVENT_RECORDS);
    assert!(st.dropped.0 > 0, "old events were dropped and counted");
}

#[test]
fn commits_lost_with_a_crash_are_counted_when_the_worker_resumes() {
    let j = job(Consistency::Asp);
    let mut st = CoordinatorState::new(j.clone(), 1, Instant::now());
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    let p = ready(st.next_partition(a, t0)).0.expect("partition");
    let span = |start: u32| {
        Some(DataSpan {
            epoch: p.epoch,
            partition: p.index,
            start,
            end: start + 1,
        })
    };
    st.advance(a, Clock(1), 0, 1, 1.0, span(p.start), (0, 0), t0)
        .expect("commit");
    let saved = st.snapshot();
    // Two more steps are committed, then the coordinator crashes before saving them.
    st.advance(a, Clock(2), 0, 1, 1.0, span(p.start + 1), (0, 0), t0)
        .expect("commit");
    st.advance(a, Clock(3), 0, 1, 1.0, span(p.start + 2), (0, 0), t0)
        .expect("commit");
    let mut back = CoordinatorState::restore(saved, &j, 1, t0).expect("restore");
    assert_eq!(back.status(t0).samples_done, 1);
    // The worker goes on where it was: its next span shows the two lost commits.
    back.advance(a, Clock(4), 0, 1, 1.0, span(p.start + 3), (0, 0), t0)
        .expect("resume");
    assert_eq!(
        back.status(t0).samples_done,
        4,
        "as many as before the crash, plus one"
    );
    assert_eq!(back.status(t0).epochs[0].samples, 4);
    assert!(back.status(t0).samples_done <= back.status(t0).samples_total);
}

#[test]
fn traffic_reported_with_steps_is_counted_once_per_epoch() {
    let job = JobConfig {
        epochs: 2,
        ..job(Consistency::Asp)
    };
    let mut st = CoordinatorState::new(job, 1, Instant::now());
    let t0 = Instant::now();
    st.shard_join("s0", "127.0.0.1:1").expect("join");
    let (a, ..) = ready(st.register("a", "x", t0, t0));
    st.advance(a, Clock(1), 0, 2, 1.0, None, (400, 800), t0)
        .expect("advance");
    // The same report again (a retry after a long poll timed out) adds nothing.
    st.advance(a, Clock(1), 0, 2, 1.0, None, (400, 800), t0)
        .expect("repeat");
    // A refused report adds nothing either.
    assert!(
        st.advance(a, Clock(5), 0, 2, 1.0, None, (1, 1), t0)
            .is_err()
    );
    st.advance(a, Clock(2), 1, 2, 1.0, None, (40, 80), t0)
        .expect("advance");
    let epochs = st.status(t0).epochs;
    assert_eq!((epochs[0].bytes_pushed, epochs[0].bytes_pulled), (400, 800));
    assert_eq!((epochs[1].bytes_pushed, epochs[1].bytes_pulled), (40, 80));
}
