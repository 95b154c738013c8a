//! Measured speed by GPU count per model and batch size, for trace jobs that name their
//! model: tables in the ElasticFlow artifact's format (one CSV per model, named after it: a
//! row per global batch size, a column per GPU count, iterations per second in the cells; an
//! empty or zero cell is a size the model cannot run at). Six models measured on A100 GPUs
//! ship in `ps/sched/curves/elasticflow-a100/` and are built in (derived from the MIT-licensed
//! ElasticFlow traces, whose durations are iterations over the ElasticFlow artifact's measured
//! throughput; see the folder's README).
//!
//! A job's curve is its model's row for its batch size (the nearest batch size the table has,
//! if not that one). A job whose model is not in the tables gets the typical curve: at each
//! GPU count, the mean of every row's speed-up. Curves are flat past their last point: more
//! GPUs than the largest useful size buy nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};

use crate::speed::Speedup;
use crate::trace::TraceJob;

/// Six models' throughput on A100 GPUs, derived from the ElasticFlow traces (MIT; see the
/// folder's README).
const BUILT_IN: [(&str, &str); 6] = [
    ("bert", include_str!("../curves/elasticflow-a100/bert.csv")),
    (
        "deepspeech2",
        include_str!("../curves/elasticflow-a100/deepspeech2.csv"),
    ),
    ("gpt2", include_str!("../curves/elasticflow-a100/gpt2.csv")),
    (
        "inception3",
        include_str!("../curves/elasticflow-a100/inception3.csv"),
    ),
    (
        "resnet50",
        include_str!("../curves/elasticflow-a100/resnet50.csv"),
    ),
    (
        "vgg16",
        include_str!("../curves/elasticflow-a100/vgg16.csv"),
    ),
];

/// Speed curves by model and batch size.
#[derive(Clone, Debug)]
pub struct Curves {
    /// By model, then by global batch size.
    models: BTreeMap<String, BTreeMap<u32, Arc<Speedup>>>,
    /// For jobs of other models: the mean speed-up of every row at each GPU count.
    typical: Arc<Speedup>,
}

impl Curves {
    /// The built-in tables (six models on A100s, derived from the ElasticFlow traces).
    pub fn built_in() -> Curves {
        // The built-in tables are checked by the tests below.
        Curves::from_tables(&BUILT_IN).unwrap_or_else(|_| Curves {
            models: BTreeMap::new(),
            typical: Arc::new(Speedup::Linear),
        })
    }

    /// Reads every `MODEL.csv` of `dir`.
    pub fn read_dir(dir: &Path) -> anyhow::Result<Curves> {
        let mut tables = Vec::new();
        let entries =
            std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
        for e in entries {
            let path = e?.path();
            if path.extension().is_some_and(|x| x == "csv") {
                let model = path
                    .file_stem()
                    .map(|s| s.to_string_lossy().to_string())
                    .unwrap_or_default();
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                tables.push((model, text));
            }
        }
        anyhow::ensure!(
            !tables.is_empty(),
            "{} has no MODEL.csv tables",
            dir.display()
        );
        Curves::from_tables(&tables).with_context(|| dir.display().to_string())
    }

    /// Parses `(model, table)` pairs.
    pub fn from_tables<M: AsRef<str>, T: AsRef<str>>(tables: &[(M, T)]) -> anyhow::Result<Curves> {
        let mut models = BTreeMap::new();
        for (model, text) in tables {
            let model = model.as_ref();
            let rows = parse(text.as_ref()).with_context(|| format!("{model}.csv"))?;
            models.insert(model.to_string(), rows);
        }
        // The typical curve: up to the largest GPU count measured, the mean speed-up.
        let all: Vec<&Arc<Speedup>> = models.values().flat_map(|r| r.values()).collect();
        anyhow::ensure!(!all.is_empty(), "no curves");
        let top = all
            .iter()
            .map(|c| match c.as_ref() {
                Speedup::Table(t) => t.len().saturating_sub(1) as u32,
                _ => 1,
            })
            .max()
            .unwrap_or(1);
        let typical = (0..=top)
            .map(|n| all.iter().map(|c| c.at(n)).sum::<f64>() / all.len() as f64)
            .collect();
        Ok(Curves {
            models,
            typical: Arc::new(Speedup::Table(typical)),
        })
    }

    /// The curve of `model` at `batch` (the nearest batch size measured; the first row if the
    /// job names none), if the tables have the model.
    pub fn of(&self, model: &str, batch: Option<u32>) -> Option<Arc<Speedup>> {
        let rows = self.models.get(model)?;
        let pick = match batch {
            Some(b) => rows
                .iter()
                .min_by_key(|(k, _)| k.abs_diff(b))
                .map(|(_, c)| c),
            None => rows.values().next(),
        };
        pick.cloned()
    }

    /// A trace job's curve: its model's, else the typical one.
    pub fn for_job(&self, j: &TraceJob) -> Arc<Speedup> {
        j.model
            .as_deref()
            .and_then(|m| self.of(m, j.batch))
            .unwrap_or_else(|| self.typical.clone())
    }

    /// The curve of a job of no known model.
    pub fn typical(&self) -> &Speedup {
        &self.typical
    }

    /// The models the tables have.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }
}

/// One model's table: `global_batch_size,1,2,4,...` then a row per batch size.
fn parse(text: &str) -> anyhow::Result<BTreeMap<u32, Arc<Speedup>>> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = lines.next().context("empty table")?;
    let sizes: Vec<u32> = header
        .split(',')
        .skip(1)
        .map(|c| {
            c.trim()
                .parse::<u32>()
                .ok()
                .filter(|n| *n > 0)
                .with_context(|| format!("header: {c:?} is not a GPU count"))
        })
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(!sizes.is_empty(), "the header names no GPU counts");
    let mut rows = BTreeMap::new();
    for (k, line) in lines.enumerate() {
        let mut cells = line.split(',');
        let batch: u32 = cells
            .next()
            .unwrap_or("")
            .trim()
            .parse()
            .with_context(|| format!("row {}: no batch size", k + 2))?;
        let mut pts = Vec::new();
        for (&n, cell) in sizes.iter().zip(cells) {
            let cell = cell.trim();
            if cell.is_empty() {
                continue;
            }
            let v: f64 = cell
                .parse()
                .with_context(|| format!("row {}: {cell:?} is not a number", k + 2))?;
            if !v.is_finite() || v < 0.0 {
                bail!("row {}: {cell:?} is not a throughput", k + 2);
            }
            if v > 0.0 {
                pts.push((n, v));
            }
        }
        anyhow::ensure!(!pts.is_empty(), "row {}: no measurement", k + 2);
        pts.sort_by_key(|p| p.0);
        rows.insert(batch, Arc::new(Speedup::Curve(pts).tabulated()));
    }
    anyhow::ensure!(!rows.is_empty(), "no rows");
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_tables_parse_and_scale_as_measured() {
        let c = Curves::from_tables(&BUILT_IN).expect("built-in tables");
        assert_eq!(c.models().count(), 6);
        // ResNet-50 at batch 256: 1.843 it/s on 1 GPU, 10.379 on 8 (the table's cells).
        let r = c.of("resnet50", Some(256)).expect("resnet50");
        assert!((r.at(8) - 10.378702 / 1.843375).abs() < 1e-5, "{}", r.at(8));
        // Between measured sizes: interpolated; past the last (64): flat.
        assert!(r.at(6) > r.at(4) && r.at(6) < r.at(8));
        assert_eq!(r.at(128), r.at(64));
        // The nearest batch size: 200 -> 256.
        assert_eq!(c.of("resnet50", Some(200)), Some(r));
        // DeepSpeech2 at batch 32 cannot run on 64 GPUs (empty cell): flat past 32.
        let d = c.of("deepspeech2", Some(32)).expect("deepspeech2");
        assert_eq!(d.at(64), d.at(32));
        // Unknown models get the typical curve, which scales far below linear at 16.
        let j = TraceJob {
            submit: 0.0,
            gpus: 1,
            duration: 1.0,
            model: Some("llama".into()),
            batch: None,
        };
        let t = c.for_job(&j);
        assert!(t.at(16) > 1.0 && t.at(16) < 8.0, "{}", t.at(16));
        assert_eq!(Curves::built_in().models().count(), 6);
    }

    /// Every cell agrees with the shipped traces: a job's duration is its iterations over the
    /// throughput at its model, batch size and GPU count, rounded up to a second.
    #[test]
    fn the_built_in_tables_are_the_shipped_traces_iterations_over_durations() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/elasticflow");
        let mut raw = std::collections::BTreeMap::new();
        for (m, t) in BUILT_IN {
            let mut lines = t.lines();
            let sizes: Vec<u32> = lines
                .next()
                .expect("header")
                .split(',')
                .skip(1)
                .map(|c| c.parse().expect("size"))
                .collect();
            for l in lines {
                let mut cells = l.split(',');
                let b: u32 = cells.next().expect("batch").parse().expect("batch");
                for (&n, c) in sizes.iter().zip(cells) {
                    if let Ok(v) = c.parse::<f64>() {
                        raw.insert((m.to_string(), b, n), v);
                    }
                }
            }
        }
        let mut checked = 0;
        for trace in ["195job.csv", "cluster01.csv", "cluster10.csv"] {
            let path = std::path::Path::new(dir).join(trace);
            let mut r = csv::Reader::from_path(&path).expect("trace");
            for rec in r.records() {
                let rec = rec.expect("row");
                let it: f64 = rec[2].parse().expect("iterations");
                let (model, batch): (&str, u32) = (&rec[3], rec[5].parse().expect("batch"));
                let (gpus, duration): (u32, f64) = (
                    rec[6].parse().expect("gpus"),
                    rec[7].parse().expect("duration"),
                );
                let thr = raw
                    .get(&(model.to_string(), batch, gpus))
                    .unwrap_or_else(|| panic!("no cell for {model} {batch} {gpus}"));
                assert_eq!(
                    (it / thr).ceil(),
                    duration,
                    "{trace}: {model} {batch} {gpus}: {it} iterations at {thr}/s"
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 195 + 1595 + 260, "every job of the three traces");
    }

    #[test]
    fn bad_tables_are_refused_by_line() {
        for (text, want) in [
            ("", "empty"),
            ("global_batch_size,1,x\n", "not a GPU count"),
            ("global_batch_size,1,2\n64,1.0,abc\n", "row 2"),
            ("global_batch_size,1,2\n64,-1,2\n", "not a throughput"),
            ("global_batch_size,1,2\n", "no rows"),
        ] {
            let e = Curves::from_tables(&[("m", text)]).expect_err(text);
            assert!(format!("{e:#}").contains(want), "{text:?}: {e:#}");
        }
    }
}
