//! The book's walk-throughs (`docs/src/*.md`), run as written: every `sh` block of a chapter,
//! in order, with bash, in a scratch folder that looks like a checkout (its folders made again,
//! each file linked to this one's) whose `target/release/` and `target/debug/` hold the programs the tests
//! built. A block's commands must all succeed (`set -euo pipefail`) within [`BLOCK_LIMIT`];
//! whatever a block starts in the background (`cmd &`) is stopped when it ends (its process
//! group is killed). Blocks of one chapter share the folder, so a later block sees what an
//! earlier one wrote.
//!
//! What stands in for what, and why (each is visible in the prelude [`PRELUDE`]):
//! - `cargo build ...` is the tests' build, already made (a release build would take CI 10
//!   minutes); `cargo run [-p P] [--bin B] -- ARGS` runs that build's `B` (or `P`) with ARGS.
//! - `sudo CMD` is `CMD`; `apt-get install PKG...` checks that every PKG is installed (CI
//!   installs them: `.ci/run`, `deploy/test.sh`) and fails naming the one that is not.
//! - `.venv` is the venv `deploy/test.sh` made with the Python chapter's install command
//!   (`EDL_BOOK_VENV`, set when test.sh walks that chapter after the Python tests).
//!
//! A chapter's author steers the harness with HTML comments (mdBook does not render them) on
//! the lines right above a block's fence:
//! - `<!-- book-test: skip REASON -->`: the block is not run; REASON says what runs it
//!   instead (CI's own commands, another test) or why it cannot run here.
//! - `<!-- book-test: with FROM => TO -->`: FROM is replaced by TO in the block before it
//!   runs (to make a long run short: a few seeds instead of thousands).
//! - `<!-- book-test: expect TEXT -->`: the block's output must contain TEXT.
//! - `<!-- book-test: needs fashion-mnist | torch | venv -->`: the block needs that dataset,
//!   PyTorch, or the venv of `EDL_BOOK_VENV`; without it the chapter is skipped here (a failure
//!   where CI installs the dataset or PyTorch).
//!
//! Every chapter with a `sh` block is walked by a test here or named in [`ELSEWHERE`]: a new
//! chapter cannot escape (`every_chapter_with_commands_is_walked`).

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The book's chapters.
const BOOK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/src");

/// The checkout.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The most one block may take.
const BLOCK_LIMIT: Duration = Duration::from_secs(300);

/// Chapters whose commands another test runs, and which.
const ELSEWHERE: &[(&str, &str)] = &[(
    "running-by-hand.md",
    "ps/tests/readme_by_hand.rs runs its section with edl-ps and edlctl on loopback",
)];

/// The programs of the workspace a chapter may run, linked into the scratch checkout's
/// `target/release/` and `target/debug/` (and on its PATH), with the examples they name.
const PROGRAMS: &[&str] = &[
    "edl-ps",
    "edlctl",
    "edl-worker",
    "edl-local",
    "edl-sched",
    "edl-sim",
    "edl-dst",
    "edl-bench",
];
const EXAMPLES: &[&str] = &["two_layer"];

/// Bash before every block: see the module's doc.
const PRELUDE: &str = r#"set -euo pipefail
cargo() {  # the tests' build stands for cargo's (deploy/tests/book.rs)
  case "$1" in
    build) echo "book-test: 'cargo $*': the tests' build in target/ stands for it" >&2 ;;
    run)
      shift
      local pkg="" bin=""
      while [ $# -gt 0 ]; do
        case "$1" in
          --) shift; break ;;
          -p|--package) pkg="$2"; shift 2 ;;
          --bin) bin="$2"; shift 2 ;;
          *) shift ;;
        esac
      done
      "$BOOK_BIN/${bin:-$pkg}" "$@" ;;
    *) echo "book-test: nothing stands for 'cargo $1'" >&2; return 1 ;;
  esac
}
sudo() { "$@"; }
apt-get() {
  [ "$1" = install ] || { echo "book-test: nothing stands for 'apt-get $1'" >&2; return 1; }
  shift
  local p
  for p in "$@"; do
    case "$p" in
      -*) ;;
      *) dpkg -s "$p" >/dev/null 2>&1 || { echo "book-test: $p is not installed (CI installs it)" >&2; return 1; } ;;
    esac
  done
}
export -f cargo sudo apt-get
"#;

/// One `sh` block and what the comments above it ask.
#[derive(Debug, Default)]
struct Block {
    /// The line of its opening fence (1-based).
    line: usize,
    text: String,
    skip: Option<String>,
    with: Vec<(String, String)>,
    expect: Vec<String>,
    needs: Vec<Need>,
}

/// The `sh` blocks of a chapter, with their directives. Errors name the line of a directive
/// the harness does not know or cannot place.
fn blocks(chapter: &str) -> Result<Vec<Block>, String> {
    enum At {
        Text,
        Sh(Block),
        Other,
    }
    let mut out = Vec::new();
    let mut pending = Block::default();
    let mut at = At::Text;
    for (i, line) in chapter.lines().enumerate() {
        let t = line.trim();
        let fence = t.starts_with("```");
        at = match at {
            At::Sh(mut b) if !fence => {
                b.text.push_str(line);
                b.text.push('\n');
                At::Sh(b)
            }
            At::Sh(b) => {
                out.push(b);
                At::Text
            }
            At::Other if fence => At::Text,
            At::Other => At::Other,
            At::Text if fence => {
                let mut b = std::mem::take(&mut pending);
                b.line = i + 1;
                if t == "```sh" {
                    At::Sh(b)
                } else if b.directed() {
                    return Err(format!(
                        "line {}: a book-test directive above a block that is not sh",
                        i + 1
                    ));
                } else {
                    At::Other
                }
            }
            At::Text => {
                if let Some(d) = t
                    .strip_prefix("<!-- book-test:")
                    .and_then(|d| d.strip_suffix("-->"))
                {
                    pending
                        .direct(d.trim())
                        .map_err(|e| format!("line {}: {e}", i + 1))?;
                } else if !t.is_empty() && pending.directed() {
                    return Err(format!(
                        "line {}: a book-test directive must stand right above its block's fence",
                        i + 1
                    ));
                }
                At::Text
            }
        };
    }
    match at {
        At::Text => Ok(out),
        _ => Err("the last block is not closed".into()),
    }
}

impl Block {
    fn directed(&self) -> bool {
        self.skip.is_some()
            || !self.with.is_empty()
            || !self.expect.is_empty()
            || !self.needs.is_empty()
    }

    /// Takes one directive (the comment's text after `book-test:`).
    fn direct(&mut self, d: &str) -> Result<(), String> {
        let (word, rest) = d.split_once(' ').unwrap_or((d, ""));
        let rest = rest.trim().to_string();
        match word {
            "skip" if !rest.is_empty() => self.skip = Some(rest),
            "with" => match rest.split_once(" => ") {
                Some((from, to)) => self.with.push((from.to_string(), to.to_string())),
                None => return Err("`with FROM => TO`".into()),
            },
            "expect" if !rest.is_empty() => self.expect.push(rest),
            "needs" if let Some(need) = Need::named(&rest) => self.needs.push(need),
            _ => {
                return Err(format!(
                    "unknown directive {d:?} (skip REASON, with FROM => TO, expect TEXT, \
                     needs fashion-mnist|torch|venv)"
                ));
            }
        }
        Ok(())
    }

    /// The text to run: every `with` applied, each one found.
    fn script(&self) -> Result<String, String> {
        let mut text = self.text.clone();
        for (from, to) in &self.with {
            if !text.contains(from.as_str()) {
                return Err(format!("`with {from} => {to}`: the block has no {from:?}"));
            }
            text = text.replace(from.as_str(), to);
        }
        Ok(text)
    }
}

/// What a block may need that a machine may lack.
#[derive(Debug)]
enum Need {
    FashionMnist,
    Torch,
    Venv,
}

/// Why a need is not met here: the variable that makes it a failure (none: always a skip),
/// what is missing, how to get it.
struct Lack {
    require: Option<&'static str>,
    what: &'static str,
    how: &'static str,
}

/// The variable naming the venv with the `edl` package installed that a chapter's `.venv`
/// stands for: `deploy/test.sh` sets it, after its own install, to walk the Python chapter.
const VENV: &str = "EDL_BOOK_VENV";

impl Need {
    fn named(name: &str) -> Option<Need> {
        match name {
            "fashion-mnist" => Some(Need::FashionMnist),
            "torch" => Some(Need::Torch),
            "venv" => Some(Need::Venv),
            _ => None,
        }
    }

    /// `None` if this machine has it.
    fn lacking(&self) -> Option<Lack> {
        let (has, lack) = match self {
            Need::FashionMnist => (
                Path::new("/usr/share/datasets/fashion-mnist").is_dir(),
                Lack {
                    require: Some("EDL_REQUIRE_DATA"),
                    what: "Fashion-MNIST",
                    how: "apt-get install dataset-fashion-mnist",
                },
            ),
            Need::Torch => (
                Command::new("/usr/bin/python3")
                    .args(["-c", "import torch, numpy, venv"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success()),
                Lack {
                    require: Some("EDL_REQUIRE_TORCH"),
                    what: "PyTorch",
                    how: "apt-get install python3-venv python3-numpy python3-torch",
                },
            ),
            Need::Venv => (
                std::env::var_os(VENV).is_some(),
                Lack {
                    require: None,
                    what: "a venv with the edl package",
                    how: "deploy/test.sh walks this chapter after its install, with EDL_BOOK_VENV",
                },
            ),
        };
        (!has).then_some(lack)
    }
}

/// A scratch checkout under the tests' temporary folder: this one's folders made again, each
/// of its files linked in (so a path that climbs out of a folder, `../../target/...`, stays
/// in the scratch checkout), but `target/`, whose `release/` and `debug/` hold links to the
/// tests' programs.
fn scratch(programs: &Path) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("edl-book-")
        .tempdir()
        .expect("a scratch folder");
    let root = Path::new(ROOT).canonicalize().expect("the checkout");
    for entry in std::fs::read_dir(&root).expect("the checkout") {
        let entry = entry.expect("an entry");
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        mirror(&entry.path(), &dir.path().join(&name)).expect("mirrors the checkout");
    }
    for profile in ["release", "debug"] {
        let bin = dir.path().join("target").join(profile);
        std::fs::create_dir_all(bin.join("examples")).expect("target/");
        for p in PROGRAMS {
            let at = programs.join(p);
            assert!(
                at.is_file(),
                "{} is missing: build the workspace's programs and examples first \
                 (cargo build --workspace --bins --examples, or cargo nextest run --workspace)",
                at.display()
            );
            std::os::unix::fs::symlink(&at, bin.join(p)).expect("links");
        }
        for e in EXAMPLES {
            let at = programs.join("examples").join(e);
            assert!(
                at.is_file(),
                "{} is missing: cargo build --workspace --examples",
                at.display()
            );
            std::os::unix::fs::symlink(&at, bin.join("examples").join(e)).expect("links");
        }
    }
    if let Some(venv) = std::env::var_os(VENV) {
        let venv = Path::new(ROOT).join(venv);
        std::os::unix::fs::symlink(venv, dir.path().join(".venv")).expect("links the venv");
    }
    dir
}

/// `to` made as `from`: folders created, files (and links) linked to `from`'s.
fn mirror(from: &Path, to: &Path) -> std::io::Result<()> {
    if !std::fs::symlink_metadata(from)?.is_dir() {
        return std::os::unix::fs::symlink(from, to);
    }
    std::fs::create_dir(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        mirror(&entry.path(), &to.join(entry.file_name()))?;
    }
    Ok(())
}

/// Runs one block in `dir` as its own process group, killed whole when the block ends;
/// `Err` holds what went wrong and the output.
fn run(block: &Block, script: &str, dir: &Path) -> Result<String, String> {
    let bin = dir.join("target/debug");
    let file = dir.join(format!(".book-block-{}.sh", block.line));
    std::fs::write(&file, format!("{PRELUDE}\n{script}")).expect("writes the block");
    let log = dir.join(format!(".book-block-{}.log", block.line));
    let out = std::fs::File::create(&log).expect("a log");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("bash")
        .arg(&file)
        .current_dir(dir)
        .env("PATH", path)
        .env("BOOK_BIN", &bin)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .process_group(0)
        .spawn()
        .expect("bash runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break Some(status);
        }
        if started.elapsed() > BLOCK_LIMIT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // What the block left running in the background, and everything those started.
    let group = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    let _ = child.wait();
    let mut text = String::new();
    let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut text));
    match status {
        Some(s) if s.success() => Ok(text),
        Some(s) => Err(format!("it failed ({s}):\n{text}")),
        None => Err(format!("it ran past {BLOCK_LIMIT:?}:\n{text}")),
    }
}

/// Walks one chapter: see the module's doc.
fn walk(chapter: &str) {
    let path = Path::new(BOOK).join(chapter);
    let text = std::fs::read_to_string(&path).expect("reads the chapter");
    let blocks = blocks(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(!blocks.is_empty(), "{chapter} has no sh block to walk");
    for b in &blocks {
        for n in &b.needs {
            if let Some(lack) = n.lacking() {
                match lack.require {
                    Some(require) => {
                        edl_shared::skip::missing(require, chapter, lack.what, lack.how)
                    }
                    None => edl_shared::skip::skipped(
                        chapter,
                        &format!("{} is missing ({})", lack.what, lack.how),
                    ),
                }
                return;
            }
        }
    }
    // The folder the tests' programs are in (`target/debug`).
    let programs = edl_testkit::procs::bin("");
    let dir = scratch(&programs);
    for b in &blocks {
        let at = format!("docs/src/{chapter}:{}", b.line);
        if let Some(why) = &b.skip {
            eprintln!("{at}: not run here: {why}");
            continue;
        }
        let script = b.script().unwrap_or_else(|e| panic!("{at}: {e}"));
        let started = Instant::now();
        let out = run(b, &script, dir.path())
            .unwrap_or_else(|e| panic!("{at}: the block\n{script}\n{e}"));
        for want in &b.expect {
            assert!(
                out.contains(want.as_str()),
                "{at}: the block's output lacks {want:?}:\n{out}"
            );
        }
        eprintln!("{at}: ran in {:.1} s", started.elapsed().as_secs_f64());
    }
}

/// The chapters walked here.
macro_rules! chapters {
    ($($test:ident => $file:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                walk($file);
            }
        )*
        const WALKED: &[&str] = &[$($file),*];
    };
}

chapters! {
    getting_started => "getting-started.md",
    python => "python.md",
    scheduler => "scheduler.md",
    elastic_operations => "elastic-operations.md",
    replicated_shards => "replicated-shards.md",
    high_availability => "high-availability.md",
    bring_your_own_model => "bring-your-own-model.md",
    simulation => "simulation.md",
}

#[test]
fn every_chapter_with_commands_is_walked() {
    let mut unwalked = Vec::new();
    for entry in std::fs::read_dir(BOOK).expect("the book") {
        let path = entry.expect("an entry").path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !name.ends_with(".md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("reads");
        let blocks = blocks(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let walked = WALKED.contains(&name) || ELSEWHERE.iter().any(|(c, _)| *c == name);
        if !blocks.is_empty() && !walked {
            unwalked.push(name.to_string());
        }
    }
    assert!(
        unwalked.is_empty(),
        "chapters with sh blocks no test walks: {unwalked:?} (add them to chapters! in \
         deploy/tests/book.rs)"
    );
}

#[test]
fn the_directives_are_read_as_written() {
    let chapter = "text\n\n<!-- book-test: with 1..2000 => 1..20 -->\n<!-- book-test: expect done -->\n\
                   ```sh\nedl-dst --seeds 1..2000\n```\n\n```toml\nx = 1\n```\n\
                   <!-- book-test: skip CI runs it -->\n```sh\n./deploy/test.sh\n```\n";
    let b = blocks(chapter).expect("reads");
    assert_eq!(b.len(), 2);
    assert_eq!(b[0].line, 5);
    assert_eq!(b[0].script().expect("applies"), "edl-dst --seeds 1..20\n");
    assert_eq!(b[0].expect, ["done"]);
    assert_eq!(b[1].skip.as_deref(), Some("CI runs it"));
    assert!(blocks("<!-- book-test: sometimes -->\n```sh\nx\n```\n").is_err());
    assert!(blocks("<!-- book-test: skip why -->\ntext\n```sh\nx\n```\n").is_err());
    assert!(blocks("<!-- book-test: skip why -->\n```toml\nx\n```\n").is_err());
    let missing = Block {
        text: "a\n".into(),
        with: vec![("b".into(), "c".into())],
        ..Block::default()
    };
    assert!(missing.script().is_err());
}
