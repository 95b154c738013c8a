//! Binary logistic regression on sparse features (LIBSVM rows).

use edl_proto::{Init, TensorSpec};

use crate::{Builtin, DataShape, SettingError, positive};

/// `kind = "logreg"`: a weight `weight` of shape `[features]` and a bias `bias` of shape
/// `[1]`, in that order, both starting at zero. Workers pull and push only the rows
/// (features) their batch touches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogReg {
    /// Number of features.
    pub features: u32,
}

impl Builtin for LogReg {
    const KIND: &'static str = "logreg";
    const KEYS: &'static [&'static str] = &["features"];

    fn from_table(table: &toml::Table, data: &mut dyn DataShape) -> Result<LogReg, SettingError> {
        let features = match table.get("features") {
            None => {
                return Err(SettingError::new(
                    "features",
                    "missing: a logreg needs features = N or features = \"auto\"",
                ));
            }
            Some(toml::Value::String(s)) if s == "auto" => {
                let n = data
                    .features()
                    .map_err(|e| SettingError::new("features", e))?;
                if n == 0 {
                    return Err(SettingError::new(
                        "features",
                        "the training data has no features",
                    ));
                }
                n
            }
            Some(toml::Value::Integer(0)) => {
                return Err(SettingError::new("features", "must be > 0"));
            }
            Some(v @ toml::Value::Integer(_)) => positive("features", "features", v)?,
            Some(v) => {
                return Err(SettingError::new(
                    "features",
                    format!(
                        "must be a positive integer or \"auto\", not {}",
                        match v {
                            toml::Value::String(s) => format!("{s:?}"),
                            other => format!("a {}", other.type_str()),
                        }
                    ),
                ));
            }
        };
        Ok(LogReg { features })
    }

    fn to_table(&self) -> toml::Table {
        toml::Table::from_iter([(
            "features".to_string(),
            toml::Value::Integer(i64::from(self.features)),
        )])
    }

    fn tensors(&self) -> Vec<TensorSpec> {
        vec![
            TensorSpec {
                name: "weight".into(),
                shape: vec![self.features],
                init: Init::Zeros,
            },
            TensorSpec {
                name: "bias".into(),
                shape: vec![1],
                init: Init::Zeros,
            },
        ]
    }

    fn describe(&self) -> String {
        format!("logreg over {} features", self.features)
    }
}
