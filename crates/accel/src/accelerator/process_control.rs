//! Process control: printing once, barriers, main-process-first sections, splitting work, seeding.

use super::{lock, Accelerator};
use crate::Result;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

impl Accelerator {
    /// Prints `msg` (and a newline) on the main process only.
    pub fn print(&self, msg: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{msg}");
        }
    }

    /// Returns when every process has reached this point (a barrier).
    pub fn wait_for_everyone(&self) -> Result<()> {
        if self.world_size() > 1 {
            self.inner.pg.barrier()?;
        }
        Ok(())
    }

    /// Runs `f` on the main process first, then on the others (e.g. download or preprocess a data set once). The
    /// main process releases the others even when its `f` fails, and returns its error.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if self.is_main_process() {
            let r = f();
            self.wait_for_everyone()?;
            r
        } else {
            self.wait_for_everyone()?;
            f()
        }
    }

    /// This rank's contiguous share of `items` (Accelerate's `split_between_processes`): sizes differ by at most
    /// one, the first `len % world_size` ranks get one more; concatenating the shares in rank order gives `items`.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        let (start, end) = split_range(items.len(), self.rank(), self.world_size());
        items[start..end].to_vec()
    }

    /// Seeds the Accelerator's RNG ([`Accelerator::rng`]) and the device RNG (CUDA; candle's CPU RNG cannot be
    /// seeded) with `seed`, or `seed + rank` when `device_specific` (different dropout masks per rank).
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let seed = if device_specific { seed.wrapping_add(self.rank() as u64) } else { seed };
        *lock(&self.inner.rng) = ChaCha8Rng::seed_from_u64(seed);
        if !self.device().is_cpu() {
            if let Err(e) = self.device().set_seed(seed) {
                tracing::warn!("could not seed the device RNG: {e}");
            }
        }
    }
}

/// `[start, end)` of rank `rank`'s share of `len` items over `world` ranks.
pub(crate) fn split_range(len: usize, rank: usize, world: usize) -> (usize, usize) {
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let end = start + base + usize::from(rank < extra);
    (start, end)
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn split_covers_everything_in_order() {
        for len in 0..20 {
            for world in 1..6 {
                let mut next = 0;
                for r in 0..world {
                    let (s, e) = split_range(len, r, world);
                    assert_eq!(s, next);
                    assert!(e - s == len / world || e - s == len / world + 1);
                    next = e;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(split_range(5, 0, 2), (0, 3));
        assert_eq!(split_range(5, 1, 2), (3, 5));
    }
}
