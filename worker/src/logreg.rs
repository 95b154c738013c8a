//! Binary logistic regression on sparse features: `p = sigmoid(bias + sum_f weight[f] * x_f)`
//! with the mean log-loss over the batch. A batch touches only the weights of the features
//! its rows hold, so a step pulls and pushes those rows of `weight` (and `bias`) and nothing
//! else.

use edl_client::JobSpec;

use crate::backend::{BackendError, StepStats};
use crate::workload::{Dataset, Grads, Model, Params, SparseBatch, SparseSet, TensorRows};

/// The model: tensors `weight` (`[features]`) and `bias` (`[1]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogReg {
    features: u32,
}

/// Log-loss of probability `p` for label `positive`, kept finite.
fn log_loss(p: f64, positive: bool) -> f64 {
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    if positive { -p.ln() } else { -(1.0 - p).ln() }
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

impl LogReg {
    /// Logistic regression over `features` features.
    pub fn new(features: u32) -> Self {
        LogReg { features }
    }

    /// Number of features.
    pub fn features(&self) -> u32 {
        self.features
    }

    /// The probability of a positive label for a row given as (weight, value) pairs.
    fn prob<'a>(terms: impl Iterator<Item = (f32, &'a f32)>, bias: f32) -> f64 {
        let z = terms
            .map(|(w, &x)| f64::from(w) * f64::from(x))
            .sum::<f64>()
            + f64::from(bias);
        sigmoid(z)
    }
}

impl Model for LogReg {
    type Data = SparseSet;

    fn check(&self, spec: &JobSpec, data: &SparseSet) -> Result<(), String> {
        let w = spec
            .tensor("weight")
            .ok_or("the job has no tensor \"weight\"")?;
        let b = spec
            .tensor("bias")
            .ok_or("the job has no tensor \"bias\"")?;
        if w.shape != [self.features] || b.shape != [1] {
            return Err(format!(
                "logistic regression over {} features needs weight [{}] and bias [1], the job \
                 has weight {:?} and bias {:?}",
                self.features, self.features, w.shape, b.shape
            ));
        }
        if data.data().features() > self.features {
            return Err(format!(
                "the data has {} features, the model {}",
                data.data().features(),
                self.features
            ));
        }
        Ok(())
    }

    fn touched(&self, batch: &SparseBatch) -> Option<Vec<TensorRows>> {
        let mut rows = batch.indices.clone();
        rows.sort_unstable();
        rows.dedup();
        Some(vec![
            TensorRows {
                tensor: "weight".into(),
                rows,
                values: Vec::new(),
            },
            TensorRows {
                tensor: "bias".into(),
                rows: vec![0],
                values: Vec::new(),
            },
        ])
    }

    fn step(
        &mut self,
        params: Params<'_>,
        batch: &SparseBatch,
        grads: Grads<'_>,
    ) -> Result<StepStats, BackendError> {
        let (Params::Rows(p), Grads::Rows(g)) = (params, grads) else {
            return Err(BackendError::Device(
                "logistic regression is sparse: it takes the rows its batch touches".into(),
            ));
        };
        let shape_err = || BackendError::Device("weight and bias rows expected".into());
        let [pw, pb] = p else { return Err(shape_err()) };
        let [gw, gb] = g else { return Err(shape_err()) };
        if batch.is_empty() {
            return Err(BackendError::EmptyBatch);
        }
        if pw.rows.len() != pw.values.len() || pb.values.len() != 1 {
            return Err(shape_err());
        }
        let bias = pb.values[0];
        gw.rows.clone_from(&pw.rows);
        gw.values.clear();
        gw.values.resize(pw.rows.len(), 0.0);
        gb.rows = vec![0];
        let mut g_bias = 0f64;
        let n = batch.len() as f64;
        let mut stats = StepStats::default();
        // Per row, where each of its features lies among the pulled rows (found once).
        let mut at: Vec<usize> = Vec::new();
        for i in 0..batch.len() {
            let (features, values) = batch.row(i);
            at.clear();
            for &f in features {
                let k = pw.rows.binary_search(&f).map_err(|_| {
                    BackendError::Device(format!("feature {f} of the batch was not pulled"))
                })?;
                at.push(k);
            }
            let p = LogReg::prob(at.iter().map(|&k| pw.values[k]).zip(values), bias);
            let positive = batch.positive[i];
            stats.loss_sum += log_loss(p, positive);
            stats.correct += usize::from((p >= 0.5) == positive);
            stats.samples += 1;
            let d = p - f64::from(u8::from(positive));
            for (&k, &x) in at.iter().zip(values) {
                gw.values[k] += (d * f64::from(x) / n) as f32;
            }
            g_bias += d / n;
        }
        gb.values = vec![g_bias as f32];
        Ok(stats)
    }

    fn evaluate(&mut self, params: &[f32], data: &SparseSet) -> Result<StepStats, BackendError> {
        let f = self.features as usize;
        if params.len() != f + 1 {
            return Err(BackendError::ParamsLen {
                expected: f + 1,
                actual: params.len(),
            });
        }
        let (weight, bias) = params.split_at(f);
        let mut stats = StepStats::default();
        let d = data.data();
        for i in 0..Dataset::len(data) {
            let (features, values) = d.row(i);
            let w = features
                .iter()
                .map(|&k| weight.get(k as usize).copied().unwrap_or(0.0));
            let p = LogReg::prob(w.zip(values), bias[0]);
            stats.loss_sum += log_loss(p, d.positive(i));
            stats.correct += usize::from((p >= 0.5) == d.positive(i));
            stats.samples += 1;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::libsvm::SparseData;
    use std::path::Path;

    #[test]
    fn gradient_matches_finite_differences() {
        let data =
            SparseData::parse("1 1:1 3:0.5\n0 2:1 3:-1\n1 1:2\n", Path::new("t")).expect("parses");
        let set = SparseSet::from(data);
        let mut batch = SparseBatch::default();
        set.gather(&[0, 1, 2], &mut batch).expect("gathers");
        let mut m = LogReg::new(3);
        let mut rows = m.touched(&batch).expect("sparse");
        assert_eq!(rows[0].rows, vec![0, 1, 2]);
        rows[0].values = vec![0.3, -0.2, 0.1];
        rows[1].values = vec![0.05];
        let mut grads = rows.clone();
        let stats = m
            .step(Params::Rows(&rows), &batch, Grads::Rows(&mut grads))
            .expect("steps");
        assert_eq!(stats.samples, 3);
        let flat = |r: &[TensorRows]| {
            let mut v = r[0].values.clone();
            v.push(r[1].values[0]);
            v
        };
        let loss = |p: &[f32]| {
            let mut m = LogReg::new(3);
            m.evaluate(p, &set).expect("evaluates").loss_sum / 3.0
        };
        let p0 = flat(&rows);
        let g = flat(&grads);
        for k in 0..4 {
            let (mut up, mut down) = (p0.clone(), p0.clone());
            up[k] += 1e-3;
            down[k] -= 1e-3;
            let numeric = (loss(&up) - loss(&down)) / 2e-3;
            assert!(
                (numeric - f64::from(g[k])).abs() < 1e-3,
                "parameter {k}: numeric {numeric}, analytic {}",
                g[k]
            );
        }
    }
}
