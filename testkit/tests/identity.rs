//! Identities bound to certificates: every request that names a worker must come from the
//! certificate that worker registered with, pushes must carry the coordinator's token for
//! their worker, a shard name is held by one live process, and certificates of another job
//! get nothing. Each spoof is refused with its own code and changes nothing.

use std::time::Duration;

use bytes::Bytes;
use edl_shared::pki::CLUSTER_SERVER_NAME;
use edl_shared::proto::frame::f32s_to_bytes;
use edl_shared::proto::ids::{Clock, Key, Token, WorkerId};
use edl_shared::proto::msg::{ChunkRef, WorkerState};
use edl_shared::proto::{Consistency, ErrorCode, Request, Response};
use edl_shared::transport::{self, CallError, Conn, TransportSettings};
use edl_shared::{Identity, Role};
use edl_testkit::{TestCluster, counter_job};
use edl_worker::Session;

async fn cluster(consistency: Consistency) -> anyhow::Result<TestCluster> {
    TestCluster::start(counter_job(64, 16, consistency), 2).await
}

/// A handshaken raw connection to `addr` under `identity`.
async fn raw(identity: &Identity, addr: &str) -> anyhow::Result<Conn> {
    let settings = TransportSettings::default();
    let ep = transport::client_endpoint(identity, &settings, false)?;
    Ok(Conn::connect(&ep, addr, &identity.name, &settings).await?)
}

fn code(r: Result<edl_shared::proto::Frame<Response>, CallError>) -> Option<ErrorCode> {
    match r {
        Ok(f) => panic!("expected a refusal, got {:?}", f.msg),
        Err(e) => e.code(),
    }
}

async fn state_of(cluster: &TestCluster, w: &Session) -> anyhow::Result<WorkerState> {
    let status = cluster.connect("observer").await?.status().await?;
    let me = status
        .workers
        .iter()
        .find(|s| s.id == w.worker())
        .expect("the worker is listed");
    Ok(me.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_certificate_cannot_act_for_a_worker() -> anyhow::Result<()> {
    let cluster = cluster(Consistency::Ssp { staleness: 1 }).await?;
    let victim = cluster.connect("alice").await?.register("alice").await?;
    let mallory = cluster.identity(Role::Worker, "mallory")?;
    let coord = raw(&mallory, &cluster.coordinator_addr.to_string()).await?;
    let worker = victim.worker();
    let spoofs = [
        Request::Leave { worker },
        Request::Heartbeat { worker },
        Request::NextPartition { worker },
        Request::Clock {
            worker,
            clock: Clock(victim.clock().0 + 1),
            epoch: 0,
            samples: 1,
            loss_sum: 0.0,
            span: None,
            last: false,
            bytes_pushed: 0,
            bytes_pulled: 0,
        },
    ];
    for req in spoofs {
        let name = req.name();
        let got = code(coord.call(req, Bytes::new()).await);
        assert_eq!(got, Some(ErrorCode::IdentityMismatch), "{name}");
    }
    // Nothing changed: alice is active, at her clock, and holds no data she did not ask for.
    assert_eq!(state_of(&cluster, &victim).await?, WorkerState::Active);
    let members = cluster.admin().await?.members().await?;
    let alice = members
        .iter()
        .find(|m| m.id == worker)
        .expect("alice listed");
    assert_eq!(alice.clock, victim.clock());
    assert_eq!(alice.samples, 0);
    victim.leave().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_for_a_dead_worker_from_another_certificate_do_not_keep_it_alive()
-> anyhow::Result<()> {
    let cluster = cluster(Consistency::Ssp { staleness: 0 }).await?;
    let victim = cluster.connect("bob").await?.register("bob").await?;
    let worker = victim.worker();
    // Bob hangs (stops heartbeating); mallory tries to keep his lease alive.
    victim.stop_heartbeat();
    let mallory = cluster.identity(Role::Worker, "mallory")?;
    let coord = raw(&mallory, &cluster.coordinator_addr.to_string()).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut refused = 0;
    while tokio::time::Instant::now() < deadline {
        let r = coord
            .call(Request::Heartbeat { worker }, Bytes::new())
            .await;
        match r {
            Err(e) if e.code() == Some(ErrorCode::IdentityMismatch) => refused += 1,
            // Once bob is dead, he is unknown to everyone.
            Err(e) if e.code() == Some(ErrorCode::UnknownWorker) => break,
            other => panic!("a spoofed heartbeat was not refused: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(refused > 0);
    assert_eq!(state_of(&cluster, &victim).await?, WorkerState::Dead);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_need_the_token_of_their_worker_and_certificate() -> anyhow::Result<()> {
    let cluster = cluster(Consistency::Asp).await?;
    let alice = cluster.connect("alice").await?.register("alice").await?;
    let reader = cluster.connect("reader").await?;
    let map = reader.map();
    let owner = map.owner(Key(0)).expect("placed");
    let addr = map.addr_of(owner).expect("address").to_string();
    let one = || vec![ChunkRef::new(Key(0), 16)];
    let push = |worker: WorkerId, token: Token| Request::Push {
        epoch: map.epoch,
        worker,
        clock: Clock(0),
        chunks: one(),
        span: None,
        covers: Vec::new(),
        token,
    };
    let grads = f32s_to_bytes(&[-1.0; 16]);

    // A client that never registered, with no token.
    let stranger = raw(&cluster.identity(Role::Worker, "stranger")?, &addr).await?;
    let got = stranger
        .call(push(alice.worker(), Token::default()), grads.clone())
        .await;
    assert_eq!(code(got), Some(ErrorCode::IdentityMismatch));
    // Alice's token, stolen and replayed from another certificate.
    let got = stranger
        .call(push(alice.worker(), alice.token()), grads.clone())
        .await;
    assert_eq!(code(got), Some(ErrorCode::IdentityMismatch));
    // Alice's token for another worker id, from alice's own certificate.
    let alice_raw = raw(&cluster.identity(Role::Worker, "alice")?, &addr).await?;
    let got = alice_raw
        .call(
            push(WorkerId(alice.worker().0 + 100), alice.token()),
            grads.clone(),
        )
        .await;
    assert_eq!(code(got), Some(ErrorCode::IdentityMismatch));

    let mut params = vec![0f32; 64];
    reader.pull_all(&mut params, Clock(0)).await?;
    assert_eq!(params, vec![0.0; 64], "a refused push changed parameters");
    // The real thing is applied.
    let ok = alice_raw
        .call(push(alice.worker(), alice.token()), grads)
        .await?;
    assert!(matches!(ok.msg, Response::Ack));
    reader.pull_all(&mut params, Clock(0)).await?;
    assert_eq!(params[..16], [1.0; 16]);
    assert_eq!(params[16..], [0.0; 48]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_registered_under_its_certificate_name() -> anyhow::Result<()> {
    let cluster = cluster(Consistency::Asp).await?;
    let w = cluster
        .connect("carol")
        .await?
        .register("not-carol")
        .await?;
    let members = cluster.admin().await?.members().await?;
    let me = members.iter().find(|m| m.id == w.worker()).expect("listed");
    assert_eq!(me.name, "carol");
    assert!(!members.iter().any(|m| m.name == "not-carol"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_shards_name_cannot_join_again_from_elsewhere() -> anyhow::Result<()> {
    let cluster = cluster(Consistency::Asp).await?;
    let before = cluster.connect("reader").await?.map();
    // The certificate of the running shard s0, used by a second process at another address.
    let s0 = cluster.identity(Role::Shard, "s0")?;
    let coord = raw(&s0, &cluster.coordinator_addr.to_string()).await?;
    let got = coord
        .call(
            Request::ShardJoin {
                addr: "127.0.0.1:1".into(),
            },
            Bytes::new(),
        )
        .await;
    assert_eq!(code(got), Some(ErrorCode::Conflict));
    let after = cluster.connect("reader2").await?.map();
    assert_eq!(before, after, "a refused join moved a shard");
    // Workers still reach every shard.
    let w = cluster.connect("w").await?.register("w").await?;
    w.push_step(&[-1.0; 64]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_job_gets_nothing() -> anyhow::Result<()> {
    let cluster = cluster(Consistency::Asp).await?;
    let pki = edl_shared::pki::PkiDir::new(cluster.state_dir());
    pki.issue(Role::Worker, "eve", "another-job", &[])?;
    let eve = pki.load(Role::Worker, "eve")?;
    assert_eq!(eve.job, "another-job");
    let settings = TransportSettings::default();
    let ep = transport::client_endpoint(&eve, &settings, false)?;
    for addr in [cluster.coordinator_addr, cluster.shard_addrs[0]] {
        let outcome = tokio::time::timeout(Duration::from_secs(20), async {
            let conn = ep.connect(addr, CLUSTER_SERVER_NAME)?.await?;
            let closed = conn.closed().await;
            anyhow::Ok(closed)
        })
        .await??;
        match outcome {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(
                    c.error_code,
                    quinn::VarInt::from_u32(ErrorCode::WrongJob.as_u16().into())
                );
                let why = String::from_utf8_lossy(&c.reason);
                assert!(why.contains("another-job"), "{why}");
            }
            other => panic!("expected the server to close with WrongJob, got {other}"),
        }
    }
    Ok(())
}
