//! Files replaced so that a crash leaves the old content or the new, never a mix: the one way
//! EDL writes a whole file that must survive (certificates, `sched.json`, checkpoints, the
//! coordinator's folded state).

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Writes `parts`, in order, as the new content of `path`: a temporary file beside it (created
/// with `mode`), fsynced, renamed over `path`, and the directory fsynced (the rename survives a
/// crash only once its entry does). On an error the temporary file is removed and `path` is as
/// it was; the error comes with the file it happened to.
pub fn replace(path: &Path, parts: &[&[u8]], mode: u32) -> Result<(), (PathBuf, std::io::Error)> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| {
            for part in parts {
                f.write_all(part)?;
            }
            f.sync_all()
        })
        .map_err(|e| (tmp.clone(), e))
        .and_then(|()| fs::rename(&tmp, path).map_err(|e| (path.to_path_buf(), e)));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| (dir.to_path_buf(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_leaves_the_new_content_and_no_temporary_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.bin");
        replace(&path, &[b"old"], 0o644).expect("writes");
        replace(&path, &[b"ne", b"w"], 0o600).expect("replaces");
        assert_eq!(fs::read(&path).expect("reads"), b"new");
        // A rename that cannot happen (a directory in the way) leaves nothing behind.
        let blocked = dir.path().join("blocked");
        fs::create_dir_all(blocked.join("in-the-way")).expect("mkdir");
        let (at, _) = replace(&blocked, &[b"x"], 0o644).expect_err("refused");
        assert_eq!(at, blocked);
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("lists")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
