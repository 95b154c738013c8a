//! A generic request server: accepts QUIC connections, checks the peer certificate's role,
//! requires the version handshake, then runs one service call per bidirectional stream.
//!
//! Services stay plain: they see a decoded request and the authenticated peer, and return a
//! response. Malformed frames, forbidden roles and version mismatches are answered here with a
//! stable error code and never reach the service.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::shutdown::CancellationToken;
use bytes::Bytes;
use edl_proto::{ErrorCode, Frame, FrameLimits, PROTOCOL_VERSION, Parts, Request, Response};
use quinn::{Endpoint, VarInt};
use tracing::{debug, info, warn};

use crate::pki::{Role, subject_of};
use crate::transport::{read_frame, write_frame};

/// The authenticated peer of a request.
#[derive(Clone, Debug)]
pub struct Peer {
    /// Its role, read from its certificate.
    pub role: Role,
    /// Its name, read from its certificate.
    pub name: String,
    /// Its address.
    pub addr: SocketAddr,
}

/// A request handler.
pub trait Service: Send + Sync + 'static {
    /// Whether `role` may make `req`. Refused requests get [`ErrorCode::Forbidden`].
    fn allowed(&self, role: Role, req: &Request) -> bool;

    /// Handles one request. Errors are returned as `Response::Error`. The answer's payload may
    /// be several buffers, sent without being joined.
    fn handle(
        &self,
        peer: &Peer,
        req: Request,
        payload: Bytes,
    ) -> impl Future<Output = Frame<Response, Parts>> + Send;
}

/// Serves `service` on `endpoint` until `shutdown` is cancelled.
pub async fn serve<S: Service>(
    endpoint: Endpoint,
    service: Arc<S>,
    limits: FrameLimits,
    shutdown: CancellationToken,
) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => {
                    let service = service.clone();
                    let shutdown = shutdown.clone();
                    conns.spawn(async move {
                        connection(incoming, service, limits, shutdown).await;
                    });
                }
                None => break,
            },
            // Reap finished connection tasks so the set does not grow without bound.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    endpoint.close(VarInt::from_u32(0), b"shutting down");
    conns.abort_all();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), endpoint.wait_idle()).await;
}

async fn connection<S: Service>(
    incoming: quinn::Incoming,
    service: Arc<S>,
    limits: FrameLimits,
    shutdown: CancellationToken,
) {
    let addr = incoming.remote_address();
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            // This is where a peer without a cluster-signed certificate ends up.
            warn!(%addr, error = %e, "refused connection");
            return;
        }
    };
    let peer = match peer_of(&conn, addr) {
        Ok(p) => p,
        Err(why) => {
            warn!(%addr, %why, "refused peer");
            conn.close(
                VarInt::from_u32(ErrorCode::Forbidden.as_u16().into()),
                why.as_bytes(),
            );
            return;
        }
    };
    debug!(%addr, role = %peer.role, name = %peer.name, "connected");
    // The first stream must carry the version handshake.
    match conn.accept_bi().await {
        Ok((mut send, mut recv)) => {
            let reply = match read_frame::<Request>(&mut recv, &limits).await {
                Ok(Frame {
                    msg: Request::Hello { version, .. },
                    ..
                }) if version == PROTOCOL_VERSION => Response::Hello {
                    version: PROTOCOL_VERSION,
                    role: peer.role.to_string(),
                },
                Ok(Frame {
                    msg: Request::Hello { version, .. },
                    ..
                }) => Response::error(
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "protocol version {version} not supported; this server speaks {PROTOCOL_VERSION}"
                    ),
                ),
                Ok(_) => Response::error(
                    ErrorCode::HandshakeRequired,
                    "the first request must be Hello",
                ),
                Err(e) => Response::error(read_error_code(&e), e.to_string()),
            };
            let ok = matches!(reply, Response::Hello { .. });
            let _ = write_frame(&mut send, Frame::<_>::new(reply)).await;
            if !ok {
                // Let the error response reach the peer before closing.
                let _ = send.stopped().await;
                conn.close(
                    VarInt::from_u32(ErrorCode::HandshakeRequired.as_u16().into()),
                    b"handshake failed",
                );
                return;
            }
        }
        Err(e) => {
            debug!(%addr, error = %e, "closed before handshake");
            return;
        }
    }
    let peer = Arc::new(peer);
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = conn.accept_bi() => a,
            Some(_) = streams.join_next(), if !streams.is_empty() => continue,
        };
        let (mut send, mut recv) = match accepted {
            Ok(s) => s,
            Err(e) => {
                debug!(%addr, error = %e, "connection ended");
                break;
            }
        };
        let service = service.clone();
        let peer = peer.clone();
        streams.spawn(async move {
            let reply = match read_frame::<Request>(&mut recv, &limits).await {
                Err(e) => Frame::new(Response::error(read_error_code(&e), e.to_string())),
                Ok(f) if matches!(f.msg, Request::Hello { .. }) => Frame::new(Response::error(
                    ErrorCode::InvalidRequest,
                    "repeated handshake",
                )),
                Ok(f) if !service.allowed(peer.role, &f.msg) => Frame::new(Response::error(
                    ErrorCode::Forbidden,
                    format!("role {} may not send this request", peer.role),
                )),
                Ok(f) => service.handle(&peer, f.msg, f.payload).await,
            };
            if let Err(e) = write_frame(&mut send, reply).await {
                debug!(error = %e, "could not send response");
            }
        });
    }
    streams.abort_all();
    info!(%addr, name = %peer.name, "disconnected");
}

/// The wire code for a request that could not be read.
fn read_error_code(e: &crate::transport::CallError) -> ErrorCode {
    match e {
        crate::transport::CallError::Proto(p) => p.code(),
        _ => ErrorCode::Malformed,
    }
}

fn peer_of(conn: &quinn::Connection, addr: SocketAddr) -> Result<Peer, String> {
    let certs = conn
        .peer_identity()
        .and_then(|any| {
            any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or("no client certificate")?;
    let leaf = certs.first().ok_or("empty certificate chain")?;
    let (role, name) = subject_of(leaf).map_err(|e| e.to_string())?;
    Ok(Peer { role, name, addr })
}
