//! The MLP description and its flat parameter layout, which is a fixed contract with the parameter server.
//!
//! For each layer `i` in order the flat vector holds `fc{i}.weight`, shape `[in, out]` row-major
//! (element `(r, c)` at `r * out + c`), followed by `fc{i}.bias`, shape `[out]`. Hidden layers
//! apply ReLU; the last layer emits logits that feed a softmax cross-entropy loss averaged over
//! the batch. The arithmetic itself lives in the backends.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use thiserror::Error;

/// Reasons a list of layer widths does not describe a usable MLP.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ModelError {
    /// Fewer than two widths were given, so there is no input/output pair to connect.
    #[error("an MLP needs at least 2 layer widths (input and output), got {0}")]
    TooFewLayers(usize),
    /// A width is zero, which would make the layer (and every matrix touching it) empty.
    #[error("layer width at position {index} is zero; every layer needs at least one unit")]
    ZeroWidth {
        /// Position of the zero in the width list.
        index: usize,
    },
    /// The total number of parameters does not fit in `usize`.
    #[error("the parameter count of layers {layers:?} overflows usize")]
    TooManyParams {
        /// The offending widths.
        layers: Vec<usize>,
    },
}

/// Where one named tensor sits in the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// `fc{i}.weight` or `fc{i}.bias`, as the parameter server names it.
    pub name: String,
    /// `[in, out]` for weights, `[out]` for biases.
    pub shape: Vec<usize>,
    /// Index of the tensor's first element in the flat vector.
    pub offset: usize,
    /// Number of elements (the product of `shape`).
    pub len: usize,
}

/// A fully connected network described by its layer widths, e.g. `[784, 256, 128, 10]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mlp {
    /// Input width, hidden widths, then the number of classes; validated by [`Mlp::new`].
    layers: Vec<usize>,
}

impl Mlp {
    /// Validates the widths: at least two, none zero, and a parameter count that fits in `usize`.
    pub fn new(layers: Vec<usize>) -> Result<Mlp, ModelError> {
        if layers.len() < 2 {
            return Err(ModelError::TooFewLayers(layers.len()));
        }
        if let Some(index) = layers.iter().position(|&w| w == 0) {
            return Err(ModelError::ZeroWidth { index });
        }
        // Checking once here lets every other method use plain arithmetic.
        let total = layers.windows(2).try_fold(0usize, |acc, w| {
            w[0].checked_mul(w[1])
                .and_then(|weights| weights.checked_add(w[1]))
                .and_then(|layer| acc.checked_add(layer))
        });
        if total.is_none() {
            return Err(ModelError::TooManyParams { layers });
        }
        Ok(Mlp { layers })
    }

    /// The layer widths, input first.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Length of the flat parameter vector.
    pub fn param_count(&self) -> usize {
        self.layers.windows(2).map(|w| w[0] * w[1] + w[1]).sum()
    }

    /// Values per input sample.
    pub fn input_dim(&self) -> usize {
        self.layers[0]
    }

    /// Number of output logits, i.e. classes.
    pub fn classes(&self) -> usize {
        self.layers[self.layers.len() - 1]
    }

    /// The named tensors in flat-vector order, so callers can exchange them with the parameter server.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let mut specs = Vec::with_capacity(2 * (self.layers.len() - 1));
        let mut offset = 0;
        for (i, w) in self.layers.windows(2).enumerate() {
            let (n_in, n_out) = (w[0], w[1]);
            specs.push(TensorSpec {
                name: format!("fc{i}.weight"),
                shape: vec![n_in, n_out],
                offset,
                len: n_in * n_out,
            });
            offset += n_in * n_out;
            specs.push(TensorSpec {
                name: format!("fc{i}.bias"),
                shape: vec![n_out],
                offset,
                len: n_out,
            });
            offset += n_out;
        }
        specs
    }

    /// Glorot/Xavier-uniform weights (limit `sqrt(6 / (in + out))`) and zero biases, for local runs.
    ///
    /// The same seed gives the same vector for a given build; `StdRng` does not promise the
    /// stream stays identical across `rand` releases, so do not persist seeds as a contract.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut params = Vec::with_capacity(self.param_count());
        for w in self.layers.windows(2) {
            let (n_in, n_out) = (w[0], w[1]);
            let limit = (6.0 / (n_in + n_out) as f64).sqrt() as f32;
            params.extend((0..n_in * n_out).map(|_| rng.random_range(-limit..=limit)));
            params.extend(std::iter::repeat_n(0.0, n_out));
        }
        params
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_widths() {
        assert_eq!(Mlp::new(vec![]), Err(ModelError::TooFewLayers(0)));
        assert_eq!(Mlp::new(vec![784]), Err(ModelError::TooFewLayers(1)));
        assert_eq!(
            Mlp::new(vec![784, 0, 10]),
            Err(ModelError::ZeroWidth { index: 1 })
        );
        assert!(matches!(
            Mlp::new(vec![usize::MAX, 2]),
            Err(ModelError::TooManyParams { .. })
        ));
    }

    #[test]
    fn layout_matches_the_contract() {
        let mlp = Mlp::new(vec![784, 256, 128, 10]).expect("valid");
        assert_eq!(mlp.input_dim(), 784);
        assert_eq!(mlp.classes(), 10);
        assert_eq!(mlp.layers(), &[784, 256, 128, 10]);
        assert_eq!(
            mlp.param_count(),
            784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
        );

        let specs = mlp.tensors();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "fc0.weight",
                "fc0.bias",
                "fc1.weight",
                "fc1.bias",
                "fc2.weight",
                "fc2.bias"
            ]
        );
        assert_eq!(specs[2].shape, [256, 128]);
        assert_eq!(specs[2].offset, 784 * 256 + 256);
        // The tensors must tile the flat vector exactly, with no gaps or overlaps.
        let mut next = 0;
        for s in &specs {
            assert_eq!(s.offset, next, "{}", s.name);
            assert_eq!(s.len, s.shape.iter().product::<usize>());
            next += s.len;
        }
        assert_eq!(next, mlp.param_count());
    }

    #[test]
    fn init_is_glorot_uniform_with_zero_bias() {
        let mlp = Mlp::new(vec![30, 20, 4]).expect("valid");
        let p = mlp.init_params(7);
        assert_eq!(p.len(), mlp.param_count());
        assert_eq!(p, mlp.init_params(7), "same seed, same parameters");
        assert_ne!(
            p,
            mlp.init_params(8),
            "different seed, different parameters"
        );
        for s in mlp.tensors() {
            let t = &p[s.offset..s.offset + s.len];
            if s.shape.len() == 1 {
                assert!(t.iter().all(|&v| v == 0.0), "{} must start at zero", s.name);
            } else {
                let limit = (6.0 / (s.shape[0] + s.shape[1]) as f32).sqrt();
                assert!(
                    t.iter().all(|v| v.abs() <= limit),
                    "{} exceeds the limit",
                    s.name
                );
                // A uniform draw spreads over the interval: its max should come near the limit.
                let max = t.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!(max > 0.9 * limit, "{}: max {max} vs limit {limit}", s.name);
            }
        }
    }
}
