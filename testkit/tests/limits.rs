//! Connection budgets in process: one identity cannot hold more connections than its budget
//! (the one past it is closed with `Busy`, others are unaffected), and a connection without
//! requests is closed after the idle timeout while its client reconnects transparently.

use std::time::Duration;

use bytes::Bytes;
use edl_shared::Role;
use edl_shared::pki::CLUSTER_SERVER_NAME;
use edl_shared::proto::{Consistency, ErrorCode, Request, Response};
use edl_shared::transport::{self, Conn, TransportSettings};
use edl_testkit::{TestCluster, counter_job, until};

fn tight() -> TransportSettings {
    let mut s = TransportSettings::default();
    s.budgets.conns_per_identity = 3;
    s.budgets.idle_timeout = Duration::from_secs(2);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identity_cannot_hold_more_connections_than_its_budget() -> anyhow::Result<()> {
    let cluster =
        TestCluster::start_with(counter_job(16, 16, Consistency::Asp), 1, tight()).await?;
    let settings = TransportSettings::default();
    let hog = cluster.identity(Role::Worker, "hog")?;
    let ep = transport::client_endpoint(&hog, &settings, false)?;
    let addr = cluster.coordinator_addr.to_string();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(Conn::connect(&ep, &addr, "hog", &settings).await?);
    }
    // The fourth is closed by the server right after TLS, before any request.
    let fourth = ep
        .connect(cluster.coordinator_addr, CLUSTER_SERVER_NAME)?
        .await?;
    match tokio::time::timeout(Duration::from_secs(10), fourth.closed()).await? {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(
                c.error_code,
                quinn::VarInt::from_u32(ErrorCode::Busy.as_u16().into())
            );
            let why = String::from_utf8_lossy(&c.reason);
            assert!(why.contains("hog") && why.contains('3'), "{why}");
        }
        other => panic!("the fourth connection ended otherwise: {other}"),
    }
    // Other identities are not affected, and the held connections still serve.
    let other = cluster.connect("other").await?;
    assert!(other.status().await.is_ok());
    for c in &held {
        assert!(matches!(
            c.call(Request::GetMap, Bytes::new()).await?.msg,
            Response::Map(_)
        ));
    }
    // Closing one frees its slot (once the server has seen the close).
    held.pop().expect("held").close();
    until(Duration::from_secs(10), || async {
        Ok(Conn::connect(&ep, &addr, "hog", &settings).await.ok())
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_clients_reconnect() -> anyhow::Result<()> {
    let cluster =
        TestCluster::start_with(counter_job(16, 16, Consistency::Asp), 1, tight()).await?;
    let settings = TransportSettings::default();
    let id = cluster.identity(Role::Worker, "sleepy")?;
    let ep = transport::client_endpoint(&id, &settings, false)?;
    let conn = Conn::connect(
        &ep,
        &cluster.coordinator_addr.to_string(),
        "sleepy",
        &settings,
    )
    .await?;
    let why = tokio::time::timeout(
        Duration::from_secs(10),
        conn.quic().expect("a QUIC connection").closed(),
    )
    .await?;
    assert!(
        matches!(why, quinn::ConnectionError::ApplicationClosed(_)),
        "{why}"
    );
    // The client library reconnects on its own after an idle close.
    let job = cluster.connect("patient").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(job.status().await.is_ok());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_announcing_a_payload_is_refused_before_anything_is_allocated()
-> anyhow::Result<()> {
    use edl_shared::proto::frame::{Message, encode_prefix};
    use edl_shared::proto::{Frame, FrameLimits};
    let cluster = TestCluster::start(counter_job(16, 16, Consistency::Asp), 1).await?;
    let settings = TransportSettings::default();
    let id = cluster.identity(Role::Worker, "greedy")?;
    let ep = transport::client_endpoint(&id, &settings, false)?;
    let conn = ep
        .connect(cluster.coordinator_addr, CLUSTER_SERVER_NAME)?
        .await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let hello = Request::Hello {
        version: edl_shared::proto::PROTOCOL_VERSION,
        name: "greedy".into(),
    }
    .to_header()?;
    // A valid Hello header, followed by the promise of a 512 MiB payload.
    send.write_all(&encode_prefix(hello.len() as u32, 512 << 20))
        .await?;
    send.write_all(&hello).await?;
    let f: Frame<Response> = transport::read_frame(&mut recv, &FrameLimits::default()).await?;
    match f.msg {
        Response::Error { code, .. } => {
            assert_eq!(ErrorCode::from_u16(code), Some(ErrorCode::TooLarge))
        }
        other => panic!("a handshake with a payload was accepted: {other:?}"),
    }
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed()).await;
    assert!(closed.is_ok(), "the connection stayed open");
    Ok(())
}
