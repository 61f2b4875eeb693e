//! A model's shape read from its build (`accel::nn::describe`, `ModelSpec::of_model`): the automatic layout's
//! parameters per rank are what each rank of that layout then builds, tied or not, for a Llama and for an MLP that
//! is no transformer; describing allocates nothing (an 8-billion-parameter Llama is described on a machine of a
//! few GiB); what tp must divide is named; a model without blocks is kept on one pipeline stage.

use crate::plan::{config, pipelined};
use crate::ranks::run_ranks;
use accel::auto_layout::{choose, enumerate, ClusterSpec, Link, ModelSpec, Precision, TrainSpec};
use accel::models::llama::{Llama, LlamaConfig};
use accel::nn::{self, describe, Activation, ModelPart};
use accel::pipeline::ScheduleKind;
use accel::plan::{ParallelPlan, ParallelStyle};
use accel::ShardingStrategy;
use candle_nn::VarMap;

/// A Llama of 4 blocks, 4 query and 2 key/value heads, a vocabulary of 101 (padded under tp).
fn llama(tied: bool) -> LlamaConfig {
    LlamaConfig { tie_word_embeddings: tied, max_position_embeddings: 64, ..LlamaConfig::new(101, 32, 48, 4, 4, 2) }
}

/// Elements of the parameters a rank built.
fn built(varmap: &VarMap) -> u64 {
    varmap.all_vars().iter().map(|v| v.elem_count() as u64).sum()
}

#[test]
fn the_described_parameters_per_rank_are_what_each_rank_of_the_layout_builds() {
    for tied in [false, true] {
        let cfg = llama(tied);
        let spec = ModelSpec::of_model(Llama::plan(&cfg), 16, |vb| Llama::new(&cfg, vb)).unwrap();
        assert_eq!((spec.n_layer, spec.d_model, spec.n_head, spec.d_ff, spec.vocab), (4, 32, 4, 48, 101));
        assert_eq!(spec.tied_embeddings, tied);
        // (tp, pp): each rank's built parameters against the spec's count for its pp rank and blocks.
        for (tp, pp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
            let acc_cfg = pipelined(pp, ScheduleKind::OneFOneB, None, config(1, 1, tp, ShardingStrategy::default()));
            let c = cfg.clone();
            let counts = run_ranks(tp * pp, acc_cfg, move |acc| {
                let varmap = VarMap::new();
                let _model = Llama::new(&c, acc.builder(&varmap, Llama::plan(&c)))?;
                Ok((acc.mesh().pp().rank(), built(&varmap)))
            });
            for (pp_rank, got) in counts {
                let want = spec.params_on_rank(tp, pp, pp_rank, 4 / pp);
                assert_eq!(got, want, "tied {tied}, tp {tp} pp {pp}: pp rank {pp_rank} built {got}, spec {want}");
            }
        }
        // One process holds the single-process model.
        let whole = run_ranks(1, config(1, 1, 1, ShardingStrategy::default()), move |acc| {
            let varmap = VarMap::new();
            let _model = Llama::new(&cfg, acc.builder(&varmap, Llama::plan(&cfg)))?;
            Ok(built(&varmap))
        });
        assert_eq!(spec.total_params(), whole[0]);
    }
}

#[test]
fn the_described_shape_names_what_tp_must_divide() {
    let cfg = llama(false);
    let spec = ModelSpec::of_model(Llama::plan(&cfg), 16, |vb| Llama::new(&cfg, vb)).unwrap();
    // 2 key/value heads: tp 2 splits them, tp 4 does not (the vocabulary, padded, never constrains tp).
    assert!(spec.tp_fits(2));
    let misfit = spec.tp_misfit(4).expect("tp 4 does not split 2 key/value heads");
    let heads = "the heads split under `model.layers.*.self_attn` of 2";
    assert_eq!(misfit, format!("tp 4 does not divide {heads}"), "each size named once, not once per layer");
    // 48 MLP rows: tp 3 divides neither them nor the heads; the first sizes are named.
    let misfit = spec.tp_misfit(3).expect("tp 3");
    assert!(misfit.contains("model.layers.0.self_attn.q_proj.weight dim 0 of 32"), "{misfit}");
    assert!(misfit.contains("more"), "{misfit}");
}

#[test]
fn describing_allocates_nothing() {
    // Llama 3 8B's shape: 8 030 261 248 parameters, 32 GB in f32 — described, not built.
    let cfg = LlamaConfig { max_position_embeddings: 64, ..LlamaConfig::new(128_256, 4096, 14_336, 32, 32, 8) };
    let shape = describe(Llama::plan(&cfg), |vb| Llama::new(&cfg, vb)).unwrap();
    assert_eq!(shape.num_params(), 8_030_261_248);
    assert_eq!(shape.blocks.as_ref().map(Vec::len), Some(32));
    let attention = "model.layers.0.self_attn".to_string();
    assert_eq!(shape.heads[..2], [(attention.clone(), 32), (attention, 8)]);
    let q = shape.params.iter().find(|p| p.name == "model.layers.31.self_attn.q_proj.weight").unwrap();
    assert_eq!((q.part, q.split, q.matmul, q.copy), (ModelPart::Block(31), Some((0, false)), true, false));
    let embed = shape.params.iter().find(|p| p.name == "model.embed_tokens.weight").unwrap();
    assert_eq!((embed.part, embed.split, embed.matmul), (ModelPart::Input, Some((0, true)), false));
    let head = shape.params.iter().find(|p| p.name == "lm_head.weight").unwrap();
    assert_eq!((head.part, head.matmul), (ModelPart::Output, true));
}

/// An MLP on the builder, fc1 column-wise and fc2 row-wise: no blocks, no attention.
fn mlp_spec(hidden: usize) -> ModelSpec {
    let plan = ParallelPlan::new().with("fc1", ParallelStyle::Colwise).with("fc2", ParallelStyle::Rowwise);
    ModelSpec::of_model(plan, 1, |vb| {
        let fc1 = nn::linear(784, hidden, vb.pp("fc1"))?.with_activation(Activation::Relu);
        let fc2 = nn::linear(hidden, 10, vb.pp("fc2"))?;
        Ok::<_, candle_core::Error>(candle_nn::seq().add(fc1).add(fc2))
    })
    .unwrap()
}

#[test]
fn a_model_without_blocks_is_laid_out_on_one_pipeline_stage() {
    let spec = mlp_spec(256);
    assert_eq!((spec.n_layer, spec.n_head, spec.d_model, spec.d_ff), (1, 0, 784, 256));
    assert!(!spec.has_stages());
    assert_eq!(spec.total_params(), 784 * 256 + 256 + 256 * 10 + 10);
    // tp 2: fc1's weight and bias and fc2's weight split, fc2's bias whole.
    assert_eq!(spec.params_on_rank(2, 1, 0, 1), (784 * 256 + 256 + 256 * 10) / 2 + 10);
    // FLOPs: 2 per weight element per sample, no attention term.
    assert_eq!(spec.block_forward_flops_per_token(1), 2.0 * (784.0 * 256.0 + 2560.0));
    // Kept for the backward, per sample: fc1's input and output, fc2's input and output, f32.
    assert_eq!(spec.block_activation_bytes(1, 1, 4), 4 * (784 + 256 + 256 + 10));
    assert_eq!(
        spec.tp_misfit(3).unwrap(),
        "tp 3 does not divide fc1.weight dim 0 of 256, fc1.bias dim 0 of 256, fc2.weight dim 1 of 256"
    );

    // Four processes: every pp > 1 is ruled out, naming why; a layout is chosen among the rest.
    let link = Link::new(5e-6, 10e9);
    let cluster = ClusterSpec::uniform(1, 4, 1 << 30, 50e9, link, link);
    let train = TrainSpec::new(32, &[8, 16, 32], Precision::Fp32);
    let (_, rejected) = enumerate(&spec, 4, &train);
    let lines = rejected.lines().join("\n");
    assert!(lines.contains("pp 2: the model is not declared as blocks (accel::nn::staged)"), "{lines}");
    let choice = choose(&spec, &cluster, &train, &Default::default()).unwrap();
    assert_eq!(choice.best.layout.pp, 1);
}
