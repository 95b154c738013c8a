//! A custom-model job from a job file, run with real processes: `edl-ps coordinator --job`,
//! two `edl-ps shard`s and two workers of the two-layer example (`edl-test-worker`, which
//! logs each batch it is handed). One worker is killed with SIGKILL while it trains; the other
//! finishes the epoch. Every shard's ledger must be exact, and every batch either process
//! was handed must hold the indices of the specified epoch order for its span, so a span
//! re-issued from the dead worker to the live one has the same indices in both processes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_shared::proto::order::epoch_order;
use edl_testkit::{assert_exactly_once, have_fashion_mnist};
use edl_worker::client::{ClientConfig, Job};
use tokio::process::{Child, Command};

const SAMPLES: u32 = 4_000;

fn bin(name: &str) -> anyhow::Result<PathBuf> {
    let dir = Path::new(env!("CARGO_BIN_EXE_edl-test-worker"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let path = dir.join(name);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build it first (cargo build -p edl-ps)",
        path.display()
    );
    Ok(path)
}

fn spawn(program: &Path, args: &[&str], log: &Path) -> anyhow::Result<Child> {
    let out = std::fs::File::create(log)?;
    Ok(Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true)
        .spawn()?)
}

async fn wait_for_file(path: &Path, limit: Duration) -> anyhow::Result<String> {
    let until = Instant::now() + limit;
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && !s.trim().is_empty()
        {
            return Ok(s.trim().to_string());
        }
        anyhow::ensure!(Instant::now() < until, "{} did not appear", path.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The batches a worker logged: (epoch, start, end) → indices.
fn batches(log: &Path) -> anyhow::Result<HashMap<(u32, u32, u32), Vec<u32>>> {
    let mut out = HashMap::new();
    for line in std::fs::read_to_string(log)?.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let [e, s, t, idx] = f[..] else {
            continue; // a line cut short by the kill
        };
        let indices: Result<Vec<u32>, _> = idx.split(',').map(str::parse).collect();
        let (Ok(indices), Ok(e), Ok(s), Ok(t)) = (indices, e.parse(), s.parse(), t.parse()) else {
            continue;
        };
        out.insert((e, s, t), indices);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_model_job_keeps_exactly_once_when_a_worker_is_killed() -> anyhow::Result<()> {
    if !have_fashion_mnist() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    // The example job, shortened: one epoch of 4,000 samples, a 1 s lease.
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/jobs/two-layer.toml"),
    )?;
    let mut short = text.clone();
    for (from, to) in [
        (
            "samples = 60000",
            "samples = 4000\npartition_size = 512\nlease_ms = 1000",
        ),
        ("epochs = 3", "epochs = 1"),
    ] {
        anyhow::ensure!(short.contains(from), "two-layer.toml has no {from:?}");
        short = short.replacen(from, to, 1);
    }
    let job_file = dir.path().join("job.toml");
    std::fs::write(&job_file, short)?;
    let job = edl_shared::jobfile::load(&job_file)?;

    let ps = bin("edl-ps")?;
    let worker = PathBuf::from(env!("CARGO_BIN_EXE_edl-test-worker"));
    let (st, jf) = (state.to_string_lossy(), job_file.to_string_lossy());
    let addr_file = dir.path().join("coordinator.addr");
    let af = addr_file.to_string_lossy();
    let _coordinator = spawn(
        &ps,
        &[
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--addr-file",
            &af,
            "--shards",
            "2",
            "--job",
            &jf,
            "--state-dir",
            &st,
            "--no-persist",
        ],
        &dir.path().join("coordinator.log"),
    )?;
    let addr = wait_for_file(&addr_file, Duration::from_secs(60)).await?;
    let mut shards = Vec::new();
    for name in ["s0", "s1"] {
        shards.push(spawn(
            &ps,
            &[
                "shard",
                "--coordinator",
                &addr,
                "--listen",
                "127.0.0.1:0",
                "--name",
                name,
                "--state-dir",
                &st,
                "--no-checkpoint",
            ],
            &dir.path().join(format!("{name}.log")),
        )?);
    }
    let (log_a, log_b) = (dir.path().join("a.batches"), dir.path().join("b.batches"));
    let mut a = spawn(
        &worker,
        &[&addr, &st, "wa", &log_a.to_string_lossy()],
        &dir.path().join("wa.log"),
    )?;
    let mut b = spawn(
        &worker,
        &[&addr, &st, "wb", &log_b.to_string_lossy()],
        &dir.path().join("wb.log"),
    )?;
    // Kill A once it has been handed a few batches: it dies in the middle of a step.
    let until = Instant::now() + Duration::from_secs(120);
    while batches(&log_a).map(|m| m.len()).unwrap_or(0) < 4 {
        anyhow::ensure!(Instant::now() < until, "worker A never trained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.start_kill()?;
    a.wait().await?;
    let done = tokio::time::timeout(Duration::from_secs(180), b.wait()).await??;
    let b_log = std::fs::read_to_string(dir.path().join("wb.log")).unwrap_or_default();
    anyhow::ensure!(done.success(), "worker B failed: {done}\n{b_log}");

    let identity = PkiDir::new(&state).ensure(Role::Worker, "check")?;
    let cfg = ClientConfig {
        coordinator: addr.clone(),
        identity,
        settings: Default::default(),
    };
    let check = Job::connect(&cfg).await?;
    assert!(check.status().await?.finished);
    assert_exactly_once(&check, u64::from(SAMPLES)).await?;

    let (from_a, from_b) = (batches(&log_a)?, batches(&log_b)?);
    let order = epoch_order(job.seed, 0, SAMPLES);
    for (who, spans) in [("A", &from_a), ("B", &from_b)] {
        for (&(e, s, t), indices) in spans {
            assert_eq!(e, 0);
            assert_eq!(
                indices[..],
                order[s as usize..t as usize],
                "worker {who}'s batch {s}..{t}"
            );
        }
    }
    let both = from_a.keys().filter(|k| from_b.contains_key(k)).count();
    eprintln!(
        "A was handed {} batches, B {}; {both} span(s) re-issued from A to B with the same \
         indices",
        from_a.len(),
        from_b.len()
    );
    Ok(())
}
