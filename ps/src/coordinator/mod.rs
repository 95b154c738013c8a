pub mod data;
pub mod etcd;
mod http;
pub mod meta;
mod metrics;
mod probe;
mod replicas;
mod reshard;
pub mod state;

pub use crate::link::{LinkFuture, ShardCaller, ShardLink};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use edl_shared::proto::{
    ErrorCode, Frame, JobConfig, Parts, Request, Response, StragglerSettings, WorkerId,
};
use edl_shared::shutdown::CancellationToken;
use edl_shared::token::Signer;
use edl_shared::transport::{TransportSettings, server_endpoint};
use edl_shared::{Identity, Peer, Role, Service};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::Notify;
use tracing::{info, warn};

pub use meta::{FileLog, MemoryStore, MetaStore, StoreError, read_state};
use state::{CoordinatorSnap, CoordinatorState, Poll};

mod durable;
mod process;

use durable::*;
pub use process::*;

/// How long a long-polling request waits before it is answered with `NotReady`.
const LONG_POLL: Duration = Duration::from_secs(60);

/// What a coordinator needs to start.
#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    /// The job.
    pub job: JobConfig,
    /// Shard servers to wait for before the shard map is formed.
    pub shards: u32,
    /// Where the coordinator keeps its durable state; restored from on start if present.
    pub state_file: Option<PathBuf>,
    /// How stragglers and stalls are found and handled (changeable at run time; a restart
    /// goes back to these).
    pub stragglers: StragglerSettings,
    /// Declare a silent worker dead as soon as its socket is found gone (a datagram to its
    /// address answered "port unreachable"), not only when its lease expires. Off where
    /// workers sit behind a NAT that could answer so for a live one.
    pub probe_sockets: bool,
}

/// The coordinator service: the state behind a lock, and a version counter that wakes waiters
/// whenever the state changes.
pub struct Coordinator {
    state: Mutex<CoordinatorState>,
    /// Bumped on every change the waiters care about; `changed` wakes them, in the order they
    /// began to wait (a `watch` channel would wake them in a random order, and the
    /// simulation's runs would not be functions of their seeds).
    version: AtomicU64,
    changed: Notify,
    /// Where the durable state is kept, if anywhere.
    store: Option<Arc<dyn MetaStore>>,
    /// The state version the last periodic save began from.
    saved_version: AtomicU64,
    /// Group commit: tickets taken by callers of `durable` (each after its changes)...
    wanted: AtomicU64,
    /// ...and the highest ticket whose changes a finished write holds.
    done: AtomicU64,
    /// Connections to shards for resharding (set once the coordinator has an identity).
    caller: std::sync::OnceLock<Arc<dyn ShardLink>>,
    /// The job named in the coordinator's certificate (set with its identity), which worker
    /// tokens are bound to.
    job_name: std::sync::OnceLock<String>,
    /// Held while a resharding runs: one at a time.
    resharding: tokio::sync::Mutex<()>,
    /// Held from a write's snapshot until it is durable: writes reach the store one at a
    /// time and in snapshot order. Holds the record written last.
    writing: tokio::sync::Mutex<Option<Arc<[u8]>>>,
    /// Cancelled when the store refused a write because another coordinator leads now: this
    /// one answers nothing more that depends on its state, and its process ends.
    deposed: CancellationToken,
    /// Since when the store's writes fail as unavailable (etcd unreachable), if they do, and
    /// whether training reports are being acknowledged from memory meanwhile (logged once per
    /// outage).
    store_failing: std::sync::Mutex<Option<tokio::time::Instant>>,
    from_memory: std::sync::atomic::AtomicBool,
    /// When a standby last asked this coordinator whether it leads (`etcd::Prober`), and for
    /// how long after that this one may acknowledge from memory: a standby revokes the lease of
    /// a leader that has not answered it for its `dead_after`, so a leader no standby reaches
    /// must not count on its lease.
    probed: std::sync::Mutex<Option<tokio::time::Instant>>,
    probe_window: std::sync::Mutex<Duration>,
    /// When the last check that this coordinator still leads was sent, and whether the store
    /// confirmed it (`false`: it could not be reached), shared by the requests that arrived
    /// before it was sent (see [`Coordinator::still_leads`]); held while one is under way.
    confirmed: tokio::sync::Mutex<Option<(tokio::time::Instant, bool)>>,
    /// A replicated job's shards not to seed new backups on until the time given: one its
    /// primary could not reach, or whose seeding failed.
    avoid: std::sync::Mutex<
        std::collections::HashMap<edl_shared::proto::ShardId, tokio::time::Instant>,
    >,
    /// A replicated job's shards silent now (see `watch_shards`): none of them takes the place
    /// of a dead primary.
    silent: std::sync::Mutex<Vec<edl_shared::proto::ShardId>>,
}

impl Coordinator {
    /// A coordinator for `config`.
    pub fn new(config: CoordinatorConfig) -> anyhow::Result<Self> {
        let mut state = CoordinatorState::new(config.job, config.shards, edl_shared::clock::now());
        state
            .set_stragglers(config.stragglers)
            .map_err(|(_, e)| anyhow::anyhow!(e))?;
        Ok(Self::with_state(state))
    }

    fn with_state(state: CoordinatorState) -> Self {
        Coordinator {
            state: Mutex::new(state),
            version: AtomicU64::new(0),
            changed: Notify::new(),
            store: None,
            saved_version: AtomicU64::new(0),
            wanted: AtomicU64::new(0),
            done: AtomicU64::new(0),
            caller: std::sync::OnceLock::new(),
            job_name: std::sync::OnceLock::new(),
            resharding: tokio::sync::Mutex::new(()),
            writing: tokio::sync::Mutex::new(None),
            deposed: CancellationToken::new(),
            store_failing: Default::default(),
            from_memory: Default::default(),
            probed: std::sync::Mutex::new(None),
            probe_window: std::sync::Mutex::new(Duration::from_millis(750)),
            confirmed: tokio::sync::Mutex::new(None),
            avoid: Default::default(),
            silent: Default::default(),
        }
    }

    /// A coordinator for `config`, restored from its state file when it holds a state, and
    /// keeping its state there.
    pub fn open(config: CoordinatorConfig) -> anyhow::Result<Self> {
        let Some(path) = config.state_file.clone() else {
            return Self::new(config);
        };
        let (log, latest) = meta::FileLog::open(&path)?;
        let coordinator = match latest {
            None => Self::new(config)?,
            Some(record) => {
                let snap = meta::decode(&record)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                let restored = Self::restored(snap, config)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                info!(path = %path.display(), "coordinator state restored");
                restored
            }
        };
        Ok(coordinator.with_store(Arc::new(log)))
    }

    /// A coordinator for `config` restored from `snap` (what [`Coordinator::snapshot`] took;
    /// `open` reads it from the state file). It keeps no state until given a store.
    pub fn restored(snap: CoordinatorSnap, config: CoordinatorConfig) -> anyhow::Result<Self> {
        let mut state =
            CoordinatorState::restore(snap, &config.job, config.shards, edl_shared::clock::now())
                .map_err(|e| anyhow::anyhow!(e))?;
        state
            .set_stragglers(config.stragglers)
            .map_err(|(_, e)| anyhow::anyhow!(e))?;
        Ok(Self::with_state(state))
    }

    /// How this coordinator reaches shards (for resharding, and to check that a shard's name
    /// is not in use); set once, before it serves. Without one it cannot reshard.
    pub fn set_shard_link(&self, link: Arc<dyn ShardLink>) {
        let _ = self.caller.set(link);
    }

    /// The durable state as it is now: what a save writes.
    fn snapshot(&self) -> CoordinatorSnap {
        self.lock().snapshot()
    }

    /// Reads the state (for in-process drivers: the simulation, tests, the dashboard).
    pub fn inspect<R>(&self, f: impl FnOnce(&CoordinatorState) -> R) -> R {
        f(&self.lock())
    }

    /// Keeps the durable state in `store`.
    pub fn with_store(mut self, store: Arc<dyn MetaStore>) -> Self {
        self.store = Some(store);
        self
    }

    fn lock(&self) -> MutexGuard<'_, CoordinatorState> {
        // A panic while holding the lock would be a bug; keep serving with the state as left.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// Runs `step` until it gives an answer, waiting for state changes in between.
    async fn wait_for<T>(
        &self,
        mut step: impl FnMut(&mut CoordinatorState) -> Poll<T>,
    ) -> Result<T, Response> {
        let deadline = tokio::time::Instant::now() + LONG_POLL;
        loop {
            // Registered before the state is read, so no change after the read is missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let outcome = {
                let mut st = self.lock();
                step(&mut st)
            };
            match outcome {
                Poll::Ready(v) => return Ok(v),
                Poll::Failed(code, msg) => return Err(Response::error(code, msg)),
                Poll::Pending => {}
            }
            match tokio::time::timeout_at(deadline, changed).await {
                Ok(()) => {}
                Err(_) => {
                    return Err(Response::error(
                        ErrorCode::NotReady,
                        "timed out waiting; retry",
                    ));
                }
            }
        }
    }

    /// Declares workers dead whose lease expired, and reports (or drops, as the job says)
    /// workers that hold the others up; returns how many were declared dead or dropped.
    pub fn sweep(&self, now: Instant) -> usize {
        let (dead, dropped, news) = {
            let mut st = self.lock();
            let dead = st.expire_leases(now);
            let dropped = st.stalls(now);
            (dead, dropped, st.take_news())
        };
        for w in &dead {
            warn!(worker = %w, "lease expired: worker declared dead, its data returns to the pool");
        }
        for line in &news {
            warn!("{line}");
        }
        if !dead.is_empty() || !dropped.is_empty() || !news.is_empty() {
            self.bump();
        }
        dead.len() + dropped.len()
    }

    /// Gives every active worker a fresh lease from `now`: this coordinator did not run for
    /// `gap` (it was stopped or starved), so it could not hear them; a worker is dropped only
    /// for its own silence, measured while the coordinator runs.
    pub fn renew_leases(&self, now: Instant, gap: Duration) {
        let n = self.lock().renew_leases(now);
        if n > 0 {
            warn!(
                workers = n,
                "the coordinator did not run for {:.1} s: every worker's lease starts again",
                gap.as_secs_f64()
            );
        }
    }

    /// Declares dead the workers whose sockets `probe` found gone; returns how many.
    fn sweep_gone(&self, probe: &mut probe::Prober, now: Instant) -> usize {
        let silent = self.lock().silent(now, probe::SILENT);
        let gone = probe.check(&silent);
        let mut n = 0;
        for (worker, addr) in gone {
            let detail = format!(
                "its socket {addr} is gone (port unreachable) after {} ms of silence",
                probe::SILENT.as_millis()
            );
            if self.lock().declare_dead(worker, now, detail) {
                warn!(%worker, %addr, "socket gone: worker declared dead, its data returns to the pool");
                n += 1;
            }
        }
        if n > 0 {
            self.bump();
        }
        n
    }

    /// A status snapshot.
    pub fn status(&self) -> edl_shared::proto::msg::JobStatus {
        self.lock().status(edl_shared::clock::now())
    }

    fn job_name(&self) -> &str {
        self.job_name
            .get()
            .map_or(edl_shared::pki::DEFAULT_JOB, String::as_str)
    }

    /// The refusal of a request for `worker` from an identity other than the one it
    /// registered as, if it is one.
    fn not_owner(&self, worker: WorkerId, peer: &Peer) -> Option<Response> {
        let (code, msg) = self.lock().check_owner(worker, &peer.name).err()?;
        warn!(%worker, peer = %peer.name, addr = %peer.addr, "refused: {msg}");
        Some(Response::error(code, msg))
    }

    /// A shard joins under `peer`'s name at `addr`. A name already held by a shard at
    /// another address is refused while that shard still answers: two processes must not
    /// share one shard's identity, and a second join must not move a live shard's address.
    async fn shard_join(&self, peer: &Peer, addr: &str) -> Response {
        let old = self.lock().shard_addr_by_name(&peer.name);
        let rejoined = old.is_some();
        if let (Some(old), Some(caller)) = (old.filter(|o| o != addr), self.caller.get()) {
            if caller.answers(&old).await {
                return Response::error(
                    ErrorCode::Conflict,
                    format!(
                        "shard {} is already serving at {old}; stop it before starting another \
                         shard with this name (or use another name)",
                        peer.name
                    ),
                );
            }
            warn!(shard = %peer.name, %old, new = %addr, "shard moved: the old address is gone");
        }
        let joined = self.lock().shard_join(&peer.name, addr);
        if let (Ok(id), true) = (&joined, rejoined) {
            self.restarted(*id).await;
        }
        match joined {
            Err((code, msg)) => Response::error(code, msg),
            Ok(id) => {
                info!(shard = %id, name = %peer.name, %addr, "shard joined");
                self.bump();
                match self.wait_for(|st| st.assignment(id)).await {
                    Ok((job, map)) => Response::ShardAssigned {
                        shard: id,
                        job,
                        map,
                        token_key: self.lock().token_key(),
                    },
                    Err(e) => e,
                }
            }
        }
    }
}

impl Service for Coordinator {
    fn allowed(&self, role: Role, req: &Request) -> bool {
        match req {
            Request::ShardJoin { .. } | Request::BackupLost { .. } => role == Role::Shard,
            Request::Preempt { .. } | Request::Evaluation { .. } => {
                role == Role::Admin || role == Role::Worker
            }
            Request::Register { .. }
            | Request::Heartbeat { .. }
            | Request::Leave { .. }
            | Request::NextPartition { .. }
            | Request::Clock { .. } => role == Role::Worker,
            Request::Drain { .. }
            | Request::ShardAdd { .. }
            | Request::ShardRemove { .. }
            | Request::Reshard { .. }
            | Request::MoveRange { .. }
            | Request::Migrate { .. }
            | Request::Scale { .. }
            | Request::Placements
            | Request::PlacementFailed { .. }
            | Request::Stragglers { .. } => role == Role::Admin,
            _ => true,
        }
    }

    async fn handle(&self, peer: &Peer, req: Request, payload: Parts) -> Frame<Response, Parts> {
        // Reads that nothing is done with but showing them. The map and the placements are
        // acted on (requests routed, workers started), so they are answered only once what
        // they show is durable: a map or placement held only in memory (its write waiting on
        // an unavailable store) could be taken back by a crash or a failover, and a map of the
        // same epoch but other ranges published after it.
        let reads_only = matches!(
            req,
            Request::Status
                | Request::History { .. }
                | Request::Trace { .. }
                | Request::Members
                | Request::GetJob
                | Request::ShardList
                | Request::Heartbeat { .. }
                | Request::Stragglers { set: None }
        );
        let training = matches!(req, Request::Clock { .. } | Request::NextPartition { .. });
        let probe = matches!(req, Request::GetJob) && peer.role == Role::Coordinator;
        if probe {
            // A standby's probe (`etcd::Prober`): it sees this coordinator leading (the key
            // names it), so it will not revoke the lease for its `dead_after`. Answered as it
            // comes: held up by `still_leads` while the store is unreachable, no probe would
            // count again, and nothing could be acknowledged from memory.
            *self.probed.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(tokio::time::Instant::now());
        } else if !self.still_leads().await {
            return Frame::new(Response::NotLeader { leader: None });
        }
        let began = tokio::time::Instant::now();
        let answer = self.answer(peer, req, payload).await;
        // A long poll (or a pause) may have outlived the lead: checked again before the
        // answer goes, which may rest on nothing written (a refusal, a wait's end).
        if !probe && began.elapsed() >= RECHECK_AFTER && !self.still_leads().await {
            return Frame::new(Response::NotLeader { leader: None });
        }
        // Nothing is acknowledged before the changes it depends on are durable (training
        // reports aside while the store is unreachable within the lead's lease); a deposed
        // coordinator acknowledges nothing.
        let durable = match (reads_only, training) {
            (true, _) => true,
            (false, true) => self.durable_training().await,
            (false, false) => self.durable().await,
        };
        if !durable {
            return Frame::new(Response::NotLeader { leader: None });
        }
        let (news, stalls) = {
            let mut st = self.lock();
            (st.take_news(), st.take_stalls())
        };
        metrics::stalls(stalls);
        if !news.is_empty() {
            for line in news {
                info!("{line}");
            }
            self.bump();
        }
        answer
    }
}

impl Coordinator {
    async fn answer(&self, peer: &Peer, req: Request, _payload: Parts) -> Frame<Response, Parts> {
        let now = edl_shared::clock::now;
        // A worker may give itself a preemption notice, no other.
        if let Request::Preempt { worker, .. } = &req
            && peer.role == Role::Worker
            && let Some(refused) = self.not_owner(*worker, peer)
        {
            return Frame::new(refused);
        }
        if let Request::Heartbeat { worker }
        | Request::Leave { worker }
        | Request::NextPartition { worker }
        | Request::Clock { worker, .. } = &req
            && let Some(refused) = self.not_owner(*worker, peer)
        {
            return Frame::new(refused);
        }
        let resp = match req {
            Request::ShardJoin { addr } => self.shard_join(peer, &addr).await,
            Request::Register {
                name: label,
                placement,
            } => {
                // The worker is registered under the name in its certificate, never under
                // one it claims.
                let requested = now();
                let name = &peer.name;
                match self
                    .wait_for(|st| {
                        let at = now();
                        let r = st.register(name, &peer.addr.to_string(), requested, at);
                        if let (Poll::Ready((worker, ..)), Some(p)) = (&r, placement) {
                            st.placed(*worker, p, at);
                        }
                        r
                    })
                    .await
                {
                    Ok((worker, job, map, clock)) => {
                        info!(%worker, %name, %label, addr = %peer.addr, %clock, "worker admitted");
                        let token_key = self.lock().token_key();
                        let token = Signer::new(&token_key, self.job_name()).issue(worker, name);
                        Response::Registered {
                            worker,
                            job,
                            map,
                            clock,
                            token,
                        }
                    }
                    Err(e) => e,
                }
            }
            Request::Heartbeat { worker } => match self.lock().beat(worker, now()) {
                Ok((drain, notice_ms)) => Response::Beat { drain, notice_ms },
                Err((code, msg)) => Response::error(code, msg),
            },
            Request::Preempt { worker, notice_ms } => {
                let notice = Duration::from_millis(notice_ms);
                let r = self.lock().preempt(worker, notice, now());
                match r {
                    Ok(placement) => {
                        info!(%worker, notice_ms, by = %peer.name, "preemption notice");
                        self.bump();
                        match placement {
                            Some(p) => Response::Placed(p),
                            None => Response::Ack,
                        }
                    }
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::Migrate { worker, slot } => {
                let r = self.lock().migrate(worker, slot, now());
                match r {
                    Ok(p) => {
                        self.bump();
                        Response::Placed(p)
                    }
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::Scale { workers } => {
                let r = self.lock().scale(workers, now());
                match r {
                    Ok(r) => {
                        self.bump();
                        Response::Scaled(r)
                    }
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::Placements => Response::Placements(self.lock().placements()),
            Request::PlacementFailed { id, reason } => {
                let r = self.lock().placement_failed(id, &reason, now());
                match r {
                    Ok(()) => Response::Ack,
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::Stragglers { set } => {
                let mut st = self.lock();
                match set.filter(|s| *s != st.stragglers()) {
                    None => Response::Stragglers(st.stragglers()),
                    Some(s) => match st.set_stragglers(s) {
                        Ok(()) => {
                            info!(settings = ?s, by = %peer.name, "straggler settings changed");
                            Response::Stragglers(s)
                        }
                        Err((code, msg)) => Response::error(code, msg),
                    },
                }
            }
            Request::Leave { worker } => {
                let r = self.lock().leave(worker, now());
                match r {
                    Ok(()) => {
                        info!(%worker, "worker left");
                        self.bump();
                        Response::Ack
                    }
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::NextPartition { worker } => {
                // While it waits for data the worker does not hold back the others' clocks.
                if let Err((code, msg)) = self.lock().set_idle(worker) {
                    return Frame::new(Response::error(code, msg));
                }
                self.bump();
                match self.wait_for(|st| st.next_partition(worker, now())).await {
                    Ok((partition, clock)) => Response::Partition { partition, clock },
                    Err(e) => e,
                }
            }
            Request::Clock {
                worker,
                clock,
                epoch,
                samples,
                loss_sum,
                span,
                last,
                bytes_pushed,
                bytes_pulled,
            } => {
                let traffic = (bytes_pushed, bytes_pulled);
                let r = (self.lock()).advance(
                    worker,
                    clock,
                    epoch,
                    samples,
                    loss_sum,
                    span,
                    traffic,
                    now(),
                );
                match r {
                    Err((code, msg)) => Response::error(code, msg),
                    Ok(()) => {
                        self.bump();
                        if last {
                            return Frame::new(Response::ClockGranted {
                                min_clock: self.lock().min_clock(),
                                drain: true,
                            });
                        }
                        tracing::trace!(%worker, %clock, "clock: waiting");
                        match self.wait_for(|st| st.may_proceed(worker)).await {
                            Ok((min_clock, drain)) => {
                                self.lock().granted(worker, now());
                                tracing::trace!(%worker, %clock, %min_clock, "clock: granted");
                                Response::ClockGranted { min_clock, drain }
                            }
                            Err(e) => e,
                        }
                    }
                }
            }
            Request::Status => Response::Status(self.status()),
            Request::History { from_ms } => Response::History(self.lock().history(from_ms)),
            Request::Evaluation {
                clock,
                accuracy,
                loss,
                samples,
            } => {
                let r = self
                    .lock()
                    .evaluation(&peer.name, clock, accuracy, loss, samples, now());
                match r {
                    Ok(()) => {
                        info!(by = %peer.name, %clock, accuracy, loss, samples, "evaluation");
                        self.bump();
                        Response::Ack
                    }
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::Trace { from_step } => Response::Trace(self.lock().trace(from_step)),
            Request::Members => Response::Members(self.lock().members(edl_shared::clock::now())),
            Request::Drain { worker } => {
                let r = self.lock().drain(worker, now());
                match r {
                    Ok(()) => {
                        info!(%worker, "drain requested");
                        self.bump();
                        Response::Ack
                    }
                    Err((code, msg)) => Response::error(code, msg),
                }
            }
            Request::GetJob => Response::Job(self.lock().job().clone()),
            Request::ShardList => Response::ShardList(self.lock().shard_list()),
            Request::ShardAdd { addr } => self.reshape(reshard::Reshape::Add(addr)).await,
            Request::ShardRemove { shard } => self.reshape(reshard::Reshape::Remove(shard)).await,
            Request::Reshard { by_load } => {
                self.reshape(reshard::Reshape::Rebalance { by_load }).await
            }
            Request::MoveRange { start, end, to } => {
                self.reshape(reshard::Reshape::Move { start, end, to })
                    .await
            }
            Request::BackupLost { backup } => self.backup_lost(peer, backup).await,
            Request::WaitMap { after } => {
                let newer = self
                    .wait_for(|st| match st.map() {
                        Some(map) if map.epoch > after => Poll::Ready(map),
                        _ => Poll::Pending,
                    })
                    .await;
                match newer {
                    Ok(map) => Response::Map(map),
                    Err(timed_out) => timed_out,
                }
            }
            Request::GetMap => {
                let st = self.lock();
                match st.map() {
                    Some(map) => Response::Map(map),
                    None => {
                        let (joined, expected) = st.shards_joined();
                        Response::error(
                            ErrorCode::NotReady,
                            format!(
                                "shard map not formed yet: {joined} of {expected} shard servers \
                                 have joined"
                            ),
                        )
                    }
                }
            }
            other => Response::error(
                ErrorCode::InvalidRequest,
                format!("the coordinator does not serve {}", other.name()),
            ),
        };
        Frame::new(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::Consistency;

    fn config() -> CoordinatorConfig {
        CoordinatorConfig {
            // The state tests' small job.
            job: state::tests::job(Consistency::Asp),
            shards: 1,
            state_file: None,
            stragglers: Default::default(),
            probe_sockets: false,
        }
    }

    async fn ask(c: &Coordinator, role: Role, req: Request) -> Response {
        let peer = Peer::in_process(role, "t", "default", "127.0.0.1:9".parse().expect("addr"));
        c.handle(&peer, req, Parts::default()).await.msg
    }

    /// A leader whose term another coordinator's election ended while it was away (paused,
    /// cut off) answers nothing from its state, reads included: it finds out from the store
    /// before it answers, and is deposed.
    #[tokio::test]
    async fn a_leader_deposed_while_it_was_away_answers_nothing_from_its_old_state() {
        let disk = meta::MemoryStore::default();
        let lead = Coordinator::new(config())
            .expect("coordinator")
            .with_store(Arc::new(disk.elect()));
        assert!(matches!(
            ask(&lead, Role::Admin, Request::Status).await,
            Response::Status(_)
        ));
        // Another coordinator is elected; this one has not been probed lately.
        let _next = disk.elect();
        assert!(matches!(
            ask(&lead, Role::Admin, Request::Status).await,
            Response::NotLeader { leader: None }
        ));
        assert!(lead.deposed().is_cancelled());
    }

    /// With the store unreachable, a leader no standby ever probed answers (as it acknowledges
    /// training from memory); one a standby probed, but not lately, waits until a probe
    /// comes, and a probe is answered at once.
    #[tokio::test]
    async fn a_leader_cut_off_from_the_store_answers_while_no_standby_could_replace_it() {
        let disk = meta::MemoryStore::default();
        let handle = disk.elect();
        let lead = Arc::new(
            Coordinator::new(config())
                .expect("coordinator")
                .with_store(Arc::new(handle.clone())),
        );
        lead.set_probe_window(Duration::from_millis(100));
        handle.cut_off();
        assert!(matches!(
            ask(&lead, Role::Admin, Request::Status).await,
            Response::Status(_)
        ));
        // A standby probes it, then goes quiet for longer than the probe window.
        assert!(!matches!(
            ask(&lead, Role::Coordinator, Request::GetJob).await,
            Response::NotLeader { .. }
        ));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let waiting = tokio::spawn({
            let lead = lead.clone();
            async move { ask(&lead, Role::Admin, Request::Status).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !waiting.is_finished(),
            "answered with no probe and no store"
        );
        // The standby probes again, as it does every 250 ms: each probe is answered at once,
        // and the waiting request once it sees one within the window.
        let standby = tokio::spawn({
            let lead = lead.clone();
            async move {
                loop {
                    let r = ask(&lead, Role::Coordinator, Request::GetJob).await;
                    assert!(!matches!(r, Response::NotLeader { .. }), "{r:?}");
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
            }
        });
        let answer = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("answered once probed")
            .expect("task");
        assert!(matches!(answer, Response::Status(_)), "{answer:?}");
        assert!(!standby.is_finished(), "a probe was refused");
        standby.abort();
    }
}
