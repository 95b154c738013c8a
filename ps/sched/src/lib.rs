//! EDL cluster scheduling: policies that share a pool of GPU slots among elastic jobs
//! ([`policy`]), the scaling models they plan with ([`speed`], measured per model in
//! [`curves`]), job traces ([`trace`]) and
//! the trace-driven simulator that compares them ([`sim`], the `edl-sim` binary). The
//! policies are written against [`policy::JobView`] only, so that the scheduler service
//! ([`cluster`], the `edl-sched` binary) runs the same code on real jobs.

pub mod cluster;
pub mod curves;
pub mod plot;
pub mod policy;
pub mod sim;
pub mod speed;
pub mod trace;
