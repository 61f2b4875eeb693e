//! The overlapped backward of [`DistributedDataParallel`]: gradient buckets all-reduced while later backward
//! segments still compute (see the module docs of `ddp.rs` and of [`crate::segments`]).
//!
//! The plan: after which backward segment (0 = the one that ends at the loss) each parameter's gradient is
//! final. It is learned on the first synced call for a given number of segments — every rank records the last
//! segment that gave each parameter a gradient, and one all-reduce (max) makes the plan the same, and safe, on
//! every rank — and the buckets are rebuilt in that order, never spanning two segments. A later call launches
//! bucket `k` right after segment `plan.bucket_ready[k]`, in bucket order (the order every rank issues its
//! all-reduces in), while this thread goes on with the next segment.

use super::{bucket, plan_buckets, BucketLayout, DistributedDataParallel};
use crate::segments::BackwardSegments;
use crate::{DdpError, ReduceOp, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use std::sync::Arc;

/// When each gradient is final, for one number of backward segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OverlapPlan {
    /// Segments of the backward pass the plan was learned for.
    pub segments: usize,
    /// Per parameter (registration order): the backward segment after which its gradient is final.
    pub final_after: Vec<usize>,
    /// Per bucket (communication order): the backward segment after which all its parameters are final.
    pub bucket_ready: Vec<usize>,
}

impl DistributedDataParallel {
    /// See [`DistributedDataParallel::backward_segments_into`].
    pub(super) fn run_segments_into(
        &self,
        loss: &Tensor,
        segments: BackwardSegments,
        slots: &mut [Option<Tensor>],
        sync: bool,
        mut add: impl FnMut(GradStore, &mut [Option<Tensor>]) -> Result<Vec<usize>>,
    ) -> Result<()> {
        if slots.len() != self.vars.len() {
            return Err(DdpError::InvalidArgument(format!(
                "DDP backward: {} gradient slots for {} wrapped parameters; pass one slot per parameter, in \
                 named_vars order",
                slots.len(),
                self.vars.len()
            )));
        }
        let num_segments = segments.num_segments();
        if !sync || self.pg.world_size() == 1 {
            return segments.backward(loss, |_, store| add(store, slots).map(drop));
        }
        if !self.overlaps() {
            // The same gradients, reduced after the backward pass in the construction layout (sync_gradients').
            let mut received = vec![false; self.vars.len()];
            segments.backward(loss, |_, store| {
                for i in add(store, slots)? {
                    received[i] = true;
                }
                Ok::<(), DdpError>(())
            })?;
            if !self.opts.find_unused_parameters {
                self.check_all_received(&received)?;
            }
            return self.reduce_gradients(slots);
        }
        let layout = self.layout();
        match &layout.overlap {
            Some(plan) if plan.segments == num_segments && !self.opts.find_unused_parameters => {
                self.overlapped(&layout, plan, loss, segments, slots, add)
            }
            _ if self.opts.find_unused_parameters => {
                // Which parameters some rank used is known only after the whole backward pass (one bitmap
                // all-reduce): no overlap.
                segments.backward(loss, |_, store| add(store, slots).map(drop))?;
                self.reduce_gradients(slots)
            }
            _ => {
                // Learning step: the backward pass first, then the plan, then one reduction in the new layout.
                let mut last_seen = vec![0i64; self.vars.len()];
                segments.backward(loss, |k, store| {
                    for i in add(store, slots)? {
                        last_seen[i] = k as i64 + 1;
                    }
                    Ok::<(), DdpError>(())
                })?;
                // Before any communication, so on the rank at fault (as sync_gradients).
                self.check_all_received(&last_seen.iter().map(|&s| s > 0).collect::<Vec<_>>())?;
                self.learn(last_seen, num_segments)?;
                self.reduce_gradients(slots)
            }
        }
    }

    /// Agrees on the plan across ranks and rebuilds the buckets for it. `last_seen[i]` = 1 + the last backward
    /// segment that gave parameter `i` a gradient on this rank (0: none).
    fn learn(&self, mut last_seen: Vec<i64>, num_segments: usize) -> Result<()> {
        // The segment count rides along (max of n and of −n gives both extremes) so that ranks cutting their
        // backward pass differently fail together, with both counts named.
        last_seen.extend([num_segments as i64, -(num_segments as i64)]);
        self.pg.all_reduce(&mut last_seen, ReduceOp::Max)?;
        let min_segments = -last_seen.pop().unwrap_or(0);
        let max_segments = last_seen.pop().unwrap_or(0);
        if min_segments != max_segments {
            return Err(DdpError::InvalidArgument(format!(
                "DDP backward: ranks cut their backward pass into different numbers of segments ({min_segments} to \
                 {max_segments}, this rank {num_segments}); every rank must run the same model with the same \
                 segments::cut calls"
            )));
        }
        let final_after: Vec<usize> = last_seen.iter().map(|&s| s as usize - 1).collect();
        // Final earliest first; within a segment, reverse registration order (as the construction layout).
        let mut order: Vec<usize> = (0..self.vars.len()).rev().collect();
        order.sort_by_key(|&i| final_after[i]);
        let stage: Vec<usize> = order.iter().map(|&i| final_after[i]).collect();
        let (first_cap, cap) = self.caps;
        let params: Vec<_> = self.sizes.iter().copied().zip(self.dtypes.iter().copied()).collect();
        let buckets =
            plan_buckets(bucket::assign_in_order(&params, &order, &stage, first_cap, cap), &self.sizes, &self.dtypes);
        let bucket_ready =
            buckets.iter().map(|b| b.params.iter().map(|&p| final_after[p]).max().unwrap_or(0)).collect();
        let overlap = OverlapPlan { segments: num_segments, final_after, bucket_ready };
        tracing::debug!(rank = self.pg.rank(), ?overlap, "DDP: buckets rebuilt for the overlapped backward");
        *crate::sync::lock(&self.layout) = Arc::new(BucketLayout { buckets, overlap: Some(overlap) });
        Ok(())
    }

    /// A backward pass whose buckets go out as their segments finish.
    fn overlapped(
        &self,
        layout: &BucketLayout,
        plan: &OverlapPlan,
        loss: &Tensor,
        segments: BackwardSegments,
        slots: &mut [Option<Tensor>],
        mut add: impl FnMut(GradStore, &mut [Option<Tensor>]) -> Result<Vec<usize>>,
    ) -> Result<()> {
        let buckets = layout.buckets.len();
        // Which parameters this call's backward pass gave a gradient (slots may hold earlier micro-batches').
        let mut received = vec![false; self.vars.len()];
        let all_used = vec![true; slots.len()];
        let reduced = self.pipelined(layout, &all_used, |pipe| {
            segments.backward(loss, |k, store| {
                let got = add(store, slots)?;
                for &i in &got {
                    received[i] = true;
                }
                if let Some(&late) = got.iter().find(|&&i| plan.final_after[i] < k) {
                    return Err(DdpError::InvalidArgument(format!(
                        "DDP backward: parameter `{}` got a gradient in backward segment {k}, after its bucket \
                         was sent (its gradients were final after segment {} when the buckets were planned); \
                         the model must use each parameter between the same cuts at every step",
                        self.vars[late].0, plan.final_after[late]
                    )));
                }
                while pipe.launched() < buckets && plan.bucket_ready[pipe.launched()] <= k {
                    self.launch_checked(pipe, slots, &received, Some(k))?;
                }
                Ok::<(), DdpError>(())
            })?;
            while pipe.launched() < buckets {
                self.launch_checked(pipe, slots, &received, None)?;
            }
            Ok(())
        })?;
        reduced.put_back_into(slots)
    }

    /// Launches the next bucket after backward segment `segment` (`None`: after the whole backward pass); this
    /// call's backward pass must have given each of its parameters a gradient by then.
    fn launch_checked(
        &self,
        pipe: &mut super::Pipeline<'_, '_>,
        slots: &[Option<Tensor>],
        received: &[bool],
        segment: Option<usize>,
    ) -> Result<()> {
        let k = pipe.launched();
        let missing: Vec<String> =
            pipe.layout.buckets[k].params.iter().filter(|&&p| !received[p]).map(|&p| self.vars[p].0.clone()).collect();
        match (missing.is_empty(), segment) {
            (true, _) => pipe.launch(k, slots),
            (false, None) => Err(DdpError::UnusedParameters { names: missing }),
            // Planned final by now: either the model stopped using them, or uses them in a later segment (before
            // a cut it did not have when the plan was made).
            (false, Some(s)) => Err(DdpError::InvalidArgument(format!(
                "DDP backward: parameters {missing:?} have no gradient after backward segment {s}, where the plan \
                 made on the first step has them final; the model now uses them later in the backward pass (before \
                 a cut it did not have then) or not at all — every step must cut the same way and use every \
                 parameter (or set DdpOptions::find_unused_parameters = true)"
            ))),
        }
    }

    /// [`DdpError::UnusedParameters`] naming every parameter whose `received` is false.
    fn check_all_received(&self, received: &[bool]) -> Result<()> {
        let missing: Vec<String> =
            received.iter().zip(&self.vars).filter(|(r, _)| !**r).map(|(_, (name, _))| name.clone()).collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(DdpError::UnusedParameters { names: missing })
        }
    }
}
