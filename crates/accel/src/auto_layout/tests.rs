//! The cost model against hand-computed numbers and published formulas, the pipeline terms against the schedule
//! simulator, and the chooser on small clusters whose right answer is known: tp inside a machine when it is fast,
//! no tp when links are slow everywhere, FULL_SHARD when the model does not fit whole, fewer layers on a smaller
//! machine, the smallest memory that would fit when nothing does, and the same answer whatever the input order.

use super::*;
use crate::pipeline::{simulate, Costs, PipelineSchedule, ScheduleKind};
use crate::sharding::ShardingStrategy::{self, FullShard, NoShard, ShardGradOp, ShardOptim};

/// The examples' char-GPT (`GptConfig::small(76)`): 820 992 parameters.
/// The char-GPT with Korthikanti's tensors only (accel's autograd extras left out, so the hand-computed bytes
/// below stay those of the published formula; the extras are tested in `activations_follow_…`).
fn char_gpt() -> ModelSpec {
    let formula_only = ActivationSpec {
        extra_h: 0,
        extra_h_split: 0,
        extra_f: 0,
        tp_extra_h: 0,
        recomputed_blocks_live: 1,
        ..ActivationSpec::accel(false, 4)
    };
    ModelSpec::gpt(4, 128, 4, 512, 76, 64).with_activations(formula_only)
}

/// A 167 M-parameter GPT: 2.67 GB of fp32 AdamW state, more than the 2 GiB processes below hold.
fn mid_gpt() -> ModelSpec {
    ModelSpec::gpt(8, 1024, 16, 4096, 32000, 512)
}

fn no_overhead() -> Assumptions {
    // The hand-computed figures below use a 10 % margin (the default is 20 %).
    Assumptions { runtime_overhead_bytes: 0, memory_margin: 0.1, ..Assumptions::default() }
}

/// A pp 1 layout.
fn flat(rep: usize, shard: usize, tp: usize, sharding: ShardingStrategy, b: usize, k: usize) -> Layout {
    Layout {
        dp_replicate: rep,
        dp_shard: shard,
        tp,
        pp: 1,
        sharding,
        schedule: None,
        virtual_stages: 1,
        microbatches: 1,
        accumulation_steps: k,
        micro_batch_size: b,
        activation_checkpointing: false,
        layers_per_stage: None,
    }
}

fn one_machine(processes: usize, memory: u64, link: Link) -> ClusterSpec {
    ClusterSpec::uniform(1, processes, memory, 1e10, link, link)
}

#[test]
fn the_char_gpt_has_the_examples_parameter_count_and_splits_as_megatron() {
    let m = char_gpt();
    assert_eq!(m.total_params(), 820_992, "GptConfig::small(76).num_parameters()");
    // 4h² + 2hf + 9h + f with h 128, f 512.
    assert_eq!(m.block_params(), 198_272);
    // tp 2: (4h² + 2hf + 3h + f) / 2 split, 6h of norms and row-parallel biases replicated.
    assert_eq!(m.block_params_per_rank(2), (198_272 - 768) / 2 + 768);
    // ⌈76/2⌉ rows of the token embedding + the replicated 64 × 128 positions.
    assert_eq!(m.embedding_params_per_rank(2), 38 * 128 + 64 * 128);
    assert_eq!(m.head_params_per_rank(2, 1), 256 + 38 * 128);
    let tied = char_gpt().with_tied_embeddings(true);
    assert_eq!(tied.total_params(), 820_992 - 76 * 128);
    assert_eq!(tied.head_params_per_rank(1, 1), 256, "at pp 1 the head reads the embedding");
    assert_eq!(tied.head_params_per_rank(1, 2), 256 + 76 * 128, "at pp 2 the last stage holds a copy");
    // Every rank's share adds up to the model at pp 4 (one block each).
    let per_rank: u64 = (0..4).map(|r| m.params_on_rank(1, 4, r, 1)).sum();
    assert_eq!(per_rank, 820_992);
    assert!(m.tp_fits(4) && !m.tp_fits(3) && !m.tp_fits(8), "tp divides n_head 4, d_model and d_ff");

    let raw = char_gpt().with_total_params(1_000_003).unwrap();
    assert_eq!(raw.total_params(), 1_000_003);
    let e = char_gpt().with_total_params(10_000).unwrap_err().to_string();
    assert!(e.contains("10000 parameters are too few"), "{e}");
}

#[test]
fn state_bytes_follow_zero_and_accel() {
    let paper = StateBytes::zero_paper(Precision::Bf16, OptimizerKind::AdamW);
    assert_eq!((paper.param, paper.grad, paper.optimizer, paper.activation), (2, 2, 12, 2), "ZeRO §3.1: K = 12");
    let fp32 = StateBytes::zero_paper(Precision::Fp32, OptimizerKind::AdamW);
    assert_eq!((fp32.param, fp32.grad, fp32.optimizer), (4, 4, 8));
    // accel: fp32 gradient slots; bf16 on the CPU is autocast over f32 (no masters); fp16 keeps fp32 masters.
    let cpu_bf16 = StateBytes::accel(Precision::Bf16, OptimizerKind::AdamW, true);
    assert_eq!((cpu_bf16.param, cpu_bf16.grad, cpu_bf16.optimizer, cpu_bf16.activation), (4, 4, 8, 4));
    let gpu_fp16 = StateBytes::accel(Precision::Fp16, OptimizerKind::AdamW, false);
    assert_eq!((gpu_fp16.param, gpu_fp16.grad, gpu_fp16.optimizer, gpu_fp16.activation), (2, 4, 12, 2));
    let sgd = TrainSpec::new(8, &[1], Precision::Fp32).with_optimizer(OptimizerKind::SgdMomentum);
    assert_eq!(sgd.bytes.optimizer, 4);
}

/// The char-GPT on 2 processes, b 4, one micro-batch, fp32 AdamW (4 + 4 + 8 bytes), 1 MB of overhead: every term of
/// every stage, computed by hand.
#[test]
fn memory_per_sharding_stage_matches_hand_computed_bytes() {
    let model = char_gpt();
    let cluster = one_machine(2, 1 << 40, Link::new(0.0, 1e9));
    let train = TrainSpec::new(8, &[4], Precision::Fp32);
    let a = Assumptions { runtime_overhead_bytes: 1_000_000, ..Assumptions::default() };
    let memory = |layout: Layout| evaluate(&model, &cluster, &train, &a, &layout).unwrap().ranks[0].memory;

    const PSI: u64 = 820_992;
    const HALF: u64 = PSI / 2; // ⌈Ψ/2⌉ = 410 496
                               // Activations per micro-batch of 4 × 64 tokens, f32, no dropout, fused attention (no s² term):
                               // a block keeps 4·(4h + 4h + 2f) = 8 192 bytes per token → 2 097 152; 4 blocks 8 388 608; the embedding's
                               // output 256·128·4 = 131 072; the head's two inputs and the logits + f32 probabilities 256·(1 024 + 76·8) =
                               // 417 792.
    const ACTIVATIONS: u64 = 8_388_608 + 131_072 + 417_792;
    assert_eq!(ACTIVATIONS, 8_937_472);

    let ddp = memory(flat(2, 1, 1, NoShard, 4, 1));
    let want = MemoryBreakdown {
        params: 4 * PSI,
        grads: 4 * PSI,
        optimizer: 8 * PSI,
        gathered: 0,
        grad_buffer: 0, // one fp32 micro-batch: the backward's gradients become the slots
        activations: ACTIVATIONS,
        overhead: 1_000_000,
    };
    assert_eq!(ddp, want);
    assert_eq!(ddp.total(), 23_073_344);

    let zero1 = memory(flat(1, 2, 1, ShardOptim, 4, 1));
    // The gradients packed into the flat buffer of the reduce-scatter: at 2 ranks in fp32 that copy costs what
    // halving the moments saves (as measured: ZeRO-1's peak sits at DDP's).
    assert_eq!(zero1, MemoryBreakdown { optimizer: 8 * HALF, grad_buffer: 4 * PSI, ..want });
    assert_eq!(zero1.total(), 23_073_344);

    let zero2 = memory(flat(1, 2, 1, ShardGradOp, 4, 1));
    // The whole micro-batch gradient exists before its reduce-scatter, and its packed copy.
    assert_eq!(zero2, MemoryBreakdown { grads: 4 * HALF, optimizer: 8 * HALF, grad_buffer: 8 * PSI, ..want });
    assert_eq!(zero2.total(), 24_715_328);

    let zero3 = memory(flat(1, 2, 1, FullShard, 4, 1));
    // One block (198 272) gathered with the embeddings (17 920) and the head (9 984), plus the block's gradient —
    // less than the whole model accel draws in fp32 before sharding it, which bounds the term; units recomputed:
    // each block keeps its input (131 072), one block is whole while recomputed.
    let one_unit = (198_272 + 17_920 + 9_984) * 4 + 198_272 * 4;
    let gathered = 4 * PSI;
    let activations = 4 * 131_072 + 131_072 + 417_792 + 2_097_152;
    assert_eq!((one_unit, gathered, activations), (1_697_792, 3_283_968, 3_170_304));
    assert_eq!(
        zero3,
        MemoryBreakdown {
            params: 4 * HALF,
            grads: 4 * HALF,
            optimizer: 8 * HALF,
            gathered,
            grad_buffer: 0,
            activations,
            overhead: 1_000_000,
        }
    );
    assert_eq!(zero3.total(), 14_022_208);

    // Accumulating 2 micro-batches under DDP: the second's gradients are added to the slots.
    let train2 = TrainSpec::new(16, &[4], Precision::Fp32);
    let c = evaluate(&model, &cluster, &train2, &a, &flat(2, 1, 1, NoShard, 4, 2)).unwrap();
    assert_eq!(c.ranks[0].memory.grad_buffer, 4 * PSI);
}

/// ZeRO's Figure 1: Ψ = 7.5 B, mixed-precision Adam (K = 12), N = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
#[test]
fn resting_memory_reproduces_the_zero_papers_figure_1() {
    let model = ModelSpec::gpt(32, 4096, 32, 16384, 50_000, 2048).with_total_params(7_500_000_000).unwrap();
    let cluster = ClusterSpec::uniform(8, 8, 1 << 50, 1e14, Link::new(1e-6, 1e11), Link::new(1e-5, 1e10));
    let train = TrainSpec::new(64, &[1], Precision::Bf16);
    let a = no_overhead();
    let resting = |rep, shard, sharding| {
        evaluate(&model, &cluster, &train, &a, &flat(rep, shard, 1, sharding, 1, 1)).unwrap().ranks[0].memory.resting()
    };
    assert_eq!(resting(64, 1, NoShard), 120_000_000_000);
    assert_eq!(resting(1, 64, ShardOptim), 30_000_000_000 + 1_406_250_000);
    assert_eq!(resting(1, 64, ShardGradOp), 15_000_000_000 + 1_640_625_000);
    assert_eq!(resting(1, 64, FullShard), 1_875_000_000);
}

/// Korthikanti et al. 2022, eq. 1 and 2: `s·b·h·(34 + 5·a·s/h)` bytes per block in 16-bit, `s·b·h·(10 + 24/t +
/// 5·a·s/(h·t))` under tp.
#[test]
fn activations_follow_korthikanti_and_our_f32_case() {
    let (h, a, s) = (1024u64, 16u64, 2048u64);
    let m = ModelSpec::gpt(24, h as usize, a as usize, 4 * h as usize, 50_000, s as usize)
        .with_activations(ActivationSpec::korthikanti());
    for b in [1u64, 4] {
        assert_eq!(m.block_activation_bytes(b as usize, 1, 2), s * b * h * 34 + 5 * a * s * s * b);
        for t in [2u64, 4, 8] {
            assert_eq!(
                m.block_activation_bytes(b as usize, t as usize, 2),
                s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t,
                "b {b} t {t}"
            );
        }
    }
    assert_eq!(m.checkpointed_block_bytes(1, 2), 2 * s * h, "full recomputation keeps 2·s·b·h per block");
    // accel's fused f32 ops keep no s² tensor: 4·(4h + (4h + 2f)/t) per token, and candle's autograd keeps
    // 4·(2h + (6h + f)/t) more (the biased linears' products before the bias, the heads' q, k, v).
    let ours = ModelSpec::gpt(24, h as usize, a as usize, 4 * h as usize, 50_000, s as usize);
    // Under tp, 4·8h more (the tp regions' copies and partial sums).
    assert_eq!(
        ours.block_activation_bytes(1, 2, 4),
        s * 4 * (4 * h + 12 * h / 2) + s * 4 * (2 * h + 10 * h / 2) + s * 4 * 8 * h
    );
    let dropout = ours.clone().with_activations(ActivationSpec::accel(true, 4));
    assert_eq!(dropout.block_activation_bytes(1, 1, 4), s * (4 * 16 * h + 4 * (2 * h + 4 * h)) + s * 4 * 12 * h);
}

/// The closed forms of the bubble and of the micro-batches in flight against the schedule simulator, on every
/// rank of every schedule.
#[test]
fn bubble_and_in_flight_micro_batches_agree_with_the_simulator() {
    assert_eq!(bubble_fraction(2, 4, 1), 0.2);
    assert_eq!(bubble_fraction(4, 8, 1), 3.0 / 11.0);
    assert_eq!(bubble_fraction(2, 4, 2), 1.0 / 9.0);
    assert_eq!(bubble_fraction(1, 4, 1), 0.0);
    let shapes = [
        (ScheduleKind::GPipe, 2, 4, 1),
        (ScheduleKind::GPipe, 4, 6, 1),
        (ScheduleKind::OneFOneB, 2, 2, 1),
        (ScheduleKind::OneFOneB, 4, 8, 1),
        (ScheduleKind::OneFOneB, 3, 7, 1),
        (ScheduleKind::Interleaved1F1B, 2, 4, 2),
        (ScheduleKind::Interleaved1F1B, 2, 8, 3),
        (ScheduleKind::Interleaved1F1B, 4, 8, 2),
        (ScheduleKind::Interleaved1F1B, 4, 16, 2),
    ];
    for (kind, pp, m, v) in shapes {
        let report = simulate(&PipelineSchedule::new(kind, pp, m, v).unwrap(), Costs::default()).unwrap();
        for r in 0..pp {
            assert!((report.bubble[r] - bubble_fraction(pp, m, v)).abs() < 1e-9, "{kind} pp {pp} m {m} v {v} r {r}");
            assert_eq!(
                report.peak_in_flight[r],
                in_flight_chunks(Some(kind), pp, r, m, v),
                "{kind} {pp} {m} {v} r {r}"
            );
        }
    }
}

#[test]
fn ring_collectives_and_the_zero_communication_volumes() {
    let link = Link::new(1e-5, 1e9);
    assert!((all_reduce_time(4, 1e6, &link) - (6.0 * 1e-5 + 1.5e-3)).abs() < 1e-15);
    assert!((reduce_scatter_time(4, 1e6, &link) - (3.0 * 1e-5 + 0.75e-3)).abs() < 1e-15);
    assert_eq!(all_gather_time(4, 1e6, &link), reduce_scatter_time(4, 1e6, &link));
    assert_eq!(all_reduce_time(1, 1e6, &link), 0.0);
    assert!((send_time(1e6, &link) - 1.01e-3).abs() < 1e-15);

    // Bandwidth only (α = 0), 2 ranks, 4 micro-batches of 2: ZeRO-1 moves DDP's 2Ψ, ZeRO-2 (k + 1)Ψ = 5Ψ,
    // FULL_SHARD 3Ψ per micro-batch = 12Ψ.
    let model = char_gpt();
    let cluster = one_machine(2, 1 << 40, Link::new(0.0, 1e9));
    let train = TrainSpec::new(16, &[2], Precision::Fp32);
    let a = no_overhead();
    let dp = |l: Layout| evaluate(&model, &cluster, &train, &a, &l).unwrap().time.dp_comm;
    let ddp = dp(flat(2, 1, 1, NoShard, 2, 4));
    assert!((ddp - 2.0 * 0.5 * 820_992.0 * 4.0 / 1e9).abs() < 1e-12, "2(n − 1)/n · Ψ · 4 bytes / β");
    for (sharding, ratio) in [(ShardOptim, 1.0), (ShardGradOp, 2.5), (FullShard, 6.0)] {
        let r = dp(flat(1, 2, 1, sharding, 2, 4)) / ddp;
        assert!((r - ratio).abs() < 1e-9, "{sharding}: {r}");
    }
}

/// One process: 3 forwards' worth of FLOPs per step (6 per parameter per token plus attention), 4 with
/// recomputation.
#[test]
fn compute_counts_six_flops_per_parameter_per_token() {
    let model = char_gpt();
    let cluster = one_machine(1, 1 << 40, Link::new(0.0, 1e9));
    let train = TrainSpec::new(4, &[4], Precision::Fp32);
    let a = no_overhead();
    // Forward per token: 4 blocks × (2 · 196 608 matrix parameters + 4·s·h = 32 768) + the head's 2·h·V = 19 456.
    let per_token = 4.0 * (2.0 * 196_608.0 + 32_768.0) + 19_456.0;
    assert_eq!(per_token, 1_723_392.0);
    let plain = evaluate(&model, &cluster, &train, &a, &flat(1, 1, 1, NoShard, 4, 1)).unwrap().time;
    assert!((plain.compute - 3.0 * 256.0 * per_token / 1e10).abs() < 1e-15);
    assert_eq!((plain.tp_comm, plain.pp_comm, plain.dp_comm, plain.bubble), (0.0, 0.0, 0.0, 0.0));
    assert_eq!(plain.total, plain.compute);
    let checkpointed = Layout { activation_checkpointing: true, ..flat(1, 1, 1, NoShard, 4, 1) };
    let recomputing = evaluate(&model, &cluster, &train, &a, &checkpointed).unwrap().time;
    assert!((recomputing.compute / plain.compute - 4.0 / 3.0).abs() < 1e-12);
}

/// 2 machines × 2 processes: the mesh's tp-innermost order keeps tp 2 inside a machine, tp 4 crosses; dp groups
/// across machines share each machine's link.
#[test]
fn placement_follows_the_mesh_order_over_the_machines() {
    let cluster = ClusterSpec::uniform(2, 2, 1 << 30, 1e12, Link::new(1e-6, 50e9), Link::new(2e-5, 2e9));
    let tp2 = Placement::new(&cluster, &flat(2, 1, 2, NoShard, 1, 1));
    assert_eq!(tp2.worst(GroupKind::Tp).class, LinkClass::Intra);
    let dp = tp2.worst(GroupKind::Dp);
    assert_eq!((dp.class, dp.share, dp.link.beta), (LinkClass::Inter, 2, 1e9), "groups {{0, 2}} and {{1, 3}}");
    let tp4 = Placement::new(&cluster, &flat(1, 1, 4, NoShard, 1, 1));
    let t = tp4.worst(GroupKind::Tp);
    assert_eq!((t.class, t.share, t.link.beta, t.link.alpha), (LinkClass::Inter, 1, 2e9, 2e-5));
    let dp4 = Placement::new(&cluster, &flat(4, 1, 1, NoShard, 1, 1));
    assert_eq!(dp4.worst(GroupKind::Dp).class, LinkClass::Inter);
    assert_eq!(dp4.worst(GroupKind::Tp).class, LinkClass::Local);
    // pp 2 × tp 2: pp rank 0 on machine 0, pp rank 1 on machine 1.
    let pp = Layout { pp: 2, dp_replicate: 1, schedule: Some(ScheduleKind::OneFOneB), ..flat(1, 1, 2, NoShard, 1, 1) };
    let placed = Placement::new(&cluster, &pp);
    assert_eq!((placed.machines_of(0), placed.machines_of(1)), (vec![0], vec![1]));
    assert_eq!(placed.link(GroupKind::PpNext, 0).share, 2, "both tp ranks send across at once");
    assert_eq!(placed.rank(1, 0, 0, 1), 3);
    // Machines with different links: a group runs at its machine's; the layout's tp at the slowest machine's.
    let mut mixed = cluster.clone();
    mixed.machines[1].intra = Link::new(5e-6, 5e9);
    let tp2 = Placement::new(&mixed, &flat(2, 1, 2, NoShard, 1, 1));
    assert_eq!(tp2.worst(GroupKind::Tp).link, Link::new(5e-6, 5e9));
    let pp2 = Placement::new(&mixed, &Layout { dp_replicate: 2, tp: 1, ..pp });
    assert_eq!((pp2.link(GroupKind::Dp, 0).link.beta, pp2.link(GroupKind::Dp, 1).link.beta), (50e9, 5e9));
}

/// The 4-process cluster of the two tests below, and a 167 M-parameter model that does not fit one 2 GiB
/// process whole; the program trains with DDP (no sharding), so it needs tp or pp.
fn needs_tp_or_pp(intra: Link) -> (ModelSpec, ClusterSpec, TrainSpec) {
    let slow = Link::new(20e-6, 2e9);
    let cluster = ClusterSpec::uniform(2, 2, 2 << 30, 1e13, intra, slow);
    let train = TrainSpec::new(4, &[1], Precision::Fp32).with_strategies(&[NoShard]);
    (mid_gpt(), cluster, train)
}

#[test]
fn a_fast_machine_link_gets_tp_inside_the_machine_and_pp_across() {
    let (model, cluster, train) = needs_tp_or_pp(Link::new(1e-6, 50e9));
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    let best = &choice.best;
    assert_eq!((best.layout.tp, best.layout.pp, best.layout.dp()), (2, 2, 1), "{choice}");
    let tp = best.groups.iter().find(|g| g.kind == GroupKind::Tp).unwrap();
    assert_eq!(tp.link.class, LinkClass::Intra);
    let pp = best.groups.iter().find(|g| g.kind == GroupKind::PpNext).unwrap();
    assert_eq!(pp.link.class, LinkClass::Inter);
    // tp 4 would cross machines: it fits, and is slower.
    let tp4 = evaluate(&model, &cluster, &train, &no_overhead(), &flat(1, 1, 4, NoShard, 1, 4)).unwrap();
    assert!(tp4.fits() && tp4.time.total > best.time.total, "{:?} vs {:?}", tp4.time, best.time);
    // DDP over 4 does not fit: 16 bytes × 167 M parameters.
    let ddp = evaluate(&model, &cluster, &train, &no_overhead(), &flat(4, 1, 1, NoShard, 1, 1)).unwrap();
    assert!(!ddp.fits());
    // The printed why: the links, the choice with its step by part, its groups, each pp rank's memory, the
    // runners-up.
    let text = choice.to_string();
    for part in [
        "links: within a machine α 1.0 µs, β 50.0 GB/s; across machines α 20.0 µs, β 2.0 GB/s per machine",
        "chosen: dp_replicate 1 × dp_shard 1 × tp 2 × pp 2 (1F1B, 4 micro-batches), micro-batch 1",
        "groups: tp 2 within a machine (α 1.0 µs, β 50.0 GB/s); pp 2 sends across machines (α 20.0 µs, β 1.0 GB/s, \
         a machine's link shared by 2 groups)",
        "memory, pp rank 0 (machine 0, ",
        "memory, pp rank 1 (machine 1, ",
        "runners-up (the fastest fitting layout of each other shape):",
    ] {
        assert!(text.contains(part), "{part}\n{text}");
    }
    assert!(text.contains(&format!("  step {} per optimizer step", best.time)), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("%), peak")).count(), choice.runners_up.len(), "{text}");
}

#[test]
fn slow_links_everywhere_prefer_pipeline_stages_over_tp() {
    let (model, cluster, train) = needs_tp_or_pp(Link::new(20e-6, 2e9));
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    assert_eq!(choice.best.layout.tp, 1, "{choice}");
    assert_eq!(choice.best.layout.pp, 4, "{choice}");
    // The best layout with tp is a runner-up, slower by its all-reduces.
    let with_tp = choice.runners_up.iter().find(|c| c.layout.tp > 1).expect("a tp runner-up");
    assert!(with_tp.time.tp_comm > choice.best.time.total - choice.best.time.compute, "{choice}");
}

/// 4 processes of one machine, the program has neither tp nor pp: DDP, ZeRO-1 and ZeRO-2 do not fit 2 GiB,
/// FULL_SHARD over 2 does not either (8Ψ of state and the 4Ψ drawn before sharding), FULL_SHARD over 4 does.
#[test]
fn a_model_too_large_for_one_process_is_fully_sharded() {
    let model = mid_gpt();
    let cluster = one_machine(4, 1 << 31, Link::new(1e-6, 20e9));
    let train = TrainSpec::new(8, &[1, 2], Precision::Fp32).with_parallel_forms(false, false);
    let a = no_overhead();
    let choice = choose(&model, &cluster, &train, &a).unwrap();
    let l = &choice.best.layout;
    assert_eq!((l.dp_shard, l.sharding, l.tp, l.pp), (4, FullShard, 1, 1), "{choice}");
    for (rep, shard, sharding) in [(4, 1, NoShard), (1, 4, ShardOptim), (1, 4, ShardGradOp), (2, 2, FullShard)] {
        let c = evaluate(&model, &cluster, &train, &a, &flat(rep, shard, 1, sharding, 1, 2)).unwrap();
        assert!(!c.fits(), "{} fits: {}", c.layout, c.ranks[0].memory);
    }
    assert!(choice.to_string().contains("dp_shard 4 (FULL_SHARD)"), "{choice}");
}

/// Two machines of one process, of `big` and `small` bytes. The program trains with DDP (no sharding, no tp), so
/// only pipeline stages split the model.
fn uneven(big: u64, small: u64) -> (ModelSpec, ClusterSpec, TrainSpec) {
    let link = Link::new(20e-6, 2e9);
    let big = Machine {
        processes: 1,
        memory_per_process: big,
        flops_per_process: 1e13,
        intra: link,
        op_latency: 0.0,
        sync_latency: 0.0,
        memory_bandwidth: f64::INFINITY,
    };
    let small = Machine { memory_per_process: small, ..big };
    let cluster = ClusterSpec { machines: vec![big, small], inter: link };
    let train = TrainSpec::new(8, &[1], Precision::Fp32).with_strategies(&[NoShard]).with_parallel_forms(false, true);
    (mid_gpt(), cluster, train)
}

#[test]
fn an_uneven_cluster_gives_the_smaller_machines_stage_fewer_layers() {
    // 4 GiB and 1.5 GiB: the whole model's state (2.67 GB) fits the two together, the even split [4, 4] does not
    // fit the small one.
    let (model, cluster, train) = uneven(4 << 30, 3 << 29);
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    let best = &choice.best;
    let list = best.layout.layers_per_stage.clone().expect("an uneven split");
    assert_eq!(best.layout.pp, 2, "{choice}");
    assert!(list[1] < list[0] && list.iter().sum::<usize>() == 8, "{list:?}");
    let even = best.even_split.as_ref().unwrap();
    assert_eq!(even.layers, vec![4, 4]);
    assert!(!even.fits && even.tightest.0 == 1, "the even split overflows the small machine: {even:?}");
    assert!(best.ranks[1].fits() && best.ranks[1].usable < best.ranks[0].usable);
    // One block more on the small machine would not fit.
    let mut tighter = list.clone();
    tighter[0] -= 1;
    tighter[1] += 1;
    let more = Layout { layers_per_stage: Some(tighter), ..best.layout.clone() };
    assert!(!evaluate(&model, &cluster, &train, &no_overhead(), &more).unwrap().ranks[1].fits());
    let note = choice.notes.join("\n");
    assert!(note.contains("fewer where memory is smaller") && note.contains("the even split [4, 4] needs"), "{note}");
    assert_eq!(best.layout.parallelism_config().pp_size, 2);
}

/// Equal memory, one machine twice as fast: its stage takes more blocks.
#[test]
fn a_faster_machines_stage_takes_more_layers() {
    let (model, mut cluster, train) = uneven(3 << 30, 3 << 30);
    cluster.machines[0].flops_per_process = 2e13;
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    let list = choice.best.layout.layers_per_stage.clone().expect("an uneven split");
    assert!(list[0] > list[1] + 2, "{choice}");
    let even = choice.best.even_split.as_ref().unwrap();
    assert!(even.step > choice.best.time.total, "{even:?}");
    let note = choice.notes.join("\n");
    assert!(note.contains("split by their predicted time") && note.contains("machines differ in compute"), "{note}");
}

#[test]
fn an_uneven_cluster_without_stages_says_why_the_layout_is_uniform() {
    // 6 GiB and 3 GiB: DDP's 16 bytes per parameter do not fit the small machine, FULL_SHARD over both does.
    let (model, cluster, train) = uneven(6 << 30, 3 << 30);
    let train = train.with_parallel_forms(false, false).with_strategies(&[NoShard, FullShard]);
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    assert_eq!((choice.best.layout.dp_shard, choice.best.layout.sharding), (2, FullShard), "{choice}");
    let note = choice.notes.join("\n");
    assert!(note.contains("the layout is uniform") && note.contains("the program has no pipeline stages"), "{note}");
    assert!(note.contains("the tightest is pp rank 0 on machines 0, 1"), "{note}");
    assert!(choice.to_string().contains("note: machines differ in memory per process (machine 0: 6.00 GiB"));
}

/// One process of 10 MB for the char-GPT, 4 sequences per step in micro-batches of 1 or 4. Its two layouts need
/// (fp32 AdamW, 1 MB of overhead): b 4 — the DDP case of `memory_per_sharding_stage_matches_hand_computed_bytes`,
/// 23 073 344 bytes; b 1 × 4 accumulation steps — 16Ψ = 13 135 872, the accumulated micro-batch's gradients 4Ψ =
/// 3 283 968, a quarter of the activations 2 234 368, 1 000 000: 19 654 208, so 21 838 009 with the 10 % margin.
#[test]
fn when_nothing_fits_the_error_names_the_smallest_memory_that_would() {
    let model = char_gpt();
    let cluster = one_machine(1, 10_000_000, Link::new(1e-6, 1e9));
    let train = TrainSpec::new(4, &[1, 4], Precision::Fp32).with_parallel_forms(false, false);
    let a = Assumptions { runtime_overhead_bytes: 1_000_000, memory_margin: 0.1, ..Assumptions::default() };
    let e = choose(&model, &cluster, &train, &a).unwrap_err();
    let AutoLayoutError::NothingFits { needed_per_process, more_machines, considered, least_memory, fastest, .. } = &e
    else {
        panic!("{e}")
    };
    assert_eq!((*needed_per_process, *considered), (21_838_009, 2));
    assert_eq!((least_memory.layout.micro_batch_size, least_memory.peak_memory()), (1, 19_654_208));
    // The same compute in either: the tie goes to the simpler layout, one micro-batch of 4 without accumulation.
    assert_eq!((fastest.layout.micro_batch_size, fastest.layout.accumulation_steps), (4, 1));
    assert_eq!(a.usable(21_838_009), 19_654_208);
    assert!(a.usable(21_838_008) < 19_654_208);
    let text = e.to_string();
    assert!(text.contains("The smallest memory per process that would fit is 20.83 MiB (21838009 bytes"), "{text}");
    // It fits with that memory, not with a byte less.
    let enough = one_machine(1, 21_838_009, Link::new(1e-6, 1e9));
    assert_eq!(choose(&model, &enough, &train, &a).unwrap().best.layout, least_memory.layout);
    assert!(choose(&model, &one_machine(1, 21_838_008, Link::new(1e-6, 1e9)), &train, &a).is_err());
    // 4 processes of 10 MB fit (FULL_SHARD: 6.8 MB each); 2 do not (10.1 MB), 3 cannot split 4 sequences.
    assert_eq!(*more_machines, Some((3, 4)));
    assert!(text.ends_with("Or add 3 machines like the largest (4 processes in all)"), "{text}");
    let grown = |n| ClusterSpec { machines: vec![cluster.machines[0]; n], ..cluster.clone() };
    assert_eq!(choose(&model, &grown(4), &train, &a).unwrap().best.layout.sharding, FullShard);
    assert!(choose(&model, &grown(2), &train, &a).is_err() && choose(&model, &grown(3), &train, &a).is_err());
}

#[test]
fn no_layout_for_the_batch_names_the_rules_and_the_nearest_batch() {
    let cluster = one_machine(4, 1 << 40, Link::new(1e-6, 1e9));
    let train =
        TrainSpec::new(6, &[1], Precision::Fp32).with_parallel_forms(false, false).with_gradient_accumulation(false);
    let e = choose(&char_gpt(), &cluster, &train, &no_overhead()).unwrap_err();
    let AutoLayoutError::NoLayout { world, nearest_batches, reasons } = &e else { panic!("{e}") };
    assert_eq!((*world, *nearest_batches), (4, (Some(4), None)));
    let text = e.to_string();
    assert!(
        text.contains("global batch does not split (7 candidates, e.g. 6 sequences over dp 4 × micro-batch 1)"),
        "{text}"
    );
    assert!(text.ends_with("a global batch of 4 sequences would have layouts"), "{text}");
    assert!(reasons.iter().any(|r| r.starts_with("pipeline not allowed")), "{reasons:?}");
}

/// Free communication: DDP, ZeRO-1 and ZeRO-2 take the same time; at 2 fp32 ranks ZeRO-1's packed gradients cost
/// what halving the moments saves (16Ψ either way) and ZeRO-2 holds more (a whole micro-batch gradient and its
/// packed copy). Equal time goes to the simpler layout (DDP: sharding buys nothing where everything fits, and its
/// copies cost time the α–β model does not see), then to less memory; when DDP does not fit, FULL_SHARD does.
#[test]
fn ties_go_to_the_simpler_layout_then_to_less_memory() {
    let model = char_gpt();
    let cluster = one_machine(2, 1 << 30, Link::new(0.0, 1e30));
    let train = TrainSpec::new(8, &[4], Precision::Fp32).with_parallel_forms(false, false);
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    assert_eq!((choice.best.layout.dp_shard, choice.best.layout.sharding), (1, NoShard), "{choice}");
    let zero1 = choice.runners_up.iter().find(|c| c.layout.sharding == ShardOptim).unwrap();
    assert_eq!((zero1.time.total * 1e9).round(), (choice.best.time.total * 1e9).round());
    assert!(zero1.peak_memory() <= choice.best.peak_memory());
    // Where DDP does not fit and a sharded layout does, memory decides.
    let tight = one_machine(2, choice.best.peak_memory() * 10 / 9 - 1, Link::new(0.0, 1e30));
    let choice = choose(&model, &tight, &train, &no_overhead()).unwrap();
    assert_eq!(choice.best.layout.sharding, FullShard, "{choice}");

    // GPipe and 1F1B at pp 4 with 4 micro-batches: the same time; 1F1B holds no more than GPipe on any rank (the
    // first rank holds all 4 micro-batches either way) and is the simpler.
    let (model, cluster, train) = needs_tp_or_pp(Link::new(20e-6, 2e9));
    let choice = choose(&model, &cluster, &train, &no_overhead()).unwrap();
    assert_eq!((choice.best.layout.pp, choice.best.layout.schedule), (4, Some(ScheduleKind::OneFOneB)), "{choice}");
    let gpipe = choice.runners_up.iter().find(|c| c.layout.schedule == Some(ScheduleKind::GPipe)).unwrap();
    assert_eq!((gpipe.layout.pp, gpipe.layout.tp), (4, 1));
    assert_eq!((gpipe.time.total * 1e9).round(), (choice.best.time.total * 1e9).round());
    assert!(gpipe.peak_memory() >= choice.best.peak_memory());
}

#[test]
fn the_choice_does_not_depend_on_the_order_of_the_inputs() {
    let (model, cluster, train) = needs_tp_or_pp(Link::new(1e-6, 50e9));
    let train =
        TrainSpec { micro_batch_sizes: vec![1, 2, 4], ..train }.with_strategies(&[NoShard, ShardOptim, FullShard]);
    let a = Assumptions { runners_up: 6, ..no_overhead() };
    let first = choose(&model, &cluster, &train, &a).unwrap().to_string();
    assert_eq!(choose(&model, &cluster, &train, &a).unwrap().to_string(), first);
    let reordered = TrainSpec {
        micro_batch_sizes: vec![4, 1, 2, 1],
        strategies: vec![FullShard, NoShard, ShardOptim],
        schedules: vec![ScheduleKind::Interleaved1F1B, ScheduleKind::OneFOneB, ScheduleKind::GPipe],
        ..train
    };
    assert_eq!(choose(&model, &cluster, &reordered, &a).unwrap().to_string(), first);
}

#[test]
fn a_layout_becomes_the_accelerators_settings() {
    let l = Layout {
        dp_replicate: 1,
        dp_shard: 2,
        tp: 1,
        pp: 2,
        sharding: ShardGradOp,
        schedule: Some(ScheduleKind::Interleaved1F1B),
        virtual_stages: 2,
        microbatches: 4,
        accumulation_steps: 1,
        micro_batch_size: 2,
        activation_checkpointing: false,
        layers_per_stage: None,
    };
    let c = l.parallelism_config();
    c.validate_sizes().unwrap();
    assert_eq!((c.dp_shard_size, c.pp_size, c.pp_microbatches_per_step(), c.pp_stages_per_rank()), (2, 2, 4, 2));
    assert_eq!(c.sharding_strategy, ShardGradOp);
    assert_eq!(l.per_process_batch(), 8, "pipeline_backward is handed the 4 micro-batches of 2");
    assert_eq!(l.rank_layers(8), Some(vec![4, 4]));
    assert_eq!(
        l.to_string(),
        "dp_replicate 1 × dp_shard 2 (SHARD_GRAD_OP) × tp 1 × pp 2 (Interleaved1F1B, 2 stages per rank, 4 \
         micro-batches), micro-batch 2"
    );
    let uneven =
        Layout { schedule: Some(ScheduleKind::OneFOneB), virtual_stages: 1, layers_per_stage: Some(vec![5, 3]), ..l };
    assert_eq!(uneven.rank_layers(8), Some(vec![5, 3]));
    assert!(uneven.to_string().ends_with("micro-batch 2, layers per stage [5, 3]"));
}

#[test]
fn bad_inputs_are_refused_with_what_is_wrong() {
    let cluster = one_machine(2, 1 << 30, Link::new(1e-6, 1e9));
    let train = TrainSpec::new(8, &[1], Precision::Fp32);
    let e = choose(&ModelSpec::gpt(2, 130, 4, 512, 10, 8), &cluster, &train, &no_overhead()).unwrap_err();
    assert!(e.to_string().contains("n_head 4 does not divide d_model 130"), "{e}");
    let no_bandwidth = one_machine(2, 1 << 30, Link::new(1e-6, 0.0));
    assert!(choose(&char_gpt(), &no_bandwidth, &train, &no_overhead()).is_err());
    let empty = TrainSpec { micro_batch_sizes: vec![], ..train.clone() };
    assert!(choose(&char_gpt(), &cluster, &empty, &no_overhead()).is_err());
    let wrong_world = evaluate(&char_gpt(), &cluster, &train, &no_overhead(), &flat(4, 1, 1, NoShard, 1, 1));
    assert!(wrong_world.unwrap_err().to_string().contains("has 4 processes, the cluster 2"));
    let err: crate::AccelError = AutoLayoutError::InvalidSpec("x".into()).into();
    assert!(err.to_string().starts_with("invalid configuration parallelism_config = \"auto\""), "{err}");
}

/// FULL_SHARD recomputes its units on pipeline stages too (accel records each stage's forward): one unit gathered
/// at a time, two all-gathers per micro-batch; activation checkpointing applies at any pp; tied embeddings add an
/// all-reduce between the first and the last stage.
#[test]
fn full_shard_and_checkpointing_apply_to_pipeline_stages_and_tied_embeddings_sum_across() {
    let model = char_gpt();
    let link = Link::new(1e-5, 1e9);
    let cluster = one_machine(4, 1 << 40, link);
    let train = TrainSpec::new(8, &[1], Precision::Fp32);
    let a = no_overhead();
    let pipeline =
        Layout { pp: 2, schedule: Some(ScheduleKind::OneFOneB), microbatches: 4, ..flat(1, 2, 1, FullShard, 1, 1) };
    let c = evaluate(&model, &cluster, &train, &a, &pipeline).unwrap();
    // pp rank 0: 2 blocks + the embeddings = 414 464 parameters, 1F1B holds 2 micro-batches there.
    assert_eq!(model.params_on_rank(1, 2, 0, 2), 414_464);
    let m0 = c.ranks[0].memory;
    assert_eq!(m0.gathered, (198_272 + 17_920) * 4 + 198_272 * 4, "one unit and the embeddings");
    // Recomputed: each of 2 micro-batches keeps its 2 blocks' inputs (64 tokens × 128 × 4 bytes) and the
    // embedding's output; one block is whole while recomputed (8 192 bytes per token).
    assert_eq!(m0.activations, 2 * (2 * 32_768 + 32_768) + 64 * 8_192);
    // Per micro-batch on the pace-setting rank: 2 all-gathers of its parameters and a reduce-scatter, over 2 ranks.
    let r = c.time.critical_pp_rank;
    let bytes = model.params_on_rank(1, 2, r, 2) as f64 * 4.0;
    assert!((c.time.dp_comm - 4.0 * 3.0 * all_gather_time(2, bytes, &link)).abs() < 1e-12, "{:?}", c.time);

    let on = train.clone().with_checkpointing(Checkpointing::On);
    let (layouts, _) = enumerate(&model, 4, &on);
    assert!(layouts.iter().any(|l| l.pp > 1 && l.activation_checkpointing));
    assert!(layouts.iter().all(|l| l.activation_checkpointing == (l.sharding != FullShard)));
    let auto = train.clone().with_checkpointing(Checkpointing::Auto);
    assert!(enumerate(&model, 4, &auto).0.len() > layouts.len());

    let ddp_pipeline = Layout { dp_replicate: 2, dp_shard: 1, sharding: NoShard, ..pipeline };
    let dp = |m: &ModelSpec| evaluate(m, &cluster, &train, &a, &ddp_pipeline).unwrap().time.dp_comm;
    let tied = char_gpt().with_tied_embeddings(true);
    let extra = all_reduce_time(2, (76 * 128 * 4) as f64, &link);
    assert!((dp(&tied) - dp(&model) - extra).abs() < 1e-12, "{} {} {extra}", dp(&tied), dp(&model));
}

/// A much slower machine still gets a block: every pipeline stage holds at least one (a stage without blocks has
/// no parameters for the program to build; found when the probe measured two simulated machines at different
/// speeds and the split came out [2, 1, 0, 1]).
#[test]
fn an_uneven_split_leaves_no_stage_without_blocks() {
    let link = Link::new(20e-6, 2e9);
    let fast = Machine {
        processes: 1,
        memory_per_process: 1 << 40,
        flops_per_process: 1e10,
        intra: link,
        op_latency: 0.0,
        sync_latency: 0.0,
        memory_bandwidth: f64::INFINITY,
    };
    let slow = Machine { flops_per_process: 1e8, ..fast };
    let cluster = ClusterSpec { machines: vec![fast, fast, slow, fast], inter: link };
    let train = TrainSpec::new(8, &[1], Precision::Fp32).with_strategies(&[NoShard]).with_parallel_forms(false, true);
    let a = no_overhead();
    let layout =
        Layout { pp: 4, schedule: Some(ScheduleKind::OneFOneB), microbatches: 8, ..flat(1, 1, 1, NoShard, 1, 1) };
    for n_layer in [4, 8] {
        let model = ModelSpec::gpt(n_layer, 128, 4, 512, 76, 64);
        let c = evaluate(&model, &cluster, &train, &a, &layout).unwrap();
        let blocks: Vec<usize> = c.ranks.iter().map(|r| r.layers).collect();
        assert!(blocks.iter().all(|&n| n >= 1), "{blocks:?}");
        assert_eq!(blocks.iter().sum::<usize>(), n_layer);
        assert_eq!(blocks[2], 1, "the slow machine's stage holds the fewest: {blocks:?}");
    }
}

/// Predicted times within the tie tolerance of the fastest go to the simplest layout: the choice does not flip
/// between layouts on differences far below the probe's noise. Without a tolerance the fastest wins.
#[test]
fn near_ties_go_to_the_simplest_layout() {
    let model = char_gpt();
    let cluster = one_machine(4, 1 << 30, Link::new(5e-6, 1e9));
    let train = TrainSpec::new(32, &[8], Precision::Fp32).with_parallel_forms(false, false);
    let exact = Assumptions { tie_tolerance: 0.0, ..no_overhead() };
    let fastest = choose(&model, &cluster, &train, &exact).unwrap().best;
    let tolerant = Assumptions { tie_tolerance: 0.01, ..no_overhead() };
    let chosen = choose(&model, &cluster, &train, &tolerant).unwrap().best;
    assert!(chosen.time.total <= fastest.time.total * 1.01);
    // Every layout within 1 % of the fastest is at least as complex as the chosen one.
    let (layouts, _) = enumerate(&model, 4, &train);
    for l in &layouts {
        let c = evaluate(&model, &cluster, &train, &tolerant, l).unwrap();
        if c.fits() && c.time.total <= fastest.time.total * 1.01 {
            assert!(
                c.layout.complexity() >= chosen.layout.complexity(),
                "{} is simpler than {}",
                c.layout,
                chosen.layout
            );
        }
    }
    // Here the α–β model predicts HSDP (two rings of 2) a hair faster than DDP (one ring of 4); DDP is chosen.
    assert_eq!((chosen.layout.dp_replicate, chosen.layout.dp_shard), (4, 1), "{}", chosen.layout);
    assert!(fastest.time.total < chosen.time.total, "{} vs {}", fastest.layout, chosen.layout);
}

/// The measured synchronisation cost is paid once per blocking collective and send: tp 2 over 2 micro-batches of
/// accumulation pays it for 4 all-reduces per block, one for the embedding, one for the head's input and three
/// for the vocab-parallel loss, per micro-batch, plus the step's data-parallel reduction (none at dp 1); a
/// pipeline pays it per send; data parallelism once per step.
#[test]
fn synchronisation_under_load_is_paid_per_collective_and_send() {
    let model = char_gpt();
    let train = TrainSpec::new(4, &[1, 2, 4], Precision::Fp32);
    let a = no_overhead();
    let link = Link::new(0.0, 1e12);
    let cluster = |sync: f64| {
        let mut c = one_machine(2, 1 << 40, link);
        c.machines[0].sync_latency = sync;
        c
    };
    let sync = 0.003;
    let tp2 = flat(1, 1, 2, NoShard, 2, 2);
    let quiet = evaluate(&model, &cluster(0.0), &train, &a, &tp2).unwrap().time;
    let loaded = evaluate(&model, &cluster(sync), &train, &a, &tp2).unwrap().time;
    let per_microbatch = 4.0 * 4.0 + 1.0 + 1.0 + 3.0;
    assert!((loaded.tp_comm - quiet.tp_comm - 2.0 * per_microbatch * sync).abs() < 1e-12, "{loaded} vs {quiet}");
    assert_eq!((loaded.compute, loaded.dp_comm), (quiet.compute, quiet.dp_comm));
    // pp 2, GPipe, 4 micro-batches: each rank sends one activation or one gradient per micro-batch.
    let pp2 = Layout {
        pp: 2,
        schedule: Some(crate::pipeline::ScheduleKind::GPipe),
        microbatches: 4,
        micro_batch_size: 1,
        ..flat(1, 1, 1, NoShard, 1, 1)
    };
    let quiet = evaluate(&model, &cluster(0.0), &train, &a, &pp2).unwrap().time;
    let loaded = evaluate(&model, &cluster(sync), &train, &a, &pp2).unwrap().time;
    assert!((loaded.pp_comm - quiet.pp_comm - 4.0 * sync).abs() < 1e-12, "{loaded} vs {quiet}");
    // DDP: one all-reduce per step.
    let ddp = flat(2, 1, 1, NoShard, 2, 1);
    let quiet = evaluate(&model, &cluster(0.0), &train, &a, &ddp).unwrap().time;
    let loaded = evaluate(&model, &cluster(sync), &train, &a, &ddp).unwrap().time;
    assert!((loaded.dp_comm - quiet.dp_comm - sync).abs() < 1e-12, "{loaded} vs {quiet}");
}

/// Accumulating gradients over m micro-batches moves 3 · (m − 1) · Ψ_r · 4 bytes at the measured bandwidth:
/// the rank's whole gradient without sharding, its shard under ZeRO-2.
#[test]
fn gradient_accumulation_costs_memory_traffic_per_extra_micro_batch() {
    let model = char_gpt();
    let train = TrainSpec::new(8, &[1, 2, 4], Precision::Fp32);
    let a = no_overhead();
    let link = Link::new(0.0, 1e12);
    let bandwidth = 1e9;
    let cluster = |bw: f64| {
        let mut c = one_machine(2, 1 << 40, link);
        c.machines[0].memory_bandwidth = bw;
        c
    };
    let psi = model.total_params() as f64;
    for (layout, held) in [
        (flat(2, 1, 1, NoShard, 1, 4), psi),
        (flat(1, 2, 1, ShardGradOp, 1, 4), model.params_on_rank(1, 1, 0, 4) as f64 / 2.0),
    ] {
        let free = evaluate(&model, &cluster(f64::INFINITY), &train, &a, &layout).unwrap().time;
        let paid = evaluate(&model, &cluster(bandwidth), &train, &a, &layout).unwrap().time;
        let expected = 3.0 * 3.0 * held * 4.0 / bandwidth;
        assert!((paid.compute - free.compute - expected).abs() < 1e-9, "{layout}: {paid} vs {free}, {expected}");
    }
    // One micro-batch accumulates nothing.
    let one = flat(2, 1, 1, NoShard, 4, 1);
    let free = evaluate(&model, &cluster(f64::INFINITY), &train, &a, &one).unwrap().time;
    assert_eq!(evaluate(&model, &cluster(bandwidth), &train, &a, &one).unwrap().time.compute, free.compute);
}
