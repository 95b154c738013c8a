//! Training progress for the person at the terminal: a live progress bar, or one plain line per
//! finished epoch when the output is not a terminal (logs, CI) or the bar is turned off.
//!
//! Epochs are shown counted from 1 with the number of epochs (`epoch 2/3`), as `edlctl
//! status` shows them; the coordinator's API, the JSON report and the dashboard's data number
//! them from 0.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use edl_shared::proto::msg::{EpochStats, JobStatus, WorkerState};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How far back the samples/s figure looks, so that it follows the current speed rather than
/// the average since the start.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// What a status snapshot says, in the terms the launcher shows.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Samples processed so far.
    pub done: u64,
    /// Samples the whole run will process.
    pub total: u64,
    /// The latest epoch with samples, counted from 0.
    pub epoch: Option<u32>,
    /// Number of epochs in the job.
    pub epochs: u32,
    /// The mean training loss of that epoch so far.
    pub loss: Option<f64>,
    /// Workers currently active.
    pub active: usize,
}

impl Snapshot {
    /// Reads a status snapshot.
    pub fn of(st: &JobStatus) -> Snapshot {
        let latest = st.epochs.iter().rev().find(|e| e.samples > 0);
        Snapshot {
            done: st.samples_done,
            total: st.samples_total,
            epoch: latest.map(|e| e.epoch),
            epochs: u32::try_from(st.epochs.len()).unwrap_or(u32::MAX),
            loss: latest.and_then(mean_loss),
            active: active_workers(st),
        }
    }
}

/// The mean per-sample loss of an epoch, if it has samples.
pub fn mean_loss(e: &EpochStats) -> Option<f64> {
    (e.samples > 0).then(|| e.loss_sum / e.samples as f64)
}

/// Workers the coordinator counts as active.
pub fn active_workers(st: &JobStatus) -> usize {
    st.workers
        .iter()
        .filter(|w| w.state == WorkerState::Active)
        .count()
}

/// The epochs of `st` that are complete: all their samples are in, or the whole job is done.
pub fn completed_epochs(st: &JobStatus) -> impl Iterator<Item = &EpochStats> {
    // The coordinator reports the samples of the whole run, split evenly across epochs.
    let per_epoch = st.samples_total / (st.epochs.len().max(1) as u64);
    st.epochs
        .iter()
        .filter(move |e| st.finished || (per_epoch > 0 && e.samples >= per_epoch))
}

/// A one-line account of every worker, for a warning that training has stalled.
pub fn worker_states(st: &JobStatus) -> String {
    let workers: Vec<String> = st
        .workers
        .iter()
        .map(|w| {
            format!(
                "{} ({}) {:?} at {}, silent {} ms",
                w.name, w.id, w.state, w.clock, w.idle_ms
            )
        })
        .collect();
    format!(
        "{}/{} samples, slowest active clock {}; workers: {}",
        st.samples_done,
        st.samples_total,
        st.min_clock,
        if workers.is_empty() {
            "none".to_string()
        } else {
            workers.join("; ")
        }
    )
}

/// Notices when the sample count stops moving, so that a hung job says so instead of sitting
/// silently behind a frozen bar.
#[derive(Debug)]
pub struct StallWatch {
    after: Duration,
    last: Option<(u64, Instant)>,
    warned: bool,
}

impl StallWatch {
    /// Warns once per stall that lasts longer than `after`.
    pub fn new(after: Duration) -> StallWatch {
        StallWatch {
            after,
            last: None,
            warned: false,
        }
    }

    /// How long the sample count has stood still as of `at`.
    pub fn stalled_for(&self, at: Instant) -> Duration {
        self.last
            .map_or(Duration::ZERO, |(_, since)| at.duration_since(since))
    }

    /// Records a snapshot taken at `at`; returns a warning when progress has stalled for
    /// longer than the limit (once per stall).
    pub fn check(&mut self, st: &JobStatus, at: Instant) -> Option<String> {
        match self.last {
            Some((done, since)) if done == st.samples_done => {
                let stalled = at.duration_since(since);
                if stalled > self.after && !self.warned && !st.finished {
                    self.warned = true;
                    return Some(format!(
                        "edl-local: warning: no training progress for {} s: {}",
                        stalled.as_secs(),
                        worker_states(st)
                    ));
                }
                None
            }
            _ => {
                self.warned = false;
                self.last = Some((st.samples_done, at));
                None
            }
        }
    }
}

/// Samples per second over the last few seconds of snapshots.
#[derive(Debug, Default)]
struct Rate {
    points: VecDeque<(Instant, u64)>,
}

impl Rate {
    fn add(&mut self, at: Instant, done: u64) -> Option<f64> {
        self.points.push_back((at, done));
        while let Some(&(t, _)) = self.points.front() {
            if at.duration_since(t) > RATE_WINDOW && self.points.len() > 2 {
                self.points.pop_front();
            } else {
                break;
            }
        }
        let (t0, d0) = *self.points.front()?;
        let dt = at.duration_since(t0).as_secs_f64();
        (dt > 0.5).then(|| done.saturating_sub(d0) as f64 / dt)
    }
}

/// How progress is shown.
#[derive(Debug)]
enum Display {
    /// A live bar on stderr.
    Bar(ProgressBar),
    /// One line on stderr per completed epoch; `printed` epochs are done.
    Lines { printed: usize },
}

/// How people are shown epoch `e` (numbered from 0) of a job of `epochs`: `epoch E+1/EPOCHS`.
pub fn epoch_label(e: u32, epochs: u32) -> String {
    format!("epoch {}/{epochs}", e.saturating_add(1))
}

/// The progress display of one run.
#[derive(Debug)]
pub struct Progress {
    display: Display,
    rate: Rate,
    /// When a status first showed training under way (an active worker or samples done).
    began: Option<Instant>,
    /// When the latest epoch shown was seen complete.
    last_epoch: Option<Instant>,
    /// The most workers seen active since the latest epoch shown (the workers of a finished
    /// job have left by its last status).
    peak_active: usize,
}

impl Progress {
    /// A live bar when `bar` is true, plain lines otherwise.
    pub fn new(bar: bool) -> anyhow::Result<Progress> {
        let display = if bar {
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30.cyan/blue} {pos}/{len} samples  {msg}",
            )?
            .progress_chars("=> ");
            // No length until the first status says how many samples the run has.
            let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                .with_style(style)
                .with_message("waiting for the shard map");
            pb.enable_steady_tick(Duration::from_millis(120));
            Display::Bar(pb)
        } else {
            Display::Lines { printed: 0 }
        };
        Ok(Progress {
            display,
            rate: Rate::default(),
            began: None,
            last_epoch: None,
            peak_active: 0,
        })
    }

    /// Shows a status snapshot taken at `at`. An epoch's time runs from the moment the one
    /// before was seen complete (the first, from the first status showing training under
    /// way), so that the epochs' times add up to the training time, to within the period of
    /// the snapshots.
    pub fn update(&mut self, st: &JobStatus, at: Instant) {
        for line in self.epoch_lines(st, at) {
            eprintln!("{line}");
        }
    }

    /// Updates the bar, or with plain output returns the lines of the epochs `st` shows
    /// complete that were not shown yet.
    fn epoch_lines(&mut self, st: &JobStatus, at: Instant) -> Vec<String> {
        let snap = Snapshot::of(st);
        let rate = self.rate.add(at, snap.done);
        if self.began.is_none() && (snap.active > 0 || snap.done > 0) {
            self.began = Some(at);
        }
        self.peak_active = self.peak_active.max(snap.active);
        let printed = match &mut self.display {
            Display::Bar(pb) => {
                pb.set_length(snap.total);
                pb.set_position(snap.done);
                pb.set_message(bar_message(&snap, rate));
                return Vec::new();
            }
            Display::Lines { printed } => printed,
        };
        let began = self.began.unwrap_or(at);
        let mut lines = Vec::new();
        for e in completed_epochs(st).skip(*printed) {
            let times = EpochTimes {
                took: at.saturating_duration_since(self.last_epoch.unwrap_or(began)),
                training: at.saturating_duration_since(began),
            };
            lines.push(epoch_line(e, snap.epochs, self.peak_active, rate, times));
            self.last_epoch = Some(at);
            self.peak_active = snap.active;
            *printed += 1;
        }
        lines
    }

    /// Shows a line of text without disturbing the bar.
    pub fn println(&self, line: &str) {
        match &self.display {
            Display::Bar(pb) => pb.println(line),
            Display::Lines { .. } => eprintln!("{line}"),
        }
    }

    /// Ends the display after the final status: the bar stays at its last state and plain
    /// output catches up on epochs it has not shown yet.
    pub fn finish(&mut self, last: &JobStatus) {
        self.update(last, Instant::now());
        if let Display::Bar(pb) = &self.display {
            pb.finish();
        }
    }

    /// Ends the display after a failure, leaving the bar where it stopped.
    pub fn abandon(&self) {
        if let Display::Bar(pb) = &self.display {
            pb.abandon();
        }
    }
}

fn bar_message(s: &Snapshot, rate: Option<f64>) -> String {
    let mut msg = match s.epoch {
        Some(e) => epoch_label(e, s.epochs),
        None => format!("epoch -/{}", s.epochs),
    };
    if let Some(loss) = s.loss {
        msg.push_str(&format!("  loss {loss:.4}"));
    }
    msg.push_str(&format!(
        "  {} {}",
        s.active,
        if s.active == 1 { "worker" } else { "workers" }
    ));
    if let Some(r) = rate {
        msg.push_str(&format!("  {r:.0} samples/s"));
    }
    msg
}

/// How long an epoch took, and the training time when it was done.
#[derive(Clone, Copy, Debug)]
struct EpochTimes {
    /// From the previous epoch's end (the first's: the start of training) to its own.
    took: Duration,
    /// From the start of training to its end.
    training: Duration,
}

/// An epoch's line; `workers`: the most seen active while it ran.
fn epoch_line(
    e: &EpochStats,
    epochs: u32,
    workers: usize,
    rate: Option<f64>,
    times: EpochTimes,
) -> String {
    let loss = mean_loss(e).map_or_else(|| "-".to_string(), |l| format!("{l:.4}"));
    let rate = rate.map_or_else(|| "-".to_string(), |r| format!("{r:.0}"));
    format!(
        "{} done in {:.1} s ({:.1} s of training so far): {} samples, mean train loss {loss}, \
         {workers} {}, {rate} samples/s",
        epoch_label(e.epoch, epochs),
        times.took.as_secs_f64(),
        times.training.as_secs_f64(),
        e.samples,
        if workers == 1 { "worker" } else { "workers" },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::msg::WorkerStatus;
    use edl_shared::proto::{Clock, WorkerId};

    fn status(epochs: &[(u64, f64)], per_epoch: u64, finished: bool) -> JobStatus {
        JobStatus {
            t_ms: 0,
            shards_joined: 2,
            shards_expected: 2,
            samples_total: per_epoch * epochs.len() as u64,
            samples_done: epochs.iter().map(|e| e.0).sum(),
            epochs: epochs
                .iter()
                .enumerate()
                .map(|(i, &(samples, loss_sum))| EpochStats {
                    epoch: i as u32,
                    samples,
                    loss_sum,
                    bytes_pushed: 0,
                    bytes_pulled: 0,
                })
                .collect(),
            workers: vec![
                WorkerStatus {
                    id: WorkerId(1),
                    name: "w0".into(),
                    state: WorkerState::Active,
                    clock: Clock(3),
                    idle_ms: 0,
                    draining: false,
                },
                WorkerStatus {
                    id: WorkerId(2),
                    name: "w1".into(),
                    state: WorkerState::Dead,
                    clock: Clock(1),
                    idle_ms: 9000,
                    draining: false,
                },
            ],
            min_clock: Clock(3),
            finished,
            samples_per_s: 0.0,
            loss: None,
            evaluation: None,
        }
    }

    #[test]
    fn snapshot_shows_the_latest_epoch_with_samples() {
        let st = status(&[(100, 50.0), (40, 8.0), (0, 0.0)], 100, false);
        let s = Snapshot::of(&st);
        assert_eq!(s.epoch, Some(1));
        assert_eq!(s.epochs, 3);
        assert_eq!(s.loss, Some(0.2));
        assert_eq!(s.active, 1);
        assert_eq!((s.done, s.total), (140, 300));
    }

    #[test]
    fn snapshot_before_any_samples_has_no_epoch() {
        let s = Snapshot::of(&status(&[(0, 0.0), (0, 0.0)], 100, false));
        assert_eq!((s.epoch, s.loss), (None, None));
    }

    #[test]
    fn epochs_complete_when_full_or_when_the_job_is_done() {
        let st = status(&[(100, 1.0), (99, 1.0)], 100, false);
        let done: Vec<u32> = completed_epochs(&st).map(|e| e.epoch).collect();
        assert_eq!(done, [0]);
        let st = status(&[(100, 1.0), (99, 1.0)], 100, true);
        assert_eq!(completed_epochs(&st).count(), 2);
    }

    #[test]
    fn stall_watch_warns_once_per_stall() {
        let mut w = StallWatch::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let st = status(&[(40, 8.0)], 100, false);
        assert_eq!(w.check(&st, t0), None);
        assert_eq!(w.check(&st, t0 + Duration::from_secs(5)), None);
        assert_eq!(
            w.stalled_for(t0 + Duration::from_secs(7)),
            Duration::from_secs(7)
        );
        let warning = w.check(&st, t0 + Duration::from_secs(11)).expect("stalled");
        assert!(
            warning.contains("no training progress for 11 s"),
            "{warning}"
        );
        assert!(warning.contains("w0 (worker#1) Active at c3"), "{warning}");
        assert_eq!(w.check(&st, t0 + Duration::from_secs(30)), None);
        // Progress resumes, then stalls again: a second warning.
        let moved = status(&[(60, 9.0)], 100, false);
        assert_eq!(w.check(&moved, t0 + Duration::from_secs(31)), None);
        assert!(w.check(&moved, t0 + Duration::from_secs(42)).is_some());
    }

    #[test]
    fn epochs_show_from_1_and_lines_give_each_epoch_its_own_time_and_workers() {
        let st = status(&[(100, 50.0), (40, 8.0), (0, 0.0)], 100, false);
        let s = Snapshot::of(&st);
        assert_eq!(
            bar_message(&s, Some(1234.4)),
            "epoch 2/3  loss 0.2000  1 worker  1234 samples/s"
        );
        let fresh = Snapshot::of(&status(&[(0, 0.0), (0, 0.0)], 100, false));
        assert!(bar_message(&fresh, None).starts_with("epoch -/2"));
        let times = EpochTimes {
            took: Duration::from_millis(4_140),
            training: Duration::from_millis(8_420),
        };
        assert_eq!(
            epoch_line(&st.epochs[1], 3, 2, Some(980.0), times),
            "epoch 2/3 done in 4.1 s (8.4 s of training so far): 40 samples, mean train \
             loss 0.2000, 2 workers, 980 samples/s"
        );

        // Each epoch's time runs from the previous one's end; the first's from the first
        // status that showed training (here an active worker, before any samples).
        let mut p = Progress::new(false).expect("progress");
        let t0 = Instant::now();
        let mut lines_at = |st: JobStatus, at: Instant| p.epoch_lines(&st, at);
        assert!(lines_at(status(&[(0, 0.0), (0, 0.0)], 100, false), t0).is_empty());
        let one = lines_at(
            status(&[(100, 1.0), (10, 1.0)], 100, false),
            t0 + Duration::from_secs(3),
        );
        assert_eq!(one.len(), 1);
        assert!(
            one[0].starts_with("epoch 1/2 done in 3.0 s (3.0 s "),
            "{one:?}"
        );
        // The job's end: its worker has left.
        let mut end = status(&[(100, 1.0), (100, 1.0)], 100, true);
        end.workers[0].state = WorkerState::Left;
        let two = lines_at(end, t0 + Duration::from_secs(8));
        assert!(
            two[0].starts_with("epoch 2/2 done in 5.0 s (8.0 s "),
            "{two:?}"
        );
        // The job is over and no worker is active any more: the line names the worker that
        // trained the epoch, not the 0 active at the end.
        assert!(two[0].contains(", 1 worker, "), "{two:?}");
    }

    #[test]
    fn rate_follows_the_window() {
        let mut r = Rate::default();
        let t0 = Instant::now();
        assert_eq!(r.add(t0, 0), None);
        assert_eq!(r.add(t0 + Duration::from_secs(1), 1000), Some(1000.0));
        // Much later, the old points fall out of the window and the rate is the recent one.
        r.add(t0 + Duration::from_secs(20), 2000);
        let recent = r.add(t0 + Duration::from_secs(22), 2200).expect("rate");
        assert!((recent - 100.0).abs() < 1e-9, "{recent}");
    }
}
