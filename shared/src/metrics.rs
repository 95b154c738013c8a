//! The process's Prometheus metrics: one registry per process (as Prometheus expects of a
//! scrape target), metrics registered once per kind of component, and hooks run before each
//! scrape that copy a component's state into its gauges. [`render`] writes the registry in
//! the OpenMetrics text format; `crate::http` serves it at `/metrics`.
//!
//! Every metric is named `edl_…`; see each component's module for its own (the request server's
//! are in [`crate::server`]).

use std::sync::atomic::AtomicU64;
use std::sync::{LazyLock, Mutex};

use prometheus_client::registry::{Metric, Registry};

pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::metrics::family::Family;
pub use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// A gauge of floating-point values.
pub type Gauge = prometheus_client::metrics::gauge::Gauge<f64, AtomicU64>;
/// A metric's labels, in order.
pub type Labels = Vec<(&'static str, String)>;
/// `N` labels known at compile time (request kinds, directions, phases): nothing is allocated
/// to look one up, for metrics counted on every request.
pub type Fixed<const N: usize> = [(&'static str, &'static str); N];
/// Gauges by label.
pub type Gauges = Family<Labels, Gauge>;
/// Counters by label.
pub type Counters = Family<Labels, Counter>;
/// Histograms by label, with the buckets of the function that makes them.
pub type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// A hook run before each scrape; returns false once its component is gone (it is then dropped).
type Hook = Box<dyn Fn() -> bool + Send + Sync>;

struct Global {
    registry: Mutex<Registry>,
    hooks: Mutex<Vec<Hook>>,
}

static GLOBAL: LazyLock<Global> = LazyLock::new(|| Global {
    registry: Mutex::new(Registry::default()),
    hooks: Mutex::new(Vec::new()),
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    GLOBAL.registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers `metric` under `name` (without the `edl_` prefix, which is added) and returns
/// it. Register each name once per process: keep the result in a `LazyLock`.
pub fn register<M: Metric + Clone>(name: &str, help: &str, metric: M) -> M {
    registry().register(format!("edl_{name}"), help, metric.clone());
    metric
}

/// A counter (`name` gets `edl_` before and `_total` after it).
pub fn counter(name: &str, help: &str) -> Counter {
    register(name, help, Counter::default())
}

/// A gauge.
pub fn gauge(name: &str, help: &str) -> Gauge {
    register(name, help, Gauge::default())
}

/// Counters by label.
pub fn counters(name: &str, help: &str) -> Counters {
    register(name, help, Counters::default())
}

/// Gauges by label.
pub fn gauges(name: &str, help: &str) -> Gauges {
    register(name, help, Gauges::default())
}

/// Histograms by label, each with the buckets `make` gives.
pub fn histograms(name: &str, help: &str, make: fn() -> Histogram) -> Histograms {
    register(name, help, Histograms::new_with_constructor(make))
}

/// Buckets for durations in seconds, 100 µs to about 100 s.
pub fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-4, 2.5, 16))
}

/// Runs `refresh` on `component` before every scrape, for as long as it lives.
pub fn watch<T: Send + Sync + 'static>(
    component: &std::sync::Arc<T>,
    refresh: impl Fn(&T) + Send + Sync + 'static,
) {
    let weak = std::sync::Arc::downgrade(component);
    on_scrape(move || {
        let Some(c) = weak.upgrade() else {
            return false;
        };
        refresh(&c);
        true
    });
}

/// Runs `hook` before every scrape, until it returns false.
pub fn on_scrape(hook: impl Fn() -> bool + Send + Sync + 'static) {
    GLOBAL
        .hooks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Box::new(hook));
}

/// The metrics in the OpenMetrics text format, after running the scrape hooks.
pub fn render() -> String {
    GLOBAL
        .hooks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|hook| hook());
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry());
    out
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Sets the gauges of `family` to `values`, dropping label sets not among them (a worker
/// that left, an epoch of a finished run).
pub fn set_all(family: &Gauges, values: impl IntoIterator<Item = (Labels, f64)>) {
    family.clear();
    for (labels, v) in values {
        family.get_or_create(&labels).set(v);
    }
}

/// One label.
pub fn label(key: &'static str, value: impl ToString) -> Labels {
    vec![(key, value.to_string())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_metrics_render_as_openmetrics_with_hook_values() {
        static G: LazyLock<Gauges> = LazyLock::new(|| gauges("test_things", "Things."));
        static C: LazyLock<Counter> = LazyLock::new(|| counter("test_events", "Events."));
        C.inc_by(3);
        on_scrape(|| {
            set_all(&G, [(label("kind", "a"), 1.5), (label("kind", "b"), 2.0)]);
            true
        });
        let text = render();
        assert!(text.contains("# TYPE edl_test_things gauge"), "{text}");
        assert!(text.contains("edl_test_things{kind=\"a\"} 1.5"), "{text}");
        assert!(text.contains("edl_test_events_total 3"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
    }
}
