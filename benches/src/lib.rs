//! EDL benchmarks. The `edl-bench` binary (transport, apply, scale, elastic and time-to-accuracy
//! benchmarks, issue [bench]) will live here; until then this crate only holds its place in the
//! workspace layout and measures nothing.
