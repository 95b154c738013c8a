//! What elasticity buys a running job: straggler handling, preemption notices, migration and
//! resizing. The coordinator decides; a *placer* (the process that starts workers: `edl-local`,
//! a scheduler, a test) fulfils its placement requests by starting workers that name the
//! request when they register.

use std::fmt;
use std::str::FromStr;

use crate::ids::WorkerId;

/// What the coordinator does with a worker it flags as a straggler.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub enum StragglerPolicy {
    /// Flag it (log, event, `edlctl workers`) and do nothing else.
    #[default]
    Ignore,
    /// Drain it: the job goes on with one worker fewer.
    Drop,
    /// Ask the placer for a replacement, admit it, then drain the straggler: the worker
    /// count never dips. Preemption notices get a replacement too.
    Replace,
}

impl StragglerPolicy {
    /// Every policy, for help texts and errors.
    pub const ALL: [StragglerPolicy; 3] = [Self::Ignore, Self::Drop, Self::Replace];
}

impl fmt::Display for StragglerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ignore => "ignore",
            Self::Drop => "drop",
            Self::Replace => "replace",
        })
    }
}

impl FromStr for StragglerPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.to_string() == s)
            .ok_or_else(|| format!("unknown straggler policy {s:?}: use ignore, drop or replace"))
    }
}

/// How stragglers and stalls are found and what is done about them.
///
/// A worker's *step time* is its own work: from the grant of one step to the report of the
/// next (pull, compute, push), never its wait for slower workers. A worker is judged on the
/// median of its steps that ended within the last `window_ms` (at least its last
/// [`StragglerSettings::MIN_STEPS`]), against the other judged workers' medians over the same
/// stretch of time: a machine that slows everyone slows the reference too. It is flagged once
/// its median has been more than `factor` times the reference, and more than `min_gap_ms`
/// and the spread between the others' medians above it, at every judgement for
/// [`StragglerSettings::confirm`]; it recovers once it has been below
/// [`StragglerSettings::recover_factor`] as long. Steps within `warmup_ms` of its admission
/// are not judged, nor counted in anyone's reference.
#[derive(Clone, Copy, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct StragglerSettings {
    /// What to do with a flagged worker.
    pub policy: StragglerPolicy,
    /// A worker is slow while its median step time is more than this many times the median
    /// of the other workers' medians.
    pub factor: f32,
    /// The stretch of time, in milliseconds, whose steps a worker is judged on.
    pub window_ms: u32,
    /// A worker is slow only while its median exceeds the others' by at least this many
    /// milliseconds: scheduling noise on a busy machine is not a straggler.
    pub min_gap_ms: f32,
    /// A worker is judged only from this many milliseconds after its admission (its first
    /// steps pay for cold caches, first pulls and allocation).
    pub warmup_ms: u32,
    /// A worker that holds the minimum clock others wait on (SSP and BSP) without finishing a
    /// step for this many milliseconds is reported by name (log, event, `edlctl workers`).
    pub stall_ms: u32,
    /// What is done about such a worker: 0 waits for it however long it takes; otherwise it
    /// is dropped (as if dead: its data returns to the pool, the others go on) once it has
    /// held the minimum this many milliseconds.
    pub stall_drop_ms: u32,
}

impl StragglerSettings {
    /// The default factor.
    pub const FACTOR: f32 = 1.5;
    /// The default window: a slowdown of 3x on a running worker is flagged about 0.75
    /// window + confirmation after it begins, one of 2x about 0.67 window + confirmation.
    pub const WINDOW_MS: u32 = 1_500;
    /// The default minimum gap.
    pub const MIN_GAP_MS: f32 = 2.0;
    /// The default warm-up.
    pub const WARMUP_MS: u32 = 2_000;
    /// The default time before a stall is reported.
    pub const STALL_MS: u32 = 10_000;
    /// Steps a worker's window holds at least, however old (a slow model's steps can be
    /// longer than the window), and that a worker needs before it is judged.
    pub const MIN_STEPS: usize = 3;

    /// How long a worker must be judged slow (or recovered) at every judgement before it is
    /// flagged (or unflagged): a fifth of the window, at least 100 ms.
    pub fn confirm(&self) -> std::time::Duration {
        std::time::Duration::from_millis(u64::from((self.window_ms / 5).max(100)))
    }

    /// Below this many times the reference a flagged worker counts as recovered: halfway
    /// between 1 and the factor, so that a worker near the threshold is not flagged and
    /// unflagged by every other step.
    pub fn recover_factor(&self) -> f32 {
        1.0 + (self.factor - 1.0) / 2.0
    }

    /// Checks the settings: a factor above 1 (and finite), a window of 100 ms to 10 minutes,
    /// a gap of 0 to 60 s, a warm-up of at most 10 minutes, a stall report after 100 ms to a
    /// day, and a drop (if any) no sooner than the report.
    pub fn check(&self) -> Result<(), String> {
        if !(self.factor.is_finite() && self.factor > 1.0) {
            return Err(format!(
                "straggler factor {} must be a finite number above 1",
                self.factor
            ));
        }
        if !(100..=600_000).contains(&self.window_ms) {
            return Err(format!(
                "straggler window {} ms must be 100 ms to 10 minutes",
                self.window_ms
            ));
        }
        if !(self.min_gap_ms.is_finite() && (0.0..=60_000.0).contains(&self.min_gap_ms)) {
            return Err(format!(
                "straggler minimum gap {} ms must be 0 to 60000 ms",
                self.min_gap_ms
            ));
        }
        if self.warmup_ms > 600_000 {
            return Err(format!(
                "straggler warm-up {} ms must be at most 10 minutes",
                self.warmup_ms
            ));
        }
        if !(100..=86_400_000).contains(&self.stall_ms) {
            return Err(format!(
                "stall report after {} ms must be 100 ms to a day",
                self.stall_ms
            ));
        }
        if self.stall_drop_ms != 0 && self.stall_drop_ms < self.stall_ms {
            return Err(format!(
                "a stalled worker is dropped after {} ms, before it is reported ({} ms): \
                 drop after the report, or 0 to wait",
                self.stall_drop_ms, self.stall_ms
            ));
        }
        Ok(())
    }
}

impl Default for StragglerSettings {
    fn default() -> Self {
        StragglerSettings {
            policy: StragglerPolicy::Ignore,
            factor: Self::FACTOR,
            window_ms: Self::WINDOW_MS,
            min_gap_ms: Self::MIN_GAP_MS,
            warmup_ms: Self::WARMUP_MS,
            stall_ms: Self::STALL_MS,
            stall_drop_ms: 0,
        }
    }
}

/// Why a replacement is wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ReplaceReason {
    /// The old worker was flagged as a straggler (policy `replace`).
    Straggler,
    /// The old worker got a preemption notice (policy `replace`).
    Preempt,
    /// An operator moves the worker (`edlctl migrate`).
    Migrate,
}

impl fmt::Display for ReplaceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Straggler => "straggler",
            Self::Preempt => "preempt",
            Self::Migrate => "migrate",
        })
    }
}

/// What a placement asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum PlacementKind {
    /// One more worker (the job grows: `edlctl scale`, profiling).
    Add,
    /// A worker to take `old`'s place: once it is admitted, `old` is drained.
    Replace {
        /// The worker replaced.
        old: WorkerId,
        /// Why.
        reason: ReplaceReason,
    },
}

impl PlacementKind {
    /// `add`, or `replace OLD (reason)` with the old worker named by `name`.
    pub fn describe(&self, name: impl Fn(WorkerId) -> String) -> String {
        match *self {
            PlacementKind::Add => "add".into(),
            PlacementKind::Replace { old, reason } => format!("replace {} ({reason})", name(old)),
        }
    }
}

/// Where a placement stands.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum PlacementState {
    /// Waiting for a placer to start a worker for it.
    Pending,
    /// A worker naming it was admitted.
    Done {
        /// The new worker.
        worker: WorkerId,
    },
    /// The placer could not start a worker for it.
    Failed {
        /// Why, in the placer's words.
        reason: String,
    },
    /// No longer wanted: the job shrank before it was placed (an addition, or the
    /// replacement of a worker the resize drained).
    Cancelled,
}

/// A request to start a worker.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Placement {
    /// Its id: a worker started for it names it when it registers.
    pub id: u64,
    /// What it asks for.
    pub kind: PlacementKind,
    /// Where the placer should start the worker (a slot name it knows), if anywhere specific.
    pub slot: Option<String>,
    /// Where it stands.
    pub state: PlacementState,
    /// When it was made, in milliseconds since the coordinator started.
    pub t_ms: u64,
}

impl Placement {
    /// Still waiting for a worker.
    pub fn is_pending(&self) -> bool {
        self.state == PlacementState::Pending
    }
}

/// What a resize did.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Resize {
    /// Placements made for workers to add.
    pub placed: Vec<u64>,
    /// Workers asked to leave.
    pub drained: Vec<WorkerId>,
    /// Pending placements no longer wanted.
    pub cancelled: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip_and_bad_settings_are_refused() {
        for p in StragglerPolicy::ALL {
            assert_eq!(p.to_string().parse::<StragglerPolicy>(), Ok(p));
        }
        assert!("evict".parse::<StragglerPolicy>().is_err());
        assert!(StragglerSettings::default().check().is_ok());
        let d = StragglerSettings::default();
        let bad = [
            StragglerSettings { factor: 1.0, ..d },
            StragglerSettings {
                factor: f32::NAN,
                ..d
            },
            StragglerSettings { window_ms: 99, ..d },
            StragglerSettings {
                window_ms: 600_001,
                ..d
            },
            StragglerSettings {
                min_gap_ms: -1.0,
                ..d
            },
            StragglerSettings {
                min_gap_ms: f32::INFINITY,
                ..d
            },
            StragglerSettings {
                warmup_ms: 600_001,
                ..d
            },
            StragglerSettings { stall_ms: 50, ..d },
            StragglerSettings {
                stall_drop_ms: d.stall_ms - 1,
                ..d
            },
        ];
        for s in bad {
            assert!(s.check().is_err(), "{s:?}");
        }
        let drop_later = StragglerSettings {
            stall_drop_ms: d.stall_ms,
            ..d
        };
        assert!(drop_later.check().is_ok());
        assert_eq!(d.recover_factor(), 1.25);
        assert_eq!(d.confirm().as_millis(), 300);
    }
}
