//! The deterministic simulation (`edl-dst`): a fixed range of seeds in CI, each run a pure
//! function of its seed.

use std::time::Instant;

use edl_proto::msg::EventKind;
use edl_proto::{Consistency, StragglerPolicy, StragglerSettings, WorkerId};
use edl_testkit::dst::{self, Kind, Options, Report, Scenario, Scripted, Target};
use edl_testkit::traces::{StragglerRun, fewest_active, first_event_since, rate};

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

/// The same faults with the real client library as the workers (`--clients`): its `Session`
/// in the trainer's loop (pull, push, commit, leave), its reconnects, re-routing and
/// heartbeats, over in-process connections of the simulated network (a lost message is a
/// connection that fails after a second). The seeds that draw SSP(0) run BSP. Planted bugs it
/// catches: a shard applying a span
/// twice (seed 1), a coordinator leasing a second partition when asked again (seed 3, where
/// the model of the client found it first).
#[test]
fn real_clients_keep_the_invariants() {
    let options = Options {
        clients: true,
        ..Options::default()
    };
    let mut faults = [0u64; 6];
    for seed in 1..=400 {
        let r = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
        let seen = [
            r.lost,
            r.workers.2.into(),
            r.restarts.into(),
            r.moves.0.into(),
            r.shard_crashes.into(),
            (r.consistency == Consistency::Bsp).into(),
        ];
        for (sum, n) in faults.iter_mut().zip(seen) {
            *sum += n;
        }
    }
    // Lost messages, workers declared dead, coordinator restarts, moves, shard crashes; and
    // runs under BSP.
    assert!(faults[..5].iter().all(|&n| n > 100), "{faults:?}");
    assert!(faults[5] > 10, "BSP runs: {faults:?}");
    let a = dst::run(7, options).expect("seed 7");
    let b = dst::run(7, options).expect("seed 7");
    assert_eq!(a.digest, b.digest);
}

/// Every run of a seed is the same history: seeds run twice, with the model of the client and
/// with the real one. (Found so: requests waiting on a shard's map were woken by a `watch`,
/// and a stopped client's heartbeat raced its next tick in an unbiased `select!`, both in a
/// random order; seed 7 alone had replayed.)
#[test]
fn a_seed_replays_to_the_same_history() {
    for clients in [false, true] {
        let options = Options {
            clients,
            ..Options::default()
        };
        // More seeds with real clients: their tasks interleave with more of the services'.
        let seeds = if clients { 1..=500 } else { 1..=200 };
        for seed in seeds {
            replays(seed, options);
        }
    }
    let seven = dst::run(7, Options::default()).expect("seed 7");
    let other = dst::run(8, Options::default()).expect("seed 8");
    assert_ne!(seven.digest, other.digest);
}

/// Replicated jobs (`--replicas`): the coordinator watches the shards and promotes backups,
/// and shards crash at every step of a push's replication and of a new backup's seeding (1 to
/// 3 armed per seed), on top of each seed's faults (shard crashes and partitions, coordinator
/// crashes or failovers, lost and repeated messages), with two and three copies, the model of
/// the client and the real one. No acknowledged push may be lost or applied twice, crashes or
/// not: at every acknowledgement the primary's copy and its backups' hold the push, and at the
/// end every copy, primary and backup, is exact to the float, with every key back to its
/// copies.
#[test]
fn replicated_jobs_lose_nothing_when_shards_crash_at_every_point_of_replication() {
    let runs = [
        (2, false, false, 1..=500),
        (3, false, false, 1..=250),
        (2, true, false, 1..=250),
        (2, false, true, 1..=250),
    ];
    for (replicas, clients, failover, seeds) in runs {
        let options = Options {
            replicas,
            clients,
            failover,
            ..Options::default()
        };
        let (mut promoted, mut seeded, mut hits) = (0, 0, [0u32; 7]);
        for seed in seeds.clone() {
            let r = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
            promoted += r.replication.0;
            seeded += r.replication.1;
            for (sum, n) in hits.iter_mut().zip(r.replication.2) {
                *sum += n;
            }
        }
        // The seeds exercise what they claim: backups promoted and seeded, and crashes at
        // every point.
        let runs = seeds.count() as u32;
        let what = format!(
            "replicas {replicas}, clients {clients}, failover {failover}: {promoted} promoted, \
             {seeded} seeded, crashes at {:?}: {hits:?}",
            dst::Point::ALL
        );
        assert!(promoted > runs / 2 && seeded > runs / 2, "{what}");
        // A primary that sent a copy is the last full copy of its keys but where the job keeps
        // three: with two, that crash waits (and never comes).
        let points = dst::Point::ALL.iter().zip(hits);
        let may = |p: &dst::Point| replicas > 2 || *p != dst::Point::CopySent;
        assert!(
            points.filter(|(p, _)| may(p)).all(|(_, n)| n >= runs / 50),
            "{what}"
        );
    }
}

/// Found by the simulation of replicated jobs (since the shards and the coordinator in the
/// simulation are the real services, the seeds run here are ones that fail with each fix
/// undone, checked; the seeds it was found at first are in parentheses):
/// - seed 1, three copies: a shard backing two primaries' keys kept one ledger for both, so the
///   second primary's forward of a span was taken for a repeat of the first's and skipped (its
///   keys' backup copies missed it). A backup's copies now have a ledger per primary.
/// - seed 272, three copies (296, two): a copy a primary offered its new backup again after a
///   failed try could reach a restarted process that never saw the pushes the first one kept
///   and acknowledged. A copy is now offered once; a failed seeding is seeded again.
/// - seed 191, three copies (687, two): a shard dropped as a backup while cut off, and picked
///   again, took its stale copy for the new one. A copy held under an older map is replaced, and
///   pushes forwarded before the new copy arrived are kept for it, not applied to the stale one.
/// - seed 1411, three copies (32, two): a push forwarded to a backup being seeded with some of
///   its keys was kept whole, and a failed seeding took with it what the keys the backup held
///   already were acknowledged. Those keys' part now travels apart and is applied at once.
/// - seed 1841, two copies with failovers (179): a late, older map made a new backup drop the
///   pushes it kept for the newer seeding's copy. Only a map at least as new voids them.
/// - seed 992, three copies with the real client: one question at a time, a question sent
///   while the coordinator was cut off hid for a second that a shard answered again, and the
///   shard was taken for dead, its keys given to a backup that had just crashed. A question now
///   goes every tick.
#[test]
fn replication_bugs_the_simulation_found_stay_fixed() {
    let with = |replicas, clients, failover| Options {
        replicas,
        clients,
        failover,
        ..Options::default()
    };
    let seeds = [
        (1, with(3, false, false)),
        (272, with(3, false, false)),
        (191, with(3, false, false)),
        (1411, with(3, false, false)),
        (1841, with(2, false, true)),
        (992, with(3, true, false)),
    ];
    for (seed, options) in seeds {
        dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
    }
}

/// Replicated seeds replay too (the coordinator's watch, its questions and promotions, and the
/// shards' forwards are tasks of their own).
#[test]
fn a_replicated_seed_replays_to_the_same_history() {
    for clients in [false, true] {
        let options = Options {
            replicas: 2,
            clients,
            ..Options::default()
        };
        for seed in 1..=100 {
            replays(seed, options);
        }
    }
}

/// Runs `seed` twice: the same history both times.
fn replays(seed: u64, options: Options) {
    let a = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
    let b = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(
        (a.digest, a.events, a.virtual_ms),
        (b.digest, b.events, b.virtual_ms),
        "seed {seed}, {options:?}"
    );
}

/// Found by the simulation (at seed 3): with a coordinator call repeated on a new connection
/// (the client's default), a `NextPartition` whose answer was lost was served twice; the first
/// partition stayed leased to a worker that never learnt of it, and the job could not finish
/// while that worker lived. Asking again now returns the lease held. Since the shards in the
/// simulation are the real service, seed 1 is the one that fails with the fix undone (386 of
/// 414 samples done, the rest stranded; checked).
#[test]
fn a_lost_lease_answer_strands_no_data() {
    dst::run(1, Options::default()).unwrap_or_else(|f| panic!("{f}"));
}

/// The coordinator answers only once the changes an answer depends on are durable ([ha]). With
/// its state saved every half second instead, a restarted coordinator met reports of what it
/// had acknowledged and forgotten (the simulation checks for them after every event): a clock
/// or a commit past its saved one at seed 0, with real clients at seed 14; and with real
/// clients under BSP (seeds 363, 585), its clocks were older than the steps the shards had
/// applied, every worker that joined was refused with `StaleClock`, and the job stalled.
/// (All four fail with the answers not waiting for the store; checked.)
#[test]
fn nothing_the_coordinator_acknowledged_is_lost_in_its_crash() {
    dst::run(0, Options::default()).unwrap_or_else(|f| panic!("{f}"));
    let clients = Options {
        clients: true,
        ..Options::default()
    };
    for seed in [14, 363, 585] {
        let r = dst::run(seed, clients).unwrap_or_else(|f| panic!("{f}"));
        assert!(r.restarts > 0, "seed {seed} has no coordinator crash");
    }
    for seed in [363, 585] {
        let r = dst::run(seed, clients).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(r.consistency, Consistency::Bsp, "seed {seed}");
    }
}

/// The seeds' coordinator crashes as etcd fails a leader over (`--failover`): the leader is
/// cut off from the store and the workers but runs on, its late orders still reaching the
/// shards, and a standby restored from the store leads at the next term. Every invariant
/// holds (exactly-once ledgers, one map per epoch, nothing acknowledged lost), with the
/// model of the client and with real clients; and the fencing is exercised: old leaders
/// found themselves deposed when they next wrote. With real clients the job has a standby at
/// a second address that names the leader it saw last; two thirds of the leaders lost are
/// killed instead (for up to 8 s), half of those elected again at their own address, and half
/// of the others paused (their clients' calls time out) rather than only cut off: 1,000 seeds.
#[test]
fn failovers_to_a_standby_keep_the_invariants() {
    for (clients, seeds) in [(false, 1..=500), (true, 1..=1000)] {
        let options = Options {
            failover: true,
            clients,
            ..Options::default()
        };
        let (mut failovers, mut fenced, mut killed, mut back, mut paused) = (0, 0, 0, 0, 0);
        for seed in seeds {
            let r = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
            failovers += r.failovers.0;
            fenced += r.failovers.1;
            killed += r.leaders_killed.0;
            back += r.leaders_killed.1;
            paused += r.leaders_paused;
        }
        let counts = format!(
            "clients {clients}: {failovers} failovers, {fenced} deposed leaders fenced off, \
             {killed} leaders killed, {back} of them elected again at their own address, \
             {paused} leaders paused"
        );
        eprintln!("{counts}");
        assert!(failovers > 100 && fenced > 20, "{counts}");
        if clients {
            assert!(killed > 200 && back > 80 && paused > 50, "{counts}");
        }
    }
}

/// Seeds whose leader is killed while the standby names it (`--failover --clients`). With the
/// client as it was, a worker sent by the standby to the dead leader, failing to reach it, went
/// on asking the standby while it believed it asked the leader, forever: these seeds never
/// finished (22 of seeds 1..400 did not). Now each finishes with no worker dropped.
#[test]
fn a_client_never_waits_on_a_standby() {
    let options = Options {
        failover: true,
        clients: true,
        ..Options::default()
    };
    for seed in [29, 34, 37, 71] {
        let r = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
        assert!(r.leaders_killed.0 > 0, "seed {seed}: no leader killed: {r}");
        assert_eq!(r.dropped, 0, "seed {seed}: a worker was dropped: {r}");
    }
}

/// A leader deposed while it settles a move (`--failover --mid-move`) goes on re-sending its
/// fence (a `SetMap` tried again every second) after the standby took over; the shards refuse
/// those orders for their term (seeds 241, 267, 351, 394). The maps' epochs alone would have
/// kept these runs right (the fence is older than the new leader's maps, which the shards
/// keep; checked with the term check undone): the term is the second line of defence, for an
/// order of a deposed leader whose map is not older.
#[test]
fn a_deposed_leaders_late_orders_are_refused_by_the_shards() {
    let options = Options {
        failover: true,
        mid_move: true,
        ..Options::default()
    };
    for seed in [241, 267, 351, 394] {
        let r = dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
        assert!(r.failovers.2 > 0, "seed {seed}: no order refused: {r}");
    }
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
        step_ms: 0,
        stragglers: StragglerSettings::default(),
        clients: false,
        replicas: 1,
        standby: false,
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

/// Found by the simulation (at the seeds named; since the shards in the simulation are the real
/// service, the seeds run here are the ones that fail with each fix undone, checked):
/// - 120 (still 120): a move whose hand-off failed (the destination was down) left its map
///   epoch to the next move's different map: two maps of one epoch. Every map now takes an
///   epoch above all the coordinator ever sent (`issued`, saved before a move's map goes out).
/// - 192 (now 72): a worker that adopted a failed move's map (the source refused with it while
///   the range was out) routed to the destination, which never got the range, forever. The
///   coordinator now publishes the placement again above the failed move's map, and the
///   shards refuse a superseded move at both ends.
/// - 5993 (now 1137): a shard that took a range back after a failed hand-off kept a checkpoint
///   written while the range was out, and could not restart with the coordinator's map. It
///   now writes its checkpoint after taking the range back.
#[test]
fn failed_moves_leave_one_map_per_epoch_and_no_stranded_range() {
    for seed in [120, 72, 1137] {
        dst::run(seed, Options::default()).unwrap_or_else(|f| panic!("{f}"));
    }
}

/// Found with `--mid-move`: a coordinator that crashed after a move's hand-off but before
/// publishing came back with the old map, and the range sat on a shard no map named (seed
/// 1203); a shard restarted meanwhile could not restore its checkpoint against that map
/// (seeds 32, 692; all three still fail with the fix undone, checked since the shards in the
/// simulation are the real service). The move is now recorded before its `MoveOut` goes, and a
/// restarted
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

/// Found with `--mid-move` once the shards in the simulation were the real service (its
/// hand-off window included): a destination took a range but its answers were lost for the
/// whole window, and the source took the range back: two shards held it (seeds 108, 1014),
/// or batches were applied twice (493) or lost (67). The source now takes a range back only
/// when the destination refuses it; unanswered, it goes on offering the range, held at
/// neither end, and the coordinator fences the destination and asks it where the range is on
/// any failed move; a destination acknowledges an offer of a range it took before, wherever
/// the range is now (seed 1014 failed without that; the others without the rest; checked).
#[test]
fn an_unanswered_hand_off_is_not_taken_back() {
    let options = Options {
        mid_move: true,
        ..Options::default()
    };
    for seed in [108, 1014, 493, 67] {
        dst::run(seed, options).unwrap_or_else(|f| panic!("{f}"));
    }
}

/// Four workers in lockstep (SSP(0): BSP's barrier, as the coordinator grants clocks), 20 ms of
/// compute a step; at 4 s the third computes `factor` times slower, and at 20 s at its normal
/// speed again. The straggler detector and `policy` run on virtual time: the measured rates
/// are exact, whatever the machine's load.
const SLOWED_MS: u64 = 4_000;

fn straggler_run(policy: StragglerPolicy, factor: u32) -> StragglerRun {
    let scenario = Scenario {
        workers: 4,
        consistency: Consistency::Ssp { staleness: 0 },
        data: (12_000, 400, 4),
        max_delay_ms: 2,
        step_ms: 20,
        stragglers: StragglerSettings {
            policy,
            ..StragglerSettings::default()
        },
        ..quiet(vec![
            (SLOWED_MS, Scripted::Slow(2, factor)),
            (20_000, Scripted::Slow(2, 1)),
        ])
    };
    let options = Options {
        trace: true,
        ..Options::default()
    };
    let r = dst::run_scenario(1, scenario, options).unwrap_or_else(|f| panic!("{f}"));
    let trace = r.trace.as_ref().expect("a trace");
    let straggler = r.ids[2].expect("w2 registered");
    let first =
        |kind: EventKind, worker: WorkerId| first_event_since(trace, kind, worker, SLOWED_MS);
    let flagged =
        first(EventKind::Straggler, straggler).unwrap_or_else(|| panic!("not flagged: {r}"));
    // No other worker is flagged.
    let others: Vec<WorkerId> = (trace.events.iter())
        .filter(|e| e.kind == EventKind::Straggler && e.worker != straggler)
        .map(|e| e.worker)
        .collect();
    assert!(others.is_empty(), "flagged besides w2: {others:?}");
    let left = match policy {
        StragglerPolicy::Ignore => None,
        _ => first(EventKind::Leave, straggler),
    };
    let recovered = left.unwrap_or(flagged);
    let end = recovered + 5_000;
    assert!(
        end < 20_000,
        "the window ends after the slowdown: {r}\n{:?}",
        trace.events
    );
    StragglerRun {
        before: rate(trace, 4, SLOWED_MS - 3_000, SLOWED_MS),
        after: rate(trace, 4, recovered + 1_000, end),
        detect_ms: flagged - SLOWED_MS,
        recover_ms: left.map(|l| l - SLOWED_MS),
        fewest_active: fewest_active(trace, SLOWED_MS, end),
    }
}

/// What `elastic_ops.rs` measured on real time with the real trainer (and still does for the
/// replacement under BSP, over QUIC): ignored, a 3x straggler holds every lockstep step back;
/// replaced, the job is back to speed within a bounded time and never runs with fewer than its
/// four workers; and the detector flags a 3x straggler within 2 s of its slowdown.
#[test]
fn a_straggler_in_lockstep_costs_throughput_until_it_is_replaced() {
    let ignored = straggler_run(StragglerPolicy::Ignore, 3);
    let replaced = straggler_run(StragglerPolicy::Replace, 3);
    eprintln!("ignore:  {ignored:?}\nreplace: {replaced:?}");
    assert!(
        ignored.after < 0.7 * ignored.before,
        "ignoring a 3x straggler should cost throughput: {ignored:?}"
    );
    assert!(
        replaced.after >= 0.85 * replaced.before,
        "after the replacement the job should be back to speed: {replaced:?}"
    );
    let recover = replaced.recover_ms.expect("the straggler left");
    assert!(recover < 15_000, "recovery took {recover} ms");
    assert!(
        replaced.detect_ms < 2_000 && ignored.detect_ms < 2_000,
        "a 3x straggler was flagged after {} and {} ms",
        ignored.detect_ms,
        replaced.detect_ms
    );
    assert!(
        replaced.fewest_active >= 4,
        "the worker count dipped: {replaced:?}"
    );
}

/// A worker slowed twofold is flagged within 5 s (moved here from `elastic_ops.rs`).
#[test]
fn a_worker_slowed_twofold_is_flagged_within_five_seconds() {
    let run = straggler_run(StragglerPolicy::Ignore, 2);
    eprintln!("2x: {run:?}");
    assert!(
        run.detect_ms < 5_000,
        "a 2x straggler was flagged after {} ms",
        run.detect_ms
    );
}
