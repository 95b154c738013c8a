//! Bring your own model: a two-layer network, defined here, trained on Fashion-MNIST with the
//! client API. The job (`deploy/jobs/two-layer.toml`) holds `fc1.weight` [784, H], `fc1.bias`
//! [H], `fc2.weight` [H, 10] and `fc2.bias` [10], found by name, and its `[worker]` table runs
//! this program. As a job of its own, or beside others on the scheduler:
//!
//!     cargo build --release -p edl-worker --example two_layer
//!     edl-local --job deploy/jobs/two-layer.toml --workers 2
//!     edlctl job submit deploy/jobs/two-layer.toml --workers 2
//!
//! It speaks the process contract (`edl_shared::contract`): a placer gives it the coordinator,
//! its certificate and its placement in `EDL_*` variables, and SIGTERM drains it. By hand,
//! against a coordinator and shard started with `edl-ps`:
//!
//!     EDL_COORDINATOR=127.0.0.1:7070 EDL_STATE_DIR=edl-state EDL_NAME=w1 \
//!         target/release/examples/two_layer

use std::time::Duration;

use edl_shared::proto::Clock;
use edl_worker::client::{Batch, ClientConfig, ClientError, Job, TensorView};
use edl_worker::data::{DEFAULT_DATA_DIR, ImageSet};

/// `y += a * x`, over the shorter of the two.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// The network: `softmax(relu(x W1 + b1) W2 + b2)` with cross-entropy loss.
pub struct TwoLayer {
    w1: TensorView,
    b1: TensorView,
    w2: TensorView,
    b2: TensorView,
}

impl TwoLayer {
    /// Finds the model's tensors in the job.
    pub fn of(job: &Job) -> Result<TwoLayer, ClientError> {
        let s = job.spec();
        Ok(TwoLayer {
            w1: s.require("fc1.weight")?.clone(),
            b1: s.require("fc1.bias")?.clone(),
            w2: s.require("fc2.weight")?.clone(),
            b2: s.require("fc2.bias")?.clone(),
        })
    }

    /// Adds the mean gradient over the samples `x` (rows of 784) with labels `y` to `g` (flat,
    /// zeroed by the caller), and returns (loss sum, correct predictions).
    pub fn step(&self, p: &[f32], x: &[f32], y: &[u8], g: Option<&mut [f32]>) -> (f64, usize) {
        let (d, h, c) = (self.w1.shape[0] as usize, self.w1.shape[1] as usize, 10);
        let (w1, b1, w2, b2) = (self.w1.of(p), self.b1.of(p), self.w2.of(p), self.b2.of(p));
        let n = y.len();
        let (mut loss, mut correct) = (0.0, 0);
        let mut grads = g;
        for (xi, &yi) in x.chunks(d).zip(y) {
            let mut hid: Vec<f32> = b1.to_vec();
            xi.iter()
                .enumerate()
                .for_each(|(k, &v)| axpy(&mut hid, v, &w1[k * h..]));
            hid.iter_mut().for_each(|v| *v = v.max(0.0));
            let mut out: Vec<f32> = b2.to_vec();
            hid.iter()
                .enumerate()
                .for_each(|(j, &a)| axpy(&mut out, a, &w2[j * c..]));
            let max = out.iter().copied().fold(f32::MIN, f32::max);
            let z: f32 = out.iter().map(|v| (v - max).exp()).sum();
            let prob: Vec<f32> = out.iter().map(|v| (v - max).exp() / z).collect();
            let yi = yi as usize;
            loss -= f64::from(prob[yi].max(1e-12).ln());
            let best = prob.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
            correct += usize::from(best.map(|b| b.0) == Some(yi));
            let Some(g) = grads.as_deref_mut() else {
                continue;
            };
            // Backward: dL/dout = prob - onehot(y), averaged over the batch.
            let mut dout = prob;
            dout[yi] -= 1.0;
            dout.iter_mut().for_each(|v| *v /= n as f32);
            let mut dhid = vec![0f32; h];
            for (j, &a) in hid.iter().enumerate().filter(|(_, a)| **a > 0.0) {
                axpy(&mut g[self.w2.offset + j * c..][..c], a, &dout);
                dhid[j] = w2[j * c..(j + 1) * c]
                    .iter()
                    .zip(&dout)
                    .map(|(w, d)| w * d)
                    .sum();
            }
            axpy(self.b2.of_mut(g), 1.0, &dout);
            axpy(self.b1.of_mut(g), 1.0, &dhid);
            for (k, &v) in xi.iter().enumerate() {
                axpy(&mut g[self.w1.offset + k * h..][..h], v, &dhid);
            }
        }
        (loss, correct)
    }
}

/// Joins `job` and trains until its data is done or a drain (a SIGTERM too, with `signals`),
/// then leaves; returns the steps taken. `seen` sees each batch first (a test logs them).
pub async fn train(
    job: Job,
    data: &ImageSet,
    signals: bool,
    mut seen: impl FnMut(&Batch) -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let model = TwoLayer::of(&job)?;
    let mut params = vec![0f32; job.spec().param_count()];
    let (mut grads, mut x, mut y) = (params.clone(), Vec::new(), Vec::new());
    let mut session = job.join().await?; // stop-free: admitted once prepared
    if signals {
        session.leave_on_signals(Duration::from_secs(30))?;
    }
    let mut steps = 0;
    while let Some(batch) = session.next_batch().await? {
        seen(&batch)?;
        session.pull(&mut params).await?;
        data.gather(batch.indices(), &mut x, &mut y)?;
        grads.iter_mut().for_each(|g| *g = 0.0);
        let (loss, _) = model.step(&params, &x, &y, Some(&mut grads));
        session.push(&batch, &grads).await?;
        session.commit(batch, loss).await?;
        steps += 1;
        if session.drain_requested() {
            break;
        }
    }
    session.leave().await?;
    Ok(steps)
}

/// Test accuracy of the job's current parameters.
pub async fn accuracy(cfg: &ClientConfig, test: &ImageSet) -> anyhow::Result<f64> {
    let job = Job::connect(cfg).await?;
    let mut params = vec![0f32; job.spec().param_count()];
    job.pull_all(&mut params, Clock(u64::MAX)).await?;
    let (_, correct) = TwoLayer::of(&job)?.step(&params, test.images(), test.labels(), None);
    Ok(correct as f64 / test.len() as f64)
}

/// Trains as a placer started it; the training data is the job's `[data]` (Fashion-MNIST's
/// default place without one).
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let job = Job::from_env().await?;
    let train_data = match &job.config().data {
        Some(d) => std::path::PathBuf::from(&d.train),
        None => std::path::Path::new(DEFAULT_DATA_DIR).join("train"),
    };
    let test_data = job.config().data.as_ref().map(|d| d.test.clone());
    let steps = train(job, &ImageSet::load_prefix(&train_data)?, true, |_| Ok(())).await?;
    eprintln!("{steps} steps");
    // Report how the job's parameters do on its test data (the last worker's report, made
    // when the job has finished, is of the final model).
    if let Some(test) = test_data.filter(|t| !t.is_empty()) {
        let env = edl_shared::contract::WorkerEnv::from_env()?;
        let job = Job::connect(&ClientConfig::from_contract(&env)?).await?;
        let test = ImageSet::load_prefix(std::path::Path::new(&test))?;
        let mut params = vec![0f32; job.spec().param_count()];
        let status = job.pull_current(&mut params).await?;
        let (loss, correct) = TwoLayer::of(&job)?.step(&params, test.images(), test.labels(), None);
        let n = test.len() as f64;
        job.report_evaluation(
            status.min_clock,
            correct as f64 / n,
            loss / n,
            test.len() as u64,
        )
        .await?;
        eprintln!("test accuracy {:.4}", correct as f64 / n);
    }
    Ok(())
}
