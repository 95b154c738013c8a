//! `edl-ps` processes for the tests and benchmarks that kill and restart them
//! (`tests/shard_restart.rs`, `tests/ha.rs`, `edl-bench failover`): the binary beside the
//! test, a free port, a child killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The binaries `cargo test --workspace` builds beside this test.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target directory")
        .join(name)
}

/// A free UDP port on loopback (bound and released).
pub fn free_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.local_addr().expect("addr").port()
}

pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The text of the file at `path` (an address a process writes once it listens), trimmed, once
/// it is there and not empty; `None` if it is not within `limit`.
pub fn wait_for_file(path: &Path, limit: std::time::Duration) -> Option<String> {
    let started = std::time::Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && !s.trim().is_empty()
        {
            return Some(s.trim().to_string());
        }
        if started.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Starts `edl-ps ARGS --state-dir STATE` from beside the test, its log in `STATE/LOG`.
pub fn spawn(args: &[&str], state: &Path, log: &str) -> Proc {
    spawn_from(&bin("edl-ps"), args, state, log).expect("edl-ps starts")
}

/// Starts the `edl-ps` at `ps` (a benchmark's, beside it) as [`spawn`] does.
pub fn spawn_from(ps: &Path, args: &[&str], state: &Path, log: &str) -> std::io::Result<Proc> {
    let log = std::fs::File::create(state.join(log))?;
    let child = Command::new(ps)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?;
    Ok(Proc(child))
}

/// Starts `edl-ps shard` (the one at `ps`) named `name`, listening on `listen` and joining the
/// coordinators at `coordinator`, as [`spawn_from`] does; its log in `STATE/LOG`.
pub fn spawn_shard(
    ps: &Path,
    (coordinator, listen, name): (&str, &str, &str),
    state: &Path,
    log: &str,
) -> std::io::Result<Proc> {
    let args = [
        "shard",
        "--coordinator",
        coordinator,
        "--listen",
        listen,
        "--name",
        name,
    ];
    spawn_from(ps, &args, state, log)
}

/// Starts `n` shard servers `s0`, `s1`, ... of the `edl-ps` beside the test, joining the
/// coordinators at `coordinator` (one address, or several separated by commas), each listening
/// on a free loopback port, their logs in `STATE/sN.log`.
pub fn shards(coordinator: &str, n: usize, state: &Path) -> Vec<Proc> {
    (0..n)
        .map(|i| {
            let name = format!("s{i}");
            let log = format!("{name}.log");
            spawn_shard(
                &bin("edl-ps"),
                (coordinator, "127.0.0.1:0", &name),
                state,
                &log,
            )
            .expect("edl-ps shard starts")
        })
        .collect()
}

/// The last `lines` lines of every `*.log` file in `dir`, each under its name: what a test
/// prints when it fails, since its processes' logs go with its temporary directory.
pub fn log_tails(dir: &Path, lines: usize) -> String {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    names.sort();
    let mut out = String::new();
    for path in names {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let from = all.len().saturating_sub(lines);
        out.push_str(&format!(
            "==> {} (last {} of {} lines) <==\n",
            path.display(),
            all.len() - from,
            all.len()
        ));
        for l in &all[from..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}
