//! Output directories in Hugging Face's layout.
//!
//! `checkpoint-STEP/` holds config.json + model.safetensors + tokenizer.json (loadable by
//! transformers' `from_pretrained` as is), the optimizer moments (optimizer.safetensors), the
//! trainer state (trainer_state.json: step, epoch, data position) and the resolved config
//! (sprtrain.toml), and last a manifest of every file's size and checksum (manifest.json). A
//! checkpoint is written under a temporary name, synced, and renamed into place, so a kill
//! during a save never leaves one that looks complete, nor touches the previous one, and a
//! power cut after it never leaves a damaged one under its name. A resume verifies the
//! checkpoint against its manifest first.

pub mod manifest;
pub mod streamed;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::io::atomic_file::{publish, sync_dir, write_atomic, write_atomic_with, write_json};
use crate::io::hf_files::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILE, TOKENIZER_FILES};
use crate::models::{lora, HfConfig, TaskModel};
use crate::optim::AdamW;
use manifest::Verdict;

pub const TRAINER_STATE: &str = "trainer_state.json";
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";
pub const RESOLVED_CONFIG: &str = "sprtrain.toml";
const PREFIX: &str = "checkpoint-";

/// Where training stands; enough, with the optimizer moments, to continue exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// The checkpoint format ([`manifest::FORMAT`]); 1 in checkpoints from before it was kept.
    #[serde(default = "first_format")]
    pub format: u32,
    /// Optimizer steps completed.
    pub global_step: usize,
    /// Epoch of the next step and the index of the next global batch within it.
    pub epoch: usize,
    pub batch_in_epoch: usize,
    pub total_steps: usize,
    /// AdamW's step counter (bias correction).
    pub optimizer_step: i64,
    /// Flat-buffer layout the moments were saved with: (name, numel) in order.
    pub layout: Vec<(String, i64)>,
    /// Metric history: one entry per logged or evaluated step.
    pub log_history: Vec<serde_json::Value>,
    /// The best value of `eval.metric_for_best_model` so far, the step it was reached at and
    /// that step's checkpoint (with `train.load_best_model_at_end`).
    #[serde(default)]
    pub best_metric: Option<f64>,
    #[serde(default)]
    pub best_global_step: Option<usize>,
    #[serde(default)]
    pub best_model_checkpoint: Option<PathBuf>,
    /// Evaluations in a row that did not improve the metric enough (early stopping).
    #[serde(default)]
    pub early_stopping_patience_counter: usize,
    /// Examples per optimizer step (batch size x accumulation x processes) and the number of
    /// processes of the run that saved this state; 0 in checkpoints from before they were kept.
    #[serde(default)]
    pub global_batch: usize,
    #[serde(default)]
    pub world_size: usize,
}

fn first_format() -> u32 {
    1
}

impl TrainerState {
    /// The state before the first step of a run of `total_steps` over parameters `layout`.
    pub fn start(layout: Vec<(String, i64)>, total_steps: usize) -> Self {
        TrainerState {
            format: manifest::FORMAT,
            global_step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            total_steps,
            optimizer_step: 0,
            layout,
            log_history: Vec::new(),
            best_metric: None,
            best_global_step: None,
            best_model_checkpoint: None,
            early_stopping_patience_counter: 0,
            global_batch: 0,
            world_size: 0,
        }
    }
}

/// Writes named tensors as fp32 safetensors with transformers' `format: pt` metadata,
/// atomically (a temporary file, then a rename). Each tensor's bytes go from its own memory
/// to the file: no copy of the whole model (or optimizer state) is built in memory.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    // safetensors stores little-endian data, which an fp32 tensor's memory is on this target.
    const _: () = assert!(cfg!(target_endian = "little"));
    let contiguous: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.to_kind(Kind::Float).contiguous()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = contiguous
        .iter()
        .map(|(n, t)| {
            // SAFETY: `t` is a contiguous fp32 CPU tensor of numel elements that outlives the
            // view, and nothing writes to it while the file is written.
            let bytes =
                unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, t.numel() * 4) };
            let shape = t.size().iter().map(|&d| d as usize).collect();
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, bytes)?,
            ))
        })
        .collect::<Result<_>>()?;
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    write_atomic_with(path, |tmp| {
        // The error's Display already includes its io::Error: format it once.
        safetensors::serialize_to_file(views, metadata, tmp)
            .map_err(|e| anyhow!("cannot write {}: {e}", tmp.display()))
    })
}

/// config.json as transformers writes it for the trained model: the original keys, plus the
/// architecture, labels and problem type.
pub fn model_config_json(config: &HfConfig, class_name: &str) -> Result<String> {
    let mut raw = config.raw.as_object().cloned().unwrap_or_default();
    raw.insert("architectures".into(), serde_json::json!([class_name]));
    let id2label: BTreeMap<String, String> = config
        .id2label
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let label2id: BTreeMap<String, usize> = config
        .id2label
        .iter()
        .map(|(k, v)| (v.clone(), *k))
        .collect();
    raw.insert("id2label".into(), serde_json::to_value(id2label)?);
    raw.insert("label2id".into(), serde_json::to_value(label2id)?);
    raw.remove("num_labels");
    if let Some(p) = config.problem_type {
        raw.insert("problem_type".into(), p.as_hf_str().into());
    }
    let mut value = serde_json::Value::Object(raw);
    sort_keys(&mut value);
    Ok(serde_json::to_string_pretty(&value)? + "\n")
}

/// Orders every object's keys, as transformers' `to_json_string` (`sort_keys=True`) does.
fn sort_keys(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.sort_keys();
            map.values_mut().for_each(sort_keys);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_keys),
        _ => {}
    }
}

/// Everything a model directory holds, ready to write.
pub struct ModelFiles<'a> {
    pub model: &'a TaskModel,
    pub vs: &'a tch::nn::VarStore,
    pub tokenizer: &'a TokenizerFiles,
    pub resolved_config: &'a str,
    /// The model trained from (`model.name_or_path`), named by LoRA adapters.
    pub base_model: &'a str,
    /// Weights above this many bytes are saved in shards (`train.save_max_shard_size`).
    pub max_shard_bytes: u64,
    /// Weight files written already, in this directory, to move in instead of writing them
    /// from `vs` (ZeRO stage 3 streams them: [`streamed::StreamedModel`]).
    pub written: Option<(&'a Path, &'a [String])>,
}

/// The size above which transformers' `save_pretrained` shards weights by default ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The weights (model.safetensors, or shards and their index above `max_shard_bytes`) and
/// config.json of `model` with these variables.
pub fn write_full_model(
    dir: &Path,
    model: &TaskModel,
    mut named: Vec<(String, Tensor)>,
    max_shard_bytes: u64,
) -> Result<()> {
    named.sort_by(|a, b| a.0.cmp(&b.0));
    write_weights(dir, &named, max_shard_bytes)?;
    write_atomic(
        &dir.join(CONFIG_FILE),
        model_config_json(&model.config, &model.class_name())?.as_bytes(),
    )
}

/// fp32 weights as `save_pretrained` lays them out: one model.safetensors up to
/// `max_shard_bytes`, else `model-0000K-of-0000N.safetensors` shards ([`shard_ranges`], tensors
/// in name order) named by model.safetensors.index.json, written last. Weight files of the
/// other layout left in `dir` by an earlier save are removed after, so a loader never finds
/// both.
fn write_weights(dir: &Path, named: &[(String, Tensor)], max_shard_bytes: u64) -> Result<()> {
    let bytes: Vec<u64> = named.iter().map(|(_, t)| t.numel() as u64 * 4).collect();
    let shards = shard_ranges(&bytes, max_shard_bytes);
    let mut kept = Vec::new();
    for (k, range) in shards.iter().enumerate() {
        let file = weights_file_name(k, shards.len());
        write_safetensors(&dir.join(&file), &named[range.clone()])?;
        kept.push(file);
    }
    if let Some(index) = weights_index(named.iter().map(|(n, _)| n), &bytes, &shards) {
        write_json(&dir.join(INDEX_FILE), &index)?;
        kept.push(INDEX_FILE.to_string());
    }
    remove_stale_weights(dir, &kept)
}

/// How `save_pretrained` cuts tensors of these `bytes` (in order) into shards of at most
/// `max_shard_bytes`: a new shard where the next tensor would overflow, a larger tensor alone.
pub fn shard_ranges(bytes: &[u64], max_shard_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut size) = (0, 0u64);
    for (i, &b) in bytes.iter().enumerate() {
        if i > start && size + b > max_shard_bytes {
            shards.push(start..i);
            (start, size) = (i, 0);
        }
        size += b;
    }
    shards.push(start..bytes.len());
    shards
}

/// Shard `k` of `n`'s file name: model.safetensors alone, else model-0000K-of-0000N.safetensors.
pub fn weights_file_name(k: usize, n: usize) -> String {
    match n {
        1 => SINGLE_FILE.to_string(),
        _ => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
    }
}

/// model.safetensors.index.json for tensors `names` of `bytes` cut into `shards`; None for one
/// file.
pub fn weights_index<'a>(
    names: impl Iterator<Item = &'a String>,
    bytes: &[u64],
    shards: &[std::ops::Range<usize>],
) -> Option<serde_json::Value> {
    if shards.len() < 2 {
        return None;
    }
    let names: Vec<&String> = names.collect();
    let mut weight_map = serde_json::Map::new();
    for (k, range) in shards.iter().enumerate() {
        for name in &names[range.clone()] {
            weight_map.insert((*name).clone(), weights_file_name(k, shards.len()).into());
        }
    }
    let total: u64 = bytes.iter().sum();
    Some(serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}))
}

/// Removes weight files (model.safetensors, shards, the index) in `dir` that are not `kept`.
fn remove_stale_weights(dir: &Path, kept: &[String]) -> Result<()> {
    let is_weights = |name: &str| {
        name == SINGLE_FILE
            || name == INDEX_FILE
            || (name.starts_with("model-")
                && name.contains("-of-")
                && name.ends_with(".safetensors"))
    };
    let mut removed = false;
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().to_string();
        if is_weights(&name) && !kept.contains(&name) {
            let path = dir.join(&name);
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove the stale {}", path.display()))?;
            removed = true;
        }
    }
    if removed {
        sync_dir(dir)?;
    }
    Ok(())
}

fn write_model_files(dir: &Path, files: &ModelFiles) -> Result<()> {
    let config = &files.model.config;
    match &config.lora {
        // LoRA: the adapters alone, in PEFT's layout, naming the base model.
        Some(spec) => {
            let mut named: Vec<(String, Tensor)> = files
                .vs
                .variables()
                .into_iter()
                .filter(|(n, _)| lora::is_adapter_variable(n))
                .map(|(n, t)| (lora::peft_key(&n), t))
                .collect();
            named.sort_by(|a, b| a.0.cmp(&b.0));
            write_safetensors(&dir.join(lora::ADAPTER_WEIGHTS), &named)?;
            let json = lora::adapter_config_json(spec, config.arch, files.base_model, "CAUSAL_LM");
            write_atomic(&dir.join(lora::ADAPTER_CONFIG), json.as_bytes())?;
        }
        None => match files.written {
            Some((from, names)) => {
                for name in names {
                    publish(&from.join(name), &dir.join(name))?;
                }
                remove_stale_weights(dir, names)?;
                let config_json = model_config_json(config, &files.model.class_name())?;
                write_atomic(&dir.join(CONFIG_FILE), config_json.as_bytes())?;
            }
            None => write_full_model(
                dir,
                files.model,
                files.vs.variables().into_iter().collect(),
                files.max_shard_bytes,
            )?,
        },
    }
    files.tokenizer.write(dir)?;
    write_atomic(&dir.join(RESOLVED_CONFIG), files.resolved_config.as_bytes())
}

/// tokenizer.json plus the side files AutoTokenizer reads (and the chat template), where the
/// source has them, read when a run starts: the directory they come from (the checkpoint a
/// run resumed from) may be rotated away before the run's last save.
pub struct TokenizerFiles(Vec<(&'static str, Vec<u8>)>);

impl TokenizerFiles {
    pub fn read(tokenizer_json: &Path) -> Result<Self> {
        let source = tokenizer_json.parent().unwrap_or(Path::new("."));
        let mut files = Vec::new();
        for name in TOKENIZER_FILES {
            let src = source.join(name);
            if name == TOKENIZER_FILE || src.is_file() {
                let bytes = std::fs::read(&src)
                    .with_context(|| format!("cannot read {}", src.display()))?;
                files.push((name, bytes));
            }
        }
        Ok(TokenizerFiles(files))
    }

    /// Writes the files into `dir`, each atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        self.0
            .iter()
            .try_for_each(|(name, bytes)| write_atomic(&dir.join(name), bytes))
    }
}

/// Copies tokenizer.json and its side files beside it into `dir`.
pub fn copy_tokenizer(tokenizer_json: &Path, dir: &Path) -> Result<()> {
    TokenizerFiles::read(tokenizer_json)?.write(dir)
}

/// The final model at the root of the output directory (file by file, each atomic).
pub fn save_final(output_dir: &Path, files: &ModelFiles) -> Result<()> {
    write_model_files(output_dir, files)
}

/// The optimizer moments a checkpoint saves: in memory, or already written to a synced file of
/// the output directory (under ZeRO, as they were gathered), which moves into the checkpoint.
pub enum OptimizerState {
    Moments(Vec<(String, Tensor)>),
    Written(PathBuf),
}

/// Where rank 0 writes the optimizer state of step `step` as it is gathered, before it moves
/// into the checkpoint.
pub fn streamed_optimizer_path(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!(".{OPTIMIZER_STATE}-{step}.partial"))
}

/// Where ZeRO stage 3 streams a save's weights (`tag`: the step, or `final`) before they move
/// into the checkpoint or the output directory.
pub fn streamed_model_dir(output_dir: &Path, tag: &str) -> PathBuf {
    output_dir.join(format!(".model-{tag}.partial"))
}

/// Writes `checkpoint-STEP` atomically and removes the oldest beyond `keep` (0 keeps all),
/// never the state's best checkpoint nor the newest (so `keep` 1 can leave two, as
/// transformers' rotation does).
pub fn save_checkpoint(
    output_dir: &Path,
    files: &ModelFiles,
    state: &TrainerState,
    optimizer: &OptimizerState,
    keep: usize,
) -> Result<PathBuf> {
    let final_dir = checkpoint_dir(output_dir, state.global_step);
    let tmp = partial_dir(output_dir, state.global_step);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("cannot clear {}", tmp.display()))?;
    }
    let state = TrainerState {
        format: manifest::FORMAT,
        ..state.clone()
    };
    let written = std::fs::create_dir_all(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))
        .and_then(|()| {
            write_model_files(&tmp, files)?;
            match optimizer {
                OptimizerState::Moments(moments) => {
                    write_safetensors(&tmp.join(OPTIMIZER_STATE), moments)?
                }
                OptimizerState::Written(file) => publish(file, &tmp.join(OPTIMIZER_STATE))?,
            }
            write_atomic(
                &tmp.join(TRAINER_STATE),
                serde_json::to_string_pretty(&state)?.as_bytes(),
            )?;
            // Last: a checkpoint with a manifest has every file it lists.
            manifest::write(&tmp)
        });
    if let Err(e) = written {
        // Give the space back (a full disk stays usable for the files that follow).
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    publish_checkpoint(output_dir, &tmp, &final_dir, state.global_step)?;
    // Older checkpoints go only once this one is known to be on disk whole.
    match manifest::verify(&final_dir, manifest::FORMAT)? {
        Verdict::Intact => {}
        Verdict::Damaged(why) => bail!("the checkpoint just written does not verify: {why}"),
        Verdict::Unverified => bail!("{} was written without a manifest", final_dir.display()),
    }
    if keep > 0 {
        rotate(output_dir, keep, state.best_global_step)?;
    }
    Ok(final_dir)
}

/// Renames the synced checkpoint `tmp` to `final_dir` and syncs the output directory. A
/// re-save of a step swaps the new directory in, then drops the old one (`recover` puts the
/// old one back should the process end between the renames).
fn publish_checkpoint(output_dir: &Path, tmp: &Path, final_dir: &Path, step: usize) -> Result<()> {
    if final_dir.exists() {
        let old = old_dir(output_dir, step);
        publish(final_dir, &old)?;
        crate::runtime::fault::point("old checkpoint moved aside");
        publish(tmp, final_dir)?;
        crate::runtime::fault::point("checkpoint in place");
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("cannot remove {}", old.display()))?;
        sync_dir(output_dir)
    } else {
        publish(tmp, final_dir)?;
        crate::runtime::fault::point("checkpoint in place");
        Ok(())
    }
}

/// Removes the oldest checkpoints beyond `keep`, never the best one nor the newest.
fn rotate(output_dir: &Path, keep: usize, best: Option<usize>) -> Result<()> {
    let all = list_checkpoints(output_dir)?;
    let mut excess = all.len().saturating_sub(keep);
    for (step, old) in &all[..all.len().saturating_sub(1)] {
        if excess == 0 {
            break;
        }
        if Some(*step) == best {
            continue;
        }
        // Renamed away first, so no half-removed directory keeps a checkpoint's name.
        let doomed = old_dir(output_dir, *step);
        publish(old, &doomed).with_context(|| format!("cannot remove {}", old.display()))?;
        crate::runtime::fault::point("rotated checkpoint moved aside");
        std::fs::remove_dir_all(&doomed)
            .with_context(|| format!("cannot remove {}", doomed.display()))?;
        crate::runtime::fault::point("rotated checkpoint removed");
        excess -= 1;
    }
    sync_dir(output_dir)
}

/// Where the checkpoint of `step` is written before it is renamed into place.
fn partial_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!(".{PREFIX}{step}.partial"))
}

/// Where a checkpoint goes while it is replaced or removed.
fn old_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!(".{PREFIX}{step}.old"))
}

/// Tidies what a process killed during a save left in `output_dir`: partial checkpoints are
/// removed, and an old checkpoint moved aside for a re-save of its step is put back when the
/// new one never took its place (otherwise removed). Returns what it did, one line each.
pub fn recover(output_dir: &Path) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(output_dir) else {
        return Ok(done);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let path = entry.path();
        let Some(rest) = name.strip_prefix(&format!(".{PREFIX}")) else {
            continue;
        };
        if let Some(step) = rest.strip_suffix(".old").and_then(|s| s.parse().ok()) {
            let dir = checkpoint_dir(output_dir, step);
            if !dir.exists() && path.join(TRAINER_STATE).is_file() {
                std::fs::rename(&path, &dir)
                    .with_context(|| format!("cannot restore {}", dir.display()))?;
                done.push(format!(
                    "restored {} from an interrupted save",
                    dir.display()
                ));
                continue;
            }
        } else if rest.strip_suffix(".partial").is_none() {
            continue;
        }
        std::fs::remove_dir_all(&path)
            .with_context(|| format!("cannot remove {}", path.display()))?;
        done.push(format!(
            "removed {}, left by an interrupted save",
            path.display()
        ));
    }
    for line in &done {
        tracing::warn!("{line}");
    }
    Ok(done)
}

/// Where the checkpoint of `step` goes.
pub fn checkpoint_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!("{PREFIX}{step}"))
}

/// Complete checkpoints in `output_dir`, oldest first.
pub fn list_checkpoints(output_dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(output_dir) else {
        return Ok(found);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(step) = name
            .strip_prefix(PREFIX)
            .and_then(|s| s.parse::<usize>().ok())
        {
            if entry.path().join(TRAINER_STATE).is_file() {
                found.push((step, entry.path()));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// A checkpoint's trainer state and optimizer moments.
pub fn load_training_state(dir: &Path) -> Result<(TrainerState, BTreeMap<String, Tensor>)> {
    let path = dir.join(TRAINER_STATE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{} is not a checkpoint: no {TRAINER_STATE}", dir.display()))?;
    let state: TrainerState =
        serde_json::from_str(&text).with_context(|| format!("{} is malformed", path.display()))?;
    let moments = crate::models::weights::read_safetensors(&dir.join(OPTIMIZER_STATE))?
        .into_iter()
        .collect();
    Ok((state, moments))
}

/// Restores the optimizer from checkpoint `dir` and returns where training stood there.
/// `layout` is this run's flat-buffer layout, which must be the checkpoint's; `total_steps`
/// is this run's plan (a changed plan is warned about and followed).
pub fn resume(
    dir: &Path,
    adamw: &mut AdamW,
    layout: &[(String, i64)],
    total_steps: usize,
) -> Result<TrainerState> {
    let (saved, moments) = load_training_state(dir)?;
    if saved.layout != layout {
        bail!(
            "{}: the checkpoint's parameters differ from this config's model",
            dir.display()
        );
    }
    adamw.restore(&moments, saved.optimizer_step, dir)?;
    if saved.total_steps != total_steps {
        tracing::warn!(
            "resuming with {total_steps} total steps; the checkpoint planned {}",
            saved.total_steps
        );
    }
    tracing::info!(
        "resumed from {} at step {}",
        dir.display(),
        saved.global_step
    );
    Ok(TrainerState {
        total_steps,
        ..saved
    })
}

/// Puts the weights saved in checkpoint `dir` (the full model, or a LoRA run's adapters) into
/// `vs`: the best model, brought back at the end of training.
pub fn load_weights(dir: &Path, vs: &tch::nn::VarStore, model: &TaskModel) -> Result<()> {
    if model.config.lora.is_some() {
        lora::load_adapter(vs, &lora::read_adapter(dir)?)
    } else {
        let ckpt = crate::models::weights::read_checkpoint(dir)?;
        crate::models::weights::load_checkpoint(vs, model, ckpt).map(|_| ())
    }
    .with_context(|| format!("cannot load the best model from {}", dir.display()))
}

/// Checks checkpoint `dir` against its manifest ([`manifest::verify`]), for the format its
/// trainer state declares.
pub fn verify(dir: &Path) -> Result<Verdict> {
    let state = dir.join(TRAINER_STATE);
    let declared = std::fs::read_to_string(&state)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .map(|v| v.get("format").and_then(|f| f.as_u64()).unwrap_or(1));
    match declared {
        Some(format) => manifest::verify(dir, u32::try_from(format).unwrap_or(u32::MAX)),
        // An unreadable state: only a manifest can still say what the checkpoint held.
        None if dir.join(manifest::MANIFEST).is_file() => manifest::verify(dir, manifest::FORMAT),
        None => Ok(Verdict::Damaged(format!(
            "{} is unreadable or malformed",
            state.display()
        ))),
    }
}

/// Resolves `--resume latest|PATH` against the output directory, verifying the checkpoint.
/// `latest` passes over damaged checkpoints, newest first, to the newest intact one, and
/// returns a line for each one passed over; a damaged `PATH` is refused.
pub fn resume_dir(output_dir: &Path, spec: &str) -> Result<(PathBuf, Vec<String>)> {
    if spec == "latest" {
        let mut passed_over = Vec::new();
        for (_, dir) in list_checkpoints(output_dir)?.into_iter().rev() {
            match verify(&dir)? {
                Verdict::Intact | Verdict::Unverified => return Ok((dir, passed_over)),
                Verdict::Damaged(why) => {
                    passed_over.push(format!("passing over {}: {why}", dir.display()))
                }
            }
        }
        if passed_over.is_empty() {
            bail!("--resume latest: no checkpoint in {}", output_dir.display());
        }
        bail!(
            "--resume latest: no intact checkpoint in {} ({})",
            output_dir.display(),
            passed_over.join("; ")
        );
    }
    let dir = PathBuf::from(spec);
    if !dir.join(TRAINER_STATE).is_file() {
        bail!("--resume {spec}: not a checkpoint directory (no {TRAINER_STATE})");
    }
    if let Verdict::Damaged(why) = verify(&dir)? {
        bail!("--resume {spec}: the checkpoint is damaged: {why}");
    }
    Ok((dir, Vec::new()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safetensors_are_written_from_tensor_memory_and_read_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, -0.5]).view([2, 3]);
        // A non-contiguous view and a non-fp32 tensor are written as contiguous fp32.
        let b = Tensor::from_slice(&[1i64, 2, 3, 4])
            .view([2, 2])
            .transpose(0, 1);
        write_safetensors(&path, &[("a".into(), a.shallow_clone()), ("b".into(), b)]).unwrap();
        let back = crate::models::weights::read_safetensors(&path).unwrap();
        let get = |n: &str| -> Vec<f32> {
            let t = &back.iter().find(|(k, _)| k == n).unwrap().1;
            Vec::try_from(t.view([-1])).unwrap()
        };
        assert_eq!(get("a"), vec![1.5, -2.0, 3.25, 0.0, 7.0, -0.5]);
        assert_eq!(get("b"), vec![1.0, 3.0, 2.0, 4.0]);
        assert!(!crate::io::atomic_file::temporary_path(&path).exists());
    }

    #[test]
    fn a_failed_write_says_why_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("t.safetensors");
        let t = Tensor::from_slice(&[1.0f32]);
        let err = format!(
            "{:#}",
            write_safetensors(&path, &[("t".into(), t)]).unwrap_err()
        );
        assert!(err.starts_with("cannot write "), "{err}");
        assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    }
}
