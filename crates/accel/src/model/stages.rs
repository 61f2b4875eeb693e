//! [`Stages`]: what a prepared model knows about the other pipeline stages — every pp rank's parameter names and
//! single-process shapes, exchanged once at `prepare_model` — so that
//!
//! - `state_dict` gathers the whole model from the stages (`model.safetensors` holds the single-process tensors
//!   under the single-process names, whatever the layout; for a checkpoint only onto pp rank 0, so no other rank
//!   ever holds the whole model),
//! - `load_state_dict` takes the other stages' tensors as expected, not as strangers,
//! - the optimizer state is saved as one process would hold it (parameters renumbered from each stage's sorted
//!   names to the whole model's) and split back by any layout, so a checkpoint's optimizer state loads at another
//!   pp size,
//! - a weight several stages hold (tied) is found, and its copies start equal.
//!
//! Only this file knows how a stage's parameter indices map to the single-process model's.

use super::TiedWeights;
use crate::state::StateDict;
use crate::tensor_parallel::ParamLayout;
use crate::{AccelError, Result};
use candle_core::{DType, Device, Tensor, Var};
use ddp_core::{ProcessGroup, ReduceOp};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// The shape a parameter has in a single-process model (a tp shard's split dimension at its full size).
pub(super) fn full_shape(local: &[usize], layout: ParamLayout) -> Vec<usize> {
    let mut dims = local.to_vec();
    if let ParamLayout::Sharded { dim, full, .. } = layout {
        dims[dim] = full;
    }
    dims
}

/// Who receives the stages' tensors: every pp rank (a state dict a program reads), or only pp rank 0 (a checkpoint,
/// which the job's rank 0 writes: no other rank ever holds the whole model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gather {
    Everyone,
    FirstStage,
}

/// Named tensors' single-process shapes, `(name, dims)`.
type Shaped = Vec<(String, Vec<usize>)>;

/// Every pp rank's parameters and the pp group (see the module documentation).
#[derive(Debug)]
pub(super) struct Stages {
    pp: ProcessGroup,
    /// By pp rank: `(name, single-process shape)`, in name order.
    params: Vec<Shaped>,
    /// The single-process model's parameter names: the union of the stages', sorted (a parameter's index in the
    /// single-process model, which optimizer states are keyed by).
    whole: Vec<String>,
}

impl Stages {
    /// Exchanges `mine` (this stage's `(name, single-process shape)`, name order) over the pp group
    /// (collective).
    pub(super) fn exchange(pp: &ProcessGroup, mine: Vec<(String, Vec<usize>)>) -> Result<Self> {
        let params: Vec<Shaped> = all_gather_json(pp, &mine)?;
        let whole: BTreeSet<String> = params.iter().flatten().map(|(n, _)| n.clone()).collect();
        Ok(Stages { pp: pp.clone(), params, whole: whole.into_iter().collect() })
    }

    /// Whether some stage holds parameter `name`.
    pub(super) fn holds(&self, name: &str) -> bool {
        self.whole.binary_search_by(|n| n.as_str().cmp(name)).is_ok()
    }

    /// The single-process index of each of pp rank `rank`'s parameters.
    fn whole_indices(&self, rank: usize) -> Vec<usize> {
        self.params[rank]
            .iter()
            .map(|(n, _)| self.whole.binary_search(n).expect("every stage's name is in the union"))
            .collect()
    }

    /// The weights this rank shares with other pp ranks (a name held by several stages: GPT-2's token embedding,
    /// read by the first stage and, as the head, by the last), one group per set of pp ranks sharing names, made
    /// in the same order on every pp rank (collective over pp). The copies start equal: each is broadcast from the
    /// lowest pp rank holding it (Megatron-LM's embedding group; Megatron-LM#299 was copies that started apart).
    /// `masters` are this stage's fp32 weights, name order.
    pub(super) fn tied_weights(&self, masters: &[Var]) -> Result<Vec<TiedWeights>> {
        let mut holders: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (rank, params) in self.params.iter().enumerate() {
            for (name, _) in params {
                holders.entry(name.as_str()).or_default().push(rank);
            }
        }
        let sets: BTreeSet<&Vec<usize>> = holders.values().filter(|r| r.len() > 1).collect();
        let mine = &self.params[self.pp.rank()];
        let mut tied = Vec::new();
        for set in sets {
            let Some(group) = self.pp.new_group(set)? else { continue };
            let params: Vec<usize> = mine
                .iter()
                .enumerate()
                .filter(|(_, (n, _))| holders.get(n.as_str()) == Some(set))
                .map(|(i, _)| i)
                .collect();
            for &i in &params {
                masters[i].set(&group.broadcast_tensor(masters[i].as_tensor(), 0)?)?;
            }
            tied.push(TiedWeights { group, params, counted_here: self.pp.rank() == set[0] });
        }
        Ok(tied)
    }

    /// `local` (this stage's full tensors by name) with every other stage's added: one broadcast of each stage's
    /// flat fp32 values (collective over pp).
    pub(super) fn gather(
        &self,
        mut local: BTreeMap<String, Tensor>,
        device: &Device,
        to: Gather,
    ) -> Result<BTreeMap<String, Tensor>> {
        for (root, params) in self.params.iter().enumerate() {
            for (name, t) in self.send_tensors(root, params, |name| local[name].clone(), device, to)? {
                local.entry(name).or_insert(t);
            }
        }
        Ok(local)
    }

    /// A stage's optimizer state (full tensors, keyed `{stage index}.{buffer}`) → the single-process model's:
    /// every stage's buffers renumbered to single-process indices and gathered, each parameter's update count
    /// taken from the lowest stage holding it (collective over pp). Every stage steps once per optimizer step, so
    /// the step counts agree.
    pub(super) fn gather_optimizer_state(&self, local: StateDict, device: &Device, to: Gather) -> Result<StateDict> {
        let me = self.pp.rank();
        let index = self.whole_indices(me);
        // This stage's buffers under their single-process keys; the names and shapes go to every pp rank.
        let by_new_key: BTreeMap<String, Tensor> = local
            .tensors
            .iter()
            .map(|(k, t)| Ok((renumber(k, |i| index.get(i).copied())?, t.clone())))
            .collect::<Result<_>>()?;
        let renamed: Shaped = by_new_key.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect();
        let steps: Vec<u64> = local.meta_field("param_steps").unwrap_or_default();
        let all: Vec<(Shaped, Vec<u64>)> = all_gather_json(&self.pp, &(renamed, steps))?;
        let mut full = StateDict { tensors: BTreeMap::new(), meta: local.meta.clone() };
        let mut param_steps: Vec<Option<u64>> = vec![None; self.whole.len()];
        for (root, (keys, steps)) in all.iter().enumerate() {
            for (name, t) in self.send_tensors(root, keys, |k| by_new_key[k].clone(), device, to)? {
                full.tensors.entry(name).or_insert(t);
            }
            for (g, s) in self.whole_indices(root).into_iter().zip(steps) {
                param_steps[g].get_or_insert(*s);
            }
        }
        if let Some(meta) = full.meta.as_object_mut() {
            meta.insert("num_params".into(), self.whole.len().into());
            meta.insert("param_steps".into(), param_steps.into_iter().map(Option::unwrap_or_default).collect());
        }
        Ok(full)
    }

    /// The inverse of [`Self::gather_optimizer_state`]: this stage's part of a single-process optimizer state
    /// (no communication).
    pub(super) fn own_optimizer_state(&self, full: StateDict) -> Result<StateDict> {
        let index = self.whole_indices(self.pp.rank());
        let local_of: BTreeMap<usize, usize> = index.iter().enumerate().map(|(i, g)| (*g, i)).collect();
        let steps: Vec<u64> = full.meta_field("param_steps").unwrap_or_default();
        let mut own = StateDict { tensors: BTreeMap::new(), meta: full.meta.clone() };
        for (k, t) in full.tensors {
            if let Some(g) = k.split_once('.').and_then(|(i, _)| i.parse::<usize>().ok()) {
                if g >= self.whole.len() {
                    return Err(AccelError::InvalidArgument(format!(
                        "the optimizer state names parameter {g}, but the model has {} parameters over its pipeline \
                         stages: the state belongs to another model",
                        self.whole.len()
                    )));
                }
                if local_of.contains_key(&g) {
                    own.tensors.insert(renumber(&k, |g| local_of.get(&g).copied())?, t);
                }
            }
        }
        if let Some(meta) = own.meta.as_object_mut() {
            meta.insert("num_params".into(), index.len().into());
            if !steps.is_empty() {
                let mine: Vec<u64> = index.iter().map(|&g| steps.get(g).copied().unwrap_or_default()).collect();
                meta.insert("param_steps".into(), mine.into());
            }
        }
        Ok(own)
    }

    /// The tensors `keys` (name, shape) of pp rank `root`, which `get` reads on that rank, sent as one flat fp32
    /// buffer to every pp rank (a broadcast) or to pp rank 0 only (point to point); returns them by name where they
    /// arrived (and on `root`), nothing elsewhere.
    fn send_tensors(
        &self,
        root: usize,
        keys: &[(String, Vec<usize>)],
        get: impl Fn(&str) -> Tensor,
        device: &Device,
        to: Gather,
    ) -> Result<Vec<(String, Tensor)>> {
        let me = self.pp.rank();
        let receives = match to {
            Gather::Everyone => true,
            Gather::FirstStage => me == root || me == 0,
        };
        if !receives {
            return Ok(Vec::new());
        }
        let numel: Vec<usize> = keys.iter().map(|(_, dims)| dims.iter().product()).collect();
        let mut flat: Vec<f32> = if root == me {
            let mut v = Vec::with_capacity(numel.iter().sum());
            for (name, _) in keys {
                v.extend(get(name).flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
            }
            v
        } else {
            vec![0.0; numel.iter().sum()]
        };
        match to {
            Gather::Everyone => self.pp.broadcast(&mut flat, root)?,
            Gather::FirstStage if root == 0 => {}
            Gather::FirstStage if me == root => self.pp.send(&flat, 0)?,
            Gather::FirstStage => self.pp.recv(&mut flat, root)?,
        }
        let mut at = 0;
        let mut out = Vec::with_capacity(keys.len());
        for ((name, dims), n) in keys.iter().zip(&numel) {
            out.push((name.clone(), Tensor::from_slice(&flat[at..at + n], dims.as_slice(), device)?));
            at += n;
        }
        Ok(out)
    }
}

/// `{i}.{rest}` → `{map(i)}.{rest}`.
fn renumber(key: &str, map: impl Fn(usize) -> Option<usize>) -> Result<String> {
    let (i, rest) =
        key.split_once('.').and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest))).ok_or_else(|| {
            AccelError::InvalidArgument(format!("optimizer state key {key:?} is not {{parameter}}.{{buffer}}"))
        })?;
    let to = map(i).ok_or_else(|| {
        AccelError::InvalidArgument(format!(
            "the optimizer state names parameter {i}, which this pipeline stage does not hold: the state belongs to \
             another model"
        ))
    })?;
    Ok(format!("{to}.{rest}"))
}

/// Every rank's `mine` (collective over `group`): one all-gather of the JSON text, padded to the longest.
fn all_gather_json<T: Serialize + DeserializeOwned>(group: &ProcessGroup, mine: &T) -> Result<Vec<T>> {
    let text = serde_json::to_vec(mine).map_err(|e| AccelError::json("encoding what a stage holds", e))?;
    let mut len = [text.len() as i64];
    group.all_reduce(&mut len, ReduceOp::Max)?;
    let width = len[0] as usize;
    let mut padded = text;
    padded.resize(width, b' ');
    let mut all = vec![0u8; width * group.world_size()];
    group.all_gather(&padded, &mut all)?;
    all.chunks(width.max(1))
        .take(group.world_size())
        .map(|c| serde_json::from_slice(c).map_err(|e| AccelError::json("reading what another stage holds", e)))
        .collect()
}
