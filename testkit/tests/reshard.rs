//! Online resharding on an in-process cluster: key ranges move back and forth between three
//! shards while clients push known increments, and afterwards every parameter equals the sum
//! of the acknowledged pushes exactly (not approximately: counters of small integers are exact
//! in f32). Adding and removing a shard rebalances the same way.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use edl_shared::proto::{Clock, Consistency, Key};
use edl_testkit::{TestCluster, counter_job};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const FLOATS: usize = 2000;
const CHUNK: u32 = 100;
const KEYS: u64 = FLOATS as u64 / CHUNK as u64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_exact_while_ranges_move_between_three_shards() -> anyhow::Result<()> {
    const CLIENTS: usize = 4;
    let mut cluster =
        TestCluster::start(counter_job(FLOATS as u32, CHUNK, Consistency::Asp), 2).await?;
    let admin = cluster.admin().await?;
    let third = cluster.add_shard("s2").await?;
    let added = admin.shard_add(&third.to_string()).await?;
    assert!(!added.moves.is_empty(), "the new shard gets keys");
    assert_eq!(added.layout.len(), 3);

    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..CLIENTS {
        let session = cluster
            .connect(&format!("c{i}"))
            .await?
            .register("c")
            .await?;
        let stop = stop.clone();
        clients.spawn(async move {
            // Client i adds (i + 1) to every counter per dense push, and 1 to key i's counters
            // per sparse push. Every push must be acknowledged: the library re-routes parts
            // refused under an old map.
            let dense = vec![-(i as f32 + 1.0); FLOATS];
            let sparse = vec![-1.0f32; CHUNK as usize];
            let (mut dense_acks, mut sparse_acks) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                session.push_step(&dense).await?;
                dense_acks += 1;
                session.push_keys(&[(Key(i as u64), &sparse)]).await?;
                sparse_acks += 1;
            }
            session.leave().await?;
            anyhow::Ok((i, dense_acks, sparse_acks))
        });
    }

    // Move ranges back and forth while the clients push.
    let mut rng = StdRng::seed_from_u64(5);
    let mut moves = 0;
    let mut holds = Vec::new();
    for _ in 0..24 {
        let start = rng.random_range(0..KEYS - 1);
        let end = rng.random_range(start + 1..=(start + 6).min(KEYS));
        let to = format!("s{}", rng.random_range(0..3));
        let v = admin.move_range(start, end, &to).await?;
        moves += v.moves.len();
        holds.extend(v.moves.iter().map(|m| m.hold_ms));
        tokio::time::sleep(std::time::Duration::from_millis(15)).await;
    }
    let rebalanced = admin.reshard(false).await?;
    moves += rebalanced.moves.len();
    stop.store(true, Ordering::Relaxed);

    let mut want = vec![0f32; FLOATS];
    let mut pushes = 0;
    while let Some(joined) = clients.join_next().await {
        let (i, dense, sparse) = joined??;
        assert!(dense > 0, "client {i} pushed nothing");
        pushes += dense + sparse;
        for v in want.iter_mut() {
            *v += (i as f32 + 1.0) * dense as f32;
        }
        let key = i * CHUNK as usize;
        for v in &mut want[key..key + CHUNK as usize] {
            *v += sparse as f32;
        }
    }
    assert!(moves >= 20, "only {moves} moves happened");

    let reader = cluster.connect("reader").await?;
    let mut got = vec![0f32; FLOATS];
    reader.pull_all(&mut got, Clock(0)).await?;
    let wrong: Vec<usize> = (0..FLOATS).filter(|&k| got[k] != want[k]).collect();
    assert!(
        wrong.is_empty(),
        "{} of {FLOATS} counters differ after {pushes} pushes and {moves} moves; first: float {} is {} not {}",
        wrong.len(),
        wrong[0],
        got[wrong[0]],
        want[wrong[0]]
    );
    // Every shard holds about a third of the keys after the rebalance.
    let rows = admin.shard_stats().await?;
    let held: Vec<u64> = rows.iter().map(|(r, _)| r.keys).collect();
    assert_eq!(held.iter().sum::<u64>(), KEYS);
    assert!(held.iter().all(|&k| (6..=7).contains(&k)), "{held:?}");
    eprintln!(
        "{pushes} pushes, {moves} moves; range hold ms: max {:.1}",
        holds.iter().copied().fold(0.0, f64::max)
    );
    cluster.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_shard_hands_over_everything_and_retires() -> anyhow::Result<()> {
    let cluster =
        TestCluster::start(counter_job(FLOATS as u32, CHUNK, Consistency::Asp), 3).await?;
    let admin = cluster.admin().await?;
    let session = cluster.connect("c").await?.register("c").await?;
    session.push_step(&vec![-2.0; FLOATS]).await?;
    let v = admin.shard_remove("s1").await?;
    assert!(v.layout.iter().all(|(id, _)| *id != 1), "{:?}", v.layout);
    // The session routes with the old map; its next push is re-routed transparently.
    session.push_step(&vec![-3.0; FLOATS]).await?;
    let mut got = vec![0f32; FLOATS];
    session.pull(&mut got).await?;
    assert!(got.iter().all(|&v| v == 5.0));
    let rows = admin.shard_stats().await?;
    let roles: Vec<(u32, &str)> = rows.iter().map(|(r, _)| (r.id, r.role.as_str())).collect();
    assert_eq!(roles, vec![(0, "active"), (1, "retired"), (2, "active")]);
    // Refusals are clear: the retired shard cannot take keys, and ranges must exist.
    let err = admin.move_range(0, 2, "s1").await.expect_err("retired");
    assert!(err.to_string().contains("removed"), "{err}");
    let err = admin
        .move_range(5, 999, "s0")
        .await
        .expect_err("no such keys");
    assert!(err.to_string().contains("not a range"), "{err}");
    cluster.stop().await;
    Ok(())
}
