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

/// A checkpoint's files, memory-mapped, and where each tensor lies in them by its (renamed)
/// state-dict key. Nothing is read until a tensor is loaded, and loading reads one tensor at a
/// time, so a load holds the model's parameters plus one tensor, not the file as well.
pub struct Checkpoint {
    files: Vec<MappedFile>,
    entries: BTreeMap<String, Stored>,
    /// Directory of the checkpoint, for messages.
    pub dir: PathBuf,
}

struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// One tensor of a mapped file: its name there, dtype, shape and bytes in the mapping.
struct Stored {
    file: usize,
    name: String,
    kind: Kind,
    shape: Vec<i64>,
    bytes: std::ops::Range<usize>,
}

impl Checkpoint {
    /// The file tensor `stored` lies in, for messages.
    fn path_of(&self, stored: &Stored) -> &Path {
        &self.files[stored.file].path
    }

    /// `stored` read from its mapping into a tensor of its own (then given back, see
    /// [`release`]).
    fn read(&self, stored: &Stored) -> Result<Tensor> {
        let file = &self.files[stored.file];
        let data = &file.map[stored.bytes.clone()];
        let tensor =
            Tensor::f_from_data_size(data, &stored.shape, stored.kind).with_context(|| {
                format!(
                    "{}: cannot read tensor {}",
                    file.path.display(),
                    stored.name
                )
            })?;
        release(data);
        Ok(tensor)
    }

    /// Copies `stored` straight from the mapping into `var`'s memory, a few MB at a time, each
    /// piece's pages given back once copied: a load then holds the parameters and one piece,
    /// not a second copy of the tensor. False (nothing done) where `var` differs in dtype or
    /// size or is not contiguous: then [`Checkpoint::read`] and a converting copy.
    fn copy_into(&self, stored: &Stored, var: &Tensor) -> bool {
        let file = &self.files[stored.file];
        let data = &file.map[stored.bytes.clone()];
        let same = var.kind() == stored.kind
            && var.is_contiguous()
            && var.numel() * var.kind().elt_size_in_bytes() == data.len();
        if !same {
            return false;
        }
        let dst = var.data_ptr() as *mut u8;
        for (k, piece) in data.chunks(COPY_PIECE_BYTES).enumerate() {
            // SAFETY: `var` is a contiguous tensor of exactly `data.len()` bytes that nothing
            // else uses during the load; the pieces are disjoint and in bounds.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    piece.as_ptr(),
                    dst.add(k * COPY_PIECE_BYTES),
                    piece.len(),
                )
            };
            release(piece);
        }
        true
    }
}

/// What [`Checkpoint::copy_into`] copies before giving the file's pages back.
const COPY_PIECE_BYTES: usize = 8 << 20;

/// Gives the whole pages of `data` (a slice of a checkpoint's mapping, already read) back: the
/// page cache keeps them, but they would otherwise count towards this process's memory until
/// the whole checkpoint is loaded.
fn release(data: &[u8]) {
    let page = 4096;
    let start = (data.as_ptr() as usize).next_multiple_of(page);
    let end = (data.as_ptr() as usize + data.len()) / page * page;
    if end > start {
        // SAFETY: whole pages inside a read-only private file mapping that nothing reads now;
        // MADV_DONTNEED drops them from this process (a later read would fault them in from
        // the file again). Advice only: a refusal leaves them mapped.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
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
    let mut out = Vec::new();
    for (name, view) in deserialize(path, &bytes)?.tensors() {
        let kind = kind_in(path, &name, &view)?;
        let tensor = Tensor::f_from_data_size(view.data(), &shape_of(&view), kind)
            .with_context(|| format!("{}: cannot read tensor {name}", path.display()))?;
        out.push((name, tensor));
    }
    Ok(out)
}

/// `bytes`, the contents of `path`, as safetensors: the header and sizes checked.
fn deserialize<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a valid safetensors file (truncated or corrupt?): {e}",
            path.display()
        )
    })
}

/// The libtorch dtype of tensor `name` of `path`; an error for dtypes libtorch lacks.
fn kind_in(path: &Path, name: &str, view: &safetensors::tensor::TensorView) -> Result<Kind> {
    kind_of(view.dtype()).with_context(|| {
        format!(
            "{}: tensor {name} has unsupported dtype {:?}",
            path.display(),
            view.dtype()
        )
    })
}

fn shape_of(view: &safetensors::tensor::TensorView) -> Vec<i64> {
    view.shape().iter().map(|&d| d as i64).collect()
}

/// Maps `path` and records where its tensors lie; the header is checked now (a truncated or
/// corrupt file is refused here, as when it was read whole).
fn read_file_into(path: &Path, ckpt: &mut Checkpoint) -> Result<()> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    // SAFETY: the mapping is read-only and private; a file changed under a running load is
    // the caller's to avoid, as for any reader (a checkpoint is never rewritten in place).
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    let index = ckpt.files.len();
    for (name, view) in deserialize(path, &map)?.tensors() {
        let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
        let stored = Stored {
            file: index,
            kind: kind_in(path, &name, &view)?,
            shape: shape_of(&view),
            bytes: start..start + view.data().len(),
            name: name.clone(),
        };
        ckpt.entries.insert(modern_key(&name), stored);
    }
    ckpt.files.push(MappedFile {
        path: path.to_path_buf(),
        map,
    });
    Ok(())
}

/// Reads `model.safetensors`, or every shard named by `model.safetensors.index.json`.
pub fn read_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint {
        files: Vec::new(),
        entries: BTreeMap::new(),
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
            if !ckpt.entries.contains_key(&modern_key(key)) {
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

/// Copies the checkpoint into the model's variables, a tensor at a time; see the module doc
/// for the rules.
pub fn load_checkpoint(
    vs: &nn::VarStore,
    model: &TaskModel,
    mut ckpt: Checkpoint,
) -> Result<LoadReport> {
    let mut vars = vs.variables();
    let entries = std::mem::take(&mut ckpt.entries);
    let mut stored = by_model_name(model, &vars, entries);
    let mut report = LoadReport::default();
    let mut names: Vec<String> = vars.keys().cloned().collect();
    names.sort();
    for name in names {
        let Some(var) = vars.get_mut(&name) else {
            continue;
        };
        let Some((orig, entry)) = stored.remove(&name) else {
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
        let file = ckpt.path_of(&entry).display().to_string();
        check_stored(&entry, var, &file, &orig, model)?;
        if !ckpt.copy_into(&entry, var) {
            let src = ckpt.read(&entry)?;
            tch::no_grad(|| var.f_copy_(&src.to_kind(var.kind())))
                .with_context(|| format!("{file}: cannot copy tensor {orig}"))?;
        }
        report.loaded += 1;
    }
    report.unused = stored
        .into_values()
        .map(|(orig, _)| orig)
        .filter(|k| !ignored_on_load(k, model.config.tie_word_embeddings))
        .collect();
    report.unused.sort();
    Ok(report)
}

/// The checkpoint's tensors under the model's names (a bare model's checkpoint on a task
/// model, or the reverse), each with its name in the file.
fn by_model_name<T>(
    model: &TaskModel,
    vars: &std::collections::HashMap<String, Tensor>,
    ckpt_tensors: BTreeMap<String, T>,
) -> BTreeMap<String, (String, T)> {
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

/// Checks stored tensor `orig` of `file` against `var` before anything is read: a shape other
/// than config.json's or a non-float dtype is an error naming both.
fn check_stored(
    stored: &Stored,
    var: &Tensor,
    file: &str,
    orig: &str,
    model: &TaskModel,
) -> Result<()> {
    if stored.shape != var.size() {
        bail!(
            "{file}: tensor {orig} has shape {:?} but {} expects {:?} from config.json",
            stored.shape,
            model.class_name(),
            var.size()
        );
    }
    if !matches!(
        stored.kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    ) {
        bail!(
            "{file}: tensor {orig} has dtype {:?}, expected a floating-point type",
            stored.kind
        );
    }
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
