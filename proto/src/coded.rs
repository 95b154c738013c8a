//! A push's payload walked chunk by chunk, each chunk at its own coding ([`ChunkRef`]'s
//! `wire` and `sparse`: a job's tensors may travel differently). [`check`] reads it whole
//! before anything is applied; [`Coded`] then hands each chunk's values on as f32 runs where
//! they are applied: f32 values where they lie, 16-bit values converted a block at a time into
//! a buffer that stays in cache, a sparse record spread into a chunk of zeros. No f32 copy of
//! the push is made.

use bytes::Bytes;

use crate::error::ProtoError;
use crate::frame::{F32Run, F32Runs};
use crate::msg::ChunkRef;
use crate::sparse::each_sparse;
use crate::wire::{BLOCK, Wire, decode, first_bad_le};

/// Checks that `parts` hold exactly the values of `chunks`, each well formed and finite in
/// its precision. The chunks' lengths must have been checked against the job's keys: a
/// sparse record is spread over a buffer of its chunk's length. A value that is not: `NonFinite` with its position among the chunks'
/// values; too few bytes: `Truncated`; more: `Trailing`; a bad sparse record: `Payload`.
pub fn check(parts: &[Bytes], chunks: &[ChunkRef]) -> Result<(), ProtoError> {
    let mut runs = F32Runs::new(parts);
    let mut record = Vec::new();
    let mut at = 0u64;
    for c in chunks {
        let len = c.len as usize;
        if c.sparse {
            gather_record(&mut runs, c, &mut record)?;
            each_sparse(&record, [len], c.wire, |_, _| {}).map_err(|e| offset(e, at))?;
        } else {
            let size = c.wire.value_bytes();
            let (mut seen, mut bad) = (0usize, None);
            let got = runs.bytes(len * size, size, |b| {
                if bad.is_none() {
                    bad = first_bad_le(b, c.wire).map(|i| seen + i);
                    seen += b.len() / size;
                }
            });
            if let Some(i) = bad {
                return Err(ProtoError::NonFinite {
                    index: at + i as u64,
                });
            }
            short(got, len * size)?;
        }
        at += u64::from(c.len);
    }
    match runs.remaining() {
        0 => Ok(()),
        n => Err(ProtoError::Trailing(n as u64)),
    }
}

/// The payload bytes each of `chunks` takes in `parts`, in order: a dense chunk's values, a
/// sparse record as long as its count says; as many as `parts` hold (a checked payload holds
/// all of them).
pub fn sizes(parts: &[Bytes], chunks: &[ChunkRef]) -> Vec<usize> {
    let mut runs = F32Runs::new(parts);
    let mut count = Vec::with_capacity(4);
    let mut out = Vec::with_capacity(chunks.len());
    for c in chunks {
        let size = if c.sparse {
            count.clear();
            if !runs.gather(4, &mut count) {
                break;
            }
            let n = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
            4 + n * (4 + c.wire.value_bytes())
        } else {
            c.len as usize * c.wire.value_bytes()
        };
        let skipped = if c.sparse { size - 4 } else { size };
        if runs.bytes(skipped, 1, |_| {}) < skipped {
            break;
        }
        out.push(size);
    }
    out
}

/// Buffers a walk reuses: a block of converted values, a sparse record and its chunk.
#[derive(Debug, Default)]
struct Scratch {
    block: Vec<f32>,
    record: Vec<u8>,
    dense: Vec<f32>,
}

/// Gathers chunk `c`'s sparse record into `record` (its count no more than the chunk's
/// values; the rest read by [`each_sparse`]).
fn gather_record(
    runs: &mut F32Runs<'_>,
    c: &ChunkRef,
    record: &mut Vec<u8>,
) -> Result<(), ProtoError> {
    let len = c.len as usize;
    record.clear();
    let truncated = |got: usize, needed: usize| ProtoError::Truncated {
        needed: needed as u64,
        got: got as u64,
    };
    if !runs.gather(4, record) {
        return Err(truncated(record.len(), 4));
    }
    let count = u32::from_le_bytes([record[0], record[1], record[2], record[3]]) as usize;
    if count > len {
        return Err(ProtoError::Payload(format!(
            "a sparse record sends {count} values of {len}"
        )));
    }
    let body = count * (4 + c.wire.value_bytes());
    if !runs.gather(body, record) {
        return Err(truncated(record.len() - 4, body));
    }
    Ok(())
}

/// `e` with a value's position moved on by `at` values.
fn offset(e: ProtoError, at: u64) -> ProtoError {
    match e {
        ProtoError::NonFinite { index } => ProtoError::NonFinite { index: at + index },
        other => other,
    }
}

fn short(got: usize, needed: usize) -> Result<(), ProtoError> {
    match got == needed {
        true => Ok(()),
        false => Err(ProtoError::Truncated {
            needed: needed as u64,
            got: got as u64,
        }),
    }
}

/// Walks a checked payload ([`check`]) chunk by chunk, handing each chunk's values on as f32.
#[derive(Debug)]
pub struct Coded<'a> {
    runs: F32Runs<'a>,
    scratch: Scratch,
}

impl<'a> Coded<'a> {
    /// A walk over `parts` from the start.
    pub fn new(parts: &'a [Bytes]) -> Self {
        Coded {
            runs: F32Runs::new(parts),
            scratch: Scratch::default(),
        }
    }

    /// Hands chunk `c`'s values to `f` as runs of f32, each with its position in the chunk.
    /// `Err` if the payload does not hold them as `c` says (it was not checked).
    pub fn take(
        &mut self,
        c: &ChunkRef,
        mut f: impl FnMut(usize, F32Run<'_>),
    ) -> Result<(), ProtoError> {
        let len = c.len as usize;
        if c.sparse {
            let Scratch { record, dense, .. } = &mut self.scratch;
            gather_record(&mut self.runs, c, record)?;
            dense.clear();
            dense.resize(len, 0.0);
            each_sparse(record, [len], c.wire, |p, v| dense[p] = v)?;
            f(0, F32Run::Values(dense));
            return Ok(());
        }
        if c.wire == Wire::F32 {
            let mut seen = 0;
            self.runs.take(len, |at, run| {
                seen += run.len();
                f(at, run)
            });
            return short(seen * 4, len * 4);
        }
        let size = c.wire.value_bytes();
        let block = &mut self.scratch.block;
        block.resize(BLOCK, 0.0);
        let (mut at, mut bad) = (0usize, None);
        let got = self.runs.bytes(len * size, size, |b| {
            if bad.is_some() {
                return;
            }
            for piece in b.chunks(BLOCK * size) {
                let out = &mut block[..piece.len() / size];
                if let Err(e) = decode(piece, c.wire, out) {
                    bad.get_or_insert(e);
                    return;
                }
                f(at, F32Run::Values(out));
                at += out.len();
            }
        });
        match bad {
            Some(e) => Err(e),
            None => short(got, len * size),
        }
    }

    /// Steps past chunk `c`'s values without converting them.
    pub fn skip(&mut self, c: &ChunkRef) -> Result<(), ProtoError> {
        if c.sparse {
            return gather_record(&mut self.runs, c, &mut self.scratch.record);
        }
        let bytes = c.len as usize * c.wire.value_bytes();
        short(self.runs.bytes(bytes, 1, |_| {}), bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Key;
    use crate::sparse::encode_topk;
    use bytes::BytesMut;

    /// The values `chunks` of `payload` (cut into parts at `cuts`) hand on, flat.
    fn walked(chunks: &[ChunkRef], payload: &[u8], cuts: &[usize]) -> Vec<f32> {
        let mut parts = Vec::new();
        let mut from = 0;
        for &c in cuts.iter().chain([&payload.len()]) {
            parts.push(Bytes::copy_from_slice(&payload[from..c]));
            from = c;
        }
        check(&parts, chunks).expect("well formed");
        let mut coded = Coded::new(&parts);
        let mut out = Vec::new();
        for c in chunks {
            let mut chunk = vec![f32::NAN; c.len as usize];
            coded
                .take(c, |at, run| match run {
                    F32Run::Values(v) => chunk[at..at + v.len()].copy_from_slice(v),
                    F32Run::Le(b) => {
                        crate::frame::bytes_to_f32s(b, &mut chunk[at..at + b.len() / 4])
                            .expect("whole values")
                    }
                })
                .expect("walks");
            out.extend(chunk);
        }
        out
    }

    #[test]
    fn chunks_at_different_codings_walk_back_to_their_values_across_any_cuts() {
        let a: Vec<f32> = (0..5000).map(|i| i as f32 * 0.25 - 300.0).collect();
        let b: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
        let mut c = vec![0.0f32; 200];
        c[17] = 3.0;
        c[150] = -2.0;
        let mut payload = BytesMut::new();
        crate::wire::encode_finite(&mut payload, &a, Wire::Bf16).expect("finite");
        crate::frame::extend_f32s(&mut payload, &b);
        let mut acc = c.clone();
        encode_topk(&mut payload, &mut acc, 2, Wire::F16, &mut Vec::new()).expect("finite");
        let chunks = [
            ChunkRef::new(Key(0), 5000).coded(Wire::Bf16, false),
            ChunkRef::new(Key(1), 10),
            ChunkRef::new(Key(2), 200).coded(Wire::F16, true),
        ];
        let want: Vec<f32> = crate::wire::round_trip(&a, Wire::Bf16)
            .expect("finite")
            .into_iter()
            .chain(b.iter().copied())
            .chain(c.iter().copied())
            .collect();
        for cuts in [&[][..], &[1], &[3, 9999, 10001, 10040], &[10000, 10043]] {
            assert_eq!(walked(&chunks, &payload, cuts), want, "cut at {cuts:?}");
        }
    }

    #[test]
    fn a_payload_that_does_not_hold_its_chunks_is_refused_with_the_position() {
        let one = [ChunkRef::new(Key(0), 2).coded(Wire::Bf16, false)];
        let two = [ChunkRef::new(Key(0), 3), one[0]];
        let bf16 = |v: f32| half::bf16::from_f32(v).to_le_bytes();
        let nan_second: Vec<u8> = [bf16(1.0), bf16(f32::NAN)].concat();
        let parts = |b: &[u8]| vec![Bytes::copy_from_slice(b)];
        assert!(matches!(
            check(&parts(&nan_second), &one),
            Err(ProtoError::NonFinite { index: 1 })
        ));
        let lead: Vec<u8> = [1f32, 2.0, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let both = [lead.clone(), nan_second.clone()].concat();
        assert!(matches!(
            check(&parts(&both), &two),
            Err(ProtoError::NonFinite { index: 4 })
        ));
        assert!(matches!(
            check(&parts(&nan_second[..3]), &one),
            Err(ProtoError::Truncated { .. })
        ));
        let long = [nan_second.clone(), vec![0]].concat();
        let fine: Vec<u8> = [bf16(1.0), bf16(2.0), [0, 0]].concat();
        assert!(matches!(
            check(&parts(&fine), &one),
            Err(ProtoError::Trailing(2))
        ));
        assert!(check(&parts(&long), &one).is_err());
        let sparse = [ChunkRef::new(Key(0), 4).coded(Wire::F32, true)];
        let too_many: Vec<u8> = 5u32.to_le_bytes().to_vec();
        assert!(matches!(
            check(&parts(&too_many), &sparse),
            Err(ProtoError::Payload(_))
        ));
    }
}
