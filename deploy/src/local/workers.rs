//! The launcher's worker processes: which scenario worker each one stands for, the slot it runs in, what the launcher
//! did to it (and so how it may exit), and the check that notices a worker failing or every
//! worker being done.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::report::WorkerProcess;
use edl_launch::procs::Proc;

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

/// One worker process.
#[derive(Debug)]
pub(super) struct WorkerProc {
    /// The process; its name is the worker's certificate name.
    pub proc: Proc,
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

    /// The slots taken by worker processes that still run.
    pub fn busy_slots(&mut self) -> anyhow::Result<Vec<String>> {
        let mut out = Vec::new();
        for w in &mut self.list {
            if w.proc.try_exit()?.is_none() {
                out.push(w.slot.clone());
            }
        }
        Ok(out)
    }

    /// Whether a process was already started for placement `id`.
    pub fn has_placement(&self, id: u64) -> bool {
        self.list.iter().any(|w| w.placement == Some(id))
    }

    /// The processes the launcher has left alone and that still run.
    pub fn running_untouched(&mut self) -> anyhow::Result<Vec<&mut WorkerProc>> {
        let mut out = Vec::new();
        for w in &mut self.list {
            if w.fate == Fate::Trains && w.proc.try_exit()?.is_none() {
                out.push(w);
            }
        }
        Ok(out)
    }

    /// The process named `name`.
    pub fn by_name(&mut self, name: &str) -> Option<&mut WorkerProc> {
        self.list.iter_mut().find(|w| w.proc.name() == name)
    }

    /// Records, for each worker seen to have exited since the last call, the time in the
    /// coordinator's clock: `now_ms` is the coordinator's clock now.
    pub fn note_exits(&mut self, now_ms: u64) -> anyhow::Result<()> {
        for w in &mut self.list {
            if w.exited_ms.is_none() && w.proc.try_exit()?.is_some() {
                w.exited_ms = Some(now_ms);
            }
        }
        Ok(())
    }

    /// Fails if a worker has exited in a way its fate does not allow; returns the time of the
    /// check that found every worker gone.
    pub fn check(&mut self) -> anyhow::Result<Option<Instant>> {
        let mut running = 0;
        for w in &mut self.list {
            match w.proc.try_exit()? {
                None => running += 1,
                Some(status) => allowed(w, status)?,
            }
        }
        Ok((running == 0).then(Instant::now))
    }

    /// Stops every worker still running (after a failure), each with SIGTERM and `grace`.
    pub async fn terminate_all(&mut self, grace: Duration) -> Vec<String> {
        let mut problems = Vec::new();
        for w in &mut self.list {
            // A worker that is still running here is one the failed run no longer needs; how
            // it stops is not news.
            if let Err(e) = w.proc.terminate(grace).await {
                problems.push(format!("{e:#}"));
            }
        }
        problems
    }

    /// How every worker ended, for the report.
    pub fn report(&mut self) -> Vec<WorkerProcess> {
        self.list
            .iter_mut()
            .map(|w| {
                let status = w.proc.try_exit().ok().flatten();
                WorkerProcess {
                    name: w.proc.name().to_string(),
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

/// Fails unless `status` is a way `w` may end.
pub(super) fn allowed(w: &WorkerProc, status: ExitStatus) -> anyhow::Result<()> {
    if status.success() || w.fate == Fate::Killed {
        return Ok(());
    }
    bail!("{}", w.proc.failure(w.fate.failure(), status))
}
