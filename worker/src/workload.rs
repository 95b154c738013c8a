//! The seams between the trainer and what it trains: a [`Dataset`] serves samples by index, a
//! [`Model`] computes a step's gradient from parameters it pulls densely (the whole flat
//! vector) or sparsely (the rows its batch touches). The built-in pairs are the MLP on an idx
//! image set ([`MlpModel`] on [`ImageSet`]) and logistic regression on LIBSVM rows
//! ([`crate::logreg::LogReg`] on [`SparseSet`]); the compute device is the [`Backend`] beneath a
//! model.

use std::path::Path;

use edl_client::JobSpec;
use edl_shared::libsvm::{LibSvmError, SparseData};

use crate::backend::{Backend, BackendError, StepStats};
use crate::data::{DataError, ImageSet};
use crate::model::Mlp;

/// Samples addressed by index: what a batch's indices point into.
pub trait Dataset: Send + Sync {
    /// A gathered mini-batch (reused from step to step).
    type Batch: Default + Send;

    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the samples at `indices` into `out`, replacing its contents; an index out of
    /// range is an error and leaves `out` unchanged.
    fn gather(&self, indices: &[u32], out: &mut Self::Batch) -> Result<(), DataError>;
}

/// Some rows of one tensor and their values (parameters pulled, or gradients to push).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TensorRows {
    /// The tensor's name.
    pub tensor: String,
    /// The rows, sorted, without repeats.
    pub rows: Vec<u32>,
    /// `rows.len()` rows of the tensor's row length.
    pub values: Vec<f32>,
}

/// The parameters a step computes from.
#[derive(Clone, Copy, Debug)]
pub enum Params<'a> {
    /// The whole flat vector.
    Dense(&'a [f32]),
    /// The rows the batch touches ([`Model::touched`]), with their values.
    Rows(&'a [TensorRows]),
}

/// Where a step writes its gradient: the same form as its [`Params`].
#[derive(Debug)]
pub enum Grads<'a> {
    /// The whole flat vector (overwritten).
    Dense(&'a mut [f32]),
    /// The same rows as the parameters (values overwritten).
    Rows(&'a mut [TensorRows]),
}

/// A model the trainer can train: it checks itself against the job, says which parameters a
/// batch needs, and computes a step's gradient (the mean over the batch) and statistics.
pub trait Model: Send {
    /// The data it trains on.
    type Data: Dataset;

    /// Checks the job's tensors and the data against the model; the error says what differs.
    fn check(&self, spec: &JobSpec, data: &Self::Data) -> Result<(), String>;

    /// For a sparse model, the rows of each tensor `batch` reads and writes (values empty);
    /// `None` for a dense model, which pulls the whole flat vector.
    fn touched(&self, _batch: &<Self::Data as Dataset>::Batch) -> Option<Vec<TensorRows>> {
        None
    }

    /// Runs one step before the worker joins, so that its first real step is not slow (for a
    /// GPU: context, kernels, buffers). The default does nothing.
    fn warm_up(&mut self, _spec: &JobSpec, _data: &Self::Data) -> Result<(), BackendError> {
        Ok(())
    }

    /// Forward and backward over `batch`.
    fn step(
        &mut self,
        params: Params<'_>,
        batch: &<Self::Data as Dataset>::Batch,
        grads: Grads<'_>,
    ) -> Result<StepStats, BackendError>;

    /// Loss and accuracy of the whole flat parameter vector `params` on `data`.
    fn evaluate(&mut self, params: &[f32], data: &Self::Data) -> Result<StepStats, BackendError>;
}

/// A gathered batch of images: `x` row-major, one label per row in `y`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImageBatch {
    /// Inputs, `rows * dim` values.
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<u8>,
}

impl Dataset for ImageSet {
    type Batch = ImageBatch;

    fn len(&self) -> usize {
        ImageSet::len(self)
    }

    fn gather(&self, indices: &[u32], out: &mut ImageBatch) -> Result<(), DataError> {
        ImageSet::gather(self, indices, &mut out.x, &mut out.y)
    }
}

/// The MLP, computed on a [`Backend`].
pub struct MlpModel<'b> {
    mlp: Mlp,
    backend: &'b mut dyn Backend,
}

impl std::fmt::Debug for MlpModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlpModel")
            .field("layers", &self.mlp.layers())
            .field("backend", &self.backend.name())
            .finish()
    }
}

impl<'b> MlpModel<'b> {
    /// The MLP `mlp` on `backend`.
    pub fn new(mlp: Mlp, backend: &'b mut dyn Backend) -> Self {
        MlpModel { mlp, backend }
    }

    /// The network.
    pub fn mlp(&self) -> &Mlp {
        &self.mlp
    }
}

impl Model for MlpModel<'_> {
    type Data = ImageSet;

    fn check(&self, spec: &JobSpec, data: &ImageSet) -> Result<(), String> {
        let want: Vec<(String, Vec<u32>)> = self
            .mlp
            .tensors()
            .into_iter()
            .map(|t| (t.name, t.shape.iter().map(|&d| d as u32).collect()))
            .collect();
        let have: Vec<(String, Vec<u32>)> = spec
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        if want != have {
            return Err(format!(
                "the job's tensors {have:?} are not those of an MLP {:?}",
                self.mlp.layers()
            ));
        }
        if data.dim() != self.mlp.input_dim() || data.classes() > self.mlp.classes() {
            return Err(format!(
                "dataset has {} inputs and {} classes, model expects {} and {}",
                data.dim(),
                data.classes(),
                self.mlp.input_dim(),
                self.mlp.classes()
            ));
        }
        Ok(())
    }

    fn warm_up(&mut self, spec: &JobSpec, data: &ImageSet) -> Result<(), BackendError> {
        let n = data.len().min(64) as u32;
        let mut batch = ImageBatch::default();
        if n == 0 || Dataset::gather(data, &(0..n).collect::<Vec<_>>(), &mut batch).is_err() {
            return Ok(());
        }
        let params = vec![0f32; spec.param_count()];
        let mut grads = vec![0f32; spec.param_count()];
        self.backend
            .forward_backward(&self.mlp, &params, &batch.x, &batch.y, &mut grads)
            .map(|_| ())
    }

    fn step(
        &mut self,
        params: Params<'_>,
        batch: &ImageBatch,
        grads: Grads<'_>,
    ) -> Result<StepStats, BackendError> {
        match (params, grads) {
            (Params::Dense(p), Grads::Dense(g)) => self
                .backend
                .forward_backward(&self.mlp, p, &batch.x, &batch.y, g),
            _ => Err(BackendError::Device(
                "the MLP is dense: it takes the whole parameter vector".into(),
            )),
        }
    }

    fn evaluate(&mut self, params: &[f32], data: &ImageSet) -> Result<StepStats, BackendError> {
        self.backend
            .evaluate(&self.mlp, params, data.images(), data.labels())
    }
}

/// Sparse labelled rows (LIBSVM), as a [`Dataset`].
#[derive(Clone, Debug, PartialEq)]
pub struct SparseSet {
    data: SparseData,
}

/// A gathered batch of sparse rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseBatch {
    /// Row `i`'s features are `indices[offsets[i]..offsets[i + 1]]`.
    pub offsets: Vec<usize>,
    /// Feature indices (0-based).
    pub indices: Vec<u32>,
    /// Feature values.
    pub values: Vec<f32>,
    /// True for a positive label.
    pub positive: Vec<bool>,
}

impl SparseBatch {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.positive.len()
    }

    /// True when the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.positive.is_empty()
    }

    /// Row `i`'s features and values.
    pub fn row(&self, i: usize) -> (&[u32], &[f32]) {
        let (a, b) = (self.offsets[i], self.offsets[i + 1]);
        (&self.indices[a..b], &self.values[a..b])
    }
}

impl SparseSet {
    /// Loads a LIBSVM file.
    pub fn load(path: &Path) -> Result<SparseSet, LibSvmError> {
        Ok(SparseSet {
            data: SparseData::load(path)?,
        })
    }

    /// The data set held.
    pub fn data(&self) -> &SparseData {
        &self.data
    }
}

impl From<SparseData> for SparseSet {
    fn from(data: SparseData) -> Self {
        SparseSet { data }
    }
}

impl Dataset for SparseSet {
    type Batch = SparseBatch;

    fn len(&self) -> usize {
        self.data.len()
    }

    fn gather(&self, indices: &[u32], out: &mut SparseBatch) -> Result<(), DataError> {
        let len = self.data.len();
        if let Some(&index) = indices.iter().find(|&&i| i as usize >= len) {
            return Err(DataError::IndexOutOfRange { index, len });
        }
        out.offsets.clear();
        out.indices.clear();
        out.values.clear();
        out.positive.clear();
        out.offsets.push(0);
        for &i in indices {
            let (idx, val) = self.data.row(i as usize);
            out.indices.extend_from_slice(idx);
            out.values.extend_from_slice(val);
            out.offsets.push(out.indices.len());
            out.positive.push(self.data.positive(i as usize));
        }
        Ok(())
    }
}
