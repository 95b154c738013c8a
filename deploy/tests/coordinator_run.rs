//! End-to-end run of `edl-local` with real `edl-ps` and `edl-worker` processes while the
//! coordinator is killed with SIGKILL and restarted ten times (`scenarios/coordinator.toml`):
//! the coordinator makes every change durable before it answers, so the job loses nothing.
//! Every scenario event is carried out, every worker finishes normally, every shard applies
//! every sample of every epoch exactly once, and the coordinator's counters are exact.
//!
//! The binaries and the dataset are found as in `local_run.rs`. The run is the scenario file's
//! own command, `edl-local --workers 3 --epochs 3` (2 shards, 60,000 samples an epoch, the
//! default MLP): about 18 s of training in a debug build on 2 cores without the kills, which
//! fall at 1 s to 10 s.

mod common;

use std::path::Path;
use std::process::Command;

use edl_deploy::Report;

/// Samples per epoch (`edl-local`'s default).
const TRAIN_SAMPLES: u64 = 60_000;
/// Epochs of the run.
const EPOCHS: usize = 3;
/// Kills in the scenario, each followed by a restart.
const KILLS: usize = 10;

/// Keeps the run's directory (state and logs) when the test fails, and says where it is.
struct KeepOnFailure(tempfile::TempDir);

impl Drop for KeepOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.disable_cleanup(true);
            eprintln!(
                "the run's state and logs are kept in {}",
                self.0.path().display()
            );
        }
    }
}

/// The lines of `log` that report a warning or an error, for a failure message.
fn troubles(log: &Path) -> String {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_coordinator_is_killed_and_restarted_ten_times_and_nothing_is_lost() {
    if !common::have_dataset() {
        return;
    }
    let bins = common::bin_dir();
    let dir = KeepOnFailure(tempfile::tempdir().expect("tempdir"));
    let state = dir.0.path().join("state");
    let report = dir.0.path().join("report.json");
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/coordinator.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_edl-local"))
        .args([
            "--workers",
            "3",
            "--epochs",
            "3",
            "--no-http",
            "--no-progress",
        ])
        .args(["--stall-timeout", "120"])
        .arg("--scenario")
        .arg(&scenario)
        .arg("--report")
        .arg(&report)
        .arg("--state-dir")
        .arg(&state)
        .arg("--bin-dir")
        .arg(&bins)
        .output()
        .expect("edl-local runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!("{stdout}");
    assert!(
        out.status.success(),
        "edl-local failed:\n{stdout}\n{stderr}"
    );
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&report).expect("report file"))
        .expect("report JSON");

    // Every event was carried out: none was skipped, and the report has all twenty.
    assert!(
        r.scenario_skipped.is_empty(),
        "{:?}\n{stderr}",
        r.scenario_skipped
    );
    for kind in ["kill_coordinator", "restart_coordinator"] {
        let n = r.events.iter().filter(|e| e.kind == kind).count();
        assert_eq!(n, KILLS, "{kind}: {:?}", r.events);
    }
    let mut launched: Vec<_> = r
        .events
        .iter()
        .filter(|e| e.kind.ends_with("_coordinator"))
        .collect();
    launched.sort_by_key(|e| e.t_ms);
    for pair in launched.chunks(2) {
        assert_eq!(pair[0].kind, "kill_coordinator", "{launched:?}");
        assert_eq!(pair[1].kind, "restart_coordinator", "{launched:?}");
        assert!(pair[1].took_ms.is_some(), "{launched:?}");
    }
    // Each restart was a new process on the same state: it restored what the killed one
    // acknowledged.
    let logs = state.join("logs");
    for n in 1..=KILLS {
        let log = logs.join(format!("coordinator-restart{n}.log"));
        let text = std::fs::read_to_string(&log).expect("a restarted coordinator's log");
        assert!(
            text.contains("coordinator state restored"),
            "{}:\n{text}",
            log.display()
        );
    }

    // No worker failed: each one trained to the end and exited 0.
    assert_eq!(r.worker_processes.len(), 3, "{:?}", r.worker_processes);
    for p in &r.worker_processes {
        assert_eq!(
            (p.fate.as_str(), p.exit_code, p.signal),
            ("none", Some(0), None),
            "{p:?}; its warnings and errors:\n{}",
            troubles(&logs.join(format!("{}.log", p.name)))
        );
    }
    assert!(r.shutdown_problems.is_empty(), "{:?}", r.shutdown_problems);

    // Every sample of every epoch was applied exactly once on every shard (the report has
    // each epoch's worst shard), and the coordinator counted each exactly once.
    assert!(r.finished);
    assert_eq!(r.epochs.len(), EPOCHS, "{:?}", r.epochs);
    for e in &r.epochs {
        assert_eq!(
            (e.samples, e.missing, e.duplicates),
            (TRAIN_SAMPLES, 0, 0),
            "epoch {e:?}"
        );
        assert_eq!(e.reported_samples, TRAIN_SAMPLES, "epoch {e:?}");
    }
    assert_eq!(r.samples, TRAIN_SAMPLES * EPOCHS as u64);
    // Three epochs of the default MLP reach about 0.87; chance is 0.1.
    assert!(r.test_accuracy > 0.8, "{}", r.test_accuracy);
}
