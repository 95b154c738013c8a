//! Job files as the `edl-ps` and `edlctl` binaries handle them: `edl-ps job check` finds a
//! job's missing data, `edlctl job submit` checks the file before it reaches for a scheduler,
//! and `edlctl job show` keeps a failed job's long message readable. The scheduler is a
//! stand-in served in this process over the same QUIC and mutual TLS as `edl-sched`'s.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edl_shared::pki::PkiDir;
use edl_shared::proto::sched::{JobRecord, JobState, SchedRequest, SchedResponse, Submission};
use edl_shared::proto::{ErrorCode, Frame, Parts, Request, Response};
use edl_shared::server::{Peer, Service};
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::{TransportSettings, server_endpoint};
use edl_shared::{Role, serve};

/// A valid job without data.
const JOB: &str = r#"[model]
kind = "mlp"
layers = [4, 3]

[training]
batch_size = 8
samples = 64
"#;

/// A job with a typo on line 6.
const TYPO: &str = r#"[model]
kind = "mlp"
layers = [4, 3]

[training]
batch_sise = 8
samples = 64
"#;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn job_check(file: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edl-ps"))
        .args(["job", "check"])
        .arg(file)
        .args(extra)
        .output()
        .expect("runs edl-ps")
}

/// Writes an idx job whose data lies in `dir` under the prefixes `train` and `t10k`.
fn idx_job(dir: &Path) -> std::path::PathBuf {
    let file = dir.join("job.toml");
    let body = format!("{JOB}\n[data]\nformat = \"idx\"\ntrain = \"train\"\ntest = \"t10k\"\n");
    std::fs::write(&file, body).expect("writes the job");
    file
}

#[test]
fn job_check_names_the_idx_files_that_are_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let file = idx_job(d);
    let touch = |name: &str| std::fs::write(d.join(name), b"").expect("writes");

    // Nothing there: both splits are missing, each with both of its files.
    let out = job_check(&file, &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{}", text(&out.stdout));
    assert!(
        !text(&out.stdout).contains("valid"),
        "{}",
        text(&out.stdout)
    );
    // Each named with its line, as every other job-file error is.
    for (field, line, prefix) in [("data.train", 11, "train"), ("data.test", 12, "t10k")] {
        let line = err
            .lines()
            .find(|l| l.contains(&format!("job.toml:{line}: {field}: ")))
            .unwrap_or_else(|| panic!("no line for {field}: {err}"));
        for kind in ["images-idx3-ubyte", "labels-idx1-ubyte"] {
            let missing = d.join(format!("{prefix}-{kind}"));
            assert!(line.contains(&missing.display().to_string()), "{line}");
        }
    }

    // Images (gzipped) and labels (raw) of train, only the images of t10k: only t10k's labels
    // are missing, and only data.test is named.
    touch("train-images-idx3-ubyte.gz");
    touch("train-labels-idx1-ubyte");
    touch("t10k-images-idx3-ubyte");
    let out = job_check(&file, &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("data.train"), "{err}");
    let labels = d.join("t10k-labels-idx1-ubyte").display().to_string();
    let images = d.join("t10k-images-idx3-ubyte").display().to_string();
    assert!(
        err.contains(&format!("job.toml:12: data.test: {labels} not found")),
        "{err}"
    );
    assert!(!err.contains(&images), "{err}");

    // Everything there: valid, and the table still follows.
    touch("t10k-labels-idx1-ubyte.gz");
    let out = job_check(&file, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("job.toml: valid"));
}

#[test]
fn job_check_says_when_an_idx_prefix_is_a_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::create_dir(d.join("fashion")).expect("mkdir");
    for name in ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"] {
        std::fs::write(d.join("fashion").join(name), b"").expect("writes");
    }
    let file = d.join("job.toml");
    let body = format!("{JOB}\n[data]\nformat = \"idx\"\ntrain = \"fashion\"\n");
    std::fs::write(&file, body).expect("writes the job");
    let out = job_check(&file, &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    let hint = format!(
        "is a directory: name the files' prefix in it, e.g. {}",
        d.join("fashion").join("train").display()
    );
    assert!(err.contains(&hint), "{err}");
}

#[test]
fn job_check_finds_a_missing_libsvm_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("a.train"), "1 3:1 7:1\n0 2:1\n").expect("writes");
    let file = d.join("job.toml");
    let job = "[model]\nkind = \"logreg\"\nfeatures = 8\n\n[training]\nbatch_size = 2\nsamples = 2\n\
               \n[data]\nformat = \"libsvm\"\ntrain = \"a.train\"\ntest = \"a.test\"\n";
    std::fs::write(&file, job).expect("writes the job");
    let out = job_check(&file, &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    let test = d.join("a.test").display().to_string();
    assert!(
        err.contains(&format!(
            "job.toml:12: data.test: LIBSVM file {test} not found"
        )),
        "{err}"
    );
    assert!(!err.contains("data.train"), "{err}");
    // For data that only the workers' hosts hold, the check can be left out.
    let out = job_check(&file, &["--no-data-check"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::write(d.join("a.test"), "1 1:1\n").expect("writes");
    let out = job_check(&file, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Runs `edlctl` against the scheduler at `sched` with the state directory `state`, killing it
/// after `limit`; `None` if it had not finished by then.
async fn edlctl(state: &Path, sched: &str, args: &[&str], limit: Duration) -> Option<Output> {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_edlctl"))
        .args(["--scheduler", sched, "--state-dir"])
        .arg(state)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("runs edlctl");
    tokio::time::timeout(limit, child.wait_with_output())
        .await
        .ok()
        .map(|r| r.expect("edlctl's output"))
}

#[tokio::test]
async fn job_submit_reports_a_typo_before_reaching_for_a_scheduler() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let file = d.join("typo.toml");
    std::fs::write(&file, TYPO).expect("writes the job");
    // A scheduler address where nothing answers: a socket that is bound and never read.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("binds");
    let addr = silent.local_addr().expect("address").to_string();
    let state = d.join("state");
    let started = Instant::now();
    let out = edlctl(
        &state,
        &addr,
        &["job", "submit", &file.display().to_string()],
        Duration::from_secs(20),
    )
    .await
    .expect("edlctl waited for a scheduler instead of checking the job file");
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("{}:6: training.batch_sise: ", file.display())),
        "{err}"
    );
    assert!(!err.contains("connecting"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Nothing was done before the check: not even the admin certificate was made.
    assert!(!state.exists(), "the state directory was created");
}

/// A scheduler stand-in: records submissions, shows every job as failed with `message`.
struct Sched {
    submitted: Mutex<Vec<Submission>>,
    message: String,
}

fn record(name: &str, state: JobState, message: &str) -> JobRecord {
    JobRecord {
        name: name.into(),
        owner: "edlctl".into(),
        workers: 2,
        min_workers: 1,
        max_workers: 4,
        priority: 0,
        state,
        alloc: 0,
        running: 0,
        resizes: 0,
        resize_cost_ms: None,
        submit_ms: 1_000,
        start_ms: Some(2_000),
        end_ms: Some(9_000),
        attained_s: 14.0,
        samples: (128, 640),
        coordinator: None,
        dir: format!("/var/lib/edl-sched/jobs/{name}"),
        ledger: None,
        message: message.into(),
        runs: "edl-worker".into(),
    }
}

impl Service for Sched {
    fn allowed(&self, role: Role, _req: &Request) -> bool {
        role == Role::Admin
    }

    async fn handle(&self, _peer: &Peer, req: Request, _payload: Parts) -> Frame<Response, Parts> {
        let job = match req {
            Request::Sched(SchedRequest::Submit(s)) => {
                let job = record("j1", JobState::Queued, "");
                self.submitted.lock().expect("lock").push(s);
                job
            }
            Request::Sched(SchedRequest::Show { job }) => {
                record(&job, JobState::Failed, &self.message)
            }
            other => {
                return Frame::new(Response::error(
                    ErrorCode::InvalidRequest,
                    format!("the stand-in does not answer {}", other.name()),
                ));
            }
        };
        Frame::new(Response::Sched(SchedResponse::Job(Box::new(job))))
    }
}

/// Serves `sched` on loopback with a scheduler certificate from `state`'s CA; its address.
fn start(state: &Path, sched: Arc<Sched>, stop: &CancellationToken) -> String {
    let id = PkiDir::new(state)
        .ensure(Role::Coordinator, "scheduler")
        .expect("a scheduler identity");
    let settings = TransportSettings::default();
    let endpoint =
        server_endpoint("127.0.0.1:0".parse().expect("addr"), &id, &settings).expect("an endpoint");
    let addr = endpoint.local_addr().expect("address").to_string();
    let stop = stop.clone();
    tokio::spawn(async move { serve(endpoint, sched, &id.job, &settings, stop).await });
    addr
}

#[tokio::test]
async fn job_submit_sends_a_checked_file_and_show_keeps_a_failure_readable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let state = d.join("state");
    // A failure as edl-sched words it: a long first line, then the end of the worker's log.
    let log = d.join("state/jobs/j1/logs/p7.log").display().to_string();
    let message = format!(
        "3 workers in a row failed; the last: p7 p7 exited (exit status: 1); its log is {log}; \
         it ends with:\n    2026-01-01T00:00:00.000000Z  INFO no usable CUDA device; falling back \
         to the CPU backend reason=no CUDA driver: libcuda could not be loaded\n    Error: \
         loading the idx images /data/fashion-mnist/train: dataset file \
         /data/fashion-mnist/train-images-idx3-ubyte not found (also looked for it with a .gz \
         suffix); the directory given must hold `train-images-idx3-ubyte`, \
         `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte` \
         (each may end in .gz)"
    );
    assert!(message.lines().next().map_or(0, str::len) > 100);
    let sched = Arc::new(Sched {
        submitted: Mutex::default(),
        message: message.clone(),
    });
    let stop = CancellationToken::new();
    let addr = start(&state, sched.clone(), &stop);
    let limit = Duration::from_secs(30);

    // A valid file is submitted as written, with its directory.
    let file = d.join("job.toml");
    std::fs::write(&file, JOB).expect("writes the job");
    let args = ["job", "submit", "--job", "alpha", "--workers", "3"];
    let out = edlctl(
        &state,
        &addr,
        &[&args[..], &[&file.display().to_string()]].concat(),
        limit,
    )
    .await
    .expect("edlctl job submit finishes");
    assert!(out.status.success(), "{}", text(&out.stderr));
    {
        let submitted = sched.submitted.lock().expect("lock");
        let [s] = &submitted[..] else {
            panic!("submitted {submitted:?}");
        };
        assert_eq!((s.name.as_str(), s.job_file.as_str()), ("alpha", JOB));
        assert_eq!(Path::new(&s.file_dir), d);
        assert_eq!((s.workers, s.min_workers, s.max_workers), (3, 1, 6));
    }

    // A failed job: every line within 100 columns, the message whole below the table.
    let out = edlctl(&state, &addr, &["job", "show", "j1"], limit)
        .await
        .expect("edlctl job show finishes");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    for line in shown.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}\n{shown}",
            line.chars().count()
        );
    }
    assert!(shown.contains("failed"), "{shown}");
    let (table, below) = shown
        .split_once("message:\n")
        .expect("the message below the table");
    assert!(!table.contains("workers in a row"), "{shown}");
    let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(words(below), words(&message), "{shown}");
    // The log's lines still start lines of their own, indented.
    assert!(
        below.contains("\n      Error: loading the idx images"),
        "{shown}"
    );
    stop.cancel();
}

#[test]
fn job_check_says_what_the_workers_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("job.toml");
    let check = |body: &str| {
        std::fs::write(&file, body).expect("writes the job");
        let out = job_check(&file, &[]);
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let (ok, out, err) = check(JOB);
    assert!(ok, "{err}");
    assert!(
        out.contains("workers run: edl-worker (built-in model)"),
        "{out}"
    );

    let program = format!("{JOB}\n[worker]\ncommand = [\"python3\", \"train.py\", \"a b\"]\n");
    let (ok, out, err) = check(&program);
    assert!(ok, "{err}");
    assert!(out.contains("workers run: python3 train.py 'a b'"), "{out}");
    // --toml keeps the table.
    let toml = job_check(&file, &["--toml"]);
    assert!(
        text(&toml.stdout).contains("[worker]\ncommand = [\"python3\", \"train.py\", \"a b\"]")
    );

    let custom = "[model]\nkind = \"custom\"\n\n[[tensor]]\nname = \"w\"\nshape = [4]\n\
                  init = \"zeros\"\n";
    let (ok, out, err) = check(custom);
    assert!(ok, "{err}");
    assert!(out.contains("workers: none named"), "{out}");

    let reserved = format!("{JOB}\n[worker]\nenv = {{ EDL_PLACEMENT = \"3\" }}\n");
    let (ok, _, err) = check(&reserved);
    assert!(!ok);
    assert!(
        err.contains("job.toml:10: worker.env.EDL_PLACEMENT"),
        "{err}"
    );
}
