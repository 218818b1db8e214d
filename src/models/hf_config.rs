//! Hugging Face `config.json` for the model families we support, normalised into one struct.
//!
//! Defaults are those of the transformers config classes (BertConfig, DistilBertConfig,
//! RobertaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config), so a
//! config.json that omits a key means what it means in transformers 5.23.

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
    /// RoBERTa's architecture with its own name (XLM-RoBERTa's multilingual checkpoints).
    XlmRoberta,
    /// BERT's encoder on embeddings of their own width, projected up (ELECTRA's discriminator
    /// and generator).
    Electra,
    /// Disentangled attention over relative positions (DeBERTa-v2 and -v3).
    DebertaV2,
    /// Rotary positions, GeGLU, alternating global and local attention.
    ModernBert,
    Gpt2,
    /// Llama 2/3.x, SmolLM2, TinyLlama.
    Llama,
    Mistral,
    /// Llama with q/k/v biases.
    Qwen2,
    /// Llama with RMSNorm on each head's queries and keys.
    Qwen3,
}

impl Arch {
    /// Prefix of the backbone's parameters in task checkpoints (`base_model_prefix`).
    pub fn prefix(self) -> &'static str {
        match self {
            Arch::Bert => "bert",
            Arch::DistilBert => "distilbert",
            Arch::Roberta | Arch::XlmRoberta => "roberta",
            Arch::Electra => "electra",
            Arch::DebertaV2 => "deberta",
            Arch::ModernBert => "model",
            Arch::Gpt2 => "transformer",
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 => "model",
        }
    }

    /// Causal language models (attention to earlier tokens only).
    pub fn is_decoder(self) -> bool {
        !matches!(
            self,
            Arch::Bert
                | Arch::DistilBert
                | Arch::Roberta
                | Arch::XlmRoberta
                | Arch::Electra
                | Arch::DebertaV2
                | Arch::ModernBert
        )
    }

    /// Class-name stem used in messages, as in `BertForSequenceClassification`.
    pub fn class_stem(self) -> &'static str {
        match self {
            Arch::Bert => "Bert",
            Arch::DistilBert => "DistilBert",
            Arch::Roberta => "Roberta",
            Arch::XlmRoberta => "XLMRoberta",
            Arch::Electra => "Electra",
            Arch::DebertaV2 => "DebertaV2",
            Arch::ModernBert => "ModernBert",
            Arch::Gpt2 => "GPT2",
            Arch::Llama => "Llama",
            Arch::Mistral => "Mistral",
            Arch::Qwen2 => "Qwen2",
            Arch::Qwen3 => "Qwen3",
        }
    }

    /// First path segments of backbone parameters in a checkpoint saved without the prefix.
    pub fn backbone_roots(self) -> &'static [&'static str] {
        match self {
            Arch::Bert | Arch::Roberta | Arch::XlmRoberta => &["embeddings", "encoder", "pooler"],
            Arch::Electra => &["embeddings", "embeddings_project", "encoder"],
            Arch::DebertaV2 => &["embeddings", "encoder"],
            Arch::ModernBert => &["embeddings", "layers", "final_norm"],
            Arch::DistilBert => &["embeddings", "transformer"],
            Arch::Gpt2 => &["wte", "wpe", "h", "ln_f"],
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 => {
                &["embed_tokens", "layers", "norm"]
            }
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

/// Rotary position embeddings (`rope_parameters`, or the older `rope_theta` + `rope_scaling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// `rope_type`: how the inverse frequencies are rescaled for longer contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `default`: 1 / theta^(2i/D).
    None,
    /// `linear`: positions divided by `factor`.
    Linear { factor: f64 },
    /// `llama3` (Llama 3.1+): long wavelengths divided by `factor`, short ones kept, a smooth
    /// ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// One model configuration, whatever the family.
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub arch: Arch,
    pub vocab_size: i64,
    pub hidden_size: i64,
    /// Width of the token embeddings: `hidden_size`, except ELECTRA's `embedding_size`.
    pub embedding_size: i64,
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
    /// Key/value heads (grouped-query attention); `num_heads` for encoders.
    pub num_kv_heads: i64,
    /// Width of one attention head.
    pub head_dim: i64,
    /// Dropout on the embeddings' output.
    pub embedding_dropout: f64,
    /// Rotary positions (the Llama family); `None` for learned positions.
    pub rope: Option<Rope>,
    /// Biases on the query, key and value projections (Llama's `attention_bias`, Qwen2).
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub output_bias: bool,
    /// Biases on the gated MLP (`mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm on each head's queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Each token attends to at most this many tokens back (Mistral's `sliding_window`).
    pub sliding_window: Option<i64>,
    /// Tokens that end a generation (`eos_token_id`, one id or a list).
    pub eos_token_ids: Vec<i64>,
    /// `bos_token_id`, if the config names one.
    pub bos_token_id: Option<i64>,
    /// Whether config.json names a `pad_token_id` (decoders often have none; batches are then
    /// padded with `pad_token_id` = the end-of-sequence id, or 0).
    pub has_pad_token: bool,
    /// LoRA adapters to build on the targeted layers (a training choice, not in config.json).
    pub lora: Option<LoraSpec>,
    /// DeBERTa-v2/v3's attention and pooler settings.
    pub deberta: Option<DebertaSettings>,
    /// ModernBERT's layer pattern, rotary bases, biases and heads.
    pub modernbert: Option<ModernBertSettings>,
    /// The file as read, kept so a saved config.json carries every key it came with.
    pub raw: serde_json::Value,
}

/// The DeBERTa-specific keys of config.json, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct DebertaSettings {
    pub relative_attention: bool,
    /// Relative distances are clipped to +-span (`max_relative_positions`, or
    /// `position_buckets` when bucketing).
    pub max_relative_positions: i64,
    /// > 0: distances beyond half of it are log-bucketed (v3: 256).
    pub position_buckets: i64,
    pub c2p: bool,
    pub p2c: bool,
    /// Positions are projected with the content's query/key projections (v3) instead of
    /// their own `pos_key_proj` / `pos_query_proj`.
    pub share_att_key: bool,
    /// LayerNorm on the relative embeddings (`norm_rel_ebd = "layer_norm"`).
    pub norm_rel_embeddings: bool,
    /// Absolute position embeddings added to the input (false in v3).
    pub position_biased_input: bool,
    pub pooler_hidden_size: i64,
    pub pooler_dropout: f64,
    pub pooler_activation: Activation,
}

impl DebertaSettings {
    /// Rows of the relative-embedding table are 2 x this.
    pub fn span(&self) -> i64 {
        if self.position_buckets > 0 {
            self.position_buckets
        } else {
            self.max_relative_positions
        }
    }
}

/// The ModernBERT-specific keys of config.json, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ModernBertSettings {
    /// Per layer: local (sliding-window) attention, else global.
    pub local_layers: Vec<bool>,
    /// Keys within this distance of the query are seen by local layers (local_attention / 2).
    pub half_window: i64,
    pub global_rope_theta: f64,
    pub local_rope_theta: f64,
    pub norm_bias: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub mlp_dropout: f64,
    pub classifier_bias: bool,
    pub classifier_activation: Activation,
    /// Sequence classification pools the first token ("cls") or the mean of real tokens.
    pub mean_pooling: bool,
    pub decoder_bias: bool,
}

/// Which layers get adapters, and their shape.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub r: i64,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names (last path segment, or a dotted suffix) that get adapters.
    pub target_modules: Vec<String>,
}

impl LoraSpec {
    /// PEFT's default targets per model type (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
    pub fn default_targets(arch: Arch) -> Vec<String> {
        let names: &[&str] = match arch {
            Arch::Gpt2 => &["c_attn"],
            Arch::Bert | Arch::Roberta | Arch::XlmRoberta | Arch::Electra => &["query", "value"],
            Arch::DistilBert => &["q_lin", "v_lin"],
            Arch::DebertaV2 => &["query_proj", "value_proj"],
            Arch::ModernBert => &["Wqkv"],
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 => &["q_proj", "v_proj"],
        };
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Whether the module at `path` (dotted) gets an adapter: PEFT's rule, an exact name or a
    /// `.`-separated suffix.
    pub fn targets(&self, path: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| path == t || path.ends_with(&format!(".{t}")))
    }

    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }
}

impl HfConfig {
    pub fn num_labels(&self) -> usize {
        self.id2label.len()
    }

    /// Longest input the position embeddings allow. RoBERTa's positions start after the
    /// padding index, so it fits `pad_token_id + 1` fewer tokens than it has positions.
    pub fn max_input_tokens(&self) -> usize {
        let positions = self.max_position_embeddings as usize;
        match self.arch {
            Arch::Roberta | Arch::XlmRoberta => {
                positions.saturating_sub(self.pad_token_id as usize + 1)
            }
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
            "bert" | "roberta" | "xlm-roberta" | "electra" => {
                bert_config(&model_type, &raw, &common)?
            }
            "distilbert" => distilbert_config(serde_json::from_value(raw.clone())?, &common)?,
            "deberta-v2" => deberta_v2_config(serde_json::from_value(raw.clone())?, &common)?,
            "modernbert" => modernbert_config(serde_json::from_value(raw.clone())?, &common)?,
            "gpt2" => gpt2_config(serde_json::from_value(raw.clone())?)?,
            "llama" | "mistral" | "qwen2" | "qwen3" => {
                llama_config(&model_type, serde_json::from_value(raw.clone())?, &raw)?
            }
            other => {
                bail!("unsupported model_type {other:?} (supported: {SUPPORTED_MODEL_TYPES})")
            }
        };
        cfg.id2label = common.id2label()?;
        // Encoders and GPT-2 tie by default, the Llama family does not.
        cfg.tie_word_embeddings = common.tie_word_embeddings.unwrap_or(matches!(
            cfg.arch,
            Arch::Bert
                | Arch::DistilBert
                | Arch::Roberta
                | Arch::XlmRoberta
                | Arch::Electra
                | Arch::DebertaV2
                | Arch::ModernBert
                | Arch::Gpt2
        ));
        if cfg.arch.is_decoder() {
            decoder_tokens(&mut cfg, &raw, &common);
        }
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
        if self.num_kv_heads <= 0 || self.num_heads % self.num_kv_heads != 0 {
            bail!(
                "num_key_value_heads {} does not divide the number of attention heads {}",
                self.num_kv_heads,
                self.num_heads
            );
        }
        if self.head_dim <= 0 || (self.rope.is_some() && self.head_dim % 2 != 0) {
            bail!(
                "head_dim {} must be positive (and even with RoPE)",
                self.head_dim
            );
        }
        Ok(())
    }
}

/// The encoder `model_type`s (masked LM, token classification, question answering), for
/// messages.
pub const ENCODER_MODEL_TYPES: &str =
    "bert, distilbert, roberta, xlm-roberta, electra, deberta-v2, modernbert";

/// The `model_type`s sprtrain builds, for messages.
pub const SUPPORTED_MODEL_TYPES: &str =
    "bert, distilbert, roberta, xlm-roberta, electra, deberta-v2, modernbert, gpt2, llama, mistral, qwen2, qwen3";

/// The values every family starts from (encoders' choices: learned positions, biases
/// everywhere, MHA), which each family's keys then override.
fn family_defaults(hidden: i64, heads: i64, dropout: f64) -> HfConfig {
    HfConfig {
        arch: Arch::Bert,
        vocab_size: 0,
        hidden_size: hidden,
        embedding_size: hidden,
        num_layers: 0,
        num_heads: heads,
        intermediate_size: 0,
        activation: Activation::Gelu,
        hidden_dropout: dropout,
        attention_dropout: 0.0,
        max_position_embeddings: 0,
        type_vocab_size: 0,
        layer_norm_eps: 0.0,
        pad_token_id: 0,
        initializer_range: 0.0,
        classifier_dropout: 0.0,
        qa_dropout: 0.0,
        sinusoidal_pos_embds: false,
        tie_word_embeddings: true,
        id2label: BTreeMap::new(),
        problem_type: None,
        num_kv_heads: heads,
        head_dim: if heads > 0 { hidden / heads } else { 0 },
        embedding_dropout: dropout,
        rope: None,
        qkv_bias: true,
        output_bias: true,
        mlp_bias: true,
        qk_norm: false,
        sliding_window: None,
        eos_token_ids: Vec::new(),
        bos_token_id: None,
        has_pad_token: true,
        lora: None,
        deberta: None,
        modernbert: None,
        raw: serde_json::Value::Null,
    }
}

/// BertConfig, RobertaConfig, XLMRobertaConfig and ElectraConfig.
fn bert_config(model_type: &str, raw: &serde_json::Value, common: &CommonKeys) -> Result<HfConfig> {
    let arch = match model_type {
        "bert" => Arch::Bert,
        "roberta" => Arch::Roberta,
        "xlm-roberta" => Arch::XlmRoberta,
        _ => Arch::Electra,
    };
    let pad_default = if matches!(arch, Arch::Bert | Arch::Electra) {
        0
    } else {
        1
    };
    let c: BertKeys = if arch == Arch::Electra {
        // ElectraConfig's defaults differ from BERT's: keys not given take them.
        let mut keys = serde_json::json!({
            "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
            "embedding_size": 128,
        });
        if let (Some(k), Some(given)) = (keys.as_object_mut(), raw.as_object()) {
            k.extend(given.clone());
        }
        serde_json::from_value(keys)?
    } else {
        serde_json::from_value(raw.clone())?
    };
    if c.position_embedding_type != "absolute" {
        bail!(
            "position_embedding_type {:?} is not supported (only \"absolute\")",
            c.position_embedding_type
        );
    }
    Ok(HfConfig {
        arch,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        embedding_size: c.embedding_size.unwrap_or(c.hidden_size),
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
        ..family_defaults(c.hidden_size, c.num_attention_heads, c.hidden_dropout_prob)
    })
}

/// DistilBertConfig.
fn distilbert_config(c: DistilBertKeys, common: &CommonKeys) -> Result<HfConfig> {
    Ok(HfConfig {
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
        ..family_defaults(c.dim, c.n_heads, c.dropout)
    })
}

/// A decoder's begin and end tokens, and what pads its batches.
fn decoder_tokens(cfg: &mut HfConfig, raw: &serde_json::Value, common: &CommonKeys) {
    // A key left out means the family's default; a null means none.
    let (bos_default, eos_default) = match cfg.arch {
        Arch::Gpt2 => (Some(50256), Some(50256)),
        Arch::Llama | Arch::Mistral => (Some(1), Some(2)),
        _ => (None, None),
    };
    cfg.bos_token_id = match raw.get("bos_token_id") {
        None => bos_default,
        Some(_) => common.bos_token_id,
    };
    cfg.eos_token_ids = match &common.eos_token_id {
        _ if raw.get("eos_token_id").is_none() => eos_default.into_iter().collect(),
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(ids)) => ids.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    };
    // Batches of a decoder without a pad token are padded with end-of-sequence (as
    // transformers' examples set `tokenizer.pad_token = tokenizer.eos_token`), else 0.
    cfg.has_pad_token = common.pad_token_id.is_some();
    cfg.pad_token_id = common
        .pad_token_id
        .or(cfg.eos_token_ids.first().copied())
        .unwrap_or(0);
}

/// `DebertaV2Config` (its defaults for keys left out).
fn deberta_v2_config(c: DebertaKeys, common: &CommonKeys) -> Result<HfConfig> {
    if c.conv_kernel_size > 0 {
        bail!(
            "conv_kernel_size {} (DeBERTa-v2's ConvLayer) is not supported",
            c.conv_kernel_size
        );
    }
    let att_types: Vec<String> = match &c.pos_att_type {
        serde_json::Value::String(s) => s.split('|').map(|t| t.trim().to_lowercase()).collect(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_str().map(str::to_lowercase))
            .collect(),
        _ => Vec::new(),
    };
    let max_relative_positions = if c.max_relative_positions < 1 {
        c.max_position_embeddings
    } else {
        c.max_relative_positions
    };
    let norm_rel_embeddings = c
        .norm_rel_ebd
        .to_lowercase()
        .split('|')
        .any(|t| t.trim() == "layer_norm");
    let settings = DebertaSettings {
        relative_attention: c.relative_attention,
        max_relative_positions,
        position_buckets: c.position_buckets,
        c2p: att_types.iter().any(|t| t == "c2p"),
        p2c: att_types.iter().any(|t| t == "p2c"),
        share_att_key: c.share_att_key,
        norm_rel_embeddings,
        position_biased_input: c.position_biased_input,
        pooler_hidden_size: c.pooler_hidden_size.unwrap_or(c.hidden_size),
        pooler_dropout: c.pooler_dropout,
        pooler_activation: Activation::parse(&c.pooler_hidden_act)?,
    };
    if settings.pooler_hidden_size != c.hidden_size {
        bail!(
            "pooler_hidden_size {} differs from hidden_size {}: not supported",
            settings.pooler_hidden_size,
            c.hidden_size
        );
    }
    Ok(HfConfig {
        arch: Arch::DebertaV2,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        embedding_size: c.embedding_size.unwrap_or(c.hidden_size),
        num_layers: c.num_hidden_layers,
        num_heads: c.num_attention_heads,
        intermediate_size: c.intermediate_size,
        activation: Activation::parse(&c.hidden_act)?,
        attention_dropout: c.attention_probs_dropout_prob,
        max_position_embeddings: c.max_position_embeddings,
        type_vocab_size: c.type_vocab_size,
        layer_norm_eps: c.layer_norm_eps,
        pad_token_id: common.pad_token_id.unwrap_or(0),
        initializer_range: c.initializer_range,
        classifier_dropout: c.cls_dropout.unwrap_or(c.hidden_dropout_prob),
        deberta: Some(settings),
        ..family_defaults(c.hidden_size, c.num_attention_heads, c.hidden_dropout_prob)
    })
}

/// `ModernBertConfig` (its defaults for keys left out; the layer pattern from `layer_types` or
/// `global_attn_every_n_layers`, the rotary bases from `rope_parameters` or the older
/// `global_rope_theta` / `local_rope_theta`).
fn modernbert_config(c: ModernBertKeys, common: &CommonKeys) -> Result<HfConfig> {
    let local_layers: Vec<bool> = match &c.layer_types {
        Some(types) => types.iter().map(|t| t == "sliding_attention").collect(),
        None => (0..c.num_hidden_layers)
            .map(|i| i % c.global_attn_every_n_layers.max(1) != 0)
            .collect(),
    };
    if local_layers.len() != c.num_hidden_layers as usize {
        bail!(
            "layer_types has {} entries for {} layers",
            local_layers.len(),
            c.num_hidden_layers
        );
    }
    let theta = |kind: &str, fallback: Option<f64>, default: f64| -> Result<f64> {
        let params = c.rope_parameters.as_ref().and_then(|p| p.get(kind));
        if let Some(t) = params
            .and_then(|p| p.get("rope_type"))
            .and_then(|t| t.as_str())
        {
            if t != "default" {
                bail!("rope_parameters.{kind}.rope_type {t:?} is not supported (only \"default\")");
            }
        }
        Ok(params
            .and_then(|p| p.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .or(fallback)
            .unwrap_or(default))
    };
    if !c.decoder_bias {
        bail!("decoder_bias false is not supported");
    }
    let settings = ModernBertSettings {
        local_layers,
        half_window: c.local_attention / 2,
        global_rope_theta: theta("full_attention", c.global_rope_theta, 160_000.0)?,
        local_rope_theta: theta("sliding_attention", c.local_rope_theta, 10_000.0)?,
        norm_bias: c.norm_bias,
        attention_bias: c.attention_bias,
        mlp_bias: c.mlp_bias,
        mlp_dropout: c.mlp_dropout,
        classifier_bias: c.classifier_bias,
        classifier_activation: Activation::parse(&c.classifier_activation)?,
        mean_pooling: match c.classifier_pooling.as_str() {
            "cls" => false,
            "mean" => true,
            other => bail!("classifier_pooling {other:?} is not supported (\"cls\" or \"mean\")"),
        },
        decoder_bias: c.decoder_bias,
    };
    Ok(HfConfig {
        arch: Arch::ModernBert,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        num_layers: c.num_hidden_layers,
        num_heads: c.num_attention_heads,
        intermediate_size: c.intermediate_size,
        activation: Activation::parse(&c.hidden_activation)?,
        attention_dropout: c.attention_dropout,
        max_position_embeddings: c.max_position_embeddings,
        layer_norm_eps: c.norm_eps,
        pad_token_id: common.pad_token_id.unwrap_or(50283),
        initializer_range: c.initializer_range,
        classifier_dropout: c.classifier_dropout,
        modernbert: Some(settings),
        ..family_defaults(c.hidden_size, c.num_attention_heads, c.embedding_dropout)
    })
}

/// `GPT2Config`.
fn gpt2_config(c: Gpt2Keys) -> Result<HfConfig> {
    if !c.scale_attn_weights || c.scale_attn_by_inverse_layer_idx || c.reorder_and_upcast_attn {
        bail!("GPT-2 attention variants (scale_attn_weights false, scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn) are not supported");
    }
    if c.add_cross_attention {
        bail!("GPT-2 with cross-attention (add_cross_attention) is not supported");
    }
    let heads = c.n_head;
    Ok(HfConfig {
        arch: Arch::Gpt2,
        vocab_size: c.vocab_size,
        num_layers: c.n_layer,
        intermediate_size: c.n_inner.unwrap_or(4 * c.n_embd),
        activation: Activation::parse(&c.activation_function)?,
        attention_dropout: c.attn_pdrop,
        max_position_embeddings: c.n_positions,
        layer_norm_eps: c.layer_norm_epsilon,
        initializer_range: c.initializer_range,
        classifier_dropout: 0.0,
        embedding_dropout: c.embd_pdrop,
        ..family_defaults(c.n_embd, heads, c.resid_pdrop)
    })
}

/// `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`: one decoder with switches.
fn llama_config(model_type: &str, c: LlamaKeys, raw: &serde_json::Value) -> Result<HfConfig> {
    let arch = match model_type {
        "llama" => Arch::Llama,
        "mistral" => Arch::Mistral,
        "qwen2" => Arch::Qwen2,
        _ => Arch::Qwen3,
    };
    // The family defaults that differ from Llama's.
    let (intermediate, positions, kv_default) = match arch {
        Arch::Mistral => (14336, 131072, Some(8)),
        Arch::Qwen2 | Arch::Qwen3 => (22016, 32768, None),
        _ => (11008, 2048, None),
    };
    let hidden = c.hidden_size.unwrap_or(4096);
    let heads = c.num_attention_heads.unwrap_or(32);
    if heads <= 0 {
        bail!("num_attention_heads must be positive, got {heads}");
    }
    let head_dim = match (arch, c.head_dim) {
        (_, Some(d)) => d,
        (Arch::Qwen3, None) => 128,
        _ => hidden / heads,
    };
    let sliding_window = match arch {
        Arch::Mistral => match raw.get("sliding_window") {
            None => Some(4096),
            Some(v) => v.as_i64(),
        },
        Arch::Qwen2 | Arch::Qwen3 if c.use_sliding_window => {
            bail!("use_sliding_window is not supported for {model_type}")
        }
        _ => None,
    };
    let attention_bias = c.attention_bias && matches!(arch, Arch::Llama | Arch::Qwen3);
    Ok(HfConfig {
        arch,
        vocab_size: c
            .vocab_size
            .unwrap_or(if matches!(arch, Arch::Qwen2 | Arch::Qwen3) {
                151936
            } else {
                32000
            }),
        num_layers: c.num_hidden_layers.unwrap_or(32),
        intermediate_size: c.intermediate_size.unwrap_or(intermediate),
        activation: Activation::parse(&c.hidden_act)?,
        attention_dropout: c.attention_dropout,
        max_position_embeddings: c.max_position_embeddings.unwrap_or(positions),
        layer_norm_eps: c.rms_norm_eps,
        initializer_range: c.initializer_range,
        classifier_dropout: 0.0,
        num_kv_heads: c.num_key_value_heads.or(kv_default).unwrap_or(heads),
        head_dim,
        embedding_dropout: 0.0,
        rope: Some(rope(raw, c.max_position_embeddings.unwrap_or(positions))?),
        qkv_bias: attention_bias || arch == Arch::Qwen2,
        output_bias: attention_bias,
        mlp_bias: c.mlp_bias && arch == Arch::Llama,
        qk_norm: arch == Arch::Qwen3,
        sliding_window,
        ..family_defaults(hidden, heads, 0.0)
    })
}

/// RoPE parameters as transformers 5 standardises them: `rope_scaling` (older files) wins over
/// `rope_parameters`; `rope_theta` may sit at the top level.
fn rope(raw: &serde_json::Value, max_positions: i64) -> Result<Rope> {
    let params = raw
        .get("rope_scaling")
        .filter(|v| v.is_object())
        .or_else(|| raw.get("rope_parameters").filter(|v| v.is_object()));
    let num =
        |key: &str| -> Option<f64> { params.and_then(|p| p.get(key)).and_then(|v| v.as_f64()) };
    let theta = num("rope_theta")
        .or_else(|| raw.get("rope_theta").and_then(|v| v.as_f64()))
        .unwrap_or(10000.0);
    if num("partial_rotary_factor").is_some_and(|f| f != 1.0) {
        bail!("partial_rotary_factor is not supported");
    }
    let rope_type = params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let need =
        |key: &str| num(key).with_context(|| format!("rope_type {rope_type:?} needs \"{key}\""));
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")
                .unwrap_or(max_positions as f64),
        },
        other => bail!("rope_type {other:?} is not supported (supported: default, linear, llama3)"),
    };
    Ok(Rope { theta, scaling })
}

/// Keys every transformers config shares.
#[derive(Deserialize)]
struct CommonKeys {
    pad_token_id: Option<i64>,
    bos_token_id: Option<i64>,
    /// One id or a list of ids.
    eos_token_id: Option<serde_json::Value>,
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
    /// ELECTRA: the width of the embeddings (projected to `hidden_size` when it differs).
    embedding_size: Option<i64>,
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
            embedding_size: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(default)]
struct DebertaKeys {
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
    relative_attention: bool,
    max_relative_positions: i64,
    position_buckets: i64,
    pos_att_type: serde_json::Value,
    share_att_key: bool,
    norm_rel_ebd: String,
    position_biased_input: bool,
    pooler_hidden_size: Option<i64>,
    pooler_dropout: f64,
    pooler_hidden_act: String,
    cls_dropout: Option<f64>,
    embedding_size: Option<i64>,
    conv_kernel_size: i64,
}

impl Default for DebertaKeys {
    fn default() -> Self {
        DebertaKeys {
            vocab_size: 128100,
            hidden_size: 1536,
            num_hidden_layers: 24,
            num_attention_heads: 24,
            intermediate_size: 6144,
            hidden_act: "gelu".into(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 0,
            initializer_range: 0.02,
            layer_norm_eps: 1e-7,
            relative_attention: false,
            max_relative_positions: -1,
            position_buckets: -1,
            pos_att_type: serde_json::Value::Null,
            share_att_key: false,
            norm_rel_ebd: "none".into(),
            position_biased_input: true,
            pooler_hidden_size: None,
            pooler_dropout: 0.0,
            pooler_hidden_act: "gelu".into(),
            cls_dropout: None,
            embedding_size: None,
            conv_kernel_size: 0,
        }
    }
}

#[derive(Deserialize)]
#[serde(default)]
struct ModernBertKeys {
    vocab_size: i64,
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    hidden_activation: String,
    max_position_embeddings: i64,
    initializer_range: f64,
    norm_eps: f64,
    norm_bias: bool,
    attention_bias: bool,
    attention_dropout: f64,
    layer_types: Option<Vec<String>>,
    global_attn_every_n_layers: i64,
    rope_parameters: Option<serde_json::Value>,
    global_rope_theta: Option<f64>,
    local_rope_theta: Option<f64>,
    local_attention: i64,
    embedding_dropout: f64,
    mlp_bias: bool,
    mlp_dropout: f64,
    decoder_bias: bool,
    classifier_pooling: String,
    classifier_dropout: f64,
    classifier_bias: bool,
    classifier_activation: String,
}

impl Default for ModernBertKeys {
    fn default() -> Self {
        ModernBertKeys {
            vocab_size: 50368,
            hidden_size: 768,
            intermediate_size: 1152,
            num_hidden_layers: 22,
            num_attention_heads: 12,
            hidden_activation: "gelu".into(),
            max_position_embeddings: 8192,
            initializer_range: 0.02,
            norm_eps: 1e-5,
            norm_bias: false,
            attention_bias: false,
            attention_dropout: 0.0,
            layer_types: None,
            global_attn_every_n_layers: 3,
            rope_parameters: None,
            global_rope_theta: None,
            local_rope_theta: None,
            local_attention: 128,
            embedding_dropout: 0.0,
            mlp_bias: false,
            mlp_dropout: 0.0,
            decoder_bias: true,
            classifier_pooling: "cls".into(),
            classifier_dropout: 0.0,
            classifier_bias: false,
            classifier_activation: "gelu".into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(default)]
struct Gpt2Keys {
    vocab_size: i64,
    n_positions: i64,
    n_embd: i64,
    n_layer: i64,
    n_head: i64,
    n_inner: Option<i64>,
    activation_function: String,
    resid_pdrop: f64,
    embd_pdrop: f64,
    attn_pdrop: f64,
    layer_norm_epsilon: f64,
    initializer_range: f64,
    scale_attn_weights: bool,
    scale_attn_by_inverse_layer_idx: bool,
    reorder_and_upcast_attn: bool,
    add_cross_attention: bool,
}

impl Default for Gpt2Keys {
    fn default() -> Self {
        Gpt2Keys {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            activation_function: "gelu_new".into(),
            resid_pdrop: 0.1,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            layer_norm_epsilon: 1e-5,
            initializer_range: 0.02,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            reorder_and_upcast_attn: false,
            add_cross_attention: false,
        }
    }
}

/// The Llama family's keys; `None` where the families' defaults differ.
#[derive(Deserialize)]
#[serde(default)]
struct LlamaKeys {
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    hidden_act: String,
    max_position_embeddings: Option<i64>,
    initializer_range: f64,
    rms_norm_eps: f64,
    attention_bias: bool,
    attention_dropout: f64,
    mlp_bias: bool,
    use_sliding_window: bool,
}

impl Default for LlamaKeys {
    fn default() -> Self {
        LlamaKeys {
            vocab_size: None,
            hidden_size: None,
            intermediate_size: None,
            num_hidden_layers: None,
            num_attention_heads: None,
            num_key_value_heads: None,
            head_dim: None,
            hidden_act: "silu".into(),
            max_position_embeddings: None,
            initializer_range: 0.02,
            rms_norm_eps: 1e-6,
            attention_bias: false,
            attention_dropout: 0.0,
            mlp_bias: false,
            use_sliding_window: false,
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
        let c = HfConfig::from_json_str(r#"{"model_type":"distilbert"}"#).unwrap();
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
        let c = HfConfig::from_json_str(
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
            HfConfig::from_json_str(r#"{"model_type":"bert","hidden_size":100}"#).unwrap_err();
        assert!(format!("{err:#}").contains("not a multiple"), "{err:#}");
        let err =
            HfConfig::from_json_str(r#"{"model_type":"bert","hidden_size":"big"}"#).unwrap_err();
        assert!(format!("{err:#}").contains("invalid type"), "{err:#}");
        let err = HfConfig::from_json_str(r#"{"model_type":"t5"}"#).unwrap_err();
        assert!(
            format!("{err:#}").contains("unsupported model_type \"t5\""),
            "{err:#}"
        );
        let err = HfConfig::from_json_str(
            r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":8,"num_key_value_heads":3}"#,
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("does not divide"), "{err:#}");
        let err = HfConfig::from_json_str(
            r#"{"model_type":"llama","rope_scaling":{"rope_type":"yarn","factor":4.0}}"#,
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("rope_type \"yarn\" is not supported"),
            "{err:#}"
        );
    }

    #[test]
    fn decoder_configs_follow_each_familys_defaults() {
        let c = HfConfig::from_json_str(r#"{"model_type":"gpt2"}"#).unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.intermediate_size,
                c.max_position_embeddings
            ),
            (768, 3072, 1024)
        );
        assert_eq!(
            (c.activation, c.layer_norm_eps),
            (Activation::GeluTanh, 1e-5)
        );
        assert!(c.tie_word_embeddings && !c.has_pad_token);
        // No pad token: batches are padded with end-of-sequence.
        assert_eq!(
            (c.pad_token_id, c.eos_token_ids.as_slice()),
            (50256, &[50256][..])
        );
        let m = HfConfig::from_json_str(r#"{"model_type":"mistral"}"#).unwrap();
        assert_eq!(
            (m.num_kv_heads, m.head_dim, m.sliding_window),
            (8, 128, Some(4096))
        );
        assert!(!m.tie_word_embeddings && !m.qkv_bias);
        let q2 = HfConfig::from_json_str(r#"{"model_type":"qwen2"}"#).unwrap();
        assert!(q2.qkv_bias && !q2.output_bias && q2.sliding_window.is_none());
        let q3 = HfConfig::from_json_str(
            r#"{"model_type":"qwen3","hidden_size":1024,"num_attention_heads":16}"#,
        )
        .unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias);
        assert_eq!(q3.head_dim, 128);
        // Llama 3.1's rope_scaling, the pre-v5 way, and a list of end-of-sequence ids.
        let l = HfConfig::from_json_str(
            r#"{"model_type":"llama","rope_theta":500000.0,"eos_token_id":[128001,128009],"vocab_size":128256,
                "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )
        .unwrap();
        assert_eq!(l.eos_token_ids, [128001, 128009]);
        assert_eq!(
            l.rope,
            Some(Rope {
                theta: 500000.0,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0
                }
            })
        );
    }
}
