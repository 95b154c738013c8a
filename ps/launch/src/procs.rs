//! Child processes of the launcher: started with their output in a log file, watched without
//! blocking, and stopped with SIGTERM first and SIGKILL only when they do not listen.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use edl_shared::transport::{DATAGRAM_ENV, LOOPBACK_DATAGRAM};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// How many bytes at the end of a log are read to show its last lines in an error.
const TAIL_BYTES: u64 = 16 * 1024;

/// How a child should be started.
#[derive(Clone, Debug, Default)]
pub struct Spawn {
    /// A short name for messages, such as `s0` or `coordinator`.
    pub name: String,
    /// The program to run.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// The file that receives its stderr (and its stdout unless `capture_stdout`).
    pub log: PathBuf,
    /// Pipe stdout to the launcher instead of the log, for children that print a result.
    pub capture_stdout: bool,
    /// Variables added to the launcher's environment.
    pub env: Vec<(String, OsString)>,
    /// The working directory; `None`: the launcher's.
    pub dir: Option<PathBuf>,
}

/// A running (or finished) child process and where its output goes.
#[derive(Debug)]
pub struct Proc {
    name: String,
    log: PathBuf,
    child: Child,
    exited: Option<ExitStatus>,
}

/// How [`Proc::terminate`] ended a child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// It had already exited with this status before it was asked to stop.
    Before(ExitStatus),
    /// It exited with this status after SIGTERM.
    OnTerm(ExitStatus),
    /// It ignored SIGTERM for the whole grace period and was killed.
    Killed,
}

impl Proc {
    /// Starts a child with stdin closed and its output in `spec.log` (created or truncated).
    ///
    /// Children get `RUST_LOG=info` unless the launcher's own `RUST_LOG` is set, so their logs
    /// say what they did, and `NO_COLOR=1` so the log files hold no terminal escapes. The child
    /// is killed if its handle is dropped, so that a launcher that fails or is interrupted leaves
    /// nothing behind.
    pub fn spawn(spec: Spawn) -> anyhow::Result<Proc> {
        let log = File::create(&spec.log)
            .with_context(|| format!("cannot create log file {}", spec.log.display()))?;
        let stderr = log
            .try_clone()
            .with_context(|| format!("cannot reopen log file {}", spec.log.display()))?;
        let stdout = if spec.capture_stdout {
            Stdio::piped()
        } else {
            Stdio::from(log)
        };
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::from(stderr))
            .env("NO_COLOR", "1")
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        // Every process of a local run talks over loopback, which carries large datagrams.
        if std::env::var_os(DATAGRAM_ENV).is_none() {
            cmd.env(DATAGRAM_ENV, LOOPBACK_DATAGRAM.to_string());
        }
        cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
        if let Some(dir) = &spec.dir {
            cmd.current_dir(dir);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {} ({})", spec.name, spec.program.display()))?;
        Ok(Proc {
            name: spec.name,
            log: spec.log,
            child,
            exited: None,
        })
    }

    /// The child's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Lets the child run on after this handle (and the launcher) is gone: it is not killed
    /// on drop. Whoever takes it back watches it by its pid.
    pub fn detach(self) {
        // Forgetting the handle skips tokio's kill-on-drop; the child is reparented to init
        // when the launcher exits, which reaps it.
        std::mem::forget(self.child);
    }

    /// The child's log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The exit status if the child has exited, without waiting.
    pub fn try_exit(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        if self.exited.is_none() {
            self.exited = self
                .child
                .try_wait()
                .with_context(|| format!("cannot check on {}", self.name))?;
        }
        Ok(self.exited)
    }

    /// Waits until the child has written its listening address to `addr_file` (which it
    /// writes atomically, so a file that exists holds the whole address), checking every
    /// `poll`; fails if the child exits first or `limit` passes.
    pub async fn wait_for_addr(
        &mut self,
        addr_file: &Path,
        limit: Duration,
        poll: Duration,
    ) -> anyhow::Result<std::net::SocketAddr> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(text) = std::fs::read_to_string(addr_file) {
                return text.trim().parse().with_context(|| {
                    format!("{} holds {text:?}, not an address", addr_file.display())
                });
            }
            if let Some(status) = self.try_exit()? {
                bail!("{}", self.failure("exited before it was listening", status));
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{} did not write {} within {} s; its log is {}",
                    self.name,
                    addr_file.display(),
                    limit.as_secs(),
                    self.log.display()
                );
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Waits for the child to exit and collects what it printed on stdout (empty unless it was
    /// started with `capture_stdout`).
    pub async fn output(self) -> anyhow::Result<(ExitStatus, String)> {
        let name = self.name;
        let out = self
            .child
            .wait_with_output()
            .await
            .with_context(|| format!("cannot wait for {name}"))?;
        Ok((
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ))
    }

    /// Sends `signal` to the child unless it has already exited; returns whether it was sent.
    pub fn signal(&mut self, signal: Signal) -> anyhow::Result<bool> {
        if self.try_exit()?.is_some() {
            return Ok(false);
        }
        // A missing pid means tokio has already reaped the child.
        let Some(pid) = self.child.id() else {
            return Ok(false);
        };
        let pid = i32::try_from(pid).with_context(|| format!("pid {pid} out of range"))?;
        match kill(Pid::from_raw(pid), signal) {
            Ok(()) => Ok(true),
            // It exited between the check above and the signal.
            Err(nix::errno::Errno::ESRCH) => Ok(false),
            Err(e) => bail!("cannot send {signal} to {} (pid {pid}): {e}", self.name),
        }
    }

    /// Waits up to `limit` for the child to exit; `None` if it is still running then.
    pub async fn wait_exit(&mut self, limit: Duration) -> anyhow::Result<Option<ExitStatus>> {
        if let Some(status) = self.try_exit()? {
            return Ok(Some(status));
        }
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => {
                let status = status.with_context(|| format!("cannot wait for {}", self.name))?;
                self.exited = Some(status);
                Ok(Some(status))
            }
            Err(_) => Ok(None),
        }
    }

    /// Asks the child to stop with SIGTERM, waits up to `grace`, then kills it.
    pub async fn terminate(&mut self, grace: Duration) -> anyhow::Result<Stopped> {
        if let Some(status) = self.try_exit()? {
            return Ok(Stopped::Before(status));
        }
        // A missing pid means tokio has already reaped the child; waiting returns its status.
        if let Some(pid) = self.child.id() {
            let pid = i32::try_from(pid).with_context(|| format!("pid {pid} out of range"))?;
            match kill(Pid::from_raw(pid), Signal::SIGTERM) {
                // ESRCH: it exited between the check above and the signal; the wait below
                // collects its status.
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(e) => bail!("cannot send SIGTERM to {} (pid {pid}): {e}", self.name),
            }
        }
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => {
                let status = status.with_context(|| format!("cannot wait for {}", self.name))?;
                self.exited = Some(status);
                Ok(Stopped::OnTerm(status))
            }
            Err(_) => {
                self.child
                    .kill()
                    .await
                    .with_context(|| format!("cannot kill {}", self.name))?;
                self.exited = self.child.try_wait().ok().flatten();
                Ok(Stopped::Killed)
            }
        }
    }

    /// An error message for this child having stopped when it should not have; see
    /// [`failure_message`].
    pub fn failure(&self, what: &str, status: ExitStatus) -> String {
        failure_message(&self.name, &self.log, what, status)
    }
}

/// An error message for a child that stopped when it should not have: its status, its log file
/// and the last lines of that log, which usually say why.
pub fn failure_message(name: &str, log: &Path, what: &str, status: ExitStatus) -> String {
    let mut msg = format!("{name} {what} ({status}); its log is {}", log.display());
    match log_tail(log, 12) {
        Ok(tail) if !tail.is_empty() => {
            msg.push_str("; it ends with:\n    ");
            msg.push_str(&tail.join("\n    "));
        }
        Ok(_) => msg.push_str(" (empty)"),
        Err(e) => msg.push_str(&format!(" (unreadable: {e})")),
    }
    msg
}

/// The last `n` lines of a log file, reading only its end so that a large log costs little.
pub fn log_tail(path: &Path, n: usize) -> std::io::Result<Vec<String>> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let start = len.saturating_sub(TAIL_BYTES);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let mut lines: Vec<&str> = text.lines().collect();
    // A read that starts mid-file most likely starts mid-line; that fragment is dropped.
    if start > 0 && !lines.is_empty() {
        lines.remove(0);
    }
    let skip = lines.len().saturating_sub(n);
    Ok(lines[skip..].iter().map(|l| l.to_string()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(dir: &Path, name: &str, script: &str, capture_stdout: bool) -> Spawn {
        Spawn {
            name: name.into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            log: dir.join(format!("{name}.log")),
            capture_stdout,
            ..Spawn::default()
        }
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.log");
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, text).expect("write");
        let tail = log_tail(&path, 3).expect("tail");
        assert_eq!(tail, ["line 97", "line 98", "line 99"]);
    }

    #[test]
    fn log_tail_of_a_large_file_drops_the_partial_first_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("big.log");
        let text: String = (0..10_000).map(|i| format!("line {i:05}\n")).collect();
        std::fs::write(&path, text).expect("write");
        let tail = log_tail(&path, 100_000).expect("tail");
        assert!(
            tail.iter().all(|l| l.len() == "line 00000".len()),
            "{tail:?}"
        );
        assert_eq!(tail.last().map(String::as_str), Some("line 09999"));
    }

    #[tokio::test]
    async fn output_goes_to_the_log_and_failures_quote_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut p = Proc::spawn(sh(
            dir.path(),
            "bad",
            "echo out; echo err >&2; exit 3",
            false,
        ))
        .expect("spawn");
        let status = loop {
            if let Some(s) = p.try_exit().expect("try_exit") {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(status.code(), Some(3));
        let msg = p.failure("exited", status);
        assert!(msg.contains("bad.log"), "{msg}");
        assert!(msg.contains("out") && msg.contains("err"), "{msg}");
    }

    #[tokio::test]
    async fn captured_stdout_is_returned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = Proc::spawn(sh(
            dir.path(),
            "eval",
            "echo '{\"x\":1}'; echo log >&2",
            true,
        ))
        .expect("spawn");
        let (status, out) = p.output().await.expect("output");
        assert!(status.success());
        assert_eq!(out.trim(), "{\"x\":1}");
        let log = std::fs::read_to_string(dir.path().join("eval.log")).expect("log");
        assert_eq!(log.trim(), "log");
    }

    #[tokio::test]
    async fn terminate_uses_sigterm_then_kill() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut polite = Proc::spawn(sh(dir.path(), "polite", "sleep 30", false)).expect("spawn");
        let stopped = polite
            .terminate(Duration::from_secs(5))
            .await
            .expect("terminate");
        assert!(matches!(stopped, Stopped::OnTerm(_)), "{stopped:?}");

        let mut stubborn = Proc::spawn(sh(
            dir.path(),
            "stubborn",
            "trap '' TERM; while true; do sleep 0.05; done",
            false,
        ))
        .expect("spawn");
        // The shell needs a moment to install its trap before the signal is sent.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stopped = stubborn
            .terminate(Duration::from_millis(300))
            .await
            .expect("terminate");
        assert_eq!(stopped, Stopped::Killed);

        let mut victim = Proc::spawn(sh(dir.path(), "victim", "sleep 30", false)).expect("spawn");
        assert_eq!(
            victim
                .wait_exit(Duration::from_millis(50))
                .await
                .expect("wait"),
            None
        );
        assert!(victim.signal(Signal::SIGKILL).expect("signal"));
        let status = victim
            .wait_exit(Duration::from_secs(5))
            .await
            .expect("wait")
            .expect("exited");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
        assert!(
            !victim
                .signal(Signal::SIGTERM)
                .expect("no signal to the dead")
        );

        let mut done = Proc::spawn(sh(dir.path(), "done", "exit 0", false)).expect("spawn");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stopped = done
            .terminate(Duration::from_secs(1))
            .await
            .expect("terminate");
        assert!(
            matches!(stopped, Stopped::Before(s) if s.success()),
            "{stopped:?}"
        );
    }
}
