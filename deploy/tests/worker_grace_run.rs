//! A worker's shutdown is bounded, with real processes: `edl-ps coordinator`, one `edl-ps
//! shard` and two `edl-worker`s. With the coordinator alive, SIGTERM makes a worker finish its
//! step, commit, leave and exit 0. With the coordinator killed (SIGKILL), SIGTERM makes the
//! other worker give up once its `--grace` runs out: it exits with status 3 and says on stderr
//! what it could not hand back (its registration, its leased and uncommitted data or an
//! unanswered lease, an unanswered commit).
//!
//! The binaries and the dataset are found as in `local_run.rs`.

mod common;

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// The job's lease: also the default grace period, far longer than the one the test gives,
/// so that an exit within the test's bound shows `--grace` was used.
const LEASE_MS: &str = "10000";

/// The grace period the worker whose coordinator is gone gets.
const GRACE: Duration = Duration::from_secs(2);

/// What the exit may take past the grace period (a debug build on a busy machine).
const EXIT_MARGIN: Duration = Duration::from_secs(3);

/// Starts `program` with `args`, stdout and stderr each to a file in `dir` named after `name`.
fn spawn(program: &Path, args: &[&str], dir: &Path, name: &str) -> Child {
    let out = std::fs::File::create(dir.join(format!("{name}.out"))).expect("stdout file");
    let err = std::fs::File::create(dir.join(format!("{name}.err"))).expect("stderr file");
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()))
}

/// What `name` wrote on stderr so far.
fn stderr_of(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.err"))).unwrap_or_default()
}

/// Waits until `check` holds, polling every 20 ms, for at most `limit`; panics with `what`
/// otherwise.
async fn wait_until(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < until, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `signal` to `child`.
fn signal(child: &Child, signal: Signal) {
    let pid = child.id().expect("the child is running");
    kill(Pid::from_raw(pid as i32), signal).expect("signal sent");
}

/// Waits for `child` to exit within `limit`; returns its status and how long it took.
async fn exit_within(child: &mut Child, limit: Duration, name: &str) -> (ExitStatus, Duration) {
    let begun = Instant::now();
    let status = tokio::time::timeout(limit, child.wait())
        .await
        .unwrap_or_else(|_| panic!("{name} did not exit within {limit:?}"))
        .expect("wait");
    (status, begun.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_cleanly_and_is_bounded_when_the_coordinator_is_gone() {
    if !common::have_dataset() {
        return;
    }
    let bins = common::bin_dir();
    let (ps, worker) = (bins.join("edl-ps"), bins.join("edl-worker"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let state = dir.join("state");
    let st = state.to_string_lossy().to_string();
    let addr_file = dir.join("coordinator.addr");

    // Enough epochs that the job outlasts the test; two partitions per epoch, so that each
    // worker holds one, of 256 batches each.
    let mut coordinator = spawn(
        &ps,
        &[
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--addr-file",
            &addr_file.to_string_lossy(),
            "--shards",
            "1",
            "--layers",
            "784,32,10",
            "--epochs",
            "1000",
            "--train-samples",
            "8192",
            "--partition-size",
            "4096",
            "--batch-size",
            "16",
            "--lease-ms",
            LEASE_MS,
            "--state-dir",
            &st,
            "--no-persist",
        ],
        dir,
        "coordinator",
    );
    let mut addr = String::new();
    wait_until(Duration::from_secs(60), "the coordinator's address", || {
        addr = std::fs::read_to_string(&addr_file)
            .unwrap_or_default()
            .trim()
            .to_string();
        !addr.is_empty()
    })
    .await;
    let _shard = spawn(
        &ps,
        &[
            "shard",
            "--coordinator",
            &addr,
            "--listen",
            "127.0.0.1:0",
            "--name",
            "s0",
            "--state-dir",
            &st,
            "--no-checkpoint",
        ],
        dir,
        "s0",
    );
    let start_worker = |name: &str, grace: &[&str]| {
        let mut args = vec![
            "--coordinator",
            &addr,
            "--name",
            name,
            "--state-dir",
            &st,
            "--device",
            "cpu",
            "--progress-every",
            "100ms",
        ];
        args.extend_from_slice(grace);
        spawn(&worker, &args, dir, name)
    };
    // `wa` keeps the default grace (the lease); `wb` is given a shorter one.
    let grace = format!("{}ms", GRACE.as_millis());
    let mut wa = start_worker("wa", &[]);
    let mut wb = start_worker("wb", &["--grace", &grace]);
    for name in ["wa", "wb"] {
        wait_until(Duration::from_secs(120), &format!("{name} trains"), || {
            stderr_of(dir, name).contains("samples_per_s")
        })
        .await;
    }

    // The coordinator answers: SIGTERM finishes the step, commits, leaves, exits 0.
    signal(&wa, Signal::SIGTERM);
    let (status, took) = exit_within(&mut wa, Duration::from_secs(60), "wa").await;
    let err = stderr_of(dir, "wa");
    assert_eq!(status.code(), Some(0), "wa after SIGTERM:\n{err}");
    assert!(err.contains("worker done"), "{err}");
    assert!(!err.contains("abandoning"), "{err}");
    eprintln!("wa left and exited 0 {took:?} after SIGTERM");

    // The coordinator is gone: SIGTERM gives up after the grace period, with status 3.
    coordinator.start_kill().expect("SIGKILL the coordinator");
    coordinator.wait().await.expect("the coordinator exits");
    signal(&wb, Signal::SIGTERM);
    let (status, took) = exit_within(&mut wb, GRACE + EXIT_MARGIN + EXIT_MARGIN, "wb").await;
    let err = stderr_of(dir, "wb");
    eprintln!("wb exited with {status} {took:?} after SIGTERM");
    assert_eq!(status.code(), Some(3), "wb after SIGTERM:\n{err}");
    assert!(
        took >= GRACE && took < GRACE + EXIT_MARGIN,
        "wb exited {took:?} after SIGTERM, its grace period is {GRACE:?}:\n{err}"
    );
    let last = err
        .lines()
        .find(|l| l.starts_with("edl-worker: exiting with status 3"))
        .unwrap_or_else(|| panic!("no exit line on wb's stderr:\n{err}"));
    eprintln!("{last}");
    assert!(
        last.contains(&format!(
            "grace period ({GRACE:?}) ran out before the coordinator answered this worker's \
             leave; not handed back: worker#"
        )),
        "{last}"
    );
    assert!(last.contains("'s registration"), "{last}");
    // The coordinator died before the signal, so whatever wb did last needed it: it holds
    // the uncommitted rest of a partition (its last commit unanswered, or pushed and not
    // committed when the grace cut the step's wait), or asked for a partition unanswered.
    let holds_data = last.contains("leased and not committed")
        && (last.contains("the last batch's commit") || last.contains("the last batch ("));
    let asked = last.contains("a partition lease asked for and not answered");
    assert!(holds_data || asked, "{last}");
    assert!(
        last.contains("to the pool when its lease expires"),
        "{last}"
    );
}
