//! Backward segments: the backward pass of one forward run piece by piece, so gradient communication can start
//! while the rest of the backward pass still computes.
//!
//! PyTorch's DDP starts a bucket's all-reduce from autograd hooks the moment its last gradient is produced (Li et
//! al., "PyTorch Distributed", VLDB 2020, §3.2.3). candle has no hooks: `Tensor::backward` returns every gradient
//! at once. Instead the model marks *cut points* in its forward pass with [`cut`] — typically between layers or
//! transformer blocks — and the backward pass runs one segment at a time, from the loss back to the first cut.
//! After each segment the gradients of the parameters it reached are complete (unless an earlier segment uses
//! them too), and [`crate::DistributedDataParallel::backward`] all-reduces their buckets on a communication
//! thread while the next segment computes.
//!
//! ```no_run
//! # fn main() -> ddp_core::Result<()> {
//! # let (pg, varmap) = (ddp_core::ProcessGroup::single_process()?, candle_nn::VarMap::new());
//! # let (layer1, layer2, x) = (candle_nn::Linear::new(x(), None), candle_nn::Linear::new(x(), None), x());
//! # fn x() -> candle_core::Tensor { unimplemented!() }
//! use candle_core::Module;
//! use ddp_core::{segments, DdpOptions, DistributedDataParallel};
//! let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default())?;
//! // In the model's forward: `segments::cut` marks where one segment ends (a no-op outside `record`).
//! let (loss, cuts) = segments::record(|| -> ddp_core::Result<_> {
//!     let h = segments::cut(&layer1.forward(&x)?)?;
//!     Ok(layer2.forward(&h)?.sum_all()?)
//! })?;
//! let grads = ddp.backward(&loss, cuts)?; // = loss.backward() + sync_gradients, overlapped
//! # let _ = grads; Ok(()) }
//! ```
//!
//! How a cut works: [`cut`]`(x)` returns a fresh leaf variable holding `x`'s values (one copy of the
//! activation) and remembers `x`. The graph after the cut starts at the leaf, so `loss.backward()` stops there
//! and yields the gradient of the leaf, `g`. The next segment's backward starts at `x` with `g` as its incoming
//! gradient (a custom op whose backward returns `g`), exactly the gradient a single backward pass would have
//! propagated into `x`: the parameter gradients are the same values computed by the same ops (the one
//! difference: a gradient that is exactly −0.0 at a cut arrives as +0.0).
//!
//! [`checkpoint`] builds activation checkpointing on the same cuts: a block whose forward ran without keeping its
//! activations is recomputed when the backward pass reaches it.
//!
//! Rules: cuts are recorded only inside [`record`] (on the calling thread) and only on tensors that carry a
//! gradient (an input or a detached tensor is returned unchanged). Recording scopes nest; a cut goes to the
//! innermost. Outside a recording, [`cut`] is the identity and costs nothing, so a model that marks cuts runs
//! unchanged in evaluation and in code that calls `loss.backward()` itself.

use crate::{DdpError, Result};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var};
use std::cell::RefCell;

/// One cut: the tensor the forward pass produced and the leaf the rest of the graph was built on.
struct Cut {
    source: Source,
    leaf: Var,
}

/// Where a cut's backward continues from.
enum Source {
    /// The tensor the forward pass produced (its graph kept).
    Kept(Tensor),
    /// A checkpointed block's output, recomputed at the backward pass from its input (a leaf of the previous cut)
    /// by the block's forward ([`checkpoint`]).
    Recompute { input: Tensor, forward: Box<Recompute> },
}

/// A checkpointed block's forward, run again during the backward pass.
type Recompute = dyn Fn(&Tensor) -> candle_core::Result<Tensor>;

/// The cut points of one recorded forward pass, in forward order (what [`record`] returns).
///
/// `n` cuts make `n + 1` segments; segment 0 runs from the inputs to the first cut, segment `n` from the last cut
/// to the loss. [`BackwardSegments::backward`] visits them from `n` down to 0.
#[derive(Default)]
#[must_use = "a recorded forward pass needs its segments' backward: DistributedDataParallel::backward(&loss, cuts) or \
              Accelerator::backward_segments; a plain backward() stops at the first cut"]
pub struct BackwardSegments {
    cuts: Vec<Cut>,
}

impl Drop for BackwardSegments {
    /// Cuts dropped without their backward pass mean the gradient of every layer before them was never computed
    /// if the caller ran a plain `loss.backward()` instead: say so (nothing to say for an evaluation pass, which
    /// records no cut on tensors that carry no gradient).
    fn drop(&mut self) {
        if !self.cuts.is_empty() && !std::thread::panicking() {
            tracing::warn!(
                cuts = self.cuts.len(),
                "backward segments dropped without their backward pass: a plain loss.backward() stops at the first \
                 cut, so the layers before it get no gradient; pass them to DistributedDataParallel::backward or \
                 Accelerator::backward_segments"
            );
        }
    }
}

impl std::fmt::Debug for BackwardSegments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackwardSegments").field("cuts", &self.cuts.len()).finish()
    }
}

thread_local! {
    /// The open recordings of this thread, innermost last.
    static RECORDING: RefCell<Vec<Vec<Cut>>> = const { RefCell::new(Vec::new()) };
}

/// Pops the recording `record` pushed, also when `f` panics or returns early.
struct Recording;

impl Drop for Recording {
    fn drop(&mut self) {
        RECORDING.with(|r| r.borrow_mut().pop());
    }
}

/// Runs `f` (a forward pass) and returns its result with the cuts [`cut`] recorded while it ran on this thread.
pub fn record<R, E>(f: impl FnOnce() -> std::result::Result<R, E>) -> std::result::Result<(R, BackwardSegments), E> {
    RECORDING.with(|r| r.borrow_mut().push(Vec::new()));
    let guard = Recording;
    let out = f()?;
    let cuts = RECORDING.with(|r| std::mem::take(r.borrow_mut().last_mut().expect("pushed above")));
    drop(guard);
    Ok((out, BackwardSegments { cuts }))
}

/// Marks the end of a backward segment at `x` (see the module docs). Inside [`record`] and when `x` carries a
/// gradient: a new leaf with `x`'s values (same shape, dtype and device; one copy), which the rest of the forward
/// pass must use instead of `x`. Otherwise `x` itself.
///
/// Errors: candle's, from the copy.
pub fn cut(x: &Tensor) -> candle_core::Result<Tensor> {
    let recording = RECORDING.with(|r| !r.borrow().is_empty());
    if !recording || !x.track_op() {
        return Ok(x.clone());
    }
    let leaf = Var::from_tensor(x)?;
    let out = leaf.as_tensor().clone();
    push(Cut { source: Source::Kept(x.clone()), leaf });
    Ok(out)
}

fn push(cut: Cut) {
    RECORDING.with(|r| {
        if let Some(open) = r.borrow_mut().last_mut() {
            open.push(cut);
        }
    });
}

/// Activation checkpointing (PyTorch's `torch.utils.checkpoint`; Chen et al. 2016, "Training Deep Nets with
/// Sublinear Memory Cost"): `forward(x)` — a block of the model — runs without keeping its activations; the
/// backward pass runs it again from `x` when it reaches the block, then goes through it. Inside [`record`] and
/// when `x` carries a gradient: a cut before the block (at `x`) and one after it (at its output), the segment
/// between them rebuilt at the backward pass; returns the block's output (a new leaf) for the rest of the forward.
/// Otherwise (no recording: evaluation, a plain `loss.backward()`) `forward(x)` as it is.
///
/// `forward` must compute the same values when run again (the same ops on the same inputs; randomness drawn from
/// the step, not from a generator that advanced: accel's dropout masks are addressed, so they repeat). Gradients
/// are those of the run without checkpointing; the cost is one more forward of the block.
///
/// Errors: `forward`'s; candle's.
pub fn checkpoint(
    x: &Tensor,
    forward: impl Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
) -> candle_core::Result<Tensor> {
    let recording = RECORDING.with(|r| !r.borrow().is_empty());
    if !recording || !x.track_op() {
        return forward(x);
    }
    // The block's input as a leaf: `x` itself when it is one already (the output of the block before, checkpointed
    // too), else a cut at `x`.
    let input = if x.is_variable() {
        x.clone()
    } else {
        let leaf = Var::from_tensor(x)?;
        push(Cut { source: Source::Kept(x.clone()), leaf: leaf.clone() });
        leaf.as_tensor().clone()
    };
    // The block's output without its graph: the activations inside are freed when `y` goes.
    let y = forward(&input)?.detach();
    let leaf = Var::from_tensor(&y)?;
    let out = leaf.as_tensor().clone();
    push(Cut { source: Source::Recompute { input, forward: Box::new(forward) }, leaf });
    Ok(out)
}

impl BackwardSegments {
    /// Number of cuts (one fewer than segments).
    pub fn num_cuts(&self) -> usize {
        self.cuts.len()
    }

    /// Number of segments (cuts + 1).
    pub fn num_segments(&self) -> usize {
        self.cuts.len() + 1
    }

    /// The backward pass of `loss` (a scalar), segment by segment from the loss back to the inputs:
    /// `on_segment(k, store)` receives, for k = 0, 1, …, the gradients of the variables the k-th segment *in
    /// backward order* reached (the cut leaves taken out). A variable used in several segments gets a part of its
    /// gradient in each; the sum over all calls is `loss.backward()`'s gradient.
    ///
    /// Errors: candle's; a cut whose leaf the loss does not depend on ([`DdpError::InvalidArgument`]: a cut on a
    /// tensor the rest of the forward pass did not use); `on_segment`'s.
    pub fn backward<E: From<DdpError>>(
        self,
        loss: &Tensor,
        on_segment: impl FnMut(usize, GradStore) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let store = loss.backward().map_err(DdpError::from)?;
        self.backward_rest(store, on_segment)
    }

    /// [`BackwardSegments::backward`] of a forward pass whose output is not a loss: the backward pass starts at
    /// `output` with `grad` as its incoming gradient ([`backward_from`]; a pipeline stage's forward, with the
    /// gradient the next stage sent for its output), then goes segment by segment as `backward` does.
    ///
    /// Errors: [`backward_from`]'s; those of [`BackwardSegments::backward`].
    pub fn backward_from<E: From<DdpError>>(
        self,
        output: &Tensor,
        grad: &Tensor,
        on_segment: impl FnMut(usize, GradStore) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let store = backward_from(output, grad)?;
        self.backward_rest(store, on_segment)
    }

    /// The segments' backward from `store`, the last segment's gradients.
    fn backward_rest<E: From<DdpError>>(
        mut self,
        mut store: GradStore,
        mut on_segment: impl FnMut(usize, GradStore) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut cuts = std::mem::take(&mut self.cuts);
        let total = cuts.len();
        // Gradients of the leaves, summed over the segments that used them.
        let mut pending: Vec<Option<Tensor>> = vec![None; total];
        for k in 0.. {
            take_leaf_gradients(&cuts, &mut store, &mut pending).map_err(E::from)?;
            on_segment(k, store)?;
            let Some(cut) = cuts.pop() else { break };
            let Some(grad) = pending.pop().flatten() else {
                return Err(DdpError::InvalidArgument(format!(
                    "backward segments: the loss does not depend on cut {} of {total} (segments::cut on a tensor \
                     the rest of the forward pass did not use: continue from the tensor cut returns)",
                    cuts.len() + 1
                ))
                .into());
            };
            // The next segment's backward starts at the cut's source with the leaf's gradient coming in; a
            // checkpointed block's source is computed again first (its graph built from its input leaf).
            let source = match &cut.source {
                Source::Kept(t) => t.clone(),
                Source::Recompute { input, forward } => forward(input).map_err(DdpError::from)?,
            };
            let seeded = source.apply_op1(SeedGradient { grad }).map_err(DdpError::from)?;
            drop((cut, source));
            store = seeded.backward().map_err(DdpError::from)?;
        }
        Ok(())
    }
}

/// The backward pass of `output` with `grad` as its incoming gradient — torch's `output.backward(grad)`: the
/// gradients of everything `output` depends on, as a backward from a loss whose gradient with respect to
/// `output` is `grad`. A pipeline stage starts its backward here from the gradient the next stage sends for its
/// output; the gradient of its input (a variable holding the activation it received) is in the store too.
///
/// `grad` enters unchanged (the seeding op of [`BackwardSegments::backward`]; no multiply by a ones tensor), so
/// the gradients are the values a single backward pass through both stages computes.
///
/// Errors: [`DdpError::InvalidArgument`] when `grad`'s shape or dtype is not `output`'s; candle's.
pub fn backward_from(output: &Tensor, grad: &Tensor) -> Result<GradStore> {
    if output.shape() != grad.shape() || output.dtype() != grad.dtype() {
        return Err(DdpError::InvalidArgument(format!(
            "backward_from: the gradient is {:?} {:?} but the output is {:?} {:?}; pass the gradient of this output \
             (same shape and dtype)",
            grad.dims(),
            grad.dtype(),
            output.dims(),
            output.dtype()
        )));
    }
    let seeded = output.apply_op1(SeedGradient { grad: grad.clone() })?;
    Ok(seeded.backward()?)
}

/// Moves the gradients of every remaining cut's leaf from `store` into `pending` (summed).
fn take_leaf_gradients(cuts: &[Cut], store: &mut GradStore, pending: &mut [Option<Tensor>]) -> Result<()> {
    for (cut, slot) in cuts.iter().zip(pending.iter_mut()) {
        if let Some(g) = store.remove(cut.leaf.as_tensor()) {
            *slot = Some(match slot.take() {
                Some(acc) => (acc + g)?,
                None => g,
            });
        }
    }
    Ok(())
}

/// Forward: a scalar zero; backward: the stored gradient for the argument.
struct SeedGradient {
    grad: Tensor,
}

/// A scalar zero of the storage's dtype on its device.
fn zero_scalar<S: BackendStorage<Device: BackendDevice<Storage = S>>>(s: &S) -> candle_core::Result<(S, Shape)> {
    let shape = Shape::from(());
    Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
}

impl CustomOp1 for SeedGradient {
    fn name(&self) -> &'static str {
        "backward-segment-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        zero_scalar(s)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        zero_scalar(s)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.grad.clone()))
    }
}
