//! Launching EDL's processes, shared by `edl-local`, `edl-sched` and the tests: the command
//! lines of the servers and of a job's workers ([`launch`]: `edl-worker`, or the program of the
//! job file's `[worker]` table, with the process contract of [`edl_shared::contract`]), child
//! processes with their logs ([`procs`]), and the [`Placer`] seam with the placer that runs
//! processes on this machine ([`LocalPlacer`]). It sits below `deploy/` and `ps/sched`, which
//! both use it.

pub mod launch;
pub mod placer;
pub mod procs;

pub use launch::{Binaries, Creds, WorkerLaunch};
/// The signals of the process contract, as [`Placer::signal`] takes them.
pub use nix::sys::signal::Signal;
pub use placer::{Exit, JobLaunch, LOCAL_HOST, LocalPlacer, Placer, ProcRecord, STOP_GRACE, Slot};
pub use procs::{Proc, Spawn, Stopped};
