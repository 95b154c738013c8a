//! Unit tests of the event costs, the noise floor, the shard events and the per-epoch account.

use super::*;
use edl_shared::proto::Clock;
use edl_shared::proto::msg::{EpochStats, EventRecord, StepRecord};

fn ev(t_ms: u64, requested_ms: u64, kind: EventKind, w: u64) -> EventRecord {
    EventRecord {
        t_ms,
        requested_ms,
        kind,
        worker: WorkerId(w),
        name: format!("w{w}"),
        detail: String::new(),
    }
}

fn steps(w: u64, times: impl IntoIterator<Item = u64>) -> Vec<StepRecord> {
    times
        .into_iter()
        .enumerate()
        .map(|(i, t_ms)| StepRecord {
            t_ms,
            worker: WorkerId(w),
            clock: Clock(i as u64 + 1),
        })
        .collect()
}

fn trace(events: Vec<EventRecord>, mut all: Vec<Vec<StepRecord>>) -> JobTrace {
    let mut steps: Vec<StepRecord> = all.drain(..).flatten().collect();
    steps.sort_by_key(|s| s.t_ms);
    JobTrace {
        events,
        steps,
        ..JobTrace::default()
    }
}

#[test]
fn medians() {
    assert_eq!(median(&mut []), None);
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), Some(2.5));
}

#[test]
fn a_join_that_holds_nobody_back_costs_nothing_and_has_a_latency() {
    // w1 and w2 step every 10 ms; w3 asks to join at 95, is admitted at 100 and steps at
    // 130.
    let t = trace(
        vec![
            ev(0, 0, EventKind::Join, 1),
            ev(0, 0, EventKind::Join, 2),
            ev(100, 95, EventKind::Join, 3),
        ],
        vec![
            steps(1, (1..=20).map(|i| i * 10)),
            steps(2, (1..=20).map(|i| i * 10 + 5)),
            steps(3, [130, 140]),
        ],
    );
    let r = event_costs(&t);
    assert_eq!(r.len(), 3);
    // Initial joins: nobody had stepped.
    assert_eq!((r[0].step_ms, r[0].stall_ms), (None, None));
    assert_eq!(r[0].join_latency_ms, Some(10.0));
    assert_eq!(r[2].kind, "join");
    assert_eq!(r[2].worker, "w3");
    assert_eq!(r[2].step_ms, Some(10.0));
    assert_eq!(r[2].stall_ms, Some(0.0));
    assert_eq!(r[2].join_latency_ms, Some(35.0));
}

#[test]
fn a_death_stalls_the_others_for_the_lease() {
    // w2 dies after its step at 100; the others wait until it is declared dead at 1100.
    let t = trace(
        vec![ev(1100, 1100, EventKind::Dead, 2)],
        vec![
            steps(1, (1..=10).map(|i| i * 10).chain([1110, 1120])),
            steps(2, (1..=10).map(|i| i * 10)),
        ],
    );
    let r = event_costs(&t);
    assert_eq!(r[0].kind, "dead");
    assert_eq!(r[0].step_ms, Some(10.0));
    // Gap 100 → 1110 is 1010 ms, of which 10 is a normal step.
    assert_eq!(r[0].stall_ms, Some(1000.0));
    assert_eq!(r[0].join_latency_ms, None);
}

#[test]
fn a_killed_worker_is_not_an_other_while_it_awaits_its_lease() {
    // w2 is killed after its step at 100 and declared dead at 1100; w3 joins at 500, while
    // w1 keeps stepping (ASP).
    let t = trace(
        vec![
            ev(500, 490, EventKind::Join, 3),
            ev(1100, 1100, EventKind::Dead, 2),
        ],
        vec![
            steps(1, (1..=100).map(|i| i * 10)),
            steps(2, (1..=10).map(|i| i * 10)),
            steps(3, [520]),
        ],
    );
    let r = event_costs(&t);
    assert_eq!(r[0].stall_ms, Some(0.0));
}

#[test]
fn a_restart_shows_up_whole_and_departed_workers_are_not_others() {
    // w1 and w2 step every 10 ms until 100; both are stopped (leaves at 110 and 120) and
    // w3 starts stepping at 2100.
    let t = trace(
        vec![
            ev(110, 110, EventKind::Leave, 1),
            ev(120, 120, EventKind::Leave, 2),
            ev(2000, 1500, EventKind::Join, 3),
        ],
        vec![
            steps(1, (1..=10).map(|i| i * 10)),
            steps(2, (1..=10).map(|i| i * 10)),
            steps(3, [2100, 2110]),
        ],
    );
    let r = event_costs(&t);
    // At w1's leave, w2 has no step after it: w3's first step stands in.
    assert_eq!(r[0].stall_ms, Some(2000.0 - 10.0));
    // At w2's leave, w1 had already left: no others.
    assert_eq!(r[1].stall_ms, None);
    // The new worker's join: nobody else left standing had stepped.
    assert_eq!(r[2].stall_ms, None);
    assert_eq!(r[2].join_latency_ms, Some(600.0));
}

#[test]
fn a_straggler_does_not_hide_a_restart_and_leavers_are_left_out() {
    // Restart: w1, w2 and w3 step every 10 ms until 100; w2 and w1 leave at 105 and 106,
    // w3 makes one more step at 110 and leaves at 115; the new w4 steps from 900.
    let t = trace(
        vec![
            ev(105, 105, EventKind::Leave, 2),
            ev(106, 106, EventKind::Leave, 1),
            ev(115, 115, EventKind::Leave, 3),
        ],
        vec![
            steps(1, (1..=10).map(|i| i * 10)),
            steps(2, (1..=10).map(|i| i * 10)),
            steps(3, (1..=11).map(|i| i * 10)),
            steps(4, (90..=99).map(|i| i * 10)),
        ],
    );
    let r = event_costs(&t);
    assert_eq!(r[0].stall_ms, Some(800.0 - 10.0), "w1 waits for w4: {r:?}");
    // Elastic: w3 joins at 105 while w2 leaves for good right after it and w1 goes on;
    // w2 is left out, and w1's steps straddle the join as usual.
    let t = trace(
        vec![
            ev(105, 100, EventKind::Join, 3),
            ev(106, 106, EventKind::Leave, 2),
        ],
        vec![
            steps(1, (1..=30).map(|i| i * 10)),
            steps(2, (1..=10).map(|i| i * 10)),
            steps(3, (11..=30).map(|i| i * 10 + 5)),
        ],
    );
    let r = event_costs(&t);
    assert_eq!(r[0].stall_ms, Some(0.0), "{r:?}");
}

#[test]
fn the_step_window_follows_recent_steps() {
    // 30 slow steps (100 ms apart), then 30 fast ones (10 ms apart), then an event.
    let times: Vec<u64> = (0..30)
        .map(|i| i * 100)
        .chain((1..=30).map(|i| 2900 + i * 10))
        .collect();
    let last = *times.last().expect("steps");
    let t = trace(
        vec![ev(last + 1, last + 1, EventKind::Drain, 9)],
        vec![steps(1, times.iter().copied().chain([last + 12]))],
    );
    let r = event_costs(&t);
    assert_eq!(r[0].step_ms, Some(10.0));
    assert_eq!(r[0].stall_ms, Some(2.0));
}

#[test]
fn the_noise_floor_skips_events_and_silences() {
    // Until everyone leaves at 10 s, two workers step every 10 ms, except that w1 takes
    // 40 ms every tenth step; w3 joins at 5000 and a killed w4 is silent from 6003 until it
    // is declared dead at 7000.
    let jittery = (1..).scan(0, |t, i| {
        *t += if i % 10 == 0 { 40 } else { 10 };
        Some(*t)
    });
    let t = trace(
        vec![
            ev(5000, 5000, EventKind::Join, 3),
            ev(7000, 7000, EventKind::Dead, 4),
            ev(10_000, 10_000, EventKind::Leave, 1),
            ev(10_000, 10_000, EventKind::Leave, 2),
            ev(10_000, 10_000, EventKind::Leave, 3),
        ],
        vec![
            steps(1, jittery.take_while(|&t| t < 10_000)),
            steps(2, (1..1000).map(|i| i * 10 + 5)),
            steps(3, (501..1000).map(|i| i * 10 + 7)),
            steps(4, (1..=600).map(|i| i * 10 + 3)),
        ],
    );
    let n = stall_noise(&t, &[]).expect("moments");
    // 1010 to 9410 ms by 100 ms, less 4010..5910 around the join, 6010..7910 around the
    // death (which covers w4's silence) and 9010..9410 before the leaves.
    assert_eq!(n.moments, 85 - 20 - 20 - 5, "{n:?}");
    assert_eq!(n.median_step_ms, Some(10.0));
    // w1's 40 ms steps straddle about a third of the moments: 30 ms over its usual 10.
    assert_eq!(n.median_stall_ms, 0.0, "{n:?}");
    assert_eq!(n.p90_stall_ms, 30.0, "{n:?}");
    assert!(stall_noise(&trace(vec![], vec![]), &[]).is_none());
    // A shard event's span is kept clear of too: 2010..3910 around a span 3000..3010.
    let m = stall_noise(&t, &[(3000, 3010)]).expect("moments");
    assert_eq!(m.moments, n.moments - 20, "{m:?}");
}

#[test]
fn epochs_take_the_worst_shard() {
    let st = JobStatus {
        t_ms: 0,
        shards_joined: 2,
        shards_expected: 2,
        samples_total: 200,
        samples_done: 200,
        epochs: vec![
            EpochStats {
                epoch: 0,
                samples: 100,
                loss_sum: 50.0,
                bytes_pushed: 400,
                bytes_pulled: 800,
            },
            EpochStats {
                epoch: 1,
                samples: 100,
                loss_sum: 25.0,
                bytes_pushed: 0,
                bytes_pulled: 0,
            },
        ],
        workers: vec![],
        min_clock: Clock(0),
        finished: true,
        samples_per_s: 0.0,
        loss: None,
        evaluation: None,
    };
    let l = |epoch, applied, duplicates, skipped_pushes| EpochLedger {
        epoch,
        applied,
        duplicates,
        missing: 100 - applied,
        skipped_pushes,
    };
    let ledgers = vec![
        (ShardId(0), vec![l(0, 100, 0, 1), l(1, 100, 2, 0)]),
        (ShardId(1), vec![l(0, 98, 0, 0)]),
    ];
    let r = epoch_reports(&st, &ledgers, 100);
    assert_eq!(
        (
            r[0].samples,
            r[0].duplicates,
            r[0].missing,
            r[0].skipped_pushes
        ),
        (98, 0, 2, 1)
    );
    assert_eq!(r[0].train_loss, 0.5);
    // Shard 1 has no account of epoch 1: it applied none of it.
    assert_eq!((r[1].samples, r[1].duplicates, r[1].missing), (0, 2, 100));
    assert_eq!(r[1].reported_samples, 100);
    assert_eq!((r[0].bytes_pushed, r[0].bytes_pulled), (400, 800));
    let t = crate::report::Traffic::of(&r, 200);
    assert_eq!((t.bytes_pushed, t.bytes_pulled), (400, 800));
    assert_eq!((t.pushed_per_sample, t.pulled_per_sample), (2.0, 4.0));
}

#[test]
fn kinds_are_summed_up() {
    let e = |kind: &str, stall: Option<f64>, join: Option<f64>| EventReport {
        t_ms: 0,
        kind: kind.into(),
        worker: "w0".into(),
        step_ms: Some(10.0),
        stall_ms: stall,
        join_latency_ms: join,
        hold_ms: (kind == "move").then_some(3.0),
        bytes: None,
        took_ms: None,
    };
    let s = kind_summaries(&[
        e("leave", Some(4.0), None),
        e("join", None, Some(30.0)),
        e("join", Some(2.0), Some(50.0)),
        e("leave", Some(8.0), None),
        e("leave", Some(1.0), None),
    ]);
    assert_eq!(s.len(), 2);
    assert_eq!(s[1].median_hold_ms, None);
    assert_eq!(
        (s[0].kind.as_str(), s[0].count, s[0].measured),
        ("join", 2, 1)
    );
    assert_eq!(s[0].median_join_latency_ms, Some(40.0));
    assert_eq!(s[1].median_stall_ms, Some(4.0));
    assert_eq!(s[1].max_stall_ms, Some(8.0));
    let s = kind_summaries(&[e("move", Some(2.0), None), e("shard_add", None, None)]);
    let kinds: Vec<&str> = s.iter().map(|k| k.kind.as_str()).collect();
    assert_eq!(kinds, ["shard_add", "move"]);
    assert_eq!(
        (s[1].median_hold_ms, s[1].max_hold_ms),
        (Some(3.0), Some(3.0))
    );
}

#[test]
fn moves_and_shard_events_cost_what_the_others_wait() {
    // w1 steps every 10 ms until 1000, except that a move at 505 holds it from 500 to
    // 540; w2 steps every 10 ms from 5, and waits from 985 to 1305 for s1, killed at 1005
    // and serving again at 1300.
    let w1 = (1..=50).chain(54..=100).map(|i| i * 10);
    let w2 = (1..=99).chain(131..=150).map(|i| i * 10 - 5);
    let mut t = trace(vec![], vec![steps(1, w1), steps(2, w2)]);
    t.moves.push(MoveReport {
        t_ms: 505,
        start: 3,
        end: 6,
        from: ShardId(0),
        to: ShardId(2),
        epoch: edl_shared::proto::ids::MapEpoch(3),
        bytes: 4096,
        millis: 40.0,
        hold_ms: 33.0,
    });
    let names = BTreeMap::from([(ShardId(0), "s0".to_string())]);
    let actions = [
        ShardAction {
            t_ms: 1005,
            kind: "kill_shard",
            shard: "s1".into(),
            took_ms: None,
        },
        ShardAction {
            t_ms: 1200,
            kind: "restart_shard",
            shard: "s1".into(),
            took_ms: Some(100.0),
        },
    ];
    let mut r = shard_costs(&t, &names, &actions);
    r.sort_by_key(|e| e.t_ms);
    assert_eq!(r.len(), 3);
    assert_eq!(r[0].kind, "move");
    // s2 has no name: its id stands in.
    assert_eq!(r[0].worker, "keys 3..6 s0→s2");
    assert_eq!((r[0].step_ms, r[0].stall_ms), (Some(10.0), Some(30.0)));
    assert_eq!(
        (r[0].hold_ms, r[0].bytes, r[0].took_ms),
        (Some(33.0), Some(4096), Some(40.0))
    );
    assert_eq!(
        (r[1].kind.as_str(), r[1].worker.as_str()),
        ("kill_shard", "s1")
    );
    // w2's gap 985 → 1305 is 320 ms, 310 over its usual step; w1, which stepped no more,
    // is left out since w2 went on.
    assert_eq!(r[1].stall_ms, Some(310.0));
    assert_eq!((r[2].stall_ms, r[2].took_ms), (Some(310.0), Some(100.0)));
    assert_eq!(
        shard_quiet_spans(&t, &actions),
        [(505, 505), (1005, 1300), (1200, 1300)]
    );
}

#[test]
fn a_killed_coordinator_is_quiet_until_its_restart_and_summed_up_apart() {
    let t = trace(vec![], vec![steps(1, (1..=100).map(|i| i * 10))]);
    let act = |t_ms: u64, kind: &'static str, shard: &str, took_ms: Option<f64>| ShardAction {
        t_ms,
        kind,
        shard: shard.into(),
        took_ms,
    };
    let actions = [
        act(200, "kill_shard", "s1", None),
        act(300, "kill_coordinator", "coordinator", None),
        act(700, "restart_coordinator", "coordinator", Some(60.0)),
        act(800, "restart_shard", "s1", Some(10.0)),
    ];
    // Each absence runs from the kill to the end of the matching restart: the coordinator's
    // restart does not end a shard's.
    assert_eq!(
        shard_quiet_spans(&t, &actions),
        [(200, 810), (300, 760), (700, 760), (800, 810)]
    );
    let r = shard_costs(&t, &BTreeMap::new(), &actions[1..3]);
    let s = kind_summaries(&r);
    let kinds: Vec<(&str, usize)> = s.iter().map(|k| (k.kind.as_str(), k.count)).collect();
    assert_eq!(kinds, [("kill_coordinator", 1), ("restart_coordinator", 1)]);
}
