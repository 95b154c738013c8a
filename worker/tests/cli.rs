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
        edl_shared::skip::missing(
            "EDL_REQUIRE_DATA",
            "",
            edl_worker::data::DEFAULT_DATA_DIR,
            "apt-get install dataset-fashion-mnist",
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // The cluster's CA, which issues the worker its certificate.
    edl_shared::pki::PkiDir::new(dir.path())
        .init_ca()
        .expect("a CA");
    // Nothing listens on this port: the worker keeps trying to reach the coordinator.
    let mut child = Command::new(env!("CARGO_BIN_EXE_edl-worker"))
        .args(["--coordinator", "127.0.0.1:9"])
        .arg("--state-dir")
        .arg(dir.path())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawns");
    // Its first log line (the certificate the cluster CA issues it) comes after it
    // listens for signals: it is running, and not admitted. The rest of its log is read on, so
    // that it never waits on a full pipe.
    let stderr = child.stderr.take().expect("stderr");
    let (first, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stderr).lines();
        let _ = first.send(lines.next());
        lines.for_each(drop);
    });
    let line = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the worker logs a first line");
    assert!(line.is_some_and(|l| l.is_ok()), "the worker wrote nothing");
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

/// The book's reference page of `edl-worker` is its `--help` (`EDL_BLESS=1` rewrites it).
#[test]
fn the_reference_page_of_edl_worker_is_current() {
    let programs = [(
        env!("CARGO_BIN_EXE_edl-worker"),
        "edl-worker",
        "The training worker of the built-in models (and the evaluator, `--evaluate`).",
    )];
    edl_shared::docgen::check_cli_pages(env!("CARGO_MANIFEST_DIR"), &programs)
        .unwrap_or_else(|e| panic!("{e}"));
}
