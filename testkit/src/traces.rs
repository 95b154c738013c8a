//! Figures read from a coordinator's trace (`JobTrace`), as the straggler tests measure them
//! on real time (`elastic_ops.rs`) and on virtual time (`dst.rs`).

use edl_proto::WorkerId;
use edl_proto::msg::{EventKind, JobTrace};

/// What one straggler run measured.
#[derive(Debug)]
pub struct StragglerRun {
    /// Samples per second before the slowdown, and after the straggler left (or was flagged,
    /// if it stays).
    pub before: f64,
    pub after: f64,
    /// From the slowdown to the flag.
    pub detect_ms: u64,
    /// From the slowdown to the straggler's departure.
    pub recover_ms: Option<u64>,
    /// Fewest active workers from the slowdown to the end of the "after" window.
    pub fewest_active: i64,
}

/// Samples per second over `[from, to)` of the coordinator's clock, `batch` samples a step.
pub fn rate(trace: &JobTrace, batch: u32, from: u64, to: u64) -> f64 {
    let steps = (trace.steps.iter())
        .filter(|s| s.t_ms >= from && s.t_ms < to)
        .count();
    steps as f64 * f64::from(batch) * 1000.0 / (to - from) as f64
}

/// The time of the first `kind` event of `worker` at or after `since`.
pub fn first_event_since(
    trace: &JobTrace,
    kind: EventKind,
    worker: WorkerId,
    since: u64,
) -> Option<u64> {
    (trace.events.iter())
        .find(|e| e.kind == kind && e.worker == worker && e.t_ms >= since)
        .map(|e| e.t_ms)
}

/// The fewest workers active over `[from, to]`: at `from`, and after each membership change
/// until `to`.
pub fn fewest_active(trace: &JobTrace, from: u64, to: u64) -> i64 {
    let active_at = |t: u64| -> i64 {
        (trace.events.iter().filter(|e| e.t_ms <= t))
            .map(|e| match e.kind {
                EventKind::Join => 1,
                EventKind::Leave | EventKind::Dead => -1,
                _ => 0,
            })
            .sum()
    };
    (trace.events.iter())
        .filter(|e| e.t_ms >= from && e.t_ms <= to)
        .map(|e| active_at(e.t_ms))
        .fold(active_at(from), i64::min)
}
