//! The simulator against real runs: one small trace (8 jobs on 4 slots, scaled to about a
//! minute and a half) runs through `edl-sched` with real processes, under static FIFO and
//! under the elastic policy, and through `edl-sim`'s simulator with the speed measured from
//! those same jobs (the scheduler records each job's throughput at every size it held).
//!
//! The FIFO run calibrates: its jobs' throughput by worker count makes the speed curve, and
//! what a curve cannot know (the time from a job's start until it trains, and from its end
//! until the scheduler sees it) is the start cost. Replayed with each job's own measured
//! throughput, the FIFO run checks the queueing and that cost. The elastic run is predicted
//! from the FIFO run's curve and the growths' measured cost: which job gets how many workers
//! when, and so each job's completion time. Both within 15% per job and 10% on the mean. This
//! is how far a simulated figure can be trusted; BENCHMARKS.md has the table.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ONE_AT_A_TIME, Sched, assert_exact, job_file};
use edl_ps::cluster::JobRow;
use edl_sched::cluster::state::{MEASURED_FOR, Saved};
use edl_sched::curves::Curves;
use edl_sched::policy::{Elastic, Fifo, Policy};
use edl_sched::sim::{SimConfig, simulate};
use edl_sched::speed::Speedup;
use edl_sched::trace::TraceJob;

/// The trace: submission (seconds from the first), workers asked for, samples per epoch and
/// epochs. A worker's step of 32 samples takes 25 ms ([`PACE`]): about 1,280 samples/s, so
/// the jobs take 10 to 30 s at the size they ask for.
const TRACE: [(f64, u32, u32, u32); 8] = [
    (0.0, 2, 36_000, 2),
    (4.0, 1, 24_000, 1),
    (8.0, 4, 36_000, 2),
    (12.0, 1, 15_000, 1),
    (18.0, 2, 24_000, 2),
    (24.0, 3, 27_000, 2),
    (30.0, 1, 12_000, 1),
    (36.0, 2, 15_000, 2),
];

/// Workers' steps take a fixed time, as on a GPU, rather than a multiple of their work on
/// this machine's two cores (which slows down as more jobs share them): the jobs' speed then
/// follows their workers, which is what the simulator models.
const PACE: &str = "\"--step-time\", \"25ms\"";

const SLOTS: u32 = 4;

/// One real run of the trace under `policy`: every job's row and the scheduler's state.
fn run(dir: &Path, policy: &str) -> (Vec<JobRow>, Saved) {
    let sched = Sched::start_paced(dir, policy, PACE);
    let start = Instant::now();
    for (k, &(at, workers, samples, epochs)) in TRACE.iter().enumerate() {
        let due = start + Duration::from_secs_f64(at);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let name = format!("j{k}");
        let file = job_file(dir, &name, samples);
        let text = std::fs::read_to_string(&file).expect("job file");
        std::fs::write(
            &file,
            text.replace("epochs = 1", &format!("epochs = {epochs}")),
        )
        .expect("job file");
        // The default bounds, as the simulator's: a quarter of what it asks for, twice it.
        sched.edlctl(&[
            "job",
            "submit",
            file.to_str().expect("utf-8 path"),
            "--job",
            &name,
            "--workers",
            &workers.to_string(),
        ]);
    }
    let mut jobs = sched.wait(
        |j| {
            j.len() == TRACE.len()
                && j.iter()
                    .all(|j| j.state != "queued" && j.state != "running")
        },
        "the jobs did not all end",
    );
    assert_exact(&jobs, policy);
    let saved = Saved::load(&sched.state.join("sched.json")).expect("the scheduler's state");
    jobs.sort_by_key(|j| j.submit_ms);
    (jobs, saved)
}

/// Samples per second at each worker count, over every job of `saved` (steady spans only).
fn curve(saved: &Saved) -> Vec<(u32, f64)> {
    let mut by: std::collections::BTreeMap<u32, (u64, f64)> = Default::default();
    for j in &saved.jobs {
        for &(w, samples, secs) in &j.throughput {
            let e = by.entry(w).or_default();
            e.0 += samples;
            e.1 += secs;
        }
    }
    by.into_iter()
        .filter(|(_, (s, secs))| *s > 0 && *secs >= MEASURED_FOR)
        .map(|(w, (s, secs))| (w, s as f64 / secs))
        .collect()
}

/// The trace as the simulator reads it: the real submission times; each job's duration at the
/// size it asked for from the curve.
fn trace(real: &[JobRow], rate: impl Fn(&JobRow) -> f64) -> Vec<TraceJob> {
    let first = real.iter().map(|j| j.submit_ms).min().unwrap_or(0);
    real.iter()
        .map(|j| TraceJob {
            submit: (j.submit_ms - first) as f64 / 1000.0,
            gpus: j.workers,
            duration: j.samples_total as f64 / rate(j),
            model: Some("mlp".into()),
            batch: None,
        })
        .collect()
}

/// A job's own throughput at the size it asked for, as the scheduler measured it.
fn own_rate(saved: &Saved, j: &JobRow) -> f64 {
    let job = saved.job(&j.name).expect("the job's state");
    let (samples, secs) = job
        .throughput
        .iter()
        .filter(|r| r.0 == j.workers)
        .fold((0, 0.0), |(s, t), r| (s + r.1, t + r.2));
    assert!(secs > 0.0, "{} never trained steadily at its size", j.name);
    samples as f64 / secs
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

#[test]
fn the_simulator_predicts_a_real_elastic_run() {
    if !edl_testkit::have_fashion_mnist() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let (fifo, fifo_saved) = run(dir.path(), "fifo");
    let (elastic, elastic_saved) = run(dir.path(), "elastic");

    // The curve, from the FIFO run (every size 1..4 held steadily by some job).
    let pts = curve(&fifo_saved);
    eprintln!("measured samples/s by workers (fifo run): {pts:.0?}");
    eprintln!(
        "measured samples/s by workers (elastic run): {:.0?}",
        curve(&elastic_saved)
    );
    assert_eq!(
        pts.iter().map(|p| p.0).collect::<Vec<_>>(),
        (1..=SLOTS).collect::<Vec<_>>(),
        "the FIFO run measured every size"
    );
    let rate1 = pts[0].1;
    let table = format!(
        "global_batch_size,{}\n32,{}\n",
        pts.iter()
            .map(|p| p.0.to_string())
            .collect::<Vec<_>>()
            .join(","),
        pts.iter()
            .map(|p| p.1.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    let curves = Curves::from_tables(&[("mlp", table)]).expect("the measured curve");
    let speed = curves.of("mlp", None).expect("mlp");

    // What the curve cannot know, from the FIFO run: a job's time from its start to its end
    // beyond training at its size (servers and workers starting, the end being seen).
    let start_cost = mean(
        &fifo
            .iter()
            .map(|j| {
                let ran = (j.end_ms.unwrap_or(0) - j.start_ms.unwrap_or(0)) as f64 / 1000.0;
                ran - j.samples_total as f64 / own_rate(&fifo_saved, j)
            })
            .collect::<Vec<_>>(),
    )
    .max(0.0);
    // A growth's cost: the scheduler's measurement (the time until its new workers train).
    let joins: Vec<f64> = elastic.iter().filter_map(|j| j.resize_cost_s).collect();
    let join_cost = if joins.is_empty() { 0.0 } else { mean(&joins) };
    eprintln!("start cost {start_cost:.2} s, join cost {join_cost:.2} s ({joins:.2?})");

    let cfg = SimConfig {
        gpus: SLOTS,
        speed: Speedup::Linear,
        curves: Some(Arc::new(curves)),
        resize_cost: 0.014,
        restart_cost: 0.0,
        start_cost,
        join_cost,
        // The test cluster's resize_interval and resize_overhead (common::Sched).
        min_interval: 1.0,
        resize_by_restart: false,
        max_factor: 2,
        min_share: 0.25,
        overhead: 1.0,
    };
    let mut rows = Vec::new();
    let mut checks = Vec::new();
    // FIFO with each job's own throughput; elastic predicted from the FIFO run's curve.
    let fifo_jobs = trace(&fifo, |j| own_rate(&fifo_saved, j));
    let elastic_jobs = trace(&elastic, |j| rate1 * speed.at(j.workers));
    let runs = [
        ("fifo", &fifo, fifo_jobs, Box::new(Fifo) as Box<dyn Policy>),
        ("elastic", &elastic, elastic_jobs, Box::new(Elastic)),
    ];
    for (name, real, jobs, mut policy) in runs {
        let (summary, out) = simulate(&jobs, policy.as_mut(), &cfg).expect("simulate");
        let sim: Vec<f64> = out.iter().map(|o| o.finish - o.submit).collect();
        let got: Vec<f64> = real.iter().map(|j| j.jct_s.expect("finished")).collect();
        for (k, (s, r)) in sim.iter().zip(&got).enumerate() {
            rows.push(format!(
                "{name:8} {:3} {:2} workers {:6} samples: real {r:6.1} s, sim {s:6.1} s ({:+.1}%)",
                real[k].name,
                real[k].workers,
                real[k].samples_total,
                (s / r - 1.0) * 100.0
            ));
        }
        let (ms, mr) = (mean(&sim), mean(&got));
        rows.push(format!(
            "{name:8} mean JCT: real {mr:.1} s, sim {ms:.1} s ({:+.1}%); sim resizes {}",
            (ms / mr - 1.0) * 100.0,
            summary.resizes
        ));
        checks.push((name, sim, got));
    }
    eprintln!("{}", rows.join("\n"));
    for (name, sim, real) in &checks {
        for (k, (s, r)) in sim.iter().zip(real).enumerate() {
            assert!(
                (s / r - 1.0).abs() <= 0.15,
                "{name}: job {k}: simulated {s:.1} s against {r:.1} s real\n{}",
                rows.join("\n")
            );
        }
        let (ms, mr) = (mean(sim), mean(real));
        assert!(
            (ms / mr - 1.0).abs() <= 0.10,
            "{name}: mean simulated {ms:.1} s against {mr:.1} s real\n{}",
            rows.join("\n")
        );
    }
}
