//! The coordinator as a process: bound to its address and serving, its background tasks
//! (leases, saves, the watch over the shards), and an elected coordinator's campaign.

use super::*;

/// A coordinator bound to an address, ready to serve.
pub struct BoundCoordinator {
    /// The service, for in-process inspection.
    pub coordinator: Arc<Coordinator>,
    /// The address it listens on.
    pub addr: SocketAddr,
    pub(super) endpoint: quinn::Endpoint,
    pub(super) settings: TransportSettings,
    pub(super) probe_sockets: bool,
}

/// Binds a coordinator on `listen`.
pub fn bind(
    config: CoordinatorConfig,
    listen: SocketAddr,
    identity: &Identity,
    settings: TransportSettings,
) -> anyhow::Result<BoundCoordinator> {
    let probe_sockets = config.probe_sockets;
    let coordinator = Coordinator::open(config)?;
    coordinator.set_shard_link(Arc::new(ShardCaller::new(identity, &settings)?));
    let _ = coordinator.job_name.set(identity.job.clone());
    let coordinator = Arc::new(coordinator);
    metrics::watch(&coordinator);
    let endpoint = server_endpoint(listen, identity, &settings)?;
    let addr = endpoint.local_addr()?;
    Ok(BoundCoordinator {
        coordinator,
        addr,
        endpoint,
        settings,
        probe_sockets,
    })
}

impl BoundCoordinator {
    /// Serves the dashboard, its JSON API and `/metrics` on `addr` until `shutdown`; returns
    /// the bound address.
    pub async fn serve_http(
        &self,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> std::io::Result<SocketAddr> {
        let pages = Arc::new(http::Dashboard(self.coordinator.clone()));
        edl_shared::http::serve(addr, pages, shutdown).await
    }

    /// Serves until `shutdown` is cancelled, sweeping expired leases in the background.
    pub async fn run(self, shutdown: CancellationToken) {
        let background = Background::start(&self.coordinator, self.probe_sockets, &shutdown);
        info!(addr = %self.addr, aes_gcm = self.settings.aead.name(), "coordinator serving");
        let job = self.coordinator.job_name().to_string();
        edl_shared::serve(
            self.endpoint,
            self.coordinator.clone(),
            &job,
            &self.settings,
            shutdown,
        )
        .await;
        background.stop(&self.coordinator).await;
    }
}

/// A coordinator's work besides answering: the sweeper (expired leases, stalls, the probe of
/// silent workers), the periodic save of changes no answer waited for, and the settling of
/// a move a crash left in its middle.
pub(super) struct Background {
    pub(super) sweeper: tokio::task::JoinHandle<()>,
    pub(super) persister: Option<tokio::task::JoinHandle<()>>,
    pub(super) resuming: tokio::task::JoinHandle<()>,
    /// A replicated job's watch over its shards (see [`Coordinator::watch_shards`]).
    pub(super) watching: Option<tokio::task::JoinHandle<()>>,
}

impl Background {
    pub(super) fn start(
        coordinator: &Arc<Coordinator>,
        probing: bool,
        stop: &CancellationToken,
    ) -> Self {
        let lease = Duration::from_millis(u64::from(coordinator.lock().job().lease_ms));
        let (c, sweep_stop) = (coordinator.clone(), stop.clone());
        let sweeper = tokio::spawn(async move {
            let mut tick =
                tokio::time::interval((lease / 8).clamp(Duration::from_millis(20), probe::TICK));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut prober = probe::Prober::default();
            let mut last = edl_shared::clock::now();
            loop {
                tokio::select! {
                    _ = sweep_stop.cancelled() => break,
                    _ = tick.tick() => {
                        let now = edl_shared::clock::now();
                        // A coordinator that did not run for half a lease (stopped, starved)
                        // heard no one meanwhile: silence is measured only while it runs.
                        let gap = now.saturating_duration_since(last);
                        last = now;
                        if gap > lease / 2 {
                            c.renew_leases(now, gap);
                        }
                        c.sweep(now);
                        if probing {
                            c.sweep_gone(&mut prober, now);
                        }
                    }
                }
            }
        });
        let persister = coordinator.store.is_some().then(|| {
            let (c, stop) = (coordinator.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(PERSIST_EVERY) => {}
                    }
                    c.save_changes().await;
                }
            })
        });
        // A move a crash left in its middle is settled once the shards can be reached.
        let c = coordinator.clone();
        let resuming = tokio::spawn(async move { c.resume().await });
        let watching = (coordinator.lock().job().replicas > 1).then(|| {
            let (c, stop) = (coordinator.clone(), stop.clone());
            tokio::spawn(async move { c.watch_shards(stop).await })
        });
        Background {
            sweeper,
            persister,
            resuming,
            watching,
        }
    }

    /// Stops the background work (the caller cancelled its token) and saves the state.
    pub(super) async fn stop(self, coordinator: &Coordinator) {
        self.sweeper.abort();
        self.resuming.abort();
        if let Some(w) = self.watching {
            w.abort();
        }
        if let Some(p) = self.persister {
            let _ = p.await;
        }
        if coordinator.store.is_some()
            && let Some(bytes) = coordinator.durable_bytes().await
        {
            info!(bytes, "coordinator state saved");
        }
    }
}

/// One of several coordinators of a job sharing an etcd (`--meta etcd://...`): it answers
/// every request with where the leader is until it is elected, then as the coordinator.
pub(super) struct Elected {
    pub(super) leader: std::sync::OnceLock<Arc<Coordinator>>,
    pub(super) standby: tokio::sync::watch::Receiver<Option<String>>,
}

impl Service for Elected {
    fn allowed(&self, role: Role, req: &Request) -> bool {
        self.leader.get().is_none_or(|c| c.allowed(role, req))
    }

    async fn handle(&self, peer: &Peer, req: Request, payload: Parts) -> Frame<Response, Parts> {
        match self.leader.get() {
            Some(c) => c.handle(peer, req, payload).await,
            None => Frame::new(Response::NotLeader {
                leader: self.standby.borrow().clone(),
            }),
        }
    }
}

/// How a coordinator that shares its job with others through etcd runs.
pub struct ElectedConfig {
    /// The etcd members (`etcd://H:P,...`, parsed by [`etcd::parse_url`]).
    pub endpoints: Vec<String>,
    /// The address the others and the clients reach this coordinator at.
    pub advertise: String,
    /// The leader's etcd lease: a leader cut off from etcd this long steps down; until then
    /// it acknowledges training reports from memory (so training rides out an etcd outage
    /// shorter than this). A leader that dies is replaced within `dead_after` (its lease
    /// revoked by a standby), or after this long if no standby can tell.
    pub ttl: Duration,
    /// A leader that does not answer a standby as the leader for this long is taken for dead
    /// and replaced (its lease revoked). Shorter fails over sooner; a live leader that stops
    /// answering this long (a long pause, a cut link between the two) is replaced, safely.
    pub dead_after: Duration,
}

/// Runs a coordinator of a job whose state is in etcd until `shutdown`: it answers at once (as
/// a standby, naming the leader), campaigns, and once elected restores the state etcd holds
/// and serves. `on_bound` gets the bound address as soon as it is known. Returns an error if
/// it was deposed (its lease lapsed or another coordinator took the lead): the process should
/// end, and may be started again as a standby.
pub async fn run_elected(
    config: CoordinatorConfig,
    elected: ElectedConfig,
    listen: SocketAddr,
    identity: &Identity,
    settings: TransportSettings,
    shutdown: CancellationToken,
    on_bound: impl FnOnce(SocketAddr) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let meta =
        etcd::EtcdMeta::connect(elected.endpoints.clone(), &identity.job, "coordinator").await?;
    let endpoint = server_endpoint(listen, identity, &settings)?;
    on_bound(endpoint.local_addr()?)?;
    let (standby, watching) = tokio::sync::watch::channel(None);
    let prober = etcd::Prober::new(identity, &settings, elected.dead_after)?;
    let service = Arc::new(Elected {
        leader: std::sync::OnceLock::new(),
        standby: watching,
    });
    let server = {
        let (service, job, settings, stop) = (
            service.clone(),
            identity.job.clone(),
            settings.clone(),
            shutdown.clone(),
        );
        tokio::spawn(
            async move { edl_shared::serve(endpoint, service, &job, &settings, stop).await },
        )
    };
    info!(advertise = %elected.advertise, etcd = %elected.endpoints.join(","), "coordinator campaigning for the lead");
    let probing = config.probe_sockets;
    let led = meta
        .lead(
            &elected.advertise,
            elected.ttl,
            &prober,
            &standby,
            &shutdown,
            async |lead, record| {
                let coordinator = match record {
                    Some(record) => Coordinator::restored(meta::decode(&record)?, config)?,
                    None => Coordinator::new(config)?,
                };
                let coordinator = coordinator.with_store(Arc::new(meta.store(lead)));
                coordinator.set_probe_window(elected.dead_after * 3 / 4);
                coordinator.set_shard_link(Arc::new(ShardCaller::new(identity, &settings)?));
                let _ = coordinator.job_name.set(identity.job.clone());
                Ok(Arc::new(coordinator))
            },
        )
        .await;
    let (lead, coordinator) = match led {
        Ok(Some(led)) => led,
        Ok(None) => {
            let _ = server.await;
            return Ok(());
        }
        Err(e) => {
            shutdown.cancel();
            let _ = server.await;
            return Err(e);
        }
    };
    metrics::watch(&coordinator);
    let _ = service.leader.set(coordinator.clone());
    info!(term = lead.term, advertise = %elected.advertise, "coordinator elected: leading the job");
    let work = shutdown.child_token();
    let background = Background::start(&coordinator, probing, &work);
    let deposed = coordinator.deposed();
    let outcome = tokio::select! {
        _ = shutdown.cancelled() => Ok(()),
        _ = lead.lost.cancelled() => Err(anyhow::anyhow!(
            "deposed: the lead's etcd lease (term {}) may have expired; another coordinator may \
             lead now",
            lead.term
        )),
        _ = deposed.cancelled() => Err(anyhow::anyhow!(
            "deposed: another coordinator took the lead (term {} is over)",
            lead.term
        )),
    };
    work.cancel();
    match outcome {
        Ok(()) => {
            let _ = server.await;
            background.stop(&coordinator).await;
            meta.resign(&lead).await;
            Ok(())
        }
        Err(e) => {
            // Nothing more is answered or written: the state is the new leader's.
            shutdown.cancel();
            let _ = server.await;
            Err(e)
        }
    }
}
