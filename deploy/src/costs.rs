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
//!
//! Shard events belong to no worker, so every worker that had stepped is an other: a key-range
//! move of the trace at its start, and the launcher's shard events (adding, removing, killing
//! and restarting a shard server; killing and restarting the coordinator) at the moment the
//! launcher acted, are measured as the moments of [`stall_noise`] are. A move also reports how long its range was held (neither readable
//! nor writable) and the bytes it streamed.

use std::collections::{BTreeMap, BTreeSet};

use edl_shared::proto::ids::{ShardId, WorkerId};
use edl_shared::proto::msg::{EpochLedger, EventKind, JobStatus, JobTrace, MoveReport};

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

/// The lowercase name of an event kind, as the report writes it (the coordinator's own).
pub use edl_ps::coordinator::state::kind_name;

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
        // Flags, notices and requests are not membership changes (see `crate::elastic`).
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::Join | EventKind::Drain | EventKind::Leave | EventKind::Dead
            )
        })
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
                hold_ms: None,
                bytes: None,
                took_ms: None,
            }
        })
        .collect()
}

/// A shard event the launcher carried out (see [`crate::scenario::Action`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ShardAction {
    /// When the launcher acted, in milliseconds since the coordinator started.
    pub t_ms: u64,
    /// `shard_add`, `shard_remove`, `kill_shard` or `restart_shard`; `kill_coordinator` or
    /// `restart_coordinator`.
    pub kind: &'static str,
    /// The shard's process name (`coordinator` for the coordinator's events).
    pub shard: String,
    /// How long the launcher's part took: for an add, from starting the process to the
    /// coordinator's answer (its moves done); for a remove, the coordinator's answer; for a
    /// restart, until the shard served again (the coordinator: until it answered again).
    /// `None` for a kill.
    pub took_ms: Option<f64>,
}

/// How a move names its shards: by process name where known, by id otherwise.
fn shard_label(names: &BTreeMap<ShardId, String>, id: ShardId) -> String {
    names.get(&id).cloned().unwrap_or_else(|| id.to_string())
}

/// How a move appears in the report's `worker` field: `keys 3..6 s0→s2`.
pub fn move_label(m: &MoveReport, names: &BTreeMap<ShardId, String>) -> String {
    format!(
        "keys {}..{} {}→{}",
        m.start,
        m.end,
        shard_label(names, m.from),
        shard_label(names, m.to)
    )
}

/// Every key-range move of `trace` and every shard event of the launcher, with the stall
/// around it; `names` gives the shards' process names by id.
pub fn shard_costs(
    trace: &JobTrace,
    names: &BTreeMap<ShardId, String>,
    actions: &[ShardAction],
) -> Vec<EventReport> {
    let line = Timeline::of(trace);
    let moves = trace.moves.iter().map(|m| {
        let (step_ms, stall_ms) = line.cost_at(m.t_ms, None);
        EventReport {
            t_ms: m.t_ms,
            kind: "move".into(),
            worker: move_label(m, names),
            step_ms,
            stall_ms,
            join_latency_ms: None,
            hold_ms: Some(m.hold_ms),
            bytes: Some(m.bytes),
            took_ms: Some(m.millis),
        }
    });
    let acts = actions.iter().map(|a| {
        let (step_ms, stall_ms) = line.cost_at(a.t_ms, None);
        EventReport {
            t_ms: a.t_ms,
            kind: a.kind.into(),
            worker: a.shard.clone(),
            step_ms,
            stall_ms,
            join_latency_ms: None,
            hold_ms: None,
            bytes: None,
            took_ms: a.took_ms,
        }
    });
    // A launcher's request comes before the moves it caused when both fall on one
    // millisecond (and the caller sorts by time, stably).
    acts.chain(moves).collect()
}

/// The times a noise floor must keep clear of, besides the trace's membership events: every
/// move, every shard or coordinator event, and a killed shard's or coordinator's whole
/// absence (from the kill to the end of its restart).
pub fn shard_quiet_spans(trace: &JobTrace, actions: &[ShardAction]) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = trace.moves.iter().map(|m| (m.t_ms, m.t_ms)).collect();
    for (i, a) in actions.iter().enumerate() {
        let mut end = a.t_ms + a.took_ms.map_or(0, |t| t as u64);
        let restart = match a.kind {
            "kill_shard" => Some("restart_shard"),
            "kill_coordinator" => Some("restart_coordinator"),
            _ => None,
        };
        if let Some(restart) = restart
            && let Some(back) = actions[i + 1..]
                .iter()
                .find(|b| b.kind == restart && b.shard == a.shard)
        {
            end = back.t_ms + back.took_ms.map_or(0, |t| t as u64);
        }
        spans.push((a.t_ms, end));
    }
    spans
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
/// stepped in the second before), at least [`NOISE_CLEARANCE_MS`] from any event and from
/// every span of `also_quiet` (see [`shard_quiet_spans`]), and outside the silence of a worker
/// that died (from its last step to its death).
pub fn stall_noise(trace: &JobTrace, also_quiet: &[(u64, u64)]) -> Option<StallNoise> {
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
            && also_quiet
                .iter()
                .all(|&(from, to)| t + NOISE_CLEARANCE_MS <= from || t >= to + NOISE_CLEARANCE_MS)
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
            let worst = edl_ps::ledger::worst_case(ledgers, e.epoch, train_samples);
            EpochReport {
                epoch: e.epoch,
                samples: worst.applied,
                duplicates: worst.duplicates,
                missing: worst.missing,
                skipped_pushes: worst.skipped_pushes,
                reported_samples: e.samples,
                train_loss: if e.samples > 0 {
                    e.loss_sum / e.samples as f64
                } else {
                    0.0
                },
                bytes_pushed: e.bytes_pushed,
                bytes_pulled: e.bytes_pulled,
            }
        })
        .collect()
}

/// The event kinds in the order the summary lists them.
pub const KINDS: [&str; 11] = [
    "join",
    "drain",
    "leave",
    "dead",
    "shard_add",
    "move",
    "shard_remove",
    "kill_shard",
    "restart_shard",
    "kill_coordinator",
    "restart_coordinator",
];

/// Per event kind (in the order of [`KINDS`]): how many, and the median and largest stall,
/// the median join latency and the median and largest hold over the events that have one.
pub fn kind_summaries(events: &[EventReport]) -> Vec<KindSummary> {
    let kinds: BTreeSet<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    KINDS
        .into_iter()
        .filter(|k| kinds.contains(k))
        .map(|kind| {
            let of: Vec<&EventReport> = events.iter().filter(|e| e.kind == kind).collect();
            let mut stalls: Vec<f64> = of.iter().filter_map(|e| e.stall_ms).collect();
            let mut steps: Vec<f64> = of.iter().filter_map(|e| e.step_ms).collect();
            let mut joins: Vec<f64> = of.iter().filter_map(|e| e.join_latency_ms).collect();
            let mut holds: Vec<f64> = of.iter().filter_map(|e| e.hold_ms).collect();
            KindSummary {
                kind: kind.to_string(),
                count: of.len(),
                measured: stalls.len(),
                median_stall_ms: median(&mut stalls),
                max_stall_ms: stalls.iter().copied().reduce(f64::max),
                median_step_ms: median(&mut steps),
                median_join_latency_ms: median(&mut joins),
                max_hold_ms: holds.iter().copied().reduce(f64::max),
                median_hold_ms: median(&mut holds),
            }
        })
        .collect()
}

/// The costs of one kind of event, summed up.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KindSummary {
    /// One of [`KINDS`].
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
    /// Median time a moved range was held (moves only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub median_hold_ms: Option<f64>,
    /// Longest time a moved range was held (moves only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hold_ms: Option<f64>,
}

#[cfg(test)]
mod tests;
