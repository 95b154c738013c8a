//! What tests and benchmarks of the detectors run beside or as a job: CPU hogs (other tenants
//! of the machine, slowing every process unevenly) and the sparse logistic regression's job
//! file on the agaricus data shipped in `deploy/data`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Threads that keep `n` cores busy until dropped.
#[derive(Debug)]
pub struct Hogs {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hogs {
    /// Starts `n` spinning threads.
    pub fn start(n: usize) -> Hogs {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(Ordering::Relaxed) {
                        for i in 0..100_000u64 {
                            x = std::hint::black_box(x.wrapping_mul(0x5851_f42d_4c95_7f2d) ^ i);
                        }
                    }
                })
            })
            .collect();
        Hogs { stop, threads }
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Training samples in agaricus' training file.
pub const AGARICUS_SAMPLES: u64 = 6_513;

/// Writes a job file into `dir` that trains the sparse logistic regression on agaricus for
/// `epochs` under ASP (batches of 8 rows, one key per feature); returns its path.
pub fn logreg_job(dir: &Path, epochs: u32) -> std::io::Result<PathBuf> {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/data/agaricus");
    let job = dir.join("logreg.toml");
    std::fs::write(
        &job,
        format!(
            "[model]\nkind = \"logreg\"\nfeatures = \"auto\"\n[optimizer]\nkind = \"sgd\"\n\
             lr = 0.5\n[training]\nconsistency = \"asp\"\nbatch_size = 8\nepochs = {epochs}\n\
             samples = \"auto\"\npartition_size = 512\nchunk_size = 1\n[data]\n\
             format = \"libsvm\"\ntrain = {:?}\ntest = {:?}\n",
            data.join("agaricus.txt.train"),
            data.join("agaricus.txt.test")
        ),
    )?;
    Ok(job)
}
