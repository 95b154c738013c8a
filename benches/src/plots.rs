//! PNG plots of the results (plotters).

use std::path::Path;

use plotters::prelude::*;

use crate::{scale, transport, tta};

const SYSTEMS: [(&str, RGBColor); 3] = [("edl", BLUE), ("quinn", GREEN), ("tcp", RED)];

/// Gbit/s against tensor size, one line per system, for one client and one shard; solid with
/// large datagrams, dashed with the default ones (path-MTU discovery).
pub fn transport(
    loopback: &transport::Results,
    default: &transport::Results,
    path: &Path,
) -> anyhow::Result<()> {
    let series = |r: &transport::Results, sys: &str| -> Vec<(f64, f64)> {
        r.rows
            .iter()
            .filter(|x| x.system == sys && x.clients == 1 && x.shards == 1)
            .map(|x| ((x.size as f64).log2(), x.gbps * 8.0))
            .collect()
    };
    let top = [loopback, default]
        .iter()
        .flat_map(|r| r.rows.iter().map(|x| x.gbps * 8.0))
        .fold(1.0, f64::max)
        * 1.1;
    let xs: Vec<f64> = loopback
        .rows
        .iter()
        .map(|x| (x.size as f64).log2())
        .collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::MAX, f64::min),
        xs.iter().copied().fold(f64::MIN, f64::max),
    );
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("push+pull, 1 client, 1 shard", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x0 - 0.3..x1 + 0.3, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("tensor size")
        .y_desc("Gbit/s (both directions)")
        .x_label_formatter(&|v| crate::report::size(2f64.powf(*v).round() as usize))
        .draw()?;
    for (sys, color) in SYSTEMS {
        let solid = series(loopback, sys);
        chart
            .draw_series(LineSeries::new(solid.clone(), color.stroke_width(2)))?
            .label(format!("{sys}, large datagrams"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(solid.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        if sys != "tcp" {
            let dashed = series(default, sys);
            chart
                .draw_series(DashedLineSeries::new(dashed, 6, 4, color.stroke_width(1)))?
                .label(format!("{sys}, default datagrams"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(1))
                });
        }
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

/// One color per shard count; the SSP series in black.
fn shard_color(shards: usize, consistency: &str) -> RGBColor {
    match (shards, consistency) {
        (_, c) if c != "asp" => BLACK,
        (1, _) => BLUE,
        (2, _) => RGBColor(0, 150, 0),
        _ => RED,
    }
}

/// Scaling efficiency against workers, one line per series (color: shards; solid: dense,
/// dashed: sparse); saturated points hollow, the 90% target dotted.
pub fn scale(r: &scale::Results, path: &Path) -> anyhow::Result<()> {
    let mut series: Vec<String> = Vec::new();
    for x in &r.rows {
        if !series.contains(&x.series()) {
            series.push(x.series());
        }
    }
    let most = r.rows.iter().map(|x| x.workers).max().unwrap_or(1) as f64;
    let top = r
        .rows
        .iter()
        .map(|x| x.efficiency * 100.0)
        .fold(110.0, f64::max)
        + 5.0;
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "scaling efficiency, {} model, {:.0} ms compute per step",
                crate::report::size(r.model_bytes),
                r.compute_ms
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..most + 1.0, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("workers (solid: dense, dashed: sparse; hollow: saturated)")
        .y_desc("efficiency, % of n × one worker")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}%"))
        .draw()?;
    chart.draw_series(DashedLineSeries::new(
        vec![(0.0, 90.0), (most + 1.0, 90.0)],
        3,
        5,
        BLACK.mix(0.4).stroke_width(1),
    ))?;
    for name in &series {
        let pts: Vec<&scale::Row> = r.rows.iter().filter(|x| &x.series() == name).collect();
        let Some(first) = pts.first() else { continue };
        let color = shard_color(first.shards, &first.consistency);
        let xy: Vec<(f64, f64)> = pts
            .iter()
            .map(|x| (x.workers as f64, x.efficiency * 100.0))
            .collect();
        let legend = name.clone();
        if first.mode == scale::Mode::Dense {
            chart
                .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))?
                .label(legend)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        } else {
            chart
                .draw_series(DashedLineSeries::new(
                    xy.clone(),
                    6,
                    4,
                    color.stroke_width(2),
                ))?
                .label(legend)
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(0, 0), (7, 0)], color.stroke_width(2))
                        + PathElement::new(vec![(11, 0), (18, 0)], color.stroke_width(2))
                });
        }
        chart.draw_series(pts.iter().map(|x| {
            let style = if x.saturated {
                color.stroke_width(2)
            } else {
                color.filled()
            };
            Circle::new((x.workers as f64, x.efficiency * 100.0), 4, style)
        }))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Time to the target accuracy as bars (median over the seeds, whiskers from the fastest to
/// the slowest), grouped by worker count, one color per consistency model.
pub fn tta(r: &tta::Results, path: &Path) -> anyhow::Result<()> {
    let mut workers: Vec<usize> = r.summary.iter().map(|c| c.workers).collect();
    workers.sort_unstable();
    workers.dedup();
    let mut modes: Vec<String> = Vec::new();
    for c in &r.summary {
        if !modes.contains(&c.consistency) {
            modes.push(c.consistency.clone());
        }
    }
    let top = r
        .summary
        .iter()
        .filter_map(|c| c.max_tta_s)
        .fold(0.5, f64::max)
        * 1.2;
    let colors = [BLUE, RGBColor(0, 150, 0), RED, MAGENTA, CYAN];
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("time to {} test accuracy, Fashion-MNIST", r.target),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.6..workers.len() as f64 - 0.4, 0.0..top)?;
    let labels = workers.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(workers.len())
        .x_label_formatter(&|v| {
            let i = v.round();
            match labels.get(i as usize) {
                Some(w) if (v - i).abs() < 0.01 && i >= 0.0 => {
                    format!("{w} worker{}", if *w == 1 { "" } else { "s" })
                }
                _ => String::new(),
            }
        })
        .y_desc("seconds (median; whiskers: fastest, slowest)")
        .draw()?;
    let width = 0.8 / modes.len().max(1) as f64;
    for (m, mode) in modes.iter().enumerate() {
        let color = colors[m % colors.len()];
        let cells: Vec<(f64, &tta::Cell)> = r
            .summary
            .iter()
            .filter(|c| &c.consistency == mode)
            .filter_map(|c| {
                let g = workers.iter().position(|w| *w == c.workers)?;
                Some((g as f64 - 0.4 + width * (m as f64 + 0.5), c))
            })
            .collect();
        chart
            .draw_series(cells.iter().filter_map(|(x, c)| {
                let h = c.median_tta_s?;
                Some(Rectangle::new(
                    [(x - width * 0.45, 0.0), (x + width * 0.45, h)],
                    color.mix(0.7).filled(),
                ))
            }))?
            .label(mode.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        chart.draw_series(cells.iter().filter_map(|(x, c)| {
            let (lo, hi) = (c.min_tta_s?, c.max_tta_s?);
            Some(PathElement::new(
                vec![(*x, lo), (*x, hi)],
                BLACK.stroke_width(2),
            ))
        }))?;
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
