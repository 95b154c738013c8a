//! Real jobs on the scheduler: `edl-sched` on 4 slots of this machine, jobs submitted with
//! `edlctl job submit`, every process real (coordinators, shards, workers over QUIC with
//! per-job certificates). The same submission pattern runs under the elastic policy and
//! under static FIFO in one test; the elastic one must finish with a lower mean job
//! completion time, and under both no slot is ever held twice (replayed from the
//! scheduler's event log) and every job's ledger is exact.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use edl_ps::cluster::JobRow;
use edl_sched::cluster::state::{EventLog, check_slots};

/// Workers sleep this many times their step's compute after each step, so that a job's speed
/// follows its slots rather than this machine's two cores.
const SLOWDOWN: &str = "10";
/// How long the whole submission pattern may take under one policy.
const LIMIT: Duration = Duration::from_secs(400);

fn bin_dir() -> PathBuf {
    let dir = match std::env::var_os("EDL_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_BIN_EXE_edl-sched"))
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default(),
    };
    for b in ["edl-ps", "edl-worker", "edlctl"] {
        assert!(
            dir.join(b).is_file(),
            "{b} is not in {}: build the workspace (cargo build) or set EDL_BIN_DIR",
            dir.display()
        );
    }
    dir
}

/// A job file: a small MLP on Fashion-MNIST, one epoch of `samples`.
fn job_file(dir: &Path, name: &str, samples: u32) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[model]\nkind = \"mlp\"\nlayers = [784, 32, 10]\n\n[optimizer]\nkind = \"sgd\"\n\
         lr = 0.05\n\n[training]\nconsistency = \"asp\"\nsamples = {samples}\nepochs = 1\n\
         batch_size = 32\npartition_size = 256\nlease_ms = 2000\n"
    );
    std::fs::write(&path, text).expect("write the job file");
    path
}

struct Sched {
    child: Child,
    addr: String,
    state: PathBuf,
    bins: PathBuf,
}

impl Sched {
    fn start(dir: &Path, policy: &str) -> Sched {
        let bins = bin_dir();
        let state = dir.join(format!("state-{policy}"));
        let cluster = dir.join(format!("cluster-{policy}.toml"));
        std::fs::write(
            &cluster,
            format!(
                "policy = \"{policy}\"\nslots = 4\nshards = 1\nresize_interval = \"1s\"\n\
                 worker_args = [\"--slowdown\", \"{SLOWDOWN}\"]\n"
            ),
        )
        .expect("write the cluster file");
        let addr_file = dir.join(format!("sched-{policy}.addr"));
        let log = std::fs::File::create(dir.join(format!("sched-{policy}.log"))).expect("log");
        let child = Command::new(bins.join("edl-sched"))
            .args(["--cluster".as_ref(), cluster.as_os_str()])
            .args(["--state-dir".as_ref(), state.as_os_str()])
            .args(["--listen", "127.0.0.1:0", "--stop-jobs-on-exit"])
            .args(["--addr-file".as_ref(), addr_file.as_os_str()])
            .args(["--bin-dir".as_ref(), bins.as_os_str()])
            .stderr(log)
            .spawn()
            .expect("start edl-sched");
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Ok(a) = std::fs::read_to_string(&addr_file) {
                break a;
            }
            assert!(Instant::now() < deadline, "edl-sched did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Sched {
            child,
            addr,
            state,
            bins,
        }
    }

    fn edlctl(&self, args: &[&str]) -> Output {
        let out = Command::new(self.bins.join("edlctl"))
            .args(["--scheduler", &self.addr])
            .args(["--state-dir".as_ref(), self.state.as_os_str()])
            .args(args)
            .output()
            .expect("run edlctl");
        assert!(
            out.status.success(),
            "edlctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn submit(&self, file: &Path, name: &str, workers: u32) {
        let file = file.to_str().expect("utf-8 path");
        let w = workers.to_string();
        self.edlctl(&[
            "job",
            "submit",
            file,
            "--job",
            name,
            "--workers",
            &w,
            "--min",
            "1",
            "--max",
            &w,
        ]);
    }

    fn jobs(&self) -> Vec<JobRow> {
        let out = self.edlctl(&["--json", "job", "list"]);
        serde_json::from_slice(&out.stdout).expect("job list JSON")
    }

    fn wait(&self, until: impl Fn(&[JobRow]) -> bool, what: &str) -> Vec<JobRow> {
        let deadline = Instant::now() + LIMIT;
        loop {
            let jobs = self.jobs();
            if until(&jobs) {
                return jobs;
            }
            assert!(Instant::now() < deadline, "{what}: {jobs:#?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Sched {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

/// One long job that asks for all 4 slots, then two short ones that ask for 2 each, once the
/// long one runs. Returns the mean completion time.
fn run_pattern(dir: &Path, policy: &str) -> f64 {
    let sched = Sched::start(dir, policy);
    let long = job_file(dir, "long", 48_000);
    let short = job_file(dir, "short", 4_000);
    sched.submit(&long, "long", 4);
    sched.wait(
        |j| j.iter().any(|j| j.name == "long" && j.samples > 0),
        "the long job did not start training",
    );
    sched.submit(&short, "short-a", 2);
    sched.submit(&short, "short-b", 2);
    let jobs = sched.wait(
        |j| {
            j.iter()
                .all(|j| j.state != "queued" && j.state != "running")
        },
        "the jobs did not all end",
    );
    let mut jcts = Vec::new();
    for j in &jobs {
        assert_eq!(j.state, "finished", "{policy}: {j:#?}");
        let l = j
            .ledger
            .unwrap_or_else(|| panic!("{policy}: no ledger: {j:#?}"));
        assert_eq!(
            (l.applied, l.duplicates, l.missing),
            (j.samples_total, 0, 0),
            "{policy}: {} ledger",
            j.name
        );
        jcts.push(j.jct_s.expect("finished jobs have a completion time"));
    }
    let events = EventLog::read(&sched.state.join("events.jsonl")).expect("event log");
    let slots: Vec<String> = (0..4).map(|i| format!("slot{i}")).collect();
    let most = check_slots(&events, &slots).unwrap_or_else(|e| panic!("{policy}: {e}"));
    assert!(most <= 4);
    let resizes: u32 = jobs.iter().map(|j| j.resizes).sum();
    let mean = jcts.iter().sum::<f64>() / jcts.len() as f64;
    eprintln!(
        "{policy}: completion times {jcts:.1?} s, mean {mean:.1} s; {resizes} resizes; at most \
         {most} slots held"
    );
    mean
}

#[test]
fn elastic_beats_fifo_on_the_same_jobs() {
    if !edl_testkit::have_fashion_mnist() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let elastic = run_pattern(dir.path(), "elastic");
    let fifo = run_pattern(dir.path(), "fifo");
    eprintln!(
        "mean completion time: elastic {elastic:.1} s, fifo {fifo:.1} s ({:.2} of fifo)",
        elastic / fifo
    );
    assert!(
        elastic < fifo,
        "elastic {elastic:.1} s is not below fifo {fifo:.1} s"
    );
}
