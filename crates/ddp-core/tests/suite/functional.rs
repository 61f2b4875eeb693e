//! Differentiable collectives (`ddp_core::functional`): forward values and gradients through `Var` +
//! `backward` on 2 and 4 ranks (threads), against hand-computed references. All inputs are small integers
//! in f32, so sums and products are exact and every comparison is exact (tolerance 0).

use crate::common::run_ranks;
use candle_core::{Device, Tensor, Var};
use ddp_core::functional::{copy_to_group, gather_from_group, reduce_from_group, split_to_group};
use ddp_core::ProcessGroup;

/// Rank `rank`'s deterministic input of shape `dims`: small integers (exact in f32), different per rank.
fn data(rank: usize, salt: usize, dims: &[usize]) -> Vec<f32> {
    let n: usize = dims.iter().product();
    (0..n).map(|i| ((rank * 7 + salt * 3 + i * 5) % 9) as f32 - 4.0).collect()
}

fn tensor(rank: usize, salt: usize, dims: &[usize]) -> Tensor {
    Tensor::from_vec(data(rank, salt, dims), dims, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `y` and the gradient of `Σ y ⊙ w` with respect to `x` (`w` = this rank's weights of `y`'s shape).
fn forward_backward(x: &Var, y: &Tensor, w: &Tensor) -> (Vec<f32>, Vec<f32>) {
    let loss = y.mul(w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    (values(y), values(grads.get(x).expect("x has a gradient")))
}

/// The chunks of `full` (shape `dims`) along `dim`, one per rank, concatenated in rank order = `full`; returns
/// chunk `r` of `world`.
fn chunk(full: &Tensor, dim: usize, r: usize, world: usize) -> Tensor {
    let len = full.dim(dim).unwrap() / world;
    full.narrow(dim, r * len, len).unwrap()
}

fn check_copy(world: usize) {
    let dims = [2, 3];
    let out = run_ranks(world, None, move |pg| {
        let x = Var::from_tensor(&tensor(pg.rank(), 0, &dims)).unwrap();
        let y = copy_to_group(x.as_tensor(), &pg).unwrap();
        forward_backward(&x, &y, &tensor(pg.rank(), 1, &dims))
    });
    // Forward: identity. Backward: the weights summed over the ranks.
    let sum_w = (0..world).map(|r| tensor(r, 1, &dims)).reduce(|a, b| (a + b).unwrap()).unwrap();
    for (r, (y, gx)) in out.iter().enumerate() {
        assert_eq!(y, &data(r, 0, &dims), "rank {r} forward");
        assert_eq!(gx, &values(&sum_w), "rank {r} gradient");
    }
}

fn check_reduce(world: usize) {
    let dims = [3, 2];
    let out = run_ranks(world, None, move |pg| {
        let x = Var::from_tensor(&tensor(pg.rank(), 0, &dims)).unwrap();
        let y = reduce_from_group(x.as_tensor(), &pg).unwrap();
        forward_backward(&x, &y, &tensor(pg.rank(), 1, &dims))
    });
    // Forward: the inputs summed. Backward: this rank's weights unchanged.
    let sum_x = (0..world).map(|r| tensor(r, 0, &dims)).reduce(|a, b| (a + b).unwrap()).unwrap();
    for (r, (y, gx)) in out.iter().enumerate() {
        assert_eq!(y, &values(&sum_x), "rank {r} forward");
        assert_eq!(gx, &data(r, 1, &dims), "rank {r} gradient");
    }
}

fn check_gather(world: usize, dim: usize) {
    let dims = [2, 3, 2];
    let out = run_ranks(world, None, move |pg| {
        let x = Var::from_tensor(&tensor(pg.rank(), 0, &dims)).unwrap();
        let y = gather_from_group(x.as_tensor(), &pg, dim).unwrap();
        let mut full = dims.to_vec();
        full[dim] *= pg.world_size();
        assert_eq!(y.dims(), full.as_slice());
        forward_backward(&x, &y, &tensor(pg.rank(), 1, &full))
    });
    let xs: Vec<Tensor> = (0..world).map(|r| tensor(r, 0, &dims)).collect();
    let gathered = Tensor::cat(&xs, dim).unwrap();
    let mut full = dims.to_vec();
    full[dim] *= world;
    for (r, (y, gx)) in out.iter().enumerate() {
        assert_eq!(y, &values(&gathered), "rank {r} forward (dim {dim})");
        // Backward: this rank's chunk of its own weights.
        assert_eq!(gx, &values(&chunk(&tensor(r, 1, &full), dim, r, world)), "rank {r} gradient (dim {dim})");
    }
}

fn check_split(world: usize, dim: usize) {
    let mut full = vec![2, 3, 2];
    full[dim] *= world;
    let full2 = full.clone();
    let out = run_ranks(world, None, move |pg| {
        let x = Var::from_tensor(&tensor(pg.rank(), 0, &full2)).unwrap();
        let y = split_to_group(x.as_tensor(), &pg, dim).unwrap();
        forward_backward(&x, &y, &tensor(pg.rank(), 1, y.dims()))
    });
    let chunk_dims = [2, 3, 2];
    let ws: Vec<Tensor> = (0..world).map(|r| tensor(r, 1, &chunk_dims)).collect();
    let gathered_w = Tensor::cat(&ws, dim).unwrap();
    for (r, (y, gx)) in out.iter().enumerate() {
        assert_eq!(y, &values(&chunk(&tensor(r, 0, &full), dim, r, world)), "rank {r} forward (dim {dim})");
        // Backward: every rank's weights, gathered along `dim`.
        assert_eq!(gx, &values(&gathered_w), "rank {r} gradient (dim {dim})");
    }
}

#[test]
fn copy_to_group_is_identity_forward_all_reduce_backward() {
    check_copy(2);
    check_copy(4);
}

#[test]
fn reduce_from_group_is_all_reduce_forward_identity_backward() {
    check_reduce(2);
    check_reduce(4);
}

#[test]
fn gather_from_group_gathers_forward_and_keeps_own_chunk_backward() {
    for dim in 0..3 {
        check_gather(2, dim);
    }
    check_gather(4, 1);
    check_gather(4, 2);
}

#[test]
fn split_to_group_keeps_own_chunk_forward_and_gathers_backward() {
    for dim in 0..3 {
        check_split(2, dim);
    }
    check_split(4, 0);
    check_split(4, 2);
}

/// f ∘ (a sharded scaling) ∘ g, Megatron's column→row pattern: `z = g(c_r ⊙ f(x))` = `x ⊙ Σ_r c_r` on every
/// rank, so `∂Σz/∂x = Σ_r c_r` — once, not × world (pytorch#58005: a g whose backward also all-reduced, or an
/// f whose backward ran twice, would multiply it by the group size).
#[test]
fn f_then_g_gives_the_gradient_once_not_times_world() {
    for world in [2, 4] {
        let dims = [4];
        let out = run_ranks(world, None, move |pg| {
            // The input is replicated (the same on every rank), as before a column-parallel layer.
            let x = Var::from_tensor(&tensor(0, 0, &dims)).unwrap();
            let h = copy_to_group(x.as_tensor(), &pg).unwrap();
            let a = h.mul(&tensor(pg.rank(), 2, &dims)).unwrap();
            let z = reduce_from_group(&a, &pg).unwrap();
            let grads = z.sum_all().unwrap().backward().unwrap();
            (values(&z), values(grads.get(&x).unwrap()))
        });
        let sum_c = (0..world).map(|r| tensor(r, 2, &dims)).reduce(|a, b| (a + b).unwrap()).unwrap();
        let z_ref = values(&tensor(0, 0, &dims).mul(&sum_c).unwrap());
        for (r, (z, gx)) in out.iter().enumerate() {
            assert_eq!(z, &z_ref, "world {world} rank {r} forward");
            assert_eq!(gx, &values(&sum_c), "world {world} rank {r}: gradient must be Σc once");
        }
    }
}

/// Two uses of one *f* output (attention's q, k, v sharing one f): the gradients add up before f's backward,
/// which then all-reduces once.
#[test]
fn one_f_feeding_two_branches_all_reduces_the_summed_gradient() {
    let out = run_ranks(2, None, |pg| {
        let x = Var::from_tensor(&tensor(0, 0, &[3])).unwrap();
        let h = copy_to_group(x.as_tensor(), &pg).unwrap();
        let a = h.mul(&tensor(pg.rank(), 1, &[3])).unwrap();
        let b = h.mul(&tensor(pg.rank(), 2, &[3])).unwrap();
        let z = reduce_from_group(&(a + b).unwrap(), &pg).unwrap();
        let grads = z.sum_all().unwrap().backward().unwrap();
        values(grads.get(&x).unwrap())
    });
    let want: Tensor =
        (0..2).map(|r| (tensor(r, 1, &[3]) + tensor(r, 2, &[3])).unwrap()).reduce(|a, b| (a + b).unwrap()).unwrap();
    assert_eq!(out[0], values(&want));
    assert_eq!(out[1], values(&want));
}

#[test]
fn one_rank_group_is_the_identity() {
    let pg = ProcessGroup::single_process().unwrap();
    let x = Var::from_tensor(&tensor(0, 0, &[2, 4])).unwrap();
    let t = x.as_tensor();
    let y = copy_to_group(t, &pg).unwrap();
    let y = reduce_from_group(&y, &pg).unwrap();
    let y = gather_from_group(&y, &pg, 1).unwrap();
    let y = split_to_group(&y, &pg, 1).unwrap();
    assert_eq!(values(&y), values(t));
    let (_, gx) = forward_backward(&x, &y, &tensor(0, 1, &[2, 4]));
    assert_eq!(gx, data(0, 1, &[2, 4]));
}

#[test]
fn bad_dims_are_refused_with_the_sizes() {
    let out = run_ranks(2, None, |pg| {
        let x = tensor(0, 0, &[3, 2]);
        let split = split_to_group(&x, &pg, 0).unwrap_err().to_string();
        let gather = gather_from_group(&x, &pg, 2).unwrap_err().to_string();
        (split, gather)
    });
    let (split, gather) = &out[0];
    assert!(split.contains("split_to_group") && split.contains("(3)") && split.contains("group size 2"), "{split}");
    assert!(gather.contains("gather_from_group") && gather.contains("dim 2") && gather.contains("[3, 2]"), "{gather}");
}
