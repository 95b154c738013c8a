//! EDL deployment tools. [`local`] runs a whole job on this machine as separate OS processes
//! (coordinator, shards, workers, then an evaluator) and reports how it went; it is the library
//! behind the `edl-local` binary.
//!
//! The pieces are split by concern: [`procs`] starts, watches and stops child processes,
//! [`progress`] shows how training is going, and [`report`] turns the outcome into a summary and
//! a JSON report.

pub mod local;
pub mod procs;
pub mod progress;
pub mod report;

pub use local::{LocalConfig, run};
pub use report::Report;
