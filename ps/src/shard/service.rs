//! The shard as a network service: its requests (`Service::handle`), the moves and copies it
//! drives as the coordinator asks, and `edl-ps shard`'s process (`run`, `join`).

use super::*;

/// The shard service: waits for its assignment, then serves pulls and pushes, and moves key
/// ranges when the coordinator asks.
pub struct ShardService {
    /// The shard's state, once the coordinator assigned its ranges.
    pub(super) state: watch::Sender<Option<Arc<ShardState>>>,
    pub(super) checkpoint: Option<CheckpointStore>,
    /// For handing ranges to other shards (as this shard).
    pub(super) link: Arc<dyn ShardLink>,
    /// Checks worker tokens: the coordinator's key (learned when this shard joins) and the job
    /// in this shard's certificate.
    pub(super) tokens: std::sync::OnceLock<Signer>,
    /// Cancelled when the coordinator retires this shard.
    pub(super) retire: CancellationToken,
    /// The coordinators' addresses (comma-separated), for a primary's report of a backup it
    /// cannot reach; none in the simulation.
    pub(super) coordinator: std::sync::OnceLock<String>,
}

impl Service for ShardService {
    fn allowed(&self, role: Role, req: &Request) -> bool {
        match req {
            Request::Push { .. } => role == Role::Worker,
            Request::Checkpoint => role == Role::Admin,
            Request::SetMap { .. } | Request::MoveOut { .. } | Request::CopyOut { .. } => {
                role == Role::Coordinator
            }
            Request::MoveIn { .. } | Request::Replicate { .. } | Request::CopyIn { .. } => {
                role == Role::Shard
            }
            Request::KeyLoads => matches!(role, Role::Coordinator | Role::Admin),
            _ => true,
        }
    }

    async fn handle(&self, peer: &Peer, req: Request, payload: Parts) -> Frame<Response, Parts> {
        if let Request::Push { worker, token, .. } = &req
            && let Some(refused) = self.bad_token(peer, *worker, token)
        {
            return Frame::new(refused);
        }
        // A request for the shard's keys may have raced its start, so it waits a while for
        // the assignment; an operator asking how the shard stands is told at once that it has
        // none yet (a shard that joined before the map formed waits for the others to join).
        let st = match req {
            Request::ShardStats => self.state.borrow().clone(),
            _ => self.ready().await,
        };
        let Some(st) = st else {
            return Frame::new(Response::error(ErrorCode::NotReady, UNASSIGNED));
        };
        // A coordinator's orders carry its term: a deposed leader's are refused.
        if let Request::SetMap { term, .. }
        | Request::MoveOut { term, .. }
        | Request::CopyOut { term, .. } = &req
            && let Err(refused) = st.admit_term(*term)
        {
            tracing::warn!("{}", refused.message);
            return Frame::new(Response::from(refused));
        }
        let out = match req {
            Request::Pull {
                epoch,
                ranges,
                apply_through,
                wire,
            } => {
                let keys = || ranges.iter().flat_map(|r| (r.start..r.end).map(Key));
                if epoch > st.map_epoch() && !st.holds(keys()) {
                    st.wait_for_epoch(epoch, EPOCH_WAIT).await;
                }
                st.pull_in(epoch, &ranges, apply_through, wire)
                    .map_err(Response::from)
            }
            Request::Push {
                epoch,
                worker,
                clock,
                chunks,
                span,
                covers,
                token: _,
            } => {
                let keys = || {
                    let covered = covers.iter().flat_map(|r| (r.start..r.end).map(Key));
                    chunks.iter().map(|c| c.key).chain(covered)
                };
                if epoch > st.map_epoch() && !st.holds(keys()) {
                    st.wait_for_epoch(epoch, EPOCH_WAIT).await;
                }
                let push = (
                    epoch,
                    worker,
                    clock,
                    &chunks[..],
                    &payload.0[..],
                    span.as_ref(),
                    &covers[..],
                );
                self.push_replicated(&st, push, peer.server.in_flight())
                    .await
            }
            Request::Replicate {
                epoch,
                worker,
                clock,
                chunks,
                span,
                covers,
                seeding,
            } => {
                let kept = seeding
                    .then(|| {
                        let push = Kept::new(
                            epoch,
                            worker,
                            clock,
                            chunks.clone(),
                            payload.0.clone(),
                            span,
                            covers.clone(),
                        );
                        st.keep_or_replicate(push)
                    })
                    .flatten();
                if let Some(done) = kept {
                    return Frame::new(match done {
                        Ok(_) => Response::Ack,
                        Err(r) => Response::from(r),
                    });
                }
                if epoch > st.map_epoch() {
                    st.wait_for_epoch(epoch, EPOCH_WAIT).await;
                }
                let push = (
                    epoch,
                    worker,
                    clock,
                    &chunks[..],
                    &payload.0[..],
                    span.as_ref(),
                    &covers[..],
                );
                st.replicate(push)
                    .map(|_| Frame::new(Response::Ack))
                    .map_err(Response::from)
            }
            Request::Ledger => Ok(Frame::new(Response::Ledger(st.ledger_report()))),
            Request::ShardStats => Ok(Frame::new(Response::ShardStats(st.stats()))),
            Request::KeyLoads => Ok(Frame::new(Response::KeyLoads(st.take_key_loads()))),
            Request::Checkpoint => match self.checkpoint_now(&st).await {
                None => Err(Response::error(
                    ErrorCode::InvalidRequest,
                    "this shard runs without a checkpoint path",
                )),
                Some(Ok((path, bytes, millis))) => Ok(Frame::new(Response::Checkpointed {
                    path,
                    bytes,
                    millis,
                })),
                Some(Err(e)) => Err(Response::error(ErrorCode::Internal, e)),
            },
            Request::GetMap => Ok(Frame::new(Response::Map((*st.read_map()).clone()))),
            Request::SetMap { map, retire, .. } => {
                st.adopt_map(&map);
                if retire && st.num_keys() == 0 {
                    info!(shard = %st.id(), "removed from the job; retiring");
                    // Linger a moment, answering requests routed with an old map with the
                    // new one, so that clients re-route instead of finding it gone.
                    let retire = self.retire.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(RETIRE_GRACE).await;
                        retire.cancel();
                    });
                }
                Ok(Frame::new(Response::Ack))
            }
            Request::MoveOut {
                start,
                end,
                to,
                map,
                ..
            } => self.move_out(&st, (start, end, to), map).await,
            Request::MoveIn { start, end, map } => {
                self.move_in(&st, (start, end), map, &payload.to_bytes())
                    .await
            }
            Request::CopyOut {
                start,
                end,
                to,
                map,
                ..
            } => self.copy_out(&st, (start, end, to), map).await,
            Request::CopyIn { start, end, map } => match RangeExport::decode(&payload.to_bytes()) {
                Err(e) => Err(Response::error(
                    ErrorCode::Malformed,
                    format!("range copy: {e}"),
                )),
                Ok(export) => match st.seed(start, end, &map, export) {
                    Err(r) => Err(Response::from(r)),
                    Ok(()) => {
                        info!(shard = %st.id(), start, end, epoch = %map.epoch,
                            "seeded: now a backup of these keys");
                        Ok(Frame::new(Response::Ack))
                    }
                },
            },
            other => Err(Response::error(
                ErrorCode::InvalidRequest,
                format!("a shard does not serve {}", other.name()),
            )),
        };
        out.unwrap_or_else(Frame::new)
    }
}

/// Where a shard listens and how it finds the coordinator.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    /// The coordinators' addresses (one, or several separated by commas: the job's leader
    /// and standbys).
    pub coordinator: String,
    /// The address to bind.
    pub listen: SocketAddr,
    /// The address to announce to workers (defaults to the bound address).
    pub advertise: Option<String>,
    /// Where this shard keeps its checkpoint; `None` disables checkpoints.
    pub checkpoint: Option<PathBuf>,
    /// Write a checkpoint this often (and on demand, and at shutdown).
    pub checkpoint_every: Option<Duration>,
}

/// Runs a shard until `shutdown`: binds, joins the coordinator, initializes its ranges, serves.
pub async fn run(
    config: ShardConfig,
    identity: Identity,
    settings: TransportSettings,
    shutdown: CancellationToken,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    let endpoint = server_endpoint(config.listen, &identity, &settings)?;
    let addr = endpoint.local_addr()?;
    if let Some(tx) = bound {
        let _ = tx.send(addr);
    }
    // Stopping the shard: a signal (the parent token) or retirement by the coordinator.
    let shutdown = shutdown.child_token();
    let service = Arc::new(ShardService::new(
        Arc::new(ShardCaller::new(&identity, &settings)?),
        config.checkpoint.clone().map(CheckpointStore::File),
        shutdown.clone(),
    ));
    let server = {
        let (service, settings, stop, job) = (
            service.clone(),
            settings.clone(),
            shutdown.clone(),
            identity.job.clone(),
        );
        tokio::spawn(async move {
            edl_shared::serve(endpoint, service, &job, &settings, stop).await;
        })
    };
    let advertise = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    let joined = tokio::select! {
        _ = shutdown.cancelled() => None,
        r = join(&config.coordinator, &advertise, &identity, &settings) => Some(r?),
    };
    let Some((id, job, map, token_key)) = joined else {
        server.await?;
        return Ok(());
    };
    service.trust(&token_key, &identity.job);
    service.report_to(&config.coordinator);
    // A shard of a replicated job that the map gives nothing rejoins as a standby: the live
    // copies on the other shards hold everything acknowledged since its checkpoint.
    let standby = ShardState::rejoins_as_standby(&job, &map, id);
    if standby && config.checkpoint.as_deref().is_some_and(Path::exists) {
        info!(shard = %id, "rejoining a replicated job as a standby: its checkpoint is not \
            used (the live copies are newer)");
    }
    let state = match config
        .checkpoint
        .as_deref()
        .filter(|p| p.exists() && !standby)
    {
        Some(path) => {
            let t = std::time::Instant::now();
            let restored = checkpoint::read(path)
                .and_then(|ckpt| ShardState::restore(id, job, map, ckpt))
                .map_err(|e| anyhow::anyhow!("restoring {}: {e}", path.display()))?;
            info!(shard = %id, path = %path.display(), keys = restored.num_keys(),
                millis = t.elapsed().as_secs_f64() * 1000.0, "restored from checkpoint");
            restored
        }
        None => ShardState::new(id, job, map),
    };
    let state = Arc::new(state);
    metrics::watch(&state);
    info!(shard = %id, %addr, keys = state.num_keys(), aes_gcm = settings.aead.name(),
        "shard serving");
    service.assign(state.clone());
    let periodic = match (&config.checkpoint, config.checkpoint_every) {
        (Some(path), Some(every)) => {
            let store = CheckpointStore::File(path.clone());
            let (state, stop) = (state.clone(), shutdown.clone());
            Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    match store.write(&state).await {
                        Ok((_, bytes, ms)) => tracing::debug!(bytes, ms, "checkpoint written"),
                        Err(e) => tracing::error!(error = %e, "checkpoint failed"),
                    }
                }
            }))
        }
        _ => None,
    };
    server.await?;
    if let Some(p) = periodic {
        let _ = p.await;
    }
    // A clean shutdown leaves a checkpoint of the final state.
    if let Some(path) = &config.checkpoint {
        match write_checkpoint(&state, path) {
            Ok((bytes, ms)) => info!(bytes, ms, path = %path.display(), "final checkpoint written"),
            Err(e) => tracing::error!(error = %e, "final checkpoint failed"),
        }
    }
    Ok(())
}

/// Joins the coordinator, retrying while it is not reachable or not ready.
pub(super) async fn join(
    coordinator: &str,
    advertise: &str,
    identity: &Identity,
    settings: &TransportSettings,
) -> anyhow::Result<(ShardId, JobConfig, ShardMap, Token)> {
    let ep = client_endpoint(identity, settings, false)?;
    let mut coordinators =
        edl_shared::leader::Coordinators::parse(coordinator).map_err(anyhow::Error::msg)?;
    let mut delay = Duration::from_millis(50);
    loop {
        let at = coordinators.current().to_string();
        let attempt = async {
            let conn = Conn::connect(&ep, &at, &identity.name, settings).await?;
            let resp = conn
                .call(
                    Request::ShardJoin {
                        addr: advertise.to_string(),
                    },
                    Bytes::new(),
                )
                .await?;
            match resp.msg {
                Response::ShardAssigned {
                    shard,
                    job,
                    map,
                    token_key,
                } => Ok((shard, job, map, token_key)),
                other => Err(CallError::unexpected(&other)),
            }
        };
        match attempt.await {
            Ok(v) => return Ok(v),
            Err(e @ CallError::Remote { .. }) if e.code() != Some(ErrorCode::NotReady) => {
                return Err(e.into());
            }
            // A standby: join the leader it names.
            Err(CallError::NotLeader { leader: Some(l) }) => {
                tracing::info!(leader = %l, "the coordinator at {at} stands by: joining the leader");
                coordinators.follow(Some(&l));
            }
            Err(e) => {
                tracing::debug!(error = %e, "coordinator at {at} not ready; retrying");
                coordinators.advance();
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

impl ShardService {
    /// A service with no assignment yet: it answers `NotReady` until [`ShardService::trust`]
    /// and [`ShardService::assign`]. It reaches other shards through `link`, keeps its
    /// checkpoints in `checkpoint` (none if `None`), and cancels `retire` when the coordinator
    /// retires it.
    pub fn new(
        link: Arc<dyn ShardLink>,
        checkpoint: Option<CheckpointStore>,
        retire: CancellationToken,
    ) -> ShardService {
        ShardService {
            state: watch::Sender::new(None),
            checkpoint,
            link,
            tokens: std::sync::OnceLock::new(),
            retire,
            coordinator: std::sync::OnceLock::new(),
        }
    }

    /// Reports backups it cannot reach to the coordinators at `addrs` (comma-separated).
    pub fn report_to(&self, addrs: &str) {
        let _ = self.coordinator.set(addrs.to_string());
    }

    /// Accepts the tokens the coordinator signs with `key` for job `job` (given when this
    /// shard joins; the first key given stays).
    pub fn trust(&self, key: &Token, job: &str) {
        let _ = self.tokens.set(Signer::new(key, job));
    }

    /// Serves `state`, the shard's ranges, from now on.
    pub fn assign(&self, state: Arc<ShardState>) {
        self.state.send_replace(Some(state));
    }

    pub(super) async fn ready(&self) -> Option<Arc<ShardState>> {
        let mut rx = self.state.subscribe();
        let wait = rx.wait_for(|s| s.is_some());
        match tokio::time::timeout(Duration::from_secs(30), wait).await {
            Ok(Ok(s)) => s.clone(),
            _ => None,
        }
    }

    /// Writes a checkpoint, if this shard keeps one.
    pub(super) async fn checkpoint_now(
        &self,
        st: &Arc<ShardState>,
    ) -> Option<Result<(String, u64, f64), String>> {
        checkpoint_to(self.checkpoint.as_ref(), st).await
    }

    /// The refusal of a push whose token was not issued to `worker` for the pushing
    /// certificate, if it is one.
    pub(super) fn bad_token(
        &self,
        peer: &Peer,
        worker: WorkerId,
        token: &Token,
    ) -> Option<Response> {
        let Some(tokens) = self.tokens.get() else {
            return Some(Response::error(ErrorCode::NotReady, UNASSIGNED));
        };
        if tokens.verify(worker, &peer.name, token) {
            return None;
        }
        tracing::warn!(%worker, peer = %peer.name, addr = %peer.addr,
            "push refused: no valid token for this worker and certificate");
        Some(Response::error(
            ErrorCode::IdentityMismatch,
            format!(
                "push for {worker} refused: its token was not issued to {:?} (register first, \
                 and push only for the worker id the coordinator gave you)",
                peer.name
            ),
        ))
    }
}
