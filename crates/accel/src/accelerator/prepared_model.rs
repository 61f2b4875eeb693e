//! [`PreparedModel`]: a model's parameters as the Accelerator manages them — the compute-dtype `Var`s the model
//! reads, their fp32 master copies the optimizer updates (the same `Var`s in fp32), the DDP wrapper, and the fp32
//! gradient accumulator filled by `backward`.

use super::{lock, Accelerator};
use crate::{AccelError, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use ddp_core::DistributedDataParallel;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Handle to a prepared model. Cheap to clone; clones share parameters and gradients.
#[derive(Clone)]
pub struct PreparedModel {
    pub(crate) inner: Arc<ModelInner>,
}

pub(crate) struct ModelInner {
    /// `VarMap` names, sorted (the same order on every rank).
    pub(crate) names: Vec<String>,
    /// The model's `Var`s, in the compute dtype.
    pub(crate) params: Vec<Var>,
    /// fp32 master weights; the very same `Var`s as `params` when the compute dtype is F32.
    pub(crate) masters: Vec<Var>,
    /// Whether `masters` are separate copies (bf16 / fp16 compute).
    pub(crate) has_masters: bool,
    /// DDP over the fp32 masters (gradients are all-reduced in fp32).
    pub(crate) ddp: DistributedDataParallel,
    pub(crate) find_unused_parameters: bool,
    pub(crate) grads: Mutex<GradAccumulator>,
}

/// fp32 gradients accumulated over the micro-steps of one window.
#[derive(Debug, Default)]
pub(crate) struct GradAccumulator {
    /// One slot per parameter; `None` until the first backward of the window.
    pub(crate) grads: Vec<Option<Tensor>>,
    /// The window's gradients have been all-reduced: the optimizer may step.
    pub(crate) synced: bool,
    /// fp16: the gradients were divided by the loss scale already (by clipping) in this window.
    pub(crate) unscaled: bool,
    /// fp16: the unscaled gradients contain inf/NaN.
    pub(crate) found_inf: bool,
}

impl GradAccumulator {
    pub(crate) fn clear(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = None);
        self.synced = false;
        self.unscaled = false;
        self.found_inf = false;
    }
}

impl std::fmt::Debug for PreparedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedModel")
            .field("parameters", &self.inner.names.len())
            .field("master_weights", &self.inner.has_masters)
            .finish()
    }
}

impl PreparedModel {
    pub(crate) fn new(acc: &Accelerator, varmap: &VarMap) -> Result<Self> {
        let mut named: Vec<(String, Var)> = lock(varmap.data()).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if named.is_empty() {
            return Err(AccelError::Usage(
                "prepare_model: the VarMap has no variables; build the model with accelerator.var_builder(&varmap) \
                 before preparing it"
                    .into(),
            ));
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, v) in &named {
            if !v.device().same_device(acc.device()) {
                return Err(AccelError::InvalidArgument(format!(
                    "prepare_model: parameter {name:?} is on {:?} but the Accelerator uses {:?}; build the model \
                     with accelerator.var_builder(&varmap)",
                    v.device(),
                    acc.device()
                )));
            }
        }
        let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        let params: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let has_masters = params.iter().any(|v| v.dtype() != DType::F32);
        let masters: Vec<Var> = if has_masters {
            params
                .iter()
                .map(|v| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?))
                .collect::<candle_core::Result<_>>()?
        } else {
            params.clone()
        };
        let cfg = &acc.inner.config.ddp;
        let ddp = DistributedDataParallel::from_named_vars(
            &acc.inner.pg,
            names.iter().cloned().zip(masters.iter().cloned()).collect(),
            cfg.clone(),
        )?;
        let model = PreparedModel {
            inner: Arc::new(ModelInner {
                names,
                params,
                masters,
                has_masters,
                ddp,
                find_unused_parameters: cfg.find_unused_parameters,
                grads: Mutex::new(GradAccumulator::default()),
            }),
        };
        // DDP broadcast rank 0's values into the masters: make the compute copies agree.
        model.copy_masters_to_params()?;
        Ok(model)
    }

    /// Parameter names (the `VarMap` names, sorted).
    pub fn names(&self) -> &[String] {
        &self.inner.names
    }

    /// The model's `Var`s in the compute dtype, in [`PreparedModel::names`] order.
    pub fn parameters(&self) -> &[Var] {
        &self.inner.params
    }

    /// The fp32 master weights the optimizer updates (the same `Var`s as [`PreparedModel::parameters`] in fp32).
    pub fn master_weights(&self) -> &[Var] {
        &self.inner.masters
    }

    /// Number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.inner.params.iter().map(|v| v.elem_count()).sum()
    }

    /// The DDP wrapper (bucket layout, options).
    pub fn ddp(&self) -> &DistributedDataParallel {
        &self.inner.ddp
    }

    /// fp32 master weights by name (what `model.safetensors` holds).
    pub fn state_dict(&self) -> BTreeMap<String, Tensor> {
        self.inner.names.iter().cloned().zip(self.inner.masters.iter().map(|v| v.as_tensor().clone())).collect()
    }

    /// Loads weights by name into the masters and the compute-dtype parameters (cast as needed). Errors name a
    /// missing, unexpected or mis-shaped tensor.
    pub fn load_state_dict(&self, weights: &BTreeMap<String, Tensor>) -> Result<()> {
        for name in weights.keys() {
            if !self.inner.names.contains(name) {
                return Err(AccelError::InvalidArgument(format!(
                    "load_state_dict: tensor {name:?} is not a parameter of this model"
                )));
            }
        }
        for (name, master) in self.inner.names.iter().zip(&self.inner.masters) {
            let t = weights.get(name).ok_or_else(|| {
                AccelError::InvalidArgument(format!("load_state_dict: no tensor for parameter {name:?}"))
            })?;
            if t.shape() != master.shape() {
                return Err(AccelError::InvalidArgument(format!(
                    "load_state_dict: parameter {name:?} has shape {:?} but the tensor has shape {:?}",
                    master.shape(),
                    t.shape()
                )));
            }
            master.set(&t.to_device(master.device())?.to_dtype(DType::F32)?)?;
        }
        self.copy_masters_to_params()
    }

    /// The accumulated fp32 gradients (averaged across ranks after a sync step; still loss-scaled under fp16
    /// until clipping or the optimizer step unscales them), `None` for parameters without one yet.
    pub fn gradients(&self) -> Vec<Option<Tensor>> {
        lock(&self.inner.grads).grads.clone()
    }

    /// Whether the accumulated gradients have been all-reduced (the optimizer step will apply them).
    pub fn gradients_synced(&self) -> bool {
        lock(&self.inner.grads).synced
    }

    /// Casts the fp32 masters back into the compute-dtype `Var`s (no-op in fp32).
    pub(crate) fn copy_masters_to_params(&self) -> Result<()> {
        if self.inner.has_masters {
            for (p, m) in self.inner.params.iter().zip(&self.inner.masters) {
                p.set(&m.as_tensor().to_dtype(p.dtype())?)?;
            }
        }
        Ok(())
    }

    /// Adds this micro-step's gradients (cast to fp32) to the accumulator.
    pub(crate) fn accumulate(&self, grads: &GradStore) -> Result<()> {
        let inner = &self.inner;
        let mut acc = lock(&inner.grads);
        if acc.grads.len() != inner.params.len() {
            acc.grads = vec![None; inner.params.len()];
        }
        // A new window after a step/zero_grad: start from a clean slate.
        if acc.synced {
            acc.clear();
        }
        let mut missing = Vec::new();
        for (i, p) in inner.params.iter().enumerate() {
            let g = match grads.get(p.as_tensor()) {
                Some(g) => g.to_dtype(DType::F32)?,
                None if inner.find_unused_parameters => continue,
                None => {
                    missing.push(inner.names[i].clone());
                    continue;
                }
            };
            acc.grads[i] = Some(match acc.grads[i].take() {
                None => g,
                Some(a) => (a + g)?,
            });
        }
        if !missing.is_empty() {
            return Err(ddp_core::DdpError::UnusedParameters { names: missing }.into());
        }
        Ok(())
    }

    /// All-reduces (averages) the accumulated gradients through DDP and marks them ready for the optimizer.
    pub(crate) fn sync(&self) -> Result<()> {
        let inner = &self.inner;
        let mut acc = lock(&inner.grads);
        if acc.grads.len() != inner.params.len() {
            acc.grads = vec![None; inner.params.len()];
        }
        let mut store = GradStore::default();
        for (slot, m) in acc.grads.iter_mut().zip(&inner.masters) {
            let g = match slot.take() {
                Some(g) => g,
                None => m.as_tensor().zeros_like()?,
            };
            store.insert(m.as_tensor(), g);
        }
        inner.ddp.sync_gradients(&mut store)?;
        for (slot, m) in acc.grads.iter_mut().zip(&inner.masters) {
            *slot = store.remove(m.as_tensor());
        }
        acc.synced = true;
        Ok(())
    }
}
