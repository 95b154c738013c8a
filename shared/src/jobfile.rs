//! Job files: a TOML description of a training job (model, optimizer, consistency, training
//! settings, data) that parses into a validated [`JobConfig`], with errors that name the field
//! and the line.
//!
//! ```toml
//! [model]
//! kind = "mlp"                 # "mlp" | "logreg" | "custom"
//! layers = [784, 256, 128, 10] # mlp only; logreg takes `features = N | "auto"`
//!
//! [optimizer]
//! kind = "adam"                # sgd | momentum | adam | adamw | adagrad | rmsprop | adadelta
//! lr = 0.001                   # and the kind's torch.optim arguments: momentum, dampening,
//!                              # nesterov, weight_decay, beta1, beta2, eps, amsgrad, lr_decay,
//!                              # initial_accumulator_value, alpha, centered, rho
//!
//! [[optimizer.group]]          # PyTorch's parameter groups: these tensors (names, `*`)
//! tensors = ["*.bias"]         # with these settings changed
//! weight_decay = 0.0
//!
//! [schedule]                   # torch.optim.lr_scheduler's, over each group's lr
//! kind = "step"                # constant | step | multistep | exponential | cosine |
//! step_size = 1                # linear | onecycle, with PyTorch's arguments
//! gamma = 0.7
//! by = "epoch"                 # what it counts: "step" (applied updates) or "epoch"
//! scale = "none"               # bsp: "linear" or "sqrt" in the workers an update averages
//!
//! [training]
//! consistency = "ssp:2"        # asp | bsp | ssp:N
//! samples = 60000              # or "auto" (counted in the libsvm training data)
//!
//! [data]
//! format = "idx"               # idx | libsvm
//! train = "/usr/share/datasets/fashion-mnist/train"
//! test = "/usr/share/datasets/fashion-mnist/t10k"
//! ```
//!
//! A `custom` model lists its tensors as `[[tensor]]` tables (`name`, `shape`, `init` and, for
//! some inits, `scale` or `value`), each with a `wire` of its own if it travels unlike the
//! job's `[training] wire`; a built-in model's tensor takes one from a `[[tensor]]` table that
//! holds only its `name` and `wire`. A `[worker]` table says what the job's workers run (see
//! [`WorkerSpec`]; without one they run `edl-worker`), for the placers: [`parse`] and [`load`]
//! give the coordinator's view and skip it, [`parse_file`] and [`load_file`] keep it. Settings left out take the defaults of
//! `edl-ps coordinator`'s flags, so a file and the flags describe the same job. Relative data
//! paths are resolved against the job file's directory.

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};

use edl_models as models;
use edl_proto::schedule::SettingValue;
use edl_proto::{
    Curve, DataFormat, DataSpec, Init, JobConfig, LrSchedule, ModelSection, OptimizerGroup,
    OptimizerSpec, TensorSpec,
};
use serde::Deserialize;
use serde::de::{self, Deserializer, Unexpected, Visitor};
use toml::Spanned;

use crate::libsvm;
use crate::units::human_bytes;

mod spans;
mod worker;

pub use spans::line_of;
pub use worker::{MAX_GPUS, WorkerSpec};

/// The settings a job takes when its file (or `edl-ps coordinator`'s and `edl-local`'s flags,
/// which use these as their defaults) leaves them out.
pub mod defaults {
    use edl_proto::{Consistency, OptimizerSpec};

    /// Adam at learning rate 0.001 (`adam:0.001`).
    pub const OPTIMIZER: OptimizerSpec = OptimizerSpec::Adam {
        lr: 0.001,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        amsgrad: false,
        decoupled: false,
    };
    /// `ssp:2`.
    pub const CONSISTENCY: Consistency = Consistency::Ssp { staleness: 2 };
    /// Samples per mini-batch.
    pub const BATCH_SIZE: u32 = 64;
    /// Passes over the data.
    pub const EPOCHS: u32 = 3;
    /// Training samples per epoch.
    pub const SAMPLES: u32 = 60_000;
    /// Samples per leased partition.
    pub const PARTITION_SIZE: u32 = 1024;
    /// Worker heartbeat lease.
    pub const LEASE_MS: u32 = 3000;
    /// Seed for initialization and the data order.
    pub const SEED: u64 = 1;
    /// Floats per key.
    pub const CHUNK_SIZE: u32 = 16_384;
    /// Copies of every key range (1: none).
    pub const REPLICAS: u32 = 1;
}

/// The most copies of a key range a job may ask for.
pub const MAX_REPLICAS: u32 = 8;

/// A shorter lease would drop healthy workers between two heartbeats.
const MIN_LEASE_MS: u32 = 100;
/// The most floats a job's tensors may hold together (2^31).
const MAX_PARAMETERS: u64 = 1 << 31;

/// A job file that does not describe a valid job; `Display` is the full message.
#[derive(Debug, thiserror::Error)]
pub enum JobFileError {
    /// The job file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The job file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// The file is not valid TOML, has an unknown or ill-typed field, or describes an invalid job.
    #[error("{}{}: {field}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        /// The job file.
        path: PathBuf,
        /// The 1-based line of the offending field, when known.
        line: Option<usize>,
        /// The field's dotted path, e.g. `training.batch_size` or `tensor[1].shape`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// A whole job file: the job the coordinator runs and what its workers run.
#[derive(Clone, Debug, PartialEq)]
pub struct JobFile {
    /// The job (the coordinator's part).
    pub job: JobConfig,
    /// The `[worker]` table (the placers' part); the default runs `edl-worker`.
    pub worker: WorkerSpec,
}

impl JobFile {
    /// Why no placer can start this job's workers, if none can: a custom model whose file
    /// names no `[worker]` program (`edl-worker` trains only the built-in models).
    pub fn unplaceable(&self) -> Option<&'static str> {
        (self.job.model.is_custom() && self.worker.is_builtin()).then_some(
            "the model is custom (defined by the job's own program) and the file names no \
             program for its workers: add a [worker] table with command = [...] (edl-worker \
             trains only the built-in models, mlp and logreg)",
        )
    }

    /// The file as text that [`parse_file`] reads back to an equal [`JobFile`] (see
    /// [`to_toml`]).
    pub fn to_toml(&self) -> String {
        let mut out = to_toml(&self.job);
        // Writing to a String cannot fail.
        let _ = worker::write_worker(&mut out, &self.worker);
        out
    }
}

/// Reads and parses a job file for the coordinator (see [`parse`]).
pub fn load(path: &Path) -> Result<JobConfig, JobFileError> {
    load_file(path).map(|f| f.job)
}

/// Reads and parses a whole job file (see [`parse_file`]).
pub fn load_file(path: &Path) -> Result<JobFile, JobFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| JobFileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_file(&text, path)
}

/// Parses and validates a job file's text for the coordinator: the job, with the `[worker]`
/// table checked but left out (see [`parse_file`]). `path` names the file in messages and
/// anchors relative data paths; the training data is read only for `auto` counts.
pub fn parse(text: &str, path: &Path) -> Result<JobConfig, JobFileError> {
    parse_file(text, path).map(|f| f.job)
}

/// Reads a job file's `[worker]` table alone (the file must be valid TOML with known tables;
/// the job itself is not checked, and no data is read).
pub fn load_worker(path: &Path) -> Result<WorkerSpec, JobFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| JobFileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let cx = Cx { text: &text, path };
    let raw: RawJob = toml::from_str(&text).map_err(|e| cx.toml_error(&e))?;
    cx.worker_of(&raw)
}

/// Parses and validates a whole job file's text: the job and its `[worker]` table.
pub fn parse_file(text: &str, path: &Path) -> Result<JobFile, JobFileError> {
    let cx = Cx { text, path };
    let raw: RawJob = toml::from_str(text).map_err(|e| cx.toml_error(&e))?;
    let worker = cx.worker_of(&raw)?;
    let data = raw.data.as_ref().map(|d| cx.data(d)).transpose()?;
    let mut counts = Counts {
        train: match (&data, &raw.data) {
            (Some(spec), Some(d)) if spec.format == DataFormat::LibSvm => {
                Some((PathBuf::from(&spec.train), d.get_ref().train.span()))
            }
            _ => None,
        },
        shape: None,
    };
    let (model, tensors) = cx.model(&raw, &mut counts)?;
    let (optimizer, optimizer_groups) = cx.optimizer(raw.optimizer.as_ref(), &tensors)?;
    let schedule = raw.schedule.as_ref().map(|s| cx.schedule(s)).transpose()?;
    let mut job = JobConfig {
        model,
        tensors,
        chunk_size: defaults::CHUNK_SIZE,
        optimizer,
        optimizer_groups,
        schedule: Default::default(),
        consistency: defaults::CONSISTENCY,
        batch_size: defaults::BATCH_SIZE,
        epochs: defaults::EPOCHS,
        partition_size: defaults::PARTITION_SIZE,
        train_samples: defaults::SAMPLES,
        seed: defaults::SEED,
        lease_ms: defaults::LEASE_MS,
        replicas: defaults::REPLICAS,
        wire: Default::default(),
        tensor_wires: Vec::new(),
        data,
    };
    if let Some(t) = &raw.training {
        cx.training(t.get_ref(), &mut counts, &mut job)?;
    }
    job.tensor_wires = cx.tensor_wires(&raw, &job.tensors)?;
    if let (Some(schedule), Some(raw)) = (schedule, &raw.schedule) {
        job.schedule = schedule;
        job.check_schedule()
            .map_err(|m| cx.at(raw, "schedule", m))?;
    }
    Ok(JobFile { job, worker })
}

/// Writes a job as a job file that [`parse`] reads back to an equal [`JobConfig`]: a `custom`
/// model lists its tensors, an `mlp` or `logreg` model is written by kind (its tensors are
/// assumed to be the ones the kind builds). Data paths are written as they are; relative ones
/// resolve against the directory of the file they are written to.
pub fn to_toml(job: &JobConfig) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_toml(&mut out, job);
    out
}

/// The resolved job as a human-readable report: the settings, a table of tensors (name, shape,
/// init, offset, floats, keys) and the totals (parameters, bytes at 4 per float, keys).
pub fn describe(job: &JobConfig) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_description(&mut out, job);
    out
}

// ---------------------------------------------------------------------------------------------
// The file as written: every table denies unknown fields, and values keep their spans so that
// semantic errors can name the line.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    model: Spanned<RawModel>,
    optimizer: Option<Spanned<RawOptimizer>>,
    schedule: Option<Spanned<RawSchedule>>,
    training: Option<Spanned<RawTraining>>,
    data: Option<Spanned<RawData>>,
    tensor: Option<Spanned<Vec<Spanned<RawTensor>>>>,
    worker: Option<Spanned<worker::RawWorker>>,
}

/// The `[model]` table: `kind` and the kind's settings, which the model registry reads.
type RawModel = BTreeMap<String, Spanned<toml::Value>>;

/// The `[optimizer]` table: `kind` and torch.optim's arguments of that kind.
type RawOptimizer = BTreeMap<String, Spanned<toml::Value>>;

/// The `[schedule]` table: `kind`, the scheduler's arguments, `by` and `scale`.
type RawSchedule = BTreeMap<String, Spanned<toml::Value>>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTraining {
    consistency: Option<Spanned<String>>,
    batch_size: Option<Spanned<u32>>,
    epochs: Option<Spanned<u32>>,
    samples: Option<Spanned<Count>>,
    partition_size: Option<Spanned<u32>>,
    lease_ms: Option<Spanned<u32>>,
    replicas: Option<Spanned<u32>>,
    wire: Option<Spanned<String>>,
    seed: Option<Spanned<Seed>>,
    chunk_size: Option<Spanned<u32>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawData {
    format: Spanned<String>,
    train: Spanned<String>,
    test: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    name: Spanned<String>,
    shape: Option<Spanned<Vec<Spanned<u32>>>>,
    init: Option<Spanned<String>>,
    scale: Option<Spanned<f32>>,
    value: Option<Spanned<f32>>,
    wire: Option<Spanned<String>>,
}

/// A count given as a number or as `"auto"` (taken from the training data).
enum Count {
    Auto,
    Fixed(u32),
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer or \"auto\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                u32::try_from(v)
                    .map(Count::Fixed)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                u32::try_from(v)
                    .map(Count::Fixed)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Count, E> {
                match v {
                    "auto" => Ok(Count::Auto),
                    _ => Err(E::invalid_value(Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A seed: a TOML integer, or a decimal string for seeds above `i64::MAX` (TOML integers are
/// signed 64-bit).
struct Seed(u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer (or a decimal string above 2^63)")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                u64::try_from(v)
                    .map(Seed)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seed, E> {
                v.parse()
                    .map(Seed)
                    .map_err(|_| E::invalid_value(Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// The training data's shape, scanned at most once and only when a count is `auto`.
struct Counts {
    /// The LIBSVM training file and the span of `data.train`; `None` without libsvm data.
    train: Option<(PathBuf, Range<usize>)>,
    shape: Option<libsvm::Shape>,
}

impl Counts {
    fn shape<T>(
        &mut self,
        cx: &Cx<'_>,
        at: &Spanned<T>,
        field: &str,
    ) -> Result<libsvm::Shape, JobFileError> {
        self.shape_at(cx, at.span(), field)
    }

    fn shape_at(
        &mut self,
        cx: &Cx<'_>,
        at: Range<usize>,
        field: &str,
    ) -> Result<libsvm::Shape, JobFileError> {
        if let Some(shape) = self.shape {
            return Ok(shape);
        }
        let Some((train, span)) = &self.train else {
            return Err(cx.err(
                at,
                field,
                "\"auto\" needs libsvm training data to count: add [data] with format = \"libsvm\"",
            ));
        };
        let shape = libsvm::scan(train).map_err(|e| {
            cx.err(
                span.clone(),
                "data.train",
                format!("cannot count the training data for {field} = \"auto\": {e}"),
            )
        })?;
        self.shape = Some(shape);
        Ok(shape)
    }
}

/// The training data as a built-in model sizes itself from it; the job file's own error
/// (with its line) is kept for the caller.
struct ModelData<'c, 'a> {
    cx: &'c Cx<'a>,
    counts: &'c mut Counts,
    /// Where the count the model asks for is written, for errors.
    at: Range<usize>,
    error: Option<JobFileError>,
}

impl models::DataShape for ModelData<'_, '_> {
    fn features(&mut self) -> Result<u32, String> {
        // The model's setting that asked is `features` (the one count a model takes).
        let at = self.at.clone();
        match self.counts.shape_at(self.cx, at, "model.features") {
            Ok(shape) => Ok(shape.features),
            Err(e) => {
                let message = e.to_string();
                self.error = Some(e);
                Err(message)
            }
        }
    }
}

/// The model kinds as a job file writes them: `"mlp", "logreg" or "custom"`.
fn quoted_kinds() -> String {
    let names: Vec<String> = models::BUILTINS
        .iter()
        .map(|k| format!("{:?}", k.name))
        .collect();
    format!("{} or {:?}", names.join(", "), ModelSection::CUSTOM)
}

/// The file being parsed, for messages.
struct Cx<'a> {
    text: &'a str,
    path: &'a Path,
}

impl Cx<'_> {
    /// The 1-based line holding byte `offset`.
    fn line(&self, offset: usize) -> usize {
        spans::line_at(self.text, offset)
    }

    fn err(&self, span: Range<usize>, field: &str, message: impl Into<String>) -> JobFileError {
        JobFileError::Invalid {
            path: self.path.to_path_buf(),
            line: (!self.text.is_empty()).then(|| self.line(span.start)),
            field: field.to_owned(),
            message: message.into(),
        }
    }

    fn at<T>(&self, value: &Spanned<T>, field: &str, message: impl Into<String>) -> JobFileError {
        self.err(value.span(), field, message)
    }

    /// A TOML syntax or type error, with the field found from its span.
    fn toml_error(&self, e: &toml::de::Error) -> JobFileError {
        let message = e.message().trim().to_owned();
        let span = e.span();
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'));
        let found = span
            .as_ref()
            .and_then(|s| spans::field_at(self.text, s.start));
        let (line, field) = match (span, missing) {
            // A field missing from the top level has an empty span at the start of the file.
            (Some(s), Some(name)) if s.is_empty() && s.start == 0 => (None, name.to_owned()),
            // Otherwise the span is the header of the table that lacks the field.
            (Some(s), Some(name)) => (
                Some(self.line(s.start)),
                found.map_or_else(|| name.to_owned(), |table| format!("{table}.{name}")),
            ),
            (Some(s), None) => (
                Some(self.line(s.start)),
                found.unwrap_or_else(|| "(toml)".to_owned()),
            ),
            (None, _) => (None, missing.unwrap_or("(toml)").to_owned()),
        };
        JobFileError::Invalid {
            path: self.path.to_path_buf(),
            line,
            field,
            message,
        }
    }

    fn data(&self, raw: &Spanned<RawData>) -> Result<DataSpec, JobFileError> {
        let d = raw.get_ref();
        let format = match d.format.get_ref().as_str() {
            "idx" => DataFormat::Idx,
            "libsvm" => DataFormat::LibSvm,
            other => {
                return Err(self.at(
                    &d.format,
                    "data.format",
                    format!("unknown format {other:?}: use idx or libsvm"),
                ));
            }
        };
        let resolve = |p: &Spanned<String>, field: &str| -> Result<String, JobFileError> {
            if p.get_ref().is_empty() {
                return Err(self.at(p, field, "must not be empty"));
            }
            let given = Path::new(p.get_ref());
            if given.is_absolute() {
                return Ok(p.get_ref().clone());
            }
            // Absolute (from the current directory, without resolving links), since workers
            // read the path from the coordinator and may run elsewhere.
            let dir = self.path.parent().unwrap_or(Path::new(""));
            let joined = dir.join(given);
            std::path::absolute(&joined)
                .unwrap_or(joined)
                .to_str()
                .map(str::to_owned)
                .ok_or_else(|| self.at(p, field, "the resolved path is not valid UTF-8"))
        };
        Ok(DataSpec {
            format,
            train: resolve(&d.train, "data.train")?,
            test: match &d.test {
                Some(t) => resolve(t, "data.test")?,
                None => String::new(),
            },
        })
    }

    fn model(
        &self,
        raw: &RawJob,
        counts: &mut Counts,
    ) -> Result<(ModelSection, Vec<TensorSpec>), JobFileError> {
        let table = raw.model.get_ref();
        let Some(kind_value) = table.get("kind") else {
            return Err(self.at(
                &raw.model,
                "model.kind",
                format!("missing: say which model, kind = {}", quoted_kinds()),
            ));
        };
        let Some(kind) = kind_value.get_ref().as_str() else {
            return Err(self.at(
                kind_value,
                "model.kind",
                format!("must be a string: {}", quoted_kinds()),
            ));
        };
        if kind == ModelSection::CUSTOM {
            if let Some((key, v)) = table.iter().find(|(k, _)| *k != "kind") {
                let message = match models::taking(key) {
                    Some(k) => format!("only for kind = {:?}", k.name),
                    None => "unknown key: a custom model's tensors are [[tensor]] tables".into(),
                };
                return Err(self.at(v, &format!("model.{key}"), message));
            }
            let list = raw.tensor.as_ref().map(Spanned::get_ref);
            let Some(list) = list.filter(|l| !l.is_empty()) else {
                return Err(self.at(
                    kind_value,
                    "tensor",
                    "missing: a custom model lists its tensors as [[tensor]] tables",
                ));
            };
            return self.custom(list);
        }
        if models::find(kind).is_none() {
            let refused = models::unknown_kind(kind);
            return Err(self.at(kind_value, "model.kind", refused.message));
        }
        // A built-in model's tensors may only be given a wire.
        let tables = raw.tensor.as_ref().map_or(&[][..], |t| t.get_ref());
        for (i, t) in tables.iter().enumerate() {
            let r = t.get_ref();
            let builds = (r.shape.as_ref().map(Spanned::span))
                .or(r.init.as_ref().map(Spanned::span))
                .or(r.scale.as_ref().map(Spanned::span))
                .or(r.value.as_ref().map(Spanned::span));
            if let Some(span) = builds.or_else(|| r.wire.is_none().then(|| t.span())) {
                return Err(self.err(
                    span,
                    &format!("tensor[{i}]"),
                    format!(
                        "kind = {kind:?} builds its own tensors: a [[tensor]] table may only \
                         give one a wire (name and wire); shape and init are for kind = \
                         \"custom\""
                    ),
                ));
            }
        }
        let settings: toml::Table = table
            .iter()
            .filter(|(k, _)| *k != "kind")
            .map(|(k, v)| (k.clone(), v.get_ref().clone()))
            .collect();
        let mut data = ModelData {
            cx: self,
            counts,
            // A count the model sizes from the data is its `features` (see DataShape).
            at: table.get("features").unwrap_or(kind_value).span(),
            error: None,
        };
        let built = models::build(kind, &settings, &mut data);
        let error = data.error.take();
        let model = built.map_err(|e| {
            error.unwrap_or_else(|| {
                let span = table.get(&e.key).unwrap_or(kind_value).span();
                self.err(span, &format!("model.{}", e.key), e.message)
            })
        })?;
        // The check names the setting that sizes the model (the only one a built-in has).
        let sizing = table
            .iter()
            .find(|(k, _)| *k != "kind")
            .map_or((kind_value.span(), "model.kind".to_string()), |(k, v)| {
                (v.span(), format!("model.{k}"))
            });
        self.check_total(&model.tensors, sizing.0, &sizing.1)?;
        Ok((model.section, model.tensors))
    }

    /// Applies the `[training]` table over edl-ps's defaults.
    fn training(
        &self,
        t: &RawTraining,
        counts: &mut Counts,
        job: &mut JobConfig,
    ) -> Result<(), JobFileError> {
        let positive = |slot: &mut u32, v: &Option<Spanned<u32>>, field: &str| {
            if let Some(v) = v {
                if *v.get_ref() == 0 {
                    return Err(self.at(v, field, "must be > 0"));
                }
                *slot = *v.get_ref();
            }
            Ok(())
        };
        positive(&mut job.batch_size, &t.batch_size, "training.batch_size")?;
        positive(&mut job.epochs, &t.epochs, "training.epochs")?;
        // A batch larger than a partition is allowed: workers cut batches within a partition.
        positive(
            &mut job.partition_size,
            &t.partition_size,
            "training.partition_size",
        )?;
        positive(&mut job.chunk_size, &t.chunk_size, "training.chunk_size")?;
        if let Some(c) = &t.consistency {
            job.consistency = c
                .get_ref()
                .parse()
                .map_err(|m| self.at(c, "training.consistency", m))?;
        }
        if let Some(s) = &t.samples {
            job.train_samples = match s.get_ref() {
                Count::Fixed(0) => return Err(self.at(s, "training.samples", "must be > 0")),
                Count::Fixed(n) => *n,
                Count::Auto => counts.shape(self, s, "training.samples")?.samples,
            };
        }
        if let Some(v) = &t.lease_ms {
            if *v.get_ref() < MIN_LEASE_MS {
                let message = format!("must be >= {MIN_LEASE_MS}");
                return Err(self.at(v, "training.lease_ms", message));
            }
            job.lease_ms = *v.get_ref();
        }
        if let Some(v) = &t.replicas {
            if !(1..=MAX_REPLICAS).contains(v.get_ref()) {
                let message = format!(
                    "must be 1 (no copies) to {MAX_REPLICAS}, and at most the job's shards"
                );
                return Err(self.at(v, "training.replicas", message));
            }
            job.replicas = *v.get_ref();
        }
        if let Some(v) = &t.wire {
            job.wire = (v.get_ref().parse()).map_err(|e| self.at(v, "training.wire", e))?;
        }
        if let Some(seed) = &t.seed {
            job.seed = seed.get_ref().0;
        }
        Ok(())
    }

    /// The wires `[[tensor]]` tables give their tensors (a built-in model's named by their
    /// names).
    fn tensor_wires(
        &self,
        raw: &RawJob,
        tensors: &[TensorSpec],
    ) -> Result<Vec<edl_proto::TensorWire>, JobFileError> {
        let tables = raw.tensor.as_ref().map_or(&[][..], |t| t.get_ref());
        let mut wires = Vec::new();
        for (i, t) in tables.iter().enumerate() {
            let t = t.get_ref();
            let Some(w) = &t.wire else { continue };
            let field = format!("tensor[{i}].wire");
            let wire = (w.get_ref().parse()).map_err(|e| self.at(w, &field, e))?;
            let name = t.name.get_ref();
            let Some(tensor) = tensors.iter().position(|s| &s.name == name) else {
                let names: Vec<&str> = tensors.iter().map(|s| s.name.as_str()).collect();
                return Err(self.at(
                    &t.name,
                    &format!("tensor[{i}].name"),
                    format!(
                        "the model has no tensor {name:?}: it has {}",
                        names.join(", ")
                    ),
                ));
            };
            if wires
                .iter()
                .any(|w: &edl_proto::TensorWire| w.tensor as usize == tensor)
            {
                return Err(self.at(
                    &t.name,
                    &format!("tensor[{i}].name"),
                    format!("tensor {name:?} is given a wire twice"),
                ));
            }
            wires.push(edl_proto::TensorWire {
                tensor: tensor as u32,
                wire,
            });
        }
        Ok(wires)
    }

    fn check_total(
        &self,
        tensors: &[TensorSpec],
        span: Range<usize>,
        field: &str,
    ) -> Result<(), JobFileError> {
        let total = tensors.iter().fold(0u64, |n, t| n.saturating_add(t.len()));
        if total > MAX_PARAMETERS {
            return Err(self.err(
                span,
                field,
                format!(
                    "the model has {total} parameters, more than the limit of \
                     {MAX_PARAMETERS} (2^31) floats"
                ),
            ));
        }
        Ok(())
    }

    fn custom(
        &self,
        list: &[Spanned<RawTensor>],
    ) -> Result<(ModelSection, Vec<TensorSpec>), JobFileError> {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let mut tensors = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let t = t.get_ref();
            let field = |k: &str| format!("tensor[{i}].{k}");
            let name = t.name.get_ref();
            if name.is_empty() {
                return Err(self.at(&t.name, &field("name"), "must not be empty"));
            }
            if name.chars().any(char::is_whitespace) {
                return Err(self.at(
                    &t.name,
                    &field("name"),
                    format!("{name:?} contains whitespace"),
                ));
            }
            if let Some(j) = seen.insert(name, i) {
                return Err(self.at(
                    &t.name,
                    &field("name"),
                    format!("{name:?} is already the name of tensor[{j}]"),
                ));
            }
            let (Some(dims), Some(init)) = (&t.shape, &t.init) else {
                let key = if t.shape.is_none() { "shape" } else { "init" };
                return Err(self.at(&t.name, &field(key), "missing: a custom tensor needs one"));
            };
            if dims.get_ref().is_empty() {
                return Err(self.at(dims, &field("shape"), "must have at least one dim"));
            }
            if let Some((d, dim)) = dims
                .get_ref()
                .iter()
                .enumerate()
                .find(|(_, d)| *d.get_ref() == 0)
            {
                return Err(self.at(dim, &field("shape"), format!("dim {d} is 0; must be > 0")));
            }
            let shape: Vec<u32> = dims.get_ref().iter().map(|d| *d.get_ref()).collect();
            let init = self.init(t, init, &shape, &field)?;
            tensors.push(TensorSpec {
                name: name.clone(),
                shape,
                init,
            });
            self.check_total(&tensors, dims.span(), &field("shape"))?;
        }
        Ok((ModelSection::custom(), tensors))
    }

    fn init(
        &self,
        t: &RawTensor,
        init: &Spanned<String>,
        shape: &[u32],
        field: &dyn Fn(&str) -> String,
    ) -> Result<Init, JobFileError> {
        let kind = init.get_ref().as_str();
        let forbid = |v: &Option<Spanned<f32>>, key: &str| match v {
            Some(v) => Err(self.at(v, &field(key), format!("not used by init = {kind:?}"))),
            None => Ok(()),
        };
        let required = |v: &Option<Spanned<f32>>, key: &str, positive: bool| match v {
            None => Err(self.at(
                init,
                &field(key),
                format!("missing: init = {kind:?} needs {key}"),
            )),
            Some(v) if !v.get_ref().is_finite() => {
                Err(self.at(v, &field(key), "must be a finite number"))
            }
            Some(v) if positive && *v.get_ref() <= 0.0 => {
                Err(self.at(v, &field(key), "must be > 0"))
            }
            Some(v) => Ok(*v.get_ref()),
        };
        let init = match kind {
            "zeros" => {
                forbid(&t.scale, "scale")?;
                forbid(&t.value, "value")?;
                Init::Zeros
            }
            "constant" => {
                forbid(&t.scale, "scale")?;
                Init::Constant {
                    value: required(&t.value, "value", false)?,
                }
            }
            "uniform" => {
                forbid(&t.value, "value")?;
                Init::Uniform {
                    limit: required(&t.scale, "scale", true)?,
                }
            }
            "normal" => {
                forbid(&t.value, "value")?;
                Init::Normal {
                    std: required(&t.scale, "scale", true)?,
                }
            }
            _ => match fan_init(kind, shape) {
                Some(init) => {
                    forbid(&t.scale, "scale")?;
                    forbid(&t.value, "value")?;
                    init
                }
                None => {
                    return Err(self.at(
                        init,
                        &field("init"),
                        format!(
                            "unknown init {kind:?}: use zeros, constant, uniform, normal, \
                             glorot_uniform, glorot_normal, he_uniform or he_normal"
                        ),
                    ));
                }
            },
        };
        Ok(init)
    }

    fn optimizer(
        &self,
        raw: Option<&Spanned<RawOptimizer>>,
        tensors: &[TensorSpec],
    ) -> Result<(OptimizerSpec, Vec<OptimizerGroup>), JobFileError> {
        let Some(raw) = raw else {
            return Ok((defaults::OPTIMIZER, Vec::new()));
        };
        let table = raw.get_ref();
        let kinds = OptimizerSpec::KINDS.join(", ");
        let Some(kind_value) = table.get("kind") else {
            return Err(self.at(
                raw,
                "optimizer.kind",
                format!("missing: say which optimizer, one of {kinds}"),
            ));
        };
        let Some(kind) = kind_value.get_ref().as_str() else {
            return Err(self.at(
                kind_value,
                "optimizer.kind",
                format!("must be a string: {kinds}"),
            ));
        };
        // The kind alone is the optimizer with PyTorch's defaults.
        let Some(mut spec) = OptimizerSpec::defaults(kind) else {
            return Err(self.at(
                kind_value,
                "optimizer.kind",
                format!("unknown optimizer {kind:?}: use {kinds}"),
            ));
        };
        for (key, v) in table.iter().filter(|(k, _)| *k != "kind" && *k != "group") {
            set_optimizer_key(&mut spec, key, v.get_ref())
                .map_err(|m| self.at(v, &format!("optimizer.{key}"), m))?;
        }
        spec.check()
            .map_err(|m| self.at(kind_value, "optimizer", m))?;
        let groups = match table.get("group") {
            None => Vec::new(),
            Some(v) => self.optimizer_groups(v, &spec, tensors)?,
        };
        Ok((spec, groups))
    }

    /// The `[schedule]` table over a constant schedule.
    fn schedule(&self, raw: &Spanned<RawSchedule>) -> Result<LrSchedule, JobFileError> {
        let table = raw.get_ref();
        let kinds = Curve::KINDS.join(", ");
        let kind = match table.get("kind") {
            None => "constant",
            Some(v) => v
                .get_ref()
                .as_str()
                .ok_or_else(|| self.at(v, "schedule.kind", format!("must be a string: {kinds}")))?,
        };
        let Some(curve) = Curve::defaults(kind) else {
            let at = table.get("kind").map_or(raw.span(), Spanned::span);
            return Err(self.err(
                at,
                "schedule.kind",
                format!("unknown schedule {kind:?}: use {kinds}"),
            ));
        };
        let mut schedule = LrSchedule {
            curve,
            ..LrSchedule::default()
        };
        for (key, v) in table.iter().filter(|(k, _)| *k != "kind") {
            let field = format!("schedule.{key}");
            let value = match v.get_ref() {
                toml::Value::Integer(i) => SettingValue::Number(*i as f64),
                toml::Value::Float(x) => SettingValue::Number(*x),
                toml::Value::Boolean(b) => SettingValue::Flag(*b),
                toml::Value::String(w) => SettingValue::Word(w.clone()),
                toml::Value::Array(list) => SettingValue::Counts(
                    list.iter()
                        .map(|m| m.as_integer().and_then(|i| u64::try_from(i).ok()))
                        .collect::<Option<_>>()
                        .ok_or_else(|| self.at(v, &field, "must be whole numbers >= 0"))?,
                ),
                other => {
                    return Err(self.at(v, &field, format!("cannot be a {}", other.type_str())));
                }
            };
            if !schedule
                .set(key, value)
                .map_err(|m| self.at(v, &field, m))?
            {
                let keys = edl_proto::schedule::schedule_keys(kind).join(", ");
                return Err(self.at(
                    v,
                    &field,
                    format!("unknown key: kind = {kind:?} takes {keys}"),
                ));
            }
        }
        schedule
            .curve
            .check()
            .map_err(|m| self.at(raw, "schedule", m))?;
        Ok(schedule)
    }

    /// `[[optimizer.group]]` tables: `tensors` (names, or patterns with `*`) and settings
    /// over the job's optimizer, as PyTorch's parameter groups.
    fn optimizer_groups(
        &self,
        v: &Spanned<toml::Value>,
        base: &OptimizerSpec,
        tensors: &[TensorSpec],
    ) -> Result<Vec<OptimizerGroup>, JobFileError> {
        let toml::Value::Array(list) = v.get_ref() else {
            return Err(self.at(v, "optimizer.group", "must be [[optimizer.group]] tables"));
        };
        let mut groups = Vec::with_capacity(list.len());
        let mut owner: HashMap<u32, usize> = HashMap::new();
        for (i, g) in list.iter().enumerate() {
            let field = |k: &str| format!("optimizer.group[{i}].{k}");
            let err = |k: &str, m: String| self.at(v, &field(k), m);
            let Some(g) = g.as_table() else {
                return Err(err("", "must be a table".into()));
            };
            let Some(names) = g.get("tensors").and_then(toml::Value::as_array) else {
                return Err(err(
                    "tensors",
                    "missing: a group names its tensors, e.g. tensors = [\"*.bias\"]".into(),
                ));
            };
            let mut members = Vec::new();
            for name in names {
                let Some(pattern) = name.as_str() else {
                    return Err(err("tensors", format!("{name} is not a tensor name")));
                };
                let hits: Vec<u32> = (0..tensors.len() as u32)
                    .filter(|&t| glob_match(pattern, &tensors[t as usize].name))
                    .collect();
                if hits.is_empty() {
                    return Err(err(
                        "tensors",
                        format!("{pattern:?} names no tensor of the model"),
                    ));
                }
                for t in hits {
                    if let Some(j) = owner.insert(t, i).filter(|&j| j != i) {
                        return Err(err(
                            "tensors",
                            format!(
                                "{:?} is already in group {j}: a tensor is in one group",
                                tensors[t as usize].name
                            ),
                        ));
                    }
                    if !members.contains(&t) {
                        members.push(t);
                    }
                }
            }
            let mut spec = base.clone();
            for (key, value) in g.iter().filter(|(k, _)| *k != "tensors") {
                if key == "kind" {
                    return Err(err(
                        key,
                        "a group keeps the job's optimizer kind; it changes its settings".into(),
                    ));
                }
                set_optimizer_key(&mut spec, key, value).map_err(|m| err(key, m))?;
            }
            spec.check().map_err(|m| err("", m))?;
            groups.push(OptimizerGroup {
                tensors: members,
                optimizer: spec,
            });
        }
        Ok(groups)
    }
}

/// Sets optimizer setting `key` of `spec`'s kind from a job file's value; the message names
/// what is wrong (the kinds that take a key this kind does not).
fn set_optimizer_key(spec: &mut OptimizerSpec, key: &str, v: &toml::Value) -> Result<(), String> {
    let kind = spec.kind();
    let keys = OptimizerSpec::keys(kind);
    if key != "lr" && !keys.contains(&key) {
        let owners: Vec<String> = OptimizerSpec::KINDS
            .iter()
            .filter(|k| OptimizerSpec::keys(k).contains(&key))
            .map(|k| format!("{k:?}"))
            .collect();
        return Err(if owners.is_empty() {
            format!("unknown key: kind = {kind:?} takes lr, {}", keys.join(", "))
        } else {
            format!("only for kind = {}", owners.join(" or "))
        });
    }
    let set = match v {
        toml::Value::Boolean(on) => spec.set_flag(key, *on)?,
        toml::Value::Float(x) => spec.set_number(key, *x)?,
        toml::Value::Integer(i) => spec.set_number(key, *i as f64)?,
        other => {
            return Err(format!(
                "must be a number or a boolean, not a {}",
                other.type_str()
            ));
        }
    };
    if !set {
        let want = if v.is_bool() {
            "a number"
        } else {
            "true or false"
        };
        return Err(format!("must be {want}"));
    }
    Ok(())
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else {
                return false;
            };
            (0..=tail.len())
                .filter(|&i| tail.is_char_boundary(i))
                .any(|i| glob_match(rest, &tail[i..]))
        }
    }
}

/// The fans of a tensor under the `[in, out, receptive...]` convention: `[a]` has both fans
/// `a`; `[a, b, rest...]` has `a * prod(rest)` in and `b * prod(rest)` out.
fn fans(shape: &[u32]) -> (f64, f64) {
    match shape {
        [] => (1.0, 1.0),
        [a] => (f64::from(*a), f64::from(*a)),
        [a, b, rest @ ..] => {
            let receptive: f64 = rest.iter().map(|&d| f64::from(d)).product();
            (f64::from(*a) * receptive, f64::from(*b) * receptive)
        }
    }
}

/// Resolves a Glorot or He init from the tensor's fans; `None` for other names.
fn fan_init(kind: &str, shape: &[u32]) -> Option<Init> {
    let (fan_in, fan_out) = fans(shape);
    let init = match kind {
        "glorot_uniform" => Init::Uniform {
            limit: (6.0 / (fan_in + fan_out)).sqrt() as f32,
        },
        "glorot_normal" => Init::Normal {
            std: (2.0 / (fan_in + fan_out)).sqrt() as f32,
        },
        "he_uniform" => Init::Uniform {
            limit: (6.0 / fan_in).sqrt() as f32,
        },
        "he_normal" => Init::Normal {
            std: (2.0 / fan_in).sqrt() as f32,
        },
        _ => return None,
    };
    Some(init)
}

// ---------------------------------------------------------------------------------------------
// Writing.

/// A float as TOML: `Debug` always writes a `.` or an exponent and the shortest digits that
/// read back to the same `f32`.
fn toml_float(x: f32) -> String {
    if x.is_nan() {
        "nan".to_owned()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.to_owned()
    } else {
        format!("{x:?}")
    }
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn join<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `lr` and every other setting of `o`, a line each.
fn write_optimizer_settings(out: &mut String, o: &OptimizerSpec) -> fmt::Result {
    writeln!(out, "lr = {:?}", o.lr())?;
    for (key, value) in o.settings_text() {
        writeln!(out, "{key} = {value}")?;
    }
    Ok(())
}

fn write_toml(out: &mut String, job: &JobConfig) -> fmt::Result {
    writeln!(out, "[model]")?;
    writeln!(out, "kind = {}", toml_string(&job.model.kind))?;
    // The registry's settings are TOML already (a custom model has none).
    let settings = job.model.settings.trim_end();
    if !settings.is_empty() {
        writeln!(out, "{settings}")?;
    }
    writeln!(out, "\n[optimizer]")?;
    writeln!(out, "kind = \"{}\"", job.optimizer.kind())?;
    write_optimizer_settings(out, &job.optimizer)?;
    for g in &job.optimizer_groups {
        let names: Vec<String> = g
            .tensors
            .iter()
            .filter_map(|&t| job.tensors.get(t as usize))
            .map(|t| toml_string(&t.name))
            .collect();
        writeln!(
            out,
            "\n[[optimizer.group]]\ntensors = [{}]",
            names.join(", ")
        )?;
        write_optimizer_settings(out, &g.optimizer)?;
    }
    if job.schedule != LrSchedule::default() {
        writeln!(out, "\n[schedule]")?;
        writeln!(out, "kind = \"{}\"", job.schedule.curve.kind())?;
        for (key, value) in job.schedule.curve.settings_text() {
            writeln!(out, "{key} = {value}")?;
        }
        writeln!(out, "by = \"{}\"", job.schedule.by)?;
        writeln!(out, "scale = \"{}\"", job.schedule.scale)?;
    }
    writeln!(out, "\n[training]")?;
    writeln!(out, "consistency = \"{}\"", job.consistency)?;
    writeln!(out, "batch_size = {}", job.batch_size)?;
    writeln!(out, "epochs = {}", job.epochs)?;
    writeln!(out, "samples = {}", job.train_samples)?;
    writeln!(out, "partition_size = {}", job.partition_size)?;
    writeln!(out, "lease_ms = {}", job.lease_ms)?;
    if job.replicas != defaults::REPLICAS {
        writeln!(out, "replicas = {}", job.replicas)?;
    }
    if !job.wire.is_exact() {
        writeln!(out, "wire = \"{}\"", job.wire)?;
    }
    if i64::try_from(job.seed).is_ok() {
        writeln!(out, "seed = {}", job.seed)?;
    } else {
        writeln!(out, "seed = \"{}\"", job.seed)?;
    }
    writeln!(out, "chunk_size = {}", job.chunk_size)?;
    if let Some(data) = &job.data {
        writeln!(out, "\n[data]")?;
        writeln!(out, "format = \"{}\"", data.format)?;
        writeln!(out, "train = {}", toml_string(&data.train))?;
        if !data.test.is_empty() {
            writeln!(out, "test = {}", toml_string(&data.test))?;
        }
    }
    let own_wire = |t: usize| job.tensor_wires.iter().find(|w| w.tensor as usize == t);
    if job.model.is_custom() {
        for (i, t) in job.tensors.iter().enumerate() {
            writeln!(out, "\n[[tensor]]")?;
            writeln!(out, "name = {}", toml_string(&t.name))?;
            if let Some(w) = own_wire(i) {
                writeln!(out, "wire = \"{}\"", w.wire)?;
            }
            writeln!(out, "shape = [{}]", join(&t.shape))?;
            match t.init {
                Init::Zeros => writeln!(out, "init = \"zeros\"")?,
                Init::Uniform { limit } => {
                    writeln!(out, "init = \"uniform\"\nscale = {}", toml_float(limit))?;
                }
                Init::Normal { std } => {
                    writeln!(out, "init = \"normal\"\nscale = {}", toml_float(std))?;
                }
                Init::Constant { value } => {
                    writeln!(out, "init = \"constant\"\nvalue = {}", toml_float(value))?;
                }
            }
        }
    } else {
        for w in &job.tensor_wires {
            if let Some(t) = job.tensors.get(w.tensor as usize) {
                writeln!(out, "\n[[tensor]]")?;
                writeln!(out, "name = {}", toml_string(&t.name))?;
                writeln!(out, "wire = \"{}\"", w.wire)?;
            }
        }
    }
    Ok(())
}

/// The parameter groups, one line each: their tensors and what differs from the job's.
fn groups_text(job: &JobConfig) -> String {
    if job.optimizer_groups.is_empty() {
        return "none".into();
    }
    let base = job.optimizer.settings_text();
    job.optimizer_groups
        .iter()
        .map(|g| {
            let names: Vec<&str> = g
                .tensors
                .iter()
                .filter_map(|&t| job.tensors.get(t as usize))
                .map(|t| t.name.as_str())
                .collect();
            let mut changed: Vec<String> = Vec::new();
            if g.optimizer.lr().to_bits() != job.optimizer.lr().to_bits() {
                changed.push(format!("lr {}", g.optimizer.lr()));
            }
            for ((key, value), (_, was)) in g.optimizer.settings_text().into_iter().zip(&base) {
                if value != *was {
                    changed.push(format!("{key} {value}"));
                }
            }
            format!("{}: {}", names.join(", "), changed.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn optimizer_text(o: &OptimizerSpec) -> String {
    let mut out = format!("{}, lr {}", o.kind(), o.lr());
    for (key, value) in o.changed_settings() {
        let _ = write!(out, ", {key} {value}");
    }
    out
}

/// How a job's pushes and pulls travel, for its description.
fn wire_text(wire: edl_proto::WireSpec) -> String {
    let values = match wire.values {
        edl_proto::Wire::F32 => "at f32".to_string(),
        w => format!("at 16 bits ({w})"),
    };
    match wire.topk {
        None if wire.is_exact() => "f32 (pushes and pulls exact)".to_string(),
        None => format!("{wire} (pushes and pulls {values}; shards keep f32)"),
        Some(k) => format!(
            "{wire} (each push sends the largest {}% of every chunk's values {values}, the \
             rest held back by the worker for its next push; pulls {values})",
            k.fraction() * 100.0
        ),
    }
}

/// The tensors that travel at a wire of their own, for a job's description.
fn tensor_wires_text(job: &JobConfig) -> String {
    let named = job.tensor_wires.iter().map(|w| {
        let name = job.tensors.get(w.tensor as usize).map_or("?", |t| &t.name);
        format!("{name} {}", wire_text(w.wire))
    });
    named.collect::<Vec<_>>().join("; ")
}

fn write_description(out: &mut String, job: &JobConfig) -> fmt::Result {
    let partitions = job.train_samples.div_ceil(job.partition_size.max(1));
    let settings = [
        ("model", models::describe(&job.model, &job.tensors)),
        ("optimizer", optimizer_text(&job.optimizer)),
        ("groups", groups_text(job)),
        ("schedule", job.schedule.to_string()),
        ("consistency", job.consistency.to_string()),
        ("batch size", format!("{} samples", job.batch_size)),
        ("epochs", job.epochs.to_string()),
        ("samples", format!("{} per epoch", job.train_samples)),
        (
            "partitions",
            format!(
                "{} samples each, {partitions} per epoch",
                job.partition_size
            ),
        ),
        ("lease", format!("{} ms", job.lease_ms)),
        (
            "replicas",
            match job.replicas {
                0 | 1 => "1 (no backup copies)".to_string(),
                n => format!("{n} (a primary and {} backups of every key range)", n - 1),
            },
        ),
        ("wire", wire_text(job.wire)),
        ("tensor wires", tensor_wires_text(job)),
        ("seed", job.seed.to_string()),
        ("chunk size", format!("{} floats per key", job.chunk_size)),
        (
            "data",
            match &job.data {
                None => "not named (workers are told where it lies)".to_owned(),
                Some(d) if d.test.is_empty() => format!("{}: train {}", d.format, d.train),
                Some(d) => format!("{}: train {}, test {}", d.format, d.train, d.test),
            },
        ),
    ];
    for (name, value) in settings {
        // Most jobs have no parameter groups: no line for them.
        if name == "groups" && job.optimizer_groups.is_empty() {
            continue;
        }
        if name == "tensor wires" && job.tensor_wires.is_empty() {
            continue;
        }
        if name == "schedule" && job.schedule == LrSchedule::default() {
            continue;
        }
        writeln!(out, "{name:<12} {value}")?;
    }

    let mut keys = vec![0u64; job.tensors.len()];
    let layout = job.layout();
    for span in layout.spans() {
        if let Some(k) = keys.get_mut(span.tensor) {
            *k += 1;
        }
    }
    let mut rows = vec![[
        "tensor".to_owned(),
        "shape".to_owned(),
        "init".to_owned(),
        "offset".to_owned(),
        "floats".to_owned(),
        "keys".to_owned(),
    ]];
    let mut offset = 0u64;
    for (t, k) in job.tensors.iter().zip(&keys) {
        let shape: Vec<String> = t.shape.iter().map(u32::to_string).collect();
        rows.push([
            t.name.clone(),
            format!("[{}]", shape.join(", ")),
            t.init.to_string(),
            offset.to_string(),
            t.len().to_string(),
            k.to_string(),
        ]);
        offset = offset.saturating_add(t.len());
    }
    let mut width = [0usize; 6];
    for row in &rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    writeln!(out)?;
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(width).enumerate() {
            // Names, shapes and inits align left, numbers right.
            if i < 3 {
                write!(line, "{cell:<w$}  ")?;
            } else {
                write!(line, "{cell:>w$}  ")?;
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    let total = layout.total_len();
    let bytes = total.saturating_mul(4);
    writeln!(
        out,
        "\ntotal: {total} parameters, {bytes} bytes ({}), {} keys",
        human_bytes(bytes),
        layout.num_keys()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_proto::Consistency;
    use models::{Builtin, LogReg, Mlp};

    const MLP: &str = r#"[model]
kind = "mlp"
layers = [784, 256, 128, 10]

[optimizer]
kind = "sgd"
lr = 0.1

[training]
consistency = "ssp:2"
batch_size = 64
epochs = 3
samples = 60000
"#;

    const LOGREG: &str = r#"[model]
kind = "logreg"
features = 126

[optimizer]
kind = "momentum"
lr = 0.05
momentum = 0.9

[training]
consistency = "asp"
batch_size = 32
samples = 6513

[data]
format = "libsvm"
train = "/data/agaricus.txt.train"
"#;

    const CUSTOM: &str = r#"[model]
kind = "custom"

[optimizer]
kind = "momentum"
lr = 0.05
momentum = 0.9

[training]
consistency = "bsp"
batch_size = 32
epochs = 1
samples = 1000

[[tensor]]
name = "fc1.weight"
shape = [784, 128]
init = "glorot_uniform"

[[tensor]]
name = "fc1.bias"
shape = [128]
init = "zeros"
"#;

    fn job(text: &str) -> JobConfig {
        match parse(text, Path::new("job.toml")) {
            Ok(job) => job,
            Err(e) => panic!("{e}\n--- in ---\n{text}"),
        }
    }

    /// `base` with each `(from, to)` replaced once (and `from` present).
    fn with(base: &str, edits: &[(&str, &str)]) -> String {
        let mut text = base.to_owned();
        for (from, to) in edits {
            assert!(text.contains(from), "{from:?} not in the base text");
            text = text.replacen(from, to, 1);
        }
        text
    }

    /// A base text, its edits, the field the error must name and its line.
    type Case = (
        &'static str,
        &'static [(&'static str, &'static str)],
        &'static str,
        usize,
    );

    fn close(a: f32, b: f64) -> bool {
        (f64::from(a) - b).abs() < 1e-6
    }

    #[test]
    fn the_wire_is_read_and_written_back() {
        assert!(job(MLP).wire.is_exact());
        for (name, values, topk) in [
            ("bf16", edl_proto::Wire::Bf16, None),
            ("topk:0.01", edl_proto::Wire::F32, Some(0.01)),
            ("topk:0.05+fp16", edl_proto::Wire::F16, Some(0.05)),
        ] {
            let text = MLP.replace(
                "samples = 60000",
                &format!("samples = 60000\nwire = \"{name}\""),
            );
            let read = job(&text);
            assert_eq!(read.wire.values, values, "{name}");
            assert_eq!(
                read.wire.topk.map(edl_proto::TopK::fraction),
                topk,
                "{name}"
            );
            let back = to_toml(&read);
            assert!(back.contains(&format!("wire = \"{name}\"")), "{back}");
            assert_eq!(job(&back).wire, read.wire, "{name}");
        }
        let topk = job(&MLP.replace("samples = 60000", "samples = 60000\nwire = \"topk:0.01\""));
        let text = describe(&topk);
        assert!(
            text.contains("largest 1% of every chunk's values at f32"),
            "{text}"
        );
    }

    #[test]
    fn tensors_take_wires_of_their_own_in_custom_and_built_in_models() {
        let custom = CUSTOM.replace(
            "name = \"fc1.bias\"\n",
            "name = \"fc1.bias\"\nwire = \"bf16\"\n",
        );
        let custom = custom.replace("samples = 1000", "samples = 1000\nwire = \"topk:0.01\"");
        let read = job(&custom);
        let bf16: edl_proto::WireSpec = "bf16".parse().expect("bf16");
        assert_eq!(read.wire_of(0), read.wire);
        assert_eq!(read.wire_of(1), bf16);
        assert_eq!(job(&to_toml(&read)), read);
        let text = describe(&read);
        assert!(
            text.contains("fc1.bias bf16 (pushes and pulls at 16 bits"),
            "{text}"
        );
        // A built-in model's tensor, by name; written back and read again.
        let mlp = format!("{MLP}\n[[tensor]]\nname = \"fc2.bias\"\nwire = \"fp16\"\n");
        let read = job(&mlp);
        let t = read.tensor_index("fc2.bias").expect("fc2.bias");
        assert_eq!(read.wire_of(t), "fp16".parse().expect("fp16"));
        assert_eq!(
            read.wires().iter().filter(|w| w.is_exact()).count(),
            read.tensors.len() - 1
        );
        assert_eq!(job(&to_toml(&read)), read);
        // Refused: a name the model does not have, a tensor named twice, a bad wire, and a
        // built-in model's table with nothing to give.
        let cases = [
            (
                mlp.replace("fc2.bias", "fc9.bias"),
                "tensor[0].name",
                "has no tensor \"fc9.bias\"",
            ),
            (
                format!("{mlp}\n[[tensor]]\nname = \"fc2.bias\"\nwire = \"bf16\"\n"),
                "tensor[1].name",
                "given a wire twice",
            ),
            (
                mlp.replace("\"fp16\"", "\"int8\""),
                "tensor[0].wire",
                "unknown wire",
            ),
            (
                mlp.replace("wire = \"fp16\"\n", ""),
                "tensor[0]",
                "builds its own tensors",
            ),
        ];
        for (text, field, message) in cases {
            let e = parse(&text, Path::new("job.toml")).expect_err(field);
            let shown = e.to_string();
            assert!(
                shown.contains(field) && shown.contains(message),
                "{field}: {shown}"
            );
        }
    }

    #[test]
    fn replicas_are_read_and_written_back() {
        assert_eq!(job(MLP).replicas, 1);
        let text = MLP.replace("samples = 60000", "samples = 60000\nreplicas = 3");
        let three = job(&text);
        assert_eq!(three.replicas, 3);
        let back = to_toml(&three);
        assert!(back.contains("replicas = 3"), "{back}");
        assert_eq!(job(&back).replicas, 3);
    }

    #[test]
    fn mlp_file_takes_edl_ps_defaults_for_the_rest() {
        let job = job(MLP);
        let layers = vec![784, 256, 128, 10];
        assert_eq!(
            job.tensors,
            Mlp {
                layers: layers.clone()
            }
            .tensors()
        );
        assert_eq!(job.model, Mlp { layers }.section());
        assert_eq!(job.optimizer, OptimizerSpec::sgd(0.1));
        assert_eq!(job.consistency, Consistency::Ssp { staleness: 2 });
        assert_eq!(
            (job.batch_size, job.epochs, job.train_samples),
            (64, 3, 60_000)
        );
        assert_eq!((job.partition_size, job.lease_ms), (1024, 3000));
        assert_eq!((job.seed, job.chunk_size), (1, 16_384));
        assert_eq!(job.data, None);

        // With only a model, the job is the one `edl-ps coordinator` builds from its defaults.
        let bare = self::job("[model]\nkind = \"mlp\"\nlayers = [784, 256, 128, 10]\n");
        assert_eq!(bare.optimizer, OptimizerSpec::adam(0.001));
        assert_eq!(bare.consistency, Consistency::Ssp { staleness: 2 });
        assert_eq!(bare.train_samples, 60_000);
    }

    #[test]
    fn every_torch_optimizer_reads_with_its_arguments() {
        let table = |t: &str| job(&MLP.replace("kind = \"sgd\"\nlr = 0.1", t)).optimizer;
        assert_eq!(
            table("kind = \"adamw\"\nlr = 0.002\nbeta2 = 0.99\namsgrad = true"),
            "adamw:0.002,beta2=0.99,amsgrad=true"
                .parse()
                .expect("adamw")
        );
        assert_eq!(
            table("kind = \"sgd\"\nlr = 1\nmomentum = 0.9\nnesterov = true\nweight_decay = 5e-4"),
            OptimizerSpec::Sgd {
                lr: 1.0,
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true,
                weight_decay: 5e-4,
            }
        );
        assert_eq!(
            table("kind = \"rmsprop\"\ncentered = true"),
            OptimizerSpec::RmsProp {
                lr: 0.01,
                alpha: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                momentum: 0.0,
                centered: true,
            }
        );
        assert_eq!(
            table("kind = \"adadelta\""),
            OptimizerSpec::defaults("adadelta").expect("adadelta")
        );
        let adagrad = table("kind = \"adagrad\"\nlr_decay = 0.1\ninitial_accumulator_value = 0.5");
        assert_eq!(
            adagrad.to_string(),
            "adagrad:0.01,lr_decay=0.1,initial_accumulator_value=0.5"
        );
    }

    #[test]
    fn parameter_groups_name_their_tensors_and_change_settings() {
        let groups = "\n[[optimizer.group]]\ntensors = [\"*.bias\"]\nweight_decay = 0\nlr = 0.5\n";
        let text = MLP.replace(
            "lr = 0.1\n",
            &format!("lr = 0.1\nweight_decay = 0.01\n{groups}"),
        );
        let job = self::job(&text);
        assert_eq!(job.optimizer_groups.len(), 1);
        let g = &job.optimizer_groups[0];
        let names: Vec<&str> = g
            .tensors
            .iter()
            .map(|&t| job.tensors[t as usize].name.as_str())
            .collect();
        assert_eq!(names, ["fc0.bias", "fc1.bias", "fc2.bias"]);
        assert_eq!(g.optimizer, OptimizerSpec::sgd(0.5));
        assert_eq!(job.optimizer_of(1), &g.optimizer);
        assert_eq!(job.optimizer_of(0), &job.optimizer);
        assert!(describe(&job).contains("fc0.bias, fc1.bias, fc2.bias: lr 0.5, weight_decay 0.0"));
        // Written out and read back, the groups are the same.
        let again = parse(&to_toml(&job), Path::new("again.toml")).expect("round trip");
        assert_eq!(again.optimizer_groups, job.optimizer_groups);
        let refused = [
            (
                "tensors = [\"*.bias\"]",
                "tensors = [\"conv*\"]",
                "names no tensor",
            ),
            (
                "weight_decay = 0\n",
                "weight_decay = 0\n\n[[optimizer.group]]\ntensors = [\"fc1.*\"]\n",
                "already in group 0",
            ),
            (
                "weight_decay = 0\n",
                "kind = \"adam\"\n",
                "keeps the job's optimizer kind",
            ),
            ("weight_decay = 0\n", "amsgrad = true\n", "only for kind"),
            (
                "tensors = [\"*.bias\"]\n",
                "",
                "missing: a group names its tensors",
            ),
        ];
        refused_naming(&text, &refused, "optimizer.group[");
        assert!(glob_match("*.bias", "fc0.bias") && !glob_match("*.bias", "fc0.weight"));
        assert!(glob_match("a*b*c", "aXbYc") && glob_match("*", "") && !glob_match("a*", "b"));
    }

    /// Each `(from, to, why)`: `text` with `from` replaced by `to` is refused, the message
    /// saying `why` and naming `field`.
    fn refused_naming(text: &str, cases: &[(&str, &str, &str)], field: &str) {
        for (from, to, why) in cases {
            let bad = text.replace(from, to);
            let e = parse(&bad, Path::new("j.toml")).expect_err(to).to_string();
            assert!(e.contains(why) && e.contains(field), "{to}: {e}");
        }
    }

    #[test]
    fn schedules_read_with_pytorchs_arguments_and_round_trip() {
        let text = with(
            MLP,
            &[(
                "[training]",
                "[schedule]\nkind = \"multistep\"\nmilestones = [2, 4]\ngamma = 0.5\n\
                 by = \"epoch\"\n\n[training]",
            )],
        );
        let job = job(&text);
        assert_eq!(
            job.schedule.to_string(),
            "multistep,milestones=2:4,gamma=0.5,by=epoch"
        );
        assert!(describe(&job).contains("schedule     multistep,milestones=2:4"));
        let again = parse(&to_toml(&job), Path::new("again.toml")).expect("round trip");
        assert_eq!(again.schedule, job.schedule);
        // No table: constant, and nothing about it in the description.
        assert_eq!(self::job(MLP).schedule, LrSchedule::default());
        assert!(!describe(&self::job(MLP)).contains("schedule"));

        let refused: &[(&str, &str, &str)] = &[
            (
                "kind = \"multistep\"",
                "kind = \"warmup\"",
                "unknown schedule",
            ),
            (
                "milestones = [2, 4]",
                "T_max = 3",
                "unknown key: kind = \"multistep\"",
            ),
            ("milestones = [2, 4]", "milestones = [4, 2]", "ascending"),
            ("milestones = [2, 4]", "milestones = [-1]", "whole numbers"),
            ("gamma = 0.5", "gamma = \"half\"", "gamma must be a number"),
            ("by = \"epoch\"", "by = \"batch\"", "unknown unit"),
            // Scaling is for BSP's averaged updates; this job is ssp:2.
            (
                "by = \"epoch\"",
                "scale = \"linear\"",
                "needs consistency = \"bsp\"",
            ),
        ];
        refused_naming(&text, refused, "schedule");
        // Momentum cycling needs a momentum: plain SGD has none.
        let one = with(
            MLP,
            &[(
                "[training]",
                "[schedule]\nkind = \"onecycle\"\ntotal_steps = 100\n\n[training]",
            )],
        );
        let e = parse(&one, Path::new("j.toml")).expect_err("sgd has no momentum");
        assert!(e.to_string().contains("cycle_momentum = false"), "{e}");
        let one = one.replace(
            "total_steps = 100",
            "total_steps = 100\ncycle_momentum = false",
        );
        assert!(matches!(
            self::job(&one).schedule.curve,
            Curve::OneCycle { .. }
        ));
    }

    #[test]
    fn logreg_file_with_fixed_counts() {
        let job = job(LOGREG);
        assert_eq!(job.model, LogReg { features: 126 }.section());
        assert_eq!(job.tensors, LogReg { features: 126 }.tensors());
        assert_eq!(job.optimizer, OptimizerSpec::momentum(0.05, 0.9));
        assert_eq!(job.consistency, Consistency::Asp);
        assert_eq!((job.batch_size, job.train_samples), (32, 6513));
        let data = job.data.expect("data");
        assert_eq!(data.format, DataFormat::LibSvm);
        assert_eq!(data.train, "/data/agaricus.txt.train");
        assert_eq!(data.test, "");
    }

    #[test]
    fn custom_file_lists_tensors() {
        let job = job(CUSTOM);
        assert_eq!(job.model, ModelSection::custom());
        assert_eq!(job.consistency, Consistency::Bsp);
        let names: Vec<&str> = job.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["fc1.weight", "fc1.bias"]);
        assert_eq!(job.tensors[0].shape, [784, 128]);
        // Glorot-uniform as the built-in MLP draws it.
        assert_eq!(
            job.tensors[0].init,
            Mlp {
                layers: vec![784, 128]
            }
            .tensors()[0]
                .init
        );
        assert_eq!(job.tensors[1].init, Init::Zeros);
    }

    #[test]
    fn glorot_and_he_resolve_from_the_fans() {
        assert_eq!(fans(&[784, 128]), (784.0, 128.0));
        assert_eq!(fans(&[10]), (10.0, 10.0));
        assert_eq!(fans(&[3, 16, 5, 5]), (75.0, 400.0));
        let cases: [(&str, &[u32], f64); 7] = [
            ("glorot_uniform", &[784, 128], 0.081_110_710_565_381_27),
            ("glorot_normal", &[784, 128], 0.046_829_290_579_084_7),
            ("he_uniform", &[784, 128], 0.087_481_776_527_970_65),
            ("he_normal", &[784, 128], 0.050_507_627_227_610_534),
            ("glorot_uniform", &[10], 0.547_722_557_505_166_1),
            ("glorot_uniform", &[3, 16, 5, 5], 0.112_390_297_389_803_27),
            ("he_normal", &[3, 16, 5, 5], 0.163_299_316_185_545_22),
        ];
        for (kind, shape, want) in cases {
            let got = match fan_init(kind, shape) {
                Some(Init::Uniform { limit }) if kind.ends_with("uniform") => limit,
                Some(Init::Normal { std }) if kind.ends_with("normal") => std,
                other => panic!("{kind} {shape:?} resolved to {other:?}"),
            };
            assert!(close(got, want), "{kind} {shape:?}: {got} != {want}");
        }
        assert_eq!(fan_init("xavier", &[1]), None);

        // Through a file: he_normal on a conv kernel.
        let text = with(
            CUSTOM,
            &[(
                "shape = [784, 128]\ninit = \"glorot_uniform\"",
                "shape = [3, 16, 5, 5]\ninit = \"he_normal\"",
            )],
        );
        match &self::job(&text).tensors[0].init {
            Init::Normal { std } => assert!(close(*std, 0.163_299_316_185_545_22)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn auto_counts_come_from_the_libsvm_training_data() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(
            dir.path().join("train.txt"),
            "1 3:1 10:1\n# a comment\n0 1:0.5\n1 7:2 12:1\n",
        )?;
        let text = with(
            LOGREG,
            &[
                ("features = 126", "features = \"auto\""),
                ("samples = 6513", "samples = \"auto\""),
                (
                    "train = \"/data/agaricus.txt.train\"",
                    "train = \"train.txt\"\ntest = \"test.txt\"",
                ),
            ],
        );
        let file = dir.path().join("job.toml");
        std::fs::write(&file, &text)?;
        let job = load(&file)?;
        assert_eq!(job.model, LogReg { features: 12 }.section());
        assert_eq!(job.tensors, LogReg { features: 12 }.tensors());
        assert_eq!(job.train_samples, 3);
        // Relative paths resolve against the job file's directory; the test data is not read.
        let data = job.data.expect("data");
        assert_eq!(Path::new(&data.train), dir.path().join("train.txt"));
        assert_eq!(Path::new(&data.test), dir.path().join("test.txt"));

        // A missing training file is an error at data.train.
        std::fs::remove_file(dir.path().join("train.txt"))?;
        match load(&file) {
            Err(JobFileError::Invalid { field, line, .. }) => {
                assert_eq!((field.as_str(), line), ("data.train", Some(17)));
            }
            other => panic!("expected an error at data.train, got {other:?}"),
        }
        Ok(())
    }

    #[test]
    fn invalid_fields_are_named_with_their_line() {
        const TENSOR_FOR_MLP: &str =
            "samples = 60000\n\n[[tensor]]\nname = \"x\"\nshape = [1]\ninit = \"zeros\"";
        #[rustfmt::skip]
        let cases: &[Case] = &[
            // Unknown keys, also inside [[tensor]].
            (MLP, &[("epochs = 3", "epochs = 3\nepoch = 4")], "training.epoch", 13),
            (CUSTOM, &[("init = \"zeros\"", "init = \"zeros\"\nstd = 1")], "tensor[1].std", 24),
            // TOML syntax and types.
            (MLP, &[("lr = 0.1", "lr = 0.1.2")], "optimizer.lr", 7),
            (MLP, &[("batch_size = 64", "batch_size = -64")], "training.batch_size", 11),
            (MLP, &[("kind = \"mlp\"\n", "")], "model.kind", 1),
            // Model.
            (MLP, &[("kind = \"mlp\"", "kind = \"cnn\"")], "model.kind", 2),
            (MLP, &[("[784, 256, 128, 10]", "[784, 0, 10]")], "model.layers", 3),
            (MLP, &[("[784, 256, 128, 10]", "[784]")], "model.layers", 3),
            (MLP, &[("10]\n", "10]\nfeatures = 3\n")], "model.features", 4),
            (MLP, &[("samples = 60000", TENSOR_FOR_MLP)], "tensor[0]", 17),
            (MLP, &[("kind = \"mlp\"\nlayers = [784, 256, 128, 10]", "kind = \"custom\"")], "tensor", 2),
            (LOGREG, &[("features = 126", "features = 0")], "model.features", 3),
            (LOGREG, &[("features = 126", "features = \"auto\""), ("\"libsvm\"", "\"idx\"")], "model.features", 3),
            // Tensors.
            (CUSTOM, &[("name = \"fc1.bias\"", "name = \"fc1.weight\"")], "tensor[1].name", 21),
            (CUSTOM, &[("name = \"fc1.bias\"", "name = \"fc1 bias\"")], "tensor[1].name", 21),
            (CUSTOM, &[("shape = [128]", "shape = [128, 0]")], "tensor[1].shape", 22),
            (CUSTOM, &[("shape = [128]", "shape = []")], "tensor[1].shape", 22),
            (CUSTOM, &[("shape = [784, 128]", "shape = [65536, 32769]")], "tensor[0].shape", 17),
            (CUSTOM, &[("init = \"zeros\"", "init = \"xavier\"")], "tensor[1].init", 23),
            (CUSTOM, &[("init = \"zeros\"", "init = \"uniform\"")], "tensor[1].scale", 23),
            (CUSTOM, &[("init = \"zeros\"", "init = \"normal\"\nscale = 0.0")], "tensor[1].scale", 24),
            (CUSTOM, &[("init = \"zeros\"", "init = \"zeros\"\nscale = 0.1")], "tensor[1].scale", 24),
            (CUSTOM, &[("init = \"zeros\"", "init = \"constant\"\nvalue = nan")], "tensor[1].value", 24),
            // Optimizer.
            (MLP, &[("lr = 0.1", "lr = -0.1")], "optimizer.lr", 7),
            (MLP, &[("kind = \"sgd\"", "kind = \"lamb\"")], "optimizer.kind", 6),
            (MLP, &[("lr = 0.1", "lr = 0.1\nnesterov = true")], "optimizer", 6),
            (MLP, &[("lr = 0.1", "lr = 0.1\namsgrad = true")], "optimizer.amsgrad", 8),
            (MLP, &[("lr = 0.1", "lr = 0.1\nmomentum = true")], "optimizer.momentum", 8),
            (MLP, &[("lr = 0.1", "lr = 0.1\nnesterov = 1")], "optimizer.nesterov", 8),
            (MLP, &[("lr = 0.1", "lr = 0.1\nbetas = [0.9, 0.99]")], "optimizer.betas", 8),
            (MLP, &[("kind = \"sgd\"", "kind = \"adam\""), ("lr = 0.1", "lr = 0.1\neps = 0.0")], "optimizer.eps", 8),
            (LOGREG, &[("momentum = 0.9", "momentum = 1.0")], "optimizer.momentum", 8),
            (LOGREG, &[("momentum = 0.9", "beta1 = 0.9")], "optimizer.beta1", 8),
            // Training.
            (MLP, &[("\"ssp:2\"", "\"ssp:x\"")], "training.consistency", 10),
            (MLP, &[("batch_size = 64", "batch_size = 0")], "training.batch_size", 11),
            (MLP, &[("epochs = 3", "epochs = 0")], "training.epochs", 12),
            (MLP, &[("samples = 60000", "samples = 0")], "training.samples", 13),
            (MLP, &[("samples = 60000", "samples = \"auto\"")], "training.samples", 13),
            (MLP, &[("samples = 60000", "samples = \"many\"")], "training.samples", 13),
            (MLP, &[("samples = 60000", "samples = 60000\nlease_ms = 50")], "training.lease_ms", 14),
            (MLP, &[("samples = 60000", "samples = 60000\nchunk_size = 0")], "training.chunk_size", 14),
            (MLP, &[("samples = 60000", "samples = 60000\npartition_size = 0")], "training.partition_size", 14),
            (MLP, &[("samples = 60000", "samples = 60000\nreplicas = 0")], "training.replicas", 14),
            (MLP, &[("samples = 60000", "samples = 60000\nreplicas = 9")], "training.replicas", 14),
            (MLP, &[("samples = 60000", "samples = 60000\nwire = \"int8\"")], "training.wire", 14),
            // Data.
            (LOGREG, &[("\"libsvm\"", "\"csv\"")], "data.format", 16),
            (LOGREG, &[("\"/data/agaricus.txt.train\"", "\"\"")], "data.train", 17),
            (LOGREG, &[("format = \"libsvm\"\n", "")], "data.format", 15),
        ];
        for (base, edits, field, line) in cases {
            let text = with(base, edits);
            match parse(&text, Path::new("job.toml")) {
                Err(e @ JobFileError::Invalid { .. }) => {
                    let JobFileError::Invalid {
                        field: got_field,
                        line: got_line,
                        message,
                        ..
                    } = &e
                    else {
                        unreachable!()
                    };
                    assert_eq!(
                        (got_field.as_str(), *got_line),
                        (*field, Some(*line)),
                        "{edits:?}: {e}"
                    );
                    assert!(!message.is_empty());
                    assert!(
                        e.to_string()
                            .starts_with(&format!("job.toml:{line}: {field}: ")),
                        "{e}"
                    );
                }
                other => panic!("{edits:?}: expected an error at {field}, got {other:?}"),
            }
        }
        let e = parse(
            &with(CUSTOM, &[("shape = [784, 128]", "shape = [65536, 32769]")]),
            Path::new("j"),
        );
        assert!(format!("{e:?}").contains("2147483648"), "{e:?}");
    }

    #[test]
    fn a_missing_table_or_file_is_named() {
        match parse("[training]\nepochs = 3\n", Path::new("job.toml")) {
            Err(e @ JobFileError::Invalid { line: None, .. }) => {
                assert_eq!(e.to_string(), "job.toml: model: missing field `model`");
            }
            other => panic!("{other:?}"),
        }
        let missing = Path::new("/nonexistent/edl/job.toml");
        assert!(matches!(load(missing), Err(JobFileError::Io { .. })));
    }

    #[test]
    fn to_toml_round_trips() {
        let mut mlp = job(MLP);
        mlp.optimizer = OptimizerSpec::Adam {
            lr: 3e-4,
            beta1: 0.85,
            beta2: 0.995,
            eps: 1e-7,
            weight_decay: 0.01,
            amsgrad: true,
            decoupled: true,
        };
        mlp.data = Some(DataSpec {
            format: DataFormat::Idx,
            train: "/usr/share/datasets/fashion-mnist/train".into(),
            test: "/usr/share/datasets/fashion-mnist/t10k".into(),
        });
        let mut custom = job(CUSTOM);
        custom.seed = u64::MAX;
        custom.tensors.extend([
            TensorSpec {
                name: "odd\"name\\".into(),
                shape: vec![2, 3, 4],
                init: Init::Normal { std: 0.123_456_79 },
            },
            TensorSpec {
                name: "scale".into(),
                shape: vec![1],
                init: Init::Constant { value: -1.5e-20 },
            },
            TensorSpec {
                name: "big".into(),
                shape: vec![7],
                init: Init::Uniform { limit: 3.0e20 },
            },
        ]);
        for job in [mlp, self::job(LOGREG), custom] {
            let text = to_toml(&job);
            let back = parse(&text, Path::new("job.toml"))
                .unwrap_or_else(|e| panic!("{e}\n--- in ---\n{text}"));
            assert_eq!(back, job, "\n{text}");
        }
    }

    #[test]
    fn describe_lists_tensors_and_totals() {
        let text = describe(&job(CUSTOM));
        for part in [
            "custom",
            "sgd, lr 0.05, momentum 0.9",
            "bsp",
            "fc1.weight",
            "[784, 128]",
            "fc1.bias",
            // 784 * 128 + 128 floats in 7 + 1 keys of 16384.
            "100480 parameters",
            "401920 bytes (392.5 KiB)",
            "8 keys",
        ] {
            assert!(text.contains(part), "{part:?} missing from\n{text}");
        }
        let bias = text
            .lines()
            .find(|l| l.starts_with("fc1.bias"))
            .expect("a row for fc1.bias");
        // Offset 100352, 128 floats, 1 key.
        let cells: Vec<&str> = bias.split_whitespace().collect();
        assert_eq!(cells[cells.len() - 3..], ["100352", "128", "1"], "{bias}");
    }

    #[test]
    fn example_job_files_parse() -> anyhow::Result<()> {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/jobs"));
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|p| p.extension().is_some_and(|e| e == "toml"));
        files.sort();
        let mut parsed = 0;
        for file in &files {
            let name = file
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            let agaricus = dir.join("../data/agaricus/agaricus.txt.train");
            if name.starts_with("agaricus") && !agaricus.exists() {
                eprintln!(
                    "{} is missing: checking {name} on stand-in data",
                    agaricus.display()
                );
                let tmp = tempfile::tempdir()?;
                std::fs::create_dir_all(tmp.path().join("jobs"))?;
                std::fs::create_dir_all(tmp.path().join("data/agaricus"))?;
                std::fs::write(
                    tmp.path().join("data/agaricus/agaricus.txt.train"),
                    "1 3:1 10:1 126:1\n0 1:1 9:1\n",
                )?;
                std::fs::copy(file, tmp.path().join("jobs").join(name))?;
                let job = load(&tmp.path().join("jobs").join(name))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                assert_eq!(job.model, LogReg { features: 126 }.section());
                assert_eq!(job.train_samples, 2);
                parsed += 1;
                continue;
            }
            let job = load(file).map_err(|e| anyhow::anyhow!("{e}"))?;
            match name {
                "mlp.toml" => {
                    let layers = vec![784, 256, 128, 10];
                    assert_eq!(job.model, Mlp { layers }.section());
                }
                "two-layer.toml" => {
                    assert_eq!(job.model, ModelSection::custom());
                    let names: Vec<&str> = job.tensors.iter().map(|t| t.name.as_str()).collect();
                    assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
                }
                "agaricus-logreg.toml" => {
                    assert!(LogReg::from_section(&job.model).is_ok_and(|m| m.features > 0));
                }
                _ => {}
            }
            parsed += 1;
        }
        assert!(
            files.len() >= 3,
            "expected the example job files in {}",
            dir.display()
        );
        assert_eq!(parsed, files.len());
        Ok(())
    }
}
