//! The coordinator's process, and the scenario's coordinator events: `kill_coordinator` sends
//! it SIGKILL, and `restart_coordinator` starts it again with the same arguments and state
//! directory on the address it had, where the workers and shards, which keep calling that
//! address, find it again. The coordinator makes every change durable before it answers (its
//! write-ahead log in `STATE_DIR/coordinator/`), so the restarted one carries on from what it
//! acknowledged.
//!
//! A restarted coordinator's clock starts at 0 again, and its trace and history hold only
//! what happened since it started. The report keeps one time base, the first coordinator's
//! clock: the launcher learns where each coordinator's clock starts on its own clock (the
//! machine's monotonic clock, which every process shares) and shifts what a later one tells
//! by the difference ([`CoordinatorRun::offset_ms`]).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use edl_launch::Signal;
use edl_launch::procs::{Proc, Spawn};
use edl_ps::admin::Admin;
use edl_shared::proto::msg::{JobHistory, JobTrace};
use edl_shared::transport::TransportSettings;

use super::play::{ADMIN_TIMEOUT, KILL_WAIT, Outcome, ms};
use super::{ADDR_CHECK, COORDINATOR_NAME, COORDINATOR_START, Launch};
use crate::costs::ShardAction;
use crate::scenario::{Action, ScenarioEvent};

/// How the coordinator was started, whether it is down, and where its clock stands.
#[derive(Debug, Default)]
pub(super) struct CoordinatorRun {
    /// The first start's arguments (`--listen 127.0.0.1:0`); a restart puts the address that
    /// start got in place of the port 0.
    pub args: Vec<OsString>,
    /// The dashboard's address as the first start got it, if it serves one: a restart serves
    /// it there again, so that an open page keeps working.
    pub dashboard: Option<SocketAddr>,
    /// Killed by the scenario and not restarted yet: its exit is expected.
    pub down: bool,
    /// Processes started so far, the first included (a restarted one logs apart).
    pub starts: usize,
    /// When the first coordinator's clock started, on the launcher's clock.
    pub first_zero: Option<Instant>,
    /// Milliseconds from the start of the first coordinator's clock to the current one's:
    /// what turns the current coordinator's times into the report's.
    pub offset_ms: u64,
}

/// Where a coordinator's clock started, on the launcher's clock (a status's time less the
/// coordinator's clock in it, at the middle of the request), the clock it told, and when.
pub(super) async fn clock_zero(admin: &Admin) -> anyhow::Result<(Instant, u64, Instant)> {
    let sent = Instant::now();
    let st = tokio::time::timeout(ADMIN_TIMEOUT, admin.status())
        .await
        .context("the coordinator did not tell its clock in time")?
        .context("asking the coordinator for its clock")?;
    let middle = sent + sent.elapsed() / 2;
    let zero = middle
        .checked_sub(Duration::from_millis(st.t_ms))
        .unwrap_or(middle);
    Ok((zero, st.t_ms, middle))
}

/// Puts `addr` in place of the value of `flag` in `args`.
fn set_flag(args: &mut [OsString], flag: &str, addr: SocketAddr) -> anyhow::Result<()> {
    let value = args
        .iter()
        .position(|a| a == flag)
        .and_then(|i| args.get_mut(i + 1))
        .with_context(|| format!("the coordinator's arguments have no {flag} ADDR"))?;
    *value = addr.to_string().into();
    Ok(())
}

/// Moves the times of a coordinator's trace `by_ms` later: into the report's time base.
pub(super) fn shift_trace(trace: &mut JobTrace, by_ms: u64) {
    for e in &mut trace.events {
        e.t_ms += by_ms;
        e.requested_ms += by_ms;
    }
    for s in &mut trace.steps {
        s.t_ms += by_ms;
    }
    for m in &mut trace.moves {
        m.t_ms += by_ms;
    }
}

/// Moves the times of a coordinator's history `by_ms` later: into the report's time base.
pub(super) fn shift_history(history: &mut JobHistory, by_ms: u64) {
    for p in &mut history.points {
        p.t_ms += by_ms;
    }
    for e in &mut history.evaluations {
        e.t_ms += by_ms;
    }
}

impl Launch<'_> {
    /// Where the coordinator writes its address.
    pub(super) fn coordinator_addr_file(&self) -> PathBuf {
        self.state_dir.join("coordinator.addr")
    }

    /// Where the coordinator writes its dashboard's address.
    pub(super) fn dashboard_addr_file(&self) -> PathBuf {
        self.state_dir.join("dashboard.addr")
    }

    /// `at` in the report's time base: milliseconds since the first coordinator's clock
    /// started.
    fn report_ms(&self, at: Instant) -> u64 {
        self.coordinator_run
            .first_zero
            .map_or(0, |z| at.saturating_duration_since(z).as_millis() as u64)
    }

    /// Starts a coordinator process with `args`, logging to `log` in the log directory, and
    /// waits until it has written its address (and its dashboard's, if it serves one).
    pub(super) async fn spawn_coordinator(
        &mut self,
        args: Vec<OsString>,
        log: &str,
    ) -> anyhow::Result<SocketAddr> {
        let addr_file = self.coordinator_addr_file();
        let http_file = self.dashboard_addr_file();
        // A state directory can be reused, and a restarted coordinator writes its files
        // again: an address an earlier process left must not be mistaken for this one's.
        edl_launch::launch::remove_stale(&addr_file)?;
        edl_launch::launch::remove_stale(&http_file)?;
        let proc = self.coordinator.insert(Proc::spawn(Spawn {
            name: COORDINATOR_NAME.into(),
            program: self.bins.ps.clone(),
            args,
            log: self.logs.join(log),
            ..Spawn::default()
        })?);
        self.coordinator_run.starts += 1;
        let addr = proc
            .wait_for_addr(&addr_file, COORDINATOR_START, ADDR_CHECK)
            .await?;
        if self.cfg.observe.http.is_some() {
            let at = proc
                .wait_for_addr(&http_file, COORDINATOR_START, ADDR_CHECK)
                .await?;
            if self.coordinator_run.dashboard.is_none() {
                self.coordinator_run.dashboard = Some(at);
                self.progress
                    .println(&format!("edl-local: dashboard at http://{at}/"));
            }
        }
        Ok(addr)
    }

    /// Carries out a kill_coordinator or restart_coordinator event (in elastic and
    /// `--restart-on-change` runs alike: they change no worker).
    pub(super) async fn apply_coordinator(
        &mut self,
        ev: &ScenarioEvent,
    ) -> anyhow::Result<Outcome> {
        match ev.action {
            Action::KillCoordinator => self.kill_coordinator(ev).await?,
            Action::RestartCoordinator => self.restart_coordinator(ev).await?,
            _ => bail!("{} is not a coordinator event", ev.action),
        }
        Ok(Outcome::Done)
    }

    /// Sends the coordinator SIGKILL and waits until it is gone.
    async fn kill_coordinator(&mut self, ev: &ScenarioEvent) -> anyhow::Result<()> {
        let killed = Instant::now();
        let Some(p) = self.coordinator.as_mut() else {
            bail!("there is no coordinator process to kill");
        };
        if !p.signal(Signal::SIGKILL)? {
            bail!("the coordinator had already exited before it could be killed");
        }
        self.coordinator_run.down = true;
        // Its connection died with it (a call on it would wait for the idle timeout): the
        // restart connects anew. Until then nothing asks: the placements are not polled, and
        // no other scenario event may come in between.
        self.admin = None;
        if p.wait_exit(KILL_WAIT).await?.is_none() {
            bail!(
                "the coordinator did not die within {} s of SIGKILL",
                KILL_WAIT.as_secs()
            );
        }
        let t_ms = self.report_ms(killed);
        self.shard_actions.push(ShardAction {
            t_ms,
            kind: "kill_coordinator",
            shard: COORDINATOR_NAME.into(),
            took_ms: None,
        });
        self.progress.println(&format!(
            "edl-local: {:.1} s: {}",
            ev.at.as_secs_f64(),
            ev.action
        ));
        Ok(())
    }

    /// Starts the killed coordinator again with the first start's arguments on the address
    /// it had, waits until it listens, and connects the launcher's admin client to it.
    async fn restart_coordinator(&mut self, ev: &ScenarioEvent) -> anyhow::Result<()> {
        if !self.coordinator_run.down {
            bail!("the coordinator is running; only a killed coordinator restarts");
        }
        let addr = self
            .coordinator_addr
            .context("the coordinator never started")?;
        let mut args = self.coordinator_run.args.clone();
        set_flag(&mut args, "--listen", addr)?;
        if let Some(dashboard) = self.coordinator_run.dashboard {
            set_flag(&mut args, "--http", dashboard)?;
        }
        let started = Instant::now();
        let log = format!("coordinator-restart{}.log", self.coordinator_run.starts);
        let now_at = self.spawn_coordinator(args, &log).await?;
        if now_at != addr {
            bail!("the restarted coordinator listens on {now_at}, not on {addr} as before");
        }
        self.coordinator_run.down = false;
        let identity = self
            .identity
            .clone()
            .context("the launcher has no identity to connect with")?;
        let admin = tokio::time::timeout(
            ADMIN_TIMEOUT,
            Admin::connect(&addr.to_string(), &identity, TransportSettings::default()),
        )
        .await
        .context("connecting to the restarted coordinator timed out")?
        .context("connecting to the restarted coordinator as an admin")?;
        let (zero, t_ms, asked) = clock_zero(&admin).await?;
        let took = started.elapsed();
        self.admin = Some(admin);
        let first = *self.coordinator_run.first_zero.get_or_insert(zero);
        let offset_ms = zero.saturating_duration_since(first).as_millis() as u64;
        self.coordinator_run.offset_ms = offset_ms;
        self.clock = Some((t_ms + offset_ms, asked));
        let t_ms = self.report_ms(started);
        self.shard_actions.push(ShardAction {
            t_ms,
            kind: "restart_coordinator",
            shard: COORDINATOR_NAME.into(),
            took_ms: Some(ms(took)),
        });
        self.progress.println(&format!(
            "edl-local: {:.1} s: {}: answering on {addr} again after {:.0} ms",
            ev.at.as_secs_f64(),
            ev.action,
            ms(took)
        ));
        Ok(())
    }
}
