//! A parallelization plan as data: which tensor-parallel style each layer of a model gets, decided outside the
//! model's code (transformers' `base_model_tp_plan`, torchtitan's `parallelize_module` plan).
//!
//! A [`ParallelPlan`] maps *patterns* over module paths to a [`ParallelStyle`]. A module path is the dotted prefix
//! under which a layer asks the builder for its parameters (`layers.3.self_attn.q_proj`); a pattern is the same
//! with `*` standing for any one segment (`layers.*.self_attn.q_proj`). The model asks the builder
//! ([`crate::nn::VarBuilder`]) for a `linear` or an `embedding`; the builder looks its path up in the plan and
//! builds the column-parallel, row-parallel, vocab-parallel or replicated layer. The model's code never names a
//! style, so changing the layout is changing the sizes or the plan, never the model.
//!
//! ```
//! use accel::plan::{ParallelPlan, ParallelStyle};
//! // Llama's plan in transformers' words (q/k/v/gate/up column-wise, o/down row-wise), head and embedding
//! // vocab-parallel.
//! let plan = ParallelPlan::new()
//!     .with("layers.*.self_attn.q_proj", ParallelStyle::Colwise)
//!     .with("layers.*.self_attn.o_proj", ParallelStyle::Rowwise)
//!     .with("embed_tokens", ParallelStyle::VocabParallel);
//! assert_eq!(plan.style_of("layers.7.self_attn.q_proj").unwrap().unwrap().1, ParallelStyle::Colwise);
//! assert!(plan.style_of("layers.7.mlp.up_proj").unwrap().is_none());
//! // The same plan as transformers writes it (and as a YAML config's `parallelism_config_tp_plan` map holds it):
//! let same = ParallelPlan::from_pairs([
//!     ("layers.*.self_attn.q_proj", "colwise"),
//!     ("layers.*.self_attn.o_proj", "rowwise"),
//!     ("embed_tokens", "vocab_parallel"),
//! ])
//! .unwrap();
//! assert_eq!(plan, same);
//! ```
//!
//! Errors (each names the layer, its shape and what would fit): a pattern that matches no layer of the model
//! (checked when the model is prepared), a linear layer no pattern covers at tp > 1, a style that does not fit the
//! layer (row-wise on an embedding), sizes the tp size does not divide, two patterns giving one layer different
//! styles.

use crate::{AccelError, Result};
use serde::{Deserialize, Serialize};

/// Environment variable: set (to anything but `0`), `prepare_model` prints which parameter the plan gave which
/// style, once, on the main process (`accel launch --print-plan` sets it).
pub const PRINT_PLAN_ENV: &str = "ACCEL_PRINT_PLAN";
use std::fmt;
use std::str::FromStr;

/// How one layer is split over the tensor-parallel group (Megatron-LM §3; the names are transformers' and
/// torchtitan's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParallelStyle {
    /// A linear layer split by output features (`weight` `[out, in]` → `[out/tp, in]`, bias `[out/tp]`): input
    /// replicated, output this rank's `out/tp` features. Megatron's `ColumnParallelLinear`, torchtitan's
    /// `ColwiseParallel`. Attention's q, k, v and an MLP's up/gate projections.
    Colwise,
    /// [`ParallelStyle::Colwise`] with the output all-gathered (`[.., out]` on every rank): transformers'
    /// `colwise_rep`, for a head whose logits the loss reads whole.
    ColwiseRep,
    /// A linear layer split by input features (`weight` `[out, in]` → `[out, in/tp]`, bias replicated): input this
    /// rank's `in/tp` features (a column-wise layer's output), the partial products summed over the group.
    /// Megatron's `RowParallelLinear`, torchtitan's `RowwiseParallel`. Attention's output projection, an MLP's
    /// down projection.
    Rowwise,
    /// An embedding split by vocabulary rows, or a head split by vocabulary columns (both padded to a multiple of
    /// tp; the head's logits stay sharded for [`crate::tensor_parallel::vocab_parallel_cross_entropy`]).
    /// Megatron's `VocabParallelEmbedding` and parallel head.
    VocabParallel,
    /// Every tp rank holds the whole layer and computes it whole.
    Replicate,
}

impl ParallelStyle {
    /// Every style, in the order the documentation lists them.
    pub const ALL: [ParallelStyle; 5] = [
        ParallelStyle::Colwise,
        ParallelStyle::ColwiseRep,
        ParallelStyle::Rowwise,
        ParallelStyle::VocabParallel,
        ParallelStyle::Replicate,
    ];

    /// The style's name in plans and config files (`colwise`, `colwise_rep`, `rowwise`, `vocab_parallel`,
    /// `replicate`).
    pub fn name(self) -> &'static str {
        match self {
            ParallelStyle::Colwise => "colwise",
            ParallelStyle::ColwiseRep => "colwise_rep",
            ParallelStyle::Rowwise => "rowwise",
            ParallelStyle::VocabParallel => "vocab_parallel",
            ParallelStyle::Replicate => "replicate",
        }
    }
}

impl fmt::Display for ParallelStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ParallelStyle {
    type Err = AccelError;

    /// A style by name (case-insensitive; `-` reads as `_`). Errors: an unknown name, listing the known ones;
    /// `sequence_parallel`, said to be unsupported.
    fn from_str(s: &str) -> Result<Self> {
        let key = s.trim().to_ascii_lowercase().replace('-', "_");
        if let Some(style) = ParallelStyle::ALL.into_iter().find(|st| st.name() == key) {
            return Ok(style);
        }
        let reason = if key == "sequence_parallel" {
            "sequence-parallel norms are not supported yet: give the norms `replicate` (or leave them out of the \
             plan: a norm is replicated by default)"
                .to_string()
        } else {
            let known: Vec<&str> = ParallelStyle::ALL.iter().map(|s| s.name()).collect();
            format!("not a parallel style; the styles are {}", known.join(", "))
        };
        Err(AccelError::Config { key: "parallel plan style".into(), value: s.to_string(), reason })
    }
}

/// A pattern over module paths: dot-separated segments, `*` matching any one segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PathPattern {
    text: String,
    segments: Vec<String>,
}

impl PathPattern {
    /// Parses `text`. Errors: an empty pattern or an empty segment (`a..b`, a leading or trailing dot).
    pub fn new(text: &str) -> Result<Self> {
        let segments: Vec<String> = text.split('.').map(str::to_string).collect();
        if text.is_empty() || segments.iter().any(String::is_empty) {
            return Err(AccelError::Config {
                key: "parallel plan pattern".into(),
                value: text.to_string(),
                reason: "a pattern is a module path with `*` for any one segment, e.g. `layers.*.self_attn.q_proj` \
                         (no empty segment)"
                    .into(),
            });
        }
        Ok(PathPattern { text: text.to_string(), segments })
    }

    /// Whether `path` (a module path, `layers.3.self_attn.q_proj`) matches: as many segments, each equal or `*`.
    pub fn matches(&self, path: &str) -> bool {
        let mut parts = path.split('.');
        let all = self.segments.iter().all(|s| parts.next().is_some_and(|p| s == "*" || s == p));
        all && parts.next().is_none()
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Which tensor-parallel style each layer of a model gets: an ordered list of `(pattern, style)` rules (see the
/// module documentation). A layer no rule matches is replicated when it is a norm, an embedding or any parameter
/// asked for by name; a *linear* layer no rule matches is an error at tp > 1 (a forgotten pattern would otherwise
/// silently train a replicated layer). The empty plan (`Default`) replicates everything: what a model needs at
/// tp = 1, and all a model written without a plan gets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ParallelPlan {
    rules: Vec<(PathPattern, ParallelStyle)>,
}

impl ParallelPlan {
    /// The empty plan.
    pub fn new() -> Self {
        ParallelPlan::default()
    }

    /// Adds the rule `pattern → style`. Panics on a malformed pattern (a programming error in a plan written in
    /// code; [`ParallelPlan::try_with`] returns it as an error, for plans read from files).
    pub fn with(self, pattern: &str, style: ParallelStyle) -> Self {
        self.try_with(pattern, style).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Adds the rule `pattern → style`. Errors: a malformed pattern ([`PathPattern::new`]), a pattern already in
    /// the plan.
    pub fn try_with(mut self, pattern: &str, style: ParallelStyle) -> Result<Self> {
        let pattern = PathPattern::new(pattern)?;
        if let Some((_, old)) = self.rules.iter().find(|(p, _)| *p == pattern) {
            return Err(AccelError::Config {
                key: "parallel plan pattern".into(),
                value: pattern.to_string(),
                reason: format!("given twice (as {old} and as {style}); keep one"),
            });
        }
        self.rules.push((pattern, style));
        Ok(self)
    }

    /// A plan from `(pattern, style name)` pairs, transformers' `tp_plan` dictionaries as they are written.
    /// Errors: those of [`ParallelPlan::try_with`] and [`ParallelStyle::from_str`].
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self> {
        pairs.into_iter().try_fold(ParallelPlan::new(), |plan, (pattern, style)| {
            let style = style.parse::<ParallelStyle>().map_err(|e| match e {
                AccelError::Config { value, reason, .. } => {
                    AccelError::Config { key: format!("parallel plan[{pattern:?}]"), value, reason }
                }
                e => e,
            })?;
            plan.try_with(pattern, style)
        })
    }

    /// The rules, in order.
    pub fn rules(&self) -> impl Iterator<Item = (&PathPattern, ParallelStyle)> {
        self.rules.iter().map(|(p, s)| (p, *s))
    }

    /// Whether the plan has no rule.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The style of module `path` and the index of the rule that gave it; `None` when no rule matches. Errors:
    /// two rules matching `path` with different styles (both named).
    pub fn style_of(&self, path: &str) -> Result<Option<(usize, ParallelStyle)>> {
        let mut found: Option<(usize, ParallelStyle)> = None;
        for (i, (pattern, style)) in self.rules.iter().enumerate() {
            if !pattern.matches(path) {
                continue;
            }
            match found {
                None => found = Some((i, *style)),
                Some((j, other)) if other != *style => {
                    return Err(AccelError::InvalidArgument(format!(
                        "parallel plan: layer `{path}` matches `{}` ({other}) and `{pattern}` ({style}); make the \
                         patterns disjoint so each layer gets one style",
                        self.rules[j].0
                    )))
                }
                Some(_) => {}
            }
        }
        Ok(found)
    }

    /// The pattern of rule `index`.
    pub(crate) fn pattern(&self, index: usize) -> &PathPattern {
        &self.rules[index].0
    }
}

impl Serialize for ParallelPlan {
    /// A map `pattern → style name`, in rule order (transformers' `tp_plan` dictionary).
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.rules.len()))?;
        for (pattern, style) in &self.rules {
            map.serialize_entry(pattern.as_str(), style.name())?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for ParallelPlan {
    /// From a map `pattern → style name`, in the map's order.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = ParallelPlan;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from module-path patterns to parallel styles (colwise, rowwise, ...)")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<ParallelPlan, A::Error> {
                let mut pairs: Vec<(String, String)> = Vec::new();
                while let Some(entry) = map.next_entry::<String, String>()? {
                    pairs.push(entry);
                }
                ParallelPlan::from_pairs(pairs.iter().map(|(p, s)| (p.as_str(), s.as_str())))
                    .map_err(serde::de::Error::custom)
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// `path` with every all-digit segment replaced by `*`: the pattern a plan would use for it
/// (`layers.3.mlp.fc1` → `layers.*.mlp.fc1`).
pub(crate) fn generalize(path: &str) -> String {
    path.split('.')
        .map(|s| if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) { "*" } else { s })
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_paths_segment_by_segment() {
        let p = PathPattern::new("layers.*.self_attn.q_proj").unwrap();
        assert!(p.matches("layers.0.self_attn.q_proj"));
        assert!(p.matches("layers.12.self_attn.q_proj"));
        assert!(!p.matches("layers.0.self_attn.q_proj.extra"), "longer path");
        assert!(!p.matches("layers.0.self_attn"), "shorter path");
        assert!(!p.matches("model.layers.0.self_attn.q_proj"), "a pattern is anchored at the root");
        assert!(!p.matches("layers.0.self_attn.k_proj"));
        for bad in ["", "a..b", ".a", "a."] {
            let err = PathPattern::new(bad).unwrap_err().to_string();
            assert!(err.contains("no empty segment"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn styles_parse_by_name_and_unknown_ones_are_listed() {
        assert_eq!("Colwise".parse::<ParallelStyle>().unwrap(), ParallelStyle::Colwise);
        assert_eq!("colwise-rep".parse::<ParallelStyle>().unwrap(), ParallelStyle::ColwiseRep);
        for style in ParallelStyle::ALL {
            assert_eq!(style.name().parse::<ParallelStyle>().unwrap(), style);
        }
        let err = "colwize".parse::<ParallelStyle>().unwrap_err().to_string();
        assert!(err.contains("\"colwize\"") && err.contains("colwise, colwise_rep, rowwise, vocab_parallel"), "{err}");
        let err = "sequence_parallel".parse::<ParallelStyle>().unwrap_err().to_string();
        assert!(err.contains("not supported yet"), "{err}");
    }

    #[test]
    fn conflicting_and_repeated_rules_are_refused() {
        let plan =
            ParallelPlan::new().with("layers.*.fc", ParallelStyle::Colwise).with("layers.0.fc", ParallelStyle::Rowwise);
        let err = plan.style_of("layers.0.fc").unwrap_err().to_string();
        assert!(err.contains("`layers.*.fc` (colwise) and `layers.0.fc` (rowwise)"), "{err}");
        assert_eq!(plan.style_of("layers.1.fc").unwrap(), Some((0, ParallelStyle::Colwise)));
        // The same style twice is no conflict.
        let agree = ParallelPlan::new().with("a.*", ParallelStyle::Colwise).with("*.b", ParallelStyle::Colwise);
        assert_eq!(agree.style_of("a.b").unwrap(), Some((0, ParallelStyle::Colwise)));
        let err = ParallelPlan::new().with("a", ParallelStyle::Colwise).try_with("a", ParallelStyle::Rowwise);
        assert!(err.unwrap_err().to_string().contains("given twice (as colwise and as rowwise)"));
    }

    #[test]
    fn a_plan_reads_and_writes_transformers_dictionary_form() {
        let json =
            r#"{"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise", "lm_head": "vocab_parallel"}"#;
        let plan: ParallelPlan = serde_json::from_str(json).unwrap();
        let rules: Vec<(String, ParallelStyle)> = plan.rules().map(|(p, s)| (p.to_string(), s)).collect();
        assert_eq!(
            rules,
            vec![
                ("layers.*.mlp.up_proj".to_string(), ParallelStyle::Colwise),
                ("layers.*.mlp.down_proj".to_string(), ParallelStyle::Rowwise),
                ("lm_head".to_string(), ParallelStyle::VocabParallel),
            ]
        );
        let back: ParallelPlan = serde_json::from_str(&serde_json::to_string(&plan).unwrap()).unwrap();
        assert_eq!(back, plan);
        let err = serde_json::from_str::<ParallelPlan>(r#"{"lm_head": "gathered"}"#).unwrap_err().to_string();
        assert!(err.contains("parallel plan[\"lm_head\"]") && err.contains("\"gathered\""), "{err}");
    }

    #[test]
    fn generalize_replaces_layer_indices() {
        assert_eq!(generalize("layers.3.mlp.fc1"), "layers.*.mlp.fc1");
        assert_eq!(generalize("h.10.attn.c_proj"), "h.*.attn.c_proj");
        assert_eq!(generalize("lm_head"), "lm_head");
    }
}
