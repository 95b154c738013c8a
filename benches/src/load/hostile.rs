//! The hostile client of `edl-bench load --hostile`: it holds the cheapest resources a peer
//! with a valid certificate can make a server keep, while the well-behaved clients measure
//! what that costs them.
//!
//! - *Half-sent frames*: on an authenticated worker connection to each shard (Hello done), it
//!   opens streams and writes the prefix of a push announcing the largest payload the limits
//!   accept (1 GiB), the push's header and a few KiB of it, then stalls with the stream open.
//! - *Idle connections*: TLS-authenticated QUIC connections to every server that never send
//!   the Hello handshake; keep-alives hold them open.
//!
//! Whatever a server does about it (answer with an error code, reset the stream, close the
//! connection) is counted by kind, and the hostile client tries again after a short pause, so
//! that the pressure lasts the whole run.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use edl_shared::Identity;
use edl_shared::pki::CLUSTER_SERVER_NAME;
use edl_shared::proto::frame::{Message, encode_prefix};
use edl_shared::proto::{Clock, FrameLimits, MapEpoch, Request, Response, Token, WorkerId};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{Conn, TransportSettings, client_endpoint, read_frame};
use serde::Serialize;
use tokio::task::JoinSet;

use super::{call_kind, code_name, connection_kind};

/// Bytes of the announced payload actually sent before a frame stalls.
const SENT_BYTES: usize = 4096;
/// The pause before trying again after the server ended a frame or a connection, so that a
/// server refusing everything at once does not turn the hostile client into a busy loop.
const RETRY: Duration = Duration::from_millis(100);

/// How much the hostile client holds.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Half-sent frames, spread over the shards.
    pub frames: usize,
    /// Idle connections without a handshake, spread over every server.
    pub idle: usize,
}

/// What the hostile client did and what the servers did about it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Half-sent frames it tries to hold.
    pub frames: usize,
    /// Idle connections it tries to hold.
    pub idle: usize,
    /// Frames announced and stalled, retries included.
    pub frames_sent: u64,
    /// The most frames held stalled at once.
    pub frames_held_peak: u64,
    /// Frames still held stalled when the measured window ended.
    pub frames_held_at_end: u64,
    /// How the servers ended stalled frames, by kind.
    pub frame_outcomes: BTreeMap<String, u64>,
    /// Idle connections established, reconnections included.
    pub idle_opened: u64,
    /// The most idle connections held at once.
    pub idle_held_peak: u64,
    /// Idle connections still open when the measured window ended.
    pub idle_held_at_end: u64,
    /// How the servers ended idle connections, by kind.
    pub idle_outcomes: BTreeMap<String, u64>,
    /// Connections that could not be established, by kind.
    pub connect_failures: BTreeMap<String, u64>,
}

/// A count that goes up and down, with its peak.
#[derive(Debug, Default)]
struct Gauge {
    now: AtomicU64,
    peak: AtomicU64,
}

impl Gauge {
    fn up(&self) {
        let n = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(n, Ordering::Relaxed);
    }

    fn down(&self) {
        self.now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The counters every task of the hostile client updates.
#[derive(Debug, Default)]
struct Counters {
    frames_sent: AtomicU64,
    frames_held: Gauge,
    idle_opened: AtomicU64,
    idle_held: Gauge,
    frame_outcomes: Mutex<BTreeMap<String, u64>>,
    idle_outcomes: Mutex<BTreeMap<String, u64>>,
    connect_failures: Mutex<BTreeMap<String, u64>>,
}

fn count(map: &Mutex<BTreeMap<String, u64>>, kind: String) {
    *map.lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(kind)
        .or_default() += 1;
}

fn counts(map: &Mutex<BTreeMap<String, u64>>) -> BTreeMap<String, u64> {
    map.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The running hostile client.
#[derive(Debug)]
pub struct Hostile {
    plan: Plan,
    counters: Arc<Counters>,
    stop: CancellationToken,
    tasks: JoinSet<()>,
}

impl Hostile {
    /// Starts holding `plan.frames` half-sent frames over `shards` and `plan.idle` idle
    /// connections over `servers`, as the worker `identity`.
    pub fn start(
        plan: Plan,
        identity: &Identity,
        settings: &TransportSettings,
        shards: &[SocketAddr],
        servers: &[SocketAddr],
    ) -> anyhow::Result<Hostile> {
        anyhow::ensure!(
            !shards.is_empty() && !servers.is_empty(),
            "no servers to attack"
        );
        let counters = Arc::new(Counters::default());
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let frame = Bytes::from(stalled_push()?);
        let endpoint = client_endpoint(identity, settings, false)?;
        for (i, addr) in shards.iter().enumerate() {
            let n = share(plan.frames, shards.len(), i);
            if n > 0 {
                tasks.spawn(frame_group(
                    Link {
                        endpoint: endpoint.clone(),
                        addr: *addr,
                        name: identity.name.clone(),
                        settings: settings.clone(),
                    },
                    n,
                    frame.clone(),
                    counters.clone(),
                    stop.clone(),
                ));
            }
        }
        for i in 0..plan.idle {
            tasks.spawn(idle_slot(
                endpoint.clone(),
                servers[i % servers.len()],
                counters.clone(),
                stop.clone(),
            ));
        }
        Ok(Hostile {
            plan,
            counters,
            stop,
            tasks,
        })
    }

    /// What happened so far.
    pub fn report(&self) -> Report {
        let c = &self.counters;
        Report {
            frames: self.plan.frames,
            idle: self.plan.idle,
            frames_sent: c.frames_sent.load(Ordering::Relaxed),
            frames_held_peak: c.frames_held.peak.load(Ordering::Relaxed),
            frames_held_at_end: c.frames_held.now.load(Ordering::Relaxed),
            frame_outcomes: counts(&c.frame_outcomes),
            idle_opened: c.idle_opened.load(Ordering::Relaxed),
            idle_held_peak: c.idle_held.peak.load(Ordering::Relaxed),
            idle_held_at_end: c.idle_held.now.load(Ordering::Relaxed),
            idle_outcomes: counts(&c.idle_outcomes),
            connect_failures: counts(&c.connect_failures),
        }
    }

    /// Lets go of everything it holds.
    pub async fn stop(mut self) {
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Item `i`'s share when `total` is spread over `n`.
fn share(total: usize, n: usize, i: usize) -> usize {
    total / n + usize::from(i < total % n)
}

/// The start of a push announcing the largest payload the default limits accept: prefix,
/// header and [`SENT_BYTES`] of zeros (finite floats, so that nothing is refused early for
/// what was sent).
fn stalled_push() -> anyhow::Result<BytesMut> {
    let header = Request::Push {
        epoch: MapEpoch(0),
        worker: WorkerId(0),
        clock: Clock(0),
        chunks: Vec::new(),
        span: None,
        covers: Vec::new(),
        token: Token([0; 32]),
    }
    .to_header()?;
    let mut out = BytesMut::new();
    out.extend_from_slice(&encode_prefix(
        u32::try_from(header.len())?,
        FrameLimits::default().max_payload,
    ));
    out.extend_from_slice(&header);
    out.extend_from_slice(&[0u8; SENT_BYTES]);
    Ok(out)
}

/// Sleeps for `d` unless `stop` comes first; false if it did.
async fn pause(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// Where an authenticated hostile connection goes.
#[derive(Clone, Debug)]
struct Link {
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    name: String,
    settings: TransportSettings,
}

/// Holds `n` stalled frames on one authenticated connection to a shard; when the shard
/// closes it, connects again.
async fn frame_group(
    link: Link,
    n: usize,
    frame: Bytes,
    c: Arc<Counters>,
    stop: CancellationToken,
) {
    let addr = link.addr.to_string();
    loop {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            r = Conn::connect(&link.endpoint, &addr, &link.name, &link.settings) => r,
        };
        match connected {
            Ok(conn) => {
                let mut slots = JoinSet::new();
                for _ in 0..n {
                    slots.spawn(frame_slot(
                        conn.quic()
                            .expect("Conn::connect makes QUIC connections")
                            .clone(),
                        frame.clone(),
                        c.clone(),
                        stop.clone(),
                    ));
                }
                while slots.join_next().await.is_some() {}
            }
            Err(e) => count(&c.connect_failures, format!("worker: {}", call_kind(&e))),
        }
        if !pause(&stop, RETRY).await {
            return;
        }
    }
}

/// Keeps one stalled frame on `conn`, sending a new one whenever the server ends it, until the
/// connection closes or the run ends.
async fn frame_slot(
    conn: quinn::Connection,
    frame: Bytes,
    c: Arc<Counters>,
    stop: CancellationToken,
) {
    while conn.close_reason().is_none() {
        let outcome = tokio::select! {
            _ = stop.cancelled() => return,
            o = stalled_frame(&conn, &frame, &c) => o,
        };
        count(&c.frame_outcomes, outcome);
        if !pause(&stop, RETRY).await {
            return;
        }
    }
}

/// Sends the start of `frame` on a new stream and waits for the server to do something about
/// it; returns what it did.
async fn stalled_frame(conn: &quinn::Connection, frame: &Bytes, c: &Counters) -> String {
    let (mut send, mut recv) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return format!("no stream: {}", connection_kind(&e)),
    };
    if let Err(e) = send.write_all(frame).await {
        return match e {
            quinn::WriteError::Stopped(code) => {
                format!("stopped by the server ({})", code_name(code.into_inner()))
            }
            quinn::WriteError::ConnectionLost(e) => format!("connection: {}", connection_kind(&e)),
            other => other.to_string(),
        };
    }
    c.frames_sent.fetch_add(1, Ordering::Relaxed);
    c.frames_held.up();
    let answer = read_frame::<Response>(&mut recv, &FrameLimits::default()).await;
    c.frames_held.down();
    // The send side stays open (never finished) until the server has done something.
    drop(send);
    match answer {
        Ok(f) => match f.msg {
            Response::Error { code, .. } => format!("answered {}", code_name(code.into())),
            other => format!(
                "answered {}",
                call_kind(&edl_shared::transport::CallError::unexpected(&other))
            ),
        },
        Err(e) => call_kind(&e),
    }
}

/// Keeps one connection to `addr` open without ever saying Hello; connects again when the
/// server closes it.
async fn idle_slot(
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    c: Arc<Counters>,
    stop: CancellationToken,
) {
    loop {
        let connected = match endpoint.connect(addr, CLUSTER_SERVER_NAME) {
            Ok(connecting) => tokio::select! {
                _ = stop.cancelled() => return,
                r = connecting => r.map_err(|e| connection_kind(&e)),
            },
            Err(e) => Err(e.to_string()),
        };
        match connected {
            Ok(conn) => {
                c.idle_opened.fetch_add(1, Ordering::Relaxed);
                c.idle_held.up();
                let reason = tokio::select! {
                    _ = stop.cancelled() => return,
                    r = conn.closed() => r,
                };
                c.idle_held.down();
                count(&c.idle_outcomes, connection_kind(&reason));
            }
            Err(kind) => count(&c.connect_failures, format!("idle: {kind}")),
        }
        if !pause(&stop, RETRY).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::frame::{PREFIX_LEN, parse_prefix};

    #[test]
    fn shares_add_up() {
        for (total, n) in [(0, 2), (7, 2), (256, 3), (1, 4)] {
            let parts: Vec<usize> = (0..n).map(|i| share(total, n, i)).collect();
            assert_eq!(parts.iter().sum::<usize>(), total, "{parts:?}");
            assert!(parts.iter().max().unwrap_or(&0) - parts.iter().min().unwrap_or(&0) <= 1);
        }
    }

    #[test]
    fn the_stalled_push_announces_the_largest_payload() -> anyhow::Result<()> {
        let f = stalled_push()?;
        let p = parse_prefix(&f, &FrameLimits::default())?;
        assert_eq!(p.payload_len, FrameLimits::default().max_payload);
        let header = &f[PREFIX_LEN..PREFIX_LEN + p.header_len as usize];
        assert!(matches!(
            Request::from_header(header)?,
            Request::Push { .. }
        ));
        assert_eq!(f.len(), PREFIX_LEN + p.header_len as usize + SENT_BYTES);
        Ok(())
    }
}
