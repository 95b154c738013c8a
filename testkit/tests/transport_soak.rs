//! Many sequential and concurrent calls on one connection must not stall.

use std::time::Duration;

use edl_shared::proto::Consistency;
use edl_testkit::{TestCluster, counter_job};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_calls_on_one_connection_do_not_stall() -> anyhow::Result<()> {
    let cluster = TestCluster::start(counter_job(64, 16, Consistency::Asp), 1).await?;
    let job = cluster.connect("soak").await?;
    let mut v = vec![0f32; 64];
    for i in 0..6000 {
        tokio::time::timeout(Duration::from_secs(5), job.status())
            .await
            .map_err(|_| anyhow::anyhow!("status call {i} stalled"))??;
        if i % 3 == 0 {
            tokio::time::timeout(
                Duration::from_secs(5),
                job.pull_all(&mut v, edl_shared::proto::Clock(0)),
            )
            .await
            .map_err(|_| anyhow::anyhow!("pull {i} stalled"))??;
        }
    }
    Ok(())
}
