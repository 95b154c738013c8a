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

/// A client (`edlctl`) finds the coordinator's address in the state directory it is given,
/// never creates a CA or replaces one, and a client that cannot connect names the address it
/// tried and what to check: a wrong CA, nothing listening.
#[test]
fn a_client_makes_no_ca_and_says_what_to_check_when_it_cannot_connect() {
    let edlctl = |state: &std::path::Path, coordinator: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_edlctl"))
            .args(["--coordinator", coordinator, "--state-dir"])
            .arg(state)
            .arg("status")
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("runs");
        assert!(!out.status.success(), "status succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let cluster = tempfile::tempdir().expect("tempdir");
    // Where a local run's coordinator writes its address: clients given the state directory
    // read it there.
    let addr_file = cluster.path().join(edl_shared::cli::COORDINATOR_ADDR_FILE);
    let mut coordinator = edl_ps()
        .args(["coordinator", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(cluster.path())
        .arg("--addr-file")
        .arg(&addr_file)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawns");
    let started = std::time::Instant::now();
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file)
            && !a.trim().is_empty()
        {
            break a.trim().to_string();
        }
        assert!(
            started.elapsed().as_secs() < 60,
            "the coordinator never bound"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };

    // The cluster's state directory and no --coordinator: the address written there is used.
    let out = Command::new(env!("CARGO_BIN_EXE_edlctl"))
        .arg("--state-dir")
        .arg(cluster.path())
        .args(["--json", "status"])
        .env_remove("EDL_COORDINATOR")
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "edlctl did not find the coordinator through the state directory: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // An empty state directory: no CA is made, and the error says what to give.
    let empty = tempfile::tempdir().expect("tempdir");
    let err = edlctl(empty.path(), &addr);
    assert!(err.contains("no cluster CA"), "{err}");
    assert!(!empty.path().join("pki").exists(), "a client made a PKI");

    // The cluster's CA certificate without its key: kept, and the missing certificate named.
    let copied = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(copied.path().join("pki")).expect("mkdir");
    let ca = edl_shared::pki::PkiDir::new(cluster.path()).ca_cert();
    let ca_pem = std::fs::read(&ca).expect("the cluster CA");
    std::fs::write(copied.path().join("pki/ca.pem"), &ca_pem).expect("copy");
    let err = edlctl(copied.path(), &addr);
    assert!(err.contains("admin-edlctl.pem is not issued"), "{err}");
    assert_eq!(
        std::fs::read(copied.path().join("pki/ca.pem")).expect("still there"),
        ca_pem
    );

    // Another cluster's CA: the handshake fails, and the error says why.
    let other = tempfile::tempdir().expect("tempdir");
    edl_shared::pki::PkiDir::new(other.path())
        .init_ca()
        .expect("another CA");
    let err = edlctl(other.path(), &addr);
    assert!(
        err.contains(&format!("could not connect to {addr}")),
        "{err}"
    );
    assert!(err.contains("not of one cluster CA"), "{err}");

    // Nothing listening (a port held by a silent socket): both addresses named.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let dead = silent.local_addr().expect("addr").to_string();
    let err = edlctl(cluster.path(), &format!("{dead},{dead}"));
    assert!(
        err.contains(&format!("could not connect to {dead}, {dead}")),
        "{err}"
    );
    assert!(err.contains("UDP to that port"), "{err}");
    let _ = coordinator.kill();
    let _ = coordinator.wait();
}

/// The book's reference pages of `edl-ps` and `edlctl` are their `--help` texts, every
/// subcommand's included (`EDL_BLESS=1` rewrites them).
#[test]
fn the_reference_pages_of_edl_ps_and_edlctl_are_current() {
    let programs = [
        (
            env!("CARGO_BIN_EXE_edl-ps"),
            "edl-ps",
            "The parameter-server processes (`coordinator`, `shard`), the cluster CA's commands \
             and the job-file checker.",
        ),
        (
            env!("CARGO_BIN_EXE_edlctl"),
            "edlctl",
            "The operator's view of a running job (and, with `job` and `slots`, of a \
             scheduler's cluster).",
        ),
    ];
    edl_shared::docgen::check_cli_pages(env!("CARGO_MANIFEST_DIR"), &programs)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Runs `bin ARGS` in `cwd` with no state directory or coordinator from the environment, and
/// checks that it fails within 5 s saying `want`, in at most `lines` lines.
fn refused_at_once<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    bin: &str,
    args: &[S],
    cwd: &std::path::Path,
    want: &str,
    lines: usize,
) {
    let started = std::time::Instant::now();
    let out = Command::new(bin)
        .args(args)
        .current_dir(cwd)
        .env_remove("EDL_STATE_DIR")
        .env_remove("EDL_COORDINATOR")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{bin} {args:?} succeeded");
    assert!(err.contains(want), "{bin} {args:?}: {err}");
    assert!(err.lines().count() <= lines, "{bin} {args:?}: {err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{bin} {args:?} took {:?}",
        started.elapsed()
    );
}

/// A newcomer's first tries: `edl-ps` and `edlctl` with no arguments, `edlctl status` with no
/// cluster in sight. Each fails at once with a short answer that says what to give, and leaves
/// nothing in the folder it ran in (no state directory, no CA).
#[test]
fn first_tries_get_short_answers_and_leave_nothing_behind() {
    let cwd = tempfile::tempdir().expect("tempdir");
    for (bin, args, want) in [
        (
            env!("CARGO_BIN_EXE_edl-ps"),
            &[][..],
            "Usage: edl-ps <COMMAND>",
        ),
        (
            env!("CARGO_BIN_EXE_edlctl"),
            &[][..],
            "Usage: edlctl [OPTIONS] <COMMAND>",
        ),
        (
            env!("CARGO_BIN_EXE_edlctl"),
            &["status"][..],
            "no cluster CA at edl-state/pki: a client joins an existing cluster; give the \
             cluster's state directory (--state-dir",
        ),
    ] {
        refused_at_once(bin, args, cwd.path(), want, 40);
        let left: Vec<_> = std::fs::read_dir(cwd.path())
            .expect("reads")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert!(left.is_empty(), "{bin} {args:?} left {left:?}");
    }
}

/// The sweep of a newcomer's mistakes past the first tries: a malformed coordinator address, a
/// certificate given with another cluster's CA, a state folder an older EDL wrote. Each gets a
/// short answer naming what is wrong and what to do, within a few seconds, and writes nothing.
#[test]
fn a_newcomers_mistakes_get_answers_that_say_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let ca = |name: &str| {
        let out = edl_ps()
            .args(["ca", "init", "--state-dir"])
            .arg(d.join(name))
            .output()
            .expect("runs");
        assert!(out.status.success(), "ca init: {out:?}");
    };
    let issue = |name: &str, role: &str, cn: &str| {
        let out = edl_ps()
            .args(["ca", "issue", "--role", role, "--name", cn, "--state-dir"])
            .arg(d.join(name))
            .output()
            .expect("runs");
        assert!(out.status.success(), "ca issue: {out:?}");
    };
    ca("one");
    ca("other");
    issue("other", "admin", "ops");
    // An older EDL's coordinator folder: its CA and certificate, and its state in this
    // format's header with an earlier version.
    ca("old");
    issue("old", "coordinator", "coordinator");
    let old = d.join("old");
    std::fs::create_dir_all(old.join("coordinator")).expect("mkdir");
    let mut header = b"EDLCOORD".to_vec();
    header.extend_from_slice(&1u32.to_le_bytes());
    header.extend_from_slice(&[0u8; 24]);
    std::fs::write(old.join("coordinator/state.bin"), &header).expect("writes");
    let s = |p: &str| d.join(p).display().to_string();
    let cases: [(&str, Vec<String>, &str); 3] = [
        (
            env!("CARGO_BIN_EXE_edlctl"),
            vec![
                "--state-dir".into(),
                s("one"),
                "--coordinator".into(),
                "nonsense".into(),
                "status".into(),
            ],
            "coordinator address \"nonsense\" has no port: expected HOST:PORT",
        ),
        (
            env!("CARGO_BIN_EXE_edlctl"),
            vec![
                "--ca".into(),
                s("one/pki/ca.pem"),
                "--cert".into(),
                s("other/pki/admin-ops.pem"),
                "--key".into(),
                s("other/pki/admin-ops.key"),
                "status".into(),
            ],
            "admin-ops.pem was not issued by the CA in",
        ),
        (
            env!("CARGO_BIN_EXE_edl-ps"),
            vec![
                "coordinator".into(),
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--state-dir".into(),
                s("old"),
            ],
            "written in EDL's state format 1; this EDL reads format",
        ),
    ];
    let files = |d: &std::path::Path| -> Vec<std::path::PathBuf> {
        let mut all = Vec::new();
        let mut todo = vec![d.to_path_buf()];
        while let Some(p) = todo.pop() {
            for e in std::fs::read_dir(&p).expect("reads") {
                let e = e.expect("entry").path();
                if e.is_dir() {
                    todo.push(e.clone());
                }
                all.push(e);
            }
        }
        all.sort();
        all
    };
    let before = files(d);
    for (bin, args, want) in cases {
        refused_at_once(bin, &args, d, want, 10);
        assert_eq!(files(d), before, "{bin} {args:?} left files");
    }
}
