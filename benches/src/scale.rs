//! `edl-bench scale`: synthetic workers over 1, 2 and 4 shards. A synthetic worker pulls,
//! "computes" for a fixed time (a sleep: a GPU busy with a step leaves the CPU free), pushes
//! and reports its step, in a closed loop; dense workers pull and push the whole model, sparse
//! ones an eighth of its keys, a different eighth each step. Throughput is counted over a
//! fixed window after a warm-up (held open, if need be, until a step ends in it), and scaling
//! efficiency is throughput at `n` workers over `n`
//! times that of one worker at the same shards and mode.
//!
//! The transport ceiling is measured in the same run: the same loop with no compute at all,
//! [`Plan::ceiling_workers`] workers, per shard count and mode. A point whose ideal demand
//! (`n` times one worker's rate) reaches that ceiling is marked *saturated*: past it, the
//! transport (on this machine: the CPU cores doing QUIC, TLS and the optimizer) cannot
//! move more, and efficiency must fall.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_shared::proto::{Clock, Consistency, Key};
use edl_shared::transport::TransportSettings;
use edl_testkit::{TestCluster, counter_job};
use edl_worker::{ClientError, Gradients, Job, Session};
use serde::Serialize;
use tokio::task::JoinSet;

/// Samples a synthetic step stands for (the batch size of `edl-local`'s default job), for the
/// samples/s column.
pub const BATCH: u32 = 64;
/// A sparse step touches one key in this many.
pub const SPARSE_EVERY: u64 = 8;

/// What a synthetic step moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Pull and push every key.
    Dense,
    /// Pull and push one key in [`SPARSE_EVERY`], spread over the model (and the shards).
    Sparse,
}

impl Mode {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
            Mode::Sparse => "sparse",
        }
    }
}

/// A synthetic worker: its buffers, its mode and its compute time.
pub struct Synth {
    params: Vec<f32>,
    grads: Gradients,
    mode: Mode,
    compute: Duration,
    /// Staggers which keys a sparse worker touches, so that workers do not move in lockstep.
    index: u64,
    keys: u64,
}

impl Synth {
    /// A worker for `job`'s model; `index` staggers its sparse keys.
    pub fn new(job: &Job, mode: Mode, compute: Duration, index: usize) -> Synth {
        let n = job.param_count();
        Synth {
            params: vec![0.0; n],
            // Tiny and finite: the shards apply them (SGD) like real gradients.
            grads: Gradients::from(vec![1e-6; n]),
            mode,
            compute,
            index: index as u64,
            keys: job.layout().num_keys(),
        }
    }

    /// Pulls every parameter, as a joining worker does before asking to be admitted.
    pub async fn warm(&mut self, job: &Job) -> Result<(), ClientError> {
        job.pull_all(&mut self.params, Clock(0)).await
    }

    /// One step: pull, compute, push, report. Returns the bytes of parameters and gradients
    /// moved.
    pub async fn step(&mut self, s: &mut Session) -> Result<u64, ClientError> {
        let moved = match self.mode {
            Mode::Dense => {
                s.pull(&mut self.params).await?;
                self.compute().await;
                s.push_step_gradients(&self.grads).await?;
                2 * 4 * self.params.len() as u64
            }
            Mode::Sparse => {
                let keys = sparse_keys(self.index, s.clock(), self.keys);
                let got = s.job().pull_keys(&keys, Clock(0)).await?;
                self.compute().await;
                let chunks: Vec<(Key, &[f32])> = got
                    .iter()
                    .map(|(k, v)| (*k, &self.grads[..v.len().min(self.grads.len())]))
                    .collect();
                s.push_keys(&chunks).await?;
                2 * 4 * got.iter().map(|(_, v)| v.len() as u64).sum::<u64>()
            }
        };
        s.advance(0, BATCH, 0.0).await?;
        Ok(moved)
    }

    async fn compute(&self) {
        if !self.compute.is_zero() {
            tokio::time::sleep(self.compute).await;
        }
    }
}

/// One line of the plot: a shard count, a mode and a consistency model, measured at every
/// worker count of the plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Series {
    /// Shards.
    pub shards: usize,
    /// dense or sparse.
    pub mode: Mode,
    /// ASP or SSP (sparse pulls do not close BSP steps).
    pub consistency: Consistency,
}

/// The keys a sparse step of worker `index` at `clock` touches, of `keys`: every
/// [`SPARSE_EVERY`]th key, from an offset that moves by one per step.
fn sparse_keys(index: u64, clock: Clock, keys: u64) -> Vec<Key> {
    let first = (index + clock.0) % SPARSE_EVERY;
    (first..keys)
        .step_by(SPARSE_EVERY as usize)
        .map(Key)
        .collect()
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Worker counts; the first is the efficiency baseline (normally 1).
    pub workers: Vec<usize>,
    /// The series.
    pub series: Vec<Series>,
    /// Model size in bytes (one tensor).
    pub model_bytes: usize,
    /// Floats per key.
    pub chunk: u32,
    /// Synthetic compute per step.
    pub compute: Duration,
    /// Steps before the window opens (connections warm, clocks spread).
    pub warmup: Duration,
    /// The measured window.
    pub window: Duration,
    /// Workers of the no-compute run that measures the transport ceiling.
    pub ceiling_workers: usize,
    /// Transport settings for servers and workers.
    pub settings: TransportSettings,
    /// Copies of every key range (a series over fewer shards is skipped).
    pub replicas: u32,
}

impl Plan {
    /// 1 to 16 workers over 1, 2 and 4 shards, dense and sparse, under ASP, and dense over 2
    /// shards under SSP(2); a 4 MiB model and 20 ms of compute per step. `quick` measures a
    /// few points for a moment each.
    pub fn standard(quick: bool, settings: TransportSettings) -> Plan {
        let shards: &[usize] = if quick { &[2] } else { &[1, 2, 4] };
        let mut series: Vec<Series> = shards
            .iter()
            .flat_map(|&shards| {
                [Mode::Dense, Mode::Sparse].map(|mode| Series {
                    shards,
                    mode,
                    consistency: Consistency::Asp,
                })
            })
            .collect();
        series.push(Series {
            shards: 2,
            mode: Mode::Dense,
            consistency: Consistency::Ssp { staleness: 2 },
        });
        Plan {
            workers: if quick {
                vec![1, 2]
            } else {
                vec![1, 2, 4, 6, 8, 12, 16]
            },
            series,
            model_bytes: 4 << 20,
            chunk: 8192,
            compute: Duration::from_millis(20),
            warmup: Duration::from_millis(if quick { 100 } else { 400 }),
            window: Duration::from_millis(if quick { 200 } else { 2500 }),
            ceiling_workers: if quick { 2 } else { 8 },
            settings,
            replicas: 1,
        }
    }
}

/// One point.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Workers.
    pub workers: usize,
    /// Shards.
    pub shards: usize,
    /// dense or sparse.
    pub mode: Mode,
    /// The consistency model (`asp`, `ssp:S`).
    pub consistency: String,
    /// Steps per second, all workers together.
    pub steps_per_s: f64,
    /// `steps_per_s` × [`BATCH`].
    pub samples_per_s: f64,
    /// Parameters and gradients moved, both directions, Gbit/s.
    pub gbit_s: f64,
    /// Mean wall time of one worker's step, milliseconds.
    pub step_ms: f64,
    /// `steps_per_s` over `workers` × one worker's, same series.
    pub efficiency: f64,
    /// `workers` × one worker's steps/s over the ceiling's: the load asked of the transport.
    pub load: f64,
    /// `load` ≥ 1: the transport cannot keep up with this many workers.
    pub saturated: bool,
}

impl Row {
    /// The series' label: `2 shards dense asp`.
    pub fn series(&self) -> String {
        format!(
            "{} shard{} {} {}",
            self.shards,
            if self.shards == 1 { "" } else { "s" },
            self.mode.name(),
            self.consistency
        )
    }
}

/// The transport ceiling of one series: the step loop without compute.
#[derive(Clone, Debug, Serialize)]
pub struct Ceiling {
    /// Shards.
    pub shards: usize,
    /// dense or sparse.
    pub mode: Mode,
    /// The consistency model.
    pub consistency: String,
    /// Workers.
    pub workers: usize,
    /// Steps per second, all workers together.
    pub steps_per_s: f64,
    /// Gbit/s moved.
    pub gbit_s: f64,
}

/// What the run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// Model bytes.
    pub model_bytes: usize,
    /// Keys of the model.
    pub keys: u64,
    /// Compute per step, milliseconds.
    pub compute_ms: f64,
    /// Every point, series by series.
    pub rows: Vec<Row>,
    /// The transport ceilings, one per series.
    pub ceilings: Vec<Ceiling>,
}

impl Results {
    /// Per series, the point with the most workers that is not saturated.
    pub fn last_unsaturated(&self) -> Vec<&Row> {
        let mut out: Vec<&Row> = Vec::new();
        for r in self.rows.iter().filter(|r| !r.saturated) {
            match out.iter_mut().find(|o| o.series() == r.series()) {
                Some(o) if o.workers < r.workers => *o = r,
                Some(_) => {}
                None => out.push(r),
            }
        }
        out
    }
}

/// A measured point before the ratios.
struct Measured {
    steps_per_s: f64,
    gbit_s: f64,
    step_ms: f64,
}

/// Runs the plan: one cluster per shard count and consistency model, its workers connected
/// once and registered afresh for each point (so that idle workers never hold others back).
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    let floats = (plan.model_bytes / 4).max(1) as u32;
    let mut rows = Vec::new();
    let mut ceilings = Vec::new();
    let mut keys = 0;
    let most = plan
        .workers
        .iter()
        .copied()
        .chain([plan.ceiling_workers])
        .max()
        .unwrap_or(1);
    let mut clusters: Vec<(usize, Consistency)> = Vec::new();
    for s in &plan.series {
        if !clusters.contains(&(s.shards, s.consistency)) {
            clusters.push((s.shards, s.consistency));
        }
    }
    for (shards, consistency) in clusters {
        let mut job = counter_job(floats, plan.chunk, consistency);
        job.replicas = plan.replicas;
        let cluster = TestCluster::start_with(job, shards as u32, plan.settings.clone())
            .await
            .context("starting the cluster")?;
        let mut jobs = Vec::new();
        for i in 0..most {
            let mut cfg = cluster.client_config(&format!("w{i}"))?;
            cfg.settings = plan.settings.clone();
            jobs.push(Job::connect(&cfg).await?);
        }
        keys = jobs[0].layout().num_keys();
        let of_cluster = plan
            .series
            .iter()
            .filter(|s| s.shards == shards && s.consistency == consistency);
        for series in of_cluster {
            let (mode, name) = (series.mode, series.mode.name());
            let ceiling = measure(&jobs[..plan.ceiling_workers], mode, Duration::ZERO, plan)
                .await
                .with_context(|| format!("ceiling, {shards} shards, {name}, {consistency}"))?;
            ceilings.push(Ceiling {
                shards,
                mode,
                consistency: consistency.to_string(),
                workers: plan.ceiling_workers,
                steps_per_s: ceiling.steps_per_s,
                gbit_s: ceiling.gbit_s,
            });
            let mut per_worker: Option<f64> = None;
            for &n in &plan.workers {
                let m = measure(&jobs[..n], mode, plan.compute, plan)
                    .await
                    .with_context(|| format!("{n} workers, {shards} shards, {name}"))?;
                let base = *per_worker.get_or_insert(m.steps_per_s / n as f64);
                let load = n as f64 * base / ceiling.steps_per_s.max(1e-9);
                let row = Row {
                    workers: n,
                    shards,
                    mode,
                    consistency: consistency.to_string(),
                    steps_per_s: m.steps_per_s,
                    samples_per_s: m.steps_per_s * f64::from(BATCH),
                    gbit_s: m.gbit_s,
                    step_ms: m.step_ms,
                    efficiency: m.steps_per_s / (n as f64 * base).max(1e-9),
                    load,
                    saturated: load >= 1.0,
                };
                eprintln!(
                    "scale: {n:>2} workers, {}: {:.1} steps/s, {:.2} Gbit/s, efficiency {:.0}%",
                    row.series(),
                    m.steps_per_s,
                    m.gbit_s,
                    row.efficiency * 100.0
                );
                rows.push(row);
            }
        }
        drop(jobs);
        cluster.stop().await;
    }
    Ok(Results {
        model_bytes: plan.model_bytes,
        keys,
        compute_ms: plan.compute.as_secs_f64() * 1e3,
        rows,
        ceilings,
    })
}

/// The longest a measured window stays open waiting for its first step.
const MAX_WINDOW: Duration = Duration::from_secs(60);

/// Registers one worker per job, lets them step for the warm-up and the window, and counts the
/// steps and bytes of the window; then they leave.
async fn measure(
    jobs: &[Job],
    mode: Mode,
    compute: Duration,
    plan: &Plan,
) -> anyhow::Result<Measured> {
    let steps = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = JoinSet::new();
    for (i, job) in jobs.iter().enumerate() {
        let mut synth = Synth::new(job, mode, compute, i);
        let mut session = job.clone().register(&format!("w{i}")).await?;
        let (steps, bytes, stop) = (steps.clone(), bytes.clone(), stop.clone());
        set.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let moved = synth.step(&mut session).await?;
                steps.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(moved, Ordering::Relaxed);
            }
            session.leave().await?;
            anyhow::Ok(())
        });
    }
    tokio::time::sleep(plan.warmup).await;
    let (s0, b0, t0) = (
        steps.load(Ordering::Relaxed),
        bytes.load(Ordering::Relaxed),
        Instant::now(),
    );
    tokio::time::sleep(plan.window).await;
    // A window in which no step ended measures nothing (on a machine busy with other work, a
    // short window can fall inside one slow step): it stays open until a step ends, and the
    // rate is over the time it was really open.
    let until = t0 + MAX_WINDOW;
    while steps.load(Ordering::Relaxed) == s0 && Instant::now() < until {
        tokio::time::sleep(plan.window.min(Duration::from_millis(100))).await;
    }
    let (s1, b1, wall) = (
        steps.load(Ordering::Relaxed),
        bytes.load(Ordering::Relaxed),
        t0.elapsed(),
    );
    stop.store(true, Ordering::Relaxed);
    while let Some(r) = set.join_next().await {
        r??;
    }
    let secs = wall.as_secs_f64().max(1e-9);
    let steps_per_s = (s1 - s0) as f64 / secs;
    Ok(Measured {
        steps_per_s,
        gbit_s: (b1 - b0) as f64 * 8.0 / secs / 1e9,
        step_ms: jobs.len() as f64 / steps_per_s.max(1e-9) * 1e3,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_steps_touch_an_eighth_and_cover_every_key_in_eight_steps() {
        let mut seen = vec![0; 128];
        for clock in 0..SPARSE_EVERY {
            let keys = sparse_keys(3, Clock(clock), 128);
            assert_eq!(keys.len(), 16);
            for k in keys {
                seen[k.0 as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        // Workers at the same clock touch different keys.
        assert_ne!(sparse_keys(0, Clock(5), 128), sparse_keys(1, Clock(5), 128));
    }

    fn row(workers: usize, shards: usize, load: f64) -> Row {
        Row {
            workers,
            shards,
            mode: Mode::Dense,
            consistency: "asp".into(),
            steps_per_s: 1.0,
            samples_per_s: 64.0,
            gbit_s: 1.0,
            step_ms: 1.0,
            efficiency: 1.0,
            load,
            saturated: load >= 1.0,
        }
    }

    #[test]
    fn the_last_unsaturated_point_is_picked_per_series() {
        let r = Results {
            model_bytes: 1,
            keys: 1,
            compute_ms: 1.0,
            rows: vec![
                row(1, 1, 0.1),
                row(8, 1, 0.8),
                row(16, 1, 1.6),
                row(1, 2, 0.05),
                row(16, 2, 0.8),
            ],
            ceilings: Vec::new(),
        };
        let last: Vec<(usize, usize)> = r
            .last_unsaturated()
            .iter()
            .map(|x| (x.shards, x.workers))
            .collect();
        assert_eq!(last, [(1, 8), (2, 16)]);
    }
}
