//! Activation checkpointing per block (PyTorch's `torch.utils.checkpoint`, HF's `gradient_checkpointing`, FSDP's
//! activation checkpointing; Chen et al. 2016): a model wraps each block's forward in [`block`]; when the run
//! asks for it (`AcceleratorConfig::activation_checkpointing`, `ACCEL_ACTIVATION_CHECKPOINTING`, the Trainer's
//! `gradient_checkpointing`), the block keeps no activations in the forward pass and is computed again when the
//! backward pass reaches it ([`crate::segments::checkpoint`]) — one more forward per block for the memory of its
//! activations. The gradients are those of the run without it: the recomputation repeats the same ops on the same
//! values, under the same dropout masks (the context of the forward is carried into it; masks are addressed, not
//! drawn from a generator that moved on).
//!
//! Where it applies: forwards recorded for a segmented backward — `Accelerator::pipeline_backward` (at pp 1 the
//! whole forward, under pp each stage's forward in the pipeline executor), a loop using `backward_segments`, the
//! Trainer. Elsewhere (evaluation, a plain `backward`) [`block`] runs the block as it is.

use crate::tensor_parallel::{dropout_context, with_dropout_context};
use candle_core::Tensor;
use std::cell::Cell;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    /// Block forwards run again by backward passes on this thread.
    static RECOMPUTED: Cell<u64> = const { Cell::new(0) };
}

/// How many block forwards the backward passes of this thread ran again (a diagnostic: it proves the blocks were
/// checkpointed, and says what the recomputation cost in forwards; per thread, as a rank's training step runs on
/// one).
pub fn blocks_recomputed() -> u64 {
    RECOMPUTED.with(Cell::get)
}

/// Runs `f` with activation checkpointing on or off for the blocks it runs on this thread (the training step
/// does, from the Accelerator's config).
pub fn with_activation_checkpointing<R>(on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(ON.with(|c| c.replace(on)));
    f()
}

/// Whether the current training forward checkpoints its blocks.
pub fn enabled() -> bool {
    ON.with(Cell::get)
}

/// One block of a model: `forward(x)`, checkpointed when the run asks for it (see the module documentation).
/// `forward` must be `'static` (clone the block into it: candle tensors are shared, a clone costs nothing).
///
/// Errors: `forward`'s.
pub fn block(
    x: &Tensor,
    forward: impl Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
) -> candle_core::Result<Tensor> {
    if !enabled() {
        return forward(x);
    }
    checkpointed(x, forward)
}

/// One FULL_SHARD unit (FSDP's wrapped module; Zhao et al. 2023, "PyTorch FSDP", §3.1): `forward(x)` builds the
/// unit from a gathering [`crate::ParamBuilder`] (`PreparedModel::param_builder`) and runs it. In a recorded
/// forward (a segmented backward: `pipeline_backward` at pp 1, `backward_segments`, the Trainer) it is always
/// checkpointed — its gathered weights and activations are dropped when it returns, and the backward pass gathers
/// the weights again, recomputes the unit and reduce-scatters its gradients before the next unit's backward — so
/// at most one unit's whole weights are alive at a time. Elsewhere (a plain `backward`, evaluation) it runs as it
/// is and the graph keeps its gathered weights until the backward pass. The gradients are the same either way.
///
/// Errors: `forward`'s.
pub fn unit(
    x: &Tensor,
    forward: impl Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
) -> candle_core::Result<Tensor> {
    checkpointed(x, forward)
}

/// `forward` under [`crate::segments::checkpoint`], run again under the forward's dropout context; recomputations
/// counted.
fn checkpointed(
    x: &Tensor,
    forward: impl Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
) -> candle_core::Result<Tensor> {
    let ctx = dropout_context();
    let first = Cell::new(true); // the forward's own run is not a recomputation
    crate::segments::checkpoint(x, move |x| {
        if !first.replace(false) {
            RECOMPUTED.with(|c| c.set(c.get() + 1));
        }
        match ctx {
            Some(ctx) => with_dropout_context(ctx, || forward(x)),
            None => forward(x),
        }
    })
}
