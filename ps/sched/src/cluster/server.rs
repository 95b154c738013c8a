//! The scheduler's network face: the generic request server (QUIC, mutual TLS, version
//! handshake, budgets) with a service that passes scheduler requests, and who sent them, to
//! the scheduler's loop and returns its answer.

use edl_shared::Role;
use edl_shared::proto::sched::{SchedRequest, SchedResponse};
use edl_shared::proto::{ErrorCode, Frame, Parts, Request, Response};
use edl_shared::server::{Peer, Service};
use tokio::sync::{mpsc, oneshot};

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
}

impl SchedService {
    /// A service handing requests to `tx`.
    pub fn new(tx: mpsc::Sender<Ask>) -> SchedService {
        SchedService { tx }
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
