//! A test aid, not a product binary: the worker of `worker/examples/two_layer.rs`, logging
//! every batch it is handed (epoch, span and sample indices, one line each, flushed), so that
//! a test can kill it and compare the indices another process gets for the same span.
//!
//! Usage: `edl-test-worker COORDINATOR STATE_DIR NAME LOG`, or with no arguments as a job's
//! `[worker]` program: connected by the process contract's environment, honouring SIGTERM,
//! logging nothing, pausing `EDL_TEST_STEP_MS` before each step.

use std::io::Write;

use anyhow::Context;
use edl_shared::Role;
use edl_shared::pki::PkiDir;
use edl_worker::client::ClientConfig;
use edl_worker::data::{DEFAULT_DATA_DIR, ImageSet};

#[path = "../../../worker/examples/two_layer.rs"]
#[allow(dead_code)]
mod two_layer;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        // EDL_TEST_STEP_MS: a pause before each step, so that a test's job lives long enough
        // to be resized, killed and migrated.
        let pause = match std::env::var("EDL_TEST_STEP_MS") {
            Ok(ms) => std::time::Duration::from_millis(ms.parse().context("EDL_TEST_STEP_MS")?),
            Err(_) => std::time::Duration::ZERO,
        };
        let job = edl_worker::client::Job::from_env().await?;
        let data = ImageSet::load_prefix(&std::path::Path::new(DEFAULT_DATA_DIR).join("train"))?;
        let steps = two_layer::train(job, &data, true, |_| {
            std::thread::sleep(pause);
            Ok(())
        })
        .await?;
        eprintln!("edl-test-worker: {steps} steps");
        return Ok(());
    }
    let [coordinator, state, name, log] = &args[..] else {
        anyhow::bail!("usage: edl-test-worker COORDINATOR STATE_DIR NAME LOG");
    };
    let identity = PkiDir::new(state.as_ref()).ensure(Role::Worker, name)?;
    let cfg = ClientConfig {
        coordinator: coordinator.clone(),
        identity,
        settings: Default::default(),
    };
    let data = ImageSet::load_prefix(&std::path::Path::new(DEFAULT_DATA_DIR).join("train"))?;
    let mut log = std::fs::File::create(log).with_context(|| format!("creating {log}"))?;
    let job = edl_worker::client::Job::connect(&cfg).await?;
    two_layer::train(job, &data, false, |batch| {
        let s = batch.span();
        let indices: Vec<String> = batch.indices().iter().map(u32::to_string).collect();
        writeln!(
            log,
            "{} {} {} {}",
            s.epoch,
            s.start,
            s.end,
            indices.join(",")
        )?;
        Ok(log.flush()?)
    })
    .await?;
    Ok(())
}
