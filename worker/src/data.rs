//! Labelled image sets in idx files (Fashion-MNIST, MNIST, any class count): parsing (raw or
//! gzip), pixel normalization and mini-batch gathering.

use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use thiserror::Error;

/// Where the `dataset-fashion-mnist` package installs the idx files.
pub const DEFAULT_DATA_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Magic number of an idx file holding unsigned bytes in three dimensions (images).
pub const IDX3_MAGIC: u32 = 0x0000_0803;
/// Magic number of an idx file holding unsigned bytes in one dimension (labels).
pub const IDX1_MAGIC: u32 = 0x0000_0801;
/// The first two bytes of every gzip stream; files are sniffed rather than trusted by name.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// What the user can do when Fashion-MNIST's files are absent, shown in
/// [`DataError::Missing`].
const MISSING_HINT: &str = "install it with `apt-get install dataset-fashion-mnist` \
                            or pass --data-dir <DIR> pointing at the idx files";
/// The same for files of another directory (a data set of the user's own).
const MISSING_OWN: &str = "the directory given must hold `train-images-idx3-ubyte`, \
                           `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and \
                           `t10k-labels-idx1-ubyte` (each may end in .gz)";

/// The hint for a missing `path`: Fashion-MNIST's package, or what a directory must hold.
fn missing_hint(path: &Path) -> &'static str {
    if path.starts_with(DEFAULT_DATA_DIR) {
        MISSING_HINT
    } else {
        MISSING_OWN
    }
}

/// Which half of Fashion-MNIST to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The 60,000 training samples (`train-*` files).
    Train,
    /// The 10,000 test samples (`t10k-*` files).
    Test,
}

impl Split {
    /// The file name prefix the original distribution uses for this split (`train`, `t10k`).
    pub fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }
}

/// Everything that can go wrong while loading or sampling the dataset.
#[derive(Debug, Error)]
pub enum DataError {
    /// The file does not exist (for [`ImageSet::load`], neither with nor without `.gz`).
    #[error("dataset file {} not found (also looked for it with a .gz suffix); {hint}", .path.display())]
    Missing {
        /// The path that was looked for, without the `.gz` suffix when the directory was searched.
        path: PathBuf,
        /// How to get the dataset in place.
        hint: &'static str,
    },
    /// The file exists but reading it failed.
    #[error("cannot read {}: {source}", .path.display())]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying operating system error.
        source: io::Error,
    },
    /// The file starts with the gzip magic but does not decompress cleanly.
    #[error("cannot decompress {}: {source}", .path.display())]
    Gzip {
        /// The gzip file being decompressed.
        path: PathBuf,
        /// The decoder's error, e.g. an unexpected end of the stream.
        source: io::Error,
    },
    /// The idx magic number is not the one expected for this kind of file.
    #[error("{}: bad idx magic 0x{found:08x}, expected 0x{expected:08x}", .path.display())]
    BadMagic {
        /// The offending file.
        path: PathBuf,
        /// The magic number this file should carry.
        expected: u32,
        /// The magic number actually found.
        found: u32,
    },
    /// The (decompressed) file is shorter than its header says.
    #[error("{}: truncated, needs {needed} bytes but has {actual}", .path.display())]
    Truncated {
        /// The offending file.
        path: PathBuf,
        /// Bytes required by the header (wide enough that no header can overflow it).
        needed: u128,
        /// Bytes actually present.
        actual: usize,
    },
    /// The (decompressed) file is longer than its header says, so it is probably not what it claims to be.
    #[error("{}: {actual} bytes but the header describes only {expected}", .path.display())]
    TrailingData {
        /// The offending file.
        path: PathBuf,
        /// Bytes described by the header.
        expected: usize,
        /// Bytes actually present.
        actual: usize,
    },
    /// The image and label files disagree on the number of samples.
    #[error("{} holds {images} images but {} holds {labels} labels", .images_path.display(), .labels_path.display())]
    CountMismatch {
        /// The image file.
        images_path: PathBuf,
        /// Number of images in it.
        images: usize,
        /// The label file.
        labels_path: PathBuf,
        /// Number of labels in it.
        labels: usize,
    },
    /// A mini-batch asked for a sample the dataset does not have.
    #[error("sample index {index} is out of range for a dataset of {len} samples")]
    IndexOutOfRange {
        /// The requested index.
        index: u32,
        /// Number of samples in the dataset.
        len: usize,
    },
}

/// A labelled image set held in memory as normalized `f32` rows: each pixel is scaled to
/// [0, 1], then centered and scaled by the set's own mean and standard deviation (for
/// Fashion-MNIST's training set 0.2860 and 0.3530). The class count is one more than the
/// largest label.
#[derive(Clone, PartialEq)]
pub struct ImageSet {
    /// `len() * dim` values, row-major, each `(pixel / 255 - mean) / std`.
    images: Vec<f32>,
    /// One class index per image, all below `classes`.
    labels: Vec<u8>,
    /// Values per image (rows * cols of the idx header).
    dim: usize,
    /// Number of classes the labels range over.
    classes: usize,
}

impl fmt::Debug for ImageSet {
    // A derived Debug would print tens of millions of floats, so only the shape is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageSet")
            .field("len", &self.len())
            .field("dim", &self.dim)
            .field("classes", &self.classes)
            .finish_non_exhaustive()
    }
}

impl ImageSet {
    /// Loads one split from `dir`, accepting each idx file raw or gzip-compressed.
    pub fn load(dir: &Path, split: Split) -> Result<ImageSet, DataError> {
        ImageSet::load_prefix(&dir.join(split.prefix()))
    }

    /// Loads `PREFIX-images-idx3-ubyte` and `PREFIX-labels-idx1-ubyte` (each raw or with a
    /// `.gz` suffix), e.g. the prefix `/usr/share/datasets/fashion-mnist/train`.
    pub fn load_prefix(prefix: &Path) -> Result<ImageSet, DataError> {
        let dir = prefix.parent().unwrap_or(Path::new("."));
        let stem = prefix
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let images = locate(dir, &format!("{stem}-images-idx3-ubyte"))?;
        let labels = locate(dir, &format!("{stem}-labels-idx1-ubyte"))?;
        ImageSet::load_idx(&images, &labels)
    }

    /// Loads an explicit idx3 image file and idx1 label file; gzip is detected from the content.
    pub fn load_idx(images: &Path, labels: &Path) -> Result<ImageSet, DataError> {
        let image_bytes = read_maybe_gz(images)?;
        let (count, dim, pixels) = parse_idx3(images, &image_bytes)?;
        let label_bytes = read_maybe_gz(labels)?;
        let label_slice = parse_idx1(labels, &label_bytes)?;
        if label_slice.len() != count {
            return Err(DataError::CountMismatch {
                images_path: images.to_path_buf(),
                images: count,
                labels_path: labels.to_path_buf(),
                labels: label_slice.len(),
            });
        }
        let classes = label_slice.iter().max().map_or(0, |&m| usize::from(m) + 1);
        // The set's own pixel statistics, in one pass (f64 sums: tens of millions of pixels).
        let (sum, sq) = pixels.iter().fold((0f64, 0f64), |(s, q), &p| {
            let v = f64::from(p) / 255.0;
            (s + v, q + v * v)
        });
        let n = pixels.len().max(1) as f64;
        let mean = sum / n;
        let std = (sq / n - mean * mean).max(0.0).sqrt();
        let std = if std > 1e-6 { std } else { 1.0 };
        let (mean, std) = (mean as f32, std as f32);
        let images = pixels
            .iter()
            .map(|&p| (f32::from(p) / 255.0 - mean) / std)
            .collect();
        Ok(ImageSet {
            images,
            labels: label_slice.to_vec(),
            dim,
            classes,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the dataset holds no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of input values per sample.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of classes the labels range over.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// All labels, one per sample.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// All normalized images, `len() * dim()` values row-major.
    pub fn images(&self) -> &[f32] {
        &self.images
    }

    /// Keeps only the first `n` samples (no-op when `n >= len()`), e.g. to make tests quick.
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.len());
        self.labels.truncate(n);
        self.images.truncate(n * self.dim);
    }

    /// Copies the samples at `indices` into `x` (row-major) and `y`, replacing their contents.
    ///
    /// All indices are checked before anything is copied, so on error `x` and `y` are left unchanged.
    pub fn gather(
        &self,
        indices: &[u32],
        x: &mut Vec<f32>,
        y: &mut Vec<u8>,
    ) -> Result<(), DataError> {
        let len = self.len();
        if let Some(&index) = indices.iter().find(|&&i| i as usize >= len) {
            return Err(DataError::IndexOutOfRange { index, len });
        }
        x.clear();
        y.clear();
        x.reserve(indices.len() * self.dim);
        y.reserve(indices.len());
        for &i in indices {
            let i = i as usize;
            x.extend_from_slice(&self.images[i * self.dim..(i + 1) * self.dim]);
            y.push(self.labels[i]);
        }
        Ok(())
    }
}

/// Finds `dir/stem`, falling back to `dir/stem.gz`, since distributions ship either form.
fn locate(dir: &Path, stem: &str) -> Result<PathBuf, DataError> {
    let plain = dir.join(stem);
    if plain.is_file() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{stem}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(DataError::Missing {
        hint: missing_hint(&plain),
        path: plain,
    })
}

/// Reads a whole file, decompressing it when it starts with the gzip magic.
fn read_maybe_gz(path: &Path) -> Result<Vec<u8>, DataError> {
    let raw = fs::read(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            DataError::Missing {
                path: path.to_path_buf(),
                hint: missing_hint(path),
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    if !raw.starts_with(&GZIP_MAGIC) {
        return Ok(raw);
    }
    let mut out = Vec::new();
    MultiGzDecoder::new(raw.as_slice())
        .read_to_end(&mut out)
        .map_err(|source| DataError::Gzip {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(out)
}

/// Reads the big-endian `u32` at `at`, reporting truncation rather than panicking on short input.
fn be_u32(path: &Path, bytes: &[u8], at: usize) -> Result<u32, DataError> {
    bytes
        .get(at..at + 4)
        .and_then(|s| <[u8; 4]>::try_from(s).ok())
        .map(u32::from_be_bytes)
        .ok_or_else(|| DataError::Truncated {
            path: path.to_path_buf(),
            needed: (at + 4) as u128,
            actual: bytes.len(),
        })
}

/// Checks the magic and dimension header of an idx file and returns the dimensions and the payload.
fn parse_idx<'a, const N: usize>(
    path: &Path,
    bytes: &'a [u8],
    magic: u32,
) -> Result<([usize; N], &'a [u8]), DataError> {
    let found = be_u32(path, bytes, 0)?;
    if found != magic {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            expected: magic,
            found,
        });
    }
    let mut dims = [0u32; N];
    for (i, d) in dims.iter_mut().enumerate() {
        *d = be_u32(path, bytes, 4 + 4 * i)?;
    }
    let header = 4 + 4 * N;
    // u128 holds the product of up to three u32 dimensions, so a hostile header cannot overflow it.
    let needed = header as u128 + dims.iter().map(|&d| u128::from(d)).product::<u128>();
    if needed > bytes.len() as u128 {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            needed,
            actual: bytes.len(),
        });
    }
    if needed < bytes.len() as u128 {
        return Err(DataError::TrailingData {
            path: path.to_path_buf(),
            // The file is bigger than `needed`, so `needed` fits in usize.
            expected: needed as usize,
            actual: bytes.len(),
        });
    }
    // `needed` equals the file length here, so the header fits and the payload slice is in bounds.
    Ok((dims.map(|d| d as usize), &bytes[header..]))
}

/// Parses an idx3 image file into (count, rows * cols, pixels).
fn parse_idx3<'a>(path: &Path, bytes: &'a [u8]) -> Result<(usize, usize, &'a [u8]), DataError> {
    let ([count, rows, cols], pixels) = parse_idx::<3>(path, bytes, IDX3_MAGIC)?;
    // With count > 0 the product is bounded by the file length; with count == 0 nothing is ever
    // indexed, so saturating merely avoids an overflow panic on a hostile empty file.
    Ok((count, rows.saturating_mul(cols), pixels))
}

/// Parses an idx1 label file into its labels.
fn parse_idx1<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a [u8], DataError> {
    let ([_count], labels) = parse_idx::<1>(path, bytes, IDX1_MAGIC)?;
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A per-test directory under the system temp dir, removed on drop so failed tests do not litter.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            // Tests run in parallel within one process, so the pid alone is not unique enough.
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("edl-data-{}-{tag}-{n}", std::process::id()));
            fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Builds an idx3 file of `count` images of `rows` x `cols`, pixel k of the file being k % 256.
    fn idx3(count: u32, rows: u32, cols: u32) -> Vec<u8> {
        let mut v = Vec::new();
        for word in [IDX3_MAGIC, count, rows, cols] {
            v.extend_from_slice(&word.to_be_bytes());
        }
        v.extend((0..count * rows * cols).map(|k| (k % 256) as u8));
        v
    }

    /// Builds an idx1 file holding `labels`.
    fn idx1(labels: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&IDX1_MAGIC.to_be_bytes());
        v.extend_from_slice(&(labels.len() as u32).to_be_bytes());
        v.extend_from_slice(labels);
        v
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(bytes).expect("gzip in memory");
        enc.finish().expect("gzip in memory")
    }

    /// Writes a split's image and label files, with names chosen so that `load` must find them.
    fn write_split(dir: &Path, prefix: &str, images: &[u8], labels: &[u8], gz_suffix: bool) {
        let suffix = if gz_suffix { ".gz" } else { "" };
        fs::write(
            dir.join(format!("{prefix}-images-idx3-ubyte{suffix}")),
            images,
        )
        .expect("write");
        fs::write(
            dir.join(format!("{prefix}-labels-idx1-ubyte{suffix}")),
            labels,
        )
        .expect("write");
    }

    /// Pixel `p` of the synthetic images (pixels 0..18) as the loader normalizes it.
    fn normalized(p: u8) -> f32 {
        let v: Vec<f64> = (0..18).map(|p| f64::from(p) / 255.0).collect();
        let mean = v.iter().sum::<f64>() / 18.0;
        let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / 18.0).sqrt();
        ((f64::from(p) / 255.0 - mean) / std) as f32
    }

    fn check_synthetic(ds: &ImageSet) {
        assert_eq!(ds.len(), 3);
        assert!(!ds.is_empty());
        assert_eq!(ds.dim(), 6);
        assert_eq!(ds.classes(), 10);
        assert_eq!(ds.labels(), &[7, 0, 9]);
        assert_eq!(ds.images().len(), 18);
        for (k, &v) in ds.images().iter().enumerate() {
            assert!((v - normalized(k as u8)).abs() < 1e-4, "pixel {k}: {v}");
        }
    }

    #[test]
    fn loads_raw_files() {
        let tmp = TempDir::new("raw");
        write_split(&tmp.0, "train", &idx3(3, 2, 3), &idx1(&[7, 0, 9]), false);
        let ds = ImageSet::load(&tmp.0, Split::Train).expect("load raw");
        check_synthetic(&ds);
    }

    #[test]
    fn loads_gzip_files_by_magic() {
        let tmp = TempDir::new("gz");
        write_split(
            &tmp.0,
            "t10k",
            &gzip(&idx3(3, 2, 3)),
            &gzip(&idx1(&[7, 0, 9])),
            true,
        );
        let ds = ImageSet::load(&tmp.0, Split::Test).expect("load gz");
        check_synthetic(&ds);
        // Gzip content under a plain name must also be recognized, since detection ignores names.
        let tmp = TempDir::new("gz-plain-name");
        write_split(
            &tmp.0,
            "train",
            &gzip(&idx3(3, 2, 3)),
            &gzip(&idx1(&[7, 0, 9])),
            false,
        );
        check_synthetic(&ImageSet::load(&tmp.0, Split::Train).expect("load gz without suffix"));
    }

    #[test]
    fn missing_files_say_what_to_do() {
        // A directory of one's own: what it must hold, not Fashion-MNIST's package.
        let tmp = TempDir::new("missing");
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("empty dir");
        assert!(matches!(err, DataError::Missing { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("train-images-idx3-ubyte"), "{msg}");
        assert!(!msg.contains("fashion"), "{msg}");
        // Fashion-MNIST's place: its package, or another directory.
        let hint = missing_hint(&Path::new(DEFAULT_DATA_DIR).join("train-images-idx3-ubyte"));
        assert!(
            hint.contains("apt-get install dataset-fashion-mnist"),
            "{hint}"
        );
        assert!(hint.contains("--data-dir"), "{hint}");
    }

    #[test]
    fn truncated_files_are_rejected() {
        let tmp = TempDir::new("trunc");
        let mut images = idx3(3, 2, 3);
        images.pop();
        write_split(&tmp.0, "train", &images, &idx1(&[7, 0, 9]), false);
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("short payload");
        assert!(
            matches!(
                err,
                DataError::Truncated {
                    needed: 34,
                    actual: 33,
                    ..
                }
            ),
            "{err:?}"
        );

        // A header cut short must fail the same way instead of indexing past the end.
        write_split(
            &tmp.0,
            "train",
            &idx3(3, 2, 3)[..10],
            &idx1(&[7, 0, 9]),
            false,
        );
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("short header");
        assert!(matches!(err, DataError::Truncated { .. }), "{err:?}");

        // A cut gzip stream is a decompression failure.
        let gz = gzip(&idx3(3, 2, 3));
        write_split(
            &tmp.0,
            "train",
            &gz[..gz.len() / 2],
            &idx1(&[7, 0, 9]),
            false,
        );
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("short gzip");
        assert!(matches!(err, DataError::Gzip { .. }), "{err:?}");

        // A header claiming an absurd size must not overflow or allocate.
        let mut huge = idx3(0, 0, 0);
        huge[4..16].copy_from_slice(&[0xff; 12]);
        write_split(&tmp.0, "train", &huge, &idx1(&[]), false);
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("huge header");
        assert!(matches!(err, DataError::Truncated { .. }), "{err:?}");
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let tmp = TempDir::new("trailing");
        let mut labels = idx1(&[7, 0, 9]);
        labels.push(1);
        write_split(&tmp.0, "train", &idx3(3, 2, 3), &labels, false);
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("extra byte");
        assert!(matches!(err, DataError::TrailingData { .. }), "{err:?}");
    }

    #[test]
    fn bad_magic_is_rejected() {
        let tmp = TempDir::new("magic");
        // Swapping the files gives each one the other's magic.
        write_split(&tmp.0, "train", &idx1(&[7, 0, 9]), &idx3(3, 2, 3), false);
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("swapped");
        assert!(
            matches!(
                err,
                DataError::BadMagic {
                    expected: IDX3_MAGIC,
                    found: IDX1_MAGIC,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn labels_set_the_class_count() {
        let tmp = TempDir::new("label");
        write_split(&tmp.0, "train", &idx3(3, 2, 3), &idx1(&[7, 200, 9]), false);
        let ds = ImageSet::load(&tmp.0, Split::Train).expect("any u8 label");
        assert_eq!(ds.classes(), 201);
        write_split(&tmp.0, "mine", &idx3(3, 2, 3), &idx1(&[1, 0, 1]), true);
        let ds = ImageSet::load_prefix(&tmp.0.join("mine")).expect("a prefix of .gz files");
        assert_eq!((ds.len(), ds.classes()), (3, 2));
    }

    #[test]
    fn count_mismatch_is_rejected() {
        let tmp = TempDir::new("count");
        write_split(&tmp.0, "train", &idx3(3, 2, 3), &idx1(&[7, 0]), false);
        let err = ImageSet::load(&tmp.0, Split::Train).expect_err("2 labels for 3 images");
        assert!(
            matches!(
                err,
                DataError::CountMismatch {
                    images: 3,
                    labels: 2,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn gather_and_truncate() {
        let tmp = TempDir::new("gather");
        write_split(&tmp.0, "train", &idx3(3, 2, 3), &idx1(&[7, 0, 9]), false);
        let mut ds = ImageSet::load(&tmp.0, Split::Train).expect("load");

        let (mut x, mut y) = (vec![42.0], vec![42]);
        ds.gather(&[2, 0, 2], &mut x, &mut y).expect("in range");
        assert_eq!(y, [9, 7, 9]);
        let expect: Vec<f32> = [
            12u8, 13, 14, 15, 16, 17, 0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17,
        ]
        .iter()
        .map(|&p| normalized(p))
        .collect();
        assert_eq!(x.len(), expect.len());
        for (a, b) in x.iter().zip(&expect) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }

        let err = ds.gather(&[0, 3], &mut x, &mut y).expect_err("index 3");
        assert!(
            matches!(err, DataError::IndexOutOfRange { index: 3, len: 3 }),
            "{err:?}"
        );
        assert_eq!(
            y,
            [9, 7, 9],
            "a failed gather must leave the batch untouched"
        );

        ds.truncate(10);
        assert_eq!(ds.len(), 3);
        ds.truncate(1);
        assert_eq!(ds.len(), 1);
        assert_eq!(ds.images().len(), 6);
        assert_eq!(ds.labels(), &[7]);
        assert!(ds.gather(&[1], &mut x, &mut y).is_err());
    }
}
