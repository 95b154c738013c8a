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

fn job_file(dir: &std::path::Path, program: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("custom.toml");
    let text = format!(
        "[model]\nkind = \"custom\"\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n\n[training]\n\
         consistency = \"ssp:2\"\nsamples = {SAMPLES}\nepochs = 1\nbatch_size = 64\n\
         partition_size = 512\nlease_ms = 1000\n\n\
         [[tensor]]\nname = \"fc1.weight\"\nshape = [784, 32]\ninit = \"glorot_uniform\"\n\n\
         [[tensor]]\nname = \"fc1.bias\"\nshape = [32]\ninit = \"zeros\"\n\n\
         [[tensor]]\nname = \"fc2.weight\"\nshape = [32, 10]\ninit = \"glorot_uniform\"\n\n\
         [[tensor]]\nname = \"fc2.bias\"\nshape = [10]\ninit = \"zeros\"\n\n\
         [worker]\ncommand = [{:?}]\nenv = {{ EDL_TEST_STEP_MS = \"20\" }}\n",
        program.display().to_string()
    );
    std::fs::write(&path, text).expect("write the job file");
    path
}

#[tokio::test]
async fn a_job_files_program_trains_through_churn_exactly_once() {
    if !common::have_dataset() {
        return;
    }
    let _one = common::ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let program = common::bin_dir().join("edl-test-worker");
    assert!(
        program.is_file(),
        "{} is missing: build the workspace",
        program.display()
    );
    let file = job_file(dir.path(), &program);
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
