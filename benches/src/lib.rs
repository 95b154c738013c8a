//! EDL's benchmarks, run by the `edl-bench` binary: transport (EDL against bare quinn and
//! TCP), apply (server-side optimizers against memcpy), scale (synthetic workers over shards),
//! elastic (membership changes on a running job), tta (time to accuracy), load (many
//! clients, and optionally a hostile one, against real server processes) and control (the
//! coordinator's commits with each durable store). Each prints a table and can write JSON;
//! `edl-bench all` regenerates `BENCHMARKS.md`.

pub mod apply;
pub mod control;
pub mod detect;
pub mod elastic;
pub mod failover;
pub mod load;
pub mod netns;
pub mod plots;
pub mod promote;
pub mod report;
pub mod scale;
pub mod stats;
pub mod transport;
pub mod tta;
