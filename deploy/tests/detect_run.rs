//! Failure and straggler detection with real processes on a loaded machine: identical workers
//! beside CPU hogs are never flagged as stragglers (ASP, SSP and BSP, the MLP and a sparse
//! logistic regression); a worker killed with SIGKILL is declared dead within a second, while
//! one stopped with SIGSTOP for 2 s (a long GC pause, swapping) is not.

mod common;

use edl_deploy::{Report, Scenario, ScenarioFile};
use edl_shared::proto::Consistency;
use edl_testkit::tenants::{AGARICUS_SAMPLES, Hogs, logreg_job};

/// The straggler episodes of a run, as lines for a failure message.
fn flags(r: &Report) -> Vec<String> {
    r.elastic
        .stragglers
        .iter()
        .map(|s| format!("{} flagged at {} ms", s.worker, s.flagged_ms))
        .collect()
}

/// A run of `workers` workers without a scenario.
fn plain(dir: &std::path::Path, workers: u32) -> edl_deploy::LocalConfig {
    const NOTHING: &str =
        "[[event]]\nat_s = 0.0\naction = \"slow\"\nworker = \"w0\"\nfactor = 1.0\n";
    let mut cfg = common::scenario_config(dir, NOTHING, 1, false, workers);
    cfg.scenario = None;
    cfg
}

fn exact(r: &Report, samples: u64) {
    assert!(r.finished, "{r}");
    for e in &r.epochs {
        assert_eq!(
            (e.samples, e.duplicates, e.missing),
            (samples, 0, 0),
            "epoch {e:?}"
        );
    }
}

#[tokio::test]
async fn identical_workers_beside_cpu_hogs_are_never_flagged() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    // 3 workers, 2 shards and a coordinator on this machine's cores, and two hogs beside
    // them: every worker is slowed, unevenly from moment to moment, none is a straggler.
    let _hogs = Hogs::start(2);
    for consistency in ["asp", "ssp:2", "bsp"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = plain(dir.path(), 3);
        cfg.epochs = 1;
        cfg.lease_ms = 3_000;
        cfg.consistency = consistency.parse::<Consistency>().expect("consistency");
        let r = common::run(&cfg).await;
        println!("{consistency}: {} s, {:?}", r.train_wall_s, flags(&r));
        exact(&r, u64::from(common::TRAIN_SAMPLES));
        assert!(
            r.elastic.stragglers.is_empty(),
            "{consistency}: {:?}",
            flags(&r)
        );
    }
    // The sparse logistic regression (short steps, each touching other rows) under ASP.
    let dir = tempfile::tempdir().expect("tempdir");
    let job = logreg_job(dir.path(), 12).expect("job file");
    let mut cfg = plain(dir.path(), 3);
    cfg.job = Some(job);
    let r = common::run(&cfg).await;
    println!("logreg: {} s, {:?}", r.train_wall_s, flags(&r));
    exact(&r, AGARICUS_SAMPLES);
    assert!(r.elastic.stragglers.is_empty(), "logreg: {:?}", flags(&r));
}

const KILL_AND_PAUSE: &str = r#"
[[event]]
at_s = 3.0
action = "kill"
worker = "w0"

[[event]]
at_s = 5.0
action = "pause"
worker = "w1"
for_s = 2.0
"#;

#[tokio::test]
async fn a_killed_worker_is_dead_within_a_second_and_a_paused_one_is_not() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = common::scenario_config(dir.path(), KILL_AND_PAUSE, 2, false, 3);
    // The default lease (3 s): longer than the pause, and much longer than the second a
    // death may take to be found.
    cfg.lease_ms = 3_000;
    // Training must outlast the pause at 5 s with room to spare: 2 epochs once ended at 4.5 s
    // on an idle machine (the pause was then skipped); 5 take 10 s or more there.
    cfg.epochs = 5;
    cfg.scenario = Some(ScenarioFile {
        scenario: Scenario::parse(KILL_AND_PAUSE, 3, 2).expect("scenario"),
        path: dir.path().join("scenario.toml"),
    });
    let r = common::run(&cfg).await;
    println!("{r}");
    assert!(r.scenario_skipped.is_empty(), "{:?}", r.scenario_skipped);
    exact(&r, u64::from(common::TRAIN_SAMPLES));
    let death = &r.elastic.deaths[..];
    assert_eq!(death.len(), 1, "{death:?}");
    let d = &death[0];
    let s = d.detect_s.expect("the killed worker was declared dead");
    assert!(s < 1.0, "declared dead {s} s after SIGKILL: {d:?}");
    assert!(
        d.how.contains("socket"),
        "found by its socket, not its lease: {d:?}"
    );
    let pause = &r.elastic.pauses[..];
    assert_eq!(pause.len(), 1, "{pause:?}");
    assert_eq!(pause[0].declared_dead_ms, None, "{pause:?}");
    let w1 = r
        .worker_processes
        .iter()
        .find(|p| p.name == "w1")
        .expect("w1");
    assert_eq!(
        w1.exit_code,
        Some(0),
        "the paused worker trained on: {w1:?}"
    );
}
