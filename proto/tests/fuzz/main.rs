//! Property tests of every decoder in `edl-proto`: frames, prefixes, headers, float payloads,
//! the key layout, the shard map and the text forms of job settings.
//!
//! Each property runs a bounded number of cases from a fixed seed, so a plain `cargo test` is
//! quick and repeatable. For a deeper run, set `PROPTEST_CASES` (and `PROPTEST_RNG_SEED` for
//! other inputs), e.g. `PROPTEST_CASES=100000 cargo test --release -p edl-proto --test fuzz`.
//! Inputs that once broke a decoder are kept as plain tests in `regressions.rs`.

mod floats;
mod frames;
mod job;
mod regressions;
mod strategies;

use edl_proto::{ErrorCode, ProtoError};
use proptest::test_runner::{Config, RngSeed, TestCaseError};

/// The seed every property starts from unless `PROPTEST_RNG_SEED` says otherwise.
const SEED: u64 = 0x00ed_1f00_2f00_2f00;

/// A configuration running `cases` cases from [`SEED`]. The environment's `PROPTEST_CASES` and
/// `PROPTEST_RNG_SEED` win when set. Failures are not written to files: a failing input is
/// turned into a test in `regressions.rs` instead, where it documents the bug it found.
pub fn config(cases: u32) -> Config {
    let env = Config::default();
    let set = |name: &str| std::env::var_os(name).is_some();
    Config {
        cases: if set("PROPTEST_CASES") {
            env.cases
        } else {
            cases
        },
        rng_seed: if set("PROPTEST_RNG_SEED") {
            env.rng_seed
        } else {
            RngSeed::Fixed(SEED)
        },
        failure_persistence: None,
        ..env
    }
}

/// Checks what every decoding error must give: a stable wire code that decodes back to itself,
/// and a message for humans.
pub fn check_error(e: &ProtoError) -> Result<(), TestCaseError> {
    let code = e.code();
    proptest::prop_assert_eq!(ErrorCode::from_u16(code.as_u16()), Some(code));
    proptest::prop_assert!(!e.to_string().is_empty());
    Ok(())
}
