//! Reading Hugging Face safetensors checkpoints (single file or sharded with an index) and
//! loading them strictly into a [`TaskModel`]'s variables.
//!
//! Follows transformers' `from_pretrained` rules: the base-model prefix is added or stripped
//! as needed, legacy `gamma`/`beta` LayerNorm names are renamed, heads missing from the
//! checkpoint are newly initialised, unused tensors are reported. Unlike transformers, a
//! missing backbone tensor or any shape mismatch is an error.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};
use tch::{nn, Kind, Tensor};

use super::TaskModel;
use crate::io::hf_files::{read_index, INDEX_FILE, PICKLE_FILE, SINGLE_FILE};

/// All tensors of a checkpoint, by their (renamed) state-dict key.
pub struct Checkpoint {
    pub tensors: BTreeMap<String, Tensor>,
    /// Which file each tensor came from, for messages.
    pub origin: BTreeMap<String, PathBuf>,
    /// Directory of the checkpoint, for messages.
    pub dir: PathBuf,
}

/// What a load did, reported as transformers reports it.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub loaded: usize,
    /// Checkpoint keys no variable used (e.g. the pooler when fine-tuning for QA).
    pub unused: Vec<String>,
    /// Variables absent from the checkpoint and left at their fresh initialisation.
    pub newly_initialised: Vec<String>,
}

impl LoadReport {
    /// The two summary lines, when there is something to say.
    pub fn summary_lines(&self, class: &str, dir: &Path) -> Vec<String> {
        let mut lines = Vec::new();
        if !self.unused.is_empty() {
            lines.push(format!(
                "some weights of the checkpoint at {} were not used when initializing {class}: [{}]",
                dir.display(),
                self.unused.join(", ")
            ));
        }
        if !self.newly_initialised.is_empty() {
            lines.push(format!(
                "some weights of {class} were not initialized from the checkpoint at {} and are newly initialized: [{}]",
                dir.display(),
                self.newly_initialised.join(", ")
            ));
        }
        lines
    }
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

/// transformers renames these legacy LayerNorm parameter names on load.
fn modern_key(key: &str) -> String {
    if let Some(stem) = key.strip_suffix(".gamma") {
        format!("{stem}.weight")
    } else if let Some(stem) = key.strip_suffix(".beta") {
        format!("{stem}.bias")
    } else {
        key.to_string()
    }
}

/// Every tensor of one safetensors file, by its stored name.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a valid safetensors file (truncated or corrupt?): {e}",
            path.display()
        )
    })?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype()).with_context(|| {
            format!(
                "{}: tensor {name} has unsupported dtype {:?}",
                path.display(),
                view.dtype()
            )
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let tensor = Tensor::f_from_data_size(view.data(), &shape, kind)
            .with_context(|| format!("{}: cannot read tensor {name}", path.display()))?;
        out.push((name, tensor));
    }
    Ok(out)
}

fn read_file_into(path: &Path, ckpt: &mut Checkpoint) -> Result<()> {
    for (name, tensor) in read_safetensors(path)? {
        let key = modern_key(&name);
        ckpt.origin.insert(key.clone(), path.to_path_buf());
        ckpt.tensors.insert(key, tensor);
    }
    Ok(())
}

/// Reads `model.safetensors`, or every shard named by `model.safetensors.index.json`.
pub fn read_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint {
        tensors: BTreeMap::new(),
        origin: BTreeMap::new(),
        dir: dir.to_path_buf(),
    };
    let single = dir.join(SINGLE_FILE);
    let index = dir.join(INDEX_FILE);
    if single.is_file() {
        read_file_into(&single, &mut ckpt)?;
    } else if index.is_file() {
        let weight_map = read_index(&index)?;
        let shards: BTreeSet<&String> = weight_map.values().collect();
        for shard in shards {
            let path = dir.join(shard);
            if !path.is_file() {
                bail!(
                    "shard {} named by {} is missing",
                    path.display(),
                    index.display()
                );
            }
            read_file_into(&path, &mut ckpt)?;
        }
        for key in weight_map.keys() {
            if !ckpt.tensors.contains_key(&modern_key(key)) {
                bail!(
                    "{} maps tensor {key} to a shard that does not contain it",
                    index.display()
                );
            }
        }
    } else if dir.join(PICKLE_FILE).is_file() {
        bail!(
            "{} holds only {PICKLE_FILE}; sprtrain reads safetensors (convert with transformers: model.save_pretrained(dir, safe_serialization=True))",
            dir.display()
        );
    } else {
        bail!("no {SINGLE_FILE} or {INDEX_FILE} in {}", dir.display());
    }
    Ok(ckpt)
}

/// Tensors transformers ignores on load: buffers (position ids, GPT-2's causal-mask `attn.bias`,
/// RoPE frequencies) and tied copies of the word embeddings.
fn ignored_on_load(key: &str, tied: bool) -> bool {
    key.ends_with("position_ids")
        || key.ends_with(".attn.bias")
        || key.ends_with(".attn.masked_bias")
        || key.ends_with("rotary_emb.inv_freq")
        || (tied && key == "lm_head.weight")
        || key == "cls.predictions.decoder.weight"
        || key == "cls.predictions.decoder.bias"
        || key == "lm_head.decoder.weight"
        || key == "lm_head.decoder.bias"
        || key == "vocab_projector.weight"
        || (tied && key == "generator_lm_head.weight")
        || (tied && key == "decoder.weight")
}

/// Copies the checkpoint into the model's variables; see the module doc for the rules.
pub fn load_checkpoint(
    vs: &nn::VarStore,
    model: &TaskModel,
    ckpt: Checkpoint,
) -> Result<LoadReport> {
    let mut vars = vs.variables();
    let mut tensors = by_model_name(model, &vars, ckpt.tensors);
    let mut report = LoadReport::default();
    let mut names: Vec<String> = vars.keys().cloned().collect();
    names.sort();
    for name in names {
        let Some(var) = vars.get_mut(&name) else {
            continue;
        };
        let Some((orig, src)) = tensors.remove(&name) else {
            // LoRA adapters start fresh on a base model, as PEFT's do (not reported).
            if super::layers::is_adapter_variable(&name) {
                continue;
            }
            if model.may_be_newly_initialised(&name) {
                report.newly_initialised.push(name);
                continue;
            }
            bail!(
                "tensor {name} is missing from the checkpoint at {}",
                ckpt.dir.display()
            );
        };
        let file = ckpt
            .origin
            .get(&orig)
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        copy_checked(var, &src, &file, &orig, model)?;
        report.loaded += 1;
    }
    report.unused = tensors
        .into_values()
        .map(|(orig, _)| orig)
        .filter(|k| !ignored_on_load(k, model.config.tie_word_embeddings))
        .collect();
    report.unused.sort();
    Ok(report)
}

/// The checkpoint's tensors under the model's names (a bare model's checkpoint on a task
/// model, or the reverse), each with its name in the file.
fn by_model_name(
    model: &TaskModel,
    vars: &std::collections::HashMap<String, Tensor>,
    ckpt_tensors: BTreeMap<String, Tensor>,
) -> BTreeMap<String, (String, Tensor)> {
    let arch = model.config.arch;
    let prefix = arch.prefix();
    let model_prefixed = vars.keys().any(|k| k.starts_with(&format!("{prefix}.")));
    let ckpt_prefixed = ckpt_tensors
        .keys()
        .any(|k| k.starts_with(&format!("{prefix}.")));
    let roots = arch.backbone_roots();
    let rename = |key: &str| -> String {
        match (model_prefixed, ckpt_prefixed) {
            (true, false) if roots.iter().any(|r| key.split('.').next() == Some(*r)) => {
                format!("{prefix}.{key}")
            }
            (false, true) => key
                .strip_prefix(&format!("{prefix}."))
                .unwrap_or(key)
                .to_string(),
            _ => key.to_string(),
        }
    };
    ckpt_tensors
        .into_iter()
        .map(|(key, tensor)| (rename(&key), (key, tensor)))
        .collect()
}

/// Copies `src` (tensor `orig` of `file`) into `var`, converting its dtype; a shape other than
/// config.json's or a non-float tensor is an error naming both.
fn copy_checked(
    var: &mut Tensor,
    src: &Tensor,
    file: &str,
    orig: &str,
    model: &TaskModel,
) -> Result<()> {
    if src.size() != var.size() {
        bail!(
            "{file}: tensor {orig} has shape {:?} but {} expects {:?} from config.json",
            src.size(),
            model.class_name(),
            var.size()
        );
    }
    if !src.is_floating_point() {
        bail!(
            "{file}: tensor {orig} has dtype {:?}, expected a floating-point type",
            src.kind()
        );
    }
    let kind = var.kind();
    tch::no_grad(|| var.f_copy_(&src.to_kind(kind)))
        .with_context(|| format!("{file}: cannot copy tensor {orig}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_layer_norm_names_are_renamed() {
        assert_eq!(
            modern_key("bert.embeddings.LayerNorm.gamma"),
            "bert.embeddings.LayerNorm.weight"
        );
        assert_eq!(
            modern_key("encoder.layer.0.output.LayerNorm.beta"),
            "encoder.layer.0.output.LayerNorm.bias"
        );
        assert_eq!(modern_key("classifier.bias"), "classifier.bias");
    }
}
