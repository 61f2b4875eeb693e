//! Starting a world process group under `mpirun` / `srun`: the layout comes from MPI itself, and the
//! rendezvous store is set up through MPI (no MASTER_ADDR / MASTER_PORT / ACCEL_RUN_TOKEN needed).
//!
//! Rank 0 binds a [`TcpStoreServer`] on a free port (loopback when every rank runs on this machine, all
//! interfaces otherwise) and broadcasts `host:port` and the run token with `MPI_Bcast`; every rank connects.
//! The store is what sub-groups and higher levels (DDP's parameter check, the Accelerator) use for small facts;
//! collectives go through MPI communicators.

use super::backend::MpiBackend;
use crate::backend::{Backend, BackendKind};
use crate::process_group::{GroupOptions, InitOptions};
use crate::store::{MemoryStore, Store, TcpStore, TcpStoreServer};
use crate::token::RunToken;
use crate::{DdpError, ProcessGroup, Result};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of the bootstrap message (`host:port\ntoken` or `ERR\nreason`).
const BOOT_BYTES: usize = 1024;
/// Bytes of a processor name in the layout exchange (MPI_MAX_PROCESSOR_NAME is 256 in Open MPI and MPICH).
const NAME_BYTES: usize = 256;

/// The job layout as MPI sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpiLayout {
    /// Rank in `MPI_COMM_WORLD`.
    pub rank: usize,
    /// Size of `MPI_COMM_WORLD`.
    pub world_size: usize,
    /// Rank among the processes on this machine (same processor name), in world-rank order.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Whether every rank runs on this machine.
    pub single_node: bool,
}

impl ProcessGroup {
    /// The world group of a job started by `mpirun` / `srun` / `mpiexec`, on the MPI backend: rank, world size
    /// and local rank come from MPI, the store is set up through MPI. Every process of the job calls it.
    /// `timeout` bounds every collective and store wait (see the MPI watchdog for what a timeout does).
    pub fn init_mpi(timeout: Duration) -> Result<Self> {
        let mut opts = InitOptions::single_process();
        opts.backend = BackendKind::Mpi;
        opts.timeout = timeout;
        init_world(opts, false)
    }
}

/// The world group on the MPI backend (what `ProcessGroup::init` does for [`BackendKind::Mpi`]).
///
/// With `check_layout`, `opts.rank` / `opts.world_size` (from the environment) must agree with MPI's, else
/// [`DdpError::InvalidArgument`] names both. `opts.store_bind_addr` overrides where rank 0's store listens;
/// `opts.token` (else ACCEL_RUN_TOKEN, else a fresh one) protects the store.
pub fn init_world(opts: InitOptions, check_layout: bool) -> Result<ProcessGroup> {
    let boot = MpiBackend::world(opts.timeout)?;
    let layout = layout(&boot)?;
    if check_layout && (opts.rank != layout.rank || opts.world_size != layout.world_size) {
        return Err(DdpError::InvalidArgument(format!(
            "the environment says rank {} of {} but MPI says rank {} of {}: start every rank with the same \
             launcher (mpirun -np N / srun -n N) and do not mix RANK/WORLD_SIZE from another one",
            opts.rank, opts.world_size, layout.rank, layout.world_size
        )));
    }
    let group_opts = |token: Option<RunToken>, advertise: String| GroupOptions {
        backend: BackendKind::Mpi,
        timeout: opts.timeout,
        token,
        local_rank: Some(layout.local_rank),
        local_world_size: Some(layout.local_world_size),
        advertise_host: Some(advertise),
        cpu_tuning: None,
    };
    if layout.world_size == 1 {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(opts.timeout));
        return ProcessGroup::build_world(store, None, 0, 1, group_opts(opts.token, "127.0.0.1".into()));
    }
    let (server, addr, token) = bootstrap_store(&boot, &opts, &layout)?;
    drop(boot);
    let tcp = TcpStore::connect(&addr, token, opts.timeout)?;
    let advertise = tcp.local_ip().to_string();
    let store: Arc<dyn Store> = Arc::new(tcp);
    ProcessGroup::build_world(store, server, layout.rank, layout.world_size, group_opts(Some(token), advertise))
}

/// Gathers every rank's processor name to derive local ranks.
fn layout(boot: &MpiBackend) -> Result<MpiLayout> {
    let (rank, world_size) = (boot.rank(), boot.world_size());
    let mut mine = [0u8; NAME_BYTES];
    let name = super::runtime::processor_name();
    let n = name.len().min(NAME_BYTES);
    mine[..n].copy_from_slice(&name.as_bytes()[..n]);
    let mut all = vec![0u8; NAME_BYTES * world_size];
    boot.all_gather(&mine, &mut all)?;
    let names: Vec<&[u8]> = all.chunks(NAME_BYTES).collect();
    let local_rank = names[..rank].iter().filter(|n| **n == mine.as_slice()).count();
    let local_world_size = names.iter().filter(|n| **n == mine.as_slice()).count();
    Ok(MpiLayout { rank, world_size, local_rank, local_world_size, single_node: local_world_size == world_size })
}

/// Rank 0 hosts the store and broadcasts where it is; returns (server on rank 0, address, token).
fn bootstrap_store(
    boot: &MpiBackend,
    opts: &InitOptions,
    layout: &MpiLayout,
) -> Result<(Option<Arc<TcpStoreServer>>, String, RunToken)> {
    let mut msg = [0u8; BOOT_BYTES];
    let mut server = None;
    if layout.rank == 0 {
        let hosted = host_store(opts, layout);
        let text = match &hosted {
            Ok((_, addr, token)) => format!("{addr}\n{}", token.to_hex()),
            Err(e) => format!("ERR\n{e}"),
        };
        let n = text.len().min(BOOT_BYTES);
        msg[..n].copy_from_slice(&text.as_bytes()[..n]);
        boot.broadcast(&mut msg, 0)?;
        let (s, addr, token) = hosted?;
        server = Some(Arc::new(s));
        return Ok((server, addr, token));
    }
    boot.broadcast(&mut msg, 0)?;
    let end = msg.iter().position(|&b| b == 0).unwrap_or(BOOT_BYTES);
    let text = String::from_utf8_lossy(&msg[..end]).into_owned();
    let (first, rest) = text.split_once('\n').unwrap_or((&text, ""));
    if first == "ERR" {
        return Err(DdpError::BackendUnavailable {
            backend: "mpi",
            reason: format!("rank 0 could not host the store: {rest}"),
        });
    }
    let token = RunToken::from_hex(rest.trim())?;
    Ok((server.take(), first.to_string(), token))
}

fn host_store(opts: &InitOptions, layout: &MpiLayout) -> Result<(TcpStoreServer, String, RunToken)> {
    let token = match opts.token {
        Some(t) => t,
        None => match RunToken::from_env()? {
            Some(t) => t,
            None => RunToken::generate()?,
        },
    };
    let explicit_addr = crate::env::explicit_master_addr();
    // Where the user says: the bind address given, else MASTER_ADDR (what the peers connect to), else on one node
    // loopback; only a multi-node job that names no address listens on every interface (the peers find rank 0 by
    // its host name, whose address this process cannot tell reliably), the run token still proven by every peer.
    let bind_host = match (&opts.store_bind_addr, &explicit_addr, layout.single_node) {
        (Some(b), _, _) => b.clone(),
        (None, _, true) => "127.0.0.1".to_string(),
        (None, Some(addr), false) => addr.clone(),
        (None, None, false) => "0.0.0.0".to_string(),
    };
    let server = TcpStoreServer::bind(&format!("{bind_host}:0"), token)?;
    let port = server.port();
    let connect_host = if layout.single_node {
        "127.0.0.1".to_string()
    } else {
        explicit_addr.unwrap_or_else(super::runtime::processor_name)
    };
    tracing::info!(addr = %server.local_addr(), "MPI rank 0 hosts the store; peers connect to {connect_host}:{port}");
    Ok((server, format!("{connect_host}:{port}"), token))
}
