//! The trace-driven simulator: jobs arrive as the trace says, a policy decides at every
//! arrival and completion (and when a rate-limited job may be resized again) how many GPUs
//! each holds, and each job progresses at the speed its GPU count gives it
//! ([`Speedup`]). A job needs `duration x speed(GPUs it asked for)` of work, so that with
//! exactly the GPUs it asked for it takes the trace's duration.
//!
//! An elastic job runs with between `min_share` of the GPUs it asked for (at least one) and
//! `max_factor` times them.
//!
//! Costs: a running job that is resized stops progressing for the resize's cost (EDL's
//! stop-free cost, or a restart's for the restart-based variant); a preempted job pays a
//! restart when it resumes; a first start is free. A running job is resized at most once per
//! `cost / overhead` seconds (so resizes take at most that fraction of its time). Nothing is
//! random: the same trace, policy and settings give the same schedule.

use std::sync::Arc;

use serde::Serialize;

use crate::curves::Curves;
use crate::policy::{JobView, Policy};
use crate::speed::Speedup;
use crate::trace::TraceJob;

/// What a simulation runs on.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// GPU slots in the cluster.
    pub gpus: u32,
    /// Speed by GPU count of the jobs `curves` has no curve for.
    pub speed: Speedup,
    /// Measured speed by GPU count per model (and batch size), for the jobs of a trace that
    /// name them.
    pub curves: Option<Arc<Curves>>,
    /// Seconds a running job loses to a stop-free resize.
    pub resize_cost: f64,
    /// Seconds a job loses to a restart (resuming after preemption, or every resize of the
    /// restart-based variant).
    pub restart_cost: f64,
    /// Seconds from a job's first start until it trains (its servers' and workers' start).
    pub start_cost: f64,
    /// Seconds a stop-free growth's new workers take to start training: the job runs on at
    /// its old size meanwhile.
    pub join_cost: f64,
    /// The least time between two resizes of a running job (the scheduler's
    /// `resize_interval`).
    pub min_interval: f64,
    /// Resize by restarting (checkpoint, stop, start) instead of stop-free.
    pub resize_by_restart: bool,
    /// An elastic job may use up to this many times the GPUs it asked for.
    pub max_factor: u32,
    /// An elastic job needs at least this share of the GPUs it asked for (rounded up, at
    /// least one).
    pub min_share: f64,
    /// The most of a job's time its resizes may cost (the rate limit).
    pub overhead: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            gpus: 64,
            speed: Speedup::Amdahl { serial: 0.05 },
            curves: None,
            resize_cost: 0.014,
            restart_cost: 30.0,
            start_cost: 0.0,
            join_cost: 0.0,
            min_interval: 0.0,
            resize_by_restart: false,
            max_factor: 2,
            min_share: 0.25,
            overhead: 0.05,
        }
    }
}

/// One job's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobOutcome {
    /// Submission time.
    pub submit: f64,
    /// First start.
    pub start: f64,
    /// Completion.
    pub finish: f64,
    /// GPUs asked for.
    pub requested: u32,
    /// Resizes while running.
    pub resizes: u32,
    /// Times it was stopped and started again: resumptions after a preemption, and resizes
    /// by restart (which count as resizes too).
    pub restarts: u32,
}

/// A policy's figures on a trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// The policy (and `+restart` for the restart-based variant).
    pub policy: String,
    /// Jobs completed.
    pub jobs: usize,
    /// Mean job completion time, seconds.
    pub mean_jct: f64,
    /// 99th percentile of the job completion time, seconds.
    pub p99_jct: f64,
    /// From the first submission to the last completion, seconds.
    pub makespan: f64,
    /// Mean time from submission to first start, seconds.
    pub mean_queue: f64,
    /// GPU-seconds spent training over GPU-seconds available during the makespan.
    pub utilization: f64,
    /// Resizes of running jobs.
    pub resizes: u64,
    /// Stops and starts again: resumptions after preemption, and resizes by restart.
    pub restarts: u64,
    /// Decisions the simulation took (arrivals, completions, wake-ups).
    pub events: u64,
}

#[derive(Clone, Debug)]
struct State {
    work: f64,
    left: f64,
    pause_until: f64,
    /// Until then (a growth's new workers starting), the job trains at `slow_alloc` GPUs.
    slow_until: f64,
    slow_alloc: u32,
    start: Option<f64>,
    finish: Option<f64>,
    ran: bool,
    resizes: u32,
    restarts: u32,
    speed: Arc<Speedup>,
}

/// Relative precision of completion.
const EPS: f64 = 1e-9;

/// Replays `jobs` (in submission order) under `policy`.
///
/// The jobs that have arrived and not finished are kept as the policy sees them
/// ([`JobView`]s in arrival order), updated in place: an event costs the policy's decision and
/// a pass over those jobs, never a rebuild.
pub fn simulate(
    jobs: &[TraceJob],
    policy: &mut dyn Policy,
    cfg: &SimConfig,
) -> anyhow::Result<(Summary, Vec<JobOutcome>)> {
    anyhow::ensure!(cfg.gpus > 0, "a cluster needs at least one GPU");
    anyhow::ensure!(
        cfg.overhead > 0.0 && cfg.overhead <= 1.0,
        "the resize overhead must be above 0 and at most 1"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&cfg.min_share),
        "the minimum share must be 0 to 1"
    );
    let gpus = cfg.gpus;
    let default_speed = Arc::new(cfg.speed.clone());
    let mut st: Vec<State> = jobs
        .iter()
        .map(|j| {
            let speed = cfg
                .curves
                .as_ref()
                .map_or_else(|| default_speed.clone(), |c| c.for_job(j));
            let work = j.duration * speed.at(j.gpus.min(gpus));
            State {
                work,
                left: work,
                pause_until: 0.0,
                slow_until: 0.0,
                slow_alloc: 0,
                start: None,
                finish: None,
                ran: false,
                resizes: 0,
                restarts: 0,
                speed,
            }
        })
        .collect();
    let resize_cost = if cfg.resize_by_restart {
        cfg.restart_cost
    } else {
        cfg.resize_cost
    };
    let view = |i: usize, s: &State| JobView {
        id: i,
        submit: jobs[i].submit,
        requested: jobs[i].gpus.min(gpus),
        min: ((f64::from(jobs[i].gpus.min(gpus)) * cfg.min_share).ceil() as u32).clamp(1, gpus),
        max: (jobs[i].gpus.saturating_mul(cfg.max_factor)).clamp(1, gpus),
        alloc: 0,
        attained: 0.0,
        resize_after: 0.0,
        priority: 0,
        speed: s.speed.clone(),
    };
    // The jobs that have arrived and not finished, in arrival order.
    let mut active: Vec<JobView> = Vec::new();
    let mut next = 0usize;
    let mut t = jobs.first().map_or(0.0, |j| j.submit);
    let mut busy = 0.0f64;
    let mut events = 0u64;
    loop {
        events += 1;
        // Arrivals due, then the policy's decision.
        while next < jobs.len() && jobs[next].submit <= t {
            active.push(view(next, &st[next]));
            next += 1;
        }
        if !active.is_empty() {
            let want = policy.allocate(t, gpus, &active);
            anyhow::ensure!(want.len() == active.len(), "the policy skipped jobs");
            let total: u64 = want.iter().map(|&w| u64::from(w)).sum();
            anyhow::ensure!(
                total <= u64::from(gpus),
                "{} allocated {total} of {gpus} GPUs at {t} s",
                policy.name()
            );
            for (v, &w) in active.iter_mut().zip(&want) {
                let old = v.alloc;
                if w == old {
                    continue;
                }
                let s = &mut st[v.id];
                if old == 0 {
                    // A start, or a resumption after a preemption.
                    let cost = if s.ran {
                        cfg.restart_cost
                    } else {
                        cfg.start_cost
                    };
                    if s.ran {
                        s.restarts += 1;
                    }
                    s.pause_until = t + cost;
                    s.ran = true;
                    s.start.get_or_insert(t);
                } else if w > 0 {
                    s.resizes += 1;
                    // A resize by restart stops and starts the job again.
                    if cfg.resize_by_restart {
                        s.restarts += 1;
                    }
                    s.pause_until = t.max(s.pause_until) + resize_cost;
                    // A stop-free growth: the job trains at the size it had until the new
                    // workers start.
                    let had = if t < s.slow_until { s.slow_alloc } else { old };
                    let joining = !cfg.resize_by_restart && w > had && cfg.join_cost > 0.0;
                    if joining {
                        s.slow_alloc = had;
                        s.slow_until = s.pause_until + cfg.join_cost;
                    } else {
                        s.slow_until = 0.0;
                    }
                    let cost = resize_cost + if joining { cfg.join_cost } else { 0.0 };
                    v.resize_after = t + cfg.min_interval.max(cost / cfg.overhead);
                }
                v.alloc = w;
            }
        }
        // The next event: an arrival, a completion, a rate limit running out, or a time the
        // policy asks to decide again.
        let mut until = jobs.get(next).map_or(f64::INFINITY, |j| j.submit);
        if let Some(w) = policy.wake_after(t, &active).filter(|w| *w > t) {
            until = until.min(w);
        }
        let elastic = policy.elastic();
        for v in &active {
            if v.alloc > 0 {
                let done = finish_time(&st[v.id], v.alloc, t);
                until = until.min(done);
                if elastic && v.resize_after > t {
                    until = until.min(v.resize_after);
                }
            }
        }
        if !until.is_finite() {
            anyhow::ensure!(
                active.is_empty(),
                "{} left {} jobs waiting with nothing running",
                policy.name(),
                active.len()
            );
            break;
        }
        let mut ended = false;
        for v in &mut active {
            if v.alloc == 0 {
                continue;
            }
            let s = &mut st[v.id];
            let from = t.max(s.pause_until).min(until);
            let eff = until - from;
            s.left -= trained(s, v.alloc, t, until);
            v.attained += f64::from(v.alloc) * (until - t);
            busy += f64::from(v.alloc) * eff;
            if s.left <= EPS * s.work.max(1.0) {
                s.left = 0.0;
                s.finish = Some(until);
                ended = true;
            }
        }
        t = until;
        if ended {
            active.retain(|v| {
                let done = st[v.id].finish.is_some();
                if done {
                    policy.forget(v.id);
                }
                !done
            });
        }
    }
    let outcomes: Vec<JobOutcome> = jobs
        .iter()
        .zip(&st)
        .map(|(j, s)| JobOutcome {
            submit: j.submit,
            start: s.start.unwrap_or(j.submit),
            finish: s.finish.unwrap_or(j.submit),
            requested: j.gpus,
            resizes: s.resizes,
            restarts: s.restarts,
        })
        .collect();
    let mut summary = summarize(
        &format!(
            "{}{}",
            policy.name(),
            if cfg.resize_by_restart && policy.elastic() {
                "+restart"
            } else {
                ""
            }
        ),
        &outcomes,
        busy,
        gpus,
    );
    summary.events = events;
    Ok((summary, outcomes))
}

/// The work job `s` holding `alloc` GPUs does from `t` to `until`: nothing while paused, at
/// its old size while a growth's workers join, then at `alloc`.
fn trained(s: &State, alloc: u32, t: f64, until: f64) -> f64 {
    let from = t.max(s.pause_until).min(until);
    let slow_end = s.slow_until.clamp(from, until);
    (slow_end - from) * s.speed.at(s.slow_alloc) + (until - slow_end) * s.speed.at(alloc)
}

/// When job `s` holding `alloc` GPUs from `t` on finishes, if nothing changes.
fn finish_time(s: &State, alloc: u32, t: f64) -> f64 {
    let from = t.max(s.pause_until);
    let mut left = s.left;
    let mut at = from;
    if s.slow_until > from {
        let slow = s.speed.at(s.slow_alloc);
        let can = (s.slow_until - from) * slow;
        if can >= left && slow > 0.0 {
            return from + left / slow;
        }
        left -= can;
        at = s.slow_until;
    }
    at + left / s.speed.at(alloc)
}

fn summarize(policy: &str, out: &[JobOutcome], busy: f64, gpus: u32) -> Summary {
    let n = out.len();
    let mut jct: Vec<f64> = out.iter().map(|o| o.finish - o.submit).collect();
    jct.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let p99 = if n == 0 {
        0.0
    } else {
        jct[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1]
    };
    let first = out.iter().map(|o| o.submit).fold(f64::INFINITY, f64::min);
    let last = out
        .iter()
        .map(|o| o.finish)
        .fold(f64::NEG_INFINITY, f64::max);
    let makespan = if n == 0 { 0.0 } else { last - first };
    let queue: Vec<f64> = out.iter().map(|o| o.start - o.submit).collect();
    Summary {
        policy: policy.to_string(),
        jobs: n,
        mean_jct: mean(&jct),
        p99_jct: p99,
        makespan,
        mean_queue: mean(&queue),
        utilization: if makespan > 0.0 {
            busy / (f64::from(gpus) * makespan)
        } else {
            0.0
        },
        resizes: out.iter().map(|o| u64::from(o.resizes)).sum(),
        restarts: out.iter().map(|o| u64::from(o.restarts)).sum(),
        events: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Elastic, Fifo, Goodput, Tiresias};

    fn j(submit: f64, gpus: u32, duration: f64) -> TraceJob {
        TraceJob {
            submit,
            gpus,
            duration,
            model: None,
            batch: None,
        }
    }

    fn cfg(gpus: u32) -> SimConfig {
        SimConfig {
            gpus,
            speed: Speedup::Linear,
            curves: None,
            resize_cost: 0.0,
            restart_cost: 0.0,
            start_cost: 0.0,
            join_cost: 0.0,
            min_interval: 0.0,
            resize_by_restart: false,
            max_factor: 2,
            min_share: 0.0,
            overhead: 1.0,
        }
    }

    fn finishes(out: &[JobOutcome]) -> Vec<f64> {
        out.iter().map(|o| o.finish).collect()
    }

    // Three jobs on 4 GPUs, linear speed, free resizes:
    //   A at 0 s, 2 GPUs for 100 s (200 GPU-s); B at 10 s, 4 GPUs for 50 s (200 GPU-s);
    //   C at 20 s, 1 GPU for 40 s (40 GPU-s).
    fn tiny() -> Vec<TraceJob> {
        vec![j(0.0, 2, 100.0), j(10.0, 4, 50.0), j(20.0, 1, 40.0)]
    }

    #[test]
    fn fifo_by_hand() {
        // A runs 0-100 on 2 GPUs; B (4 GPUs) waits for A: 100-150; C waits behind B (strict
        // FIFO): 150-190.
        let (s, out) = simulate(&tiny(), &mut Fifo, &cfg(4)).expect("sim");
        assert_eq!(finishes(&out), vec![100.0, 150.0, 190.0]);
        assert_eq!(s.mean_jct, (100.0 + 140.0 + 170.0) / 3.0);
        assert_eq!(s.makespan, 190.0);
        assert_eq!(s.mean_queue, (0.0 + 90.0 + 130.0) / 3.0);
        assert!((s.utilization - 440.0 / (4.0 * 190.0)).abs() < 1e-12);
    }

    #[test]
    fn tiresias_by_hand() {
        // Limit 100 GPU-s (two queues); a job runs with all its GPUs or not at all.
        //  0 s: A runs (2).  10 s: B (4) does not fit beside A and waits behind it.
        // 20 s: C runs beside A (fit-first: B is skipped).
        // 50 s: A crosses 100 GPU-s and joins the second queue. The first queue: C (running,
        //       ahead of the waiting B) keeps its GPU; B (4) still does not fit; A (2) runs on.
        // 60 s: C done. B takes all 4; A (60 of 100 s done) is preempted.
        // 85 s: B crosses 100 GPU-s and joins the back of the second queue, behind A: A
        //       resumes (2), B (4) no longer fits and is preempted (25 of 50 s done).
        // 125 s: A done; B resumes: 25 s more, done at 150 s. Two resumptions.
        let mut p = Tiresias::new(vec![100.0]);
        let (s, out) = simulate(&tiny(), &mut p, &cfg(4)).expect("sim");
        assert_eq!(finishes(&out), vec![125.0, 150.0, 60.0]);
        assert_eq!(s.restarts, 2);
        assert_eq!(s.resizes, 0);
    }

    #[test]
    fn tiresias_keeps_running_jobs_ahead_of_waiting_ones_in_a_queue() {
        // 8 GPUs, limit 100 GPU-s. Y (8 GPUs, 1000 s) crosses the limit at 12.5 s and runs on
        // alone. X (4) at 20 s and Z (4) at 21 s preempt it from the first queue. X crosses at
        // 45 s and runs on (Y, waiting in the second queue, does not fit beside Z); Z crosses
        // at 46 s and runs on too; Z ends at 50 s. Now Y (earlier) waits behind X (running) in the second
        // queue: X keeps its GPUs to the end (120 s) instead of Y preempting it, as ordering
        // the queue by arrival would; then Y runs the 980 s it has left.
        let jobs = vec![j(0.0, 8, 1000.0), j(20.0, 4, 100.0), j(21.0, 4, 29.0)];
        let mut p = Tiresias::new(vec![100.0]);
        let (_, out) = simulate(&jobs, &mut p, &cfg(8)).expect("sim");
        assert_eq!(finishes(&out), vec![1100.0, 120.0, 50.0]);
        assert_eq!(out[1].restarts, 0, "X is never preempted");
    }

    #[test]
    fn elastic_by_hand() {
        // A alone grows to 4 GPUs (max 2x2): 40 GPU-s done by 10 s (10 s x 4). B arrives: both
        // get their minimum (1), then up to what they asked for round robin: A 2, B 2 (4 in
        // all). At 20 s C arrives: minimums A 1, B 1, C 1, then A 2 (asked 2), B... one slot
        // left goes to A first (arrival order): A 2, B 1, C 1.
        // A: 40 + 2*10 = 60 by 20 s; left 140 at 2 GPU/s -> would end at 90.
        // B: 20 by 20 s; left 180 at 1/s.  C: 40 at 1/s -> ends at 60.
        // At 60: C done; A has 60+80=140, left 60; B 20+40=60, left 140. Slots: A 1,B 1, then
        // requested caps A 2, B 2: A 2, B 2. A ends at 90; B has 60+60=120 left 80.
        // At 90: B alone, grows to 4 (max 8 capped at 4): 80/4 = 20 s -> 110.
        let (s, out) = simulate(&tiny(), &mut Elastic, &cfg(4)).expect("sim");
        assert_eq!(finishes(&out), vec![90.0, 110.0, 60.0]);
        assert!(s.resizes > 0);
        assert_eq!(s.utilization, 1.0);
    }

    #[test]
    fn goodput_by_hand_under_linear_speed_spreads_like_elastic_in_capacity() {
        // With linear speed every slot buys the same; goodput keeps the cluster full too.
        let (s, out) = simulate(&tiny(), &mut Goodput, &cfg(4)).expect("sim");
        assert_eq!(s.utilization, 1.0);
        assert!(out.iter().all(|o| o.finish > o.submit));
        // Total work 440 GPU-s on 4 GPUs from 0 with no idle slot: done at 110.
        assert_eq!(s.makespan, 110.0);
    }

    #[test]
    fn a_growth_trains_at_the_old_size_until_its_workers_join() {
        // 4 GPUs: A (2 GPUs, 100 s: 200 GPU-s) and B (2, 10 s) at 0. B ends at 10 s and A
        // grows to 4; its new workers take 5 s to join: 20 done by 10 s, 10 more by 15 s at
        // 2 GPUs, the 170 left at 4: done at 57.5 s (55 s if they joined at once).
        let jobs = vec![j(0.0, 2, 100.0), j(0.0, 2, 10.0)];
        let mut c = cfg(4);
        c.join_cost = 5.0;
        let (_, out) = simulate(&jobs, &mut Elastic, &c).expect("sim");
        assert_eq!(finishes(&out), vec![57.5, 10.0]);
        c.join_cost = 0.0;
        let (_, out) = simulate(&jobs, &mut Elastic, &c).expect("sim");
        assert_eq!(finishes(&out), vec![55.0, 10.0]);
        // A first start costs start_cost.
        c.start_cost = 2.0;
        let (_, out) = simulate(&jobs, &mut Elastic, &c).expect("sim");
        assert_eq!(out[1].finish, 12.0);
    }

    #[test]
    fn costs_and_the_rate_limit_slow_elastic_down() {
        let mut c = cfg(4);
        c.restart_cost = 5.0;
        c.resize_by_restart = true;
        c.overhead = 0.05;
        let (restart, _) = simulate(&tiny(), &mut Elastic, &c).expect("sim");
        let (free, _) = simulate(&tiny(), &mut Elastic, &cfg(4)).expect("sim");
        assert!(restart.mean_jct > free.mean_jct, "{restart:?} {free:?}");
        assert_eq!(restart.policy, "elastic+restart");
    }

    #[test]
    fn the_same_inputs_give_the_same_schedule() {
        let trace: Vec<TraceJob> = (0..200)
            .map(|i| {
                j(
                    f64::from(i * 37 % 500),
                    1 + (i % 7),
                    30.0 + f64::from(i % 13) * 17.0,
                )
            })
            .collect();
        let mut sorted = trace.clone();
        sorted.sort_by(|a, b| a.submit.total_cmp(&b.submit));
        let c = SimConfig {
            gpus: 16,
            ..SimConfig::default()
        };
        for name in ["fifo", "tiresias", "elastic", "goodput"] {
            let mut p = crate::policy::by_name(name).expect("policy");
            let a = simulate(&sorted, p.as_mut(), &c).expect("sim");
            let mut p = crate::policy::by_name(name).expect("policy");
            let b = simulate(&sorted, p.as_mut(), &c).expect("sim");
            assert_eq!(a, b, "{name}");
            assert_eq!(a.0.jobs, 200);
            assert!(a.0.utilization <= 1.0 + 1e-9, "{name}: {:?}", a.0);
        }
    }
}
