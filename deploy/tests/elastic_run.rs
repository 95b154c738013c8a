//! The elastic operations on a live `edl-local` job with real processes, from a scenario: a
//! worker slowed 4x is flagged and replaced, a worker sent SIGUSR1 (a spot notice) leaves
//! within its notice and gets a substitute, and a worker is migrated to a named slot without
//! the job ever running below its worker count; every sample is still applied exactly once.

mod common;

use std::time::Duration;

use common::TRAIN_SAMPLES;
use edl_shared::proto::{StragglerPolicy, StragglerSettings};

const SCENARIO: &str = r#"
[[event]]
at_s = 0.3
action = "slow"
worker = "w1"
factor = 4.0

[[event]]
at_s = 0.6
action = "preempt"
worker = "w0"

[[event]]
at_s = 0.9
action = "migrate"
worker = "w2"
to = "slot7"
"#;

#[tokio::test]
async fn stragglers_preemption_and_migration_on_a_live_job() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = common::scenario_config(dir.path(), SCENARIO, 5, false, 3);
    cfg.epochs = 4;
    cfg.elastic.stragglers = StragglerSettings {
        policy: StragglerPolicy::Replace,
        ..StragglerSettings::default()
    };
    cfg.elastic.preempt_notice = Duration::from_secs(5);
    cfg.elastic.slots = 8;
    let r = common::run(&cfg).await;
    println!("{r}");
    assert!(r.finished);
    assert!(r.scenario_skipped.is_empty(), "{:?}", r.scenario_skipped);
    for e in &r.epochs {
        assert_eq!(
            (e.samples, e.duplicates, e.missing),
            (u64::from(TRAIN_SAMPLES), 0, 0),
            "epoch {e:?}"
        );
    }
    for p in &r.worker_processes {
        assert_eq!(p.exit_code, Some(0), "{p:?}");
    }
    let el = &r.elastic;
    // The process each scenario event acted on. A scenario name stands for the latest worker
    // in its place: on a busy machine another worker may be flagged (and replaced) first.
    let acted_on = |action: &str| {
        el.actions
            .iter()
            .find(|a| a.action == action)
            .map(|a| a.worker.clone())
            .unwrap_or_else(|| panic!("no {action} carried out: {el:?}"))
    };
    let (slowed, preempted, migrated) =
        (acted_on("slow"), acted_on("preempt"), acted_on("migrate"));

    // The slowed worker is flagged and replaced by a worker the launcher started for it.
    let s = el
        .stragglers
        .iter()
        .find(|s| s.worker == slowed && s.slowed_ms.is_some())
        .unwrap_or_else(|| panic!("{slowed} flagged: {el:?}"));
    assert!(s.replaced_by.is_some() && s.left_ms.is_some(), "{s:?}");

    // The preempted worker exits within its 5 s notice, and a substitute is admitted; the
    // worker trains on until then, so the job never runs short.
    let p = el
        .preemptions
        .iter()
        .find(|p| p.worker == preempted)
        .unwrap_or_else(|| panic!("{preempted} preempted: {el:?}"));
    let exit = p.exit_s.expect("the preempted worker exited");
    assert!(exit < 5.0, "{preempted} took {exit} s to leave: {p:?}");
    assert!(
        p.noticed_ms.is_some(),
        "the worker told the coordinator: {p:?}"
    );
    assert!(p.replacement_joined_ms.is_some(), "{p:?}");
    let w0 = r
        .worker_processes
        .iter()
        .find(|w| w.name == preempted)
        .expect("the preempted process");
    assert_eq!(w0.fate, "preempted");
    let sub = el
        .placements
        .iter()
        .find(|m| m.what.contains(&preempted) && m.what.contains("preempt"))
        .expect("the preempted worker's substitute");
    assert!(p.replacement_joined_ms <= p.left_ms, "{p:?} {sub:?}");
    let (fewest, before) = sub
        .active_min_and_before
        .expect("the preempted worker left");
    assert!(fewest >= before, "{sub:?}");

    // The migration started its worker in slot7, which was admitted before w2 left: the job
    // never ran below its worker count.
    let m = el
        .placements
        .iter()
        .find(|p| p.what.contains(&migrated) && p.what.contains("migrate"))
        .unwrap_or_else(|| panic!("a migration of {migrated}: {el:?}"));
    assert_eq!(m.state, "done", "{m:?}");
    assert_eq!(m.slot.as_deref(), Some("slot7"));
    let (fewest, before) = m.active_min_and_before.expect("the migrated worker left");
    assert!(fewest >= before, "{m:?}");
    let new = m.worker.as_deref().expect("the new worker");
    let proc = r
        .worker_processes
        .iter()
        .find(|w| w.name == new)
        .expect("its process");
    assert_eq!(proc.slot, "slot7");
    assert!(m.joined_ms <= m.old_left_ms, "{m:?}");
}
