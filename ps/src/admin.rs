//! The operator's client: a light connection to the coordinator (and, for shard details, to
//! each shard) with the admin role, plus serializable views of what it reads, for `edlctl`.

use bytes::Bytes;
use edl_shared::Identity;
use edl_shared::leader::Coordinators;
use edl_shared::proto::ErrorCode;
use edl_shared::proto::msg::{
    EpochLedger, JobStatus, MoveReport, ShardEntry, ShardRole, ShardStats, WorkerInfo, WorkerState,
};
use edl_shared::proto::{
    JobConfig, Placement, Request, Response, ShardId, ShardMap, StragglerSettings, WorkerId,
    place::Resize,
};
use edl_shared::transport::{CallError, Conn, TransportSettings, client_endpoint};
use serde::Serialize;

/// An authenticated admin connection to a job.
pub struct Admin {
    coordinator: std::sync::Mutex<Conn>,
    /// The job's coordinators (one, or the leader and standbys) and the one in use.
    coordinators: std::sync::Mutex<Coordinators>,
    endpoint: quinn::Endpoint,
    settings: TransportSettings,
    name: String,
}

/// Tries of a request across a job's coordinators before the last error is given back.
const LEADER_TRIES: usize = 8;

/// What one of a job's coordinators is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CoordinatorRole {
    /// It leads: it answered.
    Leader,
    /// It stands by; it named the leader, if one is elected.
    Standby {
        /// The leader's address.
        leader: Option<String>,
    },
}

impl Admin {
    /// Connects to the coordinator at `addrs`: one address, or several separated by commas
    /// (a job's coordinators sharing an etcd), of which the first that answers is used; a
    /// standby's answer moves the requests on to the leader it names.
    pub async fn connect(
        addrs: &str,
        identity: &Identity,
        settings: TransportSettings,
    ) -> Result<Admin, CallError> {
        let mut coordinators = Coordinators::parse(addrs).map_err(CallError::Address)?;
        let endpoint = client_endpoint(identity, &settings, false)?;
        let mut tried = Vec::new();
        let coordinator = loop {
            let at = coordinators.current().to_string();
            match Conn::connect(&endpoint, &at, &identity.name, &settings).await {
                Ok(c) => break c,
                Err(e) => {
                    tracing::debug!(error = %e, "coordinator at {at} does not answer");
                    tried.push(at);
                    if tried.len() == coordinators.all().len() {
                        return Err(CallError::Unreachable {
                            tried,
                            cause: Box::new(e),
                        });
                    }
                    coordinators.advance();
                }
            }
        };
        Ok(Admin {
            coordinator: std::sync::Mutex::new(coordinator),
            coordinators: std::sync::Mutex::new(coordinators),
            endpoint,
            settings,
            name: identity.name.clone(),
        })
    }

    /// The address of the coordinator in use (the leader, once a request found it).
    pub fn coordinator_addr(&self) -> String {
        self.coordinators
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .current()
            .to_string()
    }

    pub(crate) async fn ask(&self, req: Request) -> Result<Response, CallError> {
        let mut tries = 0;
        loop {
            let conn = self
                .coordinator
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            let err = match conn.call(req.clone(), Bytes::new()).await {
                Ok(answer) => return Ok(answer.msg),
                Err(e @ CallError::NotLeader { .. }) => e,
                // A server shutting down (or deposed) did nothing with the request: another
                // of several may lead now.
                Err(e)
                    if (e.connection_failed() || e.code() == Some(ErrorCode::ShuttingDown))
                        && self.several() =>
                {
                    e
                }
                Err(e) => return Err(e),
            };
            tries += 1;
            if tries >= LEADER_TRIES {
                return Err(err);
            }
            let (from, to) = {
                let mut c = self.coordinators.lock().unwrap_or_else(|p| p.into_inner());
                let from = c.current().to_string();
                let to = match &err {
                    CallError::NotLeader { leader: Some(l) } => c.follow(Some(l)).to_string(),
                    _ => c.advance().to_string(),
                };
                (from, to)
            };
            if !matches!(err, CallError::NotLeader { leader: Some(_) }) || from == to {
                // An election may be under way, or the leader named is starting.
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            tracing::info!("{err}; asking the coordinator at {to}");
            if let Ok(c) = Conn::connect(&self.endpoint, &to, &self.name, &self.settings).await {
                *self.coordinator.lock().unwrap_or_else(|p| p.into_inner()) = c;
            }
        }
    }

    fn several(&self) -> bool {
        self.coordinators
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .all()
            .len()
            > 1
    }

    /// Each of the job's coordinators (the addresses given, and the leader if a standby names
    /// another): its address and what it is, leader, standby or unreachable (with why).
    pub async fn coordinators(&self) -> Vec<(String, Result<CoordinatorRole, String>)> {
        let mut addrs = self
            .coordinators
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .all()
            .to_vec();
        let mut out = Vec::new();
        let mut i = 0;
        while let Some(addr) = addrs.get(i).cloned() {
            i += 1;
            let asked = async {
                let conn = Conn::connect(&self.endpoint, &addr, &self.name, &self.settings).await?;
                conn.call(Request::Status, Bytes::new()).await
            };
            let role = match tokio::time::timeout(std::time::Duration::from_secs(3), asked).await {
                Ok(Ok(_)) => Ok(CoordinatorRole::Leader),
                Ok(Err(CallError::NotLeader { leader })) => {
                    if let Some(l) = &leader
                        && !addrs.contains(l)
                    {
                        addrs.push(l.clone());
                    }
                    Ok(CoordinatorRole::Standby { leader })
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer within 3 s".into()),
            };
            out.push((addr, role));
        }
        out
    }

    /// The job status.
    pub async fn status(&self) -> Result<JobStatus, CallError> {
        match self.ask(Request::Status).await? {
            Response::Status(s) => Ok(s),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// The job configuration.
    pub async fn job(&self) -> Result<JobConfig, CallError> {
        match self.ask(Request::GetJob).await? {
            Response::Job(j) => Ok(j),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// The shard map.
    pub async fn map(&self) -> Result<ShardMap, CallError> {
        match self.ask(Request::GetMap).await? {
            Response::Map(m) => Ok(m),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// Every shard's per-epoch data ledger, of the shards in the map now (ranges may have
    /// moved since this connection was made), as the client's `Job::ledgers` gives them.
    pub async fn ledgers(&self) -> Result<Vec<(ShardId, Vec<EpochLedger>)>, CallError> {
        let mut out = Vec::new();
        for shard in &self.map().await?.shards {
            match self.ask_shard(&shard.addr, Request::Ledger).await? {
                Response::Ledger(l) => out.push((shard.id, l)),
                other => return Err(CallError::unexpected(&other)),
            }
        }
        Ok(out)
    }

    /// Every worker in detail.
    pub async fn members(&self) -> Result<Vec<WorkerInfo>, CallError> {
        match self.ask(Request::Members).await? {
            Response::Members(m) => Ok(m),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// One request to the shard at `addr`, on a connection of its own.
    async fn ask_shard(&self, addr: &str, req: Request) -> Result<Response, CallError> {
        let limit = match req {
            Request::Checkpoint => SHARD_CHECKPOINT,
            _ => SHARD_ANSWER,
        };
        let ask = async {
            let conn = Conn::connect(&self.endpoint, addr, &self.name, &self.settings).await?;
            Ok(conn.call(req, Bytes::new()).await?.msg)
        };
        // A shard that died (a replicated job's, replaced by its backups) never answers: say
        // so before the connection's idle timeout.
        tokio::time::timeout(limit, ask).await.unwrap_or_else(|_| {
            Err(CallError::TimedOut(format!(
                "{addr} did not answer within {limit:?}"
            )))
        })
    }

    /// Asks a worker to leave after its current step.
    pub async fn drain(&self, worker: WorkerId) -> Result<(), CallError> {
        self.ask(Request::Drain { worker }).await.map(|_| ())
    }

    /// Gives a worker a preemption notice; under policy `replace`, the placement made for
    /// its substitute.
    pub async fn preempt(
        &self,
        worker: WorkerId,
        notice: std::time::Duration,
    ) -> Result<Option<Placement>, CallError> {
        let notice_ms = notice.as_millis().min(u128::from(u64::MAX)) as u64;
        match self.ask(Request::Preempt { worker, notice_ms }).await? {
            Response::Placed(p) => Ok(Some(p)),
            Response::Ack => Ok(None),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// Moves a worker: the placement made for the new one.
    pub async fn migrate(
        &self,
        worker: WorkerId,
        slot: Option<String>,
    ) -> Result<Placement, CallError> {
        match self.ask(Request::Migrate { worker, slot }).await? {
            Response::Placed(p) => Ok(p),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// Resizes the job to `workers`: the placements made, workers drained and placements
    /// cancelled.
    pub async fn scale(&self, workers: u32) -> Result<Resize, CallError> {
        match self.ask(Request::Scale { workers }).await? {
            Response::Scaled(r) => Ok(r),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// The placement requests: pending ones and the latest finished ones.
    pub async fn placements(&self) -> Result<Vec<Placement>, CallError> {
        match self.ask(Request::Placements).await? {
            Response::Placements(p) => Ok(p),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// Tells the coordinator that a placement could not be fulfilled.
    pub async fn placement_failed(&self, id: u64, reason: &str) -> Result<(), CallError> {
        self.ask(Request::PlacementFailed {
            id,
            reason: reason.to_string(),
        })
        .await
        .map(|_| ())
    }

    /// The straggler and stall settings after `change` (read, changed, and written back only
    /// if it changed anything: a change that leaves them as they are only reads).
    pub async fn stragglers(
        &self,
        change: impl FnOnce(&mut StragglerSettings),
    ) -> Result<StragglerSettings, CallError> {
        let ask = |set| async move {
            match self.ask(Request::Stragglers { set }).await? {
                Response::Stragglers(s) => Ok(s),
                other => Err(CallError::unexpected(&other)),
            }
        };
        let now = ask(None).await?;
        let mut s = now;
        change(&mut s);
        if s == now {
            Ok(now)
        } else {
            ask(Some(s)).await
        }
    }

    /// Waits (polling) until placement `id` is no longer pending, up to `limit`; its final
    /// state, or `None` if it is still pending then.
    pub async fn wait_placement(
        &self,
        id: u64,
        limit: std::time::Duration,
    ) -> Result<Option<Placement>, CallError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(p) = self
                .placements()
                .await?
                .into_iter()
                .find(|p| p.id == id && !p.is_pending())
            {
                return Ok(Some(p));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Asks every shard to write a checkpoint now; per shard the outcome.
    pub async fn checkpoint_all(&self) -> Result<Vec<CheckpointRow>, CallError> {
        let map = self.map().await?;
        let mut out = Vec::new();
        for info in &map.shards {
            let got = match self.ask_shard(&info.addr, Request::Checkpoint).await {
                Ok(Response::Checkpointed {
                    path,
                    bytes,
                    millis,
                }) => Ok((path, bytes, millis)),
                Ok(other) => Err(CallError::unexpected(&other)),
                Err(e) => Err(e),
            };
            out.push(match got {
                Ok((path, bytes, millis)) => CheckpointRow {
                    shard: info.id.0,
                    path,
                    bytes,
                    millis,
                    error: None,
                },
                Err(e) => CheckpointRow {
                    shard: info.id.0,
                    path: String::new(),
                    bytes: 0,
                    millis: 0.0,
                    error: Some(e.to_string()),
                },
            });
        }
        Ok(out)
    }

    /// Every shard server the job has had: id, certificate name, address and role.
    pub async fn shard_list(&self) -> Result<Vec<ShardEntry>, CallError> {
        match self.ask(Request::ShardList).await? {
            Response::ShardList(l) => Ok(l),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// One shard's row: for a shard not retired, its holdings and load, asked of the shard
    /// itself (a shard that cannot be reached gives its error instead; a standby shard that
    /// has no assignment yet is [`ShardRow::unassigned`], not in error).
    pub async fn shard_row(&self, entry: &ShardEntry) -> (ShardRow, Option<String>) {
        let mut row = ShardRow {
            id: entry.id.0,
            name: entry.name.clone(),
            addr: entry.addr.clone(),
            role: role_name(entry.role).into(),
            ..ShardRow::default()
        };
        if entry.role == ShardRole::Retired {
            return (row, None);
        }
        match self.ask_shard(&entry.addr, Request::ShardStats).await {
            Ok(Response::ShardStats(s)) => {
                row.fill(&s);
                (row, None)
            }
            Ok(other) => (row, Some(CallError::unexpected(&other).to_string())),
            Err(e) if unassigned(entry, &e) => {
                row.unassigned = true;
                (row, None)
            }
            Err(e) => (row, Some(e.to_string())),
        }
    }

    /// Every shard the job has had, with its role; for those not retired, holdings and load
    /// (a shard that cannot be reached gives its error instead).
    pub async fn shard_stats(&self) -> Result<Vec<(ShardRow, Option<String>)>, CallError> {
        let mut out = Vec::new();
        for entry in &self.shard_list().await? {
            out.push(self.shard_row(entry).await);
        }
        Ok(out)
    }

    async fn reshape(&self, req: Request) -> Result<ReshardView, CallError> {
        match self.ask(req).await? {
            Response::Resharded { moves, map } => Ok(ReshardView::new(&moves, &map)),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// Adds the standby shard named `addr` (its `--name`), or at that address, and moves its
    /// share of keys to it.
    pub async fn shard_add(&self, addr: &str) -> Result<ReshardView, CallError> {
        self.reshape(Request::ShardAdd {
            addr: addr.to_string(),
        })
        .await
    }

    /// Moves every key off the shard named `shard` (its `--name`, or its address) and
    /// retires it.
    pub async fn shard_remove(&self, shard: &str) -> Result<ReshardView, CallError> {
        self.reshape(Request::ShardRemove {
            shard: shard.to_string(),
        })
        .await
    }

    /// Rebalances the key ranges over every shard not removed (standby shards included), by
    /// size or by recent load.
    pub async fn reshard(&self, by_load: bool) -> Result<ReshardView, CallError> {
        self.reshape(Request::Reshard { by_load }).await
    }

    /// Moves keys `[start, end)` to the shard named `to` (its `--name`, or its address).
    pub async fn move_range(
        &self,
        start: u64,
        end: u64,
        to: &str,
    ) -> Result<ReshardView, CallError> {
        self.reshape(Request::MoveRange {
            start,
            end,
            to: to.to_string(),
        })
        .await
    }
}

/// How long an operator's question about a shard's holdings waits for its answer.
const SHARD_ANSWER: std::time::Duration = std::time::Duration::from_secs(2);
/// How long an operator's checkpoint order waits for the shard's answer (a large shard
/// writes for a while).
const SHARD_CHECKPOINT: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether `err`, the answer of the shard of `entry`, says that it has no assignment yet: a
/// standby shard (holding no keys) answers so until the shard map forms.
pub fn unassigned(entry: &ShardEntry, err: &CallError) -> bool {
    entry.role == ShardRole::Standby && err.code() == Some(ErrorCode::NotReady)
}

fn role_name(role: ShardRole) -> &'static str {
    match role {
        ShardRole::Active => "active",
        ShardRole::Standby => "standby",
        ShardRole::Retired => "retired",
    }
}

/// One move of a resharding, for `edlctl`.
#[derive(Debug, Serialize)]
pub struct MoveRow {
    /// Keys moved, as `start..end`.
    pub range: String,
    /// Source shard.
    pub from: u32,
    /// Destination shard.
    pub to: u32,
    /// Bytes of state streamed.
    pub bytes: u64,
    /// Milliseconds the range could not be read or written.
    pub hold_ms: f64,
    /// Milliseconds the whole move took.
    pub millis: f64,
    /// The map epoch it published.
    pub epoch: u64,
}

/// What a resharding did, and the layout it left.
#[derive(Debug, Serialize)]
pub struct ReshardView {
    /// The moves, in order.
    pub moves: Vec<MoveRow>,
    /// The map epoch now current.
    pub epoch: u64,
    /// The layout: per shard, its ranges as `start..end`.
    pub layout: Vec<(u32, Vec<String>)>,
}

impl ReshardView {
    fn new(moves: &[MoveReport], map: &ShardMap) -> Self {
        let layout = map
            .shards
            .iter()
            .map(|s| {
                let ranges = map
                    .ranges_of(s.id)
                    .map(|r| format!("{}..{}", r.start, r.end))
                    .collect();
                (s.id.0, ranges)
            })
            .collect();
        ReshardView {
            moves: moves
                .iter()
                .map(|m| MoveRow {
                    range: format!("{}..{}", m.start, m.end),
                    from: m.from.0,
                    to: m.to.0,
                    bytes: m.bytes,
                    hold_ms: m.hold_ms,
                    millis: m.millis,
                    epoch: m.epoch.0,
                })
                .collect(),
            epoch: map.epoch.0,
            layout,
        }
    }
}

/// Parses a key range `START..END` (keys may be written `k12`).
pub fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let key = |p: &str| {
        p.trim()
            .trim_start_matches('k')
            .parse::<u64>()
            .map_err(|_| format!("{p:?} is not a key number"))
    };
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?} is not a range START..END"))?;
    let (a, b) = (key(a)?, key(b)?);
    if a >= b {
        return Err(format!("{s:?} is empty"));
    }
    Ok((a, b))
}

/// `edlctl status`, as JSON.
#[derive(Debug, Serialize)]
pub struct StatusView {
    /// Model description.
    pub model: String,
    /// Optimizer.
    pub optimizer: String,
    /// Consistency model.
    pub consistency: String,
    /// Epochs.
    pub epochs: u32,
    /// Batch size.
    pub batch_size: u32,
    /// The shard servers by role.
    pub shards: ShardCounts,
    /// Active workers.
    pub active_workers: usize,
    /// The slowest active worker's clock.
    pub min_clock: u64,
    /// The fastest active worker's clock.
    pub max_clock: u64,
    /// Samples done / total.
    pub samples: (u64, u64),
    /// Committed samples per second over the last ten seconds, all workers together.
    pub samples_per_s: f64,
    /// Mean training loss per sample over the last ten seconds.
    pub loss: Option<f64>,
    /// Mean training loss of the latest epoch with samples.
    pub epoch_loss: Option<(u32, f64)>,
    /// The latest evaluation: accuracy (0 to 1), loss, the job's minimum clock at its pull
    /// and how many seconds ago it was reported.
    pub evaluation: Option<EvalView>,
    /// Seconds until the run ends at the current rate.
    pub eta_s: Option<f64>,
    /// Every epoch's data is done.
    pub finished: bool,
}

/// The latest evaluation, for `edlctl status`.
#[derive(Debug, Serialize)]
pub struct EvalView {
    /// Fraction classified right.
    pub accuracy: f64,
    /// Mean loss.
    pub loss: f64,
    /// The job's minimum clock when the parameters were pulled (every step through it of
    /// every worker training then was in them), never below an earlier evaluation's.
    pub clock: u64,
    /// Seconds since it was reported.
    pub age_s: f64,
}

/// The job's shard servers by role, for `edlctl status`.
#[derive(Debug, Default, PartialEq, Eq, Serialize)]
pub struct ShardCounts {
    /// Shards that hold keys.
    pub active: u32,
    /// Shards that joined and hold nothing: until the shard map forms every shard that has
    /// joined, after that those waiting for `edlctl shard add`.
    pub standby: u32,
    /// Shards removed from the job.
    pub retired: u32,
    /// Shards the job waits for before it forms its shard map.
    pub expected: u32,
}

impl ShardCounts {
    /// Counts the coordinator's shard list; `expected` is the status's `shards_expected`.
    pub fn new(list: &[ShardEntry], expected: u32) -> Self {
        let count = |role| list.iter().filter(|e| e.role == role).count() as u32;
        ShardCounts {
            active: count(ShardRole::Active),
            standby: count(ShardRole::Standby),
            retired: count(ShardRole::Retired),
            expected,
        }
    }

    /// Whether the shard map has formed: once it has, some shard always holds keys.
    pub fn formed(&self) -> bool {
        self.active > 0
    }
}

impl std::fmt::Display for ShardCounts {
    /// `2 active, 1 standby, 1 retired` (roles without shards left out), or before the map
    /// forms `1 of 2 joined (the shard map forms once all have)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.formed() {
            return write!(
                f,
                "{} of {} joined (the shard map forms once all have)",
                self.standby, self.expected
            );
        }
        write!(f, "{} active", self.active)?;
        for (n, role) in [(self.standby, "standby"), (self.retired, "retired")] {
            if n > 0 {
                write!(f, ", {n} {role}")?;
            }
        }
        Ok(())
    }
}

impl StatusView {
    /// Builds the view; `shards` is the coordinator's shard list.
    pub fn new(
        job: &JobConfig,
        st: &JobStatus,
        members: &[WorkerInfo],
        shards: &[ShardEntry],
    ) -> Self {
        let active: Vec<&WorkerInfo> = members
            .iter()
            .filter(|w| w.state == WorkerState::Active)
            .collect();
        let model = edl_shared::models::describe(&job.model, &job.tensors);
        StatusView {
            model,
            optimizer: job.optimizer.to_string(),
            consistency: job.consistency.to_string(),
            epochs: job.epochs,
            batch_size: job.batch_size,
            shards: ShardCounts::new(shards, st.shards_expected),
            active_workers: active.len(),
            min_clock: st.min_clock.0,
            max_clock: active.iter().map(|w| w.clock.0).max().unwrap_or(0),
            samples: (st.samples_done, st.samples_total),
            samples_per_s: st.samples_per_s,
            loss: st.loss,
            epoch_loss: st
                .epochs
                .iter()
                .rev()
                .find(|e| e.samples > 0)
                .map(|e| (e.epoch, e.loss_sum / e.samples as f64)),
            evaluation: st.evaluation.as_ref().map(|e| EvalView {
                accuracy: e.accuracy,
                loss: e.loss,
                clock: e.clock.0,
                age_s: st.t_ms.saturating_sub(e.t_ms) as f64 / 1000.0,
            }),
            eta_s: crate::views::eta_s(st),
            finished: st.finished,
        }
    }
}

/// One row of `edlctl workers`.
#[derive(Debug, Serialize)]
pub struct WorkerRow {
    /// Worker id.
    pub id: u64,
    /// Certificate name.
    pub name: String,
    /// Address it registered from.
    pub addr: String,
    /// active, draining, left or dead.
    pub state: String,
    /// Steps completed.
    pub clock: u64,
    /// Steps per second over the last ten seconds.
    pub steps_per_s: f64,
    /// Samples committed.
    pub samples: u64,
    /// Milliseconds since its last heartbeat.
    pub last_heartbeat_ms: u64,
    /// Median busy time of its recent steps (its own work, not consistency waits).
    pub step_ms: f64,
    /// The median of the other workers' median step times over the same window: what its
    /// own is compared against (0 while unknown).
    pub others_ms: f64,
    /// Its median step time over the other workers' median (0 while unknown).
    pub straggler_score: f64,
    /// Flagged as a straggler.
    pub straggler: bool,
    /// Where the straggler detector stands on it: warming, ok, suspect, straggler or `-`.
    pub judged: String,
    /// Milliseconds it has held the minimum clock others wait on without a step, once past
    /// the job's stall report time.
    pub stalled_ms: Option<u64>,
    /// Steps behind the most advanced worker (how stale its gradients are under ASP).
    pub staleness: u64,
    /// Milliseconds left of its preemption notice.
    pub notice_ms: Option<u64>,
    /// The placement it was started for.
    pub placement: Option<u64>,
}

impl From<&WorkerInfo> for WorkerRow {
    fn from(w: &WorkerInfo) -> Self {
        let state = crate::views::worker_state(w.state, w.draining);
        WorkerRow {
            id: w.id.0,
            name: w.name.clone(),
            addr: w.addr.clone(),
            state: state.into(),
            clock: w.clock.0,
            steps_per_s: w.steps_per_s,
            samples: w.samples,
            last_heartbeat_ms: w.idle_ms,
            step_ms: w.step_ms,
            others_ms: w.others_ms,
            straggler_score: w.straggler_score,
            straggler: w.straggler,
            judged: w.judged.to_string(),
            stalled_ms: w.stalled_ms,
            staleness: w.staleness,
            notice_ms: w.notice_ms,
            placement: w.placement,
        }
    }
}

/// One row of `edlctl placements`.
#[derive(Debug, Serialize)]
pub struct PlacementRow {
    /// Placement id.
    pub id: u64,
    /// When it was made (milliseconds since the coordinator started).
    pub t_ms: u64,
    /// What it asks for: `add`, or `replace wN (reason)`.
    pub what: String,
    /// Where, if somewhere specific.
    pub slot: Option<String>,
    /// pending, `done: wN`, `failed: ...` or cancelled.
    pub state: String,
}

impl PlacementRow {
    /// The row of `p`, naming workers as `members` knows them.
    pub fn new(p: &Placement, members: &[WorkerInfo]) -> Self {
        use edl_shared::proto::PlacementState;
        let name = |w: WorkerId| {
            members
                .iter()
                .find(|m| m.id == w)
                .map_or_else(|| w.to_string(), |m| format!("{} ({})", m.name, w.0))
        };
        PlacementRow {
            id: p.id,
            t_ms: p.t_ms,
            what: p.kind.describe(name),
            slot: p.slot.clone(),
            state: match &p.state {
                PlacementState::Pending => "pending".into(),
                PlacementState::Done { worker } => format!("done: {}", name(*worker)),
                PlacementState::Failed { reason } => format!("failed: {reason}"),
                PlacementState::Cancelled => "cancelled".into(),
            },
        }
    }
}

/// One row of `edlctl checkpoint`.
#[derive(Debug, Serialize)]
pub struct CheckpointRow {
    /// Shard id.
    pub shard: u32,
    /// Where the shard wrote it.
    pub path: String,
    /// Bytes written.
    pub bytes: u64,
    /// Milliseconds the shard spent.
    pub millis: f64,
    /// Why it failed.
    pub error: Option<String>,
}

/// One row of `edlctl shards`.
#[derive(Debug, Default, Serialize)]
pub struct ShardRow {
    /// Shard id.
    pub id: u32,
    /// The name in its certificate (the process's `--name`).
    pub name: String,
    /// Address.
    pub addr: String,
    /// active, standby or retired.
    pub role: String,
    /// A standby shard without its assignment yet (it joined before the shard map formed): it
    /// holds and serves nothing until the map forms. Waiting, not unreachable.
    pub unassigned: bool,
    /// Key ranges held, as `start..end`.
    pub ranges: Vec<String>,
    /// Keys held.
    pub keys: u64,
    /// Bytes of parameters and optimizer state.
    pub bytes: u64,
    /// Pushes served.
    pub pushes: u64,
    /// Pulls served.
    pub pulls: u64,
    /// Payload bytes received and sent.
    pub traffic_bytes: u64,
    /// Replicated jobs: key ranges it holds backup copies of, as `start..end`.
    pub backups: Vec<String>,
    /// Replicated jobs: forwards of pushes to its backups (one per push and backup) not
    /// acknowledged yet.
    pub lag: u64,
}

impl ShardRow {
    fn fill(&mut self, s: &ShardStats) {
        let text = |ranges: &[edl_shared::proto::msg::KeyRange]| -> Vec<String> {
            ranges
                .iter()
                .map(|r| format!("{}..{}", r.start, r.end))
                .collect()
        };
        self.ranges = text(&s.ranges);
        self.keys = s.keys;
        self.bytes = s.state_bytes;
        self.pushes = s.pushes;
        self.pulls = s.pulls;
        self.traffic_bytes = s.bytes_in + s.bytes_out;
        self.backups = text(&s.backups);
        self.lag = s.lag;
    }
}

/// Picks the worker a `drain` means: a numeric id, or the name of exactly one active worker.
pub fn resolve_worker(members: &[WorkerInfo], which: &str) -> Result<WorkerId, String> {
    if let Ok(id) = which.parse::<u64>() {
        return members
            .iter()
            .find(|w| w.id.0 == id)
            .map(|w| w.id)
            .ok_or_else(|| format!("no worker with id {id}"));
    }
    let active: Vec<&WorkerInfo> = members
        .iter()
        .filter(|w| w.name == which && w.state == WorkerState::Active)
        .collect();
    match active.as_slice() {
        [one] => Ok(one.id),
        [] => Err(format!("no active worker named {which:?}")),
        many => Err(format!(
            "{} active workers are named {which:?} (ids {}); give the id",
            many.len(),
            many.iter()
                .map(|w| w.id.0.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

pub use edl_shared::units::human_bytes;

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::Clock;

    fn w(id: u64, name: &str, state: WorkerState) -> WorkerInfo {
        WorkerInfo {
            id: WorkerId(id),
            name: name.into(),
            addr: "127.0.0.1:1".into(),
            state,
            clock: Clock(0),
            idle_ms: 0,
            draining: false,
            steps_per_s: 0.0,
            samples: 0,
            step_ms: 0.0,
            others_ms: 0.0,
            straggler_score: 0.0,
            straggler: false,
            judged: edl_shared::proto::msg::Judgement::Unjudged,
            stalled_ms: None,
            staleness: 0,
            notice_ms: None,
            placement: None,
        }
    }

    #[test]
    fn drain_targets_resolve_by_id_or_unique_active_name() {
        let ms = vec![
            w(1, "w0", WorkerState::Left),
            w(2, "w0", WorkerState::Active),
            w(3, "w1", WorkerState::Active),
            w(4, "w1", WorkerState::Active),
        ];
        assert_eq!(resolve_worker(&ms, "w0"), Ok(WorkerId(2)));
        assert_eq!(resolve_worker(&ms, "4"), Ok(WorkerId(4)));
        assert!(
            resolve_worker(&ms, "w1")
                .expect_err("ambiguous")
                .contains("3, 4")
        );
        assert!(resolve_worker(&ms, "w9").is_err());
        assert!(resolve_worker(&ms, "99").is_err());
    }

    #[test]
    fn ranges_and_shards_parse() {
        assert_eq!(parse_range("3..9"), Ok((3, 9)));
        assert_eq!(parse_range("k3..k9"), Ok((3, 9)));
        assert!(parse_range("9..3").is_err());
        assert!(parse_range("3-9").is_err());
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }
}
