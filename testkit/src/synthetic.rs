//! Synthetic compute for tests of what depends on timing (stragglers, profiling): a model
//! whose step takes a set time, optionally holding one of a limited number of compute units
//! (so that throughput stops growing at a known worker count), trained by the real trainer
//! in worker threads of their own; and an in-process placer that starts such a worker for
//! each placement the coordinator makes.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use edl_ps::admin::Admin;
use edl_shared::proto::{Consistency, Init, JobConfig, ModelSection, OptimizerSpec, TensorSpec};
use edl_shared::shutdown::CancellationToken;
use edl_worker::backend::{BackendError, StepStats};
use edl_worker::client::JobSpec;
use edl_worker::data::DataError;
use edl_worker::trainer::{self, Slowdown, TrainOptions, TrainSummary};
use edl_worker::workload::{Dataset, Grads, Model, Params};
use edl_worker::{ClientConfig, Job};

use crate::TestCluster;

/// Parameters of a synthetic job.
pub const SYNTHETIC_FLOATS: u32 = 64;

/// A job of one 64-float tensor with a custom model, `samples` per epoch in batches of 8.
pub fn synthetic_job(samples: u32, epochs: u32, consistency: Consistency) -> JobConfig {
    JobConfig {
        model: ModelSection::custom(),
        tensors: vec![TensorSpec {
            name: "w".into(),
            shape: vec![SYNTHETIC_FLOATS],
            init: Init::Zeros,
        }],
        chunk_size: 32,
        optimizer: OptimizerSpec::sgd(0.01),
        optimizer_groups: Vec::new(),
        schedule: Default::default(),
        consistency,
        batch_size: 8,
        epochs,
        partition_size: 256,
        train_samples: samples,
        seed: 3,
        lease_ms: 3000,
        replicas: 1,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data: None,
    }
}

/// Sample indices, nothing else: what a synthetic batch is.
#[derive(Clone, Debug)]
pub struct Indices(pub usize);

impl Dataset for Indices {
    type Batch = Vec<u32>;

    fn len(&self) -> usize {
        self.0
    }

    fn gather(&self, indices: &[u32], out: &mut Vec<u32>) -> Result<(), DataError> {
        out.clear();
        out.extend_from_slice(indices);
        Ok(())
    }
}

/// A counting semaphore for threads: `n` compute units (GPUs, say) shared by every worker.
#[derive(Debug)]
pub struct Units {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Units {
    /// `n` units.
    pub fn new(n: usize) -> Arc<Units> {
        Arc::new(Units {
            free: Mutex::new(n),
            freed: Condvar::new(),
        })
    }

    fn hold(&self, d: Duration) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
        drop(free);
        std::thread::sleep(d);
        *self.free.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.freed.notify_one();
    }
}

/// A model whose step takes `step` (holding a unit of `units`, if given) and pushes a small
/// constant gradient.
#[derive(Clone, Debug)]
pub struct SleepModel {
    /// The time a step computes.
    pub step: Duration,
    /// Compute units a step must hold.
    pub units: Option<Arc<Units>>,
}

impl Model for SleepModel {
    type Data = Indices;

    fn check(&self, spec: &JobSpec, _data: &Indices) -> Result<(), String> {
        if spec.param_count() != SYNTHETIC_FLOATS as usize {
            return Err(format!("expected {SYNTHETIC_FLOATS} parameters"));
        }
        Ok(())
    }

    fn step(
        &mut self,
        _params: Params<'_>,
        batch: &Vec<u32>,
        grads: Grads<'_>,
    ) -> Result<StepStats, BackendError> {
        match &self.units {
            Some(u) => u.hold(self.step),
            None => std::thread::sleep(self.step),
        }
        if let Grads::Dense(g) = grads {
            g.fill(0.001);
        }
        Ok(StepStats {
            loss_sum: 0.5 * batch.len() as f64,
            correct: 0,
            samples: batch.len(),
        })
    }

    fn evaluate(&mut self, _params: &[f32], data: &Indices) -> Result<StepStats, BackendError> {
        Ok(StepStats {
            loss_sum: 0.0,
            correct: 0,
            samples: data.0,
        })
    }
}

/// A synthetic worker in a thread of its own (its step blocks the thread, as a real one
/// blocks on its device): trains `model` until the data runs out, `shutdown`, a drain or a
/// preemption; `placement` is the placement it was started for.
pub fn spawn_worker(
    cfg: ClientConfig,
    placement: Option<u64>,
    mut model: SleepModel,
    samples: usize,
    slowdown: Slowdown,
    shutdown: CancellationToken,
) -> std::thread::JoinHandle<anyhow::Result<TrainSummary>> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let job = Job::connect(&cfg).await?.for_placement(placement);
            let opts = TrainOptions {
                slowdown,
                ..TrainOptions::default()
            };
            Ok(trainer::train(job, &mut model, &Indices(samples), opts, shutdown).await?)
        })
    })
}

/// An in-process placer: polls the coordinator's placements and starts a synthetic worker
/// (named `p<id>`, stopped by `workers`) for each new pending one, until `stop`. Returns the
/// workers started.
pub async fn run_placer(
    cluster: &TestCluster,
    admin: &Admin,
    model: SleepModel,
    samples: usize,
    workers: CancellationToken,
    stop: CancellationToken,
) -> anyhow::Result<Vec<std::thread::JoinHandle<anyhow::Result<TrainSummary>>>> {
    let mut started = Vec::new();
    let mut handles = Vec::new();
    while !stop.is_cancelled() {
        for p in admin.placements().await? {
            if p.is_pending() && !started.contains(&p.id) {
                started.push(p.id);
                let cfg = cluster.client_config(&format!("p{}", p.id))?;
                handles.push(spawn_worker(
                    cfg,
                    Some(p.id),
                    model.clone(),
                    samples,
                    Slowdown::default(),
                    workers.clone(),
                ));
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    Ok(handles)
}
