//! The Llama family against code no one here wrote: transformers' `LlamaForCausalLM` (the fixture
//! `tests/fixtures/llama`, made by `scripts/llama-fixture.py`: a grouped-query model with its own head, and a tied
//! one with Llama 3's RoPE scaling) and candle-transformers' `llama`. Logits, loss and every gradient match at one
//! process and at tp 2, pp 2, FULL_SHARD 2 and dp 2 × tp 2; greedy generation matches token for token; a
//! directory saved at any layout loads at any other; bad checkpoints are refused by name with nothing written.
//!
//! Tolerance: f32, `|a − b| ≤ 1e-5 · max(1, |b|)` (the issue's 1e-5; products sum in other orders).

use crate::plan::{config, pipelined};
use crate::ranks::*;
use accel::models::llama::{self, Llama, LlamaConfig, RopeScaling, SaveOptions};
use accel::pipeline::ScheduleKind;
use accel::{AcceleratorConfig, AdamW, AdamWConfig, Sgd, SgdConfig, ShardingStrategy};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const TOL: f32 = 1e-5;

fn fixture(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama").join(model)
}

/// What transformers computed for the fixture's batch.
struct Reference {
    /// `[2, 8]` u32.
    input_ids: Tensor,
    logits: Vec<f32>,
    loss: f32,
    grads: BTreeMap<String, Vec<f32>>,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn reference(model: &str) -> Reference {
    let r = accel::state::load_safetensors(&fixture(model).join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = |n: &str| r[n].to_dtype(DType::U32).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let grads = r.iter().filter_map(|(n, t)| n.strip_prefix("grad.").map(|n| (n.to_string(), flat(t)))).collect();
    Reference {
        input_ids: ids("input_ids"),
        logits: flat(&r["logits"]),
        loss: flat(&r["loss"])[0],
        grads,
        prompt: ids("prompt_ids").flatten_all().unwrap().to_vec1().unwrap(),
        greedy: ids("greedy_ids").flatten_all().unwrap().to_vec1().unwrap(),
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

/// Builds a directory's model at the layout `acc` has from its weights (the builder reading them).
fn load(acc: &accel::Accelerator, dir: &Path) -> anyhow::Result<(Llama, accel::PreparedModel, LlamaConfig)> {
    let config = LlamaConfig::from_pretrained(dir)?;
    let varmap = VarMap::new();
    let weights = llama::PretrainedWeights::open(dir, &config)?;
    let model = Llama::new(&config, acc.builder(&varmap, Llama::plan(&config)).with_weights(weights))?;
    let prepared = acc.prepare_model(&varmap)?;
    Ok((model, prepared, config))
}

/// [`load`] the other way: the model built from the seed and prepared, then the weights loaded into it.
fn load_into_prepared(acc: &accel::Accelerator, dir: &Path) -> anyhow::Result<(Llama, accel::PreparedModel)> {
    let config = LlamaConfig::from_pretrained(dir)?;
    let varmap = VarMap::new();
    let model = Llama::new(&config, acc.builder(&varmap, Llama::plan(&config)))?;
    let prepared = acc.prepare_model(&varmap)?;
    llama::load_pretrained(&prepared, &config, dir)?;
    Ok((model, prepared))
}

/// One rank's view of the fixture's batch: (its dp rank, the full logits of its rows where this rank holds the
/// last stage, its rows' loss, every full gradient).
type Computed = (usize, Option<Vec<f32>>, f32, BTreeMap<String, Vec<f32>>);

/// Loads the fixture at the layout `cfg` gives and computes its logits (all 8 positions), the loss of the ids
/// shifted by one (what transformers' `labels` computes) and the gradients (`w₀ − w₁` after one SGD step at
/// learning rate 1), each dp rank on its rows of the batch.
fn compute(model_name: &'static str, world: usize, cfg: AcceleratorConfig) -> Vec<Computed> {
    run_ranks(world, cfg, move |acc| {
        let (model, prepared, _) = load(&acc, &fixture(model_name))?;
        let ids = reference(model_name).input_ids;
        let rows = 2 / acc.data_parallel_size();
        let ids = ids.narrow(0, acc.data_parallel_rank() * rows, rows)?;
        let logits = Arc::new(Mutex::new(None));
        let seen = logits.clone();
        acc.pipeline_forward(&model, &ids, &ids, |l, _| {
            let full = model.full_logits(l)?;
            *seen.lock().unwrap() = Some(full.flatten_all()?.to_vec1::<f32>()?);
            Ok(Tensor::new(0f32, l.device())?)
        })?;
        let before = to_f32_map(&prepared.state_dict()?);
        let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(1.0))?)?;
        let (inputs, targets) = (ids.narrow(1, 0, 7)?, ids.narrow(1, 1, 7)?);
        let loss = acc.pipeline_backward(&model, &inputs, &targets, |l, t| model.loss(l, t))?;
        assert!(opt.step()?);
        let after = to_f32_map(&prepared.state_dict()?);
        let grads =
            before.iter().map(|(n, w0)| (n.clone(), w0.iter().zip(&after[n]).map(|(a, b)| a - b).collect())).collect();
        let logits = logits.lock().unwrap().take();
        Ok((acc.data_parallel_rank(), logits, loss.to_scalar::<f32>()?, grads))
    })
}

fn plain() -> AcceleratorConfig {
    config(1, 1, 1, ShardingStrategy::default())
}

/// The layouts the issue names, each with its world size.
fn layouts() -> Vec<(&'static str, usize, AcceleratorConfig)> {
    vec![
        ("one process", 1, plain()),
        ("tp 2", 2, config(1, 1, 2, ShardingStrategy::default())),
        ("pp 2", 2, pipelined(2, ScheduleKind::OneFOneB, None, plain())),
        ("FULL_SHARD 2", 2, config(1, 2, 1, ShardingStrategy::FullShard)),
        ("dp 2 × tp 2", 4, config(2, 1, 2, ShardingStrategy::default())),
        // Beyond the issue's list (the fixture's batch of 2 rows bounds dp at 2): the runtime's recomputation,
        // sharding with tensor parallelism, and pipeline × tensor parallelism.
        ("activation checkpointing", 1, AcceleratorConfig { activation_checkpointing: true, ..plain() }),
        ("FULL_SHARD 2 × tp 2", 4, config(1, 2, 2, ShardingStrategy::FullShard)),
        ("pp 2 × tp 2", 4, pipelined(2, ScheduleKind::OneFOneB, None, config(1, 1, 2, ShardingStrategy::default()))),
        ("ZeRO-1 over dp_shard 2", 2, config(1, 2, 1, ShardingStrategy::ShardOptim)),
        ("ZeRO-2 over dp_shard 2", 2, config(1, 2, 1, ShardingStrategy::ShardGradOp)),
        ("pp 2, GPipe", 2, pipelined(2, ScheduleKind::GPipe, None, plain())),
    ]
}

#[test]
fn logits_loss_and_gradients_match_transformers_at_every_layout() {
    for model in ["gqa", "tied"] {
        let want = reference(model);
        for (name, world, cfg) in layouts() {
            let ranks = compute(model, world, cfg);
            // Logits: each dp rank's rows, from every rank that holds the last stage.
            let per_row = want.logits.len() / 2;
            let mut checked = 0;
            for (dp_rank, logits, _, _) in &ranks {
                if let Some(logits) = logits {
                    let rows = logits.len() / per_row;
                    let start = dp_rank * rows * per_row;
                    let d = max_diff(logits, &want.logits[start..start + logits.len()]);
                    assert!(d <= TOL, "{model}, {name}: logits differ from transformers' by {d:e}");
                    checked += rows;
                }
            }
            assert!(checked >= 2, "{model}, {name}: no rank returned the logits of every row");
            // Each dp rank's mean over its rows; the batch's mean is their mean (equal rows per rank).
            let loss = ranks.iter().map(|r| r.2).sum::<f32>() / ranks.len() as f32;
            assert!((loss - want.loss).abs() <= TOL * want.loss, "{model}, {name}: loss {loss} vs {}", want.loss);
            let grads = &ranks[0].3;
            assert_eq!(grads.keys().collect::<Vec<_>>(), want.grads.keys().collect::<Vec<_>>(), "{model}, {name}");
            let d = max_rel_diff(grads, &want.grads);
            eprintln!("Llama {model}, {name}: loss {loss:.8} (transformers {:.8}), gradients within {d:e}", want.loss);
            assert!(d <= TOL, "{model}, {name}: gradients differ from transformers' by {d:e}");
            for (r, rank) in ranks.iter().enumerate() {
                assert_eq!(&rank.3, grads, "{model}, {name}: rank {r}'s weights differ from rank 0's");
            }
        }
    }
}

#[test]
fn greedy_generation_matches_transformers_token_for_token() {
    for model in ["gqa", "tied"] {
        let want = reference(model);
        for (name, world, cfg) in
            [("one process", 1, plain()), ("tp 2", 2, config(1, 1, 2, ShardingStrategy::default()))]
        {
            let prompt = want.prompt.clone();
            let new_tokens = want.greedy.len() - prompt.len();
            let got = run_ranks(world, cfg, move |acc| {
                let (model, _, _) = load(&acc, &fixture(model))?;
                Ok(model.generate_greedy(&prompt, new_tokens)?)
            });
            for ids in got {
                assert_eq!(ids, want.greedy, "{model}, {name}: greedy ids differ from transformers' generate");
            }
        }
    }
}

/// Trains the gqa fixture two AdamW steps at one layout and saves it; returns the saved weights and the loss of
/// the next batch.
fn train_and_save(
    world: usize,
    cfg: AcceleratorConfig,
    dir: PathBuf,
    options: SaveOptions,
) -> (BTreeMap<String, Vec<f32>>, f32) {
    let out = run_ranks(world, cfg, move |acc| {
        let (model, prepared, config) = load(&acc, &fixture("gqa"))?;
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(0.01))?)?;
        let ids = reference("gqa").input_ids;
        let rows = 2 / acc.data_parallel_size();
        let ids = ids.narrow(0, acc.data_parallel_rank() * rows, rows)?;
        for _ in 0..2 {
            acc.pipeline_backward(&model, &ids.narrow(1, 0, 7)?, &ids.narrow(1, 1, 7)?, |l, t| model.loss(l, t))?;
            assert!(opt.step()?);
        }
        llama::save_pretrained(&acc, &prepared, &config, &dir, &options)?;
        let next = next_loss(&acc, &model)?;
        Ok((to_f32_map(&prepared.state_dict()?), next))
    });
    out.into_iter().next().unwrap()
}

/// The mean loss over the whole fixture batch (reversed, so it is not the batch trained on), every layout.
fn next_loss(acc: &accel::Accelerator, model: &Llama) -> anyhow::Result<f32> {
    let ids = reference("gqa").input_ids.flip(&[1])?.contiguous()?;
    let loss = acc.pipeline_forward(model, &ids.narrow(1, 0, 7)?, &ids.narrow(1, 1, 7)?, |l, t| model.loss(l, t))?;
    Ok(loss.to_scalar::<f32>()?)
}

#[test]
fn a_directory_saved_at_any_layout_loads_at_any_other() {
    let tmp = tempfile::tempdir().unwrap();
    let layouts = [layouts(), vec![("dp 2", 2, config(2, 1, 1, ShardingStrategy::default()))]].concat();
    let mut saved = Vec::new();
    for (i, (name, world, cfg)) in layouts.iter().enumerate() {
        let dir = tmp.path().join(format!("saved-{i}"));
        // Sharded files from half the layouts (small shards: several files and an index).
        let max_shard_size = (i % 2 == 1).then_some(40_000);
        let (weights, next) =
            train_and_save(*world, cfg.clone(), dir.clone(), SaveOptions { max_shard_size, ..Default::default() });
        assert_eq!(dir.join(llama::WEIGHTS_INDEX_FILE).exists(), max_shard_size.is_some(), "{name}");
        saved.push((name, dir, weights, next));
    }
    // Every layout trained to the same weights (one process's, within rounding).
    for (name, _, weights, _) in &saved[1..] {
        let d = max_rel_diff(weights, &saved[0].2);
        assert!(d <= TOL, "{name}: trained weights differ from one process's by {d:e}");
    }
    for (from, dir, weights, next) in &saved {
        for (to, world, cfg) in &layouts {
            let dir = dir.clone();
            // Half the loads build the model from the weights, half load them into a prepared model.
            let built = (from.len() + to.len()) % 2 == 0;
            let got = run_ranks(*world, cfg.clone(), move |acc| {
                let (model, prepared) = match built {
                    true => load(&acc, &dir).map(|(m, p, _)| (m, p))?,
                    false => load_into_prepared(&acc, &dir)?,
                };
                Ok((to_f32_map(&prepared.state_dict()?), next_loss(&acc, &model)?))
            });
            let (loaded, loss) = &got[0];
            assert_eq!(loaded, weights, "saved at {from}, loaded at {to}: weights changed");
            assert!((loss - next).abs() <= TOL * next, "saved at {from}, loaded at {to}: next loss {loss} vs {next}");
        }
    }
}

#[test]
fn half_precision_directories_round_to_the_saved_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let dir = tmp.path().join(format!("{dtype:?}"));
        let d = dir.clone();
        let weights = run_ranks(2, config(1, 1, 2, ShardingStrategy::default()), move |acc| {
            let (_, prepared, config) = load(&acc, &fixture("gqa"))?;
            llama::save_pretrained(&acc, &prepared, &config, &d, &SaveOptions { dtype, ..Default::default() })?;
            Ok(prepared.state_dict()?)
        });
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let name = if dtype == DType::BF16 { "bfloat16" } else { "float16" };
        assert!(text.contains(&format!("\"dtype\": \"{name}\"")), "{text}");
        let on_disk = accel::state::load_safetensors(&dir.join(llama::WEIGHTS_FILE), &Device::Cpu).unwrap();
        assert!(on_disk.values().all(|t| t.dtype() == dtype));
        let rounded: BTreeMap<_, _> = weights[0]
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap()))
            .collect();
        let loaded = run_ranks(1, plain(), move |acc| Ok(load(&acc, &dir)?.1.state_dict()?));
        assert_eq!(to_f32_map(&loaded[0]), to_f32_map(&rounded), "{dtype:?}: loaded weights are not the saved ones");
    }
}

/// The gqa fixture copied into a fresh directory with its config and weights changed by `edit`.
fn edited(
    root: &Path,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value, &mut BTreeMap<String, Tensor>),
) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture("gqa");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let mut weights = accel::state::load_safetensors(&src.join(llama::WEIGHTS_FILE), &Device::Cpu).unwrap();
    edit(&mut config, &mut weights);
    std::fs::write(dir.join("config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    accel::state::save_safetensors(&weights, &dir.join(llama::WEIGHTS_FILE)).unwrap();
    dir
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// The error of loading `dir` at one process; the weights must be untouched and nothing written.
fn load_error(dir: PathBuf) -> String {
    let before = listing(dir.parent().unwrap());
    let d = dir.clone();
    let err = run_ranks(1, plain(), move |acc| {
        let config = match LlamaConfig::from_pretrained(&d) {
            Ok(c) => c,
            Err(e) => return Ok(e.to_string()),
        };
        let varmap = VarMap::new();
        let _model = Llama::new(&config, acc.builder(&varmap, Llama::plan(&config)))?;
        let prepared = acc.prepare_model(&varmap)?;
        let start = to_f32_map(&prepared.state_dict()?);
        let err = llama::load_pretrained(&prepared, &config, &d).unwrap_err().to_string();
        assert_eq!(to_f32_map(&prepared.state_dict()?), start, "a refused load changed the weights");
        Ok(err)
    });
    assert_eq!(listing(dir.parent().unwrap()), before, "a refused load wrote files");
    err.into_iter().next().unwrap()
}

#[test]
fn bad_checkpoints_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let cases: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        (
            "unknown model_type",
            edited(root, "mistral", |c, _| c["model_type"] = "gemma".into()),
            vec!["model_type \"gemma\" is not a Llama"],
        ),
        (
            "another family's config (GPT-2's fields, not Llama's)",
            edited(root, "gpt2", |c, _| {
                c["model_type"] = "gpt2".into();
                c.as_object_mut().unwrap().remove("hidden_size");
            }),
            vec!["model_type \"gpt2\" is not a Llama"],
        ),
        (
            "another architecture",
            edited(root, "arch", |c, _| c["architectures"] = serde_json::json!(["LlamaForSequenceClassification"])),
            vec!["architecture \"LlamaForSequenceClassification\" is not LlamaForCausalLM"],
        ),
        (
            "an unsupported RoPE scaling",
            edited(root, "yarn", |c, _| c["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})),
            vec!["rope scaling type \"yarn\" is not supported", "\"default\", \"linear\" and \"llama3\""],
        ),
        (
            "a missing weight",
            edited(root, "missing", |_, w| {
                w.remove("model.layers.2.mlp.down_proj.weight");
            }),
            vec!["lack 1 weight(s)", "\"model.layers.2.mlp.down_proj.weight\""],
        ),
        (
            "an unexpected weight",
            edited(root, "unexpected", |_, w| {
                let t = w["model.norm.weight"].clone();
                w.insert("model.layers.0.self_attn.q_norm.weight".into(), t);
            }),
            vec!["hold 1 weight(s)", "\"model.layers.0.self_attn.q_norm.weight\""],
        ),
        (
            "a shape the config disagrees with",
            edited(root, "shape", |c, _| c["intermediate_size"] = 60.into()),
            vec!["model.layers.0.mlp.down_proj.weight has shape [32, 64]", "config.json gives [32, 60]"],
        ),
        (
            "key/value heads that do not divide the query heads",
            edited(root, "heads", |c, _| c["num_key_value_heads"] = 3.into()),
            vec!["num_key_value_heads = 3 must divide num_attention_heads = 4", "values that fit: 1, 2, 4"],
        ),
    ];
    for (what, dir, needles) in cases {
        let err = load_error(dir);
        for needle in needles {
            assert!(err.contains(needle), "{what}: {err:?} lacks {needle:?}");
        }
    }
    // No weight file.
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(fixture("gqa").join("config.json"), empty.join("config.json")).unwrap();
    let err = load_error(empty);
    assert!(err.contains("holds neither model.safetensors nor model.safetensors.index.json"), "{err}");
}

#[test]
fn a_layout_that_cannot_split_the_heads_is_refused_with_the_sizes_that_fit() {
    let errors = run_ranks(4, config(1, 1, 4, ShardingStrategy::default()), |acc| {
        let config = LlamaConfig::from_pretrained(&fixture("gqa"))?;
        let varmap = VarMap::new();
        Ok(Llama::new(&config, acc.builder(&varmap, Llama::plan(&config))).err().map(|e| e.to_string()))
    });
    for err in errors {
        let err = err.expect("tp 4 over 2 key/value heads must be refused");
        assert!(err.contains("tp size 4 does not divide num_key_value_heads = 2"), "{err}");
        assert!(err.contains("tp sizes that fit: 1, 2"), "{err}");
    }
}

#[test]
fn save_pretrained_never_replaces_a_directory_it_did_not_write() {
    let tmp = tempfile::tempdir().unwrap();
    let save = |dir: PathBuf, files: Vec<(String, Vec<u8>)>| {
        run_ranks(2, config(1, 1, 2, ShardingStrategy::default()), move |acc| {
            let (_, prepared, config) = load(&acc, &fixture("gqa"))?;
            let options = SaveOptions { files: files.clone(), ..Default::default() };
            Ok(llama::save_pretrained(&acc, &prepared, &config, &dir, &options).err().map(|e| e.to_string()))
        })
    };
    // Not a model directory: no config.json, a config.json that names no model_type, a subdirectory.
    type Make = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Make, &str)> = vec![
        (
            "notes",
            Box::new(|d: &Path| std::fs::write(d.join("todo.txt"), "mine").unwrap()),
            "no config.json naming a model_type",
        ),
        (
            "settings",
            Box::new(|d: &Path| std::fs::write(d.join("config.json"), "{\"app\": 1}").unwrap()),
            "no config.json naming a model_type",
        ),
        (
            "project",
            Box::new(|d: &Path| {
                std::fs::write(d.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
                std::fs::create_dir_all(d.join("src")).unwrap();
            }),
            "holds a directory, \"src\"",
        ),
    ];
    for (name, make, why) in cases {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        make(&dir);
        let before = listing(&dir);
        let errors = save(dir.clone(), Vec::new());
        let main = errors[0].as_deref().unwrap_or_else(|| panic!("{name}: replaced"));
        assert!(main.contains(why) && main.contains("it is not replaced"), "{name}: {main}");
        assert!(errors[1].as_deref().unwrap().contains("another rank failed while preparing"), "{:?}", errors[1]);
        assert_eq!(listing(&dir), before, "{name}: changed");
    }
    // A model directory is replaced: its weights and config anew, its other files kept unless written anew.
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for (file, text) in [
        ("config.json", "{\"model_type\": \"llama\"}"),
        ("README.md", "mine"),
        ("tokenizer.json", "old"),
        ("model-00001-of-00009.safetensors", "stale"),
    ] {
        std::fs::write(model.join(file), text).unwrap();
    }
    let errors = save(model.clone(), vec![("tokenizer.json".into(), b"new".to_vec())]);
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    assert_eq!(listing(&model), vec!["README.md", "config.json", "model.safetensors", "tokenizer.json"]);
    assert_eq!(std::fs::read_to_string(model.join("README.md")).unwrap(), "mine");
    assert_eq!(std::fs::read_to_string(model.join("tokenizer.json")).unwrap(), "new");
    let names: Vec<String> = listing(tmp.path()).into_iter().filter(|n| n.starts_with('.')).collect();
    assert!(names.is_empty(), "hidden siblings left behind: {names:?}");
}

#[test]
fn both_config_formats_of_transformers_are_read() {
    // transformers 4.x: top-level rope_theta, rope_scaling with `type`, torch_dtype.
    let old = r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}"#;
    let config = LlamaConfig::from_json(old).unwrap();
    let rope = config.rope().unwrap();
    assert_eq!(rope.theta, 500000.0);
    assert!(matches!(rope.scaling, RopeScaling::Llama3 { factor: 8.0, original_max_position_embeddings: 8192, .. }));
    assert_eq!(config.num_key_value_heads(), 4);
    assert_eq!(config.head_dim(), 4);
    // Written back with the fields it was read with (and the unknown ones kept).
    let again = LlamaConfig::from_json(&config.to_json().unwrap()).unwrap();
    assert_eq!(again, config);
    // transformers 5.x (the fixture): rope_parameters.
    let tied = LlamaConfig::from_pretrained(&fixture("tied")).unwrap();
    assert_eq!(tied.rope().unwrap().theta, 500000.0);
    assert!(matches!(tied.rope().unwrap().scaling, RopeScaling::Llama3 { original_max_position_embeddings: 32, .. }));
    let linear = LlamaConfig::from_json(&old.replace("\"llama3\"", "\"linear\"")).unwrap();
    assert_eq!(linear.rope().unwrap().scaling, RopeScaling::Linear { factor: 8.0 });
}

/// candle-transformers' Llama (its own RoPE tables, attention and loading) on the fixture's weights: the same
/// logits as ours at every position (its forward returns the last position's, so each prefix runs once).
#[test]
fn candle_transformers_gives_the_same_logits() {
    use candle_transformers::models::llama as ct;
    for model in ["gqa", "tied"] {
        let dir = fixture(model);
        let ours = LlamaConfig::from_pretrained(&dir).unwrap();
        let rope = ours.rope().unwrap();
        let rope_scaling = match rope.scaling {
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                Some(ct::Llama3RopeConfig {
                    factor: factor as f32,
                    low_freq_factor: low_freq_factor as f32,
                    high_freq_factor: high_freq_factor as f32,
                    original_max_position_embeddings,
                    rope_type: ct::Llama3RopeType::Llama3,
                })
            }
            RopeScaling::Default => None,
            RopeScaling::Linear { .. } => unreachable!("the fixture has no linear scaling"),
        };
        let config = ct::Config {
            hidden_size: ours.hidden_size,
            intermediate_size: ours.intermediate_size,
            vocab_size: ours.vocab_size,
            num_hidden_layers: ours.num_hidden_layers,
            num_attention_heads: ours.num_attention_heads,
            num_key_value_heads: ours.num_key_value_heads(),
            use_flash_attn: false,
            rms_norm_eps: ours.rms_norm_eps,
            rope_theta: rope.theta as f32,
            bos_token_id: None,
            eos_token_id: None,
            rope_scaling,
            max_position_embeddings: ours.max_position_embeddings,
            tie_word_embeddings: ours.tie_word_embeddings,
        };
        // SAFETY: the fixture is read-only while the test runs.
        let vb = unsafe {
            candle_nn::VarBuilder::from_mmaped_safetensors(&[dir.join(llama::WEIGHTS_FILE)], DType::F32, &Device::Cpu)
        }
        .unwrap();
        let theirs = ct::Llama::load(vb, &config).unwrap();
        let want = reference(model);
        let (ids, vocab) = (&want.input_ids, ours.vocab_size);
        let ours_logits = run_ranks(1, plain(), move |acc| {
            let (m, _, _) = load(&acc, &fixture(model))?;
            Ok(m.full_logits(&m.forward(&reference(model).input_ids)?)?)
        })
        .remove(0);
        for s in 1..=ids.dim(1).unwrap() {
            let mut cache = ct::Cache::new(false, DType::F32, &config, &Device::Cpu).unwrap();
            let last = theirs.forward(&ids.narrow(1, 0, s).unwrap(), 0, &mut cache).unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let ours_at = ours_logits.narrow(1, s - 1, 1).unwrap().reshape((2, vocab)).unwrap();
            let d = max_diff(&flat(&ours_at), &flat(&last));
            assert!(d <= TOL, "{model}, position {}: logits differ from candle-transformers' by {d:e}", s - 1);
        }
    }
}

/// A vocabulary tp does not divide (13 rows over tp 2: padded to 14): the builder reads each rank's real rows of
/// the embedding and the head from the file and pads the rest, and every weight comes back as saved.
#[test]
fn a_padded_vocabulary_loads_its_real_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("odd");
    let d = dir.clone();
    let saved = run_ranks(1, plain(), move |acc| {
        let config = LlamaConfig::new(13, 16, 24, 2, 4, 2);
        let varmap = VarMap::new();
        let _model = Llama::new(&config, acc.builder(&varmap, Llama::plan(&config)))?;
        let prepared = acc.prepare_model(&varmap)?;
        llama::save_pretrained(&acc, &prepared, &config, &d, &SaveOptions::default())?;
        Ok(to_f32_map(&prepared.state_dict()?))
    })
    .remove(0);
    let loaded = run_ranks(2, config(1, 1, 2, ShardingStrategy::default()), move |acc| {
        let (model, prepared, _) = load(&acc, &dir)?;
        let head_rows = model.forward(&Tensor::new(&[[1u32, 2]], &Device::Cpu)?)?.dim(2)?;
        Ok((to_f32_map(&prepared.state_dict()?), head_rows))
    });
    for (weights, head_rows) in loaded {
        assert_eq!(weights, saved, "loaded at tp 2, the weights differ from the saved ones");
        assert_eq!(head_rows, 7, "13 vocabulary rows padded to 14: 7 per rank");
    }
}

/// Per tensor, the largest difference over the tensor's largest magnitude (a scale-free measure for 16-bit
/// compute, whose errors follow the values' scale); the worst tensor's, and its name.
fn worst_scaled_diff(got: &BTreeMap<String, Vec<f32>>, want: &BTreeMap<String, Vec<f32>>) -> (f32, String) {
    let mut worst = (0.0f32, String::new());
    for (name, w) in want {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        let d = got[name].iter().zip(w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

/// bf16 autocast (the products' inputs rounded to bf16, fp32 masters and accumulation, PyTorch's CPU autocast):
/// at one process and at tp 2, pp 2, FULL_SHARD 2 and dp 2 × tp 2 the loss stays within 5e-4 (relative) of
/// transformers' fp32 loss and of the one-process bf16 run, and every gradient within 5e-2 of its tensor's largest
/// magnitude from transformers' fp32 gradients (3e-2 from the one-process bf16 run: the split sums round to bf16
/// at other places). Measured: losses within 1.8e-4 of transformers' and 2.0e-4 of one process; gradients within
/// 3.3e-2 and 2.4e-2. The gradients differ from fp32 by more than 1e-3 (bf16 is in effect: fp32 agrees to 4e-7).
#[test]
fn mixed_precision_bf16_stays_near_transformers_at_every_layout() {
    use accel::MixedPrecision;
    let bf16 = |cfg: AcceleratorConfig| AcceleratorConfig { mixed_precision: MixedPrecision::Bf16, ..cfg };
    let near = |got: f32, want: f32| (got - want).abs() <= 5e-4 * want.abs();
    for model in ["gqa", "tied"] {
        let want = reference(model);
        let one = compute(model, 1, bf16(plain()));
        let (one_loss, one_grads) = (one[0].2, one[0].3.clone());
        assert!(near(one_loss, want.loss), "{model}: bf16 loss {one_loss} vs transformers' fp32 {}", want.loss);
        let (d, name) = worst_scaled_diff(&one_grads, &want.grads);
        assert!(d <= 5e-2, "{model}: bf16 gradient of {name} differs from transformers' fp32 by {d:e} of its scale");
        assert!(d > 1e-3, "{model}: bf16 gradients equal fp32 ones to {d:e}: is autocast in effect?");
        for (layout, world, cfg) in [
            ("tp 2", 2, config(1, 1, 2, ShardingStrategy::default())),
            ("pp 2", 2, pipelined(2, ScheduleKind::OneFOneB, None, plain())),
            ("FULL_SHARD 2", 2, config(1, 2, 1, ShardingStrategy::FullShard)),
            ("dp 2 × tp 2", 4, config(2, 1, 2, ShardingStrategy::default())),
        ] {
            let ranks = compute(model, world, bf16(cfg));
            let loss = ranks.iter().map(|r| r.2).sum::<f32>() / ranks.len() as f32;
            assert!(near(loss, one_loss) && near(loss, want.loss), "{model}, bf16 {layout}: loss {loss} vs {one_loss}");
            let (d, name) = worst_scaled_diff(&ranks[0].3, &one_grads);
            assert!(d <= 3e-2, "{model}, bf16 {layout}: gradient of {name} differs from one process by {d:e}");
            let (d, name) = worst_scaled_diff(&ranks[0].3, &want.grads);
            assert!(d <= 5e-2, "{model}, bf16 {layout}: gradient of {name} differs from transformers by {d:e}");
            for (r, rank) in ranks.iter().enumerate() {
                assert_eq!(&rank.3, &ranks[0].3, "{model}, bf16 {layout}: rank {r}'s weights differ from rank 0's");
            }
        }
    }
}
