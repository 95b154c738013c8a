//! What the elastic features did in a run, from the coordinator's trace and placements and the
//! launcher's own actions: per straggler the time to detection and to recovery with the
//! throughput before, during and after; per preemption the time from the notice to the exit;
//! per placement when its worker was admitted and the one it replaced left; and the number of
//! active workers over time.

use std::collections::BTreeMap;

use edl_shared::proto::ids::WorkerId;
use edl_shared::proto::msg::{EventKind, JobTrace};
use edl_shared::proto::{Placement, PlacementKind, PlacementState};
use serde::{Deserialize, Serialize};

use crate::report::WorkerProcess;

/// Length of the throughput windows before and after a straggler episode.
const WINDOW_MS: u64 = 8_000;
/// Time left after a recovery before the "after" window starts (the replacement's first
/// steps, the straggler's exit).
const SETTLE_MS: u64 = 1_000;

/// A scenario event the launcher carried out for the elastic features.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LauncherAction {
    /// When, in milliseconds since the coordinator started (`None` before the first status).
    pub t_ms: Option<u64>,
    /// `slow`, `pause`, `preempt`, `migrate`, `kill` or `term`.
    pub action: String,
    /// The worker process it acted on.
    pub worker: String,
    /// The factor, the notice, or the placement made.
    pub detail: String,
}

/// A placement and what became of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementReport {
    /// Its id.
    pub id: u64,
    /// `add`, or `replace NAME (reason)`.
    pub what: String,
    /// The slot asked for.
    pub slot: Option<String>,
    /// pending, done, failed or cancelled.
    pub state: String,
    /// When the coordinator made it.
    pub requested_ms: u64,
    /// The worker admitted for it.
    pub worker: Option<String>,
    /// When that worker was admitted.
    pub joined_ms: Option<u64>,
    /// For a replacement: when the replaced worker left (or was declared dead).
    pub old_left_ms: Option<u64>,
    /// For a replacement: the fewest active workers between the request and the old
    /// worker's departure, and the number active at the request.
    pub active_min_and_before: Option<(u32, u32)>,
}

/// One straggler episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StragglerReport {
    /// The worker flagged.
    pub worker: String,
    /// When the launcher slowed it (scenario `slow`), if it did.
    pub slowed_ms: Option<u64>,
    /// When the coordinator flagged it.
    pub flagged_ms: u64,
    /// Seconds from the slowdown to the flag.
    pub detect_s: Option<f64>,
    /// The worker that replaced it, if one did.
    pub replaced_by: Option<String>,
    /// When the straggler left (drained after its replacement was admitted, or dropped).
    pub left_ms: Option<u64>,
    /// Seconds from the slowdown to the straggler's departure (the job back at full speed).
    pub recover_s: Option<f64>,
    /// Job samples/s over the window before the slowdown.
    pub before_samples_per_s: Option<f64>,
    /// Job samples/s from the slowdown (or flag) to the straggler's departure (or the flag
    /// plus the window, if it stayed).
    pub during_samples_per_s: Option<f64>,
    /// Job samples/s over the window after that (with the straggler still there if it
    /// stayed).
    pub after_samples_per_s: Option<f64>,
}

/// One preemption notice sent as SIGUSR1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreemptionReport {
    /// The worker.
    pub worker: String,
    /// When the launcher sent SIGUSR1.
    pub signalled_ms: Option<u64>,
    /// When the coordinator heard of it from the worker.
    pub noticed_ms: Option<u64>,
    /// When the worker left the job.
    pub left_ms: Option<u64>,
    /// When its process exited.
    pub exited_ms: Option<u64>,
    /// Seconds from SIGUSR1 to the process's exit.
    pub exit_s: Option<f64>,
    /// The substitute admitted for it, if any.
    pub replaced_by: Option<String>,
    /// When the substitute was admitted.
    pub replacement_joined_ms: Option<u64>,
}

/// One worker the launcher killed (scenario `kill`, SIGKILL): how soon the coordinator
/// declared it dead, and how it found out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeathReport {
    /// The worker.
    pub worker: String,
    /// When the launcher sent SIGKILL.
    pub killed_ms: Option<u64>,
    /// When the coordinator declared it dead (or it left first).
    pub dead_ms: Option<u64>,
    /// Seconds from SIGKILL to the declaration.
    pub detect_s: Option<f64>,
    /// How the coordinator found out (the event's detail: its socket gone, or its lease).
    pub how: String,
}

/// One worker the launcher stopped for a while (scenario `pause`): whether the coordinator
/// wrongly declared it dead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PauseReport {
    /// The worker.
    pub worker: String,
    /// When the launcher sent SIGSTOP.
    pub paused_ms: Option<u64>,
    /// What the launcher did (`SIGSTOP for 2 s`).
    pub detail: String,
    /// When the coordinator declared it dead, if it did.
    pub declared_dead_ms: Option<u64>,
}

/// The elastic part of a run's report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ElasticReport {
    /// What the launcher did (scenario slow, pause, preempt, migrate, kill, term).
    pub actions: Vec<LauncherAction>,
    /// Every placement the coordinator made.
    pub placements: Vec<PlacementReport>,
    /// Every straggler episode.
    pub stragglers: Vec<StragglerReport>,
    /// Every preemption by signal.
    pub preemptions: Vec<PreemptionReport>,
    /// Active workers after each membership change: (milliseconds, count).
    pub active: Vec<(u64, u32)>,
    /// Every worker killed with SIGKILL.
    #[serde(default)]
    pub deaths: Vec<DeathReport>,
    /// Every worker paused with SIGSTOP.
    #[serde(default)]
    pub pauses: Vec<PauseReport>,
}

struct Trace<'a> {
    trace: &'a JobTrace,
    names: BTreeMap<WorkerId, String>,
    batch: u32,
}

impl Trace<'_> {
    fn name(&self, w: WorkerId) -> String {
        self.names.get(&w).cloned().unwrap_or_else(|| w.to_string())
    }

    fn id_of(&self, name: &str) -> Option<WorkerId> {
        self.names
            .iter()
            .rev()
            .find(|(_, n)| *n == name)
            .map(|(id, _)| *id)
    }

    fn first(&self, kinds: &[EventKind], w: WorkerId) -> Option<u64> {
        self.trace
            .events
            .iter()
            .find(|e| e.worker == w && kinds.contains(&e.kind))
            .map(|e| e.t_ms)
    }

    fn left(&self, w: WorkerId) -> Option<u64> {
        self.first(&[EventKind::Leave, EventKind::Dead], w)
    }

    /// Samples per second over `[from, to)`, counting a batch per step; `None` for a window
    /// shorter than a second or past the last step.
    fn rate(&self, from: u64, to: u64) -> Option<f64> {
        let last = self.trace.steps.iter().map(|s| s.t_ms).max()?;
        let to = to.min(last);
        if to < from + 1000 {
            return None;
        }
        let steps = self
            .trace
            .steps
            .iter()
            .filter(|s| s.t_ms >= from && s.t_ms < to)
            .count();
        Some(steps as f64 * f64::from(self.batch) * 1000.0 / (to - from) as f64)
    }

    /// Active workers after each join, leave or death.
    fn active(&self) -> Vec<(u64, u32)> {
        let mut n: i64 = 0;
        let mut out = Vec::new();
        for e in &self.trace.events {
            match e.kind {
                EventKind::Join => n += 1,
                EventKind::Leave | EventKind::Dead => n -= 1,
                _ => continue,
            }
            out.push((e.t_ms, n.max(0) as u32));
        }
        out
    }
}

fn secs(from: Option<u64>, to: Option<u64>) -> Option<f64> {
    Some(to?.checked_sub(from?)? as f64 / 1000.0)
}

impl ElasticReport {
    /// The report of a run: `processes` for exit times, `actions` the launcher's,
    /// `placements` the coordinator's, `batch` to turn steps into samples.
    pub fn of(
        trace: &JobTrace,
        processes: &[WorkerProcess],
        actions: Vec<LauncherAction>,
        placements: Vec<Placement>,
        batch: u32,
    ) -> ElasticReport {
        let t = Trace {
            trace,
            names: trace
                .events
                .iter()
                .filter(|e| e.kind == EventKind::Join)
                .map(|e| (e.worker, e.name.clone()))
                .collect(),
            batch,
        };
        let active = t.active();
        let active_at = |ms: u64| {
            active
                .iter()
                .take_while(|(at, _)| *at <= ms)
                .last()
                .map_or(0, |(_, n)| *n)
        };
        let placed: Vec<PlacementReport> = placements
            .iter()
            .map(|p| {
                let new = match p.state {
                    PlacementState::Done { worker } => Some(worker),
                    _ => None,
                };
                let old = match p.kind {
                    PlacementKind::Replace { old, .. } => Some(old),
                    PlacementKind::Add => None,
                };
                let old_left = old.and_then(|o| t.left(o));
                let window = old_left.map(|left| {
                    let min = active
                        .iter()
                        .filter(|(at, _)| *at >= p.t_ms && *at <= left)
                        .map(|(_, n)| *n)
                        .min()
                        .unwrap_or(u32::MAX);
                    let before = active_at(p.t_ms);
                    (min.min(before), before)
                });
                PlacementReport {
                    id: p.id,
                    what: p.kind.describe(|w| t.name(w)),
                    slot: p.slot.clone(),
                    state: match &p.state {
                        PlacementState::Pending => "pending".into(),
                        PlacementState::Done { .. } => "done".into(),
                        PlacementState::Failed { reason } => format!("failed: {reason}"),
                        PlacementState::Cancelled => "cancelled".into(),
                    },
                    requested_ms: p.t_ms,
                    worker: new.map(|w| t.name(w)),
                    joined_ms: new.and_then(|w| t.first(&[EventKind::Join], w)),
                    old_left_ms: old_left,
                    active_min_and_before: window,
                }
            })
            .collect();
        let replacement_of = |old: WorkerId| {
            placed.iter().zip(&placements).find_map(|(r, p)| {
                matches!(p.kind, PlacementKind::Replace { old: o, .. } if o == old)
                    .then_some(r)
                    .filter(|r| r.worker.is_some())
            })
        };
        let stragglers = trace
            .events
            .iter()
            .filter(|e| e.kind == EventKind::Straggler)
            .map(|e| {
                let slowed = actions
                    .iter()
                    .filter(|a| a.action == "slow" && a.worker == e.name)
                    .filter_map(|a| a.t_ms)
                    .filter(|&ms| ms <= e.t_ms)
                    .max();
                // It counts as gone only if it was made to leave (drained by policy drop or
                // for its replacement); one that trained on to the end stayed.
                let drained = t.trace.events.iter().any(|d| {
                    d.kind == EventKind::Drain && d.worker == e.worker && d.t_ms >= e.t_ms
                });
                let left = t.left(e.worker).filter(|_| drained);
                let start = slowed.unwrap_or(e.t_ms);
                // The window before starts once the membership before the slowdown had
                // settled (not during the first joins).
                let settled = trace
                    .events
                    .iter()
                    .filter(|j| j.kind == EventKind::Join && j.t_ms <= start)
                    .map(|j| j.t_ms + SETTLE_MS)
                    .max()
                    .unwrap_or(0);
                let during_end = left.unwrap_or(e.t_ms + WINDOW_MS);
                let after_start = left.unwrap_or(e.t_ms) + SETTLE_MS;
                StragglerReport {
                    worker: e.name.clone(),
                    slowed_ms: slowed,
                    flagged_ms: e.t_ms,
                    detect_s: secs(slowed, Some(e.t_ms)),
                    replaced_by: replacement_of(e.worker).and_then(|r| r.worker.clone()),
                    left_ms: left,
                    recover_s: secs(slowed, left),
                    before_samples_per_s: slowed
                        .and_then(|s| t.rate(s.saturating_sub(WINDOW_MS).max(settled), s)),
                    during_samples_per_s: t.rate(start, during_end),
                    after_samples_per_s: t.rate(after_start, after_start + WINDOW_MS),
                }
            })
            .collect();
        let preemptions = actions
            .iter()
            .filter(|a| a.action == "preempt")
            .map(|a| {
                let id = t.id_of(&a.worker);
                let exited = processes
                    .iter()
                    .find(|p| p.name == a.worker)
                    .and_then(|p| p.exited_ms);
                let replacement = id.and_then(replacement_of);
                PreemptionReport {
                    worker: a.worker.clone(),
                    signalled_ms: a.t_ms,
                    noticed_ms: id.and_then(|w| t.first(&[EventKind::Preempt], w)),
                    left_ms: id.and_then(|w| t.left(w)),
                    exited_ms: exited,
                    exit_s: secs(a.t_ms, exited),
                    replaced_by: replacement.and_then(|r| r.worker.clone()),
                    replacement_joined_ms: replacement.and_then(|r| r.joined_ms),
                }
            })
            .collect();
        let deaths = actions
            .iter()
            .filter(|a| a.action == "kill")
            .map(|a| {
                let id = t.id_of(&a.worker);
                // Its departure, as `Trace::left` finds it, with the event's detail.
                let event = trace.events.iter().find(|e| {
                    Some(e.worker) == id && matches!(e.kind, EventKind::Dead | EventKind::Leave)
                });
                DeathReport {
                    worker: a.worker.clone(),
                    killed_ms: a.t_ms,
                    dead_ms: event.map(|e| e.t_ms),
                    detect_s: secs(a.t_ms, event.map(|e| e.t_ms)),
                    how: event.map_or_else(
                        || "never declared dead".into(),
                        |e| match e.kind {
                            EventKind::Leave => "left before it was killed".into(),
                            _ => e.detail.clone(),
                        },
                    ),
                }
            })
            .collect();
        let pauses = actions
            .iter()
            .filter(|a| a.action == "pause")
            .map(|a| {
                let id = t.id_of(&a.worker);
                PauseReport {
                    worker: a.worker.clone(),
                    paused_ms: a.t_ms,
                    detail: a.detail.clone(),
                    declared_dead_ms: id.and_then(|w| t.first(&[EventKind::Dead], w)),
                }
            })
            .collect();
        ElasticReport {
            actions,
            placements: placed,
            stragglers,
            preemptions,
            active,
            deaths,
            pauses,
        }
    }
}

fn at(ms: Option<u64>) -> String {
    ms.map_or("?".into(), |m| format!("{:.1} s", m as f64 / 1000.0))
}

fn rate(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{r:.0}"))
}

impl std::fmt::Display for ElasticReport {
    /// Indented lines for the run's summary; nothing when no elastic feature acted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for s in &self.stragglers {
            write!(
                f,
                "  straggler {}: flagged at {}",
                s.worker,
                at(Some(s.flagged_ms))
            )?;
            if let Some(d) = s.detect_s {
                write!(f, ", {d:.1} s after it was slowed")?;
            }
            match (&s.replaced_by, s.recover_s) {
                (Some(by), Some(r)) => {
                    write!(f, "; replaced by {by}, gone {r:.1} s after the slowdown")?
                }
                (None, Some(r)) => write!(f, "; gone {r:.1} s after the slowdown")?,
                _ => write!(f, "; stayed")?,
            }
            writeln!(
                f,
                "; samples/s before {}, during {}, after {}",
                rate(s.before_samples_per_s),
                rate(s.during_samples_per_s),
                rate(s.after_samples_per_s)
            )?;
        }
        for p in &self.preemptions {
            write!(
                f,
                "  preempted {} (SIGUSR1 at {}): exited",
                p.worker,
                at(p.signalled_ms)
            )?;
            match p.exit_s {
                Some(s) => write!(f, " {s:.1} s later")?,
                None => write!(f, " at {}", at(p.exited_ms))?,
            }
            match (&p.replaced_by, p.replacement_joined_ms) {
                (Some(by), Some(j)) => {
                    writeln!(f, "; {by} admitted in its place at {}", at(Some(j)))?
                }
                _ => writeln!(f, "; no substitute")?,
            }
        }
        for d in &self.deaths {
            write!(
                f,
                "  killed {} (SIGKILL at {}): ",
                d.worker,
                at(d.killed_ms)
            )?;
            match d.detect_s {
                Some(s) => writeln!(f, "declared dead {s:.2} s later ({})", d.how)?,
                None => writeln!(f, "{}", d.how)?,
            }
        }
        for p in &self.pauses {
            write!(
                f,
                "  paused {} ({} at {}): ",
                p.worker,
                p.detail,
                at(p.paused_ms)
            )?;
            match p.declared_dead_ms {
                Some(ms) => writeln!(f, "DECLARED DEAD at {}", at(Some(ms)))?,
                None => writeln!(f, "not declared dead")?,
            }
        }
        for p in &self.placements {
            write!(f, "  placement {} ({}", p.id, p.what)?;
            if let Some(slot) = &p.slot {
                write!(f, ", to {slot}")?;
            }
            write!(f, "): {}", p.state)?;
            if let (Some(w), Some(j)) = (&p.worker, p.joined_ms) {
                write!(
                    f,
                    ", {w} admitted {:.1} s after the request",
                    j.saturating_sub(p.requested_ms) as f64 / 1000.0
                )?;
            }
            if let Some((min, before)) = p.active_min_and_before {
                write!(f, "; active workers never below {min} (were {before})")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::ids::Clock;
    use edl_shared::proto::msg::{EventRecord, StepRecord};
    use edl_shared::proto::place::ReplaceReason;

    fn ev(t_ms: u64, kind: EventKind, worker: u64, name: &str) -> EventRecord {
        EventRecord {
            t_ms,
            requested_ms: t_ms,
            kind,
            worker: WorkerId(worker),
            name: name.into(),
            detail: String::new(),
        }
    }

    /// Steps of `workers` every `every` ms over `[from, to)`.
    fn steps(workers: &[u64], from: u64, to: u64, every: u64) -> Vec<StepRecord> {
        let mut out = Vec::new();
        let mut t = from;
        while t < to {
            for &w in workers {
                out.push(StepRecord {
                    t_ms: t,
                    worker: WorkerId(w),
                    clock: Clock(t),
                });
            }
            t += every;
        }
        out
    }

    fn trace(events: Vec<EventRecord>, steps: Vec<StepRecord>) -> JobTrace {
        JobTrace {
            events,
            steps,
            moves: Vec::new(),
            first_step: 0,
            next_step: 0,
            more: false,
            dropped: (0, 0, 0),
        }
    }

    fn slow(t_ms: u64, worker: &str) -> LauncherAction {
        LauncherAction {
            t_ms: Some(t_ms),
            action: "slow".into(),
            worker: worker.into(),
            detail: "3x".into(),
        }
    }

    #[test]
    fn a_replaced_straggler_recovers_and_an_ignored_one_stays() {
        // Two workers step every 100 ms (10 steps/s each, batch 10: 200 samples/s); w1 is
        // slowed at 10 s, flagged at 11 s; the job then runs at a third of the speed until
        // p1 joins at 12 s and w1 leaves at 12.5 s.
        let mut st = steps(&[1, 2], 0, 10_000, 100);
        st.extend(steps(&[1, 2], 10_000, 12_500, 300));
        st.extend(steps(&[2, 3], 12_500, 30_000, 100));
        let events = vec![
            ev(0, EventKind::Join, 1, "w0"),
            ev(0, EventKind::Join, 2, "w1"),
            ev(11_000, EventKind::Straggler, 2, "w1"),
            ev(11_000, EventKind::ReplaceRequested, 2, "w1"),
            ev(12_000, EventKind::Join, 3, "p1"),
            ev(12_000, EventKind::Drain, 2, "w1"),
            ev(12_500, EventKind::Leave, 2, "w1"),
        ];
        let placements = vec![Placement {
            id: 1,
            kind: PlacementKind::Replace {
                old: WorkerId(2),
                reason: ReplaceReason::Straggler,
            },
            slot: None,
            state: PlacementState::Done {
                worker: WorkerId(3),
            },
            t_ms: 11_000,
        }];
        let r = ElasticReport::of(
            &trace(events.clone(), st.clone()),
            &[],
            vec![slow(10_000, "w1")],
            placements,
            10,
        );
        let s = &r.stragglers[0];
        assert_eq!(s.detect_s, Some(1.0));
        assert_eq!(s.recover_s, Some(2.5));
        assert_eq!(s.replaced_by.as_deref(), Some("p1"));
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1.0);
        assert!(near(s.before_samples_per_s, 200.0), "{s:?}");
        assert!(s.during_samples_per_s.is_some_and(|d| d < 100.0), "{s:?}");
        assert!(near(s.after_samples_per_s, 200.0), "{s:?}");
        let p = &r.placements[0];
        assert_eq!((p.joined_ms, p.old_left_ms), (Some(12_000), Some(12_500)));
        assert_eq!(p.active_min_and_before, Some((2, 2)));
        assert_eq!(p.what, "replace w1 (straggler)");
        assert!(r.to_string().contains("replaced by p1"), "{r}");

        // Ignored: w1 trains on to the end (it leaves only when the data runs out).
        let mut st = steps(&[1, 2], 0, 10_000, 100);
        st.extend(steps(&[1, 2], 10_000, 30_000, 300));
        let events = vec![
            ev(0, EventKind::Join, 1, "w0"),
            ev(0, EventKind::Join, 2, "w1"),
            ev(11_000, EventKind::Straggler, 2, "w1"),
            ev(30_000, EventKind::Leave, 1, "w0"),
            ev(30_000, EventKind::Leave, 2, "w1"),
        ];
        let r = ElasticReport::of(
            &trace(events, st),
            &[],
            vec![slow(10_000, "w1")],
            vec![],
            10,
        );
        let s = &r.stragglers[0];
        assert_eq!(
            (s.left_ms, s.recover_s, s.replaced_by.as_ref()),
            (None, None, None)
        );
        assert!(s.after_samples_per_s.is_some_and(|a| a < 100.0), "{s:?}");
        assert!(r.to_string().contains("stayed"), "{r}");
        assert_eq!(r.active.last(), Some(&(30_000, 0)));
    }

    #[test]
    fn a_preemption_reports_its_exit_and_substitute() {
        let events = vec![
            ev(0, EventKind::Join, 1, "w0"),
            ev(5_000, EventKind::Preempt, 1, "w0"),
            ev(6_000, EventKind::Join, 2, "p1"),
            ev(6_000, EventKind::Drain, 1, "w0"),
            ev(6_100, EventKind::Leave, 1, "w0"),
        ];
        let placements = vec![Placement {
            id: 1,
            kind: PlacementKind::Replace {
                old: WorkerId(1),
                reason: ReplaceReason::Preempt,
            },
            slot: None,
            state: PlacementState::Done {
                worker: WorkerId(2),
            },
            t_ms: 5_000,
        }];
        let procs = [WorkerProcess {
            name: "w0".into(),
            slot: "slot0".into(),
            placement: None,
            exited_ms: Some(6_200),
            fate: "preempted".into(),
            exit_code: Some(0),
            signal: None,
        }];
        let action = LauncherAction {
            t_ms: Some(4_990),
            action: "preempt".into(),
            worker: "w0".into(),
            detail: "SIGUSR1".into(),
        };
        let r = ElasticReport::of(&trace(events, vec![]), &procs, vec![action], placements, 8);
        let p = &r.preemptions[0];
        assert_eq!(p.noticed_ms, Some(5_000));
        assert_eq!(p.left_ms, Some(6_100));
        assert!(p.exit_s.is_some_and(|s| (s - 1.21).abs() < 1e-9), "{p:?}");
        assert_eq!(p.replaced_by.as_deref(), Some("p1"));
        assert_eq!(p.replacement_joined_ms, Some(6_000));
        assert_eq!(r.placements[0].active_min_and_before, Some((1, 1)));
    }
}
