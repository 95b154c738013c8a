//! End-to-end runs of a replicated job with real `edl-ps` and `edl-worker` processes: three
//! shards keep copies of every key range, and shards killed with SIGKILL are never restarted.
//! The backups take over; every epoch is exact (no sample missing, none twice) and the job
//! learns as usual.
//!
//! Sized as in `reshard_run.rs`: the small MLP (784-64-10, 7 keys), 2 epochs of 30,000
//! samples, 2 workers.

mod common;

use common::TRAIN_SAMPLES;
use edl_deploy::Report;

/// Runs `scenario` with 3 shards keeping `replicas` copies of every range.
async fn run_replicated(dir: &std::path::Path, scenario: &str, replicas: u32) -> Report {
    let cfg = common::replicated_config(dir, scenario, 7, false, 2, (3, replicas));
    common::run(&cfg).await
}

/// The checks every run here passes: finished, learned, every epoch exact, every worker
/// ended well, and the killed shards hold nothing at the end.
fn assert_exact(r: &Report, killed: &[&str]) {
    assert!(r.finished);
    assert!(r.scenario_skipped.is_empty(), "{:?}", r.scenario_skipped);
    // 60,000 samples of a small MLP reach about 0.85 here; chance is 0.1.
    assert!(r.test_accuracy > 0.75, "{}", r.test_accuracy);
    assert_eq!(r.epochs.len(), 2);
    for e in &r.epochs {
        // Nothing the killed primaries acknowledged was lost, and nothing was applied twice.
        assert_eq!(
            (e.samples, e.missing, e.duplicates),
            (u64::from(TRAIN_SAMPLES), 0, 0),
            "epoch {e:?}"
        );
        assert_eq!(e.reported_samples, u64::from(TRAIN_SAMPLES), "epoch {e:?}");
    }
    for p in &r.worker_processes {
        assert_eq!((p.fate.as_str(), p.exit_code), ("none", Some(0)), "{p:?}");
    }
    for name in killed {
        let s = r
            .shard_layout
            .iter()
            .find(|s| s.name == *name)
            .unwrap_or_else(|| panic!("no {name}: {:?}", r.shard_layout));
        assert_ne!(s.role, "active", "{s:?}");
    }
    let active: Vec<_> = r
        .shard_layout
        .iter()
        .filter(|s| s.role == "active")
        .collect();
    assert_eq!(active.len(), 3 - killed.len(), "{:?}", r.shard_layout);
}

#[tokio::test]
async fn a_shard_killed_for_good_loses_nothing_with_two_copies() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let scenario = "[[event]]\nat_s = 1.0\naction = \"kill_shard\"\nshard = \"s1\"\n";
    let r = run_replicated(dir.path(), scenario, 2).await;
    println!("{r}");
    assert_exact(&r, &["s1"]);
}

#[tokio::test]
async fn two_shards_killed_in_a_row_lose_nothing_with_three_copies() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let scenario = "[[event]]\nat_s = 1.0\naction = \"kill_shard\"\nshard = \"s1\"\n\n\
                    [[event]]\nat_s = 2.0\naction = \"kill_shard\"\nshard = \"s0\"\n";
    let r = run_replicated(dir.path(), scenario, 3).await;
    println!("{r}");
    assert_exact(&r, &["s1", "s0"]);
}
