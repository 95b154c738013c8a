//! Reader for LIBSVM-format sparse classification data.
//!
//! Each non-blank line is one sample: a label followed by `INDEX:VALUE` feature tokens, with
//! 1-based, strictly increasing indices, for example:
//!
//! ```text
//! 1 3:1 10:1 11:1 21:1
//! 0 3:1 10:1 20:1 21:0.5
//! -1 7:2.5
//! ```
//!
//! Blank lines and lines starting with `#` are skipped, a trailing `# comment` is ignored,
//! tokens may be separated by spaces or tabs, and a trailing `\r` is tolerated. `qid:N` tokens
//! (ranking data) are accepted and skipped. Indices are stored 0-based (file index minus 1).
//!
//! [`SparseData`] keeps a whole data set in memory; [`scan`] only counts samples and features.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Why a LIBSVM file could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum LibSvmError {
    /// The file could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// A line is malformed.
    #[error("{}:{line}: {what}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong, naming the offending token.
        what: String,
    },
    /// The file holds no sample.
    #[error("{}: no samples", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// A sparse labelled data set held in memory (CSR layout).
#[derive(Clone, Debug, PartialEq)]
pub struct SparseData {
    /// Row `i` spans `offsets[i]..offsets[i + 1]` of `indices` and `values`; `len() + 1` entries.
    offsets: Vec<usize>,
    /// 0-based feature ids, strictly increasing within each row.
    indices: Vec<u32>,
    /// Feature values, parallel to `indices`.
    values: Vec<f32>,
    /// One label per sample, as written in the file.
    labels: Vec<f32>,
    /// One more than the largest 0-based index seen, or 0 when no feature was seen.
    features: u32,
}

impl SparseData {
    /// Parses LIBSVM text. `path` is only used in error messages.
    ///
    /// Fails with [`LibSvmError::Line`] on the first malformed line and with
    /// [`LibSvmError::Empty`] when the text holds no sample.
    pub fn parse(text: &str, path: &Path) -> Result<SparseData, LibSvmError> {
        let mut data = SparseData {
            offsets: vec![0],
            indices: Vec::new(),
            values: Vec::new(),
            labels: Vec::new(),
            features: 0,
        };
        for (n, line) in text.lines().enumerate() {
            let at = Location { path, line: n + 1 };
            let Some(label) = parse_line(line, &at, &mut data.indices, &mut data.values)? else {
                continue;
            };
            if data.labels.len() >= MAX_SAMPLES {
                return Err(at.error(too_many_samples()));
            }
            data.labels.push(label);
            data.offsets.push(data.indices.len());
        }
        if data.labels.is_empty() {
            return Err(LibSvmError::Empty {
                path: path.to_path_buf(),
            });
        }
        // Indices are strictly increasing within a row, so each row's largest is its last.
        data.features = data
            .offsets
            .windows(2)
            .filter(|w| w[1] > w[0])
            .map(|w| data.indices[w[1] - 1] + 1)
            .max()
            .unwrap_or(0);
        Ok(data)
    }

    /// Reads and parses a file.
    ///
    /// Fails with [`LibSvmError::Io`] when the file cannot be read, otherwise as
    /// [`SparseData::parse`] does (text that is not UTF-8 is a [`LibSvmError::Line`] error).
    pub fn load(path: &Path) -> Result<SparseData, LibSvmError> {
        let bytes = std::fs::read(path).map_err(|source| LibSvmError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        match std::str::from_utf8(&bytes) {
            Ok(text) => SparseData::parse(text, path),
            Err(e) => {
                let line = 1 + bytes[..e.valid_up_to()]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count();
                Err(Location { path, line }.error(NOT_UTF8.to_string()))
            }
        }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there is no sample (never true for data returned by `parse` or `load`).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of features: one more than the largest 0-based feature index seen.
    pub fn features(&self) -> u32 {
        self.features
    }

    /// Sample i's (0-based feature index, value) pairs, sorted by index.
    ///
    /// # Panics
    /// If `i >= self.len()`.
    pub fn row(&self, i: usize) -> (&[u32], &[f32]) {
        let span = self.offsets[i]..self.offsets[i + 1];
        (&self.indices[span.clone()], &self.values[span])
    }

    /// Sample i's label, as written in the file.
    ///
    /// # Panics
    /// If `i >= self.len()`.
    pub fn label(&self, i: usize) -> f32 {
        self.labels[i]
    }

    /// Sample i's label as a binary class: true for a positive label (> 0), false for 0 or -1.
    ///
    /// # Panics
    /// If `i >= self.len()`.
    pub fn positive(&self, i: usize) -> bool {
        self.labels[i] > 0.0
    }
}

/// Counts without keeping the data (for a job file whose sample and feature counts are `auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Number of samples (non-blank, non-comment lines).
    pub samples: u32,
    /// One more than the largest 0-based feature index seen, or 0 when no feature was seen.
    pub features: u32,
}

/// Scans a LIBSVM file for its sample count and feature count, validating every line as `parse` does.
///
/// The file is read line by line, so memory use does not grow with its size. Errors are those of
/// [`SparseData::load`].
pub fn scan(path: &Path) -> Result<Shape, LibSvmError> {
    let io_error = |source| LibSvmError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io_error)?);
    let mut raw = Vec::new();
    let mut indices = Vec::new();
    let mut values = Vec::new();
    let mut samples: u32 = 0;
    let mut features: u32 = 0;
    let mut line = 0;
    loop {
        raw.clear();
        if reader.read_until(b'\n', &mut raw).map_err(io_error)? == 0 {
            break;
        }
        line += 1;
        let at = Location { path, line };
        let text = std::str::from_utf8(&raw).map_err(|_| at.error(NOT_UTF8.to_string()))?;
        indices.clear();
        values.clear();
        if parse_line(text, &at, &mut indices, &mut values)?.is_none() {
            continue;
        }
        samples = samples
            .checked_add(1)
            .ok_or_else(|| at.error(too_many_samples()))?;
        if let Some(&last) = indices.last() {
            features = features.max(last + 1);
        }
    }
    if samples == 0 {
        return Err(LibSvmError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(Shape { samples, features })
}

/// The most samples a data set may hold (sample ids are `u32`).
const MAX_SAMPLES: usize = u32::MAX as usize;

/// Message for a line that is not UTF-8.
const NOT_UTF8: &str = "line is not valid UTF-8";

fn too_many_samples() -> String {
    format!("more than {} samples", u32::MAX)
}

/// Where a line came from, for error messages.
struct Location<'a> {
    path: &'a Path,
    line: usize,
}

impl Location<'_> {
    fn error(&self, what: String) -> LibSvmError {
        LibSvmError::Line {
            path: self.path.to_path_buf(),
            line: self.line,
            what,
        }
    }
}

/// Parses one line. Returns `None` for a blank or comment line; otherwise the label, with the
/// line's 0-based feature indices and values appended to `indices` and `values`.
///
/// On error, `indices` and `values` may hold part of the line's features.
fn parse_line(
    line: &str,
    at: &Location<'_>,
    indices: &mut Vec<u32>,
    values: &mut Vec<f32>,
) -> Result<Option<f32>, LibSvmError> {
    let data = match line.find('#') {
        Some(hash) => &line[..hash],
        None => line,
    };
    let mut tokens = data.split_ascii_whitespace();
    let Some(label_token) = tokens.next() else {
        return Ok(None);
    };
    let label = match label_token.parse::<f32>() {
        Ok(label) if label.is_finite() => label,
        Ok(_) => {
            return Err(at.error(format!("label {label_token:?} is not a finite number")));
        }
        Err(_) if label_token.contains(':') => {
            return Err(at.error(format!(
                "line starts with feature {label_token:?} instead of a label"
            )));
        }
        Err(_) => return Err(at.error(format!("label {label_token:?} is not a number"))),
    };
    // The previous feature's 1-based index as written, for the increasing-order check.
    let mut previous: Option<u64> = None;
    for token in tokens {
        let Some((index_text, value_text)) = token.split_once(':') else {
            return Err(at.error(format!(
                "feature {token:?}: missing ':' (expected INDEX:VALUE)"
            )));
        };
        if index_text == "qid" {
            if value_text.parse::<u64>().is_err() {
                return Err(at.error(format!(
                    "{token:?}: query id {value_text:?} is not a non-negative integer"
                )));
            }
            continue;
        }
        let index = parse_index(index_text)
            .map_err(|why| at.error(format!("feature {token:?}: index {index_text:?} {why}")))?;
        if index == 0 {
            return Err(at.error(format!(
                "feature {token:?}: feature index 0: LIBSVM indices start at 1"
            )));
        }
        if index > u64::from(u32::MAX) {
            return Err(at.error(format!(
                "feature {token:?}: index {index} exceeds the largest supported index {}",
                u32::MAX
            )));
        }
        if let Some(previous) = previous
            && index <= previous
        {
            return Err(at.error(format!(
                "feature {token:?}: index {index} is not greater than the previous index \
                 {previous} (indices must be strictly increasing)"
            )));
        }
        previous = Some(index);
        let value = match value_text.parse::<f32>() {
            Ok(value) if value.is_finite() => value,
            Ok(_) => {
                return Err(at.error(format!(
                    "feature {token:?}: value {value_text:?} is not a finite number"
                )));
            }
            Err(_) => {
                return Err(at.error(format!(
                    "feature {token:?}: value {value_text:?} is not a number"
                )));
            }
        };
        // In range: 1 <= index <= u32::MAX was checked above.
        indices.push((index - 1) as u32);
        values.push(value);
    }
    Ok(Some(label))
}

/// Parses a 1-based feature index; the error says why it is not one.
fn parse_index(text: &str) -> Result<u64, &'static str> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err("is not an integer");
    }
    text.parse::<u64>().map_err(|_| "is too large")
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "1 3:1 10:1 11:1 21:1\n0 3:1 10:1 20:1 21:0.5\n-1 7:2.5\n";

    fn path() -> &'static Path {
        Path::new("data.txt")
    }

    /// Parses `text`, expecting a line error; returns (line, message) after checking the
    /// displayed form.
    fn line_error(text: &str) -> (usize, String) {
        match SparseData::parse(text, path()) {
            Err(e @ LibSvmError::Line { .. }) => {
                let shown = e.to_string();
                let LibSvmError::Line { line, what, .. } = e else {
                    unreachable!()
                };
                assert_eq!(shown, format!("data.txt:{line}: {what}"));
                (line, what)
            }
            other => panic!("expected a line error for {text:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_the_example() {
        let data = SparseData::parse(EXAMPLE, path()).expect("example parses");
        assert_eq!(data.len(), 3);
        assert!(!data.is_empty());
        assert_eq!(data.features(), 21);
        assert_eq!(data.label(0), 1.0);
        assert_eq!(data.label(1), 0.0);
        assert_eq!(data.label(2), -1.0);
        assert!(data.positive(0));
        assert!(!data.positive(1));
        assert!(!data.positive(2));
        assert_eq!(
            data.row(0),
            (&[2, 9, 10, 20][..], &[1.0, 1.0, 1.0, 1.0][..])
        );
        assert_eq!(
            data.row(1),
            (&[2, 9, 19, 20][..], &[1.0, 1.0, 1.0, 0.5][..])
        );
        assert_eq!(data.row(2), (&[6][..], &[2.5][..]));
    }

    #[test]
    fn label_only_lines_are_samples_without_features() {
        let data = SparseData::parse("1\n0\n", path()).expect("parses");
        assert_eq!(data.len(), 2);
        assert_eq!(data.features(), 0);
        assert_eq!(data.row(1), (&[][..], &[][..]));
    }

    #[test]
    fn comments_blank_lines_tabs_and_crlf() {
        let text = "# header comment\r\n\r\n  \t\n1\t3:1  10:1 # trailing comment\r\n\
                    #0 1:1\n   # indented comment\n0 qid:7 2:0.25\r\n-1 1:1";
        let data = SparseData::parse(text, path()).expect("parses");
        assert_eq!(data.len(), 3);
        assert_eq!(data.features(), 10);
        assert_eq!(data.row(0), (&[2, 9][..], &[1.0, 1.0][..]));
        assert_eq!(data.row(1), (&[1][..], &[0.25][..]));
        assert_eq!(data.row(2), (&[0][..], &[1.0][..]));
        assert_eq!(data.label(2), -1.0);
    }

    #[test]
    fn missing_colon() {
        let (line, what) = line_error("1 3:1\n\n0 3:1 17\n");
        assert_eq!(line, 3);
        assert!(
            what.contains("\"17\"") && what.contains("missing ':'"),
            "{what}"
        );
    }

    #[test]
    fn bad_index() {
        let (line, what) = line_error("1 3:1\n0 3x:1\n");
        assert_eq!(line, 2);
        assert_eq!(what, r#"feature "3x:1": index "3x" is not an integer"#);
        let (_, what) = line_error("1 -3:1\n");
        assert!(what.contains(r#"index "-3" is not an integer"#), "{what}");
        let (_, what) = line_error("1 :1\n");
        assert!(what.contains(r#"index "" is not an integer"#), "{what}");
    }

    #[test]
    fn index_too_large() {
        let (_, what) = line_error("1 4294967296:1\n");
        assert!(
            what.contains("4294967296") && what.contains("exceeds"),
            "{what}"
        );
        let (_, what) = line_error("1 99999999999999999999999:1\n");
        assert!(what.contains("is too large"), "{what}");
        let data = SparseData::parse("1 4294967295:1\n", path()).expect("largest index parses");
        assert_eq!(data.features(), u32::MAX);
    }

    #[test]
    fn index_zero() {
        let (line, what) = line_error("# c\n1 0:1\n");
        assert_eq!(line, 2);
        assert!(
            what.contains("\"0:1\"") && what.contains("feature index 0: LIBSVM indices start at 1"),
            "{what}"
        );
    }

    #[test]
    fn non_increasing_indices() {
        let (line, what) = line_error("1 3:1\n1 3:1 10:1 5:1\n");
        assert_eq!(line, 2);
        assert!(
            what.contains("\"5:1\"") && what.contains(" 5 ") && what.contains("10"),
            "{what}"
        );
        let (_, what) = line_error("1 3:1 3:2\n");
        assert!(
            what.contains("\"3:2\"") && what.contains("strictly increasing"),
            "{what}"
        );
    }

    #[test]
    fn bad_value() {
        let (line, what) = line_error("1 3:1\n0 1:1\n1 4:abc\n");
        assert_eq!(line, 3);
        assert_eq!(what, r#"feature "4:abc": value "abc" is not a number"#);
        let (_, what) = line_error("1 4:\n");
        assert!(what.contains(r#"value "" is not a number"#), "{what}");
    }

    #[test]
    fn non_finite_values() {
        for value in ["nan", "NaN", "inf", "-inf", "1e40"] {
            let (line, what) = line_error(&format!("1 2:1\n0 4:{value}\n"));
            assert_eq!(line, 2);
            assert!(
                what.contains(&format!("\"4:{value}\"")) && what.contains("not a finite number"),
                "{what}"
            );
        }
    }

    #[test]
    fn bad_label() {
        let (line, what) = line_error("1 3:1\nyes 3:1\n");
        assert_eq!(line, 2);
        assert_eq!(what, r#"label "yes" is not a number"#);
        let (_, what) = line_error("nan 3:1\n");
        assert_eq!(what, r#"label "nan" is not a finite number"#);
        let (_, what) = line_error("3:1 4:1\n");
        assert!(
            what.contains("\"3:1\"") && what.contains("instead of a label"),
            "{what}"
        );
    }

    #[test]
    fn bad_query_id() {
        let (_, what) = line_error("1 qid:x 3:1\n");
        assert!(what.contains("\"qid:x\""), "{what}");
    }

    #[test]
    fn empty_input() {
        for text in ["", "\n\n", "# only a comment\n   \n"] {
            match SparseData::parse(text, path()) {
                Err(e @ LibSvmError::Empty { .. }) => {
                    assert_eq!(e.to_string(), "data.txt: no samples");
                }
                other => panic!("expected Empty for {text:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn load_and_scan_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("small.txt");
        std::fs::write(&file, EXAMPLE).expect("write");
        let data = SparseData::load(&file).expect("loads");
        assert_eq!(data, SparseData::parse(EXAMPLE, &file).expect("parses"));
        assert_eq!(
            scan(&file).expect("scans"),
            Shape {
                samples: 3,
                features: 21
            }
        );

        let bad = dir.path().join("bad.txt");
        std::fs::write(&bad, "1 1:1\n# c\n0 2:1 2:1\n").expect("write");
        for err in [SparseData::load(&bad).err(), scan(&bad).err()] {
            match err {
                Some(LibSvmError::Line { line, what, .. }) => {
                    assert_eq!(line, 3);
                    assert!(what.contains("strictly increasing"), "{what}");
                }
                other => panic!("expected a line error, got {other:?}"),
            }
        }

        let not_utf8 = dir.path().join("latin1.txt");
        std::fs::write(&not_utf8, b"1 1:1\n0 2:1 \xe9\n").expect("write");
        for err in [SparseData::load(&not_utf8).err(), scan(&not_utf8).err()] {
            assert!(
                matches!(err, Some(LibSvmError::Line { line: 2, .. })),
                "{err:?}"
            );
        }

        let empty = dir.path().join("empty.txt");
        std::fs::write(&empty, "# nothing\n").expect("write");
        assert!(matches!(
            SparseData::load(&empty),
            Err(LibSvmError::Empty { .. })
        ));
        assert!(matches!(scan(&empty), Err(LibSvmError::Empty { .. })));

        let missing = dir.path().join("missing.txt");
        for err in [SparseData::load(&missing).err(), scan(&missing).err()] {
            match err {
                Some(e @ LibSvmError::Io { .. }) => {
                    assert!(e.to_string().starts_with("cannot read "), "{e}");
                }
                other => panic!("expected an I/O error, got {other:?}"),
            }
        }
    }

    #[test]
    fn agaricus() {
        // The repository ships the data set (deploy/data/agaricus).
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/data/agaricus");
        for (name, samples) in [("agaricus.txt.train", 6513), ("agaricus.txt.test", 1611)] {
            let file = dir.join(name);
            let data = SparseData::load(&file).expect("agaricus loads");
            assert_eq!(data.len(), samples, "{name}");
            if name.ends_with("train") {
                assert_eq!(data.features(), 126);
            }
            assert!(data.features() <= 126);
            for i in 0..data.len() {
                let label = data.label(i);
                assert!(
                    label == 0.0 || label == 1.0,
                    "{name} sample {i}: label {label}"
                );
                assert_eq!(data.positive(i), label == 1.0);
                let (indices, values) = data.row(i);
                assert_eq!(indices.len(), values.len());
                assert!(!indices.is_empty());
            }
            let shape = scan(&file).expect("agaricus scans");
            assert_eq!(
                shape,
                Shape {
                    samples: data.len() as u32,
                    features: data.features()
                }
            );
        }
    }
}
