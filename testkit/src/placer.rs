//! The test double of [`edl_launch::Placer`]: jobs run in this process, their coordinator and
//! shards as tasks (with the certificates the launcher issued in the job's directory) and their
//! workers as synthetic workers in threads ([`crate::synthetic`]), so that a launcher's loop
//! (the cluster scheduler's) can be tested without processes, and every call it makes is
//! recorded for the test to check.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::Context;
use edl_launch::Signal;
use edl_launch::{Exit, JobLaunch, Placer, ProcRecord, Slot};
use edl_ps::coordinator;
use edl_ps::shard;
use edl_shared::Role;
use edl_shared::pki::load_identity;
use edl_shared::shutdown::CancellationToken;
use edl_shared::transport::TransportSettings;
use edl_worker::ClientConfig;
use edl_worker::trainer::{Slowdown, TrainSummary};

use crate::synthetic::{SleepModel, spawn_worker};

/// One call made to the placer, as the test sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// `start_servers` of a job.
    StartServers(String),
    /// `start_worker`: job, worker, slot, placement.
    StartWorker(String, String, String, Option<u64>),
    /// `stop_worker`: job, worker.
    StopWorker(String, String),
    /// `stop_job`.
    StopJob(String),
}

struct Worker {
    job: String,
    name: String,
    stop: CancellationToken,
    thread: Option<JoinHandle<anyhow::Result<TrainSummary>>>,
}

/// A placer running jobs in this process (see the module's documentation). Workers train a
/// [`SleepModel`], so a job's model must be [`crate::synthetic::synthetic_job`]'s.
pub struct ThreadPlacer {
    model: SleepModel,
    samples: usize,
    servers: HashMap<String, CancellationToken>,
    workers: Vec<Worker>,
    fail_servers: bool,
    /// Every call, in order.
    pub calls: Arc<Mutex<Vec<Call>>>,
}

impl ThreadPlacer {
    /// A placer whose workers step `model` over `samples` samples.
    pub fn new(model: SleepModel, samples: usize) -> ThreadPlacer {
        ThreadPlacer {
            model,
            samples,
            servers: HashMap::new(),
            workers: Vec::new(),
            fail_servers: false,
            calls: Arc::default(),
        }
    }

    /// Makes every `start_servers` fail (a job whose servers cannot start).
    pub fn failing_servers(mut self) -> ThreadPlacer {
        self.fail_servers = true;
        self
    }

    fn record(&self, c: Call) {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).push(c);
    }
}

impl Placer for ThreadPlacer {
    async fn start_servers(
        &mut self,
        job: &JobLaunch,
    ) -> anyhow::Result<(SocketAddr, Vec<ProcRecord>)> {
        self.record(Call::StartServers(job.name.clone()));
        anyhow::ensure!(
            !self.fail_servers,
            "the servers of {} cannot start",
            job.name
        );
        let config = edl_shared::jobfile::load(&job.job_file())?;
        let stop = CancellationToken::new();
        let creds = |role, name: &str| {
            let c = job.creds(role, name);
            load_identity(&c.ca, &c.cert, &c.key).with_context(|| format!("{role}/{name}"))
        };
        let bound = coordinator::bind(
            crate::in_memory_coordinator(config, job.shards),
            "127.0.0.1:0".parse()?,
            &creds(Role::Coordinator, "coordinator")?,
            TransportSettings::default(),
        )?;
        let addr = bound.addr;
        tokio::spawn(bound.run(stop.clone()));
        let mut procs = vec![ProcRecord {
            name: "coordinator".into(),
            pid: 0,
            slot: None,
        }];
        for i in 0..job.shards {
            let name = format!("s{i}");
            let cfg = crate::loopback_shard(&addr);
            let (id, stop) = (creds(Role::Shard, &name)?, stop.clone());
            tokio::spawn(async move {
                if let Err(e) = shard::run(cfg, id, TransportSettings::default(), stop, None).await
                {
                    tracing::error!(error = %e, "test shard failed");
                }
            });
            procs.push(ProcRecord {
                name,
                pid: 0,
                slot: None,
            });
        }
        self.servers.insert(job.name.clone(), stop);
        Ok((addr, procs))
    }

    async fn start_worker(
        &mut self,
        job: &JobLaunch,
        coordinator: &SocketAddr,
        name: &str,
        slot: &Slot,
        placement: Option<u64>,
    ) -> anyhow::Result<ProcRecord> {
        self.record(Call::StartWorker(
            job.name.clone(),
            name.to_string(),
            slot.name.clone(),
            placement,
        ));
        let c = job.creds(Role::Worker, name);
        let cfg = ClientConfig {
            coordinator: coordinator.to_string(),
            identity: load_identity(&c.ca, &c.cert, &c.key)?,
            settings: TransportSettings::default(),
        };
        let stop = CancellationToken::new();
        let thread = spawn_worker(
            cfg,
            placement,
            self.model.clone(),
            self.samples,
            Slowdown::default(),
            stop.clone(),
        );
        self.workers.push(Worker {
            job: job.name.clone(),
            name: name.to_string(),
            stop,
            thread: Some(thread),
        });
        Ok(ProcRecord {
            name: name.to_string(),
            pid: 0,
            slot: Some(slot.name.clone()),
        })
    }

    async fn stop_worker(&mut self, job: &str, name: &str) {
        self.record(Call::StopWorker(job.to_string(), name.to_string()));
        for w in self
            .workers
            .iter()
            .filter(|w| w.job == job && w.name == name)
        {
            w.stop.cancel();
        }
    }

    /// SIGTERM asks the worker's thread to leave (as [`Placer::stop_worker`]); a thread
    /// cannot be sent other signals.
    async fn signal(&mut self, job: &str, name: &str, signal: Signal) -> anyhow::Result<bool> {
        anyhow::ensure!(
            signal == Signal::SIGTERM,
            "the thread placer cannot send {signal} to {job}/{name}: a thread takes SIGTERM only"
        );
        let running = self
            .workers
            .iter()
            .any(|w| w.job == job && w.name == name && w.thread.is_some());
        self.stop_worker(job, name).await;
        Ok(running)
    }

    async fn exited(&mut self) -> Vec<Exit> {
        let mut out = Vec::new();
        self.workers.retain_mut(|w| {
            if !w.thread.as_ref().is_some_and(JoinHandle::is_finished) {
                return true;
            }
            let (ok, what) = match w.thread.take().map(JoinHandle::join) {
                Some(Ok(Ok(s))) => (true, format!("exited after {} steps", s.steps)),
                Some(Ok(Err(e))) => (false, format!("failed: {e:#}")),
                _ => (false, "panicked".to_string()),
            };
            out.push(Exit {
                job: w.job.clone(),
                name: w.name.clone(),
                ok,
                what,
                status: None,
            });
            false
        });
        out
    }

    async fn stop_job(&mut self, job: &str) {
        self.record(Call::StopJob(job.to_string()));
        let (mine, rest): (Vec<Worker>, Vec<Worker>) = std::mem::take(&mut self.workers)
            .into_iter()
            .partition(|w| w.job == job);
        self.workers = rest;
        for mut w in mine {
            w.stop.cancel();
            if let Some(t) = w.thread.take() {
                let _ = tokio::task::spawn_blocking(move || t.join()).await;
            }
        }
        if let Some(stop) = self.servers.remove(job) {
            stop.cancel();
        }
    }

    /// Nothing runs across a restart of the test's process: every process is gone.
    async fn adopt(&mut self, _job: &str, procs: &[ProcRecord]) -> Vec<String> {
        procs.iter().map(|p| p.name.clone()).collect()
    }

    fn detach_all(&mut self) {}
}
