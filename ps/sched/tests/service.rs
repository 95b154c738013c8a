//! The scheduler as a service, with real jobs: who may do what (a job belongs to the name in
//! its submitter's certificate; the certificates of one job get nothing from another job's
//! servers) and durability (stopped and started again, the scheduler takes back the jobs
//! still running, and they finish with exact ledgers).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Sched, job_file};
use edl_ps::cluster::JobRow;
use edl_sched::cluster::state::{EventLog, check_slots};
use edl_shared::pki::{CLUSTER_SERVER_NAME, load_identity};
use edl_shared::proto::ErrorCode;
use edl_shared::transport::{TransportSettings, client_endpoint};

fn row(jobs: &[JobRow], name: &str) -> JobRow {
    jobs.iter()
        .find(|j| j.name == name)
        .unwrap_or_else(|| panic!("no job {name}: {jobs:#?}"))
        .clone()
}

/// `role-name` credentials from a job's certificate directory.
fn creds(job_dir: &str, file: &str) -> (PathBuf, PathBuf, PathBuf) {
    let pki = Path::new(job_dir).join("pki");
    (
        pki.join("ca.pem"),
        pki.join(format!("{file}.pem")),
        pki.join(format!("{file}.key")),
    )
}

/// Connects to `addr` with the credentials `c` and returns how the server closed the
/// connection: its error code and reason.
fn refusal(c: &(PathBuf, PathBuf, PathBuf), addr: &str) -> (u64, String) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let id = load_identity(&c.0, &c.1, &c.2).expect("identity");
        let ep = client_endpoint(&id, &TransportSettings::default(), false).expect("endpoint");
        let addr = addr.parse().expect("address");
        let closed = tokio::time::timeout(Duration::from_secs(20), async {
            let conn = ep
                .connect(addr, CLUSTER_SERVER_NAME)
                .expect("connect")
                .await
                .expect("TLS handshake");
            conn.closed().await
        })
        .await
        .expect("the server closes the connection");
        match closed {
            quinn::ConnectionError::ApplicationClosed(c) => (
                c.error_code.into_inner(),
                String::from_utf8_lossy(&c.reason).into_owned(),
            ),
            other => panic!("expected a refusal, got {other}"),
        }
    })
}

#[test]
fn jobs_are_isolated_owned_and_outlive_a_scheduler_restart() {
    if !edl_testkit::have_fashion_mnist() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sched = Sched::start(dir.path(), "elastic", false);
    let file = job_file(dir.path(), "job", 40_000);
    let file = file.to_str().expect("utf-8 path");
    sched.submit(Path::new(file), "alpha", 2);
    let bob = sched.edlctl_as(
        "bob",
        &[
            "job",
            "submit",
            file,
            "--job",
            "beta",
            "--workers",
            "2",
            "--min",
            "1",
            "--max",
            "2",
        ],
    );
    assert!(
        bob.status.success(),
        "{}",
        String::from_utf8_lossy(&bob.stderr)
    );
    let jobs = sched.wait(
        |j| {
            ["alpha", "beta"].iter().all(|n| {
                j.iter()
                    .any(|j| j.name == *n && j.samples > 0 && j.running > 0)
            })
        },
        "both jobs train",
    );
    let (alpha, beta) = (row(&jobs, "alpha"), row(&jobs, "beta"));
    assert_eq!(
        (alpha.owner.as_str(), beta.owner.as_str()),
        ("edlctl", "bob")
    );

    // A job the scheduler cannot run is refused at submission, with the reason.
    let custom = dir.path().join("custom.toml");
    std::fs::write(
        &custom,
        "[model]\nkind = \"custom\"\n[[tensor]]\nname = \"w\"\nshape = [4]\ninit = \"zeros\"\n",
    )
    .expect("write");
    let out = sched.edlctl_as(
        "edlctl",
        &["job", "submit", custom.to_str().expect("utf-8")],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("custom"), "{err}");
    // A job whose workers keep failing (its data is missing) fails, with the workers' error,
    // instead of starting workers forever.
    let broken = dir.path().join("broken.toml");
    std::fs::write(
        &broken,
        "[model]\nkind = \"logreg\"\nfeatures = 8\n[training]\nsamples = 100\n\
         [data]\nformat = \"libsvm\"\ntrain = \"/nonexistent/train.libsvm\"\n",
    )
    .expect("write");
    sched.submit(&broken, "broken", 1);
    let jobs = sched.wait(
        |j| j.iter().any(|j| j.name == "broken" && j.state == "failed"),
        "the broken job did not fail",
    );
    let b = row(&jobs, "broken");
    assert!(b.message.contains("in a row"), "{}", b.message);

    // Only a job's owner (or an operator) may cancel it.
    let out = sched.edlctl_as("mallory", &["job", "cancel", "alpha"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to edlctl"), "{err}");

    // A worker certified for alpha gets nothing from beta's coordinator or shard.
    let beta_coordinator = beta.coordinator.clone().expect("beta runs");
    let beta_shard = std::fs::read_to_string(Path::new(&beta.dir).join("s0.addr"))
        .expect("beta's shard address");
    let alpha_worker = creds(&alpha.dir, "worker-p1");
    for addr in [&beta_coordinator, &beta_shard] {
        let (code, why) = refusal(&alpha_worker, addr);
        assert_eq!(
            code,
            u64::from(ErrorCode::WrongJob.as_u16()),
            "{addr}: {why}"
        );
        assert!(
            why.contains("\"alpha\"") && why.contains("\"beta\""),
            "{why}"
        );
    }
    // Nor does the scheduler's own client certificate (job "default").
    let pki = sched.state.join("pki");
    let cluster_admin = (
        pki.join("ca.pem"),
        pki.join("admin-edlctl.pem"),
        pki.join("admin-edlctl.key"),
    );
    let (code, _) = refusal(&cluster_admin, &beta_coordinator);
    assert_eq!(code, u64::from(ErrorCode::WrongJob.as_u16()));
    // Bob's certificate for beta reaches beta, and alpha's owner's does not.
    let status = |c: &(PathBuf, PathBuf, PathBuf)| {
        std::process::Command::new(sched.bins.join("edlctl"))
            .args(["--coordinator", &beta_coordinator])
            .args(["--ca".as_ref(), c.0.as_os_str()])
            .args(["--cert".as_ref(), c.1.as_os_str()])
            .args(["--key".as_ref(), c.2.as_os_str()])
            .arg("status")
            .output()
            .expect("edlctl status")
    };
    let ok = status(&creds(&beta.dir, "admin-bob"));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(!status(&creds(&alpha.dir, "admin-edlctl")).status.success());

    // The scheduler stops and starts again: the jobs train on and it takes them back.
    sched.restart();
    let jobs = sched.jobs();
    for name in ["alpha", "beta"] {
        let j = row(&jobs, name);
        assert_eq!(j.state, "running", "{j:#?}");
    }
    let jobs = sched.wait(
        |j| {
            j.iter()
                .all(|j| j.state != "queued" && j.state != "running")
        },
        "the jobs did not finish",
    );
    for j in jobs.iter().filter(|j| j.name != "broken") {
        assert_eq!(j.state, "finished", "{j:#?}");
        let l = j.ledger.expect("a finished job's ledger");
        assert_eq!(
            (l.applied, l.duplicates, l.missing),
            (j.samples_total, 0, 0)
        );
    }
    let events = EventLog::read(&sched.state.join("events.jsonl")).expect("event log");
    let adopted = events.iter().filter(|e| e.event == "adopt").count();
    assert_eq!(adopted, 2, "{events:#?}");
    let slots: Vec<String> = (0..4).map(|i| format!("slot{i}")).collect();
    check_slots(&events, &slots).expect("no slot held twice");
}
