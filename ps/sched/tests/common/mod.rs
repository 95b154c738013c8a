//! Helpers for the scheduler's end-to-end tests: the binaries, job files, and an
//! `edl-sched` process driven through `edlctl`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use edl_ps::cluster::JobRow;

/// The tests of one file run in parallel threads; runs of real jobs compared by their timing
/// must not share the two cores with another: each holds this.
pub static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Workers sleep this many times their step's compute after each step, so that a job's speed
/// follows its slots rather than this machine's two cores.
pub const SLOWDOWN: &str = "10";
/// How long the whole submission pattern may take under one policy.
pub const LIMIT: Duration = Duration::from_secs(400);

pub fn bin_dir() -> PathBuf {
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
pub fn job_file(dir: &Path, name: &str, samples: u32) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[model]\nkind = \"mlp\"\nlayers = [784, 32, 10]\n\n[optimizer]\nkind = \"sgd\"\n\
         lr = 0.05\n\n[training]\nconsistency = \"asp\"\nsamples = {samples}\nepochs = 1\n\
         batch_size = 32\npartition_size = 256\nlease_ms = 2000\n"
    );
    std::fs::write(&path, text).expect("write the job file");
    path
}

/// Asserts that every job finished with an exact ledger: every sample applied once on every
/// shard. `what` labels the messages.
pub fn assert_exact(jobs: &[JobRow], what: &str) {
    for j in jobs {
        assert_eq!(j.state, "finished", "{what}: {j:#?}");
        let l = j
            .ledger
            .unwrap_or_else(|| panic!("{what}: no ledger: {j:#?}"));
        assert_eq!(
            (l.applied, l.duplicates, l.missing),
            (j.samples_total, 0, 0),
            "{what}: {} ledger",
            j.name
        );
    }
}

pub struct Sched {
    pub child: Option<Child>,
    pub addr: String,
    pub state: PathBuf,
    pub bins: PathBuf,
    pub cluster: PathBuf,
    pub addr_file: PathBuf,
    pub log: PathBuf,
    /// Cancel the jobs when it stops (else they run on, for a restarted scheduler).
    pub stop_jobs: bool,
    /// More arguments (`--meta ...`).
    pub extra: Vec<String>,
}

impl Sched {
    /// A scheduler of 4 slots under `policy`, its files in `dir`.
    pub fn start(dir: &Path, policy: &str, stop_jobs: bool) -> Sched {
        Sched::start_with(dir, policy, 4, "", stop_jobs)
    }

    /// A scheduler of `slots` slots under `policy`, with `extra` lines in its cluster file.
    pub fn start_with(dir: &Path, policy: &str, slots: u32, extra: &str, stop_jobs: bool) -> Sched {
        let mut s = Sched::prepare(dir, policy, slots, extra, stop_jobs);
        s.launch();
        s
    }

    /// A scheduler of 4 slots under `policy` whose workers take `worker_args` (a TOML array's
    /// items) instead of the default pacing.
    pub fn start_paced(dir: &Path, policy: &str, worker_args: &str) -> Sched {
        let mut s = Sched::prepare(dir, policy, 4, "", true);
        let text = std::fs::read_to_string(&s.cluster).expect("cluster file");
        let default = format!("worker_args = [\"--slowdown\", \"{SLOWDOWN}\"]");
        assert!(text.contains(&default));
        std::fs::write(
            &s.cluster,
            text.replace(&default, &format!("worker_args = [{worker_args}]")),
        )
        .expect("write the cluster file");
        s.launch();
        s
    }

    /// Scheduler number `i` of several sharing `dir`'s state directory and the etcd at
    /// `etcd_url` (one leads), with a lease of `ttl`.
    pub fn start_elected(dir: &Path, policy: &str, i: usize, etcd_url: &str, ttl: &str) -> Sched {
        let mut s = Sched::prepare(dir, policy, 4, "", false);
        s.addr_file = dir.join(format!("sched-{policy}-{i}.addr"));
        s.log = dir.join(format!("sched-{policy}-{i}.log"));
        s.extra = ["--meta", etcd_url, "--leader-ttl", ttl]
            .map(String::from)
            .to_vec();
        s.launch();
        s
    }

    fn prepare(dir: &Path, policy: &str, slots: u32, extra: &str, stop_jobs: bool) -> Sched {
        let cluster = dir.join(format!("cluster-{policy}.toml"));
        std::fs::write(
            &cluster,
            format!(
                "policy = \"{policy}\"\nslots = {slots}\nshards = 1\nresize_interval = \"1s\"\n\
                 resize_overhead = 1.0\n\
                 worker_args = [\"--slowdown\", \"{SLOWDOWN}\"]\n{extra}"
            ),
        )
        .expect("write the cluster file");
        let bins = bin_dir();
        Sched {
            child: None,
            addr: String::new(),
            state: dir.join(format!("state-{policy}")),
            cluster,
            addr_file: dir.join(format!("sched-{policy}.addr")),
            log: dir.join(format!("sched-{policy}.log")),
            bins,
            stop_jobs,
            extra: Vec::new(),
        }
    }

    fn launch(&mut self) {
        let _ = std::fs::remove_file(&self.addr_file);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let mut cmd = Command::new(self.bins.join("edl-sched"));
        cmd.args(["--cluster".as_ref(), self.cluster.as_os_str()])
            .args(["--state-dir".as_ref(), self.state.as_os_str()])
            .args(["--listen", "127.0.0.1:0"])
            .args(["--addr-file".as_ref(), self.addr_file.as_os_str()])
            .args(["--bin-dir".as_ref(), self.bins.as_os_str()])
            .args(&self.extra)
            .stderr(log);
        if self.stop_jobs {
            cmd.arg("--stop-jobs-on-exit");
        }
        self.child = Some(cmd.spawn().expect("start edl-sched"));
        let deadline = Instant::now() + Duration::from_secs(30);
        self.addr = loop {
            if let Ok(a) = std::fs::read_to_string(&self.addr_file) {
                break a;
            }
            assert!(Instant::now() < deadline, "edl-sched did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
    }

    /// Stops the scheduler with SIGTERM and waits for it.
    pub fn stop(&mut self) {
        let mut child = self.child.take().expect("edl-sched runs");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = child.wait().expect("wait for edl-sched");
        assert!(status.success(), "edl-sched exited with {status}");
    }

    /// Stops the scheduler and starts it again on the same state directory.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Kills the scheduler with SIGKILL.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("edl-sched runs");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts the scheduler again (after [`Sched::kill`]).
    pub fn relaunch(&mut self) {
        self.launch();
    }

    /// The scheduler's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Runs edlctl against the scheduler as the admin certificate `name`.
    pub fn edlctl_as(&self, name: &str, args: &[&str]) -> Output {
        Command::new(self.bins.join("edlctl"))
            .args(["--scheduler", &self.addr, "--name", name])
            .args(["--state-dir".as_ref(), self.state.as_os_str()])
            .args(args)
            .output()
            .expect("run edlctl")
    }

    /// Runs edlctl against the scheduler; panics if it fails.
    pub fn edlctl(&self, args: &[&str]) -> Output {
        let out = self.edlctl_as("edlctl", args);
        assert!(
            out.status.success(),
            "edlctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    pub fn submit(&self, file: &Path, name: &str, workers: u32) {
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

    pub fn jobs(&self) -> Vec<JobRow> {
        let out = self.edlctl(&["--json", "job", "list"]);
        serde_json::from_slice(&out.stdout).expect("job list JSON")
    }

    pub fn wait(&self, until: impl Fn(&[JobRow]) -> bool, what: &str) -> Vec<JobRow> {
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
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
    }
}
