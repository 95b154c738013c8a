//! The deterministic simulation (`edl-dst`): a fixed range of seeds in CI, each run a pure
//! function of its seed.

use std::time::Instant;

use edl_proto::Consistency;
use edl_testkit::dst::{self, Kind, Options, Report, Scenario, Scripted, Target};

/// Seeds CI runs (about five seconds each way): joins, drains, worker, coordinator and shard
/// crashes, partitions, dropped requests and answers by kind, resharding moves, lost and
/// repeated messages under ASP and SSP(0..2).
const SEEDS: std::ops::RangeInclusive<u64> = 1..=1000;

#[test]
fn every_seed_of_the_ci_range_keeps_the_invariants() {
    for give_up in [false, true] {
        let mut faults = [0u64; 7];
        for seed in SEEDS {
            let options = Options {
                give_up,
                ..Options::default()
            };
            let r = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
            let seen = [
                r.lost,
                r.duplicated,
                r.workers.2.into(),
                r.restarts.into(),
                r.moves.0.into(),
                r.shard_crashes.into(),
                r.cuts.into(),
            ];
            for (sum, n) in faults.iter_mut().zip(seen) {
                *sum += n;
            }
        }
        // The range exercises what it claims to: losses, repeats, workers declared dead,
        // coordinator restarts, moves, shard crashes, partitions and filters.
        assert!(
            faults.iter().all(|&n| n > 300),
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
/// worker lived (seed 3 with the fix undone: 153 of 182 samples done, the rest stranded).
/// Asking again now returns the lease held.
#[test]
fn a_lost_lease_answer_strands_no_data() {
    dst::run(3, Options::default()).unwrap_or_else(|f| panic!("{f}"));
}

/// A job of two shards and two workers with no random faults, long enough to still be
/// training when a fault scripted at 1 s begins.
fn quiet(script: Vec<(u64, Scripted)>) -> Scenario {
    Scenario {
        shards: 2,
        workers: 2,
        consistency: Consistency::Ssp { staleness: 1 },
        data: (1024, 32, 4),
        loss: 0.0,
        duplicate: 0.0,
        max_delay_ms: 5,
        script,
    }
}

fn run(scenario: Scenario) -> Report {
    let t = Instant::now();
    let report =
        dst::run_scenario(1, scenario, Options::default()).unwrap_or_else(|f| panic!("{f}"));
    eprintln!("{report} ({:?} real)", t.elapsed());
    report
}

/// The outage of `faults.rs`' real-process test (there cut to just past the transport's idle
/// timeout), at its full 90 s on virtual time: the workers keep their leases by heartbeating
/// the coordinator, wait the outage out and then train to the end; nothing is lost (every
/// ledger exact, every counter one per batch: the run's own checks).
#[test]
fn a_shard_partitioned_for_90_s_then_healed_loses_nothing() {
    let r = run(quiet(vec![(
        1000,
        Scripted::Partition(Target::Shard(0), 90_000),
    )]));
    assert!(r.virtual_ms > 91_000, "the job did not wait: {r}");
    assert_eq!((r.workers.2, r.left), (0, 2), "{r}");
    assert!(r.lost > 0, "the partition cut nothing: {r}");
}

/// A worker cut off for five leases is declared dead and its data goes to the other; when the
/// partition heals its calls are refused and it exits, and nothing it pushed counts twice.
#[test]
fn a_worker_partitioned_past_its_lease_is_dead_and_its_data_reissued() {
    let r = run(quiet(vec![(
        1000,
        Scripted::Partition(Target::Worker(0), 5000),
    )]));
    assert_eq!((r.workers.2, r.left), (1, 1), "{r}");
}

/// Every `Clock` answer lost for 2 s: each commit is repeated on a new connection, and the
/// coordinator counts each once (the run checks the ledgers and counters exactly).
#[test]
fn lost_clock_answers_make_repeated_commits_that_count_once() {
    let r = run(quiet(vec![(
        1000,
        Scripted::Filter {
            kind: Kind::Clock,
            answers: true,
            ms: 2000,
        },
    )]));
    assert!(r.lost > 0, "{r}");
    assert_eq!((r.workers.2, r.left), (0, 2), "{r}");
}

/// Found by the simulation, each now a regression seed:
/// - 120: a move whose hand-off failed (the destination was down) left its map epoch to the
///   next move's different map: two maps of one epoch. Every map now takes an epoch above all
///   the coordinator ever sent (`issued`, saved before a move's map goes out).
/// - 192: a worker that adopted a failed move's map (the source refused with it while the
///   range was out) routed to the destination, which never got the range, forever. The
///   coordinator now publishes the placement again above the failed move's map, and the
///   shards refuse a superseded move at both ends.
/// - 5993: a shard that took a range back after a failed hand-off kept a checkpoint written
///   while the range was out, and could not restart with the coordinator's map. It now writes
///   its checkpoint after taking the range back.
#[test]
fn failed_moves_leave_one_map_per_epoch_and_no_stranded_range() {
    for seed in [120, 192, 5993] {
        dst::run(seed, Options::default()).unwrap_or_else(|f| panic!("{f}"));
    }
}

/// Found with `--mid-move`: a coordinator that crashed after a move's hand-off but before
/// publishing came back with the old map, and the range sat on a shard no map named (seed
/// 1203); a shard restarted meanwhile could not restore its checkpoint against that map
/// (seeds 32, 692). The move is now recorded before its `MoveOut` goes, and a restarted
/// coordinator (or one whose `MoveOut` went unanswered) fences the destination and asks it for
/// the range before publishing either placement.
#[test]
fn a_move_the_coordinator_crashed_in_is_settled_from_the_destination() {
    let options = Options {
        mid_move: true,
        ..Options::default()
    };
    for seed in [1203, 32, 692] {
        dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
    }
}
