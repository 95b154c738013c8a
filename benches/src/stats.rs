//! Small statistics over measured durations.

use std::time::Duration;

/// Latencies of repeated operations, in microseconds.
#[derive(Clone, Debug, Default)]
pub struct Samples(Vec<f64>);

impl Samples {
    /// Records one duration.
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64() * 1e6);
    }

    /// Adds another set.
    pub fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    /// The `q`-quantile (0..=1) in microseconds, nearest rank; 0 when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    }

    /// How many were recorded.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The median (the mean of the two middle values of an even count) and the maximum of `v`;
/// zeros when empty.
pub fn median_max(v: &[u64]) -> (u64, u64) {
    let mut s = v.to_vec();
    s.sort_unstable();
    let median = match s.len() {
        0 => 0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2,
    };
    (median, s.last().copied().unwrap_or(0))
}

/// Bytes per second over `d`, in GB/s (10^9).
pub fn gbps(bytes: f64, d: Duration) -> f64 {
    bytes / d.as_secs_f64().max(1e-12) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let mut s = Samples::default();
        for us in 1..=100 {
            s.push(Duration::from_micros(us));
        }
        assert_eq!(s.quantile(0.5), 50.0);
        assert_eq!(s.quantile(0.99), 99.0);
        assert_eq!(s.quantile(1.0), 100.0);
        assert_eq!(Samples::default().quantile(0.5), 0.0);
        assert!((gbps(2e9, Duration::from_secs(2)) - 1.0).abs() < 1e-12);
    }
}
