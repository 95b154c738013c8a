//! The device operations of the CUDA backend: the NVRTC kernels (bias + ReLU, softmax
//! cross-entropy, bias gradient, ReLU gradient) and the row-major cuBLAS products of a layer.
//!
//! This file holds the backend's unsafe code: kernel launches and cuBLAS calls take raw device
//! pointers, so every launch and product checks its buffer lengths against the sizes it will
//! touch first, and the kernels guard every index with those same sizes.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::CudaError;

/// The kernels, compiled by NVRTC when the backend starts.
///
/// Matrices are row-major like the CPU backend's, and every loop runs in the same order as the
/// CPU code where the order changes the f32 result (the softmax sums), so both backends agree
/// to rounding.
const KERNELS: &str = r#"
#define NEG_INF (-__int_as_float(0x7f800000))

// y[r][c] = y[r][c] + b[c], then ReLU when `relu` is set. `v < 0` rather than fmaxf so that a
// NaN from a diverging run propagates, as on the CPU.
extern "C" __global__ void bias_act(float* y, const float* b, long long rows, int cols, int relu) {
    long long n = rows * (long long)cols;
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
        float v = y[i] + b[i % cols];
        if (relu && v < 0.0f) {
            v = 0.0f;
        }
        y[i] = v;
    }
}

// One thread per row: the row's loss and whether its argmax is the label, and with `want_grad`
// the loss gradient (softmax - onehot) * scale. The row max is subtracted before expf so large
// logits cannot overflow; the first maximum wins ties, as on the CPU.
extern "C" __global__ void softmax_xent(const float* logits, const unsigned char* y, int rows,
                                        int classes, float scale, int want_grad, float* dlogits,
                                        float* loss, unsigned char* hits) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) {
        return;
    }
    const float* row = logits + (long long)r * classes;
    int label = y[r];
    int argmax = 0;
    float maxv = NEG_INF;
    for (int i = 0; i < classes; i++) {
        if (row[i] > maxv) {
            maxv = row[i];
            argmax = i;
        }
    }
    float sum = 0.0f;
    for (int i = 0; i < classes; i++) {
        sum += expf(row[i] - maxv);
    }
    float log_sum = logf(sum);
    loss[r] = log_sum - (row[label] - maxv);
    hits[r] = argmax == label ? 1 : 0;
    if (want_grad) {
        float* drow = dlogits + (long long)r * classes;
        for (int i = 0; i < classes; i++) {
            float p = expf(row[i] - maxv - log_sum);
            float target = i == label ? 1.0f : 0.0f;
            drow[i] = (p - target) * scale;
        }
    }
}

// db[c] = sum over rows of dy[r][c]; one thread per column, rows in order.
extern "C" __global__ void col_sum(const float* dy, int rows, int cols, float* db) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) {
        return;
    }
    float s = 0.0f;
    for (int r = 0; r < rows; r++) {
        s += dy[(long long)r * cols + c];
    }
    db[c] = s;
}

// ReLU passes the gradient only where its output was positive.
extern "C" __global__ void relu_grad(float* dx, const float* a, long long n) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
        if (a[i] <= 0.0f) {
            dx[i] = 0.0f;
        }
    }
}
"#;

/// Threads per block for every kernel.
const BLOCK: u32 = 256;
/// Upper bound on blocks for the grid-stride kernels; each thread then loops.
const MAX_GRID: u32 = 65_535;

/// The PTX target for a device of compute capability `major.minor`: the newest virtual
/// architecture not above the device's, and never above `compute_90`.
///
/// PTX newer than the driver understands fails to load, and NVRTC of a newer toolkit than the
/// driver would emit just that for the newest targets; `compute_90` PTX is JIT-compiled by the
/// driver for newer devices. CUDA 13 compiles nothing older than `compute_75`.
pub(super) fn arch_for(major: i32, minor: i32) -> Option<&'static str> {
    const ARCHES: [(i32, &str); 5] = [
        (90, "compute_90"),
        (89, "compute_89"),
        (86, "compute_86"),
        (80, "compute_80"),
        (75, "compute_75"),
    ];
    let cc = major * 10 + minor;
    ARCHES
        .iter()
        .find(|&&(min, _)| cc >= min)
        .map(|&(_, arch)| arch)
}

/// Compiles the kernel source to PTX for `arch`; needs only NVRTC, not a device.
pub(super) fn compile(arch: &'static str) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some("edl_kernels.cu".into()),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(KERNELS, opts).map_err(|e| CudaError::Compile(e.to_string()))
}

/// The loaded kernels.
pub(super) struct Kernels {
    bias_act: CudaFunction,
    softmax_xent: CudaFunction,
    col_sum: CudaFunction,
    relu_grad: CudaFunction,
}

impl Kernels {
    /// Compiles the kernels for the context's device and loads them.
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, CudaError> {
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_for(major, minor).ok_or(CudaError::TooOld { major, minor })?;
        let ptx = compile(arch)?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| CudaError::Load { arch, source: e })?;
        Ok(Kernels {
            bias_act: module.load_function("bias_act")?,
            softmax_xent: module.load_function("softmax_xent")?,
            col_sum: module.load_function("col_sum")?,
            relu_grad: module.load_function("relu_grad")?,
        })
    }

    /// `y += b` per row, then ReLU when `relu`; `y` is `rows x cols`, `b` has `cols` values.
    #[allow(unsafe_code)]
    pub(super) fn bias_act(
        &self,
        stream: &CudaStream,
        y: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: i32,
        cols: i32,
        relu: bool,
    ) -> Result<(), CudaError> {
        let n = elems(rows, cols);
        expect_len("bias_act y", y.len(), n)?;
        expect_len("bias_act b", b.len(), elems(1, cols))?;
        let rows = i64::from(rows);
        let relu = i32::from(relu);
        let cfg = grid_stride(n);
        // SAFETY: the argument list matches `bias_act(float*, const float*, long long, int,
        // int)` in KERNELS, and the kernel touches y[0..rows*cols) and b[0..cols), which the
        // length checks above put inside the two buffers.
        unsafe {
            stream
                .launch_builder(&self.bias_act)
                .arg(y)
                .arg(b)
                .arg(&rows)
                .arg(&cols)
                .arg(&relu)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// Loss and argmax hit per row of the `rows x classes` logits; with `grad_scale` also the
    /// loss gradient times that scale into `dlogits` (same shape), which is untouched otherwise.
    #[allow(unsafe_code, clippy::too_many_arguments)]
    pub(super) fn softmax_xent(
        &self,
        stream: &CudaStream,
        logits: &CudaSlice<f32>,
        labels: &CudaSlice<u8>,
        rows: i32,
        classes: i32,
        dlogits: &mut CudaSlice<f32>,
        grad_scale: Option<f32>,
        loss: &mut CudaSlice<f32>,
        hits: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let n = elems(rows, classes);
        expect_len("softmax_xent logits", logits.len(), n)?;
        expect_len("softmax_xent labels", labels.len(), elems(rows, 1))?;
        expect_len("softmax_xent dlogits", dlogits.len(), n)?;
        expect_len("softmax_xent loss", loss.len(), elems(rows, 1))?;
        expect_len("softmax_xent hits", hits.len(), elems(rows, 1))?;
        let want_grad = i32::from(grad_scale.is_some());
        let scale = grad_scale.unwrap_or(0.0);
        let cfg = one_per(rows);
        // SAFETY: the arguments match `softmax_xent(const float*, const unsigned char*, int,
        // int, float, int, float*, float*, unsigned char*)`; thread r < rows touches row r of
        // logits and dlogits (rows*classes values each) and element r of labels, loss and
        // hits, all checked above. Labels are below `classes` (check_batch), so row[label]
        // stays inside the row.
        unsafe {
            stream
                .launch_builder(&self.softmax_xent)
                .arg(logits)
                .arg(labels)
                .arg(&rows)
                .arg(&classes)
                .arg(&scale)
                .arg(&want_grad)
                .arg(dlogits)
                .arg(loss)
                .arg(hits)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// `db` = column sums of the `rows x cols` matrix `dy`.
    #[allow(unsafe_code)]
    pub(super) fn col_sum(
        &self,
        stream: &CudaStream,
        dy: &CudaSlice<f32>,
        rows: i32,
        cols: i32,
        db: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        expect_len("col_sum dy", dy.len(), elems(rows, cols))?;
        expect_len("col_sum db", db.len(), elems(1, cols))?;
        let cfg = one_per(cols);
        // SAFETY: the arguments match `col_sum(const float*, int, int, float*)`; thread
        // c < cols reads column c of dy (rows*cols values) and writes db[c], checked above.
        unsafe {
            stream
                .launch_builder(&self.col_sum)
                .arg(dy)
                .arg(&rows)
                .arg(&cols)
                .arg(db)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// Zeroes `dx` wherever the layer output `a` (same length) is not positive.
    #[allow(unsafe_code)]
    pub(super) fn relu_grad(
        &self,
        stream: &CudaStream,
        dx: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        expect_len("relu_grad a", a.len(), dx.len())?;
        let n = dx.len();
        let len = i64::try_from(n).map_err(|_| CudaError::TooLarge(n))?;
        let cfg = grid_stride(n);
        // SAFETY: the arguments match `relu_grad(float*, const float*, long long)`, and the
        // kernel touches indices below `len`, the length of both buffers.
        unsafe {
            stream
                .launch_builder(&self.relu_grad)
                .arg(dx)
                .arg(a)
                .arg(&len)
                .launch(cfg)
        }?;
        Ok(())
    }
}

/// `rows * cols` for dimensions already known to be non-negative.
fn elems(rows: i32, cols: i32) -> usize {
    usize::try_from(rows).unwrap_or(0) * usize::try_from(cols).unwrap_or(0)
}

/// Fails unless a buffer has exactly the length an operation will touch.
fn expect_len(what: &'static str, actual: usize, expected: usize) -> Result<(), CudaError> {
    if actual == expected {
        Ok(())
    } else {
        Err(CudaError::Internal(format!(
            "{what}: buffer has {actual} elements, the operation needs {expected}"
        )))
    }
}

/// One thread per item, `BLOCK` threads a block.
fn one_per(items: i32) -> LaunchConfig {
    let items = u32::try_from(items).unwrap_or(0);
    LaunchConfig {
        grid_dim: (items.div_ceil(BLOCK).max(1), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Enough blocks for one thread per element up to `MAX_GRID` blocks; the kernels loop beyond.
fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_GRID as usize);
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).unwrap_or(MAX_GRID), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `Y = X·W`: `X` is `rows x n_in`, `W` is `n_in x n_out`, `Y` is `rows x n_out`, all row-major.
///
/// cuBLAS is column-major, and a row-major matrix is the column-major view of its transpose,
/// so every product below is computed transposed: here `Yᵀ = Wᵀ·Xᵀ`, with A = W and B = X.
pub(super) fn forward_cfg(rows: i32, n_in: i32, n_out: i32) -> GemmConfig<f32> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n_out,
        n: rows,
        k: n_in,
        alpha: 1.0,
        lda: n_out,
        ldb: n_in,
        beta: 0.0,
        ldc: n_out,
    }
}

/// `dW = Xᵀ·dY`, computed as `dWᵀ = dYᵀ·X`, with A = dY and B = X (transposed).
pub(super) fn grad_w_cfg(rows: i32, n_in: i32, n_out: i32) -> GemmConfig<f32> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_T,
        m: n_out,
        n: n_in,
        k: rows,
        alpha: 1.0,
        lda: n_out,
        ldb: n_in,
        beta: 0.0,
        ldc: n_out,
    }
}

/// `dX = dY·Wᵀ`, computed as `dXᵀ = W·dYᵀ`, with A = W (transposed) and B = dY.
pub(super) fn grad_x_cfg(rows: i32, n_in: i32, n_out: i32) -> GemmConfig<f32> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n_in,
        n: rows,
        k: n_out,
        alpha: 1.0,
        lda: n_out,
        ldb: n_out,
        beta: 0.0,
        ldc: n_in,
    }
}

/// Elements a column-major operand of `rows x cols` (before `op`) spans with leading dimension `ld`.
fn span(rows: i32, cols: i32, ld: i32) -> Option<usize> {
    let (rows, cols, ld) = (
        usize::try_from(rows).ok()?,
        usize::try_from(cols).ok()?,
        usize::try_from(ld).ok()?,
    );
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    (ld >= rows).then(|| ld * (cols - 1) + rows)
}

/// The elements `cfg` reads from A and B and writes to C, or `None` for an invalid config.
pub(super) fn gemm_spans(cfg: &GemmConfig<f32>) -> Option<(usize, usize, usize)> {
    let stored = |op: cublasOperation_t, r: i32, c: i32| match op {
        cublasOperation_t::CUBLAS_OP_N => (r, c),
        _ => (c, r),
    };
    let (ar, ac) = stored(cfg.transa, cfg.m, cfg.k);
    let (br, bc) = stored(cfg.transb, cfg.k, cfg.n);
    Some((
        span(ar, ac, cfg.lda)?,
        span(br, bc, cfg.ldb)?,
        span(cfg.m, cfg.n, cfg.ldc)?,
    ))
}

/// Runs `C = op(A)·op(B)` per `cfg` on the handle's stream after checking that each buffer holds
/// exactly what the product spans.
#[allow(unsafe_code)]
pub(super) fn gemm<A, B, C>(
    blas: &CudaBlas,
    cfg: GemmConfig<f32>,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<(), CudaError>
where
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    C: DevicePtrMut<f32>,
{
    let (a_len, b_len, c_len) = gemm_spans(&cfg)
        .ok_or_else(|| CudaError::Internal(format!("invalid GEMM configuration {cfg:?}")))?;
    expect_len("gemm A", a.len(), a_len)?;
    expect_len("gemm B", b.len(), b_len)?;
    expect_len("gemm C", c.len(), c_len)?;
    // SAFETY: cuBLAS reads op(A) (m x k), op(B) (k x n) and writes C (m x n) through the
    // leading dimensions in `cfg`; `gemm_spans` computed the elements each of those spans and
    // the checks above put every one inside its buffer.
    unsafe { blas.gemm(cfg, a, b, c) }.map_err(CudaError::Blas)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The BLAS definition of `C = alpha·op(A)·op(B) + beta·C`, column-major, on the CPU.
    fn blas_sgemm(cfg: &GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
        let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
        let op_a = |i: usize, l: usize| match cfg.transa {
            cublasOperation_t::CUBLAS_OP_N => a[i + l * lda],
            _ => a[l + i * lda],
        };
        let op_b = |l: usize, j: usize| match cfg.transb {
            cublasOperation_t::CUBLAS_OP_N => b[l + j * ldb],
            _ => b[j + l * ldb],
        };
        for j in 0..n {
            for i in 0..m {
                let s: f32 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                // As BLAS specifies, beta = 0 ignores C (which may hold NaN) entirely.
                let old = if cfg.beta == 0.0 {
                    0.0
                } else {
                    cfg.beta * c[i + j * ldc]
                };
                c[i + j * ldc] = cfg.alpha * s + old;
            }
        }
    }

    /// Row-major `a (r x k) · b (k x c)` the plain way.
    fn matmul(a: &[f32], b: &[f32], r: usize, k: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                out[i * c + j] = (0..k).map(|l| a[i * k + l] * b[l * c + j]).sum();
            }
        }
        out
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                out[j * r + i] = a[i * c + j];
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect()
    }

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    /// The column-major configurations compute the row-major products the CPU backend does,
    /// checked against the BLAS definition itself, so a GPU run is not the first to see them.
    #[test]
    fn gemm_configs_compute_the_row_major_products() {
        for (rows, n_in, n_out) in [(5, 7, 3), (1, 4, 9), (6, 1, 2), (3, 3, 3)] {
            let x = values(rows * n_in, 1);
            let w = values(n_in * n_out, 2);
            let dy = values(rows * n_out, 3);
            let (r, i, o) = (rows as i32, n_in as i32, n_out as i32);

            let cfg = forward_cfg(r, i, o);
            assert_eq!(gemm_spans(&cfg), Some((w.len(), x.len(), rows * n_out)));
            let mut y = vec![f32::NAN; rows * n_out];
            blas_sgemm(&cfg, &w, &x, &mut y);
            close(&y, &matmul(&x, &w, rows, n_in, n_out));

            let cfg = grad_w_cfg(r, i, o);
            assert_eq!(gemm_spans(&cfg), Some((dy.len(), x.len(), w.len())));
            let mut dw = vec![f32::NAN; n_in * n_out];
            blas_sgemm(&cfg, &dy, &x, &mut dw);
            close(
                &dw,
                &matmul(&transpose(&x, rows, n_in), &dy, n_in, rows, n_out),
            );

            let cfg = grad_x_cfg(r, i, o);
            assert_eq!(gemm_spans(&cfg), Some((w.len(), dy.len(), x.len())));
            let mut dx = vec![f32::NAN; rows * n_in];
            blas_sgemm(&cfg, &w, &dy, &mut dx);
            close(
                &dx,
                &matmul(&dy, &transpose(&w, n_in, n_out), rows, n_out, n_in),
            );
        }
    }

    #[test]
    fn gemm_spans_reject_short_leading_dimensions() {
        let mut cfg = forward_cfg(4, 5, 6);
        cfg.lda = 5;
        assert_eq!(gemm_spans(&cfg), None);
        cfg.lda = 6;
        cfg.ldb = -1;
        assert_eq!(gemm_spans(&cfg), None);
    }

    #[test]
    fn arch_never_exceeds_compute_90_and_refuses_old_devices() {
        assert_eq!(arch_for(9, 0), Some("compute_90"));
        assert_eq!(arch_for(10, 0), Some("compute_90"));
        assert_eq!(arch_for(12, 0), Some("compute_90"));
        assert_eq!(arch_for(8, 9), Some("compute_89"));
        assert_eq!(arch_for(8, 7), Some("compute_86"));
        assert_eq!(arch_for(8, 0), Some("compute_80"));
        assert_eq!(arch_for(7, 5), Some("compute_75"));
        assert_eq!(arch_for(7, 0), None);
    }

    #[test]
    fn launch_shapes_cover_the_work() {
        assert_eq!(one_per(1).grid_dim.0, 1);
        assert_eq!(one_per(257).grid_dim.0, 2);
        assert_eq!(grid_stride(0).grid_dim.0, 1);
        assert_eq!(grid_stride(512).grid_dim.0, 2);
        assert_eq!(grid_stride(usize::MAX / 2).grid_dim.0, MAX_GRID);
    }

    /// NVRTC needs no GPU, so wherever its library is installed the kernels are compiled for
    /// every target the backend may pick.
    #[test]
    #[allow(unsafe_code)]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to open the NVRTC library and closes it again.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipped: NVRTC (libnvrtc) is not installed");
            return;
        }
        for arch in ["compute_75", "compute_90"] {
            let ptx = compile(arch).expect("the kernels compile");
            let text = ptx.to_src();
            for name in ["bias_act", "softmax_xent", "col_sum", "relu_grad"] {
                assert!(text.contains(name), "{arch}: {name} missing from the PTX");
            }
        }
    }
}
