//! `edl-bench`: EDL's benchmarks against the physical limits and the transport's own ceiling,
//! measured side by side in one run. Every subcommand prints a table; `--json FILE` writes
//! the results (with the ratios) for scripts; `all` runs everything and regenerates
//! `BENCHMARKS.md` and its plots.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use edl_benches::{apply, control, detect, elastic, load, report, scale, transport, tta};
use edl_shared::proto::Consistency;
use edl_shared::transport::TransportSettings;
use edl_worker::data::DEFAULT_DATA_DIR;
use serde::Serialize;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Benchmarks of EDL: transport, optimizer apply, scaling, elasticity, time to accuracy.
#[derive(Parser, Debug)]
#[command(name = "edl-bench", version)]
struct Cli {
    /// Fewer repetitions: a check that everything runs, not a measurement.
    #[arg(long, global = true)]
    quick: bool,
    /// Also write the results as JSON to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// UDP datagram size for EDL and bare quinn (`default`: path-MTU discovery from 1,200 bytes
    /// up to a 9,000-byte link's, safe on any network; a number: fixed, for loopback or jumbo
    /// frames). Without it, `transport` uses the default and scale, elastic and tta the
    /// loopback size.
    #[arg(long, global = true)]
    datagram: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Push+pull of one tensor (4 KiB..16 MiB) through EDL, bare quinn and TCP.
    Transport {
        /// Only these tensor sizes (e.g. `4K,1M`); default 4K,64K,1M,16M.
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<String>,
        /// Only these clients×shards points (e.g. `1x1,4x1`); default 1x1,2x1,4x1,1x2.
        #[arg(long, value_delimiter = ',')]
        points: Vec<String>,
        /// Only these systems (edl, edl-noopt, quinn, tcp; and bare quinn striped over two
        /// streams or connections: quinn-2streams, quinn-2conns; edl-r2: EDL keeping two copies
        /// of every key range, at points of 2 shards or more); ratios need edl, quinn and tcp.
        #[arg(long, value_delimiter = ',')]
        systems: Vec<String>,
        /// Pairs per point instead of the size's default (longer runs for profiling).
        #[arg(long)]
        pairs: Option<usize>,
        /// Run the servers in a network namespace of their own behind a veth pair (as root),
        /// so that every system crosses a link held to --mtu, with segmentation offloads on
        /// as on a NIC; removed afterwards.
        #[arg(long)]
        netns: bool,
        /// With --netns: the link's MTU (1500: an ordinary network; 9000: jumbo frames).
        #[arg(long, default_value_t = 1500, requires = "netns")]
        mtu: u32,
    },
    /// The server-side optimizers (every torch.optim kind the shards apply) against memcpy of
    /// the same bytes.
    Apply,
    /// Joins and leaves on a running job of synthetic workers: the stall the others see and
    /// the join latency, stop-free and with stop-everything restarts.
    Elastic {
        /// Only stop-free changes (the default runs both modes).
        #[arg(long, conflicts_with = "restart_on_change")]
        stop_free: bool,
        /// Only the stop-everything restarts of `edl-local --restart-on-change`.
        #[arg(long)]
        restart_on_change: bool,
        /// Join-then-leave rounds.
        #[arg(long)]
        rounds: Option<usize>,
    },
    /// Synthetic workers (fixed compute per step) over 1, 2 and 4 shards, dense and sparse:
    /// throughput, scaling efficiency, and the transport ceiling measured alongside.
    Scale {
        /// Only these worker counts (e.g. `1,4,16`); the first is the efficiency baseline.
        #[arg(long, value_delimiter = ',')]
        workers: Vec<usize>,
        /// Only the series over these shard counts (e.g. `1,4`).
        #[arg(long, value_delimiter = ',')]
        shards: Vec<usize>,
        /// Synthetic compute per step, milliseconds.
        #[arg(long)]
        compute_ms: Option<u64>,
        /// Model size (e.g. `1M`, `256K`).
        #[arg(long)]
        model: Option<String>,
        /// Every series under this consistency model, asp or ssp:S (sparse pulls do not close
        /// BSP steps); by default ASP, and one dense series over 2 shards under SSP(2).
        #[arg(long)]
        consistency: Option<Consistency>,
        /// Copies of every key range (2: each push acknowledged once a backup holds it too);
        /// series over fewer shards are skipped. Run once with 1 and once with 2 to see the
        /// price of a copy.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
        replicas: u32,
    },
    /// Time to 0.85 test accuracy on Fashion-MNIST for 1, 2 and 4 workers under ASP, SSP(2)
    /// and BSP (real training on the CPU), or of a job file's model (--job).
    Tta {
        /// Directory with the Fashion-MNIST idx files.
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Train this job file's model (mlp or logreg, e.g. deploy/jobs/agaricus-logreg.toml)
        /// on its data, with its optimizer, batch size and samples, instead of the MLP on
        /// Fashion-MNIST; the flags still choose workers, consistency, wires and epochs.
        #[arg(long, value_name = "FILE", conflicts_with = "data_dir")]
        job: Option<PathBuf>,
        /// Only these worker counts (e.g. `1,4`).
        #[arg(long, value_delimiter = ',')]
        workers: Vec<usize>,
        /// Only these consistency models (e.g. `asp,bsp`).
        #[arg(long, value_delimiter = ',')]
        consistency: Vec<Consistency>,
        /// The test accuracy to reach.
        #[arg(long)]
        target: Option<f64>,
        /// One series per wire (e.g. `f32,bf16,topk:0.01`) [default: f32].
        #[arg(long, value_delimiter = ',')]
        wire: Vec<edl_shared::proto::WireSpec>,
        /// Every socket's uplink limited to this rate in the fault layer (e.g. `1gbit`,
        /// `100mbit`; a 20 ms drop-tail queue); the evaluator's snapshots cross clean links.
        /// With --netns, the veth link is limited instead, by the kernel (tc tbf).
        #[arg(long)]
        rate: Option<edl_shared::faults::Rate>,
        /// Run the servers (and the evaluator) in a network namespace of their own behind a
        /// veth pair of --mtu (as root); the workers cross it. Removed afterwards.
        #[arg(long)]
        netns: bool,
        /// With --netns: the link's MTU.
        #[arg(long, default_value_t = 1500, requires = "netns")]
        mtu: u32,
        /// The server-side optimizer, as edl-local takes it [default: adam:0.001].
        #[arg(long)]
        optimizer: Option<edl_shared::proto::OptimizerSpec>,
        /// Runs per cell, each with its own seed [default: 5; 1 with --quick].
        #[arg(long)]
        repeats: Option<u32>,
        /// Epochs at most [default: 6].
        #[arg(long)]
        max_epochs: Option<u32>,
        /// Milliseconds between snapshots of the parameters, the resolution of the times to
        /// target [default: 100]; a small model's runs are short enough to want less.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        snapshot_ms: Option<u64>,
    },
    /// Many clients (each a registered worker) against a real cluster of `edl-ps` processes
    /// for a set time, optionally beside a hostile client: pushes and pulls per second, their
    /// latency, errors by kind, each server's peak memory, and a check that every
    /// acknowledged push was applied. Fails if one was not.
    Load {
        /// Concurrent clients [default: 64; 4 with --quick].
        #[arg(long)]
        clients: Option<usize>,
        /// How long the clients run, seconds [default: 60; 3 with --quick].
        #[arg(long)]
        seconds: Option<f64>,
        /// Floats of the counter tensor (e.g. `64K`, `1M`) [default: 64K].
        #[arg(long)]
        floats: Option<String>,
        /// Shard servers [default: 2].
        #[arg(long)]
        shards: Option<u32>,
        /// Also run a hostile client: half-sent frames announcing 1 GiB on the shards, and
        /// idle authenticated connections that never say Hello on every server.
        #[arg(long)]
        hostile: bool,
        /// Half-sent frames the hostile client holds [default: 256; 16 with --quick].
        #[arg(long, requires = "hostile")]
        hostile_frames: Option<usize>,
        /// Idle connections the hostile client holds [default: 256; 16 with --quick].
        #[arg(long, requires = "hostile")]
        hostile_idle: Option<usize>,
        /// Where `edl-ps` is [default: next to edl-bench].
        #[arg(long)]
        bin_dir: Option<PathBuf>,
    },
    /// The detectors with real processes (edl-local: 2 shards, 3 workers): false straggler
    /// flags over runs of identical workers (MLP under ASP, SSP(2), BSP and a sparse LR, every
    /// other round beside CPU hogs), time to flag a worker slowed 1.5x, 2x and 3x, and time to
    /// declare a SIGKILLed worker dead (a SIGSTOPped one must not be). Writes its tables to
    /// `OUT/benches/detect.md`, which BENCHMARKS.md includes (updated in place too).
    Detect {
        /// Runs of identical workers [default: 20; 2 with --quick].
        #[arg(long)]
        runs: Option<usize>,
        /// Runs per slowdown factor [default: 3; 1 with --quick].
        #[arg(long)]
        slow_runs: Option<usize>,
        /// Runs that kill a worker and pause another [default: 5; 1 with --quick].
        #[arg(long)]
        death_runs: Option<usize>,
        /// Only these slowdown factors (e.g. `2,3`).
        #[arg(long, value_delimiter = ',')]
        factors: Vec<f64>,
        /// Directory with the Fashion-MNIST idx files.
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Where `edl-ps` and `edl-worker` are [default: next to edl-bench].
        #[arg(long)]
        bin_dir: Option<PathBuf>,
        /// Where BENCHMARKS.md is.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// The coordinator's commits with each durable store (none: no store, as before
    /// durability; wal: the embedded log with fdatasync; etcd) for 1, 4 and 16 concurrent
    /// workers: commits/s, a commit's p50/p99 latency and commits per store write. Writes its
    /// table to `OUT/benches/control.md`, which BENCHMARKS.md includes (updated in place too),
    /// except with --quick.
    Control {
        /// Only these worker counts (e.g. `1,4,16`) [default: 1,4,16; 1,4 with --quick].
        #[arg(long, value_delimiter = ',')]
        workers: Vec<usize>,
        /// Only these stores (none, wal, etcd) [default: all three; etcd only where one is
        /// given or installed].
        #[arg(long, value_delimiter = ',')]
        stores: Vec<control::Store>,
        /// An etcd to keep the state in (`etcd://HOST:PORT,...`); each round's job writes its
        /// own keys (`/edl/edl-bench-control-PID-N/`), left there. Without it, one member is
        /// started on free loopback ports for the run if `etcd` and `etcdctl` are installed.
        #[arg(long)]
        etcd: Option<String>,
        /// Rounds per point, the stores alternating [default: 3; 1 with --quick].
        #[arg(long)]
        rounds: Option<usize>,
        /// The measured window of a round, seconds [default: 2; 0.3 with --quick].
        #[arg(long)]
        seconds: Option<f64>,
        /// Where the coordinator's state (and a started etcd's data) goes: the disk measured
        /// [default: the system's temporary directory].
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Where BENCHMARKS.md is.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// How long the workers pause when the coordinator is killed with SIGKILL: `etcd` (two
    /// coordinators on a 3-member etcd started on loopback, the leader killed and restarted
    /// as a standby) or `wal` (one coordinator restarted on its embedded log), `kills` times;
    /// each kill's time from the SIGKILL to every worker's next commit. Needs `etcd` installed
    /// for `etcd`.
    Failover {
        /// etcd or wal.
        #[arg(long, default_value = "etcd")]
        store: edl_benches::failover::FailStore,
        /// Kills [default: 10; 2 with --quick].
        #[arg(long)]
        kills: Option<usize>,
        /// Workers.
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// The leader's etcd lease (`--leader-ttl`; the coordinator's default).
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// Steady training before each kill.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        gap: std::time::Duration,
        /// Where `edl-ps` is [default: next to edl-bench].
        #[arg(long)]
        bin_dir: Option<PathBuf>,
        /// etcd: restart a killed coordinator at once (a supervisor on its machine; it then
        /// revokes its dead predecessor's lease itself) rather than only after the failover
        /// (its machine lost: the standby finds the leader dead by its probes).
        #[arg(long)]
        restart_at_once: bool,
    },
    /// A replicated job's shard deaths: the workers' pause when a primary is killed, and the
    /// time until every range has its two copies again (real edl-ps processes, 3 shards,
    /// `--replicas 2`).
    Promote {
        /// Kills [default: 10; 2 with --quick].
        #[arg(long)]
        kills: Option<usize>,
        /// Workers.
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// The MLP's layer widths: by default the jobs' default model (235,146 floats);
        /// `4096,4096` is a 64 MiB model.
        #[arg(long, value_delimiter = ',', default_value = "784,256,128,10")]
        layers: Vec<u32>,
        /// Floats per key.
        #[arg(long, default_value_t = edl_shared::jobfile::defaults::CHUNK_SIZE)]
        chunk: u32,
        /// The shards' optimizer, whose state is copied with the parameters (by default the
        /// jobs' default, Adam: two floats of state per parameter).
        #[arg(long, default_value = "adam:0.001")]
        optimizer: String,
        /// Steady training before each kill.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        gap: std::time::Duration,
        /// Where `edl-ps` is [default: next to edl-bench].
        #[arg(long)]
        bin_dir: Option<PathBuf>,
    },
    /// Everything; rewrites BENCHMARKS.md and the plots under `--out`.
    All {
        /// Where BENCHMARKS.md and the plots go.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// Directory with the Fashion-MNIST idx files (for tta).
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
    },
}

fn datagram(arg: &str) -> anyhow::Result<Option<u16>> {
    if arg == "default" {
        return Ok(None);
    }
    let n: u16 = arg
        .parse()
        .with_context(|| format!("--datagram {arg:?}: a size in bytes, or default"))?;
    anyhow::ensure!(
        (1200..=65_527).contains(&n),
        "--datagram {n}: from 1200 to 65527 bytes"
    );
    Ok(Some(n))
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let (n, unit) = s.split_at(s.trim_end_matches(['K', 'M', 'k', 'm']).len());
    let n: usize = n.parse().with_context(|| format!("size {s:?}"))?;
    Ok(match unit {
        "K" | "k" => n << 10,
        "M" | "m" => n << 20,
        _ => n,
    })
}

fn parse_point(s: &str) -> anyhow::Result<(usize, usize)> {
    let (c, sh) = s
        .split_once('x')
        .with_context(|| format!("point {s:?}: CLIENTSxSHARDS"))?;
    Ok((c.parse()?, sh.parse()?))
}

fn write_json<T: Serialize>(path: &Option<PathBuf>, v: &T) -> anyhow::Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_vec_pretty(v)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM, naming it.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    edl_shared::telemetry::init("warn");
    let cli = Cli::parse();
    let chosen = cli.datagram.as_deref().map(datagram).transpose()?;
    // The benchmarks of a whole system run on loopback; transport shows both sizes.
    let settings = TransportSettings::default().with_datagram(chosen.flatten());
    let local = TransportSettings::default()
        .with_datagram(chosen.unwrap_or(Some(report::LOOPBACK_DATAGRAM)));
    match &cli.cmd {
        Cmd::Transport {
            sizes,
            points,
            systems,
            pairs,
            netns,
            mtu,
        } => {
            let mut plan = transport::Plan::standard(cli.quick, settings);
            plan.pairs = *pairs;
            if !sizes.is_empty() {
                plan.sizes = sizes
                    .iter()
                    .map(|s| parse_size(s))
                    .collect::<Result<_, _>>()?;
            }
            if !points.is_empty() {
                plan.points = points
                    .iter()
                    .map(|p| parse_point(p))
                    .collect::<Result<_, _>>()?;
            }
            if !systems.is_empty() {
                let known: Vec<&str> = transport::SYSTEMS
                    .into_iter()
                    .chain(transport::QUINN.map(|(name, _)| name))
                    .chain([transport::REPLICATED])
                    .collect();
                if let Some(bad) = systems.iter().find(|s| !known.contains(&s.as_str())) {
                    anyhow::bail!("unknown system {bad:?}; known: {}", known.join(", "));
                }
                plan.systems = systems.clone();
            }
            // The link and the servers' runtime live until the end of the run, and go however
            // it ends: interrupted too (a namespace would outlive the process).
            let behind = match netns {
                true => {
                    let servers = edl_benches::netns::Servers::start(*mtu, 2)?;
                    plan.side = transport::Side::behind(&servers);
                    println!("servers behind a {}", servers.link().describe());
                    Some(servers)
                }
                false => None,
            };
            let r = tokio::select! {
                r = transport::run(&plan) => r,
                why = interrupted() => Err(anyhow::anyhow!("interrupted by {why}")),
            };
            drop(behind);
            let r = r?;
            println!("{}", report::transport_table(&r));
            for line in transport::replication_costs(&r.rows) {
                println!("{line}");
            }
            write_json(&cli.json, &r)?;
        }
        Cmd::Scale {
            workers,
            shards,
            compute_ms,
            model,
            consistency,
            replicas,
        } => {
            let mut plan = scale::Plan::standard(cli.quick, local);
            plan.replicas = *replicas;
            plan.series.retain(|s| s.shards >= *replicas as usize);
            if !workers.is_empty() {
                plan.workers = workers.clone();
            }
            if !shards.is_empty() {
                plan.series.retain(|s| shards.contains(&s.shards));
            }
            if let Some(ms) = compute_ms {
                plan.compute = std::time::Duration::from_millis(*ms);
            }
            if let Some(m) = model {
                plan.model_bytes = parse_size(m)?;
            }
            if let Some(c) = consistency {
                anyhow::ensure!(
                    *c != Consistency::Bsp,
                    "--consistency bsp: sparse pulls would never close a BSP step"
                );
                let mut seen = Vec::new();
                plan.series.retain_mut(|s| {
                    s.consistency = *c;
                    let new = !seen.contains(s);
                    seen.push(*s);
                    new
                });
            }
            let r = scale::run(&plan).await?;
            if plan.replicas > 1 {
                println!("{} copies of every key range", plan.replicas);
            }
            println!("{}", report::scale_table(&r));
            write_json(&cli.json, &r)?;
        }
        Cmd::Elastic {
            stop_free,
            restart_on_change,
            rounds,
        } => {
            let mut plan = elastic::Plan::standard(cli.quick, local);
            if *stop_free {
                plan.modes = vec![elastic::Membership::StopFree];
            }
            if *restart_on_change {
                plan.modes = vec![elastic::Membership::Restart];
            }
            if let Some(r) = rounds {
                plan.rounds = *r;
            }
            let r = elastic::run(&plan).await?;
            println!("{}", report::elastic_table(&r));
            write_json(&cli.json, &r)?;
        }
        Cmd::Tta {
            data_dir,
            job,
            workers,
            consistency,
            target,
            wire,
            rate,
            netns,
            mtu,
            optimizer,
            repeats,
            max_epochs,
            snapshot_ms,
        } => {
            let mut plan = tta::Plan::standard(cli.quick, local);
            plan.data_dir = data_dir.clone();
            if let Some(file) = job {
                plan.with_job(edl_shared::jobfile::load(file)?);
            }
            if !workers.is_empty() {
                plan.workers = workers.clone();
            }
            if !consistency.is_empty() {
                plan.modes = consistency.clone();
            }
            if let Some(t) = target {
                plan.target = *t;
            }
            if !wire.is_empty() {
                plan.wires = wire.clone();
            }
            let bits = *rate;
            // Held until the runs are over: dropped, the link is removed.
            let mut servers = None;
            if *netns {
                // A real link's datagrams: what --datagram says, or path-MTU discovery.
                plan.settings = settings.clone();
                let s = edl_benches::netns::Servers::start(*mtu, 2)?;
                let mut link = s.link().describe();
                if let Some(r) = bits {
                    s.link().limit(r.bits_per_s)?;
                    link = format!("{link}, each way at {r} (tc tbf)");
                }
                plan.side = transport::Side::behind(&s);
                plan.link = Some(link);
                servers = Some(s);
            } else if let Some(r) = bits {
                plan.limit(r.bits_per_s);
            }
            if let Some(o) = optimizer {
                plan.optimizer = o.clone();
            }
            if let Some(n) = repeats {
                plan.repeats = *n;
            }
            if let Some(n) = max_epochs {
                plan.max_epochs = *n;
            }
            if let Some(ms) = snapshot_ms {
                plan.snapshot_every = std::time::Duration::from_millis(*ms);
            }
            let r = tta::run(&plan).await?;
            drop(servers);
            println!("{}", report::tta_table(&r));
            write_json(&cli.json, &r)?;
        }
        Cmd::Load {
            clients,
            seconds,
            floats,
            shards,
            hostile,
            hostile_frames,
            hostile_idle,
            bin_dir,
        } => {
            let mut plan = load::Plan::standard(cli.quick, *hostile, local);
            if let Some(n) = clients {
                plan.clients = *n;
            }
            if let Some(s) = seconds {
                anyhow::ensure!(s.is_finite() && *s > 0.0, "--seconds {s}: more than 0");
                plan.duration = std::time::Duration::from_secs_f64(*s);
            }
            if let Some(f) = floats {
                plan.spec.floats = u32::try_from(parse_size(f)?)
                    .with_context(|| format!("--floats {f}: too many"))?;
            }
            if let Some(n) = shards {
                plan.spec.shards = *n;
            }
            if let Some(h) = plan.hostile.as_mut() {
                h.frames = hostile_frames.unwrap_or(h.frames);
                h.idle = hostile_idle.unwrap_or(h.idle);
            }
            plan.spec.bin_dir = bin_dir.clone();
            let r = load::run(&plan).await?;
            println!("{}", report::load_table(&r));
            write_json(&cli.json, &r)?;
            let failures = r.failures();
            anyhow::ensure!(failures.is_empty(), "{}", failures.join("; "));
        }
        Cmd::Detect {
            runs,
            slow_runs,
            death_runs,
            factors,
            data_dir,
            bin_dir,
            out,
        } => {
            let mut plan = detect::Plan::standard(cli.quick, data_dir.clone());
            plan.runs = runs.unwrap_or(plan.runs);
            plan.slow_runs = slow_runs.unwrap_or(plan.slow_runs);
            plan.death_runs = death_runs.unwrap_or(plan.death_runs);
            if !factors.is_empty() {
                plan.factors = factors.clone();
            }
            plan.bin_dir = bin_dir.clone();
            let started = std::time::Instant::now();
            let r = detect::run(&plan).await?;
            let table = detect::table(&r);
            println!("{table}");
            write_json(&cli.json, &r)?;
            report::write_detect(&table, started.elapsed().as_secs_f64(), out)?;
            println!(
                "wrote {} and updated {}",
                out.join(report::DETECT).display(),
                out.join("BENCHMARKS.md").display()
            );
        }
        Cmd::Control {
            workers,
            stores,
            etcd,
            rounds,
            seconds,
            dir,
            out,
        } => {
            let mut plan = control::Plan::standard(cli.quick, local);
            if !workers.is_empty() {
                plan.workers = workers.clone();
            }
            if !stores.is_empty() {
                plan.stores = control::Store::ALL
                    .into_iter()
                    .filter(|s| stores.contains(s))
                    .collect();
            }
            plan.etcd = etcd.clone();
            plan.rounds = rounds.unwrap_or(plan.rounds);
            if let Some(s) = seconds {
                anyhow::ensure!(s.is_finite() && *s > 0.0, "--seconds {s}: more than 0");
                plan.window = std::time::Duration::from_secs_f64(*s);
            }
            plan.dir = dir.clone();
            let r = control::run(&plan).await?;
            println!("{}", report::control_table(&r));
            println!("{}", report::control_summary(&r));
            write_json(&cli.json, &r)?;
            if !cli.quick {
                report::write_control(&r, out)?;
                println!(
                    "wrote {} and updated {}",
                    out.join(report::CONTROL).display(),
                    out.join("BENCHMARKS.md").display()
                );
            }
        }
        Cmd::Failover {
            store,
            kills,
            workers,
            ttl,
            gap,
            bin_dir,
            restart_at_once,
        } => {
            let plan = edl_benches::failover::Plan {
                store: *store,
                kills: kills.unwrap_or(if cli.quick { 2 } else { 10 }),
                workers: *workers,
                ttl: *ttl,
                gap: *gap,
                bin_dir: bin_dir.clone(),
                restart_at_once: *restart_at_once,
            };
            let r = edl_benches::failover::run(&plan).await?;
            println!("{}", edl_benches::failover::table(&r));
            write_json(&cli.json, &r)?;
        }
        Cmd::Promote {
            kills,
            workers,
            layers,
            chunk,
            optimizer,
            gap,
            bin_dir,
        } => {
            let plan = edl_benches::promote::Plan {
                kills: kills.unwrap_or(if cli.quick { 2 } else { 10 }),
                workers: *workers,
                layers: layers.clone(),
                chunk: *chunk,
                optimizer: optimizer.clone(),
                gap: *gap,
                bin_dir: bin_dir.clone(),
            };
            let r = edl_benches::promote::run(&plan).await?;
            println!("{}", edl_benches::promote::table(&r));
            write_json(&cli.json, &r)?;
        }
        Cmd::Apply => {
            let rows = apply_run(cli.quick);
            println!("{}", report::apply_table(&rows));
            write_json(&cli.json, &rows)?;
        }
        Cmd::All { out, data_dir } => {
            let started = std::time::Instant::now();
            let stage = |name: &str| {
                eprintln!(
                    "edl-bench all: {name} ({:.0} s in)",
                    started.elapsed().as_secs_f64()
                );
            };
            stage("transport");
            let transport_default = transport::run(&transport::Plan::standard(
                cli.quick,
                settings.clone().with_datagram(None),
            ))
            .await?;
            let transport_loopback = transport::run(&transport::Plan::standard(
                cli.quick,
                settings.with_datagram(Some(report::LOOPBACK_DATAGRAM)),
            ))
            .await?;
            stage("apply");
            let apply = apply_run(cli.quick);
            stage("scale");
            let scale = scale::run(&scale::Plan::standard(cli.quick, local.clone())).await?;
            stage("elastic");
            let elastic = elastic::run(&elastic::Plan::standard(cli.quick, local.clone())).await?;
            stage("tta");
            let mut tta_plan = tta::Plan::standard(cli.quick, local);
            tta_plan.data_dir = data_dir.clone();
            let tta = tta::run(&tta_plan).await?;
            stage("done");
            let all = report::All {
                machine: report::machine(),
                seconds: started.elapsed().as_secs_f64(),
                transport_default,
                transport_loopback,
                apply,
                scale,
                elastic,
                tta,
            };
            report::write_markdown(&all, out)?;
            write_json(&cli.json, &all)?;
            println!("wrote {}", out.join("BENCHMARKS.md").display());
        }
    }
    Ok(())
}

fn apply_run(quick: bool) -> Vec<apply::Row> {
    // 16 Mi floats: 64 MiB of parameters and 64 of gradients, well past the 32 MiB L3 of the
    // machines we measure on, so that neither side runs from cache.
    let (floats, reps) = if quick { (1 << 20, 3) } else { (16 << 20, 10) };
    apply::run(floats, reps)
}
