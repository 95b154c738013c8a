//! Two schedulers sharing a 3-member etcd (`edl-sched --meta`): one leads, the other stands by
//! and tells edlctl where the leader is; the leader is killed with SIGKILL while a job runs,
//! the standby takes the lead and the running job back, and every job finishes with an exact
//! ledger. The killed scheduler, started again, stands by.

mod common;

use std::time::{Duration, Instant};

use common::{Sched, assert_exact, job_file};
use edl_testkit::etcd::{EtcdCluster, have_etcd};

/// Waits until `sched`'s log says `what`.
fn wait_log(sched: &Sched, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !sched.log_text().contains(what) {
        assert!(
            Instant::now() < deadline,
            "{} never logged {what:?}:\n{}",
            sched.log.display(),
            sched.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_standby_scheduler_takes_over_the_running_jobs_when_the_leader_is_killed() {
    if !have_etcd() {
        return;
    }
    let _one = common::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = EtcdCluster::start(3, &dir.path().join("etcd")).expect("etcd");
    let url = etcd.url();
    let mut first = Sched::start_elected(dir.path(), "fifo", 0, &url, "2s");
    wait_log(&first, "edl-sched elected", Duration::from_secs(30));
    let mut second = Sched::start_elected(dir.path(), "fifo", 1, &url, "2s");
    wait_log(&second, "campaigning for the lead", Duration::from_secs(30));
    let both = format!("{},{}", first.addr, second.addr);

    // edlctl given only the standby is sent on to the leader.
    let listed = second.jobs();
    assert!(listed.is_empty(), "{listed:#?}");
    assert!(
        !second.log_text().contains("edl-sched elected"),
        "both schedulers lead:\n{}",
        second.log_text()
    );

    first.addr = both.clone();
    second.addr = both.clone();
    let file = job_file(dir.path(), "long", 12_000);
    first.submit(&file, "long", 2);
    first.wait(
        |jobs| jobs.iter().any(|j| j.name == "long" && j.samples > 0),
        "the first job trains",
    );
    first.kill();
    let killed = Instant::now();
    wait_log(&second, "edl-sched elected", Duration::from_secs(30));
    let took = killed.elapsed();
    assert!(
        second.log_text().contains("took back a running job"),
        "the new leader did not take the job back:\n{}",
        second.log_text()
    );
    // The new leader schedules: a job submitted now runs too.
    let short = job_file(dir.path(), "short", 2_048);
    second.submit(&short, "short", 1);
    // The killed scheduler comes back as a standby.
    first.relaunch();
    first.addr = both.clone();
    wait_log(&first, "campaigning for the lead", Duration::from_secs(30));
    let jobs = second.wait(
        |jobs| {
            jobs.len() == 2
                && jobs
                    .iter()
                    .all(|j| j.state != "queued" && j.state != "running")
        },
        "both jobs end",
    );
    assert_exact(&jobs, "after a scheduler failover");
    let relaunched = first.log_text();
    let led = relaunched.matches("edl-sched elected").count();
    assert_eq!(led, 1, "the restarted scheduler led again:\n{relaunched}");
    eprintln!(
        "the standby led {} ms after the leader's SIGKILL",
        took.as_millis()
    );
}
