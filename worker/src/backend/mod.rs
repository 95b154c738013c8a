//! The compute backend interface the trainer drives, its statistics and shape errors, the CPU
//! and CUDA implementations, and the choice between them ([`Device`], [`open`]).

pub mod cpu;
pub mod cuda;

pub use cpu::CpuBackend;
pub use cuda::{CudaBackend, CudaError};

use std::fmt;
use std::str::FromStr;

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
    /// The device failed while running the pass (a CUDA driver or cuBLAS error).
    #[error("device error: {0}")]
    Device(String),
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

/// [`check_batch`] for a training step, which also needs a gradient buffer of the parameters'
/// length and at least one sample; returns the batch size.
pub fn check_step(
    mlp: &Mlp,
    params: &[f32],
    x: &[f32],
    y: &[u8],
    grads: &[f32],
) -> Result<usize, BackendError> {
    let rows = check_batch(mlp, params, x, y)?;
    if grads.len() != params.len() {
        return Err(BackendError::GradsLen {
            expected: params.len(),
            actual: grads.len(),
        });
    }
    if rows == 0 {
        return Err(BackendError::EmptyBatch);
    }
    Ok(rows)
}

/// Which compute device a worker uses, as given on the command line: `auto`, `cpu`, `cuda` or
/// `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The first CUDA device when one is usable, else the CPU.
    Auto,
    /// The CPU backend.
    Cpu,
    /// The CUDA device with this ordinal; failing if it is not usable.
    Cuda(usize),
}

/// A `--device` value that is none of `auto`, `cpu`, `cuda`, `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown device {0:?}: expected auto, cpu, cuda or cuda:N")]
pub struct ParseDeviceError(String);

impl FromStr for Device {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> Result<Device, ParseDeviceError> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| ParseDeviceError(s.to_string())),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Creates the backend for `device`. `Auto` never fails: without a usable GPU it logs why and
/// returns the CPU backend. `Cuda(n)` fails with the reason when device `n` is not usable.
pub fn open(device: Device) -> Result<Box<dyn Backend>, CudaError> {
    match device {
        Device::Cpu => Ok(Box::new(CpuBackend::new())),
        Device::Cuda(n) => Ok(Box::new(open_cuda(n)?)),
        Device::Auto => match open_cuda(0) {
            Ok(b) => Ok(Box::new(b)),
            Err(e) if e.is_unavailable() => {
                tracing::info!(reason = %e, "no usable CUDA device; falling back to the CPU backend");
                Ok(Box::new(CpuBackend::new()))
            }
            Err(e) => {
                tracing::warn!(error = %e, "the CUDA device failed to start; falling back to the CPU backend");
                Ok(Box::new(CpuBackend::new()))
            }
        },
    }
}

fn open_cuda(ordinal: usize) -> Result<CudaBackend, CudaError> {
    let b = CudaBackend::new(ordinal)?;
    tracing::info!(ordinal, device = b.device_name(), "CUDA backend ready");
    Ok(b)
}

/// Floating-point operations of the matrix products in one training step of `mlp` on `rows`
/// samples, counting `2·M·N·K` per product: forward, weight gradients, and input gradients for
/// every layer but the first (whose input needs none), which is just under 3x the forward pass.
pub fn step_gemm_flops(mlp: &Mlp, rows: usize) -> f64 {
    mlp.layers()
        .windows(2)
        .enumerate()
        .map(|(l, w)| {
            let one = 2.0 * rows as f64 * w[0] as f64 * w[1] as f64;
            if l == 0 { 2.0 * one } else { 3.0 * one }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        for (text, device) in [
            ("auto", Device::Auto),
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:0", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(text.parse::<Device>(), Ok(device));
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!(
            "auto".parse::<Device>().map(|d| d.to_string()),
            Ok("auto".into())
        );
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            let e = bad.parse::<Device>().expect_err(bad);
            assert!(e.to_string().contains("cuda:N"), "{e}");
        }
    }

    #[test]
    fn auto_and_cpu_always_open() {
        assert_eq!(open(Device::Cpu).expect("cpu").name(), "cpu");
        let auto = open(Device::Auto).expect("auto never fails");
        match cuda::probe(0) {
            Ok(_) => assert_eq!(auto.name(), "cuda"),
            Err(_) => assert_eq!(auto.name(), "cpu"),
        }
    }

    #[test]
    fn cuda_without_a_gpu_says_why() {
        match cuda::probe(0) {
            Ok(_) => println!("skipped: a CUDA device is present"),
            Err(probe) => {
                let e = open(Device::Cuda(0)).map(|b| b.name()).expect_err("no GPU");
                assert!(e.is_unavailable());
                assert_eq!(e.to_string(), probe.to_string());
            }
        }
    }

    #[test]
    fn step_flops_count_each_product() {
        let mlp = Mlp::new(vec![784, 256, 10]).expect("valid");
        let fwd = 2.0 * 64.0 * (784.0 * 256.0 + 256.0 * 10.0);
        let bwd_x = 2.0 * 64.0 * 256.0 * 10.0;
        assert_eq!(step_gemm_flops(&mlp, 64), 2.0 * fwd + bwd_x);
    }
}
