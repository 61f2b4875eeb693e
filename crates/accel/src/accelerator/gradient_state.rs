//! [`GradientState`]: the small piece of state the Accelerator and its data loaders share (Accelerate's
//! `GradientState`): whether the batch being processed is the last of its loader's epoch, and how many rows of it
//! are `even_batches` padding. `backward` reads the first to sync gradients at the end of the loader even inside
//! an accumulation window; `gather_for_metrics` reads the second to trim duplicates.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Shared, thread-safe flags written by a prepared data loader when it hands a batch to the user (not when it
/// prefetches it) and read by the Accelerator. Cheap to clone (one `Arc`).
#[derive(Debug, Clone, Default)]
pub struct GradientState {
    inner: Arc<Flags>,
}

#[derive(Debug, Default)]
struct Flags {
    end_of_dataloader: AtomicBool,
    padding_in_batch: AtomicUsize,
}

impl GradientState {
    /// A fresh state: not at the end of a loader, no padding.
    pub fn new() -> Self {
        Self::default()
    }

    /// Called by the loader with each batch it yields: `true` for the last batch of the epoch, `false` otherwise.
    pub fn set_end_of_dataloader(&self, end: bool) {
        self.inner.end_of_dataloader.store(end, Ordering::SeqCst);
    }

    /// Whether the batch most recently yielded is the last of its epoch.
    pub fn end_of_dataloader(&self) -> bool {
        self.inner.end_of_dataloader.load(Ordering::SeqCst)
    }

    /// Called by the loader with each batch it yields: how many of **this rank's** rows of the batch, counted from
    /// the end of the batch, are duplicates added by `even_batches` (0 for all but the last batch).
    pub fn set_padding_in_batch(&self, rows: usize) {
        self.inner.padding_in_batch.store(rows, Ordering::SeqCst);
    }

    /// Trailing duplicate rows in this rank's current batch.
    pub fn padding_in_batch(&self) -> usize {
        self.inner.padding_in_batch.load(Ordering::SeqCst)
    }

    /// Clears both flags (start of a new epoch, or the user left the loop early).
    pub fn reset(&self) {
        self.set_end_of_dataloader(false);
        self.set_padding_in_batch(0);
    }
}
