//! The launcher as a placer: it starts the workers the coordinator asks for (replacements of
//! stragglers and preempted workers, migrations, resizes) in free slots, and carries out the
//! scenario's elastic events (slow, preempt, migrate).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_launch::{Placer as _, Signal};
use edl_shared::proto::{ErrorCode, PlacementKind};

use super::play::{ADMIN_TIMEOUT, Outcome};
use super::workers::Fate;
use super::{Launch, LocalConfig};
use crate::elastic::LauncherAction;
use crate::scenario::{Action, ScenarioEvent};

/// How often the coordinator is asked for placements.
const PLACEMENT_POLL: Duration = Duration::from_millis(250);

/// Slots, and what the launcher did for the elastic features.
#[derive(Debug)]
pub(super) struct Placer {
    slots: Vec<String>,
    next_poll: Instant,
    /// Whether a failed placements request was already reported (said once per outage).
    said_unreachable: bool,
    /// The elastic actions carried out, for the report.
    pub actions: Vec<LauncherAction>,
}

impl Placer {
    pub fn new(cfg: &LocalConfig) -> Placer {
        let most = cfg.workers
            + cfg.scenario.as_ref().map_or(0, |s| {
                s.scenario
                    .events
                    .iter()
                    .map(|e| match &e.action {
                        Action::Add { names } => names.len() as u32,
                        _ => 0,
                    })
                    .sum()
            });
        let n = match cfg.elastic.slots {
            0 => (2 * most).max(4),
            n => n,
        };
        Placer {
            slots: (0..n).map(|i| format!("slot{i}")).collect(),
            next_poll: Instant::now(),
            said_unreachable: false,
            actions: Vec::new(),
        }
    }

    /// A free slot: `want` if given (it must exist and be free), else the first free one.
    pub fn free_slot(&self, busy: &[String], want: Option<&str>) -> Result<String, String> {
        match want {
            Some(w) if !self.slots.iter().any(|s| s == w) => Err(format!(
                "no slot {w:?} on this machine (slots: slot0..slot{}; see edl-local --slots)",
                self.slots.len() - 1
            )),
            Some(w) if busy.iter().any(|b| b == w) => Err(format!("slot {w} is taken")),
            Some(w) => Ok(w.to_string()),
            None => self
                .slots
                .iter()
                .find(|s| !busy.contains(s))
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "all {} slots are taken; start edl-local with more --slots",
                        self.slots.len()
                    )
                }),
        }
    }
}

/// The file a worker's slowdown factor is read from (the scenario's `slow` writes it).
pub(super) fn slowdown_file(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join("slowdown").join(name)
}

impl Launch<'_> {
    /// Starts a worker for every pending placement no process was started for yet (at most
    /// every [`PLACEMENT_POLL`]); a placement that cannot be placed is reported failed.
    pub(super) async fn place_due(&mut self) -> anyhow::Result<()> {
        if Instant::now() < self.placer.next_poll {
            return Ok(());
        }
        self.placer.next_poll = Instant::now() + PLACEMENT_POLL;
        let Some(admin) = &self.admin else {
            return Ok(());
        };
        let asked = tokio::time::timeout(ADMIN_TIMEOUT, async {
            let placements = admin.placements().await?;
            let pending = placements.iter().any(|p| p.is_pending());
            let members = if pending {
                admin.members().await?
            } else {
                Vec::new()
            };
            Ok::<_, edl_shared::transport::CallError>((placements, members))
        })
        .await;
        let (placements, members) = match asked {
            Ok(Ok(v)) => {
                self.placer.said_unreachable = false;
                v
            }
            // The coordinator may be busy or restarting; the next poll tries again.
            Ok(Err(e)) if !self.placer.said_unreachable => {
                self.placer.said_unreachable = true;
                tracing::warn!(error = %e, "cannot read the coordinator's placements");
                return Ok(());
            }
            _ => return Ok(()),
        };
        let todo: Vec<_> = placements
            .into_iter()
            .filter(|p| p.is_pending() && !self.workers.has_placement(p.id))
            .collect();
        for p in todo {
            let name = format!("p{}", p.id);
            // A replacement stands for the scenario's worker it replaces, so that later
            // events naming that worker act on it.
            let stands_for = match p.kind {
                PlacementKind::Replace { old, .. } => members
                    .iter()
                    .find(|m| m.id == old)
                    .and_then(|m| self.workers.by_name(&m.name))
                    .map(|w| w.stands_for.clone()),
                PlacementKind::Add => None,
            }
            .unwrap_or_else(|| name.clone());
            let what = p.kind.describe(|old| {
                members
                    .iter()
                    .find(|m| m.id == old)
                    .map_or_else(|| old.to_string(), |m| m.name.clone())
            });
            match self
                .spawn_worker(&name, &stands_for, Some((p.id, p.slot.as_deref())))
                .await
            {
                Ok(()) => {
                    let slot = self
                        .workers
                        .by_name(&name)
                        .map(|w| w.slot.clone())
                        .unwrap_or_default();
                    self.progress.println(&format!(
                        "edl-local: placement {}: started {name} in {slot} ({what})",
                        p.id
                    ));
                }
                Err(e) => {
                    let reason = format!("{e:#}");
                    self.progress.println(&format!(
                        "edl-local: placement {} ({what}) failed: {reason}",
                        p.id
                    ));
                    if let Some(admin) = &self.admin {
                        let _ = tokio::time::timeout(
                            ADMIN_TIMEOUT,
                            admin.placement_failed(p.id, &reason),
                        )
                        .await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Carries out a scenario's slow, preempt or migrate event.
    pub(super) async fn apply_elastic(&mut self, ev: &ScenarioEvent) -> anyhow::Result<Outcome> {
        let at = ev.at.as_secs_f64();
        let t_ms = self.coordinator_now();
        match &ev.action {
            Action::Slow { worker, factor } => {
                let Some(w) = self.workers.current(worker) else {
                    return Ok(Outcome::Skipped(format!("{worker} is not running")));
                };
                let name = w.name.clone();
                let file = slowdown_file(&self.state_dir, &name);
                if let Some(dir) = file.parent() {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
                edl_shared::pki::write_atomic(&file, factor.to_string().as_bytes())
                    .with_context(|| format!("writing {}", file.display()))?;
                self.record_elastic(t_ms, "slow", &name, format!("{factor}x"));
            }
            Action::Pause { worker, for_s } => {
                let Some(w) = self.workers.current(worker) else {
                    return Ok(Outcome::Skipped(format!("{worker} is not running")));
                };
                let (name, pid) = (w.name.clone(), w.pid);
                if !self
                    .procs
                    .signal(&self.job.name, &name, Signal::SIGSTOP)
                    .await?
                {
                    return Ok(Outcome::Skipped(format!("{worker} had already exited")));
                }
                // Let it go on later, whatever the launcher is doing then; a process that
                // exited meanwhile (killed while stopped) is not there to continue.
                if let Ok(pid) = i32::try_from(pid) {
                    let pause = Duration::from_secs_f64(*for_s);
                    tokio::spawn(async move {
                        tokio::time::sleep(pause).await;
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            Signal::SIGCONT,
                        );
                    });
                }
                self.record_elastic(t_ms, "pause", &name, format!("SIGSTOP for {for_s} s"));
            }
            Action::Preempt { worker } => {
                let Some(w) = self.workers.current(worker) else {
                    return Ok(Outcome::Skipped(format!("{worker} is not running")));
                };
                let name = w.name.clone();
                if !self
                    .procs
                    .signal(&self.job.name, &name, Signal::SIGUSR1)
                    .await?
                {
                    return Ok(Outcome::Skipped(format!("{worker} had already exited")));
                }
                if let Some(w) = self.workers.by_name(&name) {
                    w.fate = Fate::Preempted;
                }
                let notice = self.cfg.elastic.preempt_notice;
                self.record_elastic(
                    t_ms,
                    "preempt",
                    &name,
                    format!("SIGUSR1, {} notice", humantime::format_duration(notice)),
                );
            }
            Action::Migrate { worker, to } => {
                let Some(w) = self.workers.current(worker) else {
                    return Ok(Outcome::Skipped(format!("{worker} is not running")));
                };
                let name = w.name.clone();
                let admin = self.admin.as_ref().context("no admin connection")?;
                let members = tokio::time::timeout(ADMIN_TIMEOUT, admin.members())
                    .await
                    .context("the members request for a migration timed out")??;
                let Some(id) = members
                    .iter()
                    .rev()
                    .find(|m| {
                        m.name == name && m.state == edl_shared::proto::msg::WorkerState::Active
                    })
                    .map(|m| m.id)
                else {
                    return Ok(Outcome::Waiting(format!(
                        "{name} has not been admitted yet"
                    )));
                };
                match tokio::time::timeout(ADMIN_TIMEOUT, admin.migrate(id, to.clone())).await {
                    Ok(Ok(p)) => {
                        self.record_elastic(t_ms, "migrate", &name, format!("placement {}", p.id));
                    }
                    Ok(Err(e))
                        if matches!(
                            e.code(),
                            Some(ErrorCode::UnknownWorker | ErrorCode::Conflict)
                        ) =>
                    {
                        return Ok(Outcome::Skipped(format!("{name}: {e}")));
                    }
                    Ok(Err(e)) => return Err(e).with_context(|| format!("migrating {name}")),
                    Err(_) => anyhow::bail!("the migration request for {name} timed out"),
                }
            }
            other => anyhow::bail!("not an elastic event: {other}"),
        }
        self.progress
            .println(&format!("edl-local: {at:.1} s: {}", ev.action));
        Ok(Outcome::Done)
    }

    pub(super) fn record_elastic(
        &mut self,
        t_ms: Option<u64>,
        action: &str,
        worker: &str,
        detail: String,
    ) {
        self.placer.actions.push(LauncherAction {
            t_ms,
            action: action.to_string(),
            worker: worker.to_string(),
            detail,
        });
    }
}
