//! `edl-bench transport`: push + pull of one tensor through EDL's own client and shard
//! servers (which apply SGD), against the same bytes as request/response over a bare quinn
//! stream with the same TLS and transport settings, and over plain TCP on loopback, all in one
//! run and one process.
//!
//! One *pair* is a push of the tensor followed by a pull of it; with several shards, each
//! request is split evenly and sent to every server in parallel, as EDL's client does. GB/s
//! counts the bytes of both directions (2 × size per pair) over the wall time of all clients.
//!
//! The systems of a point are set up side by side and take turns: each runs its share of the
//! pairs in [`ROUNDS`] rounds, in an order that rotates from round to round. A machine that
//! slows down for a while (another tenant, a frequency change) slows every system alike, so
//! the ratios of one run hold even where the machine's speed does not.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use edl_shared::pki::{CLUSTER_SERVER_NAME, PkiDir};
use edl_shared::proto::{Clock, Consistency, OptimizerSpec};
use edl_shared::transport::{TransportSettings, client_endpoint, server_endpoint};
use edl_shared::{Identity, Role};
use edl_testkit::{TestCluster, counter_job};
use edl_worker::Gradients;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::stats::{Samples, gbps};

/// The systems compared: EDL, EDL whose shards apply no optimizer (SGD at learning rate 0,
/// which leaves the parameters as they are: the transport and the server's bookkeeping
/// without the update), bare quinn and plain TCP.
pub const SYSTEMS: [&str; 4] = ["edl", "edl-noopt", "quinn", "tcp"];

/// EDL keeping two copies of every key range (`--replicas 2`): each shard the primary of its
/// share and the backup of another's, so a push is acknowledged once its backup holds it too.
/// Not run by default; measured at points with at least 2 shards, beside `edl`.
pub const REPLICATED: &str = "edl-r2";

/// One measurement.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// edl, quinn or tcp.
    pub system: String,
    /// Tensor bytes.
    pub size: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Servers the tensor is split over.
    pub shards: usize,
    /// Push+pull pairs measured.
    pub pairs: usize,
    /// Bytes both ways per second, all clients together, GB/s.
    pub gbps: f64,
    /// Round trip of one pair, microseconds.
    pub p50_us: f64,
    /// 99th percentile of the pair round trip, microseconds.
    pub p99_us: f64,
    /// The datagram size (UDP payload bytes) its QUIC connections sent at the end, where
    /// the system can tell (bare quinn): what path-MTU discovery found.
    pub datagram: Option<u16>,
}

/// EDL against the baselines at one point.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// Tensor bytes.
    pub size: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Servers.
    pub shards: usize,
    /// EDL's GB/s over bare quinn's.
    pub edl_over_quinn: f64,
    /// EDL's GB/s over TCP's.
    pub edl_over_tcp: f64,
}

/// What the run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// The fixed datagram size in use (`None`: path-MTU discovery).
    pub datagram: Option<u16>,
    /// Whose AES-GCM encrypted the packets (`aws-lc` or `ring`).
    pub aead: &'static str,
    /// The link the servers were behind (`None`: loopback).
    pub link: Option<String>,
    /// Every measurement.
    pub rows: Vec<Row>,
    /// Per point, EDL over the baselines.
    pub ratios: Vec<Ratio>,
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Tensor sizes in bytes.
    pub sizes: Vec<usize>,
    /// (clients, shards) points.
    pub points: Vec<(usize, usize)>,
    /// Fewer pairs per point.
    pub quick: bool,
    /// Transport settings for EDL and bare quinn.
    pub settings: TransportSettings,
    /// The systems to run (of [`SYSTEMS`] and [`QUINN`]); ratios need edl, quinn and tcp.
    pub systems: Vec<String>,
    /// Pairs per point, instead of the default for the size.
    pub pairs: Option<usize>,
    /// Where the servers run: on loopback beside the clients, or behind a link.
    pub side: Side,
}

/// Where a benchmark's servers listen and run: on loopback in this runtime, or on a runtime
/// whose threads are in the network namespace of a [`crate::netns::Link`], at its far end.
#[derive(Clone, Debug)]
pub struct Side {
    /// The address servers listen on.
    pub ip: IpAddr,
    /// The runtime the servers run on (`None`: the caller's).
    handle: Option<tokio::runtime::Handle>,
    /// The link crossed, as reports name it (`None`: loopback).
    pub link: Option<String>,
}

impl Default for Side {
    fn default() -> Self {
        Side {
            ip: Ipv4Addr::LOCALHOST.into(),
            handle: None,
            link: None,
        }
    }
}

impl Side {
    /// Servers at the far end of `servers`' link, run on its runtime.
    pub fn behind(servers: &crate::netns::Servers) -> Side {
        Side {
            ip: servers.link().server_ip.into(),
            handle: servers.runtime().map(|rt| rt.handle().clone()),
            link: Some(servers.link().describe()),
        }
    }

    /// Runs `setup` where the servers run: what it binds, and the tasks it spawns, are there.
    pub async fn run<T: Send + 'static>(
        &self,
        setup: impl Future<Output = anyhow::Result<T>> + Send + 'static,
    ) -> anyhow::Result<T> {
        match &self.handle {
            Some(h) => h.spawn(setup).await?,
            None => setup.await,
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, 0)
    }
}

impl Plan {
    /// The plan: 4 KiB to 16 MiB; 1 client and 1 shard, 2 and 4 clients, 2 shards.
    pub fn standard(quick: bool, settings: TransportSettings) -> Plan {
        Plan {
            sizes: vec![4 << 10, 64 << 10, 1 << 20, 16 << 20],
            points: vec![(1, 1), (2, 1), (4, 1), (1, 2)],
            quick,
            settings,
            systems: SYSTEMS.iter().map(|s| s.to_string()).collect(),
            pairs: None,
            side: Side::default(),
        }
    }

    fn pairs(&self, size: usize) -> usize {
        if let Some(n) = self.pairs {
            return n.max(1);
        }
        let full = match size {
            s if s <= 4 << 10 => 2000,
            s if s <= 64 << 10 => 1000,
            s if s <= 1 << 20 => 200,
            _ => 24,
        };
        if self.quick { (full / 20).max(3) } else { full }
    }
}

/// Rounds the pairs of a point are split over (fewer when there are fewer pairs).
pub const ROUNDS: usize = 8;

/// Runs the plan.
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    let pki_dir = tempfile::tempdir()?;
    let pki = PkiDir::new(pki_dir.path());
    pki.init_ca()?;
    let mut rows = Vec::new();
    for &(clients, shards) in &plan.points {
        for &size in &plan.sizes {
            let runs = |sys: &str| plan.systems.iter().any(|s| s == sys);
            let mut ready: Vec<(&str, Ready)> = Vec::new();
            for (system, apply, replicas) in [
                ("edl", true, 1),
                ("edl-noopt", false, 1),
                (REPLICATED, true, 2),
            ] {
                if runs(system) && shards >= replicas {
                    let r = edl(size, (clients, shards), (apply, replicas), plan)
                        .await
                        .with_context(|| format!("{system} {size} B"))?;
                    ready.push((system, r));
                }
            }
            for (system, stripes) in QUINN {
                if runs(system) {
                    let r = quinn_pairs(&pki, size, (clients, shards), stripes, plan)
                        .await
                        .with_context(|| format!("{system} {size} B"))?;
                    ready.push((system, r));
                }
            }
            if runs("tcp") {
                let r = tcp_pairs(size, clients, shards, &plan.side)
                    .await
                    .with_context(|| format!("tcp {size} B"))?;
                ready.push(("tcp", r));
            }
            let measured = take_turns(&ready, clients, plan.pairs(size))
                .await
                .with_context(|| format!("{size} B, {clients}×{shards}"))?;
            for ((system, r), m) in ready.into_iter().zip(measured) {
                let mut row = m.row(system, size, clients, shards);
                row.datagram = r.datagram.as_ref().map(|d| d());
                rows.push(row);
                r.stop().await;
            }
        }
    }
    let ratios = ratios(&rows);
    Ok(Results {
        datagram: plan.settings.datagram,
        aead: plan.settings.aead.name(),
        link: plan.side.link.clone(),
        rows,
        ratios,
    })
}

/// Warms every system up, then runs `pairs` pairs of each in [`ROUNDS`] rounds, the systems
/// taking turns within a round and the first turn moving on by one each round.
async fn take_turns(
    ready: &[(&str, Ready)],
    clients: usize,
    pairs: usize,
) -> anyhow::Result<Vec<Measured>> {
    for (system, r) in ready {
        for c in 0..clients {
            for _ in 0..WARMUP {
                (r.pair)(c)
                    .await
                    .with_context(|| format!("{system}, warming up"))?;
            }
        }
    }
    let mut measured: Vec<Measured> = ready.iter().map(|_| Measured::default()).collect();
    let rounds = ROUNDS.min(pairs).max(1);
    for round in 0..rounds {
        // This round's share: the rounds' shares add up to `pairs`.
        let n = pairs * (round + 1) / rounds - pairs * round / rounds;
        for turn in 0..ready.len() {
            let k = (round + turn) % ready.len();
            let (system, r) = &ready[k];
            let m = measure(clients, n, &r.pair)
                .await
                .with_context(|| format!("{system}, round {round}"))?;
            measured[k].add(m);
        }
    }
    Ok(measured)
}

/// Per point where both ran, the price of a second copy: `edl-r2`'s pair time (p50) and
/// throughput against `edl`'s, as lines to print.
pub fn replication_costs(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter(|r| r.system == REPLICATED)
        .filter_map(|r2| {
            let one = rows.iter().find(|r| {
                r.system == "edl"
                    && (r.size, r.clients, r.shards) == (r2.size, r2.clients, r2.shards)
            })?;
            Some(format!(
                "replication cost, {} B, {}x{}: p50 {:.0} us with 2 copies against {:.0} us with \
                 one ({:.2}x); throughput {:.1} against {:.1} Gbit/s ({:.2}x)",
                r2.size,
                r2.clients,
                r2.shards,
                r2.p50_us,
                one.p50_us,
                r2.p50_us / one.p50_us.max(f64::MIN_POSITIVE),
                r2.gbps * 8.0,
                one.gbps * 8.0,
                r2.gbps / one.gbps.max(f64::MIN_POSITIVE),
            ))
        })
        .collect()
}

fn ratios(rows: &[Row]) -> Vec<Ratio> {
    let find = |sys: &str, r: &Row| {
        rows.iter()
            .find(|x| {
                x.system == sys
                    && x.size == r.size
                    && x.clients == r.clients
                    && x.shards == r.shards
            })
            .map(|x| x.gbps)
    };
    rows.iter()
        .filter(|r| r.system == "edl")
        .filter_map(|r| {
            let (q, t) = (find("quinn", r)?, find("tcp", r)?);
            Some(Ratio {
                size: r.size,
                clients: r.clients,
                shards: r.shards,
                edl_over_quinn: r.gbps / q.max(1e-12),
                edl_over_tcp: r.gbps / t.max(1e-12),
            })
        })
        .collect()
}

/// Pair latencies of all clients, and the wall time they took together.
#[derive(Default)]
struct Measured {
    samples: Samples,
    wall: Duration,
}

impl Measured {
    /// Adds another round's pairs.
    fn add(&mut self, other: Measured) {
        self.samples.extend(other.samples);
        self.wall += other.wall;
    }

    fn row(&self, system: &str, size: usize, clients: usize, shards: usize) -> Row {
        Row {
            system: system.into(),
            size,
            clients,
            shards,
            pairs: self.samples.len(),
            gbps: gbps((2 * size * self.samples.len()) as f64, self.wall),
            p50_us: self.samples.quantile(0.5),
            p99_us: self.samples.quantile(0.99),
            datagram: None,
        }
    }
}

/// Pairs run this many times before measuring (connections warm, windows open).
const WARMUP: usize = 3;

/// One push+pull pair of a client.
type PairFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// A system set up for a point: `pair(c)` runs one pair as client `c`.
struct Ready {
    pair: Box<dyn Fn(usize) -> PairFuture + Send + Sync>,
    /// Takes down what the system started (servers, a cluster).
    stop: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// The datagram size its QUIC connections send, where the system can tell.
    datagram: Option<Box<dyn Fn() -> u16 + Send + Sync>>,
}

impl Ready {
    fn new<F, Fut>(pair: F, stop: impl Future<Output = ()> + Send + 'static) -> Ready
    where
        F: Fn(usize) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        Ready {
            pair: Box::new(move |c| Box::pin(pair(c))),
            stop: Box::pin(stop),
            datagram: None,
        }
    }

    /// Ends the clients' connections, then the servers.
    async fn stop(self) {
        drop(self.pair);
        self.stop.await;
    }
}

/// Runs `clients` copies of `pair` (each `pairs` times) at once.
async fn measure(
    clients: usize,
    pairs: usize,
    pair: &(dyn Fn(usize) -> PairFuture + Send + Sync),
) -> anyhow::Result<Measured> {
    let start = Instant::now();
    let mut set = JoinSet::new();
    for c in 0..clients {
        let runs: Vec<PairFuture> = (0..pairs).map(|_| pair(c)).collect();
        set.spawn(async move {
            let mut s = Samples::default();
            for run in runs {
                let t = Instant::now();
                run.await?;
                s.push(t.elapsed());
            }
            anyhow::Ok(s)
        });
    }
    let mut samples = Samples::default();
    while let Some(r) = set.join_next().await {
        samples.extend(r??);
    }
    Ok(Measured {
        samples,
        wall: start.elapsed(),
    })
}

/// Through EDL: a cluster of `shards` shard servers holding one tensor of `size` bytes, SGD
/// (at learning rate 0 without `apply`). Gradients are pushed as [`Gradients`] (sent as they
/// lie) and pulled straight into each client's parameter buffer, as a worker does.
async fn edl(
    size: usize,
    (clients, shards): (usize, usize),
    (apply, replicas): (bool, usize),
    plan: &Plan,
) -> anyhow::Result<Ready> {
    let settings = &plan.settings;
    let floats = (size / 4).max(1);
    // Chunks of at most 256 KiB: large tensors spread over several keys per shard.
    let chunk = floats.min(64 << 10) as u32;
    let mut job = counter_job(floats as u32, chunk, Consistency::Asp);
    if !apply {
        job.optimizer = OptimizerSpec::sgd(0.0);
    }
    job.replicas = replicas as u32;
    let (server_settings, ip) = (settings.clone(), plan.side.ip);
    let cluster = plan
        .side
        .run(async move { TestCluster::start_on(job, shards as u32, server_settings, ip).await })
        .await?;
    let mut sessions = Vec::new();
    for c in 0..clients {
        let mut cfg = cluster.client_config(&format!("bench{c}"))?;
        cfg.settings = settings.clone();
        let job = edl_worker::Job::connect(&cfg).await?;
        sessions.push(Arc::new(job.register("bench").await?));
    }
    let grads = Arc::new(Gradients::from(vec![1e-6f32; floats]));
    // Each client pulls into its own buffer, reused like a worker's parameter vector.
    let outs: Vec<_> = (0..clients)
        .map(|_| Arc::new(tokio::sync::Mutex::new(vec![0f32; floats])))
        .collect();
    let pair = move |c: usize| {
        let (s, g, out) = (sessions[c].clone(), grads.clone(), outs[c].clone());
        async move {
            s.push_step_gradients(&g).await?;
            let mut out = out.lock().await;
            s.job().pull_all(&mut out, Clock(0)).await?;
            Ok(())
        }
    };
    // `Ready::stop` drops the sessions (with `pair`) before the cluster stops.
    Ok(Ready::new(pair, async move { cluster.stop().await }))
}

/// Bare quinn as the baseline, and striped: each part of a request split over 2 streams of
/// one connection, or over 2 connections, each between endpoints of their own (each endpoint
/// receives on one task), or over 2 connections between the same two endpoints (each
/// connection encrypts and decrypts on a task of its own).
pub const QUINN: [(&str, Stripes); 4] = [
    (
        "quinn",
        Stripes {
            streams: 1,
            endpoints: 1,
            conns: 1,
        },
    ),
    (
        "quinn-2streams",
        Stripes {
            streams: 2,
            endpoints: 1,
            conns: 1,
        },
    ),
    (
        "quinn-2conns",
        Stripes {
            streams: 1,
            endpoints: 2,
            conns: 1,
        },
    ),
    (
        "quinn-2conns-1ep",
        Stripes {
            streams: 1,
            endpoints: 1,
            conns: 2,
        },
    ),
];

/// How bare quinn carries each part of a request: split over `streams` streams of each
/// connection, over `conns` connections between each pair of endpoints, and over `endpoints`
/// pairs of endpoints of their own, all at once.
#[derive(Clone, Copy, Debug)]
pub struct Stripes {
    /// Streams per connection.
    pub streams: usize,
    /// Connections, each between endpoints of their own.
    pub endpoints: usize,
    /// Connections between each pair of endpoints.
    pub conns: usize,
}

/// Bare quinn: `shards` servers that read a request (a 9-byte header: op, length; then the
/// payload for a push) and answer 8 bytes (push) or `length` bytes (pull).
async fn quinn_pairs(
    pki: &PkiDir,
    size: usize,
    (clients, shards): (usize, usize),
    stripes: Stripes,
    plan: &Plan,
) -> anyhow::Result<Ready> {
    let settings = &plan.settings;
    let (streams, endpoints) = (
        stripes.streams.max(1),
        stripes.endpoints.max(1) * stripes.conns.max(1),
    );
    // Each shard's part, cut into one piece per stream and per connection.
    let piece = (size / shards / streams / endpoints).max(1);
    let server_id = pki.ensure(Role::Shard, "bare")?;
    let (bind, server_settings) = (plan.side.addr(), settings.clone());
    let (addrs, mut servers) = plan
        .side
        .run(async move {
            let mut addrs = Vec::new();
            let mut servers = JoinSet::new();
            for _ in 0..shards * stripes.endpoints.max(1) {
                let ep = server_endpoint(bind, &server_id, &server_settings)?;
                addrs.push(ep.local_addr()?);
                servers.spawn(quinn_server(ep, Bytes::from(vec![7u8; piece])));
            }
            anyhow::Ok((addrs, servers))
        })
        .await?;
    let client_id = pki.ensure(Role::Worker, "bare-client")?;
    let mut conns = Vec::new();
    for _ in 0..clients {
        let mut mine = Vec::new();
        // With several connections per part, each gets a client endpoint of its own.
        for group in addrs.chunks(if stripes.endpoints > 1 {
            1
        } else {
            addrs.len()
        }) {
            mine.extend(quinn_connect(&client_id, settings, group, stripes.conns).await?);
        }
        // One entry per stream: streams of one connection share it.
        let mine: Vec<_> = mine
            .into_iter()
            .flat_map(|c| std::iter::repeat_n(c, streams))
            .collect();
        conns.push(Arc::new(mine));
    }
    let payload = Bytes::from(vec![1u8; piece]);
    let all: Vec<quinn::Connection> = conns.iter().flat_map(|v| v.iter().cloned()).collect();
    let pair = move |c: usize| {
        let (conns, payload) = (conns[c].clone(), payload.clone());
        async move {
            fan(&conns, |conn| quinn_call(conn.clone(), 0, payload.clone())).await?;
            fan(&conns, |conn| quinn_call(conn.clone(), 1, payload.clone())).await?;
            Ok(())
        }
    };
    let mut ready = Ready::new(pair, async move { servers.abort_all() });
    ready.datagram = Some(Box::new(move || {
        all.iter()
            .map(|c| c.stats().path.current_mtu)
            .min()
            .unwrap_or(0)
    }));
    Ok(ready)
}

async fn quinn_connect(
    id: &Identity,
    settings: &TransportSettings,
    addrs: &[SocketAddr],
    each: usize,
) -> anyhow::Result<Vec<quinn::Connection>> {
    let ep = client_endpoint(id, settings, false)?;
    let mut out = Vec::new();
    for a in addrs {
        for _ in 0..each.max(1) {
            out.push(ep.connect(*a, CLUSTER_SERVER_NAME)?.await?);
        }
    }
    Ok(out)
}

/// Runs `call` on every connection at once.
async fn fan<T, F, Fut>(conns: &[T], call: F) -> anyhow::Result<()>
where
    F: Fn(&T) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let mut set = JoinSet::new();
    for c in conns {
        set.spawn(call(c));
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(())
}

fn header(op: u8, len: usize) -> [u8; 9] {
    let mut h = [0u8; 9];
    h[0] = op;
    h[1..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// The op and length of a request header written by [`header`].
fn parse_header(h: &[u8; 9]) -> (u8, usize) {
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&h[1..]);
    (h[0], u64::from_le_bytes(len8) as usize)
}

/// One request on a new stream: op 0 pushes `payload` and reads an 8-byte ack, op 1 asks for
/// `payload.len()` bytes and reads them.
async fn quinn_call(conn: quinn::Connection, op: u8, payload: Bytes) -> anyhow::Result<()> {
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&header(op, payload.len())).await?;
    if op == 0 {
        send.write_chunk(payload.clone()).await?;
    }
    send.finish()?;
    let want = if op == 0 { 8 } else { payload.len() };
    // Receive the answer into one buffer, as the server does a push and as the TCP client
    // does: a client has to put what it pulls somewhere.
    let mut got = Vec::with_capacity(want);
    while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
        got.extend_from_slice(&chunk.bytes);
    }
    anyhow::ensure!(
        got.len() == want,
        "answer of {} bytes, expected {want}",
        got.len()
    );
    Ok(())
}

async fn quinn_server(ep: quinn::Endpoint, data: Bytes) {
    while let Some(incoming) = ep.accept().await {
        let data = data.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                let data = data.clone();
                tokio::spawn(async move {
                    let mut h = [0u8; 9];
                    if recv.read_exact(&mut h).await.is_err() {
                        return;
                    }
                    let (op, len) = parse_header(&h);
                    if op == 0 {
                        // Receive the push into one buffer, as a server would to apply it.
                        let mut buf = Vec::with_capacity(len);
                        while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, true).await {
                            buf.extend_from_slice(&chunk.bytes);
                        }
                        let _ = send.write_all(&(buf.len() as u64).to_le_bytes()).await;
                    } else {
                        let _ = send.write_chunk(data.slice(..len.min(data.len()))).await;
                    }
                    let _ = send.finish();
                    // Keep the stream until the peer has read everything.
                    let _ = send.stopped().await;
                });
            }
        });
    }
}

/// Plain TCP: one connection per (client, server), the same requests in sequence.
async fn tcp_pairs(
    size: usize,
    clients: usize,
    shards: usize,
    side: &Side,
) -> anyhow::Result<Ready> {
    let part = (size / shards).max(1);
    let bind = side.addr();
    let (addrs, mut servers) = side
        .run(async move {
            let mut addrs = Vec::new();
            let mut servers = JoinSet::new();
            for _ in 0..shards {
                let l = TcpListener::bind(bind).await?;
                addrs.push(l.local_addr()?);
                servers.spawn(tcp_server(l, Arc::new(vec![7u8; part])));
            }
            anyhow::Ok((addrs, servers))
        })
        .await?;
    let mut conns = Vec::new();
    for _ in 0..clients {
        let mut per = Vec::new();
        for a in &addrs {
            let s = TcpStream::connect(a).await?;
            s.set_nodelay(true)?;
            per.push(Arc::new(tokio::sync::Mutex::new(s)));
        }
        conns.push(Arc::new(per));
    }
    let payload = Arc::new(vec![1u8; part]);
    let pair = move |c: usize| {
        let (conns, payload) = (conns[c].clone(), payload.clone());
        async move {
            fan(&conns, |s| tcp_call(s.clone(), 0, payload.clone())).await?;
            fan(&conns, |s| tcp_call(s.clone(), 1, payload.clone())).await?;
            Ok(())
        }
    };
    Ok(Ready::new(pair, async move { servers.abort_all() }))
}

async fn tcp_call(
    stream: Arc<tokio::sync::Mutex<TcpStream>>,
    op: u8,
    payload: Arc<Vec<u8>>,
) -> anyhow::Result<()> {
    let mut s = stream.lock().await;
    s.write_all(&header(op, payload.len())).await?;
    if op == 0 {
        s.write_all(&payload).await?;
        let mut ack = [0u8; 8];
        s.read_exact(&mut ack).await?;
    } else {
        let mut buf = vec![0u8; payload.len()];
        s.read_exact(&mut buf).await?;
    }
    Ok(())
}

async fn tcp_server(l: TcpListener, data: Arc<Vec<u8>>) {
    while let Ok((mut s, _)) = l.accept().await {
        let _ = s.set_nodelay(true);
        let data = data.clone();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            loop {
                let mut h = [0u8; 9];
                if s.read_exact(&mut h).await.is_err() {
                    return;
                }
                let (op, len) = parse_header(&h);
                let ok = if op == 0 {
                    buf.resize(len, 0);
                    s.read_exact(&mut buf).await.is_ok()
                        && s.write_all(&(len as u64).to_le_bytes()).await.is_ok()
                } else {
                    s.write_all(&data[..len.min(data.len())]).await.is_ok()
                };
                if !ok {
                    return;
                }
            }
        });
    }
}
