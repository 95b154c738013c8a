//! Shard checkpoints: parameters, optimizer state, staged BSP steps and the data ledger of one
//! shard, written atomically (temporary file, fsync, rename, fsync of the directory) in a
//! versioned format with a checksum.
//!
//! ```text
//! 0        8         12        16          24      28
//! | EDLCKPT1 | version | reserved | body_len | crc32 | body (rkyv ShardCheckpoint) |
//! ```
//! A checkpoint is a consistent cut: the shard blocks pushes while it copies its state, so no
//! push is half in it, and its ledger matches its parameters.

use std::fs;
use std::path::{Path, PathBuf};

use rkyv::rancor::BoxedError;
use rkyv::util::AlignedVec;
use thiserror::Error;

const MAGIC: &[u8; 8] = b"EDLCKPT1";
/// 7: a job's wire is a `WireSpec` (precision and top-k).
const VERSION: u32 = 7;
const HEADER: usize = 28;

/// One chunk's state.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ChunkSnap {
    /// The key.
    pub key: u64,
    /// Parameters.
    pub params: Vec<f32>,
    /// The optimizer's buffers (`OptState::buffers`), one value per parameter each.
    pub state: Vec<Vec<f32>>,
    /// Updates applied to the chunk.
    pub t: u64,
    /// BSP: staged sums per step `(step, sum, gradients summed, latest epoch of their
    /// samples)`.
    pub pending: Vec<(u64, Vec<f32>, u32, u32)>,
    /// BSP: steps before this one are applied.
    pub applied_through: u64,
    /// The ledger segment whose history of applied spans this key shares.
    pub segment: u32,
    /// Floats read and written since the last rebalance by load.
    pub load: u64,
}

/// A shard's data ledger.
#[derive(Clone, Debug, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct LedgerSnap {
    /// `(epoch, partition, applied_up_to)`.
    pub progress: Vec<(u32, u32, u32)>,
    /// Applications per sample position, per epoch.
    pub counts: Vec<Vec<u8>>,
    /// Skipped pushes per epoch.
    pub skipped: Vec<u64>,
    /// Epochs folded to their counts once every sample was applied: `(epoch, duplicates)`.
    pub folded: Vec<(u32, u64)>,
}

/// Everything a shard needs to come back.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShardCheckpoint {
    /// The shard's id.
    pub shard: u32,
    /// A checksum of the job configuration, so a checkpoint is never loaded into another job.
    pub job_fingerprint: u32,
    /// The chunks.
    pub chunks: Vec<ChunkSnap>,
    /// The data ledger of each segment, by segment id.
    pub ledgers: Vec<(u32, LedgerSnap)>,
}

/// The state of a key range on its way from one shard to another: the same pieces a
/// checkpoint holds, for the moved keys only, with the ledgers of the segments they belong to.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RangeExport {
    /// The chunks, by key.
    pub chunks: Vec<ChunkSnap>,
    /// The ledgers of the chunks' segments, by the sender's segment id.
    pub ledgers: Vec<(u32, LedgerSnap)>,
}

impl RangeExport {
    /// The wire form (an rkyv archive), to travel as a frame payload.
    pub fn encode(&self) -> Result<bytes::Bytes, String> {
        rkyv::to_bytes::<BoxedError>(self)
            .map(|b| bytes::Bytes::from(b.into_vec()))
            .map_err(|e| e.to_string())
    }

    /// Decodes and validates the wire form.
    pub fn decode(payload: &[u8]) -> Result<RangeExport, String> {
        let mut aligned = AlignedVec::<16>::with_capacity(payload.len());
        aligned.extend_from_slice(payload);
        rkyv::from_bytes::<RangeExport, BoxedError>(&aligned).map_err(|e| e.to_string())
    }
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not of the expected kind.
    #[error("{0}: not an EDL state file of this kind (format {VERSION})")]
    Format(PathBuf),
    /// The file is of the expected kind, written by an EDL of another state format.
    #[error(
        "{}: written in EDL's state format {found}; this EDL reads format {VERSION}: start on a \
         fresh state directory (move this one away), or finish the job with the EDL that wrote it",
        path.display()
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// The format version its header gives.
        found: u32,
    },
    /// The body does not match its checksum (a torn or corrupted file).
    #[error("{0}: checksum mismatch")]
    Checksum(PathBuf),
    /// The body could not be decoded.
    #[error("{path}: {what}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        what: String,
    },
    /// The checkpoint belongs to another shard or job.
    #[error("{0}")]
    Mismatch(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `ckpt` to `path` atomically; returns the bytes written.
pub fn write(path: &Path, ckpt: &ShardCheckpoint) -> Result<u64, CheckpointError> {
    let body = rkyv::to_bytes::<BoxedError>(ckpt).map_err(|e| CheckpointError::Decode {
        path: path.to_path_buf(),
        what: e.to_string(),
    })?;
    write_blob(path, MAGIC, &body)
}

/// Reads and verifies a checkpoint.
pub fn read(path: &Path) -> Result<ShardCheckpoint, CheckpointError> {
    let body = read_blob(path, MAGIC)?;
    rkyv::from_bytes::<ShardCheckpoint, BoxedError>(&body).map_err(|e| CheckpointError::Decode {
        path: path.to_path_buf(),
        what: e.to_string(),
    })
}

/// Writes `body` behind a header with `magic`, the format version, its length and CRC32, in
/// place of `path` ([`edl_shared::durable::replace`]).
pub fn write_blob(path: &Path, magic: &[u8; 8], body: &[u8]) -> Result<u64, CheckpointError> {
    let mut header = Vec::with_capacity(HEADER);
    header.extend_from_slice(magic);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&(body.len() as u64).to_le_bytes());
    header.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(io(dir))?;
    }
    edl_shared::durable::replace(path, &[&header, body], 0o644)
        .map_err(|(path, source)| CheckpointError::Io { path, source })?;
    Ok((HEADER + body.len()) as u64)
}

/// Reads a blob written by [`write_blob`], checking magic, version, length and checksum. The
/// body comes back aligned for rkyv.
pub fn read_blob(path: &Path, magic: &[u8; 8]) -> Result<AlignedVec<16>, CheckpointError> {
    let bytes = fs::read(path).map_err(io(path))?;
    let format = || CheckpointError::Format(path.to_path_buf());
    let header = bytes.get(..HEADER).ok_or_else(format)?;
    if &header[..8] != magic {
        return Err(format());
    }
    let found = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if found != VERSION {
        return Err(CheckpointError::Version {
            path: path.to_path_buf(),
            found,
        });
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&header[16..24]);
    let mut crc4 = [0u8; 4];
    crc4.copy_from_slice(&header[24..28]);
    let body = bytes.get(HEADER..).ok_or_else(format)?;
    if body.len() as u64 != u64::from_le_bytes(len8)
        || crc32fast::hash(body) != u32::from_le_bytes(crc4)
    {
        return Err(CheckpointError::Checksum(path.to_path_buf()));
    }
    let mut aligned = AlignedVec::<16>::with_capacity(body.len());
    aligned.extend_from_slice(body);
    Ok(aligned)
}

/// A checksum of a job configuration.
pub fn fingerprint(job: &edl_shared::proto::JobConfig) -> u32 {
    // The wire precision changes no state: a job restarted with another keeps its checkpoint.
    let job = edl_shared::proto::JobConfig {
        wire: Default::default(),
        tensor_wires: Vec::new(),
        ..job.clone()
    };
    // A job that cannot be archived gets a fingerprint no checkpoint has.
    rkyv::to_bytes::<BoxedError>(&job)
        .map(|b| crc32fast::hash(&b))
        .unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ShardCheckpoint {
        ShardCheckpoint {
            shard: 3,
            job_fingerprint: 42,
            chunks: vec![ChunkSnap {
                key: 7,
                params: vec![1.0, -2.0, 3.5],
                state: vec![vec![0.1; 3], vec![0.2; 3]],
                t: 9,
                pending: vec![(4, vec![1.0; 3], 2, 1)],
                applied_through: 4,
                segment: 1,
                load: 12,
            }],
            ledgers: vec![(
                1,
                LedgerSnap {
                    progress: vec![(0, 1, 64)],
                    counts: vec![vec![1, 1, 0]],
                    skipped: vec![2],
                    folded: vec![],
                },
            )],
        }
    }

    #[test]
    fn round_trip_and_corruption_is_detected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s0.ckpt");
        let bytes = write(&path, &sample()).expect("write");
        assert!(bytes > HEADER as u64);
        assert_eq!(read(&path).expect("read"), sample());
        let mut raw = fs::read(&path).expect("raw");
        let last = raw.len() - 1;
        raw[last] ^= 0x40;
        fs::write(&path, &raw).expect("corrupt");
        assert!(matches!(read(&path), Err(CheckpointError::Checksum(_))));
        raw.truncate(40);
        fs::write(&path, &raw).expect("truncate");
        assert!(matches!(read(&path), Err(CheckpointError::Checksum(_))));
        fs::write(&path, b"hello").expect("junk");
        assert!(matches!(read(&path), Err(CheckpointError::Format(_))));
        // Another version's file: the version is named, and what to do.
        write(&path, &sample()).expect("write");
        let mut raw = fs::read(&path).expect("raw");
        raw[8..12].copy_from_slice(&(VERSION - 1).to_le_bytes());
        fs::write(&path, &raw).expect("older");
        let err = read(&path).expect_err("another version");
        assert!(
            matches!(err, CheckpointError::Version { found, .. } if found == VERSION - 1),
            "{err}"
        );
        assert!(err.to_string().contains("fresh state directory"), "{err}");
        assert!(matches!(
            read(&dir.path().join("none")),
            Err(CheckpointError::Io { .. })
        ));
    }
}
