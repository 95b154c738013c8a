//! Where a shard's checkpoints go: files (`edl-ps shard`) or memory (the simulation).

use super::*;

/// Writes a checkpoint of `st` to `store`, if there is one.
pub(super) async fn checkpoint_to(
    store: Option<&CheckpointStore>,
    st: &Arc<ShardState>,
) -> Option<Result<(String, u64, f64), String>> {
    Some(store?.write(st).await)
}

/// Where a shard keeps its checkpoint.
#[derive(Clone)]
pub enum CheckpointStore {
    /// A file, written off the runtime (`edl-ps shard --checkpoint`).
    File(PathBuf),
    /// Handed to a function on the runtime as it is taken: the deterministic simulation's
    /// disk, which it restarts a crashed shard from.
    Memory(Arc<dyn Fn(ShardCheckpoint) + Send + Sync>),
}

impl CheckpointStore {
    /// Writes a checkpoint of `st`: returns where, its bytes (0 in memory) and milliseconds.
    pub async fn write(&self, st: &Arc<ShardState>) -> Result<(String, u64, f64), String> {
        match self {
            CheckpointStore::File(path) => {
                let (st, path) = (st.clone(), path.clone());
                let written = tokio::task::spawn_blocking(move || {
                    write_checkpoint(&st, &path).map(|r| (r, path))
                })
                .await;
                match written {
                    Ok(Ok(((bytes, millis), path))) => {
                        Ok((path.display().to_string(), bytes, millis))
                    }
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            CheckpointStore::Memory(keep) => {
                let _one = st.saving.lock().unwrap_or_else(|p| p.into_inner());
                keep(st.snapshot());
                Ok(("memory".to_string(), 0, 0.0))
            }
        }
    }
}

/// Writes a checkpoint of `state` to `path`; returns (bytes, milliseconds).
pub fn write_checkpoint(state: &ShardState, path: &Path) -> Result<(u64, f64), CheckpointError> {
    let _one = state.saving.lock().unwrap_or_else(|p| p.into_inner());
    let t = std::time::Instant::now();
    let bytes = checkpoint::write(path, &state.snapshot())?;
    let millis = t.elapsed().as_secs_f64() * 1000.0;
    metrics::checkpointed(bytes, millis);
    Ok((bytes, millis))
}
