//! Hugging Face model directories for the Llama family: `config.json` and the weights in `model.safetensors`, or
//! sharded as `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json`
//! (`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`) — what transformers' `save_pretrained`
//! writes and `from_pretrained` reads — loaded into and saved from any layout.

use super::config::LlamaConfig;
use crate::accelerator::checkpointing::agree;
use crate::state::checkpoint_dir::{commit, partial_dir, remove_if_exists};
use crate::state::write_atomic;
use crate::tensor_parallel::InitialWeights;
use crate::{AccelError, Accelerator, PreparedModel, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The single-file weights' name.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The sharded weights' index.
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// How [`save_pretrained`] stores the weights, and what else it writes.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveOptions {
    /// The weights' dtype on disk: F32, BF16 or F16 (training keeps f32 masters; they are cast on the way out).
    pub dtype: DType,
    /// Largest shard in bytes; `None`: one `model.safetensors`. transformers' `max_shard_size` (a tensor larger
    /// than it gets a shard of its own).
    pub max_shard_size: Option<u64>,
    /// Further files written into the directory with the model, in the same commit (file name, contents): the
    /// tokenizer's `tokenizer.json` and `tokenizer_config.json`, a `generation_config.json`.
    pub files: Vec<(String, Vec<u8>)>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions { dtype: DType::F32, max_shard_size: None, files: Vec::new() }
    }
}

/// Whether `name` is one of the files the weights of a model directory live in (`model.safetensors`, its shards
/// and their index): what a save replaces rather than carries over.
fn is_weights_file(name: &str) -> bool {
    name == WEIGHTS_FILE
        || name == WEIGHTS_INDEX_FILE
        || (name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors"))
}

/// Every weight a checkpoint of `config` holds, by transformers' name, with its shape (what transformers'
/// `save_pretrained` writes for a `LlamaForCausalLM`: no `lm_head.weight` when the head is tied).
pub fn weight_shapes(config: &LlamaConfig) -> BTreeMap<String, Vec<usize>> {
    let (v, h, i) = (config.vocab_size, config.hidden_size, config.intermediate_size);
    let (q, kv) = (config.num_attention_heads * config.head_dim(), config.num_key_value_heads() * config.head_dim());
    let mut shapes = BTreeMap::new();
    shapes.insert("model.embed_tokens.weight".to_string(), vec![v, h]);
    shapes.insert("model.norm.weight".to_string(), vec![h]);
    if !config.tie_word_embeddings {
        shapes.insert("lm_head.weight".to_string(), vec![v, h]);
    }
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mut put = |name: String, shape: Vec<usize>| shapes.insert(format!("{p}.{name}"), shape);
        put("input_layernorm.weight".into(), vec![h]);
        put("post_attention_layernorm.weight".into(), vec![h]);
        let linears = [
            ("self_attn.q_proj", q, h, config.attention_bias),
            ("self_attn.k_proj", kv, h, config.attention_bias),
            ("self_attn.v_proj", kv, h, config.attention_bias),
            ("self_attn.o_proj", h, q, config.attention_bias),
            ("mlp.gate_proj", i, h, config.mlp_bias),
            ("mlp.up_proj", i, h, config.mlp_bias),
            ("mlp.down_proj", h, i, config.mlp_bias),
        ];
        for (name, out, inp, bias) in linears {
            put(format!("{name}.weight"), vec![out, inp]);
            if bias {
                put(format!("{name}.bias"), vec![out]);
            }
        }
    }
    shapes
}

/// Buffers some checkpoints carry that are not weights (transformers ignores them too).
fn ignored(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// The weight files of the directory: the index's files, or `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(WEIGHTS_INDEX_FILE);
    if index.exists() {
        let json = crate::state::read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| AccelError::InvalidArgument(format!("{} has no \"weight_map\" object", index.display())))?;
        let mut files: Vec<PathBuf> = map.values().filter_map(|f| f.as_str()).map(|f| dir.join(f)).collect();
        files.sort();
        files.dedup();
        if let Some(missing) = files.iter().find(|f| !f.exists()) {
            return Err(AccelError::InvalidArgument(format!(
                "{} names {}, which does not exist: the shards are incomplete (download or copy the whole \
                 directory)",
                index.display(),
                missing.display()
            )));
        }
        return Ok(files);
    }
    let single = dir.join(WEIGHTS_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(AccelError::InvalidArgument(format!(
        "{} holds neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}; only safetensors weights are read \
         (pytorch_model.bin is not: convert it with transformers' save_pretrained(dir, safe_serialization=True))",
        dir.display()
    )))
}

/// A list of names for a message: the first few, and how many more.
fn listed(names: &[&String]) -> String {
    let shown: Vec<String> = names.iter().take(6).map(|n| format!("{n:?}")).collect();
    match names.len() > 6 {
        true => format!("{} and {} more", shown.join(", "), names.len() - 6),
        false => shown.join(", "),
    }
}

/// A Hugging Face directory's weights, checked against a config and memory-mapped: what
/// [`crate::nn::VarBuilder::with_weights`] builds a [`super::Llama`] from (each rank reading only the tensors of its
/// pipeline stages, and of each only its tensor-parallel rows), and what [`load_pretrained`] loads into a prepared model.
pub struct PretrainedWeights {
    st: MmapedSafetensors,
    dir: PathBuf,
}

impl PretrainedWeights {
    /// Opens `dir`'s weights (`model.safetensors`, or the shards its index lists) and checks them against
    /// `config` before anything is built or loaded. Errors: no weight file, or a shard the index lists missing;
    /// missing or unexpected weights (named); a shape that disagrees with the config (both shapes named); a dtype
    /// other than f32/bf16/f16; a tied head's `lm_head.weight` that differs from the embedding.
    pub fn open(dir: &Path, config: &LlamaConfig) -> Result<Arc<Self>> {
        let files = weight_files(dir)?;
        // SAFETY: the files are mapped read-only; like every reader of safetensors (candle's, transformers'),
        // this assumes no other process truncates them while the model loads.
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| {
            AccelError::InvalidArgument(format!(
                "reading the weights of {}: {e} (a truncated or damaged safetensors file: download or copy it again)",
                dir.display()
            ))
        })?;
        let weights = PretrainedWeights { st, dir: dir.to_path_buf() };
        weights.check(config)?;
        Ok(Arc::new(weights))
    }

    fn check(&self, config: &LlamaConfig) -> Result<()> {
        let dir = &self.dir;
        let on_disk: BTreeMap<String, (Vec<usize>, safetensors::Dtype)> =
            self.st.tensors().into_iter().map(|(name, view)| (name, (view.shape().to_vec(), view.dtype()))).collect();
        let expected = weight_shapes(config);
        let in_dir = || format!("the weights in {}", dir.display());
        let missing: Vec<&String> = expected.keys().filter(|n| !on_disk.contains_key(*n)).collect();
        if !missing.is_empty() {
            return Err(AccelError::InvalidArgument(format!(
                "{} lack {} weight(s) a Llama with this config.json has: {} (a partial download, or a config \
                 that does not belong to these weights)",
                in_dir(),
                missing.len(),
                listed(&missing)
            )));
        }
        let tied_copy = |n: &str| config.tie_word_embeddings && n == "lm_head.weight";
        let unexpected: Vec<&String> =
            on_disk.keys().filter(|n| !expected.contains_key(*n) && !ignored(n) && !tied_copy(n)).collect();
        if !unexpected.is_empty() {
            return Err(AccelError::InvalidArgument(format!(
                "{} hold {} weight(s) a Llama with this config.json does not have: {} (another architecture, or a \
                 config.json that does not describe these weights, e.g. attention_bias or num_hidden_layers)",
                in_dir(),
                unexpected.len(),
                listed(&unexpected)
            )));
        }
        for (name, shape) in &expected {
            let (disk, dtype) = &on_disk[name];
            if disk != shape {
                return Err(AccelError::InvalidArgument(format!(
                    "{name} has shape {disk:?} in {} but config.json gives {shape:?}: the config does not describe \
                     these weights",
                    dir.display()
                )));
            }
            if !matches!(dtype, safetensors::Dtype::F32 | safetensors::Dtype::BF16 | safetensors::Dtype::F16) {
                return Err(AccelError::InvalidArgument(format!(
                    "{name} is stored as {dtype:?} in {}; weights are read as f32, bf16 or f16",
                    dir.display()
                )));
            }
        }
        if on_disk.contains_key("lm_head.weight") && config.tie_word_embeddings {
            let (head, embed) = (self.full_tensor("lm_head.weight")?, self.full_tensor("model.embed_tokens.weight")?);
            let diff = (head - embed)?.abs()?.max_all()?.to_scalar::<f32>()?;
            if diff != 0.0 {
                return Err(AccelError::InvalidArgument(format!(
                    "config.json ties the head to the embedding (tie_word_embeddings), but {} holds an \
                     lm_head.weight that differs from model.embed_tokens.weight (by up to {diff}): set \
                     tie_word_embeddings to false to load both",
                    dir.display()
                )));
            }
        }
        Ok(())
    }
}

/// A tensor-parallel rank reads only its rows of each sharded weight: the mapped file's bytes of those rows.
impl InitialWeights for PretrainedWeights {
    fn full_tensor(&self, name: &str) -> Result<Tensor> {
        let t = self.st.load(name, &Device::Cpu).map_err(|e| self.read_error(name, e))?;
        Ok(t.to_dtype(DType::F32)?)
    }

    fn rows(&self, name: &str, full_shape: &[usize], dim: usize, range: Range<usize>) -> Result<Option<Tensor>> {
        use safetensors::slice::TensorIndexer;
        use std::ops::Bound;
        let view = self.st.get(name).map_err(|e| self.read_error(name, e))?;
        if view.shape() != full_shape {
            return Err(AccelError::InvalidArgument(format!(
                "{name} has shape {:?} in {} but the model builds it with shape {full_shape:?}",
                view.shape(),
                self.dir.display()
            )));
        }
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            _ => return Ok(None),
        };
        let one = std::num::NonZeroUsize::MIN;
        let all = TensorIndexer::Narrow(Bound::Unbounded, Bound::Unbounded, one);
        let mut index = vec![all; dim];
        index.push(TensorIndexer::Narrow(Bound::Included(range.start), Bound::Excluded(range.end), one));
        let pieces = view.sliced_data(&index).map_err(|e| {
            AccelError::InvalidArgument(format!("reading rows {range:?} of {name} along dim {dim}: {e:?}"))
        })?;
        let bytes: Vec<u8> = pieces.flat_map(|p| p.iter().copied()).collect();
        let mut shape = full_shape.to_vec();
        shape[dim] = range.len();
        Ok(Some(Tensor::from_raw_buffer(&bytes, dtype, &shape, &Device::Cpu)?.to_dtype(DType::F32)?))
    }
}

impl PretrainedWeights {
    fn read_error(&self, name: &str, e: candle_core::Error) -> AccelError {
        AccelError::InvalidArgument(format!("reading {name} from the weights in {}: {e}", self.dir.display()))
    }
}

/// Loads a Hugging Face directory's weights into `model` (prepared from a [`super::Llama`] built with `config`),
/// at any layout: each rank reads only the tensors of its own pipeline stages and keeps its tensor-parallel slice
/// and its data-parallel shard of each. f32, bf16 and f16 on disk; the masters stay f32. No communication. (To
/// build the model from the weights instead, give its builder [`PretrainedWeights`].)
///
/// Errors, before any weight is changed: [`PretrainedWeights::open`]'s.
pub fn load_pretrained(model: &PreparedModel, config: &LlamaConfig, dir: &Path) -> Result<()> {
    let source = PretrainedWeights::open(dir, config)?;
    let weights =
        model.names().iter().map(|n| Ok((n.clone(), source.full_tensor(n)?))).collect::<Result<BTreeMap<_, _>>>()?;
    model.load_state_dict(&weights)
}

/// Saves `model` (prepared from a [`super::Llama`] built with `config`) as a Hugging Face directory — `config.json`
/// and the weights, whole (`model.safetensors`) or sharded with an index — from any layout: the tp shards and the
/// pipeline stages are gathered onto the main process, which writes. Collective: every rank calls it.
///
/// Atomic: the directory is written under a hidden sibling name and renamed into place (replacing a previous
/// save), so a crash leaves the old directory or the new one, never a mix (between the two renames the old one
/// sits under its hidden `.name.old` sibling). Replacing a model directory keeps what it held besides the config
/// and the weights — a tokenizer, `generation_config.json`, a README — unless `options.files` writes it anew:
/// fine-tuning a directory in place loses nothing. Errors, before anything is gathered or written: a dtype other
/// than f32/bf16/f16; an existing `dir` that is not a model directory ([`check_save_dir`]); then I/O (on any
/// rank: every rank returns the error and nothing is committed).
pub fn save_pretrained(
    acc: &Accelerator,
    model: &PreparedModel,
    config: &LlamaConfig,
    dir: &Path,
    options: &SaveOptions,
) -> Result<()> {
    if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(AccelError::InvalidArgument(format!(
            "save_pretrained: dtype {:?}; weights are written as F32, BF16 or F16",
            options.dtype
        )));
    }
    let main = acc.is_main_process();
    let partial = partial_dir(dir);
    let prepared = match main {
        true => check_save_dir(dir).and_then(|()| remove_if_exists(&partial)).and_then(|()| {
            std::fs::create_dir_all(&partial).map_err(|e| AccelError::io(format!("creating {}", partial.display()), e))
        }),
        false => Ok(()),
    };
    agree(acc, "preparing", dir, prepared)?;
    let full = model.checkpoint_state_dict();
    let written = match (main, full) {
        (true, Ok(full)) => write_directory(&partial, config, full, options).and_then(|()| carry_over(dir, &partial)),
        (_, full) => full.map(drop),
    };
    if let Err(e) = agree(acc, "writing", dir, written) {
        if main {
            let _ = remove_if_exists(&partial);
        }
        return Err(e);
    }
    let committed = if main { commit(&partial, dir) } else { Ok(()) };
    agree(acc, "committing", dir, committed)
}

/// Checks that [`save_pretrained`] may write `dir`: it does not exist, is empty, or is a model directory — its
/// `config.json` a model's (it names a `model_type`) and nothing in it a directory. Call it before training, so a
/// run that cannot save is refused before it starts. Errors name the directory and what makes it not a model's.
pub fn check_save_dir(dir: &Path) -> Result<()> {
    let refuse = |why: String| {
        Err(AccelError::InvalidArgument(format!(
            "save_pretrained: {} {why}; it is not replaced: choose another directory, or empty it",
            dir.display()
        )))
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries.collect::<std::io::Result<Vec<_>>>(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => return refuse("is a file".into()),
        Err(e) => return Err(AccelError::io(format!("reading {}", dir.display()), e)),
    }
    .map_err(|e| AccelError::io(format!("reading {}", dir.display()), e))?;
    if entries.is_empty() {
        return Ok(());
    }
    let config = dir.join("config.json");
    let is_model_config = std::fs::read_to_string(&config)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("model_type").is_some());
    if !is_model_config {
        return refuse("exists and is not a model directory (no config.json naming a model_type)".into());
    }
    if let Some(sub) = entries.iter().find(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
        return refuse(format!("holds a directory, {:?}, which a model directory does not", sub.file_name()));
    }
    Ok(())
}

/// Copies into the new directory `partial` what the directory it replaces held besides the config and the
/// weights (a tokenizer, a generation config, a README), unless the new one has a file of that name.
fn carry_over(dir: &Path, partial: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries {
        let entry = entry.map_err(|e| AccelError::io(format!("reading {}", dir.display()), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let target = partial.join(&name);
        if name == "config.json" || is_weights_file(&name) || target.exists() {
            continue;
        }
        let bytes = std::fs::read(entry.path()).map_err(|e| AccelError::io(format!("reading {name}"), e))?;
        write_atomic(&target, bytes)?;
    }
    Ok(())
}

/// Writes `config.json` and the weights into `dir` (a fresh directory).
fn write_directory(
    dir: &Path,
    config: &LlamaConfig,
    full: BTreeMap<String, Tensor>,
    options: &SaveOptions,
) -> Result<()> {
    write_atomic(&dir.join("config.json"), config.json_for(options.dtype)?)?;
    for (name, bytes) in &options.files {
        if name == "config.json" || is_weights_file(name) || name.contains(std::path::MAIN_SEPARATOR) {
            return Err(AccelError::InvalidArgument(format!(
                "save_pretrained: a further file may not be named {name:?} (the config, the weights and paths are \
                 save_pretrained's own)"
            )));
        }
        write_atomic(&dir.join(name), bytes)?;
    }
    let weights = full
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?.to_dtype(options.dtype)?.contiguous()?)))
        .collect::<Result<BTreeMap<String, Tensor>>>()?;
    let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
    let total: u64 = weights.values().map(bytes).sum();
    let Some(max) = options.max_shard_size else {
        return write_safetensors(&dir.join(WEIGHTS_FILE), weights);
    };
    // transformers' packing: tensors in order, a new shard when the next would pass the limit.
    let mut shards: Vec<BTreeMap<String, Tensor>> = vec![BTreeMap::new()];
    let mut size = 0;
    for (name, t) in weights {
        let current = shards.last().expect("one shard");
        if !current.is_empty() && size + bytes(&t) > max {
            shards.push(BTreeMap::new());
            size = 0;
        }
        size += bytes(&t);
        shards.last_mut().expect("one shard").insert(name, t);
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.into_iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        for name in shard.keys() {
            weight_map.insert(name.clone(), file.clone().into());
        }
        write_safetensors(&dir.join(&file), shard)?;
    }
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let text = serde_json::to_string_pretty(&index).map_err(|e| AccelError::json("encoding the index", e))?;
    write_atomic(&dir.join(WEIGHTS_INDEX_FILE), text + "\n")
}

/// One safetensors file with transformers' metadata (`format: pt`, which its loader checks).
fn write_safetensors(path: &Path, tensors: BTreeMap<String, Tensor>) -> Result<()> {
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let map: HashMap<String, Tensor> = tensors.into_iter().collect();
    let bytes = safetensors::tensor::serialize(map, Some(metadata))
        .map_err(|e| AccelError::InvalidArgument(format!("serializing {}: {e}", path.display())))?;
    write_atomic(path, bytes)
}
