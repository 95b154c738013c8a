//! Tests that cannot run on this machine (no dataset, no GPU, no browser) say so where a
//! summary sees it: `cargo test` shows such a test as `ok`.

use std::io::Write;

/// The variable naming the file that [`skipped`] appends to (the README's test command sets it
/// and lists the file's lines at the end).
pub const SKIP_LOG: &str = "EDL_SKIP_LOG";

/// Records that the running test (or part of it, `what`) was skipped and why: printed, and
/// appended as one line to the file `$EDL_SKIP_LOG` names, if any. The test is named after
/// its thread (libtest names it so) or else after its binary.
pub fn skipped(what: &str, why: &str) {
    let log = std::env::var_os(SKIP_LOG);
    record(log.as_deref().map(std::path::Path::new), what, why);
}

/// A test cannot run here because `what_is_missing` is (a dataset, a program): a failure when
/// the variable `require` is `1` (CI sets it where it installs the thing), else a skip
/// ([`skipped`] of `part`, with `how` to get it).
///
/// # Panics
/// When `require` is `1`.
pub fn missing(require: &str, part: &str, what_is_missing: &str, how: &str) {
    assert!(
        std::env::var(require).as_deref() != Ok("1"),
        "{what_is_missing} is missing and {require}=1: {how}"
    );
    skipped(part, &format!("{what_is_missing} is missing ({how})"));
}

/// [`skipped`] with the log's path given.
fn record(log: Option<&std::path::Path>, what: &str, why: &str) {
    let thread = std::thread::current();
    let test = match thread.name() {
        Some(name) if name != "main" => name.to_owned(),
        _ => std::env::args()
            .next()
            .and_then(|a| {
                std::path::Path::new(&a)
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
            })
            .unwrap_or_default(),
    };
    let line = if what.is_empty() {
        format!("{test}: {why}")
    } else {
        format!("{test} ({what}): {why}")
    };
    eprintln!("skipped {line}");
    if let Some(path) = log {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        // A test's own outcome does not depend on the summary: a log it cannot write is
        // reported on stderr above and left.
        if let Ok(mut f) = file {
            let _ = writeln!(f, "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_logged_with_the_test_and_the_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("skipped.log");
        record(Some(&log), "the browser part", "chromium not installed");
        record(Some(&log), "", "no GPU");
        let text = std::fs::read_to_string(&log).expect("the log");
        assert!(
            text.contains("a_skip_is_logged_with_the_test_and_the_reason")
                && text.contains("(the browser part): chromium not installed\n")
                && text.ends_with("_reason: no GPU\n"),
            "{text}"
        );
    }
}
