//! Hugging Face `config.json` for the encoder families we support, normalised into one struct.
//!
//! Defaults are those of the transformers config classes (BertConfig, DistilBertConfig,
//! RobertaConfig), so a config.json that omits a key means what it means in transformers.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The architecture family, from `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Bert,
    DistilBert,
    Roberta,
}

impl Arch {
    /// Prefix of the backbone's parameters in task checkpoints (`base_model_prefix`).
    pub fn prefix(self) -> &'static str {
        match self {
            Arch::Bert => "bert",
            Arch::DistilBert => "distilbert",
            Arch::Roberta => "roberta",
        }
    }

    /// Class-name stem used in messages, as in `BertForSequenceClassification`.
    pub fn class_stem(self) -> &'static str {
        match self {
            Arch::Bert => "Bert",
            Arch::DistilBert => "DistilBert",
            Arch::Roberta => "Roberta",
        }
    }

    /// First path segments of backbone parameters in a checkpoint saved without the prefix.
    pub fn backbone_roots(self) -> &'static [&'static str] {
        match self {
            Arch::Bert | Arch::Roberta => &["embeddings", "encoder", "pooler"],
            Arch::DistilBert => &["embeddings", "transformer"],
        }
    }
}

/// Activation functions named by `hidden_act` / `activation` in transformers' ACT2FN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Exact erf-based GELU (`gelu`).
    Gelu,
    /// Tanh approximation (`gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`).
    GeluTanh,
    Relu,
    Silu,
    Tanh,
}

impl Activation {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            "silu" | "swish" => Activation::Silu,
            "tanh" => Activation::Tanh,
            other => bail!(
                "unsupported activation {other:?} (supported: gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu, silu, swish, tanh)"
            ),
        })
    }
}

/// `problem_type` of sequence classification, as in transformers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemType {
    SingleLabel,
    MultiLabel,
    Regression,
}

impl ProblemType {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "single_label_classification" => ProblemType::SingleLabel,
            "multi_label_classification" => ProblemType::MultiLabel,
            "regression" => ProblemType::Regression,
            other => bail!(
                "unknown problem_type {other:?} (expected single_label_classification, multi_label_classification or regression)"
            ),
        })
    }

    pub fn as_hf_str(self) -> &'static str {
        match self {
            ProblemType::SingleLabel => "single_label_classification",
            ProblemType::MultiLabel => "multi_label_classification",
            ProblemType::Regression => "regression",
        }
    }

    /// What transformers infers when `problem_type` is unset: one label is regression,
    /// several labels with integer targets are single-label classification.
    pub fn infer(num_labels: usize) -> Self {
        if num_labels == 1 {
            ProblemType::Regression
        } else {
            ProblemType::SingleLabel
        }
    }
}

/// One encoder configuration, whatever the family.
#[derive(Debug, Clone)]
pub struct EncoderConfig {
    pub arch: Arch,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub intermediate_size: i64,
    pub activation: Activation,
    pub hidden_dropout: f64,
    pub attention_dropout: f64,
    pub max_position_embeddings: i64,
    /// 0 for DistilBERT, which has no token type embeddings.
    pub type_vocab_size: i64,
    pub layer_norm_eps: f64,
    pub pad_token_id: i64,
    pub initializer_range: f64,
    /// Dropout before the sequence-classification output layer.
    pub classifier_dropout: f64,
    /// Dropout before `qa_outputs` (DistilBERT only; BERT and RoBERTa apply none).
    pub qa_dropout: f64,
    /// DistilBERT's fixed sinusoidal position embeddings (not trained).
    pub sinusoidal_pos_embds: bool,
    /// Whether the masked-LM decoder shares the word embeddings (transformers' default).
    pub tie_word_embeddings: bool,
    /// Label names by id; its length is `num_labels`.
    pub id2label: BTreeMap<usize, String>,
    /// Explicit `problem_type`, if config.json has one.
    pub problem_type: Option<ProblemType>,
    /// The file as read, kept so a saved config.json carries every key it came with.
    pub raw: serde_json::Value,
}

impl EncoderConfig {
    pub fn num_labels(&self) -> usize {
        self.id2label.len()
    }

    /// Longest input the position embeddings allow. RoBERTa's positions start after the
    /// padding index, so it fits `pad_token_id + 1` fewer tokens than it has positions.
    pub fn max_input_tokens(&self) -> usize {
        let positions = self.max_position_embeddings as usize;
        match self.arch {
            Arch::Roberta => positions.saturating_sub(self.pad_token_id as usize + 1),
            _ => positions,
        }
    }

    /// The problem type a classification head trains for.
    pub fn resolved_problem_type(&self) -> ProblemType {
        self.problem_type
            .unwrap_or_else(|| ProblemType::infer(self.num_labels()))
    }

    /// Sets `num_labels`, keeping names already known and naming new ones `LABEL_i`.
    pub fn set_num_labels(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            bail!("num_labels must be at least 1");
        }
        self.id2label.retain(|id, _| *id < n);
        for id in 0..n {
            self.id2label
                .entry(id)
                .or_insert_with(|| format!("LABEL_{id}"));
        }
        Ok(())
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        Self::from_json_str(&text)
            .with_context(|| format!("invalid model config {}", path.display()))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: serde_json::Value = serde_json::from_str(text).context("malformed JSON")?;
        let model_type = raw
            .get("model_type")
            .and_then(|v| v.as_str())
            .context("no \"model_type\" key")?
            .to_string();
        let common: CommonKeys = serde_json::from_value(raw.clone())?;
        let mut cfg = match model_type.as_str() {
            "bert" | "roberta" => {
                let arch = if model_type == "bert" {
                    Arch::Bert
                } else {
                    Arch::Roberta
                };
                let pad_default = if arch == Arch::Roberta { 1 } else { 0 };
                let c: BertKeys = serde_json::from_value(raw.clone())?;
                if c.position_embedding_type != "absolute" {
                    bail!(
                        "position_embedding_type {:?} is not supported (only \"absolute\")",
                        c.position_embedding_type
                    );
                }
                EncoderConfig {
                    arch,
                    vocab_size: c.vocab_size,
                    hidden_size: c.hidden_size,
                    num_layers: c.num_hidden_layers,
                    num_heads: c.num_attention_heads,
                    intermediate_size: c.intermediate_size,
                    activation: Activation::parse(&c.hidden_act)?,
                    hidden_dropout: c.hidden_dropout_prob,
                    attention_dropout: c.attention_probs_dropout_prob,
                    max_position_embeddings: c.max_position_embeddings,
                    type_vocab_size: c.type_vocab_size,
                    layer_norm_eps: c.layer_norm_eps,
                    pad_token_id: common.pad_token_id.unwrap_or(pad_default),
                    initializer_range: c.initializer_range,
                    classifier_dropout: c.classifier_dropout.unwrap_or(c.hidden_dropout_prob),
                    qa_dropout: 0.0,
                    sinusoidal_pos_embds: false,
                    tie_word_embeddings: true,
                    id2label: BTreeMap::new(),
                    problem_type: None,
                    raw: serde_json::Value::Null,
                }
            }
            "distilbert" => {
                let c: DistilBertKeys = serde_json::from_value(raw.clone())?;
                EncoderConfig {
                    arch: Arch::DistilBert,
                    vocab_size: c.vocab_size,
                    hidden_size: c.dim,
                    num_layers: c.n_layers,
                    num_heads: c.n_heads,
                    intermediate_size: c.hidden_dim,
                    activation: Activation::parse(&c.activation)?,
                    hidden_dropout: c.dropout,
                    attention_dropout: c.attention_dropout,
                    max_position_embeddings: c.max_position_embeddings,
                    type_vocab_size: 0,
                    // Hard-coded in transformers' DistilBERT modules.
                    layer_norm_eps: 1e-12,
                    pad_token_id: common.pad_token_id.unwrap_or(0),
                    initializer_range: c.initializer_range,
                    classifier_dropout: c.seq_classif_dropout,
                    qa_dropout: c.qa_dropout,
                    sinusoidal_pos_embds: c.sinusoidal_pos_embds,
                    tie_word_embeddings: true,
                    id2label: BTreeMap::new(),
                    problem_type: None,
                    raw: serde_json::Value::Null,
                }
            }
            other => {
                bail!("unsupported model_type {other:?} (supported: bert, distilbert, roberta)")
            }
        };
        cfg.id2label = common.id2label()?;
        cfg.tie_word_embeddings = common.tie_word_embeddings.unwrap_or(true);
        cfg.problem_type = common
            .problem_type
            .as_deref()
            .map(ProblemType::parse)
            .transpose()?;
        cfg.raw = raw;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab size", self.vocab_size),
            ("hidden size", self.hidden_size),
            ("number of layers", self.num_layers),
            ("number of attention heads", self.num_heads),
            ("intermediate size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v <= 0 {
                bail!("{name} must be positive, got {v}");
            }
        }
        if self.hidden_size % self.num_heads != 0 {
            bail!(
                "hidden size {} is not a multiple of the number of attention heads {}",
                self.hidden_size,
                self.num_heads
            );
        }
        if self.pad_token_id < 0 || self.pad_token_id >= self.vocab_size {
            bail!(
                "pad_token_id {} is outside the vocabulary",
                self.pad_token_id
            );
        }
        Ok(())
    }
}

/// Keys every transformers config shares.
#[derive(Deserialize)]
struct CommonKeys {
    pad_token_id: Option<i64>,
    problem_type: Option<String>,
    #[serde(default)]
    id2label: Option<BTreeMap<String, String>>,
    num_labels: Option<usize>,
    tie_word_embeddings: Option<bool>,
}

impl CommonKeys {
    /// transformers: `num_labels` comes from `id2label` when present, else from `num_labels`,
    /// else 2; missing names are `LABEL_i`.
    fn id2label(&self) -> Result<BTreeMap<usize, String>> {
        let mut out = BTreeMap::new();
        if let Some(map) = &self.id2label {
            for (k, v) in map {
                let id: usize = k
                    .parse()
                    .with_context(|| format!("id2label key {k:?} is not a label id"))?;
                out.insert(id, v.clone());
            }
            if out.keys().enumerate().any(|(i, id)| i != *id) {
                bail!("id2label ids must be 0..num_labels without gaps");
            }
        }
        if out.is_empty() {
            for id in 0..self.num_labels.unwrap_or(2) {
                out.insert(id, format!("LABEL_{id}"));
            }
        }
        Ok(out)
    }
}

#[derive(Deserialize)]
#[serde(default)]
struct BertKeys {
    vocab_size: i64,
    hidden_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    intermediate_size: i64,
    hidden_act: String,
    hidden_dropout_prob: f64,
    attention_probs_dropout_prob: f64,
    max_position_embeddings: i64,
    type_vocab_size: i64,
    initializer_range: f64,
    layer_norm_eps: f64,
    position_embedding_type: String,
    classifier_dropout: Option<f64>,
}

impl Default for BertKeys {
    fn default() -> Self {
        BertKeys {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: "gelu".into(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
            position_embedding_type: "absolute".into(),
            classifier_dropout: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(default)]
struct DistilBertKeys {
    vocab_size: i64,
    max_position_embeddings: i64,
    sinusoidal_pos_embds: bool,
    n_layers: i64,
    n_heads: i64,
    dim: i64,
    hidden_dim: i64,
    dropout: f64,
    attention_dropout: f64,
    activation: String,
    initializer_range: f64,
    qa_dropout: f64,
    seq_classif_dropout: f64,
}

impl Default for DistilBertKeys {
    fn default() -> Self {
        DistilBertKeys {
            vocab_size: 30522,
            max_position_embeddings: 512,
            sinusoidal_pos_embds: false,
            n_layers: 6,
            n_heads: 12,
            dim: 768,
            hidden_dim: 3072,
            dropout: 0.1,
            attention_dropout: 0.1,
            activation: "gelu".into(),
            initializer_range: 0.02,
            qa_dropout: 0.1,
            seq_classif_dropout: 0.2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distilbert_defaults_match_transformers() {
        let c = EncoderConfig::from_json_str(r#"{"model_type":"distilbert"}"#).unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.intermediate_size
            ),
            (768, 6, 12, 3072)
        );
        assert_eq!(c.num_labels(), 2);
        assert_eq!(c.classifier_dropout, 0.2);
        assert_eq!(c.type_vocab_size, 0);
    }

    #[test]
    fn roberta_pads_with_one_and_labels_come_from_id2label() {
        let c = EncoderConfig::from_json_str(
            r#"{"model_type":"roberta","id2label":{"0":"neg","1":"neu","2":"pos"},"num_labels":7}"#,
        )
        .unwrap();
        assert_eq!(c.pad_token_id, 1);
        assert_eq!(c.num_labels(), 3);
        assert_eq!(c.resolved_problem_type(), ProblemType::SingleLabel);
    }

    #[test]
    fn rejects_bad_shapes_and_types() {
        let err =
            EncoderConfig::from_json_str(r#"{"model_type":"bert","hidden_size":100}"#).unwrap_err();
        assert!(format!("{err:#}").contains("not a multiple"), "{err:#}");
        let err = EncoderConfig::from_json_str(r#"{"model_type":"bert","hidden_size":"big"}"#)
            .unwrap_err();
        assert!(format!("{err:#}").contains("invalid type"), "{err:#}");
        let err = EncoderConfig::from_json_str(r#"{"model_type":"gpt2"}"#).unwrap_err();
        assert!(
            format!("{err:#}").contains("unsupported model_type \"gpt2\""),
            "{err:#}"
        );
    }
}
