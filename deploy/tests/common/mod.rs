//! Helpers shared by the launcher's end-to-end tests: where the binaries are, whether the
//! dataset is installed, and a short scenario run. (Each test binary uses a part of them.)
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use edl_deploy::{LocalConfig, Report, Scenario, ScenarioFile};
use edl_shared::proto::Consistency;
use edl_shared::shutdown::CancellationToken;
use edl_worker::data::DEFAULT_DATA_DIR;

/// Scenario runs take every core they can get and their events are timed: one at a time.
pub static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Training samples per epoch of a scenario run: a few seconds in a debug build.
pub const TRAIN_SAMPLES: u32 = 30_000;

/// Runs the scenario `text` (written to `dir`) on a short job of 2 shards and 2 workers: 2
/// epochs of small batches, so that there are many steps, a small MLP (784-64-10, 7 keys), a
/// 1 s lease. Panics if the run fails.
pub async fn run_scenario(dir: &Path, text: &str, seed: u64, restart_on_change: bool) -> Report {
    run(&scenario_config(dir, text, seed, restart_on_change, 2)).await
}

/// The configuration [`run_scenario`] runs, with `workers` workers, for tests that change
/// some of it.
pub fn scenario_config(
    dir: &Path,
    text: &str,
    seed: u64,
    restart_on_change: bool,
    workers: u32,
) -> LocalConfig {
    replicated_config(dir, text, seed, restart_on_change, workers, (2, 1))
}

/// [`scenario_config`] with `shards` shards keeping `replicas` copies of every key range.
pub fn replicated_config(
    dir: &Path,
    text: &str,
    seed: u64,
    restart_on_change: bool,
    workers: u32,
    (shards, replicas): (u32, u32),
) -> LocalConfig {
    let path = dir.join("scenario.toml");
    std::fs::write(&path, text).expect("write the scenario");
    LocalConfig {
        shards,
        workers,
        epochs: 2,
        consistency: "ssp:2".parse::<Consistency>().expect("consistency"),
        optimizer: "adam:0.001".parse().expect("optimizer"),
        schedule: Default::default(),
        batch_size: 16,
        train_samples: TRAIN_SAMPLES,
        lease_ms: 1000,
        replicas: (replicas > 1).then_some(replicas),
        wire: None,
        layers: vec![784, 64, 10],
        seed,
        data_dir: DEFAULT_DATA_DIR.into(),
        report: Some(dir.join("report.json")),
        trace: None,
        state_dir: Some(dir.join("state")),
        bin_dir: Some(bin_dir()),
        progress_bar: false,
        stall_timeout: Some(Duration::from_secs(60)),
        scenario: Some(ScenarioFile {
            scenario: Scenario::parse_with(text, workers, shards, replicas).expect("scenario"),
            path,
        }),
        restart_on_change,
        elastic: Default::default(),
        observe: Default::default(),
        job: None,
    }
}

/// Runs `cfg`; panics if the run fails.
pub async fn run(cfg: &LocalConfig) -> Report {
    edl_deploy::run(cfg, CancellationToken::new())
        .await
        .expect("the run succeeds")
}

/// Where the server and worker binaries are: `EDL_BIN_DIR`, or next to this test's launcher.
/// Panics with what to do when they are not there.
pub fn bin_dir() -> PathBuf {
    let dir = match std::env::var_os("EDL_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_BIN_EXE_edl-local"))
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default(),
    };
    if !dir.join("edl-ps").is_file() || !dir.join("edl-worker").is_file() {
        panic!(
            "edl-ps and edl-worker are not in {}: build them (cargo build) or set EDL_BIN_DIR",
            dir.display()
        );
    }
    dir
}

/// True when Fashion-MNIST is installed (see [`edl_testkit::have_fashion_mnist`]).
pub fn have_dataset() -> bool {
    edl_testkit::have_fashion_mnist()
}
