//! PNG plots of the results (plotters).

use std::path::Path;

use plotters::prelude::*;

use crate::transport;

const SYSTEMS: [(&str, RGBColor); 3] = [("edl", BLUE), ("quinn", GREEN), ("tcp", RED)];

/// Gbit/s against tensor size, one line per system, for one client and one shard; solid with
/// large datagrams, dashed with QUIC's default ones.
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
