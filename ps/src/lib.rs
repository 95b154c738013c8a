//! EDL parameter-server processes: the coordinator (membership, shard map, data partitions,
//! clocks) and the shard servers (parameters, optimizer state, consistency enforcement).
//!
//! Both are libraries first: the `edl-ps` binary only parses flags and calls
//! [`coordinator::run`] or [`shard::run`], so tests can run whole clusters in one process.

pub mod admin;
pub mod checkpoint;
pub mod cluster;
pub mod coordinator;
pub mod ledger;
pub mod link;
pub mod optimizer;
pub mod profile;
pub mod shard;
pub mod views;
