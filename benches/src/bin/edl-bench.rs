//! `edl-bench`: EDL's benchmarks against the physical limits and the transport's own ceiling,
//! measured side by side in one run. Every subcommand prints a table; `--json FILE` writes
//! the results (with the ratios) for scripts; `all` runs everything and regenerates
//! `BENCHMARKS.md` and its plots.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use edl_benches::{apply, report, transport};
use edl_shared::transport::TransportSettings;
use serde::Serialize;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Benchmarks of EDL: transport, optimizer apply, scaling, elasticity, time to accuracy.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Fewer repetitions: a check that everything runs, not a measurement.
    #[arg(long, global = true)]
    quick: bool,
    /// Also write the results as JSON to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// UDP datagram size for EDL and bare quinn (`default`: QUIC's 1200 bytes with path
    /// probing, safe on any network; a number: fixed, for loopback or jumbo frames).
    #[arg(long, global = true, default_value = "default")]
    datagram: String,
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
        /// Only these systems (edl, quinn, tcp); ratios need all three.
        #[arg(long, value_delimiter = ',')]
        systems: Vec<String>,
    },
    /// Server-side SGD, momentum and Adam against memcpy of the same bytes.
    Apply,
    /// Everything; rewrites BENCHMARKS.md and the plots under `--out`.
    All {
        /// Where BENCHMARKS.md and the plots go.
        #[arg(long, default_value = ".")]
        out: PathBuf,
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    edl_shared::telemetry::init("warn");
    let cli = Cli::parse();
    let settings = TransportSettings::default().with_datagram(datagram(&cli.datagram)?);
    match &cli.cmd {
        Cmd::Transport {
            sizes,
            points,
            systems,
        } => {
            let mut plan = transport::Plan::standard(cli.quick, settings);
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
                plan.systems = systems.clone();
            }
            let r = transport::run(&plan).await?;
            println!("{}", report::transport_table(&r));
            write_json(&cli.json, &r)?;
        }
        Cmd::Apply => {
            let rows = apply_run(cli.quick);
            println!("{}", report::apply_table(&rows));
            write_json(&cli.json, &rows)?;
        }
        Cmd::All { out } => {
            let all = report::All {
                machine: report::machine(),
                transport_default: transport::run(&transport::Plan::standard(
                    cli.quick,
                    settings.clone().with_datagram(None),
                ))
                .await?,
                transport_loopback: transport::run(&transport::Plan::standard(
                    cli.quick,
                    settings.with_datagram(Some(report::LOOPBACK_DATAGRAM)),
                ))
                .await?,
                apply: apply_run(cli.quick),
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
