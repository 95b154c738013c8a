//! The compute backend interface the trainer drives, its statistics and shape errors, and the CPU implementation.

pub mod cpu;

pub use cpu::CpuBackend;

use thiserror::Error;

use crate::model::Mlp;

/// What one forward (and possibly backward) pass over a batch observed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Sum over the batch of the per-sample cross-entropy loss (summed so batches can be merged exactly).
    pub loss_sum: f64,
    /// Number of samples whose argmax prediction equals the label.
    pub correct: usize,
    /// Number of samples processed.
    pub samples: usize,
}

impl StepStats {
    /// Mean loss per sample, or 0 when nothing was processed.
    pub fn mean_loss(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.loss_sum / self.samples as f64
        }
    }

    /// Fraction of correct predictions, or 0 when nothing was processed.
    pub fn accuracy(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.correct as f64 / self.samples as f64
        }
    }

    /// Adds another batch's statistics to these, e.g. to report over an epoch.
    pub fn merge(&mut self, other: &StepStats) {
        self.loss_sum += other.loss_sum;
        self.correct += other.correct;
        self.samples += other.samples;
    }
}

/// Inputs whose shapes do not fit the model; backends report these instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BackendError {
    /// The parameter vector does not have `Mlp::param_count` elements.
    #[error("params has {actual} elements but the model needs {expected}")]
    ParamsLen {
        /// The model's parameter count.
        expected: usize,
        /// Length of the given slice.
        actual: usize,
    },
    /// The input length is not a whole number of samples.
    #[error("x has {len} values, which is not a multiple of the input dim {input_dim}")]
    InputLen {
        /// Length of the given slice.
        len: usize,
        /// Values per sample the model expects.
        input_dim: usize,
    },
    /// There is not exactly one label per input row.
    #[error("y has {actual} labels but x holds {expected} samples")]
    LabelsLen {
        /// Number of rows in `x`.
        expected: usize,
        /// Length of the given slice.
        actual: usize,
    },
    /// The gradient buffer does not have `Mlp::param_count` elements.
    #[error("grads has {actual} elements but the model needs {expected}")]
    GradsLen {
        /// The model's parameter count.
        expected: usize,
        /// Length of the given slice.
        actual: usize,
    },
    /// A label names a class the model has no output for.
    #[error("label {label} at index {index} is out of range for {classes} classes")]
    LabelOutOfRange {
        /// Position of the label in `y`.
        index: usize,
        /// The label value.
        label: u8,
        /// Number of model outputs.
        classes: usize,
    },
    /// A gradient was requested for zero samples, where the batch mean is undefined.
    #[error("forward_backward needs at least one sample")]
    EmptyBatch,
}

/// A device that runs the MLP's forward and backward passes.
pub trait Backend: Send {
    /// Short identifier for logs, e.g. `"cpu"`.
    fn name(&self) -> &'static str;

    /// Computes the mean-over-batch gradient of the loss into `grads` (same layout/len as params, overwritten, not accumulated).
    fn forward_backward(
        &mut self,
        mlp: &Mlp,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grads: &mut [f32],
    ) -> Result<StepStats, BackendError>;

    /// Forward only, for evaluation: loss_sum and number of correct argmax predictions.
    fn evaluate(
        &mut self,
        mlp: &Mlp,
        params: &[f32],
        x: &[f32],
        y: &[u8],
    ) -> Result<StepStats, BackendError>;
}

/// Checks `params`, `x` and `y` against the model and returns the batch size.
///
/// Shared so every backend rejects bad shapes identically before touching any buffer.
pub fn check_batch(mlp: &Mlp, params: &[f32], x: &[f32], y: &[u8]) -> Result<usize, BackendError> {
    let expected = mlp.param_count();
    if params.len() != expected {
        return Err(BackendError::ParamsLen {
            expected,
            actual: params.len(),
        });
    }
    let input_dim = mlp.input_dim();
    if !x.len().is_multiple_of(input_dim) {
        return Err(BackendError::InputLen {
            len: x.len(),
            input_dim,
        });
    }
    let rows = x.len() / input_dim;
    if y.len() != rows {
        return Err(BackendError::LabelsLen {
            expected: rows,
            actual: y.len(),
        });
    }
    let classes = mlp.classes();
    if let Some((index, &label)) = y
        .iter()
        .enumerate()
        .find(|&(_, &label)| usize::from(label) >= classes)
    {
        return Err(BackendError::LabelOutOfRange {
            index,
            label,
            classes,
        });
    }
    Ok(rows)
}
