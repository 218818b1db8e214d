//! `sprtrain merge`: a LoRA adapter folded into its base model, written as a full model
//! directory (model.safetensors, config.json, tokenizer) that transformers loads without PEFT.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::checkpoint::{copy_tokenizer, write_full_model, DEFAULT_MAX_SHARD_BYTES};
use crate::io::hf_files::TOKENIZER_FILE;
use crate::io::hub;
use crate::models::{lora, Head, HfConfig, TaskModel};

/// `sprtrain merge` options.
#[derive(Debug, Clone, clap::Args)]
pub struct MergeArgs {
    /// The adapter directory (adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    pub adapter: PathBuf,
    /// The base model (directory or Hub id) [default: the adapter's base_model_name_or_path].
    #[arg(long)]
    pub base: Option<String>,
    /// Where to write the merged model.
    #[arg(long)]
    pub output: PathBuf,
}

/// The adapter in `adapter_dir` on its base model (`base`, or the one the adapter names).
pub fn load(
    adapter_dir: &Path,
    base: Option<&str>,
    head: Head,
) -> Result<(lora::SavedAdapter, crate::models::Pretrained, PathBuf)> {
    let saved = lora::read_adapter(adapter_dir)?;
    let base = match base {
        Some(b) => b.to_string(),
        None => saved
            .base_model
            .as_ref()
            .map(|p| p.display().to_string())
            .with_context(|| {
                format!(
                    "{} names no base_model_name_or_path: pass --base",
                    adapter_dir.join(lora::ADAPTER_CONFIG).display()
                )
            })?,
    };
    let base_dir = hub::resolve_model_dir(&base, "main")?;
    let p = lora::with_adapter(&base_dir, head, &saved)?;
    Ok((saved, p, base_dir))
}

/// Writes the merged model; returns how many layers were merged.
pub fn run(args: &MergeArgs) -> Result<usize> {
    let (saved, p, base_dir) = load(&args.adapter, args.base.as_deref(), Head::CausalLm)?;
    let merged = lora::merged_variables(&p.vs, &saved.spec, p.model.config.arch);
    let layers =
        p.vs.variables()
            .keys()
            .filter(|n| n.ends_with(".lora_A.weight"))
            .count();
    // The merged model is a plain one: its config carries no adapters.
    let config = HfConfig {
        lora: None,
        ..p.model.config.clone()
    };
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let plain = TaskModel::new(&vs.root(), config, Head::CausalLm)?;
    std::fs::create_dir_all(&args.output)
        .with_context(|| format!("cannot create {}", args.output.display()))?;
    write_full_model(&args.output, &plain, merged, DEFAULT_MAX_SHARD_BYTES)?;
    let tokenizer = [
        args.adapter.join(TOKENIZER_FILE),
        base_dir.join(TOKENIZER_FILE),
    ]
    .into_iter()
    .find(|t| t.is_file())
    .with_context(|| format!("no {TOKENIZER_FILE} beside the adapter or the base model"))?;
    copy_tokenizer(&tokenizer, &args.output)?;
    Ok(layers)
}
