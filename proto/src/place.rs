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

/// How stragglers are found and what is done about them.
#[derive(Clone, Copy, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct StragglerSettings {
    /// What to do with a flagged worker.
    pub policy: StragglerPolicy,
    /// A worker is flagged when its median step time over the window is more than this many
    /// times the median of the other workers' medians.
    pub factor: f32,
    /// Steps in the window (a worker is judged only once it has taken this many).
    pub window: u32,
}

impl StragglerSettings {
    /// The default factor.
    pub const FACTOR: f32 = 1.5;
    /// The default window.
    pub const WINDOW: u32 = 20;

    /// Checks the settings: a factor above 1 (and finite), a window of 3 to 10,000 steps.
    pub fn check(&self) -> Result<(), String> {
        if !(self.factor.is_finite() && self.factor > 1.0) {
            return Err(format!(
                "straggler factor {} must be a finite number above 1",
                self.factor
            ));
        }
        if !(3..=10_000).contains(&self.window) {
            return Err(format!(
                "straggler window {} must be 3 to 10000 steps",
                self.window
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
            window: Self::WINDOW,
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
        for (factor, window) in [(1.0, 20), (f32::NAN, 20), (2.0, 2), (2.0, 10_001)] {
            let s = StragglerSettings {
                factor,
                window,
                ..StragglerSettings::default()
            };
            assert!(s.check().is_err(), "{factor} {window}");
        }
    }
}
