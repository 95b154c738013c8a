//! Unit tests of stragglers, preemption notices and placements in the state machine.

use std::time::{Duration, Instant};

use edl_shared::proto::ids::{Clock, WorkerId};
use edl_shared::proto::msg::EventKind;
use edl_shared::proto::place::{
    PlacementKind, PlacementState, ReplaceReason, StragglerPolicy, StragglerSettings,
};
use edl_shared::proto::{Consistency, ErrorCode};

use super::super::tests::job;
use super::super::{CoordinatorState, Poll};

fn ready<T: std::fmt::Debug>(p: Poll<T>) -> T {
    match p {
        Poll::Ready(v) => v,
        other => panic!("expected Ready, got {other:?}"),
    }
}

/// A job with `n` workers, judged over windows of 5 steps under `policy`.
fn cluster(n: usize, policy: StragglerPolicy) -> (CoordinatorState, Vec<WorkerId>, Instant) {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1);
    st.set_stragglers(StragglerSettings {
        policy,
        factor: 1.5,
        window: 5,
    })
    .expect("settings");
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let ids = (0..n)
        .map(|i| ready(st.register(&format!("w{i}"), "x", t0, t0)).0)
        .collect();
    (st, ids, t0)
}

/// One step of every worker in `ids`, each busy for its entry of `busy_ms`, starting at `t`;
/// returns the time after the slowest.
fn round(st: &mut CoordinatorState, ids: &[WorkerId], busy_ms: &[u64], t: Instant) -> Instant {
    for (w, ms) in ids.iter().zip(busy_ms) {
        let clock = st
            .members(t)
            .into_iter()
            .find(|m| m.id == *w)
            .expect("member")
            .clock;
        st.granted(*w, t);
        st.advance(
            *w,
            Clock(clock.0 + 1),
            0,
            1,
            0.5,
            None,
            t + Duration::from_millis(*ms),
        )
        .expect("advance");
    }
    t + Duration::from_millis(busy_ms.iter().copied().max().unwrap_or(0))
}

fn events(st: &CoordinatorState, kind: EventKind) -> Vec<WorkerId> {
    st.trace(0)
        .events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.worker)
        .collect()
}

#[test]
fn a_slow_worker_is_flagged_after_a_window_and_replaced() {
    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Replace);
    // Four rounds: not a full window yet, nobody judged.
    for _ in 0..4 {
        t = round(&mut st, &ids, &[10, 11, 30], t);
    }
    assert!(events(&st, EventKind::Straggler).is_empty());
    t = round(&mut st, &ids, &[10, 11, 30], t);
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[2]]);
    let info = st
        .members(t)
        .into_iter()
        .find(|m| m.id == ids[2])
        .expect("member");
    assert!(info.straggler && info.straggler_score > 2.5, "{info:?}");
    let fast = st
        .members(t)
        .into_iter()
        .find(|m| m.id == ids[0])
        .expect("member");
    assert!(!fast.straggler && fast.straggler_score < 1.0, "{fast:?}");
    // A replacement is requested once, however long the straggler stays slow.
    for _ in 0..3 {
        t = round(&mut st, &ids, &[10, 11, 30], t);
    }
    let placements = st.placements();
    assert_eq!(placements.len(), 1, "{placements:?}");
    let p = &placements[0];
    assert_eq!(
        p.kind,
        PlacementKind::Replace {
            old: ids[2],
            reason: ReplaceReason::Straggler
        }
    );
    assert_eq!(events(&st, EventKind::ReplaceRequested), vec![ids[2]]);
    // The straggler keeps training until its replacement is admitted; then it is drained.
    assert!(!st.members(t).iter().any(|m| m.draining));
    let (new, ..) = ready(st.register("p1", "x", t, t));
    st.placed(new, p.id);
    assert_eq!(
        st.placements()[0].state,
        PlacementState::Done { worker: new }
    );
    let old = st
        .members(t)
        .into_iter()
        .find(|m| m.id == ids[2])
        .expect("member");
    assert!(old.draining);
    assert!(matches!(st.may_proceed(ids[2]), Poll::Ready((_, true))));
    assert_eq!(
        st.members(t)
            .iter()
            .find(|m| m.id == new)
            .and_then(|m| m.placement),
        Some(p.id)
    );
    assert!(!st.take_news().is_empty());
}

#[test]
fn ignore_flags_only_drop_drains_and_a_recovered_worker_is_unflagged() {
    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Ignore);
    for _ in 0..5 {
        t = round(&mut st, &ids, &[10, 10, 40], t);
    }
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[2]]);
    assert!(st.placements().is_empty());
    assert!(!st.members(t).iter().any(|m| m.draining));
    // Back to speed: once its window's median is, it is no longer a straggler.
    for _ in 0..5 {
        t = round(&mut st, &ids, &[10, 10, 10], t);
    }
    assert_eq!(events(&st, EventKind::Recovered), vec![ids[2]]);

    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Drop);
    for _ in 0..5 {
        t = round(&mut st, &ids, &[10, 40, 10], t);
    }
    let m = st.members(t);
    assert!(m.iter().find(|m| m.id == ids[1]).expect("member").draining);
    assert!(st.placements().is_empty());
}

#[test]
fn consistency_waits_are_not_counted_as_work() {
    // Under BSP the fast workers wait for the slow one at every grant; their busy time runs
    // from the grant, so only the slow one is flagged.
    let (mut st, ids, mut t) = cluster(4, StragglerPolicy::Ignore);
    for _ in 0..6 {
        t = round(&mut st, &ids, &[10, 10, 10, 30], t);
        // The others' grants come only once the straggler reported: 20 ms later.
        t += Duration::from_millis(20);
    }
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[3]]);
    let step = st
        .members(t)
        .into_iter()
        .find(|m| m.id == ids[0])
        .expect("member")
        .step_ms;
    assert!((step - 10.0).abs() < 1.0, "{step}");
}

#[test]
fn a_preempted_worker_trains_on_until_its_substitute_arrives() {
    let (mut st, ids, t) = cluster(2, StragglerPolicy::Replace);
    let p = st
        .preempt(ids[0], Duration::from_secs(5), t)
        .expect("preempt")
        .expect("a placement under replace");
    assert_eq!(
        p.kind,
        PlacementKind::Replace {
            old: ids[0],
            reason: ReplaceReason::Preempt
        }
    );
    // It knows its deadline, and is not asked to leave before its substitute is admitted.
    let (drain, left) = st.beat(ids[0], t + Duration::from_secs(1)).expect("beat");
    assert!(!drain);
    let left = left.expect("a deadline");
    assert!((3900..=4000).contains(&left), "{left}");
    assert_eq!(st.beat(ids[1], t).expect("beat"), (false, None));
    assert_eq!(events(&st, EventKind::Preempt), vec![ids[0]]);
    let (new, ..) = ready(st.register("p1", "x", t, t));
    st.placed(new, p.id);
    assert_eq!(
        st.placements()[0].state,
        PlacementState::Done { worker: new }
    );
    assert!(st.beat(ids[0], t).expect("beat").0, "drained once replaced");

    // A worker that leaves at its deadline before the substitute arrives: the placement
    // stays pending until one is admitted.
    let (mut st, ids, t) = cluster(2, StragglerPolicy::Replace);
    let p = st
        .preempt(ids[0], Duration::from_secs(5), t)
        .expect("preempt")
        .expect("placement");
    st.leave(ids[0]).expect("leave");
    assert!(st.placements()[0].is_pending());
    let (new, ..) = ready(st.register("p1", "x", t, t));
    st.placed(new, p.id);
    assert_eq!(
        st.placements()[0].state,
        PlacementState::Done { worker: new }
    );

    // A substitute the placer cannot start: the worker no longer waits for it.
    let (mut st, ids, t) = cluster(2, StragglerPolicy::Replace);
    let p = st
        .preempt(ids[0], Duration::from_secs(5), t)
        .expect("preempt")
        .expect("placement");
    st.placement_failed(p.id, &"x".repeat(10_000))
        .expect("failed");
    assert!(st.beat(ids[0], t).expect("beat").0);
    match &st.placements()[0].state {
        PlacementState::Failed { reason } => assert_eq!(reason.len(), 256),
        other => panic!("{other:?}"),
    }

    // Without policy replace, no substitute: drained at once.
    let (mut st, ids, t) = cluster(2, StragglerPolicy::Ignore);
    assert_eq!(st.preempt(ids[0], Duration::from_secs(5), t), Ok(None));
    assert!(st.beat(ids[0], t).expect("beat").0);
    assert!(st.preempt(WorkerId(99), Duration::from_secs(5), t).is_err());
    // A notice past any cloud's (or one that would overflow the clock) is refused, unchanged.
    assert_eq!(
        st.preempt(ids[1], Duration::from_millis(u64::MAX), t)
            .map_err(|e| e.0),
        Err(ErrorCode::InvalidRequest)
    );
    assert_eq!(st.beat(ids[1], t).expect("beat"), (false, None));
}

#[test]
fn migration_and_resizes_make_placements() {
    let (mut st, ids, t) = cluster(2, StragglerPolicy::Ignore);
    let m = st
        .migrate(ids[0], Some("slot3".into()), t)
        .expect("migrate");
    assert_eq!(m.slot.as_deref(), Some("slot3"));
    // Asking again while it is pending gives the same placement.
    assert_eq!(st.migrate(ids[0], None, t).expect("again").id, m.id);
    st.drain(ids[1]).expect("drain");
    assert_eq!(
        st.migrate(ids[1], None, t).map_err(|e| e.0),
        Err(ErrorCode::Conflict)
    );

    // Grow 1 -> 3: two placements; shrink to 2 before they are placed: one cancelled.
    let (mut st, ids, t) = cluster(1, StragglerPolicy::Ignore);
    let placed = st.scale(3, t).expect("grow").placed;
    assert_eq!(placed.len(), 2);
    let r = st.scale(2, t).expect("shrink");
    assert!(r.placed.is_empty() && r.drained.is_empty());
    assert_eq!(r.cancelled, vec![placed[1]]);
    // Both placed workers arrive (one for a cancelled placement: admitted as an extra).
    let (a, ..) = ready(st.register("p1", "x", t, t));
    st.placed(a, placed[0]);
    let (b, ..) = ready(st.register("p2", "x", t, t));
    st.placed(b, placed[1]);
    assert_eq!(
        st.placements()
            .iter()
            .find(|p| p.id == placed[1])
            .map(|p| p.state.clone()),
        Some(PlacementState::Cancelled)
    );
    // Shrink to 1: the newest two are drained, the first stays.
    let r = st.scale(1, t).expect("shrink");
    assert_eq!(r.drained, vec![b, a]);
    assert!(!st.members(t).iter().any(|m| m.id == ids[0] && m.draining));
    assert_eq!(
        st.scale(u32::MAX, t).map_err(|e| e.0),
        Err(ErrorCode::InvalidRequest)
    );
    // Shrinking drains a worker whose replacement is pending: the replacement is cancelled.
    let m = st.migrate(a, None, t);
    assert!(m.is_err(), "a is draining");
    let keep = st.migrate(ids[0], None, t).expect("migrate").id;
    let (c, ..) = ready(st.register("p3", "x", t, t));
    let m = st.migrate(c, None, t).expect("migrate").id;
    let r = st.scale(1, t).expect("shrink");
    assert_eq!(r.drained, vec![c]);
    assert_eq!(r.cancelled, vec![m]);
    assert!(
        st.placements()
            .iter()
            .any(|p| p.id == keep && p.is_pending())
    );
    // A placer's failure is recorded; a second one is refused.
    let placed = st.scale(2, t).expect("grow").placed;
    st.placement_failed(placed[0], "no slot").expect("failed");
    assert!(st.placement_failed(placed[0], "again").is_err());
}

#[test]
fn changing_the_window_judges_afresh_and_other_settings_do_not() {
    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Ignore);
    for _ in 0..5 {
        t = round(&mut st, &ids, &[10, 10, 40], t);
    }
    let flagged = |st: &CoordinatorState| st.members(t).iter().filter(|m| m.straggler).count();
    assert_eq!(flagged(&st), 1);
    let mut s = st.stragglers();
    s.policy = StragglerPolicy::Drop;
    st.set_stragglers(s).expect("policy");
    assert_eq!(flagged(&st), 1, "a policy change keeps the windows");
    s.window = 4;
    st.set_stragglers(s).expect("window");
    assert_eq!(flagged(&st), 0, "a new window starts afresh");
    assert!(st.members(t).iter().all(|m| m.step_ms == 0.0));
}

#[test]
fn bad_settings_are_refused() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1);
    let bad = StragglerSettings {
        factor: 0.5,
        ..StragglerSettings::default()
    };
    assert_eq!(
        st.set_stragglers(bad).map_err(|e| e.0),
        Err(ErrorCode::InvalidRequest)
    );
    assert_eq!(st.stragglers(), StragglerSettings::default());
}

#[test]
fn scaling_to_zero_suspends_the_job() {
    let (mut st, ids, t) = cluster(2, StragglerPolicy::Ignore);
    let placed = st.scale(3, t).expect("grow").placed;
    let r = st.scale(0, t).expect("suspend");
    assert_eq!(r.cancelled, placed);
    let mut drained = r.drained.clone();
    drained.sort();
    assert_eq!(drained, ids);
    assert!(st.members(t).iter().all(|m| m.draining));
    // Scaling up again asks for workers afresh.
    assert_eq!(st.scale(2, t).expect("resume").placed.len(), 2);
}
