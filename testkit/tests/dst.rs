//! The deterministic simulation (`edl-dst`): a fixed range of seeds in CI, each run a pure
//! function of its seed.

use edl_testkit::dst::{self, Options};

/// Seeds CI runs (about two seconds each way): joins, drains, worker and coordinator crashes,
/// resharding moves, lost and repeated messages under ASP and SSP(0..2).
const SEEDS: std::ops::RangeInclusive<u64> = 1..=400;

#[test]
fn every_seed_of_the_ci_range_keeps_the_invariants() {
    for give_up in [false, true] {
        let mut faults = (0u64, 0u64, 0u32, 0u32, 0u32);
        for seed in SEEDS {
            let options = Options {
                give_up,
                ..Options::default()
            };
            let report = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
            faults.0 += report.lost;
            faults.1 += report.duplicated;
            faults.2 += report.workers.2;
            faults.3 += report.restarts;
            faults.4 += report.moves.0;
        }
        // The range exercises what it claims to: losses, repeats, workers declared dead,
        // coordinator restarts and moves.
        assert!(
            faults.0 > 1000
                && faults.1 > 1000
                && faults.2 > 100
                && faults.3 > 100
                && faults.4 > 100,
            "give_up {give_up}: {faults:?}"
        );
    }
}

#[test]
fn a_seed_replays_to_the_same_history() {
    let a = dst::run(7, Options::default()).expect("seed 7");
    let b = dst::run(7, Options::default()).expect("seed 7");
    assert_eq!(a.digest, b.digest);
    assert_eq!((a.events, a.virtual_ms), (b.events, b.virtual_ms));
    let other = dst::run(8, Options::default()).expect("seed 8");
    assert_ne!(a.digest, other.digest);
}

/// Found by the simulation: with a coordinator call repeated on a new connection (the client's
/// default), a `NextPartition` whose answer was lost was served twice; the first partition
/// stayed leased to a worker that never learnt of it, and the job could not finish while that
/// worker lived (seed 1: the answer leasing partition 1/1 lost at 11,355 ms stranded its 28
/// samples, 386 of 414 done). Asking again now returns the lease held.
#[test]
fn a_lost_lease_answer_strands_no_data() {
    dst::run(1, Options::default()).unwrap_or_else(|f| panic!("{f}"));
}
