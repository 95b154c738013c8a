//! `edlctl` against a live in-process cluster: tables and JSON for every command, clear errors
//! and non-zero exit codes; and against `edl-ps` processes whose shard map has not formed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use edl_shared::proto::msg::WorkerState;
use edl_shared::proto::{Clock, Consistency};
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
    assert_eq!(
        status["shards"],
        serde_json::json!({"active": 2, "standby": 0, "retired": 0, "expected": 2})
    );
    let table = run(&cluster, &["status"]).await;
    let text = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(text.contains("consistency"), "{text}");
    assert_eq!(row(&text, "shards").as_deref(), Some("2 active"), "{text}");

    // An evaluation's clock never goes backwards: the final one of a job (whose minimum
    // clock can lag once no worker trains) shows at least the one before it.
    let eval = cluster.connect("eval").await?;
    eval.report_evaluation(Clock(5), 0.5, 1.0, 100).await?;
    eval.report_evaluation(Clock(2), 0.75, 0.5, 100).await?;
    let status = json(&run(&cluster, &["--json", "status"]).await);
    assert_eq!(status["evaluation"]["clock"], 5, "{status}");
    assert_eq!(status["evaluation"]["accuracy"], 0.75, "{status}");
    let text = String::from_utf8_lossy(&run(&cluster, &["status"]).await.stdout).to_string();
    let accuracy = row(&text, "accuracy").unwrap_or_default();
    assert!(
        accuracy.starts_with("75.00% (test loss 0.5000, pulled at min clock 5,"),
        "{text}"
    );

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

    // A standby shard (joined after the map formed) answers, and is no error.
    let rows = json(&run(&cluster, &["shards", "--json"]).await);
    let roles: Vec<&str> = rows
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["active", "active", "standby"]);
    assert_eq!(rows[2]["error"], serde_json::Value::Null, "{rows}");
    let status = String::from_utf8_lossy(&run(&cluster, &["status"]).await.stdout).to_string();
    assert_eq!(
        row(&status, "shards").as_deref(),
        Some("2 active, 1 standby"),
        "{status}"
    );

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
    // Three joined, two expected: the status counts by role, never "3/2".
    let status = json(&run(&cluster, &["--json", "status"]).await);
    assert_eq!(
        status["shards"],
        serde_json::json!({"active": 2, "standby": 0, "retired": 1, "expected": 2})
    );
    let status = String::from_utf8_lossy(&run(&cluster, &["status"]).await.stdout).to_string();
    assert_eq!(
        row(&status, "shards").as_deref(),
        Some("2 active, 1 retired"),
        "{status}"
    );
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
        (s["policy"].as_str(), s["window_ms"].as_u64()),
        (Some("ignore"), Some(1_500))
    );
    assert_eq!(
        s["stall_drop_ms"],
        serde_json::Value::Null,
        "waits by default: {s}"
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
                "--window",
                "2s",
                "--stall-drop",
                "1m",
            ],
        )
        .await,
    );
    assert_eq!(
        (s["policy"].as_str(), s["factor"].as_f64()),
        (Some("replace"), Some(2.0))
    );
    assert_eq!(
        (s["window_ms"].as_u64(), s["stall_drop_ms"].as_u64()),
        (Some(2_000), Some(60_000))
    );
    // Settings the coordinator refuses change nothing and say why.
    let refused = run(&cluster, &["stragglers", "--stall-drop", "1s"]).await;
    assert!(!refused.status.success());
    assert!(
        err(&refused).contains("before it is reported"),
        "{}",
        err(&refused)
    );
    let text_out = text(&run(&cluster, &["stragglers"]).await);
    assert!(
        text_out.contains("2000 ms windows") && text_out.contains("dropped after 60000 ms"),
        "{text_out}"
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
    // No step yet: the straggler detector has not judged it.
    assert_eq!(rows[0]["judged"], "warming", "{rows}");
    assert_eq!(rows[0]["stalled_ms"], serde_json::Value::Null, "{rows}");
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

/// The value in the row `key` of the two-column table `text` (as `status` prints it: the key,
/// spaces, the value).
fn row(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.trim_matches(|c| c == '│' || c == ' ').strip_prefix(key)?;
        rest.starts_with("  ").then(|| rest.trim().to_string())
    })
}

/// A server process of the test, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `edl-ps ARGS` (built beside `edlctl`) with its log in `dir`.
fn edl_ps(dir: &Path, log: &str, args: &[&str]) -> anyhow::Result<Server> {
    let exe = edlctl().with_file_name("edl-ps");
    let log = std::fs::File::create(dir.join(log))?;
    let child = Command::new(exe)
        .args(args)
        .arg("--state-dir")
        .arg(dir)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    Ok(Server(child))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_waiting_for_the_map_stands_by() -> anyhow::Result<()> {
    if !edlctl().exists() {
        anyhow::bail!(
            "{} is missing: run the tests with cargo test --workspace",
            edlctl().display()
        );
    }
    // A job of two shards with one joined: the map has not formed, and s0 waits for its
    // assignment.
    let dir = tempfile::tempdir()?;
    let addr_file = dir.path().join("coordinator.addr");
    let _coordinator = edl_ps(
        dir.path(),
        "coordinator.log",
        &[
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--addr-file",
            addr_file.to_str().expect("a UTF-8 path"),
            "--counter",
            "256",
            "--chunk-size",
            "64",
            "--shards",
            "2",
            "--no-persist",
        ],
    )?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let coordinator = loop {
        match std::fs::read_to_string(&addr_file) {
            Ok(a) if !a.trim().is_empty() => break a.trim().to_string(),
            _ if Instant::now() > deadline => anyhow::bail!("the coordinator did not start"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let _s0 = edl_ps(
        dir.path(),
        "s0.log",
        &[
            "shard",
            "--coordinator",
            &coordinator,
            "--listen",
            "127.0.0.1:0",
            "--name",
            "s0",
            "--no-checkpoint",
        ],
    )?;
    let edlctl_at = |args: &[&str]| {
        let mut cmd = Command::new(edlctl());
        cmd.args(["--coordinator", &coordinator, "--state-dir"])
            .arg(dir.path())
            .args(args);
        async move {
            tokio::task::spawn_blocking(move || cmd.output().expect("edlctl runs"))
                .await
                .expect("join")
        }
    };
    let rows = loop {
        let rows = json(&edlctl_at(&["--json", "shards"]).await);
        if !rows.as_array().expect("array").is_empty() {
            break rows;
        }
        anyhow::ensure!(Instant::now() < deadline, "s0 did not join");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Listed at once as standby, waiting, not unreachable; and `shards` succeeds.
    assert_eq!(rows[0]["name"], "s0", "{rows}");
    assert_eq!(rows[0]["role"], "standby", "{rows}");
    assert_eq!(rows[0]["unassigned"], true, "{rows}");
    assert_eq!(rows[0]["error"], serde_json::Value::Null, "{rows}");
    let asked = Instant::now();
    let table = edlctl_at(&["shards"]).await;
    let text = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(table.status.success(), "{text}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "the shard answered at once"
    );
    assert!(text.contains("waits for the shard map to form"), "{text}");
    assert!(!text.contains("unreachable"), "{text}");

    let status = json(&edlctl_at(&["--json", "status"]).await);
    assert_eq!(
        status["shards"],
        serde_json::json!({"active": 0, "standby": 1, "retired": 0, "expected": 2})
    );
    let text = String::from_utf8_lossy(&edlctl_at(&["status"]).await.stdout).to_string();
    assert_eq!(
        row(&text, "shards").as_deref(),
        Some("1 of 2 joined (the shard map forms once all have)"),
        "{text}"
    );
    Ok(())
}
