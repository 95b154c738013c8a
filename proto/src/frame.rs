//! Framing: a fixed prefix, a small rkyv-archived header, then a raw payload.
//!
//! ```text
//! 0      4        6      8            12             20
//! | EDLF | version | flags | header_len | payload_len | header ... | payload ... |
//! ```
//! All integers are little-endian. The header is validated by rkyv's bytecheck before it is
//! deserialized; the payload is handed on as a `Bytes` slice of the received buffer, uncopied.

use bytes::{Bytes, BytesMut};
use rkyv::rancor::BoxedError;
use rkyv::util::AlignedVec;

use crate::error::ProtoError;
use crate::msg::{Request, Response};

/// The magic bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"EDLF";
/// The frame format version.
pub const FRAME_VERSION: u16 = 1;
/// Length of the fixed prefix.
pub const PREFIX_LEN: usize = 20;

/// Size limits applied before any buffer is allocated for a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest accepted header.
    pub max_header: u64,
    /// Largest accepted payload.
    pub max_payload: u64,
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits {
            max_header: 4 << 20,
            max_payload: 1 << 30,
        }
    }
}

/// The decoded fixed prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    /// Header bytes that follow the prefix.
    pub header_len: u64,
    /// Payload bytes that follow the header.
    pub payload_len: u64,
}

impl Prefix {
    /// Total frame length including the prefix. The sum saturates: under limits near
    /// `u64::MAX` the claimed lengths can add up past it, and a wrapped sum could match the
    /// bytes received. `u64::MAX` itself is never the length of a buffer, so a saturated
    /// frame is refused as truncated.
    pub fn frame_len(&self) -> u64 {
        (PREFIX_LEN as u64)
            .saturating_add(self.header_len)
            .saturating_add(self.payload_len)
    }
}

/// Encodes the fixed prefix.
pub fn encode_prefix(header_len: u32, payload_len: u64) -> [u8; PREFIX_LEN] {
    let mut p = [0u8; PREFIX_LEN];
    p[0..4].copy_from_slice(&MAGIC);
    p[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
    p[8..12].copy_from_slice(&header_len.to_le_bytes());
    p[12..20].copy_from_slice(&payload_len.to_le_bytes());
    p
}

/// Decodes and checks the fixed prefix from the first [`PREFIX_LEN`] bytes of `buf`.
pub fn parse_prefix(buf: &[u8], limits: &FrameLimits) -> Result<Prefix, ProtoError> {
    let p: &[u8; PREFIX_LEN] = buf
        .get(..PREFIX_LEN)
        .and_then(|s| s.try_into().ok())
        .ok_or(ProtoError::Truncated {
            needed: PREFIX_LEN as u64,
            got: buf.len() as u64,
        })?;
    let magic = [p[0], p[1], p[2], p[3]];
    if magic != MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([p[4], p[5]]);
    if version != FRAME_VERSION {
        return Err(ProtoError::Version {
            got: version,
            want: FRAME_VERSION,
        });
    }
    let flags = u16::from_le_bytes([p[6], p[7]]);
    if flags != 0 {
        return Err(ProtoError::Flags(flags));
    }
    let header_len = u64::from(u32::from_le_bytes([p[8], p[9], p[10], p[11]]));
    let payload_len = u64::from_le_bytes([p[12], p[13], p[14], p[15], p[16], p[17], p[18], p[19]]);
    if header_len > limits.max_header {
        return Err(ProtoError::HeaderTooLarge {
            len: header_len,
            max: limits.max_header,
        });
    }
    if payload_len > limits.max_payload {
        return Err(ProtoError::PayloadTooLarge {
            len: payload_len,
            max: limits.max_payload,
        });
    }
    Ok(Prefix {
        header_len,
        payload_len,
    })
}

/// A message type that can travel as a frame header.
pub trait Message: Sized {
    /// Archives the message.
    fn to_header(&self) -> Result<AlignedVec, ProtoError>;
    /// Validates and deserializes a header. `bytes` need not be aligned.
    fn from_header(bytes: &[u8]) -> Result<Self, ProtoError>;
    /// Whether this message's payload is f32 values that must all be finite (checked as the
    /// payload arrives, see [`FiniteScan`]).
    fn finite_payload(&self) -> bool;
}

macro_rules! impl_message {
    ($t:ty, |$m:ident| $finite:expr) => {
        impl Message for $t {
            fn to_header(&self) -> Result<AlignedVec, ProtoError> {
                rkyv::to_bytes::<BoxedError>(self).map_err(|e| ProtoError::Encode(e.to_string()))
            }

            fn from_header(bytes: &[u8]) -> Result<Self, ProtoError> {
                // Received buffers are not aligned; the header is small, so one copy into an
                // aligned buffer is cheap and lets bytecheck validate it in place.
                let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
                aligned.extend_from_slice(bytes);
                rkyv::from_bytes::<$t, BoxedError>(&aligned)
                    .map_err(|e| ProtoError::Header(e.to_string()))
            }

            fn finite_payload(&self) -> bool {
                let $m = self;
                $finite
            }
        }
    };
}

// A push's gradients are checked on receipt; parameters and exports are checked where they
// are made or restored.
// A push with 16-bit or sparse chunks is checked whole by the shard before anything is
// applied ([`crate::coded::check`]).
impl_message!(Request, |m| match m {
    Request::Push { chunks, .. } | Request::Replicate { chunks, .. } =>
        chunks.iter().all(crate::msg::ChunkRef::is_plain),
    _ => false,
});
impl_message!(Response, |_m| false);

/// A frame's payload: one buffer ([`Bytes`], as every received frame has it), or [`Parts`]
/// sent back to back without being joined first.
pub trait Payload {
    /// Payload bytes in all.
    fn byte_len(&self) -> usize;
    /// Appends the buffers to send, in order, to `out`.
    fn append_to(self, out: &mut Vec<Bytes>);
}

impl Payload for Bytes {
    fn byte_len(&self) -> usize {
        self.len()
    }

    fn append_to(self, out: &mut Vec<Bytes>) {
        out.push(self);
    }
}

/// A payload of several buffers, sent as one. A shard answers a pull with each key's
/// parameters as they lie in its memory, shared rather than copied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parts(pub Vec<Bytes>);

impl Payload for Parts {
    fn byte_len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    fn append_to(self, out: &mut Vec<Bytes>) {
        out.extend(self.0);
    }
}

impl Parts {
    /// The payload as one buffer: the part itself when there is one (no copy), otherwise the
    /// parts joined (a copy; for small payloads and those that must be read whole).
    pub fn to_bytes(&self) -> Bytes {
        match self.0.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            _ => self.concat(),
        }
    }

    /// The parts joined into one buffer (a copy; for tests and small payloads).
    pub fn concat(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.byte_len());
        for p in &self.0 {
            out.extend_from_slice(p);
        }
        out.freeze()
    }
}

/// A frame: a header message and its raw payload.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame<T, P = Bytes> {
    /// The header.
    pub msg: T,
    /// The raw payload (little-endian f32 values for tensor messages).
    pub payload: P,
}

impl<T: Message, P: Payload + Default> Frame<T, P> {
    /// A frame with an empty payload.
    pub fn new(msg: T) -> Self {
        Frame {
            msg,
            payload: P::default(),
        }
    }
}

impl<T: Message, P: Payload> Frame<T, P> {
    /// A frame with a payload.
    pub fn with_payload(msg: T, payload: P) -> Self {
        Frame { msg, payload }
    }

    /// Encodes the prefix and header into one buffer; the payload is sent after it as is.
    pub fn encode_head(&self) -> Result<Bytes, ProtoError> {
        let header = self.msg.to_header()?;
        let header_len = u32::try_from(header.len())
            .map_err(|_| ProtoError::Encode("header over 4 GiB".into()))?;
        let mut out = BytesMut::with_capacity(PREFIX_LEN + header.len());
        out.extend_from_slice(&encode_prefix(header_len, self.payload.byte_len() as u64));
        out.extend_from_slice(&header);
        Ok(out.freeze())
    }
}

impl<T: Message> Frame<T> {
    /// Encodes the whole frame into one contiguous buffer (tests and small messages).
    pub fn encode(&self) -> Result<Bytes, ProtoError> {
        let head = self.encode_head()?;
        let mut out = BytesMut::with_capacity(head.len() + self.payload.len());
        out.extend_from_slice(&head);
        out.extend_from_slice(&self.payload);
        Ok(out.freeze())
    }

    /// Decodes a complete frame from `buf`; the payload is a zero-copy slice of `buf`.
    pub fn decode(buf: Bytes, limits: &FrameLimits) -> Result<Self, ProtoError> {
        let prefix = parse_prefix(&buf, limits)?;
        let have = buf.len() as u64;
        if have < prefix.frame_len() {
            return Err(ProtoError::Truncated {
                needed: prefix.frame_len(),
                got: have,
            });
        }
        if have > prefix.frame_len() {
            return Err(ProtoError::Trailing(have - prefix.frame_len()));
        }
        // Both lengths are bounded by `have`, which is a usize, so these casts are exact.
        let header_end = PREFIX_LEN + prefix.header_len as usize;
        let header = buf
            .get(PREFIX_LEN..header_end)
            .ok_or(ProtoError::Truncated {
                needed: header_end as u64,
                got: have,
            })?;
        let msg = T::from_header(header)?;
        Ok(Frame {
            msg,
            payload: buf.slice(header_end..),
        })
    }
}

/// Converts f32 values to their little-endian wire bytes.
pub fn f32s_to_bytes(values: &[f32]) -> Bytes {
    let mut out = BytesMut::with_capacity(values.len() * 4);
    extend_f32s(&mut out, values);
    out.freeze()
}

/// Appends `values` as little-endian f32 to `out` (one memcpy on little-endian machines).
pub fn extend_f32s(out: &mut BytesMut, values: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        out.reserve(values.len() * 4);
        for v in values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// Reads little-endian f32 values from wire bytes into `out`; the length must be a multiple of 4.
pub fn bytes_to_f32s(bytes: &[u8], out: &mut [f32]) -> Result<(), ProtoError> {
    if bytes.len() != out.len() * 4 {
        return Err(ProtoError::Truncated {
            needed: out.len() as u64 * 4,
            got: bytes.len() as u64,
        });
    }
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(bytes);
    } else {
        for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
        }
    }
    Ok(())
}

/// The position of the first NaN or infinity in `values`. Blocks of floats are checked with a
/// branch-free test the compiler vectorizes; only a block that holds a bad value is searched.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    first_bad(values, |x| x.to_bits())
}

/// [`first_non_finite`] of little-endian f32 values as bytes, at any alignment.
pub(crate) fn first_non_finite_le(values: &[[u8; 4]]) -> Option<usize> {
    first_bad(values, |b| u32::from_le_bytes(*b))
}

/// The position of the first item whose f32 bits (`bits`) are a NaN or an infinity: its
/// exponent bits are all ones.
fn first_bad<T, B: Fn(&T) -> u32>(items: &[T], bits: B) -> Option<usize> {
    /// The search, compiled for the CPU's widest vector unit ([`crate::wide`]).
    struct Search<'a, T, B>(&'a [T], B);
    impl<T, B: Fn(&T) -> u32> crate::wide::Loop for Search<'_, T, B> {
        type Out = Option<usize>;
        #[inline(always)]
        fn run(self) -> Option<usize> {
            const BLOCK: usize = 1024;
            let Search(items, bits) = self;
            let bad = |x: &T| u32::from((bits(x) & 0x7f80_0000) == 0x7f80_0000);
            items.chunks(BLOCK).enumerate().find_map(|(i, block)| {
                let any = block.iter().fold(0u32, |acc, x| acc | bad(x));
                (any != 0).then(|| i * BLOCK + block.iter().position(|x| bad(x) != 0).unwrap_or(0))
            })
        }
    }
    crate::wide::wide(Search(items, bits))
}

/// Checks a payload of f32 values for NaN and infinity while it is being received, each part
/// as it arrives (while it is in cache), so that no separate pass over it is needed. Parts may
/// start at any address and cut a value in two: a value split between parts is put together
/// from both.
#[derive(Clone, Debug, Default)]
pub struct FiniteScan {
    /// Floats checked so far.
    checked: u64,
    /// The first bytes of a value the last part cut in two.
    carry: [u8; 4],
    carried: usize,
    /// The first bad value's position.
    bad: Option<u64>,
}

impl FiniteScan {
    /// Checks the next part of the payload.
    pub fn part(&mut self, mut part: &[u8]) {
        if self.bad.is_some() {
            return;
        }
        if self.carried > 0 {
            let take = (4 - self.carried).min(part.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&part[..take]);
            self.carried += take;
            part = &part[take..];
            if self.carried < 4 {
                return;
            }
            self.carried = 0;
            if !f32::from_le_bytes(self.carry).is_finite() {
                self.bad = Some(self.checked);
                return;
            }
            self.checked += 1;
        }
        let (values, rest) = part.as_chunks::<4>();
        if let Some(i) = first_non_finite_le(values) {
            self.bad = Some(self.checked + i as u64);
            return;
        }
        self.checked += values.len() as u64;
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
    }

    /// `Ok` if every value scanned was finite.
    pub fn result(&self) -> Result<(), ProtoError> {
        match self.bad {
            Some(index) => Err(ProtoError::NonFinite { index }),
            None => Ok(()),
        }
    }
}

/// A run of f32 values from a payload: in place, or as little-endian bytes at any alignment
/// (read with unaligned loads; nothing is copied to line them up).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum F32Run<'a> {
    /// Values aligned where they lie (or put together from two parts).
    Values(&'a [f32]),
    /// Whole values as little-endian bytes (a multiple of 4), at any address.
    Le(&'a [u8]),
}

impl F32Run<'_> {
    /// Values in the run.
    pub fn len(&self) -> usize {
        match self {
            F32Run::Values(v) => v.len(),
            F32Run::Le(b) => b.len() / 4,
        }
    }

    /// Whether the run is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Little-endian f32 bytes (a multiple of 4) at any alignment, read value by value.
#[derive(Clone, Copy, Debug)]
pub struct LeF32s<'a>(pub &'a [u8]);

impl<'a> LeF32s<'a> {
    /// The values in order.
    #[inline(always)]
    pub fn iter(self) -> impl Iterator<Item = f32> + 'a {
        self.0
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| f32::from_le_bytes(*b))
    }
}

/// Walks a payload received in parts (as QUIC delivers a stream: any lengths, any
/// alignment) as runs of f32 values, read where they lie: a run inside one part is that part's
/// bytes (as values when aligned), and only a value cut between two parts is put together.
#[derive(Debug)]
pub struct F32Runs<'a> {
    parts: &'a [Bytes],
    /// The part being read and the byte in it.
    part: usize,
    at: usize,
    /// A value cut between two parts, put together.
    joined: [f32; 1],
}

impl<'a> F32Runs<'a> {
    /// Runs over `parts`, from the start.
    pub fn new(parts: &'a [Bytes]) -> Self {
        F32Runs {
            parts,
            part: 0,
            at: 0,
            joined: [0.0],
        }
    }

    /// Hands the next `len` values to `f`, run by run, with each run's position among them
    /// (fewer if the payload ends first).
    pub fn take(&mut self, len: usize, mut f: impl FnMut(usize, F32Run<'_>)) {
        let mut at = 0;
        while let Some(run) = self.next(len - at) {
            let n = run.len();
            f(at, run);
            at += n;
        }
    }

    /// Hands the next `n` bytes to `f` in slices whose lengths are multiples of `size`, each
    /// inside one part where it can be, a value cut between two parts put together first;
    /// returns the bytes handed on (fewer than `n` if the payload ends first).
    pub fn bytes(&mut self, n: usize, size: usize, mut f: impl FnMut(&[u8])) -> usize {
        debug_assert!(
            (1..=8).contains(&size) && n.is_multiple_of(size),
            "{n} bytes of {size}"
        );
        let size = size.clamp(1, 8);
        let mut done = 0;
        let mut value = [0u8; 8];
        while n - done >= size {
            while self.part < self.parts.len() && self.at == self.parts[self.part].len() {
                self.part += 1;
                self.at = 0;
            }
            let Some(here) = self.parts.get(self.part).map(|p| &p[self.at..]) else {
                break;
            };
            let whole = here.len().min(n - done) / size * size;
            if whole > 0 {
                f(&here[..whole]);
                self.at += whole;
                done += whole;
                continue;
            }
            // A value cut between parts.
            if !self.gather_into(&mut value[..size]) {
                break;
            }
            f(&value[..size]);
            done += size;
        }
        done
    }

    /// Appends the next `n` bytes to `out`; false (with what there was appended) if the
    /// payload ends first.
    pub fn gather(&mut self, n: usize, out: &mut Vec<u8>) -> bool {
        self.bytes(n, 1, |b| out.extend_from_slice(b)) == n
    }

    /// Fills `out` with the next bytes, across parts; false if the payload ends first.
    fn gather_into(&mut self, out: &mut [u8]) -> bool {
        let mut filled = 0;
        while filled < out.len() && self.part < self.parts.len() {
            let here = &self.parts[self.part][self.at..];
            let take = here.len().min(out.len() - filled);
            out[filled..filled + take].copy_from_slice(&here[..take]);
            filled += take;
            self.at += take;
            if self.at == self.parts[self.part].len() {
                self.part += 1;
                self.at = 0;
            }
        }
        filled == out.len()
    }

    /// The bytes not read yet.
    pub fn remaining(&self) -> usize {
        let ahead: usize = self.parts.iter().skip(self.part).map(|p| p.len()).sum();
        ahead.saturating_sub(self.at)
    }

    /// The next at most `max` values (at least one while any remain and `max > 0`); `None`
    /// once fewer than four bytes remain.
    pub fn next(&mut self, max: usize) -> Option<F32Run<'_>> {
        if max == 0 {
            return None;
        }
        while self.part < self.parts.len() && self.at == self.parts[self.part].len() {
            self.part += 1;
            self.at = 0;
        }
        let here = self.parts.get(self.part)?.get(self.at..)?;
        let n = (here.len() / 4).min(max);
        if n > 0 {
            self.at += n * 4;
            let bytes = &here[..n * 4];
            return Some(match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(values) if cfg!(target_endian = "little") => F32Run::Values(values),
                _ => F32Run::Le(bytes),
            });
        }
        // A value cut between parts: put its bytes together.
        let mut value = [0u8; 4];
        if !self.gather_into(&mut value) {
            return None;
        }
        self.joined[0] = f32::from_le_bytes(value);
        Some(F32Run::Values(&self.joined))
    }
}

/// Appends `values` as little-endian f32 to `out`, checking each block for NaN and infinity
/// just before it is copied; `Err` holds the position of the first bad value, and then `out`
/// holds only the blocks before it.
pub fn extend_finite_f32s(out: &mut BytesMut, values: &[f32]) -> Result<(), usize> {
    const BLOCK: usize = 4096;
    out.reserve(values.len() * 4);
    for (i, block) in values.chunks(BLOCK).enumerate() {
        if let Some(j) = first_non_finite(block) {
            return Err(i * BLOCK + j);
        }
        extend_f32s(out, block);
    }
    Ok(())
}

/// The wire bytes as f32 values without copying, when they are aligned for f32 (a payload
/// buffer of its own usually is) and the machine is little-endian; `None` otherwise.
pub fn f32s_in_place(bytes: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "little") {
        bytemuck::try_cast_slice(bytes).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_found_where_they_are() {
        let mut v = vec![1.5f32; 5000];
        assert_eq!(first_non_finite(&v), None);
        for (i, bad) in [
            (0, f32::NAN),
            (1023, f32::INFINITY),
            (4999, f32::NEG_INFINITY),
        ] {
            v[i] = bad;
            assert_eq!(first_non_finite(&v), Some(i));
            v[i] = f32::MAX;
        }
        assert_eq!(first_non_finite(&[]), None);
    }

    #[test]
    fn a_payload_is_checked_as_it_arrives_in_parts_of_any_length() {
        let mut v = vec![0.25f32; 3000];
        v[2222] = f32::NAN;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        for step in [1, 3, 4, 7, 4096, 20000] {
            let mut scan = FiniteScan::default();
            for part in bytes.chunks(step) {
                scan.part(part);
            }
            assert!(
                matches!(scan.result(), Err(ProtoError::NonFinite { index: 2222 })),
                "parts of {step}: {:?}",
                scan.result()
            );
        }
        // A NaN cut in two by a part boundary is found.
        let mut scan = FiniteScan::default();
        scan.part(&bytes[..2222 * 4 + 2]);
        assert!(scan.result().is_ok());
        scan.part(&bytes[2222 * 4 + 2..]);
        assert!(matches!(
            scan.result(),
            Err(ProtoError::NonFinite { index: 2222 })
        ));

        let mut out = BytesMut::new();
        assert_eq!(extend_finite_f32s(&mut out, &v), Err(2222));
        let mut out = BytesMut::new();
        assert_eq!(extend_finite_f32s(&mut out, &v[..2222]), Ok(()));
        assert_eq!(&out[..], &bytes[..2222 * 4]);
    }
    #[test]
    fn runs_read_parts_of_any_length_and_alignment_as_the_values_in_order() {
        let v: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        for (skew, step) in [(0, 4096), (1, 4096), (2, 333), (3, 1), (0, 20000), (1, 6)] {
            // Each part starts `skew` bytes into a buffer of its own, so most are misaligned.
            let parts: Vec<Bytes> = bytes
                .chunks(step)
                .map(|c| {
                    let mut b = vec![0u8; skew];
                    b.extend_from_slice(c);
                    Bytes::from(b).slice(skew..)
                })
                .collect();
            for max in [1, 7, 1000, usize::MAX] {
                let mut runs = F32Runs::new(&parts);
                let mut got = Vec::new();
                while let Some(run) = runs.next(max) {
                    assert!(!run.is_empty() && run.len() <= max);
                    match run {
                        F32Run::Values(v) => got.extend_from_slice(v),
                        F32Run::Le(b) => got.extend(LeF32s(b).iter()),
                    }
                }
                assert_eq!(got, v, "skew {skew}, parts of {step}, runs of {max}");
            }
        }
        assert!(F32Runs::new(&[]).next(10).is_none());
    }

    use crate::ids::{Clock, Key, MapEpoch, WorkerId};
    use crate::msg::ChunkRef;

    fn push_frame() -> Frame<Request> {
        let payload = f32s_to_bytes(&[1.0, -2.5, 3.25, f32::MIN_POSITIVE]);
        Frame::with_payload(
            Request::Push {
                epoch: MapEpoch(3),
                worker: WorkerId(7),
                clock: Clock(42),
                chunks: vec![ChunkRef::new(Key(9), 4)],
                span: Some(crate::msg::DataSpan {
                    epoch: 1,
                    partition: 2,
                    start: 128,
                    end: 192,
                }),
                covers: Vec::new(),
                token: crate::ids::Token([5; 32]),
            },
            payload,
        )
    }

    #[test]
    fn round_trip_with_payload() {
        let f = push_frame();
        let bytes = f.encode().expect("encode");
        let back = Frame::<Request>::decode(bytes, &FrameLimits::default()).expect("decode");
        assert_eq!(back, f);
        let mut vals = [0f32; 4];
        bytes_to_f32s(&back.payload, &mut vals).expect("floats");
        assert_eq!(vals, [1.0, -2.5, 3.25, f32::MIN_POSITIVE]);
    }

    #[test]
    fn round_trip_response_with_error_and_map() {
        let f = Frame::new(Response::error(crate::ErrorCode::StaleEpoch, "old map"));
        let bytes = f.encode().expect("encode");
        assert_eq!(
            Frame::<Response>::decode(bytes, &FrameLimits::default()).expect("decode"),
            f
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = push_frame().encode().expect("encode");
        for cut in 0..bytes.len() {
            let r = Frame::<Request>::decode(bytes.slice(..cut), &FrameLimits::default());
            assert!(r.is_err(), "truncated at {cut} decoded");
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let mut v = push_frame().encode().expect("encode").to_vec();
        v.push(0);
        let r = Frame::<Request>::decode(Bytes::from(v), &FrameLimits::default());
        assert_eq!(r, Err(ProtoError::Trailing(1)));
    }

    #[test]
    fn garbage_headers_never_panic() {
        // A deterministic xorshift stream: garbage of many lengths behind a valid prefix, and
        // single-bit flips of a valid header.
        let mut s = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for len in 0..300usize {
            let header: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let mut buf = encode_prefix(len as u32, 0).to_vec();
            buf.extend_from_slice(&header);
            let _ = Frame::<Request>::decode(Bytes::from(buf.clone()), &FrameLimits::default());
            let _ = Frame::<Response>::decode(Bytes::from(buf), &FrameLimits::default());
        }
        let good = push_frame().encode().expect("encode");
        let mut accepted_flips = 0;
        for bit in (PREFIX_LEN * 8)..(good.len() - 16) * 8 {
            let mut v = good.to_vec();
            v[bit / 8] ^= 1 << (bit % 8);
            if Frame::<Request>::decode(Bytes::from(v), &FrameLimits::default()).is_ok() {
                accepted_flips += 1;
            }
        }
        // Flips inside integer fields still decode (to other values); flips that break the
        // structure must not. Some must be rejected, or validation is not running.
        assert!(accepted_flips < (good.len() - 16 - PREFIX_LEN) * 8);
    }

    #[test]
    fn bad_prefixes_are_rejected() {
        let limits = FrameLimits {
            max_header: 64,
            max_payload: 1024,
        };
        let mut p = encode_prefix(10, 10);
        p[0] = b'X';
        assert!(matches!(
            parse_prefix(&p, &limits),
            Err(ProtoError::BadMagic(_))
        ));
        let mut p = encode_prefix(10, 10);
        p[4] = 9;
        assert!(matches!(
            parse_prefix(&p, &limits),
            Err(ProtoError::Version { .. })
        ));
        let mut p = encode_prefix(10, 10);
        p[6] = 1;
        assert_eq!(parse_prefix(&p, &limits), Err(ProtoError::Flags(1)));
        let p = encode_prefix(65, 10);
        assert!(matches!(
            parse_prefix(&p, &limits),
            Err(ProtoError::HeaderTooLarge { .. })
        ));
        let p = encode_prefix(10, 1025);
        let e = parse_prefix(&p, &limits).expect_err("oversized payload");
        assert_eq!(e.code(), crate::ErrorCode::TooLarge);
        let p = encode_prefix(10, u64::MAX);
        assert!(parse_prefix(&p, &FrameLimits::default()).is_err());
    }

    #[test]
    fn error_codes_round_trip() {
        for v in 0..100u16 {
            if let Some(c) = crate::ErrorCode::from_u16(v) {
                assert_eq!(c.as_u16(), v);
            }
        }
        assert_eq!(crate::ErrorCode::from_u16(0), None);
        assert_eq!(crate::ErrorCode::from_u16(9999), None);
    }
}
