//! The plots of a run (`edl-local --plot DIR`): throughput, active workers, training loss and
//! test accuracy over time, with every membership, resharding and shard event marked, and
//! what each event cost (its stall), drawn from the coordinator's history and the report's
//! events.

use std::path::{Path, PathBuf};

use edl_shared::proto::msg::JobHistory;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::report::EventReport;

/// One series of a panel: its points, colour, legend, and whether it is drawn as dots.
type Series<'a> = (&'a [(f64, f64)], RGBColor, &'a str, bool);

/// A panel's chart: time in seconds (0 to `end`) against `0..y_max`, with its mesh drawn.
type TimeChart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn time_chart<'a, 'b>(
    area: &'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>,
    end: f64,
    y_max: f64,
    y_desc: &str,
) -> anyhow::Result<TimeChart<'a, 'b>> {
    let mut chart = ChartBuilder::on(area)
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the coordinator started")
        .y_desc(y_desc)
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    Ok(chart)
}

/// Draws a chart's legend (lower left, where the curves rarely are).
fn legend<'a, 'b: 'a>(chart: &mut TimeChart<'a, 'b>) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

/// An event's colour on the plots.
fn color(kind: &str) -> RGBColor {
    match kind {
        "join" => RGBColor(46, 160, 67),
        "leave" => RGBColor(120, 120, 120),
        "dead" => RGBColor(215, 38, 38),
        "drain" => RGBColor(230, 140, 20),
        "move" => RGBColor(40, 100, 220),
        "preempt" => RGBColor(140, 60, 200),
        k if k.contains("shard") => RGBColor(150, 80, 170),
        _ => RGBColor(30, 30, 30),
    }
}

/// The kinds worth a marker (not straggler flags, which come and go often).
fn marked(kind: &str) -> bool {
    !matches!(kind, "straggler" | "recovered" | "replace_requested")
}

/// Draws `DIR/run.png`; returns its path.
pub fn draw(dir: &Path, history: &JobHistory, events: &[EventReport]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("run.png");
    let secs = |t_ms: u64| t_ms as f64 / 1000.0;
    let bucket_s = history.bucket_ms.max(1) as f64 / 1000.0;
    let end = history
        .points
        .iter()
        .map(|p| secs(p.t_ms) + bucket_s)
        .chain(history.evaluations.iter().map(|e| secs(e.t_ms)))
        .chain(events.iter().map(|e| secs(e.t_ms)))
        .fold(1.0, f64::max)
        * 1.03;
    let rate: Vec<(f64, f64)> = history
        .points
        .iter()
        .map(|p| (secs(p.t_ms), p.samples as f64 / bucket_s))
        .collect();
    let workers: Vec<(f64, f64)> = history
        .points
        .iter()
        .map(|p| (secs(p.t_ms), f64::from(p.workers)))
        .collect();
    let loss: Vec<(f64, f64)> = history
        .points
        .iter()
        .filter(|p| p.samples > 0)
        .map(|p| (secs(p.t_ms), p.loss_sum / p.samples as f64))
        .collect();
    let accuracy: Vec<(f64, f64)> = history
        .evaluations
        .iter()
        .map(|e| (secs(e.t_ms), 100.0 * e.accuracy))
        .collect();
    let marks: Vec<&EventReport> = events.iter().filter(|e| marked(&e.kind)).collect();

    let root = BitMapBackend::new(&path, (1100, 1300)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("EDL run", ("sans-serif", 24))?;
    let panels = root.split_evenly((5, 1));
    let top = |v: &[(f64, f64)]| v.iter().map(|p| p.1).fold(0.0, f64::max) * 1.1 + 1e-9;

    // One panel of series over time, with the event markers.
    let panel = |area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
                 y_desc: &str,
                 y_max: f64,
                 series: &[Series<'_>]|
     -> anyhow::Result<()> {
        let mut chart = time_chart(area, end, y_max, y_desc)?;
        for e in &marks {
            let x = secs(e.t_ms);
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(x, 0.0), (x, y_max)],
                color(&e.kind).mix(0.5).stroke_width(1),
            )))?;
        }
        for (points, c, label, dots) in series {
            if *dots {
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, 4, c.filled())))?
                    .label(*label)
                    .legend(move |(x, y)| Circle::new((x + 7, y), 4, c.filled()));
            } else {
                chart
                    .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))?
                    .label(*label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 14, y)], c.stroke_width(2))
                    });
            }
        }
        legend(&mut chart)
    };
    let blue = RGBColor(40, 100, 220);
    panel(
        &panels[0],
        "samples/s",
        top(&rate),
        &[(&rate, blue, "throughput (per 1 s window)", false)],
    )?;
    panel(
        &panels[1],
        "active workers",
        top(&workers).max(1.0),
        &[(&workers, RGBColor(46, 160, 67), "active workers", false)],
    )?;
    panel(
        &panels[2],
        "training loss",
        top(&loss),
        &[(
            &loss,
            RGBColor(215, 38, 38),
            "mean training loss per window",
            false,
        )],
    )?;
    panel(
        &panels[3],
        "test accuracy, %",
        100.0,
        &[(&accuracy, RGBColor(140, 60, 200), "evaluations", true)],
    )?;

    // The stall of every event, as a bar at its time.
    let stalls: Vec<(f64, f64, &str)> = marks
        .iter()
        .filter_map(|e| Some((secs(e.t_ms), e.stall_ms?, e.kind.as_str())))
        .collect();
    let stall_top = stalls.iter().map(|s| s.1).fold(0.0, f64::max) * 1.15 + 1.0;
    let mut chart = time_chart(&panels[4], end, stall_top, "stall per event, ms")?;
    let w = end / 300.0;
    chart.draw_series(
        stalls.iter().map(|&(x, ms, kind)| {
            Rectangle::new([(x - w, 0.0), (x + w, ms)], color(kind).filled())
        }),
    )?;
    let mut kinds: Vec<&str> = stalls.iter().map(|s| s.2).collect();
    kinds.sort_unstable();
    kinds.dedup();
    for kind in kinds {
        let c = color(kind);
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label(kind)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    legend(&mut chart)?;
    root.present()?;
    Ok(dir.join("run.png"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::ids::Clock;
    use edl_shared::proto::msg::{EvalRecord, HistoryPoint};

    #[test]
    fn draws_a_png_of_a_run_with_events() {
        let history = JobHistory {
            bucket_ms: 1000,
            points: (0..30)
                .map(|i| HistoryPoint {
                    t_ms: i * 1000,
                    samples: 500 + i * 10,
                    loss_sum: 500.0 / (1.0 + i as f64),
                    steps: 10,
                    workers: if i < 15 { 2 } else { 3 },
                })
                .collect(),
            evaluations: vec![EvalRecord {
                t_ms: 20_000,
                name: "eval".into(),
                clock: Clock(100),
                accuracy: 0.8,
                loss: 0.5,
                samples: 1000,
            }],
        };
        let event = |t_ms, kind: &str, stall| EventReport {
            t_ms,
            kind: kind.into(),
            worker: "w2".into(),
            step_ms: Some(50.0),
            stall_ms: stall,
            join_latency_ms: None,
            hold_ms: None,
            bytes: None,
            took_ms: None,
        };
        let events = vec![
            event(15_000, "join", Some(40.0)),
            event(22_000, "dead", None),
        ];
        let dir = tempfile::tempdir().expect("tempdir");
        let path = draw(dir.path(), &history, &events).expect("draws");
        let png = std::fs::read(&path).expect("written");
        assert_eq!(&png[1..4], b"PNG");
        assert!(png.len() > 10_000, "{} bytes", png.len());
    }
}
