//! No single point of failure in the control plane, with real processes: two coordinators of
//! one job keep its state in a real 3-member etcd on loopback, one leading, the other standing
//! by. Killing the leader with SIGKILL (three times, each restarted as a standby) costs a
//! pause, not a worker and not a sample: the standby takes the lead, restores the state etcd
//! holds, and the worker, given both addresses, follows it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use edl_ps::admin::{Admin, CoordinatorRole};
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::msg::DataSpan;
use edl_shared::transport::TransportSettings;
use edl_testkit::etcd::{EtcdCluster, have_etcd};
use edl_worker::{ClientConfig, Job};

/// The binaries `cargo test --workspace` builds beside this test.
fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target directory")
        .join(name)
}

/// A free UDP port on loopback (bound and released).
fn free_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.local_addr().expect("addr").port()
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str], state: &Path, log: &str) -> Proc {
    let log = std::fs::File::create(state.join(log)).expect("log file");
    let child = Command::new(bin("edl-ps"))
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("edl-ps starts");
    Proc(child)
}

/// Samples of the job: a 4-4 MLP (20 floats) under SGD at rate 1, batches of 4.
const SAMPLES: u32 = 192;

/// A coordinator of the job listening on `listen`, its state in `meta`.
fn coordinator(listen: &str, meta: &str, state: &Path, log: &str) -> Proc {
    let samples = SAMPLES.to_string();
    spawn(
        &[
            "coordinator",
            "--listen",
            listen,
            "--meta",
            meta,
            "--leader-ttl",
            "2s",
            "--shards",
            "2",
            "--layers",
            "4,4",
            "--chunk-size",
            "4",
            "--optimizer",
            "sgd:1",
            "--consistency",
            "ssp:1",
            "--train-samples",
            &samples,
            "--partition-size",
            "16",
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--lease-ms",
            "5000",
        ],
        state,
        log,
    )
}

/// Which of `addrs` leads, as the coordinators themselves say.
async fn leader(admin: &Admin) -> Option<String> {
    admin
        .coordinators()
        .await
        .into_iter()
        .find(|(_, r)| *r == Ok(CoordinatorRole::Leader))
        .map(|(a, _)| a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leading_coordinator_loses_no_worker_and_no_sample() -> anyhow::Result<()> {
    if !have_etcd() {
        return Ok(());
    }
    anyhow::ensure!(
        bin("edl-ps").exists(),
        "{} is missing: run the tests with cargo test --workspace",
        bin("edl-ps").display()
    );
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    let etcd = EtcdCluster::start(3, &state.join("etcd"))?;
    let meta = etcd.url();
    let pki = PkiDir::new(state);
    pki.init_ca()?;
    for (role, name) in [
        (Role::Coordinator, "coordinator"),
        (Role::Shard, "s0"),
        (Role::Shard, "s1"),
    ] {
        pki.ensure(role, name)?;
    }
    let addrs = [
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    ];
    let list = addrs.join(",");
    let mut coords = [
        Some(coordinator(&addrs[0], &meta, state, "c0.log")),
        Some(coordinator(&addrs[1], &meta, state, "c1.log")),
    ];
    let _shards: Vec<Proc> = (0..2)
        .map(|i| {
            let name = format!("s{i}");
            spawn(
                &[
                    "shard",
                    "--coordinator",
                    &list,
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
    let admin = Admin::connect(
        &list,
        &pki.ensure(Role::Admin, "op")?,
        TransportSettings::default(),
    )
    .await?;
    let cfg = ClientConfig {
        coordinator: list.clone(),
        identity: pki.ensure(Role::Worker, "w")?,
        settings: TransportSettings::default(),
    };
    let job = Job::connect(&cfg).await?;
    let mut w = job.clone().register("w").await?;
    // Kill the leader after these many commits, three times.
    let kills_at = [8, 20, 32];
    let (mut commits, mut kills, mut restarts) = (0, 0, 0);
    let mut failovers = Vec::new();
    let mut killed: Option<(usize, Instant)> = None;
    let mut part = w.next_partition().await?;
    while let Some(p) = part {
        let mut at = p.start;
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
            commits += 1;
            if let Some((i, t)) = killed.take() {
                failovers.push(t.elapsed());
                // The killed coordinator comes back, as a standby.
                restarts += 1;
                coords[i] = Some(coordinator(
                    &addrs[i],
                    &meta,
                    state,
                    &format!("c{i}-{restarts}.log"),
                ));
            }
            if kills < kills_at.len() && commits == kills_at[kills] {
                let lead = leader(&admin).await.expect("a coordinator leads");
                let i = addrs.iter().position(|a| *a == lead).expect("one of ours");
                if let Some(mut c) = coords[i].take() {
                    c.0.kill()?;
                    c.0.wait()?;
                }
                killed = Some((i, Instant::now()));
                kills += 1;
            }
        }
        part = w.next_partition().await?;
    }
    assert_eq!(kills, 3, "every kill fell within the run");
    let status = job.status().await?;
    assert!(status.finished, "{status:?}");
    assert_eq!(
        status.epochs[0].samples,
        u64::from(SAMPLES),
        "the counters are exact"
    );
    for (shard, ledgers) in job.ledgers().await? {
        let l = &ledgers[0];
        assert_eq!(
            (l.applied, l.missing, l.duplicates),
            (u64::from(SAMPLES), 0, 0),
            "shard {shard}"
        );
    }
    // Both coordinators answer: one leads, one stands by.
    let roles = admin.coordinators().await;
    let leads = roles
        .iter()
        .filter(|(_, r)| *r == Ok(CoordinatorRole::Leader))
        .count();
    let stands = roles
        .iter()
        .filter(|(_, r)| matches!(r, Ok(CoordinatorRole::Standby { leader: Some(_) })))
        .count();
    assert_eq!((leads, stands), (1, 1), "{roles:?}");
    let mut ms: Vec<u128> = failovers.iter().map(Duration::as_millis).collect();
    ms.sort_unstable();
    eprintln!("failover (kill to the worker's next commit), ms: {ms:?}");
    w.leave().await?;
    drop(coords);
    drop(etcd);
    Ok(())
}
