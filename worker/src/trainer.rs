//! The training loop over the client's batch API: for each leased mini-batch pull, compute,
//! push, commit; leave gracefully on shutdown or drain. Also the evaluation pass.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

use edl_client::{ClientError, Gradients, Holdings, Job, Notices, RowGrads, Session};
use edl_shared::metrics::{self, Counter, Gauge, Histogram};
use edl_shared::models::{self, Builtin};
use edl_shared::proto::JobConfig;
use edl_shared::proto::msg::{DataSpan, JobStatus};
use edl_shared::shutdown::CancellationToken;
use thiserror::Error;

use crate::backend::{BackendError, StepStats};
use crate::data::DataError;
use crate::model::{Mlp, ModelError};
use crate::workload::{Dataset, Grads, Model, Params};

/// Why training stopped with an error.
#[derive(Debug, Error)]
pub enum TrainError {
    /// Talking to the job failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The compute backend refused the batch.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The dataset could not serve a batch.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The job's model cannot be built.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The job and the local dataset or model do not fit together.
    #[error("job does not fit this worker: {0}")]
    Mismatch(String),
    /// The shutdown's grace period ran out before the worker had left the job (the
    /// coordinator or a shard did not answer): what it still holds goes back to the pool only
    /// when its heartbeat lease expires on the coordinator.
    #[error(
        "the shutdown grace period ({grace:?}) ran out before the coordinator answered this \
         worker's leave; not handed back: {held}; the coordinator drops the worker and returns \
         its data to the pool when its lease expires"
    )]
    Unreturned {
        /// The grace period.
        grace: Duration,
        /// What the worker still holds, as its session saw it before the leave was sent.
        held: Holdings,
    },
    /// The shutdown's grace period ran out while the worker was joining: the coordinator may
    /// have registered it (it then counts the worker dead when its lease expires).
    #[error(
        "the shutdown grace period ({grace:?}) ran out while joining: the coordinator may \
         have registered this worker, and then drops it when its lease expires"
    )]
    JoinUnfinished {
        /// The grace period.
        grace: Duration,
    },
    /// The worker was done (its data ran out, it reached `max_steps`, it was drained) but no
    /// coordinator answered its leave within [`LEAVE_LEASES`] leases: it ends without one.
    #[error(
        "no coordinator answered this worker's leave within {waited:?} (longer than a \
         failover takes); not handed back: {held}; the coordinator drops the worker and \
         returns its data to the pool when its lease expires"
    )]
    LeaveUnanswered {
        /// How long the leave waited.
        waited: Duration,
        /// What the worker still holds, as its session saw it before the leave was sent.
        held: Holdings,
    },
}

impl TrainError {
    /// True when the worker ends without being out of the job: the shutdown's grace period
    /// ran out ([`TrainError::Unreturned`], [`TrainError::JoinUnfinished`]) or no coordinator
    /// answered its leave ([`TrainError::LeaveUnanswered`]).
    pub fn grace_ran_out(&self) -> bool {
        matches!(
            self,
            TrainError::Unreturned { .. }
                | TrainError::JoinUnfinished { .. }
                | TrainError::LeaveUnanswered { .. }
        )
    }
}

/// Knobs of a training run beyond the job config.
#[derive(Default)]
pub struct TrainOptions {
    /// Stop (and leave) after this many steps.
    pub max_steps: Option<u64>,
    /// A test aid: makes every step this many times slower, as a slower device would.
    pub slowdown: Slowdown,
    /// A test aid: every step takes at least this long (the worker waits out the rest after
    /// its work), as on a device whose step time is fixed: the job's speed then follows its
    /// workers rather than how busy this machine's cores are.
    pub step_time: Option<Duration>,
    /// Spot notices this process receives (e.g. on SIGUSR1), each with its length: the
    /// worker tells the coordinator, finishes its step, commits and leaves in time.
    pub spot: Option<tokio::sync::mpsc::UnboundedReceiver<Duration>>,
    /// Log a progress line (samples/s, loss) this often; `None` logs none.
    pub progress: Option<Duration>,
    /// How long a shutdown may take once the token fires: the worker finishes its step,
    /// commits and leaves within it even when the coordinator or a shard does not answer,
    /// and otherwise ends with [`TrainError::Unreturned`]. The step and its commit get all of
    /// it but the last half second (or half, if shorter), which is kept for leaving; a step
    /// cut short is abandoned (its data returns to the pool when the worker leaves).
    /// `None`: the job's lease (`JobConfig::lease_ms`).
    pub grace: Option<Duration>,
}

/// A test aid that makes a worker a straggler: after each step's own work (pull, compute,
/// push) it sleeps `factor - 1` times that long before committing. The factor can change
/// while the worker runs: through a clone of this handle ([`Slowdown::set`]), or through a
/// file holding the number (re-read at most every 250 ms; see [`Slowdown::with_file`]).
#[derive(Clone, Debug)]
pub struct Slowdown {
    factor: Arc<AtomicU64>,
    file: Option<(PathBuf, Arc<std::sync::Mutex<Instant>>)>,
}

impl Default for Slowdown {
    fn default() -> Self {
        Slowdown::new(1.0)
    }
}

impl Slowdown {
    /// How often the file is looked at.
    const FILE_EVERY: Duration = Duration::from_millis(250);

    /// The largest factor (a longer sleep is no longer a straggler but a hang).
    pub const MAX: f64 = 1000.0;

    /// A fixed factor (1 = full speed; see [`Slowdown::set`]).
    pub fn new(factor: f64) -> Slowdown {
        let s = Slowdown {
            factor: Arc::new(AtomicU64::new(1f64.to_bits())),
            file: None,
        };
        s.set(factor);
        s
    }

    /// Also takes the factor from `path` whenever it holds a number (a missing file keeps
    /// the current factor).
    pub fn with_file(mut self, path: PathBuf) -> Slowdown {
        let long_ago = Instant::now()
            .checked_sub(Self::FILE_EVERY)
            .unwrap_or_else(Instant::now);
        self.file = Some((path, Arc::new(std::sync::Mutex::new(long_ago))));
        self
    }

    /// Changes the factor (values below 1 mean 1).
    pub fn set(&self, factor: f64) {
        let f = if factor.is_finite() {
            factor.max(1.0)
        } else {
            1.0
        };
        self.factor.store(f.to_bits(), Ordering::Relaxed);
    }

    /// The factor now.
    pub fn factor(&self) -> f64 {
        if let Some((path, last)) = &self.file {
            let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
            if last.elapsed() >= Self::FILE_EVERY {
                *last = Instant::now();
                if let Some(f) = std::fs::read_to_string(path)
                    .ok()
                    .and_then(|s| s.trim().parse::<f64>().ok())
                {
                    if (f - f64::from_bits(self.factor.load(Ordering::Relaxed))).abs() > 1e-9 {
                        tracing::info!(factor = f, "slowdown changed (test aid)");
                    }
                    self.set(f);
                }
            }
        }
        f64::from_bits(self.factor.load(Ordering::Relaxed))
    }

    /// Sleeps for the extra time a step that worked `work` takes at this factor.
    async fn after(&self, work: Duration) {
        let f = self.factor();
        if f > 1.0 {
            tokio::time::sleep(work.mul_f64(f - 1.0)).await;
        }
    }
}

/// Passes a spot notice on to the coordinator (in the background: the step goes on).
fn pass_on(notices: &Notices, notice: Duration) {
    tracing::warn!(
        notice_s = notice.as_secs_f64(),
        "preemption notice: leaving once a substitute is admitted, or after this step if none \
         is coming, and before the notice runs out"
    );
    let n = notices.clone();
    tokio::spawn(async move {
        if let Err(e) = n.preempt(notice).await {
            tracing::warn!(error = %e, "could not tell the coordinator of the preemption; leaving anyway");
        }
    });
}

/// Time kept in hand before a preemption deadline, or the end of a shutdown's grace period,
/// for leaving.
const LEAVE_MARGIN: Duration = Duration::from_millis(500);

/// A leave that is not part of a shutdown (the data ran out, `max_steps`, a drain) waits at
/// most this many leases for a coordinator to answer: longer than a failover takes, and the
/// coordinator drops a worker that did not leave when its lease expires anyway.
pub const LEAVE_LEASES: u32 = 10;

/// The bound on a shutdown: once the token fires, the worker has `grace` to finish its step,
/// commit and leave. The step and its commit get all of it but the time kept for leaving.
struct Grace<'a> {
    shutdown: &'a CancellationToken,
    grace: Duration,
    /// When the shutdown was first seen: the grace period counts from there.
    since: OnceLock<tokio::time::Instant>,
}

impl<'a> Grace<'a> {
    fn new(shutdown: &'a CancellationToken, grace: Duration) -> Self {
        Grace {
            shutdown,
            grace,
            since: OnceLock::new(),
        }
    }

    /// Resolves once the shutdown has fired and only `left` of its grace period remains;
    /// never without a shutdown.
    async fn down_to(&self, left: Duration) {
        self.shutdown.cancelled().await;
        let since = *self.since.get_or_init(|| {
            tracing::info!(
                grace = ?self.grace,
                "finishing the step, committing and leaving within the shutdown grace period"
            );
            tokio::time::Instant::now()
        });
        tokio::time::sleep_until(since + self.grace.saturating_sub(left)).await;
    }

    /// The time for finishing the step and committing is over.
    async fn finishing_over(&self) {
        self.down_to(LEAVE_MARGIN.min(self.grace / 2)).await;
    }

    /// The grace period is over.
    async fn over(&self) {
        self.down_to(Duration::ZERO).await;
    }
}

/// Commits the last step without waiting for the others, unless the shutdown's time for
/// finishing runs out first: then the commit's outcome stays unknown, and leaving settles it
/// (the coordinator returns the uncommitted samples to the pool).
async fn commit_last(
    session: &mut Session,
    span: DataSpan,
    loss_sum: f64,
    grace: &Grace<'_>,
) -> Result<(), TrainError> {
    tokio::select! {
        r = session.commit_last(span, loss_sum) => Ok(r?),
        _ = grace.finishing_over() => {
            tracing::warn!("shutdown grace period: leaving without an answer to the last commit");
            Ok(())
        }
    }
}

/// What a worker did.
#[derive(Clone, Debug, Default)]
pub struct TrainSummary {
    /// Steps completed.
    pub steps: u64,
    /// Samples processed.
    pub samples: u64,
    /// Sum of training losses.
    pub loss_sum: f64,
    /// Wall time.
    pub wall: Duration,
    /// Steps abandoned unfinished at a preemption deadline (their data returns to the pool).
    pub abandoned: u64,
}

/// Builds the MLP a job trains.
pub fn model_of(job: &JobConfig) -> Result<Mlp, TrainError> {
    let spec = models::Mlp::from_section(&job.model).map_err(TrainError::Mismatch)?;
    Ok(Mlp::new(spec.layers.iter().map(|&l| l as usize).collect())?)
}

/// The built-in model kinds this crate trains: the training half of the model registry
/// ([`edl_shared::models::BUILTINS`], which says what each kind's settings and tensors are).
/// `edl-worker` dispatches on these; a unit test checks that every registered kind is here.
pub const TRAINED_KINDS: &[&str] = &[models::Mlp::KIND, models::LogReg::KIND];

/// Registers with the job and trains `model` on `data` until the data runs out, `shutdown`
/// fires (the current step is finished first) or `max_steps` is reached; then leaves. A dense
/// model pulls and pushes the whole parameter vector each step; a sparse one only the rows
/// its batch touches.
///
/// A shutdown is bounded by the options' `grace`: once `shutdown` fires, a worker that has
/// not left by the end of it (the coordinator or a shard does not answer) returns
/// [`TrainError::Unreturned`], which names what it still holds, or
/// [`TrainError::JoinUnfinished`] while joining.
pub async fn train<M: Model>(
    job: Job,
    model: &mut M,
    data: &M::Data,
    opts: TrainOptions,
    shutdown: CancellationToken,
) -> Result<TrainSummary, TrainError> {
    let spec = job.spec().clone();
    model.check(&spec, data).map_err(TrainError::Mismatch)?;
    let samples = job.config().train_samples as usize;
    if data.len() < samples {
        return Err(TrainError::Mismatch(format!(
            "the job uses {samples} training samples, the local dataset has {}",
            data.len()
        )));
    }
    // Stop-free join: every slow thing happens before asking to be admitted, while the
    // others keep training: the model's warm-up here, the shard connections in `join`.
    model.warm_up(&spec, data)?;
    let lease = Duration::from_millis(u64::from(job.config().lease_ms));
    let grace = Grace::new(&shutdown, opts.grace.unwrap_or(lease));
    let mut session = tokio::select! {
        r = job.join() => r?,
        _ = grace.over() => return Err(TrainError::JoinUnfinished { grace: grace.grace }),
    };
    let notices = session.notices();
    // Spot notices are passed on from a task of their own, so that one never interrupts a
    // request in flight (a partition leased by an abandoned request would stay leased).
    let forward = opts.spot.map(|mut rx| {
        let n = notices.clone();
        tokio::spawn(async move {
            while let Some(notice) = rx.recv().await {
                pass_on(&n, notice);
            }
        })
    });
    let started = Instant::now();
    let mut progress = Progress::new(opts.progress);
    let mut summary = TrainSummary::default();
    let mut params = Vec::new();
    // Pushed as they lie (no copy into a wire buffer); written again once the push is done.
    let mut grads = Gradients::default();
    let mut gathered = <M::Data as Dataset>::Batch::default();
    while !shutdown.is_cancelled() {
        // Leaving at once is safe mid-request: leaving returns every lease to the pool.
        let next = tokio::select! {
            r = session.next_batch() => r?,
            _ = shutdown.cancelled() => None,
            _ = notices.expired(LEAVE_MARGIN) => None,
        };
        let Some(batch) = next else {
            break;
        };
        let step = async {
            let batch = batch;
            let begun = Instant::now();
            data.gather(batch.indices(), &mut gathered)?;
            let stats = match model.touched(&gathered) {
                None => {
                    params.resize(spec.param_count(), 0.0);
                    if grads.len() != spec.param_count() {
                        grads = Gradients::zeros(spec.param_count());
                    }
                    tracing::trace!(clock = %session.clock(), "pull");
                    session.pull(&mut params).await?;
                    let stats = model.step(
                        Params::Dense(&params),
                        &gathered,
                        Grads::Dense(grads.as_mut_slice()),
                    )?;
                    tracing::trace!(clock = %session.clock(), "push");
                    session.push_gradients(&batch, &grads).await?;
                    stats
                }
                Some(mut rows) => {
                    for r in &mut rows {
                        let t = spec.require(&r.tensor)?;
                        r.values.resize(r.rows.len() * t.row_len(), 0.0);
                        session.pull_rows(&r.tensor, &r.rows, &mut r.values).await?;
                    }
                    let mut g = rows.clone();
                    let stats = model.step(Params::Rows(&rows), &gathered, Grads::Rows(&mut g))?;
                    let out: Vec<RowGrads<'_>> = g
                        .iter()
                        .map(|r| RowGrads {
                            tensor: &r.tensor,
                            rows: &r.rows,
                            values: &r.values,
                        })
                        .collect();
                    session.push_rows(&batch, &out).await?;
                    stats
                }
            };
            opts.slowdown.after(begun.elapsed()).await;
            if let Some(t) = opts.step_time {
                tokio::time::sleep(t.saturating_sub(begun.elapsed())).await;
            }
            METRICS.work.observe(begun.elapsed().as_secs_f64());
            Ok::<_, TrainError>((stats, batch, &mut session))
        };
        tokio::pin!(step);
        // A preemption deadline, or the end of a shutdown's time for finishing, that comes
        // before the step ends abandons it: its data is not committed, so it returns to the
        // pool when the worker leaves (shards that already applied the push skip it when it
        // is re-issued).
        let done = tokio::select! {
            r = &mut step => Ok(r?),
            _ = notices.expired(LEAVE_MARGIN) => Err("preemption deadline"),
            _ = grace.finishing_over() => Err("shutdown grace period"),
        };
        let (stats, batch, session) = match done {
            Ok(done) => done,
            Err(why) => {
                tracing::warn!("{why}: abandoning the unfinished step and leaving");
                summary.abandoned += 1;
                break;
            }
        };
        summary.steps += 1;
        summary.samples += stats.samples as u64;
        summary.loss_sum += stats.loss_sum;
        let span = batch.span();
        tracing::trace!(clock = %session.clock(), "commit");
        let committing = Instant::now();
        // The step is pushed. A shutdown or a preemption deadline during the wait for the
        // others commits it without waiting (a repeat of a commit that arrived is
        // recognized) and leaves.
        tokio::select! {
            r = session.commit(batch, stats.loss_sum) => { r?; }
            _ = shutdown.cancelled() => {
                commit_last(session, span, stats.loss_sum, &grace).await?;
                break;
            }
            _ = notices.expired(LEAVE_MARGIN) => {
                commit_last(session, span, stats.loss_sum, &grace).await?;
                break;
            }
        }
        METRICS.commit.observe(committing.elapsed().as_secs_f64());
        progress.step(
            stats.samples as u64,
            stats.loss_sum,
            session.clock().0,
            session.job().traffic(),
        );
        if opts.max_steps == Some(summary.steps) || session.drain_requested() {
            // Leaving returns the uncommitted rest of the partition to the pool.
            break;
        }
    }
    summary.wall = started.elapsed();
    if let Some(f) = forward {
        f.abort();
    }
    if let Some(k) = session.job().config().wire.topk {
        // What error feedback held back goes with the worker; its uncommitted samples are
        // issued again, and a shard that applied a span skips it.
        tracing::info!(
            "leaving with a {k} residual of {:.6} (the sum of the magnitudes held back), \
             dropped with this worker",
            session.residual_l1().await
        );
    }
    // Taken before the leave is sent: a leave abandoned midway leaves its outcome unknown.
    let held = session.holdings();
    let waited = lease * LEAVE_LEASES;
    tokio::select! {
        r = session.leave() => r?,
        _ = grace.over() => {
            return Err(TrainError::Unreturned { grace: grace.grace, held });
        }
        _ = tokio::time::sleep(waited), if !shutdown.is_cancelled() => {
            return Err(TrainError::LeaveUnanswered { waited, held });
        }
    }
    Ok(summary)
}

/// Pulls the current parameters and evaluates `model` on `test`. Pending BSP steps are closed
/// only once the job has finished, so evaluating a running job never applies a partial step.
/// Returns the statistics and the job status the parameters were pulled under.
pub async fn evaluate<M: Model>(
    job: &Job,
    model: &mut M,
    test: &M::Data,
) -> Result<(StepStats, JobStatus), TrainError> {
    let mut params = vec![0f32; job.param_count()];
    let status = job.pull_current(&mut params).await?;
    Ok((model.evaluate(&params, test)?, status))
}

/// A worker's Prometheus metrics (`edl-worker --metrics`), each labelled series resolved once
/// (no lookup per step).
struct WorkerMetrics {
    steps: Counter,
    samples: Counter,
    work: Histogram,
    commit: Histogram,
    loss: Gauge,
    clock: Gauge,
    sent: Counter,
    received: Counter,
}

static METRICS: LazyLock<WorkerMetrics> = LazyLock::new(|| {
    let step = metrics::histograms(
        "worker_step_duration_seconds",
        "Time of one step: its own work (gather, pull, compute, push), then the commit \
         (phase=commit: including the wait for slower workers).",
        metrics::seconds_histogram,
    );
    let bytes = metrics::counters(
        "worker_bytes",
        "Payload bytes this worker sent (gradients) and received (parameters).",
    );
    WorkerMetrics {
        steps: metrics::counter("worker_steps", "Steps this worker committed."),
        samples: metrics::counter("worker_samples", "Samples this worker committed."),
        work: step.get_or_create_owned(&metrics::label("phase", "work")),
        commit: step.get_or_create_owned(&metrics::label("phase", "commit")),
        loss: metrics::gauge(
            "worker_loss",
            "Mean training loss per sample of the last step.",
        ),
        clock: metrics::gauge("worker_clock_steps", "This worker's clock."),
        sent: bytes.get_or_create_owned(&metrics::label("direction", "sent")),
        received: bytes.get_or_create_owned(&metrics::label("direction", "received")),
    }
});

/// Progress since the last progress line.
struct Progress {
    every: Option<Duration>,
    since: Instant,
    samples: u64,
    loss_sum: f64,
    steps: u64,
    traffic: (u64, u64),
}

impl Progress {
    fn new(every: Option<Duration>) -> Self {
        Progress {
            every,
            since: Instant::now(),
            samples: 0,
            loss_sum: 0.0,
            steps: 0,
            traffic: (0, 0),
        }
    }

    /// Counts a step; logs a progress line when one is due.
    fn step(&mut self, samples: u64, loss_sum: f64, clock: u64, traffic: edl_client::TrafficCount) {
        let m = &*METRICS;
        m.steps.inc();
        m.samples.inc_by(samples);
        if samples > 0 {
            m.loss.set(loss_sum / samples as f64);
        }
        m.clock.set(clock as f64);
        let sent = traffic.sent.saturating_sub(self.traffic.0);
        let received = traffic.received.saturating_sub(self.traffic.1);
        m.sent.inc_by(sent);
        m.received.inc_by(received);
        self.traffic = (traffic.sent, traffic.received);
        self.samples += samples;
        self.loss_sum += loss_sum;
        self.steps += 1;
        let Some(every) = self.every else {
            return;
        };
        let secs = self.since.elapsed();
        if secs < every {
            return;
        }
        let secs = secs.as_secs_f64();
        tracing::info!(
            clock,
            steps = self.steps,
            samples_per_s = format!("{:.1}", self.samples as f64 / secs),
            loss = format!("{:.4}", self.loss_sum / self.samples.max(1) as f64),
            "progress"
        );
        *self = Progress {
            traffic: self.traffic,
            ..Progress::new(self.every)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registered_model_kind_has_its_training_half() {
        let registered: Vec<&str> = models::BUILTINS.iter().map(|k| k.name).collect();
        assert_eq!(TRAINED_KINDS, registered.as_slice());
    }

    #[test]
    fn an_mlp_is_built_from_the_wire_section_and_nothing_else() {
        let mut job = bare_job();
        job.model = models::Mlp {
            layers: vec![6, 4, 3],
        }
        .section();
        assert!(model_of(&job).is_ok());
        job.model = models::LogReg { features: 6 }.section();
        let e = model_of(&job)
            .expect_err("a logreg is not an mlp")
            .to_string();
        assert!(e.contains("\"logreg\", not \"mlp\""), "{e}");
    }

    /// A job with only what the test reads set.
    fn bare_job() -> JobConfig {
        JobConfig {
            model: edl_shared::proto::ModelSection::custom(),
            tensors: Vec::new(),
            chunk_size: 1024,
            optimizer: edl_shared::proto::OptimizerSpec::sgd(0.1),
            optimizer_groups: Vec::new(),
            schedule: Default::default(),
            consistency: edl_shared::proto::Consistency::Asp,
            batch_size: 8,
            epochs: 1,
            partition_size: 64,
            train_samples: 64,
            seed: 1,
            lease_ms: 2000,
            replicas: 1,
            wire: Default::default(),
            tensor_wires: Vec::new(),
            data: None,
        }
    }
}
