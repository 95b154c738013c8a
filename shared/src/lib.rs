//! EDL shared pieces used by every process: the PKI (dev CA and node certificates), TLS and
//! QUIC transport helpers, a generic request server, shutdown and telemetry set-up.
//!
//! The wire types themselves (ids, job config, shard map, messages) live in `edl-proto`, which
//! does no I/O; they are re-exported here as [`proto`] so that callers need one import.

#[cfg(feature = "cli")]
pub mod cli;
pub mod clock;
pub mod contract;
pub mod docgen;
pub mod durable;
pub mod faults;
#[cfg(feature = "observe")]
pub mod http;
pub mod jobfile;
pub mod leader;
pub mod libsvm;
pub mod metrics;
pub mod pki;
pub mod server;
pub mod shutdown;
pub mod skip;
pub mod telemetry;
pub mod token;
pub mod transport;
pub mod units;

pub use edl_models as models;
pub use edl_proto as proto;
pub use pki::{Identity, PkiError, Role};
pub use server::{Peer, Service, serve};
pub use transport::{CallError, Conn, TransportSettings};
