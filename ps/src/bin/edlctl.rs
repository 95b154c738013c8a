//! `edlctl`: the operator's view of a running EDL job, over the same authenticated QUIC as
//! everything else (admin role). Tables by default, `--json` for scripts.

use anyhow::Context;
use clap::{Parser, Subcommand};
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use edl_ps::admin::{self, Admin, ShardRow, StatusView, WorkerRow};
use edl_shared::cli::IdentityArgs;
use edl_shared::transport::TransportSettings;
use edl_shared::{Role, telemetry};
use serde::Serialize;

/// Inspect and steer a running EDL job.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// The coordinator's address.
    #[arg(long, env = "EDL_COORDINATOR", default_value = "127.0.0.1:7070")]
    coordinator: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Certificate name to use (an admin certificate `admin/NAME` from the state directory).
    #[arg(long, default_value = "edlctl")]
    name: String,
    #[command(flatten)]
    identity: IdentityArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The job: model, optimizer, consistency, clocks, progress, throughput.
    Status,
    /// Every worker: id, address, state, clock, steps/s, last heartbeat.
    Workers,
    /// Every shard: address, key ranges, bytes held, load.
    Shards,
    /// Ask a worker to leave after its current step (by id, or by the name of one active
    /// worker); its data goes back to the pool.
    Drain {
        /// Worker id or name.
        worker: String,
    },
    /// Make every shard write a checkpoint now (parameters, optimizer state, data ledger).
    Checkpoint,
    /// Add or remove a shard server while the job runs.
    Shard {
        #[command(subcommand)]
        cmd: ShardCmd,
    },
    /// Rebalance the key ranges over the active shards while the job runs.
    Reshard {
        /// Balance by parameter bytes (`size`) or by traffic since the last rebalance (`load`).
        #[arg(long, default_value = "size", value_parser = ["size", "load"])]
        by: String,
    },
    /// Move a key range to a shard while the job runs.
    Move {
        /// Keys `START..END` (end excluded).
        range: String,
        /// The shard that takes them: its name (as given with `edl-ps shard --name`), or its
        /// address. A standby shard may take them.
        #[arg(long)]
        to: String,
    },
}

#[derive(Subcommand, Debug)]
enum ShardCmd {
    /// Give a shard server that joined (and stands by) its share of the keys. Start it first
    /// with `edl-ps shard --coordinator ...`.
    Add {
        /// The shard's name (as given with `edl-ps shard --name`), or its advertised address.
        addr: String,
    },
    /// Move every key off a shard, then retire it (the process exits).
    Remove {
        /// The shard's name (as given with `edl-ps shard --name`), or its address.
        shard: String,
    },
}

fn print_reshard(v: &admin::ReshardView, json: bool) -> anyhow::Result<()> {
    if json {
        return print_json(v);
    }
    if v.moves.is_empty() {
        println!("nothing to move");
    } else {
        let mut t = table(&["keys", "from", "to", "state", "held", "took", "map"]);
        for m in &v.moves {
            t.add_row(vec![
                m.range.clone(),
                format!("s{}", m.from),
                format!("s{}", m.to),
                admin::human_bytes(m.bytes),
                format!("{:.1} ms", m.hold_ms),
                format!("{:.1} ms", m.millis),
                format!("e{}", m.epoch),
            ]);
        }
        println!("{t}");
    }
    let mut t = table(&["shard", "key ranges"]);
    for (id, ranges) in &v.layout {
        t.add_row(vec![format!("s{id}"), ranges.join(", ")]);
    }
    println!("shard map e{}:\n{t}", v.epoch);
    Ok(())
}

fn print_json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(header.to_vec());
    t
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    telemetry::init("warn");
    let cli = Cli::parse();
    let identity = cli.identity.identity(Role::Admin, &cli.name)?;
    let admin = Admin::connect(&cli.coordinator, &identity, TransportSettings::default())
        .await
        .with_context(|| format!("connecting to the coordinator at {}", cli.coordinator))?;
    match cli.cmd {
        Cmd::Status => {
            let (job, st, members) = (
                admin.job().await?,
                admin.status().await?,
                admin.members().await?,
            );
            let v = StatusView::new(&job, &st, &members);
            if cli.json {
                return print_json(&v);
            }
            let mut t = table(&["", ""]);
            t.add_row(vec!["model".to_string(), v.model.clone()]);
            t.add_row(vec!["optimizer".to_string(), v.optimizer.clone()]);
            t.add_row(vec!["consistency".to_string(), v.consistency.clone()]);
            t.add_row(vec![
                "epochs × batch".to_string(),
                format!("{} × {}", v.epochs, v.batch_size),
            ]);
            t.add_row(vec![
                "shards".to_string(),
                format!("{}/{}", v.shards.0, v.shards.1),
            ]);
            t.add_row(vec![
                "active workers".to_string(),
                v.active_workers.to_string(),
            ]);
            t.add_row(vec![
                "clocks (min..max)".to_string(),
                format!("{}..{}", v.min_clock, v.max_clock),
            ]);
            t.add_row(vec![
                "samples".to_string(),
                format!(
                    "{} / {} ({:.1}%)",
                    v.samples.0,
                    v.samples.1,
                    100.0 * v.samples.0 as f64 / v.samples.1.max(1) as f64
                ),
            ]);
            t.add_row(vec![
                "throughput".to_string(),
                format!("{:.0} samples/s", v.samples_per_s),
            ]);
            t.add_row(vec!["finished".to_string(), v.finished.to_string()]);
            println!("{t}");
        }
        Cmd::Workers => {
            let rows: Vec<WorkerRow> = admin.members().await?.iter().map(WorkerRow::from).collect();
            if cli.json {
                return print_json(&rows);
            }
            let mut t = table(&[
                "id",
                "name",
                "address",
                "state",
                "clock",
                "steps/s",
                "samples",
                "last heartbeat",
            ]);
            for r in &rows {
                t.add_row(vec![
                    r.id.to_string(),
                    r.name.clone(),
                    r.addr.clone(),
                    r.state.clone(),
                    r.clock.to_string(),
                    format!("{:.1}", r.steps_per_s),
                    r.samples.to_string(),
                    format!("{:.1} s ago", r.last_heartbeat_ms as f64 / 1000.0),
                ]);
            }
            println!("{t}");
        }
        Cmd::Shards => {
            let rows = admin.shard_stats().await?;
            if cli.json {
                #[derive(Serialize)]
                struct Row<'a> {
                    #[serde(flatten)]
                    shard: &'a ShardRow,
                    error: &'a Option<String>,
                }
                let v: Vec<Row<'_>> = rows
                    .iter()
                    .map(|(shard, error)| Row { shard, error })
                    .collect();
                return print_json(&v);
            }
            let mut t = table(&[
                "id",
                "name",
                "address",
                "role",
                "key ranges",
                "keys",
                "bytes",
                "pushes",
                "pulls",
                "traffic",
            ]);
            for (r, err) in &rows {
                match err {
                    Some(e) => t.add_row(vec![
                        format!("s{}", r.id),
                        r.name.clone(),
                        r.addr.clone(),
                        r.role.clone(),
                        format!("unreachable: {e}"),
                    ]),
                    None if r.role == "retired" => t.add_row(vec![
                        format!("s{}", r.id),
                        r.name.clone(),
                        r.addr.clone(),
                        r.role.clone(),
                    ]),
                    None => t.add_row(vec![
                        format!("s{}", r.id),
                        r.name.clone(),
                        r.addr.clone(),
                        r.role.clone(),
                        r.ranges.join(", "),
                        r.keys.to_string(),
                        admin::human_bytes(r.bytes),
                        r.pushes.to_string(),
                        r.pulls.to_string(),
                        admin::human_bytes(r.traffic_bytes),
                    ]),
                };
            }
            println!("{t}");
            if rows.iter().any(|(_, e)| e.is_some()) {
                anyhow::bail!("some shards could not be reached");
            }
        }
        Cmd::Checkpoint => {
            let rows = admin.checkpoint_all().await?;
            if cli.json {
                print_json(&rows)?;
            } else {
                let mut t = table(&["shard", "path", "bytes", "time"]);
                for r in &rows {
                    match &r.error {
                        Some(e) => t.add_row(vec![r.shard.to_string(), format!("failed: {e}")]),
                        None => t.add_row(vec![
                            r.shard.to_string(),
                            r.path.clone(),
                            admin::human_bytes(r.bytes),
                            format!("{:.1} ms", r.millis),
                        ]),
                    };
                }
                println!("{t}");
            }
            if rows.iter().any(|r| r.error.is_some()) {
                anyhow::bail!("some shards did not write a checkpoint");
            }
        }
        Cmd::Shard {
            cmd: ShardCmd::Add { addr },
        } => {
            let v = admin
                .shard_add(&addr)
                .await
                .with_context(|| format!("adding shard {addr}"))?;
            print_reshard(&v, cli.json)?;
        }
        Cmd::Shard {
            cmd: ShardCmd::Remove { shard },
        } => {
            let v = admin
                .shard_remove(&shard)
                .await
                .with_context(|| format!("removing shard {shard}"))?;
            print_reshard(&v, cli.json)?;
        }
        Cmd::Reshard { by } => {
            let v = admin
                .reshard(by == "load")
                .await
                .context("rebalancing the shards")?;
            print_reshard(&v, cli.json)?;
        }
        Cmd::Move { range, to } => {
            let (start, end) = admin::parse_range(&range).map_err(anyhow::Error::msg)?;
            let v = admin
                .move_range(start, end, &to)
                .await
                .with_context(|| format!("moving keys {start}..{end} to {to}"))?;
            print_reshard(&v, cli.json)?;
        }
        Cmd::Drain { worker } => {
            let members = admin.members().await?;
            let id = admin::resolve_worker(&members, &worker).map_err(anyhow::Error::msg)?;
            admin
                .drain(id)
                .await
                .with_context(|| format!("draining worker {}", id.0))?;
            if cli.json {
                return print_json(&serde_json::json!({ "drained": id.0 }));
            }
            println!(
                "worker {} ({worker}) will leave after its current step",
                id.0
            );
        }
    }
    Ok(())
}
