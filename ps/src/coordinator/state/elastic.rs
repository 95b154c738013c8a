//! What elasticity buys a running job, as state-machine steps: straggler scores from each
//! worker's busy time per step, and what the policy does about a flagged one; preemption
//! notices; placements (requests for a placer to start a worker) for replacements,
//! migrations and resizes, fulfilled when a worker naming one registers.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use edl_shared::proto::ErrorCode;
use edl_shared::proto::ids::WorkerId;
use edl_shared::proto::msg::{EventKind, Judgement, WorkerState};
use edl_shared::proto::place::{
    Placement, PlacementKind, PlacementState, ReplaceReason, Resize, StragglerPolicy,
    StragglerSettings,
};

use super::{CoordinatorState, Refusal};

/// Finished placements kept for `edlctl` and placers; older ones are forgotten.
const MAX_FINISHED_PLACEMENTS: usize = 1_000;
/// The most workers a resize may ask for (each is a placement held until it is placed).
pub const MAX_SCALE: u32 = 4_096;
/// The longest preemption notice (clouds give two minutes at most).
pub const MAX_NOTICE: Duration = Duration::from_secs(24 * 3600);
/// The longest slot name and placer's failure reason kept.
const MAX_TEXT: usize = 256;

/// A worker's recent steps, for its straggler score, and its progress, for stall reports.
#[derive(Debug, Default)]
pub(super) struct Pace {
    /// When its current step began: the grant of the previous one, its admission, or the
    /// lease of a partition after waiting for data. Consistency waits are not work.
    pub busy_since: Option<Instant>,
    /// Steps that end before this are not judged (its warm-up after admission).
    pub warm_from: Option<Instant>,
    /// Its steps in the window (at least the last [`StragglerSettings::MIN_STEPS`]): when
    /// each ended and its busy milliseconds.
    pub recent: VecDeque<(Instant, f32)>,
    /// The median of `recent` at its last step.
    pub median: f32,
    /// The reference it was last judged against: the median of the others' medians (0 while
    /// unknown).
    pub others: f32,
    /// Its median over the others' (0 while unknown).
    pub score: f64,
    /// Judged slow at every judgement since then (a flag needs a later judgement, at least
    /// the confirmation time after it).
    pub suspect_since: Option<Instant>,
    /// Flagged and judged recovered at every judgement since then.
    pub recovering_since: Option<Instant>,
    /// Flagged as a straggler.
    pub flagged: bool,
    /// When its clock last moved: admission, a step, or data after waiting for it.
    pub progressed: Option<Instant>,
    /// Reported as holding the others up since its last progress.
    pub stalled: bool,
    /// The deadline of a preemption notice.
    pub notice: Option<Instant>,
    /// The placement it was started for.
    pub placement: Option<u64>,
}

impl Pace {
    /// A worker's pace from its admission at `now`: busy from now, judged after `warmup`.
    pub fn admitted(now: Instant, warmup: Duration) -> Pace {
        Pace {
            busy_since: Some(now),
            warm_from: now.checked_add(warmup),
            progressed: Some(now),
            ..Pace::default()
        }
    }

    /// Forgets its steps and judgement (the window changed length).
    fn reset(&mut self) {
        self.recent.clear();
        self.median = 0.0;
        self.others = 0.0;
        self.score = 0.0;
        self.suspect_since = None;
        self.recovering_since = None;
        self.flagged = false;
    }

    /// Judged: enough steps in its window (none are recorded during its warm-up).
    fn judged(&self) -> bool {
        self.recent.len() >= StragglerSettings::MIN_STEPS
    }

    /// Where the detector stands on it.
    pub fn judgement(&self) -> Judgement {
        if self.flagged {
            Judgement::Flagged
        } else if self.suspect_since.is_some() {
            Judgement::Suspect
        } else if !self.judged() {
            Judgement::Warming
        } else if self.score > 0.0 {
            Judgement::Ok
        } else {
            Judgement::Unjudged
        }
    }
}

/// The median of a few values (the upper one of an even count).
fn median(values: impl Iterator<Item = f32>) -> Option<f32> {
    let mut v: Vec<f32> = values.collect();
    if v.is_empty() {
        return None;
    }
    let mid = v.len() / 2;
    let (_, m, _) = v.select_nth_unstable_by(mid, f32::total_cmp);
    Some(*m)
}

/// Steps a window keeps at most, whatever their age (a bound on memory per worker).
const MAX_WINDOW_STEPS: usize = 10_000;

impl CoordinatorState {
    /// Sets how stragglers and stalls are found and handled.
    pub fn set_stragglers(&mut self, s: StragglerSettings) -> Result<(), Refusal> {
        s.check().map_err(|e| (ErrorCode::InvalidRequest, e))?;
        let window_changed = s.window_ms != self.stragglers.window_ms;
        self.stragglers = s;
        if window_changed {
            // Windows change length: judge everyone afresh.
            for w in self.workers.values_mut() {
                w.pace.reset();
            }
        }
        Ok(())
    }

    /// The straggler settings in force.
    pub fn stragglers(&self) -> StragglerSettings {
        self.stragglers
    }

    /// Log lines of what the state machine decided on its own (flags, drains, placements)
    /// since the last call, for the service layer to log.
    pub fn take_news(&mut self) -> Vec<String> {
        std::mem::take(&mut self.news)
    }

    /// The worker may start its next step now: its busy time runs from here.
    pub fn granted(&mut self, worker: WorkerId, now: Instant) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.pace.busy_since = Some(now);
        }
    }

    /// Records a step's busy time and judges the worker; called by `advance`.
    pub(super) fn paced(&mut self, worker: WorkerId, now: Instant) {
        let s = self.stragglers;
        let window = Duration::from_millis(u64::from(s.window_ms));
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        w.pace.progressed = Some(now);
        w.pace.stalled = false;
        let Some(since) = w.pace.busy_since.take() else {
            return;
        };
        if w.pace.warm_from.is_some_and(|t| now < t) {
            return;
        }
        let busy = now.saturating_duration_since(since).as_secs_f32() * 1000.0;
        let p = &mut w.pace;
        p.recent.push_back((now, busy));
        let horizon = now.checked_sub(window);
        while p.recent.len() > MAX_WINDOW_STEPS
            || (p.recent.len() > StragglerSettings::MIN_STEPS
                && horizon.is_some_and(|h| p.recent.front().is_some_and(|(t, _)| *t < h)))
        {
            p.recent.pop_front();
        }
        p.median = median(p.recent.iter().map(|(_, ms)| *ms)).unwrap_or(0.0);
        if !p.judged() {
            return;
        }
        let mine = p.median;
        // Judged against the workers that train now, are judged themselves and stepped
        // lately: within the window, or within two of their own steps where those are longer
        // than the window (a slow model), so that a worker that stopped stepping does not
        // stand for the machine's present.
        let recent = |o: &Pace| {
            o.recent.back().is_some_and(|(t, _)| {
                let lately = window.max(Duration::from_secs_f32(2.0 * o.median.max(0.0) / 1000.0));
                now.saturating_duration_since(*t) <= lately
            })
        };
        let others: Vec<(WorkerId, f32)> = self
            .workers
            .iter()
            .filter(|(id, o)| {
                **id != worker && o.counts() && !o.draining && o.pace.judged() && recent(&o.pace)
            })
            .map(|(id, o)| (*id, o.pace.median))
            .collect();
        let reference = median(others.iter().map(|(_, m)| *m)).filter(|r| *r > 0.0);
        let w = self.workers.get_mut(&worker).expect("judged above");
        let Some(reference) = reference else {
            // Nobody to compare with: no judgement, and none pending.
            w.pace.score = 0.0;
            w.pace.others = 0.0;
            w.pace.suspect_since = None;
            return;
        };
        // The noise on this machine now: how far below the reference the others spread.
        let lowest = others.iter().map(|(_, m)| *m).fold(reference, f32::min);
        let gap = (s.min_gap_ms).max(reference - lowest);
        let score = f64::from(mine) / f64::from(reference);
        let slow = score > f64::from(s.factor) && mine - reference > gap;
        let p = &mut w.pace;
        p.score = score;
        p.others = reference;
        if slow {
            p.suspect_since.get_or_insert(now);
        } else {
            p.suspect_since = None;
        }
        let confirmed = |since: Option<Instant>| {
            since.is_some_and(|t| now.saturating_duration_since(t) >= s.confirm())
        };
        if !p.flagged && !w.draining && confirmed(p.suspect_since) {
            p.flagged = true;
            p.recovering_since = None;
            let name = w.name.clone();
            let held = p
                .suspect_since
                .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f32());
            let steps = p.recent.len();
            let them: Vec<String> = others
                .iter()
                .map(|(id, m)| {
                    let name = self.workers.get(id).map_or("?", |o| o.name.as_str());
                    format!("{name} {m:.1}")
                })
                .collect();
            let detail = format!(
                "median {mine:.1} ms over its last {steps} steps against the others' \
                 {reference:.1} ms ({}): {score:.2}x > {}x and {:.1} ms above (needed {gap:.1}), \
                 for {held:.2} s",
                them.join(", "),
                s.factor,
                mine - reference,
            );
            self.event_with(EventKind::Straggler, worker, (now, now), detail.clone());
            self.news.push(format!(
                "straggler: {worker} ({name}): {detail}; policy {}",
                s.policy
            ));
            match s.policy {
                StragglerPolicy::Ignore => {}
                StragglerPolicy::Drop => {
                    let _ = self.drain(worker, now);
                    self.news
                        .push(format!("straggler {worker} drained (policy drop)"));
                }
                StragglerPolicy::Replace => {
                    self.replace(worker, ReplaceReason::Straggler, None, now);
                }
            }
        } else if p.flagged {
            if score < f64::from(s.recover_factor()) {
                p.recovering_since.get_or_insert(now);
            } else {
                p.recovering_since = None;
            }
            if confirmed(p.recovering_since) {
                p.flagged = false;
                p.recovering_since = None;
                let detail = format!(
                    "median {mine:.1} ms against the others' {reference:.1} ms: {score:.2}x < {}x",
                    s.recover_factor()
                );
                self.event_with(EventKind::Recovered, worker, (now, now), detail.clone());
                self.news
                    .push(format!("{worker} is no longer a straggler: {detail}"));
            }
        }
    }

    /// Reports (and, if the job says so, drops) workers that hold the minimum clock others
    /// wait on (SSP, BSP) without finishing a step for longer than the settings allow; called
    /// by the service layer's sweep. Returns the workers dropped.
    pub fn stalls(&mut self, now: Instant) -> Vec<WorkerId> {
        let Some(s) = self.job.consistency.staleness() else {
            return Vec::new();
        };
        let Some(min) = self.min_active_clock() else {
            return Vec::new();
        };
        let report = Duration::from_millis(u64::from(self.stragglers.stall_ms));
        let drop_after = (self.stragglers.stall_drop_ms > 0)
            .then(|| Duration::from_millis(u64::from(self.stragglers.stall_drop_ms)));
        // Only a worker at the minimum past the report time holds anyone up long enough to
        // say so (ordinarily nobody: then nothing more is looked at).
        let holding: Vec<(WorkerId, Duration)> = self
            .workers
            .iter()
            .filter(|(_, w)| w.counts() && w.clock == min)
            .filter_map(|(id, w)| {
                let held = now.saturating_duration_since(w.pace.progressed?);
                let act = !w.pace.stalled || drop_after.is_some_and(|d| held >= d);
                (held >= report && act).then_some((*id, held))
            })
            .collect();
        if holding.is_empty() {
            return Vec::new();
        }
        let waiting: Vec<&str> = self
            .workers
            .values()
            .filter(|w| w.counts() && !w.draining && w.clock.0 > min.0.saturating_add(s))
            .map(|w| w.name.as_str())
            .collect();
        if waiting.is_empty() {
            return Vec::new();
        }
        let waiting = format!(
            "{} worker(s) wait on it ({})",
            waiting.len(),
            waiting.join(", ")
        );
        let mut dropped = Vec::new();
        for (id, held) in holding {
            let Some(w) = self.workers.get_mut(&id) else {
                continue;
            };
            let what = format!(
                "holds the minimum clock {} without finishing a step for {:.1} s; {waiting}",
                min.0,
                held.as_secs_f32(),
            );
            if !w.pace.stalled {
                w.pace.stalled = true;
                let name = w.name.clone();
                let policy = match drop_after {
                    None => "policy wait: the others wait for it".to_string(),
                    Some(d) => format!("policy drop: dropped after {:.1} s", d.as_secs_f32()),
                };
                self.news
                    .push(format!("stalled: {id} ({name}) {what}; {policy}"));
                self.event_with(EventKind::Stalled, id, (now, now), what.clone());
            }
            if drop_after.is_some_and(|d| held >= d) {
                self.declare_dead(id, now, format!("dropped: it {what}"));
                dropped.push(id);
            }
        }
        dropped
    }

    /// How long `worker` has held the others up without progress, once reported.
    pub(super) fn stalled_for(&self, worker: WorkerId, now: Instant) -> Option<u64> {
        let w = self.workers.get(&worker)?;
        let since = w.pace.progressed.filter(|_| w.pace.stalled)?;
        Some(now.saturating_duration_since(since).as_millis() as u64)
    }

    /// Asks the placer for a worker to replace `old` (unless one is already pending).
    fn replace(
        &mut self,
        old: WorkerId,
        reason: ReplaceReason,
        slot: Option<String>,
        now: Instant,
    ) -> Placement {
        if let Some(p) = self.placements.iter().find(|p| {
            p.is_pending() && matches!(p.kind, PlacementKind::Replace { old: o, .. } if o == old)
        }) {
            return p.clone();
        }
        let p = self.place(PlacementKind::Replace { old, reason }, slot, now);
        self.event(EventKind::ReplaceRequested, old, now, now);
        self.news.push(format!(
            "placement {}: a replacement for {old} ({reason}) requested",
            p.id
        ));
        p
    }

    fn place(&mut self, kind: PlacementKind, slot: Option<String>, now: Instant) -> Placement {
        let p = Placement {
            id: self.next_placement,
            kind,
            slot,
            state: PlacementState::Pending,
            t_ms: self.ms(now),
        };
        self.next_placement += 1;
        self.placements.push_back(p.clone());
        let finished = if self.placements.len() > MAX_FINISHED_PLACEMENTS {
            self.placements.iter().filter(|p| !p.is_pending()).count()
        } else {
            0
        };
        if finished > MAX_FINISHED_PLACEMENTS
            && let Some(i) = self.placements.iter().position(|p| !p.is_pending())
        {
            self.placements.remove(i);
        }
        p
    }

    fn placement_mut(&mut self, id: u64) -> Option<&mut Placement> {
        self.placements.iter_mut().find(|p| p.id == id)
    }

    /// A worker admitted for placement `id`: the placement is done, and the worker it
    /// replaces (if still training) is drained. A placement that is not pending (unknown,
    /// cancelled, already done) changes nothing but the log.
    pub fn placed(&mut self, worker: WorkerId, id: u64, now: Instant) {
        let Some(p) = self.placement_mut(id).filter(|p| p.is_pending()) else {
            self.news.push(format!(
                "{worker} was started for placement {id}, which is not pending: admitted as \
                 an extra worker"
            ));
            return;
        };
        p.state = PlacementState::Done { worker };
        let kind = p.kind;
        if let Some(w) = self.workers.get_mut(&worker) {
            w.pace.placement = Some(id);
        }
        if let PlacementKind::Replace { old, reason } = kind {
            let draining = self.workers.get(&old).is_none_or(|o| o.draining);
            if !draining && self.drain(old, now).is_ok() {
                self.news
                    .push(format!("{worker} replaces {old} ({reason}): {old} drained"));
            }
        }
    }

    /// A placer could not start a worker for placement `id`.
    pub fn placement_failed(&mut self, id: u64, reason: &str, now: Instant) -> Result<(), Refusal> {
        let p = self.placement_mut(id).filter(|p| p.is_pending()).ok_or((
            ErrorCode::InvalidRequest,
            format!("placement {id} is not pending"),
        ))?;
        let mut reason = reason.to_string();
        if reason.len() > MAX_TEXT {
            let mut cut = MAX_TEXT;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        p.state = PlacementState::Failed {
            reason: reason.clone(),
        };
        // A preempted worker was waiting for its substitute: none is coming, so it leaves
        // after its step.
        if let PlacementKind::Replace {
            old,
            reason: ReplaceReason::Preempt,
        } = p.kind
        {
            let _ = self.drain(old, now);
        }
        self.news
            .push(format!("placement {id} failed in the placer: {reason}"));
        Ok(())
    }

    /// The pending placements and the latest finished ones, oldest first.
    pub fn placements(&self) -> Vec<Placement> {
        self.placements.iter().cloned().collect()
    }

    /// Gives `worker` a preemption notice: it must be gone by `now + notice`. Under policy
    /// `replace` a substitute is requested at once and the worker trains on until the
    /// substitute is admitted (then it is drained) or its deadline comes, so that the job
    /// does not run short while the substitute starts; otherwise it is drained now.
    pub fn preempt(
        &mut self,
        worker: WorkerId,
        notice: Duration,
        now: Instant,
    ) -> Result<Option<Placement>, Refusal> {
        if notice > MAX_NOTICE {
            return Err((
                ErrorCode::InvalidRequest,
                format!(
                    "a preemption notice of {} s is longer than the {} s allowed",
                    notice.as_secs(),
                    MAX_NOTICE.as_secs()
                ),
            ));
        }
        let replace = self.stragglers.policy == StragglerPolicy::Replace;
        let w = self.active(worker)?;
        let deadline = now.checked_add(notice).unwrap_or(now);
        w.pace.notice = Some(w.pace.notice.map_or(deadline, |d| d.min(deadline)));
        let leaving = w.draining;
        self.event(EventKind::Preempt, worker, now, now);
        if replace && !leaving {
            return Ok(Some(self.replace(
                worker,
                ReplaceReason::Preempt,
                None,
                now,
            )));
        }
        self.drain(worker, now)?;
        Ok(None)
    }

    /// What a heartbeat answers: whether the worker is asked to leave, and the milliseconds
    /// left of its preemption notice.
    pub fn beat(&mut self, worker: WorkerId, now: Instant) -> Result<(bool, Option<u64>), Refusal> {
        let w = self.active(worker)?;
        w.last_seen = now;
        let left = w
            .pace
            .notice
            .map(|d| d.saturating_duration_since(now).as_millis() as u64);
        Ok((w.draining, left))
    }

    /// An operator moves `worker`: a placement for its replacement, in `slot` if given.
    pub fn migrate(
        &mut self,
        worker: WorkerId,
        slot: Option<String>,
        now: Instant,
    ) -> Result<Placement, Refusal> {
        if slot.as_ref().is_some_and(|s| s.len() > MAX_TEXT) {
            return Err((
                ErrorCode::InvalidRequest,
                format!("a slot name is at most {MAX_TEXT} bytes"),
            ));
        }
        if self.active(worker)?.draining {
            return Err((
                ErrorCode::Conflict,
                format!("{worker} is already leaving; there is nothing to move"),
            ));
        }
        Ok(self.replace(worker, ReplaceReason::Migrate, slot, now))
    }

    /// Resizes the job to `target` workers that train and are not leaving: placements for
    /// the missing ones (pending additions count as coming), or, for the extra ones, pending
    /// additions cancelled first and then the newest workers drained. 0 suspends the job
    /// (a cluster scheduler taking its slots away): every worker drains, and the servers keep
    /// the parameters and the data progress until the job is scaled up again.
    pub fn scale(&mut self, target: u32, now: Instant) -> Result<Resize, Refusal> {
        if target > MAX_SCALE {
            return Err((
                ErrorCode::InvalidRequest,
                format!("{target} workers is more than the {MAX_SCALE} a job may ask for"),
            ));
        }
        let staying: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| w.state == WorkerState::Active && !w.draining)
            .map(|(id, _)| *id)
            .collect();
        let coming: Vec<u64> = self
            .placements
            .iter()
            .filter(|p| p.is_pending() && p.kind == PlacementKind::Add)
            .map(|p| p.id)
            .collect();
        let target = target as usize;
        let have = staying.len() + coming.len();
        let mut r = Resize::default();
        if target > have {
            for _ in have..target {
                r.placed.push(self.place(PlacementKind::Add, None, now).id);
            }
        } else {
            let mut extra = have - target;
            for id in coming.iter().rev() {
                if extra == 0 {
                    break;
                }
                if let Some(p) = self.placement_mut(*id) {
                    p.state = PlacementState::Cancelled;
                }
                r.cancelled.push(*id);
                extra -= 1;
            }
            for id in staying.iter().rev().take(extra) {
                self.drain(*id, now)?;
                r.drained.push(*id);
                // The job shrinks: a replacement asked for this worker is no longer wanted.
                for p in self.placements.iter_mut().filter(|p| {
                    p.is_pending()
                        && matches!(p.kind, PlacementKind::Replace { old, .. } if old == *id)
                }) {
                    p.state = PlacementState::Cancelled;
                    r.cancelled.push(p.id);
                }
            }
        }
        self.news.push(format!(
            "scale to {target}: {} placements, {} drained, {} cancelled",
            r.placed.len(),
            r.drained.len(),
            r.cancelled.len()
        ));
        Ok(r)
    }

    /// Steps behind the most advanced counting worker.
    pub(super) fn staleness(&self, worker: WorkerId) -> u64 {
        let max = self
            .workers
            .values()
            .filter(|w| w.counts())
            .map(|w| w.clock.0)
            .max()
            .unwrap_or(0);
        self.workers
            .get(&worker)
            .map_or(0, |w| max.saturating_sub(w.clock.0))
    }
}

#[cfg(test)]
mod tests;
