//! The commands a job's coordinator answers: one function each, over the admin API
//! (`edl_ps::admin::Admin`).

use super::*;
use edl_shared::proto::msg::WorkerInfo;

/// The worker a command names: a numeric id, or the name of one active worker.
pub(super) async fn resolve(
    admin: &Admin,
    which: &str,
) -> anyhow::Result<edl_shared::proto::WorkerId> {
    let members = admin.members().await?;
    admin::resolve_worker(&members, which).map_err(anyhow::Error::msg)
}

pub(super) fn secs(v: f64, flag: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} {v} is not a positive number of seconds"))
}

/// The job's status as `status` and `watch` show it, and its workers.
async fn status_view(admin: &Admin) -> anyhow::Result<(StatusView, Vec<WorkerInfo>)> {
    let (job, st, members, shards) = (
        admin.job().await?,
        admin.status().await?,
        admin.members().await?,
        admin.shard_list().await?,
    );
    Ok((StatusView::new(&job, &st, &members, &shards), members))
}

/// `edlctl status`.
pub(super) async fn status(admin: &Admin, coordinator: &str, json: bool) -> anyhow::Result<()> {
    let (v, _) = status_view(admin).await?;
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
    Ok(())
}

/// `edlctl watch`.
pub(super) async fn watch(
    admin: &Admin,
    coordinator: &str,
    every: std::time::Duration,
) -> anyhow::Result<()> {
    loop {
        let (v, members) = status_view(admin).await?;
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
    }
}

/// `edlctl workers`.
pub(super) async fn workers(admin: &Admin, json: bool) -> anyhow::Result<()> {
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
    Ok(())
}

/// `edlctl shards`.
pub(super) async fn shards(admin: &Admin, json: bool) -> anyhow::Result<()> {
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
    Ok(())
}

/// `edlctl checkpoint`.
pub(super) async fn checkpoint(admin: &Admin, json: bool) -> anyhow::Result<()> {
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
    Ok(())
}

/// `edlctl stragglers`.
pub(super) async fn stragglers(admin: &Admin, json: bool, a: StragglersArgs) -> anyhow::Result<()> {
    let StragglersArgs {
        policy,
        factor,
        window,
        min_gap,
        warmup,
        stall_report,
        stall_drop,
    } = a;
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
    Ok(())
}

/// `edlctl preempt`.
pub(super) async fn preempt(
    admin: &Admin,
    json: bool,
    worker: String,
    notice: std::time::Duration,
) -> anyhow::Result<()> {
    let id = resolve(admin, &worker).await?;
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
    Ok(())
}

/// `edlctl migrate`.
pub(super) async fn migrate(
    admin: &Admin,
    json: bool,
    worker: String,
    to: Option<String>,
    wait: std::time::Duration,
) -> anyhow::Result<()> {
    let id = resolve(admin, &worker).await?;
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
    Ok(())
}

/// `edlctl scale`.
pub(super) async fn scale(admin: &Admin, json: bool, workers: u32) -> anyhow::Result<()> {
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
    Ok(())
}

/// `edlctl placements`.
pub(super) async fn placements(admin: &Admin, json: bool) -> anyhow::Result<()> {
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
    Ok(())
}

/// `edlctl profile`.
pub(super) async fn profile(admin: &Admin, json: bool, a: ProfileArgs) -> anyhow::Result<()> {
    let ProfileArgs {
        workers,
        seconds,
        warmup,
        min_gain,
        out,
        png,
    } = a;
    let opts = edl_ps::profile::ProfileOptions {
        sizes: workers,
        warmup: secs(warmup, "--warmup")?,
        measure: secs(seconds, "--seconds")?,
        min_gain,
        ..Default::default()
    };
    let p = edl_ps::profile::profile(admin, &opts, |line| {
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
        edl_ps::profile::plot(&p, path).with_context(|| format!("drawing {}", path.display()))?;
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
    Ok(())
}

/// `edlctl drain`.
pub(super) async fn drain(admin: &Admin, json: bool, worker: String) -> anyhow::Result<()> {
    let id = resolve(admin, &worker).await?;
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
    Ok(())
}
