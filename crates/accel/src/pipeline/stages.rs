//! Which layers (blocks) each pipeline stage holds.
//!
//! A model written as a sequence of `n` blocks is cut into `stages = pp · v` consecutive runs of blocks; the first
//! stage also holds the embedding and the last the final norm, the head and the loss. By default the blocks are
//! spread evenly, a remainder going to the middle stages first (the first and the last carry the embedding and
//! the head: torchtitan's `pipeline_parallel_first/last_stage_less_layers` for the same reason); or the user
//! lists each stage's count (torchtitan's `pipeline_parallel_layers_per_stage`), where 0 is allowed (a first stage
//! that only embeds).

use crate::{AccelError, Result};
use std::ops::Range;

/// The blocks of each of `stages` stages of a model of `n_layers` blocks: `layers_per_stage` when given, else an
/// even split (see the module documentation).
///
/// Errors ([`AccelError::Config`] naming the sizes and what would fit): no stage; more stages than blocks (with an
/// even split); a list whose length is not the stage count or whose counts do not add up to `n_layers`.
pub fn split_layers(n_layers: usize, stages: usize, layers_per_stage: Option<&[usize]>) -> Result<Vec<Range<usize>>> {
    let err = |value: String, reason: String| {
        Err(AccelError::Config { key: "pipeline_parallel_layers_per_stage".into(), value, reason })
    };
    if stages == 0 {
        return err("[]".into(), "a pipeline has at least 1 stage".into());
    }
    let counts: Vec<usize> = match layers_per_stage {
        Some(list) => {
            let shown = format!("{list:?}");
            if list.len() != stages {
                return err(
                    shown,
                    format!("{} count(s) for {stages} stage(s) (pp × virtual stages); list one per stage", list.len()),
                );
            }
            let total: usize = list.iter().sum();
            if total != n_layers {
                return err(shown, format!("the counts add up to {total} but the model has {n_layers} layers"));
            }
            list.to_vec()
        }
        None => {
            if stages > n_layers {
                return Err(AccelError::Config {
                    key: "pipeline stages (parallelism_config_pp_size × pipeline_parallel_virtual_stages)".into(),
                    value: stages.to_string(),
                    reason: format!(
                        "the model has {n_layers} layers and every stage needs at least one; use at most {n_layers} \
                         stages (a smaller pp size, or 1F1B's one stage per rank instead of interleaving), a model \
                         with more layers, or list the layers per stage (pipeline_stages(n, Some(&[…])), where a \
                         stage may hold 0)"
                    ),
                });
            }
            let mut counts = vec![n_layers / stages; stages];
            // The middle stages first, then the last, then the first.
            let order: Vec<usize> = (1..stages.saturating_sub(1)).chain([stages - 1, 0]).collect();
            for &s in order.iter().take(n_layers % stages) {
                counts[s] += 1;
            }
            counts
        }
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            start += c;
            start - c..start
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_splits_give_the_remainder_to_the_middle_first() {
        assert_eq!(split_layers(4, 2, None).unwrap(), [0..2, 2..4]);
        assert_eq!(split_layers(4, 4, None).unwrap(), [0..1, 1..2, 2..3, 3..4]);
        assert_eq!(split_layers(6, 4, None).unwrap(), [0..1, 1..3, 3..5, 5..6]);
        assert_eq!(split_layers(5, 2, None).unwrap(), [0..2, 2..5]);
        assert_eq!(split_layers(3, 1, None).unwrap(), vec![0..3]);
    }

    #[test]
    fn listed_counts_and_the_errors() {
        assert_eq!(split_layers(4, 2, Some(&[1, 3])).unwrap(), [0..1, 1..4]);
        assert_eq!(split_layers(4, 3, Some(&[0, 2, 2])).unwrap(), [0..0, 0..2, 2..4]);
        let e = split_layers(2, 4, None).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "invalid configuration pipeline stages (parallelism_config_pp_size × pipeline_parallel_virtual_stages) \
                 = \"4\": the model has 2 layers and every stage needs at least one; use at most 2 stages"
            ),
            "{e}"
        );
        let e = split_layers(4, 2, Some(&[1, 2])).unwrap_err().to_string();
        assert!(e.ends_with("the counts add up to 3 but the model has 4 layers"), "{e}");
        let e = split_layers(4, 2, Some(&[4])).unwrap_err().to_string();
        assert!(e.contains("1 count(s) for 2 stage(s)"), "{e}");
    }
}
