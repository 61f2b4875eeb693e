//! [`Unit`]: a block of a model (a transformer layer) that the runtime treats as one piece — FULL_SHARD gathers
//! and frees its weights together, activation checkpointing recomputes it, DDP's overlapped backward cuts before
//! it — so the model's forward does none of that itself.

use super::builder::{PlanBook, VarBuilder};
use candle_core::{Module, Tensor};
use std::sync::Arc;

/// A block of a model built by [`unit`]: `forward` runs the block, and around it what the run's layout asks for
/// (FSDP's wrapped module, PyTorch's `checkpoint` wrapper and DDP's bucket boundary in one place):
///
/// - **FULL_SHARD**: the block's weights are gathered when it runs and dropped when it returns (it runs under
///   [`crate::activation_checkpoint::unit`]: gathered again and recomputed in the backward pass, its gradients
///   reduce-scattered before the backward moves on); the next unit's weights are prefetched while it computes,
///   and in the backward the unit before it.
/// - **Activation checkpointing** (`AcceleratorConfig::activation_checkpointing`): the block keeps no
///   activations and is recomputed in the backward pass ([`crate::activation_checkpoint::block`]).
/// - Otherwise a backward-segment cut before the block ([`crate::segments::cut`]: the identity unless the forward
///   is recorded), so DDP's overlapped backward reduces the blocks after it while the backward computes it.
///
/// At every layout the block computes the same values. `M` must be cheap to clone (the layers of `accel::nn` are:
/// they share their parameters), since the recomputation runs a clone of it.
#[derive(Clone)]
pub struct Unit<M> {
    inner: M,
    book: Arc<PlanBook>,
    index: usize,
}

/// Builds a unit at `vb`'s path (`vb.pp("layers").pp(i)`) with `build`, which makes the block's layers from the
/// builder it is given. Units are numbered in build order, which is the order their forwards run in (FULL_SHARD
/// prefetches the next one by that order). Errors: `build`'s.
pub fn unit<M>(
    vb: VarBuilder,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> candle_core::Result<Unit<M>> {
    let book = vb.book().clone();
    let index = book.add_unit(vb.prefix());
    Ok(Unit { inner: build(vb)?, book, index })
}

impl<M> Unit<M> {
    /// The block inside.
    pub fn inner(&self) -> &M {
        &self.inner
    }
}

impl<M: Module + Clone + 'static> Module for Unit<M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.book.forget_column_input();
        if let Some(source) = self.book.source() {
            if let Some(next) = self.book.unit(self.index + 1) {
                source.prefetch(&next)?;
            }
            let before = self.index.checked_sub(1).and_then(|i| self.book.unit(i));
            let inner = self.inner.clone();
            let recomputing = std::cell::Cell::new(false);
            return crate::activation_checkpoint::unit(x, move |x| {
                // The second run is the backward's recomputation: the unit before it is the next one needed.
                if recomputing.replace(true) {
                    if let Some(before) = &before {
                        source.prefetch(before)?;
                    }
                }
                inner.forward(x)
            });
        }
        if crate::activation_checkpoint::enabled() {
            let inner = self.inner.clone();
            return crate::activation_checkpoint::block(x, move |x| inner.forward(x));
        }
        self.inner.forward(&crate::segments::cut(x)?)
    }
}
