//! The scheduler's loop through the placer's test double (`edl_testkit::placer::ThreadPlacer`):
//! jobs in this process, their workers synthetic threads, every placer call recorded. Fast and
//! without processes, so the loop's decisions are checked directly: what it starts and stops
//! where, how a resize reaches the placer, what it refuses, and what a failed start does.

use std::path::Path;
use std::time::{Duration, Instant};

use edl_sched::cluster::server::Ask;
use edl_sched::cluster::state::{EventLog, check_slots};
use edl_sched::cluster::{Cluster, Scheduler};
use edl_shared::proto::ErrorCode;
use edl_shared::proto::sched::{JobRecord, JobState, SchedRequest, SchedResponse, Submission};
use edl_shared::shutdown::CancellationToken;
use edl_testkit::placer::{Call, ThreadPlacer};
use edl_testkit::synthetic::SleepModel;
use tokio::sync::{mpsc, oneshot};

/// The synthetic job (one 64-float tensor) as a job file, its `[worker]` program named (the
/// double never runs it) so that the scheduler takes the custom model.
fn job_file(samples: u32) -> String {
    format!(
        "[model]\nkind = \"custom\"\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.01\n\n[training]\n\
         consistency = \"asp\"\nbatch_size = 8\nepochs = 1\nsamples = {samples}\n\
         partition_size = 256\nlease_ms = 3000\nchunk_size = 32\n\n\
         [[tensor]]\nname = \"w\"\nshape = [64]\ninit = \"zeros\"\n\n\
         [worker]\ncommand = [\"synthetic\"]\n"
    )
}

struct Loop {
    tx: mpsc::Sender<Ask>,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Loop {
    async fn start(dir: &Path, cluster: &str, placer: ThreadPlacer) -> Loop {
        edl_shared::telemetry::init("warn");
        let cluster = Cluster::parse(cluster).expect("cluster file");
        let sched = Scheduler::new(cluster, dir, placer)
            .await
            .expect("scheduler");
        let (tx, rx) = mpsc::channel(16);
        let stop = CancellationToken::new();
        let done = tokio::spawn(sched.run(rx, stop.clone(), true));
        Loop { tx, stop, done }
    }

    async fn ask(&self, req: SchedRequest) -> Result<SchedResponse, (ErrorCode, String)> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Ask {
                req,
                who: "alice".into(),
                reply,
            })
            .await
            .expect("the loop runs");
        answer.await.expect("an answer")
    }

    async fn submit(
        &self,
        name: &str,
        text: &str,
        workers: u32,
        min: u32,
    ) -> Result<SchedResponse, (ErrorCode, String)> {
        self.ask(SchedRequest::Submit(Submission {
            name: name.into(),
            job_file: text.into(),
            file_dir: "/tmp".into(),
            workers,
            min_workers: min,
            max_workers: workers,
            priority: 0,
        }))
        .await
    }

    async fn jobs(&self) -> Vec<JobRecord> {
        match self.ask(SchedRequest::List).await {
            Ok(SchedResponse::Jobs(j)) => j,
            other => panic!("{other:?}"),
        }
    }

    async fn wait(&self, what: &str, f: impl Fn(&[JobRecord]) -> bool) -> Vec<JobRecord> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let jobs = self.jobs().await;
            if f(&jobs) {
                return jobs;
            }
            assert!(Instant::now() < deadline, "{what}: {jobs:#?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.done
            .await
            .expect("the loop ends")
            .expect("the loop was not deposed");
    }
}

const ELASTIC: &str = "policy = \"elastic\"\nslots = 4\nshards = 1\nresize_interval = \"1s\"\n\
                       resize_overhead = 1.0\n";

fn calls(c: &std::sync::Mutex<Vec<Call>>) -> Vec<Call> {
    c.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_shrinks_a_job_through_the_placer_and_both_finish_exactly_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = SleepModel {
        step: Duration::from_millis(10),
        units: None,
    };
    let placer = ThreadPlacer::new(model, 20_000);
    let log = placer.calls.clone();
    let l = Loop::start(dir.path(), ELASTIC, placer).await;
    l.submit("big", &job_file(20_000), 4, 1)
        .await
        .expect("submit");
    l.wait("big does not train on 4 workers", |j| {
        j.iter()
            .any(|j| j.name == "big" && j.running == 4 && j.samples.0 > 0)
    })
    .await;
    l.submit("small", &job_file(4_000), 2, 1)
        .await
        .expect("submit");
    let jobs = l
        .wait("the jobs do not both finish", |j| {
            j.iter().all(|j| j.state == JobState::Finished)
        })
        .await;
    for j in &jobs {
        let ledger = j.ledger.expect("a finished job's ledger");
        assert_eq!(
            (ledger.applied, ledger.duplicates, ledger.missing),
            (j.samples.1, 0, 0),
            "{j:#?}"
        );
        assert_eq!(j.runs, "synthetic");
    }
    let big = jobs.iter().find(|j| j.name == "big").expect("big");
    assert!(big.resizes >= 1, "{big:#?}");
    let calls = calls(&log);
    // Each job's servers were started once and stopped once, in that order.
    for job in ["big", "small"] {
        let start = calls
            .iter()
            .position(|c| *c == Call::StartServers(job.into()));
        let stop = calls.iter().position(|c| *c == Call::StopJob(job.into()));
        assert!(start.is_some() && start < stop, "{job}: {calls:#?}");
    }
    // small's workers started while big still ran, in slots big gave up (its coordinator
    // drained its newest workers: no signal from the placer).
    let first_small = calls
        .iter()
        .position(|c| matches!(c, Call::StartWorker(j, ..) if j == "small"));
    let big_stopped = calls.iter().position(|c| *c == Call::StopJob("big".into()));
    assert!(first_small < big_stopped, "{calls:#?}");
    let started = |job: &str| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::StartWorker(j, ..) if j == job))
            .count()
    };
    assert!(started("big") >= 4 && started("small") >= 1, "{calls:#?}");
    let events = EventLog::read(&dir.path().join("events.jsonl")).expect("event log");
    let slots: Vec<String> = (0..4).map(|i| format!("slot{i}")).collect();
    check_slots(&events, &slots).expect("no slot held twice");
    let shrunk = events
        .iter()
        .any(|e| e.job == "big" && e.event == "resize" && e.alloc.is_some_and(|a| a < 4));
    assert!(shrunk, "big was not shrunk for small: {events:#?}");
    l.stop().await;
}

#[tokio::test]
async fn what_the_loop_refuses_and_a_start_that_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = SleepModel {
        step: Duration::from_millis(1),
        units: None,
    };
    let placer = ThreadPlacer::new(model, 1_000).failing_servers();
    let log = placer.calls.clone();
    let l = Loop::start(dir.path(), ELASTIC, placer).await;

    // A custom model that names no program: edl-worker could not train it.
    let bare = job_file(1_000).replace("[worker]\ncommand = [\"synthetic\"]\n", "");
    let e = l.submit("bare", &bare, 2, 1).await.expect_err("refused");
    assert_eq!(e.0, ErrorCode::InvalidRequest);
    assert!(e.1.contains("[worker]"), "{}", e.1);
    // A [worker] table with a reserved variable is named with its line.
    let reserved = format!("{}env = {{ EDL_NAME = \"x\" }}\n", job_file(1_000));
    let e = l
        .submit("reserved", &reserved, 2, 1)
        .await
        .expect_err("refused");
    assert!(e.1.contains("worker.env.EDL_NAME"), "{}", e.1);
    assert!(
        calls(&log).is_empty(),
        "nothing reached the placer: {:?}",
        calls(&log)
    );

    // Servers that cannot start fail the job, with the placer's reason; no worker starts.
    l.submit("doomed", &job_file(1_000), 2, 1)
        .await
        .expect("submit");
    let jobs = l
        .wait("the job did not fail", |j| {
            j.iter()
                .any(|j| j.name == "doomed" && j.state == JobState::Failed)
        })
        .await;
    let doomed = jobs.iter().find(|j| j.name == "doomed").expect("doomed");
    assert!(doomed.message.contains("cannot start"), "{doomed:#?}");
    let calls = calls(&log);
    assert_eq!(calls[0], Call::StartServers("doomed".into()), "{calls:?}");
    assert!(
        !calls.iter().any(|c| matches!(c, Call::StartWorker(..))),
        "{calls:?}"
    );
    l.stop().await;
}

/// The scheduler's disk fails (`sched.json` cannot be replaced: a directory stands in its
/// place): a submission is not answered while what it changed cannot be made durable, and is
/// answered, with the state on disk, once the disk works again.
#[tokio::test]
async fn a_scheduler_whose_disk_fails_answers_nothing_it_could_not_make_durable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = SleepModel {
        step: Duration::from_millis(1),
        units: None,
    };
    let l = Loop::start(dir.path(), ELASTIC, ThreadPlacer::new(model, 1_000)).await;
    let file = dir.path().join("sched.json");
    let on_disk = |name: &str| {
        std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| {
                v["jobs"]
                    .as_array()
                    .is_some_and(|jobs| jobs.iter().any(|j| j["name"] == name))
            })
    };
    l.submit("first", &job_file(100_000), 1, 1)
        .await
        .expect("submit");
    assert!(on_disk("first"), "answered before it was on disk");

    // The disk fails: the atomic rename over sched.json cannot succeed.
    std::fs::remove_file(&file).expect("removes sched.json");
    std::fs::create_dir_all(file.join("in-the-way")).expect("a directory in its place");
    let tx = l.tx.clone();
    let mut pending = tokio::spawn(async move {
        let (reply, answer) = oneshot::channel();
        tx.send(Ask {
            req: SchedRequest::Submit(Submission {
                name: "second".into(),
                job_file: job_file(1_000),
                file_dir: "/tmp".into(),
                workers: 1,
                min_workers: 1,
                max_workers: 1,
                priority: 0,
            }),
            who: "alice".into(),
            reply,
        })
        .await
        .expect("the loop runs");
        answer.await.expect("an answer")
    });
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut pending)
            .await
            .is_err(),
        "answered while its state could not be written"
    );

    // The disk works again: the answer comes, and the state it answered is on disk.
    std::fs::remove_dir_all(&file).expect("clears the way");
    tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("answered once the disk works")
        .expect("the task")
        .expect("submitted");
    assert!(on_disk("second"), "the answered submission is not on disk");
    l.stop().await;
}
