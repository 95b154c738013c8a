//! A real etcd cluster on loopback for the failover tests: Debian's `etcd` (3.4) processes,
//! each member on ports of its own, in a temporary directory. Members can be killed and
//! restarted on their data; the whole cluster stopped and started again.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One member's ports and process.
struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A running etcd cluster.
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: PathBuf,
    initial: String,
}

/// True when `etcd` and `etcdctl` are installed. Without them a test says it was skipped (and
/// returns), unless `EDL_REQUIRE_ETCD=1` (set by CI) makes that a failure.
///
/// # Panics
/// When etcd is missing and `EDL_REQUIRE_ETCD=1`.
pub fn have_etcd() -> bool {
    let found = |p: &str, arg: &str| {
        Command::new(p)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if found("etcd", "--version") && found("etcdctl", "version") {
        return true;
    }
    edl_shared::skip::missing(
        "EDL_REQUIRE_ETCD",
        "",
        "etcd",
        "apt-get install etcd-server etcd-client",
    );
    false
}

/// `n` distinct free TCP ports on loopback (all bound before any is released, so that none is
/// handed out twice).
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let held = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(held
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()?)
}

impl EtcdCluster {
    /// Starts `n` members under `dir` and waits until the cluster answers.
    pub fn start(n: usize, dir: &Path) -> anyhow::Result<EtcdCluster> {
        std::fs::create_dir_all(dir)?;
        let ports = free_ports(2 * n)?;
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: ports[2 * i],
                peer: ports[2 * i + 1],
                child: None,
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            dir: dir.to_path_buf(),
            initial,
        };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        cluster.wait_healthy(Duration::from_secs(30))?;
        Ok(cluster)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let m = &self.members[i];
        let data = self.dir.join(&m.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", m.name)))?;
        let client = format!("http://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let child = Command::new("etcd")
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial])
            .args(["--initial-cluster-token", "edl-test"])
            .args(["--initial-cluster-state", "new"])
            // Loopback: a quick heartbeat and election, so a member's death costs little.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting etcd: {e}"))?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// `etcd://127.0.0.1:C0,127.0.0.1:C1,...`: every member, for `--meta`.
    pub fn url(&self) -> String {
        let members: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect();
        format!("etcd://{}", members.join(","))
    }

    fn endpoints(&self, running_only: bool) -> String {
        self.members
            .iter()
            .filter(|m| !running_only || m.child.is_some())
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every running member reports healthy.
    pub fn wait_healthy(&self, limit: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        loop {
            let ok = Command::new("etcdctl")
                .args(["--endpoints", &self.endpoints(true)])
                .args(["--dial-timeout", "1s", "--command-timeout", "2s"])
                .args(["endpoint", "health"])
                .env("ETCDCTL_API", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            if start.elapsed() >= limit {
                let tails: Vec<String> = (self.members.iter())
                    .map(|m| {
                        let log = self.dir.join(format!("{}.log", m.name));
                        let text = std::fs::read_to_string(log).unwrap_or_default();
                        let last: Vec<&str> = text.lines().rev().take(3).collect();
                        format!("{}: {}", m.name, last.join(" | "))
                    })
                    .collect();
                anyhow::bail!(
                    "etcd did not become healthy within {limit:?}; the members' last log lines:\n{}",
                    tails.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills member `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data.
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.spawn(i)
    }

    /// Kills every member.
    pub fn stop_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// Starts every stopped member again and waits until the cluster answers.
    pub fn start_all(&mut self) -> anyhow::Result<()> {
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                self.spawn(i)?;
            }
        }
        self.wait_healthy(Duration::from_secs(30))
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}
