"""The Llama of `accel_llama` as transformers' own LlamaForCausalLM, trained with PyTorch's native N-D parallel stack
(and transformers' own tensor parallelism) on the CPU over gloo — the PyTorch side of scripts/bench-torch-llama.sh,
the twin of `accel_llama --nproc N` at each layout.

    torchrun --standalone --nproc_per_node 2 scripts/torch_ref/nd_llama.py --layout fsdp-full --steps 30
    torchrun --standalone --nproc_per_node 4 scripts/torch_ref/nd_llama.py --layout tp2-dp2 --global-batch 16

Layouts (`--layout`; accel_llama's flags for the same layout in brackets; N = the torchrun world):
  ddp              DistributedDataParallel over N                                     [--nproc N]
  fsdp-full        FSDP2 fully_shard per decoder layer + root, 1-D mesh of N,
                   reshard_after_forward=True (FULL_SHARD, ZeRO-3)    [--dp-shard-size N --sharding-strategy FULL_SHARD]
  fsdp-grad-op     the same with reshard_after_forward=False (SHARD_GRAD_OP, ZeRO-2)
                                                                   [--dp-shard-size N --sharding-strategy SHARD_GRAD_OP]
  hsdp, hsdp-full  FSDP2 on a 2-D mesh (dp_replicate N/2 × dp_shard 2), reshard_after_forward False / True
                                                [--dp-shard-size 2 (--sharding-strategy SHARD_GRAD_OP | FULL_SHARD)]
  tpN, tpT-dpD     transformers' own tensor parallelism: rank 0 saves the seeded model (save_pretrained, a temporary
                   directory), every rank loads it with LlamaForCausalLM.from_pretrained(dir, distributed_config=
                   DistributedConfig(tp_size=T[, dp_replicate_size=D])) — the model's tp plan (embed_tokens
                   embedding_rowwise, q/k/v/gate/up colwise, o/down rowwise, lm_head colwise_gather_output: the logits
                   are gathered, the loss is the plain cross entropy) as DTensors on transformers' (pp, dp_replicate,
                   fsdp, tp) mesh, tp innermost (consecutive ranks, as ours); with D > 1 transformers wraps it in FSDP2
                   over dp_replicate × fsdp 1 (replicated, gradients all-reduced: DDP's semantics). The older
                   spelling from_pretrained(dir, tp_plan="auto", device_mesh=mesh) is the same path in transformers
                   5.25 (deprecated, FutureWarning), and its device_mesh is ignored: transformers builds its mesh from
                   WORLD_SIZE, so tp_plan="auto" alone means tp = the whole world and a tp × dp job needs
                   DistributedConfig.                                                   [--tp-size T]
  ppP[-dpD]-SCHED  torch.distributed.pipelining: the decoder layers cut into P stages (2 per rank, looped, for
                   interleaved) as ours, embed_tokens on the first stage, norm + lm_head on the last; every stage holds
                   its own LlamaRotaryEmbedding and recomputes the positions (0 … seq-1: every window starts at 0) and
                   the causal mask from the hidden states it receives, so only the hidden states travel between
                   stages; ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B over --microbatches; when D > 1, DDP
                   (device_mesh=mesh["dp"]) around each stage module (--pp-dp ddp) or the gradients averaged by one
                   all-reduce after the schedule (--pp-dp allreduce)
                                         [--pp-size P --pp-schedule GPipe|1F1B|Interleaved1F1B --microbatches M]
  accelerate       Hugging Face Accelerate's ND-parallel front end: Accelerator(cpu=True, parallelism_config=
                   ParallelismConfig(dp_shard_size=N), fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)).
                   Accelerate 1.16 refuses it on the CPU (DistributedType.MULTI_CPU), which this layout reports as
                   unsupported with Accelerate's own message; should a later Accelerate accept it, the layout fails
                   with "error:" (it does not train through Accelerate) — add that then.
                                                    [--dp-shard-size N --sharding-strategy FULL_SHARD]

The model (accel::models::llama, transformers' LlamaForCausalLM): LlamaConfig(vocab_size = the tokenizer's 2048,
hidden_size 384, intermediate_size 1024, num_hidden_layers 6, num_attention_heads 6, num_key_value_heads 2, silu,
max_position_embeddings max(seq_len, 2048), rms_norm_eps 1e-6, rope_theta 10000 (default rope), no biases, untied
unless --tie-word-embeddings, attention_dropout, bos 0, eos 1, use_cache False), attention --attn-implementation
(default sdpa: F.scaled_dot_product_attention with is_causal, transformers' default for Llama; eager writes out the
softmax with a materialised mask — the two measured within noise of each other on this CPU); transformers'
initialisation (Normal(0, 0.02) for the linears and the embedding, RMSNorm weights 1 — accel_llama's), drawn from
--seed. The parameter count is printed and asserted equal to accel_llama's (the sum of weight_shapes, each weight once).

Training as accel_llama's defaults: data/shakespeare/shakespeare8.txt tokenized with data/shakespeare/tokenizer.json
(no special tokens), the first 95 % of the ids for training, non-overlapping windows of --seq-len with targets shifted
by one, shuffled each epoch (seed + epoch) and dealt to the data-parallel ranks, drop_last; --global-batch sequences
per optimizer step over all replicas (/ dp per replica, the tp and pp peers reading the same rows); mean cross
entropy; gradient norm clipped to --max-grad-norm (1.0; each parameter counted once over dp × tp × pp);
torch.optim.AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.1) on every parameter, constant; fp32;
torch.set_num_threads(cores / world). The loop and the output lines are scripts/torch_ref/nd_harness.py's (shared
with nd_gpt.py): `step k/n: loss L, T tokens/s`, `nd_llama done: …`, `rank r (pp a dp b tp c): peak RSS X MiB`,
`nd_llama result: {json}`; a layout this stack cannot run prints `unsupported: <layout>: <reason>` and exits 0.
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_harness import (
    Batches,
    Job,
    Pipeline,
    Unsupported,
    adamw,
    banner,
    finish_args,
    first_line,
    main,
    parse_layout,
    pipeline_step,
    plain_step,
    train,
    training_args,
)

PLAIN_LAYOUTS = ("ddp", "fsdp-full", "fsdp-grad-op", "hsdp", "hsdp-full", "accelerate")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    training_args(p, lr=1e-3)
    p.set_defaults(global_batch=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--num-hidden-layers", type=int, default=6)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--num-key-value-heads", type=int, default=2)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="accel_llama's residual dropout: LlamaForCausalLM has none, so only 0 is accepted")
    p.add_argument("--attn-implementation", choices=["sdpa", "eager"], default="sdpa")
    a = finish_args(p.parse_args())
    if a.hidden_dropout != 0.0:
        p.error("--hidden-dropout: transformers' LlamaForCausalLM has no residual dropout (only attention_dropout)")
    return a


# ------------------------------------------------------------------------------------------------------- model


def llama_config(a, vocab_size):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=max(a.seq_len, 2048),
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=a.tie_word_embeddings,
        attention_bias=False,
        attention_dropout=a.attention_dropout,
        mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=1,
        use_cache=False,  # training: no key/value cache
    )
    config._attn_implementation = a.attn_implementation
    return config


def num_parameters(c):
    """accel_examples::llama::num_parameters: the sum of accel::models::llama::weight_shapes (each weight once)."""
    v, h, i = c.vocab_size, c.hidden_size, c.intermediate_size
    hd = h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    layer = 2 * h + q * h + 2 * kv * h + h * q + 3 * i * h
    return v * h + h + (0 if c.tie_word_embeddings else v * h) + c.num_hidden_layers * layer


def describe(c):
    return (f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads over "
            f"{c.num_key_value_heads} key/value heads, MLP {c.intermediate_size}, vocabulary {c.vocab_size}, "
            f"{'tied' if c.tie_word_embeddings else 'untied'} head, attention {c._attn_implementation}")


class LlamaStage(nn.Module):
    """One pipeline stage of a LlamaForCausalLM: its decoder layers `layers` (the model's own modules, under their
    indices), embed_tokens on the first stage, norm + lm_head on the last. What LlamaModel.forward does around the
    layers is redone on every stage: the positions (0 … s-1, every window starting at 0), the rotary cos/sin (a
    LlamaRotaryEmbedding of the stage's own, buffers only) and the causal mask (create_causal_mask: None under sdpa,
    which then runs is_causal) — so the stages pass each other the hidden states alone."""

    def __init__(self, model, layers, first, last):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.rotary_emb = LlamaRotaryEmbedding(config=model.config)
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids=positions)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=positions)
        if self.lm_head is None:
            return h
        return self.lm_head(self.norm(h))


def logits_of(module):
    """forward(x) → logits of a LlamaForCausalLM (or a wrapper of one)."""
    return lambda x: module(input_ids=x).logits


# -------------------------------------------------------------------------------------------------------- data


def load_tokens(a):
    """accel_examples::llama::token_datasets's training ids: the text tokenized without special tokens, the first
    95 %."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.path.join(a.data_dir, "tokenizer.json"))
    with open(os.path.join(a.data_dir, "shakespeare8.txt"), encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False).ids
    cut = len(ids) * 95 // 100
    return torch.tensor(ids[:cut], dtype=torch.int64), tok.get_vocab_size(with_added_tokens=True)


# ------------------------------------------------------------------------------------------------------ layouts


def load_tensor_parallel(a, model, tp, dp):
    """The seeded `model` saved by rank 0 and loaded by every rank under transformers' tensor parallelism."""
    import transformers
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    transformers.utils.logging.disable_progress_bar()
    path = [tempfile.mkdtemp(prefix="nd_llama-") if dist.get_rank() == 0 else None]
    try:
        if dist.get_rank() == 0:
            model.save_pretrained(path[0])
        dist.broadcast_object_list(path, src=0)
        dist.barrier()
        sizes = {"tp_size": tp, **({"dp_replicate_size": dp} if dp > 1 else {})}
        loaded = LlamaForCausalLM.from_pretrained(path[0], distributed_config=DistributedConfig(**sizes),
                                                  dtype=torch.float32, attn_implementation=a.attn_implementation)
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
    return loaded.train(), sizes


def accelerate_probe(a, world):
    """Accelerate's ND-parallel config on this CPU job: its refusal as Unsupported."""
    try:
        import accelerate
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"import accelerate failed: {first_line(e)}")
    call = (f"Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size={world}), "
            f"fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True))")
    try:
        acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=world),
                          fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True))
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"accelerate {accelerate.__version__}: {call} raised {type(e).__name__}: {first_line(e)}")
    raise AssertionError(f"accelerate {accelerate.__version__} accepted {call} (distributed type "
                         f"{acc.distributed_type}): nd_llama.py does not train through Accelerate yet — add it")


def run(a, rank, world, threads):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    kind, sizes = parse_layout(a.layout, PLAIN_LAYOUTS)
    tokens, vocab_size = load_tokens(a)
    config = llama_config(a, vocab_size)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(config).train()
    n_params = sum(p.numel() for p in model.parameters())
    expected = num_parameters(config)
    assert n_params == expected, f"{n_params} parameters, accel_llama's weight_shapes sum to {expected}"
    if a.expect_parameters is not None:
        assert n_params == a.expect_parameters, f"{n_params} parameters, accel_llama reports {a.expect_parameters}"

    pp, dp, tp = 1, world, 1
    pp_rank, dp_rank, tp_rank = 0, rank, 0

    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_module = DDP(model)
        opt = adamw(model.parameters(), a)
        step = plain_step(logits_of(train_module), opt, list(model.parameters()), a.max_grad_norm)
        desc = "DistributedDataParallel"
    elif kind in ("fsdp-full", "fsdp-grad-op", "hsdp", "hsdp-full"):
        from torch.distributed.fsdp import fully_shard

        reshard = kind in ("fsdp-full", "hsdp-full")
        if kind.startswith("hsdp"):
            if world % 2:
                raise Unsupported(f"HSDP here is dp_replicate {world}/2 × dp_shard 2: the world ({world}) must be even")
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = adamw(model.parameters(), a)
        step = plain_step(logits_of(model), opt, list(model.parameters()), a.max_grad_norm)
        desc = (f"FSDP2 fully_shard per decoder layer + root, mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, "
                f"reshard_after_forward={reshard}")
    elif kind == "tp":
        tp, dp = sizes["tp"], sizes["dp"]
        if tp * dp != world:
            raise Unsupported(f"tp {tp} × dp {dp} needs {tp * dp} processes, the job has {world}")
        model, dc = load_tensor_parallel(a, model, tp, dp)
        mm = model._mesh_manager
        tp_rank = mm.get_mesh("tp").get_local_rank()
        dp_rank = mm.get_mesh("dp_replicate").get_local_rank()
        loaded = sum(p.numel() for p in model.parameters())
        assert loaded == n_params, f"{loaded} parameters after transformers' tensor-parallel load, {n_params} before"
        heads, kv = config.num_attention_heads, config.num_key_value_heads

        def forward(x):
            try:
                return model(input_ids=x).logits
            except RuntimeError as e:
                if heads % tp or kv % tp:  # what transformers 5.25 does then (accel_llama refuses it up front)
                    raise Unsupported(f"{heads} query / {kv} key-value heads do not split over tp {tp}: transformers' "
                                      f"colwise q/k/v_proj shards are not whole heads and the attention's reshape "
                                      f"fails: {first_line(e)}") from e
                raise

        opt = adamw(model.parameters(), a)
        step = plain_step(forward, opt, list(model.parameters()), a.max_grad_norm)
        desc = (f"transformers {transformers.__version__} tensor parallelism: from_pretrained(distributed_config="
                f"DistributedConfig({', '.join(f'{k}={v}' for k, v in dc.items())})), its tp plan on mesh "
                f"{tuple(mm.get_mesh(('dp_replicate', 'fsdp', 'tp')).shape)} (dp_replicate, fsdp, tp), lm_head "
                f"colwise_gather_output" + (f", FSDP2 over dp_replicate {dp} × fsdp 1 (transformers')" if dp > 1 else ""))
    elif kind == "pp":
        if config.tie_word_embeddings:
            raise Unsupported("tied embeddings across pipeline stages: torch.distributed.pipelining has no shared-weight support between stages")
        pipe = Pipeline(a, sizes, world, config.num_hidden_layers,
                        lambda s, layers, first, last: LlamaStage(model, layers, first, last))
        del model  # what no stage of this rank holds is freed
        pp, dp, pp_rank, dp_rank = pipe.pp, pipe.dp, pipe.pp_rank, pipe.dp_rank
        opt = adamw(pipe.params, a)
        step = pipeline_step(pipe, opt, a.max_grad_norm)
        desc = pipe.desc + " (LlamaStage: rotary positions and causal mask recomputed on every stage)"
    elif kind == "accelerate":
        accelerate_probe(a, world)
        return
    else:
        raise SystemExit(f"unknown layout kind {kind}")

    per_replica = a.global_batch // dp
    if per_replica * dp != a.global_batch:
        raise Unsupported(f"--global-batch {a.global_batch} does not split over dp {dp}")
    batches = iter(Batches(tokens, a.seq_len, per_replica, dp_rank, dp, a.seed))
    tokens_per_step = a.global_batch * a.seq_len
    train("nd_llama", a, Job(step, batches, tokens_per_step, pp=pp, dp=dp, tp=tp, pp_rank=pp_rank, dp_rank=dp_rank,
                             tp_rank=tp_rank, n_params=n_params, desc=desc,
                             extra={"transformers": transformers.__version__,
                                    "attn_implementation": a.attn_implementation},
                             banner="LlamaForCausalLM, " + banner(a, n_params, describe(config), per_replica,
                                                                   tokens_per_step, threads)
                             + f", transformers {transformers.__version__}"))


if __name__ == "__main__":
    main("nd_llama", parse(), run)
