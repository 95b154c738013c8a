//! Scenario files for `edl-local --scenario`: timed membership changes (add, drain, kill, term)
//! replayed against a running job.
//!
//! ```toml
//! [[event]]
//! at_s = 3.0          # seconds after training started (the first worker was admitted)
//! action = "add"      # add | drain | kill | term
//! count = 2           # add only
//! [[event]]
//! at_s = 7.0
//! action = "drain"
//! worker = "w0"       # drain, kill and term: the worker's process name
//! ```
//!
//! A file is checked whole before anything starts: every field, the time order, and every worker
//! name against the membership the events before it leave (the launcher's workers are `w0` to
//! `w{N-1}` for `--workers N`, and added workers continue the numbering). A scenario that would
//! leave no worker running is refused too, since training could never finish.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

/// Why a scenario file was refused.
#[derive(Debug, Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read scenario {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML, or has keys a scenario does not know.
    #[error("scenario is not valid: {0}")]
    Syntax(String),
    /// The file has no `[[event]]`.
    #[error("scenario has no [[event]] entries")]
    Empty,
    /// One event is wrong; `index` counts from 1 in file order.
    #[error("scenario event {index}: {what}")]
    Event {
        /// The event's position in the file, from 1.
        index: usize,
        /// What is wrong with it.
        what: String,
    },
}

/// What an event does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start new worker processes with these names.
    Add {
        /// The new workers' names, in start order.
        names: Vec<String>,
    },
    /// Ask the coordinator to let this worker leave after its current step.
    Drain {
        /// The worker's name.
        worker: String,
    },
    /// Send SIGKILL to this worker's process.
    Kill {
        /// The worker's name.
        worker: String,
    },
    /// Send SIGTERM to this worker's process.
    Term {
        /// The worker's name.
        worker: String,
    },
}

impl Action {
    /// The worker an action removes, if it removes one.
    pub fn target(&self) -> Option<&str> {
        match self {
            Action::Add { .. } => None,
            Action::Drain { worker } | Action::Kill { worker } | Action::Term { worker } => {
                Some(worker)
            }
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Add { names } => write!(f, "add {}", names.join(", ")),
            Action::Drain { worker } => write!(f, "drain {worker}"),
            Action::Kill { worker } => write!(f, "kill -9 {worker}"),
            Action::Term { worker } => write!(f, "term {worker}"),
        }
    }
}

/// One timed event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScenarioEvent {
    /// When, after training started.
    pub at: Duration,
    /// What.
    pub action: Action,
}

/// A checked scenario: events in time order, every worker name valid where it is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// The events, in time order.
    pub events: Vec<ScenarioEvent>,
}

/// The file as written, before any check.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    event: Vec<RawEvent>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    at_s: Option<f64>,
    action: Option<String>,
    count: Option<u32>,
    worker: Option<String>,
}

/// The name of the `i`-th worker the launcher starts (from 0).
pub fn worker_name(i: u32) -> String {
    format!("w{i}")
}

impl Scenario {
    /// Reads and checks a scenario file for a run that starts `workers` workers.
    pub fn load(path: &Path, workers: u32) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Scenario::parse(&text, workers)
    }

    /// Parses and checks a scenario for a run that starts `workers` workers.
    pub fn parse(text: &str, workers: u32) -> Result<Scenario, ScenarioError> {
        let raw: RawFile =
            toml::from_str(text).map_err(|e| ScenarioError::Syntax(e.to_string()))?;
        if raw.event.is_empty() {
            return Err(ScenarioError::Empty);
        }
        let mut running: Vec<String> = (0..workers).map(worker_name).collect();
        // Why a name is no longer running, for a message that says what happened to it.
        let mut gone: Vec<(String, String)> = Vec::new();
        let mut next = workers;
        let mut last: Option<f64> = None;
        let mut events = Vec::new();
        for (i, e) in raw.event.into_iter().enumerate() {
            let index = i + 1;
            let bad = |what: String| ScenarioError::Event { index, what };
            let at_s = e
                .at_s
                .ok_or_else(|| bad("missing field `at_s` (seconds)".into()))?;
            if !at_s.is_finite() || at_s < 0.0 {
                return Err(bad(format!(
                    "at_s = {at_s} is not a time: it must be 0 or more seconds"
                )));
            }
            if let Some(prev) = last
                && at_s < prev
            {
                return Err(bad(format!(
                    "at_s = {at_s} comes before the previous event's {prev}: events must be in \
                     time order"
                )));
            }
            last = Some(at_s);
            let action = e
                .action
                .ok_or_else(|| bad("missing field `action` (add, drain, kill or term)".into()))?;
            let action = match action.as_str() {
                "add" => {
                    if e.worker.is_some() {
                        return Err(bad(
                            "`worker` does not apply to add (new workers get the next names)"
                                .into(),
                        ));
                    }
                    let count = e
                        .count
                        .ok_or_else(|| bad("missing field `count` (workers to add)".into()))?;
                    if count == 0 {
                        return Err(bad("count = 0 adds nothing".into()));
                    }
                    let names: Vec<String> = (next..next + count).map(worker_name).collect();
                    next += count;
                    running.extend(names.iter().cloned());
                    Action::Add { names }
                }
                "drain" | "kill" | "term" => {
                    if e.count.is_some() {
                        return Err(bad(format!("`count` applies to add only, not {action}")));
                    }
                    let worker = e.worker.ok_or_else(|| {
                        bad(format!(
                            "missing field `worker` ({action} needs a name, e.g. worker = \"w0\")"
                        ))
                    })?;
                    let Some(pos) = running.iter().position(|w| *w == worker) else {
                        let why = match gone.iter().find(|(w, _)| *w == worker) {
                            Some((_, why)) => format!("{worker} {why}"),
                            None => format!(
                                "no worker is named {worker:?} at that point (running: {})",
                                running.join(", ")
                            ),
                        };
                        return Err(bad(format!("cannot {action} {worker}: {why}")));
                    };
                    running.remove(pos);
                    if running.is_empty() {
                        return Err(bad(format!(
                            "{action} {worker} would leave no worker running, so training \
                             could never finish; add one first"
                        )));
                    }
                    let done = match action.as_str() {
                        "drain" => "was drained",
                        "kill" => "was killed",
                        _ => "was sent SIGTERM",
                    };
                    gone.push((worker.clone(), format!("{done} by event {index}")));
                    match action.as_str() {
                        "drain" => Action::Drain { worker },
                        "kill" => Action::Kill { worker },
                        _ => Action::Term { worker },
                    }
                }
                other => {
                    return Err(bad(format!(
                        "unknown action {other:?}; expected add, drain, kill or term"
                    )));
                }
            };
            events.push(ScenarioEvent {
                at: Duration::from_secs_f64(at_s),
                action,
            });
        }
        Ok(Scenario { events })
    }

    /// How many workers run once every event has happened, starting from `workers`.
    pub fn final_workers(&self, workers: u32) -> u32 {
        self.events.iter().fold(workers, |n, e| match &e.action {
            Action::Add { names } => n + names.len() as u32,
            _ => n.saturating_sub(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str, workers: u32) -> String {
        Scenario::parse(text, workers)
            .expect_err("should be refused")
            .to_string()
    }

    #[test]
    fn a_churn_scenario_parses_with_continued_names() {
        let s = Scenario::parse(
            r#"
            [[event]]
            at_s = 3
            action = "add"
            count = 2
            [[event]]
            at_s = 7.5
            action = "drain"
            worker = "w0"
            [[event]]
            at_s = 9.0
            action = "kill"
            worker = "w3"
            [[event]]
            at_s = 9.0
            action = "add"
            count = 1
            [[event]]
            at_s = 12.0
            action = "term"
            worker = "w4"
            "#,
            2,
        )
        .expect("valid");
        let actions: Vec<String> = s.events.iter().map(|e| e.action.to_string()).collect();
        assert_eq!(
            actions,
            ["add w2, w3", "drain w0", "kill -9 w3", "add w4", "term w4"]
        );
        assert_eq!(s.events[0].at, Duration::from_secs(3));
        assert_eq!(s.events[1].at, Duration::from_millis(7500));
        assert_eq!(s.events[2].action.target(), Some("w3"));
        assert_eq!(s.final_workers(2), 2);
    }

    #[test]
    fn bad_fields_are_named() {
        let e = err("[[event]]\nat_s = 1\naction = \"explode\"\n", 2);
        assert!(
            e.contains("event 1") && e.contains("unknown action \"explode\""),
            "{e}"
        );
        let e = err("[[event]]\naction = \"add\"\ncount = 1\n", 2);
        assert!(e.contains("missing field `at_s`"), "{e}");
        let e = err("[[event]]\nat_s = 1\ncount = 1\n", 2);
        assert!(e.contains("missing field `action`"), "{e}");
        let e = err("[[event]]\nat_s = 1\naction = \"drain\"\n", 2);
        assert!(e.contains("missing field `worker`"), "{e}");
        let e = err("[[event]]\nat_s = 1\naction = \"add\"\n", 2);
        assert!(e.contains("missing field `count`"), "{e}");
        let e = err("[[event]]\nat_s = 1\naction = \"add\"\ncount = 0\n", 2);
        assert!(e.contains("count = 0"), "{e}");
        let e = err(
            "[[event]]\nat_s = 1\naction = \"kill\"\nworker = \"w0\"\ncount = 2\n",
            2,
        );
        assert!(e.contains("`count` applies to add only"), "{e}");
        let e = err("[[event]]\nat_s = -1\naction = \"add\"\ncount = 1\n", 2);
        assert!(e.contains("not a time"), "{e}");
        // Typos in keys are not silently ignored.
        let e = err("[[event]]\nat_s = 1\naction = \"add\"\ncuont = 1\n", 2);
        assert!(e.contains("cuont"), "{e}");
        assert!(matches!(Scenario::parse("", 2), Err(ScenarioError::Empty)));
    }

    #[test]
    fn times_must_be_in_order() {
        let e = err(
            "[[event]]\nat_s = 5\naction = \"add\"\ncount = 1\n\
             [[event]]\nat_s = 4\naction = \"add\"\ncount = 1\n",
            2,
        );
        assert!(e.contains("event 2") && e.contains("time order"), "{e}");
    }

    #[test]
    fn worker_names_are_checked_against_the_membership_at_that_point() {
        let e = err(
            "[[event]]\nat_s = 1\naction = \"drain\"\nworker = \"w2\"\n",
            2,
        );
        assert!(e.contains("no worker is named \"w2\""), "{e}");
        assert!(e.contains("running: w0, w1"), "{e}");
        let e = err(
            "[[event]]\nat_s = 1\naction = \"kill\"\nworker = \"w1\"\n\
             [[event]]\nat_s = 2\naction = \"drain\"\nworker = \"w1\"\n",
            3,
        );
        assert!(
            e.contains("event 2") && e.contains("w1 was killed by event 1"),
            "{e}"
        );
        let e = err(
            "[[event]]\nat_s = 1\naction = \"term\"\nworker = \"w0\"\n",
            1,
        );
        assert!(e.contains("no worker running"), "{e}");
        // An added worker can be targeted once it exists.
        Scenario::parse(
            "[[event]]\nat_s = 1\naction = \"add\"\ncount = 1\n\
             [[event]]\nat_s = 2\naction = \"drain\"\nworker = \"w1\"\n",
            1,
        )
        .expect("w1 exists by then");
    }

    #[test]
    fn the_shipped_scenarios_are_valid_for_their_worker_counts() {
        for (text, workers, end) in [
            (include_str!("../scenarios/grow.toml"), 2, 4),
            (include_str!("../scenarios/shrink.toml"), 4, 2),
            (include_str!("../scenarios/kill.toml"), 3, 2),
            (include_str!("../scenarios/churn.toml"), 2, 3),
        ] {
            let s = Scenario::parse(text, workers).expect("valid");
            assert_eq!(s.final_workers(workers), end, "{text}");
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = Scenario::load(Path::new("/nonexistent/churn.toml"), 2)
            .expect_err("missing")
            .to_string();
        assert!(e.contains("/nonexistent/churn.toml"), "{e}");
    }
}
