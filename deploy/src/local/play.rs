//! Scenario playback: each event, once due, is carried out against the running job. A worker
//! event is carried out either elastically (start workers, drain one through the coordinator,
//! signal one) or, with `--restart-on-change`, as a stop-everything restart (see
//! [`super::RESTART_NOTE`]); a shard or coordinator event the same way in both modes (modules
//! `shards` and `coordinator`), since it does not change the worker membership.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use edl_launch::{Placer as _, Signal};
use edl_shared::proto::ErrorCode;
use edl_shared::proto::frame::f32s_to_bytes;
use edl_shared::proto::msg::{EventKind, JobStatus, WorkerState};
use edl_worker::{ClientError, Job};

use super::Launch;
use super::workers::{Fate, allowed};
use crate::report::{RestartReport, SkippedEvent};
use crate::scenario::{Action, Scenario, ScenarioEvent};

/// How long an event may wait to become possible: a drain for its worker to be admitted (it
/// may still be loading its data), a shard add for the new shard to join, a shard restart for
/// the shard to serve again.
const ADMISSION_WAIT: Duration = Duration::from_secs(120);
/// How long one admin request to the coordinator may take.
pub(super) const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the old workers of a restart get to leave after SIGTERM.
const RESTART_STOP: Duration = Duration::from_secs(60);
/// How long the new workers of a restart get to take their first step.
const RESTART_START: Duration = Duration::from_secs(180);
/// How often a restart checks whether its new workers have stepped.
const RESTART_POLL: Duration = Duration::from_millis(50);
/// How long a killed process (worker or shard) gets to disappear.
pub(super) const KILL_WAIT: Duration = Duration::from_secs(10);

/// The scenario's progress through a run.
#[derive(Debug)]
pub(super) struct Player {
    pending: VecDeque<ScenarioEvent>,
    restart: bool,
    /// Since when the front event has waited to become possible.
    waiting_since: Option<Instant>,
    /// Workers an `add` started that the coordinator has not admitted yet: a later drain,
    /// kill or term waits for them, so that a scenario's order holds whatever the time a
    /// worker takes to prepare (seconds on a busy machine).
    unadmitted: Vec<String>,
    /// The restarts done so far.
    pub restarts: Vec<RestartReport>,
    /// Events that did not happen, and why.
    pub skipped: Vec<SkippedEvent>,
}

/// What became of a due event.
pub(super) enum Outcome {
    Done,
    Skipped(String),
    /// Not possible yet; try again at the next check.
    Waiting(String),
}

impl Player {
    pub fn new(scenario: &Scenario, restart: bool) -> Player {
        Player {
            pending: scenario.events.iter().cloned().collect(),
            restart,
            waiting_since: None,
            unadmitted: Vec::new(),
            restarts: Vec::new(),
            skipped: Vec::new(),
        }
    }

    fn skip(&mut self, ev: &ScenarioEvent, reason: String) {
        self.skipped.push(SkippedEvent {
            at_s: ev.at.as_secs_f64(),
            action: ev.action.to_string(),
            reason,
        });
    }

    /// Training has ended after `elapsed` (since the first admitted worker; `None` if none
    /// was ever seen): every event left did not happen.
    pub fn finish(&mut self, elapsed: Option<Duration>) {
        while let Some(ev) = self.pending.pop_front() {
            let reason = match (self.waiting_since.take(), elapsed) {
                (Some(_), _) => "training ended while it waited to become possible (a worker to \
                                  be admitted, a shard to join or to serve again)"
                    .to_string(),
                (None, Some(e)) => format!("training ended at {:.1} s", e.as_secs_f64()),
                (None, None) => "training ended before any worker was admitted".to_string(),
            };
            self.skip(&ev, reason);
        }
    }
}

impl Launch<'_> {
    /// Carries out, in order, every scenario event due by now; `zero` is when training started.
    pub(super) async fn play_due(
        &mut self,
        player: &mut Player,
        zero: Instant,
        job: &Job,
    ) -> anyhow::Result<()> {
        while let Some(ev) = player.pending.front().cloned() {
            if zero.elapsed() < ev.at {
                break;
            }
            // Shard events are carried out the same way in both modes (`apply` hands them on).
            // Preempt and migrate need an admitted worker too (a SIGUSR1 before the worker
            // listens for it would end the process).
            let leaves = matches!(
                ev.action,
                Action::Drain { .. }
                    | Action::Kill { .. }
                    | Action::Term { .. }
                    | Action::Preempt { .. }
                    | Action::Migrate { .. }
                    | Action::Slow { .. }
            );
            let outcome = if !player.restart && leaves && !player.unadmitted.is_empty() {
                let st = tokio::time::timeout(ADMIN_TIMEOUT, job.status())
                    .await
                    .context("the status request timed out")?
                    .context("asking the coordinator which workers were admitted")?;
                player
                    .unadmitted
                    .retain(|n| !st.workers.iter().any(|w| w.name == *n));
                if player.unadmitted.is_empty() {
                    self.apply(&ev, job).await?
                } else {
                    Outcome::Waiting(format!(
                        "{} (added before it) not admitted yet",
                        player.unadmitted.join(", ")
                    ))
                }
            } else if player.restart && !ev.action.is_shard_event() && !ev.action.is_elastic_event()
            {
                self.restart(player, &ev, job).await?
            } else {
                self.apply(&ev, job).await?
            };
            match outcome {
                Outcome::Done => {
                    if let (false, Action::Add { names }) = (player.restart, &ev.action) {
                        player.unadmitted.extend(names.iter().cloned());
                    }
                }
                Outcome::Skipped(reason) => {
                    self.progress.println(&format!(
                        "edl-local: {:.1} s: skipped {}: {reason}",
                        ev.at.as_secs_f64(),
                        ev.action
                    ));
                    player.skip(&ev, reason);
                }
                Outcome::Waiting(why) => {
                    let since = *player.waiting_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > ADMISSION_WAIT {
                        bail!(
                            "scenario event at {:.1} s ({}) waited {} s: {why}",
                            ev.at.as_secs_f64(),
                            ev.action,
                            ADMISSION_WAIT.as_secs()
                        );
                    }
                    // Later events wait too, so that the scenario keeps its order. Waiting is
                    // done over several checks so that the launcher keeps watching its children.
                    return Ok(());
                }
            }
            player.waiting_since = None;
            player.pending.pop_front();
        }
        Ok(())
    }

    /// Carries out one event elastically.
    async fn apply(&mut self, ev: &ScenarioEvent, job: &Job) -> anyhow::Result<Outcome> {
        let at = ev.at.as_secs_f64();
        match &ev.action {
            Action::Add { names } => {
                for name in names {
                    self.spawn_worker(name, name, None).await?;
                }
                self.progress
                    .println(&format!("edl-local: {at:.1} s: {}", ev.action));
                Ok(Outcome::Done)
            }
            Action::Drain { worker } => {
                self.workers.refresh(&mut self.procs).await;
                let Some(w) = self.workers.current(worker) else {
                    return Ok(Outcome::Skipped(format!("{worker} is not running")));
                };
                if let Some(e) = &w.exit {
                    return Ok(Outcome::Skipped(format!(
                        "{worker} had already exited ({})",
                        e.status.map_or_else(|| e.what.clone(), |s| s.to_string())
                    )));
                }
                let st = tokio::time::timeout(ADMIN_TIMEOUT, job.status())
                    .await
                    .context("the status request for a drain timed out")?
                    .context("asking the coordinator for the worker to drain")?;
                // The latest registration under that name is the process's.
                let Some(ws) = st.workers.iter().rev().find(|ws| ws.name == *worker) else {
                    return Ok(Outcome::Waiting(format!(
                        "{worker} has not been admitted yet"
                    )));
                };
                if ws.state != WorkerState::Active {
                    return Ok(Outcome::Skipped(format!(
                        "{worker} had already left ({:?})",
                        ws.state
                    )));
                }
                let id = ws.id;
                match tokio::time::timeout(ADMIN_TIMEOUT, job.drain(id)).await {
                    Ok(Ok(())) => {}
                    // It left between the status and the drain.
                    Ok(Err(ClientError::Call(e))) if e.code() == Some(ErrorCode::UnknownWorker) => {
                        return Ok(Outcome::Skipped(format!("{worker} had just left")));
                    }
                    Ok(Err(e)) => {
                        return Err(e).with_context(|| format!("asking to drain {worker}"));
                    }
                    Err(_) => bail!("the drain request for {worker} timed out"),
                }
                w.fate = Fate::Drained;
                self.progress
                    .println(&format!("edl-local: {at:.1} s: {}", ev.action));
                Ok(Outcome::Done)
            }
            Action::Kill { worker } | Action::Term { worker } => {
                let (signal, fate) = match ev.action {
                    Action::Kill { .. } => (Signal::SIGKILL, Fate::Killed),
                    _ => (Signal::SIGTERM, Fate::Termed),
                };
                let Some(w) = self.workers.current(worker) else {
                    return Ok(Outcome::Skipped(format!("{worker} is not running")));
                };
                let name = w.name.clone();
                if !self.procs.signal(&self.job.name, &name, signal).await? {
                    return Ok(Outcome::Skipped(format!("{worker} had already exited")));
                }
                if let Some(w) = self.workers.by_name(&name) {
                    w.fate = fate;
                }
                // Kept with the elastic actions, for the time the coordinator took to find
                // a killed worker dead.
                let t_ms = self.coordinator_now();
                let what = if fate == Fate::Killed { "kill" } else { "term" };
                self.record_elastic(t_ms, what, &name, format!("{signal}"));
                self.progress
                    .println(&format!("edl-local: {at:.1} s: {}", ev.action));
                Ok(Outcome::Done)
            }
            Action::Slow { .. }
            | Action::Pause { .. }
            | Action::Preempt { .. }
            | Action::Migrate { .. } => self.apply_elastic(ev).await,
            Action::KillCoordinator | Action::RestartCoordinator => {
                self.apply_coordinator(ev).await
            }
            _ => self.apply_shard(ev).await,
        }
    }

    /// Carries out one event as a stop-everything restart: checkpoint, stop every worker,
    /// start the new membership as fresh processes.
    async fn restart(
        &mut self,
        player: &mut Player,
        ev: &ScenarioEvent,
        job: &Job,
    ) -> anyhow::Result<Outcome> {
        let before = self.workers.current_names();
        let mut after = before.clone();
        match &ev.action {
            Action::Add { names } => after.extend(names.iter().cloned()),
            a => {
                let target = a.target().unwrap_or_default();
                if !before.iter().any(|s| s == target) {
                    return Ok(Outcome::Skipped(format!("{target} is not running")));
                }
                after.retain(|s| s != target);
            }
        }
        // A worker that exited on its own found no data left: training is ending, and a
        // restart would only start workers with nothing to do.
        self.workers.refresh(&mut self.procs).await;
        if self.workers.running_untouched().len() < before.len() {
            return Ok(Outcome::Skipped(
                "training was ending (a worker had found no data left)".into(),
            ));
        }
        let n = player.restarts.len() + 1;
        let begun = Instant::now();
        if let Action::Kill { worker } = &ev.action
            && let Some(victim) = self.workers.current(worker)
        {
            victim.fate = Fate::Killed;
            let name = victim.name.clone();
            self.procs
                .signal(&self.job.name, &name, Signal::SIGKILL)
                .await?;
            if !self
                .workers
                .wait_exit(&mut self.procs, &name, KILL_WAIT)
                .await
            {
                bail!(
                    "{worker} did not die within {} s of SIGKILL",
                    KILL_WAIT.as_secs()
                );
            }
        }

        let (checkpoint, checkpoint_bytes) = self.checkpoint(job, n).await?;
        let checkpoint_ms = ms(begun.elapsed());

        let stopping = Instant::now();
        let mut old = Vec::new();
        for w in self.workers.running_untouched() {
            w.fate = Fate::Restarted;
            old.push(w.name.clone());
        }
        for name in &old {
            self.procs
                .signal(&self.job.name, name, Signal::SIGTERM)
                .await?;
        }
        for name in &old {
            let left = self
                .workers
                .wait_exit(&mut self.procs, name, RESTART_STOP)
                .await;
            let Some(w) = self.workers.by_name(name) else {
                continue;
            };
            if !left {
                bail!(
                    "{name} did not leave within {} s of SIGTERM for restart {n}; its log is {}",
                    RESTART_STOP.as_secs(),
                    w.log.display()
                );
            }
            allowed(w)?;
        }
        let stop_ms = ms(stopping.elapsed());

        let starting = Instant::now();
        let names: Vec<String> = after.iter().map(|w| format!("{w}-r{n}")).collect();
        for (w, name) in after.iter().zip(&names) {
            self.spawn_worker(name, w, None).await?;
        }
        self.wait_first_steps(job, &names, n).await?;
        let start_ms = ms(starting.elapsed());

        let report = RestartReport {
            t_ms: coordinator_ms(begun, job.status()).await? + self.coordinator_run.offset_ms,
            cause: ev.action.to_string(),
            workers_before: before.len() as u32,
            workers_after: after.len() as u32,
            checkpoint_ms,
            stop_ms,
            start_ms,
            checkpoint,
            checkpoint_bytes,
        };
        self.progress.println(&format!(
            "edl-local: {:.1} s: {} by restart {n}: checkpoint {checkpoint_ms:.0} ms, stop \
             {stop_ms:.0} ms, start {start_ms:.0} ms; now {}",
            ev.at.as_secs_f64(),
            ev.action,
            names.join(", ")
        ));
        player.restarts.push(report);
        Ok(Outcome::Done)
    }

    /// Pulls every parameter as an admin client and writes them, as little-endian f32 in the
    /// model's flat order, atomically to `<state>/checkpoint-N.bin`.
    async fn checkpoint(&self, job: &Job, n: usize) -> anyhow::Result<(std::path::PathBuf, u64)> {
        let st = tokio::time::timeout(ADMIN_TIMEOUT, job.status())
            .await
            .context("the status request for a checkpoint timed out")?
            .context("asking the coordinator for the clock to checkpoint at")?;
        let mut params = vec![0f32; job.param_count()];
        // Like the evaluator: only steps every counting worker has passed are applied.
        tokio::time::timeout(
            ADMIN_TIMEOUT,
            job.pull_all_in(&mut params, st.min_clock, edl_shared::proto::Wire::F32),
        )
        .await
        .context("the checkpoint pull timed out")?
        .context("pulling the parameters for a checkpoint")?;
        let bytes = f32s_to_bytes(&params);
        let path = self.state_dir.join(format!("checkpoint-{n}.bin"));
        edl_shared::pki::write_atomic(&path, &bytes)
            .with_context(|| format!("writing the checkpoint {}", path.display()))?;
        Ok((path, bytes.len() as u64))
    }

    /// Waits until each of the workers `names` has taken its first step, or has exited
    /// cleanly (no data was left for it).
    async fn wait_first_steps(
        &mut self,
        job: &Job,
        names: &[String],
        n: usize,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + RESTART_START;
        loop {
            self.check_servers()?;
            self.workers.refresh(&mut self.procs).await;
            let mut exited = Vec::new();
            for name in names {
                if let Some(w) = self.workers.by_name(name)
                    && w.exited()
                {
                    allowed(w)?;
                    exited.push(name.as_str());
                }
            }
            let trace = tokio::time::timeout(ADMIN_TIMEOUT, job.trace())
                .await
                .context("the trace request of a restart timed out")?
                .context("asking the coordinator for its trace")?;
            let all_stepped = names.iter().all(|name| {
                exited.contains(&name.as_str())
                    || trace
                        .events
                        .iter()
                        .filter(|e| e.kind == EventKind::Join && e.name == *name)
                        .any(|e| trace.steps.iter().any(|s| s.worker == e.worker))
            });
            if all_stepped {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the workers of restart {n} ({}) did not all take a step within {} s",
                    names.join(", "),
                    RESTART_START.as_secs()
                );
            }
            tokio::time::sleep(RESTART_POLL).await;
        }
    }
}

/// `at` in the coordinator's clock (milliseconds since it started, the trace's time base): its
/// clock as it answered `status`, less the time from `at` to the middle of that request.
pub(super) async fn coordinator_ms<E>(
    at: Instant,
    status: impl std::future::Future<Output = Result<JobStatus, E>>,
) -> anyhow::Result<u64>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let sent = Instant::now();
    let st = tokio::time::timeout(ADMIN_TIMEOUT, status)
        .await
        .context("the coordinator did not tell its clock in time")??;
    let middle = sent + sent.elapsed() / 2;
    let since = middle.saturating_duration_since(at).as_millis() as u64;
    Ok(st.t_ms.saturating_sub(since))
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
