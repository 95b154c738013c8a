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
    assert!(err.contains("dataset-fashion-mnist"), "{err}");
}
