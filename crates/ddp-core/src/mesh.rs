//! [`DeviceMesh`]: the ranks of a job laid out as a 4-D grid `[pp, dp_replicate, dp_shard, tp]`, with one
//! [`ProcessGroup`] per dimension and the derived groups N-D parallelism needs.
//!
//! Layout (as Megatron-LM's `initialize_model_parallel`, torchtitan's `ParallelDims` and Accelerate's
//! `ParallelismConfig`): **tp is innermost** — the ranks of a tensor-parallel group are neighbours, so with
//! `local_world_size` a multiple of tp they share a machine and its shared memory — and **pp outermost**:
//!
//! ```text
//! rank = ((pp · dp_replicate_size + dp_replicate) · dp_shard_size + dp_shard) · tp_size + tp
//! ```
//!
//! Groups ([`MeshDim`]): one per dimension (ranks that differ only in that coordinate), plus `Dp` =
//! dp_replicate × dp_shard (ranks holding the same model shard and seeing different data: gradients are averaged
//! over it, data loaders shard by it) and `ModelParallel` = pp × tp (ranks holding the pieces of one model
//! replica: a gradient norm is summed over it). Every size may be 1: the group of a size-1 dimension is this rank
//! alone, and nothing downstream needs to special-case a missing dimension (Accelerate PR #3986 is the bug this
//! avoids).
//!
//! Building a mesh is collective over the world group: every rank calls [`DeviceMesh::new`] with the same shape.

use crate::{DdpError, ProcessGroup, Result};

/// Sizes of the four mesh dimensions. Each is ≥ 1; their product is the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshShape {
    /// Pipeline stages (outermost).
    pub pp: usize,
    /// Data-parallel replicas (DDP / HSDP's replicate dimension).
    pub dp_replicate: usize,
    /// Sharded data parallelism (ZeRO / FSDP's shard dimension).
    pub dp_shard: usize,
    /// Tensor-parallel ranks (innermost).
    pub tp: usize,
}

/// A rank's coordinates in a [`MeshShape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshCoord {
    /// Pipeline stage.
    pub pp: usize,
    /// Index among data-parallel replicas.
    pub dp_replicate: usize,
    /// Index among the data-parallel shards.
    pub dp_shard: usize,
    /// Tensor-parallel rank.
    pub tp: usize,
}

/// A group of a [`DeviceMesh`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MeshDim {
    /// Ranks of the same data-parallel position and tp rank: the stages of one pipeline.
    Pp,
    /// The data-parallel replicas of one model shard (DDP).
    DpReplicate,
    /// The data-parallel shards (ZeRO / FSDP).
    DpShard,
    /// One tensor-parallel group.
    Tp,
    /// dp_replicate × dp_shard: every rank holding the same model piece with different data.
    Dp,
    /// pp × tp: every rank holding a piece of one model replica.
    ModelParallel,
}

impl MeshDim {
    /// Every group, in the order [`DeviceMesh::new`] builds them.
    pub const ALL: [MeshDim; 6] =
        [MeshDim::Pp, MeshDim::DpReplicate, MeshDim::DpShard, MeshDim::Tp, MeshDim::Dp, MeshDim::ModelParallel];

    /// The name used in messages and config keys (`pp`, `dp_replicate`, `dp_shard`, `tp`, `dp`, `mp`).
    pub fn name(self) -> &'static str {
        match self {
            MeshDim::Pp => "pp",
            MeshDim::DpReplicate => "dp_replicate",
            MeshDim::DpShard => "dp_shard",
            MeshDim::Tp => "tp",
            MeshDim::Dp => "dp",
            MeshDim::ModelParallel => "mp",
        }
    }
}

impl MeshShape {
    /// A shape; every size must be ≥ 1.
    pub fn new(pp: usize, dp_replicate: usize, dp_shard: usize, tp: usize) -> Result<Self> {
        let shape = MeshShape { pp, dp_replicate, dp_shard, tp };
        for (name, size) in [("pp", pp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp)] {
            if size == 0 {
                return Err(DdpError::InvalidArgument(format!(
                    "DeviceMesh: {name} size is 0 in {shape}; every size is at least 1 (1 = that dimension is off)"
                )));
            }
        }
        Ok(shape)
    }

    /// Pure data parallelism over `world_size` ranks (every other size 1).
    pub fn data_parallel(world_size: usize) -> Self {
        MeshShape { pp: 1, dp_replicate: world_size, dp_shard: 1, tp: 1 }
    }

    /// The number of ranks the shape needs.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp_replicate * self.dp_shard * self.tp
    }

    /// dp_replicate × dp_shard.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// The size of a group.
    pub fn size(&self, dim: MeshDim) -> usize {
        match dim {
            MeshDim::Pp => self.pp,
            MeshDim::DpReplicate => self.dp_replicate,
            MeshDim::DpShard => self.dp_shard,
            MeshDim::Tp => self.tp,
            MeshDim::Dp => self.dp(),
            MeshDim::ModelParallel => self.pp * self.tp,
        }
    }

    /// The coordinates of `rank` (tp innermost, pp outermost). Panics if `rank >= world_size()`.
    pub fn coord(&self, rank: usize) -> MeshCoord {
        assert!(rank < self.world_size(), "rank {rank} is outside the mesh {self}");
        MeshCoord {
            tp: rank % self.tp,
            dp_shard: rank / self.tp % self.dp_shard,
            dp_replicate: rank / (self.tp * self.dp_shard) % self.dp_replicate,
            pp: rank / (self.tp * self.dp_shard * self.dp_replicate),
        }
    }

    /// The rank at `coord` (the inverse of [`MeshShape::coord`]).
    pub fn rank(&self, c: MeshCoord) -> usize {
        ((c.pp * self.dp_replicate + c.dp_replicate) * self.dp_shard + c.dp_shard) * self.tp + c.tp
    }

    /// The group `rank` belongs to along `dim`: `(colour, position)` — ranks with equal colour form the group,
    /// ordered by position.
    fn membership(&self, rank: usize, dim: MeshDim) -> (usize, usize) {
        let c = self.coord(rank);
        let dp = c.dp_replicate * self.dp_shard + c.dp_shard;
        match dim {
            MeshDim::Tp => (rank / self.tp, c.tp),
            MeshDim::DpShard => ((c.pp * self.dp_replicate + c.dp_replicate) * self.tp + c.tp, c.dp_shard),
            MeshDim::DpReplicate => ((c.pp * self.dp_shard + c.dp_shard) * self.tp + c.tp, c.dp_replicate),
            MeshDim::Pp => (dp * self.tp + c.tp, c.pp),
            MeshDim::Dp => (c.pp * self.tp + c.tp, dp),
            MeshDim::ModelParallel => (dp, c.pp * self.tp + c.tp),
        }
    }

    /// The world ranks of the `dim` group that `rank` belongs to, in group-rank order.
    pub fn group_ranks(&self, rank: usize, dim: MeshDim) -> Vec<usize> {
        let (colour, _) = self.membership(rank, dim);
        let mut members: Vec<(usize, usize)> = (0..self.world_size())
            .filter_map(|r| {
                let (c, pos) = self.membership(r, dim);
                (c == colour).then_some((pos, r))
            })
            .collect();
        members.sort_unstable();
        members.into_iter().map(|(_, r)| r).collect()
    }
}

impl std::fmt::Display for MeshShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[pp {}, dp_replicate {}, dp_shard {}, tp {}]", self.pp, self.dp_replicate, self.dp_shard, self.tp)
    }
}

/// The ranks of a job as a [`MeshShape`] grid, with this rank's coordinates and its group along every
/// [`MeshDim`] (see the module documentation). Cheap to clone; clones share the groups.
#[derive(Clone)]
pub struct DeviceMesh {
    shape: MeshShape,
    coord: MeshCoord,
    world: ProcessGroup,
    /// Indexed like [`MeshDim::ALL`].
    groups: Vec<ProcessGroup>,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh").field("shape", &self.shape).field("coord", &self.coord).finish()
    }
}

impl DeviceMesh {
    /// Lays `world`'s ranks out as `shape` and builds one process group per [`MeshDim`] (collective over
    /// `world`: every rank calls it with the same shape, in the same order of group-creating calls).
    ///
    /// Errors: `shape.world_size() != world.world_size()` (naming both and the sizes), backend failures while
    /// connecting the groups.
    pub fn new(world: &ProcessGroup, shape: MeshShape) -> Result<Self> {
        if shape.world_size() != world.world_size() {
            return Err(DdpError::InvalidArgument(format!(
                "DeviceMesh: the layout {shape} needs pp × dp_replicate × dp_shard × tp = {} processes, but the \
                 job has {}; change the sizes so that their product is {}",
                shape.world_size(),
                world.world_size(),
                world.world_size()
            )));
        }
        let rank = world.rank();
        let mut groups = Vec::with_capacity(MeshDim::ALL.len());
        for dim in MeshDim::ALL {
            let group = if shape.size(dim) == world.world_size() {
                // The whole world along this dimension: reuse its connections.
                world.clone()
            } else {
                let (colour, position) = shape.membership(rank, dim);
                world
                    .split(Some(colour as u32), position)?
                    .expect("a rank with a colour always gets its colour's group")
            };
            debug_assert_eq!(group.world_size(), shape.size(dim));
            groups.push(group);
        }
        Ok(DeviceMesh { shape, coord: shape.coord(rank), world: world.clone(), groups })
    }

    /// A mesh of one process (every size 1).
    pub fn single_process(world: &ProcessGroup) -> Result<Self> {
        Self::new(world, MeshShape::data_parallel(1))
    }

    /// The sizes.
    pub fn shape(&self) -> MeshShape {
        self.shape
    }

    /// This rank's coordinates.
    pub fn coord(&self) -> MeshCoord {
        self.coord
    }

    /// The group the mesh was built over.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// This rank's group along `dim` (a one-rank group when that size is 1).
    pub fn group(&self, dim: MeshDim) -> &ProcessGroup {
        let i = MeshDim::ALL.iter().position(|&d| d == dim).expect("every MeshDim is in ALL");
        &self.groups[i]
    }

    /// The tensor-parallel group.
    pub fn tp(&self) -> &ProcessGroup {
        self.group(MeshDim::Tp)
    }

    /// The data-parallel group (dp_replicate × dp_shard).
    pub fn dp(&self) -> &ProcessGroup {
        self.group(MeshDim::Dp)
    }

    /// The pipeline group.
    pub fn pp(&self) -> &ProcessGroup {
        self.group(MeshDim::Pp)
    }

    /// The model-parallel group (pp × tp).
    pub fn model_parallel(&self) -> &ProcessGroup {
        self.group(MeshDim::ModelParallel)
    }
}
