//! [`PreparedModel`]: a model's parameters as the Accelerator manages them — the compute-dtype `Var`s the model
//! reads, their fp32 master copies the optimizer updates (the same `Var`s in fp32) and the parameter groups
//! whose gradients are reduced together ([`GradientReduction`]). Its gradients are not here: the Accelerator's
//! step owner holds them (see `crate::step`).

use crate::step::GradientReduction;
use crate::{AccelError, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use ddp_core::{DistributedDataParallel, ProcessGroup};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Handle to a prepared model. Cheap to clone; clones share parameters.
#[derive(Clone)]
pub struct PreparedModel {
    inner: Arc<ModelInner>,
}

struct ModelInner {
    /// Registration index with the Accelerator (where its gradient slots live).
    index: usize,
    /// `VarMap` names, sorted (the same order on every rank).
    names: Vec<String>,
    /// The model's `Var`s, in the compute dtype.
    params: Vec<Var>,
    /// fp32 master weights; the very same `Var`s as `params` when the compute dtype is F32.
    masters: Vec<Var>,
    /// Whether `masters` are separate copies (bf16 / fp16 compute).
    has_masters: bool,
    /// Parameter groups (indices into `params`) and how each group's gradients are reduced.
    groups: Vec<(Vec<usize>, GradientReduction)>,
    find_unused_parameters: bool,
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
    /// Sorts `varmap`'s variables by name, checks their device, makes fp32 masters under bf16/fp16 and wraps the
    /// masters in DDP (names and shapes checked across ranks, rank 0's values broadcast). `index` is the slot the
    /// step owner keeps this model's gradients in.
    pub(crate) fn new(
        index: usize,
        pg: &ProcessGroup,
        device: &candle_core::Device,
        ddp: &ddp_core::DdpOptions,
        varmap: &VarMap,
    ) -> Result<Self> {
        let mut named: Vec<(String, Var)> =
            crate::lock(varmap.data()).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if named.is_empty() {
            return Err(AccelError::Usage(
                "prepare_model: the VarMap has no variables; build the model with accelerator.var_builder(&varmap) \
                 before preparing it"
                    .into(),
            ));
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, v) in &named {
            if !v.device().same_device(device) {
                return Err(AccelError::InvalidArgument(format!(
                    "prepare_model: parameter {name:?} is on {:?} but the Accelerator uses {device:?}; build the \
                     model with accelerator.var_builder(&varmap)",
                    v.device(),
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
        // Data parallelism only: one group, every parameter replicated. Gradients are reduced in fp32.
        let replicated = DistributedDataParallel::from_named_vars(
            pg,
            names.iter().cloned().zip(masters.iter().cloned()).collect(),
            ddp.clone(),
        )?;
        let model = PreparedModel {
            inner: Arc::new(ModelInner {
                index,
                groups: vec![((0..params.len()).collect(), GradientReduction::AllReduce(replicated))],
                names,
                params,
                masters,
                has_masters,
                find_unused_parameters: ddp.find_unused_parameters,
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

    /// The DDP wrapper of the replicated parameters (bucket layout, options).
    pub fn ddp(&self) -> &DistributedDataParallel {
        self.inner
            .groups
            .iter()
            .map(|(_, r)| match r {
                GradientReduction::AllReduce(ddp) => ddp,
            })
            .next()
            .expect("a prepared model has one replicated group")
    }

    /// Parameter groups: the parameter indices of each and how its gradients are reduced.
    pub fn parameter_groups(&self) -> impl Iterator<Item = (&[usize], &GradientReduction)> {
        self.inner.groups.iter().map(|(p, r)| (p.as_slice(), r))
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

    /// Casts the fp32 masters back into the compute-dtype `Var`s (no-op in fp32).
    pub(crate) fn copy_masters_to_params(&self) -> Result<()> {
        if self.inner.has_masters {
            for (p, m) in self.inner.params.iter().zip(&self.inner.masters) {
                p.set(&m.as_tensor().to_dtype(p.dtype())?)?;
            }
        }
        Ok(())
    }

    pub(crate) fn index(&self) -> usize {
        self.inner.index
    }

    pub(crate) fn find_unused_parameters(&self) -> bool {
        self.inner.find_unused_parameters
    }

    /// Reduces this model's gradient slots across ranks, group by group (collective).
    pub(crate) fn reduce_gradients(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        for (params, reduction) in &self.inner.groups {
            let mut group: Vec<Option<Tensor>> = params.iter().map(|&i| slots[i].take()).collect();
            let reduced = reduction.reduce(&mut group);
            for (&i, g) in params.iter().zip(group) {
                slots[i] = g;
            }
            reduced?;
        }
        Ok(())
    }
}
