//! The binaries under the fault layer: `edl-local` and every process it starts run with
//! `EDL_FAULTS` (1% loss, 2 ms ± 1 ms delay, 1% duplicated datagrams on every link), and a
//! small job still trains every sample exactly once on every shard.

mod common;

use std::process::Command;

#[test]
fn a_job_under_injected_faults_trains_every_sample_once() {
    if !common::have_dataset() {
        return;
    }
    let bins = common::bin_dir();
    let dir = tempfile::tempdir().expect("tempdir");
    let report = dir.path().join("report.json");
    let out = Command::new(bins.join("edl-local"))
        .args(["--shards", "2", "--workers", "2", "--epochs", "1"])
        .args(["--train-samples", "4096", "--layers", "784,64,10"])
        .args(["--lease-ms", "3000", "--no-progress"])
        .arg("--bin-dir")
        .arg(&bins)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--report")
        .arg(&report)
        .env(
            "EDL_FAULTS",
            "seed=5,loss=0.01,delay=2ms,jitter=1ms,dup=0.01",
        )
        .output()
        .expect("edl-local runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "edl-local failed: {stderr}");
    let r: edl_deploy::Report =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    assert!(r.finished);
    for e in &r.epochs {
        assert_eq!((e.samples, e.duplicates, e.missing), (4096, 0, 0), "{e:?}");
    }
    // Every process ran under the faults, and said so.
    for name in ["coordinator", "s0", "s1", "w0", "w1"] {
        let log =
            std::fs::read_to_string(dir.path().join("state/logs").join(format!("{name}.log")))
                .expect("log");
        assert!(
            log.contains("network faults injected"),
            "{name} did not run under the faults:\n{log}"
        );
    }
}
