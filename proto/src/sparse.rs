//! Top-k sparsified pushes: of each chunk of a gradient, only its largest values by magnitude
//! travel, with their positions; the rest stay behind in the worker's residual and are added
//! to its next gradient (error feedback, as in Lin et al., "Deep Gradient Compression", ICLR
//! 2018, and BytePS' top-k compressor).
//!
//! A sparse push's payload holds one record per chunk, in the push's chunk order:
//!
//! ```text
//! count: u32 LE | count positions: u32 LE, ascending, each < the chunk's length
//!               | count values in the push's wire precision, little-endian
//! ```
//!
//! A shard turns it back into a dense gradient (zero where nothing travelled) before anything
//! else looks at it, so the optimizer applies it like any other push.

use std::fmt;
use std::str::FromStr;

use bytes::{BufMut, BytesMut};

use crate::error::ProtoError;
use crate::frame::first_non_finite;
use crate::wire::{Wire, decode_finite, encode_finite};

/// The fraction of each chunk's values a sparse push keeps, in parts per million.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct TopK {
    per_million: u32,
}

impl TopK {
    /// The fraction `fraction` (more than 0, at most 1, to a millionth).
    pub fn new(fraction: f64) -> Result<TopK, String> {
        let per_million = (fraction * 1e6).round();
        if !(fraction > 0.0 && fraction <= 1.0 && per_million >= 1.0) {
            return Err(format!(
                "a top-k fraction must lie in (0, 1] and be at least 0.000001, not {fraction}"
            ));
        }
        Ok(TopK {
            per_million: per_million as u32,
        })
    }

    /// The fraction kept.
    pub fn fraction(self) -> f64 {
        f64::from(self.per_million) / 1e6
    }

    /// How many of a chunk of `len` values are kept: the fraction rounded up, at least one.
    pub fn keep(self, len: usize) -> usize {
        let k = (len as u128 * u128::from(self.per_million)).div_ceil(1_000_000);
        (k as usize).clamp(len.min(1), len)
    }

    /// The most payload bytes a sparse push of `chunks` values at `wire` can take (a chunk
    /// may send fewer: zeros never travel).
    pub fn max_bytes(self, chunks: impl IntoIterator<Item = usize>, wire: Wire) -> usize {
        chunks
            .into_iter()
            .map(|len| 4 + self.keep(len) * (4 + wire.value_bytes()))
            .sum()
    }
}

impl fmt::Display for TopK {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "topk:{}", self.fraction())
    }
}

impl FromStr for TopK {
    type Err = String;

    fn from_str(s: &str) -> Result<TopK, String> {
        let s = s.trim();
        let fraction = s
            .strip_prefix("topk:")
            .ok_or_else(|| format!("{s:?} is not topk:FRACTION (e.g. topk:0.01)"))?;
        let f: f64 = fraction
            .trim()
            .parse()
            .map_err(|_| format!("{fraction:?} in {s:?} is not a number"))?;
        TopK::new(f)
    }
}

/// Appends the sparse record of one chunk, `acc` (a gradient plus its residual), keeping its
/// `k` largest values by magnitude (the lowest positions first among equal magnitudes) that
/// are not zero, and takes what travels out of it: `acc` is left holding the residual (zero
/// where a value travelled at f32, its rounding where it travelled at 16 bits). `scratch` is
/// reused between calls. `Err` holds the position of a value that is not finite (or not finite
/// in `wire`); `acc` and `out` are then unchanged.
pub fn encode_topk(
    out: &mut BytesMut,
    acc: &mut [f32],
    k: usize,
    wire: Wire,
    scratch: &mut Vec<f32>,
) -> Result<(), usize> {
    if let Some(i) = first_non_finite(acc) {
        return Err(i);
    }
    let k = k.min(acc.len());
    // The k-th largest magnitude: values above it are all kept, then values equal to it by
    // position until k are.
    let (threshold, mut ties) = if k == 0 {
        (f32::INFINITY, 0)
    } else {
        scratch.clear();
        scratch.extend(acc.iter().map(|v| v.abs()));
        let at = acc.len() - k;
        let (_, t, above) = scratch.select_nth_unstable_by(at, f32::total_cmp);
        let t = *t;
        let above = above.iter().filter(|&&m| m > t).count();
        (t, k - above)
    };
    let mut positions = Vec::with_capacity(k);
    for (i, v) in acc.iter().enumerate() {
        let m = v.abs();
        if m == 0.0 {
            continue;
        }
        if m > threshold || (m == threshold && ties > 0) {
            if m == threshold {
                ties -= 1;
            }
            positions.push(i as u32);
        }
    }
    let values: Vec<f32> = positions.iter().map(|&i| acc[i as usize]).collect();
    let start = out.len();
    out.reserve(4 + positions.len() * (4 + wire.value_bytes()));
    out.put_u32_le(positions.len() as u32);
    for &i in &positions {
        out.put_u32_le(i);
    }
    if let Err(j) = encode_finite(out, &values, wire) {
        out.truncate(start);
        return Err(positions[j] as usize);
    }
    // What stays is what did not travel: all of a value sent at f32, a 16-bit value's rounding.
    let mut sent = vec![0.0; values.len()];
    let encoded = &out[out.len() - values.len() * wire.value_bytes()..];
    decode_finite(encoded, wire, &mut sent).map_err(|_| 0usize)?;
    for (&i, s) in positions.iter().zip(&sent) {
        acc[i as usize] -= s;
    }
    Ok(())
}

/// Decodes a sparse payload (`bytes`, one record per chunk of `lens` values, in order) into
/// `out`, which holds the chunks' values one after the other and must be zero where nothing
/// travels. Refused: a record cut short or with bytes after the last one (`Truncated`,
/// `Trailing`), a count past its chunk's length or positions out of order or out of range
/// (`Header`), a value not finite in `wire` (`NonFinite` with its position in `out`).
pub fn decode_sparse(
    bytes: &[u8],
    lens: impl IntoIterator<Item = usize>,
    wire: Wire,
    out: &mut [f32],
) -> Result<(), ProtoError> {
    let (room, mut end, mut past) = (out.len(), 0usize, false);
    let lens = lens.into_iter().inspect(|len| {
        end += len;
        past |= end > room;
    });
    each_sparse(bytes, lens, wire, |i, v| {
        if let Some(o) = out.get_mut(i) {
            *o = v;
        }
    })?;
    match past {
        true => Err(ProtoError::Payload(
            "sparse chunks past the payload's end".into(),
        )),
        false => Ok(()),
    }
}

/// Reads a sparse payload as [`decode_sparse`] does, refusing what it refuses, and hands each
/// value that travelled to `put` with its position counted from the first chunk's first value
/// (a check needs no buffer to spread them over).
pub fn each_sparse(
    mut bytes: &[u8],
    lens: impl IntoIterator<Item = usize>,
    wire: Wire,
    mut put: impl FnMut(usize, f32),
) -> Result<(), ProtoError> {
    let size = wire.value_bytes();
    let mut values = Vec::new();
    let mut at = 0usize;
    for (c, len) in lens.into_iter().enumerate() {
        let count = take(&mut bytes, 4)?;
        let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
        if count > len {
            return Err(ProtoError::Payload(format!(
                "sparse chunk {c} sends {count} values of {len}"
            )));
        }
        let positions = take(&mut bytes, count * 4)?;
        let encoded = take(&mut bytes, count * size)?;
        values.resize(count, 0.0);
        decode_finite(encoded, wire, &mut values).map_err(|e| match e {
            ProtoError::NonFinite { index } => {
                let p = &positions[index as usize * 4..][..4];
                let p = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
                ProtoError::NonFinite {
                    index: (at + p as usize) as u64,
                }
            }
            other => other,
        })?;
        let mut next = 0usize;
        for (p, v) in positions.as_chunks::<4>().0.iter().zip(&values) {
            let p = u32::from_le_bytes(*p) as usize;
            if p < next || p >= len {
                return Err(ProtoError::Payload(format!(
                    "sparse chunk {c}: position {p} out of order or past its {len} values"
                )));
            }
            put(at + p, *v);
            next = p + 1;
        }
        at += len;
    }
    match bytes.len() {
        0 => Ok(()),
        n => Err(ProtoError::Trailing(n as u64)),
    }
}

/// The first `n` bytes of `bytes`, which it then starts after.
fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], ProtoError> {
    if bytes.len() < n {
        return Err(ProtoError::Truncated {
            needed: n as u64,
            got: bytes.len() as u64,
        });
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(acc: &mut [f32], k: usize) -> BytesMut {
        let mut out = BytesMut::new();
        encode_topk(&mut out, acc, k, Wire::F32, &mut Vec::new()).expect("finite");
        out
    }

    #[test]
    fn fractions_parse_print_back_and_round_the_count_up() {
        let k: TopK = "topk:0.01".parse().expect("parses");
        assert_eq!(k.to_string(), "topk:0.01");
        assert_eq!(k.fraction(), 0.01);
        assert_eq!(k.keep(1024), 11);
        assert_eq!(k.keep(100), 1);
        assert_eq!(k.keep(10), 1);
        assert_eq!(k.keep(0), 0);
        assert_eq!("topk:1".parse::<TopK>().expect("all").keep(7), 7);
        for bad in [
            "topk:0",
            "topk:1.5",
            "topk:-0.1",
            "topk:x",
            "0.01",
            "topk:1e-9",
        ] {
            assert!(bad.parse::<TopK>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_largest_values_travel_and_the_rest_stay_as_residual() {
        let mut acc = [0.5, -3.0, 0.0, 2.0, -0.25, 3.0, 1.0];
        let out = encoded(&mut acc, 3);
        // -3 and 3 and 2, at positions 1, 3, 5.
        let mut back = [9.0f32; 7];
        back.fill(0.0);
        decode_sparse(&out, [7], Wire::F32, &mut back).expect("decodes");
        assert_eq!(back, [0.0, -3.0, 0.0, 2.0, 0.0, 3.0, 0.0]);
        assert_eq!(acc, [0.5, 0.0, 0.0, 0.0, -0.25, 0.0, 1.0]);
        assert_eq!(out.len(), 4 + 3 * 8);
        // What travelled plus what stayed is what was there.
        let before = [0.5, -3.0, 0.0, 2.0, -0.25, 3.0, 1.0];
        for i in 0..7 {
            assert_eq!(back[i] + acc[i], before[i]);
        }
    }

    #[test]
    fn ties_go_to_the_lowest_positions_and_zeros_never_travel() {
        let mut acc = [1.0, -1.0, 1.0, 1.0];
        let out = encoded(&mut acc, 2);
        assert_eq!(acc, [0.0, 0.0, 1.0, 1.0]);
        assert_eq!(out.len(), 4 + 2 * 8);
        let mut zeros = [0.0f32, 0.0, 0.0];
        let out = encoded(&mut zeros, 2);
        assert_eq!(&out[..], &0u32.to_le_bytes());
        let mut few = [0.0f32, 2.0, 0.0];
        let out = encoded(&mut few, 2);
        assert_eq!(out.len(), 4 + 8);
    }

    #[test]
    fn records_of_several_chunks_decode_in_order_at_any_precision() {
        let chunks = [vec![1.0f32, -8.0, 0.5, 4.0], vec![0.25, 0.0], vec![-2.0; 5]];
        for wire in Wire::ALL {
            let mut out = BytesMut::new();
            let mut residual = Vec::new();
            for c in &chunks {
                let mut acc = c.clone();
                encode_topk(&mut out, &mut acc, 2, wire, &mut Vec::new()).expect("finite");
                residual.extend(acc);
            }
            let mut back = vec![0.0f32; 11];
            decode_sparse(&out, chunks.iter().map(Vec::len), wire, &mut back).expect("decodes");
            let whole: Vec<f32> = chunks.concat();
            let sum: Vec<f32> = back.iter().zip(&residual).map(|(a, b)| a + b).collect();
            assert_eq!(sum, whole, "{wire}");
            assert_eq!(back[1], -8.0, "{wire}");
        }
    }

    #[test]
    fn bad_values_refuse_the_chunk_and_leave_it_as_it_was() {
        let mut acc = [1.0, f32::NAN, 2.0];
        let mut out = BytesMut::new();
        let e = encode_topk(&mut out, &mut acc, 1, Wire::F32, &mut Vec::new());
        assert_eq!(e, Err(1));
        assert!(out.is_empty());
        // Past binary16's range, at its position in the chunk.
        let mut acc = [1.0, 0.0, 70_000.0];
        let e = encode_topk(&mut out, &mut acc, 1, Wire::F16, &mut Vec::new());
        assert_eq!((e, acc, out.len()), (Err(2), [1.0, 0.0, 70_000.0], 0));
    }

    #[test]
    fn malformed_payloads_are_refused() {
        let record = |count: u32, positions: &[u32], values: &[f32]| {
            let mut b = Vec::new();
            b.extend_from_slice(&count.to_le_bytes());
            positions
                .iter()
                .for_each(|p| b.extend_from_slice(&p.to_le_bytes()));
            values
                .iter()
                .for_each(|v| b.extend_from_slice(&v.to_le_bytes()));
            b
        };
        let mut out = [0.0f32; 4];
        let mut decode = |b: &[u8]| decode_sparse(b, [4], Wire::F32, &mut out);
        assert!(decode(&record(2, &[0, 3], &[1.0, 2.0])).is_ok());
        assert!(matches!(
            decode(&record(5, &[], &[])),
            Err(ProtoError::Payload(_))
        ));
        assert!(matches!(
            decode(&record(2, &[3, 1], &[1.0, 2.0])),
            Err(ProtoError::Payload(_))
        ));
        assert!(matches!(
            decode(&record(1, &[4], &[1.0])),
            Err(ProtoError::Payload(_))
        ));
        assert!(matches!(
            decode(&record(2, &[1, 1], &[1.0, 2.0])),
            Err(ProtoError::Payload(_))
        ));
        assert!(matches!(
            decode(&record(2, &[0, 1], &[1.0])),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(decode(&[1, 0]), Err(ProtoError::Truncated { .. })));
        let mut extra = record(1, &[0], &[1.0]);
        extra.push(0);
        assert_eq!(decode(&extra), Err(ProtoError::Trailing(1)));
        assert_eq!(
            decode(&record(2, &[1, 3], &[1.0, f32::INFINITY])),
            Err(ProtoError::NonFinite { index: 3 })
        );
        // Too few records for the chunks.
        assert!(matches!(
            decode_sparse(&record(0, &[], &[]), [4, 4], Wire::F32, &mut [0.0; 8]),
            Err(ProtoError::Truncated { .. })
        ));
    }
}
