//! Scheduling policies behind one trait, the same code for the simulator and (next) the
//! scheduler service: given the jobs that have arrived and not finished, each policy says how
//! many GPU slots each should hold now.
//!
//! - [`Fifo`]: static FIFO with gang scheduling, the baseline: a job runs with exactly the
//!   GPUs it asked for, in arrival order; the first job that does not fit blocks the rest.
//! - [`Tiresias`]: least attained service (discretized in two queues, as Tiresias does),
//!   preemptive and non-elastic: jobs in the first queue (less than a threshold of GPU-seconds
//!   attained) come first, each by arrival; a job runs with all its GPUs or not at all, and a
//!   preempted job pays a restart when it resumes.
//! - [`Elastic`]: every job gets its minimum in arrival order (running jobs shrink for
//!   arrivals), then the idle slots go to jobs up to what they asked for, then up to their
//!   maximum, one slot at a time in arrival order.
//! - [`Goodput`]: like [`Elastic`] for the minimums, then each idle slot goes to the job it
//!   speeds up the most, relative to the job's speed at the size it asked for (from the
//!   scaling curve, [`Speedup`]).
//!
//! A running job is resized at most once per [`JobView`]'s `resize_after` (the caller's rate
//! limit, from the resize's measured cost): until then it keeps its size.

use std::sync::Arc;

use crate::speed::Speedup;

/// A job as a policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct JobView {
    /// Names the job to stateful policies ([`Tiresias`]'s queues) from one decision to the
    /// next: unique among the jobs that have not ended, small (an index).
    pub id: usize,
    /// Arrival time, seconds.
    pub submit: f64,
    /// GPUs it asked for.
    pub requested: u32,
    /// Fewest GPUs it can run with (elastic policies).
    pub min: u32,
    /// Most GPUs it can use (elastic policies).
    pub max: u32,
    /// GPUs it holds now.
    pub alloc: u32,
    /// GPU-seconds it has held so far.
    pub attained: f64,
    /// Until when a running job may not be resized (rate limit); it keeps `alloc` before.
    pub resize_after: f64,
    /// Higher goes first wherever a policy goes by arrival (0 in traces).
    pub priority: i32,
    /// Its speed by GPU count ([`Goodput`] puts slots where they buy the most of it).
    pub speed: Arc<Speedup>,
}

impl JobView {
    fn locked(&self, now: f64) -> bool {
        self.alloc > 0 && now < self.resize_after
    }
}

/// A scheduling policy.
pub trait Policy {
    /// Its name in tables.
    fn name(&self) -> String;
    /// Whether it resizes running jobs.
    fn elastic(&self) -> bool;
    /// The GPUs each job of `jobs` should hold at `now`, in the same order, on a cluster of
    /// `gpus`. The sum never exceeds `gpus`.
    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView]) -> Vec<u32>;
    /// When the policy wants to decide again without an arrival or completion (e.g. a job
    /// crossing a priority threshold), if ever.
    fn wake_after(&self, _now: f64, _jobs: &[JobView]) -> Option<f64> {
        None
    }
    /// Job `id` has ended: a stateful policy drops what it kept about it.
    fn forget(&mut self, _id: usize) {}
}

/// Indices of `jobs` by priority (highest first), then arrival, then index.
fn by_arrival(jobs: &[JobView]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| {
        jobs[b]
            .priority
            .cmp(&jobs[a].priority)
            .then(jobs[a].submit.total_cmp(&jobs[b].submit))
            .then(a.cmp(&b))
    });
    order
}

/// Static FIFO with gang scheduling.
#[derive(Debug, Default)]
pub struct Fifo;

impl Policy for Fifo {
    fn name(&self) -> String {
        "fifo".into()
    }

    fn elastic(&self) -> bool {
        false
    }

    fn allocate(&mut self, _now: f64, gpus: u32, jobs: &[JobView]) -> Vec<u32> {
        let mut out: Vec<u32> = jobs.iter().map(|j| j.alloc).collect();
        let mut free = gpus.saturating_sub(out.iter().sum());
        for i in by_arrival(jobs) {
            if out[i] > 0 {
                continue;
            }
            let want = jobs[i].requested.min(gpus);
            if want > free {
                break;
            }
            out[i] = want;
            free -= want;
        }
        out
    }
}

/// Tiresias's discretized two-dimensional least attained service (2D-LAS, Gu et al., NSDI
/// 2019), as its published simulator (`dlas-gpu` in SymbioticLab/Tiresias) runs it:
///
/// - a job's attained service is the GPU-seconds it has held; queue `k` holds the jobs with
///   attained service below `limits[k]` (and at least `limits[k - 1]`), the last queue the rest;
/// - a new job joins the back of the first queue; a job that crosses its queue's limit joins
///   the back of the next one;
/// - at every decision the queues are scanned in order, each front to back, and a job runs
///   (with all its GPUs, or not at all) if it fits in what the jobs scanned before it left:
///   a job that does not fit is skipped, not waited for;
/// - after each decision, every queue keeps its running jobs at the front in their order and
///   moves its waiting jobs behind them, in theirs (so a running job is preempted only by a job
///   of a higher queue, never by one of its own).
///
/// - with starvation handling on (`starvation` K > 0, off in the simulator's `dlas-gpu`, on in
///   its `dlas-gpu-K`), a job of a lower queue that has waited K times as long as it has run
///   since it last entered the first queue goes back to the back of the first queue, its
///   attained service counted from zero again.
///
/// Preemption has no cost of its own here; the simulator charges a resumed job a restart.
/// Priorities (0 in traces) go before queues.
#[derive(Debug)]
pub struct Tiresias {
    /// Attained GPU-seconds at which a job leaves queue `k` for queue `k + 1`, ascending.
    pub limits: Vec<f64>,
    /// Starvation handling: a waiting job of a lower queue goes back to the first once it has
    /// waited this many times as long as it has run (0: never).
    pub starvation: f64,
    /// Wake up to demote a running job when the Tiresias simulator does rather than when it
    /// crosses its limit: its wake-ups are timed as if a job's GPU-seconds were its running
    /// seconds, so a multi-GPU job is demoted later (at the next decision after it crosses).
    /// For comparing with it; off by default.
    pub reference_wakeups: bool,
    /// Every job's queue and place in it, by [`JobView::id`].
    places: Vec<Option<Place>>,
    /// The next place at the back of a queue.
    seq: u64,
}

#[derive(Clone, Copy, Debug)]
struct Place {
    queue: usize,
    seq: u64,
    /// Attained GPU-seconds when it last entered the first queue (its service counts from
    /// there).
    base: f64,
    /// Seconds it has waited, having run, since it last entered the first queue.
    waited: f64,
    /// When the policy last decided with it.
    seen: f64,
}

impl Place {
    fn new(queue: usize, seq: u64, now: f64) -> Place {
        Place {
            queue,
            seq,
            base: 0.0,
            waited: 0.0,
            seen: now,
        }
    }
}

impl Default for Tiresias {
    fn default() -> Self {
        Tiresias::new(vec![DEFAULT_LAS_LIMIT])
    }
}

/// The limit of [`Tiresias::default`]: one GPU-hour, two queues (`edl-sim` uses the Tiresias
/// simulator's 3,250 and 7,200 GPU-seconds, three queues).
pub const DEFAULT_LAS_LIMIT: f64 = 3600.0;

impl Tiresias {
    /// 2D-LAS with these queue limits (GPU-seconds, ascending; `limits.len() + 1` queues).
    pub fn new(mut limits: Vec<f64>) -> Tiresias {
        limits.retain(|l| l.is_finite() && *l > 0.0);
        limits.sort_by(f64::total_cmp);
        Tiresias {
            limits,
            starvation: 0.0,
            reference_wakeups: false,
            places: Vec::new(),
            seq: 0,
        }
    }

    /// With starvation handling: a waiting job goes back to the first queue after waiting
    /// `k` times as long as it ran (0: never).
    pub fn with_starvation(mut self, k: f64) -> Tiresias {
        self.starvation = if k.is_finite() { k.max(0.0) } else { 0.0 };
        self
    }

    /// With [`Tiresias::reference_wakeups`].
    pub fn with_reference_wakeups(mut self, on: bool) -> Tiresias {
        self.reference_wakeups = on;
        self
    }

    /// Seconds job `j` has run since it last entered the first queue.
    fn ran(j: &JobView, p: &Place) -> f64 {
        (j.attained - p.base).max(0.0) / f64::from(j.requested.max(1))
    }

    /// The queue a job with `attained` GPU-seconds belongs in at least (within rounding).
    fn queue_of(&self, attained: f64, from: usize) -> usize {
        let mut q = from;
        while q < self.limits.len() && attained >= self.limits[q] - 1e-6 {
            q += 1;
        }
        q
    }

    fn back(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}

impl Policy for Tiresias {
    fn name(&self) -> String {
        "tiresias".into()
    }

    fn elastic(&self) -> bool {
        false
    }

    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView]) -> Vec<u32> {
        // New jobs join the first queue in arrival order; crossing a limit moves a job to the
        // back of its next queue; a starving one goes back to the first.
        for i in by_arrival(jobs) {
            let j = &jobs[i];
            if self.places.len() <= j.id {
                self.places.resize(j.id + 1, None);
            }
            let Some(mut p) = self.places[j.id] else {
                let seq = self.back();
                let queue = self.queue_of(j.attained, 0);
                self.places[j.id] = Some(Place::new(queue, seq, now));
                continue;
            };
            let ran = Tiresias::ran(j, &p);
            if j.alloc == 0 && ran > 0.0 {
                p.waited += now - p.seen;
            }
            p.seen = now;
            let queue = self.queue_of(j.attained - p.base, p.queue);
            if queue != p.queue {
                p.queue = queue;
                p.seq = self.back();
            } else if self.starvation > 0.0
                && p.queue > 0
                && j.alloc == 0
                && ran > 0.0
                && p.waited >= ran * self.starvation - 1e-6
            {
                p = Place::new(0, self.back(), now);
                p.base = j.attained;
            }
            self.places[j.id] = Some(p);
        }
        let place = |j: &JobView, places: &[Option<Place>]| {
            places[j.id].map_or((usize::MAX, u64::MAX), |p| (p.queue, p.seq))
        };
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&i| {
            let (q, s) = place(&jobs[i], &self.places);
            (std::cmp::Reverse(jobs[i].priority), q, s)
        });
        let mut out = vec![0; jobs.len()];
        let mut free = gpus;
        for &i in &order {
            let want = jobs[i].requested.clamp(1, gpus);
            if want <= free {
                out[i] = want;
                free -= want;
            }
        }
        // Waiting jobs go behind the running ones of their queue, in their order.
        for &i in &order {
            if out[i] == 0 {
                let seq = self.back();
                if let Some(p) = self.places[jobs[i].id].as_mut() {
                    p.seq = seq;
                }
            }
        }
        out
    }

    /// When the first running job crosses its queue's limit, or the first waiting one has
    /// starved.
    fn wake_after(&self, now: f64, jobs: &[JobView]) -> Option<f64> {
        jobs.iter()
            .filter_map(|j| {
                let p = self.places.get(j.id).copied().flatten()?;
                if j.alloc > 0 {
                    let limit = self.limits.get(p.queue)?;
                    let (g, served) = (f64::from(j.alloc), j.attained - p.base);
                    let after = if self.reference_wakeups {
                        // Its limit less its running seconds, over its GPUs, whole seconds.
                        ((limit - served / g) / g).floor()
                    } else {
                        (limit - served) / g
                    };
                    Some(now + after.max(0.0))
                } else if self.starvation > 0.0 && p.queue > 0 {
                    let ran = Tiresias::ran(j, &p);
                    (ran > 0.0).then(|| now + (ran * self.starvation - p.waited).max(0.0))
                } else {
                    None
                }
            })
            .min_by(f64::total_cmp)
    }

    fn forget(&mut self, id: usize) {
        if let Some(p) = self.places.get_mut(id) {
            *p = None;
        }
    }
}

/// Grows jobs into idle slots and shrinks them for arrivals.
#[derive(Debug, Default)]
pub struct Elastic;

/// Gives every job its minimum in arrival order (locked jobs keep their size); returns the
/// allocation and the free slots left.
fn minimums(now: f64, gpus: u32, jobs: &[JobView], order: &[usize]) -> (Vec<u32>, u32) {
    let mut out = vec![0u32; jobs.len()];
    let mut free = gpus;
    // Jobs that may not be resized keep what they hold.
    for (i, j) in jobs.iter().enumerate() {
        if j.locked(now) {
            out[i] = j.alloc;
            free -= j.alloc.min(free);
        }
    }
    // Running jobs first (they are not stopped for newcomers), then the queue, by arrival.
    for running in [true, false] {
        for &i in order {
            if free == 0 {
                break;
            }
            let j = &jobs[i];
            if (j.alloc > 0) != running || out[i] > 0 {
                continue;
            }
            let min = j.min.clamp(1, gpus);
            if min <= free {
                out[i] = min;
                free -= min;
            }
        }
    }
    (out, free)
}

/// Hands `free` slots out one at a time, round robin over `order`, to the jobs `may_grow`
/// allows, each up to `cap` (the rounds computed at once: every job gets `min(deficit, L)`
/// for the most full rounds `L` that fit, then one more each in order while slots last).
fn round_robin(
    out: &mut [u32],
    free: &mut u32,
    order: &[usize],
    may_grow: impl Fn(usize) -> bool,
    cap: impl Fn(usize) -> u32,
) {
    let deficit: Vec<(usize, u32)> = order
        .iter()
        .copied()
        .filter(|&i| may_grow(i))
        .map(|i| (i, cap(i).saturating_sub(out[i])))
        .filter(|&(_, d)| d > 0)
        .collect();
    if deficit.is_empty() || *free == 0 {
        return;
    }
    let given =
        |rounds: u32| -> u64 { deficit.iter().map(|&(_, d)| u64::from(d.min(rounds))).sum() };
    // The most full rounds that fit: binary search over 0..=the largest deficit.
    let (mut lo, mut hi) = (0u32, deficit.iter().map(|&(_, d)| d).max().unwrap_or(0));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if given(mid) <= u64::from(*free) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    for &(i, d) in &deficit {
        let g = d.min(lo);
        out[i] += g;
        *free -= g;
    }
    for &(i, d) in &deficit {
        if *free == 0 {
            break;
        }
        if d > lo {
            out[i] += 1;
            *free -= 1;
        }
    }
}

impl Policy for Elastic {
    fn name(&self) -> String {
        "elastic".into()
    }

    fn elastic(&self) -> bool {
        true
    }

    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView]) -> Vec<u32> {
        let order = by_arrival(jobs);
        let (mut out, mut free) = minimums(now, gpus, jobs, &order);
        // Up to what each asked for, then up to its maximum: one slot at a time, round robin
        // in arrival order.
        let grows = |i: usize| !jobs[i].locked(now);
        let started: Vec<bool> = out.iter().map(|&o| o > 0).collect();
        let may = |i: usize| started[i] && grows(i);
        round_robin(&mut out, &mut free, &order, may, |i| {
            jobs[i].requested.min(jobs[i].max)
        });
        round_robin(&mut out, &mut free, &order, may, |i| jobs[i].max);
        out
    }
}

/// Puts each idle slot where it adds the most (relative) throughput.
#[derive(Debug, Default)]
pub struct Goodput;

/// A candidate for the next slot: the most gain first, then the job holding fewer slots, then
/// the earlier in arrival order.
#[derive(PartialEq)]
struct Gain {
    gain: f64,
    holds: u32,
    pos: usize,
    job: usize,
}

impl Eq for Gain {}

impl Ord for Gain {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.gain
            .total_cmp(&o.gain)
            .then(o.holds.cmp(&self.holds))
            .then(o.pos.cmp(&self.pos))
    }
}

impl PartialOrd for Gain {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Policy for Goodput {
    fn name(&self) -> String {
        "goodput".into()
    }

    fn elastic(&self) -> bool {
        true
    }

    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView]) -> Vec<u32> {
        let order = by_arrival(jobs);
        let (mut out, mut free) = minimums(now, gpus, jobs, &order);
        // The gain of job i's next slot, relative to its speed at the size it asked for.
        let gain = |i: usize, holds: u32| {
            let j = &jobs[i];
            let nominal = j.speed.at(j.requested).max(f64::MIN_POSITIVE);
            (j.speed.at(holds + 1) - j.speed.at(holds)) / nominal
        };
        let mut heap: std::collections::BinaryHeap<Gain> = order
            .iter()
            .enumerate()
            .filter(|&(_, &i)| out[i] > 0 && !jobs[i].locked(now) && out[i] < jobs[i].max)
            .map(|(pos, &i)| Gain {
                gain: gain(i, out[i]),
                holds: out[i],
                pos,
                job: i,
            })
            .collect();
        while free > 0 {
            let Some(mut best) = heap.pop() else { break };
            if best.gain <= 0.0 {
                break;
            }
            // The best job takes slots while its next one still beats every other job's.
            let i = best.job;
            loop {
                out[i] += 1;
                free -= 1;
                best.holds = out[i];
                best.gain = gain(i, out[i]);
                if free == 0 || out[i] >= jobs[i].max || best.gain <= 0.0 {
                    break;
                }
                if heap.peek().is_some_and(|top| *top > best) {
                    break;
                }
            }
            if out[i] < jobs[i].max && best.gain > 0.0 {
                heap.push(best);
            }
        }
        out
    }
}

/// The policies by name: fifo, tiresias, elastic, goodput.
pub fn by_name(name: &str) -> Option<Box<dyn Policy>> {
    Some(match name {
        "fifo" => Box::new(Fifo),
        "tiresias" => Box::new(Tiresias::default()),
        "elastic" => Box::new(Elastic),
        "goodput" => Box::new(Goodput),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(submit: f64, requested: u32, alloc: u32) -> JobView {
        JobView {
            submit,
            requested,
            min: 1,
            max: requested * 2,
            alloc,
            attained: 0.0,
            resize_after: 0.0,
            priority: 0,
            id: submit as usize,
            speed: Arc::new(Speedup::Linear),
        }
    }

    #[test]
    fn fifo_blocks_behind_the_head_and_never_resizes() {
        let jobs = [job(0.0, 3, 3), job(1.0, 2, 0), job(2.0, 1, 0)];
        // 4 GPUs: job 1 does not fit behind job 0, and job 2 must not jump the queue.
        assert_eq!(Fifo.allocate(2.0, 4, &jobs), vec![3, 0, 0]);
        let jobs = [job(0.0, 3, 0), job(1.0, 1, 0)];
        assert_eq!(Fifo.allocate(0.0, 4, &jobs), vec![3, 1]);
    }

    #[test]
    fn priority_goes_before_arrival() {
        let early = job(0.0, 3, 0);
        let mut urgent = job(5.0, 3, 0);
        urgent.priority = 1;
        // FIFO: the urgent job is the head of the queue although it came later.
        assert_eq!(
            Fifo.allocate(5.0, 4, &[early.clone(), urgent.clone()]),
            vec![0, 3]
        );
        // Elastic: both get their minimum; the idle slot goes to the urgent job.
        assert_eq!(Elastic.allocate(5.0, 3, &[early, urgent]), vec![1, 2]);
    }

    #[test]
    fn tiresias_prefers_the_least_served_and_preempts() {
        let mut a = job(0.0, 4, 4);
        a.attained = 10_000.0;
        let b = job(5.0, 2, 0);
        let c = job(6.0, 4, 0);
        let out = Tiresias::default().allocate(6.0, 4, &[a, b, c]);
        // b (new) first; c does not fit beside it; a is preempted.
        assert_eq!(out, vec![0, 2, 0]);
    }

    #[test]
    fn elastic_shrinks_for_arrivals_and_grows_into_idle_slots() {
        // One job alone grows to its maximum.
        let out = Elastic.allocate(0.0, 8, &[job(0.0, 2, 0)]);
        assert_eq!(out, vec![4]);
        // An arrival: the running job shrinks; both get what they asked for first.
        let out = Elastic.allocate(1.0, 8, &[job(0.0, 2, 4), job(1.0, 4, 0)]);
        assert_eq!(out, vec![3, 5]);
        // A locked job keeps its size; the newcomer gets the rest.
        let mut a = job(0.0, 2, 4);
        a.resize_after = 10.0;
        let out = Elastic.allocate(1.0, 8, &[a, job(1.0, 4, 0)]);
        assert_eq!(out, vec![4, 4]);
        // More jobs than slots: minimums in arrival order, running ones first.
        let jobs = [job(0.0, 2, 2), job(1.0, 1, 0), job(2.0, 1, 0)];
        assert_eq!(Elastic.allocate(2.0, 2, &jobs), vec![1, 1, 0]);
    }

    #[test]
    fn goodput_puts_slots_where_they_buy_the_most() {
        // With diminishing returns, a second slot for the small job buys more of its
        // nominal speed than a fifth for the big one.
        let s = Arc::new(Speedup::Amdahl { serial: 0.2 });
        let (mut a, mut b) = (job(0.0, 4, 0), job(0.0, 1, 0));
        a.speed = s.clone();
        b.speed = s;
        let out = Goodput.allocate(0.0, 6, &[a, b]);
        assert_eq!(out.iter().sum::<u32>(), 6);
        assert_eq!(out[1], 2, "{out:?}");
        // Linear scaling and equal sizes: slots are spread evenly.
        let out = Goodput.allocate(0.0, 4, &[job(0.0, 2, 0), job(0.0, 2, 0)]);
        assert_eq!(out, vec![2, 2]);
    }
}
