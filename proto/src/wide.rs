//! Hot loops over floats, compiled a second time for wider vector units and picked at run
//! time. Builds target plain x86-64 (SSE2, four floats per instruction) so that one binary
//! runs on any x86-64 machine; where the CPU has AVX-512 or AVX2, [`wide`] runs the same loop
//! compiled for it (sixteen or eight floats per instruction).
//!
//! Only instruction selection changes: Rust never fuses a multiply and an add on its own, and
//! every operation these loops use (+, −, ×, ÷, √, comparisons) is exactly rounded, so each
//! version computes bit for bit the same results.

/// A loop to run with [`wide`]: its [`Loop::run`] must be `#[inline(always)]`, and so must
/// whatever it calls that is not already inlined (iterator chains are), so that the whole loop
/// is compiled into each version. (A closure would not do: the compiler may keep it a function
/// of its own, compiled once for the baseline.)
pub trait Loop {
    /// What the loop returns.
    type Out;
    /// The loop.
    fn run(self) -> Self::Out;
}

/// Runs `l` compiled for the widest vector unit this CPU has (checked once per process; the
/// check is then a load).
///
/// The crate's only unsafe code: calling a function compiled for CPU features is unsafe
/// unless the CPU was checked for them, as it is right before each call.
#[inline(always)]
#[allow(unsafe_code)]
pub fn wide<L: Loop>(l: L) -> L::Out {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above), all `avx512` enables.
            return unsafe { avx512(l) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above), all `avx2` enables.
            return unsafe { avx2(l) };
        }
    }
    l.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn avx512<L: Loop>(l: L) -> L::Out {
    l.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn avx2<L: Loop>(l: L) -> L::Out {
    l.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of every operation the optimizers use.
    struct Step<'a>(&'a [f32]);

    impl Loop for Step<'_> {
        type Out = Vec<f32>;
        #[inline(always)]
        fn run(self) -> Vec<f32> {
            self.0
                .iter()
                .map(|&v| v - 0.01 * (v * v).sqrt() / (1.0 + v.abs()))
                .collect()
        }
    }

    #[test]
    #[allow(unsafe_code)]
    fn every_version_computes_the_same_bits() {
        // Values across the range, subnormals and signed zeros included.
        let xs: Vec<f32> = (0..4099u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761) & 0xbf7f_ffff))
            .collect();
        let same = |v: &[f32], w: &[f32]| v.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        let base = Step(&xs).run();
        assert!(same(&base, &wide(Step(&xs))), "the widest version differs");
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: checked just above.
                assert!(same(&base, &unsafe { avx2(Step(&xs)) }), "AVX2 differs");
            }
        }
    }
}
