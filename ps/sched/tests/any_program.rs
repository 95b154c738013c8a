//! Any program as a scheduled job: a custom-model job whose workers run its job file's
//! `[worker]` command (`edl-test-worker`, the two-layer example of `worker/examples/` speaking
//! the process contract), beside a built-in MLP job on 4 slots under the elastic policy. Both
//! are resized; one of the custom job's workers is SIGKILLed and another migrated, and both
//! jobs finish with exact ledgers without a slot ever held twice.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{ONE_AT_A_TIME, Sched, assert_exact, job_file};
use edl_sched::cluster::state::{EventLog, check_slots};

/// The job's worker processes as the scheduler saved them: (name, pid).
fn workers_of(sched: &Sched, job: &str) -> Vec<(String, u32)> {
    let text = std::fs::read_to_string(sched.state.join("sched.json")).expect("sched.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("sched.json is JSON");
    let jobs = v["jobs"].as_array().cloned().unwrap_or_default();
    let Some(j) = jobs.iter().find(|j| j["name"] == job) else {
        return Vec::new();
    };
    j["procs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|p| !p["slot"].is_null())
        .map(|p| {
            (
                p["name"].as_str().unwrap_or_default().to_string(),
                p["pid"].as_u64().unwrap_or_default() as u32,
            )
        })
        .collect()
}

/// Waits until `f` holds (at most 120 s).
fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_custom_program_is_resized_killed_and_migrated_beside_a_builtin_job() {
    if !edl_testkit::have_fashion_mnist() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let sched = Sched::start(dir.path(), "elastic", true);
    let builtin = job_file(dir.path(), "builtin", 16_000);
    let custom = edl_testkit::test_worker_job(
        dir.path(),
        &sched.bins,
        60_000,
        150,
        "consistency = \"asp\"\npartition_size = 256\nlease_ms = 2000",
    );

    // The built-in job takes every slot; the custom one makes the policy share them.
    sched.submit(&builtin, "builtin", 4);
    sched.wait(
        |j| j.iter().any(|j| j.name == "builtin" && j.samples > 0),
        "the built-in job did not start training",
    );
    sched.submit(&custom, "custom", 4);
    sched.wait(
        |j| j.iter().any(|j| j.name == "custom" && j.samples > 0),
        "the custom job did not start training",
    );
    let show = sched.edlctl(&["job", "show", "custom"]);
    let show = String::from_utf8_lossy(&show.stdout);
    assert!(
        show.contains("workers run") && show.contains("edl-test-worker"),
        "{show}"
    );

    // Migrate one through the job's coordinator, with the owner's certificate: a new worker
    // starts for the placement, and the old one leaves once it is admitted.
    let row = sched
        .jobs()
        .into_iter()
        .find(|j| j.name == "custom")
        .expect("the custom job");
    let moved = workers_of(&sched, "custom")
        .into_iter()
        .map(|(n, _)| n)
        .next()
        .expect("a worker to migrate");
    let pki = edl_shared::pki::PkiDir::new(Path::new(&row.dir));
    let role = edl_shared::Role::Admin;
    let out = std::process::Command::new(sched.bins.join("edlctl"))
        .args([
            "--coordinator",
            row.coordinator.as_deref().expect("running"),
        ])
        .args(["--ca".as_ref(), pki.ca_cert().as_os_str()])
        .args(["--cert".as_ref(), pki.node_cert(role, "edlctl").as_os_str()])
        .args(["--key".as_ref(), pki.node_key(role, "edlctl").as_os_str()])
        .args(["migrate", &moved, "--wait", "60s"])
        .output()
        .expect("run edlctl migrate");
    assert!(
        out.status.success(),
        "edlctl migrate {moved}: {}{}\n{:#?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        sched.jobs()
    );
    until("the migrated worker did not leave", || {
        !workers_of(&sched, "custom")
            .iter()
            .any(|(n, _)| *n == moved)
    });

    // SIGKILL another: the scheduler frees the slot and starts another.
    let before = workers_of(&sched, "custom");
    let (victim, pid) = before.first().cloned().expect("a custom worker");
    assert_ne!(victim, moved);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill a worker");
    until("no replacement for the killed worker", || {
        let now = workers_of(&sched, "custom");
        !now.iter().any(|(n, _)| *n == victim)
            && now.iter().any(|(n, _)| !before.iter().any(|(b, _)| b == n))
    });

    let jobs = sched.wait(
        |j| {
            j.iter()
                .all(|j| j.state != "queued" && j.state != "running")
        },
        "the jobs did not all end",
    );
    assert_exact(&jobs, "elastic");
    for j in &jobs {
        assert!(j.resizes >= 1, "{} was never resized: {j:#?}", j.name);
    }
    let events = EventLog::read(&sched.state.join("events.jsonl")).expect("event log");
    let slots: Vec<String> = (0..4).map(|i| format!("slot{i}")).collect();
    check_slots(&events, &slots).expect("no slot held twice");
    let jct = |n: &str| jobs.iter().find(|j| j.name == n).and_then(|j| j.jct_s);
    eprintln!(
        "custom program job: completion {:?} s; built-in job: {:?} s",
        jct("custom"),
        jct("builtin")
    );
}
