//! `edl-sim`: replays a job trace against the scheduling policies and compares them: mean and
//! p99 job completion time, makespan, mean queueing delay and GPU utilization, as a table,
//! JSON and PNG plots.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use edl_sched::curves::Curves;
use edl_sched::policy;
use edl_sched::sim::{SimConfig, Summary, simulate};
use edl_sched::speed::Speedup;
use edl_sched::trace::{self, Columns};

/// Replay a job trace (CSV: submission time, GPU count, duration per job) on a cluster of
/// GPU slots under each scheduling policy.
#[derive(Parser, Debug)]
#[command(name = "edl-sim", version)]
struct Cli {
    /// The trace, e.g. ps/sched/traces/elasticflow/cluster01.csv (the other ElasticFlow
    /// clusters are in elasticflow-traces.tar.gz beside it); several, comma-separated, are
    /// replayed as one (merged by submission time).
    #[arg(long, value_delimiter = ',', required = true)]
    trace: Vec<PathBuf>,
    /// The column with the submission time in seconds.
    #[arg(long, default_value = "submission_time")]
    submit_col: String,
    /// The column with the GPU count.
    #[arg(long, default_value = "num_gpu")]
    gpus_col: String,
    /// The column with the duration in seconds (with the GPUs asked for).
    #[arg(long, default_value = "duration")]
    duration_col: String,
    /// GPU slots in the cluster.
    #[arg(long, default_value_t = 64)]
    gpus: u32,
    /// Only the first N jobs of the trace.
    #[arg(long)]
    jobs: Option<usize>,
    /// Policies to compare: fifo, tiresias, elastic, goodput; elastic+restart and
    /// goodput+restart are the same policies resizing by restart instead of stop-free, and
    /// `@F` sets an elastic policy's --max-factor for that row (elastic@1 never grows a job
    /// past what it asked for: what is left of elastic's gain is removing head-of-line
    /// blocking).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fifo,tiresias,elastic,elastic+restart,goodput"
    )]
    policies: Vec<String>,
    /// How a job's speed grows with its GPUs: `measured` (each job's model and batch size in
    /// the measured tables, --curves; a job of another model or none gets the tables' typical
    /// curve), or one model for every job: `linear`, `amdahl:S` (serial fraction S), or a
    /// curve from `edlctl profile --out FILE` given as `curve:FILE`.
    #[arg(long, default_value = "measured")]
    speedup: String,
    /// Measured throughput tables for `--speedup measured`: a folder of MODEL.csv in the
    /// ElasticFlow artifact's format (a row per global batch size, a column per GPU count).
    /// Default: the built-in A100 tables of six models (ps/sched/curves/elasticflow-a100,
    /// derived from the ElasticFlow traces).
    #[arg(long, value_name = "DIR")]
    curves: Option<PathBuf>,
    /// The column with the model's name (`--speedup measured`; optional in the trace).
    #[arg(long, default_value = "model_name")]
    model_col: String,
    /// The column with the global batch size (optional in the trace).
    #[arg(long, default_value = "batch_size")]
    batch_col: String,
    /// Seconds a running job loses to a stop-free resize. Default: the largest stall a join
    /// or leave cost in EDL's elasticity benchmark (BENCHMARKS.md, 14 ms).
    #[arg(long, default_value_t = 0.014)]
    resize_cost: f64,
    /// Seconds a job loses to a restart (checkpoint, stop, start, restore): resuming after a
    /// preemption, and every resize of a `+restart` policy. Default: 30 s, an assumption for
    /// a real cluster (process start, CUDA and data loading); EDL's local restart baseline
    /// measured 0.4-0.7 s as a lower bound.
    #[arg(long, default_value_t = 30.0)]
    restart_cost: f64,
    /// Seconds from a job's first start until it trains (its servers' and workers' start). 0
    /// by default: a trace's durations hold their own start.
    #[arg(long, default_value_t = 0.0)]
    start_cost: f64,
    /// Seconds a stop-free growth's new workers take to start training (the job trains on at
    /// its old size meanwhile). 0 by default; under a second for an `edl-worker` process on
    /// one machine (the sim-to-real replay test measured 0.83 s), longer where a pod must
    /// start.
    #[arg(long, default_value_t = 0.0)]
    join_cost: f64,
    /// The least seconds between two resizes of a running job (`edl-sched`'s
    /// `resize_interval`).
    #[arg(long, default_value_t = 0.0)]
    min_interval: f64,
    /// An elastic job may use up to this many times the GPUs it asked for.
    #[arg(long, default_value_t = 2)]
    max_factor: u32,
    /// An elastic job needs at least this share of the GPUs it asked for (rounded up, at
    /// least one): 0 lets every job shrink to one GPU, 1 never below what it asked for.
    #[arg(long, default_value_t = 0.25)]
    min_share: f64,
    /// The most of a job's time its resizes may cost: a job is resized at most once per
    /// cost/overhead seconds.
    #[arg(long, default_value_t = 0.05)]
    overhead: f64,
    /// Tiresias: the attained GPU-seconds at which a job drops to the next queue, one limit
    /// per queue but the last. Default: the Tiresias simulator's (3 queues).
    #[arg(long, value_delimiter = ',', default_values_t = [3250.0, 7200.0])]
    las_limits: Vec<f64>,
    /// Tiresias: a waiting job of a lower queue goes back to the first once it has waited K
    /// times as long as it ran since it last entered it (the simulator's `dlas-gpu-K`); 0, the
    /// default, never (its `dlas-gpu`).
    #[arg(long, default_value_t = 0.0, value_name = "K")]
    las_starvation: f64,
    /// Tiresias: demote a running job when the Tiresias simulator would (its wake-ups are
    /// timed as if GPU-seconds were running seconds, so a multi-GPU job is demoted at the next
    /// decision after it crosses its limit) rather than as it crosses: for comparing with it.
    #[arg(long)]
    las_reference_wakeups: bool,
    /// Write the table and every job's outcome as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw `jct.png` (mean and p99 per policy) and `cdf.png` here.
    #[arg(long, value_name = "DIR")]
    plots: Option<PathBuf>,
}

/// The scaling model of `--speedup` and, for `measured`, the tables.
fn speedup(s: &str, curves: Option<&PathBuf>) -> anyhow::Result<(Speedup, Option<Arc<Curves>>)> {
    if s == "measured" {
        let c = match curves {
            Some(dir) => Curves::read_dir(dir)?,
            None => Curves::built_in(),
        };
        return Ok((c.typical().clone(), Some(Arc::new(c))));
    }
    anyhow::ensure!(
        curves.is_none(),
        "--curves goes with --speedup measured (not {s})"
    );
    one_model(s).map(|m| (m, None))
}

fn one_model(s: &str) -> anyhow::Result<Speedup> {
    match s.split_once(':') {
        None if s == "linear" => Ok(Speedup::Linear),
        Some(("amdahl", f)) => {
            let serial: f64 = f
                .parse()
                .with_context(|| format!("amdahl:{f}: not a number"))?;
            anyhow::ensure!(
                (0.0..=1.0).contains(&serial),
                "amdahl:{f}: the serial fraction is 0 to 1"
            );
            Ok(Speedup::Amdahl { serial })
        }
        Some(("curve", file)) => {
            let text = std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?;
            Speedup::from_profile(&text).with_context(|| file.to_string())
        }
        _ => anyhow::bail!("--speedup {s}: use measured, linear, amdahl:S or curve:FILE"),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let cols = Columns {
        submit: cli.submit_col.clone(),
        gpus: cli.gpus_col.clone(),
        duration: cli.duration_col.clone(),
        model: cli.model_col.clone(),
        batch: cli.batch_col.clone(),
    };
    let mut jobs = Vec::new();
    for t in &cli.trace {
        jobs.extend(trace::read(t, &cols)?);
    }
    jobs.sort_by(|a, b| a.submit.total_cmp(&b.submit));
    let names = cli
        .trace
        .iter()
        .map(|t| t.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if let Some(n) = cli.jobs {
        jobs.truncate(n);
    }
    anyhow::ensure!(!jobs.is_empty(), "{names} has no jobs");
    let (speed, curves) = speedup(&cli.speedup, cli.curves.as_ref())?;
    let base = SimConfig {
        gpus: cli.gpus,
        speed,
        curves,
        resize_cost: cli.resize_cost,
        restart_cost: cli.restart_cost,
        start_cost: cli.start_cost,
        join_cost: cli.join_cost,
        min_interval: cli.min_interval,
        resize_by_restart: false,
        max_factor: cli.max_factor.max(1),
        min_share: cli.min_share,
        overhead: cli.overhead,
    };
    let mut rows: Vec<Summary> = Vec::new();
    let mut runs = Vec::new();
    let all = Instant::now();
    for name in &cli.policies {
        let (rest, factor) = match name.split_once('@') {
            Some((p, f)) => {
                let f: u32 = f
                    .parse()
                    .ok()
                    .filter(|f| *f >= 1)
                    .with_context(|| format!("{name}: @F takes a max factor of 1 or more"))?;
                (p, Some(f))
            }
            None => (name.as_str(), None),
        };
        let (pname, restart) = match rest.strip_suffix("+restart") {
            Some(p) => (p, true),
            None => (rest, false),
        };
        let mut p: Box<dyn policy::Policy> = match pname {
            "tiresias" => Box::new(
                policy::Tiresias::new(cli.las_limits.clone())
                    .with_starvation(cli.las_starvation)
                    .with_reference_wakeups(cli.las_reference_wakeups),
            ),
            other => policy::by_name(other).with_context(|| {
                format!(
                    "unknown policy {other:?}: use fifo, tiresias, elastic, goodput (+restart, @F)"
                )
            })?,
        };
        anyhow::ensure!(
            factor.is_none() || p.elastic(),
            "{name}: @F is for the elastic policies"
        );
        let cfg = SimConfig {
            resize_by_restart: restart,
            max_factor: factor.unwrap_or(base.max_factor),
            ..base.clone()
        };
        let t = Instant::now();
        let (mut summary, outcomes) = simulate(&jobs, p.as_mut(), &cfg)?;
        if factor.is_some() {
            summary.policy = name.clone();
        }
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "edl-sim: {} in {secs:.2} s ({} events, {:.0} events/s)",
            summary.policy,
            summary.events,
            summary.events as f64 / secs.max(1e-9)
        );
        runs.push((summary.policy.clone(), outcomes));
        rows.push(summary);
    }
    eprintln!(
        "edl-sim: {} policies in {:.2} s",
        rows.len(),
        all.elapsed().as_secs_f64()
    );
    let base_of = |name: &str| rows.iter().find(|r| r.policy == name).map(|r| r.mean_jct);
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(vec![
        "policy",
        "jobs",
        "mean JCT h",
        "p99 JCT h",
        "makespan h",
        "mean queue h",
        "GPU util",
        "resizes",
        "restarts",
        "JCT vs fifo",
        "JCT vs tiresias",
    ]);
    for r in &rows {
        let ratio = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.2}", r.mean_jct / b));
        t.add_row(vec![
            r.policy.clone(),
            r.jobs.to_string(),
            format!("{:.2}", r.mean_jct / 3600.0),
            format!("{:.2}", r.p99_jct / 3600.0),
            format!("{:.1}", r.makespan / 3600.0),
            format!("{:.2}", r.mean_queue / 3600.0),
            format!("{:.1}%", r.utilization * 100.0),
            r.resizes.to_string(),
            r.restarts.to_string(),
            ratio(base_of("fifo")),
            ratio(base_of("tiresias")),
        ]);
    }
    println!(
        "{} jobs of {} on {} GPUs, speedup {}, resize {} s stop-free / {} s by restart:",
        jobs.len(),
        names,
        cli.gpus,
        cli.speedup,
        cli.resize_cost,
        cli.restart_cost
    );
    println!("{t}");
    println!(
        "restarts: stops and starts again (a preempted job resuming, and under +restart every \
         resize, which counts as a resize too)"
    );
    if let Some(path) = &cli.json {
        let out = serde_json::json!({
            "trace": names,
            "gpus": cli.gpus,
            "speedup": cli.speedup,
            "resize_cost": cli.resize_cost,
            "restart_cost": cli.restart_cost,
            "summary": rows,
            "jobs": runs.iter().map(|(n, o)| (n.clone(), o)).collect::<std::collections::BTreeMap<_, _>>(),
        });
        std::fs::write(path, serde_json::to_string(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &cli.plots {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let title = format!(
            "{} on {} GPUs",
            cli.trace
                .iter()
                .map(|t| {
                    t.file_name()
                        .map(|f| f.to_string_lossy().to_string())
                        .unwrap_or_default()
                })
                .collect::<Vec<_>>()
                .join(" + "),
            cli.gpus
        );
        edl_sched::plot::jct_bars(&rows, &title, &dir.join("jct.png"))?;
        edl_sched::plot::jct_cdf(&runs, &dir.join("cdf.png"))?;
    }
    Ok(())
}
