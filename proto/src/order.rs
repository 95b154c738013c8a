//! The sample order of an epoch: a specified permutation, so that a worker in any language
//! derives the same sample indices for the same data span.
//!
//! # The algorithm (normative)
//!
//! Epoch `e` (0-based) of a job with seed `s` and `n` training samples visits the samples in
//! the order `order[0], order[1], …, order[n-1]`, computed as follows. All arithmetic is on
//! unsigned 64-bit integers and wraps.
//!
//! 1. `state = s XOR ((e + 1) * 0xA0761D6478BD642F)`.
//! 2. `next()` is SplitMix64: `state += 0x9E3779B97F4A7C15; z = state;
//!    z = (z XOR (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z XOR (z >> 27)) * 0x94D049BB133111EB;
//!    return z XOR (z >> 31)`.
//! 3. `order = [0, 1, …, n-1]`; then for `i` from `n-1` down to `1`:
//!    `j = next() mod (i + 1)`; swap `order[i]` and `order[j]` (Fisher–Yates).
//!
//! The modulo's bias is below 2^-32 for any `n` a job can have (`n < 2^32`), far below what a
//! shuffle needs. A data span `[start, end)` of epoch `e` holds the samples
//! `order[start..end]`; the test vectors below pin the algorithm, and any other
//! implementation must reproduce them:
//!
//! | seed | epoch | n      | order                                          |
//! |------|-------|--------|------------------------------------------------|
//! | 42   | 0     | 10     | 5, 0, 2, 4, 6, 7, 9, 1, 3, 8                   |
//! | 42   | 1     | 10     | 0, 2, 7, 1, 3, 4, 9, 5, 8, 6                   |
//! | 7    | 2     | 60000  | 37805, 49164, 53664, …; FNV-1a 64 of the little-endian bytes 0x2c35a04480a91ec5 |

/// The SplitMix64 generator of step 2.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The order in which epoch `epoch` of a job seeded with `seed` visits its first `n` samples
/// (see the module documentation for the algorithm).
pub fn epoch_order(seed: u64, epoch: u32, n: u32) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n).collect();
    let mut rng = SplitMix64(seed ^ (u64::from(epoch) + 1).wrapping_mul(0xA076_1D64_78BD_642F));
    for i in (1..order.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a over the little-endian bytes of the order: one number that pins a long order.
    fn fnv(order: &[u32]) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in order.iter().flat_map(|v| v.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    #[test]
    fn splitmix_matches_the_reference_outputs() {
        // The published SplitMix64 outputs for seed 0 (Vigna's reference implementation).
        let mut g = SplitMix64(0);
        assert_eq!(g.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(g.next(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn test_vectors() {
        assert_eq!(epoch_order(0, 0, 0), Vec::<u32>::new());
        assert_eq!(epoch_order(0, 0, 1), vec![0]);
        assert_eq!(epoch_order(42, 0, 10), TEN_SEED42_EPOCH0);
        assert_eq!(epoch_order(42, 1, 10), TEN_SEED42_EPOCH1);
        let long = epoch_order(7, 2, 60_000);
        assert_eq!(long[..3], [37805, 49164, 53664]);
        assert_eq!(fnv(&long), FNV_SEED7_EPOCH2_60000);
    }

    #[test]
    fn is_a_permutation_that_differs_by_epoch_and_seed() {
        let a = epoch_order(7, 0, 1000);
        assert_ne!(a, epoch_order(7, 1, 1000));
        assert_ne!(a, epoch_order(8, 0, 1000));
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
    }

    const TEN_SEED42_EPOCH0: [u32; 10] = [5, 0, 2, 4, 6, 7, 9, 1, 3, 8];
    const TEN_SEED42_EPOCH1: [u32; 10] = [0, 2, 7, 1, 3, 4, 9, 5, 8, 6];
    /// FNV-1a (64-bit) of the little-endian bytes of the order; it starts 37805, 49164, 53664.
    const FNV_SEED7_EPOCH2_60000: u64 = 0x2c35_a044_80a9_1ec5;
}
