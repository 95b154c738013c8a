//! Server-side optimizers, applied in place to one chunk of parameters at a time.

use edl_shared::proto::OptimizerSpec;
use edl_shared::proto::frame::{F32Run, LeF32s};
use edl_shared::proto::wide::{Loop, wide};

/// A piece of a gradient as the optimizer reads it: values in place, or little-endian bytes at
/// any alignment (a push's payload where QUIC delivered it).
pub trait Grad: Copy {
    /// Values in the piece.
    fn len(&self) -> usize;
    /// Whether the piece is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The values in order (inlined where it is called: [`OptState::apply_at`]'s loops are
    /// compiled for wider vector units too).
    fn values(self) -> impl Iterator<Item = f32>;
}

impl Grad for &[f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    #[inline(always)]
    fn values(self) -> impl Iterator<Item = f32> {
        self.iter().copied()
    }
}

impl Grad for LeF32s<'_> {
    fn len(&self) -> usize {
        self.0.len() / 4
    }

    #[inline(always)]
    fn values(self) -> impl Iterator<Item = f32> {
        self.iter()
    }
}

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
    /// The state as a checkpoint holds it: first moment (momentum's velocity), second moment,
    /// step count; empty where the optimizer keeps none.
    pub fn moments(&self) -> (Vec<f32>, Vec<f32>, u64) {
        match self {
            OptState::Sgd => (Vec::new(), Vec::new(), 0),
            OptState::Momentum { v } => (v.clone(), Vec::new(), 0),
            OptState::Adam { m, v, t } => (m.clone(), v.clone(), *t),
        }
    }

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
        self.start(spec, p.len());
        self.apply_at(spec, p, 0, g, scale);
    }

    /// Starts one update of a chunk of `len` parameters, to be applied in pieces with
    /// [`OptState::apply_at`] (a gradient that arrived in parts is applied where it lies).
    pub fn start(&mut self, spec: &OptimizerSpec, len: usize) {
        let matches = matches!(
            (spec, &*self),
            (OptimizerSpec::Sgd { .. }, OptState::Sgd)
                | (OptimizerSpec::Momentum { .. }, OptState::Momentum { .. })
                | (OptimizerSpec::Adam { .. }, OptState::Adam { .. })
        );
        // State and spec always come from the same job config; a mismatch cannot be built.
        if !matches {
            *self = OptState::new(spec, len);
        }
        if let OptState::Adam { t, .. } = self {
            *t += 1;
        }
    }

    /// [`OptState::apply_at`] of a run of a received payload, read where it lies.
    pub fn apply_run(
        &mut self,
        spec: &OptimizerSpec,
        p: &mut [f32],
        at: usize,
        g: F32Run<'_>,
        scale: f32,
    ) {
        match g {
            F32Run::Values(v) => self.apply_at(spec, p, at, v, scale),
            F32Run::Le(b) => self.apply_at(spec, p, at, LeF32s(b), scale),
        }
    }

    /// Applies the piece `g` of the update [`OptState::start`] began to the parameters
    /// `p[at..at + g.len()]` of the chunk `p` (the caller validated the bounds), with the
    /// CPU's widest vector unit ([`wide`]).
    pub fn apply_at(
        &mut self,
        spec: &OptimizerSpec,
        p: &mut [f32],
        at: usize,
        g: impl Grad,
        scale: f32,
    ) {
        wide(Apply {
            state: self,
            spec,
            p,
            at,
            g,
            scale,
        });
    }
}

/// [`OptState::apply_at`]'s arguments, whose [`Loop::run`] is the update: compiled into each
/// version [`wide`] makes.
struct Apply<'a, G> {
    state: &'a mut OptState,
    spec: &'a OptimizerSpec,
    p: &'a mut [f32],
    at: usize,
    g: G,
    scale: f32,
}

impl<G: Grad> Loop for Apply<'_, G> {
    type Out = ();

    #[inline(always)]
    fn run(self) {
        let Apply {
            state,
            spec,
            p,
            at,
            g,
            scale,
        } = self;
        let range = at..at + Grad::len(&g);
        let p = &mut p[range.clone()];
        match (spec, state) {
            (OptimizerSpec::Sgd { lr }, OptState::Sgd) => {
                let k = lr * scale;
                // A learning rate of zero leaves every parameter as it is (the gradients are
                // finite): nothing to write.
                if k == 0.0 {
                    return;
                }
                for (p, g) in p.iter_mut().zip(g.values()) {
                    *p -= k * g;
                }
            }
            (OptimizerSpec::Momentum { lr, momentum }, OptState::Momentum { v }) => {
                for ((p, v), g) in p.iter_mut().zip(v[range].iter_mut()).zip(g.values()) {
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
                let c1 = 1.0 - beta1.powi((*t).min(i32::MAX as u64) as i32);
                let c2 = 1.0 - beta2.powi((*t).min(i32::MAX as u64) as i32);
                let step = lr / c1;
                let c2_sqrt = c2.sqrt();
                let (m, v) = (&mut m[range.clone()], &mut v[range]);
                let values = g.values();
                for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(values)
                {
                    let g = scale * g;
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= step * *m / ((*v).sqrt() / c2_sqrt + eps);
                }
            }
            // `start` made the state fit the spec.
            _ => {}
        }
    }
}

/// One optimizer of each kind, for tests.
#[cfg(test)]
pub(crate) fn one_of_each() -> [OptimizerSpec; 3] {
    [
        OptimizerSpec::Sgd { lr: 0.1 },
        OptimizerSpec::Momentum {
            lr: 0.1,
            momentum: 0.9,
        },
        OptimizerSpec::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_applied_in_pieces_equals_one_applied_whole() {
        let g: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        for spec in one_of_each() {
            let (mut whole, mut pieces) = (OptState::new(&spec, 1000), OptState::new(&spec, 1000));
            let (mut p1, mut p2) = (vec![0.5f32; 1000], vec![0.5f32; 1000]);
            for _ in 0..3 {
                whole.apply(&spec, &mut p1, &g, 0.5);
                pieces.start(&spec, 1000);
                for (at, len) in [(0, 1), (1, 300), (301, 699)] {
                    pieces.apply_at(&spec, &mut p2, at, &g[at..at + len], 0.5);
                }
            }
            assert_eq!(p1, p2, "{spec:?}");
            assert_eq!(whole, pieces, "{spec:?}");
        }
    }

    /// The update as built, not through [`wide`].
    fn baseline(state: &mut OptState, spec: &OptimizerSpec, p: &mut [f32], g: impl Grad) {
        Apply {
            state,
            spec,
            p,
            at: 0,
            g,
            scale: 0.5,
        }
        .run();
    }

    #[test]
    fn the_widened_update_equals_the_baseline_bit_for_bit() {
        // An odd length leaves every vector width a tail; the bytes start off alignment.
        let n = 1037;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.61).cos() * 3.0).collect();
        let mut bytes = vec![0u8; 3];
        bytes.extend(g.iter().flat_map(|v| v.to_le_bytes()));
        let le = LeF32s(&bytes[3..]);
        for spec in one_of_each() {
            let (mut wide, mut base) = (OptState::new(&spec, n), OptState::new(&spec, n));
            let (mut p1, mut p2) = (vec![0.25f32; n], vec![0.25f32; n]);
            for step in 0..4 {
                wide.start(&spec, n);
                base.start(&spec, n);
                if step % 2 == 0 {
                    wide.apply_at(&spec, &mut p1, 0, g.as_slice(), 0.5);
                    baseline(&mut base, &spec, &mut p2, g.as_slice());
                } else {
                    wide.apply_at(&spec, &mut p1, 0, le, 0.5);
                    baseline(&mut base, &spec, &mut p2, le);
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p1), bits(&p2), "{spec:?}");
            assert_eq!(wide, base, "{spec:?}");
        }
    }

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
