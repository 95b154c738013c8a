//! The job's training history as the coordinator sees it live: progress per second (samples,
//! loss, steps, workers), the evaluations reported, membership event counts, and what each
//! join, leave or death cost the other workers, measured as it happens.
//!
//! The live stall of an event at `t` is the measure `edl-local` computes from the trace after
//! a run, taken online: for each other worker with a normal step interval (the median of its
//! last [`STEP_WINDOW`] intervals), how much longer than that the step straddling `t` took;
//! the event's stall is the largest, once every other worker has stepped past `t` (others
//! that leave meanwhile drop out; after [`STALL_TIMEOUT_MS`] the worst seen so far counts).

use std::collections::{BTreeMap, VecDeque};

use edl_shared::proto::ids::WorkerId;
use edl_shared::proto::msg::{
    EvalRecord, EventKind, HistoryPoint, JobHistory, RECENT_MS, WorkerState,
};

/// The width of a history window.
pub const BUCKET_MS: u64 = 1000;
/// Windows kept (a day of seconds with a step); older ones are dropped.
const MAX_POINTS: usize = 86_400;
/// The longest run of windows without a step filled in with empty ones (ten minutes).
const MAX_FILLED: u64 = 600;
/// Evaluations kept.
const MAX_EVALS: usize = 10_000;
/// Intervals per worker its normal step time is taken over.
pub const STEP_WINDOW: usize = 20;
/// How long an event's stall is watched for at most.
pub const STALL_TIMEOUT_MS: u64 = 60_000;

/// The event kinds whose stall is measured: membership changes.
fn rescales(kind: EventKind) -> bool {
    matches!(kind, EventKind::Join | EventKind::Leave | EventKind::Dead)
}

#[derive(Debug, Default)]
struct Pace {
    last_ms: Option<u64>,
    intervals: VecDeque<u64>,
}

impl Pace {
    fn median(&self) -> Option<f64> {
        if self.intervals.len() < 2 {
            return None;
        }
        let mut v: Vec<u64> = self.intervals.iter().copied().collect();
        v.sort_unstable();
        let n = v.len();
        Some(if n % 2 == 1 {
            v[n / 2] as f64
        } else {
            (v[n / 2 - 1] + v[n / 2]) as f64 / 2.0
        })
    }
}

/// An event whose cost is still being measured.
#[derive(Debug)]
struct PendingStall {
    t_ms: u64,
    kind: EventKind,
    /// Others not yet stepped past the event: their last step before it and normal interval.
    waiting: BTreeMap<WorkerId, (u64, f64)>,
    worst_ms: Option<f64>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct History {
    points: VecDeque<HistoryPoint>,
    evaluations: VecDeque<EvalRecord>,
    /// Membership events by kind since the coordinator started.
    events: BTreeMap<&'static str, u64>,
    paces: BTreeMap<WorkerId, Pace>,
    pending: Vec<PendingStall>,
    /// Measured stalls not yet taken: the event kind and milliseconds.
    stalls: Vec<(EventKind, f64)>,
}

/// The lowercase name of an event kind (as reports and metrics write it).
pub fn kind_name(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Join => "join",
        EventKind::Drain => "drain",
        EventKind::Leave => "leave",
        EventKind::Dead => "dead",
        EventKind::Straggler => "straggler",
        EventKind::Recovered => "recovered",
        EventKind::Preempt => "preempt",
        EventKind::ReplaceRequested => "replace_requested",
        EventKind::Stalled => "stalled",
    }
}

impl History {
    /// A step of `worker` reported at `t_ms`: `samples` with `loss_sum`, `workers` active.
    pub fn step(&mut self, t_ms: u64, worker: WorkerId, samples: u64, loss_sum: f64, workers: u32) {
        let start = t_ms - t_ms % BUCKET_MS;
        match self.points.back_mut() {
            Some(p) if p.t_ms == start => {
                p.samples += samples;
                p.loss_sum += loss_sum;
                p.steps += 1;
                p.workers = workers;
            }
            last => {
                // Windows without a step count as such (a stall shows as zero throughput),
                // unless the gap is long (a suspended job): then it stays a gap.
                if let Some(last) = last.copied() {
                    let gap = (start.saturating_sub(last.t_ms) / BUCKET_MS).saturating_sub(1);
                    if gap <= MAX_FILLED {
                        for i in 1..=gap {
                            self.push_point(HistoryPoint {
                                t_ms: last.t_ms + i * BUCKET_MS,
                                samples: 0,
                                loss_sum: 0.0,
                                steps: 0,
                                workers: last.workers,
                            });
                        }
                    }
                }
                self.push_point(HistoryPoint {
                    t_ms: start,
                    samples,
                    loss_sum,
                    steps: 1,
                    workers,
                });
            }
        }
        let pace = self.paces.entry(worker).or_default();
        if let Some(last) = pace.last_ms {
            if pace.intervals.len() >= STEP_WINDOW {
                pace.intervals.pop_front();
            }
            pace.intervals.push_back(t_ms.saturating_sub(last));
        }
        pace.last_ms = Some(t_ms);
        for p in &mut self.pending {
            if let Some((last, normal)) = p.waiting.remove(&worker) {
                let excess = (t_ms.saturating_sub(last) as f64 - normal).max(0.0);
                p.worst_ms = Some(p.worst_ms.map_or(excess, |w| w.max(excess)));
            }
        }
        self.settle(t_ms);
    }

    fn push_point(&mut self, p: HistoryPoint) {
        if self.points.len() >= MAX_POINTS {
            self.points.pop_front();
        }
        self.points.push_back(p);
    }

    /// Moves finished (or timed-out) measurements to the taken list.
    fn settle(&mut self, now_ms: u64) {
        let stalls = &mut self.stalls;
        self.pending.retain(|p| {
            let over = p.waiting.is_empty() || now_ms.saturating_sub(p.t_ms) > STALL_TIMEOUT_MS;
            if over && let Some(w) = p.worst_ms {
                stalls.push((p.kind, w));
            }
            !over
        });
    }

    /// A membership event at `t_ms` for `worker`; `others` are the workers still counting.
    pub fn event(
        &mut self,
        t_ms: u64,
        kind: EventKind,
        worker: WorkerId,
        others: impl IntoIterator<Item = (WorkerId, WorkerState)>,
    ) {
        *self.events.entry(kind_name(kind)).or_default() += 1;
        if matches!(kind, EventKind::Leave | EventKind::Dead) {
            self.departed(worker, t_ms);
        }
        if !rescales(kind) {
            return;
        }
        let waiting: BTreeMap<WorkerId, (u64, f64)> = others
            .into_iter()
            .filter(|&(o, state)| o != worker && state == WorkerState::Active)
            .filter_map(|(o, _)| {
                let pace = self.paces.get(&o)?;
                Some((o, (pace.last_ms?, pace.median()?)))
            })
            .collect();
        if !waiting.is_empty() {
            self.pending.push(PendingStall {
                t_ms,
                kind,
                waiting,
                worst_ms: None,
            });
        }
    }

    /// `worker` is gone: it is waited for no more.
    fn departed(&mut self, worker: WorkerId, now_ms: u64) {
        self.paces.remove(&worker);
        for p in &mut self.pending {
            p.waiting.remove(&worker);
        }
        self.settle(now_ms);
    }

    /// Records an evaluation. Its clock is raised to the previous evaluation's if lower: the
    /// parameters only move on, so what held at an earlier pull holds at this one, while the
    /// job's minimum clock can fall back once no worker trains (see
    /// [`EvalRecord::clock`]).
    pub fn evaluation(&mut self, mut record: EvalRecord) {
        if let Some(last) = self.evaluations.back() {
            record.clock = record.clock.max(last.clock);
        }
        if self.evaluations.len() >= MAX_EVALS {
            self.evaluations.pop_front();
        }
        self.evaluations.push_back(record);
    }

    /// The latest evaluation.
    pub fn latest_evaluation(&self) -> Option<&EvalRecord> {
        self.evaluations.back()
    }

    /// Samples per second and mean loss over the last [`RECENT_MS`] before `now_ms`.
    pub fn recent(&self, now_ms: u64) -> (f64, Option<f64>) {
        let from = now_ms.saturating_sub(RECENT_MS).div_ceil(BUCKET_MS) * BUCKET_MS;
        let (mut samples, mut loss) = (0u64, 0.0);
        for p in self.points.iter().rev().take_while(|p| p.t_ms >= from) {
            samples += p.samples;
            loss += p.loss_sum;
        }
        let secs = (now_ms.saturating_sub(from) as f64 / 1000.0).max(1.0);
        let mean = (samples > 0).then(|| loss / samples as f64);
        (samples as f64 / secs, mean)
    }

    /// The history from `from_ms` on (windows without a step within a run of steps are
    /// there with zero samples).
    pub fn history(&self, from_ms: u64) -> JobHistory {
        JobHistory {
            bucket_ms: BUCKET_MS,
            points: self
                .points
                .iter()
                .filter(|p| p.t_ms >= from_ms)
                .copied()
                .collect(),
            evaluations: self.evaluations.iter().cloned().collect(),
        }
    }

    /// Membership events by kind name.
    pub fn event_counts(&self) -> &BTreeMap<&'static str, u64> {
        &self.events
    }

    /// The stalls measured since the last call: event kind and milliseconds.
    pub fn take_stalls(&mut self) -> Vec<(EventKind, f64)> {
        std::mem::take(&mut self.stalls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::ids::Clock;

    fn w(n: u64) -> WorkerId {
        WorkerId(n)
    }

    #[test]
    fn windows_sum_steps_and_recent_rate_and_loss_follow_them() {
        let mut h = History::default();
        for i in 0..20u64 {
            h.step(i * 500, w(1), 10, 5.0, 1);
        }
        let hist = h.history(0);
        assert_eq!(hist.points.len(), 10);
        h.step(13_500, w(1), 10, 5.0, 1);
        let filled = h.history(10_000).points;
        assert_eq!(filled.len(), 4, "{filled:?}");
        assert!(filled[..3].iter().all(|p| p.samples == 0 && p.steps == 0));
        assert_eq!(filled[3].samples, 10);
        assert!(hist.points.iter().all(|p| p.samples == 20 && p.steps == 2));
        let (rate, loss) = h.recent(13_500);
        assert!((rate - 130.0 / 9.5).abs() < 1e-9, "{rate}");
        assert_eq!(loss, Some(0.5));
        assert_eq!(h.recent(100_000), (0.0, None));
        assert_eq!(h.history(5_000).points.len(), 9);
    }

    #[test]
    fn a_join_that_holds_the_others_back_is_measured_once_they_step_past_it() {
        let mut h = History::default();
        // Two workers stepping every 100 ms.
        for i in 1..=10u64 {
            h.step(i * 100, w(1), 1, 0.0, 2);
            h.step(i * 100 + 50, w(2), 1, 0.0, 2);
        }
        let others = [(w(1), WorkerState::Active), (w(2), WorkerState::Active)];
        h.event(1_020, EventKind::Join, w(3), others);
        assert_eq!(h.event_counts().get("join"), Some(&1));
        h.step(1_400, w(1), 1, 0.0, 3); // 400 ms instead of 100: 300 ms late
        assert!(h.take_stalls().is_empty(), "worker 2 has not stepped yet");
        h.step(1_200, w(2), 1, 0.0, 3); // 150 ms instead of 100: 50 ms late
        let stalls = h.take_stalls();
        assert_eq!(stalls.len(), 1);
        assert_eq!(stalls[0].0, EventKind::Join);
        assert!((stalls[0].1 - 300.0).abs() < 1e-9, "{stalls:?}");
    }

    #[test]
    fn an_evaluation_clock_never_goes_backwards() {
        let mut h = History::default();
        let eval = |t_ms, clock| EvalRecord {
            t_ms,
            name: "eval".into(),
            clock: Clock(clock),
            accuracy: 0.5,
            loss: 1.0,
            samples: 100,
        };
        h.evaluation(eval(1_000, 2061));
        // The final evaluation, once every worker waits for data: the job's minimum clock is
        // the floor a drained worker left.
        h.evaluation(eval(2_000, 1201));
        assert_eq!(h.latest_evaluation().map(|e| e.clock), Some(Clock(2061)));
        h.evaluation(eval(3_000, 2500));
        let clocks: Vec<u64> = h.history(0).evaluations.iter().map(|e| e.clock.0).collect();
        assert_eq!(clocks, [2061, 2061, 2500]);
    }

    #[test]
    fn an_other_that_leaves_is_not_waited_for_and_events_are_counted() {
        let mut h = History::default();
        for i in 1..=5u64 {
            h.step(i * 100, w(1), 1, 0.0, 2);
            h.step(i * 100, w(2), 1, 0.0, 2);
        }
        let others = [(w(1), WorkerState::Active), (w(2), WorkerState::Active)];
        h.event(520, EventKind::Dead, w(3), others);
        h.step(600, w(1), 1, 0.0, 2);
        h.event(610, EventKind::Leave, w(2), []);
        let stalls = h.take_stalls();
        assert_eq!(stalls.len(), 1, "{stalls:?}");
        assert_eq!(stalls[0], (EventKind::Dead, 0.0));
        assert_eq!(h.event_counts().get("dead"), Some(&1));
        assert_eq!(h.event_counts().get("leave"), Some(&1));
    }
}
