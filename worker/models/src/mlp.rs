//! A multi-layer perceptron with ReLU between layers and a softmax cross-entropy head, over
//! dense inputs (idx images).

use edl_proto::{Init, TensorSpec};

use crate::{Builtin, DataShape, SettingError, positive};

/// `kind = "mlp"`: layer `i` has a weight `fc{i}.weight` of shape `[in, out]` (row-major,
/// Glorot-uniform) and a bias `fc{i}.bias` of shape `[out]` (zeros), in that order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mlp {
    /// Layer widths from input to classes, e.g. `[784, 256, 128, 10]`.
    pub layers: Vec<u32>,
}

impl Builtin for Mlp {
    const KIND: &'static str = "mlp";
    const KEYS: &'static [&'static str] = &["layers"];

    fn from_table(table: &toml::Table, _: &mut dyn DataShape) -> Result<Mlp, SettingError> {
        let Some(v) = table.get("layers") else {
            return Err(SettingError::new(
                "layers",
                "missing: an mlp needs its layer widths, e.g. layers = [784, 256, 128, 10]",
            ));
        };
        let toml::Value::Array(items) = v else {
            return Err(SettingError::new(
                "layers",
                format!("must be an array of widths, not a {}", v.type_str()),
            ));
        };
        if items.len() < 2 {
            return Err(SettingError::new(
                "layers",
                "needs at least 2 widths (input and classes)",
            ));
        }
        let layers = items
            .iter()
            .enumerate()
            .map(|(i, w)| positive("layers", &format!("width {i}"), w))
            .collect::<Result<_, _>>()?;
        Ok(Mlp { layers })
    }

    fn to_table(&self) -> toml::Table {
        let layers = self.layers.iter().map(|&w| i64::from(w).into()).collect();
        toml::Table::from_iter([("layers".to_string(), toml::Value::Array(layers))])
    }

    fn tensors(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        for (i, w) in self.layers.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let limit = (6.0 / (f64::from(fan_in) + f64::from(fan_out))).sqrt() as f32;
            out.push(TensorSpec {
                name: format!("fc{i}.weight"),
                shape: vec![fan_in, fan_out],
                init: Init::Uniform { limit },
            });
            out.push(TensorSpec {
                name: format!("fc{i}.bias"),
                shape: vec![fan_out],
                init: Init::Zeros,
            });
        }
        out
    }

    fn describe(&self) -> String {
        let widths: Vec<String> = self.layers.iter().map(u32::to_string).collect();
        format!("mlp {}", widths.join("-"))
    }
}
