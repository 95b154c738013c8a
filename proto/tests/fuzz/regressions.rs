//! Inputs that once broke a decoder, kept as plain tests, and exhaustive checks of small domains.

use edl_proto::ErrorCode;

/// Every wire number either is no code or decodes to a code that encodes back to it.
#[test]
fn every_error_code_number_round_trips() {
    let mut known = 0;
    for v in 0..=u16::MAX {
        if let Some(c) = ErrorCode::from_u16(v) {
            assert_eq!(c.as_u16(), v);
            known += 1;
        }
    }
    assert!(known >= 15, "only {known} codes decode");
    assert_eq!(ErrorCode::from_u16(0), None);
}

/// Found by `frames::claimed_lengths` and `frames::mutated_*_frames`: under limits of
/// `u64::MAX` (a deployment's "no limit"), a prefix whose lengths add up past `u64::MAX`
/// overflowed `Prefix::frame_len`. Debug builds panicked; release builds wrapped, and where
/// the wrapped sum equalled the bytes received (the second frame here: 20 + 100 +
/// (2^64 - 100) wraps to 20), the header was sliced out of bounds and the decoder panicked.
#[test]
fn lengths_that_add_up_past_u64_max_are_truncated() {
    use bytes::Bytes;
    use edl_proto::frame::parse_prefix;
    use edl_proto::{Frame, FrameLimits, ProtoError, Request, Response};

    let unbounded = FrameLimits {
        max_header: u64::MAX,
        max_payload: u64::MAX,
    };
    let frames: [[u8; 20]; 2] = [
        // EDLF, version 1, no flags, header_len 562, payload_len 2^64 - 1.
        [
            0x45, 0x44, 0x4c, 0x46, 0x01, 0x00, 0x00, 0x00, 0x32, 0x02, 0x00, 0x00, 0xff, 0xff,
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ],
        // EDLF, version 1, no flags, header_len 100, payload_len 2^64 - 100.
        [
            0x45, 0x44, 0x4c, 0x46, 0x01, 0x00, 0x00, 0x00, 0x64, 0x00, 0x00, 0x00, 0x9c, 0xff,
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ],
    ];
    for bytes in frames {
        let prefix = parse_prefix(&bytes, &unbounded).expect("the prefix itself is valid");
        assert_eq!(prefix.frame_len(), u64::MAX);
        let truncated = ProtoError::Truncated {
            needed: u64::MAX,
            got: 20,
        };
        let buf = Bytes::copy_from_slice(&bytes);
        let request = Frame::<Request>::decode(buf.clone(), &unbounded);
        assert_eq!(request.err().as_ref(), Some(&truncated));
        let response = Frame::<Response>::decode(buf, &unbounded);
        assert_eq!(response.err().as_ref(), Some(&truncated));
    }
}

/// Found by `job::tensor_lengths`: a tensor shape is a header field (`JobConfig` travels in
/// `Registered`, `ShardAssigned` and `Job`), and the product of three large dimensions
/// overflowed `TensorSpec::len` (a panic in debug builds, a wrapped, far too small length in
/// release builds). The length now saturates.
#[test]
fn huge_tensor_shapes_saturate() {
    use edl_proto::{Init, TensorSpec};

    let spec = TensorSpec {
        name: "huge".into(),
        shape: vec![u32::MAX, u32::MAX, u32::MAX],
        init: Init::Zeros,
    };
    assert_eq!(spec.len(), u64::MAX);
    assert!(!spec.is_empty());
    let with_zero = TensorSpec {
        shape: vec![u32::MAX, u32::MAX, u32::MAX, 0],
        ..spec
    };
    assert_eq!(with_zero.len(), 0);
}

/// `KeyRange::runs` of key `u64::MAX` computed `u64::MAX + 1` for the end of its run: a
/// panic in debug builds, an empty range `[u64::MAX, 0)` in release builds. A half-open
/// `KeyRange` cannot hold that key, and no layout has that many keys: `runs` leaves it out.
#[test]
fn runs_of_the_last_key() {
    use edl_proto::msg::KeyRange;

    let runs = KeyRange::runs([u64::MAX - 1, u64::MAX].into_iter());
    assert_eq!(
        runs,
        vec![KeyRange {
            start: u64::MAX - 1,
            end: u64::MAX
        }]
    );
}
