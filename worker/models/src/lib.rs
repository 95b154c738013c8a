//! EDL's built-in models, in one registry.
//!
//! The wire carries tensors and an opaque [`ModelSection`]: a kind and its settings as TOML
//! text. This crate is the one place that knows what a built-in kind means: which settings
//! its `[model]` table takes, which tensors it has, and how it is described. Job files (the
//! coordinator's `--job`, `edl-ps job check`), `edl-worker`, `edl-local` and the scheduler ask
//! it, and `edl-worker` adds the training half of each kind (its forward and backward pass).
//! A new built-in model is a module here, its entry in [`BUILTINS`], and its training code
//! in `edl-worker`'s trainer.
//!
//! A `custom` model ([`ModelSection::CUSTOM`]) is not in the registry: its tensors are the
//! job's `[[tensor]]` tables, and whatever program the job's `[worker]` table runs computes
//! its gradients.

pub mod logreg;
pub mod mlp;

use std::fmt;

pub use edl_proto::{ModelSection, TensorSpec};
pub use logreg::LogReg;
pub use mlp::Mlp;

/// What a model may size itself from: the job's training data (`features = "auto"`).
pub trait DataShape {
    /// The number of features in the training data.
    fn features(&mut self) -> Result<u32, String>;
}

/// No training data to size from (a model section off the wire is already sized).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoData;

impl DataShape for NoData {
    fn features(&mut self) -> Result<u32, String> {
        Err("\"auto\" needs the job's training data to count".into())
    }
}

/// A setting of a `[model]` table that is missing, of the wrong type or out of range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingError {
    /// The key (`layers`), or `kind` for the kind itself.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl SettingError {
    /// An error of setting `key`.
    pub fn new(key: &str, message: impl Into<String>) -> SettingError {
        SettingError {
            key: key.to_string(),
            message: message.into(),
        }
    }
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "model.{}: {}", self.key, self.message)
    }
}

impl std::error::Error for SettingError {}

/// A built-in model kind with typed settings.
pub trait Builtin: Sized {
    /// Its name in job files and on the wire (`kind = "mlp"`).
    const KIND: &'static str;
    /// The keys its `[model]` table takes besides `kind`.
    const KEYS: &'static [&'static str];

    /// Reads the settings (the `[model]` table less `kind`), sizing from `data` what the
    /// table leaves to it. Keys outside [`Builtin::KEYS`] are refused before this is called.
    fn from_table(table: &toml::Table, data: &mut dyn DataShape) -> Result<Self, SettingError>;

    /// The settings as a table, with every count resolved: reading it back gives `self`.
    fn to_table(&self) -> toml::Table;

    /// The parameter tensors, in key order, with their initializers.
    fn tensors(&self) -> Vec<TensorSpec>;

    /// A short description, e.g. `mlp 784-256-10`.
    fn describe(&self) -> String;

    /// The wire's form of the model.
    fn section(&self) -> ModelSection {
        ModelSection {
            kind: Self::KIND.to_string(),
            settings: self.to_table().to_string(),
        }
    }

    /// Reads the model from its wire form; an error names what is wrong.
    fn from_section(section: &ModelSection) -> Result<Self, String> {
        if section.kind != Self::KIND {
            return Err(format!(
                "the job's model is {:?}, not {:?}",
                section.kind,
                Self::KIND
            ));
        }
        let table = settings_table(section)?;
        check_keys(Self::KIND, Self::KEYS, &table).map_err(|e| e.to_string())?;
        Self::from_table(&table, &mut NoData).map_err(|e| e.to_string())
    }
}

/// A built-in model as the registry lists it.
#[derive(Clone, Copy)]
pub struct Kind {
    /// Its name (`kind = "..."`).
    pub name: &'static str,
    /// The keys its table takes besides `kind`.
    pub keys: &'static [&'static str],
    build: fn(&toml::Table, &mut dyn DataShape) -> Result<Model, SettingError>,
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kind").field("name", &self.name).finish()
    }
}

const fn entry<M: Builtin>() -> Kind {
    Kind {
        name: M::KIND,
        keys: M::KEYS,
        build: build_as::<M>,
    }
}

fn build_as<M: Builtin>(
    table: &toml::Table,
    data: &mut dyn DataShape,
) -> Result<Model, SettingError> {
    let m = M::from_table(table, data)?;
    Ok(Model {
        section: m.section(),
        tensors: m.tensors(),
        description: m.describe(),
    })
}

/// Every built-in model.
pub static BUILTINS: &[Kind] = &[entry::<Mlp>(), entry::<LogReg>()];

/// A model resolved from its settings: what the wire carries, its tensors, its description.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// The wire's form.
    pub section: ModelSection,
    /// Its parameter tensors, in key order.
    pub tensors: Vec<TensorSpec>,
    /// A short description.
    pub description: String,
}

/// The built-in kind called `name`.
pub fn find(name: &str) -> Option<&'static Kind> {
    BUILTINS.iter().find(|k| k.name == name)
}

/// The kinds a job file may name, for messages: `mlp, logreg or custom`.
pub fn kinds() -> String {
    let names: Vec<&str> = BUILTINS.iter().map(|k| k.name).collect();
    format!("{} or {}", names.join(", "), ModelSection::CUSTOM)
}

/// Refuses keys that kind `kind` does not take, naming the kind that does, if any.
fn check_keys(kind: &str, keys: &[&str], table: &toml::Table) -> Result<(), SettingError> {
    for key in table.keys() {
        if keys.contains(&key.as_str()) {
            continue;
        }
        let message = match taking(key) {
            Some(k) => format!("only for kind = {:?}", k.name),
            None if keys.is_empty() => format!("unknown key: kind = {kind:?} takes no settings"),
            None => format!(
                "unknown key: kind = {kind:?} takes {}",
                keys.iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        return Err(SettingError::new(key, message));
    }
    Ok(())
}

/// The built-in kind whose table takes `key`, if any (to name it when another kind's does not).
pub fn taking(key: &str) -> Option<&'static Kind> {
    BUILTINS.iter().find(|k| k.keys.contains(&key))
}

/// The refusal of a kind the registry does not list.
pub fn unknown_kind(kind: &str) -> SettingError {
    SettingError::new(
        "kind",
        format!("unknown model kind {kind:?}: use {}", kinds()),
    )
}

/// Builds built-in model `kind` from its `[model]` table less `kind`.
pub fn build(
    kind: &str,
    table: &toml::Table,
    data: &mut dyn DataShape,
) -> Result<Model, SettingError> {
    let k = find(kind).ok_or_else(|| unknown_kind(kind))?;
    check_keys(k.name, k.keys, table)?;
    (k.build)(table, data)
}

/// The settings of a wire section as a table.
fn settings_table(section: &ModelSection) -> Result<toml::Table, String> {
    section
        .settings
        .parse::<toml::Table>()
        .map_err(|e| format!("the settings of model {:?}: {e}", section.kind))
}

/// Resolves a built-in model from its wire form (what a worker or a tool does with a job's
/// model section); `Ok(None)` for a custom model.
pub fn resolve(section: &ModelSection) -> Result<Option<Model>, String> {
    if section.is_custom() {
        return Ok(None);
    }
    let table = settings_table(section)?;
    build(&section.kind, &table, &mut NoData)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Describes a job's model: a built-in one by the registry (`mlp 784-256-10`), a custom one
/// by its tensors (`custom (3 tensors)`), a kind this build does not know as it came.
pub fn describe(section: &ModelSection, tensors: &[TensorSpec]) -> String {
    if section.is_custom() {
        let s = if tensors.len() == 1 { "" } else { "s" };
        return format!("custom ({} tensor{s})", tensors.len());
    }
    match resolve(section) {
        Ok(Some(m)) => m.description,
        _ => section.to_string(),
    }
}

/// Reads a positive `u32` from a TOML integer.
fn positive(key: &str, what: &str, v: &toml::Value) -> Result<u32, SettingError> {
    match v {
        toml::Value::Integer(0) => Err(SettingError::new(key, format!("{what} is 0; must be > 0"))),
        toml::Value::Integer(n) => u32::try_from(*n).map_err(|_| {
            SettingError::new(key, format!("{what} is {n}; must be in 1..={}", u32::MAX))
        }),
        other => Err(SettingError::new(
            key,
            format!(
                "{what} must be a positive integer, not a {}",
                other.type_str()
            ),
        )),
    }
}

#[cfg(test)]
mod tests;
