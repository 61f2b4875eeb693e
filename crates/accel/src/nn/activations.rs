//! [`ActivationSpec`]: what one block of a model keeps for its backward pass — what a model declares on its
//! builder ([`super::VarBuilder::declare_activations`]) and the automatic layout's memory model counts
//! ([`crate::auto_layout::ModelSpec`]).

/// The activation bytes a transformer block keeps for its backward pass, per Korthikanti et al. 2022 ("Reducing
/// Activation Recomputation in Large Transformer Models", §4.1), with what varies between implementations made
/// explicit. Per block, per micro-batch of `b` sequences of `s` tokens, at tp `t`, with `e` bytes per activation
/// element (the compute dtype's: [`crate::auto_layout::StateBytes::activation`]):
///
/// ```text
/// b·s·[ e·(4h + (4h + 2f)/t) + mask·(h_masks·h + f_masks·f/t) ] + b·(a/t)·s²·(score_tensors·e + score_masks·mask)
/// ```
///
/// - `4h` replicated over tp: the two layer-norm inputs, the q/k/v projections' input, the MLP's input.
/// - `(4h + 2f)/t` split over tp: q, k, v (3h), the output projection's input (h), the GELU's input and output (2f).
/// - dropout masks: `h_masks` of `[b, s, h]` (after attention and after the MLP), `f_masks` of `[b, s, f/t]`.
/// - attention scores: `score_tensors` `[b, a/t, s, s]` tensors kept (softmax output, its dropout's output) and
///   `score_masks` masks (the attention-probability dropout).
///
/// With Korthikanti's settings (16-bit values, 1-byte masks, two h-masks, two score tensors and one score mask,
/// f = 4h) this is their `s·b·h·(10 + 24/t + 5·a·s/(h·t))`, `s·b·h·(34 + 5·a·s/h)` at t = 1 (tested).
///
/// **Our CPU f32 case** ([`ActivationSpec::accel`]): the values are f32 (e = 4 — also under bf16 on the CPU, which
/// is autocast over f32 tensors); the fused attention kernel keeps only q, k and v and recomputes the
/// probabilities in its backward (as FlashAttention), so no `s²` tensor is kept; with dropout on, accel's masks are
/// tensors of the activations' dtype (e bytes) at both residual branches and on the MLP's hidden activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationSpec {
    /// Bytes per dropout-mask element; 0 when dropout is off.
    pub mask_bytes: u64,
    /// `[b, s, h]` dropout masks per block (replicated over tp).
    pub h_masks: u64,
    /// `[b, s, f/t]` dropout masks per block (split over tp).
    pub f_masks: u64,
    /// `[b, a/t, s, s]` value tensors kept per block (attention probabilities and their dropout's output).
    pub score_tensors: u64,
    /// `[b, a/t, s, s]` dropout masks per block.
    pub score_masks: u64,
    /// Further `[b, s, h]` value tensors a block keeps, replicated over tp (beyond Korthikanti's count).
    pub extra_h: u64,
    /// Further `[b, s, h/t]` value tensors a block keeps, split over tp.
    pub extra_h_split: u64,
    /// Further `[b, s, f/t]` value tensors a block keeps.
    pub extra_f: u64,
    /// Further `[b, s, h]` tensors a block keeps only under tensor parallelism (t > 1): the tp region's copies
    /// (the identity before a column-parallel layer, a row-parallel layer's partial sum before its all-reduce).
    pub tp_extra_h: u64,
    /// Blocks whose full activations are alive at once while checkpointed blocks are recomputed in the backward
    /// (1 in the ideal; see [`ActivationSpec::accel`]).
    pub recomputed_blocks_live: u64,
}

impl ActivationSpec {
    /// Korthikanti et al.'s accounting (Megatron on GPUs): 1-byte masks, dropout after attention and after the MLP
    /// and on the attention probabilities, the probabilities and their dropout's output kept.
    pub fn korthikanti() -> Self {
        ActivationSpec {
            mask_bytes: 1,
            h_masks: 2,
            f_masks: 0,
            score_tensors: 2,
            score_masks: 1,
            extra_h: 0,
            extra_h_split: 0,
            extra_f: 0,
            tp_extra_h: 0,
            recomputed_blocks_live: 1,
        }
    }

    /// accel's char-GPT with the fused ops: no score tensor kept (the attention backward recomputes them); with
    /// `dropout`, masks of `mask_bytes` each (the activation element size: accel's masks are tensors of the
    /// activations' dtype) after both residual branches and on the MLP's hidden activation. candle's autograd
    /// keeps every op's inputs, so each biased linear keeps its product before the bias too — q, k, v's (`3h/t`),
    /// the MLP's first (`f/t`), both row-parallel projections' (`h` each) — and the heads' contiguous q, k, v
    /// (`3h/t`): 2 more `h`, 6 more `h/t` and 1 more `f/t` tensor per token than Korthikanti's count (measured:
    /// the 1-process char-GPT's peak grows 3.7 MiB per sequence of 64 tokens, 4 blocks, h 128, f 512; the formula
    /// with these gives 3.6). Under tp, 8 more `h` tensors per token (the tp regions' copies and partial sums;
    /// measured at tp 2: 3.2 MiB per sequence, the formula 2.3 without them, 3.2 with). While checkpointed blocks are
    /// recomputed, two blocks' activations are alive (the recomputed block's and the previous one's, still held
    /// when the next recomputation starts; measured with checkpointing and FULL_SHARD: 2.1 and 2.3 MiB per
    /// sequence, the formula with one block 1.3).
    pub fn accel(dropout: bool, mask_bytes: u64) -> Self {
        let (mask_bytes, h_masks, f_masks) = if dropout { (mask_bytes, 2, 1) } else { (0, 0, 0) };
        ActivationSpec {
            mask_bytes,
            h_masks,
            f_masks,
            score_tensors: 0,
            score_masks: 0,
            extra_h: 2,
            extra_h_split: 6,
            extra_f: 1,
            tp_extra_h: 8,
            recomputed_blocks_live: 2,
        }
    }
}
