//! Which builder made each parameter of a model, so that `prepare_model` can check the plan it was built under
//! and refuse a layout the model cannot take — and the seeded candle `VarBuilder` for models written the candle
//! way.

use super::builder::{plan_report, PlanBook};
use crate::tensor_parallel::{draw_full, ParamInit};
use crate::{lock, AccelError, Result};
use candle_core::{DType, Device, Shape, Tensor, TensorId, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// The Accelerator's record of who built which parameter (see the module documentation). Shared with the
/// builders it hands out.
#[derive(Default)]
pub(crate) struct Provenance {
    /// Parameters made by a candle `VarBuilder` from [`crate::Accelerator::var_builder`].
    candle: Mutex<HashSet<TensorId>>,
    /// The plans of the [`super::VarBuilder`]s from [`crate::Accelerator::builder`] not yet prepared.
    books: Mutex<Vec<Arc<PlanBook>>>,
}

/// The layout a model is about to be prepared for, as far as the builders' limits go.
pub(crate) struct Target {
    pub tp_size: usize,
    pub pp_size: usize,
    /// FULL_SHARD over more than one dp_shard rank.
    pub full_shard: bool,
}

impl Provenance {
    pub(crate) fn add_book(&self, book: Arc<PlanBook>) {
        lock(&self.books).push(book);
    }

    /// Checks a model of parameters `ids` about to be prepared for `target`, and hands over the plans it was
    /// built under (forgotten here; the caller checks their rules and points them at the prepared model under
    /// FULL_SHARD). Errors: a model written the candle way at tp > 1, pp > 1 or FULL_SHARD, naming the builder
    /// to use instead.
    pub(crate) fn check(&self, ids: &[TensorId], target: &Target) -> Result<Vec<Arc<PlanBook>>> {
        let books: Vec<Arc<PlanBook>> = {
            let mut all = lock(&self.books);
            let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|b| b.made_any(ids));
            *all = rest;
            mine
        };
        let candle = {
            let made = lock(&self.candle);
            ids.iter().filter(|id| made.contains(id)).count()
        };
        let layout = match (target.tp_size > 1, target.pp_size > 1, target.full_shard) {
            (true, _, _) => Some(format!("tp_size {}", target.tp_size)),
            (_, true, _) => Some(format!("pp_size {}", target.pp_size)),
            (_, _, true) => Some("FULL_SHARD".to_string()),
            _ => None,
        };
        // A model of candle layers only has nothing to split; mixed into a planned model, a candle parameter is a
        // seeded replica like any other, except under FULL_SHARD (its layer keeps the whole weight it was built
        // with, which FULL_SHARD frees).
        let all_candle = candle > 0 && candle == ids.len();
        if let Some(layout) = layout.filter(|_| all_candle || (candle > 0 && target.full_shard)) {
            return Err(AccelError::Usage(format!(
                "prepare_model: this model's layers were built by a candle VarBuilder (accelerator.var_builder), \
                 which cannot split or shard them for {layout}; build the model with accelerator.builder(&varmap, \
                 plan) — accel::nn's VarBuilder, whose calls (pp, linear, embedding, layer_norm, rms_norm, get) are \
                 candle's; under pp its blocks declared with accel::nn::staged — or train it under DDP, ZeRO-1 or \
                 ZeRO-2 (SHARD_OPTIM, SHARD_GRAD_OP)"
            )));
        }
        Ok(books)
    }

    /// Errors: a rule of a plan that matched no layer — on any pipeline stage: the rules each stage's layers
    /// matched are agreed over `pp` first (collective over the pp group when it has several ranks).
    pub(crate) fn check_rules(books: &[Arc<PlanBook>], pp: &ddp_core::ProcessGroup) -> Result<()> {
        for book in books {
            let used = book.used();
            if pp.world_size() > 1 && !used.is_empty() {
                let mut flags: Vec<i64> = used.iter().map(|&u| i64::from(u)).collect();
                pp.all_reduce(&mut flags, ddp_core::ReduceOp::Max)?;
                book.merge_used(&flags.iter().map(|&u| u != 0).collect::<Vec<_>>());
            }
            book.check_all_rules_used()?;
        }
        Ok(())
    }

    /// The plan report of `books` (what `ACCEL_PRINT_PLAN` prints); `None` without a plan.
    pub(crate) fn report(books: &[Arc<PlanBook>], tp_size: usize) -> Option<String> {
        books.first().map(|_| books.iter().map(|b| plan_report(&b.layers(), tp_size)).collect())
    }
}

/// A candle `VarBuilder` over `varmap` whose new parameters are drawn from `seed` per name with the distribution
/// candle asked for (candle's own initialisers cannot be seeded), in `dtype` on `device`: the same seed gives the
/// same weights in every run, and the same as [`super::VarBuilder`] draws for the same layer and name. An
/// existing entry of `varmap` is returned as is (shape-checked), as candle's `VarMap` does.
pub fn seeded_var_builder(varmap: &VarMap, seed: u64, dtype: DType, device: &Device) -> VarBuilder<'static> {
    let backend = SeededVarMap { varmap: varmap.clone(), seed, record: None };
    VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
}

/// [`seeded_var_builder`], recording what it creates in `record`.
pub(crate) fn recorded_var_builder(
    varmap: &VarMap,
    seed: u64,
    dtype: DType,
    device: &Device,
    record: Arc<Provenance>,
) -> VarBuilder<'static> {
    let backend = SeededVarMap { varmap: varmap.clone(), seed, record: Some(record) };
    VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
}

struct SeededVarMap {
    varmap: VarMap,
    seed: u64,
    record: Option<Arc<Provenance>>,
}

impl SimpleBackend for SeededVarMap {
    fn get(
        &self,
        s: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut data = lock(self.varmap.data());
        if let Some(v) = data.get(name) {
            if v.shape() != &s {
                candle_core::bail!(
                    "parameter {name:?} exists with shape {:?}; it is asked for with shape {s:?}",
                    v.shape()
                )
            }
            return Ok(v.as_tensor().clone());
        }
        let values = draw_full(self.seed, name, &s, ParamInit::from_candle(init, &s))?;
        let var = Var::from_tensor(&values.to_dtype(dtype)?.to_device(dev)?)?;
        if let Some(record) = &self.record {
            lock(&record.candle).insert(var.as_tensor().id());
        }
        let t = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        match lock(self.varmap.data()).get(name) {
            Some(v) => Ok(v.as_tensor().clone()),
            None => candle_core::bail!("parameter {name:?} does not exist yet; ask for it with its shape (`get`)"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.varmap.data()).contains_key(name)
    }
}
