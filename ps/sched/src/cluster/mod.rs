//! The cluster scheduler service (`edl-sched`): a pool of worker slots ([`config`]), jobs
//! submitted with `edlctl job submit` and kept durably ([`state`]), the same policies as the
//! simulator deciding each job's size, stop-free resizes through each job's coordinator, and
//! a [`Placer`] that starts the processes ([`LocalPlacer`] on this machine, [`kube::KubePlacer`]
//! as pods). The placer seam and the local placer live below, in `edl_launch`.
//!
//! Isolation: every job's certificates carry the job's name, so a job's servers refuse the
//! certificates of any other job (and of the scheduler's own clients); a job's owner gets an
//! admin certificate for that job alone.

pub mod config;
pub mod kube;
pub mod run;
pub mod server;
pub mod state;

pub use config::Cluster;
pub use edl_launch::{LocalPlacer, Placer};
pub use run::Scheduler;
