//! The coordinator's side: its calls served as tasks, their answers, and its crashes,
//! restarts and failovers.

use super::*;

/// The coordinator's address in the simulation.
pub(super) const COORDINATOR: &str = "sim:coordinator";

/// The addresses of a job with a standby coordinator (`Scenario::standby`); either may lead.
pub(super) const COORDINATORS: [&str; 2] = [COORDINATOR, "sim:standby"];

/// A job's two coordinators as its real clients reach them: one leads, the other stands by
/// and names the leader it saw last. (Servers reach the leader whatever address they use.)
pub(super) struct Standby {
    /// The address that leads ([`COORDINATORS`]), or led until it was lost: the one the
    /// standby names.
    pub(super) leads: usize,
    /// Addresses whose process is down: a new connection to one times out.
    pub(super) down: Arc<std::sync::Mutex<BTreeSet<String>>>,
}

impl Standby {
    pub(super) fn down(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.down.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The leader's process stops answering (killed or paused); returns its address.
    pub(super) fn leader_down(&self) -> &'static str {
        let at = COORDINATORS[self.leads];
        self.down().insert(at.to_string());
        at
    }

    /// Whether the leader's process does not answer now.
    pub(super) fn leader_is_down(&self) -> bool {
        self.down().contains(COORDINATORS[self.leads])
    }
}

impl Sim {
    /// A real client's call (or a shard's: a primary reporting a backup it cannot reach)
    /// reaches the coordinator: its service serves it in a task of its own, which reports the
    /// answer when it has one.
    pub(super) fn serve_coordinator(&mut self, id: u64) {
        let Some(call) = self.links.get(&id).filter(|c| c.answer.is_none()) else {
            return;
        };
        let peer = match call.from {
            Node::Worker(slot) => {
                Peer::in_process(Role::Worker, &format!("w{slot}"), JOB, addr(0, slot))
            }
            Node::Shard(n) => Peer::in_process(Role::Shard, &format!("s{n}"), JOB, addr(1, n)),
            Node::Coordinator => return,
        };
        let (req, payload) = (call.req.clone(), call.payload.clone());
        self.seq += 1;
        let n = self.seq;
        let (c, tx) = (self.coordinator.clone(), self.answers.clone());
        let task = tokio::spawn(async move {
            let resp = if c.allowed(peer.role, &req) {
                c.handle(&peer, req, payload).await.msg
            } else {
                Response::error(ErrorCode::Forbidden, "not allowed")
            };
            let _ = tx.send(Answer {
                call: n,
                worker: LINK,
                seq: id,
                clock: Clock(0),
                resp,
            });
        });
        self.calls.insert(n, (LINK, id, task));
    }

    /// An answer from the coordinator goes back over the network; a grant is checked against
    /// the consistency model first.
    pub(super) fn answered(&mut self, a: Answer) -> Result<(), String> {
        self.calls.remove(&a.call);
        if self.orphans.remove(&a.call) {
            self.note(format!(
                "a deposed coordinator's answer to call {} is lost",
                a.call
            ));
            return Ok(());
        }
        if a.worker == LINK {
            let line = format!("coordinator answers call #{}", a.seq);
            mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
            self.note(line);
            // SSP(s): a worker at clock c goes on only while the slowest counting worker is at
            // c - s or later (a draining one leaves instead).
            let asked = self.links.get(&a.seq).map(|c| &c.req);
            if let (
                Some(Request::Clock { clock, worker, .. }),
                Response::ClockGranted { min_clock, drain },
            ) = (asked, &a.resp)
            {
                let bound = self.scenario.consistency.staleness();
                if bound.is_some_and(|s| !drain && min_clock.0.saturating_add(s) < clock.0) {
                    return Err(format!(
                        "consistency: {worker} granted clock {} with the slowest at {}, {}",
                        clock.0, min_clock.0, self.scenario.consistency
                    ));
                }
            }
            self.answer_link(a.seq, Ok(Frame::new(a.resp)));
            return Ok(());
        }
        let line = format!("coordinator answers w{} #{}", a.worker, a.seq);
        mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
        self.note(line);
        if a.worker == ADMIN {
            if let Some(s) = self.joining.remove(&a.call) {
                return self.rejoined(s, a.resp);
            }
            match a.resp {
                Response::Ack => self.drained += 1,
                Response::Resharded { moves, map } => {
                    self.moved += moves.len() as u32;
                    self.note(format!("operator: moved, map {}", map.epoch));
                }
                Response::Error { message, .. } => self.note(format!("operator: {message}")),
                _ => {}
            }
            return Ok(());
        }
        let body = match a.resp {
            Response::Registered {
                worker,
                map,
                clock,
                token,
                ..
            } => Body::Registered {
                id: worker,
                clock,
                map: Box::new(map),
                token,
            },
            Response::Partition { partition, clock } => Body::Leased {
                part: partition,
                clock,
            },
            Response::ClockGranted { min_clock, drain } => {
                // SSP(s): a worker at clock c goes on only while the slowest counting worker
                // is at c - s or later (a draining one leaves instead).
                let bound = self.scenario.consistency.staleness();
                if bound.is_some_and(|s| !drain && min_clock.0.saturating_add(s) < a.clock.0) {
                    return Err(format!(
                        "consistency: w{} granted clock {} with the slowest at {}, {}",
                        a.worker, a.clock.0, min_clock.0, self.scenario.consistency
                    ));
                }
                if let Some(s) = bound.filter(|_| !drain) {
                    self.check_grant(a.worker, a.clock, s)?;
                }
                Body::Granted { drain }
            }
            Response::Beat { drain, .. } => Body::Beat { drain },
            Response::Map(map) => Body::FreshMap(Box::new(map)),
            Response::Ack => Body::Left,
            Response::Error { code, .. }
                if ErrorCode::from_u16(code) == Some(ErrorCode::NotReady) =>
            {
                Body::NotReady
            }
            Response::Error { message, .. } => Body::Refused(message),
            other => return Err(format!("the coordinator answered {other:?}")),
        };
        self.send(
            Node::Coordinator,
            Node::Worker(a.worker),
            a.worker,
            a.seq,
            body,
        );
        Ok(())
    }

    pub(super) fn at_coordinator(&mut self, env: Envelope) -> Result<(), String> {
        let (slot, seq) = (env.worker, env.seq);
        // Faults of the network and the shards, and the shards' periodic checkpoints, do not
        // depend on the coordinator.
        match env.body {
            Body::Script(
                f @ (Scripted::Partition(..)
                | Scripted::Filter { .. }
                | Scripted::ShardCrash(..)
                | Scripted::CrashAt(..)),
            ) => return self.fault(f),
            // A shard's answer reaches the coordinator's task (gone if it crashed since).
            Body::LinkReply(id) => {
                self.link_reply(id);
                return Ok(());
            }
            Body::Script(Scripted::Slow(n, factor)) => {
                if let Some(slot) = self.live_worker(n) {
                    self.note(format!("w{slot} computes {factor} times slower"));
                    self.workers[slot].slow = factor;
                }
                return Ok(());
            }
            Body::Place(id) => {
                self.note(format!("the placer starts a worker for placement {id}"));
                self.start_worker(Some(id));
                return Ok(());
            }
            Body::Tick if self.now.is_multiple_of(CHECKPOINT_MS) => {
                for s in 0..self.shards.len() {
                    // Finished tasks are forgotten.
                    self.shards[s].tasks.retain(|_, (_, t)| !t.is_finished());
                    if self.shards[s].down.is_none() {
                        self.checkpoint(s);
                    }
                }
            }
            _ => {}
        }
        // A leader cut off from the store serves on until the standby leads.
        let serving = self.failover && self.killed.is_none() && !matches!(env.body, Body::Restart);
        if self.down_until.is_some() && !serving {
            match env.body {
                Body::Restart => {
                    if self.failover {
                        // The clients find the old leader deposed and move to the new one.
                        self.end_calls(true);
                    }
                    let saved = self.store.latest().map_err(|e| e.to_string())?;
                    let restored = match saved {
                        Some(snap) => Coordinator::restored(snap, self.config.clone()),
                        None => Coordinator::new(self.config.clone()),
                    }
                    .map_err(|e| format!("the coordinator cannot restore its state: {e}"))?;
                    // A new leader, at the next term: whoever led before writes no more. (A
                    // leader cut off reaches the store again now, to be refused.)
                    self.lead.reconnect();
                    self.lead = self.store.elect();
                    // With a standby: a killed leader back at its address wins, or the
                    // standby does (always, for a leader cut off: it still runs where it led).
                    let killed = self.killed.take();
                    if let Some(sb) = &mut self.standby {
                        sb.down().clear();
                        if killed != Some(true) {
                            sb.leads = 1 - sb.leads;
                        }
                        let at = COORDINATORS[sb.leads];
                        self.note(format!("the coordinator at {at} is elected"));
                    }
                    let restored = restored.with_store(Arc::new(self.lead.clone()));
                    restored.set_shard_link(Arc::new(SimLink {
                        from: Node::Coordinator,
                        calls: self.link.clone(),
                    }));
                    self.coordinator = Arc::new(restored);
                    // As `edl-ps coordinator` does on start: settle a move left in its middle.
                    let c = self.coordinator.clone();
                    let task = tokio::spawn(async move { c.resume().await });
                    self.seq += 1;
                    self.calls.insert(self.seq, (ADMIN, RESUME, task));
                    self.down_until = None;
                    self.restarts += 1;
                    self.note("coordinator restarted from its saved state".into());
                    self.watch();
                }
                Body::Tick => self.at(self.now + TICK_MS, Node::Coordinator, 0, 0, Body::Tick),
                Body::Script(Scripted::Join) => self.start_worker(None),
                Body::Script(Scripted::Crash(n)) => self.crash_worker(n),
                // An operator's drain fails; a crashed coordinator cannot crash again.
                Body::Script(_) => {}
                // A call to a coordinator that is down fails with its connection.
                Body::Call(id) => self.link_failed(id),
                Body::Heartbeat(_) => {}
                Body::GetMap => {
                    let t = self.now + CONNECTION_TIMEOUT_MS;
                    self.at(t, Node::Worker(slot), slot, seq, Body::Retry);
                }
                _ => self.at(
                    self.now + CONNECTION_TIMEOUT_MS,
                    Node::Worker(slot),
                    slot,
                    seq,
                    Body::ConnectionLost,
                ),
            }
            return Ok(());
        }
        match env.body {
            // The coordinator drives a move to its end before it may crash (moves across a
            // coordinator crash are not simulated yet).
            Body::Script(Scripted::CoordinatorCrash(_)) if !self.mid_move && self.moving() => {}
            // A leader already cut off is not cut off again.
            Body::Script(Scripted::CoordinatorCrash(_)) if self.down_until.is_some() => {}
            Body::Script(Scripted::LeaderLost(..))
                if self.down_until.is_some() || (!self.mid_move && self.moving()) => {}
            Body::Script(Scripted::LeaderLost(down, loss @ (Loss::CutOff | Loss::Paused))) => {
                if loss == Loss::Paused
                    && let Some(sb) = &self.standby
                {
                    let at = sb.leader_down();
                    self.leaders_paused += 1;
                    self.note(format!(
                        "the leading coordinator at {at} is paused for {down} ms"
                    ));
                }
                self.at(
                    self.now,
                    Node::Coordinator,
                    0,
                    0,
                    Body::Script(Scripted::CoordinatorCrash(down)),
                );
            }
            Body::Script(Scripted::LeaderLost(down, Loss::Killed(wins))) => {
                self.down_until = Some(self.now + down);
                self.at(self.now + down, Node::Coordinator, 0, 0, Body::Restart);
                self.killed = Some(wins);
                self.leaders_killed.0 += 1;
                self.leaders_killed.1 += u32::from(wins);
                if let Some(sb) = &self.standby {
                    let at = sb.leader_down();
                    let next = if wins { at } else { COORDINATORS[1 - sb.leads] };
                    self.note(format!(
                        "the leading coordinator at {at} is killed for {down} ms (the standby \
                         names it still); {next} leads next"
                    ));
                }
                self.lead.cut_off();
                self.end_calls(false);
                if let Some(watch) = self.watches.last() {
                    watch.cancel();
                }
            }
            Body::Script(Scripted::CoordinatorCrash(down)) => {
                self.down_until = Some(self.now + down);
                self.at(self.now + down, Node::Coordinator, 0, 0, Body::Restart);
                if self.failover {
                    // Cut off from the store, not from the workers: it serves on, and what it
                    // must write first waits, until a standby leads.
                    self.note(format!(
                        "the leading coordinator is cut off from the store; a standby leads in \
                         {down} ms"
                    ));
                    self.lead.cut_off();
                    self.old_leaders.push(self.coordinator.clone());
                    return Ok(());
                }
                self.note(format!("the coordinator crashes for {down} ms"));
                self.end_calls(false);
                if let Some(watch) = self.watches.last() {
                    watch.cancel();
                }
            }
            Body::Script(Scripted::Move(n, m)) => self.operator_move(n, m),
            Body::Tick => {
                // A placer: a worker for every placement the coordinator asks for, started
                // a moment later.
                let placements = self.coordinator.inspect(|st| st.placements());
                for p in placements.iter().filter(|p| p.is_pending()) {
                    if self.placed.insert(p.id) {
                        self.at(
                            self.now + PLACE_MS,
                            Node::Coordinator,
                            0,
                            0,
                            Body::Place(p.id),
                        );
                    }
                }
                if self.now.is_multiple_of(SAVE_MS) {
                    let c = self.coordinator.clone();
                    tokio::spawn(async move { c.save_changes().await });
                }
                let dead = self.coordinator.sweep(edl_shared::clock::now());
                if dead > 0 {
                    self.dead += dead as u32;
                    self.note(format!("coordinator: {dead} declared dead"));
                }
                if !self.faulty()
                    && !self
                        .workers
                        .iter()
                        .any(|w| !matches!(w.phase, Phase::Done | Phase::Crashed))
                    && !self.finished()
                {
                    self.note("no worker left: a new one starts".into());
                    self.start_worker(None);
                }
                self.at(self.now + TICK_MS, Node::Coordinator, 0, 0, Body::Tick);
            }
            Body::Script(Scripted::Join) => self.start_worker(None),
            Body::Script(Scripted::Drain(n)) => {
                let mut ids: Vec<WorkerId> = self.workers.iter().filter_map(|w| w.id).collect();
                if self.scenario.clients {
                    let now = edl_shared::clock::now();
                    ids = self
                        .coordinator
                        .inspect(|st| st.members(now).into_iter().map(|m| m.id).collect());
                }
                if !ids.is_empty() {
                    let worker = ids[n % ids.len()];
                    self.call(ADMIN, DRAIN, Clock(0), Request::Drain { worker });
                }
            }
            Body::Script(Scripted::Crash(n)) => self.crash_worker(n),
            Body::Register => {
                let req = Request::Register {
                    name: format!("w{slot}"),
                    placement: self.workers[slot].placement,
                };
                self.call(slot, seq, Clock(0), req);
            }
            Body::NextPartition(worker) => {
                self.call(slot, seq, Clock(0), Request::NextPartition { worker });
            }
            Body::Clock { id, clock, span } => {
                let req = Request::Clock {
                    worker: id,
                    clock,
                    epoch: span.epoch,
                    samples: span.len(),
                    loss_sum: 0.0,
                    span: Some(span),
                    last: false,
                    bytes_pushed: 0,
                    bytes_pulled: 0,
                };
                self.call(slot, seq, clock, req);
            }
            Body::Heartbeat(worker) => {
                self.call(slot, seq, Clock(0), Request::Heartbeat { worker })
            }
            Body::Leave(worker) => self.call(slot, seq, Clock(0), Request::Leave { worker }),
            Body::Call(id) => self.serve_coordinator(id),
            Body::GetMap => self.call(slot, seq, Clock(0), Request::GetMap),
            other => return Err(format!("the coordinator got {other:?}")),
        }
        Ok(())
    }
}
