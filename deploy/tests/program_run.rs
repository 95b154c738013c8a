//! `edl-local --job FILE` whose `[worker]` table names the workers' program: the launcher runs
//! it (here `edl-test-worker`, the two-layer example of `worker/examples/` speaking the process
//! contract) in place of `edl-worker`, through a churn scenario (workers added, drained, sent
//! SIGTERM and SIGKILLed), and every sample is still applied exactly once.

mod common;

use edl_deploy::Report;

const SAMPLES: u32 = 24_000;

const SCENARIO: &str = r#"
[[event]]
at_s = 0.3
action = "add"
count = 2

[[event]]
at_s = 0.9
action = "drain"
worker = "w0"

[[event]]
at_s = 1.2
action = "term"
worker = "w2"

[[event]]
at_s = 1.5
action = "kill"
worker = "w1"
"#;

#[tokio::test]
async fn a_job_files_program_trains_through_churn_exactly_once() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = edl_testkit::test_worker_job(
        dir.path(),
        &common::bin_dir(),
        SAMPLES,
        20,
        "consistency = \"ssp:2\"\npartition_size = 512\nlease_ms = 1000",
    );
    let cfg = common::scenario_config(dir.path(), SCENARIO, 5, false, 2)
        .from_job_file(&file)
        .expect("the job file");
    let r: Report = common::run(&cfg).await;
    println!("{r}");
    assert!(r.finished);
    assert!(r.scenario_skipped.is_empty(), "{:?}", r.scenario_skipped);
    assert_eq!(r.epochs.len(), 1);
    let e = &r.epochs[0];
    assert_eq!(
        (e.samples, e.duplicates, e.missing),
        (u64::from(SAMPLES), 0, 0),
        "{e:?}"
    );
    // The program reports no evaluation, and the run says so rather than evaluating with
    // edl-worker (which cannot run a custom model).
    assert_eq!(r.test_samples, 0);
    assert!(r.to_string().contains("no test evaluation"));
    let fate = |f: &str| {
        r.worker_processes
            .iter()
            .filter(|p| p.fate == f)
            .collect::<Vec<_>>()
    };
    let killed = fate("killed");
    assert_eq!(killed.len(), 1, "{:?}", r.worker_processes);
    assert_eq!(killed[0].signal, Some(9));
    // Drained, sent SIGTERM or left alone, the program leaves and exits 0.
    for p in r.worker_processes.iter().filter(|p| p.fate != "killed") {
        assert_eq!(p.exit_code, Some(0), "{p:?}");
    }
    assert_eq!(fate("termed").len(), 1, "{:?}", r.worker_processes);
    assert_eq!(fate("drained").len(), 1, "{:?}", r.worker_processes);
    // The SIGTERMed worker left (a leave event), not died by its lease.
    let termed = &fate("termed")[0].name;
    assert!(
        r.events
            .iter()
            .any(|e| e.kind == "leave" && &e.worker == termed),
        "{termed} did not leave: {:?}",
        r.events
    );
}
