//! The coordinator's Prometheus metrics: membership, per-worker pace, progress, evaluation,
//! the live stall of each membership event and resharding moves. Gauges are copied from the
//! state at each scrape; histograms are observed as things happen.

use std::sync::{Arc, LazyLock};

use edl_shared::metrics::{self, Counters, Gauge, Gauges, Histograms, label};
use edl_shared::proto::msg::{EventKind, MoveReport, WorkerState};

use super::Coordinator;
use super::state::kind_name;

struct CoordinatorMetrics {
    workers: Gauges,
    events: Gauges,
    clock: Gauges,
    staleness: Gauges,
    step: Gauges,
    straggler_score: Gauges,
    straggler: Gauges,
    samples: Gauge,
    samples_expected: Gauge,
    epoch_samples: Gauges,
    epoch_loss: Gauges,
    epoch_bytes: Gauges,
    rate: Gauge,
    loss: Gauge,
    accuracy: Gauge,
    eval_loss: Gauge,
    map_epoch: Gauge,
    stall: Histograms,
    move_seconds: Histograms,
    move_bytes: Counters,
}

static M: LazyLock<CoordinatorMetrics> = LazyLock::new(|| CoordinatorMetrics {
    workers: metrics::gauges(
        "workers",
        "Workers by state (active, draining, left, dead) among those the coordinator keeps.",
    ),
    events: metrics::gauges(
        "membership_events",
        "Membership events by kind (join, leave, dead, drain, preempt, straggler, ...) since the \
         coordinator started.",
    ),
    clock: metrics::gauges("worker_clock", "Steps completed, per worker."),
    staleness: metrics::gauges(
        "worker_staleness",
        "Steps behind the most advanced worker, per worker.",
    ),
    step: metrics::gauges(
        "worker_step_seconds",
        "Median busy time of a worker's recent steps (its own work, not the consistency wait).",
    ),
    straggler_score: metrics::gauges(
        "worker_straggler_score",
        "A worker's median step time over the median of the others' (0 while unknown).",
    ),
    straggler: metrics::gauges(
        "worker_straggler",
        "1 while a worker is flagged a straggler.",
    ),
    samples: metrics::gauge("samples_done", "Samples committed so far (every epoch)."),
    samples_expected: metrics::gauge("samples_expected", "Samples the whole run will commit."),
    epoch_samples: metrics::gauges("epoch_samples", "Samples committed, per epoch."),
    epoch_loss: metrics::gauges("epoch_loss", "Mean training loss per sample, per epoch."),
    epoch_bytes: metrics::gauges(
        "epoch_bytes",
        "Payload bytes the workers reported with their steps, per epoch and direction \
         (pushed: gradients, pulled: parameters).",
    ),
    rate: metrics::gauge(
        "samples_per_second",
        "Samples committed per second, last 10 s.",
    ),
    loss: metrics::gauge("train_loss", "Mean training loss per sample, last 10 s."),
    accuracy: metrics::gauge(
        "eval_accuracy",
        "The latest evaluation's accuracy (0 to 1).",
    ),
    eval_loss: metrics::gauge("eval_loss", "The latest evaluation's mean loss."),
    map_epoch: metrics::gauge("shard_map_epoch", "The current shard map's epoch."),
    stall: metrics::histograms(
        "rescale_pause_seconds",
        "How much longer than usual the other workers' step straddling a membership event \
         took (the worst of them), by event.",
        metrics::seconds_histogram,
    ),
    move_seconds: metrics::histograms(
        "reshard_seconds",
        "Key-range moves: from start to publication (phase=move) and the time the range was \
         held, neither readable nor writable (phase=hold).",
        metrics::seconds_histogram,
    ),
    move_bytes: metrics::counters("reshard_bytes", "State bytes streamed by key-range moves."),
});

/// Copies `coordinator`'s state into the gauges before every scrape, while it lives.
pub fn watch(coordinator: &Arc<Coordinator>) {
    LazyLock::force(&M);
    metrics::watch(coordinator, refresh);
}

fn refresh(c: &Coordinator) {
    let now = edl_shared::clock::now();
    let st = c.lock();
    let status = st.status(now);
    let members = st.members(now);
    let mut by_state = [0u64; 4];
    for w in &members {
        let i = match (w.state, w.draining) {
            (WorkerState::Active, false) => 0,
            (WorkerState::Active, true) => 1,
            (WorkerState::Left, _) => 2,
            (WorkerState::Dead, _) => 3,
        };
        by_state[i] += 1;
    }
    let names = ["active", "draining", "left", "dead"];
    metrics::set_all(
        &M.workers,
        names
            .iter()
            .zip(by_state)
            .map(|(n, v)| (label("state", n), v as f64)),
    );
    metrics::set_all(
        &M.events,
        st.event_counts()
            .into_iter()
            .map(|(k, v)| (label("kind", k), v as f64)),
    );
    let active: Vec<_> = members
        .iter()
        .filter(|w| w.state == WorkerState::Active)
        .collect();
    let per = |f: &dyn Fn(&edl_shared::proto::msg::WorkerInfo) -> f64| {
        active
            .iter()
            .map(|w| {
                let l = vec![("worker", w.id.to_string()), ("name", w.name.clone())];
                (l, f(w))
            })
            .collect::<Vec<_>>()
    };
    metrics::set_all(&M.clock, per(&|w| w.clock.0 as f64));
    metrics::set_all(&M.staleness, per(&|w| w.staleness as f64));
    metrics::set_all(&M.step, per(&|w| w.step_ms / 1000.0));
    metrics::set_all(&M.straggler_score, per(&|w| w.straggler_score));
    metrics::set_all(&M.straggler, per(&|w| f64::from(u8::from(w.straggler))));
    M.samples.set(status.samples_done as f64);
    M.samples_expected.set(status.samples_total as f64);
    metrics::set_all(
        &M.epoch_samples,
        status
            .epochs
            .iter()
            .map(|e| (label("epoch", e.epoch), e.samples as f64)),
    );
    metrics::set_all(
        &M.epoch_loss,
        status
            .epochs
            .iter()
            .filter(|e| e.samples > 0)
            .map(|e| (label("epoch", e.epoch), e.loss_sum / e.samples as f64)),
    );
    metrics::set_all(
        &M.epoch_bytes,
        status.epochs.iter().flat_map(|e| {
            [("pushed", e.bytes_pushed), ("pulled", e.bytes_pulled)].map(|(direction, b)| {
                let labels = vec![
                    ("epoch", e.epoch.to_string()),
                    ("direction", direction.to_string()),
                ];
                (labels, b as f64)
            })
        }),
    );
    M.rate.set(status.samples_per_s);
    M.loss.set(status.loss.unwrap_or(f64::NAN));
    if let Some(e) = &status.evaluation {
        M.accuracy.set(e.accuracy);
        M.eval_loss.set(e.loss);
    }
    if let Some(map) = st.map() {
        M.map_epoch.set(map.epoch.0 as f64);
    }
}

/// Observes the stalls the state measured (event kind and milliseconds).
pub fn stalls(stalls: Vec<(EventKind, f64)>) {
    for (kind, ms) in stalls {
        M.stall
            .get_or_create(&label("event", kind_name(kind)))
            .observe(ms / 1000.0);
    }
}

/// Observes a finished key-range move.
pub fn moved(r: &MoveReport) {
    M.move_seconds
        .get_or_create(&label("phase", "move"))
        .observe(r.millis / 1000.0);
    M.move_seconds
        .get_or_create(&label("phase", "hold"))
        .observe(r.hold_ms / 1000.0);
    M.move_bytes.get_or_create(&Vec::new()).inc_by(r.bytes);
}
