//! The `edl-worker` binary: help text, and a clear error when the dataset is missing.

use std::process::Command;

#[test]
fn help_explains_the_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_edl-worker"))
        .arg("--help")
        .output()
        .expect("runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--coordinator",
        "--data-dir",
        "--evaluate",
        "--state-dir",
        "--cert",
    ] {
        assert!(text.contains(flag), "help lacks {flag}: {text}");
    }
}

#[test]
fn a_missing_dataset_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_edl-worker"))
        .arg("--data-dir")
        .arg(dir.path().join("nowhere"))
        .arg("--state-dir")
        .arg(dir.path())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--data-dir") && err.contains("nowhere not found"),
        "{err}"
    );
    // Another directory than Fashion-MNIST's: no advice to install Fashion-MNIST.
    assert!(!err.contains("dataset-fashion-mnist"), "{err}");
}

#[test]
fn a_signal_before_admission_exits_cleanly_and_promptly() {
    let data = std::path::Path::new(edl_worker::data::DEFAULT_DATA_DIR);
    if !data.exists() {
        edl_shared::skip::skipped(
            "",
            "dataset not installed (apt-get install dataset-fashion-mnist)",
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // Nothing listens on this port: the worker keeps trying to reach the coordinator.
    let mut child = Command::new(env!("CARGO_BIN_EXE_edl-worker"))
        .args(["--coordinator", "127.0.0.1:9"])
        .arg("--state-dir")
        .arg(dir.path())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawns");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            started.elapsed().as_secs() < 10,
            "the worker ignored SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}
