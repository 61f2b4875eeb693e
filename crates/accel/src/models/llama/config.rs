//! [`LlamaConfig`]: transformers' `LlamaConfig` as `config.json` holds it, read in both of transformers' formats
//! (4.x: `rope_theta` + `rope_scaling`, `torch_dtype`; 5.x: `rope_parameters`, `dtype`) and checked before a
//! layer is built.

use crate::{AccelError, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;

/// The `model_type`s this model reads: `llama` (Llama 2 and 3, TinyLlama, SmolLM are `llama` themselves). Mistral
/// (`mistral`: sliding-window attention) and Qwen2 (`qwen2`: attention biases, its own names) share most of the
/// layout but are not read.
const LLAMA_TYPES: &[&str] = &["llama"];

/// A Llama-family model's hyper-parameters, under transformers' field names (`LlamaConfig`), so a `config.json`
/// written by `save_pretrained` reads as is and one we write loads in `from_pretrained`.
///
/// Fields transformers defaults (`num_key_value_heads`, `head_dim`, `hidden_act`, …) take its defaults when
/// absent. Fields this model does not read (`transformers_version`, `use_cache`, token ids, …) are kept in
/// [`LlamaConfig::other`] and written back unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size: rows of `embed_tokens`, columns of the logits.
    pub vocab_size: usize,
    /// Width of the residual stream (`d_model`).
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP's hidden layer.
    pub intermediate_size: usize,
    /// Decoder layers (the pipeline's blocks).
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention, Ainslie et al. 2023); `None`: one per query head.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of one head; `None`: `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The MLP's activation; Llama's is `silu` (the only one this model runs).
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Longest sequence the rotary tables cover.
    #[serde(default = "max_positions")]
    pub max_position_embeddings: usize,
    /// Standard deviation of the Normal initial weights of a model trained from scratch.
    #[serde(default = "initializer_range")]
    pub initializer_range: f64,
    /// ε of the RMS norms.
    #[serde(default = "rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// The head shares the embedding's weight (no `lm_head.weight` in the checkpoint).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v/o projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Dropout on the attention probabilities (training only).
    #[serde(default)]
    pub attention_dropout: f64,
    /// Biases on the MLP's projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Dropout on each residual branch's output (after `o_proj` and `down_proj`; training only). Not a field of
    /// transformers' Llama, which has none: written only when non-zero.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hidden_dropout: f64,
    /// RoPE base θ, transformers 4.x's top-level field (5.x keeps it inside `rope_parameters`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// RoPE scaling, transformers 4.x's field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Map<String, Value>>,
    /// RoPE type, θ and scaling, transformers 5.x's field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Map<String, Value>>,
    /// Every other field of `config.json` (`model_type`, `architectures`, token ids, `dtype`, …), kept as read.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

fn silu() -> String {
    "silu".into()
}
fn max_positions() -> usize {
    2048
}
fn initializer_range() -> f64 {
    0.02
}
fn rms_norm_eps() -> f64 {
    1e-6
}
fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Rotary position embeddings (Su et al. 2021, RoFormer) as transformers' Llama computes them: the base θ and how
/// the inverse frequencies are rescaled for a longer context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// Base θ of the inverse frequencies `θ^(−2i/d)`.
    pub theta: f64,
    /// Rescaling of those frequencies.
    pub scaling: RopeScaling,
}

/// The RoPE scaling types this model computes. transformers' others (`dynamic`, `yarn`, `longrope`) are refused
/// by name when a config asks for them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Unscaled (`rope_type: default`).
    Default,
    /// Position interpolation (Chen et al. 2023): every inverse frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's scaling (transformers' `_compute_llama3_parameters`): low frequencies divided by `factor`, high
    /// ones kept, the band between blended.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are low.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are high.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
}

impl LlamaConfig {
    /// A config for a model trained from scratch, with transformers' defaults for the rest (θ = 10000, no
    /// scaling, untied, no biases, no dropout): `model_type: llama`, `architectures: [LlamaForCausalLM]`.
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        let mut other = Map::new();
        other.insert("model_type".into(), "llama".into());
        other.insert("architectures".into(), Value::Array(vec!["LlamaForCausalLM".into()]));
        LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: Some(num_key_value_heads),
            head_dim: None,
            hidden_act: silu(),
            max_position_embeddings: max_positions(),
            initializer_range: initializer_range(),
            rms_norm_eps: rms_norm_eps(),
            tie_word_embeddings: false,
            attention_bias: false,
            attention_dropout: 0.0,
            mlp_bias: false,
            hidden_dropout: 0.0,
            rope_theta: Some(10_000.0),
            rope_scaling: None,
            rope_parameters: None,
            other,
        }
    }

    /// Reads and checks `dir/config.json` (a Hugging Face model directory). Errors: a missing or unparsable file,
    /// a `model_type` or architecture other than Llama's, and each of [`LlamaConfig::check`]'s.
    pub fn from_pretrained(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            AccelError::io(format!("reading {} (a Hugging Face model directory holds config.json)", path.display()), e)
        })?;
        Self::from_json(&text).map_err(|e| match e {
            AccelError::InvalidArgument(m) => AccelError::InvalidArgument(format!("{}: {m}", path.display())),
            e => e,
        })
    }

    /// Parses and checks the text of a `config.json`. Errors: not JSON; a `model_type` or architecture other
    /// than Llama's (checked first, so another family's config is named as such, not as a missing field); a
    /// missing or mistyped field; [`LlamaConfig::check`]'s.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| AccelError::InvalidArgument(format!("config.json is not JSON: {e}")))?;
        if let Some(fields) = value.as_object() {
            check_family(fields)?;
        }
        let config: LlamaConfig = serde_json::from_value(value).map_err(|e| {
            AccelError::InvalidArgument(format!("config.json is not a Llama config (transformers' LlamaConfig): {e}"))
        })?;
        config.check()?;
        Ok(config)
    }

    /// The JSON text of this config (`config.json`'s).
    pub fn to_json(&self) -> Result<String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| AccelError::json("encoding config.json", e))?;
        Ok(text + "\n")
    }

    /// Checks what the model cannot run: a `model_type` or architecture other than Llama's, an activation other
    /// than SiLU, sizes that do not fit together (key/value heads that do not divide the query heads, a hidden
    /// size heads do not divide without `head_dim`, an odd head width), dropout outside [0, 1), a RoPE scaling
    /// type it does not compute.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(AccelError::InvalidArgument(m));
        check_family(&self.other)?;
        if self.hidden_act != "silu" {
            return bad(format!(
                "hidden_act {:?}: Llama's MLP is SwiGLU, whose gate is silu; this model runs only \"silu\"",
                self.hidden_act
            ));
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0; it must be positive"));
            }
        }
        let (heads, kv) = (self.num_attention_heads, self.num_key_value_heads());
        if kv == 0 || kv > heads || !heads.is_multiple_of(kv) {
            return bad(format!(
                "num_key_value_heads = {kv} must divide num_attention_heads = {heads} (each key/value head serves \
                 the same number of query heads); values that fit: {}",
                crate::tensor_parallel::divisors(heads)
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(heads) {
            return bad(format!(
                "hidden_size = {} is not divisible by num_attention_heads = {heads}: set head_dim, or a hidden size \
                 that is a multiple of the head count",
                self.hidden_size
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            return bad(format!("head_dim = {hd}: rotary embeddings rotate pairs of features, so it must be even"));
        }
        for (name, p) in [("attention_dropout", self.attention_dropout), ("hidden_dropout", self.hidden_dropout)] {
            if !(0.0..1.0).contains(&p) {
                return bad(format!("{name} = {p} is outside [0, 1); 0 turns it off"));
            }
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return bad(format!("rms_norm_eps = {} must be positive", self.rms_norm_eps));
        }
        self.rope()?;
        Ok(())
    }

    /// Checks that a tensor-parallel group of `tp` ranks can split the model: `tp` divides the key/value heads (each
    /// rank computes whole key/value heads and the query heads they serve; they are not replicated across ranks)
    /// and the MLP's width (`intermediate_size`: gate/up column-wise, down row-wise). The vocabulary is padded, so
    /// it never constrains tp. Errors name the size and the tp sizes that fit.
    pub fn check_tp_size(&self, tp: usize) -> Result<()> {
        let kv = self.num_key_value_heads();
        let fits = |n: usize| crate::tensor_parallel::divisors(n);
        if tp == 0 || !kv.is_multiple_of(tp) {
            return Err(AccelError::InvalidArgument(format!(
                "Llama: tp size {tp} does not divide num_key_value_heads = {kv}: tensor parallelism gives each rank \
                 whole key/value heads and the query heads they serve (key/value heads are not replicated across \
                 ranks); tp sizes that fit: {}",
                fits(kv)
            )));
        }
        let f = self.intermediate_size;
        if !f.is_multiple_of(tp) {
            let both: Vec<String> =
                (1..=kv).filter(|d| kv.is_multiple_of(*d) && f.is_multiple_of(*d)).map(|d| d.to_string()).collect();
            return Err(AccelError::InvalidArgument(format!(
                "Llama: tp size {tp} does not divide intermediate_size = {f} (the MLP's gate/up projections are \
                 split by their outputs, down by its inputs); tp sizes that fit the heads and the MLP: {}",
                both.join(", ")
            )));
        }
        Ok(())
    }

    /// Key/value heads (`num_attention_heads` when absent).
    pub fn num_key_value_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The rotary embedding, from `rope_parameters` (transformers 5.x) or `rope_theta` + `rope_scaling` (4.x; θ
    /// 10000 when absent). Errors: a scaling type this model does not compute (named, with the ones it does), a
    /// missing or non-positive field of the type.
    pub fn rope(&self) -> Result<Rope> {
        let (params, theta) = match &self.rope_parameters {
            Some(p) => (Some(p), p.get("rope_theta").and_then(Value::as_f64).or(self.rope_theta)),
            None => (self.rope_scaling.as_ref(), self.rope_theta),
        };
        let theta = theta.unwrap_or(10_000.0);
        if theta.is_nan() || theta <= 1.0 {
            return Err(AccelError::InvalidArgument(format!("rope_theta = {theta} must be greater than 1")));
        }
        let Some(params) = params else { return Ok(Rope { theta, scaling: RopeScaling::Default }) };
        let kind = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str).unwrap_or("default");
        let number = |key: &str| -> Result<f64> {
            match params.get(key).and_then(Value::as_f64) {
                Some(v) if v > 0.0 => Ok(v),
                _ => Err(AccelError::InvalidArgument(format!(
                    "rope scaling {kind:?} needs a positive {key:?}, got {:?}",
                    params.get(key)
                ))),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: number("factor")? },
            "llama3" => {
                let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
                if high <= low {
                    return Err(AccelError::InvalidArgument(format!(
                        "rope scaling \"llama3\": high_freq_factor = {high} must exceed low_freq_factor = {low}"
                    )));
                }
                RopeScaling::Llama3 {
                    factor: number("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
                }
            }
            other => {
                return Err(AccelError::InvalidArgument(format!(
                    "rope scaling type {other:?} is not supported by accel's Llama; it computes \"default\", \
                     \"linear\" and \"llama3\" (transformers' \"dynamic\", \"yarn\" and \"longrope\" are not \
                     implemented)"
                )))
            }
        };
        Ok(Rope { theta, scaling })
    }

    /// The `config.json` text a save writes: `dtype` (transformers 5.x) or `torch_dtype` (4.x, when the config
    /// was read with it) set to the weights' dtype on disk, and the sizes transformers writes as numbers
    /// (`num_key_value_heads`, `head_dim`) filled in.
    pub(crate) fn json_for(&self, dtype: candle_core::DType) -> Result<String> {
        let mut config = self.clone();
        config.num_key_value_heads = Some(self.num_key_value_heads());
        config.head_dim = Some(self.head_dim());
        let name = match dtype {
            candle_core::DType::BF16 => "bfloat16",
            candle_core::DType::F16 => "float16",
            _ => "float32",
        };
        let key = if config.other.contains_key("torch_dtype") { "torch_dtype" } else { "dtype" };
        config.other.insert(key.into(), name.into());
        config.to_json()
    }
}

/// Refuses a `model_type` or an architecture other than Llama's, given the config's fields that name them.
fn check_family(fields: &Map<String, Value>) -> Result<()> {
    if let Some(t) = fields.get("model_type").and_then(Value::as_str) {
        if !LLAMA_TYPES.contains(&t) {
            return Err(AccelError::InvalidArgument(format!(
                "model_type {t:?} is not a Llama; this model reads model_type \"llama\" (LlamaForCausalLM). A \
                 model of another family needs its own implementation on accel::nn"
            )));
        }
    }
    if let Some(archs) = fields.get("architectures").and_then(Value::as_array) {
        if let Some(a) = archs.iter().filter_map(Value::as_str).find(|a| *a != "LlamaForCausalLM") {
            return Err(AccelError::InvalidArgument(format!(
                "architecture {a:?} is not LlamaForCausalLM, the only Llama head this model has (a causal language \
                 model)"
            )));
        }
    }
    Ok(())
}
