use anyhow::Context;
use clap::{Parser, Subcommand};
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use edl_ps::admin::{self, Admin, CoordinatorRole, ShardRow, StatusView, WorkerRow};
use edl_ps::cluster::{JobRow, SlotRow};
use edl_shared::cli::{IdentityArgs, ms};
use edl_shared::proto::msg::WorkerState;
use edl_shared::transport::TransportSettings;
use edl_shared::{Role, telemetry};
use serde::Serialize;

mod coord;
mod sched;
mod tables;

use coord::*;
use sched::*;
use tables::*;

/// Inspect and steer a running EDL job.
#[derive(Parser, Debug)]
#[command(name = "edlctl", version)]
struct Cli {
    #[command(flatten)]
    to: Reach,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Whom edlctl asks, and as whom.
#[derive(clap::Args, Debug)]
struct Reach {
    /// The coordinator's address; with several coordinators of a job (`edl-ps coordinator
    /// --meta`), all of them separated by commas: requests go to whichever leads, and
    /// `status` shows which leads and which stand by. [default: the address in
    /// STATE_DIR/coordinator.addr (a local run's), else 127.0.0.1:7070]
    #[arg(long, env = "EDL_COORDINATOR")]
    coordinator: Option<String>,
    /// The cluster scheduler's address (`edl-sched`), for `job` and `slots`.
    #[arg(long, env = "EDL_SCHEDULER", default_value = "127.0.0.1:7080")]
    scheduler: String,
    /// Certificate name to use (an admin certificate `admin/NAME` from the state directory).
    #[arg(long, default_value = "edlctl")]
    name: String,
    /// How long to keep trying to reach the coordinator (or the scheduler): one just started
    /// may not have written its certificate or its address yet, e.g. `edlctl --state-dir S
    /// --connect-timeout 60s status` after `edl-local --state-dir S &`. [default: one try]
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    connect_timeout: Option<std::time::Duration>,
    #[command(flatten)]
    identity: IdentityArgs,
}

/// What edlctl talks to.
#[derive(Clone, Copy)]
enum Peer {
    Coordinator,
    Scheduler,
}

impl Reach {
    /// Connects to `peer` as the admin the command line names: its identity, its address
    /// (a coordinator's may come from the state directory) and the connection, tried again
    /// every quarter second until `--connect-timeout` runs out. The address is returned too.
    async fn reach(&self, peer: Peer) -> anyhow::Result<(Admin, String)> {
        let limit = self.connect_timeout.unwrap_or_default();
        let started = std::time::Instant::now();
        let mut said = false;
        loop {
            let tried = self.try_reach(peer).await;
            match tried {
                Ok(reached) => return Ok(reached),
                Err(e) if started.elapsed() >= limit => {
                    return Err(if limit.is_zero() {
                        e
                    } else {
                        e.context(format!(
                            "gave up after {} (--connect-timeout)",
                            humantime::format_duration(limit)
                        ))
                    });
                }
                Err(e) => {
                    if !said {
                        eprintln!(
                            "edlctl: not reached yet ({e:#}); trying again for up to {}",
                            humantime::format_duration(limit)
                        );
                        said = true;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
            }
        }
    }

    async fn try_reach(&self, peer: Peer) -> anyhow::Result<(Admin, String)> {
        let (addr, what) = match peer {
            Peer::Coordinator => (
                self.identity.coordinator(self.coordinator.as_deref()),
                "the coordinator",
            ),
            Peer::Scheduler => (self.scheduler.clone(), "the scheduler (--scheduler)"),
        };
        // A malformed address is answered before a certificate is issued for nothing.
        edl_shared::leader::Coordinators::parse(&addr).map_err(anyhow::Error::msg)?;
        let identity = self.identity.identity(Role::Admin, &self.name)?;
        let admin = Admin::connect(&addr, &identity, TransportSettings::default())
            .await
            .with_context(|| format!("connecting to {what} at {addr}"))?;
        Ok((admin, addr))
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The job: model, optimizer, consistency, clocks, progress, throughput, training loss,
    /// the latest evaluation's accuracy, and the time left at the current rate.
    Status,
    /// `status` and the active workers, refreshed until the job finishes (Ctrl-C ends).
    Watch {
        /// How often to refresh.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        every: std::time::Duration,
    },
    /// Every worker: id, address, state, clock, steps/s, last heartbeat.
    Workers,
    /// Every shard: address, role, key ranges, bytes held, load. Exits 1 if a shard could
    /// not be reached (a standby shard waiting for the shard map to form is not unreachable).
    Shards,
    /// Ask a worker to leave after its current step (by id, or by the name of one active
    /// worker); its data goes back to the pool.
    Drain {
        /// Worker id or name.
        worker: String,
    },
    /// Make every shard write a checkpoint now (parameters, optimizer state, data ledger).
    Checkpoint,
    /// Show or change how stragglers and stalled workers are found and handled (flags left
    /// out keep their value).
    Stragglers(StragglersArgs),
    /// Give a worker a preemption notice (as a spot instance gets): it finishes its step,
    /// commits and leaves before the notice runs out, abandoning the step if it cannot
    /// finish in time. Under policy `replace` a substitute is started at once.
    Preempt {
        /// Worker id or name.
        worker: String,
        /// Time until the worker must be gone, e.g. 30s, 500ms, 2m.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        notice: std::time::Duration,
    },
    /// Move a worker: a new one is started (through the placer, e.g. edl-local) and admitted,
    /// then the old one drained; the job never runs below its worker count.
    Migrate {
        /// Worker id or name.
        worker: String,
        /// Where to start the new worker, in the placer's slot names (edl-local: slot0,
        /// slot1, ...).
        #[arg(long)]
        to: Option<String>,
        /// How long to wait for the new worker to be admitted.
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
    },
    /// Grow or shrink the job to N workers, stop-free: placements for new workers (a placer
    /// such as edl-local starts them), drains (newest first) for extra ones. 0 suspends the
    /// job: every worker drains and the servers keep its state until it is scaled up.
    Scale {
        /// The worker count wanted.
        workers: u32,
    },
    /// The placement requests (workers the coordinator asked a placer to start) and their
    /// outcome.
    Placements,
    /// Measure the job's scaling curve: resize it stop-free through the given worker counts,
    /// measure steady-state samples/s at each after a warm-up, print the curve and the
    /// suggested size (the knee), and resize back. Needs a placer (e.g. edl-local) and enough
    /// data left to train through every size.
    Profile(ProfileArgs),
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
    /// Jobs on the cluster scheduler (`edl-sched`, at --scheduler): submit, list, show,
    /// cancel.
    Job {
        #[command(subcommand)]
        cmd: JobCmd,
    },
    /// The cluster scheduler's worker slots and who holds each.
    Slots,
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

// The flags of `edlctl stragglers` (the variant's doc is the command's help).
#[derive(clap::Args, Debug)]
struct StragglersArgs {
    /// ignore (flag only), drop (drain the straggler) or replace (start a replacement
    /// through the placer, then drain the straggler).
    #[arg(long)]
    policy: Option<edl_shared::proto::StragglerPolicy>,
    /// A worker is a straggler past this many times the others' median step time.
    #[arg(long)]
    factor: Option<f32>,
    /// The stretch of time a worker's steps are judged over (e.g. 1500ms).
    #[arg(long, value_parser = humantime::parse_duration)]
    window: Option<std::time::Duration>,
    /// How much a straggler's median must also exceed the others' (e.g. 2ms).
    #[arg(long, value_parser = humantime::parse_duration)]
    min_gap: Option<std::time::Duration>,
    /// How long after its admission a worker is first judged (e.g. 2s).
    #[arg(long, value_parser = humantime::parse_duration)]
    warmup: Option<std::time::Duration>,
    /// Report a worker holding the others up (SSP, BSP) without a step this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    stall_report: Option<std::time::Duration>,
    /// Drop a worker that held the others up this long (a duration, or `never`).
    #[arg(long)]
    stall_drop: Option<edl_shared::cli::Never>,
}

// The flags of `edlctl profile` (the variant's doc is the command's help).
#[derive(clap::Args, Debug)]
struct ProfileArgs {
    /// The worker counts to visit, in order.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    workers: Vec<u32>,
    /// Seconds measured at each size.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Seconds of warm-up at each size before measuring.
    #[arg(long, default_value_t = 5.0)]
    warmup: f64,
    /// The knee: the last size before one where each added worker buys less than this
    /// fraction of a worker's share at the size before.
    #[arg(long, default_value_t = 0.5)]
    min_gain: f64,
    /// Write the curve as JSON here.
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
    /// Draw the curve as a PNG here.
    #[arg(long, value_name = "FILE")]
    png: Option<std::path::PathBuf>,
}

#[derive(Subcommand, Debug)]
enum JobCmd {
    /// Submit a job file (as `edl-ps coordinator --job` reads it). The scheduler starts its
    /// coordinator, shards and workers when the policy gives it slots, and resizes it
    /// stop-free. You own it: your certificate's name is its owner.
    Submit {
        /// The job file (TOML). It is checked here first; relative data paths resolve against
        /// its directory.
        file: std::path::PathBuf,
        /// The job's name (default: the scheduler names it jN).
        #[arg(long = "job")]
        job: Option<String>,
        /// Workers asked for: what a non-elastic policy gives it.
        #[arg(long, default_value_t = 2)]
        workers: u32,
        /// Fewest workers (elastic policies shrink it no further); default a quarter of
        /// --workers, at least 1.
        #[arg(long)]
        min: Option<u32>,
        /// Most workers (elastic policies grow it no further); default twice --workers.
        #[arg(long)]
        max: Option<u32>,
        /// Higher runs first; ties go by arrival.
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        priority: i32,
    },
    /// Every job: state, slots, progress, queueing time and completion time.
    List,
    /// One job in detail, with how to reach its coordinator.
    Show {
        /// The job's name.
        job: String,
    },
    /// Cancel a job (yours, or any as an operator): its processes are stopped.
    Cancel {
        /// The job's name.
        job: String,
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

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    telemetry::init("warn");
    let Cli { to, json, cmd } = Cli::parse();
    if let Cmd::Job { cmd } = cmd {
        // Before the identity and the scheduler: a mistake in a job file is reported with its
        // line whether or not a scheduler answers.
        let ask = JobAsk::new(cmd)?;
        let (sched, _) = to.reach(Peer::Scheduler).await?;
        return job_cmd(&sched, ask, json).await;
    }
    if matches!(cmd, Cmd::Slots) {
        let (sched, _) = to.reach(Peer::Scheduler).await?;
        return slots_cmd(&sched, json).await;
    }
    let (admin, coordinator) = to.reach(Peer::Coordinator).await?;
    match cmd {
        Cmd::Status => status(&admin, &coordinator, json).await?,
        Cmd::Watch { every } => watch(&admin, &coordinator, every).await?,
        Cmd::Workers => workers(&admin, json).await?,
        Cmd::Shards => shards(&admin, json).await?,
        Cmd::Checkpoint => checkpoint(&admin, json).await?,
        Cmd::Shard {
            cmd: ShardCmd::Add { addr },
        } => {
            let v = admin
                .shard_add(&addr)
                .await
                .with_context(|| format!("adding shard {addr}"))?;
            print_reshard(&v, json)?;
        }
        Cmd::Shard {
            cmd: ShardCmd::Remove { shard },
        } => {
            let v = admin
                .shard_remove(&shard)
                .await
                .with_context(|| format!("removing shard {shard}"))?;
            print_reshard(&v, json)?;
        }
        Cmd::Reshard { by } => {
            let v = admin
                .reshard(by == "load")
                .await
                .context("rebalancing the shards")?;
            print_reshard(&v, json)?;
        }
        Cmd::Job { .. } | Cmd::Slots => unreachable!("answered by the scheduler above"),
        Cmd::Move { range, to } => {
            let (start, end) = admin::parse_range(&range).map_err(anyhow::Error::msg)?;
            let v = admin
                .move_range(start, end, &to)
                .await
                .with_context(|| format!("moving keys {start}..{end} to {to}"))?;
            print_reshard(&v, json)?;
        }
        Cmd::Stragglers(a) => stragglers(&admin, json, a).await?,
        Cmd::Preempt { worker, notice } => preempt(&admin, json, worker, notice).await?,
        Cmd::Migrate { worker, to, wait } => migrate(&admin, json, worker, to, wait).await?,
        Cmd::Scale { workers } => scale(&admin, json, workers).await?,
        Cmd::Placements => placements(&admin, json).await?,
        Cmd::Profile(a) => profile(&admin, json, a).await?,
        Cmd::Drain { worker } => drain(&admin, json, worker).await?,
    }
    Ok(())
}
