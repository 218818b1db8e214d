//! LoRA (Hu et al. 2021) as PEFT implements it: a frozen linear layer W plus a trainable
//! low-rank update, y = W x + (alpha / r) B A dropout(x), with A (r, in) drawn as PyTorch's
//! kaiming_uniform(a = sqrt(5)) and B (out, r) zero, so training starts from the base model.
//! Variables sit beside the layer's own as `<module>.lora_A.weight` and `<module>.lora_B.weight`;
//! adapters are saved in PEFT's layout (adapter_config.json, adapter_model.safetensors with keys
//! `base_model.model.<module>.lora_{A,B}.weight`) so `PeftModel.from_pretrained` loads them.
//!
//! Mirrors peft/tuners/lora/layer.py (Linear, and Conv1D through fan_in_fan_out) of PEFT 0.21.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tch::{nn, Tensor};

use super::hf_config::Arch;
pub use super::hf_config::LoraSpec;
pub use super::layers::{is_adapter_variable, LoraAdapter};

/// The adapter files PEFT reads and writes.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// PEFT's prefix of every adapter key in adapter_model.safetensors.
const PEFT_PREFIX: &str = "base_model.model.";

/// PEFT's adapter_config.json for `spec` on the model from `base`.
pub fn adapter_config_json(spec: &LoraSpec, arch: Arch, base: &str, task_type: &str) -> String {
    let config = json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": arch == Arch::Gpt2,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": spec.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": spec.target_modules,
        "task_type": task_type,
        "use_dora": false,
        "use_rslora": false,
    });
    serde_json::to_string_pretty(&config).unwrap_or_default() + "\n"
}

/// The adapter keys of adapter_model.safetensors for our variables, and back.
pub fn peft_key(name: &str) -> String {
    format!("{PEFT_PREFIX}{name}")
}

/// An adapter directory: its spec, the base model it names, and its tensors by our names.
pub struct SavedAdapter {
    pub spec: LoraSpec,
    pub base_model: Option<PathBuf>,
    pub tensors: Vec<(String, Tensor)>,
    pub dir: PathBuf,
}

/// Whether `dir` holds a PEFT adapter.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// Reads a PEFT LoRA adapter directory.
pub fn read_adapter(dir: &Path) -> Result<SavedAdapter> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let c: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    refuse_unsupported(&c, &path)?;
    let at = |key: &str| format!("{}: {key}", path.display());
    let r = c
        .get("r")
        .and_then(|v| v.as_i64())
        .with_context(|| at("r"))?;
    let alpha = c
        .get("lora_alpha")
        .and_then(|v| v.as_f64())
        .with_context(|| at("lora_alpha"))?;
    let dropout = c
        .get("lora_dropout")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);
    let target_modules = match c.get("target_modules") {
        Some(serde_json::Value::Array(v)) => v
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        _ => bail!("{}: a list of module names is needed", at("target_modules")),
    };
    let base_model = c
        .get("base_model_name_or_path")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from);
    let weights = dir.join(ADAPTER_WEIGHTS);
    let tensors = super::weights::read_safetensors(&weights)?
        .into_iter()
        .map(|(k, t)| {
            // PEFT saves without the adapter name; older files may carry ".default".
            let name = k
                .strip_prefix(PEFT_PREFIX)
                .unwrap_or(&k)
                .replace(".default.", ".");
            (name, t)
        })
        .collect();
    Ok(SavedAdapter {
        spec: LoraSpec {
            r,
            alpha,
            dropout,
            target_modules,
        },
        base_model,
        tensors,
        dir: dir.to_path_buf(),
    })
}

/// PEFT settings that change the arithmetic, which sprtrain does not implement, refused by
/// name.
fn refuse_unsupported(c: &serde_json::Value, path: &Path) -> Result<()> {
    let at = |key: &str| format!("{}: {key}", path.display());
    if c.get("peft_type").and_then(|v| v.as_str()) != Some("LORA") {
        bail!(
            "{}: only LoRA adapters (peft_type \"LORA\") are supported",
            path.display()
        );
    }
    for (key, off) in [("use_dora", false), ("use_rslora", false)] {
        if c.get(key).and_then(|v| v.as_bool()).unwrap_or(off) != off {
            bail!("{} is not supported", at(key));
        }
    }
    // Settings that change the arithmetic, which we do not implement.
    for key in ["lora_bias", "use_qalora"] {
        if c.get(key).and_then(|v| v.as_bool()).unwrap_or(false) {
            bail!("{} is not supported", at(key));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if c.get(key)
            .and_then(|v| v.as_object())
            .is_some_and(|m| !m.is_empty())
        {
            bail!("{} (per-layer ranks or alphas) is not supported", at(key));
        }
    }
    for key in [
        "layers_to_transform",
        "exclude_modules",
        "target_parameters",
        "modules_to_save",
    ] {
        if c.get(key).is_some_and(|v| !v.is_null()) {
            bail!("{} is not supported", at(key));
        }
    }
    if c.get("bias").and_then(|v| v.as_str()).unwrap_or("none") != "none" {
        bail!("{}: only bias \"none\" is supported", path.display());
    }
    Ok(())
}

/// Copies `saved`'s tensors into the model's adapter variables: every adapter variable must be
/// in the file with its shape, and every tensor of the file must be an adapter of the model.
pub fn load_adapter(vs: &nn::VarStore, saved: &SavedAdapter) -> Result<()> {
    let vars = vs.variables();
    let file = saved.dir.join(ADAPTER_WEIGHTS);
    let mut expected: Vec<&String> = vars.keys().filter(|n| is_adapter_variable(n)).collect();
    expected.sort();
    for (name, tensor) in &saved.tensors {
        let Some(var) = vars.get(name) else {
            bail!(
                "{}: tensor {} has no place in this model (an adapter for a different base model?)",
                file.display(),
                peft_key(name)
            );
        };
        if var.size() != tensor.size() {
            bail!(
                "{}: tensor {} has shape {:?} but the model's layer needs {:?} (an adapter for a different base model?)",
                file.display(),
                peft_key(name),
                tensor.size(),
                var.size()
            );
        }
        let mut var = var.shallow_clone();
        tch::no_grad(|| var.copy_(&tensor.to_kind(var.kind())));
    }
    if let Some(missing) = expected
        .iter()
        .find(|n| !saved.tensors.iter().any(|(k, _)| k == **n))
    {
        bail!("{}: no tensor {}", file.display(), peft_key(missing));
    }
    Ok(())
}

/// The base model's variables with every adapter folded into its layer's weight
/// (W + (alpha / r) B A; transposed for GPT-2's Conv1D), adapters left out: a full model.
pub fn merged_variables(vs: &nn::VarStore, spec: &LoraSpec, arch: Arch) -> Vec<(String, Tensor)> {
    let vars = vs.variables();
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for (name, tensor) in &vars {
        if is_adapter_variable(name) {
            continue;
        }
        let module = name.strip_suffix(".weight");
        let a = module.and_then(|m| vars.get(&format!("{m}.lora_A.weight")));
        let b = module.and_then(|m| vars.get(&format!("{m}.lora_B.weight")));
        let merged = match (a, b) {
            (Some(a), Some(b)) => {
                let update = b.matmul(a) * spec.scale(); // (out, in)
                let update = if arch == Arch::Gpt2 {
                    update.tr()
                } else {
                    update
                };
                tch::no_grad(|| tensor + update)
            }
            _ => tensor.shallow_clone(),
        };
        out.push((name.clone(), merged));
    }
    out.sort_by(|x, y| x.0.cmp(&y.0));
    out
}

/// The base model at `base_dir` with `head`, carrying the adapters of `saved`.
pub fn with_adapter(
    base_dir: &Path,
    head: super::Head,
    saved: &SavedAdapter,
) -> Result<super::Pretrained> {
    let spec = saved.spec.clone();
    let p = super::from_pretrained(
        base_dir,
        head,
        |c| {
            c.lora = Some(spec);
            Ok(())
        },
        0,
    )
    .with_context(|| {
        format!(
            "cannot load the base model of the adapter in {}",
            saved.dir.display()
        )
    })?;
    load_adapter(&p.vs, saved)?;
    Ok(p)
}
