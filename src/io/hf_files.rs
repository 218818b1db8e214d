//! The Hugging Face model-directory layout: file names, and the shard index that names a
//! sharded checkpoint's files. Models, the Hub client and checkpoints all read this one list,
//! so none of them imports another for a file name.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};

/// The model's configuration (`PretrainedConfig.to_json_file`).
pub const CONFIG_FILE: &str = "config.json";
/// The fast tokenizer, the only tokenizer file sprtrain needs.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Weights in one safetensors file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Weights in several safetensors shards, named by this index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The PyTorch pickle format, which sprtrain refuses (named in the message).
pub const PICKLE_FILE: &str = "pytorch_model.bin";
/// Tokenizer files copied into every saved model directory where the source has them
/// (tokenizer.json always): what `AutoTokenizer.from_pretrained` reads.
pub const TOKENIZER_FILES: [&str; 7] = [
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
];

/// A sharded checkpoint's index (`model.safetensors.index.json`): tensor name -> shard file.
pub fn read_index(index: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let parsed: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = parsed
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no \"weight_map\" object", index.display()))?;
    map.iter()
        .map(|(k, v)| {
            let shard = v
                .as_str()
                .with_context(|| format!("{}: shard of {k} is not a file name", index.display()))?;
            Ok((k.clone(), shard.to_string()))
        })
        .collect()
}
