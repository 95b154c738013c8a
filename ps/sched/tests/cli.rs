//! `edl-sim` on a shipped ElasticFlow trace: a table, JSON with every policy, plots, and
//! clear errors for a wrong column or policy.

use std::process::Command;

fn sim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_edl-sim"))
        .args(args)
        .output()
        .expect("edl-sim runs")
}

const TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/elasticflow/195job.csv");

#[test]
fn a_shipped_trace_replays_under_every_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("out.json");
    let plots = dir.path().join("plots");
    let out = sim(&[
        "--trace",
        TRACE,
        "--gpus",
        "32",
        "--json",
        json.to_str().expect("path"),
        "--plots",
        plots.to_str().expect("path"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    for p in ["fifo", "tiresias", "elastic", "elastic+restart", "goodput"] {
        assert!(table.contains(p), "{table}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("valid");
    let rows = v["summary"].as_array().expect("summary");
    assert_eq!(rows.len(), 5);
    for r in rows {
        assert_eq!(r["jobs"], 195, "{r}");
        let util = r["utilization"].as_f64().expect("utilization");
        assert!(util > 0.0 && util <= 1.0, "{r}");
    }
    for png in ["jct.png", "cdf.png"] {
        assert!(std::fs::metadata(plots.join(png)).expect("plot").len() > 1000);
    }

    let bad = sim(&["--trace", TRACE, "--gpus-col", "gpus"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no column \"gpus\""));
    let bad = sim(&["--trace", TRACE, "--policies", "fifo,magic"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown policy \"magic\""));
}
