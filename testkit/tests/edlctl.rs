//! `edlctl` against a live in-process cluster: tables and JSON for every command, clear errors
//! and non-zero exit codes.

use std::path::PathBuf;
use std::process::{Command, Output};

use edl_shared::proto::Consistency;
use edl_shared::proto::msg::WorkerState;
use edl_testkit::{TestCluster, counter_job};

/// `edlctl`, built beside this test by `cargo test --workspace` (edl-ps's own tests need it).
fn edlctl() -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target directory");
    dir.join("edlctl")
}

async fn run(cluster: &TestCluster, args: &[&str]) -> Output {
    let mut cmd = Command::new(edlctl());
    cmd.arg("--coordinator")
        .arg(cluster.coordinator_addr.to_string())
        .arg("--state-dir")
        .arg(cluster.state_dir())
        .args(args);
    tokio::task::spawn_blocking(move || cmd.output().expect("edlctl runs"))
        .await
        .expect("join")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_prints_a_table_and_json() -> anyhow::Result<()> {
    if !edlctl().exists() {
        anyhow::bail!(
            "{} is missing: run the tests with cargo test --workspace",
            edlctl().display()
        );
    }
    let cluster = TestCluster::start(counter_job(256, 64, Consistency::Asp), 2).await?;
    let mut w = cluster.connect("w0").await?.register("w0").await?;
    for _ in 0..5 {
        w.push_step(&[-1.0; 256]).await?;
        w.advance(0, 1, 0.0).await?;
    }

    let status = json(&run(&cluster, &["--json", "status"]).await);
    assert_eq!(status["active_workers"], 1);
    assert_eq!(status["max_clock"], 5);
    assert_eq!(status["consistency"], "asp");
    let table = run(&cluster, &["status"]).await;
    assert!(String::from_utf8_lossy(&table.stdout).contains("consistency"));

    let workers = json(&run(&cluster, &["workers", "--json"]).await);
    let row = &workers.as_array().expect("array")[0];
    assert_eq!(row["name"], "w0");
    assert_eq!(row["state"], "active");
    assert_eq!(row["clock"], 5);
    assert!(
        row["addr"]
            .as_str()
            .expect("addr")
            .starts_with("127.0.0.1:")
    );

    let shards = json(&run(&cluster, &["shards", "--json"]).await);
    let shards = shards.as_array().expect("array");
    assert_eq!(shards.len(), 2);
    let keys: u64 = shards
        .iter()
        .map(|s| s["keys"].as_u64().expect("keys"))
        .sum();
    assert_eq!(keys, 4);
    let pushes: u64 = shards
        .iter()
        .map(|s| s["pushes"].as_u64().expect("pushes"))
        .sum();
    assert_eq!(pushes, 10, "5 pushes fanned out to 2 shards");
    let table = String::from_utf8_lossy(&run(&cluster, &["shards"]).await.stdout).to_string();
    assert!(table.contains("0..2") && table.contains("2..4"), "{table}");

    let drained = json(&run(&cluster, &["--json", "drain", "w0"]).await);
    assert_eq!(drained["drained"], w.worker().0);
    w.push_step(&[-1.0; 256]).await?;
    w.advance(0, 1, 0.0).await?;
    assert!(w.drain_requested());
    let id = w.worker();
    w.leave().await?;
    let st = cluster.coordinator.status();
    assert_eq!(
        st.workers.iter().find(|x| x.id == id).map(|x| x.state),
        Some(WorkerState::Left)
    );

    // Errors: clear message, non-zero exit.
    let bad = run(&cluster, &["drain", "nobody"]).await;
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no active worker named"));
    let mut cmd = Command::new(edlctl());
    cmd.args(["--coordinator", "not-an-address", "--state-dir"])
        .arg(cluster.state_dir())
        .arg("status");
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("runs")).await?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not-an-address"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_commands_reshape_a_live_cluster() -> anyhow::Result<()> {
    if !edlctl().exists() {
        anyhow::bail!(
            "{} is missing: run the tests with cargo test --workspace",
            edlctl().display()
        );
    }
    // 8 keys of 32 floats on two shards, then a third that stands by.
    let mut cluster = TestCluster::start(counter_job(256, 32, Consistency::Asp), 2).await?;
    let third = cluster.add_shard("s2").await?;
    let w = cluster.connect("w0").await?.register("w0").await?;
    w.push_step(&[-1.0; 256]).await?;

    let rows = json(&run(&cluster, &["shards", "--json"]).await);
    let roles: Vec<&str> = rows
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["active", "active", "standby"]);

    let added = json(&run(&cluster, &["--json", "shard", "add", &third.to_string()]).await);
    assert!(!added["moves"].as_array().expect("moves").is_empty());
    let layout = added["layout"].as_array().expect("layout");
    assert_eq!(layout.len(), 3, "{added}");

    let moved = run(&cluster, &["move", "k0..k2", "--to", "s2"]).await;
    let text = String::from_utf8_lossy(&moved.stdout).to_string();
    assert!(
        moved.status.success(),
        "{}",
        String::from_utf8_lossy(&moved.stderr)
    );
    assert!(
        text.contains("s2") && text.contains("shard map e"),
        "{text}"
    );

    let rebalanced = json(&run(&cluster, &["--json", "reshard"]).await);
    assert!(rebalanced["epoch"].as_u64().expect("epoch") > added["epoch"].as_u64().expect("e"));
    let by_load = run(&cluster, &["reshard", "--by", "load"]).await;
    assert!(
        by_load.status.success(),
        "{}",
        String::from_utf8_lossy(&by_load.stderr)
    );

    let removed = json(&run(&cluster, &["--json", "shard", "remove", "s0"]).await);
    let layout = removed["layout"].as_array().expect("layout");
    assert!(layout.iter().all(|l| l[0] != 0), "{removed}");
    let table = String::from_utf8_lossy(&run(&cluster, &["shards"]).await.stdout).to_string();
    assert!(table.contains("retired"), "{table}");
    let rows = json(&run(&cluster, &["shards", "--json"]).await);
    let keys: u64 = rows
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["keys"].as_u64().expect("keys"))
        .sum();
    assert_eq!(keys, 8, "every key held once: {rows}");

    // Training state survived every move: one push of -1 is +1 everywhere.
    let mut got = vec![0f32; 256];
    w.pull(&mut got).await?;
    assert!(got.iter().all(|&v| v == 1.0));

    // Errors: clear message, non-zero exit.
    for (args, says) in [
        (&["move", "5..2", "--to", "s1"][..], "is empty"),
        (&["move", "0..2", "--to", "s0"][..], "removed"),
        (&["move", "0..99", "--to", "s1"][..], "not a range"),
        (&["shard", "add", "127.0.0.1:1"][..], "no shard"),
        (&["shard", "remove", "s9"][..], "no shard"),
    ] {
        let out = run(&cluster, args).await;
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_commands_steer_a_live_job() -> anyhow::Result<()> {
    if !edlctl().exists() {
        anyhow::bail!(
            "{} is missing: run the tests with cargo test --workspace",
            edlctl().display()
        );
    }
    let cluster = TestCluster::start(counter_job(256, 64, Consistency::Asp), 2).await?;
    let w = cluster.connect("w0").await?.register("w0").await?;
    let text = |out: &Output| String::from_utf8_lossy(&out.stdout).to_string();
    let err = |out: &Output| String::from_utf8_lossy(&out.stderr).to_string();

    let s = json(&run(&cluster, &["--json", "stragglers"]).await);
    assert_eq!(
        (s["policy"].as_str(), s["window"].as_u64()),
        (Some("ignore"), Some(20))
    );
    let s = json(
        &run(
            &cluster,
            &[
                "--json",
                "stragglers",
                "--policy",
                "replace",
                "--factor",
                "2",
            ],
        )
        .await,
    );
    assert_eq!(
        (s["policy"].as_str(), s["factor"].as_f64()),
        (Some("replace"), Some(2.0))
    );

    // Growing by two makes two placements, pending until a placer starts workers.
    let grown = json(&run(&cluster, &["--json", "scale", "3"]).await);
    assert_eq!(grown["placed"].as_array().map(Vec::len), Some(2), "{grown}");
    let listed = run(&cluster, &["placements"]).await;
    assert!(
        text(&listed).matches("pending").count() == 2,
        "{}",
        text(&listed)
    );

    // A preemption notice under `replace`: a substitute is asked for, and the worker is told
    // its deadline (it trains on until the substitute arrives).
    let p = json(&run(&cluster, &["--json", "preempt", "w0", "--notice", "10s"]).await);
    assert_eq!(p["notice_ms"], 10_000);
    assert!(p["placement"].is_u64(), "{p}");
    let rows = json(&run(&cluster, &["--json", "workers"]).await);
    let left = rows[0]["notice_ms"].as_u64().expect("a notice");
    assert!((8_000..=10_000).contains(&left), "{rows}");
    assert!(text(&run(&cluster, &["workers"]).await).contains("preempted"));
    assert!(!w.drain_requested());

    // Without a placer nothing is admitted: the migration says so and fails.
    let m = run(&cluster, &["migrate", "w0", "--wait", "1s"]).await;
    assert!(!m.status.success());
    assert!(err(&m).contains("placer"), "{}", err(&m));

    // Errors: clear message, non-zero exit.
    for (args, says) in [
        (&["stragglers", "--factor", "0.5"][..], "above 1"),
        (
            &["stragglers", "--policy", "evict"][..],
            "unknown straggler policy",
        ),
        (&["preempt", "nobody"][..], "no active worker named"),
        (&["preempt", "w0", "--notice", "soon"][..], "soon"),
    ] {
        let out = run(&cluster, args).await;
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err(&out).contains(says), "{args:?}: {}", err(&out));
    }
    Ok(())
}
