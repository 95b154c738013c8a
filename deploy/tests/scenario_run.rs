//! End-to-end runs of scenarios with real `edl-ps` and `edl-worker` processes: a job that
//! grows, is drained and loses a worker to SIGKILL still trains every sample exactly once, both
//! elastically and with the `--restart-on-change` baseline.
//!
//! The binaries and the dataset are found as in `local_run.rs`. Training is sized to last a
//! few seconds in a debug build (small batches, so that there are many steps), and the
//! scenario's events fall in its first half (a debug build trained it in 2.4 s here).

mod common;

use common::TRAIN_SAMPLES;
use edl_deploy::Report;

/// Two workers to start with; two more join, w0 is drained, w1 is killed mid-epoch.
const SCENARIO: &str = r#"
[[event]]
at_s = 0.3
action = "add"
count = 2

[[event]]
at_s = 0.9
action = "drain"
worker = "w0"

[[event]]
at_s = 1.5
action = "kill"
worker = "w1"
"#;

/// What every scenario run must show: the job finished, learned, and applied every sample of
/// every epoch exactly once on every shard.
fn assert_trained_exactly_once(r: &Report) {
    println!("{r}");
    assert!(r.finished);
    assert!(r.scenario_skipped.is_empty(), "{:?}", r.scenario_skipped);
    assert_eq!(r.epochs.len(), 2);
    for e in &r.epochs {
        assert_eq!(
            (e.samples, e.duplicates, e.missing),
            (u64::from(TRAIN_SAMPLES), 0, 0),
            "epoch {e:?}"
        );
        assert_eq!(e.reported_samples, u64::from(TRAIN_SAMPLES), "epoch {e:?}");
    }
    // 60,000 samples of a small MLP reach about 0.85 here; chance is 0.1.
    assert!(r.test_accuracy > 0.75, "{}", r.test_accuracy);
    assert!(r.shutdown_problems.is_empty(), "{:?}", r.shutdown_problems);
    let killed: Vec<_> = r
        .worker_processes
        .iter()
        .filter(|p| p.fate == "killed")
        .collect();
    assert_eq!(killed.len(), 1, "{:?}", r.worker_processes);
    assert_eq!(killed[0].signal, Some(9));
    for p in r.worker_processes.iter().filter(|p| p.fate != "killed") {
        assert_eq!(p.exit_code, Some(0), "{p:?}");
    }
    assert!(
        r.events.iter().any(|e| e.kind == "dead"),
        "the killed worker is declared dead: {:?}",
        r.events
    );
}

#[tokio::test]
async fn an_elastic_job_grows_shrinks_and_survives_a_kill() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let r = common::run_scenario(dir.path(), SCENARIO, 3, false).await;
    assert_trained_exactly_once(&r);
    assert_eq!(r.membership, "elastic");
    assert!(r.restarts.is_empty());

    let fate = |name: &str| {
        r.worker_processes
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process {name}: {:?}", r.worker_processes))
    };
    assert_eq!(
        (fate("w0").fate.as_str(), fate("w0").exit_code),
        ("drained", Some(0))
    );
    assert_eq!(fate("w1").fate, "killed");
    for name in ["w2", "w3"] {
        assert_eq!(
            (fate(name).fate.as_str(), fate(name).exit_code),
            ("none", Some(0))
        );
    }
    let has = |kind: &str, worker: &str| {
        r.events
            .iter()
            .any(|e| e.kind == kind && e.worker == worker)
    };
    for w in ["w0", "w1", "w2", "w3"] {
        assert!(has("join", w), "{w} joined: {:?}", r.events);
    }
    assert!(has("drain", "w0") && has("leave", "w0"), "{:?}", r.events);
    assert!(has("dead", "w1") && !has("leave", "w1"), "{:?}", r.events);
    // The added workers joined a running job: their costs were measured.
    for w in ["w2", "w3"] {
        let join = r
            .events
            .iter()
            .find(|e| e.kind == "join" && e.worker == w)
            .expect("join");
        assert!(
            join.step_ms.is_some() && join.join_latency_ms.is_some(),
            "{join:?}"
        );
    }
}

/// The scenario with top-k pushes: the drained worker leaves with a residual (values its
/// pushes held back), the killed one dies with one; neither costs a sample or counts one twice.
#[tokio::test]
async fn top_k_workers_that_leave_or_die_with_residuals_lose_no_samples() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = edl_deploy::LocalConfig {
        wire: Some("topk:0.01".parse().expect("wire")),
        // Error feedback is made for plain SGD (see local_run's top-k test).
        optimizer: "sgd:0.05".parse().expect("optimizer"),
        ..common::scenario_config(dir.path(), SCENARIO, 3, false, 2)
    };
    let r = common::run(&cfg).await;
    assert_trained_exactly_once(&r);
    // A dense push: 50,890 floats of 4 bytes per batch of 16 samples.
    let cut = 4.0 * 50_890.0 / 16.0 / r.traffic.pushed_per_sample;
    assert!(cut >= 10.0, "{:?}: pushes cut only {cut:.1}x", r.traffic);
    // The drained worker said what it dropped when it left.
    let log = std::fs::read_to_string(dir.path().join("state/logs/w0.log")).expect("w0's log");
    let line = log
        .lines()
        .find(|l| l.contains("residual of"))
        .unwrap_or_else(|| panic!("w0 left without a word on its residual:\n{log}"));
    let l1: f64 = line
        .split("residual of ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no residual in {line:?}"));
    assert!(l1 > 0.0, "{line}");
}

#[tokio::test]
async fn the_restart_baseline_also_trains_every_sample_once() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let r = common::run_scenario(dir.path(), SCENARIO, 3, true).await;
    assert_trained_exactly_once(&r);
    assert_eq!(r.membership, "restart-on-change");
    assert_eq!(r.restarts.len(), 3, "{:?}", r.restarts);
    let counts: Vec<(u32, u32)> = r
        .restarts
        .iter()
        .map(|x| (x.workers_before, x.workers_after))
        .collect();
    assert_eq!(counts, [(2, 4), (4, 3), (3, 2)]);
    // The flat model: 784x64 + 64 + 64x10 + 10 floats.
    let bytes = 4 * (784 * 64 + 64 + 64 * 10 + 10);
    for x in &r.restarts {
        assert_eq!(x.checkpoint_bytes, bytes, "{x:?}");
        let len = std::fs::metadata(&x.checkpoint).expect("checkpoint").len();
        assert_eq!(len, bytes);
        assert!(
            x.start_ms > 0.0 && x.stop_ms >= 0.0 && x.checkpoint_ms > 0.0,
            "{x:?}"
        );
    }
    // The baseline drains nobody: everyone is stopped and replaced.
    assert!(r.events.iter().all(|e| e.kind != "drain"), "{:?}", r.events);
    assert!(
        r.worker_processes
            .iter()
            .any(|p| p.name == "w0-r1" && p.fate == "restarted"),
        "{:?}",
        r.worker_processes
    );
    // Stopping everyone shows: the leave that starts a restart stalls the others until the
    // new workers step, which takes at least a process start and a dataset load.
    let worst_leave = r
        .events
        .iter()
        .filter(|e| e.kind == "leave")
        .filter_map(|e| e.stall_ms)
        .fold(0.0, f64::max);
    assert!(worst_leave > 100.0, "{:?}", r.events);
}
