//! How answers are printed: tables, and JSON with `--json`.

use super::*;

pub(super) fn print_reshard(v: &admin::ReshardView, json: bool) -> anyhow::Result<()> {
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

pub(super) fn print_json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

pub(super) fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(header.to_vec());
    t
}

/// The job's coordinators as `edlctl status` prints them: `A leader, B standby, C
/// unreachable (why)`.
pub(super) fn coordinators_line(roles: &[(String, Result<CoordinatorRole, String>)]) -> String {
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

pub(super) fn coordinators_json(
    roles: &[(String, Result<CoordinatorRole, String>)],
) -> serde_json::Value {
    roles
        .iter()
        .map(|(addr, role)| match role {
            Ok(r) => serde_json::json!({ "addr": addr, "role": r }),
            Err(why) => serde_json::json!({ "addr": addr, "role": "unreachable", "error": why }),
        })
        .collect()
}

pub(super) fn opt_s(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |s| format!("{s:.1} s"))
}

/// `edlctl status` as a table.
pub(super) fn status_table(v: &StatusView) -> Table {
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
pub(super) fn replica_table(map: &edl_shared::proto::ShardMap) -> Table {
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
