//! Parallelism profiling: a running job is resized stop-free through a list of worker counts
//! (through the coordinator's placements, which a placer such as `edl-local` fulfils), and
//! its steady-state samples/s is measured at each after a warm-up. The scaling curve and its
//! knee (the size past which one more worker buys less than a set fraction of a worker's
//! share) are what a scheduler needs to place GPUs where they add the most throughput.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use edl_shared::proto::msg::WorkerState;
use edl_shared::proto::{PlacementKind, PlacementState};
use serde::{Deserialize, Serialize};

use crate::admin::Admin;

/// What to measure.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// The worker counts, in the order visited.
    pub sizes: Vec<u32>,
    /// Time at each size before measuring (new workers prepare and take their first steps).
    pub warmup: Duration,
    /// Time measured at each size.
    pub measure: Duration,
    /// The knee is the last size before one at which a worker added buys less than this
    /// fraction of the per-worker throughput of the size before.
    pub min_gain: f64,
    /// How long a resize may take to complete (workers started and admitted).
    pub settle: Duration,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            sizes: vec![1, 2, 4, 8],
            warmup: Duration::from_secs(5),
            measure: Duration::from_secs(10),
            min_gain: 0.5,
            settle: Duration::from_secs(120),
        }
    }
}

/// One point of the curve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfilePoint {
    /// Workers training.
    pub workers: u32,
    /// Samples committed per second over the measured window.
    pub samples_per_s: f64,
    /// Samples committed in the window.
    pub samples: u64,
    /// The window's length in seconds.
    pub seconds: f64,
    /// Seconds the resize to this size took (placements fulfilled, extra workers gone).
    pub resize_s: f64,
    /// Marginal gain of the workers added since the previous size: their throughput each
    /// over the per-worker throughput there (1 is linear scaling; absent for the first).
    pub gain: Option<f64>,
}

/// A scaling curve and its knee.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Profile {
    /// The points, by worker count.
    pub points: Vec<ProfilePoint>,
    /// The suggested size: the knee of the curve.
    pub knee: u32,
    /// The gain threshold that defines the knee.
    pub min_gain: f64,
    /// Workers the job had before profiling (it is resized back to them).
    pub restored_to: u32,
}

/// Workers that train and are not leaving.
async fn staying(admin: &Admin) -> anyhow::Result<u32> {
    Ok(admin
        .members()
        .await?
        .iter()
        .filter(|w| w.state == WorkerState::Active && !w.draining)
        .count() as u32)
}

/// Resizes to `n` and waits until exactly `n` workers train and no addition is pending.
async fn resize(admin: &Admin, n: u32, settle: Duration) -> anyhow::Result<()> {
    let placed = admin
        .scale(n)
        .await
        .with_context(|| format!("resizing to {n}"))?
        .placed;
    let deadline = Instant::now() + settle;
    loop {
        let placements = admin.placements().await?;
        if let Some((id, PlacementState::Failed { reason })) = placements
            .iter()
            .find(|p| placed.contains(&p.id))
            .map(|p| (p.id, &p.state))
        {
            bail!("the placer could not start a worker for placement {id}: {reason}");
        }
        let pending = placements
            .iter()
            .any(|p| p.is_pending() && p.kind == PlacementKind::Add);
        let members = admin.members().await?;
        let leaving = members
            .iter()
            .any(|w| w.state == WorkerState::Active && w.draining);
        if !pending && !leaving && staying(admin).await? == n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the job did not reach {n} workers within {} s{}",
                settle.as_secs(),
                if pending {
                    " (placements are pending: is a placer such as edl-local running the job?)"
                } else {
                    ""
                }
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Samples committed so far, failing if the job has finished (its rate would mean nothing).
async fn samples_done(admin: &Admin) -> anyhow::Result<(u64, Instant)> {
    let st = admin.status().await?;
    if st.finished {
        bail!("the job finished while being profiled; give it more epochs or profile sooner");
    }
    Ok((st.samples_done, Instant::now()))
}

/// Profiles the running job; `say` hears progress lines. The job is resized back to its
/// worker count before (also after a failure, as far as the coordinator answers).
pub async fn profile(
    admin: &Admin,
    opts: &ProfileOptions,
    mut say: impl FnMut(&str),
) -> anyhow::Result<Profile> {
    if opts.sizes.is_empty() || opts.sizes.contains(&0) {
        bail!("give at least one worker count, each at least 1");
    }
    let before = staying(admin).await?;
    if before == 0 {
        bail!("the job has no training worker to profile");
    }
    let measured = measure_all(admin, opts, &mut say).await;
    say(&format!("resizing back to {before} workers"));
    let back = admin.scale(before).await;
    let mut points = measured?;
    back.context("resizing back")?;
    points.sort_by_key(|p| p.workers);
    let knee = knee(&mut points, opts.min_gain);
    Ok(Profile {
        points,
        knee,
        min_gain: opts.min_gain,
        restored_to: before,
    })
}

async fn measure_all(
    admin: &Admin,
    opts: &ProfileOptions,
    say: &mut impl FnMut(&str),
) -> anyhow::Result<Vec<ProfilePoint>> {
    let mut points = Vec::new();
    for &n in &opts.sizes {
        let t = Instant::now();
        resize(admin, n, opts.settle).await?;
        let resize_s = t.elapsed().as_secs_f64();
        say(&format!(
            "{n} workers after {resize_s:.1} s; warming up {:.0} s, measuring {:.0} s",
            opts.warmup.as_secs_f64(),
            opts.measure.as_secs_f64()
        ));
        tokio::time::sleep(opts.warmup).await;
        let (s0, t0) = samples_done(admin).await?;
        tokio::time::sleep(opts.measure).await;
        let (s1, t1) = samples_done(admin).await?;
        let now = staying(admin).await?;
        if now != n {
            bail!("the job went from {n} to {now} workers while it was measured");
        }
        let seconds = t1.duration_since(t0).as_secs_f64();
        let samples = s1.saturating_sub(s0);
        let rate = samples as f64 / seconds;
        say(&format!("{n} workers: {rate:.0} samples/s"));
        points.push(ProfilePoint {
            workers: n,
            samples_per_s: rate,
            samples,
            seconds,
            resize_s,
            gain: None,
        });
    }
    Ok(points)
}

/// Fills each point's marginal gain and returns the knee: the last size before the first
/// whose added workers each buy less than `min_gain` of a worker's share at the size before
/// (the largest size if none does).
pub fn knee(points: &mut [ProfilePoint], min_gain: f64) -> u32 {
    let mut knee = None;
    for i in 1..points.len() {
        let (a, b) = (&points[i - 1], &points[i]);
        let per_worker = a.samples_per_s / f64::from(a.workers);
        let added = f64::from(b.workers.saturating_sub(a.workers).max(1));
        let gain = (b.samples_per_s - a.samples_per_s) / added / per_worker.max(f64::MIN_POSITIVE);
        let prev = a.workers;
        points[i].gain = Some(gain);
        if knee.is_none() && gain < min_gain {
            knee = Some(prev);
        }
    }
    knee.or(points.last().map(|p| p.workers)).unwrap_or(0)
}

/// Draws the curve as a PNG: samples/s against workers, linear scaling from the first point
/// for reference, the knee marked.
pub fn plot(profile: &Profile, path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let Some(first) = profile.points.first() else {
        bail!("no points to draw");
    };
    let max_n = profile.points.iter().map(|p| p.workers).max().unwrap_or(1);
    let per = first.samples_per_s / f64::from(first.workers);
    let top = profile
        .points
        .iter()
        .map(|p| p.samples_per_s)
        .fold(per * f64::from(max_n), f64::max)
        * 1.1;
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("scaling curve (knee: {} workers)", profile.knee),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..f64::from(max_n) + 0.5, 0.0..top.max(1.0))?;
    chart
        .configure_mesh()
        .x_desc("workers")
        .y_desc("samples/s")
        .x_labels(max_n as usize + 2)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    let linear = [(0.0, 0.0), (f64::from(max_n), per * f64::from(max_n))];
    chart
        .draw_series(LineSeries::new(linear, BLACK.mix(0.3).stroke_width(1)))?
        .label("linear from the first point")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.3)));
    let pts: Vec<(f64, f64)> = profile
        .points
        .iter()
        .map(|p| (f64::from(p.workers), p.samples_per_s))
        .collect();
    chart
        .draw_series(LineSeries::new(pts.clone(), BLUE.stroke_width(2)))?
        .label("measured")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
    chart.draw_series(
        pts.iter()
            .map(|&(x, y)| Circle::new((x, y), 4, BLUE.filled())),
    )?;
    if let Some(k) = profile.points.iter().find(|p| p.workers == profile.knee) {
        chart.draw_series(std::iter::once(Circle::new(
            (f64::from(k.workers), k.samples_per_s),
            9,
            RED.stroke_width(2),
        )))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(rates: &[(u32, f64)]) -> Vec<ProfilePoint> {
        rates
            .iter()
            .map(|&(workers, samples_per_s)| ProfilePoint {
                workers,
                samples_per_s,
                samples: 0,
                seconds: 1.0,
                resize_s: 0.0,
                gain: None,
            })
            .collect()
    }

    #[test]
    fn the_knee_is_where_a_worker_stops_paying() {
        // Linear to 3, flat after: the knee is 3.
        let mut p = pts(&[(1, 100.0), (2, 200.0), (3, 300.0), (4, 305.0), (6, 310.0)]);
        assert_eq!(knee(&mut p, 0.5), 3);
        assert_eq!(p[0].gain, None);
        assert!((p[1].gain.expect("gain") - 1.0).abs() < 1e-9);
        assert!(p[3].gain.expect("gain") < 0.1);
        // Linear all the way: the largest size.
        let mut p = pts(&[(1, 100.0), (2, 200.0), (4, 400.0)]);
        assert_eq!(knee(&mut p, 0.5), 4);
        // Steps of several workers: gain per added worker (2 -> 4 adds 2 workers buying 60
        // each against 100 each at 2: 0.6 passes, 4 -> 8 buys 10 each: stops).
        let mut p = pts(&[(2, 200.0), (4, 320.0), (8, 360.0)]);
        assert_eq!(knee(&mut p, 0.5), 4);
        // Slower with more workers: the first size.
        let mut p = pts(&[(1, 100.0), (2, 90.0)]);
        assert_eq!(knee(&mut p, 0.5), 1);
    }

    #[test]
    fn a_curve_draws() {
        let mut points = pts(&[(1, 100.0), (2, 190.0), (4, 200.0)]);
        let knee = knee(&mut points, 0.5);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("curve.png");
        plot(
            &Profile {
                points,
                knee,
                min_gain: 0.5,
                restored_to: 1,
            },
            &path,
        )
        .expect("drawn");
        assert!(std::fs::metadata(&path).expect("written").len() > 1000);
    }
}
