//! Durability with real processes: a shard killed with SIGKILL and restarted comes back from its
//! last checkpoint, workers reconnect and go on, and exactly the updates since the checkpoint
//! are lost on that shard (its data ledger shows them as missing). A coordinator killed with
//! SIGKILL comes back with everything it acknowledged and the job finishes with an exact
//! ledger.

use std::path::Path;
use std::time::{Duration, Instant};

use edl_ps::admin::Admin;
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::DataSpan;
use edl_shared::proto::{Clock, Key};
use edl_shared::transport::TransportSettings;
use edl_testkit::procs::{Proc, bin, free_port, spawn};
use edl_worker::{ClientConfig, Job};

fn wait_for_file(path: &Path) -> String {
    edl_testkit::procs::wait_for_file(path, Duration::from_secs(20))
        .unwrap_or_else(|| panic!("{} never appeared", path.display()))
}

/// A coordinator for a 4-4 MLP (20 floats: 5 keys of 4) trained with SGD at rate 1, so that a
/// gradient of -1 adds exactly 1; 64 samples in batches of 4, one epoch.
fn coordinator_args<'a>(listen: &'a str, consistency: &'a str, partition: &'a str) -> Vec<&'a str> {
    vec![
        "coordinator",
        "--listen",
        listen,
        "--shards",
        "2",
        "--layers",
        "4,4",
        "--chunk-size",
        "4",
        "--optimizer",
        "sgd:1",
        "--consistency",
        consistency,
        "--train-samples",
        "64",
        "--partition-size",
        partition,
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--lease-ms",
        "5000",
    ]
}

/// Checks that the binaries are there and issues the certificates of a coordinator and two
/// shards up front, so the processes never race to create the CA.
fn cluster_pki(state: &Path) -> anyhow::Result<PkiDir> {
    if !bin("edl-ps").exists() {
        anyhow::bail!(
            "{} is missing: run the tests with cargo test --workspace",
            bin("edl-ps").display()
        );
    }
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    for (role, name) in [
        (Role::Coordinator, "coordinator"),
        (Role::Shard, "s0"),
        (Role::Shard, "s1"),
    ] {
        pki.ensure(role, name)?;
    }
    Ok(pki)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_shard_restarts_from_its_checkpoint_and_the_job_goes_on() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    let pki = cluster_pki(state)?;
    let addr_file = state.join("coordinator.addr");
    let addr = addr_file.to_str().expect("utf-8");
    let mut args = coordinator_args("127.0.0.1:0", "asp", "64");
    args.extend(["--addr-file", addr]);
    let _coordinator = spawn(&args, state, "coordinator.log");
    let coordinator = wait_for_file(&addr_file);
    let ports = [free_port(), free_port()];
    let shard = |i: usize| {
        let listen = format!("127.0.0.1:{}", ports[i]);
        let name = format!("s{i}");
        spawn(
            &[
                "shard",
                "--coordinator",
                &coordinator,
                "--listen",
                &listen,
                "--name",
                &name,
                "--checkpoint-every",
                "0",
            ],
            state,
            &format!("{name}.log"),
        )
    };
    let mut procs = [Some(shard(0)), Some(shard(1))];

    let cfg = ClientConfig {
        coordinator: coordinator.clone(),
        identity: pki.ensure(Role::Worker, "w")?,
        settings: TransportSettings::default(),
    };
    let job = Job::connect(&cfg).await?;
    let owner_of_key0 = job.map().owner(Key(0)).expect("placed");
    let mut start = vec![0f32; 20];
    job.pull_all(&mut start, Clock(0)).await?;
    let mut w = job.clone().register("w").await?;
    let part = w.next_partition().await?.expect("data");
    let mut at = part.start;
    let step = |w_at: &mut u32| {
        let span = DataSpan {
            epoch: 0,
            partition: part.index,
            start: *w_at,
            end: *w_at + 4,
        };
        *w_at += 4;
        span
    };
    for _ in 0..3 {
        let span = step(&mut at);
        w.push_span(&[-1.0; 20], span).await?;
        w.commit_span(span, 0.0).await?;
    }
    let admin = Admin::connect(
        &coordinator,
        &pki.ensure(Role::Admin, "op")?,
        TransportSettings::default(),
    )
    .await?;
    let rows = admin.checkpoint_all().await?;
    assert!(
        rows.iter().all(|r| r.error.is_none() && r.bytes > 0),
        "{rows:?}"
    );
    for _ in 0..2 {
        let span = step(&mut at);
        w.push_span(&[-1.0; 20], span).await?;
        w.commit_span(span, 0.0).await?;
    }

    // SIGKILL the shard that holds key 0, then start it again on the same address.
    let victim_addr = job
        .map()
        .addr_of(owner_of_key0)
        .expect("address")
        .to_string();
    let victim = ports
        .iter()
        .position(|p| victim_addr.ends_with(&format!(":{p}")))
        .expect("a shard we started");
    let mut dead = procs[victim].take().expect("running");
    dead.0.kill()?;
    dead.0.wait()?;
    let restarted_at = Instant::now();
    procs[victim] = Some(shard(victim));
    // The worker's next push reconnects and goes through once the shard is back.
    let span = step(&mut at);
    tokio::time::timeout(Duration::from_secs(60), w.push_span(&[-1.0; 20], span)).await??;
    w.commit_span(span, 0.0).await?;
    let recovered = restarted_at.elapsed();
    eprintln!("shard restart to first applied push: {recovered:?}");

    let mut now = vec![0f32; 20];
    job.pull_all(&mut now, Clock(0)).await?;
    let map = job.map();
    let layout = job.layout();
    for k in layout.spans() {
        let gained = now[k.offset as usize] - start[k.offset as usize];
        let want = if map.owner(k.key) == Some(owner_of_key0) {
            // 3 pushes before the checkpoint and 1 after the restart; 2 lost with the crash.
            4.0
        } else {
            6.0
        };
        assert!(
            (gained - want).abs() < 1e-5,
            "{}: gained {gained}, want {want}",
            k.key
        );
    }
    for (shard, ledgers) in job.ledgers().await? {
        let l = &ledgers[0];
        let (applied, missing) = if shard == owner_of_key0 {
            (16, 48)
        } else {
            (24, 40)
        };
        assert_eq!(
            (l.applied, l.missing, l.duplicates),
            (applied, missing, 0),
            "shard {shard}"
        );
    }
    w.leave().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_coordinator_restarts_from_its_state_and_workers_carry_on() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    let pki = cluster_pki(state)?;
    let coordinator = format!("127.0.0.1:{}", free_port());
    let start_coordinator = || {
        spawn(
            &coordinator_args(&coordinator, "ssp:1", "16"),
            state,
            "coordinator.log",
        )
    };
    let mut coord = start_coordinator();
    let _shards: Vec<Proc> = (0..2)
        .map(|i| {
            let name = format!("s{i}");
            spawn(
                &[
                    "shard",
                    "--coordinator",
                    &coordinator,
                    "--listen",
                    "127.0.0.1:0",
                    "--name",
                    &name,
                ],
                state,
                &format!("{name}.log"),
            )
        })
        .collect();
    let cfg = ClientConfig {
        coordinator: coordinator.clone(),
        identity: pki.ensure(Role::Worker, "w")?,
        settings: TransportSettings::default(),
    };
    let job = Job::connect(&cfg).await?;
    let mut w = job.clone().register("w").await?;
    let first = w.next_partition().await?.expect("data");
    let mut at = first.start;
    for _ in 0..2 {
        let span = DataSpan {
            epoch: 0,
            partition: first.index,
            start: at,
            end: at + 4,
        };
        at += 4;
        w.push_span(&[-1.0; 20], span).await?;
        w.commit_span(span, 0.0).await?;
    }
    // The commits were acknowledged, so they are durable: kill the coordinator at once (no
    // wait for a save) and start it again.
    coord.0.kill()?;
    coord.0.wait()?;
    coord = start_coordinator();
    let restarted_at = Instant::now();
    let status = tokio::time::timeout(Duration::from_secs(30), job.status()).await??;
    assert_eq!(
        status.epochs[0].samples, 8,
        "the restarted coordinator has every acknowledged commit"
    );
    // The worker finishes its partition and then takes the rest of the data, as if nothing
    // had happened; its calls reconnect.
    let mut part = Some(first);
    while let Some(p) = part {
        while at < p.start + p.len {
            let span = DataSpan {
                epoch: 0,
                partition: p.index,
                start: at,
                end: at + 4,
            };
            at += 4;
            w.push_span(&[-1.0; 20], span).await?;
            tokio::time::timeout(Duration::from_secs(60), w.commit_span(span, 0.0)).await??;
        }
        part = w.next_partition().await?;
        if let Some(p) = part {
            at = p.start;
        }
    }
    eprintln!(
        "coordinator restart to finished job: {:?}",
        restarted_at.elapsed()
    );
    let status = job.status().await?;
    assert!(status.finished, "{status:?}");
    assert_eq!(status.epochs[0].samples, 64);
    for (shard, ledgers) in job.ledgers().await? {
        let l = &ledgers[0];
        assert_eq!(
            (l.applied, l.missing, l.duplicates),
            (64, 0, 0),
            "shard {shard}"
        );
    }
    w.leave().await?;
    drop(coord);
    Ok(())
}
