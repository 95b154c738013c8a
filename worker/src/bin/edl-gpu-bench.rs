//! `edl-gpu-bench`: times one training step of an MLP on the CPU and the CUDA backend against a
//! plain cuBLAS SGEMM of the same products, and writes synthetic idx data for GPU checks on
//! machines without Fashion-MNIST. Used by `deploy/gpu/check.sh`.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use edl_worker::backend::cuda::{self, CudaBackend};
use edl_worker::backend::{Backend, CpuBackend, step_gemm_flops};
use edl_worker::data::{IDX1_MAGIC, IDX3_MAGIC};
use edl_worker::model::Mlp;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// GPU benchmark and check helpers for EDL workers.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Time a training step (forward + backward, parameters up and gradients down) on the CPU
    /// and on a GPU, and the plain cuBLAS SGEMMs of the same shapes. Prints one line on stdout:
    /// JSON, or a markdown table row with --markdown.
    Step(StepArgs),
    /// Print the header of the markdown table that `step --markdown` rows belong to.
    Header,
    /// Write a learnable synthetic dataset in the Fashion-MNIST idx format (28x28 images, 10
    /// classes; raw, not gzipped) to DIR.
    SynthData {
        /// Output directory.
        dir: PathBuf,
        /// Training images.
        #[arg(long, default_value_t = 60_000)]
        train: u32,
        /// Test images.
        #[arg(long, default_value_t = 10_000)]
        test: u32,
    },
}

#[derive(clap::Args, Debug)]
struct StepArgs {
    /// Name of the model in the output, e.g. small or large.
    #[arg(long, default_value = "mlp")]
    label: String,
    /// MLP layer widths, input to classes.
    #[arg(long, value_delimiter = ',', default_value = "784,256,128,10")]
    layers: Vec<usize>,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// The CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Timed CPU steps (0 skips the CPU).
    #[arg(long, default_value_t = 20)]
    cpu_steps: u32,
    /// Timed GPU steps (and SGEMM repetitions).
    #[arg(long, default_value_t = 50)]
    gpu_steps: u32,
    /// Fail instead of reporting the GPU as unavailable.
    #[arg(long)]
    require_gpu: bool,
    /// Print a markdown table row instead of JSON.
    #[arg(long)]
    markdown: bool,
}

/// Columns of the markdown table.
const HEADER: &str = "| model | batch | GFLOP/step | CPU ms/step | CPU TFLOP/s | GPU ms/step | \
GPU TFLOP/s | SGEMM ms | SGEMM TFLOP/s | step / SGEMM | copy ms |\n\
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Step(args) => step(&args),
        Cmd::Header => {
            println!("{HEADER}");
            Ok(())
        }
        Cmd::SynthData { dir, train, test } => synth_data(&dir, train, test),
    }
}

/// Mean time per call of `f` over `n` calls, after one untimed call.
fn time<F: FnMut() -> anyhow::Result<()>>(n: u32, mut f: F) -> anyhow::Result<Duration> {
    f()?;
    let start = Instant::now();
    for _ in 0..n {
        f()?;
    }
    Ok(start.elapsed() / n.max(1))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn tflops(flops: f64, d: Duration) -> f64 {
    flops / d.as_secs_f64() / 1e12
}

fn step(a: &StepArgs) -> anyhow::Result<()> {
    let mlp = Mlp::new(a.layers.clone()).context("--layers")?;
    if a.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let mut rng = StdRng::seed_from_u64(1);
    let params = mlp.init_params(1);
    let x: Vec<f32> = (0..a.batch * mlp.input_dim())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let y: Vec<u8> = (0..a.batch)
        .map(|_| rng.random_range(0..mlp.classes()) as u8)
        .collect();
    let mut grads = vec![0f32; mlp.param_count()];
    let flops = step_gemm_flops(&mlp, a.batch);
    eprintln!(
        "{} {:?} batch {}: {} parameters, {:.2} GFLOP of GEMMs per step",
        a.label,
        mlp.layers(),
        a.batch,
        mlp.param_count(),
        flops / 1e9
    );

    let cpu = if a.cpu_steps > 0 {
        let mut b = CpuBackend::new();
        let t = time(a.cpu_steps, || {
            b.forward_backward(&mlp, &params, &x, &y, &mut grads)?;
            Ok(())
        })?;
        eprintln!(
            "  cpu:   {:9.3} ms/step  {:7.3} TFLOP/s",
            ms(t),
            tflops(flops, t)
        );
        Some(t)
    } else {
        None
    };

    let gpu = match CudaBackend::new(a.gpu) {
        Ok(mut b) => {
            eprintln!("  device {}: {}", b.ordinal(), b.device_name());
            // A few untimed steps settle allocations, the JIT and cuBLAS's heuristics.
            for _ in 0..3 {
                b.forward_backward(&mlp, &params, &x, &y, &mut grads)?;
            }
            let step = time(a.gpu_steps, || {
                b.forward_backward(&mlp, &params, &x, &y, &mut grads)?;
                Ok(())
            })?;
            let sgemm = b.time_step_gemms(&mlp, a.batch, a.gpu_steps)?;
            let copy = b.time_round_trip(mlp.param_count(), 10)?;
            eprintln!(
                "  gpu:   {:9.3} ms/step  {:7.3} TFLOP/s",
                ms(step),
                tflops(flops, step)
            );
            eprintln!(
                "  sgemm: {:9.3} ms       {:7.3} TFLOP/s (same products, no kernels or transfers)",
                ms(sgemm),
                tflops(flops, sgemm)
            );
            eprintln!(
                "  copy:  {:9.3} ms       parameters up and gradients down, pinned, not overlapped",
                ms(copy)
            );
            Some((step, sgemm, copy))
        }
        Err(e) if a.require_gpu => return Err(e).context("--require-gpu"),
        Err(e) if e.is_unavailable() => {
            eprintln!("  gpu:   unavailable: {e}");
            None
        }
        Err(e) => return Err(e).context("starting the CUDA backend"),
    };

    let cell = |v: Option<f64>, digits: usize| match v {
        Some(v) => format!("{v:.digits$}"),
        None => "-".into(),
    };
    let cpu_ms = cpu.map(ms);
    let cpu_tf = cpu.map(|t| tflops(flops, t));
    let gpu_ms = gpu.map(|g| ms(g.0));
    let gpu_tf = gpu.map(|g| tflops(flops, g.0));
    let sgemm_ms = gpu.map(|g| ms(g.1));
    let sgemm_tf = gpu.map(|g| tflops(flops, g.1));
    let ratio = gpu.map(|g| g.0.as_secs_f64() / g.1.as_secs_f64());
    let copy_ms = gpu.map(|g| ms(g.2));
    if a.markdown {
        println!(
            "| {} {:?} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} |",
            a.label,
            mlp.layers(),
            a.batch,
            flops / 1e9,
            cell(cpu_ms, 2),
            cell(cpu_tf, 3),
            cell(gpu_ms, 3),
            cell(gpu_tf, 2),
            cell(sgemm_ms, 3),
            cell(sgemm_tf, 2),
            cell(ratio, 2),
            cell(copy_ms, 3),
        );
    } else {
        let line = serde_json::json!({
            "label": a.label,
            "layers": mlp.layers(),
            "batch": a.batch,
            "gflop_per_step": flops / 1e9,
            "cpu_ms": cpu_ms,
            "cpu_tflops": cpu_tf,
            "gpu_ms": gpu_ms,
            "gpu_tflops": gpu_tf,
            "sgemm_ms": sgemm_ms,
            "sgemm_tflops": sgemm_tf,
            "step_over_sgemm": ratio,
            "copy_ms": copy_ms,
            "gpu_unavailable": cuda::probe(a.gpu).err().map(|e| e.to_string()),
        });
        println!("{line}");
    }
    Ok(())
}

/// Writes `n` images of class-dependent noise around ten fixed random templates, and their
/// labels, as idx files `<prefix>-images-idx3-ubyte` and `<prefix>-labels-idx1-ubyte`.
fn write_split(
    dir: &Path,
    prefix: &str,
    n: u32,
    templates: &[Vec<u8>],
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let side = 28u32;
    let mut images = Vec::with_capacity(16 + (n * side * side) as usize);
    images.extend_from_slice(&IDX3_MAGIC.to_be_bytes());
    images.extend_from_slice(&n.to_be_bytes());
    images.extend_from_slice(&side.to_be_bytes());
    images.extend_from_slice(&side.to_be_bytes());
    let mut labels = Vec::with_capacity(8 + n as usize);
    labels.extend_from_slice(&IDX1_MAGIC.to_be_bytes());
    labels.extend_from_slice(&n.to_be_bytes());
    for _ in 0..n {
        let label = rng.random_range(0..templates.len());
        labels.push(label as u8);
        images.extend(templates[label].iter().map(|&t| {
            let noisy = i32::from(t) + rng.random_range(-90..=90);
            noisy.clamp(0, 255) as u8
        }));
    }
    for (name, bytes) in [
        (format!("{prefix}-images-idx3-ubyte"), images),
        (format!("{prefix}-labels-idx1-ubyte"), labels),
    ] {
        let path = dir.join(name);
        fs::File::create(&path)
            .and_then(|mut f| f.write_all(&bytes))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn synth_data(dir: &Path, train: u32, test: u32) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut rng = StdRng::seed_from_u64(42);
    let templates: Vec<Vec<u8>> = (0..10)
        .map(|_| (0..28 * 28).map(|_| rng.random_range(0..=255u8)).collect())
        .collect();
    write_split(dir, "train", train, &templates, &mut rng)?;
    write_split(dir, "t10k", test, &templates, &mut rng)?;
    eprintln!(
        "wrote {train} training and {test} test images to {}",
        dir.display()
    );
    Ok(())
}
