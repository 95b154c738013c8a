//! The simulated network: nodes, messages and timers, their delivery (delays, losses,
//! duplicates, partitions, filters), and the calls the real services make through it
//! (`SimLink` between coordinator and shards, `SimNet` for the real client).

use super::*;

/// Where a message goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Node {
    Coordinator,
    Shard(usize),
    Worker(usize),
}

/// A message or a timer.
#[derive(Clone, Debug)]
pub(super) enum Body {
    Register,
    NextPartition(WorkerId),
    Clock {
        id: WorkerId,
        clock: Clock,
        span: DataSpan,
    },
    Heartbeat(WorkerId),
    Leave(WorkerId),
    Push {
        id: WorkerId,
        clock: Clock,
        span: DataSpan,
        epoch: MapEpoch,
        chunks: Vec<ChunkRef>,
    },
    Registered {
        id: WorkerId,
        clock: Clock,
        map: Box<ShardMap>,
        token: Token,
    },
    Leased {
        part: Option<Partition>,
        clock: Clock,
    },
    Granted {
        drain: bool,
    },
    Beat {
        drain: bool,
    },
    Pushed {
        keys: Vec<Key>,
        span: DataSpan,
    },
    /// A worker asks the coordinator for its map (a shard refused a push with an older one).
    GetMap,
    /// The coordinator's map.
    FreshMap(Box<ShardMap>),
    /// A push refused with the shard's map: route again.
    Moved {
        span: DataSpan,
        map: Box<ShardMap>,
    },
    /// A server's request (the coordinator's, or a shard's hand-off) reaches a shard
    /// (`links[id]`).
    Call(u64),
    /// A shard's answer to a server's request (`links[id]`) reaches the caller.
    LinkReply(u64),
    Refused(String),
    /// The coordinator's long poll timed out: ask again.
    NotReady,
    Left,
    Retry,
    /// A worker of a replicated job routes its push again (with the map it has now): its
    /// retry after a failed push asks the coordinator for the map first.
    Route,
    ConnectionLost,
    HeartbeatDue,
    Tick,
    Restart,
    /// A worker's compute for its batch is done: it pushes.
    Computed,
    /// The placer starts a worker for placement `id`.
    Place(u64),
    /// A crashed shard starts again from its checkpoint.
    ShardRestart,
    Script(Scripted),
}

impl Body {
    /// The kind of request a message is or answers, and whether it is an answer.
    pub(super) fn kind(&self) -> Option<(Kind, bool)> {
        Some(match self {
            Body::Register => (Kind::Register, false),
            Body::Registered { .. } => (Kind::Register, true),
            Body::NextPartition(_) => (Kind::Lease, false),
            Body::Leased { .. } => (Kind::Lease, true),
            Body::Clock { .. } => (Kind::Clock, false),
            Body::Granted { .. } => (Kind::Clock, true),
            Body::Heartbeat(_) => (Kind::Heartbeat, false),
            Body::Beat { .. } => (Kind::Heartbeat, true),
            Body::Leave(_) => (Kind::Leave, false),
            Body::Left => (Kind::Leave, true),
            Body::Push { .. } => (Kind::Push, false),
            Body::Pushed { .. } | Body::Moved { .. } => (Kind::Push, true),
            _ => return None,
        })
    }
}

/// One delivery: to whom, from which worker (for answers and worker timers), the request it
/// belongs to, and what.
#[derive(Clone, Debug)]
pub(super) struct Envelope {
    pub(super) to: Node,
    pub(super) worker: usize,
    pub(super) seq: u64,
    pub(super) body: Body,
}

/// A coordinator call's answer, from the task that served it.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) call: u64,
    /// The worker slot that asked ([`ADMIN`] for an operator).
    pub(super) worker: usize,
    pub(super) seq: u64,
    /// The clock a `Clock` request committed.
    pub(super) clock: Clock,
    pub(super) resp: Response,
}

/// The caller slot of an operator's requests.
pub(super) const ADMIN: usize = usize::MAX;

/// The caller slot of a call over the network (its request number is the call's id).
pub(super) const LINK: usize = usize::MAX - 1;

/// The request number of an operator's drain and move requests.
pub(super) const DRAIN: u64 = 0;

pub(super) const MOVE: u64 = 1;

/// The coordinator's settling of a move after a restart (a task of its own, no answer).
pub(super) const RESUME: u64 = 2;

/// A restarted shard of a replicated job joining the coordinator.
pub(super) const JOIN: u64 = 3;

/// A call over a connection of the simulated network: a server's to a shard (the
/// coordinator's, or a shard's hand-off) through [`SimLink`], or a real client's to the
/// coordinator or a shard through [`SimNet`].
pub(super) struct LinkCall {
    /// The caller and the server.
    pub(super) from: Node,
    pub(super) to: Node,
    pub(super) req: Request,
    pub(super) payload: Parts,
    /// Where the answer goes (gone if the caller crashed since).
    pub(super) reply: ReplyTo,
    /// The answer, once the server gave it, travelling back.
    pub(super) answer: Option<Answered>,
}

/// A server's answer as its caller gets it.
pub(super) type Answered = Result<Frame<Response, Parts>, CallError>;

/// A server's way to the shards in the simulation: each call is a message the simulation
/// delivers (or loses) and answers.
pub(super) struct SimLink {
    pub(super) from: Node,
    pub(super) calls: tokio::sync::mpsc::UnboundedSender<Outgoing>,
}

/// Where a shard's answer to a server goes.
pub(super) type ReplyTo = tokio::sync::oneshot::Sender<Answered>;

/// A server's call to a shard as it leaves the server: the caller, the shard's address, the
/// request and its payload, where the answer goes.
pub(super) type Outgoing = (Node, String, Request, Parts, ReplyTo);

impl ShardLink for SimLink {
    fn answers<'a>(&'a self, addr: &'a str) -> LinkFuture<'a, bool> {
        Box::pin(async move {
            self.call(addr, Request::GetMap, Parts::default())
                .await
                .is_ok()
        })
    }

    fn call<'a>(
        &'a self,
        addr: &'a str,
        req: Request,
        payload: Parts,
    ) -> LinkFuture<'a, Result<Response, CallError>> {
        Box::pin(async move {
            let frame = call(&self.calls, self.from, addr, req, payload).await?;
            CallError::answered(frame.msg)
        })
    }
}

/// One call through the simulated network, answered when the simulation delivers the answer.
async fn call(
    calls: &tokio::sync::mpsc::UnboundedSender<Outgoing>,
    from: Node,
    addr: &str,
    req: Request,
    payload: Parts,
) -> Answered {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let gone = || CallError::Address(format!("{addr}: the simulation ended"));
    calls
        .send((from, addr.to_string(), req, payload, tx))
        .map_err(|_| gone())?;
    rx.await.map_err(|_| gone())?
}

/// A real client's way to the servers in the simulation: its connections pass each call as a
/// message the simulation delivers (or loses, as a connection that fails).
#[derive(Debug)]
pub(super) struct SimNet {
    pub(super) from: Node,
    pub(super) calls: tokio::sync::mpsc::UnboundedSender<Outgoing>,
    /// Addresses whose process is down ([`Standby::down`]).
    pub(super) down: Option<Arc<std::sync::Mutex<BTreeSet<String>>>>,
}

/// A connection of [`SimNet`].
#[derive(Debug)]
pub(super) struct SimConn {
    pub(super) from: Node,
    pub(super) addr: String,
    pub(super) calls: tokio::sync::mpsc::UnboundedSender<Outgoing>,
}

impl LocalNet for SimNet {
    fn connect<'a>(
        &'a self,
        addr: &'a str,
        _name: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn LocalConn>, CallError>> {
        let conn = SimConn {
            from: self.from,
            addr: addr.to_string(),
            calls: self.calls.clone(),
        };
        let down = (self.down.as_ref())
            .is_some_and(|d| d.lock().unwrap_or_else(|p| p.into_inner()).contains(addr));
        Box::pin(async move {
            // A handshake with an address no process listens at times out.
            if down {
                tokio::time::sleep(Duration::from_millis(CONNECTION_TIMEOUT_MS)).await;
                return Err(CallError::Connection(quinn::ConnectionError::TimedOut));
            }
            Ok(Arc::new(conn) as Arc<dyn LocalConn>)
        })
    }
}

impl LocalConn for SimConn {
    fn call(&self, req: Request, payload: Parts) -> BoxFuture<'_, Answered> {
        Box::pin(call(&self.calls, self.from, &self.addr, req, payload))
    }
}

/// The kind of a client's request, for filters.
pub(super) fn kind_of(req: &Request) -> Option<Kind> {
    Some(match req {
        Request::Register { .. } => Kind::Register,
        Request::NextPartition { .. } => Kind::Lease,
        Request::Clock { .. } => Kind::Clock,
        Request::Heartbeat { .. } => Kind::Heartbeat,
        Request::Leave { .. } => Kind::Leave,
        Request::Push { .. } => Kind::Push,
        _ => return None,
    })
}

impl Sim {
    /// Schedules a delivery at virtual time `t`.
    pub(super) fn at(&mut self, t: u64, to: Node, worker: usize, seq: u64, body: Body) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.pending.insert(
            self.seq,
            Envelope {
                to,
                worker,
                seq,
                body,
            },
        );
    }

    /// Sends over the network: delayed (so messages overtake each other), maybe lost, maybe
    /// (a push) delivered twice. QUIC streams neither lose nor repeat a message: a loss is the
    /// connection failing, which the worker notices after a timeout, and then repeats the
    /// call on a new connection, as the client does by default (with `give_up`, a
    /// coordinator call lost so ends the worker instead: it exits and its lease expires).
    pub(super) fn send(&mut self, from: Node, to: Node, worker: usize, seq: u64, body: Body) {
        let faulty = self.faulty();
        let push = matches!(
            body,
            Body::Push { .. }
                | Body::Pushed { .. }
                | Body::Moved { .. }
                | Body::GetMap
                | Body::FreshMap(_)
        );
        let heartbeat = matches!(body, Body::Heartbeat(_) | Body::Beat { .. });
        let cut = self.cut(from) || self.cut(to) || self.filtered(&body);
        if cut || (faulty && self.rng.random_bool(self.scenario.loss)) {
            self.lost += 1;
            let why = if cut { "cut" } else { "lost" };
            self.note(format!("{why} {to:?} <- w{worker} {body:?}"));
            // A heartbeat's connection failing is noticed at the next call.
            if !heartbeat {
                let then = if push {
                    Body::Retry
                } else {
                    Body::ConnectionLost
                };
                self.at(
                    self.now + CONNECTION_TIMEOUT_MS,
                    Node::Worker(worker),
                    worker,
                    seq,
                    then,
                );
            }
            return;
        }
        let copies = if faulty && push && self.rng.random_bool(self.scenario.duplicate) {
            self.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = self.rng.random_range(1..=self.scenario.max_delay_ms.max(1));
            self.at(self.now + delay, to, worker, seq, body.clone());
        }
    }

    /// Whether `node` is partitioned from the others, or (a shard) down, now.
    pub(super) fn cut(&self, node: Node) -> bool {
        let now = self.now;
        self.cuts.iter().any(|&(n, until)| n == node && now < until)
            || matches!(node, Node::Shard(s) if self.shards[s].down.is_some())
    }

    /// Whether a filter drops `body` now.
    pub(super) fn filtered(&self, body: &Body) -> bool {
        let Some((kind, answer)) = body.kind() else {
            return false;
        };
        let now = self.now;
        self.filters
            .iter()
            .any(|&(k, answers, until)| k == kind && answers == answer && now < until)
    }

    /// A call over the network: the request travels (or its connection fails). Every map a
    /// call carries is one some node adopts. A real client's call may be lost, its answer too,
    /// at random while faults last, and is dropped by a filter of its kind.
    pub(super) fn link_call(
        &mut self,
        from: Node,
        addr: &str,
        req: Request,
        payload: Parts,
        reply: ReplyTo,
    ) -> Result<(), String> {
        self.seq += 1;
        let id = self.seq;
        // A client's call to the address that does not lead is the standby's to answer.
        let standby = match (&self.standby, from) {
            (Some(sb), Node::Worker(_)) => (COORDINATORS.iter().position(|a| *a == addr))
                .filter(|&i| i != sb.leads)
                .map(|_| COORDINATORS[sb.leads].to_string()),
            _ => None,
        };
        let to = match addr.strip_prefix("sim:") {
            Some("coordinator" | "standby") => Some(Node::Coordinator),
            Some(n) => (n.parse::<usize>().ok())
                .filter(|&n| n < self.shards.len())
                .map(Node::Shard),
            None => None,
        };
        let line = match &req {
            Request::SetMap { map, .. }
            | Request::CopyOut { map, .. }
            | Request::CopyIn { map, .. }
            | Request::MoveOut { map, .. }
            | Request::MoveIn { map, .. } => {
                format!(
                    "{from:?} calls {addr} #{id}: {} ({})",
                    req.name(),
                    map.epoch
                )
            }
            _ => format!("{from:?} calls {addr} #{id}: {}", req.name()),
        };
        mix(&mut self.digest, format!("{} {line}", self.now).as_bytes());
        self.note(line);
        let Some(to) = to else {
            let _ = reply.send(Err(CallError::Address(format!("no server at {addr}"))));
            return Ok(());
        };
        if let Request::SetMap { map, .. }
        | Request::MoveOut { map, .. }
        | Request::MoveIn { map, .. }
        | Request::CopyOut { map, .. }
        | Request::CopyIn { map, .. } = &req
        {
            self.saw_map(map)?;
        }
        // A primary sending a push to a backup, or a copy to a new backup, may crash as soon
        // as it sent it.
        let sent = match (&req, from) {
            (Request::Replicate { .. }, Node::Shard(p)) => Some((Point::Forwarded, p)),
            (Request::CopyIn { .. }, Node::Shard(p)) => Some((Point::CopySent, p)),
            _ => None,
        };
        let lost = self.lost_call(from, &req, false);
        self.links.insert(
            id,
            LinkCall {
                from,
                to,
                req,
                payload,
                reply,
                answer: None,
            },
        );
        // A paused leader answers no client (a killed one's calls fail where it is served).
        let paused = standby.is_none()
            && self.killed.is_none()
            && matches!(from, Node::Worker(_))
            && self.standby.as_ref().is_some_and(Standby::leader_is_down);
        if lost || paused || self.cut(from) || self.cut(to) {
            self.link_failed(id);
        } else if let Some(leader) = standby {
            let answer = Response::NotLeader {
                leader: Some(leader),
            };
            self.answer_link(id, Ok(Frame::new(answer)));
        } else {
            let delay = self.delay();
            self.at(self.now + delay, to, 0, id, Body::Call(id));
        }
        if let Some((point, p)) = sent {
            self.trap(point, p);
        }
        Ok(())
    }

    /// Whether a real client's call (or, with `answer`, its answer) is lost: at random while
    /// faults last, or by a filter of its kind.
    pub(super) fn lost_call(&mut self, from: Node, req: &Request, answer: bool) -> bool {
        if !matches!(from, Node::Worker(_)) {
            return false;
        }
        let now = self.now;
        let filtered = kind_of(req).is_some_and(|kind| {
            (self.filters.iter()).any(|&(k, a, until)| k == kind && a == answer && now < until)
        });
        filtered || (self.faulty() && self.rng.random_bool(self.scenario.loss))
    }

    /// The call `id` fails with its connection, after the timeout.
    pub(super) fn link_failed(&mut self, id: u64) {
        if let Some(call) = self.links.get_mut(&id)
            && call.answer.is_none()
        {
            let why = format!("{:?} did not answer", call.to);
            call.answer = Some(Err(CallError::Connection(quinn::ConnectionError::TimedOut)));
            let (t, to) = (self.now + CONNECTION_TIMEOUT_MS, call.from);
            self.at(t, to, 0, id, Body::LinkReply(id));
            self.lost += 1;
            self.note(format!("call #{id} fails: {why}"));
        }
    }

    /// A server answers call `id`: the answer travels back.
    pub(super) fn answer_link(&mut self, id: u64, answer: Answered) {
        let Some((from, to, req)) = (self.links.get(&id)).map(|c| (c.from, c.to, c.req.clone()))
        else {
            return;
        };
        // With `mid_move`, a server's answer across a partition is lost: the caller does not
        // learn what the shard did (a move's outcome unknown to it). A client's always is.
        let across = self.cut(from) || self.cut(to);
        let client = matches!(from, Node::Worker(_));
        if (across && (self.mid_move || client)) || self.lost_call(from, &req, true) {
            self.link_failed(id);
            return;
        }
        if self.links.get(&id).is_some_and(|c| c.answer.is_none()) {
            let delay = self.delay();
            if let Some(call) = self.links.get_mut(&id) {
                call.answer = Some(answer);
            }
            self.at(self.now + delay, from, 0, id, Body::LinkReply(id));
        }
    }

    /// The answer to call `id` reaches its caller (if the caller's task is still there).
    pub(super) fn link_reply(&mut self, id: u64) {
        if let Some(call) = self.links.remove(&id) {
            let answer = call
                .answer
                .unwrap_or_else(|| Err(CallError::Address("no answer".into())));
            let _ = call.reply.send(answer);
        }
    }

    /// A network delay.
    pub(super) fn delay(&mut self) -> u64 {
        self.rng.random_range(1..=self.scenario.max_delay_ms.max(1))
    }

    /// The coordinator's process ends, or (`orphan`) it is deposed and runs on: the calls it
    /// was serving fail with their connections, their tasks aborted or their answers lost.
    pub(super) fn end_calls(&mut self, orphan: bool) {
        for (call, (worker, seq, task)) in std::mem::take(&mut self.calls) {
            // A restarted shard's join fails with the connection: it joins again.
            if let Some(s) = self.joining.remove(&call) {
                self.at(self.now + TICK_MS, Node::Shard(s), 0, 0, Body::ShardRestart);
            }
            if orphan {
                self.orphans.insert(call);
            } else {
                task.abort();
            }
            if worker == LINK {
                self.link_failed(seq);
            } else if worker != ADMIN {
                let t = self.now + CONNECTION_TIMEOUT_MS;
                self.at(t, Node::Worker(worker), worker, seq, Body::ConnectionLost);
            }
        }
    }

    /// A worker's (or with [`ADMIN`], an operator's) call to the coordinator: its service
    /// serves it in a task of its own, which reports the answer when it has one.
    pub(super) fn call(&mut self, worker: usize, seq: u64, clock: Clock, req: Request) {
        let peer = if worker == ADMIN {
            Peer::in_process(Role::Admin, "operator", JOB, addr(2, 0))
        } else {
            Peer::in_process(Role::Worker, &format!("w{worker}"), JOB, addr(0, worker))
        };
        self.seq += 1;
        let call = self.seq;
        let (c, tx) = (self.coordinator.clone(), self.answers.clone());
        let task = tokio::spawn(async move {
            let resp = c.handle(&peer, req, Parts::default()).await.msg;
            let _ = tx.send(Answer {
                call,
                worker,
                seq,
                clock,
                resp,
            });
        });
        self.calls.insert(call, (worker, seq, task));
    }
}
