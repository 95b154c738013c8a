//! Float payloads: the finiteness scan fed in arbitrary parts, and the f32 wire conversions.

use bytes::BytesMut;
use edl_proto::ProtoError;
use edl_proto::frame::{
    FiniteScan, bytes_to_f32s, extend_finite_f32s, f32s_in_place, f32s_to_bytes, first_non_finite,
};
use edl_proto::sparse::{decode_sparse, encode_topk};
use edl_proto::wire::Wire;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;

use crate::{check_error, config};

/// A float that is NaN or infinite: all exponent bits set, any sign and mantissa.
fn non_finite() -> impl Strategy<Value = f32> {
    (any::<bool>(), 0u32..1 << 23, any::<bool>()).prop_map(|(neg, mantissa, inf)| {
        let mantissa = if inf { 0 } else { mantissa.max(1) };
        f32::from_bits(u32::from(neg) << 31 | 0x7f80_0000 | mantissa)
    })
}

/// Mostly finite values across the blocks the scanners work in, with a few bad ones placed
/// anywhere (often none, so that both answers are common).
fn values() -> impl Strategy<Value = Vec<f32>> {
    let finite = any::<u32>().prop_map(|b| {
        let x = f32::from_bits(b);
        if x.is_finite() { x } else { 0.5 }
    });
    let len = prop_oneof![0usize..40, 0usize..5000];
    (
        len.prop_flat_map(move |n| vec(finite.clone(), n)),
        vec((any::<Index>(), non_finite()), 0..3),
    )
        .prop_map(|(mut v, bad)| {
            if !v.is_empty() {
                for (at, x) in bad {
                    let i = at.index(v.len());
                    v[i] = x;
                }
            }
            v
        })
}

fn wire(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The first bad value, found the slow and obvious way.
fn naive(values: &[f32]) -> Option<usize> {
    values.iter().position(|x| !x.is_finite())
}

proptest! {
    #![proptest_config(config(512))]

    /// `first_non_finite` agrees with the obvious search.
    #[test]
    fn first_non_finite_finds_the_first(values in values()) {
        prop_assert_eq!(first_non_finite(&values), naive(&values));
    }

    /// A payload scanned as it arrives, in parts of any size, at any alignment, and with a
    /// partial float at the end, gives the answer of a scan of the whole floats at once.
    #[test]
    fn scan_in_parts_matches_whole(
        values in values(),
        tail in vec(any::<u8>(), 0..4),
        offset in 0usize..4,
        cuts in vec(any::<Index>(), 0..10),
    ) {
        let mut buf = vec![0u8; offset];
        buf.extend_from_slice(&wire(&values));
        buf.extend_from_slice(&tail);
        let received = &buf[offset..];
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(received.len() + 1)).collect();
        at.sort_unstable();
        let mut scan = FiniteScan::default();
        let mut from = 0;
        for upto in at.into_iter().chain([received.len()]) {
            scan.part(&received[from..upto]);
            from = upto;
        }
        let expected = naive(&values);
        match (scan.result(), expected) {
            (Ok(()), None) => {}
            (Err(e), Some(i)) => {
                check_error(&e)?;
                prop_assert_eq!(e, ProtoError::NonFinite { index: i as u64 });
            }
            (got, want) => {
                return Err(TestCaseError::fail(format!("scan {got:?}, expected bad at {want:?}")));
            }
        }
    }

    /// Copying with the check gives the position of the first bad value and only the blocks
    /// before it, or, when all are finite, the same bytes as a plain copy.
    #[test]
    fn checked_copy_stops_at_the_first_bad_block(values in values()) {
        let mut out = BytesMut::new();
        match (extend_finite_f32s(&mut out, &values), naive(&values)) {
            (Ok(()), None) => prop_assert_eq!(&out[..], &f32s_to_bytes(&values)[..]),
            (Err(i), Some(want)) => {
                prop_assert_eq!(i, want);
                let kept = i / 4096 * 4096;
                prop_assert_eq!(&out[..], &wire(&values[..kept])[..]);
            }
            (got, want) => {
                return Err(TestCaseError::fail(format!("copy {got:?}, expected bad at {want:?}")));
            }
        }
    }

    /// f32 values survive the wire bit for bit, NaN payloads included, in place or copied.
    #[test]
    fn f32_wire_round_trip(bits in vec(any::<u32>(), 0..300), offset in 0usize..4) {
        let values: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
        let bytes = f32s_to_bytes(&values);
        prop_assert_eq!(&bytes[..], &wire(&values)[..]);
        let mut back = vec![0f32; values.len()];
        bytes_to_f32s(&bytes, &mut back)
            .map_err(|e| TestCaseError::fail(format!("exact length refused: {e}")))?;
        let back_bits: Vec<u32> = back.iter().map(|x| x.to_bits()).collect();
        prop_assert_eq!(&back_bits, &bits);

        // In place only where the bytes are aligned for f32, and then the same values.
        let mut shifted = vec![0u8; offset];
        shifted.extend_from_slice(&bytes);
        let slice = &shifted[offset..];
        match f32s_in_place(slice) {
            Some(v) => {
                prop_assert!((slice.as_ptr() as usize).is_multiple_of(4));
                let v_bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
                prop_assert_eq!(&v_bits, &bits);
            }
            None => prop_assert!(!(slice.as_ptr() as usize).is_multiple_of(4)),
        }
    }

    /// Bytes that are not exactly the floats asked for are an error, never a panic.
    #[test]
    fn wrong_lengths_are_errors(bytes in vec(any::<u8>(), 0..64), floats in 0usize..20) {
        let mut out = vec![0f32; floats];
        let r = bytes_to_f32s(&bytes, &mut out);
        if bytes.len() == floats * 4 {
            prop_assert!(r.is_ok());
        } else {
            let e = r.err().ok_or_else(|| TestCaseError::fail("wrong length accepted"))?;
            check_error(&e)?;
            prop_assert_eq!(
                e,
                ProtoError::Truncated { needed: floats as u64 * 4, got: bytes.len() as u64 }
            );
        }
        // A length that is not whole floats is never viewed in place.
        if !bytes.len().is_multiple_of(4) {
            prop_assert!(f32s_in_place(&bytes).is_none());
        }
    }

    /// A top-k record of any finite chunk keeps at most k values, the largest by magnitude,
    /// and what travelled plus what stayed is the chunk exactly.
    #[test]
    fn top_k_sends_the_largest_and_keeps_the_rest(
        chunk in vec(-1e6f32..1e6, 0..300),
        zeros in vec(any::<Index>(), 0..50),
        k in 0usize..40,
    ) {
        let mut chunk = chunk;
        if !chunk.is_empty() {
            for z in zeros {
                let i = z.index(chunk.len());
                chunk[i] = 0.0;
            }
        }
        let mut acc = chunk.clone();
        let mut out = BytesMut::new();
        encode_topk(&mut out, &mut acc, k, Wire::F32, &mut Vec::new())
            .map_err(|i| TestCaseError::fail(format!("refused at {i}")))?;
        let mut sent = vec![0f32; chunk.len()];
        decode_sparse(&out, [chunk.len()], Wire::F32, &mut sent)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let nonzero = chunk.iter().filter(|v| **v != 0.0).count();
        let travelled = sent.iter().filter(|v| **v != 0.0).count();
        prop_assert_eq!(travelled, k.min(nonzero));
        for i in 0..chunk.len() {
            prop_assert_eq!(sent[i] + acc[i], chunk[i]);
            prop_assert!(sent[i] == 0.0 || acc[i] == 0.0);
        }
        let least_sent = sent.iter().filter(|v| **v != 0.0).map(|v| v.abs()).fold(f32::INFINITY, f32::min);
        let most_kept = acc.iter().map(|v| v.abs()).fold(0.0, f32::max);
        prop_assert!(travelled == 0 || least_sent >= most_kept);
    }

    /// Any bytes read as a sparse payload are an error or values where the chunks are, never
    /// a panic.
    #[test]
    fn sparse_payloads_of_any_bytes_are_errors_or_values(
        bytes in vec(any::<u8>(), 0..200),
        lens in vec(0usize..20, 0..5),
        sixteen in any::<bool>(),
    ) {
        let wire = if sixteen { Wire::Bf16 } else { Wire::F32 };
        let mut out = vec![0f32; lens.iter().sum()];
        match decode_sparse(&bytes, lens.iter().copied(), wire, &mut out) {
            Ok(()) => prop_assert!(out.iter().all(|v| v.is_finite())),
            Err(e) => check_error(&e)?,
        }
    }
}
