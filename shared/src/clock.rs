//! The time services read: the clock of the tokio runtime they run on.
//!
//! A service that reads time only through [`now`] and waits only with `tokio::time` runs on
//! one clock: the system's monotonic clock in production, and virtual time under a runtime
//! whose time is paused (`tokio::runtime::Builder::start_paused`), as the deterministic
//! simulation (`edl-dst`) runs the coordinator. There the clock moves only when every task
//! waits, straight to the next timer, so a 60 s long poll times out in no real time and a run
//! is a function of its seed. A separate clock object could not make tokio's timers virtual;
//! the runtime's clock does both.

use std::time::Instant;

/// Now, on the runtime's clock (the system's outside a runtime or with time not paused).
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn paused_time_moves_only_with_timers() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        let (slept, real) = rt.block_on(async {
            let (t0, real0) = (super::now(), std::time::Instant::now());
            tokio::time::sleep(Duration::from_secs(90)).await;
            (super::now() - t0, real0.elapsed())
        });
        assert!(slept >= Duration::from_secs(90), "{slept:?}");
        assert!(real < Duration::from_secs(5), "{real:?}");
    }
}
