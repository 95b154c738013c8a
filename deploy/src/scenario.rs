//! Scenario files for `edl-local --scenario`: timed changes replayed against a running job,
//! of the worker membership (add, drain, kill, term, preempt, migrate), of a worker's speed
//! (slow, a test aid), of the shard servers (shard_add, shard_remove, move, kill_shard,
//! restart_shard) and of the coordinator (kill_coordinator, restart_coordinator).
//!
//! ```toml
//! [[event]]
//! at_s = 3.0          # seconds after training started (the first worker was admitted)
//! action = "add"      # add | drain | kill | term | preempt | migrate | slow | pause
//!                     # | shard_add | shard_remove | move | kill_shard | restart_shard
//!                     # | kill_coordinator | restart_coordinator
//! count = 2           # add only
//! [[event]]
//! at_s = 7.0
//! action = "drain"
//! worker = "w0"       # drain, kill and term: the worker's process name
//! [[event]]
//! at_s = 8.0
//! action = "shard_add" # start the next shard process and move its share of keys to it
//! [[event]]
//! at_s = 9.0
//! action = "move"
//! range = "3..6"      # move only: keys START..END (end excluded)
//! to = "s2"           # move only: the shard that takes them
//! [[event]]
//! at_s = 9.5
//! action = "slow"     # test aid: the worker's steps take `factor` times as long
//! worker = "w1"
//! factor = 3.0
//! [[event]]
//! at_s = 9.7
//! action = "preempt"  # SIGUSR1: a spot notice (edl-local --preempt-notice long)
//! worker = "w2"
//! [[event]]
//! at_s = 9.8
//! action = "pause"    # SIGSTOP, then SIGCONT `for_s` later: a long GC pause or swapping
//! worker = "w1"
//! for_s = 2.0
//! [[event]]
//! at_s = 9.9
//! action = "migrate"  # a new worker (in slot `to`, optional), then the old one drained
//! worker = "w0"
//! to = "slot5"
//! [[event]]
//! at_s = 10.0
//! action = "kill_shard"
//! shard = "s1"        # shard_remove, kill_shard and restart_shard: the shard's process name
//! [[event]]
//! at_s = 11.0
//! action = "restart_shard"
//! shard = "s1"
//! [[event]]
//! at_s = 12.0
//! action = "kill_coordinator"    # SIGKILL; no fields, and the next event must restart it
//! [[event]]
//! at_s = 12.4
//! action = "restart_coordinator" # the same arguments, state directory and address
//! ```
//!
//! A file is checked whole before anything starts: every field, the time order, every worker
//! name against the membership the events before it leave (the launcher's workers are `w0` to
//! `w{N-1}` for `--workers N`, and added workers continue the numbering), and every shard name
//! likewise (`s0` to `s{N-1}` for `--shards N`, added shards continue). A scenario that would
//! leave no worker running is refused, since training could never finish; so is one that
//! removes the last shard holding keys, restarts a shard that was not killed, kills a shard
//! and never restarts it, or reshapes the shard map (shard_add, shard_remove, move) while a
//! killed shard is down, since a move may need any shard. A restart_coordinator must follow a
//! kill_coordinator, every kill_coordinator needs one, and no other event may come between the
//! two (each asks the coordinator something or needs it to notice what happened).
//! Key ranges are checked against the job's keys once it runs ([`Scenario::check_keys`]).
//!
//! Events happen in order: one that is not possible yet (a shard that has not joined, a
//! worker to drain that has not been admitted) holds back the ones after it. In elastic runs a
//! drain, kill or term also waits until every worker added before it has been admitted, so
//! that "add, then drain" means the same on a fast machine and on a busy one where a worker
//! takes seconds to prepare.

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
#[derive(Clone, Debug, PartialEq)]
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
    /// Start a new shard process with this name, and once it has joined (as a standby shard)
    /// ask the coordinator to add it, which moves its share of the keys (by size) to it.
    ShardAdd {
        /// The new shard's process name.
        shard: String,
    },
    /// Ask the coordinator to move every key off this shard; the shard then retires and exits.
    ShardRemove {
        /// The shard's process name.
        shard: String,
    },
    /// Ask the coordinator to move keys `[start, end)` to a shard.
    Move {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
        /// The receiving shard's process name.
        to: String,
    },
    /// Send SIGKILL to this shard's process: it loses what it applied since its last
    /// checkpoint.
    KillShard {
        /// The shard's process name.
        shard: String,
    },
    /// Start a killed shard again under the same name, state directory and address; it
    /// restores its checkpoint.
    RestartShard {
        /// The shard's process name.
        shard: String,
    },
    /// Send SIGKILL to the coordinator's process: it keeps what it acknowledged (its state
    /// directory's write-ahead log); workers and shards wait for it to answer again.
    KillCoordinator,
    /// Start the killed coordinator again with the same arguments, state directory and
    /// address; it restores its state and the workers reconnect.
    RestartCoordinator,
    /// A test aid: make this worker's steps `factor` times slower from now on (1 restores
    /// its speed), as a slower or shared device would.
    Slow {
        /// The worker's name.
        worker: String,
        /// The slowdown factor.
        factor: f64,
    },
    /// Stop this worker's process (SIGSTOP) and let it go on (SIGCONT) `for_s` seconds later,
    /// as a long garbage-collection pause or swapping would: alive, but silent. A pause
    /// shorter than the lease must not cost the worker its place.
    Pause {
        /// The worker's name.
        worker: String,
        /// Seconds it stays stopped.
        for_s: f64,
    },
    /// Send SIGUSR1 to this worker's process, as a cloud agent does on a spot-instance
    /// warning: it leaves within `edl-local --preempt-notice`; under straggler policy
    /// `replace` the coordinator asks for a substitute at once.
    Preempt {
        /// The worker's name.
        worker: String,
    },
    /// Ask the coordinator to move this worker (`edlctl migrate`): a new worker starts (in
    /// slot `to`, if given), is admitted, then the old one is drained. The name then stands
    /// for the new worker.
    Migrate {
        /// The worker's name.
        worker: String,
        /// The slot to start the new worker in.
        to: Option<String>,
    },
}

impl Action {
    /// The worker an action removes, if it removes one.
    pub fn target(&self) -> Option<&str> {
        match self {
            Action::Drain { worker }
            | Action::Kill { worker }
            | Action::Term { worker }
            | Action::Preempt { worker } => Some(worker),
            _ => None,
        }
    }

    /// True for the events that act on the servers (the shards and the coordinator) rather
    /// than on the worker membership: carried out the same way with `--restart-on-change`.
    pub fn is_shard_event(&self) -> bool {
        matches!(
            self,
            Action::ShardAdd { .. }
                | Action::ShardRemove { .. }
                | Action::Move { .. }
                | Action::KillShard { .. }
                | Action::RestartShard { .. }
                | Action::KillCoordinator
                | Action::RestartCoordinator
        )
    }

    /// True for the events that use elasticity itself (slow, preempt, migrate): carried out
    /// the same way with `--restart-on-change`.
    pub fn is_elastic_event(&self) -> bool {
        matches!(
            self,
            Action::Slow { .. }
                | Action::Pause { .. }
                | Action::Preempt { .. }
                | Action::Migrate { .. }
        )
    }

    /// The action's name in a scenario file (`add`, `shard_remove`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Action::Add { .. } => "add",
            Action::Drain { .. } => "drain",
            Action::Kill { .. } => "kill",
            Action::Term { .. } => "term",
            Action::ShardAdd { .. } => "shard_add",
            Action::ShardRemove { .. } => "shard_remove",
            Action::Move { .. } => "move",
            Action::KillShard { .. } => "kill_shard",
            Action::RestartShard { .. } => "restart_shard",
            Action::KillCoordinator => "kill_coordinator",
            Action::RestartCoordinator => "restart_coordinator",
            Action::Slow { .. } => "slow",
            Action::Pause { .. } => "pause",
            Action::Preempt { .. } => "preempt",
            Action::Migrate { .. } => "migrate",
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
            Action::ShardAdd { shard } => write!(f, "shard add {shard}"),
            Action::ShardRemove { shard } => write!(f, "shard remove {shard}"),
            Action::Move { start, end, to } => write!(f, "move keys {start}..{end} to {to}"),
            Action::KillShard { shard } => write!(f, "kill -9 shard {shard}"),
            Action::RestartShard { shard } => write!(f, "restart shard {shard}"),
            Action::KillCoordinator => write!(f, "kill -9 coordinator"),
            Action::RestartCoordinator => write!(f, "restart coordinator"),
            Action::Slow { worker, factor } => write!(f, "slow {worker} {factor}x"),
            Action::Pause { worker, for_s } => {
                write!(f, "pause {worker} for {for_s} s (SIGSTOP, then SIGCONT)")
            }
            Action::Preempt { worker } => write!(f, "preempt {worker} (SIGUSR1)"),
            Action::Migrate { worker, to: None } => write!(f, "migrate {worker}"),
            Action::Migrate {
                worker,
                to: Some(slot),
            } => write!(f, "migrate {worker} to {slot}"),
        }
    }
}

/// One timed event.
#[derive(Clone, Debug, PartialEq)]
pub struct ScenarioEvent {
    /// When, after training started.
    pub at: Duration,
    /// What.
    pub action: Action,
}

/// A checked scenario: events in time order, every worker and shard name valid where it is
/// used.
#[derive(Clone, Debug, PartialEq)]
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
    shard: Option<String>,
    range: Option<String>,
    to: Option<String>,
    factor: Option<f64>,
    for_s: Option<f64>,
}

impl RawEvent {
    /// The optional fields that are set, by name.
    fn fields(&self) -> [(&'static str, bool); 7] {
        [
            ("for_s", self.for_s.is_some()),
            ("count", self.count.is_some()),
            ("worker", self.worker.is_some()),
            ("shard", self.shard.is_some()),
            ("range", self.range.is_some()),
            ("to", self.to.is_some()),
            ("factor", self.factor.is_some()),
        ]
    }
}

/// Why `worker` is not among `running`, for an error message.
fn why_not_running(worker: &str, running: &[String], gone: &[(String, String)]) -> String {
    match gone.iter().find(|(w, _)| w == worker) {
        Some((_, why)) => format!("{worker} {why}"),
        None => format!(
            "no worker is named {worker:?} at that point (running: {})",
            running.join(", ")
        ),
    }
}

/// The name of the `i`-th worker the launcher starts (from 0).
pub fn worker_name(i: u32) -> String {
    format!("w{i}")
}

/// The name of the `i`-th shard the launcher starts (from 0).
pub fn shard_name(i: u32) -> String {
    format!("s{i}")
}

/// The shard servers as the events before one leave them, for checking names.
struct ShardRoster {
    /// Running and holding (or about to hold) keys.
    serving: Vec<String>,
    /// Killed and not restarted yet, with the index of the event that killed each.
    down: Vec<(String, usize)>,
    /// Removed, with the index of the event that removed each.
    removed: Vec<(String, usize)>,
    next: u32,
}

impl ShardRoster {
    fn new(shards: u32) -> Self {
        ShardRoster {
            serving: (0..shards).map(shard_name).collect(),
            down: Vec::new(),
            removed: Vec::new(),
            next: shards,
        }
    }

    /// Why `name` is not a serving shard, or `None` if it is one.
    fn not_serving(&self, name: &str) -> Option<String> {
        if self.serving.iter().any(|s| s == name) {
            return None;
        }
        Some(
            if let Some((_, i)) = self.down.iter().find(|(s, _)| s == name) {
                format!("{name} is down (killed by event {i})")
            } else if let Some((_, i)) = self.removed.iter().find(|(s, _)| s == name) {
                format!("{name} was removed by event {i}")
            } else {
                format!(
                    "no shard is named {name:?} at that point (running: {})",
                    self.serving.join(", ")
                )
            },
        )
    }

    /// Refuses a change of the shard map while a killed shard is down.
    fn reshapable(&self, what: &str) -> Result<(), String> {
        match self.down.first() {
            Some((s, i)) => Err(format!(
                "cannot {what} while {s} is down (killed by event {i}): moving keys may need \
                 any shard; restart it first"
            )),
            None => Ok(()),
        }
    }
}

impl Scenario {
    /// Reads and checks a scenario file for a run that starts `workers` workers and `shards`
    /// shards.
    pub fn load(path: &Path, workers: u32, shards: u32) -> Result<Scenario, ScenarioError> {
        Scenario::load_with(path, workers, shards, 1)
    }

    /// [`Scenario::load`] for a job that keeps `replicas` copies of every key range.
    pub fn load_with(
        path: &Path,
        workers: u32,
        shards: u32,
        replicas: u32,
    ) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Scenario::parse_with(&text, workers, shards, replicas)
    }

    /// Parses and checks a scenario for a run that starts `workers` workers and `shards`
    /// shards of a job without copies of its key ranges.
    pub fn parse(text: &str, workers: u32, shards: u32) -> Result<Scenario, ScenarioError> {
        Scenario::parse_with(text, workers, shards, 1)
    }

    /// Parses and checks a scenario for a run that starts `workers` workers and `shards`
    /// shards. With `replicas` copies of every range, up to `replicas - 1` shards may be killed and
    /// never restarted: their backups take over.
    pub fn parse_with(
        text: &str,
        workers: u32,
        shards: u32,
        replicas: u32,
    ) -> Result<Scenario, ScenarioError> {
        let raw: RawFile =
            toml::from_str(text).map_err(|e| ScenarioError::Syntax(e.to_string()))?;
        if raw.event.is_empty() {
            return Err(ScenarioError::Empty);
        }
        let mut running: Vec<String> = (0..workers).map(worker_name).collect();
        // Why a name is no longer running, for a message that says what happened to it.
        let mut gone: Vec<(String, String)> = Vec::new();
        let mut next = workers;
        let mut roster = ShardRoster::new(shards);
        // The event that killed the coordinator, while it is down.
        let mut coordinator_down: Option<usize> = None;
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
            let fields = e.fields();
            let action = e.action.ok_or_else(|| {
                bad(
                    "missing field `action` (add, drain, kill, term, preempt, migrate, slow, \
                     pause, shard_add, shard_remove, move, kill_shard, restart_shard, \
                     kill_coordinator or restart_coordinator)"
                        .into(),
                )
            })?;
            // Fields that do not apply to the action are refused rather than ignored.
            let only = |allowed: &[&str]| match fields
                .iter()
                .find(|(name, set)| *set && !allowed.contains(name))
            {
                Some((name, _)) => Err(bad(format!("`{name}` does not apply to {action}"))),
                None => Ok(()),
            };
            let shard_field = |shard: Option<String>| {
                shard.ok_or_else(|| {
                    bad(format!(
                        "missing field `shard` ({action} needs a name, e.g. shard = \"s1\")"
                    ))
                })
            };
            let action = match action.as_str() {
                "add" => {
                    if e.worker.is_some() {
                        return Err(bad(
                            "`worker` does not apply to add (new workers get the next names)"
                                .into(),
                        ));
                    }
                    only(&["count"])?;
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
                "slow" | "migrate" | "pause" => {
                    if e.count.is_some() {
                        return Err(bad(format!("`count` applies to add only, not {action}")));
                    }
                    only(match action.as_str() {
                        "slow" => &["worker", "factor"],
                        "pause" => &["worker", "for_s"],
                        _ => &["worker", "to"],
                    })?;
                    let worker = e.worker.ok_or_else(|| {
                        bad(format!(
                            "missing field `worker` ({action} needs a name, e.g. worker = \"w0\")"
                        ))
                    })?;
                    if !running.contains(&worker) {
                        return Err(bad(format!(
                            "cannot {action} {worker}: {}",
                            why_not_running(&worker, &running, &gone)
                        )));
                    }
                    if action == "slow" {
                        let factor = e.factor.ok_or_else(|| {
                            bad("missing field `factor` (e.g. factor = 3.0; 1.0 restores)".into())
                        })?;
                        if !(factor.is_finite() && (1.0..=1000.0).contains(&factor)) {
                            return Err(bad(format!("factor = {factor} must be 1 to 1000")));
                        }
                        Action::Slow { worker, factor }
                    } else if action == "pause" {
                        let for_s = e.for_s.ok_or_else(|| {
                            bad("missing field `for_s` (seconds stopped, e.g. for_s = 2.0)".into())
                        })?;
                        if !(for_s.is_finite() && (0.0..=3600.0).contains(&for_s) && for_s > 0.0) {
                            return Err(bad(format!(
                                "for_s = {for_s} must be above 0, at most 3600"
                            )));
                        }
                        Action::Pause { worker, for_s }
                    } else {
                        Action::Migrate { worker, to: e.to }
                    }
                }
                "drain" | "kill" | "term" | "preempt" => {
                    if e.count.is_some() {
                        return Err(bad(format!("`count` applies to add only, not {action}")));
                    }
                    only(&["worker"])?;
                    let worker = e.worker.ok_or_else(|| {
                        bad(format!(
                            "missing field `worker` ({action} needs a name, e.g. worker = \"w0\")"
                        ))
                    })?;
                    let Some(pos) = running.iter().position(|w| *w == worker) else {
                        let why = why_not_running(&worker, &running, &gone);
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
                        "preempt" => "was preempted",
                        _ => "was sent SIGTERM",
                    };
                    gone.push((worker.clone(), format!("{done} by event {index}")));
                    match action.as_str() {
                        "drain" => Action::Drain { worker },
                        "kill" => Action::Kill { worker },
                        "preempt" => Action::Preempt { worker },
                        _ => Action::Term { worker },
                    }
                }
                "shard_add" => {
                    only(&[])?;
                    roster.reshapable("add a shard").map_err(bad)?;
                    let shard = shard_name(roster.next);
                    roster.next += 1;
                    roster.serving.push(shard.clone());
                    Action::ShardAdd { shard }
                }
                "shard_remove" => {
                    only(&["shard"])?;
                    let shard = shard_field(e.shard)?;
                    if let Some(why) = roster.not_serving(&shard) {
                        return Err(bad(format!("cannot remove {shard}: {why}")));
                    }
                    roster.reshapable(&format!("remove {shard}")).map_err(bad)?;
                    if roster.serving.len() == 1 {
                        return Err(bad(format!(
                            "cannot remove {shard}: it is the last shard holding keys; add \
                             another first"
                        )));
                    }
                    roster.serving.retain(|s| *s != shard);
                    roster.removed.push((shard.clone(), index));
                    Action::ShardRemove { shard }
                }
                "move" => {
                    only(&["range", "to"])?;
                    let range = e.range.ok_or_else(|| {
                        bad("missing field `range` (keys START..END, e.g. range = \"3..6\")".into())
                    })?;
                    let (start, end) = edl_ps::admin::parse_range(&range)
                        .map_err(|why| bad(format!("range = {range:?}: {why}")))?;
                    let to = e.to.ok_or_else(|| {
                        bad(
                            "missing field `to` (the shard that takes the keys, e.g. to = \"s2\")"
                                .into(),
                        )
                    })?;
                    if let Some(why) = roster.not_serving(&to) {
                        return Err(bad(format!("cannot move keys to {to}: {why}")));
                    }
                    roster
                        .reshapable(&format!("move keys {start}..{end}"))
                        .map_err(bad)?;
                    Action::Move { start, end, to }
                }
                "kill_shard" => {
                    only(&["shard"])?;
                    let shard = shard_field(e.shard)?;
                    if let Some(why) = roster.not_serving(&shard) {
                        return Err(bad(format!("cannot kill {shard}: {why}")));
                    }
                    roster.serving.retain(|s| *s != shard);
                    roster.down.push((shard.clone(), index));
                    Action::KillShard { shard }
                }
                "restart_shard" => {
                    only(&["shard"])?;
                    let shard = shard_field(e.shard)?;
                    let Some(pos) = roster.down.iter().position(|(s, _)| *s == shard) else {
                        let why = match roster.not_serving(&shard) {
                            None => format!("{shard} is running; only a killed shard restarts"),
                            Some(why) => why,
                        };
                        return Err(bad(format!("cannot restart {shard}: {why}")));
                    };
                    roster.down.remove(pos);
                    roster.serving.push(shard.clone());
                    Action::RestartShard { shard }
                }
                "kill_coordinator" => {
                    only(&[])?;
                    Action::KillCoordinator
                }
                "restart_coordinator" => {
                    only(&[])?;
                    if coordinator_down.take().is_none() {
                        return Err(bad(
                            "cannot restart the coordinator: it is running; only a killed \
                             coordinator restarts (a kill_coordinator event must come just \
                             before)"
                                .into(),
                        ));
                    }
                    Action::RestartCoordinator
                }
                other => {
                    return Err(bad(format!(
                        "unknown action {other:?}; expected add, drain, kill, term, preempt, \
                         migrate, slow, pause, shard_add, shard_remove, move, kill_shard, \
                         restart_shard, kill_coordinator or restart_coordinator"
                    )));
                }
            };
            // Between a kill of the coordinator and its restart nothing else may happen: every
            // other event asks the coordinator something, or needs it to notice what happened.
            if let Some(killed) = coordinator_down {
                return Err(bad(format!(
                    "cannot {} while the coordinator is down (killed by event {killed}): no \
                     other event may come between a kill_coordinator and its \
                     restart_coordinator",
                    action.kind()
                )));
            }
            if action == Action::KillCoordinator {
                coordinator_down = Some(index);
            }
            events.push(ScenarioEvent {
                at: Duration::from_secs_f64(at_s),
                action,
            });
        }
        if let Some(index) = coordinator_down {
            return Err(ScenarioError::Event {
                index,
                what: "the coordinator is killed and never restarted: without it training could \
                       never finish; add a restart_coordinator event after it"
                    .into(),
            });
        }
        let for_good = roster
            .down
            .len()
            .saturating_sub(replicas.max(1) as usize - 1);
        if let Some((shard, index)) = roster.down.iter().take(for_good).next() {
            return Err(ScenarioError::Event {
                index: *index,
                what: format!(
                    "{shard} is killed and never restarted: without its keys training could \
                     never finish; add a restart_shard event, or keep more copies of every key \
                     range (--replicas: one more than the shards killed for good)"
                ),
            });
        }
        Ok(Scenario { events })
    }

    /// Checks every `move` against the job's `keys` keys (known once the job runs).
    pub fn check_keys(&self, keys: u64) -> Result<(), ScenarioError> {
        for (i, e) in self.events.iter().enumerate() {
            if let Action::Move { start, end, .. } = e.action
                && end > keys
            {
                return Err(ScenarioError::Event {
                    index: i + 1,
                    what: format!(
                        "keys {start}..{end} are not all in this job: it has {keys} keys \
                         (0..{keys})"
                    ),
                });
            }
        }
        Ok(())
    }

    /// True if some event acts on the shard servers.
    pub fn has_shard_events(&self) -> bool {
        self.events.iter().any(|e| e.action.is_shard_event())
    }

    /// How many workers run once every event has happened, starting from `workers`.
    pub fn final_workers(&self, workers: u32) -> u32 {
        self.events.iter().fold(workers, |n, e| match &e.action {
            Action::Add { names } => n + names.len() as u32,
            Action::Drain { .. }
            | Action::Kill { .. }
            | Action::Term { .. }
            | Action::Preempt { .. } => n.saturating_sub(1),
            _ => n,
        })
    }
}

#[cfg(test)]
mod tests;
