//! `edl._edl`: the native half of EDL's Python package. A thin layer over the client crate
//! (`edl-client`): a job, a worker's session and its batches, with parameters pulled straight
//! into, and gradients pushed straight from, the caller's own float32 buffer (any object with
//! the buffer protocol: a NumPy array, or a CPU torch tensor's `.numpy()` view). Every call that
//! waits on the network releases the GIL, and checks for Ctrl-C (and other Python signals)
//! every 50 ms while it waits, so an interrupted call raises `KeyboardInterrupt` at once.
//!
//! A session can be asked to leave (`Session.stop`, what SIGTERM does in a program that honours
//! the process contract): a `next_batch` waiting for data then ends at once, and every other call
//! is bounded by the grace period it was given, as `edl-worker`'s are. A preemption notice
//! (`Session.preempt`, SIGUSR1's) is passed on to the coordinator in the background.
//!
//! The Python half (`python/edl/`) adds the conveniences: NumPy sample indices, the batch
//! iterator, `with` for a session that always leaves, the process contract's environment and
//! signals, torch tensors, modules and data loaders.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use edl_client::{Batch as ClientBatch, ClientConfig, ClientError, Notices, RowGrads};
use edl_shared::pki::{Identity, PkiDir, load_identity};
use edl_shared::proto::ids::{Clock, WorkerId};
use edl_shared::proto::order::epoch_order;
use edl_shared::transport::TransportSettings;
use edl_shared::{PkiError, Role};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString};
use tokio::runtime::Runtime;

create_exception!(
    _edl,
    EdlError,
    PyException,
    "An EDL call failed. `code` is the error code a server answered with (e.g. \"NonFinite\", \
     \"Forbidden\", \"WrongJob\"), or None when the client refused or the transport failed; \
     `kind` names the client's error (\"Call\", \"Dropped\", \"NonFinite\", \"Batch\", ...)."
);

/// How often a waiting call looks for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Time kept in hand before a leave deadline (the end of a stop's grace period, or of a
/// preemption notice) for leaving, as `edl-worker` keeps it.
const LEAVE_MARGIN: Duration = Duration::from_millis(500);

/// An `EdlError` of the binding's own (no server code): `kind` names the cause.
fn binding_error(py: Python<'_>, kind: &str, message: String) -> PyErr {
    let err = EdlError::new_err(message);
    let value = err.value(py);
    // Plain attributes on a fresh exception object: setting them cannot fail.
    let _ = value.setattr("code", py.None());
    let _ = value.setattr("kind", kind);
    err
}

fn edl_error(py: Python<'_>, e: ClientError) -> PyErr {
    let kind = match &e {
        ClientError::Call(_) => "Call",
        ClientError::Dropped(_) => "Dropped",
        ClientError::Inconsistent { .. } => "Inconsistent",
        ClientError::NonFinite { .. } => "NonFinite",
        ClientError::OutOfRange { .. } => "OutOfRange",
        ClientError::BufferSize { .. } => "BufferSize",
        ClientError::UnknownTensor(_) => "UnknownTensor",
        ClientError::RowOutOfRange { .. } => "RowOutOfRange",
        ClientError::RowShape { .. } => "RowShape",
        ClientError::Batch(_) => "Batch",
        ClientError::Runtime(_) => "Runtime",
        ClientError::Setup(_) => "Setup",
    };
    let code = e.code().map(|c| format!("{c:?}"));
    let err = EdlError::new_err(e.to_string());
    let value = err.value(py);
    // Plain attributes on a fresh exception object: setting them cannot fail.
    let _ = value.setattr("code", code);
    let _ = value.setattr("kind", kind);
    err
}

/// How a waited-for call ended without its result.
enum Failed {
    /// The client answered with an error.
    Client(PyErr),
    /// A signal handler raised (Ctrl-C): the call was abandoned midway.
    Interrupted(PyErr),
}

impl From<Failed> for PyErr {
    fn from(f: Failed) -> PyErr {
        match f {
            Failed::Client(e) | Failed::Interrupted(e) => e,
        }
    }
}

/// Runs `fut` to completion on the client's runtime with the GIL released (see [`wait_call`]).
fn wait<T, F>(py: Python<'_>, rt: &Runtime, fut: F) -> PyResult<T>
where
    T: Send,
    F: Future<Output = Result<T, ClientError>> + Send,
{
    Ok(wait_call(py, rt, fut)?)
}

/// Runs `fut` to completion on the client's runtime with the GIL released. On the main thread
/// (the only one Python runs signal handlers on) it takes the GIL back every [`SIGNAL_POLL`]
/// to run them; one that raises (Ctrl-C's `KeyboardInterrupt`) abandons the call, which is
/// then reported as [`Failed::Interrupted`].
fn wait_call<T, F>(py: Python<'_>, rt: &Runtime, fut: F) -> Result<T, Failed>
where
    T: Send,
    F: Future<Output = Result<T, ClientError>> + Send,
{
    let main = is_main_thread(py);
    let out = py
        .detach(|| {
            rt.block_on(async {
                let mut fut = std::pin::pin!(fut);
                let first = tokio::time::Instant::now() + SIGNAL_POLL;
                let mut tick = tokio::time::interval_at(first, SIGNAL_POLL);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        r = &mut fut => return PyResult::Ok(r),
                        _ = tick.tick(), if main => {
                            Python::attach(|py| py.check_signals())?;
                        }
                    }
                }
            })
        })
        .map_err(Failed::Interrupted)?;
    out.map_err(|e| Failed::Client(edl_error(py, e)))
}

/// The interpreter's main thread, once a call from it has asked Python.
static MAIN_THREAD: OnceLock<ThreadId> = OnceLock::new();

/// True on the interpreter's main thread. Python is asked (through `threading`) only until the
/// main thread is known; after that it is a comparison, off every pull and push's path.
fn is_main_thread(py: Python<'_>) -> bool {
    let here = std::thread::current().id();
    if let Some(main) = MAIN_THREAD.get() {
        return *main == here;
    }
    let ask = || -> PyResult<bool> {
        let threading = py.import("threading")?;
        let current = threading.call_method0("current_thread")?;
        let main = threading.call_method0("main_thread")?;
        Ok(current.is(&main))
    };
    let main = ask().unwrap_or(true);
    if main {
        let _ = MAIN_THREAD.set(here);
    }
    main
}

fn runtime() -> PyResult<Arc<Runtime>> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("edl-client")
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the client runtime: {e}")))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes `m` if no other thread holds it. A session or batch is held for a whole call, during
/// which its thread waits without the GIL and takes the GIL back to look for signals: a second
/// thread blocking on it with the GIL held would deadlock both, so it is refused instead.
fn claim<'a, T>(m: &'a Mutex<T>, what: &str) -> PyResult<MutexGuard<'a, T>> {
    match m.try_lock() {
        Ok(g) => Ok(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(format!(
            "this {what} is in use by another thread's call; use it from one thread at a time"
        ))),
    }
}

/// A float32 buffer borrowed from a Python object for the length of one call.
struct Floats {
    buf: PyBuffer<f32>,
}

impl Floats {
    /// Borrows `obj`'s buffer: float32, C-contiguous, `len` floats (when given), writable when
    /// the call writes into it.
    fn get(obj: &Bound<'_, PyAny>, what: &str, len: Option<usize>, write: bool) -> PyResult<Self> {
        let buf = PyBuffer::<f32>::get(obj).map_err(|e| {
            PyTypeError::new_err(format!(
                "{what} must be a float32 buffer (a NumPy array of dtype float32, or a CPU \
                 torch.float32 tensor): {e}"
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{what} must be C-contiguous"
            )));
        }
        if write && buf.readonly() {
            return Err(PyValueError::new_err(format!(
                "{what} is read-only; pass a writable array"
            )));
        }
        if let Some(want) = len
            && buf.item_count() != want
        {
            return Err(PyValueError::new_err(format!(
                "{what} has {} floats, the job's model has {want}",
                buf.item_count()
            )));
        }
        Ok(Floats { buf })
    }

    fn len(&self) -> usize {
        self.buf.item_count()
    }

    /// The floats, to be written. The caller holds `&mut self` for as long as it uses them.
    #[allow(unsafe_code)]
    fn as_mut(&mut self) -> &mut [f32] {
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: `get` checked that the exporter describes `item_count` C-contiguous, writable
        // float32 items at `buf_ptr`, and the buffer stays exported (its memory cannot be freed
        // or resized) until `self.buf` is released on drop. As with every consumer of the buffer
        // protocol that releases the GIL (NumPy's own), Python code running on another thread
        // could touch the same memory meanwhile; that is the caller's race, as in NumPy.
        unsafe { std::slice::from_raw_parts_mut(self.buf.buf_ptr().cast::<f32>(), self.len()) }
    }

    /// The floats, to be read.
    #[allow(unsafe_code)]
    fn as_ref(&self) -> &[f32] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: as in `as_mut`, without the writability (only read).
        unsafe { std::slice::from_raw_parts(self.buf.buf_ptr().cast::<f32>(), self.len()) }
    }
}

fn role_of(role: &str) -> PyResult<Role> {
    match role {
        "worker" => Ok(Role::Worker),
        "admin" => Ok(Role::Admin),
        other => Err(PyValueError::new_err(format!(
            "role must be \"worker\" or \"admin\", not {other:?}"
        ))),
    }
}

fn settings(reconnect_s: Option<f64>, datagram: Option<u16>) -> PyResult<TransportSettings> {
    let mut s = TransportSettings::default();
    if let Some(secs) = reconnect_s {
        s.reconnect = Some(Duration::try_from_secs_f64(secs).map_err(|e| {
            PyValueError::new_err(format!(
                "reconnect must be a non-negative number of seconds: {e}"
            ))
        })?);
    }
    if let Some(n) = datagram {
        // Without it, the default (EDL_DATAGRAM's size if set, else QUIC's) stays.
        s = s.with_datagram(Some(n));
    }
    Ok(s)
}

fn credentials_error(e: PkiError) -> PyErr {
    PyValueError::new_err(format!("cannot load the credentials: {e}"))
}

/// Refuses credentials of another job than `job` (when given), before any connection: the
/// job's servers would refuse them with a less telling `WrongJob`.
fn check_job(identity: &Identity, job: Option<&str>) -> PyResult<()> {
    match job {
        Some(want) if !want.is_empty() && identity.job != want => {
            Err(PyValueError::new_err(format!(
                "the certificate of {}/{} belongs to job {:?}, not to job {want:?} (EDL_JOB)",
                identity.role, identity.name, identity.job
            )))
        }
        _ => Ok(()),
    }
}

/// A tensor as Python sees it: (name, shape, offset, floats).
type TensorRow = (String, Vec<u32>, usize, usize);

/// A data span as Python sees it: (epoch, partition, start, end).
type SpanRow = (u32, u32, u32, u32);

/// A connection to a running job (the coordinator and every shard).
#[pyclass(module = "edl._edl")]
struct Job {
    rt: Arc<Runtime>,
    /// The job named in this client's certificate.
    job_name: String,
    /// Taken by `join`.
    inner: Mutex<Option<edl_client::Job>>,
}

impl Job {
    fn connect(py: Python<'_>, cfg: ClientConfig) -> PyResult<Job> {
        let rt = runtime()?;
        let job_name = cfg.identity.job.clone();
        let inner = wait(py, &rt, edl_client::Job::connect(&cfg))?;
        Ok(Job {
            rt,
            job_name,
            inner: Mutex::new(Some(inner)),
        })
    }

    fn with<T>(&self, f: impl FnOnce(&edl_client::Job) -> T) -> PyResult<T> {
        match &*lock(&self.inner) {
            Some(j) => Ok(f(j)),
            None => Err(PyRuntimeError::new_err(
                "this Job has joined; use its Session (or connect a new Job)",
            )),
        }
    }
}

#[pymethods]
impl Job {
    /// Connects to the coordinator at `coordinator` with a certificate signed by the job's CA
    /// (`cert`, `key`: PEM files; `ca`: the cluster CA). Waits for the coordinator to answer
    /// (at most `reconnect` seconds when given) and for the shard map. `datagram` fixes the
    /// QUIC datagram size (65000 on loopback); `job`, when given, must be the certificate's.
    #[new]
    #[pyo3(signature = (coordinator, cert, key, ca, reconnect=None, datagram=None, job=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        coordinator: String,
        cert: PathBuf,
        key: PathBuf,
        ca: PathBuf,
        reconnect: Option<f64>,
        datagram: Option<u16>,
        job: Option<String>,
    ) -> PyResult<Job> {
        let identity = load_identity(&ca, &cert, &key).map_err(credentials_error)?;
        check_job(&identity, job.as_deref())?;
        let cfg = ClientConfig {
            coordinator,
            identity,
            settings: settings(reconnect, datagram)?,
        };
        Job::connect(py, cfg)
    }

    /// Connects with the development PKI of a local run's state directory (`edl-local`,
    /// `edl-ps --state-dir`): the certificate `ROLE/NAME` there, created if missing (for job
    /// `job` when given, else the PKI's default job).
    #[staticmethod]
    #[pyo3(signature = (coordinator, state_dir, name, role="worker", reconnect=None, datagram=None, job=None))]
    #[allow(clippy::too_many_arguments)]
    fn local(
        py: Python<'_>,
        coordinator: String,
        state_dir: PathBuf,
        name: &str,
        role: &str,
        reconnect: Option<f64>,
        datagram: Option<u16>,
        job: Option<String>,
    ) -> PyResult<Job> {
        let pki = PkiDir::new(&state_dir);
        let role = role_of(role)?;
        // A client never creates a CA: one of its own would only be refused by the cluster.
        let identity = pki
            .member(
                role,
                name,
                job.as_deref()
                    .filter(|j| !j.is_empty())
                    .unwrap_or(edl_shared::pki::DEFAULT_JOB),
            )
            .map_err(credentials_error)?;
        check_job(&identity, job.as_deref())?;
        let cfg = ClientConfig {
            coordinator,
            identity,
            settings: settings(reconnect, datagram)?,
        };
        Job::connect(py, cfg)
    }

    /// The job named in this client's certificate (`default` for one issued without).
    #[getter]
    fn job(&self) -> String {
        self.job_name.clone()
    }

    /// Names the placement this worker was started for (`EDL_PLACEMENT`): once the session is
    /// admitted, the coordinator counts the placement done and drains the worker it replaces,
    /// if any. Call before `join`.
    fn for_placement(&self, placement: Option<u64>) -> PyResult<()> {
        let mut g = lock(&self.inner);
        let job = g.take().ok_or_else(|| {
            PyRuntimeError::new_err("this Job has joined; name its placement before join()")
        })?;
        *g = Some(job.for_placement(placement));
        Ok(())
    }

    /// The model's tensors: a list of (name, shape, offset, floats), in the flat parameter
    /// vector's order.
    fn tensors(&self) -> PyResult<Vec<TensorRow>> {
        self.with(|j| {
            j.spec()
                .tensors()
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone(), t.offset, t.len))
                .collect()
        })
    }

    /// Floats in the model.
    #[getter]
    fn param_count(&self) -> PyResult<usize> {
        self.with(|j| j.spec().param_count())
    }

    /// The job's settings: model, optimizer, consistency, batch_size, epochs, samples,
    /// partition_size, seed, lease_ms, chunk_size, and the data's train/test paths if any.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.with(|j| j.config().clone())?;
        let d = PyDict::new(py);
        d.set_item("model", edl_shared::models::describe(&c.model, &c.tensors))?;
        d.set_item("optimizer", c.optimizer.to_string())?;
        d.set_item("consistency", c.consistency.to_string())?;
        d.set_item("batch_size", c.batch_size)?;
        d.set_item("epochs", c.epochs)?;
        d.set_item("samples", c.train_samples)?;
        d.set_item("partition_size", c.partition_size)?;
        d.set_item("seed", c.seed)?;
        d.set_item("lease_ms", c.lease_ms)?;
        d.set_item("chunk_size", c.chunk_size)?;
        if let Some(data) = &c.data {
            d.set_item("data", format!("{data:?}"))?;
        }
        Ok(d)
    }

    /// The coordinator's status: samples_done, samples_total, finished, min_clock,
    /// active_workers, workers (id, name, state, clock) and epochs (epoch, samples, loss_sum).
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let job = self.with(Clone::clone)?;
        let s = wait(py, &self.rt, async move { job.status().await })?;
        let d = PyDict::new(py);
        d.set_item("samples_done", s.samples_done)?;
        d.set_item("samples_total", s.samples_total)?;
        d.set_item("finished", s.finished)?;
        d.set_item("min_clock", s.min_clock.0)?;
        let active = s
            .workers
            .iter()
            .filter(|w| w.state == edl_shared::proto::msg::WorkerState::Active)
            .count();
        d.set_item("active_workers", active)?;
        let workers: Vec<(u64, String, String, u64)> = s
            .workers
            .iter()
            .map(|w| (w.id.0, w.name.clone(), format!("{:?}", w.state), w.clock.0))
            .collect();
        d.set_item("workers", workers)?;
        let epochs: Vec<(u32, u64, f64)> = s
            .epochs
            .iter()
            .map(|e| (e.epoch, e.samples, e.loss_sum))
            .collect();
        d.set_item("epochs", epochs)?;
        d.set_item("samples_per_s", s.samples_per_s)?;
        d.set_item("loss", s.loss)?;
        // The latest evaluation: (accuracy, loss, samples, clock, name), or None.
        let eval = s
            .evaluation
            .map(|e| (e.accuracy, e.loss, e.samples, e.clock.0, e.name));
        d.set_item("evaluation", eval)?;
        Ok(d)
    }

    /// Reports an evaluation of the parameters pulled through `clock` to the coordinator.
    fn report_evaluation(
        &self,
        py: Python<'_>,
        clock: u64,
        accuracy: f64,
        loss: f64,
        samples: u64,
    ) -> PyResult<()> {
        let job = self.with(Clone::clone)?;
        wait(py, &self.rt, async move {
            job.report_evaluation(Clock(clock), accuracy, loss, samples)
                .await
        })
    }

    /// Every shard's data ledger: a list of dicts (shard, epoch, applied, duplicates, missing,
    /// skipped_pushes).
    fn ledgers<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let job = self.with(Clone::clone)?;
        let all = wait(py, &self.rt, async move { job.ledgers().await })?;
        let mut out = Vec::new();
        for (shard, ledgers) in all {
            for l in ledgers {
                let d = PyDict::new(py);
                d.set_item("shard", shard.0)?;
                d.set_item("epoch", l.epoch)?;
                d.set_item("applied", l.applied)?;
                d.set_item("duplicates", l.duplicates)?;
                d.set_item("missing", l.missing)?;
                d.set_item("skipped_pushes", l.skipped_pushes)?;
                out.push(d);
            }
        }
        Ok(out)
    }

    /// Asks worker `worker` (its numeric id) to leave after its current step (admin role).
    fn drain(&self, py: Python<'_>, worker: u64) -> PyResult<()> {
        let job = self.with(Clone::clone)?;
        wait(
            py,
            &self.rt,
            async move { job.drain(WorkerId(worker)).await },
        )
    }

    /// Pulls the whole model as it stands into `out` (a float32 buffer of `param_count`
    /// floats), without joining: for evaluation. Returns the clock it pulled through.
    fn pull(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<u64> {
        let job = self.with(Clone::clone)?;
        let mut out = Floats::get(out, "out", Some(job.param_count()), true)?;
        let out = out.as_mut();
        wait(py, &self.rt, async move {
            job.pull_current(out).await.map(|s| s.min_clock.0)
        })
    }

    /// Joins the job as a worker, stop-free (warmed first, then admitted) and returns the
    /// session. The Job itself cannot be used afterwards.
    fn join(&self, py: Python<'_>) -> PyResult<Session> {
        let job = lock(&self.inner).take().ok_or_else(|| {
            PyRuntimeError::new_err(
                "this Job was used by join() already (even one that failed); connect a new Job",
            )
        })?;
        let inner = wait(py, &self.rt, job.join())?;
        Ok(Session {
            rt: self.rt.clone(),
            worker: inner.worker().0,
            notices: inner.notices(),
            job: inner.job().clone(),
            clock: AtomicU64::new(inner.clock().0),
            left: AtomicBool::new(false),
            broken: Mutex::new(None),
            stop: Arc::new(Stop::default()),
            preempted: Arc::new(Mutex::new(None)),
            order: Mutex::new(None),
            inner: Mutex::new(Some(inner)),
        })
    }
}

/// A request to leave: once asked, a waiting `next_batch` ends, and every call must be done by
/// the deadline (less [`LEAVE_MARGIN`], which is the leave's).
#[derive(Debug, Default)]
struct Stop {
    asked: AtomicBool,
    deadline: Mutex<Option<Instant>>,
    changed: tokio::sync::Notify,
}

impl Stop {
    fn asked(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// Asks to leave within `grace` (None: without a deadline); an earlier deadline told before
    /// is kept.
    fn ask(&self, grace: Option<Duration>) {
        self.asked.store(true, Ordering::SeqCst);
        if let Some(d) = grace.and_then(|g| Instant::now().checked_add(g)) {
            let mut g = lock(&self.deadline);
            *g = Some(g.map_or(d, |old| old.min(d)));
        }
        self.changed.notify_waiters();
    }

    fn deadline(&self) -> Option<Instant> {
        *lock(&self.deadline)
    }
}

/// How a call raced against the session's leave notices ended.
enum Bounded<T> {
    /// It finished (with its own result).
    Done(T),
    /// A `next_batch` given up because the session is asked to leave: no batch.
    Stopped,
    /// The leave deadline came first: the call was abandoned midway.
    Overrun,
}

/// Runs `fut` until it finishes or the session must move on: a stop request ends it at once
/// when `ends_on_stop` (a `next_batch`: leaving at once mid-lease is safe, the leave returns
/// every lease), and the earliest leave deadline (a stop's grace, a preemption notice), less
/// `margin`, abandons it. Without either it is `fut` itself.
async fn bounded<T>(
    fut: impl Future<Output = Result<T, ClientError>>,
    stop: &Stop,
    notices: &Notices,
    ends_on_stop: bool,
    margin: Duration,
) -> Result<Bounded<T>, ClientError> {
    let mut fut = std::pin::pin!(fut);
    loop {
        let changed = stop.changed.notified();
        let mut changed = std::pin::pin!(changed);
        changed.as_mut().enable();
        if ends_on_stop && stop.asked() {
            return Ok(Bounded::Stopped);
        }
        let stop_at = stop
            .deadline()
            .map(|d| tokio::time::Instant::from_std(d.checked_sub(margin).unwrap_or(d)));
        let over = async {
            match stop_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut fut => return r.map(Bounded::Done),
            _ = over => return Ok(Bounded::Overrun),
            _ = notices.expired(margin) => {
                return Ok(if ends_on_stop { Bounded::Stopped } else { Bounded::Overrun });
            }
            _ = &mut changed => {}
        }
    }
}

/// A mini-batch leased to this worker: its sample indices, epoch and step. Push its gradient
/// once and commit it once.
#[pyclass(module = "edl._edl")]
struct Batch {
    /// Taken by `commit`.
    inner: Mutex<Option<ClientBatch>>,
    committed: AtomicBool,
    indices: Vec<u32>,
    epoch: u32,
    span: SpanRow,
    clock: u64,
}

#[pymethods]
impl Batch {
    /// The indices of the batch's samples in the training set.
    #[getter]
    fn indices(&self) -> Vec<u32> {
        self.indices.clone()
    }

    /// The epoch (from 0).
    #[getter]
    fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The data span: (epoch, partition, start, end), positions in the epoch's order.
    #[getter]
    fn span(&self) -> SpanRow {
        self.span
    }

    /// The step (clock) the batch's gradient belongs to.
    #[getter]
    fn clock(&self) -> u64 {
        self.clock
    }

    /// True once committed.
    #[getter]
    fn committed(&self) -> bool {
        self.committed.load(Ordering::Relaxed)
    }

    fn __len__(&self) -> usize {
        self.indices.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Batch(epoch={}, clock={}, samples={})",
            self.epoch,
            self.clock,
            self.indices.len()
        )
    }
}

fn committed_already() -> PyErr {
    PyRuntimeError::new_err("this batch was committed already (or its commit failed)")
}

/// A registered worker: lease batches, pull, push, commit, leave.
#[pyclass(module = "edl._edl")]
struct Session {
    rt: Arc<Runtime>,
    worker: u64,
    /// What can be read while another thread is in a call: drain notices, traffic, the clock
    /// and whether the session has left.
    notices: edl_client::Notices,
    job: edl_client::Job,
    clock: AtomicU64,
    left: AtomicBool,
    /// Why the session cannot go on (a lease or commit whose outcome is unknown); only
    /// `leave` is left to do.
    broken: Mutex<Option<String>>,
    /// Asked to leave (`stop`), with a deadline; read and set without the session's lock.
    stop: Arc<Stop>,
    /// What became of the last preemption notice passed on: None while none was, or while
    /// it is on its way; an error's text if the coordinator could not be told.
    preempted: Arc<Mutex<Option<Result<(), String>>>>,
    /// The epoch order last used by `upcoming`, by epoch.
    order: Mutex<Option<(u32, Arc<Vec<u32>>)>>,
    /// Taken by `leave`.
    inner: Mutex<Option<edl_client::Session>>,
}

impl Session {
    /// The session for a call other than `leave`.
    fn claim(&self) -> PyResult<MutexGuard<'_, Option<edl_client::Session>>> {
        if let Some(why) = &*lock(&self.broken) {
            return Err(PyRuntimeError::new_err(format!(
                "this session cannot go on: {why}; call session.leave() (its uncommitted data \
                 returns to the pool) and join again"
            )));
        }
        claim(&self.inner, "session")
    }

    /// Records that the session cannot go on.
    fn break_off(&self, why: &str) {
        *lock(&self.broken) = Some(why.to_string());
    }

    /// Waits for `fut` (a step's call: `what`), bounded by the session's leave deadline (less
    /// the leave's margin); a call abandoned for it leaves the session only `leave()`, as does
    /// one interrupted (Ctrl-C) when `interrupt_breaks` (its outcome is then unknown).
    fn step_call<T, F>(
        &self,
        py: Python<'_>,
        what: &str,
        interrupt_breaks: bool,
        fut: F,
    ) -> PyResult<T>
    where
        T: Send,
        F: Future<Output = Result<T, ClientError>> + Send,
    {
        let fut = bounded(fut, &self.stop, &self.notices, false, LEAVE_MARGIN);
        match wait_call(py, &self.rt, fut) {
            Ok(Bounded::Done(v)) => Ok(v),
            Ok(Bounded::Stopped | Bounded::Overrun) => {
                let why = format!("a {what}() ran past the session's leave deadline");
                self.break_off(&why);
                Err(binding_error(
                    py,
                    "Overrun",
                    format!("{why} (the grace period of a stop, or a preemption notice)"),
                ))
            }
            Err(Failed::Interrupted(e)) => {
                if interrupt_breaks {
                    self.break_off(&format!("a {what}() was interrupted"));
                }
                Err(e)
            }
            Err(Failed::Client(e)) => Err(e),
        }
    }
}

fn left() -> PyErr {
    PyRuntimeError::new_err("this session has left")
}

/// The session in `guard`, unless it has left.
fn live(guard: &mut Option<edl_client::Session>) -> PyResult<&mut edl_client::Session> {
    guard.as_mut().ok_or_else(left)
}

#[pymethods]
impl Session {
    /// This worker's id.
    #[getter]
    fn worker(&self) -> u64 {
        self.worker
    }

    /// Steps completed.
    #[getter]
    fn clock(&self) -> u64 {
        self.clock.load(Ordering::Relaxed)
    }

    /// Floats in the model.
    #[getter]
    fn param_count(&self) -> usize {
        self.job.param_count()
    }

    /// True once an operator (or the scheduler) asked this worker to leave.
    #[getter]
    fn drain_requested(&self) -> bool {
        self.notices.drain_requested()
    }

    /// True once the session has left.
    #[getter]
    fn left(&self) -> bool {
        self.left.load(Ordering::Relaxed)
    }

    /// Payload bytes exchanged with the shards so far: (sent, received, requests).
    fn traffic(&self) -> (u64, u64, u64) {
        let t = self.job.traffic();
        (t.sent, t.received, t.requests)
    }

    /// The next mini-batch, or None when the job's data is done, or once the session is asked
    /// to leave (`stop`, a preemption notice's deadline). The last batch must have been
    /// committed first. `force` hands out the next batch of the leased partition even after
    /// a stop (for a step whose samples were loaded already).
    #[pyo3(signature = (force=false))]
    fn next_batch(&self, py: Python<'_>, force: bool) -> PyResult<Option<Batch>> {
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        let b = if force {
            match wait_call(py, &self.rt, s.next_batch()) {
                Ok(b) => b,
                Err(Failed::Interrupted(e)) => {
                    self.break_off("a next_batch() was interrupted");
                    return Err(e);
                }
                Err(Failed::Client(e)) => return Err(e),
            }
        } else {
            let fut = bounded(
                s.next_batch(),
                &self.stop,
                &self.notices,
                true,
                LEAVE_MARGIN,
            );
            match wait_call(py, &self.rt, fut) {
                Ok(Bounded::Done(b)) => b,
                Ok(Bounded::Stopped | Bounded::Overrun) => {
                    // Given up midway, a lease may have been granted that this session never
                    // learned of: only the leave, which returns every lease, is left.
                    self.break_off("the session was asked to leave");
                    return Ok(None);
                }
                Err(Failed::Interrupted(e)) => {
                    // The coordinator may have leased data this session never learned of.
                    self.break_off("a next_batch() was interrupted");
                    return Err(e);
                }
                Err(Failed::Client(e)) => return Err(e),
            }
        };
        self.clock.store(s.clock().0, Ordering::Relaxed);
        Ok(b.map(|b| {
            let span = b.span();
            Batch {
                indices: b.indices().to_vec(),
                epoch: b.epoch(),
                span: (span.epoch, span.partition, span.start, span.end),
                clock: b.clock().0,
                inner: Mutex::new(Some(b)),
                committed: AtomicBool::new(false),
            }
        }))
    }

    /// The batches the leased partition still holds after the one handed out last, as
    /// `next_batch` will hand them out: a list of ((epoch, partition, start, end), indices).
    /// Empty when the partition is used up (the next batch needs a new lease). Nothing is
    /// leased or sent: the indices are the epoch's order over each span.
    fn upcoming(&self) -> PyResult<Vec<(SpanRow, Vec<u32>)>> {
        let g = claim(&self.inner, "session")?;
        let s = g.as_ref().ok_or_else(left)?;
        let h = s.holdings();
        let Some(rest) = h.uncommitted else {
            return Ok(Vec::new());
        };
        // The rest of the partition starts after the batch handed out last, if it is not
        // committed yet; where the committed samples end otherwise.
        let from = match h.batch {
            Some(
                edl_client::BatchState::Handed(b)
                | edl_client::BatchState::Pushed(b)
                | edl_client::BatchState::CommitUnknown(b),
            ) if b.epoch == rest.epoch && b.partition == rest.partition => b.end,
            _ => rest.start,
        };
        let cfg = self.job.config();
        let batch_size = cfg.batch_size.max(1);
        let order = {
            let mut o = lock(&self.order);
            match &*o {
                Some((e, order)) if *e == rest.epoch => order.clone(),
                _ => {
                    let order = Arc::new(epoch_order(cfg.seed, rest.epoch, cfg.train_samples));
                    *o = Some((rest.epoch, order.clone()));
                    order
                }
            }
        };
        let mut out = Vec::new();
        let mut at = from;
        while at < rest.end {
            let end = at.saturating_add(batch_size).min(rest.end);
            let indices = order
                .get(at as usize..end as usize)
                .ok_or_else(|| {
                    PyRuntimeError::new_err(format!(
                        "positions {at}..{end} are outside an epoch of {} samples",
                        order.len()
                    ))
                })?
                .to_vec();
            out.push(((rest.epoch, rest.partition, at, end), indices));
            at = end;
        }
        Ok(out)
    }

    /// Asks the session to leave within `grace` seconds (None: no deadline): a `next_batch`
    /// returns None from now on (one waiting for data at once), and the step under way must
    /// finish (its calls are abandoned past the deadline less half a second, which the leave
    /// keeps). Needs no lock: a signal handler may call it while another call waits.
    #[pyo3(signature = (grace=None))]
    fn stop(&self, grace: Option<f64>) -> PyResult<()> {
        let grace = grace
            .map(|g| {
                Duration::try_from_secs_f64(g).map_err(|e| {
                    PyValueError::new_err(format!(
                        "grace must be a non-negative number of seconds: {e}"
                    ))
                })
            })
            .transpose()?;
        self.stop.ask(grace);
        Ok(())
    }

    /// True once `stop` was called.
    #[getter]
    fn stopping(&self) -> bool {
        self.stop.asked()
    }

    /// A preemption notice this worker got itself (SIGUSR1 from a cloud agent): it must be
    /// gone within `notice` seconds. The coordinator is told in the background (this returns
    /// at once); it then asks for a substitute and drains this worker once one is admitted,
    /// or drains it at once without a replacement policy. Calls are bounded by the deadline,
    /// and `next_batch` returns None once it nears.
    fn preempt(&self, notice: f64) -> PyResult<()> {
        let notice = Duration::try_from_secs_f64(notice).map_err(|e| {
            PyValueError::new_err(format!(
                "notice must be a non-negative number of seconds: {e}"
            ))
        })?;
        let n = self.notices.clone();
        let outcome = self.preempted.clone();
        *lock(&outcome) = None;
        self.rt.spawn(async move {
            let r = n.preempt(notice).await.map_err(|e| e.to_string());
            *lock(&outcome) = Some(r);
        });
        Ok(())
    }

    /// What became of the last preemption notice passed on: None while none was sent or it
    /// is on its way, True once the coordinator has it, or the reason it could not be told
    /// (the worker then leaves after its step anyway).
    #[getter]
    fn preempted(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        Ok(match &*lock(&self.preempted) {
            None => None,
            Some(Ok(())) => Some(PyBool::new(py, true).to_owned().into_any().unbind()),
            Some(Err(e)) => Some(PyString::new(py, e).into_any().unbind()),
        })
    }

    /// Seconds left before this worker must be gone (a stop's grace or a preemption notice,
    /// whichever ends first), or None without a deadline.
    #[getter]
    fn deadline(&self) -> Option<f64> {
        let d = match (self.stop.deadline(), self.notices.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }?;
        Some(d.saturating_duration_since(Instant::now()).as_secs_f64())
    }

    /// Pulls every parameter into `out` (a writable float32 buffer of `param_count` floats),
    /// waiting only as the job's consistency requires. Nothing is allocated for the caller.
    fn pull(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut out = Floats::get(out, "out", Some(self.job.param_count()), true)?;
        let out = out.as_mut();
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        self.step_call(py, "pull", false, s.pull(out))
    }

    /// Pushes the gradient of `batch` from `grads` (a float32 buffer of `param_count` floats).
    /// A NaN or infinity refuses the push (EdlError, kind "NonFinite"), as does a value past
    /// a 16-bit wire's range (kind "OutOfRange"), and sends nothing.
    fn push(&self, py: Python<'_>, batch: &Batch, grads: &Bound<'_, PyAny>) -> PyResult<()> {
        let grads = Floats::get(grads, "grads", Some(self.job.param_count()), false)?;
        let grads = grads.as_ref();
        let guard = claim(&batch.inner, "batch")?;
        let b = guard.as_ref().ok_or_else(committed_already)?;
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        self.step_call(py, "push", false, s.push(b, grads))
    }

    /// Pulls rows `rows` of tensor `tensor` into `out` (rows x the tensor's row length floats).
    fn pull_rows(
        &self,
        py: Python<'_>,
        tensor: &str,
        rows: Vec<u32>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut out = Floats::get(out, "out", None, true)?;
        let out = out.as_mut();
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        self.step_call(py, "pull_rows", false, s.pull_rows(tensor, &rows, out))
    }

    /// Pushes the gradient of `batch` for rows `rows` of tensor `tensor` only (`values`: rows x
    /// the tensor's row length floats).
    fn push_rows(
        &self,
        py: Python<'_>,
        batch: &Batch,
        tensor: &str,
        rows: Vec<u32>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let values = Floats::get(values, "values", None, false)?;
        let values = values.as_ref();
        let guard = claim(&batch.inner, "batch")?;
        let b = guard.as_ref().ok_or_else(committed_already)?;
        let grads = [RowGrads {
            tensor,
            rows: &rows,
            values,
        }];
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        self.step_call(py, "push_rows", false, s.push_rows(b, &grads))
    }

    /// Commits `batch` (its samples are done; `loss_sum` is the sum of their losses) and waits
    /// for the next step as the consistency requires. Returns this worker's clock (steps
    /// completed). A batch that is not the one to commit is refused with nothing changed; a
    /// commit that fails or is interrupted on its way leaves the session only `leave()`.
    fn commit(&self, py: Python<'_>, batch: &Batch, loss_sum: f64) -> PyResult<u64> {
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        let mut slot = claim(&batch.inner, "batch")?;
        let b = slot.as_ref().ok_or_else(committed_already)?;
        s.check_commit(b).map_err(|e| edl_error(py, e))?;
        let b = slot.take().ok_or_else(committed_already)?;
        drop(slot);
        let r = self.step_call(py, "commit", true, s.commit(b, loss_sum));
        if r.is_err() {
            self.break_off("a commit() failed or was interrupted midway");
        }
        r?;
        batch.committed.store(true, Ordering::Relaxed);
        let c = s.clock().0;
        self.clock.store(c, Ordering::Relaxed);
        Ok(c)
    }

    /// Reports an evaluation of the parameters pulled through `clock` to the coordinator
    /// (`edlctl status` and the dashboard show the latest).
    fn report_evaluation(
        &self,
        py: Python<'_>,
        clock: u64,
        accuracy: f64,
        loss: f64,
        samples: u64,
    ) -> PyResult<()> {
        let job = self.job.clone();
        wait(py, &self.rt, async move {
            job.report_evaluation(Clock(clock), accuracy, loss, samples)
                .await
        })
    }

    /// Leaves gracefully: uncommitted data returns to the pool. Leaving twice does nothing.
    /// After `stop` or a preemption notice the leave must be done by the deadline (it gets
    /// half a second at least, even past it): if it is not, EdlError (kind "Unreturned") says
    /// what the coordinator still holds for this worker (it returns it when the worker's
    /// lease expires).
    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        let Some(s) = claim(&self.inner, "session")?.take() else {
            return Ok(());
        };
        self.left.store(true, Ordering::Relaxed);
        let holdings = s.holdings();
        let until = match (self.stop.deadline(), self.notices.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
        .map(|d| tokio::time::Instant::from_std(d.max(Instant::now() + LEAVE_MARGIN)));
        let leave = async move {
            match until {
                None => s.leave().await.map(Some),
                Some(at) => Ok(tokio::time::timeout_at(at, s.leave())
                    .await
                    .ok()
                    .transpose()?),
            }
        };
        match wait_call(py, &self.rt, leave)? {
            Some(()) => Ok(()),
            None => Err(binding_error(
                py,
                "Unreturned",
                format!(
                    "could not leave by the deadline; the coordinator holds until the worker's \
                     lease expires: {holdings}"
                ),
            )),
        }
    }

    /// Measures the binding's cost: runs `steps` steps (next batch, pull into `params`, push
    /// zeros, commit) entirely in Rust and returns each step's pull+push time in seconds, to
    /// compare with the same loop written in Python over the same session.
    fn _bench_native(
        &self,
        py: Python<'_>,
        params: &Bound<'_, PyAny>,
        steps: usize,
    ) -> PyResult<Vec<f64>> {
        let mut params = Floats::get(params, "params", Some(self.job.param_count()), true)?;
        let params = params.as_mut();
        let grads = vec![0f32; self.job.param_count()];
        let mut g = self.claim()?;
        let s = live(&mut g)?;
        let times = wait(py, &self.rt, async {
            let mut times = Vec::with_capacity(steps);
            for _ in 0..steps {
                let Some(b) = s.next_batch().await? else {
                    break;
                };
                let t = Instant::now();
                s.pull(params).await?;
                s.push(&b, &grads).await?;
                times.push(t.elapsed().as_secs_f64());
                s.commit(b, 0.0).await?;
            }
            Ok(times)
        })?;
        self.clock.store(s.clock().0, Ordering::Relaxed);
        Ok(times)
    }
}

/// The native module.
#[pymodule]
fn _edl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Job>()?;
    m.add_class::<Session>()?;
    m.add_class::<Batch>()?;
    m.add("EdlError", m.py().get_type::<EdlError>())?;
    Ok(())
}
