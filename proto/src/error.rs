//! Stable error codes that cross the wire, and the protocol crate's own error type.

use thiserror::Error;

/// A stable code for every failure that crosses the wire. The numbers never change meaning;
/// new codes are only ever appended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// The frame or header could not be decoded.
    Malformed = 1,
    /// The peer speaks a different protocol version.
    UnsupportedVersion = 2,
    /// The peer's certificate role may not make this request.
    Forbidden = 3,
    /// The worker id is not (or no longer) registered; a dropped worker must re-register.
    UnknownWorker = 4,
    /// A key is not part of the job, or not owned by this shard.
    UnknownKey = 5,
    /// The request was routed with an old shard-map epoch; the response carries the new map.
    StaleEpoch = 6,
    /// A tensor payload has the wrong length for its keys.
    ShapeMismatch = 7,
    /// A gradient contains NaN or infinity.
    NonFinite = 8,
    /// The job is not ready yet (for example, not all shards have joined).
    NotReady = 9,
    /// The server is shutting down.
    ShuttingDown = 10,
    /// An unexpected server-side failure.
    Internal = 11,
    /// A frame exceeds the configured size limits.
    TooLarge = 12,
    /// The first request on a connection was not the handshake, or the handshake repeated.
    HandshakeRequired = 13,
    /// A push refers to a clock whose update has already been applied (BSP).
    StaleClock = 14,
    /// The request is valid but makes no sense in the current state.
    InvalidRequest = 15,
    /// The request names a worker that belongs to another identity (certificate), or a push
    /// carries no valid registration token for the worker it names.
    IdentityMismatch = 16,
    /// A budget is exhausted (bytes in flight, streams, connections per identity); retry later.
    Busy = 17,
    /// The request conflicts with a live peer: a shard name already held by a running shard.
    Conflict = 18,
    /// The peer's certificate belongs to another job.
    WrongJob = 19,
    /// A commit names a data partition the coordinator does not hold as leased to the worker
    /// (a lease lost with a coordinator's state): give the span back and lease again.
    LeaseUnknown = 20,
    /// The request came from a coordinator of an earlier term than one this server has heard
    /// from: a deposed leader, whose orders are refused.
    Deposed = 21,
}

impl ErrorCode {
    /// Decodes a code received from the wire; unknown numbers map to `None`.
    pub fn from_u16(v: u16) -> Option<Self> {
        use ErrorCode::*;
        Some(match v {
            1 => Malformed,
            2 => UnsupportedVersion,
            3 => Forbidden,
            4 => UnknownWorker,
            5 => UnknownKey,
            6 => StaleEpoch,
            7 => ShapeMismatch,
            8 => NonFinite,
            9 => NotReady,
            10 => ShuttingDown,
            11 => Internal,
            12 => TooLarge,
            13 => HandshakeRequired,
            14 => StaleClock,
            15 => InvalidRequest,
            16 => IdentityMismatch,
            17 => Busy,
            18 => Conflict,
            19 => WrongJob,
            20 => LeaseUnknown,
            21 => Deposed,
            _ => return None,
        })
    }

    /// The number sent on the wire.
    pub fn as_u16(self) -> u16 {
        self as u16
    }
}

/// Why a frame could not be encoded or decoded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtoError {
    /// The input ended before the frame did.
    #[error("truncated frame: needed {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the frame claims to need.
        needed: u64,
        /// Bytes actually available.
        got: u64,
    },
    /// The frame does not start with the EDL magic bytes.
    #[error("bad magic {0:02x?}: not an EDL frame")]
    BadMagic([u8; 4]),
    /// The frame format version is not the one this build speaks.
    #[error("unsupported frame version {got} (this build speaks {want})")]
    Version {
        /// Version found in the frame.
        got: u16,
        /// Version this build speaks.
        want: u16,
    },
    /// Reserved flag bits were set.
    #[error("reserved frame flags set: {0:#06x}")]
    Flags(u16),
    /// The header exceeds the limit.
    #[error("header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLarge {
        /// Claimed header length.
        len: u64,
        /// Configured limit.
        max: u64,
    },
    /// The payload exceeds the limit.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge {
        /// Claimed payload length.
        len: u64,
        /// Configured limit.
        max: u64,
    },
    /// Bytes follow the end of the frame.
    #[error("{0} trailing bytes after the frame")]
    Trailing(u64),
    /// The header failed validation or deserialization.
    #[error("invalid header: {0}")]
    Header(String),
    /// Encoding the header failed.
    #[error("could not encode header: {0}")]
    Encode(String),
    /// A payload's layout is not the one its header announces (a sparse push's positions).
    #[error("malformed payload: {0}")]
    Payload(String),
    /// A payload of values that must be finite (a push's gradients) holds a NaN or infinity.
    #[error("payload value at float {index} is not finite")]
    NonFinite {
        /// Position of the first bad value.
        index: u64,
    },
}

impl ProtoError {
    /// The wire error code that reports this failure to the peer.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtoError::HeaderTooLarge { .. } | ProtoError::PayloadTooLarge { .. } => {
                ErrorCode::TooLarge
            }
            ProtoError::Version { .. } => ErrorCode::UnsupportedVersion,
            ProtoError::Encode(_) => ErrorCode::Internal,
            ProtoError::NonFinite { .. } => ErrorCode::NonFinite,
            _ => ErrorCode::Malformed,
        }
    }
}
