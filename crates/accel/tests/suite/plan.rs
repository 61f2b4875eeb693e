//! Parallelism applied to a model through a plan: a model written once on `accel::nn`'s builder (candle's
//! vocabulary) trains at dp 2, tp 2, dp 2 × tp 2, ZeRO-1 and ZeRO-2 like one process with only a plan written for
//! it; a model written the candle way trains under DDP, ZeRO-1 and ZeRO-2 like one process and is refused where it
//! cannot go; every plan error names what is wrong.
//!
//! Tolerance: fp32, `|a − b| ≤ 1e-5 · max(1, |b|)` on every final weight (the split products sum in another
//! order, as in the tensor-parallel layer tests), while training moves the weights by more than 1e-2.

use crate::ranks::*;
use accel::nn::{self, Embedding, Linear, Module, RmsNorm, Staged, VarBuilder};
use accel::pipeline::ScheduleKind;
use accel::plan::{ParallelPlan, ParallelStyle};
use accel::tensor_parallel::{vocab_parallel_cross_entropy, TensorParallel};
use accel::{AcceleratorConfig, AdamW, AdamWConfig, ParallelismConfig, ShardingStrategy};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarMap;
use std::collections::BTreeMap;

const VOCAB: usize = 13;
const D_MODEL: usize = 16;
const HEADS: usize = 4;
const HIDDEN: usize = 24;
const LAYERS: usize = 4;
const SEQ: usize = 6;
const GLOBAL_BATCH: usize = 8;
const STEPS: usize = 4;

/// A Llama-shaped decoder written the candle way on `accel::nn` (no style, unit handling, prefetch or stage
/// cutting anywhere in its code): a token embedding, then per layer an RMS norm and causal attention with bias-free
/// q/k/v/o projections, an RMS norm and a bias-free SwiGLU MLP, then a final norm and a head (separate, or tied to
/// the embedding). Declared as its blocks, so the Accelerator cuts it into pipeline stages.
struct TinyLlama {
    model: Staged<Embedding, Layer, Head>,
    tp: TensorParallel,
}

#[derive(Clone)]
struct Head {
    norm: RmsNorm,
    head: Linear,
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.head.forward(&self.norm.forward(x)?)
    }
}

#[derive(Clone)]
struct Layer {
    attn_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Layer {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let (attn, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
        Ok(Layer {
            attn_norm: nn::rms_norm(D_MODEL, 1e-6, vb.pp("input_layernorm"))?,
            q: nn::linear_no_bias(D_MODEL, D_MODEL, attn.pp("q_proj"))?,
            k: nn::linear_no_bias(D_MODEL, D_MODEL, attn.pp("k_proj"))?,
            v: nn::linear_no_bias(D_MODEL, D_MODEL, attn.pp("v_proj"))?,
            o: nn::linear_no_bias(D_MODEL, D_MODEL, attn.pp("o_proj"))?,
            mlp_norm: nn::rms_norm(D_MODEL, 1e-6, vb.pp("post_attention_layernorm"))?,
            gate: nn::linear_no_bias(D_MODEL, HIDDEN, mlp.pp("gate_proj"))?,
            up: nn::linear_no_bias(D_MODEL, HIDDEN, mlp.pp("up_proj"))?,
            down: nn::linear_no_bias(HIDDEN, D_MODEL, mlp.pp("down_proj"))?,
        })
    }
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.attn_norm.forward(x)?;
        let (q, k, v) = (self.q.forward(&h)?, self.k.forward(&h)?, self.v.forward(&h)?);
        // The local head count from the shapes, never from the config.
        let heads = q.dim(D::Minus1)? / (D_MODEL / HEADS);
        let scale = 1.0 / ((D_MODEL / HEADS) as f64).sqrt();
        let a = accel::ops::attention::causal_self_attention(&q, &k, &v, heads, scale)?;
        let x = (x + self.o.forward(&a)?)?;
        let h = self.mlp_norm.forward(&x)?;
        let h = (candle_nn::ops::silu(&self.gate.forward(&h)?)? * self.up.forward(&h)?)?;
        &x + self.down.forward(&h)?
    }
}

impl TinyLlama {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Self::with_head(vb, false)
    }

    fn with_head(vb: VarBuilder, tied: bool) -> candle_core::Result<Self> {
        let embed = |vb: VarBuilder| nn::embedding(VOCAB, D_MODEL, vb.pp("embed_tokens"));
        let model = nn::staged(&vb, LAYERS, "layers", embed, Layer::new, |vb, first: Option<&Embedding>| {
            let head = match (tied, first) {
                (false, _) => nn::linear_no_bias(D_MODEL, VOCAB, vb.pp("lm_head"))?,
                (true, Some(embedding)) => Linear::tied(embedding),
                // A last stage apart from the first holds its own copy of the embedding (same name, same values).
                (true, None) => Linear::tied(&embed(vb.clone())?),
            };
            Ok(Head { norm: nn::rms_norm(D_MODEL, 1e-6, vb.pp("norm"))?, head })
        })?;
        Ok(TinyLlama { model, tp: vb.tp().clone() })
    }

    /// Logits `[b, s, vocab]` — this rank's vocabulary columns when the head is vocab-parallel.
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.model.forward(ids)
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        self.loss_of(&self.forward(ids)?, targets)
    }

    fn loss_of(&self, logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, v) = logits.dims3()?;
        let losses =
            vocab_parallel_cross_entropy(&logits.reshape((b * s, v))?, &targets.reshape(b * s)?, &self.tp, VOCAB)?;
        losses.mean_all()
    }
}

/// The model's stages, as `pipeline_backward` drives them (at pp 1 the whole model in a recorded forward, whose
/// units FULL_SHARD gathers, frees, recomputes and prefetches, and activation checkpointing recomputes).
impl accel::pipeline::StagedModel for TinyLlama {
    fn stage_forward(&self, stage: usize, input: &Tensor) -> accel::Result<Tensor> {
        self.model.stage_forward(stage, input)
    }
}

/// The plan: transformers' Llama plan (q/k/v/gate/up column-wise, o/down row-wise), the embedding and the head
/// vocab-parallel.
fn llama_plan() -> ParallelPlan {
    ParallelPlan::from_pairs([
        ("embed_tokens", "vocab_parallel"),
        ("layers.*.self_attn.q_proj", "colwise"),
        ("layers.*.self_attn.k_proj", "colwise"),
        ("layers.*.self_attn.v_proj", "colwise"),
        ("layers.*.self_attn.o_proj", "rowwise"),
        ("layers.*.mlp.gate_proj", "colwise"),
        ("layers.*.mlp.up_proj", "colwise"),
        ("layers.*.mlp.down_proj", "rowwise"),
        ("lm_head", "vocab_parallel"),
    ])
    .unwrap()
}

/// [`llama_plan`] for a head tied to the embedding (no `lm_head` layer: the embedding's rule covers both).
fn tied_plan() -> ParallelPlan {
    let llama = llama_plan();
    let rules = llama.rules().filter(|(p, _)| p.as_str() != "lm_head");
    rules.fold(ParallelPlan::new(), |plan, (p, s)| plan.with(p.as_str(), s))
}

/// Deterministic token ids `[n, SEQ + 1]`: inputs are the first SEQ columns, targets the last SEQ.
fn tokens(n: usize) -> Tensor {
    let v: Vec<u32> = (0..n * (SEQ + 1)).map(|i| ((i * 7 + i / 5) % VOCAB) as u32).collect();
    Tensor::from_vec(v, (n, SEQ + 1), &Device::Cpu).unwrap()
}

pub(crate) fn config(dp_replicate: usize, dp_shard: usize, tp: usize, sharding: ShardingStrategy) -> AcceleratorConfig {
    let parallelism = ParallelismConfig {
        dp_replicate_size: dp_replicate,
        dp_shard_size: dp_shard,
        tp_size: tp,
        sharding_strategy: sharding,
        ..ParallelismConfig::default()
    };
    AcceleratorConfig { parallelism, seed: Some(5), ..AcceleratorConfig::default() }
}

/// How a training step runs its backward.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Backward {
    /// `loss.backward()` through `accelerator.backward`.
    Plain,
    /// A recorded forward and a segmented backward (`accelerator.pipeline_backward` at pp 1).
    Recorded,
}

/// Trains the tiny Llama STEPS AdamW steps at the layout `cfg` gives (global batch GLOBAL_BATCH, each dp rank
/// its contiguous slice) and returns the initial and the final full weights, checked equal on every rank.
fn train_llama(world: usize, cfg: AcceleratorConfig) -> (BTreeMap<String, Vec<f32>>, BTreeMap<String, Vec<f32>>) {
    train_llama_with(world, cfg, Backward::Plain, false)
}

fn train_llama_with(
    world: usize,
    cfg: AcceleratorConfig,
    backward: Backward,
    tied: bool,
) -> (BTreeMap<String, Vec<f32>>, BTreeMap<String, Vec<f32>>) {
    let results = run_ranks(world, cfg, move |acc| {
        let varmap = VarMap::new();
        let plan = if tied { tied_plan() } else { llama_plan() };
        let model = TinyLlama::with_head(acc.builder(&varmap, plan), tied)?;
        let prepared = acc.prepare_model(&varmap)?;
        let initial = to_f32_map(&prepared.state_dict()?);
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(0.02))?)?;
        let data = tokens(STEPS * GLOBAL_BATCH);
        let b = GLOBAL_BATCH / acc.data_parallel_size();
        for step in 0..STEPS {
            let rows = data.narrow(0, step * GLOBAL_BATCH + acc.data_parallel_rank() * b, b)?;
            let (ids, targets) = (rows.narrow(1, 0, SEQ)?, rows.narrow(1, 1, SEQ)?);
            match backward {
                Backward::Plain => acc.backward(&model.loss(&ids, &targets)?)?,
                Backward::Recorded => {
                    acc.pipeline_backward(&model, &ids, &targets, |logits, targets| {
                        Ok(model.loss_of(logits, targets)?)
                    })?;
                }
            }
            assert!(opt.step()?);
        }
        if backward == Backward::Recorded && prepared.is_fully_sharded() {
            // Every unit's weights but the first's were gathered ahead by the prefetch, in the forward and in the
            // backward's recomputation.
            assert!(prepared.prefetched_gathers() > 0, "FULL_SHARD units were never prefetched");
        }
        Ok((initial, to_f32_map(&prepared.state_dict()?)))
    });
    for (r, w) in results.iter().enumerate().skip(1) {
        assert_eq!(w.1, results[0].1, "rank {r}'s final weights differ from rank 0's");
    }
    results.into_iter().next().unwrap()
}

#[test]
fn a_model_on_the_builder_trains_at_every_layout_with_only_a_plan() {
    let (start, one) = train_llama(1, config(1, 1, 1, ShardingStrategy::default()));
    assert!(max_rel_diff(&one, &start) > 1e-2, "training must move the weights");
    let layouts = [
        ("dp 2", 2, config(2, 1, 1, ShardingStrategy::default())),
        ("tp 2", 2, config(1, 1, 2, ShardingStrategy::default())),
        ("dp 2 × tp 2", 4, config(2, 1, 2, ShardingStrategy::default())),
        ("ZeRO-1 over dp_shard 2", 2, config(1, 2, 1, ShardingStrategy::ShardOptim)),
        ("ZeRO-2 over dp_shard 2 × tp 2", 4, config(1, 2, 2, ShardingStrategy::ShardGradOp)),
        ("FULL_SHARD over dp_shard 2", 2, config(1, 2, 1, ShardingStrategy::FullShard)),
        ("HSDP: dp_replicate 2 × FULL_SHARD dp_shard 2", 4, config(2, 2, 1, ShardingStrategy::FullShard)),
        ("FULL_SHARD dp_shard 2 × tp 2", 4, config(1, 2, 2, ShardingStrategy::FullShard)),
    ];
    for (name, world, cfg) in layouts {
        let (init, end) = train_llama(world, cfg);
        // Every layout starts from the single-process weights, bit for bit (drawn on the full shapes by name).
        assert_eq!(init, start, "{name}: initial weights differ from one process's");
        let d = max_rel_diff(&end, &one);
        eprintln!("tiny Llama, {name}: max relative difference to one process {d:e}");
        assert!(d <= 1e-5, "{name}: max relative difference to one process {d:e}");
    }
}

/// A recorded forward and a segmented backward: FULL_SHARD's units gathered, freed, recomputed and prefetched by
/// the runtime, activation checkpointing's blocks recomputed — the same weights as one process.
#[test]
fn units_are_sharded_and_checkpointed_by_the_runtime() {
    let (_, one) = train_llama(1, config(1, 1, 1, ShardingStrategy::default()));
    let checkpointed =
        AcceleratorConfig { activation_checkpointing: true, ..config(1, 1, 1, ShardingStrategy::default()) };
    let full_shard = config(1, 2, 1, ShardingStrategy::FullShard);
    let full_shard_tp = config(1, 2, 2, ShardingStrategy::FullShard);
    for (name, world, cfg) in [
        ("one process, recorded", 1, config(1, 1, 1, ShardingStrategy::default())),
        ("activation checkpointing", 1, checkpointed),
        ("FULL_SHARD over dp_shard 2, recorded", 2, full_shard),
        ("FULL_SHARD dp_shard 2 × tp 2, recorded", 4, full_shard_tp),
    ] {
        let before = accel::activation_checkpoint::blocks_recomputed();
        let (_, end) = train_llama_with(world, cfg, Backward::Recorded, false);
        let d = max_rel_diff(&end, &one);
        eprintln!("tiny Llama, {name}: max relative difference to one process {d:e}");
        assert!(d <= 1e-5, "{name}: max relative difference to one process {d:e}");
        if world == 1 && name.contains("checkpointing") {
            // Every layer recomputed in each step's backward (the ranks of one process run on this thread).
            assert_eq!(accel::activation_checkpoint::blocks_recomputed() - before, (LAYERS * STEPS) as u64);
        }
    }
}

#[test]
fn the_plan_lays_out_each_parameter_and_reports_it() {
    let shapes = run_ranks(2, config(1, 1, 2, ShardingStrategy::default()), |acc| {
        let varmap = VarMap::new();
        let vb = acc.builder(&varmap, llama_plan());
        let model = TinyLlama::new(vb.clone())?;
        let report = vb.plan_report();
        let dims = |l: &Linear| l.weight().unwrap().dims().to_vec();
        let layer = model.model.blocks()[0].1;
        let (head, embed) = (model.model.output().unwrap(), model.model.input().unwrap());
        Ok((dims(&layer.q), dims(&layer.o), dims(&head.head), embed.embeddings()?.dims().to_vec(), report))
    });
    let (q, o, head, embed, report) = &shapes[0];
    assert_eq!(q, &[D_MODEL / 2, D_MODEL], "q_proj column-wise: half the output features");
    assert_eq!(o, &[D_MODEL, D_MODEL / 2], "o_proj row-wise: half the input features");
    assert_eq!(head, &[7, D_MODEL], "lm_head vocab-parallel: 13 padded to 14, 7 per rank");
    assert_eq!(embed, &[7, D_MODEL], "embed_tokens vocab-parallel");
    assert!(report.contains("parallel plan at tp size 2 (39 layers)"), "{report}");
    assert!(
        report.contains("layers.0.self_attn.q_proj.weight [16, 16] colwise from `layers.*.self_attn.q_proj` → [8, 16]"),
        "{report}"
    );
    assert!(report.contains("layers.0.input_layernorm.weight [16] replicate by default → [16]"), "{report}");
}

/// The same tiny MLP written with candle's own `VarBuilder` and `candle_nn::linear` (no accel types inside).
fn train_candle_way(world: usize, cfg: AcceleratorConfig) -> (BTreeMap<String, Vec<f32>>, BTreeMap<String, Vec<f32>>) {
    let results = run_ranks(world, cfg, |acc| {
        let varmap = VarMap::new();
        let model = TinyMlp::new(acc.var_builder(&varmap), IN, HIDDEN, OUT)?;
        let prepared = acc.prepare_model(&varmap)?;
        let initial = to_f32_map(&prepared.state_dict()?);
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(0.02))?)?;
        let (x, y) = dataset(STEPS * GLOBAL_BATCH, 3);
        let b = GLOBAL_BATCH / acc.world_size();
        for step in 0..STEPS {
            let start = step * GLOBAL_BATCH + acc.rank() * b;
            acc.backward(&loss(&acc, &model, &x.narrow(0, start, b)?, &y.narrow(0, start, b)?)?)?;
            assert!(opt.step()?);
        }
        Ok((initial, to_f32_map(&prepared.state_dict()?)))
    });
    results.into_iter().next().unwrap()
}

#[test]
fn a_model_written_the_candle_way_is_seeded_and_trains_under_ddp_and_zero() {
    let (start, one) = train_candle_way(1, config(1, 1, 1, ShardingStrategy::default()));
    // Seeded: the same weights in another run; another seed, other weights.
    let (again, _) = train_candle_way(1, config(1, 1, 1, ShardingStrategy::default()));
    assert_eq!(again, start, "the same seed must give the same initial weights");
    let other_seed = AcceleratorConfig { seed: Some(6), ..config(1, 1, 1, ShardingStrategy::default()) };
    assert_ne!(train_candle_way(1, other_seed).0, start);
    assert!(max_rel_diff(&one, &start) > 1e-2, "training must move the weights");
    for (name, cfg) in [
        ("DDP", config(2, 1, 1, ShardingStrategy::default())),
        ("ZeRO-1", config(1, 2, 1, ShardingStrategy::ShardOptim)),
        ("ZeRO-2", config(1, 2, 1, ShardingStrategy::ShardGradOp)),
    ] {
        let (init, end) = train_candle_way(2, cfg);
        assert_eq!(init, start, "{name}: initial weights");
        let d = max_rel_diff(&end, &one);
        assert!(d <= 1e-5, "{name}: max relative difference to one process {d:e}");
    }
}

#[test]
fn a_model_written_the_candle_way_is_refused_where_it_cannot_be_split() {
    for (what, cfg) in [
        ("tp_size 2", config(1, 1, 2, ShardingStrategy::default())),
        ("FULL_SHARD", config(1, 2, 1, ShardingStrategy::FullShard)),
        ("pp_size 2", pipelined(2, ScheduleKind::OneFOneB, None, config(1, 1, 1, ShardingStrategy::default()))),
    ] {
        let errors = run_ranks(2, cfg, |acc| {
            let varmap = VarMap::new();
            TinyMlp::new(acc.var_builder(&varmap), IN, HIDDEN, OUT)?;
            Ok(acc.prepare_model(&varmap).unwrap_err().to_string())
        });
        for err in errors {
            assert!(err.contains(&format!("cannot split or shard them for {what}")), "{what}: {err}");
            assert!(err.contains("accelerator.builder(&varmap, plan)"), "{what}: {err}");
        }
    }
    // A bare tensor from the plan's builder (a layer of the user's keeps it whole) cannot follow FULL_SHARD.
    let errors = run_ranks(2, config(1, 2, 1, ShardingStrategy::FullShard), |acc| {
        let varmap = VarMap::new();
        let vb = acc.builder(&varmap, ParallelPlan::new());
        nn::linear(4, 4, vb.pp("fc"))?;
        vb.get_with_hints(4, "scale", nn::Init::Const(1.0))?;
        Ok(acc.prepare_model(&varmap).unwrap_err().to_string())
    });
    assert!(
        errors[0].contains("under FULL_SHARD parameter(s) [\"scale\"] were taken with VarBuilder::get"),
        "{}",
        errors[0]
    );
    // A model on the builder at pp 2 that does not declare its blocks is told how to.
    let errors =
        run_ranks(2, pipelined(2, ScheduleKind::OneFOneB, None, config(1, 1, 1, ShardingStrategy::default())), |acc| {
            let varmap = VarMap::new();
            nn::linear(4, 4, acc.builder(&varmap, ParallelPlan::new()).pp("fc"))?;
            Ok(acc.prepare_model(&varmap).unwrap_err().to_string())
        });
    for err in errors {
        assert!(err.contains("did not ask which stages this rank holds") && err.contains("accel::nn::staged"), "{err}");
    }
}

pub(crate) fn pipelined(
    pp: usize,
    schedule: ScheduleKind,
    virtual_stages: Option<usize>,
    rest: AcceleratorConfig,
) -> AcceleratorConfig {
    let parallelism =
        ParallelismConfig { pp_size: pp, pp_schedule: schedule, pp_virtual_stages: virtual_stages, ..rest.parallelism };
    AcceleratorConfig { parallelism, ..rest }
}

/// The model declared as its blocks is cut into stages by the Accelerator — every schedule, with dp, tp,
/// ZeRO-2 and FULL_SHARD beside it, a tied head across the first and the last stage — and trains like one
/// process.
#[test]
fn the_accelerator_cuts_a_declared_model_into_pipeline_stages() {
    let plain = || config(1, 1, 1, ShardingStrategy::default());
    let (_, one) = train_llama(1, plain());
    let layouts = [
        ("pp 2, 1F1B", 2, pipelined(2, ScheduleKind::OneFOneB, None, plain())),
        ("pp 2, GPipe", 2, pipelined(2, ScheduleKind::GPipe, None, plain())),
        ("pp 2 × 2 virtual stages, interleaved 1F1B", 2, pipelined(2, ScheduleKind::Interleaved1F1B, Some(2), plain())),
        ("pp 2 × tp 2", 4, pipelined(2, ScheduleKind::OneFOneB, None, config(1, 1, 2, ShardingStrategy::default()))),
        ("pp 2 × dp 2", 4, pipelined(2, ScheduleKind::OneFOneB, None, config(2, 1, 1, ShardingStrategy::default()))),
        (
            "pp 2 × ZeRO-2 dp_shard 2",
            4,
            pipelined(2, ScheduleKind::OneFOneB, None, config(1, 2, 1, ShardingStrategy::ShardGradOp)),
        ),
        (
            "pp 2 × FULL_SHARD dp_shard 2",
            4,
            pipelined(2, ScheduleKind::OneFOneB, None, config(1, 2, 1, ShardingStrategy::FullShard)),
        ),
    ];
    for (name, world, cfg) in layouts {
        let (_, end) = train_llama_with(world, cfg, Backward::Recorded, false);
        let d = max_rel_diff(&end, &one);
        eprintln!("tiny Llama, {name}: max relative difference to one process {d:e}");
        assert!(d <= 1e-5, "{name}: max relative difference to one process {d:e}");
    }
    // A head tied to the embedding: the last stage holds its own copy, kept equal.
    let (start, one) = train_llama_with(1, plain(), Backward::Plain, true);
    assert!(!start.contains_key("lm_head.weight"));
    for (name, world, cfg) in [
        ("tied, pp 2", 2, pipelined(2, ScheduleKind::OneFOneB, None, plain())),
        (
            "tied, pp 2 × tp 2",
            4,
            pipelined(2, ScheduleKind::OneFOneB, None, config(1, 1, 2, ShardingStrategy::default())),
        ),
    ] {
        let (init, end) = train_llama_with(world, cfg, Backward::Recorded, true);
        assert_eq!(init, start, "{name}: initial weights");
        let d = max_rel_diff(&end, &one);
        eprintln!("tiny Llama, {name}: max relative difference to one process {d:e}");
        assert!(d <= 1e-5, "{name}: max relative difference to one process {d:e}");
    }
}

/// Each rank of a pipeline builds only its stages' parameters.
#[test]
fn each_pipeline_rank_builds_only_its_stages() {
    let names =
        run_ranks(2, pipelined(2, ScheduleKind::OneFOneB, None, config(1, 1, 1, ShardingStrategy::default())), |acc| {
            let varmap = VarMap::new();
            let model = TinyLlama::new(acc.builder(&varmap, llama_plan()))?;
            let err = model.forward(&tokens(1).narrow(1, 0, SEQ)?).unwrap_err().to_string();
            assert!(err.contains("not the whole model: run them with accelerator.pipeline_backward"), "{err}");
            let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
            names.sort();
            Ok(names)
        });
    let has = |r: usize, n: &str| names[r].iter().any(|x| x == n);
    assert!(
        has(0, "embed_tokens.weight")
            && has(0, "layers.1.mlp.up_proj.weight")
            && !has(0, "layers.2.mlp.up_proj.weight")
    );
    assert!(has(1, "lm_head.weight") && has(1, "layers.3.self_attn.q_proj.weight") && !has(1, "embed_tokens.weight"));
    assert!(!has(0, "lm_head.weight") && !has(1, "layers.0.mlp.up_proj.weight"));
}

/// Builds `f`'s layers at tp 2 (two ranks) and returns rank 0's error message.
fn tp2_error(f: impl Fn(VarBuilder) -> candle_core::Result<()> + Send + Sync + 'static, plan: ParallelPlan) -> String {
    run_ranks(2, config(1, 1, 2, ShardingStrategy::default()), move |acc| {
        let varmap = VarMap::new();
        Ok(f(acc.builder(&varmap, plan.clone())).unwrap_err().to_string())
    })
    .remove(0)
}

#[test]
fn plan_errors_name_the_layer_its_shape_and_what_fits() {
    // A linear no rule covers at tp > 1.
    let err =
        tp2_error(|vb| nn::linear(8, 6, vb.pp("layers").pp(3).pp("mlp").pp("fc1")).map(drop), ParallelPlan::new());
    assert!(
        err.contains("linear layer `layers.3.mlp.fc1` (weight [6, 8]) has no style in the plan at tp size 2")
            && err.contains("`layers.*.mlp.fc1: colwise`"),
        "{err}"
    );
    // A row-wise weight whose input features tp does not divide.
    let plan = ParallelPlan::new().with("down", ParallelStyle::Rowwise);
    let err = tp2_error(|vb| nn::linear(9, 4, vb.pp("down")).map(drop), plan);
    assert!(err.contains("linear `down` is rowwise (from `down`)"), "{err}");
    assert!(err.contains("`down.weight` of shape [4, 9] is split along dim 1, of size 9, which tp size 2"), "{err}");
    assert!(err.contains("tp sizes that divide 9: 1, 3, 9"), "{err}");
    // Heads the tp size does not divide.
    let err = tp2_error(|vb| vb.pp("attn").local_heads(3).map(drop), ParallelPlan::new());
    assert!(err.contains("3 attention heads under `attn`") && err.contains("tp sizes that fit: 1, 3"), "{err}");
    // A style that does not fit the layer.
    let plan = ParallelPlan::new().with("norm", ParallelStyle::Colwise);
    let err = tp2_error(|vb| nn::rms_norm(8, 1e-6, vb.pp("norm")).map(drop), plan);
    assert!(err.contains("norm `norm` (weight [8]) gets `colwise` from pattern `norm`"), "{err}");
    let plan = ParallelPlan::new().with("wte", ParallelStyle::Colwise);
    let err = tp2_error(|vb| nn::embedding(10, 8, vb.pp("wte")).map(drop), plan);
    assert!(err.contains("give it `vocab_parallel`"), "{err}");
    // Two rules disagreeing on a layer.
    let plan = ParallelPlan::new().with("h.*.fc", ParallelStyle::Colwise).with("h.0.fc", ParallelStyle::Rowwise);
    let err = tp2_error(|vb| nn::linear(8, 8, vb.pp("h").pp(0).pp("fc")).map(drop), plan);
    assert!(err.contains("`h.*.fc` (colwise) and `h.0.fc` (rowwise)"), "{err}");
    // A typo in a pattern shows at tp > 1 as the linear it missed, which names the patterns unmatched so far.
    let plan = ParallelPlan::new().with("fc_1", ParallelStyle::Colwise);
    let err = tp2_error(|vb| nn::linear(8, 8, vb.pp("fc1")).map(drop), plan);
    assert!(err.contains("`fc1` (weight [8, 8]) has no style"), "{err}");
    assert!(err.contains("the plan's patterns that matched no layer so far: `fc_1`"), "{err}");
}

#[test]
fn a_rule_that_matches_nothing_is_refused_when_the_model_is_prepared() {
    let errors = run_ranks(1, config(1, 1, 1, ShardingStrategy::default()), |acc| {
        let varmap = VarMap::new();
        let typo = llama_plan().with("layers.*.self_attn.qproj", ParallelStyle::Colwise);
        TinyLlama::new(acc.builder(&varmap, typo))?;
        Ok(acc.prepare_model(&varmap).unwrap_err().to_string())
    });
    let err = &errors[0];
    assert!(err.contains("pattern(s) `layers.*.self_attn.qproj` match no layer of the model"), "{err}");
    assert!(err.contains("layers.*.self_attn.q_proj"), "the layers it has are listed: {err}");
    // Each once, in build order, though every block has them.
    let listed = err.split("its layers are: ").nth(1).unwrap_or_default();
    assert_eq!(listed.matches("layers.*.self_attn.q_proj").count(), 1, "{err}");
    assert!(listed.starts_with("embed_tokens, layers.*.input_layernorm, layers.*.self_attn.q_proj"), "{err}");
}

#[test]
fn the_config_plan_replaces_the_model_default() {
    // Through the environment a launcher writes (JSON), as `accel launch` carries a YAML config's plan.
    let json = r#"{"mlp.up": "rowwise", "mlp.down": "colwise"}"#;
    let p = ParallelismConfig::default()
        .with_overrides_from(|k| (k == accel::parallelism::TP_PLAN_ENV).then(|| json.to_string()))
        .unwrap();
    let from_env = p.tp_plan.clone().unwrap();
    assert_eq!(from_env.style_of("mlp.up").unwrap().unwrap().1, ParallelStyle::Rowwise);
    // Carried on to the workers in the same form, read back to the same plan.
    let env = p.env_vars();
    let carried = env.iter().find(|(k, _)| k == accel::parallelism::TP_PLAN_ENV).expect("the plan is carried");
    assert_eq!(serde_json::from_str::<ParallelPlan>(&carried.1).unwrap(), from_env);
    let err = ParallelismConfig::default()
        .with_overrides_from(|k| (k == accel::parallelism::TP_PLAN_ENV).then(|| "{\"a\": \"sideways\"}".into()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("PARALLELISM_CONFIG_TP_PLAN") && err.contains("\"sideways\""), "{err}");
    // The config's plan wins over the one the program passes.
    let cfg = AcceleratorConfig {
        parallelism: ParallelismConfig { tp_size: 2, tp_plan: Some(from_env), ..ParallelismConfig::default() },
        ..AcceleratorConfig::default()
    };
    let styles = run_ranks(2, cfg, |acc| {
        let varmap = VarMap::new();
        let default =
            ParallelPlan::new().with("mlp.up", ParallelStyle::Colwise).with("mlp.down", ParallelStyle::Rowwise);
        let vb = acc.builder(&varmap, default).pp("mlp");
        Ok((nn::linear(8, 8, vb.pp("up"))?.style(), nn::linear(8, 8, vb.pp("down"))?.style()))
    });
    assert_eq!(styles[0], (ParallelStyle::Rowwise, ParallelStyle::Colwise));
}

#[test]
fn the_layers_are_candle_modules() {
    let varmap = VarMap::new();
    let tp = TensorParallel::new(ddp_core::ProcessGroup::single_process().unwrap());
    let vb = VarBuilder::new(&varmap, &tp, 3, DType::F32, &Device::Cpu, ParallelPlan::new());
    let seq = candle_nn::seq()
        .add(nn::linear(4, 8, vb.pp("l1")).unwrap())
        .add_fn(|x| x.relu())
        .add(nn::layer_norm(8, 1e-5, vb.pp("ln")).unwrap())
        .add(nn::linear(8, 2, vb.pp("l2")).unwrap());
    let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu).unwrap();
    let y = x.apply(&seq).unwrap();
    assert_eq!(y.dims(), &[3, 2]);
    // The same numbers as candle's own layers over the same weights.
    let data = varmap.data().lock().unwrap();
    let w = |n: &str| data[n].as_tensor().clone();
    let l1 = candle_nn::Linear::new(w("l1.weight"), Some(w("l1.bias")));
    let ln = candle_nn::LayerNorm::new(w("ln.weight"), w("ln.bias"), 1e-5);
    let l2 = candle_nn::Linear::new(w("l2.weight"), Some(w("l2.bias")));
    let want = l2.forward(&ln.forward(&l1.forward(&x).unwrap().relu().unwrap()).unwrap()).unwrap();
    let diff = (y - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff < 1e-5, "accel::nn vs candle_nn: {diff}");
    // candle-nn's initial distributions: a linear weight Kaiming-normal over 4 inputs (std √2/2), its bias
    // within ±1/√4.
    let b = w("l1.bias").to_vec1::<f32>().unwrap();
    assert!(b.iter().all(|v| v.abs() <= 0.5) && b.iter().any(|v| v.abs() > 0.05), "{b:?}");
    // Seeded per name: the same as the candle-way builder draws.
    let candle_vm = VarMap::new();
    candle_nn::linear(4, 8, accel::nn::seeded_var_builder(&candle_vm, 3, DType::F32, &Device::Cpu).pp("l1")).unwrap();
    let candle_w = candle_vm.data().lock().unwrap()["l1.weight"].as_tensor().flatten_all().unwrap().to_vec1::<f32>();
    assert_eq!(candle_w.unwrap(), w("l1.weight").flatten_all().unwrap().to_vec1::<f32>().unwrap());
}

/// Column-wise layers reading the same input one after another (attention's q, k and v) share one copy of it to
/// the tp group: its gradient is summed over the three, then all-reduced once (Megatron's single *f*), not once
/// per layer — and the input gradient is the single process's.
#[test]
fn column_wise_layers_reading_one_input_all_reduce_its_gradient_once() {
    let plan = ParallelPlan::new()
        .with("q", ParallelStyle::Colwise)
        .with("k", ParallelStyle::Colwise)
        .with("v", ParallelStyle::Colwise)
        .with("o", ParallelStyle::Rowwise);
    let run = |world: usize| {
        let plan = plan.clone();
        run_ranks(world, config(1, 1, world, ShardingStrategy::default()), move |acc| {
            let varmap = VarMap::new();
            let vb = acc.builder(&varmap, plan.clone());
            let (q, k, v) =
                (nn::linear(4, 8, vb.pp("q"))?, nn::linear(4, 8, vb.pp("k"))?, nn::linear(4, 8, vb.pp("v"))?);
            let o = nn::linear(8, 4, vb.pp("o"))?;
            let values: Vec<f32> = (0..12).map(|i| ((i * 7 % 5) as f32 - 2.0) / 3.0).collect();
            let input = candle_core::Var::from_tensor(&Tensor::from_vec(values, (3, 4), &Device::Cpu)?)?;
            let tp = acc.mesh().tp().clone();
            let before = tp.traffic().all_reduce.calls;
            let x = input.as_tensor();
            let y = o.forward(&((q.forward(x)? * k.forward(x)?)? + v.forward(x)?)?)?;
            let grads = y.sqr()?.sum_all()?.backward()?;
            let calls = tp.traffic().all_reduce.calls - before;
            Ok((calls, grads.get(x).expect("a gradient for the input").flatten_all()?.to_vec1::<f32>()?))
        })
    };
    let (_, want) = run(1).remove(0);
    for (rank, (calls, grad)) in run(2).into_iter().enumerate() {
        // One all-reduce for o's forward (the row-wise sum), one for the shared input copy's gradient.
        assert_eq!(calls, 2, "rank {rank}: all-reduces over the tp group");
        let diff = grad.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
        assert!(diff < 1e-5, "rank {rank}: the input gradient differs from one process's by {diff:e}");
    }
}

/// A builder given initial weights creates each parameter from them (this rank's slice), never from the seed: a
/// parameter they lack, or hold in another shape, fails the build by name.
#[test]
fn a_builder_with_weights_creates_every_parameter_from_them() {
    struct Weights(BTreeMap<String, Tensor>);
    impl nn::InitialWeights for Weights {
        fn full_tensor(&self, name: &str) -> accel::Result<Tensor> {
            let missing = || accel::AccelError::InvalidArgument(format!("the test's weights have no {name}"));
            self.0.get(name).cloned().ok_or_else(missing)
        }
    }
    let w: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let weight = Tensor::from_vec(w, (6, 4), &Device::Cpu).unwrap();
    let plan = || ParallelPlan::new().with("fc", ParallelStyle::Colwise);
    let results = run_ranks(2, config(1, 1, 2, ShardingStrategy::default()), move |acc| {
        let weights = std::sync::Arc::new(Weights(BTreeMap::from([("fc.weight".to_string(), weight.clone())])));
        let varmap = VarMap::new();
        let fc = nn::linear_no_bias(4, 6, acc.builder(&varmap, plan()).with_weights(weights.clone()).pp("fc"))?;
        let local = fc.weight()?.flatten_all()?.to_vec1::<f32>()?;
        let with_bias = nn::linear(4, 6, acc.builder(&VarMap::new(), plan()).with_weights(weights.clone()).pp("fc"));
        let wrong = std::sync::Arc::new(Weights(BTreeMap::from([(
            "fc.weight".to_string(),
            Tensor::zeros((4, 6), DType::F32, &Device::Cpu)?,
        )])));
        let reshaped = nn::linear_no_bias(4, 6, acc.builder(&VarMap::new(), plan()).with_weights(wrong).pp("fc"));
        Ok((local, with_bias.err().unwrap().to_string(), reshaped.err().unwrap().to_string()))
    });
    for (rank, (local, missing, reshaped)) in results.iter().enumerate() {
        // Column-wise: rank r keeps output rows 3r..3r+3 of the full [6, 4] weight.
        let want: Vec<f32> = (rank * 12..rank * 12 + 12).map(|i| i as f32).collect();
        assert_eq!(local, &want, "rank {rank}: not its slice of the given weight");
        assert!(missing.contains("the test's weights have no fc.bias"), "{missing}");
        assert!(
            reshaped.contains("hold `fc.weight` with shape [4, 6], but the model builds it with shape [6, 4]"),
            "{reshaped}"
        );
    }
}
