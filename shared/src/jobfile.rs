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

mod raw;
mod resolve;
mod spans;
mod worker;
mod write;

use raw::*;
use resolve::*;
use write::*;

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
