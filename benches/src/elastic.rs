//! `edl-bench elastic`: what membership changes cost a running job of synthetic workers (the
//! step loop of [`crate::scale`]), stop-free against the classic stop-everything restart of
//! `edl-local --restart-on-change`.
//!
//! The job starts with [`Plan::workers`] workers; then, [`Plan::gap`] apart, a worker joins and
//! the oldest leaves, [`Plan::rounds`] times. Stop-free, a joiner connects and pulls the model
//! while the others train, then asks to be admitted; a leaver finishes its step and leaves.
//! With restarts, every change checkpoints the model (a pull written to a file) while the old
//! workers train, stops them all (each finishes its step and leaves), then starts the new
//! membership as fresh clients and waits for their first steps.
//!
//! Costs come from the coordinator's trace, as `edl-local` reports them
//! ([`edl_deploy::costs`]): the *stall* of an event is how much longer than usual the others'
//! step across it took, the worst of them. In a restart nobody trains across the change, so
//! each old worker's gap runs from its last step to the first step of the new membership (what
//! `costs.rs` does when nobody goes on). The *join latency* is from the moment the change was
//! asked for to the joiner's first step, on the benchmark's clock: for a restart, checkpoint,
//! stop and start together.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_deploy::costs::{self, StallNoise};
use edl_shared::proto::msg::{EventKind, JobTrace};
use edl_shared::proto::{Consistency, WorkerId};
use edl_shared::transport::TransportSettings;
use edl_testkit::{TestCluster, counter_job};
use edl_worker::{ClientConfig, Job};
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::scale::{Mode, Synth};

/// How membership changes are carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Membership {
    /// Workers join and leave while the others train.
    StopFree,
    /// Every change stops every worker and starts the new membership.
    Restart,
}

impl Membership {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Membership::StopFree => "stop-free",
            Membership::Restart => "restart",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Workers at the start (and after every round).
    pub workers: usize,
    /// Shards.
    pub shards: usize,
    /// Model bytes.
    pub model_bytes: usize,
    /// Floats per key.
    pub chunk: u32,
    /// Synthetic compute per step.
    pub compute: Duration,
    /// The consistency model.
    pub consistency: Consistency,
    /// Join-then-leave rounds.
    pub rounds: usize,
    /// Time between changes (and before the first, after the last).
    pub gap: Duration,
    /// The membership modes to run.
    pub modes: Vec<Membership>,
    /// Transport settings.
    pub settings: TransportSettings,
}

impl Plan {
    /// 4 workers of the scale benchmark's job (4 MiB, 20 ms) over 2 shards under SSP(2), six
    /// joins and six leaves 2.5 s apart, in both modes; `quick`: one of each, 0.6 s apart.
    pub fn standard(quick: bool, settings: TransportSettings) -> Plan {
        Plan {
            workers: 4,
            shards: 2,
            model_bytes: 4 << 20,
            chunk: 8192,
            compute: Duration::from_millis(20),
            consistency: Consistency::Ssp { staleness: 2 },
            rounds: if quick { 1 } else { 6 },
            gap: Duration::from_millis(if quick { 600 } else { 2500 }),
            modes: vec![Membership::StopFree, Membership::Restart],
            settings,
        }
    }
}

/// One membership change and what it cost.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// join or leave.
    pub kind: String,
    /// The worker that joined or left (the first of a restart's new membership for a join).
    pub worker: String,
    /// The others' usual step just before, milliseconds.
    pub step_ms: Option<f64>,
    /// How much longer than usual the others' step across the change took, the worst of them.
    pub stall_ms: Option<f64>,
    /// For a join: from asking for the change to the joiner's first step.
    pub join_ms: Option<f64>,
    /// For a join: from the admission request to the first step (the coordinator's clock).
    pub admitted_ms: Option<f64>,
    /// For a restart: the checkpoint, the stop and the start, milliseconds.
    pub restart: Option<[f64; 3]>,
}

/// The events of one kind, summed up.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// join or leave.
    pub kind: String,
    /// How many.
    pub count: usize,
    /// Median stall.
    pub median_stall_ms: Option<f64>,
    /// Largest stall.
    pub max_stall_ms: Option<f64>,
    /// Median join latency (joins).
    pub median_join_ms: Option<f64>,
    /// Median usual step.
    pub median_step_ms: Option<f64>,
}

/// One mode's run.
#[derive(Clone, Debug, Serialize)]
pub struct ModeRun {
    /// stop-free or restart.
    pub membership: Membership,
    /// Every change.
    pub events: Vec<Event>,
    /// Per kind.
    pub summary: Vec<Summary>,
    /// The stall measure at moments without a change.
    pub noise: Option<StallNoise>,
}

/// What the run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// Workers at the start.
    pub workers: usize,
    /// Shards.
    pub shards: usize,
    /// Model bytes.
    pub model_bytes: usize,
    /// Compute per step, milliseconds.
    pub compute_ms: f64,
    /// The consistency model.
    pub consistency: String,
    /// One run per mode.
    pub runs: Vec<ModeRun>,
}

/// Runs each mode of the plan on a fresh cluster.
pub async fn run(plan: &Plan) -> anyhow::Result<Results> {
    let mut runs = Vec::new();
    for &m in &plan.modes {
        runs.push(
            run_mode(plan, m)
                .await
                .with_context(|| format!("elastic, {}", m.name()))?,
        );
    }
    Ok(Results {
        workers: plan.workers,
        shards: plan.shards,
        model_bytes: plan.model_bytes,
        compute_ms: plan.compute.as_secs_f64() * 1e3,
        consistency: plan.consistency.to_string(),
        runs,
    })
}

/// A synthetic worker running in its own task.
struct Running {
    name: String,
    stop: Arc<AtomicBool>,
    first: Option<oneshot::Receiver<Instant>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Starts a worker: it connects and pulls the model (the slow part, before asking to be
    /// admitted, as `edl-worker` does), registers, and steps until told to stop; then leaves.
    fn start(cfg: ClientConfig, name: String, index: usize, plan: &Plan) -> Running {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = oneshot::channel();
        let compute = plan.compute;
        let task = tokio::spawn({
            let (stop, name) = (stop.clone(), name.clone());
            async move {
                let job = Job::connect(&cfg).await?;
                let mut synth = Synth::new(&job, Mode::Dense, compute, index);
                synth.warm(&job).await?;
                let mut session = job.register(&name).await?;
                synth.step(&mut session).await?;
                let _ = tx.send(Instant::now());
                while !stop.load(Ordering::Relaxed) {
                    synth.step(&mut session).await?;
                }
                session.leave().await?;
                anyhow::Ok(())
            }
        });
        Running {
            name,
            stop,
            first: Some(rx),
            task,
        }
    }

    /// Waits for its first step.
    async fn first_step(&mut self) -> anyhow::Result<Instant> {
        let rx = self.first.take().context("first step already taken")?;
        match rx.await {
            Ok(t) => Ok(t),
            // The task ended before its first step: its error says why.
            Err(_) => {
                let task = &mut self.task;
                task.await??;
                anyhow::bail!("{} ended before its first step", self.name)
            }
        }
    }

    /// Asks it to leave after its current step.
    fn signal(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Lets it finish its step and leave.
    async fn stop(self) -> anyhow::Result<()> {
        self.signal();
        self.task
            .await?
            .with_context(|| format!("worker {}", self.name))
    }
}

/// A change the benchmark made, before its costs are read from the trace.
struct Done {
    kind: &'static str,
    /// The joiner or leaver (stop-free), or the new membership (restart).
    names: Vec<String>,
    /// The old membership (restart).
    old: Vec<String>,
    join_ms: Option<f64>,
    restart: Option<[f64; 3]>,
}

async fn run_mode(plan: &Plan, mode: Membership) -> anyhow::Result<ModeRun> {
    let floats = (plan.model_bytes / 4).max(1) as u32;
    let job = counter_job(floats, plan.chunk, plan.consistency);
    let cluster = TestCluster::start_with(job, plan.shards as u32, plan.settings.clone()).await?;
    let config = |name: &str| -> anyhow::Result<ClientConfig> {
        let mut cfg = cluster.client_config(name)?;
        cfg.settings = plan.settings.clone();
        Ok(cfg)
    };
    let admin = Job::connect(&config("bench")?).await?;
    let dir = tempfile::tempdir()?;
    let mut next = 0;
    let mut fleet: Vec<Running> = Vec::new();
    for _ in 0..plan.workers {
        let name = format!("w{next}");
        fleet.push(Running::start(config(&name)?, name, next, plan));
        next += 1;
    }
    for w in &mut fleet {
        w.first_step().await?;
    }
    tokio::time::sleep(plan.gap).await;
    let mut done = Vec::new();
    let changes = (0..plan.rounds).flat_map(|_| ["join", "leave"]);
    for (generation, kind) in changes.enumerate() {
        let count = fleet.len() + usize::from(kind == "join");
        // Certificates are issued before the change is asked for, as a deployment would have
        // them ready: issuing one is no part of a join.
        let joiners: Vec<(String, ClientConfig)> = match mode {
            Membership::StopFree if kind == "join" => vec![format!("w{next}")],
            Membership::StopFree => Vec::new(),
            Membership::Restart => (0..count).map(|i| format!("g{generation}w{i}")).collect(),
        }
        .into_iter()
        .map(|n| config(&n).map(|c| (n, c)))
        .collect::<anyhow::Result<_>>()?;
        let asked = Instant::now();
        match mode {
            Membership::StopFree if kind == "join" => {
                let (name, cfg) = joiners.into_iter().next().context("no joiner")?;
                let mut w = Running::start(cfg, name.clone(), next, plan);
                next += 1;
                let first = w.first_step().await?;
                fleet.push(w);
                done.push(Done {
                    kind,
                    names: vec![name],
                    old: Vec::new(),
                    join_ms: Some(ms(first - asked)),
                    restart: None,
                });
            }
            Membership::StopFree => {
                let w = fleet.remove(0);
                let name = w.name.clone();
                w.stop().await?;
                done.push(Done {
                    kind,
                    names: vec![name],
                    old: Vec::new(),
                    join_ms: None,
                    restart: None,
                });
            }
            Membership::Restart => {
                checkpoint(&admin, &dir.path().join(format!("checkpoint-{generation}"))).await?;
                let checkpointed = Instant::now();
                let old: Vec<String> = fleet.iter().map(|w| w.name.clone()).collect();
                // Everyone is told at once, as SIGTERM to every worker process would.
                fleet.iter().for_each(Running::signal);
                for w in fleet.drain(..) {
                    w.stop().await?;
                }
                let stopped = Instant::now();
                let mut names = Vec::new();
                for (i, (name, cfg)) in joiners.into_iter().enumerate() {
                    fleet.push(Running::start(cfg, name.clone(), i, plan));
                    names.push(name);
                }
                let mut last = stopped;
                for w in &mut fleet {
                    last = last.max(w.first_step().await?);
                }
                done.push(Done {
                    kind,
                    names,
                    old,
                    join_ms: (kind == "join").then(|| ms(last - asked)),
                    restart: Some([
                        ms(checkpointed - asked),
                        ms(stopped - checkpointed),
                        ms(last - stopped),
                    ]),
                });
            }
        }
        eprintln!(
            "elastic, {}: {kind} done in {:.0} ms",
            mode.name(),
            ms(asked.elapsed())
        );
        tokio::time::sleep(plan.gap).await;
    }
    let trace = admin.trace().await?;
    fleet.iter().for_each(Running::signal);
    for w in fleet {
        w.stop().await?;
    }
    drop(admin);
    cluster.stop().await;
    let events = costs_of(&trace, &done);
    Ok(ModeRun {
        membership: mode,
        summary: summarize(&events),
        events,
        noise: costs::stall_noise(&trace, &[]),
    })
}

/// Pulls every parameter (at the slowest worker's clock, as `edl-local`'s checkpoint does)
/// and writes them to `path`.
async fn checkpoint(job: &Job, path: &std::path::Path) -> anyhow::Result<()> {
    let st = job.status().await?;
    let mut params = vec![0f32; job.param_count()];
    job.pull_all(&mut params, st.min_clock).await?;
    let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
    tokio::fs::write(path, bytes)
        .await
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Reads each change's costs from the trace.
fn costs_of(trace: &JobTrace, done: &[Done]) -> Vec<Event> {
    let reports = costs::event_costs(trace);
    let find = |kind: &str, name: &str| reports.iter().find(|r| r.kind == kind && r.worker == name);
    done.iter()
        .map(|d| {
            let first = d.names.first().cloned().unwrap_or_default();
            if d.restart.is_none() {
                let r = find(d.kind, &first);
                return Event {
                    kind: d.kind.into(),
                    worker: first,
                    step_ms: r.and_then(|r| r.step_ms),
                    stall_ms: r.and_then(|r| r.stall_ms),
                    join_ms: d.join_ms,
                    admitted_ms: r.and_then(|r| r.join_latency_ms),
                    restart: None,
                };
            }
            let (step_ms, stall_ms) = restart_stall(trace, &d.old, &d.names);
            let admitted = d
                .names
                .iter()
                .filter_map(|n| find("join", n).and_then(|r| r.join_latency_ms))
                .reduce(f64::max);
            Event {
                kind: d.kind.into(),
                worker: first,
                step_ms,
                stall_ms,
                join_ms: d.join_ms,
                admitted_ms: if d.kind == "join" { admitted } else { None },
                restart: d.restart,
            }
        })
        .collect()
}

/// The usual step and the stall of a restart from the old membership `old` to the new one
/// `new`: per old worker, from its last step to the new membership's first step, less its
/// usual step (the median of its last [`costs::STEP_WINDOW`] intervals); the worst of them.
fn restart_stall(trace: &JobTrace, old: &[String], new: &[String]) -> (Option<f64>, Option<f64>) {
    let ids = |names: &[String]| -> Vec<WorkerId> {
        trace
            .events
            .iter()
            .filter(|e| e.kind == EventKind::Join && names.contains(&e.name))
            .map(|e| e.worker)
            .collect()
    };
    let mut steps: BTreeMap<WorkerId, Vec<u64>> = BTreeMap::new();
    for s in &trace.steps {
        steps.entry(s.worker).or_default().push(s.t_ms);
    }
    let resumed = ids(new)
        .iter()
        .filter_map(|w| steps.get(w).and_then(|t| t.iter().min()).copied())
        .min();
    let mut pooled = Vec::new();
    let mut stall: Option<f64> = None;
    for w in ids(old) {
        let Some(times) = steps.get(&w) else { continue };
        let recent = &times[times.len().saturating_sub(costs::STEP_WINDOW + 1)..];
        let mut gaps: Vec<f64> = recent.windows(2).map(|p| (p[1] - p[0]) as f64).collect();
        pooled.extend(gaps.iter().copied());
        let (Some(usual), Some(&last), Some(resumed)) =
            (costs::median(&mut gaps), times.last(), resumed)
        else {
            continue;
        };
        let s = (resumed.saturating_sub(last) as f64 - usual).max(0.0);
        stall = Some(stall.map_or(s, |x| x.max(s)));
    }
    (costs::median(&mut pooled), stall)
}

fn summarize(events: &[Event]) -> Vec<Summary> {
    ["join", "leave"]
        .into_iter()
        .filter(|k| events.iter().any(|e| e.kind == *k))
        .map(|kind| {
            let of: Vec<&Event> = events.iter().filter(|e| e.kind == kind).collect();
            let mut stalls: Vec<f64> = of.iter().filter_map(|e| e.stall_ms).collect();
            let mut joins: Vec<f64> = of.iter().filter_map(|e| e.join_ms).collect();
            let mut steps: Vec<f64> = of.iter().filter_map(|e| e.step_ms).collect();
            Summary {
                kind: kind.into(),
                count: of.len(),
                max_stall_ms: stalls.iter().copied().reduce(f64::max),
                median_stall_ms: costs::median(&mut stalls),
                median_join_ms: costs::median(&mut joins),
                median_step_ms: costs::median(&mut steps),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use edl_shared::proto::msg::{EventRecord, StepRecord};
    use edl_shared::proto::{Clock, WorkerId};

    use super::*;

    fn join(t_ms: u64, worker: u64, name: &str) -> EventRecord {
        EventRecord {
            t_ms,
            requested_ms: t_ms,
            kind: EventKind::Join,
            worker: WorkerId(worker),
            name: name.into(),
            detail: String::new(),
        }
    }

    fn steps(worker: u64, from: u64, to: u64, every: u64) -> Vec<StepRecord> {
        (from..=to)
            .step_by(every as usize)
            .enumerate()
            .map(|(i, t_ms)| StepRecord {
                t_ms,
                worker: WorkerId(worker),
                clock: Clock(i as u64 + 1),
            })
            .collect()
    }

    #[test]
    fn a_restart_stalls_from_the_earliest_last_step_to_the_first_new_one() {
        let mut all = steps(1, 0, 100, 10);
        all.extend(steps(2, 5, 125, 10));
        all.extend(steps(3, 400, 500, 10));
        all.sort_by_key(|s| s.t_ms);
        let trace = JobTrace {
            events: vec![join(0, 1, "a"), join(0, 2, "b"), join(350, 3, "c")],
            steps: all,
            ..JobTrace::default()
        };
        let (step, stall) = restart_stall(&trace, &["a".into(), "b".into()], &["c".into()]);
        assert_eq!(step, Some(10.0));
        // a's last step was at 100, c's first at 400: 300 ms, less a's usual 10.
        assert_eq!(stall, Some(290.0));
    }
}
