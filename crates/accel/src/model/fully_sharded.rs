//! FULL_SHARD (ZeRO stage 3; Rajbhandari et al. 2020 §5.3; PyTorch FSDP, Zhao et al. 2023): a prepared model
//! whose parameters rest as this rank's 1-D chunks over `dp_shard` and are made whole only for a use.
//!
//! candle has no module hooks and its autograd graph keeps every tensor a backward needs, so FSDP's "unshard before
//! the unit's forward, reshard after it" is built from two pieces:
//!
//! - **Gathering at each use**: `PreparedModel::param_builder` hands the model a builder whose every parameter
//!   request all-gathers the chunks (`ddp_core::functional::gather_shards`, whose backward reduce-scatters the
//!   gradient into the chunk). `accel::nn`'s layers hold their weights as handles that ask it at each use (the
//!   char-GPT's do); a model on the lower-level `ParamBuilder` builds its parts from it inside the forward.
//! - **Units**: a block run inside `accel::activation_checkpoint::unit` (what `accel::nn::Unit` does) keeps neither its gathered weights nor its
//!   activations after its forward (checkpointed); the backward pass gathers and recomputes it, and its weights'
//!   gradients are reduce-scattered before the backward moves to the unit before it — FSDP's reshard after
//!   forward.
//! - **Prefetch** ([`Prefetcher`]): the model asks for the next unit's weights before running the current one
//!   (`ParamBuilder::prefetch`; forward: the unit after, backward: the unit before), and a communication thread
//!   gathers them over a second communicator meanwhile (`accel::nn::Unit` asks; a `ParamBuilder` model calls it).
//!
//! So between steps a rank holds 1/dp_shard of the parameters, their gradients and their optimizer state; during a
//! recorded (segmented) backward, the whole weights of one unit at a time plus those outside any unit (the
//! embeddings and the head). Communication per micro-batch: an all-gather of the model for the forward, one more
//! for each unit's recomputation and a reduce-scatter of the gradients — 3Ψ as FSDP's (ZeRO paper §7.2.2).
//!
//! A gathered weight is a copy of the chunks at that moment: one kept past an optimizer step would train the
//! stale value: the gather's backward guard makes that an error at the backward pass that reaches it.

use super::PreparedModel;
use crate::{AccelError, Result};
use candle_core::Tensor;
use ddp_core::functional::BackwardGuard;
use ddp_core::ProcessGroup;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::{mpsc, Mutex};

/// Counts the optimizer steps a FULL_SHARD model took, so a gathered weight knows whether it is still current.
#[derive(Debug, Default)]
pub(crate) struct Generation(AtomicU64);

impl Generation {
    pub(crate) fn advance(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn current(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl PreparedModel {
    /// Parameter `i` of a FULL_SHARD model, whole (this rank's tp piece) in `dtype`: its chunks all-gathered over
    /// `dp_shard` now, the gradient reduce-scattered back by the backward pass (compressed as the run's
    /// `comm_hook` says, with the same arithmetic as ZeRO-2's reduce-scatter: the sync step then averages as for
    /// it), checked not to be stale there.
    pub(super) fn gathered(&self, i: usize, dtype: candle_core::DType) -> Result<Tensor> {
        let (group, shards) = self
            .inner
            .storage
            .sharding()
            .ok_or_else(|| AccelError::Usage("gathered: the model is not fully sharded".into()))?;
        let chunks = shards.chunks();
        let (name, gathered_at, generation) =
            (self.inner.names[i].clone(), self.inner.generation.current(), self.inner.generation.clone());
        let guard: BackwardGuard = Arc::new(move || {
            if generation.current() == gathered_at {
                return Ok(());
            }
            Err(format!(
                "FULL_SHARD: parameter `{name}` was gathered before optimizer step {} and used after it (a stale \
                 copy); build the model with accelerator.builder (accel::nn's layers fetch their weights at each \
                 use), or a ParamBuilder model's parts from model.param_builder() inside the forward that uses \
                 them (a candle layer built from a VarBuilder keeps its weights)",
                gathered_at + 1
            ))
        });
        let chunk = self.inner.optimized[i].as_tensor();
        // The reduction is the parameter's group strategy's; the gathered weight's backward runs it.
        let how = self
            .inner
            .groups
            .iter()
            .find(|g| g.params.binary_search(&i).is_ok())
            .and_then(|g| g.strategy.per_use_reduction(guard))
            .ok_or_else(|| {
                AccelError::Usage(format!(
                    "gathered: parameter `{}` is in no group whose gradients rest as chunks",
                    self.inner.names[i]
                ))
            })?;
        let prefetched = self.inner.storage.prefetcher().and_then(|p| p.take(i));
        let whole = match prefetched {
            Some(whole) => ddp_core::functional::attach_gathered_shards(chunk, whole?, group, how)?,
            None => ddp_core::functional::gather_shards_with(chunk, group, how)?,
        };
        Ok(chunks[i].unslice(&whole, &self.inner.local_dims[i])?.to_dtype(dtype)?)
    }

    /// Starts gathering the weights named `prefix.…` (a unit the forward or the backward runs next) on the
    /// prefetch thread; nothing unless FULL_SHARD.
    pub(super) fn prefetch_prefix(&self, prefix: &str) -> Result<()> {
        let Some(prefetcher) = self.inner.storage.prefetcher() else { return Ok(()) };
        let dotted = format!("{prefix}.");
        let chunks: Vec<(usize, &Tensor)> = (0..self.inner.names.len())
            .filter(|&i| self.inner.names[i].starts_with(&dotted))
            .map(|i| (i, self.inner.optimized[i].as_tensor()))
            .collect();
        prefetcher.prefetch(chunks)
    }
}

/// FULL_SHARD's prefetch (FSDP's `forward_prefetch` and `backward_prefetch = BACKWARD_PRE`): the whole weights of
/// the unit that runs next are all-gathered while the current one computes — on one communication thread, over a
/// second communicator of the dp_shard ranks, so its collectives never interleave with the calling thread's (every
/// rank issues the same prefetches in the same order: the model's code is the same). A weight asked for before its
/// prefetch finished waits for it; one never prefetched is gathered on the spot. Prefetches left unused when the
/// optimizer steps are dropped (their values would be stale).
pub(crate) struct Prefetcher {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// Parameter index → where its gathered whole arrives.
    ready: Mutex<HashMap<usize, mpsc::Receiver<ddp_core::Result<Whole>>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Gathers served by a prefetch.
    hits: AtomicU64,
    /// The communicator the thread gathers over (its traffic counters).
    group: ProcessGroup,
}

/// A gathered whole `[world · chunk]`, or why the gather failed.
type Gathered = ddp_core::Result<Tensor>;

/// One gather the thread runs.
enum Gather {
    /// A host f32 chunk (every FULL_SHARD chunk on the CPU), gathered into a buffer the calling thread allocated:
    /// the whole is then allocated and freed by that one thread. Gathered into the thread's own allocations, it
    /// would be freed by another thread, which an allocator with per-thread heaps (mimalloc, which the examples
    /// use) reclaims late while the prefetch thread waits: under CPU contention a rank's peak grew by 18–26 MiB
    /// (92 → 110–120 MiB for the small char-GPT, 3 steps) with it, and stayed at 93 MiB with this.
    Host { chunk: Vec<f32>, whole: Vec<f32> },
    /// Any other chunk (a device's), gathered by the group's tensor collective.
    Tensor(Tensor),
}

/// What comes back from a [`Gather`].
enum Whole {
    Host(Vec<f32>),
    Tensor(Tensor),
}

/// One prefetch: each gather and where its whole goes.
type Job = Vec<(Gather, mpsc::Sender<ddp_core::Result<Whole>>)>;

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").field("hits", &self.hits.load(Ordering::Relaxed)).finish()
    }
}

impl Prefetcher {
    /// A prefetcher whose thread all-gathers over `group` (the dp_shard ranks' second communicator).
    pub(crate) fn new(group: ProcessGroup) -> Self {
        let counted = group.clone();
        let (tx, rx) = mpsc::channel::<Job>();
        let worker = std::thread::Builder::new()
            .name("accel-fsdp-prefetch".into())
            .spawn(move || {
                for job in rx {
                    for (gather, reply) in job {
                        let whole = match gather {
                            Gather::Host { chunk, mut whole } => {
                                group.all_gather(&chunk, &mut whole).map(|()| Whole::Host(whole))
                            }
                            Gather::Tensor(chunk) => group.all_gather_tensor(&chunk).map(Whole::Tensor),
                        };
                        // A reply nobody waits for any more (dropped at an optimizer step) is fine to lose.
                        let _ = reply.send(whole);
                    }
                }
            })
            .expect("spawning the FULL_SHARD prefetch thread");
        Prefetcher {
            jobs: Mutex::new(Some(tx)),
            ready: Mutex::default(),
            worker: Mutex::new(Some(worker)),
            hits: AtomicU64::new(0),
            group: counted,
        }
    }

    /// Starts gathering `chunks` (parameter index, this rank's chunk) unless already under way; the values are
    /// copied now.
    pub(crate) fn prefetch(&self, chunks: Vec<(usize, &Tensor)>) -> Result<()> {
        let mut ready = crate::lock(&self.ready);
        let mut job = Vec::new();
        for (i, chunk) in chunks {
            if ready.contains_key(&i) {
                continue;
            }
            let (tx, rx) = mpsc::channel();
            let gather = match (chunk.device(), chunk.dtype(), chunk.rank()) {
                (candle_core::Device::Cpu, candle_core::DType::F32, 1) => {
                    let chunk = chunk.to_vec1::<f32>()?;
                    let whole = vec![0f32; chunk.len() * self.group.world_size()];
                    Gather::Host { chunk, whole }
                }
                _ => Gather::Tensor(chunk.copy()?),
            };
            job.push((gather, tx));
            ready.insert(i, rx);
        }
        if !job.is_empty() {
            if let Some(jobs) = crate::lock(&self.jobs).as_ref() {
                let _ = jobs.send(job);
            }
        }
        Ok(())
    }

    /// The prefetched whole of parameter `i` (`[world · chunk]`), waiting for it; `None` when it was not prefetched.
    pub(crate) fn take(&self, i: usize) -> Option<Gathered> {
        let rx = crate::lock(&self.ready).remove(&i)?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        let whole = rx.recv().unwrap_or_else(|_| {
            Err(ddp_core::DdpError::InvalidArgument("FULL_SHARD prefetch: the prefetch thread is gone".into()))
        });
        Some(whole.and_then(|whole| match whole {
            Whole::Host(values) => {
                let n = values.len();
                Ok(Tensor::from_vec(values, n, &candle_core::Device::Cpu)?)
            }
            Whole::Tensor(t) => Ok(t),
        }))
    }

    /// Forgets prefetches not used (at an optimizer step: their values are stale now).
    pub(crate) fn clear(&self) {
        crate::lock(&self.ready).clear();
    }

    pub(crate) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// The collectives the prefetch thread ran (calls and payload bytes).
    pub(crate) fn traffic(&self) -> ddp_core::TrafficStats {
        self.group.traffic()
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        crate::lock(&self.jobs).take(); // the thread's queue closes: it ends after the gathers under way
        if let Some(worker) = crate::lock(&self.worker).take() {
            let _ = worker.join();
        }
    }
}
