//! The fault layer under real quinn endpoints over loopback: calls survive loss, delay,
//! reordering and duplication and take at least the delay; a partition stops them until it
//! heals, whether healed by hand or scheduled.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use edl_shared::Role;
use edl_shared::faults::{Faults, LinkFaults};
use edl_shared::pki::PkiDir;
use edl_shared::proto::{Frame, FrameLimits, PROTOCOL_VERSION, Request, Response};
use edl_shared::transport::{
    Conn, TransportSettings, client_endpoint, read_frame, server_endpoint, write_frame,
};
use quinn::Endpoint;

/// A server that answers Hello and echoes every other request's payload with an Ack, and a
/// client endpoint, both sending through `faults` (labelled "server" and "client").
struct Pair {
    client: Endpoint,
    addr: SocketAddr,
    settings: TransportSettings,
    _server: Endpoint,
    _dir: tempfile::TempDir,
}

async fn pair(faults: &Faults) -> anyhow::Result<Pair> {
    let dir = tempfile::tempdir()?;
    let pki = PkiDir::new(dir.path());
    pki.init_ca()?;
    let server_id = pki.ensure(Role::Coordinator, "c")?;
    let client_id = pki.ensure(Role::Worker, "w")?;
    let mut settings = TransportSettings {
        // Long enough that no connection idles out while a test holds a partition.
        idle_timeout: Duration::from_secs(30),
        keep_alive: Duration::from_millis(500),
        faults: Some(faults.labelled("server")),
        ..TransportSettings::default()
    };
    let server = server_endpoint("127.0.0.1:0".parse()?, &server_id, &settings)?;
    let addr = server.local_addr()?;
    tokio::spawn(echo(server.clone()));
    settings.faults = Some(faults.labelled("client"));
    let client = client_endpoint(&client_id, &settings, false)?;
    Ok(Pair {
        client,
        addr,
        settings,
        _server: server,
        _dir: dir,
    })
}

impl Pair {
    async fn connect(&self) -> anyhow::Result<Conn> {
        let addr = self.addr.to_string();
        let c = Conn::connect(&self.client, &addr, "w", &self.settings);
        Ok(tokio::time::timeout(Duration::from_secs(20), c).await??)
    }
}

async fn echo(ep: Endpoint) {
    while let Some(incoming) = ep.accept().await {
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    let frame = read_frame::<Request>(&mut recv, &FrameLimits::default()).await;
                    let reply = match frame {
                        Ok(Frame {
                            msg: Request::Hello { .. },
                            ..
                        }) => Frame::new(Response::Hello {
                            version: PROTOCOL_VERSION,
                            role: Role::Worker.to_string(),
                        }),
                        Ok(f) => Frame::with_payload(Response::Ack, f.payload),
                        Err(_) => return,
                    };
                    let _ = write_frame(&mut send, reply).await;
                });
            }
        });
    }
}

fn payload(i: usize, len: usize) -> Bytes {
    (0..len)
        .map(|j| (i * 31 + j) as u8)
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_survive_loss_and_take_at_least_the_delay() -> anyhow::Result<()> {
    let faults = Faults::new(11);
    let delay = Duration::from_millis(20);
    faults.set_default(
        LinkFaults::clean()
            .with_loss(0.05)
            .with_delay(delay, Duration::ZERO),
    );
    let p = pair(&faults).await?;
    let conn = p.connect().await?;
    // Keep calling until some datagram was lost (5% of ~10 datagrams per call), at least 30.
    let mut calls = 0;
    while calls < 30 || (faults.stats().dropped == 0 && calls < 300) {
        let body = payload(calls, 3000);
        let t = Instant::now();
        let call = conn.call(Request::Status, body.clone());
        let resp = tokio::time::timeout(Duration::from_secs(20), call).await??;
        let took = t.elapsed();
        assert_eq!(resp.payload, body, "call {calls}: echo differs");
        assert!(
            took >= 2 * delay,
            "call {calls} took {took:?}, under the round trip"
        );
        calls += 1;
    }
    let s = faults.stats();
    assert!(s.dropped > 0 && s.partitioned == 0, "{s:?}");
    assert!(s.delayed > 0 && s.sent > 0, "{s:?}");
    assert_eq!(
        s.offered,
        s.dropped + s.delayed,
        "every datagram was delayed or dropped"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_survive_reordering_and_duplication() -> anyhow::Result<()> {
    let faults = Faults::new(5);
    faults.set_default(
        LinkFaults::clean()
            .with_delay(Duration::from_millis(3), Duration::from_millis(3))
            .with_reorder(0.2, Duration::from_millis(10))
            .with_duplicate(0.1),
    );
    let p = pair(&faults).await?;
    let conn = p.connect().await?;
    for i in 0..20 {
        // Several datagrams per message, so that reordering happens inside a stream.
        let body = payload(i, 20_000);
        let call = conn.call(Request::Status, body.clone());
        let resp = tokio::time::timeout(Duration::from_secs(20), call).await??;
        assert_eq!(resp.payload, body, "call {i}: echo differs");
    }
    let s = faults.stats();
    assert!(
        s.reordered > 0 && s.duplicated > 0 && s.dropped == 0,
        "{s:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_stops_calls_until_healed() -> anyhow::Result<()> {
    let faults = Faults::new(1);
    let p = pair(&faults).await?;
    let conn = p.connect().await?;
    conn.call(Request::Status, Bytes::new()).await?;

    faults.partition("client", "server");
    let cut = tokio::time::timeout(
        Duration::from_millis(500),
        conn.call(Request::Status, Bytes::new()),
    )
    .await;
    assert!(cut.is_err(), "a call crossed the partition: {cut:?}");
    assert!(faults.stats().partitioned > 0);
    faults.heal_all();
    let t = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(10),
        conn.call(Request::Status, Bytes::new()),
    )
    .await??;
    eprintln!("first call after healing took {:?}", t.elapsed());

    // A scheduled partition of the client from everyone, 600 ms long from now.
    let now = faults.elapsed();
    faults.partition_during("client", "*", now, now + Duration::from_millis(600));
    let t = Instant::now();
    let cut = tokio::time::timeout(
        Duration::from_millis(300),
        conn.call(Request::Status, Bytes::new()),
    )
    .await;
    assert!(cut.is_err(), "a call crossed the scheduled partition");
    tokio::time::timeout(
        Duration::from_secs(10),
        conn.call(Request::Status, Bytes::new()),
    )
    .await??;
    assert!(
        t.elapsed() >= Duration::from_millis(550),
        "{:?}",
        t.elapsed()
    );
    Ok(())
}
