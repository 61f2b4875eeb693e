//! [`decide`]: the automatic layout at start-up — probe the cluster ([`super::probe_cluster`]) and
//! [`super::choose`] for a request the Accelerator completed ([`completed_request`]); [`predict`]: the cost model's
//! figures for a given layout on the measured cluster. Collective over the job's process group (the probe is);
//! every rank decides the same. The Accelerator applies a decision (`Accelerator::new`); nothing here knows its
//! config.

use super::measure::{memory_from_env, probe_cluster};
use super::request::{AutoLayoutDecision, AutoLayoutRequest};
use super::train::{Checkpointing, Precision, StateBytes};
use super::{choose, evaluate, Candidate, ClusterProbe, Layout};
use crate::Result;
use candle_core::Device;
use ddp_core::ProcessGroup;

/// `request` completed with what the run fixes: the sizes (`[dp_replicate, dp_shard, tp, pp]`, `None`: chosen),
/// the precision and the bytes per state on `device` ([`StateBytes::accel`]), checkpointing forced on when the run
/// asks for it.
pub fn completed_request(
    request: &AutoLayoutRequest,
    fixed: [Option<usize>; 4],
    precision: Precision,
    device: &Device,
    checkpointing: bool,
) -> AutoLayoutRequest {
    let mut r = request.clone();
    r.train.precision = precision;
    r.train.bytes = StateBytes::accel(precision, r.train.optimizer, device.is_cpu());
    r.train.fixed = fixed;
    if checkpointing {
        r.train.checkpointing = Checkpointing::On;
    }
    r
}

/// Probes the cluster for `request`: the memory given by the request, else [`super::MEMORY_ENV`], else detected; the
/// runtime overhead measured unless the request fixes it.
fn probe_for(
    pg: &ProcessGroup,
    device: &Device,
    request: &AutoLayoutRequest,
) -> Result<(ClusterProbe, super::Assumptions)> {
    let memory = match request.memory_per_process {
        Some(m) => Some(m),
        None => memory_from_env()?,
    };
    let m = &request.model;
    let rows = request.train.micro_batch_sizes.iter().copied().max().unwrap_or(1) * m.seq_len;
    let gradient_bytes = usize::try_from(m.total_params().saturating_mul(4)).unwrap_or(usize::MAX);
    let probe = probe_cluster(pg, device, (rows, m.d_model, m.d_ff), gradient_bytes, memory)?;
    let mut assumptions = request.assumptions;
    if !request.fixed_overhead && probe.baseline_rss > 0 {
        assumptions.runtime_overhead_bytes = probe.baseline_rss;
    }
    Ok((probe, assumptions))
}

/// Chooses the layout of `pg`'s ranks for a completed `request` (collective). Errors: the probe's, and the
/// chooser's ([`super::AutoLayoutError`]: nothing fits, with what would).
pub fn decide(pg: &ProcessGroup, device: &Device, request: &AutoLayoutRequest) -> Result<AutoLayoutDecision> {
    let (probe, assumptions) = probe_for(pg, device, request)?;
    let choice = choose(&request.model, &probe.spec, &request.train, &assumptions)?;
    Ok(AutoLayoutDecision { probe, choice })
}

/// The cost model's prediction for `layout` on the measured cluster (collective: the probe), for a completed
/// `request`. What `accel_gpt --predict` prints next to what it measures.
pub fn predict(
    pg: &ProcessGroup,
    device: &Device,
    request: &AutoLayoutRequest,
    layout: &Layout,
) -> Result<(ClusterProbe, Candidate)> {
    let (probe, assumptions) = probe_for(pg, device, request)?;
    let candidate = evaluate(&request.model, &probe.spec, &request.train, &assumptions, layout)?;
    Ok((probe, candidate))
}
