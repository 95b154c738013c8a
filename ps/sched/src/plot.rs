//! PNG plots of a simulation: mean and p99 JCT per policy, and the JCT distribution.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::sim::{JobOutcome, Summary};

const COLORS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// Bars of mean and p99 JCT (hours) per policy: a group per policy, each labelled under its
/// centre (drawn by hand: plotters' axis labels fall on round numbers, not on the groups).
pub fn jct_bars(rows: &[Summary], title: &str, path: &Path) -> anyhow::Result<()> {
    // Headroom above the tallest bar for the legend.
    let top = rows.iter().map(|r| r.p99_jct / 3600.0).fold(1e-9, f64::max) * 1.3;
    let root = BitMapBackend::new(path, (960, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = rows.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..n.max(1) as f64, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("job completion time, hours")
        .axis_desc_style(("sans-serif", 16))
        .draw()?;
    let label = ("sans-serif", 15)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    for (i, r) in rows.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        root.draw(&Text::new(r.policy.clone(), (x, y + 8), label.clone()))?;
    }
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.15, 0.0), (x + 0.5, r.mean_jct / 3600.0)],
            BLUE.filled(),
        )))?;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.5, 0.0), (x + 0.85, r.p99_jct / 3600.0)],
            RED.mix(0.6).filled(),
        )))?;
    }
    chart
        .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
        .label("mean")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], BLUE.filled()));
    chart
        .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
        .label("p99")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], RED.mix(0.6).filled()));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// The cumulative distribution of JCT (hours, log scale) per policy.
pub fn jct_cdf(runs: &[(String, Vec<JobOutcome>)], path: &Path) -> anyhow::Result<()> {
    let jcts: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|(name, out)| {
            let mut v: Vec<f64> = out
                .iter()
                .map(|o| ((o.finish - o.submit) / 3600.0).max(1e-3))
                .collect();
            v.sort_by(f64::total_cmp);
            (name.clone(), v)
        })
        .collect();
    let hi = jcts
        .iter()
        .flat_map(|(_, v)| v.last().copied())
        .fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("job completion time, CDF", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((1e-3..hi * 1.2).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("hours")
        .y_desc("fraction of jobs")
        .draw()?;
    for (k, (name, v)) in jcts.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let n = v.len().max(1) as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, (i + 1) as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
