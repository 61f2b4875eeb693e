//! Every prepared parameter's tensor-parallel layout, made explicit.
//!
//! A parameter built by a [`crate::ParamBuilder`] carries its layout (replicated, or sharded along a dimension).
//! One built any other way — candle's `VarBuilder`, `ParamBuilder::var_builder` for layers with no parallel form —
//! is replicated only if every tp rank holds the same values: at tp = 1 it is, trivially; at tp > 1 this module
//! checks it (a hash of each such parameter compared over the tp group) and registers it as replicated, or
//! refuses the model, naming the parameters. A shard made by hand (the local shape on each rank) and a
//! replicated layer initialised at random by candle (each rank draws its own values) are both caught there
//! instead of training silently as something other than the single-process model. Left undetected: a hand-made
//! shard whose pieces are equal on every rank (e.g. all zeros), which no value check can tell from a replica.

use crate::tensor_parallel::{ParamLayout, TensorParallel};
use crate::{AccelError, Result};
use candle_core::{DType, Var};
use ddp_core::ReduceOp;
use std::hash::Hasher;

/// The layout of each parameter (`names` order), registering the unregistered ones as replicated once checked
/// (see the module documentation). Collective over the tp group when tp > 1 and some parameter is unregistered
/// (the same parameters on every rank: the model is built by the same code). Errors: parameters whose values
/// differ across the tp ranks, named.
pub(crate) fn layouts(tp: &TensorParallel, names: &[String], params: &[Var]) -> Result<Vec<ParamLayout>> {
    let unregistered: Vec<usize> = (0..params.len()).filter(|&i| tp.registered(&params[i]).is_none()).collect();
    if tp.size() > 1 && !unregistered.is_empty() {
        let differ = differing_across(tp, &unregistered.iter().map(|&i| &params[i]).collect::<Vec<_>>())?;
        if !differ.is_empty() {
            let named: Vec<&str> = differ.iter().map(|&k| names[unregistered[k]].as_str()).collect();
            return Err(AccelError::InvalidArgument(format!(
                "prepare_model: parameter(s) {named:?} were not built by a ParamBuilder and hold different values \
                 on the {} tensor-parallel ranks, so they are neither a known shard nor a replica; build a shard with \
                 ParamBuilder::sharded / sharded_padded (or a parallel layer), and a replicated parameter with \
                 ParamBuilder::replicated (drawn from the seed, equal on every rank) — candle's random initialisers \
                 draw different values on each rank",
                tp.size()
            )));
        }
    }
    for &i in &unregistered {
        tp.register(&params[i], ParamLayout::Replicated);
    }
    Ok(params.iter().map(|v| tp.registered(v).expect("every parameter registered above")).collect())
}

/// Positions (in `params`) of the parameters whose values are not the same on every rank of the tp group: a
/// 63-bit hash of each parameter's bytes, its maximum and minimum over the group compared.
fn differing_across(tp: &TensorParallel, params: &[&Var]) -> Result<Vec<usize>> {
    let hashes: Vec<i64> = params.iter().map(|v| value_hash(v)).collect::<Result<_>>()?;
    let (mut max, mut min) = (hashes.clone(), hashes);
    tp.group().all_reduce(&mut max, ReduceOp::Max)?;
    tp.group().all_reduce(&mut min, ReduceOp::Min)?;
    Ok((0..params.len()).filter(|&k| max[k] != min[k]).collect())
}

/// FNV-1a over the parameter's shape and its values' f32 bits, folded to 63 bits (a non-negative i64).
fn value_hash(v: &Var) -> Result<i64> {
    let values = v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut h = ddp_core::fingerprint::Fnv1a::default();
    let dims = v.dims().iter().map(|&d| d as u64);
    for word in dims.chain(values.iter().map(|x| u64::from(x.to_bits()))) {
        h.write(&word.to_le_bytes());
    }
    Ok((h.finish() >> 1) as i64)
}
