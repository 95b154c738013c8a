//! How fast a job trains with n workers, relative to one: linear, Amdahl's law with a serial
//! fraction, or a measured scaling curve (`edlctl profile --out`), interpolated between its
//! points and flat past the last.

use serde::Deserialize;

/// A scaling model.
#[derive(Clone, Debug, PartialEq)]
pub enum Speedup {
    /// n workers are n times as fast.
    Linear,
    /// `n / (1 + serial (n - 1))`.
    Amdahl {
        /// The fraction of a step that does not parallelize.
        serial: f64,
    },
    /// Measured samples/s by worker count, ascending; normalized to the first point per
    /// worker.
    Curve(Vec<(u32, f64)>),
    /// The speed with `n` workers at index `n` (0 at 0), flat past the end: a curve
    /// tabulated once ([`Speedup::tabulated`]) so that a look-up costs an index.
    Table(Vec<f64>),
}

#[derive(Deserialize)]
struct ProfileFile {
    points: Vec<ProfilePoint>,
}

#[derive(Deserialize)]
struct ProfilePoint {
    workers: u32,
    samples_per_s: f64,
}

impl Speedup {
    /// Reads the JSON `edlctl profile --out` writes.
    pub fn from_profile(json: &str) -> anyhow::Result<Speedup> {
        let f: ProfileFile = serde_json::from_str(json)?;
        let mut pts: Vec<(u32, f64)> = f
            .points
            .into_iter()
            .filter(|p| p.workers > 0 && p.samples_per_s.is_finite() && p.samples_per_s > 0.0)
            .map(|p| (p.workers, p.samples_per_s))
            .collect();
        pts.sort_by_key(|p| p.0);
        pts.dedup_by_key(|p| p.0);
        anyhow::ensure!(!pts.is_empty(), "the profile has no usable points");
        Ok(Speedup::Curve(pts))
    }

    /// The same speed-up as a [`Speedup::Table`] where that is exact: a curve, whose speed is
    /// flat past its last point; other models as they are.
    pub fn tabulated(&self) -> Speedup {
        match self {
            Speedup::Curve(pts) => {
                let last = pts.last().map_or(0, |p| p.0);
                Speedup::Table((0..=last).map(|n| self.at(n)).collect())
            }
            other => other.clone(),
        }
    }

    /// Speed with `n` workers in units of one worker's (0 for none).
    pub fn at(&self, n: u32) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let x = f64::from(n);
        match self {
            Speedup::Linear => x,
            Speedup::Amdahl { serial } => x / (1.0 + serial * (x - 1.0)),
            Speedup::Table(t) => t.get(n as usize).or(t.last()).copied().unwrap_or(0.0),
            Speedup::Curve(pts) => {
                let (n0, r0) = pts[0];
                let unit = r0 / f64::from(n0);
                let rate = match pts.iter().position(|&(w, _)| w >= n) {
                    // Below the first point: linear from zero.
                    Some(0) => unit * x,
                    Some(k) => {
                        let (a, ra) = pts[k - 1];
                        let (b, rb) = pts[k];
                        ra + (rb - ra) * (x - f64::from(a)) / f64::from(b - a)
                    }
                    None => pts[pts.len() - 1].1,
                };
                rate / unit
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_and_curves() {
        assert_eq!(Speedup::Linear.at(4), 4.0);
        assert_eq!(Speedup::Linear.at(0), 0.0);
        let a = Speedup::Amdahl { serial: 0.5 };
        assert!((a.at(3) - 1.5).abs() < 1e-12);
        let c = Speedup::from_profile(
            r#"{"points":[{"workers":1,"samples_per_s":100.0},{"workers":4,"samples_per_s":250.0}],"knee":4}"#,
        )
        .expect("profile");
        assert_eq!(c.at(1), 1.0);
        assert!((c.at(2) - 1.5).abs() < 1e-12);
        assert_eq!(c.at(8), 2.5);
        let t = c.tabulated();
        for n in 0..12 {
            assert_eq!(t.at(n), c.at(n), "{n}");
        }
        assert!(Speedup::from_profile(r#"{"points":[]}"#).is_err());
    }
}
