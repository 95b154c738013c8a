//! End-to-end run of the local launcher with real `edl-ps` and `edl-worker` processes.
//!
//! `cargo test --workspace` builds `edl-ps` and `edl-worker` next to `edl-local` (their own
//! integration tests need them), so this test finds them there; `EDL_BIN_DIR` points elsewhere
//! (an absolute path, e.g. `$PWD/target/release`). Without the dataset the test says it was
//! skipped, unless `EDL_REQUIRE_DATA=1` (set by CI) makes that a failure.

mod common;

use std::time::Duration;

use edl_deploy::LocalConfig;
use edl_shared::proto::Consistency;
use edl_shared::shutdown::CancellationToken;
use edl_worker::data::DEFAULT_DATA_DIR;

#[tokio::test]
async fn small_job_trains_evaluates_and_reports() {
    if !common::have_dataset() {
        return;
    }
    let bins = common::bin_dir();
    let dir = tempfile::tempdir().expect("tempdir");
    let report_path = dir.path().join("report.json");
    let cfg = LocalConfig {
        shards: 2,
        workers: 2,
        epochs: 1,
        consistency: Consistency::Asp,
        optimizer: "adam:0.001".parse().expect("optimizer"),
        batch_size: 64,
        train_samples: 4096,
        lease_ms: 3000,
        layers: vec![784, 64, 10],
        seed: 7,
        data_dir: DEFAULT_DATA_DIR.into(),
        report: Some(report_path.clone()),
        trace: None,
        state_dir: Some(dir.path().join("state")),
        bin_dir: Some(bins),
        progress_bar: false,
        stall_timeout: Some(Duration::from_secs(60)),
        scenario: None,
        restart_on_change: false,
        elastic: Default::default(),
        observe: Default::default(),
        job: None,
    };
    let report = edl_deploy::run(&cfg, CancellationToken::new())
        .await
        .expect("the run succeeds");

    assert!(report.finished);
    assert_eq!(report.samples, 4096);
    assert_eq!(report.epochs.len(), 1);
    assert_eq!(report.epochs[0].samples, 4096);
    assert!(report.epochs[0].train_loss > 0.0 && report.epochs[0].train_loss < 2.5);
    assert_eq!(report.test_samples, 10_000);
    // Ten classes: chance is 0.1, and even 4,096 samples get a small MLP far past it.
    assert!(report.test_accuracy > 0.5, "{}", report.test_accuracy);
    assert!(report.throughput_samples_per_s > 0.0);
    assert!(report.wall_s >= report.train_wall_s);
    assert!(
        report.shutdown_problems.is_empty(),
        "{:?}",
        report.shutdown_problems
    );

    let written: edl_deploy::Report =
        serde_json::from_str(&std::fs::read_to_string(&report_path).expect("report file"))
            .expect("report JSON");
    assert_eq!(written, report);
    for name in ["coordinator", "s0", "s1", "w0", "w1", "eval"] {
        let log = dir.path().join("state/logs").join(format!("{name}.log"));
        assert!(log.is_file(), "missing {}", log.display());
    }
}
