//! The CUDA backend against the CPU backend: gradients, losses and evaluations on fresh random
//! weights and inputs for several layer and batch sizes. Without a GPU each GPU test says it
//! was skipped and why (set `EDL_REQUIRE_CUDA=1` to make that a failure, as the GPU check
//! does); the command-line behaviour without a GPU is checked instead.

use std::process::Command;

use edl_worker::backend::cuda::{self, CudaBackend};
use edl_worker::backend::{Backend, BackendError, CpuBackend, StepStats};
use edl_worker::model::Mlp;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Largest accepted relative error per tensor: max |gpu - cpu| / max |cpu|.
const TOLERANCE: f64 = 1e-4;
/// How close to zero (in absolute value) a hidden pre-activation may come; see `random_case`.
const KINK_MARGIN: f64 = 1e-4;

/// The CUDA backend, or `None` after printing why the test is skipped.
fn gpu() -> Option<CudaBackend> {
    match cuda::probe(0) {
        Ok(_) => Some(CudaBackend::new(0).expect("a GPU is present, so the backend must start")),
        Err(e) => {
            assert!(
                std::env::var_os("EDL_REQUIRE_CUDA").is_none(),
                "EDL_REQUIRE_CUDA is set but CUDA is unusable: {e}"
            );
            edl_shared::skip::skipped("", &e.to_string());
            None
        }
    }
}

/// A test case: a model, its parameters and one batch.
struct Case {
    mlp: Mlp,
    params: Vec<f32>,
    x: Vec<f32>,
    y: Vec<u8>,
}

/// Draws Glorot-uniform weights, small random biases and a batch of `rows` inputs in [-1.5, 1.5)
/// with random labels.
///
/// ReLU's derivative jumps at zero, so a pre-activation within rounding of zero may be positive
/// on one backend and negative on the other, and then both are right and their gradients
/// differ by that unit's whole contribution. Rows whose f64 pre-activations come within
/// `KINK_MARGIN` of zero in any hidden unit are therefore drawn again; each row's forward pass
/// is independent of the others, so this leaves every other row as drawn.
fn random_case(layers: &[usize], rows: usize, seed: u64) -> Case {
    let mlp = Mlp::new(layers.to_vec()).expect("valid widths");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut params = Vec::with_capacity(mlp.param_count());
    for w in layers.windows(2) {
        let limit = (6.0 / (w[0] + w[1]) as f64).sqrt() as f32;
        params.extend((0..w[0] * w[1]).map(|_| rng.random_range(-limit..limit)));
        params.extend((0..w[1]).map(|_| rng.random_range(-0.1f32..0.1)));
    }
    let dim = layers[0];
    let classes = layers[layers.len() - 1];
    let (mut x, mut y) = (Vec::with_capacity(rows * dim), Vec::with_capacity(rows));
    let mut redrawn = 0;
    while y.len() < rows {
        let row: Vec<f32> = (0..dim).map(|_| rng.random_range(-1.5f32..1.5)).collect();
        if min_hidden_preactivation(layers, &params, &row) < KINK_MARGIN {
            redrawn += 1;
            continue;
        }
        x.extend_from_slice(&row);
        y.push(rng.random_range(0..classes) as u8);
    }
    if redrawn > 0 {
        println!("{layers:?} x {rows}: redrew {redrawn} rows near a ReLU kink");
    }
    Case { mlp, params, x, y }
}

/// The smallest |pre-activation| of any hidden unit for one input row, in f64.
fn min_hidden_preactivation(layers: &[usize], params: &[f32], row: &[f32]) -> f64 {
    let mut input: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
    let mut offset = 0;
    let mut closest = f64::INFINITY;
    let depth = layers.len() - 1;
    for (l, w) in layers.windows(2).enumerate() {
        let (n_in, n_out) = (w[0], w[1]);
        let weight = &params[offset..offset + n_in * n_out];
        let bias = &params[offset + n_in * n_out..offset + n_in * n_out + n_out];
        offset += n_in * n_out + n_out;
        if l + 1 == depth {
            break;
        }
        let mut out: Vec<f64> = bias.iter().map(|&b| f64::from(b)).collect();
        for (i, &v) in input.iter().enumerate() {
            for (o, &wv) in out.iter_mut().zip(&weight[i * n_out..(i + 1) * n_out]) {
                *o += v * f64::from(wv);
            }
        }
        for o in &mut out {
            closest = closest.min(o.abs());
            *o = o.max(0.0);
        }
        input = out;
    }
    closest
}

/// max |a - b| / max |b| and ‖a - b‖ / ‖b‖ over one tensor.
fn rel_errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut diff_max, mut ref_max, mut diff_sq, mut ref_sq) = (0f64, 0f64, 0f64, 0f64);
    for (&a, &b) in a.iter().zip(b) {
        let d = f64::from(a) - f64::from(b);
        diff_max = diff_max.max(d.abs());
        ref_max = ref_max.max(f64::from(b).abs());
        diff_sq += d * d;
        ref_sq += f64::from(b) * f64::from(b);
    }
    (
        diff_max / ref_max.max(1e-6),
        diff_sq.sqrt() / ref_sq.sqrt().max(1e-6),
    )
}

/// Runs one training step of `case` on both backends and checks that they agree.
fn compare_step(gpu: &mut CudaBackend, case: &Case) {
    let Case { mlp, params, x, y } = case;
    let mut cpu_grads = vec![f32::NAN; mlp.param_count()];
    let mut gpu_grads = vec![f32::NAN; mlp.param_count()];
    let cpu_stats = CpuBackend::new()
        .forward_backward(mlp, params, x, y, &mut cpu_grads)
        .expect("cpu step");
    let gpu_stats = gpu
        .forward_backward(mlp, params, x, y, &mut gpu_grads)
        .expect("gpu step");
    let label = format!("{:?} x {}", mlp.layers(), y.len());
    check_stats(&label, &gpu_stats, &cpu_stats);
    assert!(
        gpu_grads.iter().all(|g| g.is_finite()),
        "{label}: non-finite GPU gradient"
    );
    for spec in mlp.tensors() {
        let range = spec.offset..spec.offset + spec.len;
        let (max_rel, norm_rel) = rel_errors(&gpu_grads[range.clone()], &cpu_grads[range]);
        println!(
            "{label} {}: max rel {max_rel:.2e}, norm rel {norm_rel:.2e}",
            spec.name
        );
        assert!(
            max_rel < TOLERANCE,
            "{label} {}: relative error {max_rel:e} (norm-based {norm_rel:e})",
            spec.name
        );
    }
}

/// Losses agree to `TOLERANCE` and hit counts up to rare argmax near-ties.
fn check_stats(label: &str, gpu: &StepStats, cpu: &StepStats) {
    assert_eq!(gpu.samples, cpu.samples, "{label}");
    let rel = (gpu.loss_sum - cpu.loss_sum).abs() / cpu.loss_sum.abs().max(1e-6);
    assert!(
        rel < TOLERANCE,
        "{label}: loss {} vs {} (rel {rel:e})",
        gpu.loss_sum,
        cpu.loss_sum
    );
    let ties = cpu.samples / 200 + 1;
    assert!(
        gpu.correct.abs_diff(cpu.correct) <= ties,
        "{label}: {} vs {} correct",
        gpu.correct,
        cpu.correct
    );
}

#[test]
fn gradients_match_the_cpu_backend() {
    let Some(mut gpu) = gpu() else {
        return;
    };
    println!("device {}: {}", gpu.ordinal(), gpu.device_name());
    // Odd sizes, a single row, no hidden layer, sizes past cuBLAS tiles and PIECE-sized
    // tensors (1024 x 1024 = PIECE), one backend throughout so buffers are rebuilt and reused.
    let cases: [(&[usize], usize); 8] = [
        (&[784, 256, 128, 10], 64),
        (&[784, 256, 128, 10], 1),
        (&[33, 70, 17, 5], 7),
        (&[12, 10], 5),
        (&[600, 513, 300, 10], 129),
        (&[784, 1024, 1024, 10], 256),
        (&[784, 1100, 10], 100),
        (&[784, 256, 128, 10], 50),
    ];
    for (i, (layers, rows)) in cases.into_iter().enumerate() {
        compare_step(&mut gpu, &random_case(layers, rows, 100 + i as u64));
    }
}

#[test]
fn repeated_steps_overwrite_gradients() {
    let Some(mut gpu) = gpu() else {
        return;
    };
    let a = random_case(&[50, 40, 30, 6], 33, 1);
    let b = random_case(&[50, 40, 30, 6], 12, 2);
    let Case { mlp, params, x, y } = &a;
    let mut first = vec![0.0; mlp.param_count()];
    gpu.forward_backward(mlp, params, x, y, &mut first)
        .expect("step");
    let mut other = vec![0.0; mlp.param_count()];
    gpu.forward_backward(&b.mlp, &b.params, &b.x, &b.y, &mut other)
        .expect("step");
    let mut again = vec![f32::NAN; mlp.param_count()];
    gpu.forward_backward(mlp, params, x, y, &mut again)
        .expect("step");
    assert_eq!(first, again, "a step must not depend on the one before");
}

#[test]
fn evaluation_matches_the_cpu_backend() {
    let Some(mut gpu) = gpu() else {
        return;
    };
    // 4,321 rows span several evaluation chunks, the last one partial.
    let case = random_case(&[784, 256, 128, 10], 4321, 7);
    let cpu = CpuBackend::new()
        .evaluate(&case.mlp, &case.params, &case.x, &case.y)
        .expect("cpu");
    let got = gpu
        .evaluate(&case.mlp, &case.params, &case.x, &case.y)
        .expect("gpu");
    check_stats("evaluate 4321", &got, &cpu);
    let empty = gpu
        .evaluate(&case.mlp, &case.params, &[], &[])
        .expect("empty");
    assert_eq!(empty, StepStats::default());
}

#[test]
fn bad_shapes_are_the_same_errors_as_on_the_cpu() {
    let Some(mut gpu) = gpu() else {
        return;
    };
    let Case { mlp, params, x, y } = random_case(&[5, 4, 3], 4, 3);
    let n = mlp.param_count();
    let mut g = vec![0.0; n];
    let e = gpu.forward_backward(&mlp, &params[1..], &x, &y, &mut g);
    assert_eq!(
        e,
        Err(BackendError::ParamsLen {
            expected: n,
            actual: n - 1
        })
    );
    let e = gpu.forward_backward(&mlp, &params, &x, &y, &mut g[1..]);
    assert!(matches!(e, Err(BackendError::GradsLen { .. })), "{e:?}");
    let e = gpu.forward_backward(&mlp, &params, &[], &[], &mut g);
    assert_eq!(e, Err(BackendError::EmptyBatch));
    let e = gpu.forward_backward(&mlp, &params, &x, &[0, 1, 3, 2], &mut g);
    assert!(
        matches!(e, Err(BackendError::LabelOutOfRange { index: 2, .. })),
        "{e:?}"
    );
    assert!(gpu.forward_backward(&mlp, &params, &x, &y, &mut g).is_ok());
}

/// The helpers above run without a GPU too: drawn rows keep clear of the ReLU kink, and the
/// error measure is zero for equal tensors and scales with the reference.
#[test]
fn cases_keep_clear_of_relu_kinks_and_errors_are_relative() {
    let layers = [784, 256, 128, 10];
    let case = random_case(&layers, 64, 9);
    assert_eq!(case.x.len(), 64 * 784);
    assert_eq!(case.params.len(), case.mlp.param_count());
    for row in case.x.chunks_exact(784) {
        assert!(min_hidden_preactivation(&layers, &case.params, row) >= KINK_MARGIN);
    }
    assert!(case.y.iter().all(|&l| l < 10));
    assert_eq!(rel_errors(&[1.0, -2.0], &[1.0, -2.0]), (0.0, 0.0));
    let (max_rel, norm_rel) = rel_errors(&[1.0, -2.0, 4.0], &[1.0, -2.0, 4.004]);
    assert!((max_rel - 1e-3).abs() < 1e-6, "{max_rel}");
    assert!(norm_rel > 0.0 && norm_rel < max_rel);
    // Without a GPU the CPU backend still runs the case, so the shapes are right.
    let mut grads = vec![0.0; case.mlp.param_count()];
    let stats = CpuBackend::new()
        .forward_backward(&case.mlp, &case.params, &case.x, &case.y, &mut grads)
        .expect("cpu step");
    assert_eq!(stats.samples, 64);
}

/// The `edl-worker` binary: beside this test when the GPU check copied both into one folder
/// (possibly on another machine, at another path), else where cargo built it.
fn worker_exe() -> std::path::PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|t| t.parent().map(|d| d.join("edl-worker")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_edl-worker").into())
}

fn worker(args: &[&str]) -> (bool, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(worker_exe())
        .args(args)
        .arg("--state-dir")
        .arg(dir.path())
        .arg("--data-dir")
        .arg(dir.path().join("no-data"))
        .env_remove("EDL_DEVICE")
        .output()
        .expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn without_a_gpu_cuda_is_refused_and_auto_falls_back() {
    let reason = match cuda::probe(0) {
        Ok(_) => {
            println!("skipped: a CUDA device is present");
            return;
        }
        Err(e) => e.to_string(),
    };
    let (ok, err) = worker(&["--device", "cuda"]);
    assert!(!ok, "--device cuda must fail without a GPU");
    assert!(
        err.contains("cannot use --device cuda:0") && err.contains(&reason),
        "{err}"
    );
    // Auto falls back, says so, and gets as far as the (missing) dataset.
    let (ok, err) = worker(&["--device", "auto"]);
    assert!(!ok);
    assert!(err.contains("falling back to the CPU backend"), "{err}");
    assert!(
        err.contains("--data-dir") && err.contains("not found"),
        "{err}"
    );
}

#[test]
fn the_device_flag_is_documented_and_checked() {
    let out = Command::new(worker_exe())
        .arg("--help")
        .output()
        .expect("runs");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--device") && help.contains("cuda:N"),
        "{help}"
    );
    let (ok, err) = worker(&["--device", "gpu"]);
    assert!(!ok);
    assert!(err.contains("expected auto, cpu, cuda or cuda:N"), "{err}");
}
