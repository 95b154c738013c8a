//! Seeing a running job: during a churn run (workers added, drained, killed), every process's
//! `/metrics` parses as Prometheus text and its counters move, the shards' ledger gauges at
//! the end match the report, and the coordinator's dashboard, loaded in headless Chromium,
//! shows numbers that change and the join, leave and death events (a screenshot is kept in
//! `target/tmp/dashboard.png`).

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use edl_deploy::ObserveConfig;
use edl_shared::shutdown::CancellationToken;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHURN: &str = r#"
[[event]]
at_s = 1.0
action = "add"
count = 2

[[event]]
at_s = 2.0
action = "drain"
worker = "w0"

[[event]]
at_s = 3.0
action = "kill"
worker = "w1"
"#;

/// GET `path` from `addr`: the status code and the body.
async fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut raw))
        .await
        .map_err(|_| std::io::Error::other("no answer in 10 s"))??;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("not HTTP: {raw:?}")))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
    // hyper answers a small body with Content-Length, never chunked here.
    Ok((code, body.to_string()))
}

/// A scrape, parsed: samples by `name{labels}`. Panics (naming the line) on anything that is
/// not the Prometheus/OpenMetrics text format.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut typed = std::collections::BTreeSet::new();
    let mut samples = BTreeMap::new();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "a scrape ends with # EOF");
    for line in &lines[..lines.len() - 1] {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            typed.insert(parts.next().expect("a name").to_string());
            let kind = parts.next().expect("a type");
            assert!(
                ["counter", "gauge", "histogram", "info", "unknown"].contains(&kind),
                "{line}"
            );
            continue;
        }
        if line.starts_with("# HELP ") || line.starts_with("# UNIT ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
        let name = series.split('{').next().expect("a name");
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "bad labels in {line:?}"
            );
        }
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "{line:?} has no # TYPE line");
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        samples.insert(series.to_string(), v);
    }
    samples
}

/// The sum of every sample of `name` (all label sets).
fn total(m: &BTreeMap<String, f64>, name: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name))
        .map(|(_, v)| v)
        .sum()
}

/// Scrapes every process whose metrics address is in `dir` (name → samples); processes that
/// do not answer (gone) are left out.
async fn scrape_all(dir: &Path) -> BTreeMap<String, BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e
            .file_name()
            .to_string_lossy()
            .trim_end_matches(".addr")
            .to_string();
        let Some(addr) = std::fs::read_to_string(e.path())
            .ok()
            .and_then(|a| a.trim().parse::<SocketAddr>().ok())
        else {
            continue;
        };
        if let Ok((200, body)) = get(addr, "/metrics").await {
            out.insert(name, parse_metrics(&body));
        }
    }
    out
}

/// Headless Chromium, if installed (required when `EDL_REQUIRE_CHROMIUM=1`).
fn chromium() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .filter_map(|b| {
            std::env::var_os("PATH")?
                .to_str()?
                .split(':')
                .map(|d| Path::new(d).join(b))
                .find(|p| p.is_file())
        })
        .next();
    if found.is_none() {
        edl_shared::skip::missing(
            "EDL_REQUIRE_CHROMIUM",
            "the browser part",
            "chromium",
            "apt-get install chromium",
        );
    }
    found
}

/// Chromium's flags for a headless, offline, sandbox-less (root in CI) run.
fn chromium_args(profile: &Path) -> Vec<String> {
    [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=3000",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("--user-data-dir={}", profile.display())])
    .collect()
}

/// Runs headless Chromium on `url` with `extra` flags; its stdout.
async fn chromium_on(chrome: &Path, profile: &Path, extra: &[String], url: &str) -> String {
    let out = tokio::process::Command::new(chrome)
        .args(chromium_args(profile))
        .args(extra)
        .arg(url)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("chromium answers within 60 s")
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The dashboard's DOM after its scripts ran for a while.
async fn dump_dom(chrome: &Path, profile: &Path, url: &str) -> String {
    chromium_on(chrome, profile, &["--dump-dom".to_string()], url).await
}

/// The text of the element with `id` in a dumped DOM.
fn text_of(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the dashboard"));
    let rest = &dom[at..];
    let start = rest.find('>').expect("a tag") + 1;
    let end = rest[start..].find('<').expect("an end") + start;
    rest[start..end].trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_dashboard_follow_a_churn_run() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let chrome = chromium();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = common::scenario_config(dir.path(), CHURN, 11, false, 2);
    cfg.epochs = 3;
    cfg.observe = ObserveConfig {
        http: Some("127.0.0.1:0".parse().expect("addr")),
        plot: Some(dir.path().join("plots")),
    };
    let state = cfg.state_dir.clone().expect("a state dir");
    let metrics_dir = state.join("metrics");
    let dashboard_file = state.join("dashboard.addr");
    let run = tokio::spawn({
        let cfg = cfg.clone();
        async move { edl_deploy::run(&cfg, CancellationToken::new()).await }
    });

    // The dashboard's address, once the coordinator is up.
    let begun = Instant::now();
    let dashboard: SocketAddr = loop {
        if let Some(a) = std::fs::read_to_string(&dashboard_file)
            .ok()
            .and_then(|a| a.trim().parse().ok())
        {
            break a;
        }
        assert!(
            begun.elapsed() < Duration::from_secs(60),
            "no dashboard address"
        );
        assert!(
            !run.is_finished(),
            "the run ended before its dashboard came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let status = || async move {
        let (code, body) = get(dashboard, "/api/status").await.expect("/api/status");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).expect("/api/status is JSON")
    };
    // First look: training has begun.
    loop {
        let st = status().await;
        if st["samples_done"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(
            begun.elapsed() < Duration::from_secs(60),
            "no training: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = scrape_all(&metrics_dir).await;
    let url = format!("http://{dashboard}/");
    let profile = dir.path().join("chromium");
    let early_dom = match &chrome {
        Some(c) => Some(dump_dom(c, &profile, &url).await),
        None => None,
    };
    // After the churn (the kill at 3 s and its lease of 1 s), look again.
    loop {
        let st = status().await;
        let dead = st["workers"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["state"] == "dead"));
        if dead || st["finished"] == true {
            break;
        }
        assert!(
            begun.elapsed() < Duration::from_secs(120),
            "no death seen: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let second = scrape_all(&metrics_dir).await;
    if let (Some(c), Some(early)) = (&chrome, &early_dom) {
        let late = dump_dom(c, &profile, &url).await;
        let done = |dom: &str| -> u64 {
            text_of(dom, "samples-done")
                .parse()
                .unwrap_or_else(|_| panic!("#samples-done is a number: {dom}"))
        };
        assert!(
            done(&late) > done(early),
            "the dashboard's sample count moves: {} then {}",
            done(early),
            done(&late)
        );
        for kind in ["ev-join", "ev-drain", "ev-leave", "ev-dead"] {
            assert!(late.contains(kind), "the dashboard lists a {kind} event");
        }
        assert!(text_of(&late, "rate") != "–", "the dashboard shows a rate");
        assert!(
            text_of(&late, "loss") != "–",
            "the dashboard shows the loss"
        );
        // The screenshot CI keeps.
        let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
        let flags = [
            format!("--screenshot={}", shot.display()),
            "--window-size=1280,1500".to_string(),
        ];
        chromium_on(c, &profile, &flags, &url).await;
        let png = std::fs::read(&shot).expect("a screenshot");
        assert_eq!(&png[1..4], b"PNG");
        eprintln!("dashboard screenshot: {}", shot.display());
    }

    // Every server answered both times, and its counters moved.
    for name in ["coordinator", "s0", "s1"] {
        let (a, b) = (&first[name], &second[name]);
        let (ra, rb) = (
            total(a, "edl_requests_total"),
            total(b, "edl_requests_total"),
        );
        assert!(rb > ra, "{name}: requests {ra} then {rb}");
    }
    for s in ["s0", "s1"] {
        let push = |m: &BTreeMap<String, f64>| m[r#"edl_requests_total{request="Push"}"#];
        assert!(push(&second[s]) > push(&first[s]), "{s} applies pushes");
        assert!(second[s]["edl_bytes_in_flight_budget"] > 0.0);
    }
    let c = &second["coordinator"];
    assert!(c["edl_samples_done"] > first["coordinator"]["edl_samples_done"]);
    assert!(c[r#"edl_membership_events{kind="join"}"#] >= 4.0, "{c:?}");
    assert_eq!(c[r#"edl_membership_events{kind="dead"}"#], 1.0);
    assert!(
        total(c, "edl_rescale_pause_seconds_count") >= 1.0,
        "a stall was measured"
    );
    // A worker's step counter moves while it trains.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let third = scrape_all(&metrics_dir).await;
    let stepped = second
        .iter()
        .filter(|(n, _)| n.starts_with('w'))
        .any(|(n, a)| {
            third
                .get(n)
                .is_some_and(|b| b["edl_worker_steps_total"] > a["edl_worker_steps_total"])
        });
    assert!(stepped, "a worker's step counter moves: {:?}", third.keys());

    // Once the job is finished (before the launcher stops the servers after its evaluation),
    // the shards' ledgers are final: they must say what the report says.
    loop {
        if status().await["finished"] == true {
            break;
        }
        assert!(
            begun.elapsed() < Duration::from_secs(300),
            "the job does not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let end = scrape_all(&metrics_dir).await;
    let report = run.await.expect("the run task").expect("the run succeeds");
    for s in ["s0", "s1"] {
        let m = end
            .get(s)
            .unwrap_or_else(|| panic!("{s} answered at the end"));
        for e in &report.epochs {
            let at = |name: &str| m[&format!("{name}{{epoch=\"{}\"}}", e.epoch)];
            assert_eq!(
                at("edl_ledger_applied"),
                cfg.train_samples as f64,
                "{s} epoch {}",
                e.epoch
            );
            assert!(at("edl_ledger_applied") >= e.samples as f64);
            assert!(at("edl_ledger_duplicates") <= e.duplicates as f64);
            assert!(at("edl_ledger_missing") <= e.missing as f64);
            assert_eq!(at("edl_ledger_duplicates"), 0.0);
            assert_eq!(at("edl_ledger_missing"), 0.0);
        }
    }
    let coord = &end["coordinator"];
    for e in &report.epochs {
        let samples = coord[&format!("edl_epoch_samples{{epoch=\"{}\"}}", e.epoch)];
        assert_eq!(samples, e.reported_samples as f64, "epoch {}", e.epoch);
        for (direction, bytes) in [("pushed", e.bytes_pushed), ("pulled", e.bytes_pulled)] {
            let key = format!(
                "edl_epoch_bytes{{epoch=\"{}\",direction=\"{direction}\"}}",
                e.epoch
            );
            assert_eq!(coord[&key], bytes as f64, "{key}");
            assert!(bytes > 0, "{key}");
        }
    }
    assert!(
        dir.path().join("plots").join("run.png").is_file(),
        "--plot drew run.png"
    );
}
