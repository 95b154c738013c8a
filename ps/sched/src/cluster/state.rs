//! The scheduler's durable state: every job with what it asked for, where it is and the
//! processes it runs, saved as JSON (atomically) after every change, and the event log, an
//! append-only JSON-lines file of every slot taken and released and every job decision, from
//! which over-commitment can be checked ([`check_slots`]).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use edl_shared::proto::sched::{JobRecord, JobState, LedgerSummary, Submission};
use serde::{Deserialize, Serialize};

/// A job's life, as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Waiting for slots.
    Queued,
    /// Its servers run.
    Running,
    /// Trained to the end.
    Finished,
    /// Failed.
    Failed,
    /// Cancelled.
    Cancelled,
}

impl State {
    /// Whether the job is over.
    pub fn is_over(self) -> bool {
        matches!(self, State::Finished | State::Failed | State::Cancelled)
    }
}

impl From<State> for JobState {
    fn from(s: State) -> JobState {
        match s {
            State::Queued => JobState::Queued,
            State::Running => JobState::Running,
            State::Finished => JobState::Finished,
            State::Failed => JobState::Failed,
            State::Cancelled => JobState::Cancelled,
        }
    }
}

pub use edl_launch::ProcRecord;

use crate::speed::Speedup;

/// The least time a job must have trained at one size for its throughput there to count.
pub const MEASURED_FOR: f64 = 2.0;

/// A job, as saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Its name.
    pub name: String,
    /// Its owner (the submitter's certificate name).
    pub owner: String,
    /// The job file's text.
    pub job_file: String,
    /// What its workers run (see `WorkerSpec::describe`); empty in state saved before it was
    /// recorded.
    #[serde(default)]
    pub runs: String,
    /// Where relative data paths resolve.
    pub file_dir: String,
    /// Workers asked for.
    pub workers: u32,
    /// Fewest.
    pub min_workers: u32,
    /// Most.
    pub max_workers: u32,
    /// Priority.
    pub priority: i32,
    /// Where it is.
    pub state: State,
    /// Slots the policy gives it.
    pub alloc: u32,
    /// Resizes of a running job.
    pub resizes: u32,
    /// Unix milliseconds.
    pub submit_ms: u64,
    /// Unix milliseconds.
    pub start_ms: Option<u64>,
    /// Unix milliseconds.
    pub end_ms: Option<u64>,
    /// Not resized again before this (unix milliseconds).
    pub resize_after_ms: u64,
    /// The latest growth's measured cost, milliseconds.
    #[serde(default)]
    pub resize_cost_ms: Option<u64>,
    /// A growth under way: when it was asked for (unix milliseconds) and the size it aims at.
    #[serde(default)]
    pub growing: Option<(u64, u32)>,
    /// Slot-seconds held.
    pub attained_s: f64,
    /// Its measured throughput: per worker count it trained at steadily, the samples and the
    /// seconds (its speed curve for the `goodput` policy, [`Job::speed`]).
    #[serde(default)]
    pub throughput: Vec<(u32, u64, f64)>,
    /// Samples trained and in all.
    pub samples: (u64, u64),
    /// The coordinator's address.
    pub coordinator: Option<String>,
    /// Its processes: servers and workers.
    pub procs: Vec<ProcRecord>,
    /// The finished job's ledger.
    pub ledger: Option<(u64, u64, u64)>,
    /// Why it failed or was cancelled.
    pub message: String,
}

impl Job {
    /// A queued job from a submission.
    pub fn new(name: String, owner: String, s: Submission, runs: String, now_ms: u64) -> Job {
        Job {
            name,
            owner,
            runs,
            job_file: s.job_file,
            file_dir: s.file_dir,
            workers: s.workers,
            min_workers: s.min_workers,
            max_workers: s.max_workers,
            priority: s.priority,
            state: State::Queued,
            alloc: 0,
            resizes: 0,
            submit_ms: now_ms,
            start_ms: None,
            end_ms: None,
            resize_after_ms: 0,
            resize_cost_ms: None,
            growing: None,
            attained_s: 0.0,
            throughput: Vec::new(),
            samples: (0, 0),
            coordinator: None,
            procs: Vec::new(),
            ledger: None,
            message: String::new(),
        }
    }

    /// Adds `samples` trained in `seconds` by `workers` steady workers to its throughput.
    pub fn measured(&mut self, workers: u32, samples: u64, seconds: f64) {
        if workers == 0 || seconds.is_nan() || seconds <= 0.0 {
            return;
        }
        match self.throughput.iter_mut().find(|r| r.0 == workers) {
            Some(r) => {
                r.1 += samples;
                r.2 += seconds;
            }
            None => {
                self.throughput.push((workers, samples, seconds));
                self.throughput.sort_by_key(|r| r.0);
            }
        }
    }

    /// Its speed by worker count: the throughput measured at each size it ran at for at
    /// least [`MEASURED_FOR`] seconds; past the largest, and before any, the `typical` curve's
    /// shape (scaled to the measurement).
    pub fn speed(&self, typical: &Speedup) -> Speedup {
        let pts: Vec<(u32, f64)> = self
            .throughput
            .iter()
            .filter(|r| r.2 >= MEASURED_FOR && r.1 > 0)
            .map(|r| (r.0, r.1 as f64 / r.2))
            .collect();
        let Some(&(last, rate)) = pts.last() else {
            return typical.clone();
        };
        let mut curve = pts;
        let top = self.max_workers.max(self.workers);
        let base = typical.at(last).max(f64::MIN_POSITIVE);
        curve.extend((last + 1..=top).map(|n| (n, rate * typical.at(n) / base)));
        Speedup::Curve(curve)
    }

    /// Worker processes running (holding slots).
    pub fn running_workers(&self) -> u32 {
        self.procs.iter().filter(|p| p.slot.is_some()).count() as u32
    }

    /// The wire record; `dir` is the job's directory.
    pub fn record(&self, dir: &Path) -> JobRecord {
        JobRecord {
            name: self.name.clone(),
            owner: self.owner.clone(),
            workers: self.workers,
            min_workers: self.min_workers,
            max_workers: self.max_workers,
            priority: self.priority,
            state: self.state.into(),
            alloc: self.alloc,
            running: self.running_workers(),
            resizes: self.resizes,
            resize_cost_ms: self.resize_cost_ms,
            submit_ms: self.submit_ms,
            start_ms: self.start_ms,
            end_ms: self.end_ms,
            attained_s: self.attained_s,
            samples: self.samples,
            coordinator: self.coordinator.clone(),
            dir: dir.display().to_string(),
            ledger: self
                .ledger
                .map(|(applied, duplicates, missing)| LedgerSummary {
                    applied,
                    duplicates,
                    missing,
                }),
            message: self.message.clone(),
            runs: self.runs.clone(),
        }
    }
}

/// Everything the scheduler saves.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Saved {
    /// Jobs by name, in submission order of their numbers.
    pub jobs: Vec<Job>,
    /// The number of the next automatically named job.
    pub next_job: u64,
    /// The number of the next worker name, per job.
    pub next_worker: BTreeMap<String, u64>,
}

impl Saved {
    /// Reads `path`, or an empty state when it does not exist.
    pub fn load(path: &Path) -> anyhow::Result<Saved> {
        match std::fs::read(path) {
            Ok(b) => serde_json::from_slice(&b)
                .with_context(|| format!("{} is not a scheduler state file", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Saved::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// Writes `path` atomically.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(self)?;
        edl_shared::pki::write_atomic(path, &json)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The job named `name`.
    pub fn job(&self, name: &str) -> Option<&Job> {
        self.jobs.iter().find(|j| j.name == name)
    }

    /// The job named `name`, to change.
    pub fn job_mut(&mut self, name: &str) -> Option<&mut Job> {
        self.jobs.iter_mut().find(|j| j.name == name)
    }
}

/// One line of the event log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Unix milliseconds.
    pub t_ms: u64,
    /// The job.
    pub job: String,
    /// `submit`, `start`, `resize`, `take` (a worker took a slot), `release` (its process
    /// exited), `finish`, `fail`, `cancel`, `adopt` (a running job taken back after a
    /// scheduler restart; its workers keep the slots their `take` recorded).
    pub event: String,
    /// The slot, for take and release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// The worker, for take and release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Slots given, for start and resize.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alloc: Option<u32>,
}

/// The append-only event log.
#[derive(Debug)]
pub struct EventLog {
    path: PathBuf,
}

impl EventLog {
    /// The log at `path` (appended to).
    pub fn new(path: PathBuf) -> EventLog {
        EventLog { path }
    }

    /// Appends `e` as one line.
    pub fn append(&self, e: &Event) -> anyhow::Result<()> {
        let mut line = serde_json::to_string(e)?;
        line.push('\n');
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        f.write_all(line.as_bytes())
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// Every event so far.
    pub fn read(path: &Path) -> anyhow::Result<Vec<Event>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .with_context(|| format!("{}:{}: not an event", path.display(), i + 1))
            })
            .collect()
    }
}

/// Replays `events` and fails at the first slot taken while held, released while free, or a
/// slot not among `slots`; returns the most slots held at once.
pub fn check_slots(events: &[Event], slots: &[String]) -> Result<usize, String> {
    let mut held: BTreeMap<&str, &str> = BTreeMap::new();
    let mut most = 0;
    for (i, e) in events.iter().enumerate() {
        let (Some(slot), Some(worker)) = (&e.slot, &e.worker) else {
            continue;
        };
        if !slots.iter().any(|s| s == slot) {
            return Err(format!("event {i}: unknown slot {slot}"));
        }
        match e.event.as_str() {
            "take" => {
                if let Some(h) = held.get(slot.as_str()) {
                    return Err(format!(
                        "event {i}: {}/{worker} took {slot}, held by {h}",
                        e.job
                    ));
                }
                held.insert(slot, worker);
            }
            "release" if held.remove(slot.as_str()).is_none() => {
                return Err(format!("event {i}: {slot} released but not held"));
            }
            _ => {}
        }
        most = most.max(held.len());
    }
    Ok(most)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: &str, slot: &str, worker: &str) -> Event {
        Event {
            t_ms: 0,
            job: "j".into(),
            event: event.into(),
            slot: Some(slot.into()),
            worker: Some(worker.into()),
            alloc: None,
        }
    }

    #[test]
    fn over_commitment_is_caught() {
        let slots = vec!["a".to_string(), "b".to_string()];
        let fine = [
            ev("take", "a", "p1"),
            ev("take", "b", "p2"),
            ev("release", "a", "p1"),
            ev("take", "a", "p3"),
        ];
        assert_eq!(check_slots(&fine, &slots), Ok(2));
        let twice = [ev("take", "a", "p1"), ev("take", "a", "p2")];
        assert!(
            check_slots(&twice, &slots)
                .expect_err("twice")
                .contains("held by p1")
        );
        let free = [ev("release", "b", "p1")];
        assert!(check_slots(&free, &slots).is_err());
        let unknown = [ev("take", "c", "p1")];
        assert!(check_slots(&unknown, &slots).is_err());
    }

    #[test]
    fn state_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sched.json");
        assert!(Saved::load(&path).expect("empty").jobs.is_empty());
        let mut s = Saved::default();
        s.jobs.push(Job::new(
            "j1".into(),
            "alice".into(),
            Submission {
                name: String::new(),
                job_file: "[model]\nkind = \"mlp\"".into(),
                file_dir: "/tmp".into(),
                workers: 2,
                min_workers: 1,
                max_workers: 4,
                priority: 0,
            },
            "python3 train.py".into(),
            5,
        ));
        s.jobs[0].measured(2, 5000, 2.5);
        s.next_job = 2;
        s.save(&path).expect("save");
        let back = Saved::load(&path).expect("load");
        assert_eq!(back.jobs, s.jobs);
        assert_eq!(back.next_job, 2);
    }

    #[test]
    fn a_jobs_speed_is_its_measured_throughput_then_the_typical_shape() {
        let mut j = Job::new(
            "j".into(),
            "alice".into(),
            Submission {
                name: String::new(),
                job_file: String::new(),
                file_dir: "/tmp".into(),
                workers: 2,
                min_workers: 1,
                max_workers: 4,
                priority: 0,
            },
            String::new(),
            0,
        );
        let typical = Speedup::Amdahl { serial: 0.1 };
        // Nothing measured yet: the typical curve.
        assert_eq!(j.speed(&typical), typical);
        // 1 worker: 100 samples/s over 3 s; 2 workers: 150/s over 4 s (two polls); a span
        // shorter than MEASURED_FOR (4 workers, 1 s) does not count yet.
        j.measured(1, 300, 3.0);
        j.measured(2, 200, 1.5);
        j.measured(2, 400, 2.5);
        j.measured(4, 1000, 1.0);
        j.measured(0, 10, 1.0);
        j.measured(3, 10, f64::NAN);
        let s = j.speed(&typical);
        assert_eq!(s.at(1), 1.0);
        assert_eq!(s.at(2), 1.5);
        // Past the largest measured size, the typical curve's shape from there.
        let want = 1.5 * typical.at(3) / typical.at(2);
        assert!((s.at(3) - want).abs() < 1e-12, "{} {want}", s.at(3));
        assert!(s.at(4) > s.at(3));
        // Once 4 workers have run long enough, their own measurement counts.
        j.measured(4, 1000, 1.5);
        assert!((j.speed(&typical).at(4) - 2000.0 / 2.5 / 100.0).abs() < 1e-12);
    }
}
