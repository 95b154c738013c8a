//! The outcome of a local run: the evaluator's verdict, per-epoch training figures and timings,
//! as a human summary and as a JSON report.

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use edl_shared::proto::msg::JobTrace;
use serde::{Deserialize, Serialize};

use crate::costs::{KindSummary, StallNoise};

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

/// Training figures of one epoch. The data account comes from the shards' ledgers, worst case
/// over shards; a correct run has `samples` equal to the training samples per epoch and no
/// duplicates or misses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochReport {
    /// The epoch, counted from 0.
    pub epoch: u32,
    /// Sample positions whose gradient was applied, on the shard that applied fewest.
    pub samples: u64,
    /// Sample positions applied more than once, on the worst shard.
    pub duplicates: u64,
    /// Sample positions never applied, on the worst shard.
    pub missing: u64,
    /// Pushes a shard skipped as already applied (re-issued data of a departed worker), most
    /// on one shard.
    pub skipped_pushes: u64,
    /// Samples the workers reported to the coordinator.
    pub reported_samples: u64,
    /// Mean per-sample training loss (0 when the epoch has no samples).
    pub train_loss: f64,
    /// Payload bytes the workers pushed for this epoch's steps (see [`Traffic`]).
    #[serde(default)]
    pub bytes_pushed: u64,
    /// Payload bytes the workers pulled for this epoch's steps.
    #[serde(default)]
    pub bytes_pulled: u64,
}

/// Payload bytes on the wire between workers and shards, all workers and epochs together:
/// gradients pushed and parameters pulled, as each worker counted them and reported them to
/// the coordinator with its steps (frame headers and QUIC's own bytes not included). The
/// bytes a worker moved after its last step report are not counted (a worker that died or
/// left mid-step, its last pulls).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Traffic {
    /// Gradient bytes pushed to the shards.
    pub bytes_pushed: u64,
    /// Parameter bytes pulled from the shards.
    pub bytes_pulled: u64,
    /// Bytes pushed per sample trained on (0 without samples).
    pub pushed_per_sample: f64,
    /// Bytes pulled per sample trained on (0 without samples).
    pub pulled_per_sample: f64,
}

impl Traffic {
    /// The totals of `epochs`, per sample of `samples`.
    pub fn of(epochs: &[EpochReport], samples: u64) -> Traffic {
        let pushed = epochs.iter().map(|e| e.bytes_pushed).sum::<u64>();
        let pulled = epochs.iter().map(|e| e.bytes_pulled).sum::<u64>();
        let per = |b: u64| {
            if samples > 0 {
                b as f64 / samples as f64
            } else {
                0.0
            }
        };
        Traffic {
            bytes_pushed: pushed,
            bytes_pulled: pulled,
            pushed_per_sample: per(pushed),
            pulled_per_sample: per(pulled),
        }
    }
}

/// One membership or shard event and what it cost the workers (see [`crate::costs`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventReport {
    /// Milliseconds since the coordinator started (the first one, where the scenario
    /// restarted it: a restarted coordinator's trace holds only what happened since).
    pub t_ms: u64,
    /// `join`, `drain`, `leave` or `dead` (the coordinator's membership events); `move` (a
    /// key-range move of the coordinator's trace); `shard_add`, `shard_remove`, `kill_shard`
    /// or `restart_shard` (the launcher's shard events); `kill_coordinator` or
    /// `restart_coordinator` (the launcher's coordinator events).
    pub kind: String,
    /// The worker's name; for a move, its keys and shards (`keys 3..6 s0→s2`); for a shard
    /// event, the shard's name (`coordinator` for the coordinator's events).
    pub worker: String,
    /// The other workers' median step time just before the event.
    pub step_ms: Option<f64>,
    /// How much longer than usual the others' step across the event took, the worst of them.
    pub stall_ms: Option<f64>,
    /// For a join: from the admission request to the worker's first step.
    pub join_latency_ms: Option<f64>,
    /// For a move: how long the range could be neither read nor written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ms: Option<f64>,
    /// For a move: the bytes of state streamed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// For a move, how long it took; for a shard event, the launcher's part (see
    /// [`crate::costs::ShardAction`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub took_ms: Option<f64>,
}

/// One shard server at the end of the run, as the coordinator and the shard itself told.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardLayout {
    /// The coordinator's id for it.
    pub id: u32,
    /// Its process (certificate) name.
    pub name: String,
    /// `active`, `standby` or `retired`.
    pub role: String,
    /// Key ranges it holds, as `start..end`.
    pub ranges: Vec<String>,
    /// Keys it holds.
    pub keys: u64,
    /// Why its holdings could not be read, if they could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One stop-everything restart of the `--restart-on-change` baseline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RestartReport {
    /// When it began, in milliseconds since the coordinator started.
    pub t_ms: u64,
    /// The scenario event that caused it.
    pub cause: String,
    /// Workers training before it.
    pub workers_before: u32,
    /// Workers started by it.
    pub workers_after: u32,
    /// Pulling every parameter and writing the checkpoint file.
    pub checkpoint_ms: f64,
    /// From SIGTERM to every old worker having exited.
    pub stop_ms: f64,
    /// From starting the new workers to each of them having taken a step (or exited because
    /// no data was left).
    pub start_ms: f64,
    /// The checkpoint file.
    pub checkpoint: PathBuf,
    /// Its size.
    pub checkpoint_bytes: u64,
}

/// A scenario event that did not happen, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SkippedEvent {
    /// Its time in the scenario.
    pub at_s: f64,
    /// What it would have done.
    pub action: String,
    /// Why it did not.
    pub reason: String,
}

/// A worker process the launcher started, and how it ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerProcess {
    /// Its name (certificate name and log file).
    pub name: String,
    /// The slot it ran in.
    #[serde(default)]
    pub slot: String,
    /// The placement it was started for (a replacement, a migration or a resize the
    /// coordinator asked for).
    #[serde(default)]
    pub placement: Option<u64>,
    /// When the launcher saw it exit, in milliseconds since the coordinator started (to
    /// within the launcher's status period).
    #[serde(default)]
    pub exited_ms: Option<u64>,
    /// What the launcher did to it: `none`, `drained`, `termed`, `killed`, `restarted` or
    /// `preempted`.
    pub fate: String,
    /// Its exit code, when it exited normally.
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
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
    /// Samples trained on in all epochs, as the workers reported them to the coordinator.
    pub samples: u64,
    /// Whether the coordinator saw every partition of every epoch completed.
    pub finished: bool,
    /// Training samples per second of training wall time.
    pub throughput_samples_per_s: f64,
    /// Payload bytes pushed and pulled by the workers.
    #[serde(default)]
    pub traffic: Traffic,
    /// Seconds the whole launcher run took, set-up and shutdown included.
    pub wall_s: f64,
    /// Seconds from the first active worker to the last worker's exit.
    pub train_wall_s: f64,
    /// Shard servers.
    pub shards: u32,
    /// Training workers at the start.
    pub workers: u32,
    /// The consistency model, as given on the command line (`ssp:2`).
    pub consistency: String,
    /// The optimizer, as given on the command line (`adam:0.001`).
    pub optimizer: String,
    /// Its learning-rate schedule (`constant`, `step,step_size=1,gamma=0.7,by=epoch`).
    pub schedule: String,
    /// MLP layer widths.
    pub layers: Vec<u32>,
    /// Samples per mini-batch.
    pub batch_size: u32,
    /// Training samples per epoch.
    pub train_samples: u32,
    /// Seed for initialization and data order.
    pub seed: u64,
    /// The scenario file replayed, if any.
    pub scenario: Option<PathBuf>,
    /// How membership changes were carried out: `elastic` or `restart-on-change`.
    pub membership: String,
    /// What that means, in a sentence or two.
    pub membership_note: String,
    /// Membership events and key-range moves from the coordinator's trace and the launcher's
    /// shard events, in time order, with their costs.
    pub events: Vec<EventReport>,
    /// The events' costs per kind.
    pub event_summary: Vec<KindSummary>,
    /// The same stall measure at moments without any event: the floor to read the events'
    /// stalls against (`None` when the run had no such moments).
    pub stall_noise: Option<StallNoise>,
    /// The restarts of `--restart-on-change` (empty otherwise).
    pub restarts: Vec<RestartReport>,
    /// Scenario events that did not happen.
    pub scenario_skipped: Vec<SkippedEvent>,
    /// Every worker process started, and how it ended.
    pub worker_processes: Vec<WorkerProcess>,
    /// Every shard server the job had, as it stood once training was done.
    #[serde(default)]
    pub shard_layout: Vec<ShardLayout>,
    /// The state directory: PKI, address file, logs and checkpoints.
    pub state_dir: PathBuf,
    /// Problems seen while stopping the servers (empty when they all stopped cleanly).
    pub shutdown_problems: Vec<String>,
    /// What stragglers, preemptions, migrations and other placements did.
    #[serde(default)]
    pub elastic: crate::elastic::ElasticReport,
}

/// The coordinator's raw trace as JSON (`--trace`), for a closer look than the report's
/// per-event figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceDump {
    /// Membership events in time order.
    pub events: Vec<TraceEvent>,
    /// Step reports in time order.
    pub steps: Vec<TraceStep>,
    /// Key-range moves in time order.
    #[serde(default)]
    pub moves: Vec<TraceMove>,
}

/// One key-range move of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceMove {
    /// Milliseconds since the coordinator started, when the move began.
    pub t_ms: u64,
    /// First key.
    pub start: u64,
    /// One past the last key.
    pub end: u64,
    /// The shard (id) that held the range.
    pub from: u32,
    /// The shard (id) that holds it now.
    pub to: u32,
    /// The map epoch the move published.
    pub epoch: u64,
    /// Bytes of state streamed.
    pub bytes: u64,
    /// Milliseconds from the start of the move to its publication.
    pub millis: f64,
    /// Milliseconds the range could be neither read nor written.
    pub hold_ms: f64,
}

/// One membership event of the trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Milliseconds since the coordinator started.
    pub t_ms: u64,
    /// For a join: when the admission request arrived.
    pub requested_ms: u64,
    /// `join`, `drain`, `leave` or `dead`.
    pub kind: String,
    /// The coordinator's id for the worker.
    pub worker_id: u64,
    /// The worker's name.
    pub name: String,
}

/// One step report of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceStep {
    /// Milliseconds since the coordinator started.
    pub t_ms: u64,
    /// The coordinator's id for the worker.
    pub worker_id: u64,
    /// The worker's clock after the step.
    pub clock: u64,
}

impl TraceDump {
    /// The dump of `trace`.
    pub fn of(trace: &JobTrace) -> TraceDump {
        TraceDump {
            events: trace
                .events
                .iter()
                .map(|e| TraceEvent {
                    t_ms: e.t_ms,
                    requested_ms: e.requested_ms,
                    kind: crate::costs::kind_name(e.kind).into(),
                    worker_id: e.worker.0,
                    name: e.name.clone(),
                })
                .collect(),
            steps: trace
                .steps
                .iter()
                .map(|s| TraceStep {
                    t_ms: s.t_ms,
                    worker_id: s.worker.0,
                    clock: s.clock.0,
                })
                .collect(),
            moves: trace
                .moves
                .iter()
                .map(|m| TraceMove {
                    t_ms: m.t_ms,
                    start: m.start,
                    end: m.end,
                    from: m.from.0,
                    to: m.to.0,
                    epoch: m.epoch.0,
                    bytes: m.bytes,
                    millis: m.millis,
                    hold_ms: m.hold_ms,
                })
                .collect(),
        }
    }

    /// Writes the dump as JSON, atomically.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let mut json = serde_json::to_vec(self).context("encoding the trace")?;
        json.push(b'\n');
        edl_shared::pki::write_atomic(path, &json)
            .with_context(|| format!("writing the trace {}", path.display()))
    }
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
            "edl-local: {} shards, {} workers, {}, {}{}, batch {}, {} training samples per epoch",
            self.shards,
            self.workers,
            self.consistency,
            self.optimizer,
            match self.schedule.as_str() {
                "constant" | "" => String::new(),
                s => format!(" ({s})"),
            },
            self.batch_size,
            self.train_samples
        )?;
        for e in &self.epochs {
            write!(
                f,
                "  {}: {} samples applied ({} duplicates, {} missing",
                crate::progress::epoch_label(e.epoch, self.epochs.len() as u32),
                e.samples,
                e.duplicates,
                e.missing
            )?;
            if e.skipped_pushes > 0 {
                write!(f, ", {} re-issued pushes skipped", e.skipped_pushes)?;
            }
            writeln!(f, "), mean train loss {:.4}", e.train_loss)?;
        }
        if !self.finished {
            writeln!(
                f,
                "  warning: the coordinator did not see every epoch completed"
            )?;
        }
        if self.test_samples == 0 {
            writeln!(
                f,
                "  no test evaluation (the job's own program reported none to the coordinator)"
            )?;
        } else {
            writeln!(
                f,
                "  test accuracy {:.4} (mean loss {:.4} on {} test images)",
                self.test_accuracy, self.test_loss, self.test_samples
            )?;
        }
        writeln!(
            f,
            "  throughput {:.0} samples/s ({} samples in {:.1} s of training); {:.1} s in all",
            self.throughput_samples_per_s, self.samples, self.train_wall_s, self.wall_s
        )?;
        let t = &self.traffic;
        writeln!(
            f,
            "  traffic {} pushed, {} pulled ({:.0} and {:.0} bytes per sample)",
            edl_shared::units::human_bytes(t.bytes_pushed),
            edl_shared::units::human_bytes(t.bytes_pulled),
            t.pushed_per_sample,
            t.pulled_per_sample
        )?;
        if self.scenario.is_some() || !self.restarts.is_empty() {
            writeln!(f, "  membership: {}", self.membership)?;
        }
        // The baseline first, so that the events' stalls below can be read against it.
        let baseline = self
            .stall_noise
            .as_ref()
            .filter(|_| !self.events.is_empty());
        if let Some(n) = baseline {
            write!(
                f,
                "    stall (how much longer than usual the others' step across an event took) \
                 baseline {:.0} ms (p90 {:.0} ms) at {} moments without any event",
                n.median_stall_ms, n.p90_stall_ms, n.moments
            )?;
            if let Some(step) = n.median_step_ms {
                write!(f, " (a step took {step:.1} ms)")?;
            }
            writeln!(
                f,
                ":\n      the others' ordinary step-to-step variation; an event's stall at or below \
                 it is no measurable stall, above it the excess is what the event cost"
            )?;
        }
        for k in &self.event_summary {
            write!(f, "    {:<5} x{}", k.kind, k.count)?;
            if let (Some(med), Some(max)) = (k.median_stall_ms, k.max_stall_ms) {
                write!(
                    f,
                    ": stall median {med:.0} ms, max {max:.0} ms ({} measured",
                    k.measured
                )?;
                if let Some(step) = k.median_step_ms {
                    write!(f, "; a step took {step:.1} ms")?;
                }
                write!(f, ")")?;
                if let Some(n) = baseline {
                    let base = n.median_stall_ms;
                    if med <= base {
                        write!(
                            f,
                            ", median within the {base:.0} ms baseline: none measurable"
                        )?;
                    } else {
                        write!(
                            f,
                            ", median {:.0} ms above the {base:.0} ms baseline",
                            med - base
                        )?;
                    }
                }
            }
            if let Some(j) = k.median_join_latency_ms {
                write!(f, "; join latency median {j:.0} ms")?;
            }
            if let (Some(med), Some(max)) = (k.median_hold_ms, k.max_hold_ms) {
                write!(f, "; range held median {med:.1} ms, max {max:.1} ms")?;
            }
            writeln!(f)?;
        }
        let shard_events: Vec<&EventReport> = self
            .events
            .iter()
            .filter(|e| !["join", "drain", "leave", "dead"].contains(&e.kind.as_str()))
            .collect();
        if shard_events
            .iter()
            .any(|e| e.kind.ends_with("_coordinator"))
        {
            writeln!(f, "  shard and coordinator events:")?;
        } else if !shard_events.is_empty() {
            writeln!(f, "  shard events:")?;
        }
        for e in shard_events {
            write!(
                f,
                "    {:>6.1} s  {} {}:",
                e.t_ms as f64 / 1000.0,
                e.kind,
                e.worker
            )?;
            match e.stall_ms {
                Some(stall) => write!(f, " stall {stall:.0} ms")?,
                None => write!(f, " stall not measured")?,
            }
            if let Some(step) = e.step_ms {
                write!(f, " (a step took {step:.1} ms)")?;
            }
            if let Some(hold) = e.hold_ms {
                write!(f, ", held {hold:.1} ms")?;
            }
            if let Some(bytes) = e.bytes {
                write!(f, ", {}", edl_ps::admin::human_bytes(bytes))?;
            }
            if let Some(took) = e.took_ms {
                write!(f, ", took {took:.0} ms")?;
            }
            writeln!(f)?;
        }
        for (i, r) in self.restarts.iter().enumerate() {
            writeln!(
                f,
                "  restart {} at {:.1} s ({}): checkpoint {:.0} ms, stop {:.0} ms, start {:.0} ms; \
                 {} -> {} workers",
                i + 1,
                r.t_ms as f64 / 1000.0,
                r.cause,
                r.checkpoint_ms,
                r.stop_ms,
                r.start_ms,
                r.workers_before,
                r.workers_after
            )?;
        }
        write!(f, "{}", self.elastic)?;
        for s in &self.scenario_skipped {
            writeln!(
                f,
                "  skipped scenario event at {:.1} s ({}): {}",
                s.at_s, s.action, s.reason
            )?;
        }
        if !self.shard_layout.is_empty() {
            writeln!(f, "  shards at the end:")?;
        }
        for s in &self.shard_layout {
            write!(f, "    {} (id {}) {}", s.name, s.id, s.role)?;
            match &s.error {
                Some(e) => write!(f, ", unreachable: {e}")?,
                None if s.role == "retired" => {}
                None => write!(f, ": {} ({} keys)", s.ranges.join(", "), s.keys)?,
            }
            writeln!(f)?;
        }
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
    fn throughput_needs_time() {
        assert_eq!(throughput(1000, 2.0), 500.0);
        assert_eq!(throughput(1000, 0.0), 0.0);
    }

    #[test]
    fn report_round_trips_through_json_with_the_documented_keys() {
        let events = vec![
            EventReport {
                t_ms: 4000,
                kind: "leave".into(),
                worker: "w0".into(),
                step_ms: Some(12.0),
                stall_ms: Some(2500.0),
                join_latency_ms: None,
                hold_ms: None,
                bytes: None,
                took_ms: None,
            },
            EventReport {
                t_ms: 5000,
                kind: "move".into(),
                worker: "keys 3..6 s0→s2".into(),
                step_ms: Some(12.0),
                stall_ms: Some(20.0),
                join_latency_ms: None,
                hold_ms: Some(4.5),
                bytes: Some(2048),
                took_ms: Some(9.0),
            },
            EventReport {
                t_ms: 6000,
                kind: "join".into(),
                worker: "w3".into(),
                step_ms: Some(12.0),
                stall_ms: Some(1.0),
                join_latency_ms: Some(300.0),
                hold_ms: None,
                bytes: None,
                took_ms: None,
            },
        ];
        let report = Report {
            test_accuracy: 0.86,
            test_loss: 0.4,
            test_samples: 10_000,
            epochs: vec![EpochReport {
                epoch: 0,
                samples: 60_000,
                duplicates: 0,
                missing: 0,
                skipped_pushes: 2,
                reported_samples: 60_000,
                train_loss: 0.5,
                bytes_pushed: 6_000_000,
                bytes_pulled: 12_000_000,
            }],
            samples: 60_000,
            finished: true,
            throughput_samples_per_s: 3000.0,
            traffic: Traffic {
                bytes_pushed: 6_000_000,
                bytes_pulled: 12_000_000,
                pushed_per_sample: 100.0,
                pulled_per_sample: 200.0,
            },
            wall_s: 25.0,
            train_wall_s: 20.0,
            shards: 2,
            workers: 3,
            consistency: "ssp:2".into(),
            optimizer: "adam:0.001".into(),
            schedule: "constant".into(),
            layers: vec![784, 256, 128, 10],
            batch_size: 64,
            train_samples: 60_000,
            seed: 1,
            scenario: Some("churn.toml".into()),
            membership: "restart-on-change".into(),
            membership_note: "stops everything".into(),
            events: events.clone(),
            event_summary: crate::costs::kind_summaries(&events),
            stall_noise: Some(StallNoise {
                moments: 120,
                median_stall_ms: 9.0,
                p90_stall_ms: 31.0,
                median_step_ms: Some(11.5),
            }),
            restarts: vec![RestartReport {
                t_ms: 3900,
                cause: "drain w0".into(),
                workers_before: 3,
                workers_after: 2,
                checkpoint_ms: 4.0,
                stop_ms: 300.0,
                start_ms: 2000.0,
                checkpoint: "/tmp/edl-local-1/checkpoint-1.bin".into(),
                checkpoint_bytes: 1024,
            }],
            scenario_skipped: vec![SkippedEvent {
                at_s: 99.0,
                action: "add w5".into(),
                reason: "training had ended".into(),
            }],
            worker_processes: vec![WorkerProcess {
                name: "w0".into(),
                slot: "slot0".into(),
                placement: None,
                exited_ms: Some(900),
                fate: "restarted".into(),
                exit_code: Some(0),
                signal: None,
            }],
            shard_layout: vec![
                ShardLayout {
                    id: 0,
                    name: "s0".into(),
                    role: "active".into(),
                    ranges: vec!["0..3".into(), "6..7".into()],
                    keys: 4,
                    error: None,
                },
                ShardLayout {
                    id: 1,
                    name: "s1".into(),
                    role: "retired".into(),
                    ranges: vec![],
                    keys: 0,
                    error: None,
                },
            ],
            state_dir: "/tmp/edl-local-1".into(),
            shutdown_problems: vec![],
            elastic: Default::default(),
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
            "traffic",
            "wall_s",
            "train_wall_s",
            "shards",
            "workers",
            "consistency",
            "optimizer",
            "schedule",
            "batch_size",
            "train_samples",
            "state_dir",
            "events",
            "restarts",
            "membership",
        ] {
            assert!(value.get(key).is_some(), "missing {key}");
        }
        assert_eq!(value["epochs"][0]["train_loss"], 0.5);
        assert_eq!(value["epochs"][0]["duplicates"], 0);
        assert_eq!(value["events"][0]["stall_ms"], 2500.0);
        assert!(value["events"][0]["join_latency_ms"].is_null());
        // Fields of moves only are left out of other events.
        assert!(value["events"][0].get("hold_ms").is_none());
        assert_eq!(value["events"][1]["hold_ms"], 4.5);
        assert_eq!(value["events"][1]["bytes"], 2048);
        assert_eq!(value["shard_layout"][1]["role"], "retired");
        assert_eq!(value["restarts"][0]["checkpoint_ms"], 4.0);
        let back: Report = serde_json::from_str(&text).expect("decode");
        assert_eq!(back, report);
        let summary = report.to_string();
        assert!(summary.contains("test accuracy 0.8600"), "{summary}");
        assert!(
            summary.contains("  epoch 1/1: 60000 samples applied (0 duplicates, 0 missing"),
            "{summary}"
        );
        assert!(
            summary.contains(
                "leave x1: stall median 2500 ms, max 2500 ms (1 measured; a step took 12.0 ms), \
                 median 2491 ms above the 9 ms baseline"
            ),
            "{summary}"
        );
        assert!(
            summary.contains("restart 1 at 3.9 s (drain w0)"),
            "{summary}"
        );
        assert!(
            summary.contains(
                "    stall (how much longer than usual the others' step across an event took) \
                 baseline 9 ms (p90 31 ms) at 120 moments without any event (a step took 11.5 \
                 ms):\n      the others' ordinary step-to-step variation; an event's stall at or \
                 below it is no measurable stall, above it the excess is what the event cost\n"
            ),
            "{summary}"
        );
        assert!(
            summary.contains(
                "join  x1: stall median 1 ms, max 1 ms (1 measured; a step took 12.0 ms), \
                 median within the 9 ms baseline: none measurable; join latency median 300 ms"
            ),
            "{summary}"
        );
        // The baseline comes before the events read against it.
        assert!(
            summary.find("baseline 9 ms (p90") < summary.find("leave x1"),
            "{summary}"
        );
        assert!(
            summary.contains("skipped scenario event at 99.0 s"),
            "{summary}"
        );
        assert!(
            summary.contains(
                "move  x1: stall median 20 ms, max 20 ms (1 measured; a step took 12.0 ms), \
                 median 11 ms above the 9 ms baseline; range held median 4.5 ms, max 4.5 ms"
            ),
            "{summary}"
        );
        assert!(
            summary.contains(
                "5.0 s  move keys 3..6 s0→s2: stall 20 ms (a step took 12.0 ms), held 4.5 ms, \
                 2.0 KiB, took 9 ms"
            ),
            "{summary}"
        );
        assert!(
            summary.contains("s0 (id 0) active: 0..3, 6..7 (4 keys)"),
            "{summary}"
        );
        assert!(summary.contains("s1 (id 1) retired\n"), "{summary}");
        assert!(summary.contains("/tmp/edl-local-1/logs"), "{summary}");
    }
}
