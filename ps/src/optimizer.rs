//! Server-side optimizers, applied in place to one chunk of parameters at a time.

use edl_shared::proto::OptimizerSpec;

/// Per-chunk optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub enum OptState {
    /// Plain SGD keeps nothing.
    Sgd,
    /// The velocity.
    Momentum {
        /// Velocity, one per parameter.
        v: Vec<f32>,
    },
    /// Adam's moments and step count.
    Adam {
        /// First moment.
        m: Vec<f32>,
        /// Second moment.
        v: Vec<f32>,
        /// Updates applied so far.
        t: u64,
    },
}

impl OptState {
    /// Fresh state for a chunk of `len` parameters.
    pub fn new(spec: &OptimizerSpec, len: usize) -> Self {
        match spec {
            OptimizerSpec::Sgd { .. } => OptState::Sgd,
            OptimizerSpec::Momentum { .. } => OptState::Momentum { v: vec![0.0; len] },
            OptimizerSpec::Adam { .. } => OptState::Adam {
                m: vec![0.0; len],
                v: vec![0.0; len],
                t: 0,
            },
        }
    }

    /// Applies gradient `g` (scaled by `scale`, e.g. 1/n for a mean of n summed gradients) to
    /// `p`. Lengths must match; the caller validated them.
    pub fn apply(&mut self, spec: &OptimizerSpec, p: &mut [f32], g: &[f32], scale: f32) {
        match (spec, self) {
            (OptimizerSpec::Sgd { lr }, OptState::Sgd) => {
                let k = lr * scale;
                for (p, g) in p.iter_mut().zip(g) {
                    *p -= k * g;
                }
            }
            (OptimizerSpec::Momentum { lr, momentum }, OptState::Momentum { v }) => {
                for ((p, v), g) in p.iter_mut().zip(v.iter_mut()).zip(g) {
                    *v = momentum * *v + scale * g;
                    *p -= lr * *v;
                }
            }
            (
                OptimizerSpec::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                },
                OptState::Adam { m, v, t },
            ) => {
                *t += 1;
                let c1 = 1.0 - beta1.powi((*t).min(i32::MAX as u64) as i32);
                let c2 = 1.0 - beta2.powi((*t).min(i32::MAX as u64) as i32);
                let step = lr / c1;
                let c2_sqrt = c2.sqrt();
                for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                    let g = scale * g;
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= step * *m / ((*v).sqrt() / c2_sqrt + eps);
                }
            }
            // State and spec always come from the same job config; a mismatch cannot be built.
            (_, state) => {
                *state = OptState::new(spec, p.len());
                state.apply(spec, p, g, scale);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_and_momentum_match_hand_computation() {
        let spec = OptimizerSpec::Sgd { lr: 0.5 };
        let mut st = OptState::new(&spec, 2);
        let mut p = [1.0, 2.0];
        st.apply(&spec, &mut p, &[2.0, -4.0], 1.0);
        assert_eq!(p, [0.0, 4.0]);

        let spec = OptimizerSpec::Momentum {
            lr: 0.1,
            momentum: 0.9,
        };
        let mut st = OptState::new(&spec, 1);
        let mut p = [0.0f32];
        st.apply(&spec, &mut p, &[1.0], 1.0);
        st.apply(&spec, &mut p, &[1.0], 1.0);
        // v1 = 1, v2 = 1.9; p = -0.1 - 0.19
        assert!((p[0] + 0.29).abs() < 1e-6, "{}", p[0]);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let spec = OptimizerSpec::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let mut st = OptState::new(&spec, 3);
        let mut p = [0.0f32; 3];
        st.apply(&spec, &mut p, &[3.0, -0.5, 100.0], 1.0);
        for (x, sign) in p.iter().zip([-1.0, 1.0, -1.0]) {
            assert!((x - sign * 0.01).abs() < 1e-5, "{x}");
        }
    }
}
