//! The launcher's shard servers: their processes, what the launcher did to each (and so how it
//! may end), and the scenario's shard events, carried out through the coordinator's admin
//! requests (the ones `edlctl shard add|remove` and `edlctl move` send).
//!
//! Shards are started one at a time, each once the coordinator lists the one before, so that
//! the coordinator's ids follow the names (`s0` is shard `s0`) and a scenario's ranges land
//! where its author expects. Every shard writes its address to `<state>/<name>.addr`; a
//! restarted shard listens on the address it had, so that its stateless resets end the
//! workers' old connections at once instead of after the idle timeout.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use edl_ps::admin::{Admin, ReshardView};
use edl_shared::Role;
use edl_shared::proto::ShardId;
use edl_shared::proto::msg::ShardEntry;
use nix::sys::signal::Signal;

use super::Launch;
use super::play::{KILL_WAIT, Outcome, coordinator_ms, ms};
use crate::costs::ShardAction;
use crate::report::ShardLayout;
use crate::scenario::{Action, ScenarioEvent, shard_name};
use edl_launch::procs::{Proc, Spawn};

/// How long a new shard may take to be listed by the coordinator at start-up.
const SHARD_JOIN: Duration = Duration::from_secs(30);
/// How often the coordinator's shard list is read while waiting for a shard to join.
const JOIN_POLL: Duration = Duration::from_millis(20);
/// How long one admin request that reads may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one request that reshapes the map (its moves included) may take.
const RESHAPE_TIMEOUT: Duration = Duration::from_secs(120);

/// What the launcher did to a shard, which says how it may end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ShardFate {
    /// Nothing: it serves until the launcher stops it.
    Serves,
    /// It was sent SIGKILL: any exit is expected.
    Killed,
    /// The coordinator removed it from the job: it retires and exits 0.
    Removed,
}

/// One shard process.
#[derive(Debug)]
pub(super) struct ShardProc {
    /// The process; its name is the shard's certificate name.
    proc: Proc,
    /// What the launcher did to it.
    fate: ShardFate,
    /// When it was started, while the launcher waits for it to serve (an added or restarted
    /// shard); `None` once it serves.
    starting: Option<Instant>,
}

/// Every shard process of a run, in start order; a restarted shard is a second process under
/// the same name.
#[derive(Debug, Default)]
pub(super) struct Shards {
    list: Vec<ShardProc>,
}

impl Shards {
    /// The latest process named `name`.
    fn current(&mut self, name: &str) -> Option<&mut ShardProc> {
        self.list.iter_mut().rev().find(|s| s.proc.name() == name)
    }

    /// How many processes have been started under `name`.
    fn starts(&self, name: &str) -> usize {
        self.list.iter().filter(|s| s.proc.name() == name).count()
    }

    /// Fails if a shard has exited in a way its fate does not allow: training cannot go on
    /// without a shard that serves, and a removed one retires with a clean exit.
    pub fn check(&mut self) -> anyhow::Result<()> {
        for s in &mut self.list {
            let Some(status) = s.proc.try_exit()? else {
                continue;
            };
            match s.fate {
                ShardFate::Killed => {}
                ShardFate::Removed if status.success() => {}
                ShardFate::Removed => {
                    bail!("{}", s.proc.failure("failed as it retired", status))
                }
                ShardFate::Serves => bail!("{}", s.proc.failure("exited during training", status)),
            }
        }
        Ok(())
    }

    /// Stops every shard still running with SIGTERM and `grace`; returns the problems worth
    /// reporting (a killed shard's death and a removed shard's clean exit are not).
    pub async fn stop(&mut self, grace: Duration) -> Vec<String> {
        let mut problems = Vec::new();
        for s in &mut self.list {
            let problem = super::stop_server(&mut s.proc, grace).await;
            if s.fate != ShardFate::Killed {
                problems.extend(problem);
            }
        }
        problems
    }
}

/// A line for the progress output: what a reshaping moved.
fn moved(v: &ReshardView) -> String {
    if v.moves.is_empty() {
        return format!("nothing to move (map e{})", v.epoch);
    }
    let bytes: u64 = v.moves.iter().map(|m| m.bytes).sum();
    let hold = v.moves.iter().map(|m| m.hold_ms).fold(0.0, f64::max);
    format!(
        "{} move{} ({}), longest hold {hold:.1} ms, map e{}",
        v.moves.len(),
        if v.moves.len() == 1 { "" } else { "s" },
        edl_ps::admin::human_bytes(bytes),
        v.epoch
    )
}

impl Launch<'_> {
    fn admin(&self) -> anyhow::Result<&Admin> {
        self.admin
            .as_ref()
            .ok_or_else(|| anyhow!("the launcher has no admin connection to the coordinator"))
    }

    /// Where the shard `name` writes its address.
    fn addr_file(&self, name: &str) -> PathBuf {
        self.state_dir.join(format!("{name}.addr"))
    }

    /// Starts a shard process named `name` listening on `listen`, issuing its certificate
    /// first if it has none yet. A restarted shard logs to a file of its own, so that the
    /// killed one's log stays.
    fn spawn_shard(&mut self, name: &str, listen: &str) -> anyhow::Result<()> {
        let coordinator = self
            .coordinator_addr
            .context("shards cannot start before the coordinator")?;
        self.pki
            .ensure(Role::Shard, name)
            .with_context(|| format!("issuing the certificate of shard/{name}"))?;
        let addr_file = self.addr_file(name);
        edl_launch::launch::remove_stale(&addr_file)?;
        let log = match self.shards.starts(name) {
            0 => format!("{name}.log"),
            n => format!("{name}-restart{n}.log"),
        };
        let mut args = edl_launch::launch::shard_args(
            &coordinator,
            name,
            listen,
            &self.state_dir,
            &addr_file,
            None,
        );
        args.extend(edl_launch::launch::metrics_args(&self.state_dir, name));
        let proc = Proc::spawn(Spawn {
            log: self.logs.join(log),
            name: name.to_string(),
            program: self.bins.ps.clone(),
            args,
            ..Spawn::default()
        })?;
        self.shards.list.push(ShardProc {
            proc,
            fate: ShardFate::Serves,
            starting: Some(Instant::now()),
        });
        Ok(())
    }

    /// Starts the shards `s0..` one at a time, each once the coordinator lists the one before.
    pub(super) async fn start_shards(&mut self) -> anyhow::Result<()> {
        for i in 0..self.cfg.shards {
            let name = shard_name(i);
            self.spawn_shard(&name, "127.0.0.1:0")?;
            let deadline = Instant::now() + SHARD_JOIN;
            while self.entry(&name).await?.is_none() {
                self.shards.check()?;
                if Instant::now() > deadline {
                    bail!(
                        "{name} did not join the coordinator within {} s; its log is {}",
                        SHARD_JOIN.as_secs(),
                        self.logs.join(format!("{name}.log")).display()
                    );
                }
                tokio::time::sleep(JOIN_POLL).await;
            }
            if let Some(s) = self.shards.current(&name) {
                s.starting = None;
            }
        }
        Ok(())
    }

    /// The coordinator's entry for the shard named `name`, if it has joined.
    async fn entry(&self, name: &str) -> anyhow::Result<Option<ShardEntry>> {
        let list = tokio::time::timeout(READ_TIMEOUT, self.admin()?.shard_list())
            .await
            .context("the shard list request timed out")?
            .context("asking the coordinator for its shards")?;
        Ok(list.into_iter().find(|e| e.name == name))
    }

    /// Sends one reshaping request and waits for its moves to finish.
    async fn reshape(
        &mut self,
        what: &str,
        req: impl AsyncFnOnce(&Admin) -> Result<ReshardView, edl_shared::transport::CallError>,
    ) -> anyhow::Result<ReshardView> {
        tokio::time::timeout(RESHAPE_TIMEOUT, req(self.admin()?))
            .await
            .with_context(|| format!("{what}: no answer within {} s", RESHAPE_TIMEOUT.as_secs()))?
            .with_context(|| what.to_string())
    }

    /// Records a shard event that happened at `at`, in the coordinator's time base.
    async fn record(
        &mut self,
        kind: &'static str,
        shard: &str,
        at: Instant,
        took: Option<Duration>,
    ) -> anyhow::Result<()> {
        let t_ms =
            coordinator_ms(at, self.admin()?.status()).await? + self.coordinator_run.offset_ms;
        self.shard_actions.push(ShardAction {
            t_ms,
            kind,
            shard: shard.to_string(),
            took_ms: took.map(ms),
        });
        Ok(())
    }

    /// Carries out one shard event (in elastic and `--restart-on-change` runs alike: shard
    /// events do not change the worker membership).
    pub(super) async fn apply_shard(&mut self, ev: &ScenarioEvent) -> anyhow::Result<Outcome> {
        let at = ev.at.as_secs_f64();
        match &ev.action {
            Action::ShardAdd { shard } => {
                if self.shards.current(shard).is_none() {
                    self.spawn_shard(shard, "127.0.0.1:0")?;
                }
                let Some(entry) = self.entry(shard).await? else {
                    return Ok(Outcome::Waiting(format!(
                        "{shard} has not joined the coordinator yet"
                    )));
                };
                let joined = self
                    .shards
                    .current(shard)
                    .and_then(|s| s.starting.take())
                    .map(|t| t.elapsed());
                let asked = Instant::now();
                let v = self
                    .reshape(&format!("adding shard {shard}"), async |a| {
                        a.shard_add(&entry.addr).await
                    })
                    .await?;
                self.record("shard_add", shard, asked, Some(asked.elapsed()))
                    .await?;
                self.progress.println(&format!(
                    "edl-local: {at:.1} s: {} (joined in {:.0} ms): {}",
                    ev.action,
                    joined.map_or(0.0, ms),
                    moved(&v)
                ));
            }
            Action::ShardRemove { shard } => {
                let asked = Instant::now();
                let v = self
                    .reshape(&format!("removing shard {shard}"), async |a| {
                        a.shard_remove(shard).await
                    })
                    .await?;
                if let Some(s) = self.shards.current(shard) {
                    s.fate = ShardFate::Removed;
                }
                self.record("shard_remove", shard, asked, Some(asked.elapsed()))
                    .await?;
                self.progress.println(&format!(
                    "edl-local: {at:.1} s: {}: {}",
                    ev.action,
                    moved(&v)
                ));
            }
            Action::Move { start, end, to } => {
                let v = self
                    .reshape(&format!("moving keys {start}..{end} to {to}"), async |a| {
                        a.move_range(*start, *end, to).await
                    })
                    .await?;
                self.progress.println(&format!(
                    "edl-local: {at:.1} s: {}: {}",
                    ev.action,
                    moved(&v)
                ));
            }
            Action::KillShard { shard } => {
                let Some(s) = self.shards.current(shard) else {
                    bail!("no shard process is named {shard}");
                };
                let killed = Instant::now();
                if !s.proc.signal(Signal::SIGKILL)? {
                    bail!("{shard} had already exited before it could be killed");
                }
                s.fate = ShardFate::Killed;
                if s.proc.wait_exit(KILL_WAIT).await?.is_none() {
                    bail!(
                        "{shard} did not die within {} s of SIGKILL",
                        KILL_WAIT.as_secs()
                    );
                }
                self.record("kill_shard", shard, killed, None).await?;
                self.progress
                    .println(&format!("edl-local: {at:.1} s: {}", ev.action));
            }
            Action::RestartShard { shard } => return self.restart_shard(ev, shard).await,
            _ => bail!("{} is not a shard event", ev.action),
        }
        Ok(Outcome::Done)
    }

    /// Starts a killed shard again on its old address, then waits (over as many checks as it
    /// takes) until it has rejoined and restored its checkpoint, that is, until it answers.
    async fn restart_shard(&mut self, ev: &ScenarioEvent, shard: &str) -> anyhow::Result<Outcome> {
        let Some((fate, starting)) = self.shards.current(shard).map(|s| (s.fate, s.starting))
        else {
            bail!("no shard process is named {shard}");
        };
        if fate == ShardFate::Killed {
            let file = self.addr_file(shard);
            let addr = std::fs::read_to_string(&file).with_context(|| {
                format!("reading the address of {shard} from {}", file.display())
            })?;
            self.spawn_shard(shard, addr.trim())?;
            return Ok(Outcome::Waiting(format!("{shard} is starting")));
        }
        let Some(started) = starting else {
            bail!("{shard} serves already");
        };
        // The address file appears once it listens; asking before could wait on a handshake.
        if !self.addr_file(shard).exists() {
            return Ok(Outcome::Waiting(format!("{shard} is not listening yet")));
        }
        let Some(entry) = self.entry(shard).await? else {
            bail!("the coordinator no longer lists {shard}");
        };
        let row = tokio::time::timeout(READ_TIMEOUT, self.admin()?.shard_row(&entry)).await;
        match row {
            Ok((_, None)) => {}
            Ok((_, Some(e))) => {
                return Ok(Outcome::Waiting(format!(
                    "{shard} does not answer yet: {e}"
                )));
            }
            Err(_) => return Ok(Outcome::Waiting(format!("{shard} does not answer yet"))),
        }
        if let Some(s) = self.shards.current(shard) {
            s.starting = None;
        }
        self.record("restart_shard", shard, started, Some(started.elapsed()))
            .await?;
        self.progress.println(&format!(
            "edl-local: {:.1} s: {}: serving again after {:.0} ms",
            ev.at.as_secs_f64(),
            ev.action,
            ms(started.elapsed())
        ));
        Ok(Outcome::Done)
    }

    /// Every shard the job has had, as it stands now, and the process names by id.
    pub(super) async fn shard_layout(
        &self,
    ) -> anyhow::Result<(Vec<ShardLayout>, BTreeMap<ShardId, String>)> {
        let admin = self.admin()?;
        let list = tokio::time::timeout(READ_TIMEOUT, admin.shard_list())
            .await
            .context("the shard list request timed out")?
            .context("asking the coordinator for its shards")?;
        let mut layout = Vec::new();
        for entry in &list {
            let (row, error) = tokio::time::timeout(READ_TIMEOUT, admin.shard_row(entry))
                .await
                .with_context(|| format!("asking {} for its holdings timed out", entry.name))?;
            layout.push(ShardLayout {
                id: row.id,
                name: entry.name.clone(),
                role: row.role,
                ranges: row.ranges,
                keys: row.keys,
                error,
            });
        }
        let names = list.into_iter().map(|e| (e.id, e.name)).collect();
        Ok((layout, names))
    }
}
