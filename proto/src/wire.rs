//! Wire precisions of tensor payloads: f32 as held, or a 16-bit float (bfloat16, IEEE
//! binary16) that halves the bytes a push or a pull puts on the network. Shards keep f32
//! parameters and optimizer state; values are converted where they are encoded and decoded.
//!
//! A value that is not finite *in the wire precision* is refused with its position: a NaN or an
//! infinity, and a finite f32 that rounds to an infinity (past binary16's largest value,
//! 65,504, or past bfloat16's, just under f32's own). Rounding is to the nearest value, ties to
//! even (`half`'s conversions, vectorized where the CPU has them).

use std::fmt;
use std::str::FromStr;

use bytes::BytesMut;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

use crate::error::ProtoError;
use crate::sparse::TopK;

/// How the values of a tensor payload travel.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub enum Wire {
    /// 32-bit floats, little-endian: exact.
    #[default]
    F32,
    /// bfloat16, little-endian: f32's range, 8 bits of precision (a relative error of at most
    /// 2^-8 per value).
    Bf16,
    /// IEEE binary16, little-endian: 11 bits of precision (a relative error of at most 2^-11),
    /// magnitudes up to 65,504 (smaller ones lose precision below 2^-14 and vanish below
    /// about 2^-25).
    F16,
}

impl Wire {
    /// Every precision, in the order of their names in [`Wire::NAMES`].
    pub const ALL: [Wire; 3] = [Wire::F32, Wire::Bf16, Wire::F16];

    /// What job files and command lines call them.
    pub const NAMES: &'static str = "f32, bf16 or fp16";

    /// Its name: `f32`, `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Wire::F32 => "f32",
            Wire::Bf16 => "bf16",
            Wire::F16 => "fp16",
        }
    }

    /// Bytes per value on the wire.
    pub fn value_bytes(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 | Wire::F16 => 2,
        }
    }
}

impl fmt::Display for Wire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Wire {
    type Err = String;

    fn from_str(s: &str) -> Result<Wire, String> {
        match s.trim() {
            "f32" | "fp32" => Ok(Wire::F32),
            "bf16" => Ok(Wire::Bf16),
            "fp16" | "f16" => Ok(Wire::F16),
            other => Err(format!(
                "unknown wire precision {other:?}: expected {}",
                Wire::NAMES
            )),
        }
    }
}

/// How a job's tensors travel: the precision of their values, and for pushes perhaps only the
/// largest of them (top-k with error feedback, [`crate::sparse`]). Job files and command lines
/// write `f32`, `bf16`, `fp16` or `topk:FRACTION` (top-k of f32 values, pulls at f32), or
/// `topk:FRACTION+bf16` (top-k of 16-bit values, pulls at 16 bits).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct WireSpec {
    /// The precision of the values pushed and pulled.
    pub values: Wire,
    /// Pushes carry only this fraction of each chunk's values.
    pub topk: Option<TopK>,
}

impl WireSpec {
    /// What job files and command lines call them.
    pub const NAMES: &'static str =
        "f32, bf16, fp16 or topk:FRACTION[+bf16|+fp16] (e.g. topk:0.01)";

    /// Dense values at `values`.
    pub fn dense(values: Wire) -> WireSpec {
        WireSpec { values, topk: None }
    }

    /// The most payload bytes a push of a chunk of `len` values takes (a sparse one may take
    /// fewer: zeros never travel).
    pub fn max_bytes(self, len: usize) -> usize {
        match self.topk {
            Some(k) => k.max_bytes([len], self.values),
            None => len * self.values.value_bytes(),
        }
    }

    /// Whether values travel exact and whole (the default).
    pub fn is_exact(self) -> bool {
        self == WireSpec::default()
    }
}

impl From<Wire> for WireSpec {
    fn from(values: Wire) -> WireSpec {
        WireSpec::dense(values)
    }
}

impl fmt::Display for WireSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.topk {
            None => write!(f, "{}", self.values),
            Some(k) if self.values == Wire::F32 => write!(f, "{k}"),
            Some(k) => write!(f, "{k}+{}", self.values),
        }
    }
}

impl FromStr for WireSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<WireSpec, String> {
        let s = s.trim();
        if s.starts_with("topk") {
            let (k, values) = match s.split_once('+') {
                Some((k, w)) => (k, w.parse::<Wire>()?),
                None => (s, Wire::F32),
            };
            return Ok(WireSpec {
                values,
                topk: Some(k.parse()?),
            });
        }
        s.parse::<Wire>()
            .map(WireSpec::dense)
            .map_err(|_| format!("unknown wire {s:?}: expected {}", WireSpec::NAMES))
    }
}

/// Values converted and checked per block: a block's 16-bit values stay in cache between the
/// conversion and the copy out.
pub(crate) const BLOCK: usize = 4096;

/// The exponent bits of a 16-bit value in `wire` (all ones: an infinity or a NaN).
fn exponent_mask(wire: Wire) -> u16 {
    match wire {
        Wire::Bf16 => 0x7f80,
        Wire::F16 | Wire::F32 => 0x7c00,
    }
}

/// The first 16-bit value of `bits` that is an infinity or a NaN in `wire`. Blocks are checked
/// without branches (vectorized); only a block that holds one is searched.
fn first_bad_half(bits: &[u16], wire: Wire) -> Option<usize> {
    let mask = exponent_mask(wire);
    let bad = |b: u16| u16::from(b & mask == mask);
    if bits.iter().fold(0, |acc, &b| acc | bad(b)) == 0 {
        return None;
    }
    bits.iter().position(|&b| bad(b) != 0)
}

/// The first value of `bytes` (whole little-endian values in `wire`, at any alignment) that
/// is not finite in it.
pub(crate) fn first_bad_le(bytes: &[u8], wire: Wire) -> Option<usize> {
    if wire == Wire::F32 {
        return crate::frame::first_non_finite_le(bytes.as_chunks::<4>().0);
    }
    let mut bits = [0u16; BLOCK];
    for (i, block) in bytes.as_chunks::<2>().0.chunks(BLOCK).enumerate() {
        let bits = &mut bits[..block.len()];
        for (b, pair) in bits.iter_mut().zip(block) {
            *b = u16::from_le_bytes(*pair);
        }
        if let Some(j) = first_bad_half(bits, wire) {
            return Some(i * BLOCK + j);
        }
    }
    None
}

/// Appends `values` to `out` in `wire`, little-endian, checking each block as it is converted.
/// `Err` holds the position of the first value that is not finite in `wire` (a NaN or an
/// infinity, or one that rounds to an infinity); `out` then holds only the blocks before it.
pub fn encode_finite(out: &mut BytesMut, values: &[f32], wire: Wire) -> Result<(), usize> {
    out.reserve(values.len() * wire.value_bytes());
    if wire == Wire::F32 {
        return crate::frame::extend_finite_f32s(out, values);
    }
    let mut bits = [0u16; BLOCK];
    for (i, block) in values.chunks(BLOCK).enumerate() {
        let bits = &mut bits[..block.len()];
        match wire {
            Wire::Bf16 => bits
                .reinterpret_cast_mut::<bf16>()
                .convert_from_f32_slice(block),
            Wire::F16 | Wire::F32 => bits
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(block),
        }
        if let Some(j) = first_bad_half(bits, wire) {
            return Err(i * BLOCK + j);
        }
        extend_u16s(out, bits);
    }
    Ok(())
}

/// Appends 16-bit values little-endian (one copy on little-endian machines).
fn extend_u16s(out: &mut BytesMut, bits: &[u16]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(bits));
    } else {
        for b in bits {
            out.extend_from_slice(&b.to_le_bytes());
        }
    }
}

/// Decodes whole values in `wire` from `bytes` into `out`, which must hold exactly as many,
/// whatever they are (parameters a shard sends; see [`decode_finite`] for gradients).
pub fn decode(bytes: &[u8], wire: Wire, out: &mut [f32]) -> Result<(), ProtoError> {
    decode_checked(bytes, wire, out, false)
}

/// Decodes whole values in `wire` from `bytes` into `out`, which must hold exactly as many.
/// A value that is not finite is refused (`ProtoError::NonFinite` with its position) and
/// `out` is then left partly written.
pub fn decode_finite(bytes: &[u8], wire: Wire, out: &mut [f32]) -> Result<(), ProtoError> {
    decode_checked(bytes, wire, out, true)
}

fn decode_checked(
    bytes: &[u8],
    wire: Wire,
    out: &mut [f32],
    finite: bool,
) -> Result<(), ProtoError> {
    let size = wire.value_bytes();
    if bytes.len() != out.len() * size {
        return Err(ProtoError::Truncated {
            needed: (out.len() * size) as u64,
            got: bytes.len() as u64,
        });
    }
    if wire == Wire::F32 {
        crate::frame::bytes_to_f32s(bytes, out)?;
        return match crate::frame::first_non_finite(out).filter(|_| finite) {
            Some(i) => Err(ProtoError::NonFinite { index: i as u64 }),
            None => Ok(()),
        };
    }
    let mut bits = [0u16; BLOCK];
    for (i, (src, dst)) in bytes
        .chunks(BLOCK * 2)
        .zip(out.chunks_mut(BLOCK))
        .enumerate()
    {
        let bits = &mut bits[..dst.len()];
        for (b, pair) in bits.iter_mut().zip(src.as_chunks::<2>().0) {
            *b = u16::from_le_bytes(*pair);
        }
        if let Some(j) = first_bad_half(bits, wire).filter(|_| finite) {
            return Err(ProtoError::NonFinite {
                index: (i * BLOCK + j) as u64,
            });
        }
        match wire {
            Wire::Bf16 => bits.reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
            Wire::F16 | Wire::F32 => bits.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
        }
    }
    Ok(())
}

/// `values` as they arrive after a trip through `wire` (what a shard applies of a push, or a
/// worker computes with after a pull), or the position of the first value `wire` refuses.
pub fn round_trip(values: &[f32], wire: Wire) -> Result<Vec<f32>, usize> {
    let mut bytes = BytesMut::new();
    encode_finite(&mut bytes, values, wire)?;
    let mut out = vec![0.0; values.len()];
    // Encoded values are finite and as many as asked: decoding cannot fail.
    decode_finite(&bytes, wire, &mut out).map_err(|_| 0usize)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(values: &[f32], wire: Wire) -> Result<BytesMut, usize> {
        let mut out = BytesMut::new();
        encode_finite(&mut out, values, wire).map(|()| out)
    }

    #[test]
    fn names_parse_and_print_back() {
        for w in Wire::ALL {
            assert_eq!(w.name().parse::<Wire>(), Ok(w));
            assert_eq!(w.to_string(), w.name());
        }
        assert_eq!("f16".parse::<Wire>(), Ok(Wire::F16));
        let e = "int8".parse::<Wire>().expect_err("unknown");
        assert!(e.contains("f32, bf16 or fp16"), "{e}");
        assert_eq!(Wire::default(), Wire::F32);
    }

    #[test]
    fn wire_specs_parse_and_print_back() {
        for s in [
            "f32",
            "bf16",
            "fp16",
            "topk:0.01",
            "topk:0.5",
            "topk:1",
            "topk:0.01+bf16",
        ] {
            let spec: WireSpec = s.parse().expect(s);
            assert_eq!(spec.to_string(), s);
        }
        let k: WireSpec = " topk:0.001 ".parse().expect("top-k");
        assert_eq!(
            (k.values, k.topk.map(TopK::fraction)),
            (Wire::F32, Some(0.001))
        );
        assert!(WireSpec::default().is_exact() && !k.is_exact());
        let e = "int8".parse::<WireSpec>().expect_err("unknown");
        assert!(e.contains("topk:FRACTION"), "{e}");
        let e = "topk:2".parse::<WireSpec>().expect_err("past 1");
        assert!(e.contains("(0, 1]"), "{e}");
    }

    #[test]
    fn sixteen_bit_wires_halve_the_bytes_and_keep_representable_values_exact() {
        // Halves up to 127.5 (8 significant bits) are exact in both 16-bit formats.
        let values: Vec<f32> = (-255..=255).map(|i| i as f32 * 0.5).collect();
        for w in Wire::ALL {
            let bytes = encode(&values, w).expect("finite");
            assert_eq!(bytes.len(), values.len() * w.value_bytes(), "{w}");
            let mut back = vec![f32::NAN; values.len()];
            decode_finite(&bytes, w, &mut back).expect("decodes");
            assert_eq!(back, values, "{w}");
        }
    }

    #[test]
    fn values_round_to_the_nearest_with_ties_to_even() {
        // 1 + 2^-8 lies halfway between bf16's 1 and 1 + 2^-7: the tie goes to the even 1.
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: it goes to 1 + 2^-6.
        let tie_down = 1.0 + 2f32.powi(-8);
        let tie_up = 1.0 + 3.0 * 2f32.powi(-8);
        let above = 1.0 + 2f32.powi(-8) + 2f32.powi(-12);
        let back = round_trip(&[tie_down, tie_up, above], Wire::Bf16).expect("finite");
        assert_eq!(back, [1.0, 1.0 + 2f32.powi(-6), 1.0 + 2f32.powi(-7)]);
        // binary16 has 10 fraction bits: 1 + 2^-11 is a tie that goes down to 1.
        let back = round_trip(
            &[1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11)],
            Wire::F16,
        )
        .expect("finite");
        assert_eq!(back, [1.0, 1.0 + 2f32.powi(-9)]);
        // The relative error stays within half a unit of the last place.
        let values: Vec<f32> = (1..5000).map(|i| (i as f32).sqrt() * 0.37 - 9.0).collect();
        for (w, bound) in [(Wire::Bf16, 2f32.powi(-8)), (Wire::F16, 2f32.powi(-11))] {
            let back = round_trip(&values, w).expect("finite");
            for (v, b) in values.iter().zip(&back) {
                assert!((v - b).abs() <= v.abs() * bound, "{w}: {v} became {b}");
            }
        }
    }

    #[test]
    fn non_finite_values_and_overflow_are_refused_at_their_position() {
        for w in Wire::ALL {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut values = vec![1.0f32; 2 * BLOCK + 10];
                values[BLOCK + 7] = bad;
                assert_eq!(encode(&values, w).map(|_| ()), Err(BLOCK + 7), "{w} {bad}");
            }
        }
        // Past binary16's largest finite value (65,504; 65,520 and up round to infinity).
        assert_eq!(encode(&[1.0, 65_504.0], Wire::F16).map(|_| ()), Ok(()));
        assert_eq!(encode(&[1.0, 2.0, 70_000.0], Wire::F16).map(|_| ()), Err(2));
        assert_eq!(encode(&[-65_520.0], Wire::F16).map(|_| ()), Err(0));
        // bfloat16 keeps f32's range, but f32's largest value rounds up to an infinity.
        assert_eq!(encode(&[1e38], Wire::Bf16).map(|_| ()), Ok(()));
        assert_eq!(encode(&[0.0, f32::MAX], Wire::Bf16).map(|_| ()), Err(1));
        assert_eq!(round_trip(&[f32::MAX], Wire::F32), Ok(vec![f32::MAX]));
    }

    #[test]
    fn decoding_refuses_bad_lengths_and_non_finite_values() {
        let mut out = [0.0f32; 3];
        for w in Wire::ALL {
            let short = vec![0u8; 3 * w.value_bytes() - 1];
            assert!(matches!(
                decode_finite(&short, w, &mut out),
                Err(ProtoError::Truncated { .. })
            ));
        }
        // bf16 and binary16 infinities and NaNs, at the second position.
        for (w, bits) in [
            (Wire::Bf16, 0x7f80u16),
            (Wire::Bf16, 0xffc1),
            (Wire::F16, 0x7c00),
            (Wire::F16, 0xfe00),
        ] {
            let mut bytes = Vec::new();
            for b in [0x3c00u16, bits, 0] {
                bytes.extend_from_slice(&b.to_le_bytes());
            }
            assert_eq!(
                decode_finite(&bytes, w, &mut out),
                Err(ProtoError::NonFinite { index: 1 }),
                "{w} {bits:#x}"
            );
        }
        let mut bytes = Vec::new();
        for v in [1.0f32, f32::NAN, 2.0] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(
            decode_finite(&bytes, Wire::F32, &mut out),
            Err(ProtoError::NonFinite { index: 1 })
        );
    }

    #[test]
    fn bf16_keeps_tiny_gradients_that_fp16_flushes() {
        // Gradients of 1e-8 are common late in training: bf16 keeps them (f32's exponent),
        // binary16 rounds them to zero (its smallest subnormal is about 6e-8).
        let back = round_trip(&[1e-8, -3e-9], Wire::Bf16).expect("finite");
        assert!((back[0] - 1e-8).abs() < 1e-10 && back[1] < 0.0, "{back:?}");
        assert_eq!(round_trip(&[1e-8], Wire::F16), Ok(vec![0.0]));
    }
}
