//! Sub-groups: `new_group(ranks)` and `split(color, key)` give members a working group with its own ranks,
//! store namespace and connections, and non-members `None`; parent and sub-group collectives interleave.

use crate::common::run_ranks;
use ddp_core::{ProcessGroup, ReduceOp};

#[test]
fn new_group_members_get_a_group_and_others_none() {
    let out = run_ranks(4, None, |pg| {
        // Unsorted on purpose: group ranks follow the sorted global ranks, as in PyTorch.
        let sub = pg.new_group(&[3, 1]).unwrap();
        let mut parent_v = [pg.rank() as i32];
        pg.all_reduce(&mut parent_v, ReduceOp::Sum).unwrap();
        assert_eq!(parent_v, [6]);
        let result = sub.map(|g| {
            assert_eq!(g.world_size(), 2);
            assert_eq!(g.members(), &[1, 3]);
            assert_eq!(g.global_rank(), pg.rank());
            let mut v = [g.rank() as f32, pg.rank() as f32];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            let mut gathered = [0i64; 2];
            g.all_gather(&[pg.rank() as i64], &mut gathered).unwrap();
            g.barrier().unwrap();
            (g.rank(), v, gathered)
        });
        pg.barrier().unwrap();
        result
    });
    assert!(out[0].is_none() && out[2].is_none());
    assert_eq!(out[1], Some((0, [1.0, 4.0], [1, 3])));
    assert_eq!(out[3], Some((1, [1.0, 4.0], [1, 3])));
}

#[test]
fn split_by_colour_orders_by_key_then_rank() {
    let out = run_ranks(4, None, |pg| {
        let r = pg.rank();
        // Even ranks: colour 0, keys reversed; rank 3 opts out; rank 1 alone in colour 7.
        let color = match r {
            0 | 2 => Some(0),
            1 => Some(7),
            _ => None,
        };
        let sub = pg.split(color, 10 - r).unwrap();
        sub.map(|g| {
            let mut v = [r as u8 + 1];
            g.all_reduce(&mut v, ReduceOp::Product).unwrap();
            (g.rank(), g.world_size(), g.members().to_vec(), v[0])
        })
    });
    assert_eq!(out[0], Some((1, 2, vec![2, 0], 3)));
    assert_eq!(out[2], Some((0, 2, vec![2, 0], 3)));
    assert_eq!(out[1], Some((0, 1, vec![1], 2)));
    assert_eq!(out[3], None);
}

#[test]
fn nested_and_repeated_sub_groups() {
    let out = run_ranks(4, None, |pg| {
        let mut sums = Vec::new();
        // The same membership twice: two independent groups.
        for _ in 0..2 {
            if let Some(g) = pg.new_group(&[0, 1, 2]).unwrap() {
                let inner = g.new_group(&[1, 2]).unwrap();
                if let Some(inner) = inner {
                    assert_eq!(inner.members(), &[1, 2]);
                    let mut v = [pg.rank() as i64 * 10];
                    inner.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    sums.push(v[0]);
                }
                let mut v = [1i64];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                sums.push(v[0]);
            }
        }
        sums
    });
    assert_eq!(out[0], vec![3, 3]);
    assert_eq!(out[1], vec![30, 3, 30, 3]);
    assert_eq!(out[2], vec![30, 3, 30, 3]);
    assert!(out[3].is_empty());
}

#[test]
fn different_rank_lists_and_bad_ranks_are_errors() {
    let out = run_ranks(2, None, |pg: ProcessGroup| {
        let dup = pg.new_group(&[0, 0]).unwrap_err().to_string();
        let range = pg.new_group(&[0, 5]).unwrap_err().to_string();
        let list = if pg.rank() == 0 { vec![0] } else { vec![0, 1] };
        let differ = pg.new_group(&list).unwrap_err().to_string();
        (dup, range, differ)
    });
    for (dup, range, differ) in out {
        assert!(dup.contains("listed twice"), "{dup}");
        assert!(range.contains("5") && range.contains("out of range"), "{range}");
        assert!(differ.contains("different rank list"), "{differ}");
    }
}
