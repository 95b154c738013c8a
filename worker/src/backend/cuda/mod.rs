//! CUDA backend: the MLP's forward and backward passes on an NVIDIA GPU through cudarc, with
//! cuBLAS for the products and NVRTC kernels for the rest (module `ops`).
//!
//! cudarc loads libcuda, cuBLAS and NVRTC at run time, so building needs no CUDA at all; a
//! machine without them gets [`CudaError::NoDriver`] (or another "unavailable" error) from
//! [`probe`] instead of cudarc's panic.
//!
//! Transfers go through pinned host buffers on a copy stream of their own, cut into pieces of
//! at most [`PIECE`] values, so that they overlap with compute: the host copies a piece of the
//! parameters into pinned memory while the previous piece crosses the bus, and each layer's
//! forward pass starts as soon as its own weights have arrived. Going back, each layer's
//! gradients are downloaded while the layers below are still being differentiated, and the host
//! copies them out as they land (module `buffers`). cudarc's per-buffer events order the two
//! streams.

mod buffers;
mod ops;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::result::CublasError;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use thiserror::Error;

use super::{Backend, BackendError, StepStats, check_batch, check_step};
use crate::model::Mlp;
use buffers::{BatchBuffers, DeviceModel, pinned};

/// Largest number of values moved by one host-device copy; big tensors travel in several.
pub const PIECE: usize = 1 << 20;
/// Rows per forward pass in `evaluate`.
const EVAL_CHUNK: usize = 2000;

/// Why the CUDA backend is unavailable or failed.
#[derive(Debug, Error)]
pub enum CudaError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// The driver is there but offers no device (cuInit or the device count failed).
    #[error("the CUDA driver reports no usable device: {0}")]
    NoDevice(String),
    /// The requested ordinal is not below the device count.
    #[error("CUDA device {ordinal} does not exist; the driver reports {count} device(s)")]
    NoSuchDevice {
        /// The requested device.
        ordinal: usize,
        /// How many the driver has.
        count: usize,
    },
    /// libcublas could not be loaded.
    #[error("cuBLAS (libcublas) could not be loaded; install the CUDA toolkit's libraries")]
    NoCublas,
    /// libnvrtc could not be loaded.
    #[error("NVRTC (libnvrtc) could not be loaded; install the CUDA toolkit's libraries")]
    NoNvrtc,
    /// The device is older than any target the kernels are compiled for.
    #[error("compute capability {major}.{minor} is older than the kernels support (7.5)")]
    TooOld {
        /// Major compute capability.
        major: i32,
        /// Minor compute capability.
        minor: i32,
    },
    /// NVRTC refused the kernels.
    #[error("compiling the kernels with NVRTC failed: {0}")]
    Compile(String),
    /// The driver refused the compiled PTX, typically because NVRTC is newer than the driver.
    #[error(
        "the driver could not load the kernels compiled for {arch} ({source}); NVRTC must come \
         from a CUDA version the driver supports"
    )]
    Load {
        /// The PTX target used.
        arch: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS error: {0}")]
    Blas(CublasError),
    /// A dimension does not fit the 32-bit sizes cuBLAS and the kernels take.
    #[error("dimension {0} is too large for cuBLAS (at most 2^31 - 1)")]
    TooLarge(usize),
    /// A buffer did not have the size an operation expected: a bug in this backend.
    #[error("internal error in the CUDA backend: {0}")]
    Internal(String),
}

impl CudaError {
    /// Whether the error says CUDA is absent (as opposed to present but failing).
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::NoDriver
                | CudaError::NoDevice(_)
                | CudaError::NoSuchDevice { .. }
                | CudaError::NoCublas
                | CudaError::NoNvrtc
        )
    }
}

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> BackendError {
        BackendError::Device(e.to_string())
    }
}

/// Checks, without creating a context, that the driver, device `ordinal`, cuBLAS and NVRTC are
/// all there; returns the number of devices.
///
/// cudarc panics when a library it needs is missing, so this runs before anything else.
#[allow(unsafe_code)]
pub fn probe(ordinal: usize) -> Result<usize, CudaError> {
    // SAFETY: `is_culib_present` only tries to dlopen the library and closes it again.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
    let count = usize::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err(CudaError::NoDevice("the device count is 0".into()));
    }
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    // SAFETY: as above, for libcublas.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::NoCublas);
    }
    // SAFETY: as above, for libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    Ok(count)
}

/// Checks that `v` fits the `int` dimensions of cuBLAS and the kernels.
fn dim(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::TooLarge(v))
}

/// Runs the MLP on one GPU. Device and pinned buffers are sized for the current model and
/// batch size and reused while those stay the same.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Kernels and products; cuBLAS is bound to it.
    compute: Arc<CudaStream>,
    /// Host-device copies.
    copy: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: ops::Kernels,
    device_name: String,
    model: Option<DeviceModel>,
    batch: Option<BatchBuffers>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ctx.ordinal())
            .field("device", &self.device_name)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Probes for CUDA, then creates a context on device `ordinal`, two streams, a cuBLAS
    /// handle, and compiles and loads the kernels.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
        probe(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        let compute = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let blas = CudaBlas::new(compute.clone()).map_err(CudaError::Blas)?;
        let kernels = ops::Kernels::load(&ctx)?;
        let device_name = ctx.name()?;
        Ok(CudaBackend {
            ctx,
            compute,
            copy,
            blas,
            kernels,
            device_name,
            model: None,
            batch: None,
        })
    }

    /// The device's name as the driver reports it, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes the device model and batch buffers fit `mlp` and `rows`.
    fn prepare(&mut self, mlp: &Mlp, rows: usize) -> Result<(), CudaError> {
        dim(rows)?;
        for &w in mlp.layers() {
            dim(w)?;
        }
        if self.model.as_ref().is_none_or(|m| m.layers != mlp.layers()) {
            self.model = None;
            self.model = Some(DeviceModel::new(&self.ctx, &self.compute, mlp)?);
        }
        if self
            .batch
            .as_ref()
            .is_none_or(|b| b.rows != rows || b.layers != mlp.layers())
        {
            self.batch = None;
            self.batch = Some(BatchBuffers::new(
                &self.ctx,
                &self.compute,
                mlp.layers(),
                rows,
            )?);
        }
        Ok(())
    }

    /// Runs the uploaded batch through the network; with `upload`, each layer's parameters are
    /// queued for upload just before the layer, so the first layers compute while the later
    /// ones are still in transit.
    fn forward(&mut self, upload: Option<&[f32]>) -> Result<(), CudaError> {
        let CudaBackend {
            compute,
            copy,
            blas,
            kernels,
            model,
            batch,
            ..
        } = self;
        let (Some(model), Some(batch)) = (model.as_mut(), batch.as_mut()) else {
            return Err(CudaError::Internal("forward before prepare".into()));
        };
        let layers = model.layers.clone();
        let depth = layers.len() - 1;
        let rows = dim(batch.rows)?;
        for l in 0..depth {
            let (n_in, n_out) = (dim(layers[l])?, dim(layers[l + 1])?);
            if let Some(params) = upload {
                model.upload_layer(copy, l, params)?;
            }
            let (done, rest) = batch.acts.split_at_mut(l);
            let out = &mut rest[0];
            let cfg = ops::forward_cfg(rows, n_in, n_out);
            match done.last() {
                Some(input) => ops::gemm(blas, cfg, &model.params[2 * l], input, out)?,
                None => ops::gemm(blas, cfg, &model.params[2 * l], &batch.x, out)?,
            }
            kernels.bias_act(
                compute,
                out,
                &model.params[2 * l + 1],
                rows,
                n_out,
                l + 1 < depth,
            )?;
        }
        Ok(())
    }

    /// Loss statistics of the forward pass, and with `grad_scale` the loss gradient with
    /// respect to the logits; the statistics are queued for download.
    fn loss(&mut self, grad_scale: Option<f32>) -> Result<(), CudaError> {
        let CudaBackend {
            compute,
            copy,
            kernels,
            batch,
            ..
        } = self;
        let batch = batch
            .as_mut()
            .ok_or_else(|| CudaError::Internal("loss before prepare".into()))?;
        let depth = batch.layers.len() - 1;
        let classes = dim(batch.layers[depth])?;
        let rows = dim(batch.rows)?;
        let BatchBuffers {
            y,
            loss,
            hits,
            acts,
            deltas,
            ..
        } = batch;
        kernels.softmax_xent(
            compute,
            &acts[depth - 1],
            y,
            rows,
            classes,
            &mut deltas[depth - 1],
            grad_scale,
            loss,
            hits,
        )?;
        batch.download_stats(copy)
    }

    /// Back-propagates from the logits' gradient, queueing each layer's gradient download as
    /// soon as it is computed.
    fn backward(&mut self) -> Result<(), CudaError> {
        let CudaBackend {
            compute,
            copy,
            blas,
            kernels,
            model,
            batch,
            ..
        } = self;
        let (Some(model), Some(batch)) = (model.as_mut(), batch.as_mut()) else {
            return Err(CudaError::Internal("backward before prepare".into()));
        };
        let layers = model.layers.clone();
        let rows = dim(batch.rows)?;
        for l in (0..layers.len() - 1).rev() {
            let (n_in, n_out) = (dim(layers[l])?, dim(layers[l + 1])?);
            let (below, rest) = batch.deltas.split_at_mut(l);
            let dy = &rest[0];
            let input = if l == 0 { &batch.x } else { &batch.acts[l - 1] };
            let (grad_w, grad_b) = model.grads[2 * l..2 * l + 2].split_at_mut(1);
            ops::gemm(
                blas,
                ops::grad_w_cfg(rows, n_in, n_out),
                dy,
                input,
                &mut grad_w[0],
            )?;
            kernels.col_sum(compute, dy, rows, n_out, &mut grad_b[0])?;
            model.download_layer(copy, l)?;
            if let Some(dx) = below.last_mut() {
                ops::gemm(
                    blas,
                    ops::grad_x_cfg(rows, n_in, n_out),
                    &model.params[2 * l],
                    dy,
                    dx,
                )?;
                kernels.relu_grad(compute, dx, &batch.acts[l - 1])?;
            }
        }
        Ok(())
    }

    /// Fails with the first error cudarc recorded in the background (event and sync calls made
    /// while dropping guards cannot return errors, so cudarc keeps them on the context).
    fn check(&self) -> Result<(), CudaError> {
        Ok(self.ctx.check_err()?)
    }

    fn step(
        &mut self,
        mlp: &Mlp,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grads: &mut [f32],
    ) -> Result<StepStats, CudaError> {
        let rows = y.len();
        self.ctx.bind_to_thread()?;
        self.prepare(mlp, rows)?;
        if let Some(batch) = self.batch.as_mut() {
            batch.upload(&self.copy, x, y)?;
        }
        self.forward(Some(params))?;
        self.loss(Some(1.0 / rows as f32))?;
        self.backward()?;
        if let Some(model) = self.model.as_ref() {
            model.collect(grads)?;
        }
        let stats = match self.batch.as_ref() {
            Some(batch) => batch.stats()?,
            None => return Err(CudaError::Internal("no batch buffers".into())),
        };
        self.check()?;
        Ok(stats)
    }

    fn eval(
        &mut self,
        mlp: &Mlp,
        params: &[f32],
        x: &[f32],
        y: &[u8],
    ) -> Result<StepStats, CudaError> {
        let mut total = StepStats::default();
        if y.is_empty() {
            return Ok(total);
        }
        self.ctx.bind_to_thread()?;
        let mut first = true;
        for (xc, yc) in x
            .chunks(EVAL_CHUNK * mlp.input_dim())
            .zip(y.chunks(EVAL_CHUNK))
        {
            self.prepare(mlp, yc.len())?;
            if let Some(batch) = self.batch.as_mut() {
                batch.upload(&self.copy, xc, yc)?;
            }
            // The parameters go up once, interleaved with the first chunk's layers.
            self.forward(first.then_some(params))?;
            first = false;
            self.loss(None)?;
            if let Some(batch) = self.batch.as_ref() {
                total.merge(&batch.stats()?);
            }
        }
        self.check()?;
        Ok(total)
    }

    /// Times `iters` runs of exactly the cuBLAS products one training step of `mlp` on `rows`
    /// samples makes (forward, weight gradients, input gradients but the first layer's), on
    /// device-resident buffers with no kernels or transfers: the floor a step can approach.
    /// Returns the mean time per run.
    pub fn time_step_gemms(
        &mut self,
        mlp: &Mlp,
        rows: usize,
        iters: u32,
    ) -> Result<Duration, CudaError> {
        self.ctx.bind_to_thread()?;
        let layers = mlp.layers();
        let stream = &self.compute;
        let r = dim(rows)?;
        /// One layer's operands: weight, input, output (reused as its gradient), weight gradient.
        struct Layer {
            n_in: i32,
            n_out: i32,
            w: CudaSlice<f32>,
            x: CudaSlice<f32>,
            y: CudaSlice<f32>,
            dw: CudaSlice<f32>,
        }
        let mut bufs = Vec::new();
        for w in layers.windows(2) {
            let (n_in, n_out) = (w[0], w[1]);
            bufs.push(Layer {
                n_in: dim(n_in)?,
                n_out: dim(n_out)?,
                w: stream.alloc_zeros(n_in * n_out)?,
                x: stream.alloc_zeros(rows * n_in)?,
                y: stream.alloc_zeros(rows * n_out)?,
                dw: stream.alloc_zeros(n_in * n_out)?,
            });
        }
        let blas = &self.blas;
        let run = |bufs: &mut [Layer]| {
            for b in bufs.iter_mut() {
                let cfg = ops::forward_cfg(r, b.n_in, b.n_out);
                ops::gemm(blas, cfg, &b.w, &b.x, &mut b.y)?;
            }
            for (l, b) in bufs.iter_mut().enumerate().rev() {
                let cfg = ops::grad_w_cfg(r, b.n_in, b.n_out);
                ops::gemm(blas, cfg, &b.y, &b.x, &mut b.dw)?;
                if l > 0 {
                    let cfg = ops::grad_x_cfg(r, b.n_in, b.n_out);
                    ops::gemm(blas, cfg, &b.w, &b.y, &mut b.x)?;
                }
            }
            Ok::<(), CudaError>(())
        };
        run(&mut bufs)?;
        stream.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            run(&mut bufs)?;
        }
        stream.synchronize()?;
        let elapsed = start.elapsed();
        self.check()?;
        Ok(elapsed / iters.max(1))
    }

    /// Times `iters` round trips of `len` values (pinned host to device and back, one after
    /// the other, without overlap): what a step's transfers cost if nothing hid them.
    pub fn time_round_trip(&mut self, len: usize, iters: u32) -> Result<Duration, CudaError> {
        self.ctx.bind_to_thread()?;
        let up = pinned::<f32>(&self.ctx, len, true)?;
        let mut down = pinned::<f32>(&self.ctx, len, false)?;
        let mut dev = self.copy.alloc_zeros::<f32>(len)?;
        self.copy.memcpy_htod(&up, &mut dev)?;
        self.copy.memcpy_dtoh(&dev, &mut down)?;
        self.copy.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            self.copy.memcpy_htod(&up, &mut dev)?;
            self.copy.memcpy_dtoh(&dev, &mut down)?;
        }
        self.copy.synchronize()?;
        let elapsed = start.elapsed();
        self.check()?;
        Ok(elapsed / iters.max(1))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn forward_backward(
        &mut self,
        mlp: &Mlp,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grads: &mut [f32],
    ) -> Result<StepStats, BackendError> {
        check_step(mlp, params, x, y, grads)?;
        Ok(self.step(mlp, params, x, y, grads)?)
    }

    fn evaluate(
        &mut self,
        mlp: &Mlp,
        params: &[f32],
        x: &[f32],
        y: &[u8],
    ) -> Result<StepStats, BackendError> {
        check_batch(mlp, params, x, y)?;
        Ok(self.eval(mlp, params, x, y)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_errors_are_told_apart_from_failures() {
        assert!(CudaError::NoDriver.is_unavailable());
        assert!(CudaError::NoNvrtc.is_unavailable());
        assert!(
            CudaError::NoSuchDevice {
                ordinal: 3,
                count: 1
            }
            .is_unavailable()
        );
        assert!(!CudaError::Compile("x".into()).is_unavailable());
        assert!(!CudaError::TooLarge(1 << 40).is_unavailable());
    }

    /// Without a GPU the probe answers with a reason instead of cudarc's panic, and so does
    /// creating the backend.
    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        match probe(0) {
            Ok(count) => println!("skipped: {count} CUDA device(s) present"),
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                let err = CudaBackend::new(0).expect_err("no device, no backend");
                assert_eq!(err.to_string(), e.to_string());
            }
        }
    }

    #[test]
    fn dimensions_beyond_i32_are_refused() {
        assert_eq!(dim(7).expect("fits"), 7);
        assert!(matches!(dim(1 << 31), Err(CudaError::TooLarge(_))));
    }
}
