//! [`StepController`]: the one owner of a training step.
//!
//! Everything that decides or records what happens to gradients between two optimizer steps lives here and
//! nowhere else:
//!
//! - the **accumulation window** (which micro-step of the window this is, `no_sync` nesting, whether a driver —
//!   the Trainer, later a pipeline schedule — set the window's end explicitly),
//! - the **sync decision** (Accelerate's rule: sync on the last micro-step of a window, on the last batch of a
//!   prepared data loader, never inside `no_sync`),
//! - the **gradient buffers** of every prepared model (fp32 slots, one per parameter, filled by backward,
//!   reduced in place on a sync step, read by the optimizer, then dropped),
//! - the **fp16 loss scaler** (unscaling happens once per optimizer step, on the final gradients only),
//! - the **step counters** saved in checkpoints.
//!
//! The data loader reports the batch it yields through [`StepController::note_batch`] (the only path for
//! end-of-data and padding); the optimizer wrapper receives gradients through
//! [`StepController::optimizer_step`] and never reaches into a model.
//!
//! One gradient representation from backward to optimizer: [`Gradients`], a slot per parameter. What happens to
//! the slots is never decided here but by each parameter group's strategy (`crate::model`'s
//! `GradientStrategy`), on every path: the reduction after backward or overlapped with it, the norm and the fp16
//! overflow check, and what follows the optimizer step. The optimizer reads the slots by reference.

mod gradients;

pub(crate) use gradients::Gradients;

use crate::data::BatchInfo;
use crate::lock;
use crate::mixed_precision::GradScaler;
use crate::model::PreparedModel;
use crate::state::StateDict;
use crate::{AccelError, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use ddp_core::segments::BackwardSegments;
use std::sync::{Arc, Mutex};

/// Step counters saved in checkpoints (`accelerator.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct StepCounters {
    /// Position in the accumulation window (micro-steps since the window's start or the last end-of-loader).
    pub micro_step: u64,
    /// Backward calls since the start of training.
    pub total_micro_steps: u64,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
    /// Optimizer steps skipped for fp16 overflow.
    pub skipped_steps: u64,
}

/// Where the current micro-step's window ends: decided by counting (Accelerate's rule) or by a driver that cuts
/// windows itself ([`crate::Accelerator::accumulate_window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WindowEnd {
    /// `micro_step % gradient_accumulation_steps == 0`, or the last batch of a prepared loader.
    Counted,
    /// The driver says whether this micro-step is the window's last.
    Explicit { last: bool },
}

/// The accumulation window.
#[derive(Debug, Clone, Default)]
struct Window {
    /// Whether the current micro-step syncs gradients (true before the first one).
    sync_gradients: bool,
    /// Inside `accumulate` / `accumulate_window`: the window was advanced on entry, `backward` must not advance it.
    in_accumulate: bool,
    /// Nesting depth of `no_sync`.
    no_sync_depth: usize,
    /// The batch the data loader yielded last was the last of its epoch.
    end_of_dataloader: bool,
    /// Trailing `even_batches` duplicate rows in that batch (for `gather_for_metrics`).
    padding_in_batch: usize,
}

#[derive(Debug, Default)]
struct State {
    window: Window,
    counters: StepCounters,
    /// Gradient slots of each prepared model, by the model's registration index.
    grads: Vec<Gradients>,
}

/// Outcome of [`StepController::optimizer_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepOutcome {
    /// Between syncs: nothing happened.
    NotSynced,
    /// fp16 overflow: the step was skipped, the loss scale backed off.
    Overflow,
    /// The optimizer applied the gradients.
    Applied,
}

/// See the module documentation. Shared by every clone of an Accelerator (behind its `Arc`).
#[derive(Debug)]
pub(crate) struct StepController {
    gradient_accumulation_steps: u64,
    /// Dynamic loss scaler; `Some` only under fp16. An `Arc` so users can read (or, in tests, replace) it.
    scaler: Option<Arc<Mutex<GradScaler>>>,
    state: Mutex<State>,
}

/// Undoes a window flag when dropped, so a panic or an early `?` inside `accumulate` / `no_sync` cannot leave it
/// set.
struct Restore<'a> {
    ctl: &'a StepController,
    undo: fn(&mut Window),
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        (self.undo)(&mut lock(&self.ctl.state).window);
    }
}

impl StepController {
    pub(crate) fn new(gradient_accumulation_steps: usize, scaler: Option<GradScaler>) -> Self {
        StepController {
            gradient_accumulation_steps: gradient_accumulation_steps as u64,
            scaler: scaler.map(|s| Arc::new(Mutex::new(s))),
            state: Mutex::new(State {
                window: Window { sync_gradients: true, ..Window::default() },
                ..State::default()
            }),
        }
    }

    /// Adds the gradient slots of a newly prepared model; returns its index.
    pub(crate) fn register_model(&self, num_params: usize) -> usize {
        let mut st = lock(&self.state);
        st.grads.push(Gradients::new(num_params));
        st.grads.len() - 1
    }

    pub(crate) fn scaler(&self) -> Option<&Arc<Mutex<GradScaler>>> {
        self.scaler.as_ref()
    }

    // ---- the window -------------------------------------------------------------------------------------------

    /// What a prepared data loader reports for each batch it hands out (the one path for end-of-data and padding).
    pub(crate) fn note_batch(&self, info: &BatchInfo) {
        let mut st = lock(&self.state);
        st.window.end_of_dataloader = info.is_last;
        st.window.padding_in_batch = info.padding;
    }

    /// Trailing duplicate rows in this rank's current batch.
    pub(crate) fn padding_in_batch(&self) -> usize {
        lock(&self.state).window.padding_in_batch
    }

    /// Whether the current micro-step syncs gradients.
    pub(crate) fn sync_gradients(&self) -> bool {
        let st = lock(&self.state);
        st.window.sync_gradients && st.window.no_sync_depth == 0
    }

    /// Advances the window by one micro-step (Accelerate's `_do_sync`).
    fn advance(&self, st: &mut State, end: WindowEnd) {
        let ga = self.gradient_accumulation_steps;
        let w = &mut st.window;
        let c = &mut st.counters;
        match end {
            WindowEnd::Counted if w.end_of_dataloader => {
                c.micro_step = 0;
                w.sync_gradients = true;
            }
            WindowEnd::Counted => {
                c.micro_step += 1;
                w.sync_gradients = c.micro_step.is_multiple_of(ga);
            }
            WindowEnd::Explicit { last: true } => {
                c.micro_step = 0;
                w.sync_gradients = true;
            }
            WindowEnd::Explicit { last: false } => {
                c.micro_step += 1;
                w.sync_gradients = false;
            }
        }
    }

    /// Runs `f` as one micro-step whose window position was decided on entry.
    fn micro_step<R, E: From<AccelError>>(
        &self,
        end: WindowEnd,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        {
            let mut st = lock(&self.state);
            if st.window.in_accumulate {
                return Err(AccelError::Usage(
                    "accumulate: calls cannot be nested (and accumulate_window runs each micro-step inside one)".into(),
                )
                .into());
            }
            self.advance(&mut st, end);
            st.window.in_accumulate = true;
        }
        let _restore = Restore { ctl: self, undo: |w| w.in_accumulate = false };
        f()
    }

    /// `Accelerator::accumulate`.
    pub(crate) fn accumulate<R, E: From<AccelError>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.micro_step(WindowEnd::Counted, f)
    }

    /// `Accelerator::accumulate_window`: `micro_batches` micro-steps, the last of which syncs.
    pub(crate) fn accumulate_window<E: From<AccelError>>(
        &self,
        micro_batches: usize,
        mut f: impl FnMut(usize) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if micro_batches == 0 {
            return Err(AccelError::InvalidArgument(
                "accumulate_window: a window needs at least one micro-batch".into(),
            )
            .into());
        }
        for i in 0..micro_batches {
            self.micro_step(WindowEnd::Explicit { last: i + 1 == micro_batches }, || f(i))?;
        }
        Ok(())
    }

    /// `Accelerator::no_sync`.
    pub(crate) fn no_sync<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        lock(&self.state).window.no_sync_depth += 1;
        let _restore = Restore { ctl: self, undo: |w| w.no_sync_depth -= 1 };
        f()
    }

    // ---- backward ---------------------------------------------------------------------------------------------

    /// One micro-batch's backward: scales `loss` (÷ GA, × fp16 loss scale), computes its gradients, adds them to
    /// every model's slots and, on a sync step, reduces them across ranks.
    pub(crate) fn backward(&self, models: &[PreparedModel], loss: &Tensor) -> Result<()> {
        let (sync, loss) = self.begin_micro_batch(loss)?;
        let mut store = loss.backward()?;
        let mut st = lock(&self.state);
        for m in models {
            add_micro_batch(&mut st.grads[m.index()], m, &mut store)?;
        }
        drop(store);
        if sync {
            for m in models {
                let g = &mut st.grads[m.index()];
                m.reduce_gradients(&mut g.slots)?;
                g.synced = true;
            }
        }
        Ok(())
    }

    /// [`Self::backward`] over a forward pass recorded with `ddp_core::segments::record`: the backward pass runs
    /// segment by segment, and with one prepared model the sync step's bucket all-reduces start while later
    /// segments still compute (DDP's overlapped backward). Several models: the same segmented backward, then
    /// the usual reduction model by model. Gradients are the same as `backward`'s.
    pub(crate) fn backward_segments(
        &self,
        models: &[PreparedModel],
        loss: &Tensor,
        segments: BackwardSegments,
    ) -> Result<()> {
        let (sync, loss) = self.begin_micro_batch(loss)?;
        // The slots leave the state for the backward pass (its ops must not wait on the step controller's lock).
        let mut taken: Vec<Gradients> = {
            let mut st = lock(&self.state);
            models
                .iter()
                .map(|m| {
                    let g = &mut st.grads[m.index()];
                    if g.synced {
                        g.clear(); // a new window after a step that did not happen: start clean
                    }
                    std::mem::take(g)
                })
                .collect()
        };
        let result = self.segmented_into(models, &loss, segments, sync, &mut taken);
        let mut st = lock(&self.state);
        for (m, g) in models.iter().zip(taken) {
            st.grads[m.index()] = g;
        }
        result
    }

    fn segmented_into(
        &self,
        models: &[PreparedModel],
        loss: &Tensor,
        segments: BackwardSegments,
        sync: bool,
        grads: &mut [Gradients],
    ) -> Result<()> {
        let mut received: Vec<Vec<bool>> = models.iter().map(|m| vec![false; m.parameters().len()]).collect();
        let overlapping = match models {
            [model] => model.overlapping_group().map(|strategy| (model, strategy)),
            _ => None,
        };
        match (overlapping, &mut *grads) {
            (Some((model, strategy)), [g]) => {
                let params = model.parameters();
                let seen = &mut received[0];
                let mut add = |mut store: GradStore, slots: &mut [Option<Tensor>]| {
                    let mut got = Vec::new();
                    for (i, p) in params.iter().enumerate() {
                        if let Some(grad) = store.remove(p.as_tensor()) {
                            gradients::add_into(&mut slots[i], grad)?;
                            seen[i] = true;
                            got.push(i);
                        }
                    }
                    Ok(got)
                };
                strategy.backward_overlapped(loss, segments, &mut g.slots, sync, &mut add)?;
                check_received(model, seen)?;
                g.synced = sync;
            }
            _ => {
                segments.backward(loss, |_, mut store| -> Result<()> {
                    for ((m, g), seen) in models.iter().zip(grads.iter_mut()).zip(&mut received) {
                        // The segment's gradients are one bucket: what a ZeRO-2 group reduce-scatters now.
                        let mut micro: Vec<Option<Tensor>> =
                            m.parameters().iter().map(|p| store.remove(p.as_tensor())).collect();
                        m.reduce_micro_batch(&mut micro)?;
                        for (i, grad) in micro.into_iter().enumerate() {
                            if let Some(grad) = grad {
                                g.add(i, grad)?;
                                seen[i] = true;
                            }
                        }
                    }
                    Ok(())
                })?;
                for ((m, g), seen) in models.iter().zip(grads.iter_mut()).zip(&received) {
                    check_received(m, seen)?;
                    if sync {
                        m.reduce_gradients(&mut g.slots)?;
                        g.synced = true;
                    }
                }
            }
        }
        Ok(())
    }

    /// Advances the window for one micro-batch's backward and scales its loss (÷ GA, × fp16 loss scale); returns
    /// whether this micro-batch syncs, and the scaled loss.
    fn begin_micro_batch(&self, loss: &Tensor) -> Result<(bool, Tensor)> {
        let sync = self.advance_for_backward();
        let mut loss = loss.clone();
        if self.gradient_accumulation_steps > 1 {
            loss = loss.affine(1.0 / self.gradient_accumulation_steps as f64, 0.0)?;
        }
        if let Some(scaler) = &self.scaler {
            let scale = lock(scaler).scale();
            loss = loss.to_dtype(candle_core::DType::F32)?.affine(scale, 0.0)?;
        }
        Ok((sync, loss))
    }

    /// Advances the window for one backward (unless `accumulate` did on entry) and counts it; returns whether
    /// it syncs.
    fn advance_for_backward(&self) -> bool {
        let mut st = lock(&self.state);
        if !st.window.in_accumulate {
            self.advance(&mut st, WindowEnd::Counted);
        }
        st.counters.total_micro_steps += 1;
        st.window.sync_gradients && st.window.no_sync_depth == 0
    }

    // ---- a pipeline step ----------------------------------------------------------------------------------------

    /// One pipeline step as one micro-step of the accumulation window (its pipeline micro-batches are inside
    /// it): advances the window as [`Self::backward`] does; returns whether it syncs and the factor each
    /// micro-batch's loss is multiplied by before its backward (÷ GA, × the fp16 loss scale: the same scaling
    /// `backward` applies, so gradients are never rescaled after).
    pub(crate) fn begin_pipeline_step(&self) -> (bool, f64) {
        let sync = self.advance_for_backward();
        let mut factor = 1.0 / self.gradient_accumulation_steps as f64;
        if let Some(scaler) = &self.scaler {
            factor *= lock(scaler).scale();
        }
        (sync, factor)
    }

    /// Adds a pipeline step's gradients (summed over its micro-batches; `grads[i]` for `model.parameters()[i]`)
    /// to `model`'s slots, with the unused-parameter check of `backward`, and on a sync step reduces them
    /// (collective over the model's groups).
    pub(crate) fn add_pipeline_gradients(
        &self,
        model: &PreparedModel,
        grads: Vec<Option<Tensor>>,
        sync: bool,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        let g = &mut st.grads[model.index()];
        if g.synced {
            g.clear();
        }
        add_gradients(g, model, grads)?;
        if sync {
            model.reduce_gradients(&mut g.slots)?;
            g.synced = true;
        }
        Ok(())
    }

    // ---- clipping ---------------------------------------------------------------------------------------------

    /// Global L2 norm of the synced gradients of every model, clipped to `max_norm`
    /// (`torch.nn.utils.clip_grad_norm_`). `None` outside a sync step: partial gradients are neither unscaled
    /// nor clipped (clipping a partial sum would not bound the step, and unscaling it early would mix scaled and
    /// unscaled micro-batches under fp16).
    pub(crate) fn clip_grad_norm(&self, models: &[PreparedModel], max_norm: f64) -> Result<Option<f64>> {
        let mut st = lock(&self.state);
        if !st.grads.iter().any(|g| g.synced) {
            return Ok(None);
        }
        let mut squares = 0.0;
        for m in models {
            let g = &mut st.grads[m.index()];
            if g.synced {
                self.unscale(m, g)?;
                // Each parameter counted once, over the norm group each group's strategy names.
                squares += m.squared_norm(&g.squared_norms()?)?;
            }
        }
        let norm = squares.sqrt();
        if !norm.is_finite() {
            return Ok(Some(norm));
        }
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for g in st.grads.iter_mut().filter(|g| g.synced) {
                g.scale(coef)?;
            }
        }
        Ok(Some(norm))
    }

    /// Clamps the synced gradients into `[-clip_value, clip_value]` (`torch.nn.utils.clip_grad_value_`);
    /// returns whether it did (false outside a sync step, as [`Self::clip_grad_norm`]).
    pub(crate) fn clip_grad_value(&self, models: &[PreparedModel], clip_value: f64) -> Result<bool> {
        let mut st = lock(&self.state);
        if !st.grads.iter().any(|g| g.synced) {
            return Ok(false);
        }
        for m in models {
            let g = &mut st.grads[m.index()];
            if g.synced {
                self.unscale(m, g)?;
                g.clamp(clip_value)?;
            }
        }
        Ok(true)
    }

    /// fp16: divides synced gradients by the loss scale, once per optimizer step, and records inf/NaN — agreed
    /// over each group's norm group (the model-parallel ranks hold different pieces but must skip the same
    /// steps).
    fn unscale(&self, model: &PreparedModel, g: &mut Gradients) -> Result<()> {
        let Some(scaler) = &self.scaler else { return Ok(()) };
        if g.unscaled || !g.synced {
            return Ok(());
        }
        g.scale(1.0 / lock(scaler).scale())?;
        g.found_inf = model.any_rank(!g.all_finite()?)?;
        g.unscaled = true;
        Ok(())
    }

    // ---- the optimizer step -----------------------------------------------------------------------------------

    /// Hands `model`'s synced gradients to `apply` (one slot per master weight; `None` for a parameter no rank
    /// used, which the optimizer skips), then drops them. Nothing happens between syncs; an fp16 overflow skips
    /// the step and backs the loss scale off.
    pub(crate) fn optimizer_step(
        &self,
        model: &PreparedModel,
        apply: impl FnOnce(&[Option<Tensor>]) -> Result<()>,
    ) -> Result<StepOutcome> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let g = &mut st.grads[model.index()];
        if !g.synced {
            return Ok(StepOutcome::NotSynced);
        }
        self.unscale(model, g)?;
        if let Some(scaler) = &self.scaler {
            lock(scaler).update(g.found_inf);
        }
        if g.found_inf {
            g.clear();
            st.counters.skipped_steps += 1;
            return Ok(StepOutcome::Overflow);
        }
        apply(&g.slots)?;
        g.clear();
        st.counters.optimizer_steps += 1;
        Ok(StepOutcome::Applied)
    }

    /// Drops `model`'s gradients on a sync step; a no-op between syncs (Accelerate's `zero_grad`).
    pub(crate) fn zero_grad(&self, model: &PreparedModel) {
        let mut st = lock(&self.state);
        let g = &mut st.grads[model.index()];
        if g.synced {
            g.clear();
        }
    }

    // ---- reading and restoring --------------------------------------------------------------------------------

    /// A copy of `model`'s gradient slots and whether they are synced.
    pub(crate) fn gradients(&self, model: &PreparedModel) -> (Vec<Option<Tensor>>, bool) {
        let st = lock(&self.state);
        let g = &st.grads[model.index()];
        (g.slots.clone(), g.synced)
    }

    /// The gradients held between optimizer steps (a checkpoint taken inside an accumulation window must carry
    /// them for an exact resume): tensors `{model index}.{parameter name}` and, per model, whether they were
    /// synced / unscaled / overflowed. `None` when no model holds any gradient (the usual checkpoint, taken right
    /// after an optimizer step). Per rank: between syncs each rank holds its own partial sums.
    pub(crate) fn gradients_state_dict(&self, models: &[PreparedModel]) -> Option<StateDict> {
        let st = lock(&self.state);
        if st.grads.iter().all(|g| g.slots.iter().all(Option::is_none)) {
            return None;
        }
        let mut flags = Vec::new();
        let mut sd = StateDict::new();
        for m in models {
            let g = &st.grads[m.index()];
            flags.push(serde_json::json!({"synced": g.synced, "unscaled": g.unscaled, "found_inf": g.found_inf}));
            for (name, slot) in m.names().iter().zip(&g.slots) {
                if let Some(t) = slot {
                    sd.tensors.insert(format!("{}.{name}", m.index()), t.clone());
                }
            }
        }
        sd.meta = serde_json::json!({ "models": flags });
        Some(sd)
    }

    /// Restores what [`Self::gradients_state_dict`] saved (after [`Self::restore`]). Errors: a gradient for a
    /// parameter the model does not have, or of another shape (the checkpoint is for another model).
    pub(crate) fn load_gradients_state_dict(&self, models: &[PreparedModel], sd: &StateDict) -> Result<()> {
        let flags: Vec<serde_json::Value> = sd.meta_field("models")?;
        let mut st = lock(&self.state);
        let mut used = 0;
        for (m, f) in models.iter().zip(flags.iter().chain(std::iter::repeat(&serde_json::Value::Null))) {
            let g = &mut st.grads[m.index()];
            for (i, (name, p)) in m.names().iter().zip(m.master_weights()).enumerate() {
                if let Some(t) = sd.tensors.get(&format!("{}.{name}", m.index())) {
                    let want = m.gradient_dims(i);
                    if t.dims() != want.as_slice() {
                        return Err(AccelError::InvalidArgument(format!(
                            "saved gradient of {name:?} has shape {:?} but this run keeps it as {want:?}: the \
                             checkpoint was taken inside an accumulation window by another model or another \
                             sharding (ZeRO-2 keeps a rank's chunk); resume from a checkpoint at an optimizer-step \
                             boundary, or with the model and layout that wrote it",
                            t.shape(),
                        )));
                    }
                    g.slots[i] = Some(t.to_device(p.device())?.to_dtype(candle_core::DType::F32)?);
                    used += 1;
                }
            }
            let flag = |k: &str| f.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false);
            g.synced = flag("synced");
            g.unscaled = flag("unscaled");
            g.found_inf = flag("found_inf");
        }
        if used != sd.tensors.len() {
            return Err(AccelError::InvalidArgument(format!(
                "the checkpoint holds {} saved gradients but only {used} match a parameter of the prepared \
                 models: it was taken inside an accumulation window by other models; resume from a checkpoint at \
                 an optimizer-step boundary, or prepare the same models",
                sd.tensors.len()
            )));
        }
        Ok(())
    }

    pub(crate) fn counters(&self) -> StepCounters {
        lock(&self.state).counters
    }

    /// Restores counters from a checkpoint and starts from a clean window (no gradients, no batch noted).
    pub(crate) fn restore(&self, counters: StepCounters) {
        let mut st = lock(&self.state);
        st.counters = counters;
        st.window = Window {
            sync_gradients: counters.micro_step.is_multiple_of(self.gradient_accumulation_steps),
            ..Window::default()
        };
        st.grads.iter_mut().for_each(Gradients::clear);
    }
}

/// The unused-parameter check of a segmented backward: every parameter got a gradient from this micro-batch,
/// unless `find_unused_parameters` (then the reduction resolves it across ranks).
fn check_received(model: &PreparedModel, received: &[bool]) -> Result<()> {
    if model.find_unused_parameters() {
        return Ok(());
    }
    let missing: Vec<String> =
        received.iter().zip(model.names()).filter(|(r, _)| !**r).map(|(_, n)| n.clone()).collect();
    missing_gradients(model, missing)
}

/// The unused-parameter error for `missing` (none: Ok) — or, when no parameter of a FULL_SHARD model got one, what
/// that means: the forward used weights built before `prepare_model` sharded them.
fn missing_gradients(model: &PreparedModel, missing: Vec<String>) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    if model.is_fully_sharded() && missing.len() == model.names().len() {
        return Err(AccelError::Usage(
            "FULL_SHARD: no parameter of the prepared model got a gradient — the forward pass used weights built \
             before prepare_model replaced them with this rank's chunks; build the model with \
             accelerator.builder (accel::nn's layers gather their weights at each use), or for training from \
             model.param_builder() after prepare_model. A model built from a candle VarBuilder cannot: use \
             SHARD_GRAD_OP (the Trainer's fsdp \"shard_grad_op\") for it"
                .into(),
        ));
    }
    Err(ddp_core::DdpError::UnusedParameters { names: missing }.into())
}

/// Adds one micro-batch's gradients of `model`'s parameters (as fp32) to its slots. The unused-parameter check
/// happens here, once per micro-batch: a parameter without a gradient is an error unless
/// `find_unused_parameters`, where its slot stays `None` for the reduction to resolve across ranks. The gradients are
/// moved out of `store` (no copy) and each is dropped once added, so accumulation costs one parameter's worth of
/// transient memory beyond what the backward pass produced.
fn add_micro_batch(g: &mut Gradients, model: &PreparedModel, store: &mut GradStore) -> Result<()> {
    // A new window after a step / zero_grad that did not happen (e.g. a sync without an optimizer): start clean.
    if g.synced {
        g.clear();
    }
    let micro = model.parameters().iter().map(|p| store.remove(p.as_tensor())).collect();
    add_gradients(g, model, micro)
}

/// Adds one micro-batch's gradients (`micro[i]` for parameter `i`) to `g`'s slots after the model's strategies
/// made them what the slots accumulate (ZeRO-2 reduce-scatters them), with the unused-parameter check.
fn add_gradients(g: &mut Gradients, model: &PreparedModel, mut micro: Vec<Option<Tensor>>) -> Result<()> {
    let missing: Vec<String> = micro
        .iter()
        .zip(model.names())
        .filter(|(grad, _)| grad.is_none() && !model.find_unused_parameters())
        .map(|(_, n)| n.clone())
        .collect();
    missing_gradients(model, missing)?;
    model.reduce_micro_batch(&mut micro)?;
    for (i, grad) in micro.into_iter().enumerate() {
        if let Some(grad) = grad {
            g.add(i, grad)?;
        }
    }
    Ok(())
}
