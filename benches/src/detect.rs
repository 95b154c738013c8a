//! `edl-bench detect`: how quick and how right the coordinator's detectors are, with real
//! processes (`edl-local`: a coordinator, 2 shards and 3 workers on this machine):
//!
//! - **false flags**: runs of identical workers (the MLP under ASP, SSP(2) and BSP, and the
//!   sparse logistic regression under ASP), every other run beside CPU hogs; every straggler
//!   flag is a false one;
//! - **slowdowns**: one worker slowed 1.5x, 2x or 3x (the test aid `slow`) once the job is
//!   warm: seconds from the slowdown to the flag;
//! - **deaths**: one worker SIGKILLed (seconds to being declared dead, and how it was found)
//!   and another SIGSTOPped for 2 s (never to be declared dead).

use std::path::{Path, PathBuf};
use std::time::Duration;

use edl_deploy::{LocalConfig, Report, Scenario, ScenarioFile};
use edl_shared::jobfile::defaults;
use edl_shared::proto::{Consistency, StragglerSettings};
use edl_shared::shutdown::CancellationToken;
use edl_testkit::tenants::{Hogs, logreg_job};
use serde::Serialize;

use edl_deploy::costs::median;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Runs of identical workers.
    pub runs: usize,
    /// Slowdown factors to detect.
    pub factors: Vec<f64>,
    /// Runs per factor.
    pub slow_runs: usize,
    /// Runs that kill one worker and pause another.
    pub death_runs: usize,
    /// Fashion-MNIST.
    pub data_dir: PathBuf,
    /// Where `edl-ps` and `edl-worker` are (default: next to this program).
    pub bin_dir: Option<PathBuf>,
}

impl Plan {
    /// 20 identical runs, 3 runs of each of 1.5x, 2x and 3x, 5 deaths (2, 1 and 1 with
    /// `quick`).
    pub fn standard(quick: bool, data_dir: PathBuf) -> Plan {
        Plan {
            runs: if quick { 2 } else { 20 },
            factors: vec![1.5, 2.0, 3.0],
            slow_runs: if quick { 1 } else { 3 },
            death_runs: if quick { 1 } else { 5 },
            data_dir,
            bin_dir: None,
        }
    }
}

/// One run of identical workers.
#[derive(Clone, Debug, Serialize)]
pub struct Identical {
    /// The model and consistency.
    pub workload: String,
    /// CPU hogs beside the job.
    pub hogs: usize,
    /// Seconds of training.
    pub train_s: f64,
    /// The workers flagged, and when (all false flags).
    pub flags: Vec<String>,
}

/// One slowdown run.
#[derive(Clone, Debug, Serialize)]
pub struct Slowed {
    /// How much slower the worker was made.
    pub factor: f64,
    /// Seconds from the slowdown to the flag (`None`: never flagged).
    pub detect_s: Option<f64>,
    /// Flags of workers that were not slowed.
    pub false_flags: usize,
}

/// One death run.
#[derive(Clone, Debug, Serialize)]
pub struct Death {
    /// Seconds from SIGKILL to the declaration of death.
    pub detect_s: Option<f64>,
    /// How it was found (the event's detail).
    pub how: String,
    /// The worker stopped for 2 s was declared dead (wrongly).
    pub paused_declared_dead: bool,
}

/// Everything measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// The detector's settings (the defaults).
    pub settings: String,
    /// Identical runs.
    pub identical: Vec<Identical>,
    /// Slowdown runs.
    pub slowed: Vec<Slowed>,
    /// Death runs.
    pub deaths: Vec<Death>,
}

/// A run of the default MLP on Fashion-MNIST: 2 shards, 3 workers, 6 epochs (about 15 s of
/// training in a release build on 2 cores).
fn config(plan: &Plan, dir: &Path, consistency: Consistency) -> LocalConfig {
    LocalConfig {
        shards: 2,
        workers: 3,
        epochs: 6,
        consistency,
        optimizer: defaults::OPTIMIZER,
        schedule: Default::default(),
        batch_size: defaults::BATCH_SIZE,
        train_samples: defaults::SAMPLES,
        lease_ms: defaults::LEASE_MS,
        replicas: None,
        wire: None,
        layers: vec![784, 256, 128, 10],
        seed: defaults::SEED,
        data_dir: plan.data_dir.clone(),
        job: None,
        report: None,
        trace: None,
        state_dir: Some(dir.join("state")),
        bin_dir: plan.bin_dir.clone(),
        progress_bar: false,
        stall_timeout: Some(Duration::from_secs(120)),
        scenario: None,
        restart_on_change: false,
        elastic: Default::default(),
        observe: Default::default(),
    }
}

fn with_scenario(mut cfg: LocalConfig, dir: &Path, text: &str) -> anyhow::Result<LocalConfig> {
    let path = dir.join("scenario.toml");
    std::fs::write(&path, text)?;
    cfg.scenario = Some(ScenarioFile {
        scenario: Scenario::parse(text, cfg.workers, cfg.shards)?,
        path,
    });
    Ok(cfg)
}

async fn run_one(cfg: &LocalConfig) -> anyhow::Result<Report> {
    let r = edl_deploy::run(cfg, CancellationToken::new()).await?;
    anyhow::ensure!(r.finished, "the run did not finish: {r}");
    Ok(r)
}

/// Runs the plan, printing a line per run to stderr.
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    let workloads: [(&str, Option<Consistency>); 4] = [
        ("mlp asp", Some(Consistency::Asp)),
        ("mlp ssp:2", Some(Consistency::Ssp { staleness: 2 })),
        ("mlp bsp", Some(Consistency::Bsp)),
        ("logreg asp", None),
    ];
    let mut identical = Vec::new();
    for i in 0..plan.runs {
        let (workload, consistency) = workloads[i % workloads.len()];
        let hogs = if (i / workloads.len()) % 2 == 1 { 2 } else { 0 };
        let dir = tempfile::tempdir()?;
        let mut cfg = config(plan, dir.path(), consistency.unwrap_or(Consistency::Asp));
        if consistency.is_none() {
            cfg.job = Some(logreg_job(dir.path(), 60)?);
        }
        let _hogs = Hogs::start(hogs);
        let r = run_one(&cfg).await?;
        let flags: Vec<String> = r
            .elastic
            .stragglers
            .iter()
            .map(|s| format!("{} at {:.1} s", s.worker, s.flagged_ms as f64 / 1000.0))
            .collect();
        eprintln!(
            "detect: identical {}/{} ({workload}, {hogs} hogs): {:.1} s, flags {flags:?}",
            i + 1,
            plan.runs,
            r.train_wall_s
        );
        identical.push(Identical {
            workload: workload.into(),
            hogs,
            train_s: r.train_wall_s,
            flags,
        });
    }
    let mut slowed = Vec::new();
    for &factor in &plan.factors {
        for i in 0..plan.slow_runs {
            let dir = tempfile::tempdir()?;
            let text = format!(
                "[[event]]\nat_s = 5.0\naction = \"slow\"\nworker = \"w1\"\nfactor = {factor}\n"
            );
            let cfg = with_scenario(
                config(plan, dir.path(), Consistency::Asp),
                dir.path(),
                &text,
            )?;
            let r = run_one(&cfg).await?;
            let mine = r.elastic.stragglers.iter().find(|s| s.worker == "w1");
            let detect_s = mine.and_then(|s| s.detect_s);
            let false_flags = r
                .elastic
                .stragglers
                .iter()
                .filter(|s| s.worker != "w1")
                .count();
            eprintln!(
                "detect: slowed {factor}x {}/{}: flagged after {detect_s:?} s, {false_flags} \
                 other flags",
                i + 1,
                plan.slow_runs
            );
            slowed.push(Slowed {
                factor,
                detect_s,
                false_flags,
            });
        }
    }
    let mut deaths = Vec::new();
    for i in 0..plan.death_runs {
        let dir = tempfile::tempdir()?;
        let text = "[[event]]\nat_s = 4.0\naction = \"kill\"\nworker = \"w1\"\n\n[[event]]\n\
                    at_s = 6.0\naction = \"pause\"\nworker = \"w2\"\nfor_s = 2.0\n";
        let cfg = with_scenario(config(plan, dir.path(), Consistency::Asp), dir.path(), text)?;
        let r = run_one(&cfg).await?;
        let d = r.elastic.deaths.first();
        let death = Death {
            detect_s: d.and_then(|d| d.detect_s),
            how: d.map_or_else(|| "no kill".into(), |d| d.how.clone()),
            paused_declared_dead: r
                .elastic
                .pauses
                .iter()
                .any(|p| p.declared_dead_ms.is_some()),
        };
        eprintln!(
            "detect: death {}/{}: {:?} s ({}), paused declared dead: {}",
            i + 1,
            plan.death_runs,
            death.detect_s,
            death.how,
            death.paused_declared_dead
        );
        deaths.push(death);
    }
    let s = StragglerSettings::default();
    Ok(Results {
        settings: format!(
            "factor {}x, window {} ms, minimum gap {} ms, warm-up {} ms, confirmed over {} ms; \
             lease {} ms, probe after 250 ms of silence",
            s.factor,
            s.window_ms,
            s.min_gap_ms,
            s.warmup_ms,
            s.confirm().as_millis(),
            defaults::LEASE_MS
        ),
        identical,
        slowed,
        deaths,
    })
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}"))
}

/// The results as text tables.
pub fn table(r: &Results) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "settings: {}", r.settings);
    let _ = writeln!(
        out,
        "\nfalse flags: identical workers (3 workers, 2 shards and the coordinator on this \
         machine; every other round beside 2 CPU hogs)"
    );
    let _ = writeln!(
        out,
        "{:<12} {:>5} {:>5} {:>16} {:>6}",
        "workload", "runs", "hogs", "training s (med)", "flags"
    );
    let mut workloads: Vec<&str> = r.identical.iter().map(|i| i.workload.as_str()).collect();
    workloads.sort_unstable();
    workloads.dedup();
    for w in workloads {
        for hogs in [0, 2] {
            let runs: Vec<&Identical> = r
                .identical
                .iter()
                .filter(|i| i.workload == w && i.hogs == hogs)
                .collect();
            if runs.is_empty() {
                continue;
            }
            let mut t: Vec<f64> = runs.iter().map(|i| i.train_s).collect();
            let flags: usize = runs.iter().map(|i| i.flags.len()).sum();
            let _ = writeln!(
                out,
                "{:<12} {:>5} {:>5} {:>16} {:>6}",
                w,
                runs.len(),
                hogs,
                secs(median(&mut t)),
                flags
            );
        }
    }
    let total: usize = r.identical.iter().map(|i| i.flags.len()).sum();
    let flagged = r.identical.iter().filter(|i| !i.flags.is_empty()).count();
    let _ = writeln!(
        out,
        "all: {} runs, {total} false flags, {flagged} runs with one",
        r.identical.len()
    );
    let _ = writeln!(
        out,
        "\nslowdowns: w1 of 3 workers (MLP, asp) slowed 5 s into training; seconds from the \
         slowdown to the flag"
    );
    let _ = writeln!(
        out,
        "{:<7} {:>5} {:>8} {:>8} {:>7} {:>12}",
        "factor", "runs", "median", "max", "missed", "other flags"
    );
    let mut factors: Vec<f64> = r.slowed.iter().map(|s| s.factor).collect();
    factors.dedup();
    for f in factors {
        let runs: Vec<&Slowed> = r.slowed.iter().filter(|s| s.factor == f).collect();
        let mut d: Vec<f64> = runs.iter().filter_map(|s| s.detect_s).collect();
        let missed = runs.len() - d.len();
        let max = d.iter().copied().reduce(f64::max);
        let med = median(&mut d);
        let _ = writeln!(
            out,
            "{:<7} {:>5} {:>8} {:>8} {:>7} {:>12}",
            format!("{f}x"),
            runs.len(),
            secs(med),
            secs(max),
            missed,
            runs.iter().map(|s| s.false_flags).sum::<usize>()
        );
    }
    let mut d: Vec<f64> = r.deaths.iter().filter_map(|d| d.detect_s).collect();
    let by_socket = r.deaths.iter().filter(|d| d.how.contains("socket")).count();
    let paused = r.deaths.iter().filter(|d| d.paused_declared_dead).count();
    let max = d.iter().copied().reduce(f64::max);
    let med = median(&mut d);
    let _ = writeln!(
        out,
        "\ndeaths: w1 SIGKILLed 4 s into training, w2 SIGSTOPped for 2 s at 6 s; seconds from \
         SIGKILL to the declaration"
    );
    let _ = writeln!(
        out,
        "{:>5} {:>8} {:>8} {:>10} {:>24}",
        "runs", "median", "max", "by socket", "paused declared dead"
    );
    let _ = writeln!(
        out,
        "{:>5} {:>8} {:>8} {:>10} {:>24}",
        r.deaths.len(),
        secs(med),
        secs(max),
        by_socket,
        paused
    );
    out
}
