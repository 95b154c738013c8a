//! A shard's Prometheus metrics: its holdings, and its data ledger per epoch (samples applied,
//! applied twice, never applied: the exactly-once account), and checkpoint durations. Pushes,
//! pulls, their bytes and apply latency are the request server's (`edl_requests_total`,
//! `edl_request_bytes_total`, `edl_request_seconds{request="Push"}`).

use std::sync::{Arc, LazyLock};

use edl_shared::metrics::{self, Gauge, Gauges, Histograms, label};

use super::ShardState;

struct ShardMetrics {
    keys: Gauge,
    floats: Gauge,
    state_bytes: Gauge,
    applied: Gauges,
    duplicates: Gauges,
    missing: Gauges,
    skipped: Gauges,
    checkpoint: Histograms,
    checkpoint_bytes: Gauge,
}

static M: LazyLock<ShardMetrics> = LazyLock::new(|| ShardMetrics {
    keys: metrics::gauge("shard_keys", "Keys (tensor chunks) this shard holds."),
    floats: metrics::gauge("shard_floats", "Parameter floats this shard holds."),
    state_bytes: metrics::gauge(
        "shard_state_bytes",
        "Bytes of parameters and optimizer state this shard holds.",
    ),
    applied: metrics::gauges(
        "ledger_applied",
        "Samples of an epoch whose gradients were applied here at least once.",
    ),
    duplicates: metrics::gauges(
        "ledger_duplicates",
        "Samples of an epoch applied here more than once (0 under exactly-once).",
    ),
    missing: metrics::gauges(
        "ledger_missing",
        "Samples of an epoch never applied here (0 once the epoch is done).",
    ),
    skipped: metrics::gauges(
        "ledger_skipped_pushes",
        "Pushes of an epoch refused as already applied (re-issued spans).",
    ),
    checkpoint: metrics::histograms(
        "checkpoint_seconds",
        "Time to copy, write and sync a checkpoint.",
        metrics::seconds_histogram,
    ),
    checkpoint_bytes: metrics::gauge("checkpoint_bytes", "Bytes of the latest checkpoint."),
});

/// Copies `state`'s holdings and ledger into the gauges before every scrape, while it lives.
pub fn watch(state: &Arc<ShardState>) {
    LazyLock::force(&M);
    metrics::watch(state, |st| {
        let s = st.stats();
        M.keys.set(s.keys as f64);
        M.floats.set(s.floats as f64);
        M.state_bytes.set(s.state_bytes as f64);
        let ledger = st.ledger_report();
        let per = |f: fn(&edl_shared::proto::msg::EpochLedger) -> u64| {
            ledger
                .iter()
                .map(move |e| (label("epoch", e.epoch), f(e) as f64))
                .collect::<Vec<_>>()
        };
        metrics::set_all(&M.applied, per(|e| e.applied));
        metrics::set_all(&M.duplicates, per(|e| e.duplicates));
        metrics::set_all(&M.missing, per(|e| e.missing));
        metrics::set_all(&M.skipped, per(|e| e.skipped_pushes));
    });
}

/// Observes a checkpoint written.
pub fn checkpointed(bytes: u64, millis: f64) {
    M.checkpoint
        .get_or_create(&Vec::new())
        .observe(millis / 1000.0);
    M.checkpoint_bytes.set(bytes as f64);
}
