//! The book's "Running the pieces by hand" (the section under that heading in
//! `docs/src/running-by-hand.md`), run as written on loopback: every command of the section's
//! shell blocks, in order, with the real `edl-ps` and `edlctl` binaries. Each `10.0.0.N:PORT`
//! becomes a loopback port of its own, a server's `--listen 0.0.0.0:PORT` the address the
//! others are told, and `/etc/edl` a temporary directory. A training `edl-worker` is this
//! package's client library under the command's certificate (this package's tests do not build
//! `edl-worker`, nor does every machine hold the data set); the evaluator is left out. The
//! checks are what the section's comments promise: the job forms with the coordinator's
//! `--shards`, the worker is admitted, and the shards end as the growing block says.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use edl_shared::Role;
use edl_shared::pki::{PkiDir, load_identity};
use edl_shared::transport::TransportSettings;
use edl_worker::{ClientConfig, Job, Session};

/// How long the job has to form and admit the worker.
const FORM: Duration = Duration::from_secs(60);

/// A server process, killed when dropped.
struct Proc {
    name: String,
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The book's chapter that holds the section.
const CHAPTER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../docs/src/running-by-hand.md"
);

/// The section's text, up to the next section.
fn section() -> String {
    let chapter = std::fs::read_to_string(CHAPTER).expect("reads docs/src/running-by-hand.md");
    edl_shared::docgen::section(&chapter, "Running the pieces by hand")
        .expect("the section is in docs/src/running-by-hand.md")
        .to_string()
}

/// The commands of the section's `sh` blocks, in order, as words: continued lines joined,
/// comments dropped.
fn commands(section: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut line = String::new();
    for l in section.lines() {
        if !in_block {
            in_block = l.trim() == "```sh";
            continue;
        }
        if l.trim() == "```" {
            in_block = false;
            continue;
        }
        let l = match l.find(" #") {
            Some(i) => &l[..i],
            None => l,
        };
        let l = l.trim_end();
        match l.strip_suffix('\\') {
            Some(more) => line.push_str(more),
            None => {
                line.push_str(l);
                let words: Vec<String> = line.split_whitespace().map(String::from).collect();
                if !words.is_empty() {
                    out.push(words);
                }
                line.clear();
            }
        }
    }
    out
}

/// The value after `flag` in `words`.
fn flag<'a>(words: &'a [String], flag: &str) -> Option<&'a str> {
    let i = words.iter().position(|w| w == flag)?;
    words.get(i + 1).map(String::as_str)
}

/// A loopback port free for both UDP (QUIC) and TCP (HTTP) just now.
fn free_port() -> u16 {
    loop {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("binds");
        let port = udp.local_addr().expect("address").port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// The section's commands made local: addresses, the state directory and `$P`.
struct Local {
    state: PathBuf,
    /// The coordinator's address as the section gives it to the others.
    coordinator: String,
    addrs: HashMap<String, String>,
    vars: HashMap<String, String>,
}

impl Local {
    fn addr(&mut self, remote: &str) -> String {
        self.addrs
            .entry(remote.to_string())
            .or_insert_with(|| format!("127.0.0.1:{}", free_port()))
            .clone()
    }

    /// `words` with every address, `/etc/edl` and `$VAR` made local.
    fn words(&mut self, words: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        for w in words {
            let mut w = w.clone();
            for (k, v) in &self.vars {
                w = w.replace(&format!("${k}"), v);
            }
            if let Some(rest) = w.strip_prefix("/etc/edl") {
                w = format!("{}{rest}", self.state.display());
            }
            if w.starts_with("10.0.0.") && w.contains(':') {
                w = self.addr(&w);
            }
            out.push(w);
        }
        // A server listens where the others are told to find it.
        let told = match (words[0].as_str(), words.get(1).map(String::as_str)) {
            ("edl-ps", Some("coordinator")) => Some(self.coordinator.clone()),
            ("edl-ps", Some("shard")) => flag(words, "--advertise").map(String::from),
            _ => None,
        };
        if let Some(told) = told {
            let at = self.addr(&told);
            let i = out.iter().position(|w| w == "--listen").expect("--listen");
            out[i + 1] = at;
        }
        out
    }
}

fn bin(name: &str) -> Command {
    Command::new(match name {
        "edl-ps" => env!("CARGO_BIN_EXE_edl-ps"),
        "edlctl" => env!("CARGO_BIN_EXE_edlctl"),
        other => panic!("the section runs {other}, which this test does not know"),
    })
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs a command to its end (within a minute), asserting success.
async fn run(words: &[String]) -> Output {
    let mut cmd = tokio::process::Command::from(bin(&words[0]));
    cmd.args(&words[1..])
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{} did not finish", words.join(" ")))
        .expect("runs");
    assert!(
        out.status.success(),
        "{}: {}\n{}",
        words.join(" "),
        text(&out.stderr),
        text(&out.stdout)
    );
    out
}

/// Joins the job as the worker an `edl-worker` command names, under the certificate it
/// names (or finds in its `--state-dir`, as `edl-worker` does).
async fn worker(words: &[String]) -> Session {
    let name = flag(words, "--name").expect("--name");
    let identity = match (
        flag(words, "--ca"),
        flag(words, "--cert"),
        flag(words, "--key"),
    ) {
        (Some(ca), Some(cert), Some(key)) => {
            load_identity(Path::new(ca), Path::new(cert), Path::new(key)).expect("loads")
        }
        _ => PkiDir::new(Path::new(flag(words, "--state-dir").expect("--state-dir")))
            .ensure(Role::Worker, name)
            .expect("an identity"),
    };
    assert_eq!(identity.name, name);
    let cfg = ClientConfig {
        coordinator: flag(words, "--coordinator").expect("--coordinator").into(),
        identity,
        settings: TransportSettings::default(),
    };
    let join = async { Job::connect(&cfg).await?.join().await };
    match tokio::time::timeout(FORM, join).await {
        Ok(session) => session.expect("joins"),
        Err(_) => panic!(
            "the job did not form: {} was not admitted within {FORM:?}",
            words.join(" ")
        ),
    }
}

/// Where an `edlctl` command's subcommand starts, past the global flags.
fn subcommand(words: &[String]) -> usize {
    let mut i = 1;
    while let Some(w) = words.get(i) {
        match w.as_str() {
            "--json" => i += 1,
            w if w.starts_with("--") => i += 2,
            _ => return i,
        }
    }
    panic!("no subcommand: {words:?}")
}

/// `edlctl shards`' row of shard `name`.
fn row<'a>(shards: &'a str, name: &str) -> &'a str {
    shards
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == name))
        .unwrap_or_else(|| panic!("no row for {name}:\n{shards}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_by_hand_walk_through_forms_a_job_and_reshapes_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let commands = commands(&section());
    let told: Vec<&str> = commands
        .iter()
        .filter_map(|c| flag(c, "--coordinator"))
        .collect();
    assert!(told.windows(2).all(|w| w[0] == w[1]), "{told:?}");
    let mut local = Local {
        state: dir.path().join("etc-edl"),
        coordinator: told.first().expect("a coordinator address").to_string(),
        addrs: HashMap::new(),
        vars: HashMap::new(),
    };
    let mut procs: Vec<Proc> = Vec::new();
    let mut sessions = Vec::new();
    let mut shards_wanted = None;
    let mut edlctl_base: Option<Vec<String>> = None;
    for remote in &commands {
        if let Some((var, value)) = remote[0].split_once('=')
            && remote.len() == 1
        {
            local.vars.insert(var.into(), value.into());
            continue;
        }
        let words = local.words(remote);
        match (words[0].as_str(), words.get(1).map(String::as_str)) {
            ("edl-ps", Some("ca")) => {
                run(&words).await;
            }
            ("edl-ps", Some(role @ ("coordinator" | "shard"))) => {
                if role == "coordinator" {
                    shards_wanted = flag(&words, "--shards").map(String::from);
                }
                let name = flag(&words, "--name").unwrap_or(role).to_string();
                let log =
                    std::fs::File::create(dir.path().join(format!("{name}.log"))).expect("log");
                let child = bin("edl-ps")
                    .args(&words[1..])
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("starts");
                procs.push(Proc {
                    name: name.clone(),
                    child,
                });
                // A shard started into a formed job joins before it is given keys: wait until
                // the coordinator lists it, as an operator would before `shard add`.
                if role == "shard"
                    && let Some(base) = &edlctl_base
                {
                    let deadline = Instant::now() + FORM;
                    loop {
                        let out = run(&[base.clone(), vec!["shards".into()]].concat()).await;
                        if text(&out.stdout).lines().any(|l| l.contains(&name)) {
                            break;
                        }
                        assert!(Instant::now() < deadline, "{name} never joined");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            ("edl-worker", _) if words.iter().any(|w| w == "--evaluate") => {}
            ("edl-worker", _) => sessions.push(worker(&words).await),
            ("edlctl", _) => {
                let sub = subcommand(&words);
                edlctl_base.get_or_insert_with(|| {
                    words[..sub]
                        .iter()
                        .filter(|w| *w != "--json")
                        .cloned()
                        .collect()
                });
                let out = run(&words).await;
                check(
                    &words[sub..],
                    &text(&out.stdout),
                    &procs,
                    shards_wanted.as_deref(),
                );
                if words[sub..].starts_with(&["shard".into(), "remove".into()]) {
                    let gone = &words[sub + 2];
                    let p = procs.iter_mut().find(|p| &p.name == gone).expect("started");
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while p.child.try_wait().expect("waits").is_none() {
                        assert!(Instant::now() < deadline, "{gone} did not exit");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            _ => panic!("the section runs {remote:?}, which this test does not know"),
        }
    }
    assert!(!sessions.is_empty(), "the section starts no worker");
    drop(sessions);
    drop(procs);
}

/// What an `edlctl` command's output must say, by the section's comments.
fn check(sub: &[String], out: &str, procs: &[Proc], shards: Option<&str>) {
    let shards = shards.expect("the coordinator was started first");
    match sub.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["status"] => {
            assert!(out.contains(&format!("{shards} active")), "{out}");
            let workers = out
                .lines()
                .find(|l| l.contains("active workers"))
                .expect("active workers");
            assert!(workers.contains(" 1 "), "{out}");
        }
        ["workers"] => assert!(row(out, "w0").contains("active"), "{out}"),
        ["checkpoint"] => {
            let v: serde_json::Value = serde_json::from_str(out).expect("JSON");
            let written = v.as_array().expect("an array");
            assert_eq!(written.len().to_string(), shards, "{out}");
            assert!(written.iter().all(|c| c["error"].is_null()), "{out}");
        }
        ["shards"] => {
            // After the growing block: s1 and s2 hold the keys, s0 is retired.
            assert!(row(out, "s0").contains("retired"), "{out}");
            for s in ["s1", "s2"] {
                assert!(row(out, s).contains("active"), "{out}");
            }
            assert!(procs.iter().any(|p| p.name == "s2"));
        }
        _ => {}
    }
}

#[test]
fn every_process_of_the_section_has_its_certificate_issued_first() {
    let mut issued: Vec<(String, String)> = Vec::new();
    for words in commands(&section()) {
        let get = |f: &str| flag(&words, f).map(String::from);
        match (words[0].as_str(), words.get(1).map(String::as_str)) {
            ("edl-ps", Some("ca")) if words[2] == "issue" => {
                issued.push((get("--role").expect("role"), get("--name").expect("name")));
            }
            ("edl-ps", Some(role @ ("shard" | "coordinator"))) => {
                let name = get("--name").unwrap_or_else(|| "coordinator".into());
                assert!(
                    issued.contains(&(role.into(), name.clone())),
                    "{role} {name} starts before `edl-ps ca issue` gives it a certificate"
                );
            }
            ("edl-worker", _) => {
                let name = get("--name").expect("name");
                let why = format!("worker {name} starts before its certificate is issued");
                assert!(issued.contains(&("worker".into(), name)), "{why}");
            }
            ("edlctl", _) => {
                let name = get("--name").unwrap_or_else(|| "edlctl".into());
                let why = format!("edlctl ({name}) runs before its certificate is issued");
                assert!(issued.contains(&("admin".into(), name)), "{why}");
            }
            _ => {}
        }
    }
}
