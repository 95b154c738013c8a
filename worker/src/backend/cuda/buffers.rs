//! The CUDA backend's buffers: the device copy of a model with its pinned staging pieces, and
//! the per-batch device and pinned buffers.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};

use super::{CudaError, PIECE};
use crate::backend::StepStats;
use crate::model::Mlp;

/// Allocates `len` values of page-locked host memory, zeroed. `write_combined` suits buffers the
/// host only writes (uploads); buffers the host reads back must be cached (downloads).
#[allow(unsafe_code)]
pub(super) fn pinned<T: DeviceRepr + ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    len: usize,
    write_combined: bool,
) -> Result<PinnedHostSlice<T>, CudaError> {
    let flags = if write_combined {
        cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED
    } else {
        0
    };
    // SAFETY: the allocation is uninitialized; it is zeroed right here, through a pointer to
    // its `len` values, before anything reads it, and all-zero bits are a valid `T`.
    unsafe {
        let mut buf = ctx.alloc_pinned_with_flags::<T>(len, flags)?;
        std::ptr::write_bytes(buf.as_mut_ptr()?, 0, len);
        Ok(buf)
    }
}

/// A piece of one tensor and its pinned staging buffer.
struct Piece {
    /// Index of the tensor in flat order (`fc0.weight`, `fc0.bias`, `fc1.weight`, ...).
    tensor: usize,
    /// First value of the piece within the tensor.
    start: usize,
    /// First value of the piece in the flat parameter vector.
    flat: usize,
    /// Staging memory of exactly the piece's length.
    host: PinnedHostSlice<f32>,
}

impl Piece {
    fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.host.len()
    }

    fn flat_range(&self) -> std::ops::Range<usize> {
        self.flat..self.flat + self.host.len()
    }
}

/// The device copy of one model: parameters and gradients per tensor, and their staging.
pub(super) struct DeviceModel {
    /// The widths this was built for.
    pub(super) layers: Vec<usize>,
    /// Parameters, one buffer per tensor so each layer is ordered on its own.
    pub(super) params: Vec<CudaSlice<f32>>,
    /// Gradients, one buffer per tensor.
    pub(super) grads: Vec<CudaSlice<f32>>,
    /// Upload pieces in flat order (write-combined).
    up: Vec<Piece>,
    /// Download pieces in flat order (cached).
    down: Vec<Piece>,
}

impl DeviceModel {
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        mlp: &Mlp,
    ) -> Result<Self, CudaError> {
        let mut model = DeviceModel {
            layers: mlp.layers().to_vec(),
            params: Vec::new(),
            grads: Vec::new(),
            up: Vec::new(),
            down: Vec::new(),
        };
        for (tensor, spec) in mlp.tensors().iter().enumerate() {
            model.params.push(stream.alloc_zeros(spec.len)?);
            model.grads.push(stream.alloc_zeros(spec.len)?);
            for start in (0..spec.len).step_by(PIECE) {
                let len = PIECE.min(spec.len - start);
                let flat = spec.offset + start;
                model.up.push(Piece {
                    tensor,
                    start,
                    flat,
                    host: pinned(ctx, len, true)?,
                });
                model.down.push(Piece {
                    tensor,
                    start,
                    flat,
                    host: pinned(ctx, len, false)?,
                });
            }
        }
        Ok(model)
    }

    /// Queues the upload of layer `l`'s weight and bias from `params` on `copy`. Returns once
    /// the host has staged the last piece; the copies themselves run on.
    pub(super) fn upload_layer(
        &mut self,
        copy: &Arc<CudaStream>,
        l: usize,
        params: &[f32],
    ) -> Result<(), CudaError> {
        let DeviceModel {
            params: dev, up, ..
        } = self;
        for p in up.iter_mut().filter(|p| p.tensor / 2 == l) {
            let src = params
                .get(p.flat_range())
                .ok_or_else(|| CudaError::Internal("parameter piece out of range".into()))?;
            // Waits for this piece's previous copy, so staging never overwrites data in flight.
            p.host.as_mut_slice()?.copy_from_slice(src);
            let range = p.range();
            copy.memcpy_htod(&p.host, &mut dev[p.tensor].slice_mut(range))?;
        }
        Ok(())
    }

    /// Queues the download of layer `l`'s gradients on `copy`; each piece waits on the device
    /// for the kernel that wrote its tensor.
    pub(super) fn download_layer(
        &mut self,
        copy: &Arc<CudaStream>,
        l: usize,
    ) -> Result<(), CudaError> {
        let DeviceModel { grads, down, .. } = self;
        for p in down.iter_mut().filter(|p| p.tensor / 2 == l) {
            let range = p.range();
            copy.memcpy_dtoh(&grads[p.tensor].slice(range), &mut p.host)?;
        }
        Ok(())
    }

    /// Copies every downloaded piece into `grads` in the order they were queued (last layer
    /// first, each layer's pieces in order), each as soon as it has landed.
    pub(super) fn collect(&self, grads: &mut [f32]) -> Result<(), CudaError> {
        for l in (0..self.layers.len() - 1).rev() {
            for p in self.down.iter().filter(|p| p.tensor / 2 == l) {
                let dst = grads
                    .get_mut(p.flat_range())
                    .ok_or_else(|| CudaError::Internal("gradient piece out of range".into()))?;
                dst.copy_from_slice(p.host.as_slice()?);
            }
        }
        Ok(())
    }
}

/// Per-batch device buffers, all of the exact size of one batch of `rows`.
pub(super) struct BatchBuffers {
    pub(super) layers: Vec<usize>,
    pub(super) rows: usize,
    x_host: PinnedHostSlice<f32>,
    y_host: PinnedHostSlice<u8>,
    loss_host: PinnedHostSlice<f32>,
    hits_host: PinnedHostSlice<u8>,
    pub(super) x: CudaSlice<f32>,
    pub(super) y: CudaSlice<u8>,
    pub(super) loss: CudaSlice<f32>,
    pub(super) hits: CudaSlice<u8>,
    /// Output of every layer: post-ReLU for hidden layers, logits for the last.
    pub(super) acts: Vec<CudaSlice<f32>>,
    /// Loss gradient with respect to each layer's output (same shapes as `acts`).
    pub(super) deltas: Vec<CudaSlice<f32>>,
}

impl BatchBuffers {
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        layers: &[usize],
        rows: usize,
    ) -> Result<Self, CudaError> {
        let input = rows * layers[0];
        let mut acts = Vec::with_capacity(layers.len() - 1);
        let mut deltas = Vec::with_capacity(layers.len() - 1);
        for &width in &layers[1..] {
            acts.push(stream.alloc_zeros(rows * width)?);
            deltas.push(stream.alloc_zeros(rows * width)?);
        }
        Ok(BatchBuffers {
            layers: layers.to_vec(),
            rows,
            x_host: pinned(ctx, input, true)?,
            y_host: pinned(ctx, rows, true)?,
            loss_host: pinned(ctx, rows, false)?,
            hits_host: pinned(ctx, rows, false)?,
            x: stream.alloc_zeros(input)?,
            y: stream.alloc_zeros(rows)?,
            loss: stream.alloc_zeros(rows)?,
            hits: stream.alloc_zeros(rows)?,
            acts,
            deltas,
        })
    }

    /// Stages and queues the upload of a batch on `copy`.
    pub(super) fn upload(
        &mut self,
        copy: &Arc<CudaStream>,
        x: &[f32],
        y: &[u8],
    ) -> Result<(), CudaError> {
        self.x_host.as_mut_slice()?.copy_from_slice(x);
        self.y_host.as_mut_slice()?.copy_from_slice(y);
        copy.memcpy_htod(&self.x_host, &mut self.x)?;
        copy.memcpy_htod(&self.y_host, &mut self.y)?;
        Ok(())
    }

    /// Queues the download of the per-row losses and hits on `copy`.
    pub(super) fn download_stats(&mut self, copy: &Arc<CudaStream>) -> Result<(), CudaError> {
        copy.memcpy_dtoh(&self.loss, &mut self.loss_host)?;
        copy.memcpy_dtoh(&self.hits, &mut self.hits_host)?;
        Ok(())
    }

    /// Waits for the statistics and sums them like the CPU backend (f32 per row, f64 sum).
    pub(super) fn stats(&self) -> Result<StepStats, CudaError> {
        let loss_sum = self
            .loss_host
            .as_slice()?
            .iter()
            .map(|&l| f64::from(l))
            .sum();
        let correct = self
            .hits_host
            .as_slice()?
            .iter()
            .filter(|&&h| h != 0)
            .count();
        Ok(StepStats {
            loss_sum,
            correct,
            samples: self.rows,
        })
    }
}
