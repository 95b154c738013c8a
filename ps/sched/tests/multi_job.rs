//! Real jobs on the scheduler: `edl-sched` on 4 slots of this machine, jobs submitted with
//! `edlctl job submit`, every process real (coordinators, shards, workers over QUIC with
//! per-job certificates). The same submission pattern runs under the elastic policy and
//! under static FIFO in one test; the elastic one must finish with a lower mean job
//! completion time, and under both no slot is ever held twice (replayed from the
//! scheduler's event log) and every job's ledger is exact.

mod common;

use std::path::Path;

use common::{ONE_AT_A_TIME, Sched, assert_exact, job_file};
use edl_sched::cluster::state::{EventLog, check_slots};

/// One long job that asks for all 4 slots, then two short ones that ask for 2 each, once the
/// long one runs. Returns the mean completion time.
fn run_pattern(dir: &Path, policy: &str) -> f64 {
    let sched = Sched::start(dir, policy, true);
    let long = job_file(dir, "long", 48_000);
    let short = job_file(dir, "short", 4_000);
    sched.submit(&long, "long", 4);
    sched.wait(
        |j| j.iter().any(|j| j.name == "long" && j.samples > 0),
        "the long job did not start training",
    );
    sched.submit(&short, "short-a", 2);
    sched.submit(&short, "short-b", 2);
    let jobs = sched.wait(
        |j| {
            j.iter()
                .all(|j| j.state != "queued" && j.state != "running")
        },
        "the jobs did not all end",
    );
    let mut jcts = Vec::new();
    assert_exact(&jobs, policy);
    for j in &jobs {
        jcts.push(j.jct_s.expect("finished jobs have a completion time"));
    }
    let events = EventLog::read(&sched.state.join("events.jsonl")).expect("event log");
    let slots: Vec<String> = (0..4).map(|i| format!("slot{i}")).collect();
    let most = check_slots(&events, &slots).unwrap_or_else(|e| panic!("{policy}: {e}"));
    assert!(most <= 4);
    let resizes: u32 = jobs.iter().map(|j| j.resizes).sum();
    let mean = jcts.iter().sum::<f64>() / jcts.len() as f64;
    eprintln!(
        "{policy}: completion times {jcts:.1?} s, mean {mean:.1} s; {resizes} resizes; at most \
         {most} slots held"
    );
    mean
}

#[test]
fn elastic_beats_fifo_on_the_same_jobs() {
    if !edl_testkit::have_fashion_mnist() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let elastic = run_pattern(dir.path(), "elastic");
    let fifo = run_pattern(dir.path(), "fifo");
    eprintln!(
        "mean completion time: elastic {elastic:.1} s, fifo {fifo:.1} s ({:.2} of fifo)",
        elastic / fifo
    );
    assert!(
        elastic < fifo,
        "elastic {elastic:.1} s is not below fifo {fifo:.1} s"
    );
}

/// Tiresias preempts without restarting anything: a job that has had its share is suspended
/// (its coordinator drains every worker and keeps the parameters and the data progress) for
/// a newcomer, and resumes later where it stopped. Both finish with exact ledgers.
#[test]
fn tiresias_suspends_and_resumes_jobs_stop_free() {
    if !edl_testkit::have_fashion_mnist() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let sched = Sched::start_with(
        dir.path(),
        "tiresias",
        2,
        "tiresias_threshold = \"2s\"\n",
        true,
    );
    let file = job_file(dir.path(), "job", 8_000);
    sched.submit(&file, "first", 2);
    sched.wait(
        |j| j.iter().any(|j| j.name == "first" && j.samples > 0),
        "the first job did not start training",
    );
    sched.submit(&file, "second", 2);
    let jobs = sched.wait(
        |j| {
            j.iter()
                .all(|j| j.state != "queued" && j.state != "running")
        },
        "the jobs did not all end",
    );
    assert_exact(&jobs, "tiresias");
    let events = EventLog::read(&sched.state.join("events.jsonl")).expect("event log");
    // The first job was suspended (resized to 0) while the second ran, then resumed.
    let first: Vec<Option<u32>> = events
        .iter()
        .filter(|e| e.job == "first" && (e.event == "start" || e.event == "resize"))
        .map(|e| e.alloc)
        .collect();
    let suspended = first.iter().position(|a| *a == Some(0));
    assert!(
        suspended.is_some_and(|i| first[i + 1..].contains(&Some(2))),
        "the first job was not suspended and resumed: {first:?}"
    );
    let slots: Vec<String> = (0..2).map(|i| format!("slot{i}")).collect();
    check_slots(&events, &slots).expect("no slot held twice");
}
