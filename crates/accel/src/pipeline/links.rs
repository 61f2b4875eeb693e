//! The point-to-point links between pipeline ranks: one two-rank process group per *ordered* pair of neighbours
//! (rank r → r + 1 and r + 1 → r, wrapping around for interleaved schedules).
//!
//! Why one group per direction: a pipeline rank receives on its main thread while a sender thread posts its
//! sends (sends are asynchronous in every schedule, see [`super::schedule`]), and a backend serialises the calls
//! of one group. On a shared group, a send that waits for its peer to receive would hold up this rank's own
//! receive — the deadlock the schedules avoid on paper. With a group per direction, a rank only ever sends on
//! its outgoing links and receives on its incoming ones, and messages on a link arrive in the order they were
//! sent.

use crate::Result;
use ddp_core::ProcessGroup;

/// This rank's links to its pipeline neighbours.
pub struct PipelineLinks {
    pp: usize,
    rank: usize,
    /// The job's rank of each pp rank (for messages).
    global: Vec<usize>,
    /// `(peer, group)`: groups this rank sends on.
    outgoing: Vec<(usize, ProcessGroup)>,
    /// `(peer, group)`: groups this rank receives on.
    incoming: Vec<(usize, ProcessGroup)>,
}

impl PipelineLinks {
    /// Creates the links over the pp group `pp_group` (collective over it: every rank calls it). Each pair of
    /// neighbouring pp ranks gets two two-rank groups, one per direction; with one pp rank there are none.
    ///
    /// Errors: the backend's, creating the groups.
    pub fn new(pp_group: &ProcessGroup) -> Result<Self> {
        let (pp, rank) = (pp_group.world_size(), pp_group.rank());
        let global = pp_group.members().to_vec();
        let mut links = PipelineLinks { pp, rank, global, outgoing: Vec::new(), incoming: Vec::new() };
        // Every ordered neighbour pair, in the same order on every rank (new_group is collective).
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for a in 0..pp {
            let b = (a + 1) % pp;
            if a != b {
                for pair in [(a, b), (b, a)] {
                    if !pairs.contains(&pair) {
                        pairs.push(pair);
                    }
                }
            }
        }
        for (from, to) in pairs {
            let group = pp_group.new_group(&[from, to])?;
            if let Some(g) = group {
                if from == rank {
                    links.outgoing.push((to, g));
                } else if to == rank {
                    links.incoming.push((from, g));
                }
            }
        }
        Ok(links)
    }

    /// Pipeline ranks.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// This rank in the pp group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's rank of pp rank `pp_rank` (`pp_rank` itself if out of range).
    pub fn global_rank(&self, pp_rank: usize) -> usize {
        self.global.get(pp_rank).copied().unwrap_or(pp_rank)
    }

    /// The group to send to `peer` on, and the peer's rank in it.
    pub(crate) fn to(&self, peer: usize) -> Option<(&ProcessGroup, usize)> {
        self.outgoing.iter().find(|(p, _)| *p == peer).map(|(p, g)| (g, usize::from(*p > self.rank)))
    }

    /// The group to receive from `peer` on, and the peer's rank in it.
    pub(crate) fn from(&self, peer: usize) -> Option<(&ProcessGroup, usize)> {
        self.incoming.iter().find(|(p, _)| *p == peer).map(|(p, g)| (g, usize::from(*p > self.rank)))
    }
}
