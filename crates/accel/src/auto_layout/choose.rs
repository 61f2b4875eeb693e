//! The chooser: every layout costed ([`evaluate`]), those that do not fit some rank's memory dropped, the rest
//! ranked by predicted step time; among those within [`Assumptions::tie_tolerance`] of the fastest the simplest
//! layout is chosen (fewer parallel dimensions, a lower ZeRO stage, fewer pipeline ranks, …; [`Layout`]'s order),
//! then the one needing least memory — and the best returned with the runners-up of
//! other shapes and the reasons ([`Choice`], whose `Display` is the printed "why"); or, when nothing fits, an
//! [`AutoLayoutError`] naming what would.
//!
//! The order is total and independent of the order the inputs list sizes, strategies or schedules in: the same
//! inputs give the same choice, byte for byte.

use super::assumptions::Assumptions;
pub use super::candidate::{Candidate, GroupUse, RankPrediction, SplitComparison};
use super::cluster::{ClusterSpec, Machine};
use super::enumerate::enumerate;
use super::error::AutoLayoutError;
use super::layout::Layout;
use super::memory::rank_memory;
use super::model::ModelSpec;
use super::placement::{GroupKind, LinkClass, Placement};
use super::split::{balance, capacities};
use super::time::TimeModel;
use super::train::TrainSpec;
use super::units;

/// The chosen layout, the runners-up and why (its `Display` prints it all).
#[derive(Debug, Clone)]
pub struct Choice {
    /// The fastest layout that fits.
    pub best: Candidate,
    /// The fastest fitting layout of each other shape (sizes, strategy, schedule), best first.
    pub runners_up: Vec<Candidate>,
    /// Layouts considered.
    pub considered: usize,
    /// Of which fit.
    pub fitting: usize,
    /// What the uneven parts of the cluster did to the choice, in words.
    pub notes: Vec<String>,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
}

/// Costs `layout` on `cluster`: every pp rank's memory, the step's time, the links. At pp > 1 with one stage per
/// rank and no `layers_per_stage`, the blocks are split too: the even split, unless the split that gives each
/// block to the rank finishing soonest with it (within each rank's memory; `split.rs`) fits where the even one
/// does not, or is faster.
///
/// Errors: a layout of another world size than the cluster's, or whose stages the model cannot fill.
pub fn evaluate(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    train: &TrainSpec,
    assumptions: &Assumptions,
    layout: &Layout,
) -> Result<Candidate, AutoLayoutError> {
    if layout.world_size() != cluster.world_size() {
        return Err(AutoLayoutError::InvalidSpec(format!(
            "the layout {layout} has {} processes, the cluster {}",
            layout.world_size(),
            cluster.world_size()
        )));
    }
    let stages = layout.pp * layout.virtual_stages;
    let even = match layout.stage_layers(model.n_layer) {
        Some(list) if list.len() == stages && list.iter().sum::<usize>() == model.n_layer => {
            layout.rank_layers(model.n_layer).expect("the stages were just split")
        }
        _ => {
            return Err(AutoLayoutError::InvalidSpec(format!(
                "the layout {layout} has {stages} pipeline stages, which the model's {} blocks do not fill as listed",
                model.n_layer
            )))
        }
    };
    let placement = Placement::new(cluster, layout);
    let costs = TimeModel { model, train, placement: &placement };
    let even_candidate = build(model, train, assumptions, &placement, &costs, layout.clone(), even.clone());
    if layout.pp == 1 || layout.virtual_stages > 1 || layout.layers_per_stage.is_some() {
        return Ok(even_candidate);
    }
    let usable: Vec<u64> = (0..layout.pp).map(|r| assumptions.usable(placement.memory_of(r))).collect();
    let caps: Option<Vec<usize>> = capacities(layout.pp, model.n_layer, |r, n| {
        rank_memory(model, train, assumptions, layout, r, n).total() <= usable[r]
    })
    .into_iter()
    .collect();
    let balanced = caps.and_then(|caps| balance(model.n_layer, &caps, |r, n| costs.microbatch(layout, r, n).total()));
    match balanced {
        Some(split) if split != even => {
            let uneven = Layout { layers_per_stage: Some(split.clone()), ..layout.clone() };
            let mut candidate = build(model, train, assumptions, &placement, &costs, uneven, split);
            let faster = candidate.time.total < even_candidate.time.total * (1.0 - 1e-9);
            if candidate.fits() && (!even_candidate.fits() || faster) {
                let tight = even_candidate.tightest();
                candidate.even_split = Some(SplitComparison {
                    layers: even,
                    fits: even_candidate.fits(),
                    step: even_candidate.time.total,
                    tightest: (tight.pp_rank, tight.memory.total(), tight.usable),
                });
                return Ok(candidate);
            }
            Ok(even_candidate)
        }
        _ => Ok(even_candidate),
    }
}

/// The candidate of `layout` with `rank_layers` blocks per pp rank.
fn build(
    model: &ModelSpec,
    train: &TrainSpec,
    assumptions: &Assumptions,
    placement: &Placement,
    costs: &TimeModel<'_>,
    layout: Layout,
    rank_layers: Vec<usize>,
) -> Candidate {
    let ranks = rank_layers
        .iter()
        .enumerate()
        .map(|(r, &layers)| RankPrediction {
            pp_rank: r,
            layers,
            memory: rank_memory(model, train, assumptions, &layout, r, layers),
            usable: assumptions.usable(placement.memory_of(r)),
            machines: placement.machines_of(r),
        })
        .collect();
    let time = costs.step(&layout, &rank_layers);
    let mut groups = Vec::new();
    let mut add = |kind, size: usize| {
        if size > 1 {
            groups.push(GroupUse { kind, size, link: placement.worst(kind) });
        }
    };
    add(GroupKind::Tp, layout.tp);
    if layout.zero_stage() == 0 {
        add(GroupKind::Dp, layout.dp());
    } else {
        add(GroupKind::DpShard, layout.dp_shard);
        add(GroupKind::DpReplicate, layout.dp_replicate);
    }
    add(GroupKind::PpNext, layout.pp);
    if model.tied_embeddings {
        add(GroupKind::Tied, layout.pp);
    }
    Candidate { layout, ranks, time, groups, even_split: None }
}

/// Chooses the layout of `cluster`'s processes for `model` trained as `train` (module documentation).
///
/// Errors: [`AutoLayoutError::InvalidSpec`] for inputs that cannot be costed; [`AutoLayoutError::NoLayout`] when
/// no layout satisfies the constraints (with the rules and the nearest global batches that have layouts);
/// [`AutoLayoutError::NothingFits`] when none fits the memory (with the smallest memory per process that would fit,
/// and how many more machines would).
pub fn choose(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    train: &TrainSpec,
    assumptions: &Assumptions,
) -> Result<Choice, AutoLayoutError> {
    model.validate()?;
    cluster.validate()?;
    train.validate()?;
    if !(0.0..1.0).contains(&assumptions.memory_margin) {
        return Err(AutoLayoutError::InvalidSpec(format!(
            "memory margin {}: a fraction in [0, 1)",
            assumptions.memory_margin
        )));
    }
    let world = cluster.world_size();
    let (layouts, why) = enumerate(model, world, train);
    if layouts.is_empty() {
        return Err(no_layout(model, world, train, why.lines()));
    }
    let mut candidates =
        layouts.iter().map(|l| evaluate(model, cluster, train, assumptions, l)).collect::<Result<Vec<_>, _>>()?;
    candidates.sort_by_cached_key(Candidate::sort_key);
    let considered = candidates.len();
    let fitting: Vec<Candidate> = candidates.iter().filter(|c| c.fits()).cloned().collect();
    let Some(fastest) = fitting.first() else {
        return Err(nothing_fits(model, cluster, train, assumptions, &candidates));
    };
    // Within the tolerance of the fastest, the simplest layout, then the one needing least memory.
    let limit = fastest.time.total * (1.0 + assumptions.tie_tolerance.max(0.0));
    let best = fitting
        .iter()
        .filter(|c| c.time.total <= limit)
        .min_by_key(|c| (c.layout.complexity(), c.peak_memory(), c.time_ns()))
        .cloned()
        .expect("the fastest is within its own tolerance");
    let mut runners_up: Vec<Candidate> = Vec::new();
    for c in &fitting {
        if runners_up.len() == assumptions.runners_up {
            break;
        }
        let family = c.layout.family();
        if family != best.layout.family() && runners_up.iter().all(|r| r.layout.family() != family) {
            runners_up.push(c.clone());
        }
    }
    let notes = notes(cluster, train, &best, &candidates);
    Ok(Choice {
        best,
        runners_up,
        considered,
        fitting: fitting.len(),
        notes,
        model: model.clone(),
        cluster: cluster.clone(),
        train: train.clone(),
    })
}

/// The error for a world size with no layout: the rules, and the nearest global batches that have one.
fn no_layout(model: &ModelSpec, world: usize, train: &TrainSpec, reasons: Vec<String>) -> AutoLayoutError {
    let has_layouts = |batch: usize| {
        let t = TrainSpec { global_batch: batch, ..train.clone() };
        !enumerate(model, world, &t).0.is_empty()
    };
    let reach = world * train.micro_batch_sizes.iter().copied().max().unwrap_or(1);
    let b = train.global_batch;
    let below = (b.saturating_sub(reach).max(1)..b).rev().find(|&n| has_layouts(n));
    let above = (b + 1..=b + reach).find(|&n| has_layouts(n));
    AutoLayoutError::NoLayout { world, reasons, nearest_batches: (below, above) }
}

/// The error when nothing fits: the least memory that would, the fastest layout's need, more machines.
fn nothing_fits(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    train: &TrainSpec,
    assumptions: &Assumptions,
    candidates: &[Candidate],
) -> AutoLayoutError {
    let need = |c: &Candidate| c.needed_per_process(assumptions);
    let least = candidates
        .iter()
        .min_by(|a, b| (need(a), a.sort_key()).cmp(&(need(b), b.sort_key())))
        .expect("there are candidates");
    let fastest = &candidates[0];
    let largest: &Machine =
        cluster.machines.iter().rev().max_by_key(|m| m.memory_per_process).expect("a cluster has machines");
    let world = cluster.world_size();
    let bound = (8 * world).max(world + largest.processes);
    let mut grown = cluster.clone();
    let mut more_machines = None;
    let mut searched_up_to = world;
    while grown.world_size() + largest.processes <= bound {
        grown.machines.push(*largest);
        searched_up_to = grown.world_size();
        let (layouts, _) = enumerate(model, grown.world_size(), train);
        let fits =
            layouts.iter().any(|l| evaluate(model, &grown, train, assumptions, l).map(|c| c.fits()).unwrap_or(false));
        if fits {
            more_machines = Some((grown.machines.len() - cluster.machines.len(), grown.world_size()));
            break;
        }
    }
    AutoLayoutError::NothingFits {
        considered: candidates.len(),
        least_memory: Box::new(least.clone()),
        needed_per_process: need(least),
        fastest: Box::new(fastest.clone()),
        fastest_needs: need(fastest),
        largest_memory: largest.memory_per_process,
        more_machines,
        searched_up_to,
    }
}

/// `machine 0: 16.00 GiB, machine 1: 8.00 GiB` (per process), from `value`.
fn per_machine(cluster: &ClusterSpec, value: impl Fn(&Machine) -> String) -> String {
    cluster
        .machines
        .iter()
        .enumerate()
        .map(|(i, m)| format!("machine {i}: {}", value(m)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why the pipeline split is uneven, and what the uneven parts of the cluster did to the choice.
fn notes(cluster: &ClusterSpec, train: &TrainSpec, best: &Candidate, all: &[Candidate]) -> Vec<String> {
    let mut notes = Vec::new();
    let l = &best.layout;
    if let (Some(list), Some(even)) = (&l.layers_per_stage, &best.even_split) {
        let (r, peak, usable) = even.tightest;
        notes.push(if even.fits {
            format!(
                "the pipeline's stages hold {list:?} blocks, split by their predicted time within each machine's \
                 memory — the even split {:?} fits but is predicted slower ({} against {})",
                even.layers,
                units::seconds(even.step),
                units::seconds(best.time.total)
            )
        } else {
            format!(
                "the pipeline's stages hold {list:?} blocks, fewer where memory is smaller — the even split {:?} \
                 needs {} on pp rank {r} ({}), which has {} usable",
                even.layers,
                units::bytes(peak),
                machines(&best.ranks[r].machines),
                units::bytes(usable)
            )
        });
    }
    if cluster.memory_is_uneven() && l.layers_per_stage.is_none() {
        let memories = per_machine(cluster, |m| units::bytes(m.memory_per_process));
        let tight = best.tightest();
        let bound = format!(
            "the tightest is pp rank {} on {}: {} of {} usable",
            tight.pp_rank,
            machines(&tight.machines),
            units::bytes(tight.memory.total()),
            units::bytes(tight.usable)
        );
        notes.push(if l.pp > 1 && l.virtual_stages == 1 {
            format!(
                "machines differ in memory per process ({memories}): the even pipeline split {:?} fits every stage \
                 and is the fastest; {bound}",
                best.ranks.iter().map(|r| r.layers).collect::<Vec<_>>()
            )
        } else {
            let uneven = all.iter().find(|c| c.fits() && c.layout.layers_per_stage.is_some());
            let why = match uneven {
                Some(u) => format!(
                    "the fastest layout with an uneven pipeline split, {}, is predicted {} per step against {}",
                    u.layout,
                    units::seconds(u.time.total),
                    units::seconds(best.time.total)
                ),
                None if !train.pipeline => {
                    "the program has no pipeline stages, so no stage can hold fewer blocks".into()
                }
                None if !all.iter().any(|c| c.layout.pp > 1 && c.layout.virtual_stages == 1) => {
                    "no pipeline layout with one stage per rank exists for this world size, model and batch, so no \
                     stage can hold fewer blocks"
                        .into()
                }
                None => "no pipeline layout fits better with fewer blocks on the smaller machine's stage".into(),
            };
            format!(
                "machines differ in memory per process ({memories}): the layout is uniform — every rank holds an \
                 equal share, so the smallest machine bounds it ({bound}); {why}"
            )
        });
    }
    if cluster.compute_is_uneven() {
        let speeds = per_machine(cluster, |m| format!("{:.3e} FLOP/s", m.flops_per_process));
        let how = if l.layers_per_stage.is_some() {
            "the pipeline's stages are split by their predicted time"
        } else {
            "every pp rank runs at the pace of its slowest process"
        };
        notes.push(format!("machines differ in compute per process ({speeds}): {how}"));
    }
    notes
}

/// `machine 0`, `machines 0, 1`.
fn machines(list: &[usize]) -> String {
    let names: Vec<String> = list.iter().map(ToString::to_string).collect();
    format!("{} {}", if list.len() == 1 { "machine" } else { "machines" }, names.join(", "))
}

/// `tp 2`, `dp_shard 4`, `pp sends`.
fn group_name(g: &GroupUse) -> String {
    match g.kind {
        GroupKind::Tp => format!("tp {}", g.size),
        GroupKind::DpShard => format!("dp_shard {}", g.size),
        GroupKind::DpReplicate => format!("dp_replicate {}", g.size),
        GroupKind::Dp => format!("dp {}", g.size),
        GroupKind::PpNext => format!("pp {} sends", g.size),
        GroupKind::Tied => "tied embedding".into(),
    }
}

impl std::fmt::Display for Choice {
    /// The printed "why": the inputs, the links, the chosen layout with its predicted step (by part), its groups'
    /// links and every pp rank's memory, the runners-up with their predictions, and the notes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (c, best) = (&self.cluster, &self.best);
        writeln!(
            f,
            "auto layout for {} ({}): model {}; {} {}, global batch {} sequences",
            units::plural(c.world_size(), "process", "processes"),
            c.describe(),
            self.model.describe(),
            self.train.precision.name(),
            self.train.optimizer.name(),
            self.train.global_batch
        )?;
        let intra: Vec<String> = c.machines.iter().map(|m| m.intra.to_string()).collect();
        let within = if intra.windows(2).all(|w| w[0] == w[1]) {
            format!("within a machine {}", intra[0])
        } else {
            per_machine(c, |m| m.intra.to_string())
        };
        match (c.world_size(), c.machines.len()) {
            // One process: no link is used.
            (1, _) => writeln!(f, "links: none (one process)")?,
            (_, 1) => writeln!(f, "links: {within}")?,
            _ => writeln!(f, "links: {within}; across machines {} per machine", c.inter)?,
        }
        writeln!(f, "chosen: {}", best.layout)?;
        writeln!(f, "  step {} per optimizer step", best.time)?;
        if !best.groups.is_empty() {
            let groups: Vec<String> = best
                .groups
                .iter()
                .map(|g| {
                    let shared = if g.link.class == LinkClass::Inter && g.link.share > 1 {
                        format!(", a machine's link shared by {} groups", g.link.share)
                    } else {
                        String::new()
                    };
                    format!("{} {} ({}{shared})", group_name(g), g.link.class.describe(), g.link.link)
                })
                .collect();
            writeln!(f, "  groups: {}", groups.join("; "))?;
        }
        for r in &best.ranks {
            writeln!(
                f,
                "  memory, pp rank {} ({}, {} blocks): {} of {} usable",
                r.pp_rank,
                machines(&r.machines),
                r.layers,
                r.memory,
                units::bytes(r.usable)
            )?;
        }
        if !self.runners_up.is_empty() {
            writeln!(f, "runners-up (the fastest fitting layout of each other shape):")?;
            for r in &self.runners_up {
                // Signed: a runner-up within the tie tolerance may be predicted slightly faster than the choice.
                let slower = match (r.time.total / best.time.total - 1.0) * 100.0 {
                    d if d.abs() < 0.05 => 0.0,
                    d => d,
                };
                writeln!(
                    f,
                    "  {}: step {} ({slower:+.1} %), peak {}",
                    r.layout,
                    r.time,
                    units::bytes(r.peak_memory())
                )?;
            }
        }
        let over = self.considered - self.fitting;
        write!(
            f,
            "considered {} layouts: {} fit, {over} {} more memory than their processes have",
            self.considered,
            self.fitting,
            if over == 1 { "needs" } else { "need" }
        )?;
        for note in &self.notes {
            write!(f, "\nnote: {note}")?;
        }
        Ok(())
    }
}
