//! The job as JSON: what the coordinator's dashboard API (`--http`) serves and `edlctl status
//! --json` prints, built from the same protocol answers. Field names are stable.

use edl_shared::proto::ShardMap;
use edl_shared::proto::msg::{
    EvalRecord, JobHistory, JobStatus, JobTrace, ShardEntry, ShardRole, ShardStats, WorkerInfo,
    WorkerState,
};
use serde_json::{Value, json};

/// A worker's state as the views write it: active, draining, left or dead.
pub fn worker_state(state: WorkerState, draining: bool) -> &'static str {
    match (state, draining) {
        (WorkerState::Active, false) => "active",
        (WorkerState::Active, true) => "draining",
        (WorkerState::Left, _) => "left",
        (WorkerState::Dead, _) => "dead",
    }
}

fn role(role: ShardRole) -> &'static str {
    match role {
        ShardRole::Active => "active",
        ShardRole::Standby => "standby",
        ShardRole::Retired => "retired",
    }
}

/// Seconds until the run ends at the current rate, if it is running and moving.
pub fn eta_s(st: &JobStatus) -> Option<f64> {
    let left = st.samples_total.saturating_sub(st.samples_done);
    (!st.finished && st.samples_per_s > 0.0).then(|| left as f64 / st.samples_per_s)
}

fn evaluation(e: &EvalRecord) -> Value {
    json!({
        "t_ms": e.t_ms, "name": e.name, "clock": e.clock.0, "accuracy": e.accuracy,
        "loss": e.loss, "samples": e.samples,
    })
}

/// Finite numbers only (JSON has no NaN).
fn num(v: f64) -> Value {
    if v.is_finite() { json!(v) } else { Value::Null }
}

/// The job's status with its workers, shards and map.
pub fn status(
    st: &JobStatus,
    members: &[WorkerInfo],
    shards: &[ShardEntry],
    map: Option<&ShardMap>,
) -> Value {
    let workers: Vec<Value> = members
        .iter()
        .map(|w| {
            json!({
                "id": w.id.to_string(), "name": w.name, "state": worker_state(w.state, w.draining),
                "clock": w.clock.0, "steps_per_s": num(w.steps_per_s), "samples": w.samples,
                "step_ms": num(w.step_ms), "others_ms": num(w.others_ms),
                "straggler_score": num(w.straggler_score), "straggler": w.straggler,
                "judged": w.judged.to_string(), "stalled_ms": w.stalled_ms,
                "staleness": w.staleness, "idle_ms": w.idle_ms,
            })
        })
        .collect();
    let shards: Vec<Value> = shards
        .iter()
        .map(|s| {
            let ranges: Vec<[u64; 2]> = map
                .map(|m| {
                    m.ranges
                        .iter()
                        .filter(|r| r.shard == s.id)
                        .map(|r| [r.start, r.end])
                        .collect()
                })
                .unwrap_or_default();
            let keys: u64 = ranges.iter().map(|r| r[1] - r[0]).sum();
            json!({
                "id": s.id.to_string(), "name": s.name, "addr": s.addr, "role": role(s.role),
                "ranges": ranges, "keys": keys,
            })
        })
        .collect();
    let epochs: Vec<Value> = st
        .epochs
        .iter()
        .map(|e| {
            let loss = (e.samples > 0).then(|| e.loss_sum / e.samples as f64);
            json!({"epoch": e.epoch, "samples": e.samples, "loss": loss.map(num)})
        })
        .collect();
    json!({
        "t_ms": st.t_ms, "finished": st.finished, "samples_done": st.samples_done,
        "samples_total": st.samples_total, "samples_per_s": num(st.samples_per_s),
        "loss": st.loss.map(num), "eta_s": eta_s(st).map(num),
        "evaluation": st.evaluation.as_ref().map(evaluation),
        "min_clock": st.min_clock.0, "shards_joined": st.shards_joined,
        "shards_expected": st.shards_expected, "map_epoch": map.map(|m| m.epoch.0),
        "epochs": epochs, "workers": workers, "shards": shards,
    })
}

/// The training history from the asked window on, with every membership event and move.
pub fn history(h: &JobHistory, trace: &JobTrace) -> Value {
    let points: Vec<Value> = h
        .points
        .iter()
        .map(|p| {
            let loss = (p.samples > 0).then(|| p.loss_sum / p.samples as f64);
            json!({
                "t_ms": p.t_ms, "samples": p.samples, "loss": loss.map(num), "steps": p.steps,
                "workers": p.workers,
            })
        })
        .collect();
    let events: Vec<Value> = trace
        .events
        .iter()
        .map(|e| {
            json!({
                "t_ms": e.t_ms, "kind": crate::coordinator::state::kind_name(e.kind),
                "worker": e.worker.to_string(), "name": e.name, "detail": e.detail,
            })
        })
        .collect();
    let moves: Vec<Value> = trace
        .moves
        .iter()
        .map(|m| {
            json!({
                "t_ms": m.t_ms, "start": m.start, "end": m.end, "from": m.from.to_string(),
                "to": m.to.to_string(), "bytes": m.bytes, "millis": num(m.millis),
                "hold_ms": num(m.hold_ms),
            })
        })
        .collect();
    json!({
        "bucket_ms": h.bucket_ms, "points": points,
        "evaluations": h.evaluations.iter().map(evaluation).collect::<Vec<_>>(),
        "events": events, "moves": moves,
    })
}

/// One shard's holdings and load, or why it did not answer.
pub fn shard_stats(entry: &ShardEntry, stats: Result<&ShardStats, String>) -> Value {
    match stats {
        Ok(s) => json!({
            "id": entry.id.to_string(), "name": entry.name, "keys": s.keys, "floats": s.floats,
            "state_bytes": s.state_bytes, "pushes": s.pushes, "pulls": s.pulls,
            "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "error": Value::Null,
        }),
        Err(why) => json!({
            "id": entry.id.to_string(), "name": entry.name, "keys": 0, "floats": 0,
            "state_bytes": 0, "pushes": 0, "pulls": 0, "bytes_in": 0, "bytes_out": 0,
            "error": why,
        }),
    }
}
