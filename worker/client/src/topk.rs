//! Top-k pushes with error feedback ([`edl_shared::proto::sparse`]): a worker sends only the
//! largest values of each chunk of its gradient plus what it held back before, and keeps the
//! rest (its residual) for its next push. The residual lives as long as the worker's session:
//! a worker that leaves, or dies, takes it with it, and the samples it had not committed are
//! issued again as for any worker. In a job whose tensors travel differently, a tensor
//! without top-k is sent whole in the same push and keeps no residual.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use edl_shared::proto::msg::{DataSpan, KeyRange};
use edl_shared::proto::sparse::encode_topk;
use edl_shared::proto::wire::encode_finite;
use edl_shared::proto::{Clock, KeyLayout, WireSpec};

use crate::ClientError;
use crate::routing::tensor_wire;

/// A worker's residual: per value of the model, what its top-k pushes have not sent yet.
#[derive(Debug, Default)]
pub(crate) struct Residual {
    /// The residual after the last push that shards took.
    kept: Vec<f32>,
    /// The residual after the push being sent (taken into `kept` range by range as shards
    /// answer it).
    next: Vec<f32>,
    scratch: Vec<f32>,
    /// The last push with a data span, until every shard took it: the same step and span
    /// pushed again (after a failure) is sent as it was first made.
    pending: Option<(Clock, DataSpan, Arc<Sparse>)>,
}

/// A top-k push of the whole model: every key's values as they travel (a sparse record, or
/// dense where its tensor is not top-k sparsified), in key order.
#[derive(Debug)]
pub(crate) struct Sparse {
    bytes: Bytes,
    /// Key `k`'s record is `bytes[at[k]..at[k + 1]]`.
    at: Vec<usize>,
}

impl Sparse {
    /// The records of the keys of `ranges` (in key order), as payload parts: shared, not
    /// copied.
    pub(crate) fn parts(&self, ranges: &[KeyRange]) -> Vec<Bytes> {
        ranges
            .iter()
            .map(|r| {
                self.bytes
                    .slice(self.at[r.start as usize]..self.at[r.end as usize])
            })
            .collect()
    }
}

impl Residual {
    /// The push of step `clock` with `span`: the pending one if it is that step's and span's
    /// (pushed again after a failure: some shards may have applied it, and skip it now),
    /// otherwise [`Residual::encode`]'s, pending until [`Residual::done`] if it has a span.
    pub(crate) fn push(
        &mut self,
        layout: &KeyLayout,
        grads: &[f32],
        wires: &[WireSpec],
        (clock, span): (Clock, Option<DataSpan>),
    ) -> Result<Arc<Sparse>, ClientError> {
        if let (Some((c, s, sparse)), Some(span)) = (&self.pending, span)
            && (*c, *s) == (clock, span)
        {
            return Ok(sparse.clone());
        }
        self.pending = None;
        let sparse = Arc::new(self.encode(layout, grads, wires)?);
        if let Some(span) = span {
            self.pending = Some((clock, span, sparse.clone()));
        }
        Ok(sparse)
    }

    /// Every shard took the pending push.
    pub(crate) fn done(&mut self) {
        self.pending = None;
    }

    /// The sparse push of `grads` (the flat gradient of the whole model) plus the residual:
    /// of each chunk, the largest values its tensor's wire says (`wires`, per tensor), at its
    /// precision; all of them where its tensor has no top-k. What is not sent becomes the next
    /// residual, taken for the keys whose shards accept the push ([`Residual::taken`]).
    fn encode(
        &mut self,
        layout: &KeyLayout,
        grads: &[f32],
        wires: &[WireSpec],
    ) -> Result<Sparse, ClientError> {
        if self.kept.len() != grads.len() {
            self.kept = vec![0.0; grads.len()];
        }
        self.next.clear();
        self.next
            .extend(self.kept.iter().zip(grads).map(|(r, g)| r + g));
        let spans = layout.spans();
        let most = (spans.iter())
            .map(|s| tensor_wire(wires, s.tensor).max_bytes(s.len as usize))
            .sum();
        let mut bytes = BytesMut::with_capacity(most);
        let mut at = Vec::with_capacity(spans.len() + 1);
        at.push(0);
        for s in spans {
            let (off, len) = (s.offset as usize, s.len as usize);
            let acc = &mut self.next[off..off + len];
            let w = tensor_wire(wires, s.tensor);
            // A gradient's own values are checked here too: a NaN in it poisons the sum.
            match w.topk {
                Some(k) => encode_topk(&mut bytes, acc, k.keep(len), w.values, &mut self.scratch),
                None => encode_finite(&mut bytes, acc, w.values).map(|()| acc.fill(0.0)),
            }
            .map_err(|i| crate::refused_at(acc, i, off, w.values))?;
            at.push(bytes.len());
        }
        Ok(Sparse {
            bytes: bytes.freeze(),
            at,
        })
    }

    /// A shard took the push for the floats at `flat` (offset, length): their residual is now
    /// what that push left.
    pub(crate) fn taken(&mut self, flat: &[(usize, usize)]) {
        for &(off, len) in flat {
            self.kept[off..off + len].copy_from_slice(&self.next[off..off + len]);
        }
    }

    /// The residual's magnitude (the sum of absolute values), for tests and reports.
    pub(crate) fn l1(&self) -> f64 {
        self.kept.iter().map(|v| f64::from(v.abs())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::sparse::decode_sparse;
    use edl_shared::proto::wire::Wire;
    use edl_shared::proto::{Init, TensorSpec};

    /// Two keys of 4 floats.
    fn layout() -> KeyLayout {
        let t = TensorSpec {
            name: "w".into(),
            shape: vec![8],
            init: Init::Zeros,
        };
        KeyLayout::new(&[t], 4)
    }

    fn sent(sparse: &Sparse, ranges: &[KeyRange], lens: &[usize]) -> Vec<f32> {
        let bytes: Vec<u8> = sparse.parts(ranges).concat();
        let mut out = vec![0.0; lens.iter().sum()];
        decode_sparse(&bytes, lens.iter().copied(), Wire::F32, &mut out).expect("decodes");
        out
    }

    #[test]
    fn what_is_held_back_is_sent_later_and_nothing_is_lost() {
        let layout = layout();
        let k = ["topk:0.25".parse::<WireSpec>().expect("top-k")];
        let mut r = Residual::default();
        let all = [KeyRange { start: 0, end: 2 }];
        let g = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 0.0];
        let mut total_sent = vec![0.0f32; 8];
        for step in 0..8 {
            let push = r.encode(&layout, &g, &k).expect("finite");
            let s = sent(&push, &all, &[4, 4]);
            // One value per key of four.
            assert_eq!(
                s.iter().filter(|v| **v != 0.0).count(),
                2,
                "step {step}: {s:?}"
            );
            r.taken(&[(0, 8)]);
            total_sent.iter_mut().zip(&s).for_each(|(t, v)| *t += v);
            // Sent plus held back is every gradient so far.
            for i in 0..8 {
                let due = g[i] * (step + 1) as f32;
                assert!((total_sent[i] + r.kept[i] - due).abs() < 1e-4, "{i}");
            }
        }
        // Small values are sent too once they have grown: 0.25 a step is sent by step 8.
        assert!(total_sent[6] > 0.0, "{total_sent:?}");
    }

    #[test]
    fn a_push_not_taken_is_sent_again_as_it_was_and_the_next_starts_from_what_was_taken() {
        let layout = layout();
        let k = ["topk:0.25".parse::<WireSpec>().expect("top-k")];
        let mut r = Residual::default();
        let g = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 0.0];
        let span = |start| DataSpan {
            epoch: 0,
            partition: 0,
            start,
            end: start + 1,
        };
        let at = |clock, start| (Clock(clock), Some(span(start)));
        let first = r.push(&layout, &g, &k, at(0, 0)).expect("finite");
        r.taken(&[(0, 8)]);
        r.done();
        let second = r.push(&layout, &g, &k, at(1, 1)).expect("finite");
        assert_ne!(
            first.parts(&[KeyRange { start: 0, end: 2 }])[0],
            second.parts(&[KeyRange { start: 0, end: 2 }])[0]
        );
        // Only the first key's shard took it; the step is pushed again, with other values
        // even: it goes as it was made.
        r.taken(&[(0, 4)]);
        let again = r.push(&layout, &[9.0; 8], &k, at(1, 1)).expect("finite");
        assert!(Arc::ptr_eq(&second, &again));
        let taken = r.l1();
        r.taken(&[(4, 4)]);
        r.done();
        // What both keys kept is what the push left: a later step starts from it.
        assert!(r.l1() != taken);
        let without_span = r.push(&layout, &g, &k, (Clock(2), None)).expect("finite");
        let again = r.push(&layout, &g, &k, (Clock(2), None)).expect("finite");
        assert!(
            !Arc::ptr_eq(&without_span, &again),
            "a push without a span is never repeated"
        );
        // A gradient that is not finite names its position and changes nothing.
        let before = r.l1();
        let mut bad = g;
        bad[5] = f32::NAN;
        assert!(matches!(
            r.push(&layout, &bad, &k, at(3, 3)),
            Err(ClientError::NonFinite { index: 5 })
        ));
        assert_eq!(r.l1(), before);
    }

    #[test]
    fn a_tensor_without_top_k_goes_whole_in_the_same_push_and_keeps_no_residual() {
        let t = |name: &str| TensorSpec {
            name: name.into(),
            shape: vec![4],
            init: Init::Zeros,
        };
        let layout = KeyLayout::new(&[t("sparse"), t("whole")], 4);
        let wires = [
            "topk:0.25".parse::<WireSpec>().expect("top-k"),
            "bf16".parse().expect("bf16"),
        ];
        let mut r = Residual::default();
        let g = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 3.0];
        let push = r.encode(&layout, &g, &wires).expect("finite");
        let top = push.parts(&[KeyRange { start: 0, end: 1 }]).concat();
        let mut first = vec![0.0; 4];
        decode_sparse(&top, [4], Wire::F32, &mut first).expect("decodes");
        assert_eq!(first, [0.0, 0.0, 0.0, 4.0]);
        let whole = push.parts(&[KeyRange { start: 1, end: 2 }]).concat();
        assert_eq!(whole.len(), 4 * 2, "four bf16 values");
        let mut second = vec![0.0; 4];
        edl_shared::proto::wire::decode(&whole, Wire::Bf16, &mut second).expect("decodes");
        assert_eq!(second, g[4..]);
        r.taken(&[(0, 8)]);
        assert_eq!(
            r.kept[4..],
            [0.0; 4],
            "nothing held back of the whole tensor"
        );
        assert_eq!(r.l1(), 6.0);
        // A value past fp16's range in the whole tensor is refused by its position.
        let wires = [wires[0], "fp16".parse().expect("fp16")];
        let mut big = g;
        big[6] = 1e6;
        assert!(matches!(
            r.encode(&layout, &big, &wires),
            Err(ClientError::OutOfRange { index: 6, .. })
        ));
    }
}
