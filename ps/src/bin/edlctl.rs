//! `edlctl`: the operator's view of a running EDL job, over the same authenticated QUIC as
//! everything else (admin role). Tables by default, `--json` for scripts.

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
    Stragglers {
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
    },
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
    Profile {
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
    },
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

/// The worker a command names: a numeric id, or the name of one active worker.
async fn resolve(admin: &Admin, which: &str) -> anyhow::Result<edl_shared::proto::WorkerId> {
    let members = admin.members().await?;
    admin::resolve_worker(&members, which).map_err(anyhow::Error::msg)
}

fn secs(v: f64, flag: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} {v} is not a positive number of seconds"))
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
        Cmd::Status => {
            let (job, st, members, shards) = (
                admin.job().await?,
                admin.status().await?,
                admin.members().await?,
                admin.shard_list().await?,
            );
            let v = StatusView::new(&job, &st, &members, &shards);
            // With several coordinators (a leader and standbys), what each one is.
            let several = coordinator.contains(',');
            let roles = if several {
                admin.coordinators().await
            } else {
                Vec::new()
            };
            if json {
                let mut out = serde_json::to_value(&v)?;
                if several && let Some(o) = out.as_object_mut() {
                    o.insert("coordinators".into(), coordinators_json(&roles));
                }
                return print_json(&out);
            }
            println!("{}", status_table(&v));
            if several {
                println!("coordinators: {}", coordinators_line(&roles));
            }
        }
        Cmd::Watch { every } => loop {
            let (job, st, members, shards) = (
                admin.job().await?,
                admin.status().await?,
                admin.members().await?,
                admin.shard_list().await?,
            );
            let v = StatusView::new(&job, &st, &members, &shards);
            // Clear the terminal, then the status and the active workers.
            print!("\x1b[2J\x1b[H");
            println!(
                "{}  (every {}; Ctrl-C ends)",
                coordinator,
                humantime::format_duration(every)
            );
            println!("{}", status_table(&v));
            let active: Vec<WorkerRow> = members
                .iter()
                .filter(|w| w.state == WorkerState::Active)
                .map(WorkerRow::from)
                .collect();
            let mut t = table(&[
                "id",
                "name",
                "state",
                "clock",
                "steps/s",
                "step ms",
                "straggler",
            ]);
            for r in &active {
                t.add_row(vec![
                    r.id.to_string(),
                    r.name.clone(),
                    r.state.clone(),
                    r.clock.to_string(),
                    format!("{:.1}", r.steps_per_s),
                    format!("{:.1}", r.step_ms),
                    if r.straggler {
                        format!("yes ({:.2})", r.straggler_score)
                    } else {
                        String::new()
                    },
                ]);
            }
            println!("{t}");
            if v.finished {
                return Ok(());
            }
            tokio::time::sleep(every).await;
        },
        Cmd::Workers => {
            let rows: Vec<WorkerRow> = admin.members().await?.iter().map(WorkerRow::from).collect();
            if json {
                return print_json(&rows);
            }
            let mut t = table(&[
                "id",
                "name",
                "address",
                "state",
                "clock",
                "steps/s",
                "step",
                "others",
                "straggler",
                "stale",
                "samples",
                "last heartbeat",
            ]);
            for r in &rows {
                let mut state = r.state.clone();
                if let Some(n) = r.notice_ms {
                    state.push_str(&format!(" (preempted, {:.1} s left)", n as f64 / 1000.0));
                }
                if let Some(n) = r.stalled_ms {
                    state.push_str(&format!(
                        " (STALLED: holds the others up, no step for {:.1} s)",
                        n as f64 / 1000.0
                    ));
                }
                t.add_row(vec![
                    r.id.to_string(),
                    r.name.clone(),
                    r.addr.clone(),
                    state,
                    r.clock.to_string(),
                    format!("{:.1}", r.steps_per_s),
                    format!("{:.1} ms", r.step_ms),
                    if r.others_ms > 0.0 {
                        format!("{:.1} ms", r.others_ms)
                    } else {
                        "-".into()
                    },
                    match r.judged.as_str() {
                        "straggler" => format!("YES {:.2}x", r.straggler_score),
                        "suspect" => format!("suspect {:.2}x", r.straggler_score),
                        "ok" => format!("{:.2}x", r.straggler_score),
                        other => other.to_string(),
                    },
                    r.staleness.to_string(),
                    r.samples.to_string(),
                    format!("{:.1} s ago", r.last_heartbeat_ms as f64 / 1000.0),
                ]);
            }
            println!("{t}");
        }
        Cmd::Shards => {
            let rows = admin.shard_stats().await?;
            if json {
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
            let map = admin.map().await.ok();
            let replicated = map.as_ref().is_some_and(|m| !m.backups.is_empty());
            let mut header = vec![
                "id",
                "name",
                "address",
                "role",
                if replicated {
                    "primary of"
                } else {
                    "key ranges"
                },
                "keys",
                "bytes",
                "pushes",
                "pulls",
                "traffic",
            ];
            if replicated {
                header.extend(["backup of", "lag"]);
            }
            let mut t = table(&header);
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
                    None if r.unassigned => t.add_row(vec![
                        format!("s{}", r.id),
                        r.name.clone(),
                        r.addr.clone(),
                        r.role.clone(),
                        "none yet: waits for the shard map to form".into(),
                    ]),
                    None => {
                        let mut row = vec![
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
                        ];
                        if replicated {
                            row.extend([r.backups.join(", "), format!("{} forwards", r.lag)]);
                        }
                        t.add_row(row)
                    }
                };
            }
            println!("{t}");
            if let Some(map) = map.filter(|m| !m.backups.is_empty()) {
                println!("\n{}", replica_table(&map));
            }
            if rows.iter().any(|(_, e)| e.is_some()) {
                anyhow::bail!("some shards could not be reached");
            }
        }
        Cmd::Checkpoint => {
            let rows = admin.checkpoint_all().await?;
            if json {
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
        Cmd::Stragglers {
            policy,
            factor,
            window,
            min_gap,
            warmup,
            stall_report,
            stall_drop,
        } => {
            let stall_drop = stall_drop.map(|d| d.0.map_or(0, ms));
            let change = |s: &mut edl_shared::proto::StragglerSettings| {
                s.policy = policy.unwrap_or(s.policy);
                s.factor = factor.unwrap_or(s.factor);
                s.window_ms = window.map_or(s.window_ms, ms);
                s.min_gap_ms = min_gap.map_or(s.min_gap_ms, |d| d.as_secs_f32() * 1000.0);
                s.warmup_ms = warmup.map_or(s.warmup_ms, ms);
                s.stall_ms = stall_report.map_or(s.stall_ms, ms);
                s.stall_drop_ms = stall_drop.unwrap_or(s.stall_drop_ms);
            };
            let s = admin
                .stragglers(change)
                .await
                .context("changing the straggler settings")?;
            if json {
                return print_json(&serde_json::json!({
                    "policy": s.policy.to_string(),
                    "factor": s.factor,
                    "window_ms": s.window_ms,
                    "min_gap_ms": s.min_gap_ms,
                    "warmup_ms": s.warmup_ms,
                    "stall_report_ms": s.stall_ms,
                    "stall_drop_ms": (s.stall_drop_ms > 0).then_some(s.stall_drop_ms),
                }));
            }
            println!(
                "stragglers: policy {}; flagged past {}x the others' median step time (and {} ms \
                 above it) over {} ms windows, held for {} ms; judged from {} ms after joining",
                s.policy,
                s.factor,
                s.min_gap_ms,
                s.window_ms,
                s.confirm().as_millis(),
                s.warmup_ms
            );
            let drop = match s.stall_drop_ms {
                0 => "waited for".to_string(),
                d => format!("dropped after {d} ms"),
            };
            println!(
                "stalls: a worker holding the others up is reported after {} ms and {drop}",
                s.stall_ms
            );
        }
        Cmd::Preempt { worker, notice } => {
            let id = resolve(&admin, &worker).await?;
            let placed = admin
                .preempt(id, notice)
                .await
                .with_context(|| format!("preempting worker {}", id.0))?;
            if json {
                return print_json(&serde_json::json!({
                    "worker": id.0,
                    "notice_ms": notice.as_millis() as u64,
                    "placement": placed.as_ref().map(|p| p.id),
                }));
            }
            println!(
                "worker {} ({worker}) will leave within {}{}",
                id.0,
                humantime::format_duration(notice),
                match &placed {
                    Some(p) => format!("; placement {} asks for its substitute", p.id),
                    None => "; no substitute (the straggler policy is not replace)".into(),
                }
            );
        }
        Cmd::Migrate { worker, to, wait } => {
            let id = resolve(&admin, &worker).await?;
            let started = std::time::Instant::now();
            let p = admin
                .migrate(id, to.clone())
                .await
                .with_context(|| format!("migrating worker {}", id.0))?;
            let done = admin.wait_placement(p.id, wait).await?;
            let took = started.elapsed().as_secs_f64();
            let members = admin.members().await?;
            let out = admin::PlacementRow::new(done.as_ref().unwrap_or(&p), &members);
            if json {
                print_json(&out)?;
            } else {
                println!(
                    "migrating worker {} ({worker}){}: placement {} {} after {took:.1} s",
                    id.0,
                    to.map(|s| format!(" to {s}")).unwrap_or_default(),
                    p.id,
                    out.state
                );
            }
            match done.map(|p| p.state) {
                Some(edl_shared::proto::PlacementState::Done { .. }) => {}
                Some(_) => anyhow::bail!("the migration did not happen: {}", out.state),
                None => anyhow::bail!(
                    "no worker was admitted for placement {} within {} (is a placer such as \
                     edl-local running the job?)",
                    p.id,
                    humantime::format_duration(wait)
                ),
            }
        }
        Cmd::Scale { workers } => {
            let edl_shared::proto::place::Resize {
                placed,
                drained,
                cancelled,
            } = admin
                .scale(workers)
                .await
                .with_context(|| format!("resizing to {workers} workers"))?;
            if json {
                return print_json(&serde_json::json!({
                    "placed": placed,
                    "drained": drained.iter().map(|w| w.0).collect::<Vec<_>>(),
                    "cancelled": cancelled,
                }));
            }
            println!(
                "scaling to {workers} workers: {} to start (placements {:?}), {} to drain {:?}, \
                 {} pending starts cancelled",
                placed.len(),
                placed,
                drained.len(),
                drained.iter().map(|w| w.0).collect::<Vec<_>>(),
                cancelled.len()
            );
        }
        Cmd::Placements => {
            let members = admin.members().await?;
            let rows: Vec<admin::PlacementRow> = admin
                .placements()
                .await?
                .iter()
                .map(|p| admin::PlacementRow::new(p, &members))
                .collect();
            if json {
                return print_json(&rows);
            }
            let mut t = table(&["id", "at", "what", "slot", "state"]);
            for r in &rows {
                t.add_row(vec![
                    r.id.to_string(),
                    format!("{:.1} s", r.t_ms as f64 / 1000.0),
                    r.what.clone(),
                    r.slot.clone().unwrap_or_else(|| "-".into()),
                    r.state.clone(),
                ]);
            }
            println!("{t}");
        }
        Cmd::Profile {
            workers,
            seconds,
            warmup,
            min_gain,
            out,
            png,
        } => {
            let opts = edl_ps::profile::ProfileOptions {
                sizes: workers,
                warmup: secs(warmup, "--warmup")?,
                measure: secs(seconds, "--seconds")?,
                min_gain,
                ..Default::default()
            };
            let p = edl_ps::profile::profile(&admin, &opts, |line| {
                if !json {
                    eprintln!("edlctl profile: {line}");
                }
            })
            .await?;
            if let Some(path) = &out {
                std::fs::write(path, serde_json::to_string_pretty(&p)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = &png {
                edl_ps::profile::plot(&p, path)
                    .with_context(|| format!("drawing {}", path.display()))?;
            }
            if json {
                return print_json(&p);
            }
            let mut t = table(&["workers", "samples/s", "per worker", "gain of added"]);
            for pt in &p.points {
                t.add_row(vec![
                    pt.workers.to_string(),
                    format!("{:.0}", pt.samples_per_s),
                    format!("{:.0}", pt.samples_per_s / f64::from(pt.workers)),
                    pt.gain.map_or("-".into(), |g| format!("{g:.2}")),
                ]);
            }
            println!("{t}");
            println!(
                "suggested size: {} workers (past it an added worker buys less than {} of a \
                 worker's share); resized back to {}",
                p.knee, p.min_gain, p.restored_to
            );
        }
        Cmd::Drain { worker } => {
            let id = resolve(&admin, &worker).await?;
            admin
                .drain(id)
                .await
                .with_context(|| format!("draining worker {}", id.0))?;
            if json {
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

/// The job's coordinators as `edlctl status` prints them: `A leader, B standby, C
/// unreachable (why)`.
fn coordinators_line(roles: &[(String, Result<CoordinatorRole, String>)]) -> String {
    let each: Vec<String> = roles
        .iter()
        .map(|(addr, role)| match role {
            Ok(CoordinatorRole::Leader) => format!("{addr} leader"),
            Ok(CoordinatorRole::Standby { .. }) => format!("{addr} standby"),
            Err(why) => format!("{addr} unreachable ({why})"),
        })
        .collect();
    each.join(", ")
}

fn coordinators_json(roles: &[(String, Result<CoordinatorRole, String>)]) -> serde_json::Value {
    roles
        .iter()
        .map(|(addr, role)| match role {
            Ok(r) => serde_json::json!({ "addr": addr, "role": r }),
            Err(why) => serde_json::json!({ "addr": addr, "role": "unreachable", "error": why }),
        })
        .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn opt_s(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |s| format!("{s:.1} s"))
}

/// What `edlctl job` asks the scheduler, a submitted job file read and checked.
enum JobAsk {
    Submit(edl_shared::proto::sched::Submission),
    List,
    Show(String),
    Cancel(String),
}

impl JobAsk {
    /// Reads and checks a submitted job file, so that a mistake is reported with its line
    /// (`file:line: field: message`) before anything is asked; the scheduler checks it again.
    fn new(cmd: JobCmd) -> anyhow::Result<JobAsk> {
        Ok(match cmd {
            JobCmd::Submit {
                file,
                job,
                workers,
                min,
                max,
                priority,
            } => {
                let text = std::fs::read_to_string(&file)
                    .with_context(|| format!("reading {}", file.display()))?;
                edl_shared::jobfile::parse(&text, &file)?;
                let abs = std::path::absolute(&file).unwrap_or_else(|_| file.clone());
                let dir = abs
                    .parent()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default();
                JobAsk::Submit(edl_shared::proto::sched::Submission {
                    name: job.unwrap_or_default(),
                    job_file: text,
                    file_dir: dir,
                    workers,
                    min_workers: min.unwrap_or(workers.div_ceil(4).max(1)),
                    max_workers: max.unwrap_or(workers.saturating_mul(2)),
                    priority,
                })
            }
            JobCmd::List => JobAsk::List,
            JobCmd::Show { job } => JobAsk::Show(job),
            JobCmd::Cancel { job } => JobAsk::Cancel(job),
        })
    }
}

async fn job_cmd(sched: &Admin, ask: JobAsk, json: bool) -> anyhow::Result<()> {
    let record = match ask {
        JobAsk::Submit(submission) => sched.submit_job(submission).await?,
        JobAsk::Show(job) => sched.show_job(&job).await?,
        JobAsk::Cancel(job) => sched.cancel_job(&job).await?,
        JobAsk::List => {
            let rows: Vec<JobRow> = sched
                .jobs()
                .await?
                .iter()
                .map(|j| JobRow::new(j, now_ms()))
                .collect();
            if json {
                return print_json(&rows);
            }
            let mut t = table(&[
                "job", "owner", "state", "workers", "slots", "samples", "queued", "jct",
            ]);
            for r in &rows {
                t.add_row(vec![
                    r.name.clone(),
                    r.owner.clone(),
                    r.state.clone(),
                    format!("{} ({}..{})", r.workers, r.min_workers, r.max_workers),
                    format!("{} ({} running)", r.alloc, r.running),
                    format!("{}/{}", r.samples, r.samples_total),
                    format!("{:.1} s", r.queued_s),
                    opt_s(r.jct_s),
                ]);
            }
            println!("{t}");
            return Ok(());
        }
    };
    let row = JobRow::new(&record, now_ms());
    if json {
        return print_json(&row);
    }
    let mut t = table(&["", ""]);
    t.add_row(vec!["job".into(), row.name.clone()]);
    t.add_row(vec!["owner".into(), row.owner.clone()]);
    t.add_row(vec!["state".into(), row.state.clone()]);
    t.add_row(vec![
        "workers (min..max)".into(),
        format!("{} ({}..{})", row.workers, row.min_workers, row.max_workers),
    ]);
    t.add_row(vec!["priority".into(), row.priority.to_string()]);
    if !row.runs.is_empty() {
        t.add_row(vec!["workers run".into(), row.runs.clone()]);
    }
    t.add_row(vec!["last growth took".into(), opt_s(row.resize_cost_s)]);
    t.add_row(vec![
        "slots".into(),
        format!(
            "{} ({} workers running, {} resizes)",
            row.alloc, row.running, row.resizes
        ),
    ]);
    t.add_row(vec![
        "samples".into(),
        format!("{}/{}", row.samples, row.samples_total),
    ]);
    t.add_row(vec!["queued".into(), format!("{:.1} s", row.queued_s)]);
    t.add_row(vec!["completion time".into(), opt_s(row.jct_s)]);
    t.add_row(vec![
        "slot-seconds".into(),
        format!("{:.1}", row.attained_s),
    ]);
    if let Some(l) = &row.ledger {
        t.add_row(vec![
            "ledger".into(),
            format!(
                "{} applied, {} duplicates, {} missing",
                l.applied, l.duplicates, l.missing
            ),
        ]);
    }
    t.add_row(vec!["directory".into(), row.dir.clone()]);
    println!("{t}");
    // Below the table, wrapped: a failure's message runs to hundreds of columns and lines of
    // a log, which would stretch every row of the table.
    if !row.message.is_empty() {
        println!("message:\n{}", wrap(&row.message, "  ", MESSAGE_WIDTH));
    }
    if let Some(c) = &row.coordinator {
        let pki = edl_shared::pki::PkiDir::new(std::path::Path::new(&row.dir));
        println!(
            "reach its coordinator with your certificate for this job:\n  edlctl --coordinator {c} \\\n    --ca {} --cert {} --key {} status",
            pki.ca_cert().display(),
            pki.node_cert(Role::Admin, &row.owner).display(),
            pki.node_key(Role::Admin, &row.owner).display(),
        );
    }
    Ok(())
}

/// The columns a job's message is wrapped to.
const MESSAGE_WIDTH: usize = 100;

/// `text` wrapped at spaces to `width` columns, each line indented by `indent`. A line keeps
/// its own leading spaces (a log's quoted lines stay indented), also on the lines it wraps to;
/// a word longer than a line is left whole, so that a path can still be copied.
fn wrap(text: &str, indent: &str, width: usize) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let body = line.trim_start();
        let lead = format!("{indent}{}", &line[..line.len() - body.len()]);
        let mut col = 0;
        for word in body.split_whitespace() {
            let n = word.chars().count();
            if col > 0 && col + 1 + n > width {
                out.push('\n');
                col = 0;
            }
            if col == 0 {
                out.push_str(&lead);
                col = lead.chars().count();
            } else {
                out.push(' ');
                col += 1;
            }
            out.push_str(word);
            col += n;
        }
        out.push('\n');
    }
    out.truncate(out.trim_end().len());
    out
}

async fn slots_cmd(sched: &Admin, json: bool) -> anyhow::Result<()> {
    let rows: Vec<SlotRow> = sched.slots().await?.iter().map(SlotRow::from).collect();
    if json {
        return print_json(&rows);
    }
    let mut t = table(&["slot", "host", "job", "worker"]);
    for r in &rows {
        t.add_row(vec![
            r.slot.clone(),
            r.host.clone(),
            r.job.clone().unwrap_or_else(|| "-".into()),
            r.worker.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    println!("{t}");
    Ok(())
}

/// `edlctl status` as a table.
fn status_table(v: &StatusView) -> Table {
    let mut t = table(&["", ""]);
    let mut row = |k: &str, v: String| {
        t.add_row(vec![k.to_string(), v]);
    };
    row("model", v.model.clone());
    row("optimizer", v.optimizer.clone());
    row("consistency", v.consistency.clone());
    row("epochs × batch", format!("{} × {}", v.epochs, v.batch_size));
    row("shards", v.shards.to_string());
    row("active workers", v.active_workers.to_string());
    row(
        "clocks (min..max)",
        format!("{}..{}", v.min_clock, v.max_clock),
    );
    row(
        "samples",
        format!(
            "{} / {} ({:.1}%)",
            v.samples.0,
            v.samples.1,
            100.0 * v.samples.0 as f64 / v.samples.1.max(1) as f64
        ),
    );
    row(
        "throughput",
        format!("{:.0} samples/s (last 10 s)", v.samples_per_s),
    );
    let dash = || "–".to_string();
    row(
        "training loss",
        match (v.loss, v.epoch_loss) {
            (Some(l), Some((e, el))) => {
                format!("{l:.4} (last 10 s); epoch {}/{}: {el:.4}", e + 1, v.epochs)
            }
            (None, Some((e, el))) => format!("epoch {}/{}: {el:.4}", e + 1, v.epochs),
            (Some(l), None) => format!("{l:.4} (last 10 s)"),
            (None, None) => dash(),
        },
    );
    row(
        "accuracy",
        v.evaluation.as_ref().map_or_else(
            || "– (no evaluation yet: edl-worker --evaluate --every 30s)".to_string(),
            |e| {
                format!(
                    "{:.2}% (test loss {:.4}, pulled at min clock {}, {:.0} s ago)",
                    100.0 * e.accuracy,
                    e.loss,
                    e.clock,
                    e.age_s
                )
            },
        ),
    );
    row(
        "ETA",
        v.eta_s.map_or_else(dash, |s| {
            humantime::format_duration(std::time::Duration::from_secs(s.round() as u64)).to_string()
        }),
    );
    row("finished", v.finished.to_string());
    t
}

/// A replicated job's key ranges, each with its primary and its backups in promotion order.
fn replica_table(map: &edl_shared::proto::ShardMap) -> Table {
    let mut cuts: std::collections::BTreeSet<u64> = std::collections::BTreeSet::new();
    for r in map.ranges.iter().chain(&map.backups) {
        cuts.extend([r.start, r.end]);
    }
    let cuts: Vec<u64> = cuts.into_iter().collect();
    let mut t = table(&["key range", "primary", "backups"]);
    for w in cuts.windows(2) {
        let key = edl_shared::proto::Key(w[0]);
        let backups: Vec<String> = map.backups_of(key).map(|s| s.to_string()).collect();
        t.add_row(vec![
            format!("{}..{}", w[0], w[1]),
            map.owner(key).map_or("none".into(), |s| s.to_string()),
            if backups.is_empty() {
                "none".into()
            } else {
                backups.join(", ")
            },
        ]);
    }
    t
}
