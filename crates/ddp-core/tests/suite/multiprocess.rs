//! The CPU backend across real processes over the TCP store on 127.0.0.1: the test binary re-executes itself
//! as 3 workers (torchrun's variables, run token, store hosted by the test like the launcher does), each
//! checking every collective against the single-process reference and exiting non-zero on a mismatch.

use crate::common::procs;
use crate::common::*;
use ddp_core::{InitOptions, ProcessGroup, ReduceOp};
use std::time::Duration;

fn conformance<T: FromSmall>(pg: &ProcessGroup) {
    let (p, r) = (pg.world_size(), pg.rank());
    for op in OPS {
        for n in [0usize, 1, 7, 1001, 300_001] {
            let mut v = input::<T>(r, n);
            pg.all_reduce(&mut v, op).unwrap();
            assert!(bits(&v) == bits(&reference::<T>(p, n, op)), "all_reduce {:?} {op:?} n={n}", T::DTYPE);
        }
        let n = 1001;
        let mut out = vec![T::zeroed(); n];
        pg.reduce_scatter(&input::<T>(r, n * p), &mut out, op).unwrap();
        assert!(bits(&out) == bits(&reference::<T>(p, n * p, op)[r * n..(r + 1) * n]), "reduce_scatter {op:?}");
    }
    for n in [0usize, 5, 200_003] {
        let mut out = vec![T::zeroed(); n * p];
        pg.all_gather(&input::<T>(r, n), &mut out).unwrap();
        let want: Vec<T> = (0..p).flat_map(|q| input::<T>(q, n)).collect();
        assert!(bits(&out) == bits(&want), "all_gather n={n}");
        let mut v = input::<T>(r, n);
        pg.broadcast(&mut v, p - 1).unwrap();
        assert!(bits(&v) == bits(&input::<T>(p - 1, n)), "broadcast n={n}");
    }
}

#[test]
fn worker() {
    let Some(scenario) = procs::scenario() else { return };
    let pg = match scenario.as_str() {
        "conformance" => ProcessGroup::init_from_env().unwrap(),
        "rank0_hosts_store" => {
            let mut opts = InitOptions::from_env().unwrap();
            opts.host_store = opts.rank == 0;
            ProcessGroup::init(opts).unwrap()
        }
        other => panic!("unknown scenario {other}"),
    };
    assert_eq!(pg.backend_name(), "cpu");
    conformance::<f32>(&pg);
    if scenario == "conformance" {
        conformance::<f64>(&pg);
        conformance::<half::f16>(&pg);
        conformance::<half::bf16>(&pg);
        conformance::<i32>(&pg);
        conformance::<i64>(&pg);
        conformance::<u8>(&pg);
        // Sub-groups across processes.
        let sub = pg.new_group(&[0, 2]).unwrap();
        assert_eq!(sub.is_some(), pg.rank() != 1);
        if let Some(sub) = sub {
            let mut v = [pg.rank() as i64 + 1];
            sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v, [4]);
        }
        let mut v = [pg.rank() as u8];
        let (p, r) = (pg.world_size(), pg.rank());
        if r == 0 {
            pg.send(&v, 1).unwrap();
        } else if r == 1 {
            pg.recv(&mut v, 0).unwrap();
            assert_eq!(v, [0]);
        }
        let _ = p;
    }
    pg.barrier().unwrap();
    println!("rank {} ok", pg.rank());
}

fn assert_all_ok(results: Vec<(Option<i32>, String, String)>) {
    for (rank, (code, out, err)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}\n{err}");
        assert!(out.contains(&format!("rank {rank} ok")), "rank {rank}:\n{out}\n{err}");
    }
}

#[test]
fn three_processes_every_collective_and_dtype_over_tcp() {
    let job = procs::spawn("multiprocess::worker", "conformance", 3, &[]);
    assert_all_ok(procs::wait_all(job, Duration::from_secs(240)));
}

#[test]
fn three_processes_over_tcp_only() {
    // No shared memory: large all_reduce takes the segmented TCP ring between processes.
    let job = procs::spawn("multiprocess::worker", "conformance", 3, &[("ACCEL_CPU_SHM", "0".to_string())]);
    assert_all_ok(procs::wait_all(job, Duration::from_secs(240)));
}

#[test]
fn rank_zero_can_host_the_store() {
    // No launcher: rank 0 binds MASTER_PORT itself. Take a free port from the OS, then free it for rank 0.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let token = ddp_core::RunToken::generate().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(["--exact", "multiprocess::worker", "--nocapture", "--test-threads=1"])
                .env(procs::SCENARIO_ENV, "rank0_hosts_store")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(ddp_core::RUN_TOKEN_ENV, token.to_hex())
                .env_remove("ACCEL_USE_AGENT_STORE")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let server = ddp_core::TcpStoreServer::bind("127.0.0.1:0", token).unwrap(); // unused; keeps Job's shape
    assert_all_ok(procs::wait_all(procs::Job { server, children }, Duration::from_secs(120)));
}
