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

/// Per-chunk optimizer state: the updates applied so far and the kind's buffers, one value per
/// parameter each (see [`OptState::buffers`]).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct OptState {
    /// Updates applied to the chunk so far (PyTorch's `step`).
    pub t: u64,
    /// The buffers, in the order [`OptState::buffers`] names them.
    pub bufs: Vec<Vec<f32>>,
}

impl OptState {
    /// The buffers `spec` keeps per parameter, in order: SGD with momentum its momentum
    /// buffer; Adam the first and second moments (and AMSGrad's maximum); Adagrad the sum of
    /// squares; RMSprop the squared average (then the gradient average when centered, then
    /// the momentum buffer with momentum); Adadelta the squared average and the accumulated
    /// delta.
    pub fn buffers(spec: &OptimizerSpec) -> usize {
        match *spec {
            OptimizerSpec::Sgd { momentum, .. } => usize::from(momentum != 0.0),
            OptimizerSpec::Adam { amsgrad, .. } => 2 + usize::from(amsgrad),
            OptimizerSpec::Adagrad { .. } => 1,
            OptimizerSpec::RmsProp {
                momentum, centered, ..
            } => 1 + usize::from(centered) + usize::from(momentum > 0.0),
            OptimizerSpec::Adadelta { .. } => 2,
        }
    }

    /// Fresh state for a chunk of `len` parameters.
    pub fn new(spec: &OptimizerSpec, len: usize) -> Self {
        let start = match *spec {
            OptimizerSpec::Adagrad {
                initial_accumulator_value,
                ..
            } => initial_accumulator_value as f32,
            _ => 0.0,
        };
        OptState {
            t: 0,
            bufs: vec![vec![start; len]; OptState::buffers(spec)],
        }
    }

    /// Whether this is state of `spec` for a chunk of `len` parameters (a checkpoint's, say).
    pub fn fits(&self, spec: &OptimizerSpec, len: usize) -> bool {
        self.bufs.len() == OptState::buffers(spec) && self.bufs.iter().all(|b| b.len() == len)
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
        // State and spec always come from the same job config; a mismatch cannot be built.
        if !self.fits(spec, len) {
            *self = OptState::new(spec, len);
        }
        self.t += 1;
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

    /// Each update as `torch.optim`'s single-tensor code computes it, operation for
    /// operation: hyperparameters and what is derived from them in double, cast to f32 where
    /// they meet a tensor; `a.mul_(x).add_(b, alpha=y)` as `a * x + y * b`, `addcmul` as
    /// `a + (v * b) * c`, `addcdiv` as `a + (v * b) / c` (no fused multiply-adds).
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
        let t = state.t.max(1);
        // The buffers in order, each cut to the piece.
        let mut bufs = state.bufs.iter_mut().map(|b| &mut b[range.clone()]);
        let grads = g.values().map(|g| scale * g);
        match *spec {
            OptimizerSpec::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => {
                let (neg_lr, wd) = ((-lr) as f32, weight_decay as f32);
                let (mu, keep) = (momentum as f32, (1.0 - dampening) as f32);
                match bufs.next() {
                    None => {
                        // A learning rate of zero leaves every parameter as it is (the
                        // gradients are finite): nothing to write.
                        if lr == 0.0 {
                            return;
                        }
                        for (p, g) in p.iter_mut().zip(grads) {
                            let d = if wd != 0.0 { g + wd * *p } else { g };
                            *p += neg_lr * d;
                        }
                    }
                    Some(b) => {
                        let first = t == 1;
                        for ((p, b), g) in p.iter_mut().zip(b.iter_mut()).zip(grads) {
                            let d = if wd != 0.0 { g + wd * *p } else { g };
                            *b = if first { d } else { *b * mu + keep * d };
                            let d = if nesterov { d + mu * *b } else { *b };
                            *p += neg_lr * d;
                        }
                    }
                }
            }
            OptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
                decoupled,
            } => {
                let step = t as f64;
                let bias1 = 1.0 - beta1.powf(step);
                let bias2_sqrt = (1.0 - beta2.powf(step)).sqrt() as f32;
                let neg_step = (-(lr / bias1)) as f32;
                let (b1, keep1) = (beta1 as f32, (1.0 - beta1) as f32);
                let (b2, keep2) = (beta2 as f32, (1.0 - beta2) as f32);
                let (eps, wd) = (eps as f32, weight_decay as f32);
                let shrink = (1.0 - lr * weight_decay) as f32;
                let (Some(m), Some(v)) = (bufs.next(), bufs.next()) else {
                    return;
                };
                // The gradient after weight decay: L2 (Adam) or parameters shrunk (AdamW).
                let decay = |p: &mut f32, g: f32| {
                    if decoupled {
                        if weight_decay != 0.0 {
                            *p *= shrink;
                        }
                        g
                    } else if wd != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    }
                };
                let moments = p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(grads);
                match bufs.next().filter(|_| amsgrad) {
                    None => {
                        for (((p, m), v), g) in moments {
                            let g = decay(p, g);
                            *m = *m * b1 + keep1 * g;
                            *v = *v * b2 + (keep2 * g) * g;
                            let denom = v.sqrt() / bias2_sqrt + eps;
                            *p += (neg_step * *m) / denom;
                        }
                    }
                    Some(vmax) => {
                        for ((((p, m), v), g), x) in moments.zip(vmax.iter_mut()) {
                            let g = decay(p, g);
                            *m = *m * b1 + keep1 * g;
                            *v = *v * b2 + (keep2 * g) * g;
                            *x = x.max(*v);
                            let denom = x.sqrt() / bias2_sqrt + eps;
                            *p += (neg_step * *m) / denom;
                        }
                    }
                }
            }
            OptimizerSpec::Adagrad {
                lr,
                lr_decay,
                weight_decay,
                eps,
                ..
            } => {
                let clr = lr / (1.0 + (t - 1) as f64 * lr_decay);
                let (neg_clr, eps, wd) = ((-clr) as f32, eps as f32, weight_decay as f32);
                let Some(sum) = bufs.next() else {
                    return;
                };
                for ((p, s), g) in p.iter_mut().zip(sum.iter_mut()).zip(grads) {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    *s += (1.0 * g) * g;
                    let std = s.sqrt() + eps;
                    *p += (neg_clr * g) / std;
                }
            }
            OptimizerSpec::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            } => {
                let (neg_lr, a, keep) = ((-lr) as f32, alpha as f32, (1.0 - alpha) as f32);
                let (eps, wd, mu) = (eps as f32, weight_decay as f32, momentum as f32);
                let Some(sq) = bufs.next() else {
                    return;
                };
                let mut avg_g = if centered { bufs.next() } else { None }.map(|b| b.iter_mut());
                let mut buf = if momentum > 0.0 { bufs.next() } else { None }.map(|b| b.iter_mut());
                for ((p, sq), g) in p.iter_mut().zip(sq.iter_mut()).zip(grads) {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    *sq = *sq * a + (keep * g) * g;
                    let avg = match avg_g.as_mut().and_then(Iterator::next) {
                        Some(ga) => {
                            *ga = *ga * a + keep * g;
                            (*sq + (-1.0 * *ga) * *ga).sqrt()
                        }
                        None => sq.sqrt(),
                    } + eps;
                    match buf.as_mut().and_then(Iterator::next) {
                        Some(b) => {
                            *b = *b * mu + (1.0 * g) / avg;
                            *p += neg_lr * *b;
                        }
                        None => *p += (neg_lr * g) / avg,
                    }
                }
            }
            OptimizerSpec::Adadelta {
                lr,
                rho,
                eps,
                weight_decay,
            } => {
                let (neg_lr, r, keep) = ((-lr) as f32, rho as f32, (1.0 - rho) as f32);
                let (eps, wd) = (eps as f32, weight_decay as f32);
                let (Some(sq), Some(acc)) = (bufs.next(), bufs.next()) else {
                    return;
                };
                for (((p, sq), acc), g) in p
                    .iter_mut()
                    .zip(sq.iter_mut())
                    .zip(acc.iter_mut())
                    .zip(grads)
                {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    *sq = *sq * r + (keep * g) * g;
                    let std = (*sq + eps).sqrt();
                    let delta = (*acc + eps).sqrt() / std * g;
                    *acc = *acc * r + (keep * delta) * delta;
                    *p += neg_lr * delta;
                }
            }
        }
    }
}

/// Every optimizer kind, and each with the settings that add buffers or branches, for tests.
#[cfg(test)]
pub(crate) fn one_of_each() -> Vec<OptimizerSpec> {
    [
        "sgd:0.1",
        "momentum:0.1:0.9",
        "sgd:0.1,momentum=0.9,dampening=0.1,weight_decay=0.01",
        "sgd:0.1,momentum=0.9,nesterov=true,weight_decay=0.01",
        "adam:0.01",
        "adam:0.01,weight_decay=0.01,amsgrad=true",
        "adamw:0.01",
        "adamw:0.01,amsgrad=true,beta1=0.8,eps=0.001",
        "adagrad:0.1,lr_decay=0.01,initial_accumulator_value=0.1,weight_decay=0.01",
        "rmsprop:0.01",
        "rmsprop:0.01,centered=true,momentum=0.9,weight_decay=0.01",
        "rmsprop:0.01,momentum=0.5",
        "adadelta:1",
        "adadelta:0.5,rho=0.95,weight_decay=0.01",
    ]
    .iter()
    .map(|s| s.parse().expect("a valid optimizer"))
    .collect()
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
        let spec = OptimizerSpec::sgd(0.5);
        let mut st = OptState::new(&spec, 2);
        let mut p = [1.0, 2.0];
        st.apply(&spec, &mut p, &[2.0, -4.0], 1.0);
        assert_eq!(p, [0.0, 4.0]);

        let spec = OptimizerSpec::momentum(0.1, 0.9);
        let mut st = OptState::new(&spec, 1);
        let mut p = [0.0f32];
        st.apply(&spec, &mut p, &[1.0], 1.0);
        st.apply(&spec, &mut p, &[1.0], 1.0);
        // v1 = 1, v2 = 1.9; p = -0.1 - 0.19
        assert!((p[0] + 0.29).abs() < 1e-6, "{}", p[0]);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let spec = OptimizerSpec::adam(0.01);
        let mut st = OptState::new(&spec, 3);
        let mut p = [0.0f32; 3];
        st.apply(&spec, &mut p, &[3.0, -0.5, 100.0], 1.0);
        for (x, sign) in p.iter().zip([-1.0, 1.0, -1.0]) {
            assert!((x - sign * 0.01).abs() < 1e-5, "{x}");
        }
    }
}
