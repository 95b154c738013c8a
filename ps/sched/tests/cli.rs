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

/// Mean JCT (hours) that the published simulators give on the shipped traces: the Tiresias
/// simulator (SymbioticLab/Tiresias, `run_sim.py --scheme=count`, schedules `fifo` and
/// `dlas-gpu`) and the ElasticFlow artifact's (pkusys/ElasticFlow, `dlas-gpu` and `fifo`),
/// run on 2026-12-05 under Python 3 with the changes BENCHMARKS.md lists. Rows: trace, GPUs,
/// FIFO (both agree), Tiresias in the Tiresias simulator, Tiresias in ElasticFlow's.
const REFERENCE: [(&str, u32, f64, f64, f64); 5] = [
    ("195job.csv", 64, 17.8579, 11.8162, 11.8727),
    ("cluster01.csv", 64, 40.0489, 8.2812, 8.4045),
    ("cluster01.csv", 128, 5.6161, 4.3402, 4.3977),
    ("cluster10.csv", 64, 9.0905, 9.0905, 9.1008),
    ("cluster10.csv", 256, 9.0905, 9.0905, 9.1058),
];

/// The Tiresias simulator's `dlas-gpu-K` (starvation handling on, K = 2 and 8) on 64 GPUs.
const STARVATION: [(&str, &str, f64); 4] = [
    ("195job.csv", "2", 12.1749),
    ("195job.csv", "8", 12.1558),
    ("cluster01.csv", "2", 10.8472),
    ("cluster01.csv", "8", 13.2117),
];

/// Mean JCT in hours per policy from `edl-sim` on a shipped trace (no preemption cost, as
/// the references), with `extra` flags.
fn means(trace: &str, gpus: u32, extra: &[&str]) -> std::collections::BTreeMap<String, f64> {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("out.json");
    let path = format!("{}/traces/elasticflow/{trace}", env!("CARGO_MANIFEST_DIR"));
    let gpus = gpus.to_string();
    let mut args = vec![
        "--trace",
        &path,
        "--gpus",
        &gpus,
        "--restart-cost",
        "0",
        "--json",
        json.to_str().expect("path"),
    ];
    args.extend_from_slice(extra);
    let out = sim(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("valid");
    v["summary"]
        .as_array()
        .expect("summary")
        .iter()
        .map(|r| {
            let policy = r["policy"].as_str().expect("policy").to_string();
            (policy, r["mean_jct"].as_f64().expect("mean JCT") / 3600.0)
        })
        .collect()
}

#[test]
fn fifo_and_tiresias_match_the_published_simulators() {
    for (trace, gpus, fifo, tiresias, elasticflow) in REFERENCE {
        let m = means(trace, gpus, &["--policies", "fifo,tiresias"]);
        let (f, t) = (m["fifo"], m["tiresias"]);
        eprintln!(
            "{trace} on {gpus}: fifo {f:.4} h (reference {fifo}), tiresias {t:.4} h \
             (references {tiresias}, {elasticflow})"
        );
        assert!(
            (f / fifo - 1.0).abs() < 1e-3,
            "{trace} on {gpus}: fifo {f} h"
        );
        for r in [tiresias, elasticflow] {
            assert!(
                (t / r - 1.0).abs() <= 0.05,
                "{trace} on {gpus}: tiresias {t:.3} h against the reference's {r} h"
            );
        }
        // Waking up to demote when the Tiresias simulator does: its figure.
        let m = means(
            trace,
            gpus,
            &["--policies", "tiresias", "--las-reference-wakeups"],
        );
        let t = m["tiresias"];
        assert!(
            (t / tiresias - 1.0).abs() < 1e-3,
            "{trace} on {gpus}: tiresias with its wake-ups {t:.4} h against {tiresias} h"
        );
    }
    for (trace, k, want) in STARVATION {
        let m = means(
            trace,
            64,
            &[
                "--policies",
                "tiresias",
                "--las-reference-wakeups",
                "--las-starvation",
                k,
            ],
        );
        let t = m["tiresias"];
        assert!(
            (t / want - 1.0).abs() < 1e-3,
            "{trace}, starvation {k}: tiresias {t:.4} h against the reference's {want} h"
        );
    }
}

/// The book's reference pages of `edl-sched` and `edl-sim` are their `--help` texts
/// (`EDL_BLESS=1` rewrites them).
#[test]
fn the_reference_pages_of_edl_sched_and_edl_sim_are_current() {
    let programs = [
        (
            env!("CARGO_BIN_EXE_edl-sched"),
            "edl-sched",
            "The cluster scheduler: shares a cluster's slots among elastic jobs.",
        ),
        (
            env!("CARGO_BIN_EXE_edl-sim"),
            "edl-sim",
            "The cluster simulator: replays a trace under the scheduler's policies.",
        ),
    ];
    edl_shared::docgen::check_cli_pages(env!("CARGO_MANIFEST_DIR"), &programs)
        .unwrap_or_else(|e| panic!("{e}"));
}
