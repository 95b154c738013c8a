//! QUIC transport: endpoints with mutual TLS 1.3 against the cluster CA, one request per
//! bidirectional stream, and typed errors for everything that can go wrong on a call.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use edl_proto::ShardMap;
use edl_proto::frame::{FiniteScan, Message, PREFIX_LEN, Parts, Payload, Prefix, parse_prefix};
use edl_proto::{ErrorCode, Frame, FrameLimits, PROTOCOL_VERSION, ProtoError, Request, Response};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, RecvStream, SendStream, VarInt};
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use thiserror::Error;

use crate::pki::{CLUSTER_SERVER_NAME, Identity, PkiError};

/// The ALPN protocol id EDL speaks.
pub const ALPN: &[u8] = b"edl/1";

/// QUIC settings shared by clients and servers.
#[derive(Clone, Debug)]
pub struct TransportSettings {
    /// Per-stream receive window in bytes; large tensors need a large window.
    pub stream_window: u32,
    /// Per-connection receive and send window in bytes.
    pub conn_window: u32,
    /// A connection silent this long is closed.
    pub idle_timeout: Duration,
    /// Keep-alive interval, well under the idle timeout.
    pub keep_alive: Duration,
    /// Frame size limits for received messages.
    pub limits: FrameLimits,
    /// What a server allows its peers (bytes in flight, streams, connections, deadlines).
    pub budgets: crate::server::Budgets,
    /// How long a client keeps retrying a server it cannot reach before it gives up; `None`
    /// (the default) retries, with capped backoff, until the server answers.
    pub reconnect: Option<Duration>,
    /// A fixed UDP datagram size (bytes of UDP payload) for paths known to carry it: loopback,
    /// or networks with jumbo frames. `None`, the default, is safe on any network: QUIC
    /// starts at 1,200-byte datagrams and path-MTU discovery probes upward to what the path
    /// carries, up to [`JUMBO_DATAGRAM`] (a 9,000-byte link's). Large datagrams are what
    /// makes bulk transfer fast: per-packet work is most of QUIC's cost.
    pub datagram: Option<u16>,
    /// Socket send and receive buffer size asked of the kernel (it caps the request at
    /// `net.core.rmem_max` / `wmem_max`). Small buffers drop packets under load.
    pub socket_buffer: usize,
    /// Whose code encrypts and decrypts the packets. Peers need not agree: both speak TLS 1.3's
    /// AES-GCM suites. The default is [`AEAD_ENV`]'s choice, else [`Aead::fastest_here`].
    pub aead: Aead,
    /// A fault plan for tests: when set, every endpoint made with these settings sends through
    /// it (loss, delay, reordering, duplication, partitions). `None`, the default unless
    /// [`crate::faults::FAULTS_ENV`] holds a spec, leaves the socket untouched.
    pub faults: Option<crate::faults::Faults>,
}

/// The environment variable that sets [`TransportSettings::datagram`] for every EDL process
/// (`edl-local` sets it for loopback runs).
pub const DATAGRAM_ENV: &str = "EDL_DATAGRAM";

/// The environment variable that sets [`TransportSettings::aead`] for every EDL process:
/// `aws-lc` or `ring` (for measuring one against the other; the default picks by CPU).
pub const AEAD_ENV: &str = "EDL_AEAD";

/// The implementation of QUIC's packet encryption (AES-GCM, the suite TLS 1.3 negotiates).
/// Bulk transfer spends most of its CPU time here, and which is faster depends on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aead {
    /// aws-lc's: the fastest where it has a path for the CPU's vector unit, AVX-512 with
    /// VAES on x86-64 (and its ARMv8 paths).
    AwsLc,
    /// ring's: it has a path for VAES with AVX2 alone (as on AMD Zen 3), where aws-lc falls
    /// back to its 128-bit AES-NI code (`_aesni_ctr32_ghash_6x`). On an AMD EPYC (Zen 3)
    /// that took EDL's 16 MiB push+pull from 7.3-7.6 to 8.8-9.6 Gbit/s
    /// (`edl-bench --datagram 65000 transport --points 1x1`, three alternating runs).
    Ring,
}

impl Aead {
    /// The faster implementation on this CPU: ring's where the CPU has VAES and AVX2 but not
    /// the AVX-512 that aws-lc's own VAES path needs; aws-lc's everywhere else.
    pub fn fastest_here() -> Aead {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let vaes_avx2 = has!("avx2") && has!("vaes") && has!("vpclmulqdq");
            // What aws-lc checks for its AVX-512 AES-GCM (crypto_gcm_avx512_enabled).
            let avx512 =
                has!("avx512f") && has!("avx512dq") && has!("avx512bw") && has!("avx512vl");
            if vaes_avx2 && !avx512 {
                return Aead::Ring;
            }
        }
        Aead::AwsLc
    }

    /// Its name in [`AEAD_ENV`]: `aws-lc` or `ring`.
    pub fn name(self) -> &'static str {
        match self {
            Aead::AwsLc => "aws-lc",
            Aead::Ring => "ring",
        }
    }

    /// The choice in [`AEAD_ENV`], if it holds one; a value that names neither is reported
    /// (once) and ignored.
    fn from_env() -> Option<Aead> {
        static CHOSEN: std::sync::OnceLock<Option<Aead>> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let v = std::env::var(AEAD_ENV).ok()?;
            let v = v.trim();
            let named = [Aead::AwsLc, Aead::Ring]
                .into_iter()
                .find(|a| a.name() == v);
            if named.is_none() {
                tracing::warn!(
                    "{AEAD_ENV}={v:?} names no AES-GCM implementation (aws-lc or ring); \
                     picking by CPU"
                );
            }
            named
        })
    }
}

/// The datagram size for loopback (whose MTU is 64 KiB): measured fastest with
/// `edl-bench transport --datagram N` among 9000, 16000, 32000 and 65000 bytes.
pub const LOOPBACK_DATAGRAM: u16 = 65_000;

/// The largest datagram path-MTU discovery looks for: the UDP payload of an IPv4 packet on a
/// link with 9,000-byte jumbo frames (an IPv6 path settles 20 bytes lower). A path that
/// carries less is found out by the probes, which cost nothing but a few lost probe packets.
pub const JUMBO_DATAGRAM: u16 = 8_972;

/// The largest UDP payload quinn sends or accepts.
const MAX_UDP_PAYLOAD: u16 = 65_527;

/// The most bytes one segmentation-offload send may carry (all its datagrams together): the
/// largest IPv4 UDP payload; the kernel refuses a larger batch.
const MAX_BATCH_BYTES: usize = 65_507;
/// quinn-proto 0.11 overflows a padded Initial above this `min_mtu`.
const MAX_MIN_MTU: u16 = 16_383;

impl Default for TransportSettings {
    /// The defaults, with [`DATAGRAM_ENV`] applied when it holds a size from 1200 to 65527, and
    /// the fault plan of [`crate::faults::FAULTS_ENV`] when it holds one.
    fn default() -> Self {
        let datagram = std::env::var(DATAGRAM_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u16>().ok())
            .filter(|n| (1200..=MAX_UDP_PAYLOAD).contains(n));
        TransportSettings {
            stream_window: 32 << 20,
            conn_window: 128 << 20,
            // Short enough that a peer that died (a SIGKILLed shard) is noticed within seconds;
            // keep-alives keep quiet but healthy connections, long polls included, open.
            idle_timeout: Duration::from_secs(6),
            keep_alive: Duration::from_millis(1500),
            limits: FrameLimits::default(),
            budgets: crate::server::Budgets::default(),
            reconnect: None,
            datagram,
            socket_buffer: 8 << 20,
            aead: Aead::from_env().unwrap_or_else(Aead::fastest_here),
            faults: crate::faults::Faults::from_env(),
        }
    }
}

impl TransportSettings {
    /// These settings with a fixed datagram size (`None`: path-MTU discovery from 1,200 bytes
    /// up to [`JUMBO_DATAGRAM`]).
    pub fn with_datagram(mut self, datagram: Option<u16>) -> Self {
        self.datagram = datagram.map(|n| n.clamp(1200, MAX_UDP_PAYLOAD));
        self
    }

    fn quinn(&self) -> Result<quinn::TransportConfig, PkiError> {
        let mut t = quinn::TransportConfig::default();
        if let Some(n) = self.datagram {
            // The path is known: start at the size, never probe, never fall back below it. The
            // congestion window must hold several datagrams or the handshake never leaves.
            t.initial_mtu(n)
                .min_mtu(n.min(MAX_MIN_MTU))
                .mtu_discovery_config(None);
            let mut cubic = quinn::congestion::CubicConfig::default();
            cubic.initial_window(10 * u64::from(n));
            t.congestion_controller_factory(Arc::new(cubic));
        } else {
            // Start safe, probe up to a jumbo link's datagrams: a 9,000-byte network gets
            // them with no setting, a 1,500-byte one settles at its own.
            let mut discovery = quinn::MtuDiscoveryConfig::default();
            discovery.upper_bound(JUMBO_DATAGRAM);
            t.mtu_discovery_config(Some(discovery));
        }
        t.stream_receive_window(VarInt::from_u32(self.stream_window));
        t.receive_window(VarInt::from_u32(self.conn_window));
        t.send_window(u64::from(self.conn_window));
        // What a peer may open toward this endpoint: a server's budget of requests in flight
        // per connection (servers open no streams toward clients).
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.budgets.streams));
        t.max_concurrent_uni_streams(VarInt::from_u32(0));
        t.max_idle_timeout(Some(
            self.idle_timeout
                .try_into()
                .map_err(|_| PkiError::Tls("idle timeout out of range".into()))?,
        ));
        t.keep_alive_interval(Some(self.keep_alive));
        Ok(t)
    }
}

/// The TLS provider: aws-lc-rs for everything (key exchange, certificates, randomness), with
/// the cipher suites, hence the packets' encryption, of `aead`.
fn provider(aead: Aead) -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    if aead == Aead::Ring {
        p.cipher_suites = rustls::crypto::ring::default_provider().cipher_suites;
    }
    Arc::new(p)
}

fn roots(id: &Identity) -> Result<Arc<RootCertStore>, PkiError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(id.ca.clone())
        .map_err(|e| PkiError::Tls(format!("bad CA certificate: {e}")))?;
    Ok(Arc::new(roots))
}

/// A QUIC server configuration that demands a client certificate signed by the cluster CA.
pub fn server_config(
    id: &Identity,
    settings: &TransportSettings,
) -> Result<quinn::ServerConfig, PkiError> {
    let tls = |e: rustls::Error| PkiError::Tls(e.to_string());
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(id)?, provider(settings.aead))
        .build()
        .map_err(|e| PkiError::Tls(e.to_string()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider(settings.aead))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(tls)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(cfg).map_err(|e| PkiError::Tls(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(settings.quinn()?));
    Ok(server)
}

/// A QUIC client configuration that presents `id` and trusts only the cluster CA.
pub fn client_config(
    id: &Identity,
    settings: &TransportSettings,
) -> Result<quinn::ClientConfig, PkiError> {
    let tls = |e: rustls::Error| PkiError::Tls(e.to_string());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider(settings.aead))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_root_certificates(roots(id)?)
        .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(tls)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(cfg).map_err(|e| PkiError::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(settings.quinn()?));
    Ok(client)
}

/// Binds a server endpoint on `addr`.
///
/// The key that signs stateless resets is derived from the node's private key, so it survives
/// a restart: when a crashed server comes back on the same address, its answer to a client's
/// packets for a connection it no longer knows is a reset the client can verify, and the client
/// learns at once that it must reconnect (instead of waiting for the idle timeout).
pub fn server_endpoint(
    addr: SocketAddr,
    id: &Identity,
    settings: &TransportSettings,
) -> Result<Endpoint, CallError> {
    use aws_lc_rs::hmac;
    let cfg = server_config(id, settings)?;
    let derive = hmac::Key::new(hmac::HMAC_SHA256, id.key.secret_der());
    let secret = hmac::sign(&derive, b"edl stateless reset key v1");
    let reset_key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_ref());
    let mut endpoint_cfg = quinn::EndpointConfig::new(Arc::new(reset_key));
    // Connection ids carry a keyed check that the endpoint uses to drop stray packets; keep
    // that key across restarts too, or the restarted server drops old packets silently
    // instead of answering them with a reset.
    let mut cid_key = [0u8; 8];
    cid_key.copy_from_slice(&secret.as_ref()[..8]);
    let cid_key = u64::from_le_bytes(cid_key);
    endpoint_cfg.cid_generator(move || {
        Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
    });
    endpoint(addr, endpoint_cfg, Some(cfg), settings)
}

/// Binds a UDP socket with the buffers of `settings` and makes it a quinn endpoint.
fn endpoint(
    addr: SocketAddr,
    mut config: quinn::EndpointConfig,
    server: Option<quinn::ServerConfig>,
    settings: &TransportSettings,
) -> Result<Endpoint, CallError> {
    use socket2::{Domain, Protocol, Socket, Type};
    // Tell peers that datagrams this large are welcome (quinn's default says 1472 bytes, which
    // would hold path-MTU discovery below a jumbo link's size).
    let largest = settings.datagram.unwrap_or(JUMBO_DATAGRAM);
    config
        .max_udp_payload_size(largest.clamp(1200, MAX_UDP_PAYLOAD))
        .map_err(|e| CallError::Bind(std::io::Error::other(e.to_string())))?;
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(CallError::Bind)?;
    // Best effort: the kernel caps the sizes, and a smaller buffer still works.
    let _ = socket.set_recv_buffer_size(settings.socket_buffer);
    let _ = socket.set_send_buffer_size(settings.socket_buffer);
    socket.bind(&addr.into()).map_err(CallError::Bind)?;
    let runtime = quinn::default_runtime()
        .ok_or_else(|| CallError::Bind(std::io::Error::other("no async runtime")))?;
    let udp = runtime
        .wrap_udp_socket(socket.into())
        .map_err(CallError::Bind)?;
    // A fixed size's batches are capped to what one send carries (a batch split midway can
    // lose its tail to a full socket buffer); discovery's are split where they grow past it.
    let max_segments = settings.datagram.map_or(usize::MAX, |n| {
        (MAX_BATCH_BYTES / usize::from(n.max(1))).max(1)
    });
    let udp: Arc<dyn quinn::AsyncUdpSocket> = Arc::new(SplitBatches {
        inner: udp,
        max_segments,
    });
    let udp = match &settings.faults {
        Some(faults) => faults.wrap(udp).map_err(CallError::Bind)?,
        None => udp,
    };
    Endpoint::new_with_abstract_socket(config, server, udp, runtime).map_err(CallError::Bind)
}

/// A UDP socket that sends a segmentation-offload batch larger than the kernel takes
/// ([`MAX_BATCH_BYTES`]) as several: quinn batches at least ten datagrams (as many as one send
/// takes where that is more, with EDL's patch of quinn), and ten large ones (a jumbo link's)
/// exceed it. Refused, the send would be taken for loss, and path-MTU
/// discovery's black-hole detection would fall back to small datagrams. With a fixed size the
/// batches are capped instead (`max_segments`), so that none is split.
#[derive(Debug)]
struct SplitBatches {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    max_segments: usize,
}

impl quinn::AsyncUdpSocket for SplitBatches {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        let Some(segment) = transmit.segment_size.filter(|s| *s > 0) else {
            return self.inner.try_send(transmit);
        };
        if transmit.contents.len() <= MAX_BATCH_BYTES {
            return self.inner.try_send(transmit);
        }
        let per_send = (MAX_BATCH_BYTES / segment).max(1) * segment;
        for (i, piece) in transmit.contents.chunks(per_send).enumerate() {
            let part = quinn::udp::Transmit {
                destination: transmit.destination,
                ecn: transmit.ecn,
                contents: piece,
                segment_size: (piece.len() > segment).then_some(segment),
                src_ip: transmit.src_ip,
            };
            match self.inner.try_send(&part) {
                Ok(()) => {}
                // Nothing sent yet: quinn tries the whole batch again once writable.
                Err(e) if i == 0 => return Err(e),
                // Some of it went: the rest is lost, and QUIC's loss recovery resends it
                // (rare: the socket buffers are large).
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// The datagram size in use on each connection, by peer: `edl_datagram_bytes`.
static DATAGRAM: std::sync::LazyLock<crate::metrics::Gauges> = std::sync::LazyLock::new(|| {
    crate::metrics::gauges(
        "datagram_bytes",
        "UDP payload bytes of the datagrams sent on the connection to each peer (path-MTU \
         discovery's finding, or the fixed --datagram size).",
    )
});

/// The task that follows the datagram size a connection sends, and its metric: both end when
/// this is dropped. The task holds a handle of the connection, which keeps it open: so the
/// owner of the connection holds this beside it, and a connection dropped by its owner still
/// closes.
#[derive(Debug)]
pub struct DatagramWatch {
    task: tokio::task::JoinHandle<()>,
    labels: crate::metrics::Labels,
}

impl DatagramWatch {
    /// Follows `conn` (what path-MTU discovery found): logs the size once it has settled and
    /// whenever it changes after that, and keeps it in `edl_datagram_bytes{peer}`.
    pub fn start(conn: &quinn::Connection, peer: String) -> DatagramWatch {
        let labels = crate::metrics::label("peer", &peer);
        DatagramWatch {
            task: tokio::spawn(watch_datagram(conn.clone(), peer, labels.clone())),
            labels,
        }
    }
}

impl Drop for DatagramWatch {
    fn drop(&mut self) {
        self.task.abort();
        DATAGRAM.remove(&self.labels);
    }
}

async fn watch_datagram(conn: quinn::Connection, peer: String, labels: crate::metrics::Labels) {
    let mut logged = 0u16;
    let mut seen = 0u16;
    // Discovery runs in the connection's first second or so, then every ten minutes.
    let mut wait = Duration::from_millis(250);
    loop {
        tokio::select! {
            _ = conn.closed() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        let now = conn.stats().path.current_mtu;
        DATAGRAM.get_or_create(&labels).set(f64::from(now));
        // Logged once unchanged for a check: not every step of the search.
        if now == seen && now != logged {
            tracing::info!(%peer, bytes = now, "datagram size in use");
            logged = now;
        }
        seen = now;
        wait = (wait * 2).min(Duration::from_secs(10));
    }
    DATAGRAM.remove(&labels);
}

/// Binds a client endpoint on an ephemeral port of the given address family.
pub fn client_endpoint(
    id: &Identity,
    settings: &TransportSettings,
    ipv6: bool,
) -> Result<Endpoint, CallError> {
    let bind: SocketAddr = if ipv6 {
        SocketAddr::from(([0u16; 8], 0))
    } else {
        SocketAddr::from(([0u8; 4], 0))
    };
    let mut ep = endpoint(bind, quinn::EndpointConfig::default(), None, settings)?;
    ep.set_default_client_config(client_config(id, settings)?);
    Ok(ep)
}

/// Why a call failed.
#[derive(Debug, Error)]
pub enum CallError {
    /// Binding a socket failed.
    #[error("cannot bind: {0}")]
    Bind(std::io::Error),
    /// The address could not be resolved or parsed: a sentence that says which and why.
    #[error("{0}")]
    Address(String),
    /// TLS or certificate set-up failed.
    #[error(transparent)]
    Pki(#[from] PkiError),
    /// The connection could not be started.
    #[error("connect: {0}")]
    Connect(#[from] quinn::ConnectError),
    /// The connection failed or was closed (including a refused handshake).
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// Writing a stream failed.
    #[error("write: {0}")]
    Write(#[from] quinn::WriteError),
    /// Reading a stream failed.
    #[error("read: {0}")]
    Read(#[from] quinn::ReadExactError),
    /// Reading a stream chunk failed.
    #[error("read: {0}")]
    ReadChunk(#[from] quinn::ReadError),
    /// The stream was closed early.
    #[error("stream closed: {0}")]
    Closed(#[from] quinn::ClosedStream),
    /// No stream could be opened on the connection (it had failed or was closed): the request
    /// was not sent, so repeating it on a new connection is always safe.
    #[error("not sent: {0}")]
    NotSent(quinn::ConnectionError),
    /// The peer did not answer in time.
    #[error("timed out: {0}")]
    TimedOut(String),
    /// The peer sent a malformed frame.
    #[error("bad frame from peer: {0}")]
    Proto(#[from] ProtoError),
    /// The peer answered with an error.
    #[error("{}: {message}", code_name(*.code))]
    Remote {
        /// The stable error code (`None` when the peer sent a code this build does not know).
        code: Option<ErrorCode>,
        /// The peer's message.
        message: String,
        /// The new shard map, with [`ErrorCode::StaleEpoch`].
        map: Option<Box<ShardMap>>,
    },
    /// The peer answered with a message that does not fit the request.
    #[error("unexpected response: {0}")]
    Unexpected(String),
    /// The answer's header does not fit what the caller asked for (its payload was not read).
    #[error("answer refused: {0}")]
    Refused(String),
    /// The request was withdrawn before it was complete ([`Release`]): the server dropped it.
    #[error("request withdrawn before it was complete")]
    Withdrawn,
    /// No connection could be made to any of the addresses tried (a job's coordinators, a
    /// scheduler).
    #[error("could not connect to {} ({cause}); {}", .tried.join(", "), reach_hint(.cause))]
    Unreachable {
        /// The addresses tried.
        tried: Vec<String>,
        /// The last failure.
        cause: Box<CallError>,
    },
    /// The coordinator asked stands by: another one leads (at `leader`, if known). It did
    /// nothing with the request, so repeating it at the leader is always safe.
    #[error("{}", not_leader_text(.leader.as_deref()))]
    NotLeader {
        /// The leader's address, if one is elected.
        leader: Option<String>,
    },
}

fn not_leader_text(leader: Option<&str>) -> String {
    match leader {
        Some(at) => format!("this coordinator stands by; the leader is at {at}"),
        None => "this coordinator stands by and no leader is elected yet".into(),
    }
}

/// What to check when a server could not be reached, by how the attempt failed.
fn reach_hint(cause: &CallError) -> &'static str {
    let text = cause.to_string();
    if text.contains("certificate") || text.contains("handshake failed") {
        "the TLS handshake failed: the server and this client are not of one cluster CA; use \
         the cluster's state directory (--state-dir, the one its coordinator uses) or its CA \
         with a certificate it issued (--ca --cert --key)"
    } else if matches!(cause, CallError::Address(_) | CallError::Connect(_)) {
        "the address is not a reachable HOST:PORT"
    } else if matches!(
        cause,
        CallError::Connection(quinn::ConnectionError::TimedOut) | CallError::TimedOut(_)
    ) {
        "check that the server runs (`edl-ps coordinator`, `edl-sched`), that it listens on \
         that address and port (its log says where), and that UDP to that port is let \
         through (QUIC runs over UDP)"
    } else if cause.connection_failed() {
        "the connection was closed: the server's log says why (a certificate it does not \
         accept, one of another job, a budget)"
    } else {
        "its log may say why"
    }
}

/// An error code as operators read it (`Busy`, `StaleEpoch`), or that it was not known.
fn code_name(code: Option<ErrorCode>) -> String {
    code.map_or_else(
        || "error (code unknown to this build)".into(),
        |c| format!("{c:?}"),
    )
}

impl CallError {
    /// The remote error code, if the peer answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            CallError::Remote { code, .. } => *code,
            _ => None,
        }
    }

    /// True for failures of the connection itself, after which a retry on a new connection
    /// (or to another of a job's coordinators) may succeed; false for answers (errors the
    /// server sent, malformed replies) and set-up errors.
    pub fn connection_failed(&self) -> bool {
        matches!(
            self,
            CallError::Connect(_)
                | CallError::Unreachable { .. }
                | CallError::Connection(_)
                | CallError::NotSent(_)
                | CallError::Read(_)
                | CallError::ReadChunk(_)
                | CallError::Write(_)
                | CallError::Closed(_)
        )
    }

    /// A peer's answer as a call's result: an error answer is [`CallError::Remote`].
    pub fn answered(msg: Response) -> Result<Response, CallError> {
        match msg {
            Response::Error { code, message, map } => Err(CallError::Remote {
                code: ErrorCode::from_u16(code),
                message,
                map: map.map(Box::new),
            }),
            Response::NotLeader { leader } => Err(CallError::NotLeader { leader }),
            msg => Ok(msg),
        }
    }

    /// An "unexpected response" error naming what arrived.
    pub fn unexpected(got: &Response) -> Self {
        let name = format!("{got:?}");
        CallError::Unexpected(name.chars().take(120).collect())
    }
}

/// Where a frame's payload goes as it arrives from the stream.
pub trait Sink<T> {
    /// The header arrived and announces `len` payload bytes: check it and get ready for them.
    /// An error refuses the frame before any payload byte is read.
    fn header(&mut self, msg: &T, len: u64) -> Result<(), String>;
    /// The next part of the payload, in order (as QUIC delivers it: any length, any
    /// alignment). The parts add up to the announced length.
    fn part(&mut self, part: Bytes);
}

/// The sink that keeps a payload as the parts it arrived in, checking a payload of f32
/// values that must be finite (a push's gradients) part by part as it arrives.
///
/// A part of [`KEEP_PART`] bytes or more is kept as QUIC delivered it, uncopied (it holds the
/// buffer quinn received its datagram into); smaller ones are copied together into buffers
/// of that size, so that a peer sending a payload in tiny pieces cannot make the receiver hold
/// a datagram buffer for every few bytes of it.
#[derive(Debug, Default)]
pub struct Collect {
    parts: Vec<Bytes>,
    small: BytesMut,
    scan: Option<FiniteScan>,
}

/// The smallest received part [`Collect`] keeps uncopied.
pub const KEEP_PART: usize = 16 << 10;

impl Collect {
    /// The payload, or why its values were refused.
    pub fn finish(mut self) -> Result<Parts, ProtoError> {
        if let Some(scan) = &self.scan {
            scan.result()?;
        }
        self.flush();
        Ok(Parts(self.parts))
    }

    fn flush(&mut self) {
        if !self.small.is_empty() {
            self.parts.push(self.small.split().freeze());
        }
    }
}

impl<T: Message> Sink<T> for Collect {
    fn header(&mut self, msg: &T, _len: u64) -> Result<(), String> {
        self.parts.clear();
        self.small.clear();
        self.scan = msg.finite_payload().then(FiniteScan::default);
        Ok(())
    }

    fn part(&mut self, part: Bytes) {
        if let Some(scan) = &mut self.scan {
            scan.part(&part);
        }
        if part.len() >= KEEP_PART {
            self.flush();
            self.parts.push(part);
        } else {
            if self.small.capacity() - self.small.len() < part.len() {
                self.flush();
                self.small.reserve(KEEP_PART);
            }
            self.small.extend_from_slice(&part);
        }
    }
}

/// Reads one frame from a stream, checking the size limits before allocating. The header is
/// decoded before the payload is read; a payload that must be finite f32 values (a push's
/// gradients) is checked part by part as it arrives, and refused with
/// [`ProtoError::NonFinite`] once it has all arrived. Bytes after the frame are refused with
/// [`ProtoError::Trailing`]. The payload comes back as one buffer (see [`read_frame_body`]
/// for the parts as they arrived).
pub async fn read_frame<T: Message>(
    recv: &mut RecvStream,
    limits: &FrameLimits,
) -> Result<Frame<T>, CallError> {
    let p = read_prefix(recv, limits).await?;
    let f = read_frame_body(recv, &p).await?;
    Ok(Frame::with_payload(f.msg, f.payload.to_bytes()))
}

/// Reads and checks a frame's fixed prefix: what the frame announces, before anything is
/// allocated for it (a server charges it against its budgets first).
pub async fn read_prefix(recv: &mut RecvStream, limits: &FrameLimits) -> Result<Prefix, CallError> {
    let mut prefix = [0u8; PREFIX_LEN];
    recv.read_exact(&mut prefix).await?;
    Ok(parse_prefix(&prefix, limits)?)
}

/// Reads the rest of a frame whose prefix [`read_prefix`] returned, up to the end of the
/// stream (see [`read_frame`]). The payload is the parts QUIC delivered, uncopied.
pub async fn read_frame_body<T: Message>(
    recv: &mut RecvStream,
    p: &Prefix,
) -> Result<Frame<T, Parts>, CallError> {
    let mut sink = Collect::default();
    let msg = read_frame_into(recv, p, &mut sink).await?;
    Ok(Frame::with_payload(msg, sink.finish()?))
}

/// Reads the rest of a frame whose prefix [`read_prefix`] returned, up to the end of the
/// stream, handing its payload to `sink` part by part as it arrives: nothing of it is
/// gathered in a buffer of the transport's. Memory grows only with what actually arrives
/// (bounded by the flow-control windows), so a peer that merely announces a large payload
/// cannot make the reader allocate it.
pub async fn read_frame_into<T: Message, S: Sink<T>>(
    recv: &mut RecvStream,
    p: &Prefix,
    sink: &mut S,
) -> Result<T, CallError> {
    // Both lengths passed the limits check, which keeps them far below usize::MAX.
    let mut header = vec![0u8; p.header_len as usize];
    recv.read_exact(&mut header).await?;
    let msg = T::from_header(&header)?;
    sink.header(&msg, p.payload_len)
        .map_err(CallError::Refused)?;
    let len = p.payload_len;
    let mut got = 0u64;
    // Several chunks per call: one look at the connection's state (a lock, a waker) for up
    // to a batch of datagrams' data, not for every datagram's.
    let mut batch: [Bytes; READ_BATCH] = Default::default();
    while got < len {
        let Some(n) = recv.read_chunks(&mut batch).await? else {
            return Err(ProtoError::Truncated { needed: len, got }.into());
        };
        for chunk in &mut batch[..n] {
            let chunk = std::mem::take(chunk);
            let room = len - got;
            if chunk.len() as u64 > room {
                // More than the frame announced: what fits is the frame's, the rest trails it.
                let extra = chunk.len() as u64 - room;
                let _ = recv.stop(VarInt::from_u32(0));
                return Err(ProtoError::Trailing(extra).into());
            }
            got += chunk.len() as u64;
            if !chunk.is_empty() {
                sink.part(chunk);
            }
        }
    }
    // The frame must be the whole stream: anything after it is a malformed message, not
    // something to ignore.
    while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
        if !chunk.bytes.is_empty() {
            let _ = recv.stop(VarInt::from_u32(0));
            return Err(ProtoError::Trailing(chunk.bytes.len() as u64).into());
        }
    }
    Ok(msg)
}

/// Stream chunks taken from quinn per call while a frame's payload is read.
const READ_BATCH: usize = 32;

/// Passes an answer's payload to the caller's sink, except an error answer's (it has none;
/// the call turns it into [`CallError::Remote`]).
struct AnswerSink<'a, S>(&'a mut S);

impl<S: Sink<Response>> Sink<Response> for AnswerSink<'_, S> {
    fn header(&mut self, msg: &Response, len: u64) -> Result<(), String> {
        match msg {
            Response::Error { .. } | Response::NotLeader { .. } if len == 0 => Ok(()),
            Response::Error { .. } => Err(format!("an error answer with {len} payload bytes")),
            _ => self.0.header(msg, len),
        }
    }

    fn part(&mut self, part: Bytes) {
        self.0.part(part);
    }
}

/// Writes one frame to a stream and finishes it. The payload is handed to quinn uncopied.
pub async fn write_frame<T: Message, P: Payload>(
    send: &mut SendStream,
    frame: Frame<T, P>,
) -> Result<(), CallError> {
    queue_frame(send, frame).await?;
    send.finish()?;
    Ok(())
}

/// Queues one frame on a stream, without finishing it: the payload is handed to quinn
/// uncopied, and this returns once quinn has taken all of it (flow control permitting, at
/// once), while it is still being sent.
async fn queue_frame<T: Message, P: Payload>(
    send: &mut SendStream,
    frame: Frame<T, P>,
) -> Result<(), CallError> {
    let head = frame.encode_head()?;
    let mut chunks = Vec::with_capacity(2);
    chunks.push(head);
    frame.payload.append_to(&mut chunks);
    send.write_all_chunks(&mut chunks).await?;
    Ok(())
}

/// Whether a request whose payload is already on its way may be completed. A server acts on a
/// request only once its stream is finished, and drops what it received of a stream that was
/// reset: so a request can be sent while something about it is still being decided (a push
/// checks its gradients for NaN while QUIC sends them), and withdrawn if the answer is no.
pub trait Release {
    /// Called once the whole payload is queued; resolves to `true` to finish the stream, or
    /// `false` to reset it (the call then fails with [`CallError::Withdrawn`]).
    fn release(&self) -> impl Future<Output = bool> + Send;
}

/// Completes every request as soon as it is queued.
#[derive(Clone, Copy, Debug, Default)]
pub struct Now;

impl Release for Now {
    async fn release(&self) -> bool {
        true
    }
}

impl<R: Release + Sync> Release for Option<R> {
    async fn release(&self) -> bool {
        match self {
            Some(r) => r.release().await,
            None => true,
        }
    }
}

/// The stream reset code of a request withdrawn by its sender ([`Release`]).
pub const WITHDRAWN: u32 = 0x5749;

/// A boxed future, as the local connections' methods return.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A connection that is not a network's: each call is handed to something in the same process
/// (the deterministic simulation, `edl-dst`, passes it as a message to a service it runs).
pub trait LocalConn: Send + Sync + std::fmt::Debug {
    /// One request and its answer (an error answer as it is: the caller turns it into
    /// [`CallError::Remote`]). A failed connection is a [`CallError`] other than `Remote`.
    fn call(
        &self,
        req: Request,
        payload: Parts,
    ) -> BoxFuture<'_, Result<Frame<Response, Parts>, CallError>>;
}

/// Opens [`LocalConn`]s.
pub trait LocalNet: Send + Sync + std::fmt::Debug {
    /// A connection to the server at `addr`, as the client named `name`.
    fn connect<'a>(
        &'a self,
        addr: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn LocalConn>, CallError>>;
}

/// How a client reaches servers: over QUIC from an endpoint (every process), or through a
/// [`LocalNet`] (the simulation).
#[derive(Clone, Debug)]
pub enum Dialer {
    /// QUIC, from this endpoint (with the client's certificate).
    Quic(Endpoint),
    /// In-process connections.
    Local(Arc<dyn LocalNet>),
}

/// An authenticated connection to an EDL server, after the version handshake.
#[derive(Clone, Debug)]
pub struct Conn {
    link: Link,
    limits: FrameLimits,
    /// Follows the connection's datagram size while any clone of it lives.
    _watch: Option<Arc<DatagramWatch>>,
}

/// What a connection runs on.
#[derive(Clone, Debug)]
enum Link {
    Quic(quinn::Connection),
    Local(Arc<dyn LocalConn>),
}

impl Conn {
    /// Connects to `addr`, verifies the server against the cluster CA and shakes hands.
    pub async fn connect(
        endpoint: &Endpoint,
        addr: &str,
        name: &str,
        settings: &TransportSettings,
    ) -> Result<Conn, CallError> {
        let sock = resolve(addr).await?;
        let conn = endpoint.connect(sock, CLUSTER_SERVER_NAME)?.await?;
        let watch = DatagramWatch::start(&conn, addr.to_string());
        let c = Conn {
            link: Link::Quic(conn),
            limits: settings.limits,
            _watch: Some(Arc::new(watch)),
        };
        let resp = c
            .call(
                Request::Hello {
                    version: PROTOCOL_VERSION,
                    name: name.to_string(),
                },
                Bytes::new(),
            )
            .await?;
        match resp.msg {
            Response::Hello { version, .. } if version == PROTOCOL_VERSION => Ok(c),
            other => Err(CallError::unexpected(&other)),
        }
    }

    /// Connects to `addr` through `dialer`: [`Conn::connect`] over QUIC, or a local connection.
    pub async fn dial(
        dialer: &Dialer,
        addr: &str,
        name: &str,
        settings: &TransportSettings,
    ) -> Result<Conn, CallError> {
        match dialer {
            Dialer::Quic(endpoint) => Conn::connect(endpoint, addr, name, settings).await,
            Dialer::Local(net) => Ok(Conn {
                link: Link::Local(net.connect(addr, name).await?),
                limits: settings.limits,
                _watch: None,
            }),
        }
    }

    /// Sends one request on a new stream and waits for its response. A `Response::Error` from
    /// the peer becomes [`CallError::Remote`]. The request's payload is sent as it lies (a
    /// [`Parts`] payload without being joined).
    pub async fn call<P: Payload>(
        &self,
        req: Request,
        payload: P,
    ) -> Result<Frame<Response>, CallError> {
        let mut sink = Collect::default();
        let msg = self.call_into(req, payload, &mut sink).await?;
        Ok(Frame::with_payload(msg, sink.finish()?.to_bytes()))
    }

    /// [`Conn::call`], with the answer's payload handed to `sink` part by part as it arrives
    /// (a pull writes it straight where it belongs). On an error `sink` may have seen part of
    /// a payload; a repeated call starts it again with [`Sink::header`].
    pub async fn call_into<P: Payload, S: Sink<Response>>(
        &self,
        req: Request,
        payload: P,
        sink: &mut S,
    ) -> Result<Response, CallError> {
        self.call_released(req, payload, &Now, sink).await
    }

    /// [`Conn::call_into`], with the request completed only once `release` allows it (while
    /// its payload is already being sent), and withdrawn otherwise.
    pub async fn call_released<P: Payload, S: Sink<Response>>(
        &self,
        req: Request,
        payload: P,
        release: &impl Release,
        sink: &mut S,
    ) -> Result<Response, CallError> {
        let conn = match &self.link {
            Link::Quic(conn) => conn,
            Link::Local(local) => {
                let mut parts = Vec::new();
                payload.append_to(&mut parts);
                if !release.release().await {
                    return Err(CallError::Withdrawn);
                }
                let answer = local.call(req, Parts(parts)).await?;
                let mut sink = AnswerSink(sink);
                let len = answer.payload.byte_len() as u64;
                sink.header(&answer.msg, len).map_err(CallError::Refused)?;
                answer.payload.0.into_iter().for_each(|p| sink.part(p));
                return CallError::answered(answer.msg);
            }
        };
        let (mut send, mut recv) = conn.open_bi().await.map_err(CallError::NotSent)?;
        queue_frame(&mut send, Frame::with_payload(req, payload)).await?;
        if !release.release().await {
            let _ = send.reset(VarInt::from_u32(WITHDRAWN));
            return Err(CallError::Withdrawn);
        }
        send.finish()?;
        let p = read_prefix(&mut recv, &self.limits).await?;
        CallError::answered(read_frame_into(&mut recv, &p, &mut AnswerSink(sink)).await?)
    }

    /// The underlying QUIC connection (none for a local one).
    pub fn quic(&self) -> Option<&quinn::Connection> {
        match &self.link {
            Link::Quic(conn) => Some(conn),
            Link::Local(_) => None,
        }
    }

    /// Closes the connection.
    pub fn close(&self) {
        if let Link::Quic(conn) = &self.link {
            conn.close(VarInt::from_u32(0), b"bye");
        }
    }
}

/// Resolves `host:port` to a socket address.
pub async fn resolve(addr: &str) -> Result<SocketAddr, CallError> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    tokio::net::lookup_host(addr)
        .await
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(|| {
            CallError::Address(format!(
                "{addr:?} is not an address this machine resolves: expected HOST:PORT (an IP \
                 address or a host name, and a port)"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn::AsyncUdpSocket;

    /// A server and a client encrypting with different implementations agree on the suite
    /// and carry a payload of many packets intact, each way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn peers_encrypting_with_aws_lc_and_with_ring_understand_each_other() {
        let dir = tempfile::tempdir().expect("temp dir");
        let pki = crate::pki::PkiDir::new(dir.path());
        pki.init_ca().expect("CA");
        let server_id = pki
            .ensure(crate::Role::Shard, "s")
            .expect("server identity");
        let client_id = pki
            .ensure(crate::Role::Worker, "w")
            .expect("client identity");
        // Each choice brings its own implementation's suites.
        let suites = |p: &rustls::crypto::CryptoProvider| {
            let at = |s: &rustls::SupportedCipherSuite| match s {
                rustls::SupportedCipherSuite::Tls13(t) => std::ptr::from_ref(*t).addr(),
                rustls::SupportedCipherSuite::Tls12(t) => std::ptr::from_ref(*t).addr(),
            };
            p.cipher_suites.iter().map(at).collect::<Vec<_>>()
        };
        let ring = rustls::crypto::ring::default_provider();
        let aws_lc = rustls::crypto::aws_lc_rs::default_provider();
        assert_eq!(suites(&provider(Aead::Ring)), suites(&ring));
        assert_eq!(suites(&provider(Aead::AwsLc)), suites(&aws_lc));
        assert_ne!(suites(&ring), suites(&aws_lc));
        let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for (server_aead, client_aead) in [(Aead::Ring, Aead::AwsLc), (Aead::AwsLc, Aead::Ring)] {
            let with = |aead| TransportSettings {
                aead,
                ..TransportSettings::default()
            };
            let server = server_endpoint(
                "127.0.0.1:0".parse().expect("addr"),
                &server_id,
                &with(server_aead),
            )
            .expect("server endpoint");
            let addr = server.local_addr().expect("bound");
            let echo = tokio::spawn(async move {
                let conn = server
                    .accept()
                    .await
                    .expect("a connection")
                    .await
                    .expect("handshake");
                let (mut send, mut recv) = conn.accept_bi().await.expect("a stream");
                let got = recv.read_to_end(1 << 20).await.expect("request");
                send.write_all(&got).await.expect("answer");
                send.finish().expect("finish");
                send.stopped().await.expect("answer received");
            });
            let client =
                client_endpoint(&client_id, &with(client_aead), false).expect("client endpoint");
            let conn = client
                .connect(addr, CLUSTER_SERVER_NAME)
                .expect("connect")
                .await
                .expect("handshake");
            let (mut send, mut recv) = conn.open_bi().await.expect("stream");
            send.write_all(&body).await.expect("request");
            send.finish().expect("finish");
            let back = recv.read_to_end(1 << 20).await.expect("answer");
            assert!(
                back == body,
                "server {server_aead:?}, client {client_aead:?}: echo differs"
            );
            echo.await.expect("echo task");
        }
    }

    /// A socket that records what it is asked to send, refusing sends once `full` of them
    /// went (as a full socket buffer does).
    #[derive(Debug, Default)]
    struct Recording {
        sent: std::sync::Mutex<Vec<(usize, Option<usize>)>>,
        full: Option<usize>,
    }

    impl quinn::AsyncUdpSocket for Recording {
        fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
            unreachable!("not polled in these tests")
        }

        fn try_send(&self, t: &quinn::udp::Transmit) -> std::io::Result<()> {
            let mut sent = self.sent.lock().expect("sent");
            if self.full.is_some_and(|n| sent.len() >= n) {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            sent.push((t.contents.len(), t.segment_size));
            Ok(())
        }

        fn poll_recv(
            &self,
            _: &mut std::task::Context,
            _: &mut [std::io::IoSliceMut<'_>],
            _: &mut [quinn::udp::RecvMeta],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Pending
        }

        fn local_addr(&self) -> std::io::Result<SocketAddr> {
            Ok(SocketAddr::from(([127, 0, 0, 1], 1)))
        }
    }

    fn transmit(contents: &[u8], segment: Option<usize>) -> quinn::udp::Transmit<'_> {
        quinn::udp::Transmit {
            destination: SocketAddr::from(([127, 0, 0, 1], 2)),
            ecn: None,
            contents,
            segment_size: segment,
            src_ip: None,
        }
    }

    #[test]
    fn batches_larger_than_the_kernel_takes_go_as_several_of_whole_datagrams() {
        let inner = Arc::new(Recording::default());
        let split = SplitBatches {
            inner: inner.clone(),
            max_segments: usize::MAX,
        };
        // Ten jumbo datagrams, the last one short: 89,000 bytes in one batch.
        let bytes = vec![0u8; 9 * 8972 + 1000];
        split.try_send(&transmit(&bytes, Some(8972))).expect("sent");
        let sent = inner.sent.lock().expect("sent").clone();
        assert_eq!(
            sent,
            [(7 * 8972, Some(8972)), (2 * 8972 + 1000, Some(8972))]
        );
        assert!(sent.iter().all(|(len, _)| *len <= MAX_BATCH_BYTES));
        // What fits goes as it is; a lone datagram too.
        inner.sent.lock().expect("sent").clear();
        split
            .try_send(&transmit(&bytes[..10 * 1452], Some(1452)))
            .expect("sent");
        split
            .try_send(&transmit(&bytes[..60_000], None))
            .expect("sent");
        assert_eq!(
            *inner.sent.lock().expect("sent"),
            [(10 * 1452, Some(1452)), (60_000, None)]
        );
        // The last piece of a split batch goes as a lone datagram when it is one.
        inner.sent.lock().expect("sent").clear();
        let long = vec![0u8; 14 * 8972 + 500];
        split.try_send(&transmit(&long, Some(8972))).expect("sent");
        assert_eq!(
            *inner.sent.lock().expect("sent"),
            [(7 * 8972, Some(8972)), (7 * 8972, Some(8972)), (500, None)]
        );
    }

    #[test]
    fn a_full_socket_refuses_a_batch_whole_or_drops_only_its_tail() {
        let bytes = vec![0u8; 10 * 8972];
        // Full at once: nothing went, and quinn is told to try the whole batch again.
        let refusing = Arc::new(Recording {
            full: Some(0),
            ..Recording::default()
        });
        let split = SplitBatches {
            inner: refusing.clone(),
            max_segments: usize::MAX,
        };
        let e = split
            .try_send(&transmit(&bytes, Some(8972)))
            .expect_err("would block");
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        // Full after the first piece: the first went, the rest counts as lost (QUIC resends
        // it), and the batch is not sent again (which would send the first piece twice).
        let half = Arc::new(Recording {
            full: Some(1),
            ..Recording::default()
        });
        let split = SplitBatches {
            inner: half.clone(),
            max_segments: usize::MAX,
        };
        split.try_send(&transmit(&bytes, Some(8972))).expect("ok");
        assert_eq!(*half.sent.lock().expect("sent"), [(7 * 8972, Some(8972))]);
    }

    /// With the default settings, path-MTU discovery finds that loopback carries a jumbo
    /// link's datagrams, both peers send them, and the size is exported as a metric.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn path_mtu_discovery_reaches_jumbo_datagrams_where_the_path_carries_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let pki = crate::pki::PkiDir::new(dir.path());
        pki.init_ca().expect("CA");
        let server_id = pki.ensure(crate::Role::Shard, "s").expect("server");
        let client_id = pki.ensure(crate::Role::Worker, "w").expect("client");
        let settings = TransportSettings {
            datagram: None,
            ..TransportSettings::default()
        };
        let server = server_endpoint("127.0.0.1:0".parse().expect("addr"), &server_id, &settings)
            .expect("server endpoint");
        let addr = server.local_addr().expect("bound");
        let accepted = tokio::spawn(async move {
            let conn = server.accept().await.expect("a connection").await;
            (server, conn.expect("handshake"))
        });
        let client = client_endpoint(&client_id, &settings, false).expect("client endpoint");
        let conn = client
            .connect(addr, CLUSTER_SERVER_NAME)
            .expect("connect")
            .await
            .expect("handshake");
        let (_server, theirs) = accepted.await.expect("server task");
        let watch = DatagramWatch::start(&conn, "mtu-test-peer".into());
        // The search starts at 1,200 bytes; it takes a few round trips, a few seconds at most.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (mine, other) = (
                conn.stats().path.current_mtu,
                theirs.stats().path.current_mtu,
            );
            let shown = crate::metrics::render().contains(&format!(
                "edl_datagram_bytes{{peer=\"mtu-test-peer\"}} {JUMBO_DATAGRAM}"
            ));
            if mine == JUMBO_DATAGRAM && other == JUMBO_DATAGRAM && shown {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "after 20 s: client {mine}, server {other} bytes; metric shown: {shown}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The metric goes with the watch; the watch holds no handle that keeps the connection.
        drop(watch);
        assert!(!crate::metrics::render().contains("mtu-test-peer"));
        drop(conn);
        tokio::time::timeout(Duration::from_secs(5), theirs.closed())
            .await
            .expect("the client's connection, dropped, closed");
        drop(client);
    }

    #[test]
    fn small_parts_are_joined_and_large_ones_kept_as_they_arrived() {
        let mut c = Collect::default();
        let msg = Response::Ack;
        Sink::<Response>::header(&mut c, &msg, 0).expect("header");
        let big = Bytes::from(vec![7u8; KEEP_PART]);
        let mut want = Vec::new();
        for i in 0..3000u32 {
            let piece = Bytes::from(vec![(i % 251) as u8; 1 + (i as usize % 40)]);
            want.extend_from_slice(&piece);
            Sink::<Response>::part(&mut c, piece);
        }
        want.extend_from_slice(&big);
        Sink::<Response>::part(&mut c, big.clone());
        let parts = c.finish().expect("no floats to check").0;
        let joined: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        assert_eq!(joined, want);
        // 3000 tiny parts became a few buffers; the large one is the very buffer received.
        assert!(
            parts.len() <= 1 + want.len() / KEEP_PART + 1,
            "{} parts",
            parts.len()
        );
        assert_eq!(parts.last().map(|p| p.as_ptr()), Some(big.as_ptr()));
    }
}
