//! `edl-ps` processes for the tests that kill and restart them (`tests/shard_restart.rs`,
//! `tests/ha.rs`): the binary beside the test, a free port, a child killed when dropped.

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

pub fn spawn(args: &[&str], state: &Path, log: &str) -> Proc {
    let log = std::fs::File::create(state.join(log)).expect("log file");
    let child = Command::new(bin("edl-ps"))
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("edl-ps starts");
    Proc(child)
}
