//! What each membership event cost the other workers, computed from the coordinator's trace
//! (membership events and the time of every step report), and the per-epoch data account from
//! the shards' ledgers.
//!
//! For an event at time `t` by worker `W`, the *others* are the workers other than `W` that had
//! stepped by `t`, had not left or died before it, and did not die later without another step
//! (a killed worker is a member until its lease expires, but its silence is not a stall it
//! suffers):
//! - `step_ms` is the median interval between consecutive steps of the others, over their last
//!   [`STEP_WINDOW`] steps up to `t`: what a step normally took just then;
//! - `stall_ms` is, over the others `O`, the largest of O's gap (its first step after `t` less
//!   its last step up to `t`) less O's own median step, floored at 0: how much longer than
//!   usual the step that straddles the event took. An `O` with no step after `t` is leaving
//!   too: while another of the others
//!   keeps training across the event it is left out (it suffers nothing), and when none does
//!   (every worker was stopped, as in a restart) its gap runs to the first step after `t` of a
//!   worker that is not leaving within [`LEAVING_MS`] — a new worker's first step — so a
//!   stop-everything restart shows up whole. An `O` without a normal step time to compare
//!   with (one step so far, and no other worker with two) is left out too;
//! - for a join, `join_latency_ms` is from the admission request to the worker's first step.
//!
//! Joins before any step have no others and no costs.

use std::collections::{BTreeMap, BTreeSet};

use edl_shared::proto::ids::{ShardId, WorkerId};
use edl_shared::proto::msg::{EpochLedger, EventKind, JobStatus, JobTrace};

use crate::report::{EpochReport, EventReport};

/// How many recent steps per worker the normal step time is taken over.
pub const STEP_WINDOW: usize = 20;
/// A worker that departs within this long after an event is taken to be leaving with it.
pub const LEAVING_MS: u64 = 1000;

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
pub fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The lowercase name of an event kind, as the report writes it.
pub fn kind_name(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Join => "join",
        EventKind::Drain => "drain",
        EventKind::Leave => "leave",
        EventKind::Dead => "dead",
    }
}

/// The step times of a trace per worker, and when workers departed.
struct Timeline {
    steps: BTreeMap<WorkerId, Vec<u64>>,
    departed: BTreeMap<WorkerId, u64>,
    died: BTreeMap<WorkerId, u64>,
}

impl Timeline {
    fn of(trace: &JobTrace) -> Timeline {
        let mut steps: BTreeMap<WorkerId, Vec<u64>> = BTreeMap::new();
        for s in &trace.steps {
            steps.entry(s.worker).or_default().push(s.t_ms);
        }
        // The trace is in time order already; sorting makes the searches safe regardless.
        for times in steps.values_mut() {
            times.sort_unstable();
        }
        let departed_by = |kinds: &[EventKind]| {
            trace
                .events
                .iter()
                .filter(|e| kinds.contains(&e.kind))
                .map(|e| (e.worker, e.t_ms))
                .collect::<BTreeMap<_, _>>()
        };
        Timeline {
            departed: departed_by(&[EventKind::Leave, EventKind::Dead]),
            died: departed_by(&[EventKind::Dead]),
            steps,
        }
    }

    /// The normal step time and the stall around time `t`, for an event of `worker` (`None`
    /// for a moment without an event).
    fn cost_at(&self, t: u64, worker: Option<WorkerId>) -> (Option<f64>, Option<f64>) {
        let not_it = |w: &WorkerId| Some(*w) != worker;
        let others: Vec<(WorkerId, &[u64])> = self
            .steps
            .iter()
            .filter(|(w, _)| not_it(w))
            .filter(|(w, _)| self.departed.get(w).is_none_or(|&d| d >= t))
            .map(|(w, times)| (*w, times.partition_point(|&s| s <= t), times))
            .filter(|&(w, n, times)| n > 0 && (n < times.len() || !self.died.contains_key(&w)))
            .map(|(w, n, times)| (w, &times[..n]))
            .collect();
        let recent = |before: &[u64]| -> Vec<f64> {
            let r = &before[before.len().saturating_sub(STEP_WINDOW + 1)..];
            r.windows(2).map(|p| (p[1] - p[0]) as f64).collect()
        };
        let mut pooled: Vec<f64> = others.iter().flat_map(|(_, b)| recent(b)).collect();
        let step_ms = median(&mut pooled);
        let next_step = |w: &WorkerId| {
            self.steps
                .get(w)
                .and_then(|times| times.iter().find(|&&s| s > t).copied())
        };
        let staying = |w: &WorkerId| self.departed.get(w).is_none_or(|&d| d > t + LEAVING_MS);
        let someone_goes_on = others
            .iter()
            .any(|(w, _)| staying(w) && next_step(w).is_some());
        // Training resumes with the first step after `t` of a worker that stays.
        let resumed = self
            .steps
            .keys()
            .filter(|w| not_it(w) && staying(w))
            .filter_map(next_step)
            .min();
        let stall_ms = others
            .iter()
            .filter_map(|(w, before)| {
                let last = *before.last()?;
                let after = match next_step(w) {
                    Some(s) => s,
                    None if someone_goes_on => return None,
                    None => resumed?,
                };
                let usual = median(&mut recent(before)).or(step_ms)?;
                Some((after - last) as f64 - usual)
            })
            .reduce(f64::max)
            .map(|s| s.max(0.0));
        (step_ms, stall_ms)
    }
}

/// Every event of `trace` with its cost.
pub fn event_costs(trace: &JobTrace) -> Vec<EventReport> {
    let line = Timeline::of(trace);
    trace
        .events
        .iter()
        .map(|e| {
            let (step_ms, stall_ms) = line.cost_at(e.t_ms, Some(e.worker));
            let join_latency_ms = (e.kind == EventKind::Join)
                .then(|| line.steps.get(&e.worker).and_then(|t| t.first()))
                .flatten()
                .map(|&first| first.saturating_sub(e.requested_ms) as f64);
            EventReport {
                t_ms: e.t_ms,
                kind: kind_name(e.kind).into(),
                worker: e.name.clone(),
                step_ms,
                stall_ms,
                join_latency_ms,
            }
        })
        .collect()
}

/// How often [`stall_noise`] samples the run.
pub const NOISE_EVERY_MS: u64 = 100;
/// How far from any membership event a moment must be to count as without one.
pub const NOISE_CLEARANCE_MS: u64 = 1000;

/// The stall measure at moments without any membership event: what [`event_costs`] would
/// report if nothing happened. With few cores and several workers, step times jitter and the
/// worst of the others' steps is often longer than usual; this is the floor an event's stall
/// is to be read against. `None` when the run had no such moments.
///
/// Moments are taken every [`NOISE_EVERY_MS`] while training was under way (some worker
/// stepped in the second before), at least [`NOISE_CLEARANCE_MS`] from any event and outside
/// the silence of a worker that died (from its last step to its death).
pub fn stall_noise(trace: &JobTrace) -> Option<StallNoise> {
    let line = Timeline::of(trace);
    let first = trace.steps.iter().map(|s| s.t_ms).min()?;
    let last = trace.steps.iter().map(|s| s.t_ms).max()?;
    let silent: Vec<(u64, u64)> = line
        .died
        .iter()
        .map(|(w, &d)| {
            let from = line.steps.get(w).and_then(|t| t.last()).copied();
            (from.unwrap_or(d), d)
        })
        .collect();
    let mut stalls = Vec::new();
    let mut steps = Vec::new();
    let mut t = first + NOISE_CLEARANCE_MS;
    while t + NOISE_CLEARANCE_MS / 2 < last {
        let quiet = trace
            .events
            .iter()
            .all(|e| e.t_ms.abs_diff(t) >= NOISE_CLEARANCE_MS)
            && silent
                .iter()
                .all(|&(from, d)| t < from || t > d + NOISE_CLEARANCE_MS / 2)
            && trace.steps.iter().any(|s| s.t_ms <= t && s.t_ms + 1000 > t);
        if quiet && let (step, Some(stall)) = line.cost_at(t, None) {
            stalls.push(stall);
            steps.extend(step);
        }
        t += NOISE_EVERY_MS;
    }
    let moments = stalls.len();
    stalls.sort_by(f64::total_cmp);
    let p90 = *stalls.get((moments * 9 / 10).min(moments.checked_sub(1)?))?;
    Some(StallNoise {
        moments,
        median_stall_ms: median(&mut stalls)?,
        p90_stall_ms: p90,
        median_step_ms: median(&mut steps),
    })
}

/// The stall measure at moments without an event (see [`stall_noise`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StallNoise {
    /// Moments sampled.
    pub moments: usize,
    /// Median stall over them.
    pub median_stall_ms: f64,
    /// 90th percentile.
    pub p90_stall_ms: f64,
    /// Median normal step time over them.
    pub median_step_ms: Option<f64>,
}

/// Per-epoch figures: the training loss from the coordinator's status, the data account from
/// the shards' ledgers, worst case over shards (the fewest samples applied, the most
/// duplicates, misses and skipped pushes). A shard without an entry for an epoch counts as
/// having applied nothing of it.
pub fn epoch_reports(
    st: &JobStatus,
    ledgers: &[(ShardId, Vec<EpochLedger>)],
    train_samples: u32,
) -> Vec<EpochReport> {
    st.epochs
        .iter()
        .map(|e| {
            let per_shard: Vec<EpochLedger> = ledgers
                .iter()
                .map(|(_, l)| {
                    l.iter()
                        .find(|x| x.epoch == e.epoch)
                        .cloned()
                        .unwrap_or(EpochLedger {
                            epoch: e.epoch,
                            applied: 0,
                            duplicates: 0,
                            missing: u64::from(train_samples),
                            skipped_pushes: 0,
                        })
                })
                .collect();
            EpochReport {
                epoch: e.epoch,
                samples: per_shard.iter().map(|l| l.applied).min().unwrap_or(0),
                duplicates: per_shard.iter().map(|l| l.duplicates).max().unwrap_or(0),
                missing: per_shard
                    .iter()
                    .map(|l| l.missing)
                    .max()
                    .unwrap_or(u64::from(train_samples)),
                skipped_pushes: per_shard
                    .iter()
                    .map(|l| l.skipped_pushes)
                    .max()
                    .unwrap_or(0),
                reported_samples: e.samples,
                train_loss: if e.samples > 0 {
                    e.loss_sum / e.samples as f64
                } else {
                    0.0
                },
            }
        })
        .collect()
}

/// Per event kind (in the order join, drain, leave, dead): how many, and the median and
/// largest stall and the median join latency over the events that have one.
pub fn kind_summaries(events: &[EventReport]) -> Vec<KindSummary> {
    let kinds: BTreeSet<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    ["join", "drain", "leave", "dead"]
        .into_iter()
        .filter(|k| kinds.contains(k))
        .map(|kind| {
            let of: Vec<&EventReport> = events.iter().filter(|e| e.kind == kind).collect();
            let mut stalls: Vec<f64> = of.iter().filter_map(|e| e.stall_ms).collect();
            let mut steps: Vec<f64> = of.iter().filter_map(|e| e.step_ms).collect();
            let mut joins: Vec<f64> = of.iter().filter_map(|e| e.join_latency_ms).collect();
            KindSummary {
                kind: kind.to_string(),
                count: of.len(),
                measured: stalls.len(),
                median_stall_ms: median(&mut stalls),
                max_stall_ms: stalls.iter().copied().reduce(f64::max),
                median_step_ms: median(&mut steps),
                median_join_latency_ms: median(&mut joins),
            }
        })
        .collect()
}

/// The costs of one kind of event, summed up.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KindSummary {
    /// `join`, `drain`, `leave` or `dead`.
    pub kind: String,
    /// Events of this kind.
    pub count: usize,
    /// Those with a stall figure (events with no other worker stepping have none).
    pub measured: usize,
    /// Median stall.
    pub median_stall_ms: Option<f64>,
    /// Largest stall.
    pub max_stall_ms: Option<f64>,
    /// Median normal step time around these events.
    pub median_step_ms: Option<f64>,
    /// Median join latency (joins only).
    pub median_join_latency_ms: Option<f64>,
}

#[cfg(test)]
mod tests {
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
            moves: Vec::new(),
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
        let n = stall_noise(&t).expect("moments");
        // 1010 to 9410 ms by 100 ms, less 4010..5910 around the join, 6010..7910 around the
        // death (which covers w4's silence) and 9010..9410 before the leaves.
        assert_eq!(n.moments, 85 - 20 - 20 - 5, "{n:?}");
        assert_eq!(n.median_step_ms, Some(10.0));
        // w1's 40 ms steps straddle about a third of the moments: 30 ms over its usual 10.
        assert_eq!(n.median_stall_ms, 0.0, "{n:?}");
        assert_eq!(n.p90_stall_ms, 30.0, "{n:?}");
        assert!(stall_noise(&trace(vec![], vec![])).is_none());
    }

    #[test]
    fn epochs_take_the_worst_shard() {
        let st = JobStatus {
            shards_joined: 2,
            shards_expected: 2,
            samples_total: 200,
            samples_done: 200,
            epochs: vec![
                EpochStats {
                    epoch: 0,
                    samples: 100,
                    loss_sum: 50.0,
                },
                EpochStats {
                    epoch: 1,
                    samples: 100,
                    loss_sum: 25.0,
                },
            ],
            workers: vec![],
            min_clock: Clock(0),
            finished: true,
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
        };
        let s = kind_summaries(&[
            e("leave", Some(4.0), None),
            e("join", None, Some(30.0)),
            e("join", Some(2.0), Some(50.0)),
            e("leave", Some(8.0), None),
            e("leave", Some(1.0), None),
        ]);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].kind.as_str(), s[0].count, s[0].measured),
            ("join", 2, 1)
        );
        assert_eq!(s[0].median_join_latency_ms, Some(40.0));
        assert_eq!(s[1].median_stall_ms, Some(4.0));
        assert_eq!(s[1].max_stall_ms, Some(8.0));
    }
}
