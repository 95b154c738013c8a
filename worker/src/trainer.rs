//! The training loop over the client's batch API: for each leased mini-batch pull, compute,
//! push, commit; leave gracefully on shutdown or drain. Also the evaluation pass.

use std::time::{Duration, Instant};

use edl_client::{ClientError, Job, RowGrads};
use edl_shared::proto::ids::Clock;
use edl_shared::proto::{JobConfig, ModelSpec};
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
}

/// Knobs of a training run beyond the job config.
#[derive(Default)]
pub struct TrainOptions {
    /// Stop (and leave) after this many steps.
    pub max_steps: Option<u64>,
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
}

/// Builds the MLP a job trains.
pub fn model_of(job: &JobConfig) -> Result<Mlp, TrainError> {
    match &job.model {
        ModelSpec::Mlp { layers } => Ok(Mlp::new(layers.iter().map(|&l| l as usize).collect())?),
        other => Err(TrainError::Mismatch(format!(
            "the job's model is {other}, not an MLP"
        ))),
    }
}

/// Registers with the job and trains `model` on `data` until the data runs out, `shutdown`
/// fires (the current step is finished first) or `max_steps` is reached; then leaves. A dense
/// model pulls and pushes the whole parameter vector each step; a sparse one only the rows
/// its batch touches.
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
    let mut session = job.join().await?;
    let started = Instant::now();
    let mut summary = TrainSummary::default();
    let mut params = Vec::new();
    let mut grads = Vec::new();
    let mut gathered = <M::Data as Dataset>::Batch::default();
    while !shutdown.is_cancelled() {
        let next = tokio::select! {
            r = session.next_batch() => r?,
            _ = shutdown.cancelled() => break,
        };
        let Some(batch) = next else {
            break;
        };
        data.gather(batch.indices(), &mut gathered)?;
        let stats = match model.touched(&gathered) {
            None => {
                params.resize(spec.param_count(), 0.0);
                grads.resize(spec.param_count(), 0.0);
                tracing::trace!(clock = %session.clock(), "pull");
                session.pull(&mut params).await?;
                let stats =
                    model.step(Params::Dense(&params), &gathered, Grads::Dense(&mut grads))?;
                tracing::trace!(clock = %session.clock(), "push");
                session.push(&batch, &grads).await?;
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
        summary.steps += 1;
        summary.samples += stats.samples as u64;
        summary.loss_sum += stats.loss_sum;
        let span = batch.span();
        tracing::trace!(clock = %session.clock(), "commit");
        // The step is pushed. A shutdown during the wait for the others commits it without
        // waiting (a repeat of a commit that arrived is recognized) and leaves.
        tokio::select! {
            r = session.commit(batch, stats.loss_sum) => { r?; }
            _ = shutdown.cancelled() => {
                session.commit_last(span, stats.loss_sum).await?;
                break;
            }
        }
        if opts.max_steps == Some(summary.steps) || session.drain_requested() {
            // Leaving returns the uncommitted rest of the partition to the pool.
            break;
        }
    }
    summary.wall = started.elapsed();
    session.leave().await?;
    Ok(summary)
}

/// Pulls the current parameters and evaluates `model` on `test`. Pending BSP steps are closed
/// only once the job has finished, so evaluating a running job never applies a partial step.
pub async fn evaluate<M: Model>(
    job: &Job,
    model: &mut M,
    test: &M::Data,
) -> Result<StepStats, TrainError> {
    let status = job.status().await?;
    let through = if status.finished {
        Clock(u64::MAX)
    } else {
        status.min_clock
    };
    let mut params = vec![0f32; job.param_count()];
    job.pull_all(&mut params, through).await?;
    Ok(model.evaluate(&params, test)?)
}
