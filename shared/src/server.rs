//! A generic request server: accepts QUIC connections, checks the peer certificate's role,
//! requires the version handshake, then runs one service call per bidirectional stream.
//!
//! Services stay plain: they see a decoded request and the authenticated peer, and return a
//! response. Malformed frames, forbidden roles and version mismatches are answered here with a
//! stable error code and never reach the service.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use crate::metrics::{self, Counter, Family, Histogram};
use crate::shutdown::CancellationToken;
use edl_proto::{ErrorCode, Frame, FrameLimits, PROTOCOL_VERSION, Parts, Request, Response};
use quinn::{Endpoint, VarInt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::pki::{Role, Subject, subject_of};
use crate::transport::{
    CallError, TransportSettings, WITHDRAWN, read_frame, read_frame_body, read_prefix, write_frame,
};

/// The authenticated peer of a request.
#[derive(Clone, Debug)]
pub struct Peer {
    /// Its role, read from its certificate.
    pub role: Role,
    /// Its name, read from its certificate.
    pub name: String,
    /// Its job, read from its certificate.
    pub job: String,
    /// Its address.
    pub addr: SocketAddr,
    /// The bytes in flight on the server it reached.
    pub server: ServerBytes,
}

impl Peer {
    /// A peer calling a service in-process, without a connection (the deterministic
    /// simulation drives services so): as if authenticated as `role` and `name` of `job` from
    /// `addr`, on a server with no bytes in flight.
    pub fn in_process(role: Role, name: &str, job: &str, addr: SocketAddr) -> Peer {
        Peer {
            role,
            name: name.to_string(),
            job: job.to_string(),
            addr,
            server: ServerBytes {
                permits: Arc::new(Semaphore::new(1)),
                total_kib: 1,
            },
        }
    }
}

/// A request handler.
pub trait Service: Send + Sync + 'static {
    /// Whether `role` may make `req`. Refused requests get [`ErrorCode::Forbidden`].
    fn allowed(&self, role: Role, req: &Request) -> bool;

    /// Handles one request. Errors are returned as `Response::Error`. The request's payload
    /// is the parts it arrived in, uncopied (a push's gradients already checked finite); the
    /// answer's payload may be several buffers, sent without being joined.
    fn handle(
        &self,
        peer: &Peer,
        req: Request,
        payload: Parts,
    ) -> impl Future<Output = Frame<Response, Parts>> + Send;
}

/// Limits a server enforces on its peers, so that no peer, authenticated or not, can make it
/// hold unbounded memory or connections. Every limit is a named setting; see docs/src/limits.md
/// (the budgets' table: docs/src/reference.md).
#[derive(Clone, Debug)]
pub struct Budgets {
    /// Bytes of request frames (as their prefixes announce them) being received or handled
    /// at once on one connection. A frame that would pass it is refused with
    /// [`ErrorCode::Busy`] before anything is allocated for it. At least one largest frame.
    pub conn_bytes: u64,
    /// Bytes of request frames being received or handled at once on the whole server. A frame
    /// that would pass it is refused with [`ErrorCode::Busy`] at once, and its stream is
    /// stopped, so that QUIC drops what the peer sent of it instead of buffering it (a
    /// frame made to wait would sit in QUIC's receive buffers, outside the budget). Nothing
    /// of a refused request was done, so clients retry it after a pause.
    pub server_bytes: u64,
    /// Requests served at once on one connection (QUIC's concurrent bidirectional streams).
    pub streams: u32,
    /// Connections held at once by one identity (role and certificate name).
    pub conns_per_identity: u32,
    /// Connections held at once in all.
    pub conns: u32,
    /// Time a new connection has to complete the version handshake.
    pub hello_timeout: Duration,
    /// Time a request frame has to arrive in full once it started.
    pub frame_timeout: Duration,
    /// A connection that sends no request for this long is closed (keep-alives do not
    /// count); clients reconnect when they need to.
    pub idle_timeout: Duration,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            conn_bytes: 1 << 30,
            server_bytes: 2 << 30,
            streams: 256,
            conns_per_identity: 256,
            conns: 4096,
            hello_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// Size limits of the handshake frame.
const HELLO_LIMITS: FrameLimits = FrameLimits {
    max_header: 4096,
    max_payload: 0,
};

/// Bytes in flight on the whole server, in KiB permits (a semaphore counts in `u32`): every
/// frame from the moment its prefix announced it until it was handled.
#[derive(Clone, Debug)]
pub struct ServerBytes {
    permits: Arc<Semaphore>,
    total_kib: u32,
}

impl ServerBytes {
    /// The bytes of every frame being received or handled now, in whole KiB per frame.
    pub fn in_flight(&self) -> u64 {
        let free = self
            .permits
            .available_permits()
            .min(self.total_kib as usize) as u64;
        (u64::from(self.total_kib) - free) * 1024
    }
}

fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// The budget a frame holds while it is received and handled; released on drop.
struct Charge {
    _server: Option<OwnedSemaphorePermit>,
    conn: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.conn.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Connections per identity, counted while they are open.
type IdentityCounts = Arc<Mutex<HashMap<(Role, String), u32>>>;

/// One open connection of an identity; uncounted on drop.
struct IdentitySlot {
    counts: IdentityCounts,
    key: (Role, String),
}

impl Drop for IdentitySlot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = c.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.key);
            }
        }
    }
}

/// The request server's metrics (every server of the process counts in them).
struct ServerMetrics {
    requests: Family<metrics::Fixed<1>, Counter>,
    bytes: Family<metrics::Fixed<2>, Counter>,
    seconds: Family<metrics::Fixed<1>, Histogram, fn() -> Histogram>,
    errors: metrics::Counters,
    connections: metrics::Gauge,
    in_flight: metrics::Gauge,
    budget: metrics::Gauge,
}

static METRICS: LazyLock<ServerMetrics> = LazyLock::new(|| ServerMetrics {
    requests: metrics::register("requests", "Requests served, by kind.", Family::default()),
    bytes: metrics::register(
        "request_bytes",
        "Frame bytes received (in) and sent (out), by request kind.",
        Family::default(),
    ),
    seconds: metrics::register(
        "request_seconds",
        "Time from a request's arrival to its answer, by kind (a push: its application; \
         a long poll: the wait).",
        Family::new_with_constructor(metrics::seconds_histogram),
    ),
    errors: metrics::counters("errors", "Error answers, by wire code."),
    connections: metrics::gauge("connections", "Open client connections."),
    in_flight: metrics::gauge(
        "bytes_in_flight",
        "Request bytes received and not yet handled (charged against the budget).",
    ),
    budget: metrics::gauge(
        "bytes_in_flight_budget",
        "The server's budget of request bytes in flight.",
    ),
});

impl ServerMetrics {
    /// Counts one request of `kind` that took `secs`.
    fn count(&self, kind: &'static str, bytes_in: u64, reply: &Frame<Response, Parts>, secs: f64) {
        use edl_proto::frame::Payload;
        // Static labels: counting a push or pull allocates nothing.
        let k = [("request", kind)];
        self.requests.get_or_create(&k).inc();
        self.seconds.get_or_create(&k).observe(secs);
        let dir = |d| [("request", kind), ("direction", d)];
        self.bytes.get_or_create(&dir("in")).inc_by(bytes_in);
        self.bytes
            .get_or_create(&dir("out"))
            .inc_by(reply.payload.byte_len() as u64);
        if let Response::Error { code, .. } = &reply.msg {
            self.error(*code);
        }
    }

    fn error(&self, code: u16) {
        let name = ErrorCode::from_u16(code).map_or_else(|| code.to_string(), |c| format!("{c:?}"));
        self.errors
            .get_or_create(&metrics::label("code", name))
            .inc();
    }
}

/// Counts a handshaken connection in the `connections` gauge while it lives.
struct OpenConnection;

impl OpenConnection {
    fn count() -> Self {
        METRICS.connections.inc();
        OpenConnection
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        METRICS.connections.dec();
    }
}

/// What every connection of one server shares.
struct Shared {
    limits: FrameLimits,
    budgets: Budgets,
    job: String,
    bytes: ServerBytes,
    identities: IdentityCounts,
}

impl Shared {
    /// Charges a frame of `len` bytes to its connection and to the server, or says why not.
    fn charge(&self, conn: &Arc<AtomicU64>, len: u64) -> Result<Charge, String> {
        let limit = self.budgets.conn_bytes;
        let taken = conn.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            (used.saturating_add(len) <= limit).then_some(used + len)
        });
        if let Err(used) = taken {
            return Err(format!(
                "a frame of {len} bytes would pass this connection's budget of {limit} bytes \
                 ({used} in flight); retry later"
            ));
        }
        let mut charge = Charge {
            _server: None,
            conn: conn.clone(),
            bytes: len,
        };
        let want = kib(len).min(self.bytes.total_kib);
        match self.bytes.permits.clone().try_acquire_many_owned(want) {
            Ok(p) => {
                charge._server = Some(p);
                Ok(charge)
            }
            Err(_) => Err(format!(
                "the server's budget of {} bytes in flight is exhausted; retry later",
                self.budgets.server_bytes
            )),
        }
    }

    /// Counts a new connection of `peer`, or says why it is one too many.
    fn admit(&self, peer: &Peer, open: usize) -> Result<IdentitySlot, String> {
        if open > self.budgets.conns as usize {
            return Err(format!(
                "the server holds its limit of {} connections",
                self.budgets.conns
            ));
        }
        let key = (peer.role, peer.name.clone());
        let mut c = self.identities.lock().unwrap_or_else(|p| p.into_inner());
        let n = c.entry(key.clone()).or_insert(0);
        if *n >= self.budgets.conns_per_identity {
            return Err(format!(
                "{}/{} holds its limit of {} connections",
                peer.role, peer.name, self.budgets.conns_per_identity
            ));
        }
        *n += 1;
        Ok(IdentitySlot {
            counts: self.identities.clone(),
            key,
        })
    }
}

/// Serves `service` on `endpoint` until `shutdown` is cancelled: only to peers of `job` (the
/// job in the server's own certificate), within `settings`' frame limits and budgets.
pub async fn serve<S: Service>(
    endpoint: Endpoint,
    service: Arc<S>,
    job: &str,
    settings: &TransportSettings,
    shutdown: CancellationToken,
) {
    let total_kib = kib(settings.budgets.server_bytes).max(1);
    let shared = Arc::new(Shared {
        limits: settings.limits,
        budgets: settings.budgets.clone(),
        job: job.to_string(),
        bytes: ServerBytes {
            permits: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
        },
        identities: Arc::default(),
    });
    METRICS.budget.set(settings.budgets.server_bytes as f64);
    metrics::watch(&shared, |s| {
        METRICS.in_flight.set(s.bytes.in_flight() as f64);
    });
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => {
                    let service = service.clone();
                    let shutdown = shutdown.clone();
                    let shared = shared.clone();
                    let open = conns.len();
                    conns.spawn(async move {
                        connection(incoming, service, shared, open, shutdown).await;
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

/// Closes `conn` with `code`, saying why.
fn refuse(conn: &quinn::Connection, code: ErrorCode, why: &str) {
    conn.close(VarInt::from_u32(code.as_u16().into()), why.as_bytes());
}

async fn connection<S: Service>(
    incoming: quinn::Incoming,
    service: Arc<S>,
    shared: Arc<Shared>,
    open: usize,
    shutdown: CancellationToken,
) {
    let addr = incoming.remote_address();
    let conn = match tokio::time::timeout(shared.budgets.hello_timeout, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            // This is where a peer without a cluster-signed certificate ends up.
            warn!(%addr, error = %e, "refused connection");
            return;
        }
        Err(_) => {
            warn!(%addr, "refused connection: TLS handshake not done in time");
            return;
        }
    };
    let peer = match peer_of(&conn, addr, &shared.bytes) {
        Ok(p) => p,
        Err(why) => {
            warn!(%addr, %why, "refused peer");
            refuse(&conn, ErrorCode::Forbidden, &why);
            return;
        }
    };
    if peer.job != shared.job {
        let why = format!(
            "certificate {}/{} belongs to job {:?}, this server to job {:?}",
            peer.role, peer.name, peer.job, shared.job
        );
        warn!(%addr, %why, "refused peer");
        refuse(&conn, ErrorCode::WrongJob, &why);
        return;
    }
    let _slot = match shared.admit(&peer, open) {
        Ok(slot) => slot,
        Err(why) => {
            warn!(%addr, %why, "refused connection");
            refuse(&conn, ErrorCode::Busy, &why);
            return;
        }
    };
    debug!(%addr, role = %peer.role, name = %peer.name, "connected");
    // Ends with this function, so that it keeps no connection open.
    let _watch =
        crate::transport::DatagramWatch::start(&conn, format!("{}/{}", peer.role, peer.name));
    // The first stream must carry the version handshake, within the deadline.
    let hello = tokio::time::timeout(shared.budgets.hello_timeout, async {
        let (mut send, mut recv) = conn.accept_bi().await?;
        // The handshake is small and carries no payload: a peer that has not shaken hands
        // gets no budget to make this server allocate anything sizable.
        let read = read_frame::<Request>(&mut recv, &HELLO_LIMITS).await;
        Ok::<_, quinn::ConnectionError>((send_hello(&mut send, read, &peer).await, send))
    })
    .await;
    match hello {
        Ok(Ok((true, _))) => {}
        Ok(Ok((false, send))) => {
            // Let the error response reach the peer before closing.
            let _ = tokio::time::timeout(shared.budgets.hello_timeout, send.stopped()).await;
            refuse(&conn, ErrorCode::HandshakeRequired, "handshake failed");
            return;
        }
        Ok(Err(e)) => {
            debug!(%addr, error = %e, "closed before handshake");
            return;
        }
        Err(_) => {
            warn!(%addr, name = %peer.name, "no handshake in time; closing");
            refuse(&conn, ErrorCode::HandshakeRequired, "no handshake in time");
            return;
        }
    }
    let peer = Arc::new(peer);
    let _counted = OpenConnection::count();
    let in_flight = Arc::new(AtomicU64::new(0));
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = tokio::time::timeout(shared.budgets.idle_timeout, conn.accept_bi()) => a,
            Some(_) = streams.join_next(), if !streams.is_empty() => continue,
        };
        let (send, recv) = match accepted {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                debug!(%addr, error = %e, "connection ended");
                break;
            }
            Err(_) if !streams.is_empty() => continue,
            Err(_) => {
                debug!(%addr, name = %peer.name, "idle; closing");
                conn.close(VarInt::from_u32(0), b"idle");
                break;
            }
        };
        let (service, peer) = (service.clone(), peer.clone());
        let (shared, in_flight) = (shared.clone(), in_flight.clone());
        streams.spawn(async move {
            request(send, recv, service, &peer, &shared, &in_flight).await;
        });
    }
    streams.abort_all();
    info!(%addr, name = %peer.name, "disconnected");
}

/// Answers the handshake request `read`; true when it was accepted.
async fn send_hello(
    send: &mut quinn::SendStream,
    read: Result<Frame<Request>, crate::transport::CallError>,
    peer: &Peer,
) -> bool {
    let reply = match read {
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
    let _ = write_frame(send, Frame::<_>::new(reply)).await;
    ok
}

/// Reads one request within the budgets and deadlines, has the service handle it, answers.
async fn request<S: Service>(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    service: Arc<S>,
    peer: &Peer,
    shared: &Shared,
    in_flight: &Arc<AtomicU64>,
) {
    let deadline = shared.budgets.frame_timeout;
    // `Err(None)`: the peer withdrew the request (`transport::Release`); nothing to answer.
    let read = async {
        let prefix =
            match tokio::time::timeout(deadline, read_prefix(&mut recv, &shared.limits)).await {
                Ok(Ok(p)) => p,
                Ok(Err(e)) => return Err(unread(&e)),
                Err(_) => {
                    return Err(Some(Response::error(
                        ErrorCode::Malformed,
                        "no frame in time",
                    )));
                }
            };
        // Charge what the frame announces before anything is allocated for it.
        let charge = match shared.charge(in_flight, prefix.frame_len()) {
            Ok(c) => c,
            Err(why) => {
                let _ = recv.stop(VarInt::from_u32(ErrorCode::Busy.as_u16().into()));
                return Err(Some(Response::error(ErrorCode::Busy, why)));
            }
        };
        match tokio::time::timeout(deadline, read_frame_body::<Request>(&mut recv, &prefix)).await {
            Ok(Ok(f)) => Ok((f, charge)),
            Ok(Err(e)) => Err(unread(&e)),
            Err(_) => {
                let _ = recv.stop(VarInt::from_u32(ErrorCode::Malformed.as_u16().into()));
                Err(Some(Response::error(
                    ErrorCode::Malformed,
                    format!("the frame did not arrive within {deadline:?}"),
                )))
            }
        }
    };
    let started = std::time::Instant::now();
    let reply = match read.await {
        Err(None) => {
            debug!(name = %peer.name, "request withdrawn by the peer");
            return;
        }
        Err(Some(resp)) => {
            if let Response::Error { code, .. } = &resp {
                METRICS.error(*code);
            }
            Frame::new(resp)
        }
        Ok((f, _)) if matches!(f.msg, Request::Hello { .. }) => Frame::new(Response::error(
            ErrorCode::InvalidRequest,
            "repeated handshake",
        )),
        Ok((f, charge)) => {
            let kind = f.msg.name();
            let bytes_in = charge.bytes;
            let reply = if service.allowed(peer.role, &f.msg) {
                // The charge is held until the request is handled: its payload lives until then.
                let _charge = charge;
                service.handle(peer, f.msg, f.payload).await
            } else {
                Frame::new(Response::error(
                    ErrorCode::Forbidden,
                    format!("role {} may not send this request", peer.role),
                ))
            };
            METRICS.count(kind, bytes_in, &reply, started.elapsed().as_secs_f64());
            reply
        }
    };
    if let Err(e) = write_frame(&mut send, reply).await {
        debug!(error = %e, "could not send response");
        return;
    }
    // Keep the stream until the peer has received the whole answer (or stopped it), within the
    // frame deadline. Ending the request at once, while QUIC was still sending a large
    // answer, made large pulls markedly slower (measured with `edl-bench transport`: at 1 MiB
    // 2.0 ms per push+pull pair instead of 2.7 ms, at 16 MiB 29 ms instead of 36 ms).
    let _ = tokio::time::timeout(shared.budgets.frame_timeout, send.stopped()).await;
}

/// The answer to a request that could not be read: none for one its sender withdrew
/// (`transport::Release`), reset before it was complete.
fn unread(e: &CallError) -> Option<Response> {
    let reset = match e {
        CallError::ReadChunk(quinn::ReadError::Reset(code))
        | CallError::Read(quinn::ReadExactError::ReadError(quinn::ReadError::Reset(code))) => {
            Some(*code)
        }
        _ => None,
    };
    (reset != Some(VarInt::from_u32(WITHDRAWN)))
        .then(|| Response::error(read_error_code(e), e.to_string()))
}

/// The wire code for a request that could not be read.
fn read_error_code(e: &crate::transport::CallError) -> ErrorCode {
    match e {
        crate::transport::CallError::Proto(p) => p.code(),
        _ => ErrorCode::Malformed,
    }
}

fn peer_of(
    conn: &quinn::Connection,
    addr: SocketAddr,
    server: &ServerBytes,
) -> Result<Peer, String> {
    let certs = conn
        .peer_identity()
        .and_then(|any| {
            any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or("no client certificate")?;
    let leaf = certs.first().ok_or("empty certificate chain")?;
    let Subject { role, name, job } = subject_of(leaf).map_err(|e| e.to_string())?;
    Ok(Peer {
        role,
        name,
        job,
        addr,
        server: server.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_in_flight_count_each_charged_frame_until_it_is_dropped() {
        let total_kib = 1024;
        let shared = Shared {
            limits: FrameLimits::default(),
            budgets: Budgets::default(),
            job: "default".into(),
            bytes: ServerBytes {
                permits: Arc::new(Semaphore::new(total_kib)),
                total_kib: total_kib as u32,
            },
            identities: Arc::default(),
        };
        let seen = shared.bytes.clone();
        let (a, b) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        assert_eq!(seen.in_flight(), 0);
        let first = shared.charge(&a, 5000).expect("within the budget");
        // In whole KiB per frame.
        assert_eq!(seen.in_flight(), 5 << 10);
        let second = shared.charge(&b, 300 << 10).expect("within the budget");
        assert_eq!(seen.in_flight(), 305 << 10);
        drop(first);
        assert_eq!(seen.in_flight(), 300 << 10);
        // A frame past the server's budget is refused and leaves nothing charged.
        assert!(shared.charge(&a, 2 << 20).is_err());
        assert_eq!(seen.in_flight(), 300 << 10);
        drop(second);
        assert_eq!(seen.in_flight(), 0);
    }
}
