//! What a model looks like to the client: its named tensors, where each lies in the flat
//! parameter vector, and which keys (chunks) hold which of a tensor's rows.

use edl_shared::proto::ids::Key;
use edl_shared::proto::{JobConfig, KeyLayout, KeySpan};

use crate::ClientError;

/// One tensor of the job's model, placed in the flat parameter vector.
///
/// A tensor of shape `[d0, d1, …]` is stored row-major: row `r` is the `row_len()` floats at
/// `offset + r * row_len()`, where `row_len()` is the product of `d1, …` (1 for a vector).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView {
    /// The tensor's name, e.g. `fc1.weight`.
    pub name: String,
    /// Its shape.
    pub shape: Vec<u32>,
    /// Position in the job's tensor list.
    pub index: usize,
    /// Offset of its first float in the flat parameter vector.
    pub offset: usize,
    /// Number of floats.
    pub len: usize,
}

impl TensorView {
    /// Number of rows (the first dimension; 1 for a scalar).
    pub fn rows(&self) -> usize {
        self.shape.first().map_or(1, |&d| d as usize)
    }

    /// Floats per row (the product of every dimension after the first).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).map(|&d| d as usize).product()
    }

    /// The tensor's floats within the flat vector `flat`.
    ///
    /// # Panics
    /// When `flat` is shorter than the model (it must hold [`JobSpec::param_count`] floats).
    pub fn of<'a>(&self, flat: &'a [f32]) -> &'a [f32] {
        &flat[self.offset..self.offset + self.len]
    }

    /// The tensor's floats within the flat vector `flat`, to write.
    ///
    /// # Panics
    /// When `flat` is shorter than the model (it must hold [`JobSpec::param_count`] floats).
    pub fn of_mut<'a>(&self, flat: &'a mut [f32]) -> &'a mut [f32] {
        &mut flat[self.offset..self.offset + self.len]
    }
}

/// The job's model as the client sees it: named tensors over one flat `f32` vector, cut into
/// keys of `chunk_size` floats that the shards own.
///
/// ```
/// use edl_client::JobSpec;
/// use edl_shared::proto::{Init, TensorSpec};
///
/// let tensors = vec![
///     TensorSpec { name: "fc.weight".into(), shape: vec![784, 10], init: Init::Zeros },
///     TensorSpec { name: "fc.bias".into(), shape: vec![10], init: Init::Zeros },
/// ];
/// let spec = JobSpec::new(&tensors, 4096);
/// let bias = spec.tensor("fc.bias").expect("the job has it");
/// assert_eq!((bias.offset, bias.len), (7840, 10));
/// assert_eq!(spec.param_count(), 7850);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobSpec {
    tensors: Vec<TensorView>,
    layout: KeyLayout,
}

impl JobSpec {
    /// The spec of `tensors` cut into chunks of `chunk_size` floats.
    pub fn new(tensors: &[edl_shared::proto::TensorSpec], chunk_size: u32) -> JobSpec {
        let mut offset = 0usize;
        let views = tensors
            .iter()
            .enumerate()
            .map(|(index, t)| {
                let len = t.len() as usize;
                let v = TensorView {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    index,
                    offset,
                    len,
                };
                offset += len;
                v
            })
            .collect();
        JobSpec {
            tensors: views,
            layout: KeyLayout::new(tensors, chunk_size),
        }
    }

    /// The spec of a job.
    pub fn of(job: &JobConfig) -> JobSpec {
        JobSpec::new(&job.tensors, job.chunk_size)
    }

    /// Every tensor, in the order of the flat vector.
    pub fn tensors(&self) -> &[TensorView] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorView> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor called `name`, or [`ClientError::UnknownTensor`].
    pub fn require(&self, name: &str) -> Result<&TensorView, ClientError> {
        self.tensor(name)
            .ok_or_else(|| ClientError::UnknownTensor(name.to_string()))
    }

    /// Floats in the whole model.
    pub fn param_count(&self) -> usize {
        self.layout.total_len() as usize
    }

    /// The key layout (which chunk of the flat vector each key is).
    pub fn layout(&self) -> &KeyLayout {
        &self.layout
    }

    /// Number of keys.
    pub fn num_keys(&self) -> u64 {
        self.layout.num_keys()
    }

    /// The keys holding rows `rows` of `tensor`, sorted and without repeats; an error names
    /// the first row out of range.
    pub fn keys_of_rows(&self, tensor: &TensorView, rows: &[u32]) -> Result<Vec<Key>, ClientError> {
        let mut keys: Vec<Key> = self.pieces(tensor, rows)?.iter().map(|p| p.key).collect();
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }

    /// Where rows `rows` of `tensor` lie in the keys' chunks, in the order of `rows`: row `i`
    /// is floats `i * row_len..(i + 1) * row_len` of the caller's buffer, in one piece per
    /// chunk it spans. An error names the first row out of range.
    pub(crate) fn pieces(
        &self,
        tensor: &TensorView,
        rows: &[u32],
    ) -> Result<Vec<Piece>, ClientError> {
        let row_len = tensor.row_len();
        let mut out = Vec::with_capacity(rows.len());
        for (i, &r) in rows.iter().enumerate() {
            if r as usize >= tensor.rows() {
                return Err(ClientError::RowOutOfRange {
                    tensor: tensor.name.clone(),
                    row: r,
                    rows: tensor.rows(),
                });
            }
            let mut pos = (tensor.offset + r as usize * row_len) as u64;
            let end = pos + row_len as u64;
            let mut buf_at = i * row_len;
            while pos < end {
                let s = self.span_at(pos).ok_or_else(|| ClientError::Inconsistent {
                    from: "client".into(),
                    what: format!("float {pos} of tensor {:?} has no key", tensor.name),
                })?;
                let len = ((s.offset + u64::from(s.len)).min(end) - pos) as usize;
                out.push(Piece {
                    key: s.key,
                    chunk_len: s.len as usize,
                    at: (pos - s.offset) as usize,
                    len,
                    buf_at,
                });
                pos += len as u64;
                buf_at += len;
            }
        }
        Ok(out)
    }

    /// The key span whose chunk holds float `at` of the flat vector.
    fn span_at(&self, at: u64) -> Option<KeySpan> {
        let spans = self.layout.spans();
        let i = spans.partition_point(|s| s.offset + u64::from(s.len) <= at);
        spans.get(i).filter(|s| s.offset <= at).copied()
    }
}

/// A run of one row's floats within one key's chunk (see [`JobSpec::pieces`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The key.
    pub(crate) key: Key,
    /// Floats in the key's chunk.
    pub(crate) chunk_len: usize,
    /// Where the run starts within the chunk.
    pub(crate) at: usize,
    /// Floats in the run.
    pub(crate) len: usize,
    /// Where the run starts within the caller's rows buffer.
    pub(crate) buf_at: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_shared::proto::{Init, TensorSpec};

    fn spec() -> JobSpec {
        let t = |name: &str, shape: Vec<u32>| TensorSpec {
            name: name.into(),
            shape,
            init: Init::Zeros,
        };
        // emb: 10 rows of 3 floats (30 floats), bias: 1; chunks of 8 floats.
        JobSpec::new(&[t("emb", vec![10, 3]), t("bias", vec![1])], 8)
    }

    #[test]
    fn views_place_tensors_and_rows() {
        let s = spec();
        let emb = s.require("emb").expect("emb");
        assert_eq!(
            (emb.rows(), emb.row_len(), emb.offset, emb.len),
            (10, 3, 0, 30)
        );
        let bias = s.require("bias").expect("bias");
        assert_eq!((bias.rows(), bias.row_len(), bias.offset), (1, 1, 30));
        assert!(matches!(
            s.require("nope"),
            Err(ClientError::UnknownTensor(n)) if n == "nope"
        ));
        let flat: Vec<f32> = (0..31).map(|i| i as f32).collect();
        assert_eq!(bias.of(&flat), &[30.0]);
    }

    #[test]
    fn rows_map_to_the_keys_that_hold_them() {
        let s = spec();
        let emb = s.require("emb").expect("emb");
        // emb keys: 0 = floats 0..8, 1 = 8..16, 2 = 16..24, 3 = 24..30; bias is key 4.
        // Row 2 is floats 6..9: keys 0 and 1. Row 9 is 27..30: key 3.
        let keys = s.keys_of_rows(emb, &[9, 2, 2]).expect("in range");
        assert_eq!(keys, vec![Key(0), Key(1), Key(3)]);
        let bias = s.require("bias").expect("bias");
        assert_eq!(s.keys_of_rows(bias, &[0]).expect("row 0"), vec![Key(4)]);
        assert!(matches!(
            s.keys_of_rows(emb, &[10]),
            Err(ClientError::RowOutOfRange {
                row: 10,
                rows: 10,
                ..
            })
        ));
    }
}
