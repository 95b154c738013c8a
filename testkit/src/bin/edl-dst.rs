//! `edl-dst`: deterministic simulation runs of a job (see `edl_testkit::dst`). One seed, with
//! its digest to compare runs, or a range of seeds, stopping at the first that fails with the
//! command that replays it.

use std::ops::RangeInclusive;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use edl_testkit::dst;

/// Runs seeded simulations of a job (workers joining, draining and crashing, ranges moving,
/// shards and the coordinator crashing and restarting, over a network that delays, reorders,
/// loses, duplicates and filters messages and partitions nodes; with --replicas, copies of
/// every range, backups promoted and seeded, and shards crashing at every step of a push's
/// replication) and checks the consistency model, exactly-once data, float-exact counters on
/// every copy, map epochs and that the job finishes.
#[derive(Parser, Debug)]
#[command(name = "edl-dst", version)]
struct Cli {
    /// Run this seed.
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run these seeds, A..B (both included).
    #[arg(long, value_name = "A..B", value_parser = parse_range, default_value = "1..200")]
    seeds: RangeInclusive<u64>,
    /// With --seed: print the digest of the run's history (the same seed gives the same one).
    #[arg(long)]
    digest: bool,
    /// With --seed: print every event of the run (of a failed one, not only the last 40).
    #[arg(long)]
    verbose: bool,
    /// Workers give up on a coordinator call whose connection failed and exit, as a client
    /// with a short TransportSettings::reconnect limit does, instead of repeating it on a new
    /// connection until the coordinator answers (the client's default).
    #[arg(long)]
    give_up: bool,
    /// Let coordinator and shard crashes fall in the middle of a range move, and partitions
    /// lose a shard's answer to the coordinator (a shard crashing during its own hand-off is
    /// known to fail: see docs/src/simulation.md).
    #[arg(long)]
    mid_move: bool,
    /// The workers are the real client library (its Session in the trainer's loop) over
    /// in-process connections, instead of the simulation's model of it.
    #[arg(long, conflicts_with = "give_up")]
    clients: bool,
    /// Coordinator crashes are failovers as with etcd: the leader is cut off, not killed (its
    /// tasks run on, its late calls reach the shards) and a standby restored from the store
    /// leads at the next term; the old leader's writes and orders are refused.
    #[arg(long)]
    failover: bool,
    /// Keep this many copies of every key range (at most the seed's shards): the coordinator
    /// watches the shards and promotes backups, and shards crash at every step of a push's
    /// replication and of a new backup's seeding.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    replicas: u32,
}

fn parse_range(s: &str) -> Result<RangeInclusive<u64>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?} is not A..B"))?;
    let a: u64 = a.parse().map_err(|_| format!("bad seed {a:?}"))?;
    let b: u64 = b
        .trim_start_matches('=')
        .parse()
        .map_err(|_| format!("bad seed {b:?}"))?;
    if a > b {
        return Err(format!("{s:?} is empty"));
    }
    Ok(a..=b)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(seed) = cli.seed {
        let options = dst::Options {
            verbose: cli.verbose,
            give_up: cli.give_up,
            mid_move: cli.mid_move,
            clients: cli.clients,
            failover: cli.failover,
            replicas: cli.replicas,
            ..dst::Options::default()
        };
        return match dst::run(seed, options) {
            Ok(report) => {
                for line in &report.log {
                    println!("{line}");
                }
                println!("{report}");
                if cli.digest {
                    println!("digest {:016x}", report.digest);
                }
                ExitCode::SUCCESS
            }
            Err(failure) => {
                eprintln!("{failure}");
                ExitCode::FAILURE
            }
        };
    }
    let started = Instant::now();
    let (mut events, mut virtual_ms) = (0u64, 0u64);
    for seed in cli.seeds.clone() {
        let options = dst::Options {
            verbose: false,
            give_up: cli.give_up,
            mid_move: cli.mid_move,
            clients: cli.clients,
            failover: cli.failover,
            replicas: cli.replicas,
            ..dst::Options::default()
        };
        match dst::run(seed, options) {
            Ok(r) => {
                events += r.events;
                virtual_ms += r.virtual_ms;
            }
            Err(failure) => {
                eprintln!("{failure}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "seeds {}..{}: all passed in {:.1} s ({events} events, {:.0} s of virtual time)",
        cli.seeds.start(),
        cli.seeds.end(),
        started.elapsed().as_secs_f64(),
        virtual_ms as f64 / 1000.0
    );
    ExitCode::SUCCESS
}
