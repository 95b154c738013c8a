//! The launcher's worker processes, which the local placer (`edl_launch::LocalPlacer`, the
//! one `edl-sched` uses) starts, signals and reports ended: which scenario worker each one
//! stands for, the slot it runs in, what the launcher did to it (and so how it may exit), and
//! the check that notices a worker failing or every worker being done.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::bail;
use edl_launch::procs::failure_message;
use edl_launch::{Exit, LocalPlacer, Placer as _};

use crate::report::WorkerProcess;

/// How often a worker that should end is looked for.
const EXIT_POLL: Duration = Duration::from_millis(20);

/// What the launcher did to a worker, which says how it may end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fate {
    /// Nothing: it trains until the data runs out and exits 0.
    Trains,
    /// The coordinator was asked to drain it: it leaves after its step and exits 0.
    Drained,
    /// It was sent SIGTERM: it finishes its step, leaves and exits 0.
    Termed,
    /// It was sent SIGKILL: any exit is expected.
    Killed,
    /// It was sent SIGTERM to be replaced in a restart: it leaves and exits 0.
    Restarted,
    /// It was sent SIGUSR1, a spot preemption notice: it leaves in time and exits 0.
    Preempted,
}

impl Fate {
    fn name(self) -> &'static str {
        match self {
            Fate::Trains => "none",
            Fate::Drained => "drained",
            Fate::Termed => "termed",
            Fate::Killed => "killed",
            Fate::Restarted => "restarted",
            Fate::Preempted => "preempted",
        }
    }

    /// How a failure is described: what happened before the worker exited badly.
    fn failure(self) -> &'static str {
        match self {
            Fate::Trains | Fate::Killed => "failed",
            Fate::Drained => "failed after it was drained",
            Fate::Termed => "failed after SIGTERM",
            Fate::Restarted => "failed when it was stopped for a restart",
            Fate::Preempted => "failed after a preemption notice",
        }
    }
}

/// One worker process, started through the local placer.
#[derive(Debug)]
pub(super) struct WorkerProc {
    /// Its certificate name (and its name with the placer).
    pub name: String,
    /// Its process id (to resume it after a pause).
    pub pid: u32,
    /// Its log file.
    pub log: PathBuf,
    /// The scenario's name for the worker it stands for. The same as the process name, except
    /// after a restart of `--restart-on-change`, where `w1-r2` stands for `w1`.
    pub stands_for: String,
    /// The slot it runs in (see [`super::slots`]).
    pub slot: String,
    /// The placement it was started for, if the coordinator asked for it.
    pub placement: Option<u64>,
    /// When the launcher saw it exit, in the coordinator's clock (see
    /// [`Workers::note_exits`]).
    pub exited_ms: Option<u64>,
    /// What the launcher did to it.
    pub fate: Fate,
    /// How it ended, once the placer reported it ([`Workers::refresh`]).
    pub exit: Option<Exit>,
}

impl WorkerProc {
    /// Whether the placer has reported it gone.
    pub fn exited(&self) -> bool {
        self.exit.is_some()
    }

    /// Its exit status, if it ended and the placer knows it.
    pub fn status(&self) -> Option<ExitStatus> {
        self.exit.as_ref().and_then(|e| e.status)
    }
}

/// Every worker process of a run, in start order.
#[derive(Debug, Default)]
pub(super) struct Workers {
    list: Vec<WorkerProc>,
}

impl Workers {
    pub fn push(&mut self, w: WorkerProc) {
        self.list.push(w);
    }

    /// Takes in what the placer saw end since the last call. Every process the run's placer
    /// starts is a worker of this list.
    pub async fn refresh(&mut self, placer: &mut LocalPlacer) {
        for e in placer.exited().await {
            match self.list.iter_mut().find(|w| w.name == e.name) {
                Some(w) => w.exit = Some(e),
                None => tracing::warn!(name = %e.name, "an unknown worker exited"),
            }
        }
    }

    /// Waits up to `limit` for worker `name` to end; whether it did.
    pub async fn wait_exit(
        &mut self,
        placer: &mut LocalPlacer,
        name: &str,
        limit: Duration,
    ) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            self.refresh(placer).await;
            if self.by_name(name).is_none_or(|w| w.exited()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(EXIT_POLL).await;
        }
    }

    /// The worker process standing for `name` that the launcher has left alone so far.
    pub fn current(&mut self, name: &str) -> Option<&mut WorkerProc> {
        self.list
            .iter_mut()
            .rev()
            .find(|w| w.stands_for == name && w.fate == Fate::Trains)
    }

    /// The scenario names of the workers the launcher has left alone, in start order.
    pub fn current_names(&self) -> Vec<String> {
        self.list
            .iter()
            .filter(|w| w.fate == Fate::Trains)
            .map(|w| w.stands_for.clone())
            .collect()
    }

    /// The slots taken by worker processes that still run (as of the last refresh).
    pub fn busy_slots(&self) -> Vec<String> {
        self.list
            .iter()
            .filter(|w| !w.exited())
            .map(|w| w.slot.clone())
            .collect()
    }

    /// Whether a process was already started for placement `id`.
    pub fn has_placement(&self, id: u64) -> bool {
        self.list.iter().any(|w| w.placement == Some(id))
    }

    /// The processes the launcher has left alone and that still run (as of the last
    /// refresh).
    pub fn running_untouched(&mut self) -> Vec<&mut WorkerProc> {
        self.list
            .iter_mut()
            .filter(|w| w.fate == Fate::Trains && !w.exited())
            .collect()
    }

    /// The process named `name`.
    pub fn by_name(&mut self, name: &str) -> Option<&mut WorkerProc> {
        self.list.iter_mut().find(|w| w.name == name)
    }

    /// Records, for each worker seen to have exited since the last call, the time in the
    /// coordinator's clock: `now_ms` is the coordinator's clock now.
    pub fn note_exits(&mut self, now_ms: u64) {
        for w in &mut self.list {
            if w.exited_ms.is_none() && w.exited() {
                w.exited_ms = Some(now_ms);
            }
        }
    }

    /// Fails if a worker has exited in a way its fate does not allow; returns the time of the
    /// check that found every worker gone.
    pub fn check(&self) -> anyhow::Result<Option<Instant>> {
        let mut running = 0;
        for w in &self.list {
            if w.exited() {
                allowed(w)?;
            } else {
                running += 1;
            }
        }
        Ok((running == 0).then(Instant::now))
    }

    /// How every worker ended, for the report.
    pub fn report(&self) -> Vec<WorkerProcess> {
        self.list
            .iter()
            .map(|w| {
                let status = w.status();
                WorkerProcess {
                    name: w.name.clone(),
                    slot: w.slot.clone(),
                    placement: w.placement,
                    exited_ms: w.exited_ms,
                    fate: w.fate.name().to_string(),
                    exit_code: status.and_then(|s| s.code()),
                    signal: status.and_then(|s| s.signal()),
                }
            })
            .collect()
    }
}

/// Fails unless `w`, if it ended, ended in a way its fate allows.
pub(super) fn allowed(w: &WorkerProc) -> anyhow::Result<()> {
    let Some(e) = &w.exit else {
        return Ok(());
    };
    if e.ok || w.fate == Fate::Killed {
        return Ok(());
    }
    match e.status {
        Some(status) => bail!(
            "{}",
            failure_message(&w.name, &w.log, w.fate.failure(), status)
        ),
        None => bail!("{} {}: {}", w.name, w.fate.failure(), e.what),
    }
}
