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

use crate::speed::Speedup;

/// A job as a policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct JobView {
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
    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView], speed: &Speedup) -> Vec<u32>;
    /// When the policy wants to decide again without an arrival or completion (e.g. a job
    /// crossing a priority threshold), if ever.
    fn wake_after(&self, _now: f64, _jobs: &[JobView]) -> Option<f64> {
        None
    }
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

    fn allocate(&mut self, _now: f64, gpus: u32, jobs: &[JobView], _speed: &Speedup) -> Vec<u32> {
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

/// Tiresias-style least attained service in two queues.
#[derive(Debug)]
pub struct Tiresias {
    /// GPU-seconds after which a job drops to the second queue.
    pub threshold: f64,
}

impl Default for Tiresias {
    fn default() -> Self {
        // One GPU-hour.
        Tiresias { threshold: 3600.0 }
    }
}

impl Tiresias {
    /// In the second queue (within rounding of the threshold).
    fn demoted(&self, j: &JobView) -> bool {
        j.attained >= self.threshold - 1e-6
    }
}

impl Policy for Tiresias {
    fn name(&self) -> String {
        "tiresias".into()
    }

    fn elastic(&self) -> bool {
        false
    }

    fn allocate(&mut self, _now: f64, gpus: u32, jobs: &[JobView], _speed: &Speedup) -> Vec<u32> {
        let mut order = by_arrival(jobs);
        // Stable: within a queue, by arrival.
        order.sort_by_key(|&i| self.demoted(&jobs[i]));
        let mut out = vec![0; jobs.len()];
        let mut free = gpus;
        for i in order {
            let want = jobs[i].requested.min(gpus);
            if want <= free {
                out[i] = want;
                free -= want;
            }
        }
        out
    }

    /// When the first running job of the first queue crosses the threshold.
    fn wake_after(&self, now: f64, jobs: &[JobView]) -> Option<f64> {
        jobs.iter()
            .filter(|j| j.alloc > 0 && !self.demoted(j))
            .map(|j| now + (self.threshold - j.attained) / f64::from(j.alloc))
            .min_by(f64::total_cmp)
    }
}

/// Grows jobs into idle slots and shrinks them for arrivals.
#[derive(Debug, Default)]
pub struct Elastic;

/// Gives every job its minimum in arrival order (locked jobs keep their size); returns the
/// allocation and the free slots left.
fn minimums(now: f64, gpus: u32, jobs: &[JobView]) -> (Vec<u32>, u32) {
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
    let order = by_arrival(jobs);
    for running in [true, false] {
        for &i in &order {
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

impl Policy for Elastic {
    fn name(&self) -> String {
        "elastic".into()
    }

    fn elastic(&self) -> bool {
        true
    }

    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView], _speed: &Speedup) -> Vec<u32> {
        let (mut out, mut free) = minimums(now, gpus, jobs);
        let order = by_arrival(jobs);
        // Up to what each asked for, then up to its maximum: one slot at a time, round robin
        // in arrival order.
        for cap in [|j: &JobView| j.requested.min(j.max), |j: &JobView| j.max] {
            loop {
                let mut gave = false;
                for &i in &order {
                    let j = &jobs[i];
                    if free == 0 {
                        break;
                    }
                    if out[i] > 0 && !j.locked(now) && out[i] < cap(j) {
                        out[i] += 1;
                        free -= 1;
                        gave = true;
                    }
                }
                if !gave || free == 0 {
                    break;
                }
            }
        }
        out
    }
}

/// Puts each idle slot where it adds the most (relative) throughput.
#[derive(Debug, Default)]
pub struct Goodput;

impl Policy for Goodput {
    fn name(&self) -> String {
        "goodput".into()
    }

    fn elastic(&self) -> bool {
        true
    }

    fn allocate(&mut self, now: f64, gpus: u32, jobs: &[JobView], speed: &Speedup) -> Vec<u32> {
        let (mut out, mut free) = minimums(now, gpus, jobs);
        let order = by_arrival(jobs);
        while free > 0 {
            // The job whose next slot buys the most of its nominal speed; ties to the job
            // holding fewer slots, then by arrival.
            let best = order
                .iter()
                .copied()
                .filter(|&i| out[i] > 0 && !jobs[i].locked(now) && out[i] < jobs[i].max)
                .map(|i| {
                    let j = &jobs[i];
                    let nominal = speed.at(j.requested).max(f64::MIN_POSITIVE);
                    (i, (speed.at(out[i] + 1) - speed.at(out[i])) / nominal)
                })
                .fold(None::<(usize, f64)>, |best, (i, g)| match best {
                    Some((b, bg)) if bg > g + 1e-12 || (bg >= g - 1e-12 && out[b] <= out[i]) => {
                        best
                    }
                    _ => Some((i, g)),
                });
            match best {
                Some((i, g)) if g > 0.0 => {
                    out[i] += 1;
                    free -= 1;
                }
                _ => break,
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
        }
    }

    #[test]
    fn fifo_blocks_behind_the_head_and_never_resizes() {
        let jobs = [job(0.0, 3, 3), job(1.0, 2, 0), job(2.0, 1, 0)];
        // 4 GPUs: job 1 does not fit behind job 0, and job 2 must not jump the queue.
        assert_eq!(
            Fifo.allocate(2.0, 4, &jobs, &Speedup::Linear),
            vec![3, 0, 0]
        );
        let jobs = [job(0.0, 3, 0), job(1.0, 1, 0)];
        assert_eq!(Fifo.allocate(0.0, 4, &jobs, &Speedup::Linear), vec![3, 1]);
    }

    #[test]
    fn priority_goes_before_arrival() {
        let early = job(0.0, 3, 0);
        let mut urgent = job(5.0, 3, 0);
        urgent.priority = 1;
        // FIFO: the urgent job is the head of the queue although it came later.
        assert_eq!(
            Fifo.allocate(5.0, 4, &[early.clone(), urgent.clone()], &Speedup::Linear),
            vec![0, 3]
        );
        // Elastic: both get their minimum; the idle slot goes to the urgent job.
        assert_eq!(
            Elastic.allocate(5.0, 3, &[early, urgent], &Speedup::Linear),
            vec![1, 2]
        );
    }

    #[test]
    fn tiresias_prefers_the_least_served_and_preempts() {
        let mut a = job(0.0, 4, 4);
        a.attained = 10_000.0;
        let b = job(5.0, 2, 0);
        let c = job(6.0, 4, 0);
        let out = Tiresias::default().allocate(6.0, 4, &[a, b, c], &Speedup::Linear);
        // b (new) first; c does not fit beside it; a is preempted.
        assert_eq!(out, vec![0, 2, 0]);
    }

    #[test]
    fn elastic_shrinks_for_arrivals_and_grows_into_idle_slots() {
        // One job alone grows to its maximum.
        let out = Elastic.allocate(0.0, 8, &[job(0.0, 2, 0)], &Speedup::Linear);
        assert_eq!(out, vec![4]);
        // An arrival: the running job shrinks; both get what they asked for first.
        let out = Elastic.allocate(1.0, 8, &[job(0.0, 2, 4), job(1.0, 4, 0)], &Speedup::Linear);
        assert_eq!(out, vec![3, 5]);
        // A locked job keeps its size; the newcomer gets the rest.
        let mut a = job(0.0, 2, 4);
        a.resize_after = 10.0;
        let out = Elastic.allocate(1.0, 8, &[a, job(1.0, 4, 0)], &Speedup::Linear);
        assert_eq!(out, vec![4, 4]);
        // More jobs than slots: minimums in arrival order, running ones first.
        let jobs = [job(0.0, 2, 2), job(1.0, 1, 0), job(2.0, 1, 0)];
        assert_eq!(
            Elastic.allocate(2.0, 2, &jobs, &Speedup::Linear),
            vec![1, 1, 0]
        );
    }

    #[test]
    fn goodput_puts_slots_where_they_buy_the_most() {
        // With diminishing returns, a second slot for the small job buys more of its
        // nominal speed than a fifth for the big one.
        let s = Speedup::Amdahl { serial: 0.2 };
        let out = Goodput.allocate(0.0, 6, &[job(0.0, 4, 0), job(0.0, 1, 0)], &s);
        assert_eq!(out.iter().sum::<u32>(), 6);
        assert_eq!(out[1], 2, "{out:?}");
        // Linear scaling and equal sizes: slots are spread evenly.
        let out = Goodput.allocate(0.0, 4, &[job(0.0, 2, 0), job(0.0, 2, 0)], &Speedup::Linear);
        assert_eq!(out, vec![2, 2]);
    }
}
