//! Learning-rate schedules that shards evaluate from a job's progress: torch.optim.lr_scheduler's
//! curves, counted in applied steps or in epochs, and the learning rate scaled with the number
//! of workers whose gradients an update averages.

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

use crate::job::{Consistency, OptimizerSpec};

/// How the learning rate moves over a job: a curve over the base learning rate (the
/// optimizer's, per parameter group, as PyTorch's `base_lrs`), the unit it counts in, and
/// whether it grows with the workers an update averages.
///
/// What the curve's `n` counts (`by`):
/// - [`ScheduleUnit::Step`]: the updates already applied to a parameter (PyTorch's
///   `state["step"]` before the update; a scheduler stepped once per `optimizer.step()`).
///   Under ASP and SSP one update is one worker's mini-batch, so steps per epoch stay
///   `samples / batch_size` whatever the worker count; under BSP one update is the mean of
///   every active worker's gradient, so steps per epoch shrink as workers join.
/// - [`ScheduleUnit::Epoch`]: the epoch of the samples the gradient came from, from 0 (a
///   scheduler stepped at the end of each epoch). The same under every consistency model and
///   any number of workers.
#[derive(Clone, Debug, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct LrSchedule {
    /// The curve.
    pub curve: Curve,
    /// What its `n` counts.
    pub by: ScheduleUnit,
    /// Growth with the workers an update averages (BSP only).
    pub scale: WorkerScaling,
}

/// What a schedule's `n` counts (see [`LrSchedule`]).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub enum ScheduleUnit {
    /// Updates applied to the parameter before this one.
    #[default]
    Step,
    /// The epoch of the gradient's samples.
    Epoch,
}

/// How the learning rate grows with `k`, the number of workers' gradients a BSP update
/// averages: the update of `k` workers is one step on a batch `k` times larger.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub enum WorkerScaling {
    /// The learning rate is the same for any number of workers.
    #[default]
    None,
    /// Times `k`: the linear scaling rule (Goyal et al., "Accurate, Large Minibatch SGD", 2017).
    Linear,
    /// Times `sqrt(k)`: keeps the update's variance (Krizhevsky, "One weird trick", 2014).
    Sqrt,
}

/// How one-cycle moves between its points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Anneal {
    /// Half a cosine.
    Cos,
    /// A straight line.
    Linear,
}

/// A schedule's curve: the learning rate at `n` from the base learning rate `lr`, as
/// torch.optim.lr_scheduler's class of the same name computes it (its closed form, in double).
#[derive(Clone, Debug, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Curve {
    /// `lr`.
    #[default]
    Constant,
    /// `StepLR`: `lr * gamma^(n / step_size)`.
    Step {
        /// Period of the decay.
        step_size: u64,
        /// Factor per period.
        gamma: f64,
    },
    /// `MultiStepLR`: `lr * gamma^m`, `m` the milestones `<= n` (a repeated one counts again).
    MultiStep {
        /// The milestones, in ascending order.
        milestones: Vec<u64>,
        /// Factor per milestone.
        gamma: f64,
    },
    /// `ExponentialLR`: `lr * gamma^n`.
    Exponential {
        /// Factor per step.
        gamma: f64,
    },
    /// `CosineAnnealingLR`: `eta_min + (lr - eta_min) * (1 + cos(pi * n / T_max)) / 2`.
    Cosine {
        /// Half period.
        t_max: u64,
        /// The floor.
        eta_min: f64,
    },
    /// `LinearLR` (a linear warm-up): `lr` times a factor going from `start_factor` to
    /// `end_factor` over `total_iters`, then staying.
    Linear {
        /// The factor at 0.
        start_factor: f64,
        /// The factor from `total_iters` on.
        end_factor: f64,
        /// Length of the ramp.
        total_iters: u64,
    },
    /// `OneCycleLR` with the optimizer's learning rate as its `max_lr`: from
    /// `lr / div_factor` up to `lr` over the first `pct_start` of `total_steps`, then down to
    /// `lr / div_factor / final_div_factor` (three-phase: back to the start first), with the
    /// momentum (Adam's `beta1`) cycled the other way between `max_momentum` and
    /// `base_momentum`. Past `total_steps` it keeps its last value (PyTorch raises).
    OneCycle {
        /// Length of the cycle.
        total_steps: u64,
        /// Fraction of the cycle spent rising.
        pct_start: f64,
        /// How it moves.
        anneal: Anneal,
        /// The start is the peak over this.
        div_factor: f64,
        /// The end is the start over this.
        final_div_factor: f64,
        /// Rise, fall back to the start, then fall to the end.
        three_phase: bool,
        /// Cycle the momentum too.
        cycle_momentum: bool,
        /// The momentum at the peak learning rate.
        base_momentum: f64,
        /// The momentum at the start and end.
        max_momentum: f64,
    },
}

/// Where one schedule setting lies, to read or write it.
enum Slot<'a> {
    Count(&'a mut u64),
    Number(&'a mut f64),
    Flag(&'a mut bool),
    Counts(&'a mut Vec<u64>),
    Anneal(&'a mut Anneal),
}

/// One schedule setting's value, as a job file or the text form gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum SettingValue {
    /// A number (a count must be a whole one).
    Number(f64),
    /// `true` or `false`.
    Flag(bool),
    /// A list of counts.
    Counts(Vec<u64>),
    /// A word (`cos`, `linear`).
    Word(String),
}

impl Curve {
    /// The curve kinds, as job files and the text form name them.
    pub const KINDS: &[&str] = &[
        "constant",
        "step",
        "multistep",
        "exponential",
        "cosine",
        "linear",
        "onecycle",
    ];

    /// `kind` with PyTorch's defaults (those PyTorch requires: `step_size` 1, `gamma` 0.1,
    /// `milestones` none, `T_max` 1, `total_steps` 1).
    pub fn defaults(kind: &str) -> Option<Curve> {
        Some(match kind {
            "constant" => Curve::Constant,
            "step" => Curve::Step {
                step_size: 1,
                gamma: 0.1,
            },
            "multistep" => Curve::MultiStep {
                milestones: Vec::new(),
                gamma: 0.1,
            },
            "exponential" => Curve::Exponential { gamma: 0.1 },
            "cosine" => Curve::Cosine {
                t_max: 1,
                eta_min: 0.0,
            },
            "linear" => Curve::Linear {
                start_factor: 1.0 / 3.0,
                end_factor: 1.0,
                total_iters: 5,
            },
            "onecycle" => Curve::OneCycle {
                total_steps: 1,
                pct_start: 0.3,
                anneal: Anneal::Cos,
                div_factor: 25.0,
                final_div_factor: 1e4,
                three_phase: false,
                cycle_momentum: true,
                base_momentum: 0.85,
                max_momentum: 0.95,
            },
            _ => return None,
        })
    }

    /// The kind's name.
    pub fn kind(&self) -> &'static str {
        match self {
            Curve::Constant => "constant",
            Curve::Step { .. } => "step",
            Curve::MultiStep { .. } => "multistep",
            Curve::Exponential { .. } => "exponential",
            Curve::Cosine { .. } => "cosine",
            Curve::Linear { .. } => "linear",
            Curve::OneCycle { .. } => "onecycle",
        }
    }

    /// Every setting of the kind, under PyTorch's argument names, in a fixed order.
    fn slots(&mut self) -> Vec<(&'static str, Slot<'_>)> {
        use Slot::{Count, Counts, Flag, Number};
        match self {
            Curve::Constant => Vec::new(),
            Curve::Step { step_size, gamma } => {
                vec![("step_size", Count(step_size)), ("gamma", Number(gamma))]
            }
            Curve::MultiStep { milestones, gamma } => {
                vec![("milestones", Counts(milestones)), ("gamma", Number(gamma))]
            }
            Curve::Exponential { gamma } => vec![("gamma", Number(gamma))],
            Curve::Cosine { t_max, eta_min } => {
                vec![("T_max", Count(t_max)), ("eta_min", Number(eta_min))]
            }
            Curve::Linear {
                start_factor,
                end_factor,
                total_iters,
            } => vec![
                ("start_factor", Number(start_factor)),
                ("end_factor", Number(end_factor)),
                ("total_iters", Count(total_iters)),
            ],
            Curve::OneCycle {
                total_steps,
                pct_start,
                anneal,
                div_factor,
                final_div_factor,
                three_phase,
                cycle_momentum,
                base_momentum,
                max_momentum,
            } => vec![
                ("total_steps", Count(total_steps)),
                ("pct_start", Number(pct_start)),
                ("anneal_strategy", Slot::Anneal(anneal)),
                ("div_factor", Number(div_factor)),
                ("final_div_factor", Number(final_div_factor)),
                ("three_phase", Flag(three_phase)),
                ("cycle_momentum", Flag(cycle_momentum)),
                ("base_momentum", Number(base_momentum)),
                ("max_momentum", Number(max_momentum)),
            ],
        }
    }

    /// The keys `kind` takes besides `kind`.
    pub fn keys(kind: &str) -> Vec<&'static str> {
        Curve::defaults(kind)
            .map(|mut c| c.slots().into_iter().map(|(k, _)| k).collect())
            .unwrap_or_default()
    }

    /// Every setting as `(key, value)`, the value as job files write it.
    pub fn settings_text(&self) -> Vec<(&'static str, String)> {
        let mut read = self.clone();
        read.slots()
            .into_iter()
            .map(|(key, slot)| {
                let v = match slot {
                    Slot::Count(n) => n.to_string(),
                    Slot::Number(x) => format!("{x:?}"),
                    Slot::Flag(b) => b.to_string(),
                    Slot::Counts(v) => format!(
                        "[{}]",
                        v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
                    ),
                    Slot::Anneal(a) => format!("\"{a}\""),
                };
                (key, v)
            })
            .collect()
    }

    /// Sets `key` (`Ok(false)`: not a key of this kind); checks the value as PyTorch does.
    pub fn set(&mut self, key: &str, value: SettingValue) -> Result<bool, String> {
        let Some(slot) = self
            .slots()
            .into_iter()
            .find_map(|(k, s)| (k == key).then_some(s))
        else {
            return Ok(false);
        };
        let count = |x: f64| -> Result<u64, String> {
            if x.fract() == 0.0 && x >= 0.0 && x < u64::MAX as f64 {
                Ok(x as u64)
            } else {
                Err(format!("{key} = {x} must be a whole number >= 0"))
            }
        };
        match (slot, value) {
            (Slot::Count(n), SettingValue::Number(x)) => *n = count(x)?,
            (Slot::Number(n), SettingValue::Number(x)) => {
                if !x.is_finite() {
                    return Err(format!("{key} = {x} must be finite"));
                }
                *n = x;
            }
            (Slot::Flag(b), SettingValue::Flag(on)) => *b = on,
            (Slot::Counts(v), SettingValue::Counts(c)) => *v = c,
            (Slot::Counts(v), SettingValue::Number(x)) => *v = vec![count(x)?],
            (Slot::Anneal(a), SettingValue::Word(w)) => {
                *a = w.parse()?;
            }
            (slot, _) => {
                let want = match slot {
                    Slot::Count(_) => "a whole number",
                    Slot::Number(_) => "a number",
                    Slot::Flag(_) => "true or false",
                    Slot::Counts(_) => "a list of whole numbers",
                    Slot::Anneal(_) => "\"cos\" or \"linear\"",
                };
                return Err(format!("{key} must be {want}"));
            }
        }
        Ok(true)
    }

    /// Checks what PyTorch refuses (and what would make a learning rate negative or infinite).
    pub fn check(&self) -> Result<(), String> {
        let positive = |key: &str, x: f64| {
            if x > 0.0 {
                Ok(())
            } else {
                Err(format!("{key} = {x} must be > 0"))
            }
        };
        let at_least_one = |key: &str, n: u64| {
            if n >= 1 {
                Ok(())
            } else {
                Err(format!("{key} must be >= 1"))
            }
        };
        match self {
            Curve::Constant => Ok(()),
            Curve::Step { step_size, gamma } => {
                at_least_one("step_size", *step_size)?;
                positive("gamma", *gamma)
            }
            Curve::MultiStep { milestones, gamma } => {
                if milestones.windows(2).any(|w| w[0] > w[1]) {
                    return Err("milestones must be in ascending order".into());
                }
                positive("gamma", *gamma)
            }
            Curve::Exponential { gamma } => positive("gamma", *gamma),
            Curve::Cosine { t_max, eta_min } => {
                at_least_one("T_max", *t_max)?;
                if *eta_min < 0.0 {
                    return Err(format!("eta_min = {eta_min} must be >= 0"));
                }
                Ok(())
            }
            Curve::Linear {
                start_factor,
                end_factor,
                total_iters,
            } => {
                if !(*start_factor > 0.0 && *start_factor <= 1.0) {
                    return Err(format!("start_factor = {start_factor} must be in (0, 1]"));
                }
                if !(0.0..=1.0).contains(end_factor) {
                    return Err(format!("end_factor = {end_factor} must be in [0, 1]"));
                }
                at_least_one("total_iters", *total_iters)
            }
            Curve::OneCycle {
                total_steps,
                pct_start,
                div_factor,
                final_div_factor,
                cycle_momentum,
                base_momentum,
                max_momentum,
                ..
            } => {
                at_least_one("total_steps", *total_steps)?;
                if !(0.0..=1.0).contains(pct_start) {
                    return Err(format!("pct_start = {pct_start} must be in [0, 1]"));
                }
                positive("div_factor", *div_factor)?;
                positive("final_div_factor", *final_div_factor)?;
                let unit = |key: &str, m: f64| {
                    if m > 0.0 && m < 1.0 {
                        Ok(())
                    } else {
                        Err(format!("{key} = {m} must be in (0, 1)"))
                    }
                };
                if *cycle_momentum {
                    unit("base_momentum", *base_momentum)?;
                    unit("max_momentum", *max_momentum)?;
                }
                Ok(())
            }
        }
    }

    /// The learning rate at `n` from base learning rate `lr`, and the momentum where the
    /// curve cycles it.
    pub fn at(&self, lr: f64, n: u64) -> (f64, Option<f64>) {
        let x = n as f64;
        let rate = match *self {
            Curve::Constant => lr,
            Curve::Step { step_size, gamma } => lr * gamma.powf((n / step_size.max(1)) as f64),
            Curve::MultiStep {
                ref milestones,
                gamma,
            } => lr * gamma.powf(milestones.iter().filter(|&&m| m <= n).count() as f64),
            Curve::Exponential { gamma } => lr * gamma.powf(x),
            Curve::Cosine { t_max, eta_min } => {
                eta_min + (lr - eta_min) * (1.0 + (PI * x / t_max.max(1) as f64).cos()) / 2.0
            }
            Curve::Linear {
                start_factor,
                end_factor,
                total_iters,
            } => {
                let total = total_iters.max(1);
                let done = n.min(total) as f64 / total as f64;
                lr * (start_factor + (end_factor - start_factor) * done)
            }
            Curve::OneCycle { .. } => return self.one_cycle(lr, n),
        };
        (rate, None)
    }

    /// [`Curve::at`] of one-cycle, phase by phase as `OneCycleLR.get_lr`.
    fn one_cycle(&self, max_lr: f64, n: u64) -> (f64, Option<f64>) {
        let Curve::OneCycle {
            total_steps,
            pct_start,
            anneal,
            div_factor,
            final_div_factor,
            three_phase,
            cycle_momentum,
            base_momentum,
            max_momentum,
        } = *self
        else {
            return (max_lr, None);
        };
        let initial = max_lr / div_factor;
        let min = initial / final_div_factor;
        let total = total_steps as f64;
        // (end step, start and end learning rate, start and end momentum) per phase.
        let phases: &[(f64, f64, f64, f64, f64)] = if three_phase {
            &[
                (
                    pct_start * total - 1.0,
                    initial,
                    max_lr,
                    max_momentum,
                    base_momentum,
                ),
                (
                    2.0 * pct_start * total - 2.0,
                    max_lr,
                    initial,
                    base_momentum,
                    max_momentum,
                ),
                (total - 1.0, initial, min, max_momentum, max_momentum),
            ]
        } else {
            &[
                (
                    pct_start * total - 1.0,
                    initial,
                    max_lr,
                    max_momentum,
                    base_momentum,
                ),
                (total - 1.0, max_lr, min, base_momentum, max_momentum),
            ]
        };
        let step = n.min(total_steps.saturating_sub(1)) as f64;
        let anneal = |start: f64, end: f64, pct: f64| match anneal {
            Anneal::Cos => end + (start - end) / 2.0 * ((PI * pct).cos() + 1.0),
            Anneal::Linear => (end - start) * pct + start,
        };
        let mut start_step = 0.0;
        for (i, &(end_step, lr0, lr1, m0, m1)) in phases.iter().enumerate() {
            if step <= end_step || i == phases.len() - 1 {
                let pct = (step - start_step) / (end_step - start_step);
                let momentum = cycle_momentum.then(|| anneal(m0, m1, pct));
                return (anneal(lr0, lr1, pct), momentum);
            }
            start_step = end_step;
        }
        (min, None)
    }
}

impl LrSchedule {
    /// Whether the learning rate is the optimizer's at every step.
    pub fn is_constant(&self) -> bool {
        self.curve == Curve::Constant && self.scale == WorkerScaling::None
    }

    /// Checks the schedule against the job it is for: the curve's settings, scaling only
    /// under BSP (under ASP and SSP an update is one worker's mini-batch, whatever the number
    /// of workers), and a cycled momentum only for optimizers that have one (`optimizers`:
    /// the job's and its parameter groups').
    pub fn check<'a>(
        &self,
        consistency: Consistency,
        optimizers: impl IntoIterator<Item = &'a OptimizerSpec>,
    ) -> Result<(), String> {
        self.curve.check()?;
        if self.scale != WorkerScaling::None && consistency != Consistency::Bsp {
            return Err(format!(
                "scale = \"{}\" needs consistency = \"bsp\": under {consistency} an update is \
                 one worker's mini-batch whatever the number of workers, so there is no larger \
                 batch to scale the learning rate for",
                self.scale
            ));
        }
        if let Curve::OneCycle {
            cycle_momentum: true,
            ..
        } = self.curve
        {
            for o in optimizers {
                match *o {
                    OptimizerSpec::Sgd { momentum, .. }
                    | OptimizerSpec::RmsProp { momentum, .. }
                        if momentum <= 0.0 =>
                    {
                        return Err(format!(
                            "onecycle cycles the momentum of {}, which has none: give it a \
                             momentum > 0 (the cycle replaces it) or set cycle_momentum = false",
                            o.kind()
                        ));
                    }
                    OptimizerSpec::Adagrad { .. } | OptimizerSpec::Adadelta { .. } => {
                        return Err(format!(
                            "onecycle cannot cycle the momentum of {}, which has none: set \
                             cycle_momentum = false",
                            o.kind()
                        ));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The optimizer `spec` as it applies the update at `n` (see [`LrSchedule`]) that averages
    /// `workers` gradients: its learning rate (and momentum) from the curve, times the
    /// workers' scaling.
    pub fn apply_to(&self, spec: &OptimizerSpec, n: u64, workers: u32) -> OptimizerSpec {
        let (rate, momentum) = self.curve.at(spec.lr(), n);
        let k = f64::from(workers.max(1));
        let rate = match self.scale {
            WorkerScaling::None => rate,
            WorkerScaling::Linear => rate * k,
            WorkerScaling::Sqrt => rate * k.sqrt(),
        };
        let mut out = spec.clone();
        match &mut out {
            OptimizerSpec::Sgd {
                lr, momentum: m, ..
            }
            | OptimizerSpec::RmsProp {
                lr, momentum: m, ..
            } => {
                *lr = rate;
                if let Some(x) = momentum {
                    *m = x;
                }
            }
            OptimizerSpec::Adam { lr, beta1, .. } => {
                *lr = rate;
                if let Some(x) = momentum {
                    *beta1 = x;
                }
            }
            OptimizerSpec::Adagrad { lr, .. } | OptimizerSpec::Adadelta { lr, .. } => *lr = rate,
        }
        out
    }

    /// Sets a key of the schedule's table (`by`, `scale`, or the curve's): `Ok(false)` when
    /// the curve does not take it.
    pub fn set(&mut self, key: &str, value: SettingValue) -> Result<bool, String> {
        let word = |v: &SettingValue| match v {
            SettingValue::Word(w) => Ok(w.clone()),
            _ => Err(format!("{key} must be a string")),
        };
        match key {
            "by" => self.by = word(&value)?.parse()?,
            "scale" => self.scale = word(&value)?.parse()?,
            _ => return self.curve.set(key, value),
        }
        Ok(true)
    }
}

/// `Display` and `FromStr` of a setting that is one of a few words, with the message for any
/// other word (`{s:?}` in it names the word given).
macro_rules! words {
    ($ty:ident, $unknown:literal, $($variant:ident => $word:literal),+ $(,)?) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self {
                    $($ty::$variant => $word,)+
                })
            }
        }

        impl FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($word => Ok($ty::$variant),)+
                    _ => Err(format!($unknown, s = s)),
                }
            }
        }
    };
}

words!(Anneal, "unknown anneal_strategy {s:?}: use cos or linear", Cos => "cos", Linear => "linear");
words!(
    ScheduleUnit,
    "unknown unit {s:?}: by = \"step\" or \"epoch\"",
    Step => "step",
    Epoch => "epoch",
);
words!(
    WorkerScaling,
    "unknown scaling {s:?}: scale = \"none\", \"linear\" or \"sqrt\"",
    None => "none",
    Linear => "linear",
    Sqrt => "sqrt",
);

impl FromStr for LrSchedule {
    type Err = String;

    /// Parses `KIND[,KEY=VALUE...]` with the curve's keys and `by` and `scale` (e.g.
    /// `step,step_size=1,gamma=0.7,by=epoch`, `multistep,milestones=30:80`,
    /// `onecycle,total_steps=2000`, `constant,scale=linear`).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let kind = parts.next().unwrap_or_default();
        let Some(curve) = Curve::defaults(kind) else {
            return Err(format!(
                "unknown schedule {s:?}: use KIND[,KEY=VALUE...] with KIND one of {}",
                Curve::KINDS.join(", ")
            ));
        };
        let mut schedule = LrSchedule {
            curve,
            ..LrSchedule::default()
        };
        for part in parts {
            let Some((key, text)) = part.split_once('=') else {
                return Err(format!("{part:?} is not KEY=VALUE in schedule {s:?}"));
            };
            let value = match text {
                "true" | "false" => SettingValue::Flag(text == "true"),
                _ if key == "milestones" => SettingValue::Counts(
                    text.split(':')
                        .filter(|m| !m.is_empty())
                        .map(|m| {
                            m.parse()
                                .map_err(|_| format!("bad milestone {m:?} in schedule {s:?}"))
                        })
                        .collect::<Result<_, _>>()?,
                ),
                _ => match text.parse::<f64>() {
                    Ok(x) => SettingValue::Number(x),
                    Err(_) => SettingValue::Word(text.to_string()),
                },
            };
            if !schedule
                .set(key, value)
                .map_err(|e| format!("{e} in schedule {s:?}"))?
            {
                return Err(format!(
                    "{key:?} is not a setting of schedule {kind} (it takes {})",
                    schedule_keys(kind).join(", ")
                ));
            }
        }
        schedule
            .curve
            .check()
            .map_err(|e| format!("{e} in schedule {s:?}"))?;
        Ok(schedule)
    }
}

/// The keys a schedule of curve `kind` takes, `by` and `scale` last.
pub fn schedule_keys(kind: &str) -> Vec<&'static str> {
    let mut keys = Curve::keys(kind);
    keys.extend(["by", "scale"]);
    keys
}

impl fmt::Display for LrSchedule {
    /// The text form [`LrSchedule::from_str`] reads: the kind and every setting.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.curve.kind())?;
        for (key, value) in self.curve.settings_text() {
            let value = value.trim_matches('"');
            let value = match value.strip_prefix('[') {
                Some(list) => list.trim_end_matches(']').replace(", ", ":"),
                None => value.to_string(),
            };
            write!(f, ",{key}={value}")?;
        }
        if self.curve != Curve::Constant {
            write!(f, ",by={}", self.by)?;
        }
        if self.scale != WorkerScaling::None {
            write!(f, ",scale={}", self.scale)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lrs(s: &str, n: u64) -> Vec<f64> {
        let schedule: LrSchedule = s.parse().expect("a valid schedule");
        (0..n).map(|i| schedule.curve.at(0.1, i).0).collect()
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-12 * y.abs().max(1e-12),
                "at {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn curves_match_pytorchs_documented_values() {
        close(
            &lrs("step,step_size=2,gamma=0.5", 5),
            &[0.1, 0.1, 0.05, 0.05, 0.025],
        );
        close(
            &lrs("multistep,milestones=1:3:3,gamma=0.5", 5),
            &[0.1, 0.05, 0.05, 0.0125, 0.0125],
        );
        close(&lrs("exponential,gamma=0.5", 3), &[0.1, 0.05, 0.025]);
        close(&lrs("cosine,T_max=2", 5), &[0.1, 0.05, 0.0, 0.05, 0.1]);
        close(
            &lrs("linear,start_factor=0.5,total_iters=2", 4),
            &[0.05, 0.075, 0.1, 0.1],
        );
        // One-cycle over 10 steps: from 0.1/25 up to 0.1 at step 2, down to 0.1/25/1e4 at 9.
        let one = lrs("onecycle,total_steps=10", 12);
        close(&one[..1], &[0.004]);
        close(&one[2..3], &[0.1]);
        close(&one[9..], &[0.004 / 1e4, 0.004 / 1e4, 0.004 / 1e4]);
        assert!(one.windows(2).take(2).all(|w| w[0] < w[1]), "{one:?}");
        assert!(
            one.windows(2).skip(2).take(7).all(|w| w[0] > w[1]),
            "{one:?}"
        );
    }

    #[test]
    fn one_cycle_cycles_the_momentum_the_other_way() {
        let s: LrSchedule = "onecycle,total_steps=10".parse().expect("valid");
        let m: Vec<f64> = (0..10)
            .map(|n| s.curve.at(1.0, n).1.expect("cycled"))
            .collect();
        close(&[m[0], m[2], m[9]], &[0.95, 0.85, 0.95]);
        let adam = s.apply_to(&OptimizerSpec::adam(0.01), 2, 1);
        assert_eq!(adam.lr(), 0.01);
        assert!(matches!(adam, OptimizerSpec::Adam { beta1, .. } if beta1 == 0.85));
        let off: LrSchedule = "onecycle,total_steps=10,cycle_momentum=false"
            .parse()
            .expect("valid");
        assert_eq!(off.curve.at(1.0, 2).1, None);
    }

    #[test]
    fn scaling_multiplies_by_the_workers_an_update_averages() {
        let s: LrSchedule = "step,step_size=10,scale=sqrt".parse().expect("valid");
        assert_eq!(s.apply_to(&OptimizerSpec::sgd(0.1), 0, 4).lr(), 0.2);
        let s: LrSchedule = "constant,scale=linear".parse().expect("valid");
        assert_eq!(s.apply_to(&OptimizerSpec::sgd(0.1), 99, 3).lr(), 0.1 * 3.0);
        assert!(!s.is_constant());
        let err = s
            .check(Consistency::Asp, [&OptimizerSpec::sgd(0.1)])
            .expect_err("asp has no larger batch");
        assert!(err.contains("needs consistency = \"bsp\""), "{err}");
        s.check(Consistency::Bsp, [&OptimizerSpec::sgd(0.1)])
            .expect("bsp scales");
    }

    #[test]
    fn the_text_form_round_trips_and_bad_settings_are_refused() {
        for text in [
            "constant",
            "step,step_size=3,gamma=0.7,by=epoch",
            "multistep,milestones=2:5,gamma=0.5,by=step,scale=linear",
            "cosine,T_max=100,eta_min=0.001,by=step",
            "onecycle,total_steps=50,pct_start=0.25,anneal_strategy=linear,div_factor=25.0,\
             final_div_factor=10000.0,three_phase=true,cycle_momentum=false,base_momentum=0.85,\
             max_momentum=0.95,by=step",
        ] {
            let s: LrSchedule = text.parse().expect(text);
            let again: LrSchedule = s.to_string().parse().expect("its own text");
            assert_eq!(again, s, "{text}");
        }
        for (bad, why) in [
            ("warmup", "unknown schedule"),
            ("step,step_size=0", "step_size must be >= 1"),
            ("step,T_max=3", "not a setting of schedule step"),
            ("cosine,T_max=1.5", "whole number"),
            ("multistep,milestones=5:2", "ascending"),
            ("linear,start_factor=0", "(0, 1]"),
            ("onecycle,anneal_strategy=cubic", "cos or linear"),
            ("step,by=batch", "by = \"step\" or \"epoch\""),
            ("exponential,gamma=nan", "finite"),
        ] {
            let err = bad.parse::<LrSchedule>().expect_err(bad);
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_cycled_momentum_needs_an_optimizer_with_one() {
        let s: LrSchedule = "onecycle,total_steps=10".parse().expect("valid");
        for (o, ok) in [
            ("sgd:0.1", false),
            ("sgd:0.1,momentum=0.9", true),
            ("adamw:0.01", true),
            ("rmsprop:0.01", false),
            ("adadelta:1", false),
        ] {
            let spec: OptimizerSpec = o.parse().expect(o);
            assert_eq!(s.check(Consistency::Asp, [&spec]).is_ok(), ok, "{o}");
        }
    }
}
