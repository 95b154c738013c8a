//! Where a coordinator keeps its durable state: the [`MetaStore`] seam.
//!
//! A coordinator answers a request only once every change the answer depends on is durable
//! (see `Coordinator::durable`): the state is written as one record, the whole durable state
//! (a few KiB: the job, the shard map, the workers with their leases and committed positions,
//! the data plan's cursor, the counters), and concurrent requests share one write (group
//! commit). A record of the whole state costs about what a delta would at this size, and
//! reading one back needs no replay that could drift from the state machine.
//!
//! - [`FileLog`] (the default, one machine): records appended to `coordinator/state.wal`
//!   with a length and a CRC-32 each, made durable with `fdatasync` before the answers
//!   waiting on them go out; when the log passes [`COMPACT_BYTES`] the latest record is
//!   written to `coordinator/state.bin` (atomically: temporary file, fsync, rename, fsync of
//!   the directory) and the log starts again. A torn record at the log's tail (a crash in
//!   the middle of an append) was never acknowledged and is cut off when the log is opened.
//! - [`MemoryStore`]: memory that outlives the coordinator, for the deterministic simulation.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use edl_shared::transport::BoxFuture;
use rkyv::rancor::BoxedError;
use thiserror::Error;

use super::state::CoordinatorSnap;
use crate::checkpoint;

/// Magic bytes of the coordinator's state file (`state.bin`).
const STATE_MAGIC: &[u8; 8] = b"EDLCOORD";

/// The log is folded into `state.bin` once it is this long.
pub const COMPACT_BYTES: u64 = 4 << 20;

/// Bytes before each log record: its length and the CRC-32 of its body.
const RECORD_HEADER: usize = 8;

/// Why a record could not be written.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The store cannot be reached or written now; the write may be tried again.
    #[error("the state store is unavailable: {0}")]
    Unavailable(String),
    /// This coordinator no longer leads: another one writes the state now.
    #[error("this coordinator was deposed: {0}")]
    Fenced(String),
}

/// A coordinator's durable store: the latest record of its state, written durably.
pub trait MetaStore: Send + Sync + 'static {
    /// Writes `record`, the whole durable state; `Ok` means it survives a crash.
    fn write(&self, record: Arc<[u8]>) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Where the state is kept, for logs and errors.
    fn describe(&self) -> String;
    /// The term of the lead this store writes for: increasing from leader to leader, carried
    /// on the coordinator's orders to shards so that they refuse a deposed leader's. 0 where
    /// there is no election (one coordinator).
    fn term(&self) -> u64 {
        0
    }
    /// Until when this writer surely leads even while the store cannot be reached (its lead's
    /// lease surely holds): meanwhile the coordinator may acknowledge training reports from
    /// memory. `None`: never (one coordinator, no lease).
    fn lease_until(&self) -> Option<tokio::time::Instant> {
        None
    }
    /// Checks, writing nothing, that this writer still leads: [`StoreError::Fenced`] once
    /// another one does. Always `Ok` where there is no election.
    fn confirm(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Encodes a state record.
pub fn encode(snap: &CoordinatorSnap) -> Vec<u8> {
    // Serializing plain owned data into a growable buffer cannot fail; an error here would be a
    // bug in the snapshot's types, so it is reported as an empty record the reader refuses.
    rkyv::to_bytes::<BoxedError>(snap)
        .map(|b| b.to_vec())
        .unwrap_or_default()
}

/// Decodes a state record.
pub fn decode(record: &[u8]) -> anyhow::Result<CoordinatorSnap> {
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(record.len());
    aligned.extend_from_slice(record);
    rkyv::from_bytes::<CoordinatorSnap, BoxedError>(&aligned).map_err(|e| {
        anyhow::anyhow!(
            "undecodable coordinator state record ({e}): was it written by another version \
                 of EDL? Start the coordinator on a fresh state directory (or etcd prefix)"
        )
    })
}

/// The embedded store: `DIR/state.bin` and the log `DIR/state.wal` beside it.
pub struct FileLog {
    base: PathBuf,
    wal: PathBuf,
    /// The open log, appended to one record at a time.
    file: Arc<Mutex<fs::File>>,
}

impl FileLog {
    /// Opens the store whose base file is `base` (`STATE_DIR/coordinator/state.bin`), creating
    /// its directory and log as needed. Returns the store and the latest record it holds.
    pub fn open(base: &Path) -> anyhow::Result<(FileLog, Option<Vec<u8>>)> {
        let dir = base.parent().unwrap_or(Path::new("."));
        let wal = base.with_extension("wal");
        let read_base = || {
            checkpoint::read_blob(base, STATE_MAGIC)
                .map(|b| b.to_vec())
                .map_err(|e| anyhow::anyhow!("{e}"))
        };
        // Without a log the folded state is all there is: read before anything is written
        // beside it, so that one this EDL cannot read (another version's) changes nothing.
        let mut folded = match !wal.exists() && base.exists() {
            true => Some(read_base()?),
            false => None,
        };
        fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        let fresh = !wal.exists();
        let mut file = fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&wal)
            .map_err(|e| anyhow::anyhow!("{}: {e}", wal.display()))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| anyhow::anyhow!("{}: {e}", wal.display()))?;
        let (latest, valid) = last_record(&bytes);
        if valid < bytes.len() {
            tracing::warn!(
                path = %wal.display(),
                cut = bytes.len() - valid,
                "the state log ends in a torn record (a crash while appending it); it was never \
                 acknowledged and is cut off"
            );
            file.set_len(valid as u64)
                .and_then(|()| file.sync_all())
                .map_err(|e| anyhow::anyhow!("{}: {e}", wal.display()))?;
        }
        if fresh {
            // The new log's directory entry must be durable before a record in it counts.
            fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        }
        let latest = match latest {
            Some(r) => Some(r.to_vec()),
            None if folded.is_some() => folded.take(),
            None if base.exists() => Some(read_base()?),
            None => None,
        };
        let log = FileLog {
            base: base.to_path_buf(),
            wal,
            file: Arc::new(Mutex::new(file)),
        };
        Ok((log, latest))
    }

    /// Appends `record` and makes it durable; folds the log into the base file once it is long.
    fn append(
        base: &Path,
        wal: &Path,
        file: &Mutex<fs::File>,
        record: &[u8],
    ) -> Result<(), String> {
        let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::with_capacity(RECORD_HEADER + record.len());
        out.extend_from_slice(&(record.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(record).to_le_bytes());
        out.extend_from_slice(record);
        let at = |e: std::io::Error| format!("{}: {e}", wal.display());
        let len = file.metadata().map_err(at)?.len();
        if let Err(e) = file.write_all(&out).and_then(|()| file.sync_data()) {
            // Whatever part of the record reached the file is cut off, so the next append
            // starts on a record boundary.
            let _ = file.set_len(len);
            return Err(at(e));
        }
        if len + out.len() as u64 >= COMPACT_BYTES {
            checkpoint::write_blob(base, STATE_MAGIC, record).map_err(|e| e.to_string())?;
            // The base file now holds this record: the log may start again.
            file.set_len(0).and_then(|()| file.sync_all()).map_err(at)?;
        }
        Ok(())
    }
}

impl MetaStore for FileLog {
    fn write(&self, record: Arc<[u8]>) -> BoxFuture<'_, Result<(), StoreError>> {
        let (base, wal, file) = (self.base.clone(), self.wal.clone(), self.file.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || Self::append(&base, &wal, &file, &record))
                .await
                .map_err(|e| StoreError::Unavailable(e.to_string()))?
                .map_err(StoreError::Unavailable)
        })
    }

    fn describe(&self) -> String {
        format!("{} (log {})", self.base.display(), self.wal.display())
    }
}

/// The last complete record in a log's bytes and the length of the valid prefix.
fn last_record(bytes: &[u8]) -> (Option<&[u8]>, usize) {
    let (mut at, mut last) = (0, None);
    while let Some(header) = bytes.get(at..at + RECORD_HEADER) {
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        let start = at + RECORD_HEADER;
        match bytes.get(start..start + len) {
            Some(body) if crc32fast::hash(body) == crc => {
                last = Some(body);
                at = start + len;
            }
            _ => break,
        }
    }
    (last, at)
}

/// Reads the durable state a coordinator keeps at `base` (`STATE_DIR/coordinator/state.bin`
/// and its log), without opening it for writing.
pub fn read_state(base: &Path) -> anyhow::Result<Option<CoordinatorSnap>> {
    let wal = base.with_extension("wal");
    let logged = match fs::read(&wal) {
        Ok(bytes) => last_record(&bytes).0.map(<[u8]>::to_vec),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => anyhow::bail!("{}: {e}", wal.display()),
    };
    let record = match logged {
        Some(r) => r,
        None if base.exists() => checkpoint::read_blob(base, STATE_MAGIC)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .to_vec(),
        None => return Ok(None),
    };
    decode(&record)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{}: {e}", base.display()))
}

/// Memory that outlives a coordinator: the simulation's disk, or its etcd. Clones share the
/// memory and the election: a handle writes for the term it was elected at
/// ([`MemoryStore::elect`]), and once a later term is elected its writes are refused
/// ([`StoreError::Fenced`]), as etcd refuses a deposed leader's; a handle
/// [`cut off`](MemoryStore::cut_off) cannot reach the store at all (its writes are
/// [`StoreError::Unavailable`]), as a leader partitioned from etcd.
#[derive(Clone, Default)]
pub struct MemoryStore {
    latest: Arc<Mutex<Option<Arc<[u8]>>>>,
    /// The term this handle writes for, and the term elected last.
    term: u64,
    elected: Arc<std::sync::atomic::AtomicU64>,
    cut: Arc<std::sync::atomic::AtomicBool>,
}

impl MemoryStore {
    /// The state last written, decoded.
    pub fn latest(&self) -> anyhow::Result<Option<CoordinatorSnap>> {
        let record = self
            .latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        record.map(|r| decode(&r)).transpose()
    }

    /// A handle for the leader elected next: a term above every earlier one, whose holders'
    /// writes are refused from now on.
    pub fn elect(&self) -> MemoryStore {
        use std::sync::atomic::Ordering;
        MemoryStore {
            latest: self.latest.clone(),
            term: self.elected.fetch_add(1, Ordering::AcqRel) + 1,
            elected: self.elected.clone(),
            cut: Arc::default(),
        }
    }

    /// Cuts this handle (and its clones) off from the store: every write fails as unavailable.
    pub fn cut_off(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Ends [`MemoryStore::cut_off`]: writes reach the store again (and are refused if a later
    /// term was elected meanwhile).
    pub fn reconnect(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl MemoryStore {
    /// Whether this handle may write now: cut off, or fenced by a later term.
    fn may_write(&self) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering;
        if self.cut.load(Ordering::Acquire) {
            Err(StoreError::Unavailable("cut off from the store".into()))
        } else if self.elected.load(Ordering::Acquire) != self.term {
            Err(StoreError::Fenced(format!(
                "term {} is over: term {} leads",
                self.term,
                self.elected.load(Ordering::Acquire)
            )))
        } else {
            Ok(())
        }
    }
}

impl MetaStore for MemoryStore {
    fn write(&self, record: Arc<[u8]>) -> BoxFuture<'_, Result<(), StoreError>> {
        let out = self.may_write().map(|()| {
            *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(record);
        });
        Box::pin(std::future::ready(out))
    }

    fn confirm(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(self.may_write()))
    }

    fn describe(&self) -> String {
        format!("memory (term {})", self.term)
    }

    fn term(&self) -> u64 {
        self.term
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_memory_store_fences_off_every_term_but_the_last_elected() {
        let disk = MemoryStore::default();
        let first = disk.elect();
        let record: Arc<[u8]> = Arc::from(&b"one"[..]);
        first
            .write(record.clone())
            .await
            .expect("the leader writes");
        assert_eq!(first.term(), 1);
        let second = disk.elect();
        assert_eq!(second.term(), 2);
        let refused = first.write(Arc::from(&b"two"[..])).await;
        assert!(
            matches!(&refused, Err(StoreError::Fenced(why)) if why.contains("term 2 leads")),
            "{:?}",
            refused.map_err(|e| e.to_string())
        );
        second.cut_off();
        assert!(matches!(
            second.write(record.clone()).await,
            Err(StoreError::Unavailable(_))
        ));
        second.reconnect();
        let third = disk.elect();
        assert!(matches!(
            second.write(record).await,
            Err(StoreError::Fenced(_))
        ));
        assert_eq!(third.term(), 3);
        // Nothing the deposed or cut-off leaders sent was written.
        let kept = disk.latest.lock().expect("memory").clone();
        assert_eq!(kept.as_deref(), Some(&b"one"[..]));
    }

    #[test]
    fn a_torn_tail_is_cut_and_the_last_whole_record_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("coordinator/state.bin");
        let (log, latest) = FileLog::open(&base).expect("open");
        assert!(latest.is_none());
        for r in [&b"first"[..], b"second", b"third"] {
            FileLog::append(&log.base, &log.wal, &log.file, r).expect("append");
        }
        drop(log);
        // A crash in the middle of a fourth append: its header and part of its body.
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(base.with_extension("wal"))
            .expect("log");
        f.write_all(&10u32.to_le_bytes()).expect("write");
        f.write_all(&crc32fast::hash(b"fourth rec").to_le_bytes())
            .expect("write");
        f.write_all(b"four").expect("write");
        drop(f);
        let (log, latest) = FileLog::open(&base).expect("reopen");
        assert_eq!(latest.as_deref(), Some(&b"third"[..]));
        // The next record follows the last whole one.
        FileLog::append(&log.base, &log.wal, &log.file, b"fifth").expect("append");
        let (_, latest) = FileLog::open(&base).expect("reopen");
        assert_eq!(latest.as_deref(), Some(&b"fifth"[..]));
    }

    #[test]
    fn a_long_log_is_folded_into_the_base_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("state.bin");
        let (log, _) = FileLog::open(&base).expect("open");
        let record = vec![7u8; 1 << 20];
        for i in 0..5u8 {
            let mut r = record.clone();
            r[0] = i;
            FileLog::append(&log.base, &log.wal, &log.file, &r).expect("append");
        }
        // 4 MiB passed at the fourth record: folded into state.bin, and the log restarted.
        let wal_len = fs::metadata(base.with_extension("wal")).expect("log").len();
        assert_eq!(wal_len, (RECORD_HEADER + record.len()) as u64);
        let folded = checkpoint::read_blob(&base, STATE_MAGIC).expect("base");
        assert_eq!(folded[0], 3);
        let (_, latest) = FileLog::open(&base).expect("reopen");
        assert_eq!(latest.map(|r| r[0]), Some(4));
        // Without the log, the base file is the state.
        fs::remove_file(base.with_extension("wal")).expect("rm");
        let (_, latest) = FileLog::open(&base).expect("reopen");
        assert_eq!(latest.map(|r| r[0]), Some(3));
    }
}
