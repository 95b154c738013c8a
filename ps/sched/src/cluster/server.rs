//! The scheduler's network face: the generic request server (QUIC, mutual TLS, version
//! handshake, budgets) with a service that passes scheduler requests, and who sent them, to
//! the scheduler's loop and returns its answer.

use edl_shared::Role;
use edl_shared::proto::sched::{SchedRequest, SchedResponse};
use edl_shared::proto::{ErrorCode, Frame, Parts, Request, Response};
use edl_shared::server::{Peer, Service};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{mpsc, oneshot, watch};

/// A request for the scheduler's loop.
#[derive(Debug)]
pub struct Ask {
    /// What was asked.
    pub req: SchedRequest,
    /// The name in the asker's (admin) certificate.
    pub who: String,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<SchedResponse, (ErrorCode, String)>>,
}

/// The scheduler's service.
#[derive(Debug)]
pub struct SchedService {
    tx: mpsc::Sender<Ask>,
    /// With an election (`edl-sched --meta`): whether this scheduler leads yet, and who does
    /// while it stands by.
    election: Option<(AtomicBool, watch::Receiver<Option<String>>)>,
}

impl SchedService {
    /// A service handing requests to `tx`.
    pub fn new(tx: mpsc::Sender<Ask>) -> SchedService {
        SchedService { tx, election: None }
    }

    /// A service of a scheduler that stands by until [`SchedService::lead`]: meanwhile it
    /// answers `NotLeader`, naming the leader `standby` holds, and clients move on to it.
    pub fn standby(tx: mpsc::Sender<Ask>, standby: watch::Receiver<Option<String>>) -> Self {
        SchedService {
            tx,
            election: Some((AtomicBool::new(false), standby)),
        }
    }

    /// This scheduler leads: requests go to its loop from now on.
    pub fn lead(&self) {
        if let Some((leading, _)) = &self.election {
            leading.store(true, Ordering::Release);
        }
    }
}

impl Service for SchedService {
    fn allowed(&self, role: Role, req: &Request) -> bool {
        match req {
            Request::Sched(_) => role == Role::Admin,
            _ => true,
        }
    }

    async fn handle(&self, peer: &Peer, req: Request, _payload: Parts) -> Frame<Response, Parts> {
        if let Some((leading, standby)) = &self.election
            && !leading.load(Ordering::Acquire)
        {
            return Frame::new(Response::NotLeader {
                leader: standby.borrow().clone(),
            });
        }
        let Request::Sched(req) = req else {
            return Frame::new(Response::error(
                ErrorCode::InvalidRequest,
                format!(
                    "{} is not a scheduler request: this is edl-sched, not a job's coordinator \
                     or shard",
                    req.name()
                ),
            ));
        };
        let (reply, answer) = oneshot::channel();
        let ask = Ask {
            req,
            who: peer.name.clone(),
            reply,
        };
        if self.tx.send(ask).await.is_err() {
            return Frame::new(Response::error(
                ErrorCode::ShuttingDown,
                "the scheduler is stopping",
            ));
        }
        Frame::new(match answer.await {
            Ok(Ok(r)) => Response::Sched(r),
            Ok(Err((code, message))) => Response::error(code, message),
            Err(_) => Response::error(ErrorCode::ShuttingDown, "the scheduler is stopping"),
        })
    }
}
