//! `DeviceMesh` on 4 ranks as threads: every layout's coordinates, the members of each group (tp innermost, pp
//! outermost, as Megatron-LM / torchtitan / Accelerate), an all_reduce in every group giving the sum of its
//! members' values, size-1 dimensions, and the errors.
//!
//! The reference is an independent enumeration: ranks counted in nested loops `pp, dp_replicate, dp_shard, tp`
//! (tp fastest), and a group = the ranks whose coordinates equal this rank's outside the group's dimensions.

use crate::common::run_ranks;
use ddp_core::{DeviceMesh, MeshDim, MeshShape, ReduceOp};

/// `(pp, dp_replicate, dp_shard, tp)` of every rank, by nested loops (tp innermost).
fn reference_coords(s: MeshShape) -> Vec<[usize; 4]> {
    let mut out = Vec::new();
    for pp in 0..s.pp {
        for dpr in 0..s.dp_replicate {
            for dps in 0..s.dp_shard {
                for tp in 0..s.tp {
                    out.push([pp, dpr, dps, tp]);
                }
            }
        }
    }
    out
}

/// Which coordinates (pp, dp_replicate, dp_shard, tp) vary inside a group of `dim`.
fn varies(dim: MeshDim) -> [bool; 4] {
    match dim {
        MeshDim::Pp => [true, false, false, false],
        MeshDim::DpReplicate => [false, true, false, false],
        MeshDim::DpShard => [false, false, true, false],
        MeshDim::Tp => [false, false, false, true],
        MeshDim::Dp => [false, true, true, false],
        MeshDim::ModelParallel => [true, false, false, true],
    }
}

/// The world ranks of `rank`'s `dim` group, ascending (which is group-rank order: within a group the rank grows
/// with the varying coordinates, taken outer to inner).
fn reference_group(s: MeshShape, rank: usize, dim: MeshDim) -> Vec<usize> {
    let coords = reference_coords(s);
    let v = varies(dim);
    (0..coords.len()).filter(|&r| (0..4).all(|i| v[i] || coords[r][i] == coords[rank][i])).collect()
}

/// What one rank sees of a mesh: its coordinates, and per group (in `MeshDim::ALL` order) the members, its own
/// group rank, and the all_reduce SUM of `world rank + 1` over the group.
type RankView = ([usize; 4], Vec<(Vec<usize>, usize, u64)>);

fn build(shape: [usize; 4]) -> (MeshShape, Vec<RankView>) {
    let s = MeshShape::new(shape[0], shape[1], shape[2], shape[3]).unwrap();
    let views = run_ranks(4, None, move |pg| {
        let mesh = DeviceMesh::new(&pg, s).unwrap();
        assert_eq!(mesh.shape(), s);
        let c = mesh.coord();
        let groups = MeshDim::ALL
            .iter()
            .map(|&dim| {
                let g = mesh.group(dim);
                let mut v = [pg.rank() as i64 + 1];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                (g.members().to_vec(), g.rank(), v[0] as u64)
            })
            .collect();
        // The named accessors are the same groups.
        assert_eq!(mesh.tp().members(), mesh.group(MeshDim::Tp).members());
        assert_eq!(mesh.dp().members(), mesh.group(MeshDim::Dp).members());
        assert_eq!(mesh.pp().members(), mesh.group(MeshDim::Pp).members());
        assert_eq!(mesh.model_parallel().members(), mesh.group(MeshDim::ModelParallel).members());
        assert_eq!(mesh.world().world_size(), 4);
        // Collectives on the world still work after the groups were built.
        pg.barrier().unwrap();
        ([c.pp, c.dp_replicate, c.dp_shard, c.tp], groups)
    });
    (s, views)
}

/// Checks every rank's view against the reference enumeration; returns the views for layout-specific checks.
fn check(shape: [usize; 4]) -> Vec<RankView> {
    let (s, views) = build(shape);
    let coords = reference_coords(s);
    for (rank, (coord, groups)) in views.iter().enumerate() {
        assert_eq!(*coord, coords[rank], "{s}: coordinates of rank {rank}");
        assert_eq!(
            s.coord(rank),
            ddp_core::MeshCoord { pp: coord[0], dp_replicate: coord[1], dp_shard: coord[2], tp: coord[3] }
        );
        assert_eq!(s.rank(s.coord(rank)), rank);
        for (&dim, (members, group_rank, sum)) in MeshDim::ALL.iter().zip(groups) {
            let expected = reference_group(s, rank, dim);
            assert_eq!(members, &expected, "{s}: {} group of rank {rank}", dim.name());
            assert_eq!(members.len(), s.size(dim), "{s}: size of the {} group", dim.name());
            assert_eq!(s.group_ranks(rank, dim), expected, "{s}: MeshShape::group_ranks {}", dim.name());
            assert_eq!(members[*group_rank], rank, "{s}: group rank of {rank} in {}", dim.name());
            let want: u64 = expected.iter().map(|&r| r as u64 + 1).sum();
            assert_eq!(*sum, want, "{s}: all_reduce over the {} group of rank {rank}", dim.name());
        }
    }
    views
}

/// Index of a dim in `MeshDim::ALL`.
fn at(dim: MeshDim) -> usize {
    MeshDim::ALL.iter().position(|&d| d == dim).unwrap()
}

#[test]
fn pure_data_parallel_1_4_1_1() {
    let v = check([1, 4, 1, 1]);
    for (rank, (coord, groups)) in v.iter().enumerate() {
        assert_eq!(*coord, [0, rank, 0, 0]);
        // Size-1 dimensions: a group of this rank alone, whose all_reduce is its own value.
        assert_eq!(groups[at(MeshDim::Tp)], (vec![rank], 0, rank as u64 + 1));
        assert_eq!(groups[at(MeshDim::Pp)], (vec![rank], 0, rank as u64 + 1));
        assert_eq!(groups[at(MeshDim::DpShard)], (vec![rank], 0, rank as u64 + 1));
        assert_eq!(groups[at(MeshDim::ModelParallel)].0, vec![rank]);
        assert_eq!(groups[at(MeshDim::Dp)], (vec![0, 1, 2, 3], rank, 10));
        assert_eq!(groups[at(MeshDim::DpReplicate)].0, vec![0, 1, 2, 3]);
    }
}

#[test]
fn dp2_tp2_1_2_1_2_puts_tp_innermost() {
    let v = check([1, 2, 1, 2]);
    let tp = |r: usize| v[r].1[at(MeshDim::Tp)].0.clone();
    let dp = |r: usize| v[r].1[at(MeshDim::Dp)].0.clone();
    // The tp group of rank 1 is {0, 1}: neighbouring ranks (the same machine when possible).
    assert_eq!((tp(0), tp(1), tp(2), tp(3)), (vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]));
    assert_eq!((dp(0), dp(1), dp(2), dp(3)), (vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]));
    assert_eq!(v[3].0, [0, 1, 0, 1]);
    // Sums: tp {0,1} → 1 + 2 = 3, tp {2,3} → 7; dp {0,2} → 4, dp {1,3} → 6.
    let sums: Vec<(u64, u64)> = v.iter().map(|(_, g)| (g[at(MeshDim::Tp)].2, g[at(MeshDim::Dp)].2)).collect();
    assert_eq!(sums, [(3, 4), (3, 6), (7, 4), (7, 6)]);
}

#[test]
fn tensor_parallel_only_1_1_1_4() {
    let v = check([1, 1, 1, 4]);
    for (rank, (coord, groups)) in v.iter().enumerate() {
        assert_eq!(*coord, [0, 0, 0, rank]);
        assert_eq!(groups[at(MeshDim::Tp)], (vec![0, 1, 2, 3], rank, 10));
        // No data-parallel dimension at all (Accelerate PR #3986's crash): the dp group is this rank alone.
        assert_eq!(groups[at(MeshDim::Dp)], (vec![rank], 0, rank as u64 + 1));
        assert_eq!(groups[at(MeshDim::ModelParallel)].0, vec![0, 1, 2, 3]);
    }
}

#[test]
fn pipeline_and_tensor_2_1_1_2_puts_pp_outermost() {
    let v = check([2, 1, 1, 2]);
    let coords: Vec<[usize; 4]> = v.iter().map(|(c, _)| *c).collect();
    assert_eq!(coords, [[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]]);
    let pp: Vec<Vec<usize>> = v.iter().map(|(_, g)| g[at(MeshDim::Pp)].0.clone()).collect();
    assert_eq!(pp, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]);
    // Model parallel = pp × tp = every rank; pp rank 1 holds group ranks 2, 3.
    assert!(v.iter().all(|(_, g)| g[at(MeshDim::ModelParallel)].0 == [0, 1, 2, 3]));
    assert_eq!(v[2].1[at(MeshDim::ModelParallel)].1, 2);
}

#[test]
fn sharded_data_and_tensor_1_1_2_2() {
    let v = check([1, 1, 2, 2]);
    let shard: Vec<Vec<usize>> = v.iter().map(|(_, g)| g[at(MeshDim::DpShard)].0.clone()).collect();
    assert_eq!(shard, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]);
    // dp = replicate × shard = the shard group here; replicate is size 1.
    assert!(v.iter().all(|(_, g)| g[at(MeshDim::Dp)].0 == g[at(MeshDim::DpShard)].0));
    assert!(v.iter().enumerate().all(|(r, (_, g))| g[at(MeshDim::DpReplicate)].0 == [r]));
}

#[test]
fn shapes_that_do_not_fit_the_world_are_refused() {
    let out =
        run_ranks(4, None, |pg| DeviceMesh::new(&pg, MeshShape::new(1, 1, 1, 2).unwrap()).unwrap_err().to_string());
    assert_eq!(
        out[0],
        "invalid argument: DeviceMesh: the layout [pp 1, dp_replicate 1, dp_shard 1, tp 2] needs pp × dp_replicate × \
         dp_shard × tp = 2 processes, but the job has 4; change the sizes so that their product is 4"
    );
    assert!(out.iter().all(|e| *e == out[0]));
    let e = MeshShape::new(1, 0, 1, 4).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid argument: DeviceMesh: dp_replicate size is 0 in [pp 1, dp_replicate 0, dp_shard 1, tp 4]; every size \
         is at least 1 (1 = that dimension is off)"
    );
}

#[test]
fn a_mesh_over_one_process_has_every_group_of_size_one() {
    let out = run_ranks(1, None, |pg| {
        let mesh = DeviceMesh::single_process(&pg).unwrap();
        MeshDim::ALL.iter().map(|&d| mesh.group(d).world_size()).collect::<Vec<_>>()
    });
    assert_eq!(out[0], [1; 6]);
}
