//! Reading the job layout from torchrun, Slurm, Open MPI and PMI variables, and the errors that name a variable.

use ddp_core::env::{init_options_from_lookup, parse_bool};
use ddp_core::{BackendKind, DdpError, DistEnv, EnvSource, RunToken, DEFAULT_COLLECTIVE_TIMEOUT};
use std::collections::HashMap;
use std::time::Duration;

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| map.get(k).cloned()
}

fn parse(vars: &[(&str, &str)]) -> ddp_core::Result<DistEnv> {
    DistEnv::from_lookup(lookup(vars))
}

/// Asserts an Env error naming `var` whose message contains every one of `words`.
fn assert_env_error(vars: &[(&str, &str)], var: &str, words: &[&str]) {
    match parse(vars) {
        Err(e @ DdpError::Env { .. }) => {
            let DdpError::Env { var: got, .. } = &e else { unreachable!() };
            assert_eq!(got, var, "{e}");
            let msg = e.to_string();
            for w in words {
                assert!(msg.contains(w), "{msg:?} should contain {w:?}");
            }
        }
        other => panic!("{vars:?}: expected an Env error naming {var}, got {other:?}"),
    }
}

#[test]
fn torchrun_names_with_every_variable() {
    let env = parse(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "1234"),
        ("ACCEL_USE_AGENT_STORE", "1"),
    ])
    .unwrap();
    assert_eq!(
        env,
        DistEnv {
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: 4,
            node_rank: 1,
            master_addr: "10.0.0.1".into(),
            master_port: 1234,
            source: EnvSource::Torchrun,
            agent_store: true,
        }
    );
    assert!(env.is_multi_node());
}

#[test]
fn torchrun_defaults_on_one_machine() {
    let env = parse(&[("RANK", "2"), ("WORLD_SIZE", "3")]).unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank), (2, 3, 2, 3, 0));
    assert_eq!((env.master_addr.as_str(), env.master_port), ("127.0.0.1", 29500));
    assert!(!env.agent_store && !env.is_multi_node());

    // Local size given, local rank derived from block placement; node rank likewise.
    let env = parse(&[("RANK", "5"), ("WORLD_SIZE", "6"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).unwrap();
    assert_eq!((env.local_rank, env.local_world_size, env.node_rank), (1, 2, 2));

    // Empty values count as unset; surrounding whitespace is ignored.
    let env = parse(&[("RANK", " 0 "), ("WORLD_SIZE", "1"), ("MASTER_ADDR", ""), ("LOCAL_RANK", "")]).unwrap();
    assert_eq!((env.rank, env.world_size, env.master_addr.as_str()), (0, 1, "127.0.0.1"));
}

#[test]
fn torchrun_wins_over_slurm_and_mpi_names() {
    let env = parse(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "1"),
    ])
    .unwrap();
    assert_eq!((env.source, env.rank, env.world_size), (EnvSource::Torchrun, 1, 2));
}

#[test]
fn slurm_names() {
    let env = parse(&[
        ("SLURM_PROCID", "7"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "3"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NTASKS_PER_NODE", "4"),
        ("MASTER_ADDR", "node001"),
    ])
    .unwrap();
    assert_eq!(env.source, EnvSource::Slurm);
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank), (7, 8, 3, 4, 1));
    assert_eq!(env.master_addr, "node001");

    // SLURM_TASKS_PER_NODE's compressed form: 2(x3),1 = nodes 0..2 run 2 tasks, node 3 runs 1.
    let base = [("SLURM_PROCID", "6"), ("SLURM_NTASKS", "7"), ("SLURM_LOCALID", "0"), ("MASTER_ADDR", "n0")];
    let with = |node: &'static str, list: &'static str| {
        let mut v = base.to_vec();
        v.push(("SLURM_NODEID", node));
        v.push(("SLURM_TASKS_PER_NODE", list));
        v
    };
    let env = parse(&with("3", "2(x3),1")).unwrap();
    assert_eq!((env.local_world_size, env.node_rank), (1, 3));
    let env = parse(&with("1", "2(x3),1")).unwrap();
    assert_eq!(env.local_world_size, 2);

    // Single node, SLURM_TASKS_PER_NODE without a node id and the same count everywhere.
    let env = parse(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_TASKS_PER_NODE", "2")]).unwrap();
    assert_eq!((env.local_rank, env.local_world_size, env.node_rank, env.master_addr.as_str()), (1, 2, 0, "127.0.0.1"));
}

#[test]
fn slurm_errors_name_the_variable() {
    assert_env_error(&[("SLURM_PROCID", "0")], "SLURM_NTASKS", &["SLURM_PROCID"]);
    assert_env_error(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_NODEID", "0"), ("SLURM_TASKS_PER_NODE", "2(y2)")],
        "SLURM_TASKS_PER_NODE",
        &["2(y2)"],
    );
    assert_env_error(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_NODEID", "5"), ("SLURM_TASKS_PER_NODE", "2(x2)")],
        "SLURM_NODEID",
        &["node 5"],
    );
    assert_env_error(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3"), ("SLURM_TASKS_PER_NODE", "2,1"), ("MASTER_ADDR", "x")],
        "SLURM_NODEID",
        &["differs between nodes"],
    );
    // Several machines and no MASTER_ADDR: a hint on how to get it from Slurm.
    assert_env_error(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_NODEID", "0"), ("SLURM_TASKS_PER_NODE", "2(x2)")],
        "MASTER_ADDR",
        &["several machines", "scontrol"],
    );
    assert_env_error(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "2"), ("SLURM_NTASKS_PER_NODE", "2")],
        "SLURM_LOCALID",
        &["SLURM_LOCALID = 2 is not below SLURM_NTASKS_PER_NODE = 2"],
    );
}

#[test]
fn open_mpi_names() {
    let env = parse(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("MASTER_ADDR", "head"),
        ("MASTER_PORT", "29600"),
    ])
    .unwrap();
    assert_eq!(env.source, EnvSource::OpenMpi);
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank), (3, 4, 1, 2, 1));
    assert_eq!(env.master_port, 29600);
    assert_env_error(&[("OMPI_COMM_WORLD_SIZE", "2")], "OMPI_COMM_WORLD_RANK", &["OMPI_COMM_WORLD_SIZE"]);
    assert_env_error(
        &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "3")],
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        &["outside 1..=2"],
    );
}

#[test]
fn pmi_names() {
    let env = parse(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap();
    assert_eq!(env.source, EnvSource::Pmi);
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank), (1, 2, 1, 2, 0));
    let env = parse(&[
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "2"),
        ("MASTER_ADDR", "h"),
    ])
    .unwrap();
    assert_eq!((env.local_rank, env.local_world_size, env.node_rank), (0, 2, 1));
    assert_env_error(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")], "PMI_RANK", &["\"x\" is not a valid number"]);
}

#[test]
fn torchrun_errors_name_the_variable() {
    assert_env_error(&[("RANK", "0")], "WORLD_SIZE", &["not set", "RANK"]);
    assert_env_error(&[("WORLD_SIZE", "2")], "RANK", &["not set", "WORLD_SIZE"]);
    assert_env_error(&[("RANK", "zero"), ("WORLD_SIZE", "2")], "RANK", &["\"zero\"", "not a valid number"]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "-2")], "WORLD_SIZE", &["\"-2\""]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE", &["at least 1"]);
    assert_env_error(&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK", &["RANK = 2 is not below WORLD_SIZE = 2"]);
    assert_env_error(
        &[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
        "LOCAL_RANK",
        &["LOCAL_RANK = 2 is not below LOCAL_WORLD_SIZE = 2"],
    );
    assert_env_error(
        &[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")],
        "LOCAL_WORLD_SIZE",
        &["LOCAL_RANK = 1 differs from RANK = 3"],
    );
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "0")], "LOCAL_WORLD_SIZE", &["1..=2"]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "a")], "LOCAL_RANK", &["\"a\""]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("GROUP_RANK", "?")], "GROUP_RANK", &["\"?\""]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")], "MASTER_PORT", &["70000"]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")], "MASTER_PORT", &["free port"]);
    assert_env_error(
        &[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")],
        "MASTER_ADDR",
        &["several machines"],
    );
    assert_env_error(
        &[("RANK", "0"), ("WORLD_SIZE", "1"), ("ACCEL_USE_AGENT_STORE", "maybe")],
        "ACCEL_USE_AGENT_STORE",
        &["\"maybe\""],
    );
    // Port 0 is fine when the launcher hosts the store (it passes the real port) or the job is one process.
    assert!(parse(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0"), ("ACCEL_USE_AGENT_STORE", "1")]).is_ok());
    assert!(parse(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "0")]).is_ok());
}

#[test]
fn no_layout_at_all_lists_what_was_looked_for() {
    for vars in [&[][..], &[("LOCAL_RANK", "0"), ("SLURM_NTASKS", "4")][..]] {
        match parse(vars) {
            Err(e @ DdpError::Env { .. }) => {
                let msg = e.to_string();
                for name in ["RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "accel launch"] {
                    assert!(msg.contains(name), "{msg:?} should mention {name}");
                }
            }
            other => panic!("expected an Env error, got {other:?}"),
        }
    }
}

#[test]
fn init_options_from_the_environment() {
    let token = RunToken::generate().unwrap();
    let hex = token.to_hex();
    let opts = init_options_from_lookup(lookup(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_PORT", "4567"),
        ("ACCEL_TIMEOUT", "12.5"),
        ("ACCEL_BACKEND", "gloo"),
        ("ACCEL_RUN_TOKEN", &hex),
    ]))
    .unwrap();
    assert_eq!((opts.rank, opts.world_size, opts.local_rank, opts.local_world_size), (0, 2, 0, 2));
    assert_eq!((opts.master_addr.as_str(), opts.master_port), ("127.0.0.1", 4567));
    assert!(opts.host_store, "rank 0 hosts the store when no launcher does");
    assert_eq!(opts.timeout, Duration::from_millis(12_500));
    assert_eq!(opts.backend, BackendKind::Cpu);
    assert_eq!(opts.token, Some(token));
    assert_eq!(opts.store_bind_addr, None);

    // Defaults; rank 0 under a launcher that hosts the store does not host one; other ranks never do.
    let opts = init_options_from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("ACCEL_USE_AGENT_STORE", "1")]))
        .unwrap();
    assert!(!opts.host_store);
    assert_eq!((opts.timeout, opts.backend, opts.token), (DEFAULT_COLLECTIVE_TIMEOUT, BackendKind::Cpu, None));
    let opts = init_options_from_lookup(lookup(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
    assert!(!opts.host_store);

    let err = |vars: &[(&str, &str)]| init_options_from_lookup(lookup(vars)).unwrap_err().to_string();
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("ACCEL_TIMEOUT", "-3")]);
    assert!(e.contains("ACCEL_TIMEOUT") && e.contains("\"-3\""), "{e}");
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("ACCEL_BACKEND", "carrier-pigeon")]);
    assert!(e.contains("ACCEL_BACKEND") && e.contains("carrier-pigeon"), "{e}");
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("ACCEL_RUN_TOKEN", "1234")]);
    assert!(e.contains("ACCEL_RUN_TOKEN") && e.contains("32 hex digits"), "{e}");
    let e = err(&[("WORLD_SIZE", "1")]);
    assert!(e.contains("RANK"), "{e}");
}

#[test]
fn booleans() {
    assert!(parse_bool("X", "1").unwrap() && parse_bool("X", "True").unwrap() && parse_bool("X", "yes").unwrap());
    assert!(!parse_bool("X", "0").unwrap() && !parse_bool("X", "false").unwrap());
    assert!(parse_bool("X", "2").unwrap_err().to_string().contains("X"));
}
