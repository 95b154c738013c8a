//! `edl-bench --quick` runs every subcommand, and `all` writes `BENCHMARKS.md`, its plots and
//! JSON with the fields scripts read. A check that the benchmarks run, not a measurement.
//!
//! tta needs Fashion-MNIST (Debian's `dataset-fashion-mnist`); without it the tta and `all`
//! checks say they were skipped, unless `EDL_REQUIRE_DATA=1` (set by CI) makes that a failure.
//! load starts `edl-ps` processes: from `EDL_BIN_DIR`, or built next to `edl-bench` first.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::Context;

use serde_json::Value;

/// One benchmark at a time: each starts clusters and measures with them.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `edl-bench --quick ARGS --json FILE` and returns the JSON it wrote.
fn bench(args: &[&str]) -> anyhow::Result<Value> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_edl-bench"))
        .arg("--quick")
        .arg("--json")
        .arg(&json)
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "edl-bench {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        !out.stdout.is_empty(),
        "edl-bench {args:?} printed no table"
    );
    Ok(serde_json::from_slice(&std::fs::read(&json)?)?)
}

/// Where `edl-bench load` finds `edl-ps`: `EDL_BIN_DIR`, or next to `edl-bench`, built there
/// first (testing this package alone does not build another package's binaries).
fn ps_bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("EDL_BIN_DIR") {
        return Ok(dir.into());
    }
    let bench = Path::new(env!("CARGO_BIN_EXE_edl-bench"));
    let dir = bench.parent().context("edl-bench has no directory")?;
    let mut cargo = Command::new(env!("CARGO"));
    // Not the variables cargo set for this test (its package's manifest, name and version...):
    // build scripts that watch them would see a change and rebuild, and the next `cargo test`
    // would rebuild their crates again for minutes.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let set_for_the_test = [
            "CARGO_MANIFEST_",
            "CARGO_PKG_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
        ]
        .iter()
        .any(|p| key.starts_with(p))
            || matches!(
                &*key,
                "CARGO_TARGET_TMPDIR"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            );
        if set_for_the_test {
            cargo.env_remove(&*key);
        }
    }
    cargo
        .args([
            "build",
            "--quiet",
            "-p",
            "edl-ps",
            "--bin",
            "edl-ps",
            "--manifest-path",
        ])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml"));
    if dir.ends_with("release") {
        cargo.arg("--release");
    }
    let status = cargo.status()?;
    anyhow::ensure!(status.success(), "building edl-ps failed ({status})");
    anyhow::ensure!(
        dir.join("edl-ps").is_file(),
        "no edl-ps in {}",
        dir.display()
    );
    Ok(dir.to_path_buf())
}

fn num(v: &Value, field: &str) -> f64 {
    v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{field} is not a number in {v}"))
}

fn check_scale(v: &Value) {
    let rows = v["rows"].as_array().expect("rows");
    assert!(!rows.is_empty());
    for r in rows {
        assert!(num(r, "steps_per_s") > 0.0, "{r}");
        assert!(num(r, "gbit_s") > 0.0, "{r}");
        assert!(num(r, "efficiency") > 0.0, "{r}");
        assert!(r["saturated"].is_boolean(), "{r}");
        assert!(["dense", "sparse"].contains(&r["mode"].as_str().expect("mode")));
    }
    // Every series' first point is its own baseline.
    for r in rows.iter().filter(|r| r["workers"] == 1) {
        assert!((num(r, "efficiency") - 1.0).abs() < 1e-9, "{r}");
    }
    let ceilings = v["ceilings"].as_array().expect("ceilings");
    assert!(!ceilings.is_empty());
    assert!(ceilings.iter().all(|c| num(c, "steps_per_s") > 0.0));
}

fn check_elastic(v: &Value) {
    let runs = v["runs"].as_array().expect("runs");
    let modes: Vec<&str> = runs
        .iter()
        .map(|r| r["membership"].as_str().expect("membership"))
        .collect();
    assert_eq!(modes, ["stop-free", "restart"]);
    for run in runs {
        let events = run["events"].as_array().expect("events");
        let kinds: Vec<&str> = events
            .iter()
            .map(|e| e["kind"].as_str().expect("kind"))
            .collect();
        assert_eq!(kinds, ["join", "leave"], "{run}");
        // Every change got its costs from the trace.
        for e in events {
            assert!(e["stall_ms"].is_number(), "{e}");
        }
        assert!(events[0]["join_ms"].as_f64().expect("join_ms") > 0.0);
        assert_eq!(run["summary"].as_array().expect("summary").len(), 2);
    }
    // A restart stops everyone: its stall covers the new workers' start.
    let restart_join = &runs[1]["events"][0];
    assert!(restart_join["restart"].is_array(), "{restart_join}");
}

fn check_tta(v: &Value) {
    assert_eq!(num(v, "target"), 0.85);
    assert_eq!(v["model"], "MLP 784-256-128-10", "{}", v["model"]);
    let runs = v["runs"].as_array().expect("runs");
    assert!(!runs.is_empty());
    for r in runs {
        let curve = r["curve"].as_array().expect("curve");
        assert!(!curve.is_empty(), "{r}");
        assert!(
            num(r, "best_accuracy") > 0.5,
            "a quick run learns something: {r}"
        );
        assert!(r.get("tta_s").is_some(), "{r}");
    }
    assert!(!v["summary"].as_array().expect("summary").is_empty());
}

#[test]
fn scale_runs() -> anyhow::Result<()> {
    check_scale(&bench(&["scale"])?);
    Ok(())
}

#[test]
fn elastic_runs() -> anyhow::Result<()> {
    check_elastic(&bench(&["elastic"])?);
    Ok(())
}

#[test]
fn tta_runs() -> anyhow::Result<()> {
    if edl_testkit::have_fashion_mnist() {
        check_tta(&bench(&["tta"])?);
    }
    Ok(())
}

/// `tta --job` trains a job file's model on its data: the sparse LR on agaricus (in the
/// repository) reaches its target, and bf16 halves what it pushes.
#[test]
fn tta_runs_a_job_file() -> anyhow::Result<()> {
    let job = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/jobs/agaricus-logreg.toml");
    let job = job.to_str().context("a UTF-8 path")?;
    let v = bench(&[
        "tta",
        "--job",
        job,
        "--target",
        "0.99",
        "--wire",
        "f32,bf16",
        "--snapshot-ms",
        "10",
    ])?;
    assert_eq!(
        v["model"], "logistic regression over 126 features (agaricus.txt.train)",
        "{v}"
    );
    assert_eq!(num(&v, "train_samples"), 6513.0, "the file's samples: {v}");
    let cells = v["summary"].as_array().context("summary")?;
    let pushed = |wire: &str| {
        let c = cells.iter().find(|c| c["wire"] == wire);
        num(c.expect("a cell per wire"), "pushed_per_sample")
    };
    for c in cells {
        assert_eq!(
            num(c, "reached"),
            1.0,
            "an epoch of agaricus reaches 0.99: {c}"
        );
    }
    assert!(
        pushed("bf16") > 0.0 && pushed("f32") >= 1.9 * pushed("bf16"),
        "{v}"
    );
    Ok(())
}

/// A few clients against real server processes for a moment, with and without the hostile
/// client: pushes happen, and every acknowledged push is in the counter.
#[test]
fn load_runs_and_loses_nothing() -> anyhow::Result<()> {
    let bins = ps_bin_dir()?;
    let bins = bins.to_str().context("a UTF-8 binary directory")?;
    let common = [
        "load",
        "--clients",
        "4",
        "--seconds",
        "3",
        "--bin-dir",
        bins,
    ];
    for hostile in [false, true] {
        let mut args = common.to_vec();
        if hostile {
            args.push("--hostile");
        }
        let v = bench(&args)?;
        let check = &v["check"];
        assert_eq!(num(check, "lost_updates"), 0.0, "{v}");
        assert_eq!(num(check, "extra_updates"), 0.0, "{v}");
        assert!(
            num(check, "acknowledged") > 0.0,
            "no push acknowledged: {v}"
        );
        assert_eq!(num(&v, "clients_running"), 4.0, "{v}");
        let push = v["ops"]
            .as_array()
            .and_then(|ops| ops.iter().find(|o| o["op"] == "push"))
            .expect("push figures");
        assert!(num(push, "per_s") > 0.0, "{push}");
        assert!(num(push, "p99_us") >= num(push, "p50_us"), "{push}");
        let servers = v["servers"].as_array().expect("servers");
        assert_eq!(servers.len(), 3, "a coordinator and two shards: {v}");
        for s in servers {
            assert!(num(s, "rss_peak_kib") > 0.0, "{s}");
        }
        if hostile {
            let h = &v["hostile"];
            assert!(num(h, "frames_sent") > 0.0, "{h}");
            assert!(num(h, "idle_opened") > 0.0, "{h}");
        } else {
            assert!(v["hostile"].is_null(), "{v}");
        }
    }
    Ok(())
}

/// The coordinator's commits with each store for a moment: every store measured commits, the
/// ratios are against `none`, and the log's writes were counted.
#[test]
fn control_runs() -> anyhow::Result<()> {
    let v = bench(&["control", "--workers", "1,2"])?;
    let rows = v["rows"].as_array().expect("rows");
    let stores: Vec<&str> = rows
        .iter()
        .map(|r| r["store"].as_str().expect("store"))
        .collect();
    // etcd is measured only where it is installed (or given); it is said when it was not.
    let etcd = stores.contains(&"etcd");
    let per_k: &[&str] = if etcd {
        &["none", "wal", "etcd"]
    } else {
        &["none", "wal"]
    };
    assert_eq!(stores, [per_k, per_k].concat(), "{v}");
    assert_eq!(v["etcd"].is_string(), etcd, "{v}");
    assert_eq!(v["skipped"].as_array().expect("skipped").is_empty(), etcd);
    for r in rows {
        assert!(num(r, "commits_per_s") > 0.0, "{r}");
        assert!(num(r, "commit_p99_us") >= num(r, "commit_p50_us"), "{r}");
        assert!(num(r, "step_p50_us") > 0.0, "{r}");
        if r["store"] == "none" {
            assert!((num(r, "vs_none") - 1.0).abs() < 1e-9, "{r}");
            assert!(r["writes_per_s"].is_null(), "{r}");
        } else {
            assert!(num(r, "writes_per_s") > 0.0, "{r}");
            assert!(num(r, "commits_per_write") > 0.0, "{r}");
        }
    }
    assert!(num(&v["probe"], "p50_us") > 0.0, "{v}");
    Ok(())
}

/// Kills of the coordinator while workers train: every kill has a failover time, the workers
/// all went on after each (or the run fails), and the median and maximum are of those times.
#[test]
fn failover_runs() -> anyhow::Result<()> {
    let bins = ps_bin_dir()?;
    let bins = bins.to_str().context("a UTF-8 binary directory")?;
    let mut stores = vec!["wal"];
    if edl_testkit::etcd::have_etcd() {
        stores.push("etcd");
    }
    for store in stores {
        let v = bench(&["failover", "--store", store, "--bin-dir", bins])?;
        let times: Vec<f64> = v["failover_ms"]
            .as_array()
            .expect("failover_ms")
            .iter()
            .map(|t| t.as_f64().expect("ms"))
            .collect();
        assert_eq!(times.len(), 2, "{v}");
        assert!(times.iter().all(|&t| t > 0.0), "{v}");
        let max = times.iter().copied().fold(0.0, f64::max);
        assert_eq!(num(&v, "max_ms"), max, "{v}");
        assert!(num(&v, "median_ms") <= max, "{v}");
        assert!(num(&v, "commits") > 0.0, "{v}");
    }
    Ok(())
}

#[test]
fn transport_and_apply_run() -> anyhow::Result<()> {
    let t = bench(&["transport", "--sizes", "4K", "--points", "1x1"])?;
    let systems = |t: &Value| -> Vec<String> {
        t["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|r| r["system"].as_str().expect("system").to_string())
            .collect()
    };
    assert_eq!(systems(&t), ["edl", "edl-noopt", "quinn", "tcp"]);
    assert_eq!(t["ratios"].as_array().expect("ratios").len(), 1);
    // Bare quinn striped over two streams or two connections, on request.
    let args = [
        "transport",
        "--sizes",
        "64K",
        "--points",
        "1x1",
        "--systems",
    ];
    let striped = bench(&[&args[..], &["quinn-2streams,quinn-2conns"]].concat())?;
    assert_eq!(systems(&striped), ["quinn-2streams", "quinn-2conns"]);
    let wrong = bench(&[&args[..], &["quic"]].concat()).expect_err("an unknown system");
    assert!(
        wrong.to_string().contains("unknown system \"quic\""),
        "{wrong}"
    );
    let a = bench(&["apply"])?;
    let names: Vec<&str> = a
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|r| r["optimizer"].as_str())
        .collect();
    for kind in [
        "sgd", "momentum", "adam", "adamw", "adagrad", "rmsprop", "adadelta",
    ] {
        assert!(names.contains(&kind), "{kind} missing from {names:?}");
    }
    Ok(())
}

#[test]
fn all_writes_the_report_and_plots() -> anyhow::Result<()> {
    if !edl_testkit::have_fashion_mnist() {
        return Ok(());
    }
    let out = tempfile::tempdir()?;
    let out_arg = out.path().to_str().expect("utf-8 temp path");
    let v = bench(&["all", "--out", out_arg])?;
    for field in [
        "machine",
        "transport_default",
        "transport_loopback",
        "apply",
        "scale",
        "elastic",
        "tta",
    ] {
        assert!(v.get(field).is_some(), "{field} missing");
    }
    check_scale(&v["scale"]);
    check_elastic(&v["elastic"]);
    check_tta(&v["tta"]);
    let md = std::fs::read_to_string(out.path().join("BENCHMARKS.md"))?;
    for heading in [
        "## Method",
        "## Transport",
        "## Optimizer apply",
        "## Scaling",
        "## Elasticity",
        "## Time to accuracy",
        "## Load",
    ] {
        assert!(md.contains(heading), "BENCHMARKS.md lacks {heading}");
    }
    for plot in ["transport", "scale", "tta"] {
        let png = std::fs::read(out.path().join(format!("benches/plots/{plot}.png")))?;
        assert!(png.starts_with(b"\x89PNG"), "{plot}.png is not a PNG");
        assert!(md.contains(&format!("benches/plots/{plot}.png")));
    }
    Ok(())
}
