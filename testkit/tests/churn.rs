//! SSP and BSP under churn, in process: workers join, leave and die while others train. The
//! staleness bound holds at every grant across the changes, and nobody waits on a departed or
//! dead worker longer than the lease.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edl_shared::proto::Consistency;
use edl_testkit::{TestCluster, counter_job};

const LEASE_MS: u64 = 500;

#[derive(Clone, Copy, Debug)]
enum Ev {
    /// A worker is about to report this clock (logged before sending: an upper bound).
    Report(&'static str, u64),
    /// A worker was let go at this clock, with the minimum the coordinator granted it at.
    Grant(&'static str, u64, u64, Duration),
    /// A worker stopped counting (logged before its leave, or when it went silent).
    Gone(&'static str),
}

type Log = Arc<Mutex<Vec<(Instant, Ev)>>>;

fn log(l: &Log, ev: Ev) {
    l.lock().expect("log").push((Instant::now(), ev));
}

async fn churn(consistency: Consistency) -> anyhow::Result<()> {
    let s = consistency.staleness().expect("SSP or BSP");
    let mut job = counter_job(32, 8, consistency);
    job.lease_ms = LEASE_MS as u32;
    let cluster = TestCluster::start(job, 2).await?;
    let l: Log = Arc::default();

    // A: fast, 80 steps. B: slow, 15 steps, then leaves. C: joins late, 10 steps, then dies.
    let mut a = cluster.connect("a").await?.register("a").await?;
    let mut b = cluster.connect("b").await?.register("b").await?;
    let c_job = cluster.connect("c").await?;
    let g = vec![0.0f32; 32];

    let lb = l.clone();
    let gb = g.clone();
    let tb = tokio::spawn(async move {
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            b.push_step(&gb).await?;
            log(&lb, Ev::Report("b", b.clock().0 + 1));
            let t = Instant::now();
            let min = b.advance(0, 1, 0.0).await?;
            log(&lb, Ev::Grant("b", b.clock().0, min.0, t.elapsed()));
        }
        log(&lb, Ev::Gone("b"));
        b.leave().await?;
        anyhow::Ok(())
    });
    let lc = l.clone();
    let gc = g.clone();
    let tc = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let mut c = c_job.register("c").await?;
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            c.push_step(&gc).await?;
            log(&lc, Ev::Report("c", c.clock().0 + 1));
            let t = Instant::now();
            let min = c.advance(0, 1, 0.0).await?;
            log(&lc, Ev::Grant("c", c.clock().0, min.0, t.elapsed()));
        }
        // C hangs: no more steps, no more heartbeats.
        log(&lc, Ev::Gone("c"));
        c.stop_heartbeat();
        tokio::time::sleep(Duration::from_millis(3 * LEASE_MS)).await;
        anyhow::Ok(())
    });
    for _ in 0..80 {
        a.push_step(&g).await?;
        log(&l, Ev::Report("a", a.clock().0 + 1));
        let t = Instant::now();
        let min = tokio::time::timeout(Duration::from_secs(10), a.advance(0, 1, 0.0)).await??;
        log(&l, Ev::Grant("a", a.clock().0, min.0, t.elapsed()));
    }
    a.leave().await?;
    tb.await??;
    tc.await??;

    let events = l.lock().expect("log").clone();
    let mut reported = std::collections::HashMap::new();
    let mut gone = std::collections::HashSet::new();
    let mut joined_c = false;
    let mut longest_wait = Duration::ZERO;
    for (_, ev) in &events {
        match *ev {
            Ev::Report(who, clock) => {
                reported.insert(who, clock);
                joined_c |= who == "c";
            }
            Ev::Gone(who) => {
                gone.insert(who);
            }
            Ev::Grant(who, clock, min, waited) => {
                assert!(
                    clock <= min + s,
                    "{who} granted at {clock} with minimum {min}"
                );
                longest_wait = longest_wait.max(waited);
                // Against every worker known to be counting, using its reported clock (which
                // can only overstate it): nobody ran more than s ahead.
                for other in ["a", "b", "c"] {
                    if other == who || gone.contains(other) {
                        continue;
                    }
                    if let Some(&theirs) = reported.get(other) {
                        assert!(
                            clock <= theirs + s,
                            "{who} at {clock} while {other} had reported only {theirs}"
                        );
                    }
                }
            }
        }
    }
    assert!(joined_c, "the late worker never stepped");
    // Waiting for the dead worker is bounded by its lease (plus the sweep interval and slack).
    let bound = Duration::from_millis(LEASE_MS + 400);
    assert!(longest_wait <= bound, "a worker waited {longest_wait:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_bound_holds_across_joins_leaves_and_deaths() -> anyhow::Result<()> {
    churn(Consistency::Ssp { staleness: 2 }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bsp_bound_holds_across_joins_leaves_and_deaths() -> anyhow::Result<()> {
    churn(Consistency::Bsp).await
}
