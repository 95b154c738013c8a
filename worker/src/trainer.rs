//! The training loop: lease a partition, and for each mini-batch pull, compute, push, advance
//! the clock; leave gracefully on shutdown. Also the data order and the evaluation pass.

use std::time::{Duration, Instant};

use edl_shared::proto::ids::Clock;
use edl_shared::proto::msg::DataSpan;
use edl_shared::proto::{JobConfig, ModelSpec};
use edl_shared::shutdown::CancellationToken;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use thiserror::Error;

use crate::backend::{Backend, BackendError, StepStats};
use crate::client::{ClientError, Job};
use crate::data::{DataError, Dataset};
use crate::model::{Mlp, ModelError};

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
        ModelSpec::Custom => Err(TrainError::Mismatch(
            "the job has no built-in model to train".into(),
        )),
    }
}

/// The order in which epoch `epoch` visits the first `n` samples: a Fisher-Yates shuffle seeded
/// by the job seed and the epoch, so every worker derives the same order.
pub fn epoch_order(seed: u64, epoch: u32, n: u32) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n).collect();
    let mut rng =
        StdRng::seed_from_u64(seed ^ (u64::from(epoch) + 1).wrapping_mul(0xa076_1d64_78bd_642f));
    for i in (1..order.len()).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
    order
}

fn check_fit(job: &JobConfig, mlp: &Mlp, train: &Dataset) -> Result<(), TrainError> {
    if train.len() < job.train_samples as usize {
        return Err(TrainError::Mismatch(format!(
            "the job uses {} training samples, the local dataset has {}",
            job.train_samples,
            train.len()
        )));
    }
    if train.dim() != mlp.input_dim() || train.classes() > mlp.classes() {
        return Err(TrainError::Mismatch(format!(
            "dataset has {} inputs and {} classes, model expects {} and {}",
            train.dim(),
            train.classes(),
            mlp.input_dim(),
            mlp.classes()
        )));
    }
    Ok(())
}

/// Registers with the job and trains until the data runs out, `shutdown` fires (the current
/// step is finished first) or `max_steps` is reached; then leaves.
pub async fn train(
    job: Job,
    name: &str,
    train: &Dataset,
    backend: &mut dyn Backend,
    opts: TrainOptions,
    shutdown: CancellationToken,
) -> Result<TrainSummary, TrainError> {
    let cfg = job.config().clone();
    let mlp = model_of(&cfg)?;
    check_fit(&cfg, &mlp, train)?;
    let mut params = vec![0f32; job.param_count()];
    let mut grads = vec![0f32; job.param_count()];
    let (mut x, mut y) = (Vec::new(), Vec::new());
    // Stop-free join: do every slow thing before asking to be admitted, while the others keep
    // training. The first pull warms the shard connections and buffers, and a pass over one
    // batch warms the backend (for a GPU: context, kernels, device buffers). Neither counts.
    job.pull_all(&mut params, Clock(0)).await?;
    let warm: Vec<u32> = (0..cfg.batch_size.clamp(1, cfg.train_samples.max(1))).collect();
    train.gather(&warm, &mut x, &mut y)?;
    backend.forward_backward(&mlp, &params, &x, &y, &mut grads)?;
    let mut session = job.register(name).await?;
    let started = Instant::now();
    let mut summary = TrainSummary::default();
    let mut order: Option<(u32, Vec<u32>)> = None;
    let batch_size = cfg.batch_size.max(1);
    'outer: while !shutdown.is_cancelled() {
        let next = tokio::select! {
            r = session.next_partition() => r?,
            _ = shutdown.cancelled() => break,
        };
        let Some(part) = next else {
            break;
        };
        if order.as_ref().map(|(e, _)| *e) != Some(part.epoch) {
            order = Some((
                part.epoch,
                epoch_order(cfg.seed, part.epoch, cfg.train_samples),
            ));
        }
        let end = part.start + part.len;
        if order.as_ref().is_none_or(|(_, o)| o.len() < end as usize) {
            return Err(TrainError::Mismatch(format!(
                "partition {}..{end} is outside the epoch",
                part.start
            )));
        }
        // Batches start at the partition's (possibly re-issued) start, so a re-issued rest
        // splits into exactly the spans its first holder would have pushed.
        let mut start = part.start;
        while start < end {
            let span = DataSpan {
                epoch: part.epoch,
                partition: part.index,
                start,
                end: (start + batch_size).min(end),
            };
            start = span.end;
            let batch = order
                .as_ref()
                .and_then(|(_, o)| o.get(span.start as usize..span.end as usize))
                .unwrap_or_default();
            tracing::trace!(clock = %session.clock(), "pull");
            session.pull(&mut params).await?;
            train.gather(batch, &mut x, &mut y)?;
            let stats: StepStats = backend.forward_backward(&mlp, &params, &x, &y, &mut grads)?;
            tracing::trace!(clock = %session.clock(), "push");
            session.push_span(&grads, span).await?;
            tracing::trace!(clock = %session.clock(), "commit");
            // The step is pushed. A shutdown during the wait for the others commits it without
            // waiting (a repeat of a commit that arrived is recognized) and leaves.
            tokio::select! {
                r = session.commit(span, stats.loss_sum) => { r?; }
                _ = shutdown.cancelled() => {
                    session.commit_last(span, stats.loss_sum).await?;
                    summary.steps += 1;
                    summary.samples += stats.samples as u64;
                    summary.loss_sum += stats.loss_sum;
                    break 'outer;
                }
            }
            summary.steps += 1;
            summary.samples += stats.samples as u64;
            summary.loss_sum += stats.loss_sum;
            if opts.max_steps == Some(summary.steps)
                || shutdown.is_cancelled()
                || session.drain_requested()
            {
                // Leaving returns the uncommitted rest of the partition to the pool.
                break 'outer;
            }
        }
    }
    summary.wall = started.elapsed();
    session.leave().await?;
    Ok(summary)
}

/// Pulls the current parameters and evaluates them on `test`. Pending BSP steps are closed only
/// once the job has finished, so evaluating a running job never applies a partial step.
pub async fn evaluate(
    job: &Job,
    test: &Dataset,
    backend: &mut dyn Backend,
) -> Result<StepStats, TrainError> {
    let mlp = model_of(job.config())?;
    let status = job.status().await?;
    let through = if status.finished {
        Clock(u64::MAX)
    } else {
        status.min_clock
    };
    let mut params = vec![0f32; job.param_count()];
    job.pull_all(&mut params, through).await?;
    Ok(backend.evaluate(&mlp, &params, test.images(), test.labels())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_order_is_a_permutation_that_differs_by_epoch() {
        let a = epoch_order(7, 0, 1000);
        let b = epoch_order(7, 1, 1000);
        assert_ne!(a, b);
        assert_eq!(a, epoch_order(7, 0, 1000));
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
    }
}
