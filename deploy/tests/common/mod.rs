//! Helpers shared by the launcher's end-to-end tests: where the binaries are, and whether the
//! dataset is installed.

use std::path::{Path, PathBuf};

use edl_worker::data::DEFAULT_DATA_DIR;

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

/// True when Fashion-MNIST is installed. Without it the test says it was skipped, unless
/// `EDL_REQUIRE_DATA=1` (set by CI) makes that a failure.
pub fn have_dataset() -> bool {
    if Path::new(DEFAULT_DATA_DIR).exists() {
        return true;
    }
    assert!(
        std::env::var("EDL_REQUIRE_DATA").as_deref() != Ok("1"),
        "{DEFAULT_DATA_DIR} is missing and EDL_REQUIRE_DATA=1"
    );
    eprintln!("skipped: dataset not installed (apt-get install dataset-fashion-mnist)");
    false
}
