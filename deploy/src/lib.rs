//! EDL deployment tools. [`local`] runs a whole job on this machine as separate OS processes
//! (coordinator, shards, workers, then an evaluator) and reports how it went; it is the library
//! behind the `edl-local` binary.
//!
//! The pieces are split by concern: `edl_launch` (below this crate, shared with the cluster
//! scheduler) finds the binaries, builds each process's command line and starts, watches and
//! stops child processes;
//! [`scenario`] reads the timed membership changes and shard events a run replays,
//! [`progress`] shows how training is going, [`costs`] works out what each event and key-range
//! move cost from the coordinator's trace, [`plot`] draws the run over time, [`elastic`] what stragglers, preemptions and
//! placements did, and [`report`] turns the outcome into a summary and a JSON report.

pub mod costs;
pub mod elastic;
pub mod local;
pub mod plot;
pub mod progress;
pub mod report;
pub mod scenario;

pub use local::{ElasticConfig, LocalConfig, ObserveConfig, ScenarioFile, run};
pub use report::Report;
pub use scenario::Scenario;
