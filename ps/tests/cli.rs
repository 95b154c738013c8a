//! The `edl-ps` binary as an operator uses it: help text, and the CA commands.

use std::process::Command;

fn edl_ps() -> Command {
    Command::new(env!("CARGO_BIN_EXE_edl-ps"))
}

#[test]
fn help_explains_every_subcommand() {
    let out = edl_ps().arg("--help").output().expect("runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for word in ["coordinator", "shard", "ca"] {
        assert!(text.contains(word), "help lacks {word}: {text}");
    }
    let out = edl_ps()
        .args(["coordinator", "--help"])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--listen",
        "--shards",
        "--consistency",
        "--optimizer",
        "--state-dir",
        "--cert",
    ] {
        assert!(text.contains(flag), "coordinator help lacks {flag}");
    }
}

#[test]
fn ca_init_and_issue_write_a_usable_identity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().to_str().expect("utf-8 path");
    let out = edl_ps()
        .args(["ca", "init", "--state-dir", state])
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = edl_ps()
        .args([
            "ca",
            "issue",
            "--state-dir",
            state,
            "--role",
            "shard",
            "--name",
            "s9",
        ])
        .args(["--host", "10.0.0.9"])
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pki = edl_shared::pki::PkiDir::new(dir.path());
    let id = pki.load(edl_shared::Role::Shard, "s9").expect("loads");
    assert_eq!(id.name, "s9");
    // A bad role is refused with a clear message.
    let out = edl_ps()
        .args([
            "ca",
            "issue",
            "--state-dir",
            state,
            "--role",
            "king",
            "--name",
            "x",
        ])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown role"));
}

#[test]
fn bad_consistency_is_refused_before_starting() {
    let out = edl_ps()
        .args([
            "coordinator",
            "--consistency",
            "ssp:x",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ssp:N"));
}
