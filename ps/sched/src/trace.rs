//! Job traces: any CSV with a submission time, a GPU count and a duration per job, the
//! column names given by the caller (the ElasticFlow traces' by default).

use std::path::Path;

use anyhow::Context;

/// One job of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceJob {
    /// Submission time, seconds.
    pub submit: f64,
    /// GPUs it asked for (at least 1).
    pub gpus: u32,
    /// Seconds it ran with them.
    pub duration: f64,
    /// Its model, if the trace names it (its speed curve, [`crate::curves::Curves`]).
    pub model: Option<String>,
    /// Its global batch size, if the trace gives it.
    pub batch: Option<u32>,
}

/// The columns to read.
#[derive(Clone, Debug)]
pub struct Columns {
    /// Submission time in seconds.
    pub submit: String,
    /// GPU count.
    pub gpus: String,
    /// Duration in seconds.
    pub duration: String,
    /// The model's name (optional: a trace without it has no model per job).
    pub model: String,
    /// The global batch size (optional).
    pub batch: String,
}

impl Default for Columns {
    fn default() -> Self {
        Columns {
            submit: "submission_time".into(),
            gpus: "num_gpu".into(),
            duration: "duration".into(),
            model: "model_name".into(),
            batch: "batch_size".into(),
        }
    }
}

/// Reads a CSV trace; jobs come out in submission order. A row with a missing or bad value
/// is an error naming its line; jobs of zero duration are skipped.
pub fn read(path: &Path, cols: &Columns) -> anyhow::Result<Vec<TraceJob>> {
    let mut r =
        csv::Reader::from_path(path).with_context(|| format!("reading {}", path.display()))?;
    let headers = r.headers()?.clone();
    let col = |name: &str| {
        headers.iter().position(|h| h == name).with_context(|| {
            format!(
                "{} has no column {name:?} (it has: {})",
                path.display(),
                headers.iter().collect::<Vec<_>>().join(", ")
            )
        })
    };
    let (s, g, d) = (col(&cols.submit)?, col(&cols.gpus)?, col(&cols.duration)?);
    let optional = |name: &str| headers.iter().position(|h| h == name);
    let (m, b) = (optional(&cols.model), optional(&cols.batch));
    let mut jobs = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.with_context(|| format!("{} line {}", path.display(), i + 2))?;
        let num = |c: usize, what: &str| -> anyhow::Result<f64> {
            let v = rec.get(c).unwrap_or("").trim();
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .with_context(|| {
                    format!(
                        "{} line {}: {what} {v:?} is not a number of 0 or more",
                        path.display(),
                        i + 2
                    )
                })
        };
        let job = TraceJob {
            submit: num(s, "submission time")?,
            gpus: (num(g, "GPU count")?.round() as u32).max(1),
            duration: num(d, "duration")?,
            model: m
                .and_then(|c| rec.get(c))
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_string),
            batch: match b {
                Some(c) => Some(num(c, "batch size")?.round() as u32).filter(|b| *b > 0),
                None => None,
            },
        };
        if job.duration > 0.0 {
            jobs.push(job);
        }
    }
    jobs.sort_by(|a, b| a.submit.total_cmp(&b.submit));
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_by_name_and_clear_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t.csv");
        std::fs::write(&p, "id,t,g,d\na,5,2,10\nb,1,0,3\nc,2,1,0\n").expect("write");
        let cols = Columns {
            submit: "t".into(),
            gpus: "g".into(),
            duration: "d".into(),
            ..Columns::default()
        };
        let jobs = read(&p, &cols).expect("read");
        assert_eq!(jobs.len(), 2);
        assert_eq!((jobs[0].submit, jobs[0].gpus), (1.0, 1));
        let e = read(&p, &Columns::default()).expect_err("no such column");
        assert!(
            e.to_string().contains("no column \"submission_time\""),
            "{e}"
        );
        std::fs::write(&p, "t,g,d\n1,x,3\n").expect("write");
        let e = read(&p, &cols).expect_err("bad value");
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
    }
}
