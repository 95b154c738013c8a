//! The shards' side: their servers and disks (checkpoints), faults and crashes, restarts
//! and rejoins, and every request they serve, watched key by key for the model.

use super::*;

/// A shard server: the real service, over its state.
pub(super) struct SimShard {
    pub(super) service: Arc<ShardService>,
    pub(super) state: Arc<ShardState>,
    /// Its disk, as its periodic checkpoints reach it.
    pub(super) store: CheckpointStore,
    /// The requests it is serving and its checkpoint writes, by id: a crash aborts them.
    pub(super) tasks: BTreeMap<u64, (Serving, tokio::task::JoinHandle<()>)>,
    /// Until when it is down, if it is.
    pub(super) down: Option<u64>,
    /// Stops what the service runs in the background (a hand-off still offering its range).
    pub(super) stop: CancellationToken,
}

/// What a shard's task serves.
#[derive(Clone, Debug)]
pub(super) enum Serving {
    /// A worker's push: the worker's slot and request, and what it pushed.
    Push {
        slot: usize,
        seq: u64,
        id: WorkerId,
        span: DataSpan,
        keys: Vec<Key>,
    },
    /// A server's call (`links[id]`).
    Link(u64),
    Checkpoint,
}

/// A shard's answer, from the task that served it.
pub(super) struct ShardAnswer {
    pub(super) shard: usize,
    pub(super) task: u64,
    pub(super) frame: Frame<Response, Parts>,
}

/// A batch of data, as `(epoch, first sample)`.
pub(super) type Batch = (u32, u32);

/// The shards' disks and the model of their keys, written by the shards' tasks as they apply
/// pushes and take checkpoints (on the runtime's one thread, so a checkpoint holds exactly the
/// batches the model says it does).
#[derive(Default)]
pub(super) struct Disk {
    /// Per shard, its last checkpoint.
    pub(super) checkpoints: Vec<Option<ShardCheckpoint>>,
    /// The model: per key, the batches applied to it (and not lost since).
    pub(super) model: BTreeMap<Key, BTreeSet<Batch>>,
    /// Per shard, the model of its keys when it wrote its checkpoint.
    pub(super) modelled: Vec<BTreeMap<Key, BTreeSet<Batch>>>,
    /// A batch applied to a key that held it already.
    pub(super) twice: Option<String>,
    /// A replicated job's model, per copy: the batches shard `s`'s copy of a key (primary or
    /// backup) holds; `None` once what it holds is not known (a new backup's copy taken
    /// while pushes were on their way to it, a restore, a BSP step).
    pub(super) copies: BTreeMap<(usize, Key), Option<BTreeSet<Batch>>>,
    /// What the model of the copies learnt, for the log.
    pub(super) notes: Vec<String>,
}

impl Disk {
    /// Shard `s` writes a checkpoint; the model of its keys is kept beside it.
    pub(super) fn save(&mut self, s: usize, ckpt: ShardCheckpoint) {
        self.modelled[s] = (ckpt.chunks.iter())
            .map(|c| {
                let k = Key(c.key);
                (k, self.model.get(&k).cloned().unwrap_or_default())
            })
            .collect();
        self.checkpoints[s] = Some(ckpt);
    }

    /// A task of shard `s` changed its copies from `before` to `after` (by key: whether the
    /// copy is a backup, and its counter): a copy that appeared, or a primary's that a backup
    /// copy replaced, is a new backup's copy from shard `source` (its batches those of the
    /// source's copy if their number is the copy's count, else not known) or not known; a
    /// backup copy that became the primary's is the same copy; a counter one up applied
    /// `batch` (a batch it held already is applied twice); a copy gone is forgotten.
    pub(super) fn changed(
        &mut self,
        s: usize,
        (before, after): (&[Copy], &[Copy]),
        batch: Option<Batch>,
        source: Option<usize>,
    ) {
        for (k, (b, a)) in before.iter().zip(after).enumerate() {
            if b == a {
                continue;
            }
            let key = Key(k as u64);
            match (*b, *a) {
                (Some((false, _)), Some((true, v))) | (None, Some((_, v))) => {
                    let from = source.and_then(|p| self.copies.get(&(p, key)).cloned().flatten());
                    let line = match (source, &from) {
                        (Some(p), Some(h)) => {
                            format!("from shard {p}, whose copy holds {}", h.len())
                        }
                        (Some(p), None) => format!("from shard {p}, whose batches are not known"),
                        (None, _) => "from no copy".into(),
                    };
                    self.notes
                        .push(format!("shard {s} takes a copy of {key} at {v} {line}"));
                    let held = from.filter(|h| h.len() as f32 == v);
                    self.copies.insert((s, key), held);
                }
                (Some((_, b)), Some((_, a))) if a == b => {}
                (Some((_, b)), Some((_, a))) if a == b + 1.0 && batch.is_some() => {
                    let Some(batch) = batch else { continue };
                    if let Some(Some(held)) = self.copies.get_mut(&(s, key))
                        && !held.insert(batch)
                        && self.twice.is_none()
                    {
                        self.twice = Some(format!(
                            "exactly-once: shard {s} applied batch {batch:?} to its copy of \
                             {key} twice"
                        ));
                    }
                }
                (Some((_, b)), Some((_, a))) => {
                    self.notes
                        .push(format!("shard {s}'s copy of {key} goes from {b} to {a}"));
                    self.copies.insert((s, key), None);
                }
                (Some(_), None) => {
                    self.notes
                        .push(format!("shard {s} drops its copy of {key}"));
                    self.copies.remove(&(s, key));
                }
                (None, None) => {}
            }
        }
    }

    /// A push applied `batch` to `key`.
    pub(super) fn applied(&mut self, s: usize, key: Key, batch: Batch) {
        if !self.model.entry(key).or_default().insert(batch) && self.twice.is_none() {
            self.twice = Some(format!(
                "exactly-once: shard {s} applied batch {batch:?} to {key} twice"
            ));
        }
    }
}

/// A shard's copy of a key as the model watches it: whether it is a backup copy, and its
/// counter.
pub(super) type Copy = Option<(bool, f32)>;

/// Locks the disks (a task that panicked holding it is a failed run anyway).
pub(super) fn lock_disk(d: &std::sync::Mutex<Disk>) -> std::sync::MutexGuard<'_, Disk> {
    d.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sim {
    /// A shard server over `state`: the real service, reaching the other shards through the
    /// simulated network and keeping its checkpoints on the simulated disk.
    pub(super) fn shard_server(&self, s: usize, state: ShardState) -> SimShard {
        let disk = self.disk.clone();
        let store = CheckpointStore::Memory(Arc::new(move |ckpt| {
            lock_disk(&disk).save(s, ckpt);
        }));
        let link = SimLink {
            from: Node::Shard(s),
            calls: self.link.clone(),
        };
        let stop = CancellationToken::new();
        let service = ShardService::new(Arc::new(link), Some(store.clone()), stop.clone());
        service.trust(&self.token_key, JOB);
        // A primary reports a backup it cannot reach to the coordinator.
        service.report_to(COORDINATOR);
        let state = Arc::new(state);
        service.assign(state.clone());
        SimShard {
            service: Arc::new(service),
            state,
            store,
            tasks: BTreeMap::new(),
            down: None,
            stop,
        }
    }

    /// Shard `s` writes its checkpoint, as its periodic writer does (a task of its own, on the
    /// runtime's one thread: its disk is memory).
    pub(super) fn checkpoint(&mut self, s: usize) {
        let shard = &self.shards[s];
        let (state, store) = (shard.state.clone(), shard.store.clone());
        let task = tokio::spawn(async move {
            let _ = store.write(&state).await;
        });
        self.seq += 1;
        let id = self.seq;
        self.shards[s].tasks.insert(id, (Serving::Checkpoint, task));
    }

    /// Begins a fault of the network or a shard.
    pub(super) fn fault(&mut self, what: Scripted) -> Result<(), String> {
        match what {
            Scripted::Partition(target, ms) => {
                let node = match target {
                    Target::Coordinator => Node::Coordinator,
                    Target::Shard(n) => Node::Shard(n % self.shards.len()),
                    Target::Worker(n) => match self.live_worker(n) {
                        Some(slot) => Node::Worker(slot),
                        None => return Ok(()),
                    },
                };
                self.note(format!("{node:?} is partitioned for {ms} ms"));
                self.cuts.push((node, self.now + ms));
            }
            Scripted::Filter { kind, answers, ms } => {
                self.note(format!(
                    "{kind:?} {} are dropped for {ms} ms",
                    if answers { "answers" } else { "requests" }
                ));
                self.filters.push((kind, answers, self.now + ms));
            }
            // A shard does not crash in the middle of a move (not simulated yet).
            Scripted::ShardCrash(_, _) if !self.mid_move && self.moving() => {}
            Scripted::ShardCrash(n, down) => {
                self.crash_shard(n % self.shards.len(), down);
            }
            Scripted::CrashAt(point, n, down) => {
                self.note(format!("a shard crashes at {point:?} #{n}"));
                self.traps.push((point, n, down));
            }
            other => return Err(format!("{other:?} is not a fault")),
        }
        Ok(())
    }

    /// Shard `s` crashes, to restart `down` ms later; false if it is down already, or if it
    /// holds the last live copy of some keys of a replicated job (what replicas promise to
    /// survive is fewer failures than copies, and a shard cut off long enough is taken for a
    /// failed one: its copies do not count, until the coordinator can have heard it again, a
    /// question's timeout and a tick after the cut heals).
    pub(super) fn crash_shard(&mut self, s: usize, down: u64) -> bool {
        if self.shards[s].down.is_some() {
            return false;
        }
        if self.replicated() {
            let me = ShardId(s as u32);
            let heard_again = self.now.saturating_sub(CONNECTION_TIMEOUT_MS + 2 * TICK_MS);
            let cut = |n: Node| (self.cuts.iter()).any(|&(c, until)| c == n && heard_again < until);
            let up = |id: ShardId| {
                id != me
                    && !cut(Node::Shard(id.0 as usize))
                    && self
                        .shards
                        .get(id.0 as usize)
                        .is_some_and(|sh| sh.down.is_none())
            };
            let last = self.keys.iter().any(|c| {
                let copies: Vec<ShardId> = (self.map.owner(c.key).into_iter())
                    .chain(self.map.backups_of(c.key))
                    .collect();
                copies.contains(&me) && !copies.into_iter().any(up)
            });
            if last {
                self.note(format!(
                    "shard {s} holds the last live copy of some keys: no crash"
                ));
                return false;
            }
        }
        self.note(format!("shard {s} crashes for {down} ms"));
        self.shards[s].down = Some(self.now + down);
        self.shards[s].stop.cancel();
        self.shard_crashes += 1;
        // Its process ends: what it was serving fails with the connections, and what it was
        // doing (a hand-off, a checkpoint, a push's forwards) stops where it was.
        for (_, (serving, task)) in std::mem::take(&mut self.shards[s].tasks) {
            task.abort();
            if let Serving::Push { slot, seq, .. } = serving {
                let t = self.now + CONNECTION_TIMEOUT_MS;
                self.at(t, Node::Worker(slot), slot, seq, Body::Retry);
            }
        }
        let serving: Vec<u64> = (self.links.iter())
            .filter(|(_, c)| c.to == Node::Shard(s) && c.answer.is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in serving {
            self.link_failed(id);
        }
        self.at(self.now + down, Node::Shard(s), 0, 0, Body::ShardRestart);
        true
    }

    /// Shard `s` reached `point` of a replication: a crash armed there goes off if it is the
    /// time (and the shard may crash); true if it crashed.
    pub(super) fn trap(&mut self, point: Point, s: usize) -> bool {
        let Some(i) = self.traps.iter().position(|t| t.0 == point) else {
            return false;
        };
        if self.traps[i].1 > 1 {
            self.traps[i].1 -= 1;
            return false;
        }
        let down = self.traps[i].2;
        self.note(format!("shard {s} at {point:?}"));
        if !self.crash_shard(s, down) {
            return false;
        }
        self.traps.remove(i);
        if let Some(n) = Point::ALL.iter().position(|p| *p == point) {
            self.hits[n] += 1;
        }
        true
    }

    pub(super) fn at_shard(&mut self, s: usize, env: Envelope) -> Result<(), String> {
        // A shard's answer reaches the server that called (gone if it crashed since); a
        // primary may crash as its backup's acknowledgement of a push arrives.
        if let Body::LinkReply(id) = env.body {
            let acked = self.links.get(&id).is_some_and(|c| {
                matches!(c.req, Request::Replicate { .. })
                    && matches!(&c.answer, Some(Ok(f)) if matches!(f.msg, Response::Ack))
            });
            if acked && self.shards[s].down.is_none() {
                self.trap(Point::BackupAcked, s);
            }
            self.link_reply(id);
            return Ok(());
        }
        // A push reaching its primary, a forwarded push its backup, a copy its new backup.
        let point = match &env.body {
            Body::Push { .. } => Some(Point::Pushed),
            Body::Call(id) => match self.links.get(id).map(|c| &c.req) {
                Some(Request::Push { .. }) => Some(Point::Pushed),
                Some(Request::Replicate { .. }) => Some(Point::AtBackup),
                Some(Request::CopyIn { .. }) => Some(Point::CopyArrives),
                _ => None,
            },
            _ => None,
        };
        if let Some(point) = point.filter(|_| self.shards[s].down.is_none())
            && self.trap(point, s)
        {
            return self.at_shard(s, env);
        }
        if self.shards[s].down.is_some() {
            match env.body {
                // It starts again from its checkpoint and the map the coordinator gives it
                // when it joins (once the coordinator is up).
                Body::ShardRestart if self.down_until.is_some() => {
                    self.at(self.now + TICK_MS, Node::Shard(s), 0, 0, Body::ShardRestart);
                }
                Body::ShardRestart => self.restart_shard(s)?,
                // What reaches a dead process fails with the connection.
                Body::Push { .. } => {
                    let (w, seq) = (env.worker, env.seq);
                    let t = self.now + CONNECTION_TIMEOUT_MS;
                    self.at(t, Node::Worker(w), w, seq, Body::Retry);
                }
                Body::Call(id) => self.link_failed(id),
                other => return Err(format!("shard {s} got {other:?} while down")),
            }
            return Ok(());
        }
        match env.body {
            Body::Push {
                id,
                clock,
                span,
                epoch,
                chunks,
            } => self.serve_push(s, (env.worker, env.seq), (id, clock, span, epoch), chunks),
            Body::Call(id) => self.serve_link(s, id),
            other => return Err(format!("shard {s} got {other:?}")),
        }
        Ok(())
    }

    /// Shard `s` restarts from its last checkpoint with the coordinator's map; the model forgets,
    /// as the shard does, what came after the checkpoint.
    pub(super) fn restart_shard(&mut self, s: usize) -> Result<(), String> {
        if self.replicated() {
            self.rejoin(s);
            return Ok(());
        }
        let (job, map) = self.coordinator.inspect(|st| (st.job().clone(), st.map()));
        let map = map.ok_or("the coordinator has no map")?;
        let ckpt = {
            let mut d = lock_disk(&self.disk);
            let ckpt = d.checkpoints[s]
                .clone()
                .ok_or("a shard without a checkpoint")?;
            for c in &ckpt.chunks {
                let kept = d.modelled[s].get(&Key(c.key)).cloned();
                d.model.insert(Key(c.key), kept.unwrap_or_default());
            }
            ckpt
        };
        let state = ShardState::restore(ShardId(s as u32), job, map, ckpt)
            .map_err(|e| format!("shard {s} cannot restore its checkpoint: {e}"))?;
        self.shards[s] = self.shard_server(s, state);
        self.note(format!("shard {s} restarted from its checkpoint"));
        Ok(())
    }

    /// Restarted shard `s` of a replicated job joins the coordinator, as `edl-ps shard` does
    /// (the coordinator first replaces it by its backups if its map still places it); it
    /// serves once answered ([`Sim::rejoined`]).
    pub(super) fn rejoin(&mut self, s: usize) {
        let peer = Peer::in_process(Role::Shard, &format!("s{s}"), JOB, addr(1, s));
        self.seq += 1;
        let call = self.seq;
        let (c, tx) = (self.coordinator.clone(), self.answers.clone());
        let task = tokio::spawn(async move {
            let req = Request::ShardJoin {
                addr: format!("sim:{s}"),
            };
            let resp = c.handle(&peer, req, Parts::default()).await.msg;
            let _ = tx.send(Answer {
                call,
                worker: ADMIN,
                seq: JOIN,
                clock: Clock(0),
                resp,
            });
        });
        self.calls.insert(call, (ADMIN, JOIN, task));
        self.joining.insert(call, s);
    }

    /// Shard `s` of a replicated job joined again: a standby if the map gives it nothing (its
    /// checkpoint not used), else restored from its checkpoint; the model forgets its copies.
    pub(super) fn rejoined(&mut self, s: usize, resp: Response) -> Result<(), String> {
        let Response::ShardAssigned { job, map, .. } = resp else {
            return Err(format!("shard {s}'s join was answered {resp:?}"));
        };
        let id = ShardId(s as u32);
        let standby = ShardState::rejoins_as_standby(&job, &map, id);
        let state = if standby {
            ShardState::new(id, job, map)
        } else {
            let ckpt = lock_disk(&self.disk).checkpoints[s].clone();
            let ckpt = ckpt.ok_or("a shard without a checkpoint")?;
            ShardState::restore(id, job, map.clone(), ckpt).map_err(|e| {
                format!("shard {s} cannot restore its checkpoint with map {map:?}: {e}")
            })?
        };
        let mut d = lock_disk(&self.disk);
        d.copies.retain(|(on, _), _| *on != s);
        for c in &self.keys {
            if state.param(c.key, 0).is_some() {
                d.copies.insert((s, c.key), None);
            }
        }
        drop(d);
        self.shards[s] = self.shard_server(s, state);
        let how = if standby {
            "as a standby"
        } else {
            "from its checkpoint"
        };
        self.note(format!("shard {s} rejoined {how}"));
        Ok(())
    }

    /// A worker's push reaches shard `s` (the simulation's own worker's).
    pub(super) fn serve_push(
        &mut self,
        s: usize,
        (slot, seq): (usize, u64),
        (id, clock, span, epoch): (WorkerId, Clock, DataSpan, MapEpoch),
        chunks: Vec<ChunkRef>,
    ) {
        let Some(token) = self.workers[slot].token else {
            return;
        };
        let floats: u32 = chunks.iter().map(|c| c.len).sum();
        let payload: Vec<u8> = (0..floats).flat_map(|_| (-1.0f32).to_le_bytes()).collect();
        let keys: Vec<Key> = chunks.iter().map(|c| c.key).collect();
        let req = Request::Push {
            epoch,
            worker: id,
            clock,
            chunks,
            span: Some(span),
            covers: Vec::new(),
            token,
        };
        let serving = Serving::Push {
            slot,
            seq,
            id,
            span,
            keys,
        };
        let payload = Parts(vec![Bytes::from(payload)]);
        self.serve(s, Node::Worker(slot), req, payload, serving);
    }

    /// A call over the network reaches shard `s`.
    pub(super) fn serve_link(&mut self, s: usize, id: u64) {
        // A request whose connection failed (the shard restarted since) was never served.
        let Some(call) = self.links.get(&id).filter(|c| c.answer.is_none()) else {
            return;
        };
        let (from, req, payload) = (call.from, call.req.clone(), call.payload.clone());
        self.serve(s, from, req, payload, Serving::Link(id));
    }

    /// Shard `s`'s service serves `req` from `from` in a task of its own. A push's task
    /// watches the pushed keys' counters around each step of the service, so the model learns,
    /// as it happens, which keys the push was applied to.
    pub(super) fn serve(
        &mut self,
        s: usize,
        from: Node,
        req: Request,
        payload: Parts,
        serving: Serving,
    ) {
        let peer = match from {
            Node::Worker(slot) => {
                Peer::in_process(Role::Worker, &format!("w{slot}"), JOB, addr(0, slot))
            }
            Node::Shard(n) => Peer::in_process(Role::Shard, &format!("s{n}"), JOB, addr(1, n)),
            Node::Coordinator => {
                Peer::in_process(Role::Coordinator, "coordinator", JOB, addr(3, 0))
            }
        };
        let pushed = match &req {
            Request::Push {
                chunks,
                span: Some(span),
                ..
            } => Some((chunks.iter().map(|c| c.key).collect::<Vec<Key>>(), *span)),
            _ => None,
        };
        // A replicated job's model follows every copy: any request may change one.
        let copies = self.replicated().then(|| {
            let batch = match &req {
                Request::Push {
                    span: Some(span), ..
                }
                | Request::Replicate {
                    span: Some(span), ..
                } => Some((span.epoch, span.start)),
                _ => None,
            };
            let source = match (&req, from) {
                (Request::CopyIn { .. }, Node::Shard(p)) => Some(p),
                _ => None,
            };
            (batch, source, self.keys.len() as u64)
        });
        self.seq += 1;
        let task_id = self.seq;
        let shard = &self.shards[s];
        let (service, state, disk) = (
            shard.service.clone(),
            shard.state.clone(),
            self.disk.clone(),
        );
        let tx = self.shard_answers.clone();
        let task = tokio::spawn(async move {
            let frame = if !service.allowed(peer.role, &req) {
                Frame::new(Response::error(ErrorCode::Forbidden, "not allowed"))
            } else if let Some((batch, source, keys)) = copies {
                let values = |st: &ShardState| -> Vec<Copy> {
                    (0..keys)
                        .map(|k| {
                            let primary = st.param(Key(k), 0).map(|v| (false, v));
                            primary.or_else(|| st.backup_param(Key(k), 0).map(|v| (true, v)))
                        })
                        .collect()
                };
                let mut serving = std::pin::pin!(service.handle(&peer, req, payload));
                std::future::poll_fn(|cx| {
                    let before = values(&state);
                    let step = serving.as_mut().poll(cx);
                    let after = values(&state);
                    if before != after {
                        lock_disk(&disk).changed(s, (&before, &after), batch, source);
                    }
                    step
                })
                .await
            } else if let Some((keys, span)) = pushed {
                let batch = (span.epoch, span.start);
                let counters = |st: &ShardState| -> Vec<Option<f32>> {
                    keys.iter().map(|&k| st.param(k, 0)).collect()
                };
                let mut serving = std::pin::pin!(service.handle(&peer, req, payload));
                std::future::poll_fn(|cx| {
                    let before = counters(&state);
                    let step = serving.as_mut().poll(cx);
                    let after = counters(&state);
                    for ((k, b), a) in keys.iter().zip(before).zip(after) {
                        if b.is_some() && a != b {
                            lock_disk(&disk).applied(s, *k, batch);
                        }
                    }
                    step
                })
                .await
            } else {
                service.handle(&peer, req, payload).await
            };
            let _ = tx.send(ShardAnswer {
                shard: s,
                task: task_id,
                frame,
            });
        });
        self.shards[s].tasks.insert(task_id, (serving, task));
    }

    /// A shard's task answered: a worker's push (acknowledged, or refused with the shard's
    /// map), or a call over the network.
    pub(super) fn shard_answered(&mut self, a: ShardAnswer) -> Result<(), String> {
        let Some((serving, _)) = self.shards[a.shard].tasks.remove(&a.task) else {
            return Ok(());
        };
        let (slot, seq, id, span, keys) = match serving {
            Serving::Link(id) => {
                let line = format!("shard {} answers call #{id}", a.shard);
                mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
                self.note(line);
                let failed = matches!(a.frame.msg, Response::Error { .. });
                if let Response::Error { code, .. } = &a.frame.msg
                    && ErrorCode::from_u16(*code) == Some(ErrorCode::Deposed)
                {
                    self.note(format!(
                        "shard {} refuses a deposed leader's order",
                        a.shard
                    ));
                    self.orders_refused += 1;
                }
                let req = self.links.get(&id).map(|c| c.req.clone());
                let mut acked = false;
                match req {
                    Some(Request::MoveOut { .. }) if failed => self.taken_back += 1,
                    Some(Request::Push {
                        worker,
                        chunks,
                        span: Some(span),
                        ..
                    }) if matches!(a.frame.msg, Response::Ack) => {
                        let keys: Vec<Key> = chunks.iter().map(|c| c.key).collect();
                        self.acknowledged(a.shard, worker, span, &keys)?;
                        acked = true;
                    }
                    _ => {}
                }
                self.answer_link(id, Ok(a.frame));
                if acked {
                    self.trap(Point::Acked, a.shard);
                }
                return Ok(());
            }
            Serving::Checkpoint => return Ok(()),
            Serving::Push {
                slot,
                seq,
                id,
                span,
                keys,
            } => (slot, seq, id, span, keys),
        };
        let line = format!("shard {} answers w{slot} #{seq}", a.shard);
        mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
        self.note(line);
        let answer = match CallError::answered(a.frame.msg) {
            Ok(Response::Ack) => {
                self.acknowledged(a.shard, id, span, &keys)?;
                Body::Pushed { keys, span }
            }
            Err(CallError::Remote {
                code: Some(ErrorCode::StaleEpoch),
                map: Some(map),
                ..
            }) => Body::Moved { span, map },
            Err(e) => {
                return Err(format!(
                    "shard {} refused {id}'s push of {span:?}: {e}",
                    a.shard
                ));
            }
            Ok(other) => return Err(format!("shard {} answered a push {other:?}", a.shard)),
        };
        let acked = matches!(answer, Body::Pushed { .. });
        self.send(Node::Shard(a.shard), Node::Worker(slot), slot, seq, answer);
        if acked {
            self.trap(Point::Acked, a.shard);
        }
        Ok(())
    }

    /// An operator asks the coordinator to move a range `Scripted::Move(n, m)` names (from its
    /// map now) to another shard.
    pub(super) fn operator_move(&mut self, n: usize, m: usize) {
        let Some(map) = self.coordinator.inspect(|st| st.map()) else {
            return;
        };
        let shards = self.shards.len();
        let Some(r) = map.ranges.get(n % map.ranges.len().max(1)).copied() else {
            return;
        };
        let to = (r.shard.0 as usize + 1 + m % (shards - 1).max(1)) % shards;
        let len = r.end - r.start;
        let start = r.start + (n as u64 / 7) % len;
        let end = (start + 1 + (n as u64 / 3) % len).min(r.end);
        self.note(format!("operator: move {start}..{end} to s{to}"));
        let req = Request::MoveRange {
            start,
            end,
            to: format!("s{to}"),
        };
        self.call(ADMIN, MOVE, Clock(0), req);
    }
}
