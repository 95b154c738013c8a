//! Authentication and bad input over real QUIC: peers without a cluster-signed certificate are
//! refused, roles are enforced, and malformed, oversized, stale or non-finite requests get a
//! clear error code and change nothing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use edl_shared::pki::{CLUSTER_SERVER_NAME, PkiDir};
use edl_shared::proto::frame::{encode_prefix, f32s_to_bytes};
use edl_shared::proto::ids::{Clock, Key, MapEpoch, WorkerId};
use edl_shared::proto::msg::ChunkRef;
use edl_shared::proto::{Consistency, ErrorCode, Frame, FrameLimits, Request, Response};
use edl_shared::transport::{self, CallError, Conn, TransportSettings, read_frame};
use edl_shared::{Identity, Role};
use edl_testkit::{TestCluster, counter_job};
use edl_worker::{ClientConfig, ClientError, Gradients, Job};

async fn cluster() -> anyhow::Result<TestCluster> {
    TestCluster::start(counter_job(64, 16, Consistency::Asp), 2).await
}

fn remote_code(e: &ClientError) -> Option<ErrorCode> {
    match e {
        ClientError::Call(c) => c.code(),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused() -> anyhow::Result<()> {
    let cluster = cluster().await?;
    let rogue_dir = tempfile::tempdir()?;
    let rogue = PkiDir::new(rogue_dir.path()).ensure(Role::Worker, "mallory")?;
    // Trust the real cluster CA, so that only the server's check can fail.
    let real = cluster.identity(Role::Worker, "honest")?;
    let identity = Identity {
        ca: real.ca,
        ..rogue
    };
    let cfg = ClientConfig {
        coordinator: cluster.coordinator_addr.to_string(),
        identity,
        settings: TransportSettings::default(),
    };
    let r = tokio::time::timeout(Duration::from_secs(20), Job::connect(&cfg)).await?;
    let err = r.expect_err("a rogue certificate must be refused");
    // The server closes the connection in the handshake; the client meets the close wherever
    // it is (connecting, opening a stream, writing or reading the request): any failure of
    // the connection itself, none of the server's answers.
    assert!(
        matches!(
            &err,
            ClientError::Call(CallError::Unreachable { tried, cause })
                if cause.connection_failed() && *tried == [cfg.coordinator.clone()]
        ),
        "unexpected error: {err}"
    );
    // The server closes the connection on the bad certificate; whether its TLS alert
    // (`BadSignature`) reaches the client before the close depends on timing, so the hint is
    // either the one for a foreign CA or the one for a closed connection.
    let text = err.to_string();
    assert!(
        text.contains("not of one cluster CA") || text.contains("the connection was closed"),
        "{err}"
    );
    // The honest identity still works.
    cluster.connect("honest").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_certificate_is_refused() -> anyhow::Result<()> {
    let cluster = cluster().await?;
    let real = cluster.identity(Role::Worker, "honest")?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(real.ca.clone())?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![transport::ALPN.to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    // TLS 1.3 lets the client finish its side before the server checks the certificate, so
    // the refusal may surface on connect or on the first request; either way nothing works.
    let outcome = tokio::time::timeout(Duration::from_secs(20), async {
        let conn = ep
            .connect(cluster.coordinator_addr, CLUSTER_SERVER_NAME)?
            .await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        transport::write_frame(&mut send, Frame::<_>::new(Request::Status)).await?;
        let f: Frame<Response> = read_frame(&mut recv, &FrameLimits::default()).await?;
        anyhow::Ok(f.msg)
    })
    .await?;
    assert!(
        outcome.is_err(),
        "a client without a certificate got an answer: {outcome:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_are_checked() -> anyhow::Result<()> {
    let cluster = cluster().await?;
    let cfg = ClientConfig {
        coordinator: cluster.coordinator_addr.to_string(),
        identity: cluster.identity(Role::Shard, "impostor")?,
        settings: TransportSettings::default(),
    };
    let job = Job::connect(&cfg).await?;
    let err = job
        .register("impostor")
        .await
        .expect_err("a shard may not register");
    assert_eq!(remote_code(&err), Some(ErrorCode::Forbidden), "{err}");
    Ok(())
}

/// Opens a handshaken connection and sends raw bytes as one request.
async fn raw_call(conn: &Conn, bytes: Vec<u8>) -> anyhow::Result<Response> {
    let (mut send, mut recv) = conn.quic().expect("a QUIC connection").open_bi().await?;
    send.write_all(&bytes).await?;
    send.finish()?;
    let f: Frame<Response> = read_frame(&mut recv, &FrameLimits::default()).await?;
    Ok(f.msg)
}

fn code_of(r: &Response) -> Option<ErrorCode> {
    match r {
        Response::Error { code, .. } => ErrorCode::from_u16(*code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_frames_get_errors_and_the_server_lives_on() -> anyhow::Result<()> {
    let cluster = cluster().await?;
    let id = cluster.identity(Role::Worker, "fuzzer")?;
    let settings = TransportSettings::default();
    let ep = transport::client_endpoint(&id, &settings, false)?;
    for addr in [cluster.coordinator_addr, cluster.shard_addrs[0]] {
        let conn = Conn::connect(&ep, &addr.to_string(), "fuzzer", &settings).await?;
        // Garbage behind a valid prefix.
        let mut garbage = encode_prefix(40, 0).to_vec();
        garbage.extend((0..40u8).map(|i| i.wrapping_mul(97)));
        assert_eq!(
            code_of(&raw_call(&conn, garbage).await?),
            Some(ErrorCode::Malformed)
        );
        // Not a frame at all.
        let junk = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(
            code_of(&raw_call(&conn, junk).await?),
            Some(ErrorCode::Malformed)
        );
        // A 2 GiB payload announced: refused before anything is allocated.
        let huge = encode_prefix(8, 2 << 30).to_vec();
        assert_eq!(
            code_of(&raw_call(&conn, huge).await?),
            Some(ErrorCode::TooLarge)
        );
        // Truncated: the prefix promises more than arrives.
        let short = encode_prefix(100, 100).to_vec();
        assert_eq!(
            code_of(&raw_call(&conn, short).await?),
            Some(ErrorCode::Malformed)
        );
        // A second handshake is refused.
        let hello = Frame::new(Request::Hello {
            version: 1,
            name: "again".into(),
        })
        .encode()?;
        assert_eq!(
            code_of(&raw_call(&conn, hello.to_vec()).await?),
            Some(ErrorCode::InvalidRequest)
        );
        // The same connection still serves valid requests.
        let ok = conn.call(Request::GetMap, Bytes::new()).await?;
        assert!(matches!(ok.msg, Response::Map(_)));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_protocol_version_is_refused_at_the_handshake() -> anyhow::Result<()> {
    let cluster = cluster().await?;
    let id = cluster.identity(Role::Worker, "old")?;
    let settings = TransportSettings::default();
    let ep = transport::client_endpoint(&id, &settings, false)?;
    let conn = ep
        .connect(cluster.coordinator_addr, CLUSTER_SERVER_NAME)?
        .await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let hello = Request::Hello {
        version: 99,
        name: "old".into(),
    };
    transport::write_frame(&mut send, Frame::<_>::new(hello)).await?;
    let f: Frame<Response> = read_frame(&mut recv, &FrameLimits::default()).await?;
    assert_eq!(code_of(&f.msg), Some(ErrorCode::UnsupportedVersion));
    // The server closes the connection after a failed handshake.
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed()).await;
    assert!(
        closed.is_ok(),
        "connection stayed open after a failed handshake"
    );
    Ok(())
}

/// With one shard, shared gradients are not checked before they travel: the shard refuses
/// a bad gradient whole, and the client then finds the index to report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shard_refuses_a_bad_shared_gradient_whole() -> anyhow::Result<()> {
    let cluster = TestCluster::start(counter_job(64, 16, Consistency::Asp), 1).await?;
    let session = cluster.connect("w").await?.register("w").await?;
    let mut before = vec![0f32; 64];
    session.job().pull_all(&mut before, Clock(0)).await?;
    let mut g = Gradients::from(vec![-1.0f32; 64]);
    g.as_mut_slice()[50] = f32::NAN;
    let err = session
        .push_step_gradients(&g)
        .await
        .expect_err("NaN must be refused");
    assert!(matches!(err, ClientError::NonFinite { index: 50 }), "{err}");
    let mut after = vec![0f32; 64];
    session.job().pull_all(&mut after, Clock(0)).await?;
    assert_eq!(before, after, "a refused push changed parameters");
    Ok(())
}

/// At fp16, a finite gradient past 65,504 is refused as out of range (not as a NaN), with
/// its position in the model, in whole-model pushes, row pushes and top-k pushes alike; a
/// NaN among rows is named by its position in the model too. Nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradients_that_do_not_fit_a_16_bit_wire_are_refused_by_position() -> anyhow::Result<()> {
    for wire in ["fp16", "topk:0.25+fp16"] {
        let mut job = counter_job(64, 16, Consistency::Asp);
        job.wire = wire.parse().map_err(anyhow::Error::msg)?;
        let cluster = TestCluster::start(job, 2).await?;
        let session = cluster.connect("w").await?.register("w").await?;
        let mut before = vec![0f32; 64];
        session.job().pull_all(&mut before, Clock(0)).await?;
        let mut g = vec![-1.0f32; 64];
        g[37] = 70_000.0;
        let err = session.push_step(&g).await.expect_err("past fp16");
        assert!(
            matches!(err, ClientError::OutOfRange { index: 37, value, .. } if value == 70_000.0),
            "{wire}: {err}"
        );
        assert!(err.to_string().contains("65,504"), "{err}");
        let shared = Gradients::from(g.clone());
        let err = session
            .push_step_gradients(&shared)
            .await
            .expect_err("past fp16");
        assert!(
            matches!(err, ClientError::OutOfRange { index: 37, .. }),
            "{wire}: {err}"
        );
        // Rows: key 2 holds floats 32..48.
        let mut row = vec![1.0f32; 16];
        row[5] = 1e6;
        let err = session
            .push_keys(&[(Key(2), &row)])
            .await
            .expect_err("past fp16");
        assert!(
            matches!(err, ClientError::OutOfRange { index: 37, .. }),
            "{wire}: {err}"
        );
        row[5] = f32::NAN;
        let err = session.push_keys(&[(Key(2), &row)]).await.expect_err("NaN");
        assert!(
            matches!(err, ClientError::NonFinite { index: 37 }),
            "{wire}: {err}"
        );
        let mut after = vec![0f32; 64];
        session.job().pull_all(&mut after, Clock(0)).await?;
        assert_eq!(before, after, "{wire}: a refused push changed parameters");
        assert_eq!(
            session.residual_l1().await,
            0.0,
            "{wire}: a refused push kept a residual"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pushes_over_the_wire_change_nothing() -> anyhow::Result<()> {
    let cluster = cluster().await?;
    let session = cluster.connect("w").await?.register("w").await?;
    let job = cluster.connect("reader").await?;
    let mut before = vec![0f32; 64];
    job.pull_all(&mut before, Clock(0)).await?;

    let mut nan = vec![-1.0f32; 64];
    nan[40] = f32::NAN;
    let err = session
        .push_step(&nan)
        .await
        .expect_err("NaN must be refused");
    assert!(matches!(err, ClientError::NonFinite { index: 40 }), "{err}");
    let err = session.push_step(&[1.0; 3]).await.expect_err("wrong size");
    assert!(matches!(err, ClientError::BufferSize { .. }), "{err}");
    // Shared gradients are checked while QUIC already sends them: each shard's request is
    // completed only once both parts passed, and withdrawn otherwise, so a bad value in
    // either shard's part leaves both unchanged.
    for bad in [3, 40, 63] {
        let mut g = Gradients::from(vec![-1.0f32; 64]);
        g.as_mut_slice()[bad] = f32::INFINITY;
        let err = session
            .push_step_gradients(&g)
            .await
            .expect_err("infinity must be refused");
        assert!(
            matches!(err, ClientError::NonFinite { index } if index == bad),
            "{err}"
        );
    }

    // Raw requests on the session's own identity, with its id and token.
    let id = cluster.identity(Role::Worker, "w")?;
    let settings = TransportSettings::default();
    let ep = transport::client_endpoint(&id, &settings, false)?;
    let owner = job.map().owner(Key(0)).expect("key 0 is placed");
    let addr = job.map().addr_of(owner).expect("shard address").to_string();
    let conn = Conn::connect(&ep, &addr, "raw", &settings).await?;
    let (worker, token) = (session.worker(), session.token());
    let push = |epoch: MapEpoch, chunks: Vec<ChunkRef>, values: Vec<f32>| {
        let conn = conn.clone();
        async move {
            conn.call(
                Request::Push {
                    epoch,
                    worker,
                    clock: Clock(0),
                    chunks,
                    span: None,
                    covers: Vec::new(),
                    token,
                },
                f32s_to_bytes(&values),
            )
            .await
        }
    };
    let one = vec![ChunkRef::new(Key(0), 16)];
    // A key the shard does not hold (routed with a wrong or old map) is refused with the map.
    let elsewhere = (0..4)
        .map(Key)
        .find(|k| job.map().owner(*k) != Some(owner))
        .expect("the other shard holds a key");
    let misrouted = vec![ChunkRef::new(elsewhere, 16)];
    let stale = push(MapEpoch(0), misrouted, vec![-1.0; 16])
        .await
        .expect_err("stale epoch");
    assert_eq!(stale.code(), Some(ErrorCode::StaleEpoch));
    assert!(
        matches!(stale, CallError::Remote { map: Some(_), .. }),
        "the new map comes along"
    );
    let epoch = job.map().epoch;
    let short = push(epoch, one.clone(), vec![-1.0; 15])
        .await
        .expect_err("short payload");
    assert_eq!(short.code(), Some(ErrorCode::ShapeMismatch));
    let unknown = push(epoch, vec![ChunkRef::new(Key(999), 16)], vec![-1.0; 16])
        .await
        .expect_err("unknown key");
    assert_eq!(unknown.code(), Some(ErrorCode::UnknownKey));
    let inf = push(epoch, one.clone(), vec![f32::INFINITY; 16])
        .await
        .expect_err("infinite");
    assert_eq!(inf.code(), Some(ErrorCode::NonFinite));

    let mut after = vec![0f32; 64];
    job.pull_all(&mut after, Clock(0)).await?;
    assert_eq!(before, after, "a refused push changed parameters");
    // A well-formed push on the same connection is applied.
    push(epoch, one, vec![-1.0; 16]).await?;
    job.pull_all(&mut after, Clock(0)).await?;
    assert_eq!(after[..16], [1.0; 16]);
    // The session's connections, whose requests were withdrawn, still carry pushes.
    session
        .push_step_gradients(&Gradients::from(vec![-1.0f32; 64]))
        .await?;
    job.pull_all(&mut after, Clock(0)).await?;
    assert_eq!(after[..16], [2.0; 16]);
    let moved: Vec<f32> = before[16..].iter().map(|b| b + 1.0).collect();
    assert_eq!(after[16..], moved[..]);

    // Unknown workers are told so.
    let coord = Conn::connect(&ep, &cluster.coordinator_addr.to_string(), "raw", &settings).await?;
    let hb = coord
        .call(
            Request::Heartbeat {
                worker: WorkerId(424242),
            },
            Bytes::new(),
        )
        .await
        .expect_err("unknown worker");
    assert_eq!(hb.code(), Some(ErrorCode::UnknownWorker));
    session.leave().await?;
    Ok(())
}
