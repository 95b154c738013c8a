//! Unit tests of stragglers, preemption notices and placements in the state machine.

use std::time::{Duration, Instant};

use edl_shared::proto::ids::{Clock, WorkerId};
use edl_shared::proto::msg::{EventKind, Judgement, WorkerInfo, WorkerState};
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

/// The settings of these tests: windows of 500 ms (a slowdown confirmed over 100 ms), no
/// warm-up, a 2 ms minimum gap.
fn settings(policy: StragglerPolicy) -> StragglerSettings {
    StragglerSettings {
        policy,
        factor: 1.5,
        window_ms: 500,
        min_gap_ms: 2.0,
        warmup_ms: 0,
        ..StragglerSettings::default()
    }
}

/// A job with `n` workers under `settings`.
fn cluster_with(
    n: usize,
    consistency: Consistency,
    settings: StragglerSettings,
) -> (CoordinatorState, Vec<WorkerId>, Instant) {
    let mut st = CoordinatorState::new(job(consistency), 1, Instant::now());
    st.set_stragglers(settings).expect("settings");
    let t0 = Instant::now();
    st.shard_join("s0", "x").expect("join");
    let ids = (0..n)
        .map(|i| ready(st.register(&format!("w{i}"), "127.0.0.1:9", t0, t0)).0)
        .collect();
    (st, ids, t0)
}

/// A job with `n` workers under [`settings`] with `policy`.
fn cluster(n: usize, policy: StragglerPolicy) -> (CoordinatorState, Vec<WorkerId>, Instant) {
    cluster_with(n, Consistency::Asp, settings(policy))
}

/// One step of every worker in `ids`, each busy for its entry of `busy_ms`, starting at `t`;
/// returns the time after the slowest.
fn round(st: &mut CoordinatorState, ids: &[WorkerId], busy_ms: &[f64], t: Instant) -> Instant {
    for (w, ms) in ids.iter().zip(busy_ms) {
        let clock = member(st, *w, t).clock;
        st.granted(*w, t);
        st.advance(
            *w,
            Clock(clock.0 + 1),
            0,
            1,
            0.5,
            None,
            (0, 0),
            t + Duration::from_secs_f64(ms / 1000.0),
        )
        .expect("advance");
    }
    t + Duration::from_secs_f64(busy_ms.iter().copied().fold(0.0, f64::max) / 1000.0)
}

/// `n` rounds of [`round`].
fn rounds(
    st: &mut CoordinatorState,
    ids: &[WorkerId],
    busy_ms: &[f64],
    mut t: Instant,
    n: usize,
) -> Instant {
    for _ in 0..n {
        t = round(st, ids, busy_ms, t);
    }
    t
}

fn member(st: &CoordinatorState, w: WorkerId, t: Instant) -> WorkerInfo {
    st.members(t)
        .into_iter()
        .find(|m| m.id == w)
        .expect("member")
}

fn events(st: &CoordinatorState, kind: EventKind) -> Vec<WorkerId> {
    st.trace(0)
        .events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.worker)
        .collect()
}

fn details(st: &CoordinatorState, kind: EventKind) -> Vec<String> {
    st.trace(0)
        .events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.detail.clone())
        .collect()
}

#[test]
fn a_slow_worker_is_flagged_once_confirmed_and_replaced() {
    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Replace);
    let slow = [10.0, 11.0, 30.0];
    // Two rounds (30 ms each): fewer steps than a judgement needs.
    t = rounds(&mut st, &ids, &slow, t, 2);
    assert_eq!(member(&st, ids[2], t).judged, Judgement::Warming);
    // From the third round it is judged slow, but only confirmed once that held for 100 ms
    // (a fifth of the window): the seventh round ends 120 ms after the third.
    t = rounds(&mut st, &ids, &slow, t, 4);
    assert!(events(&st, EventKind::Straggler).is_empty());
    assert_eq!(member(&st, ids[2], t).judged, Judgement::Suspect);
    t = round(&mut st, &ids, &slow, t);
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[2]]);
    let info = member(&st, ids[2], t);
    assert!(info.straggler && info.straggler_score > 2.5, "{info:?}");
    assert_eq!(info.judged, Judgement::Flagged);
    assert!((info.others_ms - 11.0).abs() < 0.5, "{info:?}");
    // The event carries the evidence: its median and the others'.
    let detail = &details(&st, EventKind::Straggler)[0];
    assert!(
        detail.contains("median 30.0 ms") && detail.contains("11.0 ms") && detail.contains("w1"),
        "{detail}"
    );
    let fast = member(&st, ids[0], t);
    assert!(!fast.straggler && fast.straggler_score < 1.0, "{fast:?}");
    assert_eq!(fast.judged, Judgement::Ok);
    // A replacement is requested once, however long the straggler stays slow.
    t = rounds(&mut st, &ids, &slow, t, 3);
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
    st.placed(new, p.id, Instant::now());
    assert_eq!(
        st.placements()[0].state,
        PlacementState::Done { worker: new }
    );
    assert!(member(&st, ids[2], t).draining);
    assert!(matches!(st.may_proceed(ids[2]), Poll::Ready((_, true))));
    assert_eq!(member(&st, new, t).placement, Some(p.id));
    assert!(!st.take_news().is_empty());
}

#[test]
fn ignore_flags_only_drop_drains_and_a_recovered_worker_is_unflagged_with_hysteresis() {
    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Ignore);
    t = rounds(&mut st, &ids, &[10.0, 10.0, 40.0], t, 8);
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[2]]);
    assert!(st.placements().is_empty());
    assert!(!st.members(t).iter().any(|m| m.draining));
    // Faster, but still above the recovery threshold (1.25x): still a straggler.
    t = rounds(&mut st, &ids, &[10.0, 10.0, 14.0], t, 100);
    assert!(member(&st, ids[2], t).straggler);
    assert!(events(&st, EventKind::Recovered).is_empty());
    // Back to speed: once its window's median is, for 100 ms, it is no longer a straggler.
    t = rounds(&mut st, &ids, &[10.0, 10.0, 10.0], t, 5);
    assert!(
        member(&st, ids[2], t).straggler,
        "recovery is confirmed too"
    );
    rounds(&mut st, &ids, &[10.0, 10.0, 10.0], t, 60);
    assert_eq!(events(&st, EventKind::Recovered), vec![ids[2]]);
    assert!(details(&st, EventKind::Recovered)[0].contains("< 1.25x"));

    let (mut st, ids, t) = cluster(3, StragglerPolicy::Drop);
    let t = rounds(&mut st, &ids, &[10.0, 40.0, 10.0], t, 8);
    let m = st.members(t);
    assert!(m.iter().find(|m| m.id == ids[1]).expect("member").draining);
    assert!(st.placements().is_empty());
}

#[test]
fn consistency_waits_are_not_counted_as_work() {
    // Under BSP the fast workers wait for the slow one at every grant; their busy time runs
    // from the grant, so only the slow one is flagged.
    let (mut st, ids, mut t) = cluster(4, StragglerPolicy::Ignore);
    for _ in 0..10 {
        t = round(&mut st, &ids, &[10.0, 10.0, 10.0, 30.0], t);
        // The others' grants come only once the straggler reported: 20 ms later.
        t += Duration::from_millis(20);
    }
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[3]]);
    let step = member(&st, ids[0], t).step_ms;
    assert!((step - 10.0).abs() < 1.0, "{step}");
}

#[test]
fn a_new_worker_is_not_judged_during_its_warm_up() {
    let warm = StragglerSettings {
        warmup_ms: 1_000,
        ..settings(StragglerPolicy::Ignore)
    };
    let (mut st, ids, t) = cluster_with(3, Consistency::Asp, warm);
    // Its first second is slow (cold caches, first pulls): not judged, not flagged.
    let t = rounds(&mut st, &ids, &[10.0, 10.0, 40.0], t, 24);
    assert!(events(&st, EventKind::Straggler).is_empty());
    assert_eq!(member(&st, ids[2], t).judged, Judgement::Warming);
    // Slow past its warm-up: judged and flagged as any other.
    rounds(&mut st, &ids, &[10.0, 10.0, 40.0], t, 10);
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[2]]);
}

#[test]
fn small_gaps_and_a_machine_slowing_everyone_are_not_stragglers() {
    let (mut st, ids, t) = cluster(3, StragglerPolicy::Ignore);
    // 1.9x, but 0.9 ms: scheduling noise on short steps, under the 2 ms minimum gap.
    let t = rounds(&mut st, &ids, &[1.0, 1.0, 1.9], t, 1_000);
    assert!(events(&st, EventKind::Straggler).is_empty());
    assert!(member(&st, ids[2], t).straggler_score > 1.8);
    // Everyone four times slower at once (a CPU hog beside them): the reference slows too.
    let t = rounds(&mut st, &ids, &[10.0, 10.0, 10.0], t, 100);
    rounds(&mut st, &ids, &[40.0, 41.0, 39.0], t, 100);
    assert!(events(&st, EventKind::Straggler).is_empty());
}

#[test]
fn noisy_identical_workers_are_never_flagged() {
    // Heavy-tailed step times (a busy machine: most steps 8-14 ms, one in ten descheduled
    // for up to 80 ms), from a seeded generator: no flag in 20,000 steps.
    let (mut st, ids, mut t) = cluster(3, StragglerPolicy::Ignore);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 10_000) as f64 / 10_000.0
    };
    for _ in 0..6_667 {
        let busy: Vec<f64> = (0..3)
            .map(|_| {
                let base = 8.0 + 6.0 * next();
                if next() < 0.1 {
                    base + 80.0 * next()
                } else {
                    base
                }
            })
            .collect();
        t = round(&mut st, &ids, &busy, t);
    }
    assert!(events(&st, EventKind::Straggler).is_empty());
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
    st.placed(new, p.id, Instant::now());
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
    st.leave(ids[0], Instant::now()).expect("leave");
    assert!(st.placements()[0].is_pending());
    let (new, ..) = ready(st.register("p1", "x", t, t));
    st.placed(new, p.id, Instant::now());
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
    st.placement_failed(p.id, &"x".repeat(10_000), Instant::now())
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
    st.drain(ids[1], Instant::now()).expect("drain");
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
    st.placed(a, placed[0], Instant::now());
    let (b, ..) = ready(st.register("p2", "x", t, t));
    st.placed(b, placed[1], Instant::now());
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
    st.placement_failed(placed[0], "no slot", Instant::now())
        .expect("failed");
    assert!(
        st.placement_failed(placed[0], "again", Instant::now())
            .is_err()
    );
}

#[test]
fn changing_the_window_judges_afresh_and_other_settings_do_not() {
    let (mut st, ids, t) = cluster(3, StragglerPolicy::Ignore);
    let t = rounds(&mut st, &ids, &[10.0, 10.0, 40.0], t, 8);
    let flagged = |st: &CoordinatorState| st.members(t).iter().filter(|m| m.straggler).count();
    assert_eq!(flagged(&st), 1);
    let mut s = st.stragglers();
    s.policy = StragglerPolicy::Drop;
    st.set_stragglers(s).expect("policy");
    assert_eq!(flagged(&st), 1, "a policy change keeps the windows");
    s.window_ms = 400;
    st.set_stragglers(s).expect("window");
    assert_eq!(flagged(&st), 0, "a new window starts afresh");
    assert!(st.members(t).iter().all(|m| m.step_ms == 0.0));
}

#[test]
fn bad_settings_are_refused() {
    let mut st = CoordinatorState::new(job(Consistency::Asp), 1, Instant::now());
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

#[test]
fn a_worker_holding_the_others_up_is_named_then_dropped_if_the_job_says_so() {
    let stalls = StragglerSettings {
        stall_ms: 1_000,
        stall_drop_ms: 3_000,
        ..settings(StragglerPolicy::Ignore)
    };
    let (mut st, ids, t0) = cluster_with(2, Consistency::Ssp { staleness: 1 }, stalls);
    let (busy, idle) = (ids[0], ids[1]);
    // The busy worker leases data and trains two steps ahead; the idle one (a session that
    // joined and takes no batches) holds clock 0.
    assert!(ready(st.next_partition(busy, t0)).0.is_some());
    let mut t = t0;
    for c in 1..=2 {
        st.advance(busy, Clock(c), 0, 1, 0.5, None, (0, 0), t)
            .expect("advance");
        t += Duration::from_millis(10);
    }
    assert!(matches!(st.may_proceed(busy), Poll::Pending));
    // Nothing to report before the set time.
    assert!(st.stalls(t0 + Duration::from_millis(900)).is_empty());
    assert!(events(&st, EventKind::Stalled).is_empty());
    assert_eq!(member(&st, idle, t).stalled_ms, None);
    // Past it: named once, with whom it holds up; the others still wait (policy wait so far).
    let t = t0 + Duration::from_millis(1_100);
    assert!(st.stalls(t).is_empty());
    assert!(st.stalls(t + Duration::from_millis(100)).is_empty());
    assert_eq!(events(&st, EventKind::Stalled), vec![idle]);
    let detail = &details(&st, EventKind::Stalled)[0];
    assert!(
        detail.contains("minimum clock 0") && detail.contains("(w0)"),
        "{detail}"
    );
    assert!(
        st.take_news()
            .iter()
            .any(|n| n.contains("stalled") && n.contains("w1"))
    );
    assert_eq!(member(&st, idle, t).stalled_ms, Some(1_100));
    assert!(matches!(st.may_proceed(busy), Poll::Pending));
    // Past the drop time: dropped as if dead, and the busy worker goes on.
    let t = t0 + Duration::from_millis(3_000);
    assert_eq!(st.stalls(t), vec![idle]);
    assert_eq!(member(&st, idle, t).state, WorkerState::Dead);
    assert!(details(&st, EventKind::Dead)[0].starts_with("dropped"));
    assert!(matches!(st.may_proceed(busy), Poll::Ready(_)));
}

#[test]
fn a_stall_is_reported_only_while_someone_waits_and_never_under_asp() {
    let stalls = StragglerSettings {
        stall_ms: 1_000,
        ..settings(StragglerPolicy::Ignore)
    };
    // Under SSP with nobody ahead past the bound, a slow step holds nobody up.
    let (mut st, ids, t0) = cluster_with(2, Consistency::Ssp { staleness: 3 }, stalls);
    st.advance(ids[0], Clock(1), 0, 1, 0.5, None, (0, 0), t0)
        .expect("advance");
    assert!(st.stalls(t0 + Duration::from_secs(5)).is_empty());
    assert!(events(&st, EventKind::Stalled).is_empty());
    // Under ASP nobody ever waits.
    let (mut st, ids, t0) = cluster_with(2, Consistency::Asp, stalls);
    for c in 1..=5 {
        st.advance(ids[0], Clock(c), 0, 1, 0.5, None, (0, 0), t0)
            .expect("advance");
    }
    assert!(st.stalls(t0 + Duration::from_secs(60)).is_empty());
    assert!(events(&st, EventKind::Stalled).is_empty());
    // A worker that progresses is not reported again until it stalls anew (BSP).
    let (mut st, ids, t0) = cluster_with(2, Consistency::Bsp, stalls);
    st.advance(ids[0], Clock(1), 0, 1, 0.5, None, (0, 0), t0)
        .expect("advance");
    st.stalls(t0 + Duration::from_millis(1_500));
    assert_eq!(events(&st, EventKind::Stalled), vec![ids[1]]);
    let t1 = t0 + Duration::from_millis(1_600);
    st.advance(ids[1], Clock(1), 0, 1, 0.5, None, (0, 0), t1)
        .expect("advance");
    assert_eq!(member(&st, ids[1], t1).stalled_ms, None);
    st.advance(ids[0], Clock(2), 0, 1, 0.5, None, (0, 0), t1)
        .expect("advance");
    st.stalls(t1 + Duration::from_millis(900));
    assert_eq!(events(&st, EventKind::Stalled).len(), 1);
    st.stalls(t1 + Duration::from_millis(1_100));
    assert_eq!(events(&st, EventKind::Stalled).len(), 2);
}

#[test]
fn silent_workers_are_listed_for_probing_and_declared_dead_with_the_reason() {
    let (mut st, ids, t0) = cluster(2, StragglerPolicy::Ignore);
    st.heartbeat(ids[0], t0 + Duration::from_millis(200))
        .expect("beat");
    let silent = st.silent(t0 + Duration::from_millis(300), Duration::from_millis(250));
    assert_eq!(silent, vec![(ids[1], "127.0.0.1:9".to_string())]);
    assert!(st.declare_dead(ids[1], t0, "its socket is gone".into()));
    assert!(
        !st.declare_dead(ids[1], t0, "again".into()),
        "only an active worker dies"
    );
    assert_eq!(
        details(&st, EventKind::Dead),
        vec!["its socket is gone".to_string()]
    );
    // The lease is the backstop, and says so.
    let dead = st.expire_leases(t0 + Duration::from_millis(1_300));
    assert_eq!(dead, vec![ids[0]]);
    assert!(details(&st, EventKind::Dead)[1].starts_with("lease expired"));
}

#[test]
fn a_slow_model_with_steps_longer_than_the_window_is_still_judged() {
    // Steps of 1 to 3 s against a 500 ms window: each worker's window keeps its last 3 steps,
    // and the others count as stepping lately within two of their own steps.
    let (mut st, ids, t) = cluster(3, StragglerPolicy::Ignore);
    rounds(&mut st, &ids, &[1_000.0, 1_000.0, 3_000.0], t, 6);
    assert_eq!(events(&st, EventKind::Straggler), vec![ids[2]]);
}
