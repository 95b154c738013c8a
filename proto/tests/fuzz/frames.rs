//! Frames, prefixes and headers: arbitrary bytes, mutated valid frames and round trips.

use std::fmt::Debug;

use bytes::Bytes;
use edl_proto::frame::{
    FRAME_VERSION, MAGIC, Message, PREFIX_LEN, Prefix, encode_prefix, parse_prefix,
};
use edl_proto::{ErrorCode, Frame, FrameLimits, Parts, Payload, ProtoError, Request, Response};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

use crate::strategies::{payload, request, response};
use crate::{check_error, config};

/// Limits small enough that valid frames exceed them.
const SMALL: FrameLimits = FrameLimits {
    max_header: 64,
    max_payload: 64,
};

/// Limits a deployment could configure to mean "no limit".
const UNBOUNDED: FrameLimits = FrameLimits {
    max_header: u64::MAX,
    max_payload: u64::MAX,
};

fn limits() -> impl Strategy<Value = FrameLimits> {
    prop_oneof![Just(FrameLimits::default()), Just(SMALL), Just(UNBOUNDED)]
}

/// A header length as a prefix may claim it: small, anywhere, or at the edge.
fn claimed_header_len() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..600, any::<u32>(), Just(u32::MAX)]
}

/// A payload length as a prefix may claim it: small, anywhere, or near the edge (where sums
/// with the other lengths overflow).
fn claimed_payload_len() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..600,
        any::<u64>(),
        (0u64..600).prop_map(|d| u64::MAX - d)
    ]
}

/// One change to an encoded frame or header.
#[derive(Clone, Debug)]
enum Mutation {
    /// Flips one bit.
    Flip(Index, u8),
    /// Overwrites one byte.
    Set(Index, u8),
    /// Cuts the buffer at a point.
    Truncate(Index),
    /// Appends bytes.
    Extend(Vec<u8>),
    /// Removes one byte, shifting the rest.
    Remove(Index),
    /// Inserts one byte, shifting the rest.
    Insert(Index, u8),
    /// Overwrites the prefix's header length (when the buffer holds it).
    HeaderLen(u32),
    /// Overwrites the prefix's payload length (when the buffer holds it).
    PayloadLen(u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => vec(any::<u8>(), 1..16).prop_map(Mutation::Extend),
        1 => any::<Index>().prop_map(Mutation::Remove),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => claimed_header_len().prop_map(Mutation::HeaderLen),
        1 => claimed_payload_len().prop_map(Mutation::PayloadLen),
    ]
}

fn apply(buf: &mut Vec<u8>, m: &Mutation) {
    // An index into an empty buffer has nothing to pick; those mutations do nothing there.
    let len = buf.len();
    match m {
        Mutation::Flip(i, bit) if len > 0 => buf[i.index(len)] ^= 1 << bit,
        Mutation::Set(i, byte) if len > 0 => buf[i.index(len)] = *byte,
        Mutation::Truncate(i) if len > 0 => buf.truncate(i.index(len)),
        Mutation::Extend(more) => buf.extend_from_slice(more),
        Mutation::Remove(i) if len > 0 => {
            buf.remove(i.index(len));
        }
        Mutation::Insert(i, byte) => buf.insert(i.index(len + 1), *byte),
        Mutation::HeaderLen(h) if len >= 12 => buf[8..12].copy_from_slice(&h.to_le_bytes()),
        Mutation::PayloadLen(p) if len >= PREFIX_LEN => {
            buf[12..PREFIX_LEN].copy_from_slice(&p.to_le_bytes());
        }
        _ => {}
    }
}

/// Re-encodes a decoded message and decodes it again: whatever a decoder accepts must survive
/// a round trip bit for bit (compared as bytes, so NaN fields reached by mutation compare too).
fn check_reencodes<T: Message>(msg: &T) -> Result<(), TestCaseError> {
    let once = msg
        .to_header()
        .map_err(|e| TestCaseError::fail(format!("a decoded message does not encode: {e}")))?;
    let back = T::from_header(&once)
        .map_err(|e| TestCaseError::fail(format!("a re-encoded message does not decode: {e}")))?;
    let twice = back
        .to_header()
        .map_err(|e| TestCaseError::fail(format!("a decoded message does not encode: {e}")))?;
    prop_assert_eq!(once.as_slice(), twice.as_slice());
    Ok(())
}

/// Decodes `buf` as a frame of `T` and checks the outcome against the prefix: an accepted frame
/// is exactly as long as its prefix says, within the limits, and re-encodes; a refused one
/// fails with the prefix's own error when the prefix is bad, and with a stable code always.
fn check_decode<T: Message + Debug>(buf: &[u8], limits: &FrameLimits) -> Result<(), TestCaseError> {
    let prefix = parse_prefix(buf, limits);
    match Frame::<T>::decode(Bytes::copy_from_slice(buf), limits) {
        Ok(frame) => {
            let p = prefix.map_err(|e| {
                TestCaseError::fail(format!("a frame decoded with a refused prefix: {e}"))
            })?;
            prop_assert!(p.header_len <= limits.max_header);
            prop_assert!(p.payload_len <= limits.max_payload);
            prop_assert_eq!(p.frame_len(), buf.len() as u64);
            let header_end = PREFIX_LEN + p.header_len as usize;
            prop_assert_eq!(&frame.payload[..], &buf[header_end..]);
            check_reencodes(&frame.msg)
        }
        Err(e) => {
            check_error(&e)?;
            if let Err(pe) = prefix {
                prop_assert_eq!(e, pe);
            }
            Ok(())
        }
    }
}

/// [`check_decode`] of `buf` as a request frame and as a response frame.
fn check_decode_both(buf: &[u8], limits: &FrameLimits) -> Result<(), TestCaseError> {
    check_decode::<Request>(buf, limits)?;
    check_decode::<Response>(buf, limits)
}

/// [`check_refusal`] of `buf` decoded as a request frame and as a response frame.
fn check_refusal_both(
    buf: Vec<u8>,
    limits: &FrameLimits,
    expected: Option<&ProtoError>,
) -> Result<(), TestCaseError> {
    let buf = Bytes::from(buf);
    check_refusal(Frame::<Request>::decode(buf.clone(), limits), expected)?;
    check_refusal(Frame::<Response>::decode(buf, limits), expected)
}

/// Checks a decoding outcome against the error expected from the prefix alone: that error
/// exactly, or, when none is expected, success or a refused header.
fn check_refusal<T: Debug>(
    got: Result<Frame<T>, ProtoError>,
    expected: Option<&ProtoError>,
) -> Result<(), TestCaseError> {
    match (got, expected) {
        (Err(e), Some(want)) => prop_assert_eq!(&e, want),
        (Ok(frame), Some(want)) => {
            return Err(TestCaseError::fail(format!(
                "decoded {frame:?}, expected {want:?}"
            )));
        }
        (Err(e), None) => prop_assert!(matches!(e, ProtoError::Header(_)), "{:?}", e),
        (Ok(_), None) => {}
    }
    Ok(())
}

/// The error a frame whose prefix claims `header_len` and `payload_len` must get when `have`
/// bytes arrived in all, once the prefix itself passed.
fn length_error(header_len: u64, payload_len: u64, have: u64) -> Option<ProtoError> {
    let want = (PREFIX_LEN as u64)
        .checked_add(header_len)
        .and_then(|n| n.checked_add(payload_len));
    match want {
        Some(want) if want == have => None,
        Some(want) if want < have => Some(ProtoError::Trailing(have - want)),
        _ => Some(ProtoError::Truncated {
            needed: want.unwrap_or(u64::MAX),
            got: have,
        }),
    }
}

fn encoded<T: Message>(msg: T, payload: Vec<u8>) -> Result<(Frame<T>, Vec<u8>), TestCaseError> {
    let frame = Frame::with_payload(msg, Bytes::from(payload));
    let bytes = frame
        .encode()
        .map_err(|e| TestCaseError::fail(format!("a valid message does not encode: {e}")))?;
    Ok((frame, bytes.to_vec()))
}

/// One of each single change to try on a valid frame.
#[derive(Clone, Debug)]
struct Changes {
    /// Where to cut it.
    cut: Index,
    /// What to append.
    extra: Vec<u8>,
    /// Which byte to flip a bit of (in the payload, and in the prefix's first 8 bytes).
    flip: Index,
    /// Which bit.
    bit: u8,
    /// A header length to claim instead.
    header_len: u32,
    /// A payload length to claim instead.
    payload_len: u64,
}

fn changes() -> impl Strategy<Value = Changes> {
    (
        any::<Index>(),
        vec(any::<u8>(), 1..9),
        any::<Index>(),
        0u8..8,
        claimed_header_len(),
        claimed_payload_len(),
    )
        .prop_map(|(cut, extra, flip, bit, header_len, payload_len)| Changes {
            cut,
            extra,
            flip,
            bit,
            header_len,
            payload_len,
        })
}

/// The precise answers to one change of a valid frame, whatever its message type.
fn check_single_mutations<T: Message + Debug + PartialEq + Clone>(
    msg: T,
    payload: Vec<u8>,
    changes: &Changes,
) -> Result<(), TestCaseError> {
    let Changes {
        cut,
        ref extra,
        flip,
        bit,
        header_len,
        payload_len,
    } = *changes;
    let limits = FrameLimits::default();
    let (frame, good) = encoded(msg, payload)?;
    let full = good.len();
    let h = full - PREFIX_LEN - frame.payload.len();
    let decode = |v: Vec<u8>| Frame::<T>::decode(Bytes::from(v), &limits);

    // A truncated frame is truncated, wherever the cut falls.
    let at = cut.index(full);
    let needed = if at < PREFIX_LEN { PREFIX_LEN } else { full } as u64;
    let got = decode(good[..at].to_vec());
    prop_assert_eq!(
        got,
        Err(ProtoError::Truncated {
            needed,
            got: at as u64
        })
    );

    // Bytes after a complete frame are refused and counted.
    let mut longer = good.clone();
    longer.extend_from_slice(extra);
    prop_assert_eq!(
        decode(longer),
        Err(ProtoError::Trailing(extra.len() as u64))
    );

    // The payload is opaque to the frame: a flipped bit there changes only the payload.
    if !frame.payload.is_empty() {
        let mut v = good.clone();
        let i = PREFIX_LEN + h + flip.index(frame.payload.len());
        v[i] ^= 1 << bit;
        let back = decode(v.clone())
            .map_err(|e| TestCaseError::fail(format!("a payload bit flip broke the frame: {e}")))?;
        prop_assert_eq!(&back.msg, &frame.msg);
        prop_assert_eq!(&back.payload[..], &v[PREFIX_LEN + h..]);
    }

    // Any bit of the magic, version or flags makes the prefix refused with its own error.
    let mut v = good.clone();
    let i = flip.index(8);
    v[i] ^= 1 << bit;
    let e = decode(v).err();
    let expected = match i {
        0..4 => matches!(e, Some(ProtoError::BadMagic(_))),
        4..6 => matches!(e, Some(ProtoError::Version { .. })),
        _ => matches!(e, Some(ProtoError::Flags(_))),
    };
    prop_assert!(expected, "byte {} flipped: {:?}", i, e);

    // A changed header length is refused: too large, or the lengths no longer add up.
    if header_len as usize != h {
        let mut v = good.clone();
        v[8..12].copy_from_slice(&header_len.to_le_bytes());
        let expected = if u64::from(header_len) > limits.max_header {
            Some(ProtoError::HeaderTooLarge {
                len: u64::from(header_len),
                max: limits.max_header,
            })
        } else {
            length_error(
                u64::from(header_len),
                frame.payload.len() as u64,
                full as u64,
            )
        };
        prop_assert_eq!(decode(v).err(), expected);
    }

    // A changed payload length likewise.
    if payload_len != frame.payload.len() as u64 {
        let mut v = good;
        v[12..PREFIX_LEN].copy_from_slice(&payload_len.to_le_bytes());
        let expected = if payload_len > limits.max_payload {
            Some(ProtoError::PayloadTooLarge {
                len: payload_len,
                max: limits.max_payload,
            })
        } else {
            length_error(h as u64, payload_len, full as u64)
        };
        prop_assert_eq!(decode(v).err(), expected);
    }
    Ok(())
}

/// Encodes and decodes a frame three ways (whole, head plus payload, head plus parts) and
/// checks that they agree, that the frame decodes to itself, and that trailing bytes are
/// refused.
fn check_round_trip<T: Message + Debug + PartialEq + Clone>(
    msg: T,
    payload: Vec<u8>,
    cuts: &[Index],
    extra: &[u8],
) -> Result<(), TestCaseError> {
    let limits = FrameLimits::default();
    let (frame, bytes) = encoded(msg, payload)?;
    let head = frame
        .encode_head()
        .map_err(|e| TestCaseError::fail(format!("head: {e}")))?;
    prop_assert_eq!(&bytes[..head.len()], &head[..]);
    prop_assert_eq!(&bytes[head.len()..], &frame.payload[..]);

    let p = parse_prefix(&bytes, &limits)
        .map_err(|e| TestCaseError::fail(format!("prefix of a valid frame: {e}")))?;
    prop_assert_eq!(p.header_len as usize, head.len() - PREFIX_LEN);
    prop_assert_eq!(p.payload_len as usize, frame.payload.len());
    prop_assert_eq!(p.frame_len(), bytes.len() as u64);

    let back = Frame::<T>::decode(Bytes::from(bytes.clone()), &limits);
    prop_assert_eq!(back.as_ref(), Ok(&frame));

    // The header alone decodes too, from an unaligned place in a larger buffer.
    let mut shifted = vec![0xa5u8];
    shifted.extend_from_slice(&head[PREFIX_LEN..]);
    let alone = T::from_header(&shifted[1..]);
    prop_assert_eq!(alone.as_ref(), Ok(&frame.msg));

    let mut longer = bytes;
    longer.extend_from_slice(extra);
    prop_assert_eq!(
        Frame::<T>::decode(Bytes::from(longer), &limits),
        Err(ProtoError::Trailing(extra.len() as u64))
    );

    // The payload sent as parts gives the same head and the same bytes on the wire.
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| c.index(frame.payload.len() + 1))
        .collect();
    at.sort_unstable();
    let mut parts = Vec::new();
    let mut from = 0;
    for to in at.into_iter().chain([frame.payload.len()]) {
        parts.push(frame.payload.slice(from..to));
        from = to;
    }
    let parts = Parts(parts);
    prop_assert_eq!(parts.byte_len(), frame.payload.len());
    prop_assert_eq!(&parts.concat(), &frame.payload);
    let sent = Frame::<T, Parts>::with_payload(frame.msg.clone(), parts.clone());
    let sent_head = sent
        .encode_head()
        .map_err(|e| TestCaseError::fail(format!("head with parts: {e}")))?;
    prop_assert_eq!(&sent_head, &head);
    let mut out = Vec::new();
    parts.clone().append_to(&mut out);
    prop_assert_eq!(out, parts.0);
    Ok(())
}

proptest! {
    #![proptest_config(config(2048))]

    /// Arbitrary bytes never panic a decoder; any answer is consistent with the prefix.
    #[test]
    fn arbitrary_bytes(bytes in vec(any::<u8>(), 0..200), limits in limits()) {
        if let Err(e) = parse_prefix(&bytes, &limits) {
            check_error(&e)?;
        }
        check_decode_both(&bytes, &limits)?;
    }

    /// The prefix decoder agrees with the format: magic, version 1, no flags, then lengths
    /// within the limits, checked in that order; fewer than 20 bytes are truncated.
    #[test]
    fn prefix_fields(
        magic in prop_oneof![3 => Just(MAGIC), 1 => any::<[u8; 4]>()],
        version in prop_oneof![3 => Just(FRAME_VERSION), 1 => any::<u16>()],
        flags in prop_oneof![3 => Just(0u16), 1 => any::<u16>()],
        header_len in claimed_header_len(),
        payload_len in claimed_payload_len(),
        cut in any::<Index>(),
        limits in limits(),
    ) {
        let mut bytes = magic.to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&flags.to_le_bytes());
        bytes.extend_from_slice(&header_len.to_le_bytes());
        bytes.extend_from_slice(&payload_len.to_le_bytes());
        let (h, p) = (u64::from(header_len), payload_len);
        let want = if magic != MAGIC {
            Err(ProtoError::BadMagic(magic))
        } else if version != FRAME_VERSION {
            Err(ProtoError::Version { got: version, want: FRAME_VERSION })
        } else if flags != 0 {
            Err(ProtoError::Flags(flags))
        } else if h > limits.max_header {
            Err(ProtoError::HeaderTooLarge { len: h, max: limits.max_header })
        } else if p > limits.max_payload {
            Err(ProtoError::PayloadTooLarge { len: p, max: limits.max_payload })
        } else {
            Ok(Prefix { header_len: h, payload_len: p })
        };
        let got = parse_prefix(&bytes, &limits);
        if let Err(e) = &got {
            check_error(e)?;
        }
        prop_assert_eq!(got, want);
        let at = cut.index(PREFIX_LEN);
        prop_assert_eq!(
            parse_prefix(&bytes[..at], &limits),
            Err(ProtoError::Truncated { needed: PREFIX_LEN as u64, got: at as u64 })
        );
    }

    /// A valid prefix followed by a garbage header exercises header validation itself: once
    /// the lengths add up and fit the limits, only the header can be refused.
    #[test]
    fn garbage_behind_a_valid_prefix(
        header in vec(any::<u8>(), 0..400),
        payload in payload(),
        limits in limits(),
    ) {
        let mut buf = encode_prefix(header.len() as u32, payload.len() as u64).to_vec();
        buf.extend_from_slice(&header);
        buf.extend_from_slice(&payload);
        check_decode_both(&buf, &limits)?;
        let expected = if header.len() as u64 > limits.max_header {
            Some(ProtoError::HeaderTooLarge { len: header.len() as u64, max: limits.max_header })
        } else if payload.len() as u64 > limits.max_payload {
            Some(ProtoError::PayloadTooLarge { len: payload.len() as u64, max: limits.max_payload })
        } else {
            None
        };
        check_refusal_both(buf, &limits, expected.as_ref())?;
    }

    /// Any lengths in a valid prefix, however large, are refused by the limits or by the
    /// bytes actually there, and the error says which.
    #[test]
    fn claimed_lengths(
        header_len in claimed_header_len(),
        payload_len in claimed_payload_len(),
        body in vec(any::<u8>(), 0..200),
        limits in limits(),
    ) {
        let mut buf = encode_prefix(header_len, payload_len).to_vec();
        buf.extend_from_slice(&body);
        let (h, p, have) = (u64::from(header_len), payload_len, buf.len() as u64);
        let expected = if h > limits.max_header {
            Some(ProtoError::HeaderTooLarge { len: h, max: limits.max_header })
        } else if p > limits.max_payload {
            Some(ProtoError::PayloadTooLarge { len: p, max: limits.max_payload })
        } else {
            length_error(h, p, have)
        };
        check_decode_both(&buf, &limits)?;
        check_refusal_both(buf, &limits, expected.as_ref())?;
    }

    /// Valid request and response frames changed in a few places never panic the decoders.
    #[test]
    fn mutated_frames(
        req in request(),
        resp in response(),
        payload in payload(),
        mutations in vec(mutation(), 1..5),
        limits in limits(),
    ) {
        for mut buf in [encoded(req, payload.clone())?.1, encoded(resp, payload)?.1] {
            for m in &mutations {
                apply(&mut buf, m);
            }
            check_decode_both(&buf, &limits)?;
        }
    }

    /// Arbitrary header bytes never panic `from_header`; what is accepted re-encodes.
    #[test]
    fn arbitrary_headers(bytes in vec(any::<u8>(), 0..512)) {
        for r in [
            Request::from_header(&bytes).map(|m| check_reencodes(&m)),
            Response::from_header(&bytes).map(|m| check_reencodes(&m)),
        ] {
            match r {
                Ok(checked) => checked?,
                Err(e) => {
                    check_error(&e)?;
                    prop_assert_eq!(e.code(), ErrorCode::Malformed);
                }
            }
        }
    }

    /// Valid headers changed in a few places never panic `from_header` of either type.
    #[test]
    fn mutated_headers(
        req in request(),
        resp in response(),
        mutations in vec(mutation(), 1..4),
    ) {
        let encode = |h: Result<_, ProtoError>| {
            h.map(|v: rkyv::util::AlignedVec| v.to_vec())
                .map_err(|e| TestCaseError::fail(format!("encode: {e}")))
        };
        for mut header in [encode(req.to_header())?, encode(resp.to_header())?] {
            for m in &mutations {
                apply(&mut header, m);
            }
            match Request::from_header(&header) {
                Ok(m) => check_reencodes(&m)?,
                Err(e) => check_error(&e)?,
            }
            match Response::from_header(&header) {
                Ok(m) => check_reencodes(&m)?,
                Err(e) => check_error(&e)?,
            }
        }
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Every request encodes and decodes to itself; trailing bytes are refused.
    #[test]
    fn request_round_trip(
        msg in request(),
        payload in payload(),
        cuts in vec(any::<Index>(), 0..4),
        extra in vec(any::<u8>(), 1..9),
    ) {
        // A push with 16-bit or sparse chunks is checked by the shard, not as f32 on receipt.
        let plain = |c: &[edl_proto::msg::ChunkRef]| {
            c.iter().all(|c| c.wire == edl_proto::Wire::F32 && !c.sparse)
        };
        prop_assert_eq!(
            msg.finite_payload(),
            match &msg {
                Request::Push { chunks, .. } | Request::Replicate { chunks, .. } => plain(chunks),
                _ => false,
            }
        );
        check_round_trip(msg, payload, &cuts, &extra)?;
    }

    /// Every response encodes and decodes to itself; trailing bytes are refused.
    #[test]
    fn response_round_trip(
        msg in response(),
        payload in payload(),
        cuts in vec(any::<Index>(), 0..4),
        extra in vec(any::<u8>(), 1..9),
    ) {
        prop_assert!(!msg.finite_payload());
        check_round_trip(msg, payload, &cuts, &extra)?;
    }

    /// One change to a valid request frame gets exactly the error it should.
    #[test]
    fn single_request_mutations(
        msg in request(),
        payload in payload(),
        changes in changes(),
    ) {
        check_single_mutations(msg, payload, &changes)?;
    }

    /// One change to a valid response frame gets exactly the error it should.
    #[test]
    fn single_response_mutations(
        msg in response(),
        payload in payload(),
        changes in changes(),
    ) {
        check_single_mutations(msg, payload, &changes)?;
    }
}
