//! [`Placement`]: where a layout's ranks land and which link each of its groups spans.
//!
//! The Accelerator lays ranks out as the mesh `[pp, dp_replicate, dp_shard, tp]`, tp innermost (Megatron's and
//! torchtitan's order): rank = `((pp_i · R + r_i) · S + s_i) · T + t_i`. The cluster's machines take consecutive
//! ranks in machine order. So a tp group is `T` consecutive ranks — inside one machine exactly when no machine
//! boundary falls inside it (with equal machines: when T divides the processes per machine) — a dp_shard group
//! strides by T, a dp_replicate group by S·T, a pp pair by R·S·T.
//!
//! A group inside one machine uses that machine's link; a group across machines is a ring through the link between
//! machines, which each machine shares among every group of the same kind that crosses it at the same time (all
//! tp groups run together, so do all dp groups, all pipeline sends): its β is the machine's β divided by that
//! count, its α the larger of the two classes'. A group of one rank communicates nothing ([`LinkClass::Local`]).

use super::cluster::{ClusterSpec, Link};
use super::layout::Layout;
use std::collections::BTreeSet;

/// Which link class a group spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinkClass {
    /// A group of one rank: no communication.
    Local,
    /// Inside one machine.
    Intra,
    /// Across machines.
    Inter,
}

impl LinkClass {
    /// `—`, `within a machine`, `across machines`.
    pub fn describe(self) -> &'static str {
        match self {
            LinkClass::Local => "—",
            LinkClass::Intra => "within a machine",
            LinkClass::Inter => "across machines",
        }
    }
}

/// The kinds of groups a layout communicates over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    /// A tensor-parallel group (T consecutive ranks).
    Tp,
    /// A dp_shard group (ZeRO's reduce-scatter and all-gather).
    DpShard,
    /// A dp_replicate group (HSDP's all-reduce of the shards).
    DpReplicate,
    /// The whole data-parallel group, dp_replicate × dp_shard (DDP's all-reduce).
    Dp,
    /// A pp rank and the next one (activations forward, their gradients back).
    PpNext,
    /// The first and the last pp rank (tied embeddings' gradient sum).
    Tied,
}

/// The link a group communicates over, as its collectives see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupLink {
    /// Inside a machine, across machines, or none.
    pub class: LinkClass,
    /// Effective α and β: across machines, β is the machine's share for this group.
    pub link: Link,
    /// Groups of this kind sharing a machine's link across machines (1 inside a machine).
    pub share: usize,
}

impl GroupLink {
    /// No communication.
    fn local() -> Self {
        GroupLink { class: LinkClass::Local, link: Link::new(0.0, f64::INFINITY), share: 1 }
    }

    /// The slower of two links: lower β, then higher α, then across machines before within one.
    fn slower(self, other: GroupLink) -> GroupLink {
        let key = |g: &GroupLink| (g.class != LinkClass::Local, -g.link.beta, g.link.alpha, g.class);
        let (a, b) = (key(&self), key(&other));
        if b.partial_cmp(&a) == Some(std::cmp::Ordering::Greater) {
            other
        } else {
            self
        }
    }
}

/// A layout's ranks on a cluster (see the module documentation).
#[derive(Debug, Clone)]
pub struct Placement {
    /// The mesh sizes `[pp, R, S, T]`.
    shape: [usize; 4],
    /// Stages per pp rank.
    virtual_stages: usize,
    /// The machine of each rank.
    machine_of: Vec<usize>,
    /// Per pp rank: the smallest memory per process among its ranks, the smallest FLOP/s, its machines.
    memory: Vec<u64>,
    flops: Vec<f64>,
    op_latency: Vec<f64>,
    sync_latency: Vec<f64>,
    memory_bandwidth: Vec<f64>,
    machines: Vec<BTreeSet<usize>>,
    /// Per group kind, per pp rank: the slowest link of its groups there.
    links: Vec<(GroupKind, Vec<GroupLink>)>,
}

impl Placement {
    /// The placement of `layout`'s ranks on `cluster` (whose world size must be the layout's).
    pub fn new(cluster: &ClusterSpec, layout: &Layout) -> Self {
        let shape = [layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp];
        let machine_of = cluster.machine_of_ranks();
        debug_assert_eq!(machine_of.len(), layout.world_size());
        let [p, r, s, t] = shape;
        let mut memory = vec![u64::MAX; p];
        let mut flops = vec![f64::INFINITY; p];
        let mut op_latency = vec![0.0f64; p];
        let mut sync_latency = vec![0.0f64; p];
        let mut memory_bandwidth = vec![f64::INFINITY; p];
        let mut machines = vec![BTreeSet::new(); p];
        for (rank, &m) in machine_of.iter().enumerate() {
            let pp_rank = rank / (r * s * t);
            let machine = &cluster.machines[m];
            memory[pp_rank] = memory[pp_rank].min(machine.memory_per_process);
            flops[pp_rank] = flops[pp_rank].min(machine.flops_per_process);
            op_latency[pp_rank] = op_latency[pp_rank].max(machine.op_latency);
            sync_latency[pp_rank] = sync_latency[pp_rank].max(machine.sync_latency);
            memory_bandwidth[pp_rank] = memory_bandwidth[pp_rank].min(machine.memory_bandwidth);
            machines[pp_rank].insert(m);
        }
        let mut placement = Placement {
            shape,
            virtual_stages: layout.virtual_stages,
            machine_of,
            memory,
            flops,
            op_latency,
            sync_latency,
            memory_bandwidth,
            machines,
            links: Vec::new(),
        };
        for kind in [
            GroupKind::Tp,
            GroupKind::DpShard,
            GroupKind::DpReplicate,
            GroupKind::Dp,
            GroupKind::PpNext,
            GroupKind::Tied,
        ] {
            let links = placement.links_of(cluster, kind);
            placement.links.push((kind, links));
        }
        placement
    }

    /// The rank at mesh coordinates `(pp, dp_replicate, dp_shard, tp)`.
    pub fn rank(&self, pp: usize, rep: usize, shard: usize, tp: usize) -> usize {
        let [_, r, s, t] = self.shape;
        ((pp * r + rep) * s + shard) * t + tp
    }

    /// The machine of `rank`.
    pub fn machine_of(&self, rank: usize) -> usize {
        self.machine_of[rank]
    }

    /// The smallest memory per process among pp rank `pp_rank`'s processes.
    pub fn memory_of(&self, pp_rank: usize) -> u64 {
        self.memory[pp_rank]
    }

    /// The smallest FLOP/s per process among pp rank `pp_rank`'s processes (the one the others wait for).
    pub fn flops_of(&self, pp_rank: usize) -> f64 {
        self.flops[pp_rank]
    }

    /// The largest fixed cost per operator call among pp rank `pp_rank`'s processes, seconds.
    pub fn op_latency_of(&self, pp_rank: usize) -> f64 {
        self.op_latency[pp_rank]
    }

    /// The largest synchronisation cost per blocking collective or send among pp rank `pp_rank`'s processes
    /// ([`super::Machine::sync_latency`]), seconds.
    pub fn sync_latency_of(&self, pp_rank: usize) -> f64 {
        self.sync_latency[pp_rank]
    }

    /// The smallest memory bandwidth per process among pp rank `pp_rank`'s processes, bytes/s.
    pub fn memory_bandwidth_of(&self, pp_rank: usize) -> f64 {
        self.memory_bandwidth[pp_rank]
    }

    /// The machines pp rank `pp_rank`'s processes are on.
    pub fn machines_of(&self, pp_rank: usize) -> Vec<usize> {
        self.machines[pp_rank].iter().copied().collect()
    }

    /// The slowest link of the `kind` groups at pp rank `pp_rank` (for [`GroupKind::PpNext`]: between it and the
    /// next pp rank; for [`GroupKind::Tied`]: between the first and the last, at either).
    pub fn link(&self, kind: GroupKind, pp_rank: usize) -> GroupLink {
        self.links.iter().find(|(k, _)| *k == kind).map(|(_, l)| l[pp_rank]).unwrap_or_else(GroupLink::local)
    }

    /// The slowest link of the `kind` groups anywhere in the layout.
    pub fn worst(&self, kind: GroupKind) -> GroupLink {
        (0..self.shape[0]).map(|p| self.link(kind, p)).fold(GroupLink::local(), GroupLink::slower)
    }

    /// Every group of `kind`, as (pp rank it belongs to, its ranks).
    fn groups(&self, kind: GroupKind) -> Vec<(usize, Vec<usize>)> {
        let [p, r, s, t] = self.shape;
        let mut out = Vec::new();
        for pi in 0..p {
            match kind {
                GroupKind::Tp => {
                    for (ri, si) in grid(r, s) {
                        out.push((pi, (0..t).map(|ti| self.rank(pi, ri, si, ti)).collect()));
                    }
                }
                GroupKind::DpShard => {
                    for (ri, ti) in grid(r, t) {
                        out.push((pi, (0..s).map(|si| self.rank(pi, ri, si, ti)).collect()));
                    }
                }
                GroupKind::DpReplicate => {
                    for (si, ti) in grid(s, t) {
                        out.push((pi, (0..r).map(|ri| self.rank(pi, ri, si, ti)).collect()));
                    }
                }
                GroupKind::Dp => {
                    for ti in 0..t {
                        out.push((pi, grid(r, s).map(|(ri, si)| self.rank(pi, ri, si, ti)).collect()));
                    }
                }
                GroupKind::PpNext | GroupKind::Tied => {
                    // The last pp rank sends to the first only when interleaving (its stages loop back); at pp 2
                    // that is the pair of ranks 0 and 1 again (links are full duplex), which is not counted twice.
                    let other = match kind {
                        GroupKind::PpNext if pi + 1 < p || (self.virtual_stages > 1 && p > 2) => (pi + 1) % p,
                        GroupKind::Tied if pi == 0 => p - 1,
                        _ => continue,
                    };
                    if other == pi {
                        continue;
                    }
                    for (ri, si) in grid(r, s) {
                        for ti in 0..t {
                            out.push((pi, vec![self.rank(pi, ri, si, ti), self.rank(other, ri, si, ti)]));
                        }
                    }
                }
            }
        }
        out
    }

    /// Per pp rank, the slowest link of the `kind` groups there (module documentation).
    fn links_of(&self, cluster: &ClusterSpec, kind: GroupKind) -> Vec<GroupLink> {
        let groups = self.groups(kind);
        let touched: Vec<BTreeSet<usize>> =
            groups.iter().map(|(_, ranks)| ranks.iter().map(|&r| self.machine_of[r]).collect()).collect();
        // Groups crossing machines, counted per machine: they share its link to the others.
        let mut crossing = vec![0usize; cluster.machines.len()];
        for machines in touched.iter().filter(|m| m.len() > 1) {
            machines.iter().for_each(|&m| crossing[m] += 1);
        }
        let mut links = vec![GroupLink::local(); self.shape[0]];
        for ((pp_rank, ranks), machines) in groups.iter().zip(&touched) {
            let link = if ranks.len() < 2 {
                GroupLink::local()
            } else if machines.len() == 1 {
                let m = *machines.iter().next().expect("a group has ranks");
                GroupLink { class: LinkClass::Intra, link: cluster.machines[m].intra, share: 1 }
            } else {
                let share = machines.iter().map(|&m| crossing[m]).max().unwrap_or(1);
                let mut link = Link::new(cluster.inter.alpha, cluster.inter.beta / share as f64);
                for &m in machines {
                    // Ranks of the group on one machine pass the ring's data over its own link too.
                    if ranks.iter().filter(|&&r| self.machine_of[r] == m).count() > 1 {
                        let intra = cluster.machines[m].intra;
                        link = Link::new(link.alpha.max(intra.alpha), link.beta.min(intra.beta));
                    }
                }
                GroupLink { class: LinkClass::Inter, link, share }
            };
            links[*pp_rank] = links[*pp_rank].slower(link);
            if kind == GroupKind::Tied {
                let last = self.shape[0] - 1;
                links[last] = links[last].slower(link);
            }
        }
        if kind == GroupKind::PpNext && self.shape[0] == 2 && self.virtual_stages > 1 {
            links[1] = links[0];
        }
        links
    }
}

/// `(i, j)` for `i < a`, `j < b`, row-major.
fn grid(a: usize, b: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..a).flat_map(move |i| (0..b).map(move |j| (i, j)))
}
