//! The workers: the model of the client's loop (register, lease, push, commit, wait,
//! leave) and the real client's, and their starts and crashes.

use super::*;

/// A worker's place in the client's loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Registering,
    Leasing,
    Pushing,
    Committing,
    Leaving,
    Done,
    Crashed,
}

/// A simulated worker.
#[derive(Debug)]
pub(super) struct Worker {
    pub(super) id: Option<WorkerId>,
    pub(super) phase: Phase,
    /// The request awaited (answers to older ones are stale).
    pub(super) seq: u64,
    pub(super) clock: Clock,
    pub(super) part: Option<(Partition, u32)>,
    pub(super) span: Option<DataSpan>,
    /// The keys that acknowledged the current batch's push.
    pub(super) acks: BTreeSet<Key>,
    /// The shard map the worker routes with.
    pub(super) map: ShardMap,
    pub(super) drain: bool,
    /// What its pushes prove their sender with (from its registration).
    pub(super) token: Option<Token>,
    /// The placement it was started for.
    pub(super) placement: Option<u64>,
    /// How many times slower than the scenario's step it computes.
    pub(super) slow: u32,
    /// A real client's task, and how it ended (with `Scenario::clients`).
    pub(super) client: Option<(tokio::task::JoinHandle<()>, Outcome)>,
}

/// How a real client's task ended, once it did.
pub(super) type Outcome = Arc<std::sync::Mutex<Option<String>>>;

/// A real client in the trainer's loop: pull, compute (a sleep of `step`), push gradients of
/// -1 everywhere, commit; leaves when there is no data left or it is asked to drain. Returns
/// its steps.
async fn client_loop(
    cfg: edl_worker::ClientConfig,
    dialer: Dialer,
    placement: Option<u64>,
    step: Duration,
) -> Result<u64, edl_worker::ClientError> {
    let job = edl_worker::Job::connect_with(&cfg, dialer)
        .await?
        .for_placement(placement);
    let mut session = job.register(&cfg.identity.name).await?;
    let n = session.spec().param_count();
    let (mut params, grads) = (vec![0.0f32; n], vec![-1.0f32; n]);
    let mut steps = 0;
    while let Some(batch) = session.next_batch().await? {
        session.pull(&mut params).await?;
        if !step.is_zero() {
            tokio::time::sleep(step).await;
        }
        session.push(&batch, &grads).await?;
        session.commit(batch, 0.0).await?;
        steps += 1;
        if session.drain_requested() {
            break;
        }
    }
    session.leave().await?;
    Ok(steps)
}

impl Sim {
    /// A worker starts (for a placement the coordinator asked for, if `placement`).
    pub(super) fn start_worker(&mut self, placement: Option<u64>) {
        let slot = self.workers.len();
        self.workers.push(Worker {
            id: None,
            phase: Phase::Registering,
            seq: 0,
            clock: Clock(0),
            part: None,
            span: None,
            acks: BTreeSet::new(),
            map: self.map.clone(),
            drain: false,
            token: None,
            placement,
            slow: 1,
            client: None,
        });
        if self.scenario.clients {
            self.start_client(slot, placement);
        } else {
            self.request(slot, Body::Register);
        }
    }

    /// Worker `slot` is a real client: the client library's `Session`, in the trainer's loop
    /// (pull, compute, push, commit; leave when out of data or drained), over the simulated
    /// network.
    pub(super) fn start_client(&mut self, slot: usize, placement: Option<u64>) {
        let name = format!("w{slot}");
        let cfg = edl_worker::ClientConfig {
            coordinator: match &self.standby {
                Some(_) => COORDINATORS.join(","),
                None => COORDINATOR.to_string(),
            },
            identity: edl_shared::Identity::unsigned(Role::Worker, &name, JOB),
            settings: edl_shared::transport::TransportSettings::default(),
        };
        let net = SimNet {
            from: Node::Worker(slot),
            calls: self.link.clone(),
            down: self.standby.as_ref().map(|s| s.down.clone()),
        };
        let step = Duration::from_millis(self.scenario.step_ms);
        let outcome = Arc::new(std::sync::Mutex::new(None));
        let ended = outcome.clone();
        let task = tokio::spawn(async move {
            let r = client_loop(cfg, Dialer::Local(Arc::new(net)), placement, step).await;
            let line = match r {
                Ok(steps) => format!("left after {steps} steps"),
                Err(e) => format!("exited: {e}"),
            };
            *ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(line);
        });
        self.workers[slot].phase = Phase::Pushing;
        self.workers[slot].client = Some((task, outcome));
    }

    /// Real clients whose task ended are done.
    pub(super) fn clients_ended(&mut self) {
        for slot in 0..self.workers.len() {
            let w = &mut self.workers[slot];
            let Some((task, outcome)) = &w.client else {
                continue;
            };
            if w.phase == Phase::Pushing && task.is_finished() {
                w.phase = Phase::Done;
                let line = outcome.lock().unwrap_or_else(|p| p.into_inner()).take();
                if line.as_deref().is_some_and(|l| l.starts_with("left")) {
                    self.left += 1;
                }
                if line
                    .as_deref()
                    .is_some_and(|l| l.contains("dropped by the coordinator"))
                {
                    self.dropped += 1;
                }
                self.note(format!("w{slot} {}", line.unwrap_or_default()));
            }
        }
    }

    /// A worker's next request to the coordinator, awaited.
    pub(super) fn request(&mut self, slot: usize, body: Body) {
        self.seq += 1;
        let seq = self.seq;
        self.workers[slot].seq = seq;
        self.send(Node::Worker(slot), Node::Coordinator, slot, seq, body);
    }

    /// The current batch's pushes to the shards that have not acknowledged it.
    pub(super) fn push(&mut self, slot: usize) {
        self.seq += 1;
        let seq = self.seq;
        let w = &mut self.workers[slot];
        w.seq = seq;
        let (Some(id), Some(span)) = (w.id, w.span) else {
            return;
        };
        let clock = w.clock;
        let mut by_shard: BTreeMap<ShardId, Vec<ChunkRef>> = BTreeMap::new();
        for c in self.keys.iter().filter(|c| !w.acks.contains(&c.key)) {
            if let Some(owner) = w.map.owner(c.key) {
                by_shard.entry(owner).or_default().push(*c);
            }
        }
        let epoch = w.map.epoch;
        for (shard, chunks) in by_shard {
            let body = Body::Push {
                id,
                clock,
                span,
                epoch,
                chunks,
            };
            let to = Node::Shard(shard.0 as usize);
            self.send(Node::Worker(slot), to, slot, seq, body);
        }
    }

    /// The n-th live worker (modulo their number), if any is.
    pub(super) fn live_worker(&self, n: usize) -> Option<usize> {
        let live: Vec<usize> = (0..self.workers.len())
            .filter(|&s| !matches!(self.workers[s].phase, Phase::Done | Phase::Crashed))
            .collect();
        live.get(n % live.len().max(1)).copied()
    }

    /// The n-th live worker (modulo their number) stops.
    pub(super) fn crash_worker(&mut self, n: usize) {
        if let Some(s) = self.live_worker(n) {
            self.workers[s].phase = Phase::Crashed;
            self.crashed += 1;
            self.note(format!("w{s} crashes"));
            // A real client's process ends: its tasks stop, and nothing more of it is heard.
            if let Some((task, _)) = &self.workers[s].client {
                task.abort();
                self.cuts.push((Node::Worker(s), u64::MAX));
            }
        }
    }

    pub(super) fn at_worker(&mut self, slot: usize, env: Envelope) -> Result<(), String> {
        // An answer to a real client's call reaches it (if its task is still there).
        if let Body::LinkReply(id) = env.body {
            self.link_reply(id);
            return Ok(());
        }
        let phase = self.workers[slot].phase;
        if matches!(phase, Phase::Done | Phase::Crashed) {
            return Ok(());
        }
        let current = env.seq == self.workers[slot].seq;
        match env.body {
            // A replicated job's worker whose push failed asks for the map first: a backup may
            // have taken the place of a dead primary (the client follows maps as they change).
            Body::Retry if current && phase == Phase::Pushing && self.replicated() => {
                let seq = self.workers[slot].seq;
                self.send(
                    Node::Worker(slot),
                    Node::Coordinator,
                    slot,
                    seq,
                    Body::GetMap,
                );
            }
            // A retry of an older round of pushes is stale: the current round carries its keys.
            Body::Retry | Body::Route if current && phase == Phase::Pushing => self.push(slot),
            Body::Computed if current && phase == Phase::Pushing => self.push(slot),
            // A map asked for while pushing (a refusal's, a replicated job's retry) is asked
            // again with the push, as when its message is lost.
            Body::ConnectionLost if current && phase == Phase::Pushing => {
                self.at(self.now, Node::Worker(slot), slot, env.seq, Body::Retry);
            }
            Body::ConnectionLost if current && !self.give_up => self.repeat(slot),
            Body::ConnectionLost if current => {
                self.note(format!(
                    "w{slot} exits: its connection to the coordinator failed"
                ));
                self.workers[slot].phase = Phase::Crashed;
            }
            Body::HeartbeatDue => {
                if let Some(id) = self.workers[slot].id {
                    self.seq += 1;
                    let seq = self.seq;
                    let body = Body::Heartbeat(id);
                    self.send(Node::Worker(slot), Node::Coordinator, slot, seq, body);
                    self.heartbeat_later(slot);
                }
            }
            Body::Beat { drain } => self.workers[slot].drain |= drain,
            // The long poll timed out: the client asks again at once.
            Body::NotReady if current => self.repeat(slot),
            Body::Refused(m) if current || phase == Phase::Pushing => {
                // The client gives up: a worker the coordinator dropped exits.
                self.note(format!("w{slot} exits: {m}"));
                self.workers[slot].phase = Phase::Done;
            }
            Body::Registered {
                id,
                clock,
                map,
                token,
            } if current && phase == Phase::Registering => {
                let w = &mut self.workers[slot];
                w.id = Some(id);
                w.token = Some(token);
                w.clock = clock;
                w.map = *map;
                w.phase = Phase::Leasing;
                self.heartbeat_later(slot);
                self.request(slot, Body::NextPartition(id));
            }
            Body::Leased { part, clock } if current && phase == Phase::Leasing => {
                self.workers[slot].clock = clock;
                match part {
                    Some(p) => {
                        self.workers[slot].part = Some((p, p.start));
                        self.next_batch(slot);
                    }
                    None => self.leave(slot),
                }
            }
            Body::Moved { span, map } if phase == Phase::Pushing => {
                self.rerouted += 1;
                let w = &mut self.workers[slot];
                if w.span == Some(span) {
                    let seq = w.seq;
                    if map.epoch > w.map.epoch {
                        // Route again with the newer map.
                        w.map = *map;
                        let again = self.route();
                        self.at(self.now, Node::Worker(slot), slot, seq, again);
                    } else {
                        // The refusing shard is behind: ask the coordinator for its map, as
                        // the client does.
                        self.send(
                            Node::Worker(slot),
                            Node::Coordinator,
                            slot,
                            seq,
                            Body::GetMap,
                        );
                    }
                }
            }
            Body::FreshMap(map) if current && phase == Phase::Pushing => {
                let w = &mut self.workers[slot];
                // The newer map at once; otherwise again after a moment (a destination may
                // still be waiting for the keys).
                let after = if map.epoch > w.map.epoch {
                    w.map = *map;
                    0
                } else {
                    20
                };
                let again = self.route();
                self.at(self.now + after, Node::Worker(slot), slot, env.seq, again);
            }
            Body::Pushed { keys, span } if phase == Phase::Pushing => {
                let w = &mut self.workers[slot];
                if w.span == Some(span) {
                    w.acks.extend(keys);
                    if w.acks.len() == self.keys.len()
                        && let Some(id) = w.id
                    {
                        w.phase = Phase::Committing;
                        let clock = Clock(w.clock.0 + 1);
                        self.request(slot, Body::Clock { id, clock, span });
                    }
                }
            }
            Body::Granted { drain } if current && phase == Phase::Committing => {
                let w = &mut self.workers[slot];
                w.clock = Clock(w.clock.0 + 1);
                w.span = None;
                if drain || w.drain {
                    self.leave(slot);
                } else {
                    self.next_batch(slot);
                }
            }
            Body::Left if current && phase == Phase::Leaving => {
                self.workers[slot].phase = Phase::Done;
                self.left += 1;
            }
            // A stale answer (to a request repeated since) or a stale timer.
            _ => {}
        }
        Ok(())
    }

    /// What routes a worker's push again at once (a replicated job's worker asks for the map
    /// first only after a push failed).
    pub(super) fn route(&self) -> Body {
        if self.replicated() {
            Body::Route
        } else {
            Body::Retry
        }
    }

    /// Schedules a worker's next heartbeat, four to a lease.
    pub(super) fn heartbeat_later(&mut self, slot: usize) {
        let every = u64::from(self.coordinator.inspect(|st| st.job().lease_ms)) / 4;
        self.at(
            self.now + every,
            Node::Worker(slot),
            slot,
            0,
            Body::HeartbeatDue,
        );
    }

    /// Repeats the awaited coordinator request on a new connection.
    pub(super) fn repeat(&mut self, slot: usize) {
        let w = &self.workers[slot];
        let body = match (w.phase, w.id, w.span) {
            (Phase::Registering, _, _) => Body::Register,
            (Phase::Leasing, Some(id), _) => Body::NextPartition(id),
            (Phase::Committing, Some(id), Some(span)) => Body::Clock {
                id,
                clock: Clock(w.clock.0 + 1),
                span,
            },
            (Phase::Leaving, Some(id), _) => Body::Leave(id),
            _ => return,
        };
        self.request(slot, body);
    }

    /// The next batch of the worker's partition, or the next lease.
    pub(super) fn next_batch(&mut self, slot: usize) {
        let batch = self.scenario.data.2;
        let w = &mut self.workers[slot];
        let Some(id) = w.id else {
            return;
        };
        match w.part {
            Some((p, next)) if next < p.start + p.len => {
                let span = crate::batch_span(&p, next, batch);
                w.part = Some((p, span.end));
                w.span = Some(span);
                w.acks.clear();
                w.phase = Phase::Pushing;
                let compute = self.scenario.step_ms * u64::from(w.slow);
                if compute == 0 {
                    self.push(slot);
                } else {
                    let seq = w.seq;
                    self.at(
                        self.now + compute,
                        Node::Worker(slot),
                        slot,
                        seq,
                        Body::Computed,
                    );
                }
            }
            _ => {
                w.part = None;
                if w.drain {
                    self.leave(slot);
                } else {
                    w.phase = Phase::Leasing;
                    self.request(slot, Body::NextPartition(id));
                }
            }
        }
    }

    pub(super) fn leave(&mut self, slot: usize) {
        let w = &mut self.workers[slot];
        w.phase = Phase::Leaving;
        if let Some(id) = w.id {
            self.request(slot, Body::Leave(id));
        }
    }
}
