//! The run configuration: typed TOML, every field defaulted and documented. Unknown or
//! mistyped keys fail with their dotted path and the file. `configs/reference.toml` lists
//! every field with its default (a test keeps it in step with this file).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::sysinfo::CpuInfo;

/// Everything a run needs, as resolved from the file and `--set` overrides.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Which model to load and for what task.
    pub model: ModelConfig,
    /// Numerics and threads.
    pub runtime: RuntimeConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Local directory (config.json, model.safetensors or a sharded index, tokenizer.json) or a
    /// Hugging Face Hub id resolved into the standard HF cache.
    pub name_or_path: String,
    /// Hub revision (branch, tag or commit hash); ignored for local directories.
    pub revision: String,
    /// Head to train: "seq-cls", "qa" or "mlm".
    pub task: TaskName,
    /// Labels of a new classification head; 0 keeps config.json's count.
    pub num_labels: usize,
    /// Sequence classification loss: "auto" (as transformers infers it), "single_label_classification",
    /// "multi_label_classification" or "regression".
    pub problem_type: String,
    /// Tokens per example including special tokens; longer inputs are truncated.
    pub max_seq_len: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name_or_path: "distilbert-base-uncased".into(),
            revision: "main".into(),
            task: TaskName::SeqCls,
            num_labels: 0,
            problem_type: "auto".into(),
            max_seq_len: 128,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskName {
    #[serde(rename = "seq-cls")]
    SeqCls,
    #[serde(rename = "qa")]
    Qa,
    #[serde(rename = "mlm")]
    Mlm,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// "fp32", "bf16" (bf16 compute, fp32 master weights) or "auto" (bf16 only where the CPU
    /// has AMX-BF16 or AVX512-BF16).
    pub precision: Precision,
    /// libtorch intra-op threads; 0 = the physical cores available to this process.
    pub threads: usize,
    /// Seed for head initialisation, dropout and data order.
    pub seed: u64,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            precision: Precision::Auto,
            threads: 0,
            seed: 42,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Bf16,
    Auto,
}

impl Precision {
    /// `auto` becomes bf16 only on CPUs with bf16 units.
    pub fn resolve(self, cpu: &CpuInfo) -> Precision {
        match self {
            Precision::Auto if cpu.has_bf16_units() => Precision::Bf16,
            Precision::Auto => Precision::Fp32,
            p => p,
        }
    }
}

/// 1-based line of a byte offset, for messages.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// Parses one `--set section.key=value`; the value is TOML (`3`, `true`, `"x"`), or else a
/// bare string.
fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let (path, raw) = assignment
        .split_once('=')
        .with_context(|| format!("--set {assignment}: expected section.key=value"))?;
    let path = path.trim();
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let keys: Vec<&str> = path.split('.').collect();
    if keys.iter().any(|k| k.is_empty()) {
        bail!("--set {assignment}: malformed key {path:?}");
    }
    let (last, parents) = keys.split_last().context("empty key")?;
    let mut cur = table;
    for (depth, key) in parents.iter().enumerate() {
        let entry = cur
            .entry(key.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().with_context(|| {
            format!(
                "--set {assignment}: {} is not a section",
                keys[..=depth].join(".")
            )
        })?;
    }
    cur.insert(last.to_string(), value);
    Ok(())
}

impl Config {
    /// Reads `path` and applies `overrides` (`section.key=value`).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Self::from_toml_str(&text, overrides).with_context(|| format!("config {}", path.display()))
    }

    pub fn from_toml_str(text: &str, overrides: &[String]) -> Result<Config> {
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let line = e.span().map(|s| line_of(text, s.start)).unwrap_or(0);
            anyhow!("line {line}: {}", e.message().trim())
        })?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                // The path runs down to the offending key, unknown keys included.
                let key = e.path().to_string();
                let message = e.inner().message().trim().to_string();
                anyhow!("{key}: {message}")
            })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        if self.model.name_or_path.trim().is_empty() {
            bail!("model.name_or_path: must name a model directory or Hub id");
        }
        if self.model.max_seq_len < 8 {
            bail!(
                "model.max_seq_len: {} is too short (at least 8 tokens)",
                self.model.max_seq_len
            );
        }
        if self.model.problem_type != "auto" {
            crate::models::ProblemType::parse(&self.model.problem_type)
                .context("model.problem_type")?;
        }
        Ok(())
    }

    /// The resolved config as TOML, as saved beside checkpoints.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).context("cannot serialise config")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_are_typed_and_win() {
        let c = Config::from_toml_str(
            "[model]\nname_or_path = \"x\"\n",
            &[
                "model.max_seq_len=64".into(),
                "runtime.precision=fp32".into(),
                "model.revision=v1.0".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.model.max_seq_len, 64);
        assert_eq!(c.runtime.precision, Precision::Fp32);
        assert_eq!(c.model.revision, "v1.0");
        assert_eq!(c.runtime.seed, 42);
    }

    #[test]
    fn unknown_and_mistyped_keys_name_their_dotted_path() {
        let err = Config::from_toml_str("[model]\nmax_seq_lenn = 3\n", &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("model.max_seq_lenn: unknown field"),
            "{err}"
        );
        let err = Config::from_toml_str("[runtime]\nthreads = \"four\"\n", &[]).unwrap_err();
        assert!(
            err.to_string().starts_with("runtime.threads: invalid type"),
            "{err}"
        );
        let err = Config::from_toml_str("[modle]\n", &[]).unwrap_err();
        assert!(err.to_string().starts_with("modle: unknown field"), "{err}");
        let err = Config::from_toml_str("", &["runtime.precision=fp16".into()]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("runtime.precision: unknown variant"),
            "{err}"
        );
        let err = Config::from_toml_str("[model\n", &[]).unwrap_err();
        assert!(err.to_string().starts_with("line 1:"), "{err}");
    }

    #[test]
    fn auto_precision_follows_the_cpu() {
        let amx = CpuInfo {
            amx_bf16: true,
            ..Default::default()
        };
        assert_eq!(Precision::Auto.resolve(&amx), Precision::Bf16);
        assert_eq!(
            Precision::Auto.resolve(&CpuInfo::default()),
            Precision::Fp32
        );
        assert_eq!(
            Precision::Bf16.resolve(&CpuInfo::default()),
            Precision::Bf16
        );
    }

    /// configs/reference.toml must be the defaults, each key documented by a comment above it.
    #[test]
    fn reference_config_lists_every_field() {
        let text = include_str!("../configs/reference.toml");
        assert_eq!(Config::from_toml_str(text, &[]).unwrap(), Config::default());
        let defaults = toml::Value::try_from(Config::default()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (section, fields) in defaults.as_table().unwrap() {
            let start = lines
                .iter()
                .position(|l| *l == format!("[{section}]"))
                .expect(section);
            for key in fields.as_table().unwrap().keys() {
                let at = start
                    + lines[start..]
                        .iter()
                        .position(|l| l.starts_with(&format!("{key} = ")))
                        .unwrap_or_else(|| panic!("{section}.{key} missing"));
                assert!(
                    lines[at - 1].starts_with('#'),
                    "{section}.{key} has no doc comment"
                );
            }
        }
    }
}
