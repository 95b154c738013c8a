//! The outcome of a local run: the evaluator's verdict, per-epoch training figures and timings,
//! as a human summary and as a JSON report.

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use edl_shared::proto::msg::JobStatus;
use serde::{Deserialize, Serialize};

/// The line `edl-worker --evaluate` prints on stdout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Fraction of test images classified correctly.
    pub test_accuracy: f64,
    /// Mean cross-entropy loss on the test set.
    pub test_loss: f64,
    /// Test images evaluated.
    pub test_samples: u64,
}

impl Evaluation {
    /// Parses the evaluator's stdout: the last non-empty line must be its JSON result, so that a
    /// stray line printed before it does not matter.
    pub fn parse(stdout: &str) -> anyhow::Result<Evaluation> {
        let line = stdout
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .context("the evaluator printed nothing on stdout")?;
        serde_json::from_str(line)
            .with_context(|| format!("the evaluator printed {line:?}, not its JSON result"))
    }
}

/// Training figures of one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochReport {
    /// The epoch, counted from 0.
    pub epoch: u32,
    /// Samples trained on.
    pub samples: u64,
    /// Mean per-sample training loss (0 when the epoch has no samples).
    pub train_loss: f64,
}

/// Everything a run reports; written as JSON with `--report`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Fraction of test images the final model classifies correctly.
    pub test_accuracy: f64,
    /// Mean test loss of the final model.
    pub test_loss: f64,
    /// Test images evaluated.
    pub test_samples: u64,
    /// Per-epoch training figures.
    pub epochs: Vec<EpochReport>,
    /// Samples trained on in all epochs.
    pub samples: u64,
    /// Whether the coordinator saw every partition of every epoch completed.
    pub finished: bool,
    /// Training samples per second of training wall time.
    pub throughput_samples_per_s: f64,
    /// Seconds the whole launcher run took, set-up and shutdown included.
    pub wall_s: f64,
    /// Seconds from the first active worker to the last worker's exit.
    pub train_wall_s: f64,
    /// Shard servers.
    pub shards: u32,
    /// Training workers.
    pub workers: u32,
    /// The consistency model, as given on the command line (`ssp:2`).
    pub consistency: String,
    /// The optimizer, as given on the command line (`adam:0.001`).
    pub optimizer: String,
    /// MLP layer widths.
    pub layers: Vec<u32>,
    /// Samples per mini-batch.
    pub batch_size: u32,
    /// Training samples per epoch.
    pub train_samples: u32,
    /// Seed for initialization and data order.
    pub seed: u64,
    /// The state directory: PKI, address file and logs.
    pub state_dir: PathBuf,
    /// Problems seen while stopping the servers (empty when they all stopped cleanly).
    pub shutdown_problems: Vec<String>,
}

/// Per-epoch figures from a status snapshot.
pub fn epoch_reports(st: &JobStatus) -> Vec<EpochReport> {
    st.epochs
        .iter()
        .map(|e| EpochReport {
            epoch: e.epoch,
            samples: e.samples,
            train_loss: if e.samples > 0 {
                e.loss_sum / e.samples as f64
            } else {
                0.0
            },
        })
        .collect()
}

/// Samples per second, or 0 when no time was measured.
pub fn throughput(samples: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        samples as f64 / seconds
    } else {
        0.0
    }
}

impl Report {
    /// Writes the report as pretty JSON, atomically, so that a reader never sees half of it.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let mut json = serde_json::to_vec_pretty(self).context("encoding the report")?;
        json.push(b'\n');
        edl_shared::pki::write_atomic(path, &json)
            .with_context(|| format!("writing the report {}", path.display()))
    }
}

impl fmt::Display for Report {
    /// The human summary.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "edl-local: {} shards, {} workers, {}, {}, batch {}, {} training samples per epoch",
            self.shards,
            self.workers,
            self.consistency,
            self.optimizer,
            self.batch_size,
            self.train_samples
        )?;
        for e in &self.epochs {
            writeln!(
                f,
                "  epoch {}: {} samples, mean train loss {:.4}",
                e.epoch + 1,
                e.samples,
                e.train_loss
            )?;
        }
        if !self.finished {
            writeln!(
                f,
                "  warning: the coordinator did not see every epoch completed"
            )?;
        }
        writeln!(
            f,
            "  test accuracy {:.4} (mean loss {:.4} on {} test images)",
            self.test_accuracy, self.test_loss, self.test_samples
        )?;
        writeln!(
            f,
            "  throughput {:.0} samples/s ({} samples in {:.1} s of training); {:.1} s in all",
            self.throughput_samples_per_s, self.samples, self.train_wall_s, self.wall_s
        )?;
        for p in &self.shutdown_problems {
            writeln!(f, "  warning: {p}")?;
        }
        write!(
            f,
            "  state and logs: {}",
            self.state_dir.join("logs").display()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::Clock;
    use edl_shared::proto::msg::EpochStats;

    #[test]
    fn evaluation_reads_the_last_line() {
        let e = Evaluation::parse(
            "noise\n{\"test_accuracy\":0.875,\"test_loss\":0.35,\"test_samples\":10000}\n\n",
        )
        .expect("parse");
        assert_eq!(e.test_accuracy, 0.875);
        assert_eq!(e.test_loss, 0.35);
        assert_eq!(e.test_samples, 10_000);
    }

    #[test]
    fn evaluation_rejects_empty_and_garbage_output() {
        let err = Evaluation::parse("\n  \n").expect_err("empty");
        assert!(err.to_string().contains("nothing"), "{err}");
        let err = Evaluation::parse("{\"test_accuracy\":1}").expect_err("partial");
        assert!(format!("{err:#}").contains("not its JSON"), "{err:#}");
    }

    #[test]
    fn epoch_reports_divide_loss_by_samples() {
        let st = JobStatus {
            shards_joined: 1,
            shards_expected: 1,
            samples_total: 200,
            samples_done: 100,
            epochs: vec![
                EpochStats {
                    epoch: 0,
                    samples: 100,
                    loss_sum: 25.0,
                },
                EpochStats {
                    epoch: 1,
                    samples: 0,
                    loss_sum: 0.0,
                },
            ],
            workers: vec![],
            min_clock: Clock(0),
            finished: false,
        };
        let r = epoch_reports(&st);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].epoch, r[0].samples, r[0].train_loss), (0, 100, 0.25));
        assert_eq!((r[1].samples, r[1].train_loss), (0, 0.0));
        assert_eq!(throughput(1000, 2.0), 500.0);
        assert_eq!(throughput(1000, 0.0), 0.0);
    }

    #[test]
    fn report_round_trips_through_json_with_the_documented_keys() {
        let report = Report {
            test_accuracy: 0.86,
            test_loss: 0.4,
            test_samples: 10_000,
            epochs: vec![EpochReport {
                epoch: 0,
                samples: 60_000,
                train_loss: 0.5,
            }],
            samples: 60_000,
            finished: true,
            throughput_samples_per_s: 3000.0,
            wall_s: 25.0,
            train_wall_s: 20.0,
            shards: 2,
            workers: 3,
            consistency: "ssp:2".into(),
            optimizer: "adam:0.001".into(),
            layers: vec![784, 256, 128, 10],
            batch_size: 64,
            train_samples: 60_000,
            seed: 1,
            state_dir: "/tmp/edl-local-1".into(),
            shutdown_problems: vec![],
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("r.json");
        report.write_json(&path).expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        let value: serde_json::Value = serde_json::from_str(&text).expect("json");
        for key in [
            "test_accuracy",
            "test_loss",
            "epochs",
            "throughput_samples_per_s",
            "wall_s",
            "train_wall_s",
            "shards",
            "workers",
            "consistency",
            "optimizer",
            "batch_size",
            "train_samples",
            "state_dir",
        ] {
            assert!(value.get(key).is_some(), "missing {key}");
        }
        assert_eq!(value["epochs"][0]["train_loss"], 0.5);
        let back: Report = serde_json::from_str(&text).expect("decode");
        assert_eq!(back, report);
        let summary = report.to_string();
        assert!(summary.contains("test accuracy 0.8600"), "{summary}");
        assert!(summary.contains("/tmp/edl-local-1/logs"), "{summary}");
    }
}
