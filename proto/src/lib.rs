//! EDL wire protocol: ids, job and shard-map types, messages, framing and error codes.
//!
//! This crate does no I/O. It knows bytes and types, never sockets or runtimes, so every
//! decoding path can be tested (and fuzzed) on plain byte slices. Anything that comes from the
//! network is decoded through [`frame`], which validates before it trusts.

pub mod coded;
pub mod error;
pub mod frame;
pub mod ids;
pub mod job;
pub mod msg;
pub mod order;
pub mod place;
pub mod sched;
pub mod schedule;
pub mod sparse;
pub mod wide;
pub mod wire;

pub use error::{ErrorCode, ProtoError};
pub use frame::{Frame, FrameLimits, Parts, Payload};
pub use ids::{Clock, Key, MapEpoch, ShardId, Token, WorkerId};
pub use job::{
    Consistency, DataFormat, DataSpec, Init, JobConfig, KeyLayout, KeySpan, ModelSection,
    OptimizerGroup, OptimizerSpec, ShardMap, TensorSpec, TensorWire,
};
pub use msg::{Request, Response};
pub use place::{Placement, PlacementKind, PlacementState, StragglerPolicy, StragglerSettings};
pub use schedule::{Anneal, Curve, LrSchedule, ScheduleUnit, WorkerScaling};
pub use sparse::TopK;
pub use wire::{Wire, WireSpec};

/// The protocol version spoken by this build. A peer with a different version is refused at
/// the handshake with [`ErrorCode::UnsupportedVersion`].
pub const PROTOCOL_VERSION: u32 = 14;
