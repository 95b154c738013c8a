//! Job configuration (model tensors, optimizer, consistency), the key layout that cuts tensors
//! into chunks, and the versioned shard map that places key ranges on shards.

use std::fmt;
use std::str::FromStr;

use crate::ids::{Key, MapEpoch, ShardId};

/// How a tensor's initial values are drawn. Shards initialize each chunk from a generator
/// seeded by the job seed and the chunk's key, so values do not depend on placement.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Init {
    /// All zeros (biases, counters).
    Zeros,
    /// Uniform in `[-limit, limit]` (Glorot/Xavier when `limit = sqrt(6 / (fan_in + fan_out))`).
    Uniform {
        /// Half-width of the interval.
        limit: f32,
    },
    /// Every element `value`.
    Constant {
        /// The value.
        value: f32,
    },
    /// Normal with mean 0 and standard deviation `std` (He when `std = sqrt(2 / fan_in)`).
    Normal {
        /// The standard deviation.
        std: f32,
    },
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => write!(f, "zeros"),
            Init::Uniform { limit } => write!(f, "uniform(±{limit})"),
            Init::Constant { value } => write!(f, "constant({value})"),
            Init::Normal { std } => write!(f, "normal(std {std})"),
        }
    }
}

/// One named tensor of the model.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TensorSpec {
    /// A stable name, e.g. `fc0.weight`.
    pub name: String,
    /// The shape; the element count is the product.
    pub shape: Vec<u32>,
    /// How the tensor starts.
    pub init: Init,
}

impl TensorSpec {
    /// Number of f32 elements. The product saturates at `u64::MAX` instead of overflowing: a
    /// shape arrives in headers, and an absurd one must not panic the peer that reads it.
    pub fn len(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)))
    }

    /// True when the tensor holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The model a job trains, as the wire carries it: a kind and its settings, which only the
/// model registry (`edl-models`, beside the worker) reads. The wire knows tensors, not models:
/// a built-in model is a kind the registry lists (`mlp`, `logreg`) with its settings as TOML
/// text (e.g. `layers = [784, 256, 10]`), and a `custom` model is the tensors alone, defined
/// by the application (a model built with the client library, a PyTorch module) or by tests.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ModelSection {
    /// The model's kind: a built-in model's name, or [`ModelSection::CUSTOM`].
    pub kind: String,
    /// The kind's settings, a TOML table's body (empty for a custom model).
    pub settings: String,
}

impl ModelSection {
    /// The kind of a model defined by its tensors alone.
    pub const CUSTOM: &str = "custom";

    /// A model defined by its tensors alone.
    pub fn custom() -> ModelSection {
        ModelSection {
            kind: ModelSection::CUSTOM.to_string(),
            settings: String::new(),
        }
    }

    /// Whether the model is defined by its tensors alone.
    pub fn is_custom(&self) -> bool {
        self.kind == ModelSection::CUSTOM
    }
}

impl fmt::Display for ModelSection {
    /// The kind, and the settings on one line; the registry describes built-in models better.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settings: Vec<&str> = self
            .settings
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        if settings.is_empty() {
            write!(f, "{}", self.kind)
        } else {
            write!(f, "{} ({})", self.kind, settings.join(", "))
        }
    }
}

/// The format of a job's data files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum DataFormat {
    /// Labelled images in idx files: `PREFIX-images-idx3-ubyte` and
    /// `PREFIX-labels-idx1-ubyte` (each optionally gzip-compressed, with a `.gz` suffix), as
    /// MNIST and Fashion-MNIST ship them.
    Idx,
    /// Sparse labelled rows in LIBSVM text format (`LABEL INDEX:VALUE ...`, 1-based indices).
    LibSvm,
}

impl fmt::Display for DataFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataFormat::Idx => write!(f, "idx"),
            DataFormat::LibSvm => write!(f, "libsvm"),
        }
    }
}

/// Where a job's data lies, as the job file named it: workers read it from there unless told
/// otherwise.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct DataSpec {
    /// The file format.
    pub format: DataFormat,
    /// The training data: an idx prefix (e.g. `/usr/share/datasets/fashion-mnist/train`) or a
    /// LIBSVM file.
    pub train: String,
    /// The test data, in the same form (empty when there is none).
    pub test: String,
}

/// The server-side optimizer that shards apply to pushed gradients: torch.optim's algorithms
/// with their arguments, names and defaults, computed as PyTorch computes them (the
/// hyperparameters are doubles, as Python's floats are, and what is derived from them is
/// computed in double before it meets the f32 parameters). A "step" is one update of a chunk:
/// one push under ASP and SSP, one aggregated step under BSP.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum OptimizerSpec {
    /// `torch.optim.SGD`: weight decay, then momentum (the first step's buffer is the
    /// gradient; later `b = momentum * b + (1 - dampening) * g`), Nesterov or not.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0: plain SGD).
        momentum: f64,
        /// Dampening of the momentum.
        dampening: f64,
        /// Nesterov momentum (needs momentum > 0 and no dampening).
        nesterov: bool,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// `torch.optim.Adam` (L2 weight decay added to the gradient) or, with `decoupled`,
    /// `torch.optim.AdamW` (parameters shrunk by `lr * weight_decay` first); bias-corrected,
    /// counted per chunk in applied updates.
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        eps: f64,
        /// Weight decay.
        weight_decay: f64,
        /// AMSGrad: the running maximum of the second moment normalizes.
        amsgrad: bool,
        /// AdamW's decoupled weight decay.
        decoupled: bool,
    },
    /// `torch.optim.Adagrad`.
    Adagrad {
        /// Learning rate.
        lr: f64,
        /// Learning-rate decay per step.
        lr_decay: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// The accumulator's starting value.
        initial_accumulator_value: f64,
        /// Denominator epsilon.
        eps: f64,
    },
    /// `torch.optim.RMSprop`.
    RmsProp {
        /// Learning rate.
        lr: f64,
        /// Smoothing constant of the squared-gradient average.
        alpha: f64,
        /// Denominator epsilon.
        eps: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Momentum factor (0: none).
        momentum: f64,
        /// Centered: normalize by the estimated variance.
        centered: bool,
    },
    /// `torch.optim.Adadelta`.
    Adadelta {
        /// Learning rate (scales the delta).
        lr: f64,
        /// Decay of the running averages.
        rho: f64,
        /// Epsilon inside the square roots.
        eps: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
}

/// Where one optimizer setting lies in a spec, to read or write it.
enum Slot<'a> {
    Number(&'a mut f64),
    Flag(&'a mut bool),
}

impl OptimizerSpec {
    /// The optimizer kinds, as job files and the text form name them.
    pub const KINDS: &[&str] = &[
        "sgd", "momentum", "adam", "adamw", "adagrad", "rmsprop", "adadelta",
    ];

    /// Plain SGD.
    pub fn sgd(lr: f64) -> OptimizerSpec {
        OptimizerSpec::Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    /// SGD with heavy-ball momentum.
    pub fn momentum(lr: f64, momentum: f64) -> OptimizerSpec {
        OptimizerSpec::Sgd {
            lr,
            momentum,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    /// Adam with PyTorch's defaults but the learning rate.
    pub fn adam(lr: f64) -> OptimizerSpec {
        OptimizerSpec::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            decoupled: false,
        }
    }

    /// `kind` with PyTorch's defaults (`momentum` is SGD with momentum 0.9; SGD's learning
    /// rate, which PyTorch requires, is 0.1).
    pub fn defaults(kind: &str) -> Option<OptimizerSpec> {
        Some(match kind {
            "sgd" => OptimizerSpec::sgd(0.1),
            "momentum" => OptimizerSpec::momentum(0.05, 0.9),
            "adam" => OptimizerSpec::adam(0.001),
            "adamw" => OptimizerSpec::Adam {
                lr: 0.001,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                amsgrad: false,
                decoupled: true,
            },
            "adagrad" => OptimizerSpec::Adagrad {
                lr: 0.01,
                lr_decay: 0.0,
                weight_decay: 0.0,
                initial_accumulator_value: 0.0,
                eps: 1e-10,
            },
            "rmsprop" => OptimizerSpec::RmsProp {
                lr: 0.01,
                alpha: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                momentum: 0.0,
                centered: false,
            },
            "adadelta" => OptimizerSpec::Adadelta {
                lr: 1.0,
                rho: 0.9,
                eps: 1e-6,
                weight_decay: 0.0,
            },
            _ => return None,
        })
    }

    /// The kind's name (`adamw` for Adam with decoupled weight decay).
    pub fn kind(&self) -> &'static str {
        match self {
            OptimizerSpec::Sgd { .. } => "sgd",
            OptimizerSpec::Adam {
                decoupled: false, ..
            } => "adam",
            OptimizerSpec::Adam { .. } => "adamw",
            OptimizerSpec::Adagrad { .. } => "adagrad",
            OptimizerSpec::RmsProp { .. } => "rmsprop",
            OptimizerSpec::Adadelta { .. } => "adadelta",
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerSpec::Sgd { lr, .. }
            | OptimizerSpec::Adam { lr, .. }
            | OptimizerSpec::Adagrad { lr, .. }
            | OptimizerSpec::RmsProp { lr, .. }
            | OptimizerSpec::Adadelta { lr, .. } => lr,
        }
    }

    /// Every setting of the kind, the learning rate first, in a fixed order: the one table
    /// the text form, job files and their checks read and write.
    fn slots(&mut self) -> Vec<(&'static str, Slot<'_>)> {
        use Slot::{Flag, Number};
        match self {
            OptimizerSpec::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => vec![
                ("lr", Number(lr)),
                ("momentum", Number(momentum)),
                ("dampening", Number(dampening)),
                ("nesterov", Flag(nesterov)),
                ("weight_decay", Number(weight_decay)),
            ],
            OptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
                decoupled: _,
            } => vec![
                ("lr", Number(lr)),
                ("beta1", Number(beta1)),
                ("beta2", Number(beta2)),
                ("eps", Number(eps)),
                ("weight_decay", Number(weight_decay)),
                ("amsgrad", Flag(amsgrad)),
            ],
            OptimizerSpec::Adagrad {
                lr,
                lr_decay,
                weight_decay,
                initial_accumulator_value,
                eps,
            } => vec![
                ("lr", Number(lr)),
                ("lr_decay", Number(lr_decay)),
                ("weight_decay", Number(weight_decay)),
                (
                    "initial_accumulator_value",
                    Number(initial_accumulator_value),
                ),
                ("eps", Number(eps)),
            ],
            OptimizerSpec::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            } => vec![
                ("lr", Number(lr)),
                ("alpha", Number(alpha)),
                ("eps", Number(eps)),
                ("weight_decay", Number(weight_decay)),
                ("momentum", Number(momentum)),
                ("centered", Flag(centered)),
            ],
            OptimizerSpec::Adadelta {
                lr,
                rho,
                eps,
                weight_decay,
            } => vec![
                ("lr", Number(lr)),
                ("rho", Number(rho)),
                ("eps", Number(eps)),
                ("weight_decay", Number(weight_decay)),
            ],
        }
    }

    /// The settings besides the learning rate as `(key, value)`, the value as the text form
    /// and job files write it (`0.9`, `true`).
    pub fn settings_text(&self) -> Vec<(&'static str, String)> {
        let mut read = self.clone();
        read.slots()
            .into_iter()
            .skip(1)
            .map(|(key, slot)| {
                let v = match slot {
                    Slot::Number(x) => format!("{x:?}"),
                    Slot::Flag(b) => b.to_string(),
                };
                (key, v)
            })
            .collect()
    }

    /// [`OptimizerSpec::settings_text`] less what equals the kind's default.
    pub fn changed_settings(&self) -> Vec<(&'static str, String)> {
        let defaults = OptimizerSpec::defaults(self.kind())
            .map(|d| d.settings_text())
            .unwrap_or_default();
        self.settings_text()
            .into_iter()
            .zip(defaults)
            .filter(|(s, d)| s.1 != d.1)
            .map(|(s, _)| s)
            .collect()
    }

    /// The keys `kind` takes besides `kind` and `lr` (for job files' checks).
    pub fn keys(kind: &str) -> Vec<&'static str> {
        OptimizerSpec::defaults(kind)
            .map(|mut o| o.slots().into_iter().skip(1).map(|(k, _)| k).collect())
            .unwrap_or_default()
    }

    /// Sets `key` (a key of [`OptimizerSpec::keys`] or `lr`) from a number (`Ok(false)`:
    /// not a key of this kind); checks the value's range as PyTorch does.
    pub fn set_number(&mut self, key: &str, x: f64) -> Result<bool, String> {
        let Some(slot) = self.slots().into_iter().find_map(|(k, slot)| match slot {
            Slot::Number(x) if k == key => Some(x),
            _ => None,
        }) else {
            return Ok(false);
        };
        let unit = matches!(key, "beta1" | "beta2" | "alpha" | "rho" | "dampening");
        // Stricter than PyTorch where a value could only diverge: eps > 0, momentum < 1.
        let ok = x.is_finite()
            && x >= 0.0
            && match key {
                "beta1" | "beta2" | "momentum" => x < 1.0,
                "alpha" | "rho" | "dampening" => x <= 1.0,
                "eps" => x > 0.0,
                _ => true,
            };
        if !ok {
            let rule = match key {
                "beta1" | "beta2" | "momentum" => "must be in [0, 1)",
                _ if unit => "must be in [0, 1]",
                "eps" => "must be finite and > 0",
                _ => "must be finite and >= 0",
            };
            return Err(format!("{key} = {x} is out of range: {rule}"));
        }
        *slot = x;
        Ok(true)
    }

    /// Sets flag `key` (`Ok(false)`: not a flag of this kind).
    pub fn set_flag(&mut self, key: &str, on: bool) -> Result<bool, String> {
        let Some(slot) = self.slots().into_iter().find_map(|(k, slot)| match slot {
            Slot::Flag(b) if k == key => Some(b),
            _ => None,
        }) else {
            return Ok(false);
        };
        *slot = on;
        Ok(true)
    }

    /// Checks what PyTorch refuses across settings.
    pub fn check(&self) -> Result<(), String> {
        if let OptimizerSpec::Sgd {
            momentum,
            dampening,
            nesterov: true,
            ..
        } = *self
            && (momentum <= 0.0 || dampening != 0.0)
        {
            return Err("nesterov needs momentum > 0 and dampening = 0".into());
        }
        Ok(())
    }
}

impl FromStr for OptimizerSpec {
    type Err = String;

    /// Parses `KIND[:LR][,KEY=VALUE...]` (e.g. `adamw:0.001,weight_decay=0.05`,
    /// `sgd:0.1,momentum=0.9,nesterov=true`); `momentum:LR:M` is SGD with momentum M.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let head = parts.next().unwrap_or_default();
        let mut fields = head.split(':');
        let kind = fields.next().unwrap_or_default();
        let Some(mut spec) = OptimizerSpec::defaults(kind) else {
            return Err(format!(
                "unknown optimizer {s:?}: use KIND[:LR][,KEY=VALUE...] with KIND one of {}",
                OptimizerSpec::KINDS.join(", ")
            ));
        };
        let number = |v: &str| -> Result<f64, String> {
            v.parse::<f64>()
                .map_err(|_| format!("bad number {v:?} in optimizer {s:?}"))
        };
        if let Some(lr) = fields.next() {
            spec.set_number("lr", number(lr)?)
                .map_err(|e| format!("{e} in optimizer {s:?}"))?;
        }
        if let Some(m) = fields.next() {
            if kind != "momentum" {
                return Err(format!("too many fields in optimizer {s:?}"));
            }
            spec.set_number("momentum", number(m)?)
                .map_err(|e| format!("{e} in optimizer {s:?}"))?;
        }
        if fields.next().is_some() {
            return Err(format!("too many fields in optimizer {s:?}"));
        }
        for part in parts {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("{part:?} is not KEY=VALUE in optimizer {s:?}"));
            };
            let known = match value {
                "true" | "false" => spec.set_flag(key, value == "true")?,
                v => spec
                    .set_number(key, number(v)?)
                    .map_err(|e| format!("{e} in optimizer {s:?}"))?,
            };
            if !known {
                return Err(format!(
                    "{key:?} is not a setting of {} (it takes lr, {})",
                    spec.kind(),
                    OptimizerSpec::keys(spec.kind()).join(", ")
                ));
            }
        }
        spec.check()
            .map_err(|e| format!("{e} in optimizer {s:?}"))?;
        Ok(spec)
    }
}

impl fmt::Display for OptimizerSpec {
    /// `KIND:LR` and every setting that differs from the kind's default, as `,KEY=VALUE`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind(), self.lr())?;
        for (key, value) in self.changed_settings() {
            write!(f, ",{key}={value}")?;
        }
        Ok(())
    }
}

/// The consistency model shards and coordinator enforce between workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Consistency {
    /// Asynchronous: pushes apply on arrival, nobody waits.
    Asp,
    /// Stale-synchronous: a worker at clock `c` proceeds only while the slowest active worker
    /// is at clock `>= c - staleness`.
    Ssp {
        /// The staleness bound `s`.
        staleness: u32,
    },
    /// Bulk-synchronous: SSP(0) with aggregation; the update of step `t` is applied once every
    /// worker active at step `t` has pushed (or left).
    Bsp,
}

impl Consistency {
    /// The staleness bound, or `None` for ASP.
    pub fn staleness(self) -> Option<u64> {
        match self {
            Consistency::Asp => None,
            Consistency::Ssp { staleness } => Some(u64::from(staleness)),
            Consistency::Bsp => Some(0),
        }
    }
}

impl FromStr for Consistency {
    type Err = String;

    /// Parses `asp`, `bsp` or `ssp:S`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "asp" => Ok(Consistency::Asp),
            "bsp" => Ok(Consistency::Bsp),
            _ => match s.strip_prefix("ssp:") {
                Some(n) => n
                    .parse()
                    .map(|staleness| Consistency::Ssp { staleness })
                    .map_err(|_| format!("bad staleness in {s:?}: expected ssp:N")),
                None => Err(format!("unknown consistency {s:?}: use asp, ssp:S or bsp")),
            },
        }
    }
}

impl fmt::Display for Consistency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Consistency::Asp => write!(f, "asp"),
            Consistency::Ssp { staleness } => write!(f, "ssp:{staleness}"),
            Consistency::Bsp => write!(f, "bsp"),
        }
    }
}

/// Everything a shard and a worker must agree on about a job.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct JobConfig {
    /// The model the workers train.
    pub model: ModelSection,
    /// The parameter tensors, in key order.
    pub tensors: Vec<TensorSpec>,
    /// Floats per key: tensors are cut into chunks of this size (the last chunk may be shorter).
    pub chunk_size: u32,
    /// The server-side optimizer.
    pub optimizer: OptimizerSpec,
    /// Per-tensor settings (PyTorch's parameter groups): a tensor a group names is updated
    /// with the group's optimizer instead of `optimizer`.
    pub optimizer_groups: Vec<OptimizerGroup>,
    /// How the learning rate of every group moves over the job (constant by default).
    pub schedule: crate::LrSchedule,
    /// The consistency model.
    pub consistency: Consistency,
    /// Samples per mini-batch.
    pub batch_size: u32,
    /// Passes over the training data.
    pub epochs: u32,
    /// Samples per data partition handed to a worker.
    pub partition_size: u32,
    /// Number of training samples used per epoch.
    pub train_samples: u32,
    /// Seed for initialization and the per-epoch data order.
    pub seed: u64,
    /// Worker heartbeat lease in milliseconds; a worker silent this long is declared dead.
    pub lease_ms: u32,
    /// Copies of every key range (1: no replication): a primary and `replicas - 1` backups on
    /// other shards ([`ShardMap::backups`]).
    pub replicas: u32,
    /// How pushes and pulls travel ([`crate::WireSpec`]): the precision of their values, and
    /// whether pushes are top-k sparsified. Shards keep f32 whatever it is.
    pub wire: crate::WireSpec,
    /// Tensors that travel at a wire of their own instead of `wire` (a job file's
    /// `[[tensor]] wire`): a tensor is named once at most.
    pub tensor_wires: Vec<TensorWire>,
    /// Where the data lies, when the job says (a job file's `[data]`); workers may be told
    /// otherwise.
    pub data: Option<DataSpec>,
}

/// A tensor that travels at a wire of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TensorWire {
    /// The tensor's index in the job's tensors.
    pub tensor: u32,
    /// How its pushes and pulls travel.
    pub wire: crate::WireSpec,
}

/// A parameter group: tensors updated with their own optimizer settings.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct OptimizerGroup {
    /// Indices into the job's tensors; a tensor is in one group at most.
    pub tensors: Vec<u32>,
    /// Their optimizer (the job's kind, with the group's settings).
    pub optimizer: OptimizerSpec,
}

impl JobConfig {
    /// The optimizer of tensor `tensor`: its group's, or the job's.
    pub fn optimizer_of(&self, tensor: usize) -> &OptimizerSpec {
        self.group_optimizer(self.group_of(tensor))
    }

    /// The parameter group tensor `tensor` is in, if any (an index into `optimizer_groups`,
    /// for holders to look up once and keep).
    pub fn group_of(&self, tensor: usize) -> Option<usize> {
        self.optimizer_groups
            .iter()
            .position(|g| g.tensors.iter().any(|&t| t as usize == tensor))
    }

    /// The optimizer of group `group` ([`JobConfig::group_of`]), or the job's for none.
    pub fn group_optimizer(&self, group: Option<usize>) -> &OptimizerSpec {
        group
            .and_then(|g| self.optimizer_groups.get(g))
            .map_or(&self.optimizer, |g| &g.optimizer)
    }

    /// How tensor `tensor`'s pushes and pulls travel: its own wire, or the job's.
    pub fn wire_of(&self, tensor: usize) -> crate::WireSpec {
        self.tensor_wires
            .iter()
            .find(|w| w.tensor as usize == tensor)
            .map_or(self.wire, |w| w.wire)
    }

    /// Every tensor's wire ([`JobConfig::wire_of`]), in tensor order.
    pub fn wires(&self) -> Vec<crate::WireSpec> {
        (0..self.tensors.len()).map(|t| self.wire_of(t)).collect()
    }

    /// Checks [`JobConfig::schedule`] against the consistency model and the optimizers.
    pub fn check_schedule(&self) -> Result<(), String> {
        let groups = self.optimizer_groups.iter().map(|g| &g.optimizer);
        self.schedule.check(
            self.consistency,
            std::iter::once(&self.optimizer).chain(groups),
        )
    }

    /// The index of the tensor called `name`.
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    /// Cuts the tensors into keys.
    pub fn layout(&self) -> KeyLayout {
        KeyLayout::new(&self.tensors, self.chunk_size)
    }
}

/// One key's place in the flat parameter vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySpan {
    /// The key.
    pub key: Key,
    /// Index of the tensor the chunk belongs to.
    pub tensor: usize,
    /// Offset of the chunk's first float in the flat parameter vector.
    pub offset: u64,
    /// Number of floats in the chunk.
    pub len: u32,
}

/// The mapping from keys to chunks of the flat parameter vector (all tensors concatenated in
/// order). Key `k` is the `k`-th chunk counting across tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyLayout {
    spans: Vec<KeySpan>,
    total: u64,
}

impl KeyLayout {
    /// Builds the layout; a chunk size of 0 is treated as 1.
    pub fn new(tensors: &[TensorSpec], chunk_size: u32) -> Self {
        let chunk = u64::from(chunk_size.max(1));
        let mut spans = Vec::new();
        let mut offset = 0u64;
        for (t, spec) in tensors.iter().enumerate() {
            let len = spec.len();
            let mut start = 0;
            while start < len {
                let n = chunk.min(len - start);
                spans.push(KeySpan {
                    key: Key(spans.len() as u64),
                    tensor: t,
                    offset: offset + start,
                    len: n as u32,
                });
                start += n;
            }
            offset += len;
        }
        KeyLayout {
            spans,
            total: offset,
        }
    }

    /// Number of keys.
    pub fn num_keys(&self) -> u64 {
        self.spans.len() as u64
    }

    /// Total floats across all tensors.
    pub fn total_len(&self) -> u64 {
        self.total
    }

    /// The span of one key, or `None` if the key is not part of the job.
    pub fn span(&self, key: Key) -> Option<&KeySpan> {
        usize::try_from(key.0).ok().and_then(|i| self.spans.get(i))
    }

    /// All spans in key order.
    pub fn spans(&self) -> &[KeySpan] {
        &self.spans
    }
}

/// Maximal runs of keys (0, 1, ...) with the same shard, skipping keys with none.
fn runs(shards: impl Iterator<Item = Option<ShardId>>) -> Vec<RangeOwner> {
    let mut out: Vec<RangeOwner> = Vec::new();
    for (k, shard) in (0u64..).zip(shards) {
        let Some(shard) = shard else { continue };
        match out.last_mut() {
            Some(last) if last.shard == shard && last.end == k => last.end = k + 1,
            _ => out.push(RangeOwner {
                start: k,
                end: k + 1,
                shard,
            }),
        }
    }
    out
}

/// A shard server known to the coordinator.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShardInfo {
    /// Its id.
    pub id: ShardId,
    /// The address workers connect to.
    pub addr: String,
}

/// A half-open key range `[start, end)` owned by one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RangeOwner {
    /// First key.
    pub start: u64,
    /// One past the last key.
    pub end: u64,
    /// The owning shard.
    pub shard: ShardId,
}

/// The versioned placement of key ranges on shards.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShardMap {
    /// Bumped on every change.
    pub epoch: MapEpoch,
    /// The shard servers.
    pub shards: Vec<ShardInfo>,
    /// Ranges sorted by `start`, covering `[0, num_keys)` without gaps or overlaps: each
    /// range's primary, which serves its pulls and pushes.
    pub ranges: Vec<RangeOwner>,
    /// Replicated jobs: the backup copies, each a range and a shard holding a copy of it (never
    /// its primary). A key's backups, in the order they appear here, are the order in which
    /// they are promoted when its primary dies. Empty without replication.
    pub backups: Vec<RangeOwner>,
}

impl ShardMap {
    /// Places the keys of `layout` on `shards` in contiguous ranges of roughly equal float
    /// counts, so a large tensor is split across shards rather than placed whole on one.
    pub fn balanced(epoch: MapEpoch, shards: Vec<ShardInfo>, layout: &KeyLayout) -> ShardMap {
        let n = shards.len().max(1) as u64;
        let mut ranges: Vec<RangeOwner> = Vec::new();
        let total = layout.total_len().max(1);
        let mut shard_idx = 0u64;
        let mut start = 0u64;
        for span in layout.spans() {
            // Move to the next shard once this one holds its share of floats.
            let target_end = total * (shard_idx + 1) / n;
            if span.offset >= target_end && shard_idx + 1 < n && span.key.0 > start {
                ranges.push(RangeOwner {
                    start,
                    end: span.key.0,
                    shard: shards[shard_idx as usize].id,
                });
                start = span.key.0;
                shard_idx += 1;
            }
        }
        if let Some(last) = shards.get(shard_idx as usize) {
            ranges.push(RangeOwner {
                start,
                end: layout.num_keys(),
                shard: last.id,
            });
        }
        ShardMap {
            epoch,
            shards,
            ranges,
            backups: Vec::new(),
        }
    }

    /// [`ShardMap::balanced`] with `replicas - 1` backups of every range: range `i`'s on the
    /// shards that follow its primary in `shards`, wrapping around. `replicas` is at most the
    /// number of shards.
    pub fn replicated(
        epoch: MapEpoch,
        shards: Vec<ShardInfo>,
        layout: &KeyLayout,
        replicas: u32,
    ) -> ShardMap {
        let mut map = ShardMap::balanced(epoch, shards, layout);
        let ids: Vec<ShardId> = map.shards.iter().map(|s| s.id).collect();
        let copies = (replicas.max(1) as usize).min(ids.len());
        for rank in 1..copies {
            for r in &map.ranges {
                let Some(i) = ids.iter().position(|s| *s == r.shard) else {
                    continue;
                };
                map.backups.push(RangeOwner {
                    shard: ids[(i + rank) % ids.len()],
                    ..*r
                });
            }
        }
        map
    }

    /// The map one epoch later with shard `to` (listed as `to_info` if it was not yet) a
    /// backup of keys `[start, end)` as well, last in their promotion order.
    pub fn with_backup(&self, start: u64, end: u64, to_info: &ShardInfo) -> ShardMap {
        let mut map = self.clone();
        map.epoch = MapEpoch(self.epoch.0 + 1);
        map.backups.push(RangeOwner {
            start,
            end,
            shard: to_info.id,
        });
        if !map.shards.iter().any(|s| s.id == to_info.id) {
            map.shards.push(to_info.clone());
        }
        map
    }

    /// The map one epoch later without `backup` as the backup of any range `primary` is the
    /// primary of; `None` if it is the backup of none.
    pub fn without_backup(&self, primary: ShardId, backup: ShardId) -> Option<ShardMap> {
        let n = self.num_keys();
        let mut backups: Vec<Vec<ShardId>> = Vec::with_capacity(n as usize);
        let mut changed = false;
        for k in 0..n {
            let mut copies: Vec<ShardId> = self.backups_of(Key(k)).collect();
            if self.owner(Key(k)) == Some(primary) && copies.contains(&backup) {
                copies.retain(|s| *s != backup);
                changed = true;
            }
            backups.push(copies);
        }
        if !changed {
            return None;
        }
        let owners = (0..n).map(|k| self.owner(Key(k)));
        Some(self.next_with(runs(owners), &backups))
    }

    /// The map one epoch later with `ranges`, each key's `backups` (in promotion order), and
    /// the shards that hold anything in it.
    fn next_with(&self, ranges: Vec<RangeOwner>, backups: &[Vec<ShardId>]) -> ShardMap {
        let mut map = ShardMap {
            epoch: MapEpoch(self.epoch.0 + 1),
            shards: Vec::new(),
            ranges,
            backups: Vec::new(),
        };
        let deepest = backups.iter().map(Vec::len).max().unwrap_or(0);
        for rank in 0..deepest {
            map.backups
                .extend(runs(backups.iter().map(|b| b.get(rank).copied())));
        }
        map.shards = self
            .shards
            .iter()
            .filter(|s| map.places(s.id))
            .cloned()
            .collect();
        map
    }

    /// The backups of `key`, in promotion order.
    pub fn backups_of(&self, key: Key) -> impl Iterator<Item = ShardId> + '_ {
        self.backups
            .iter()
            .filter(move |r| r.start <= key.0 && key.0 < r.end)
            .map(|r| r.shard)
    }

    /// The ranges `shard` holds backup copies of.
    pub fn backed_by(&self, shard: ShardId) -> impl Iterator<Item = &RangeOwner> {
        self.backups.iter().filter(move |r| r.shard == shard)
    }

    /// Whether `shard` holds a primary range or a backup copy in this map.
    pub fn places(&self, shard: ShardId) -> bool {
        self.ranges_of(shard).next().is_some() || self.backed_by(shard).next().is_some()
    }

    /// The map one epoch later without shard `dead`: each key it was the primary of goes to
    /// the first of the key's backups that is not `dead` nor in `avoid` (shards that may be
    /// dead too: the backup copy is dropped, as it is the primary now), and its backup copies
    /// are dropped, but for keys whose primary is in `avoid` (its copy may be their last). A
    /// key of `dead` without such a backup stays on `dead` (with its other backups). `None` if
    /// that changes nothing (`dead` holds nothing in this map, or only keys without another
    /// copy).
    pub fn without(&self, dead: ShardId, avoid: &[ShardId]) -> Option<ShardMap> {
        if !self.places(dead) {
            return None;
        }
        let n = self.num_keys();
        let mut owners: Vec<ShardId> = Vec::with_capacity(n as usize);
        let mut backups: Vec<Vec<ShardId>> = Vec::with_capacity(n as usize);
        for k in 0..n {
            let mut owner = self.owner(Key(k)).unwrap_or(dead);
            let wary = owner != dead && avoid.contains(&owner);
            let mut copies: Vec<ShardId> = (self.backups_of(Key(k)))
                .filter(|s| *s != dead || wary)
                .collect();
            let next = copies.iter().position(|s| !avoid.contains(s));
            if let (true, Some(i)) = (owner == dead, next) {
                owner = copies.remove(i);
            }
            owners.push(owner);
            backups.push(copies);
        }
        let map = self.next_with(runs(owners.iter().copied().map(Some)), &backups);
        if map.ranges == self.ranges && map.backups == self.backups {
            // Nothing of it had a live backup.
            return None;
        }
        Some(map)
    }

    /// The shard that owns `key`.
    pub fn owner(&self, key: Key) -> Option<ShardId> {
        let i = self.ranges.partition_point(|r| r.end <= key.0);
        self.ranges
            .get(i)
            .filter(|r| r.start <= key.0 && key.0 < r.end)
            .map(|r| r.shard)
    }

    /// The ranges owned by `shard`.
    pub fn ranges_of(&self, shard: ShardId) -> impl Iterator<Item = &RangeOwner> {
        self.ranges.iter().filter(move |r| r.shard == shard)
    }

    /// The address of `shard`.
    pub fn addr_of(&self, shard: ShardId) -> Option<&str> {
        self.shards
            .iter()
            .find(|s| s.id == shard)
            .map(|s| s.addr.as_str())
    }

    /// The number of keys the map covers.
    pub fn num_keys(&self) -> u64 {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// The shards that own at least one range, ordered by where their first range starts.
    pub fn owners_in_order(&self) -> Vec<ShardId> {
        let mut out: Vec<ShardId> = Vec::new();
        for r in &self.ranges {
            if !out.contains(&r.shard) {
                out.push(r.shard);
            }
        }
        out
    }

    /// The map one epoch later, with `[start, end)` owned by `to` (listed in `shards` as
    /// `to_info` if it was not yet) and shards left without ranges dropped from `shards`.
    /// Adjacent ranges of one owner are merged.
    pub fn with_move(&self, start: u64, end: u64, to_info: &ShardInfo) -> ShardMap {
        let mut ranges: Vec<RangeOwner> = Vec::new();
        let mut push = |r: RangeOwner| {
            if r.end <= r.start {
                return;
            }
            match ranges.last_mut() {
                Some(last) if last.shard == r.shard && last.end == r.start => last.end = r.end,
                _ => ranges.push(r),
            }
        };
        for r in &self.ranges {
            let (a, b) = (r.start.max(start), r.end.min(end));
            if a >= b {
                push(*r);
                continue;
            }
            push(RangeOwner { end: a, ..*r });
            push(RangeOwner {
                start: a,
                end: b,
                shard: to_info.id,
            });
            push(RangeOwner { start: b, ..*r });
        }
        let mut shards = self.shards.clone();
        if !shards.iter().any(|s| s.id == to_info.id) {
            shards.push(to_info.clone());
        }
        shards.retain(|s| ranges.iter().any(|r| r.shard == s.id));
        ShardMap {
            epoch: MapEpoch(self.epoch.0 + 1),
            shards,
            ranges,
            backups: self.backups.clone(),
        }
    }

    /// The moves that turn this map's placement into contiguous ranges over `targets` (in
    /// that order) balanced by `weight` per key: each move is `(start, end, from, to)`, a
    /// maximal run of keys that changes owner from one shard to the same other shard. Every
    /// target gets at least one key when there are enough keys.
    pub fn plan_balance(
        &self,
        targets: &[ShardId],
        weight: &[f64],
    ) -> Vec<(u64, u64, ShardId, ShardId)> {
        let n = self.num_keys();
        if targets.is_empty() || n == 0 || weight.len() as u64 != n {
            return Vec::new();
        }
        let total: f64 = weight
            .iter()
            .map(|w| w.max(0.0))
            .sum::<f64>()
            .max(f64::MIN_POSITIVE);
        let parts = targets.len() as u64;
        // Key `k` goes to the part its weight midpoint falls in, advancing at most one part
        // per key (so no part is skipped) and early enough that every later part gets a key.
        let mut target_of = Vec::with_capacity(n as usize);
        let (mut before, mut part, mut in_part) = (0.0, 0u64, 0u64);
        for k in 0..n {
            let w = weight[k as usize].max(0.0);
            let want = (((before + w / 2.0) / total * parts as f64) as u64).min(parts - 1);
            let must = n - k <= parts - 1 - part;
            if (want > part || must) && in_part > 0 && part + 1 < parts {
                part += 1;
                in_part = 0;
            }
            target_of.push(part);
            in_part += 1;
            before += w;
        }
        let mut moves: Vec<(u64, u64, ShardId, ShardId)> = Vec::new();
        for k in 0..n {
            let Some(from) = self.owner(Key(k)) else {
                continue;
            };
            let to = targets[target_of[k as usize] as usize];
            if from == to {
                continue;
            }
            match moves.last_mut() {
                Some(m) if m.1 == k && m.2 == from && m.3 == to => m.1 = k + 1,
                _ => moves.push((k, k + 1, from, to)),
            }
        }
        moves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensors of a perceptron with these widths: a weight and a bias per layer.
    fn dense_layers(widths: &[u32]) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        for (i, w) in widths.windows(2).enumerate() {
            for (name, shape) in [("weight", vec![w[0], w[1]]), ("bias", vec![w[1]])] {
                out.push(TensorSpec {
                    name: format!("fc{i}.{name}"),
                    shape,
                    init: Init::Zeros,
                });
            }
        }
        out
    }

    fn shards(n: u32) -> Vec<ShardInfo> {
        (0..n)
            .map(|i| ShardInfo {
                id: ShardId(i),
                addr: format!("127.0.0.1:{}", 1000 + i),
            })
            .collect()
    }

    #[test]
    fn layout_cuts_tensors_into_chunks() {
        let tensors = dense_layers(&[784, 256, 128, 10]);
        let layout = KeyLayout::new(&tensors, 16384);
        assert_eq!(
            layout.total_len(),
            784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
        );
        // 200704 floats of fc0.weight make 13 chunks, the last one partial.
        let fc0: Vec<_> = layout.spans().iter().filter(|s| s.tensor == 0).collect();
        assert_eq!(fc0.len(), 13);
        assert_eq!(fc0[12].len, 200704 - 12 * 16384);
        let sum: u64 = layout.spans().iter().map(|s| u64::from(s.len)).sum();
        assert_eq!(sum, layout.total_len());
        for w in layout.spans().windows(2) {
            assert_eq!(w[0].offset + u64::from(w[0].len), w[1].offset);
        }
    }

    /// Every key of `map`: its primary first, then its backups in promotion order.
    fn copies(map: &ShardMap) -> Vec<Vec<u32>> {
        (0..map.num_keys())
            .map(|k| {
                map.owner(Key(k))
                    .into_iter()
                    .chain(map.backups_of(Key(k)))
                    .map(|s| s.0)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn replicated_maps_promote_backups_and_drop_and_add_copies() {
        let layout = KeyLayout::new(&dense_layers(&[8, 4]), 6);
        // 36 floats in 7 keys (the weight's 32 in 6, the bias's 4 in 1), 12 floats a shard.
        let map = ShardMap::replicated(MapEpoch(1), shards(3), &layout, 3);
        assert_eq!(
            copies(&map),
            [
                [0, 1, 2],
                [0, 1, 2],
                [1, 2, 0],
                [1, 2, 0],
                [2, 0, 1],
                [2, 0, 1],
                [2, 0, 1]
            ]
        );
        assert!(map.backed_by(ShardId(1)).all(|r| r.shard == ShardId(1)));
        // s1 dies while s2 is silent too: its keys go to their first backup that is not (s0);
        // s1 stays the backup of s2's keys (their copy on s1 may be the last).
        let wary = map
            .without(ShardId(1), &[ShardId(2)])
            .expect("s1 held keys");
        assert_eq!(
            copies(&wary),
            [
                vec![0, 2],
                vec![0, 2],
                vec![0, 2],
                vec![0, 2],
                vec![2, 0, 1],
                vec![2, 0, 1],
                vec![2, 0, 1]
            ]
        );
        // With s0 silent as well, s1's keys have no backup to go to and its copies may be the
        // last of the others' keys: nothing changes.
        assert_eq!(map.without(ShardId(1), &[ShardId(0), ShardId(2)]), None);
        // s1 dies: its keys go to their first backup (s2), its copies go.
        let after = map.without(ShardId(1), &[]).expect("s1 held keys");
        assert_eq!(after.epoch, MapEpoch(2));
        assert_eq!(
            copies(&after),
            [[0, 2], [0, 2], [2, 0], [2, 0], [2, 0], [2, 0], [2, 0]]
        );
        assert!(!after.places(ShardId(1)));
        assert_eq!(after.shards.len(), 2);
        // Then s2: s0 holds everything, alone.
        let last = after.without(ShardId(2), &[]).expect("s2 held keys");
        assert_eq!(copies(&last), vec![vec![0]; 7]);
        // A key without another copy stays on its dead primary: nothing changes.
        assert_eq!(last.without(ShardId(0), &[]), None);
        // s0 cannot reach its backup s2: s2 is dropped for s0's keys only.
        let cut = after
            .without_backup(ShardId(0), ShardId(2))
            .expect("a backup");
        assert_eq!(
            copies(&cut),
            [
                vec![0],
                vec![0],
                vec![2, 0],
                vec![2, 0],
                vec![2, 0],
                vec![2, 0],
                vec![2, 0]
            ]
        );
        assert_eq!(cut.without_backup(ShardId(0), ShardId(2)), None);
        // A new backup of keys 0..2, last in promotion order.
        let seeded = cut.with_backup(0, 2, &shards(3)[1]);
        assert_eq!(copies(&seeded)[..2], [[0, 1], [0, 1]]);
        assert!(seeded.places(ShardId(1)));
    }

    #[test]
    fn balanced_map_splits_large_tensor_and_covers_all_keys() {
        let tensors = dense_layers(&[784, 256, 128, 10]);
        let layout = KeyLayout::new(&tensors, 16384);
        let map = ShardMap::balanced(MapEpoch(1), shards(2), &layout);
        assert_eq!(map.ranges.len(), 2);
        assert_eq!(map.ranges[0].start, 0);
        assert_eq!(map.ranges[1].end, layout.num_keys());
        assert_eq!(map.ranges[0].end, map.ranges[1].start);
        // fc0.weight (keys 0..13) is split across both shards.
        assert_eq!(map.owner(Key(0)), Some(ShardId(0)));
        assert_eq!(map.owner(Key(12)), Some(ShardId(1)));
        assert_eq!(map.owner(Key(layout.num_keys())), None);
    }

    #[test]
    fn more_shards_than_keys_still_covers() {
        let tensors = vec![TensorSpec {
            name: "x".into(),
            shape: vec![10],
            init: Init::Zeros,
        }];
        let layout = KeyLayout::new(&tensors, 4);
        let map = ShardMap::balanced(MapEpoch(1), shards(5), &layout);
        let covered: u64 = map.ranges.iter().map(|r| r.end - r.start).sum();
        assert_eq!(covered, 3);
        for k in 0..3 {
            assert!(map.owner(Key(k)).is_some());
        }
    }

    #[test]
    fn moves_reassign_ranges_and_plans_balance() {
        let tensors = vec![TensorSpec {
            name: "x".into(),
            shape: vec![40],
            init: Init::Zeros,
        }];
        let layout = KeyLayout::new(&tensors, 4);
        let map = ShardMap::balanced(MapEpoch(1), shards(2), &layout);
        assert_eq!(map.num_keys(), 10);
        let s2 = ShardInfo {
            id: ShardId(2),
            addr: "new".into(),
        };
        let moved = map.with_move(3, 7, &s2);
        assert_eq!(moved.epoch, MapEpoch(2));
        let owners: Vec<u32> = (0..10)
            .map(|k| moved.owner(Key(k)).expect("covered").0)
            .collect();
        assert_eq!(owners, [0, 0, 0, 2, 2, 2, 2, 1, 1, 1]);
        assert_eq!(moved.addr_of(ShardId(2)), Some("new"));
        // Moving a shard's last keys away drops it from the map; adjacent ranges merge.
        let back = moved.with_move(3, 7, &shards(2)[0]);
        assert!(back.addr_of(ShardId(2)).is_none());
        assert_eq!(back.ranges.len(), 2);

        let sizes = vec![1.0; 10];
        let plan = map.plan_balance(&[ShardId(0), ShardId(1), ShardId(2)], &sizes);
        let mut after = map.clone();
        for (a, b, from, to) in &plan {
            assert_ne!(from, to);
            let info = if to.0 == 2 {
                s2.clone()
            } else {
                shards(2)[to.0 as usize].clone()
            };
            after = after.with_move(*a, *b, &info);
        }
        let count = |s: u32| {
            (0..10)
                .filter(|k| after.owner(Key(*k)) == Some(ShardId(s)))
                .count()
        };
        assert!((3..=4).contains(&count(0)) && (3..=4).contains(&count(1)));
        assert!((3..=4).contains(&count(2)));
        // A balanced map needs no moves; every target gets a key even with skewed weights.
        assert!(
            after
                .plan_balance(&after.owners_in_order(), &sizes)
                .is_empty()
        );
        let mut skewed = vec![0.0; 10];
        skewed[0] = 100.0;
        let plan = map.plan_balance(&[ShardId(0), ShardId(1)], &skewed);
        assert_eq!(plan, vec![(1, 5, ShardId(0), ShardId(1))]);
    }

    #[test]
    fn parse_consistency_and_optimizer() {
        assert_eq!("ssp:2".parse(), Ok(Consistency::Ssp { staleness: 2 }));
        assert_eq!("bsp".parse(), Ok(Consistency::Bsp));
        assert!("ssp:x".parse::<Consistency>().is_err());
        assert_eq!("sgd:0.5".parse(), Ok(OptimizerSpec::sgd(0.5)));
        assert_eq!(
            "momentum:0.1:0.8".parse(),
            Ok(OptimizerSpec::momentum(0.1, 0.8))
        );
        assert_eq!(
            "sgd:0.1,momentum=0.8".parse::<OptimizerSpec>(),
            Ok(OptimizerSpec::momentum(0.1, 0.8))
        );
        assert!("adam:nan".parse::<OptimizerSpec>().is_err());
        assert!("lamb".parse::<OptimizerSpec>().is_err());
        let adamw: OptimizerSpec = "adamw:0.002,amsgrad=true,weight_decay=0.05"
            .parse()
            .expect("adamw");
        assert_eq!(
            adamw,
            OptimizerSpec::Adam {
                lr: 0.002,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.05,
                amsgrad: true,
                decoupled: true,
            }
        );
        assert_eq!(
            adamw.to_string(),
            "adamw:0.002,weight_decay=0.05,amsgrad=true"
        );
        assert_eq!(OptimizerSpec::adam(0.001).to_string(), "adam:0.001");
        let refused = [
            ("sgd:0.1,nesterov=true", "nesterov needs momentum"),
            ("adam:0.1,beta1=1", "[0, 1)"),
            ("rmsprop:0.1,rho=0.5", "not a setting of rmsprop"),
            ("adadelta:1:2", "too many fields"),
            ("adagrad,eps", "not KEY=VALUE"),
        ];
        for (text, why) in refused {
            let e = text.parse::<OptimizerSpec>().expect_err(text);
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
