//! The run configuration: typed TOML, every field defaulted and documented. Unknown or
//! mistyped keys fail with their dotted path and the file. `configs/reference.toml` lists
//! every field with its default (a test keeps it in step with this file).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::dist::Transport;
use crate::models::{Head, ProblemType};
use crate::runtime::sysinfo::CpuInfo;

/// Everything a run needs, as resolved from the file and `--set` overrides.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Which model to load and for what task.
    pub model: ModelConfig,
    /// Training and evaluation data.
    pub data: DataConfig,
    /// The optimization run.
    pub train: TrainConfig,
    /// Evaluation during and after training.
    pub eval: EvalConfig,
    /// Extractive question answering (model.task = "qa"), as run_qa.py.
    pub qa: QaConfig,
    /// Numerics and threads.
    pub runtime: RuntimeConfig,
    /// Data parallelism over MPI.
    pub dist: DistConfig,
    /// LoRA adapters: with r > 0 only they train (and cross the wire), saved in PEFT's layout.
    pub lora: LoraConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank of the adapters; 0 = no LoRA (full fine-tuning).
    pub r: usize,
    /// Scale numerator: the update is (alpha / r) B A.
    pub alpha: f64,
    /// Dropout on the adapters' input in training.
    pub dropout: f64,
    /// Layers that get adapters, by module name (e.g. ["q_proj", "v_proj"]); empty = PEFT's
    /// default for the model type (q_proj and v_proj for the Llama family, c_attn for GPT-2).
    pub target_modules: Vec<String>,
    /// Which biases train: "none" (PEFT's default; the only choice supported).
    pub bias: String,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 0,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: Vec::new(),
            bias: "none".into(),
        }
    }
}

impl LoraConfig {
    /// The adapters to build on a model of `arch`, if LoRA is on.
    pub fn spec(&self, arch: crate::models::Arch) -> Option<crate::models::lora::LoraSpec> {
        use crate::models::lora::LoraSpec;
        (self.r > 0).then(|| LoraSpec {
            r: self.r as i64,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: if self.target_modules.is_empty() {
                LoraSpec::default_targets(arch)
            } else {
                self.target_modules.clone()
            },
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QaConfig {
    /// Tokens shared by consecutive windows of a context longer than model.max_seq_len.
    pub doc_stride: usize,
    /// SQuAD v2.0: questions may have no answer, and the model may answer "" (the null answer).
    pub version_2_with_negative: bool,
    /// Highest start and end logits paired per window when extracting answers.
    pub n_best_size: usize,
    /// Longest answer, in tokens.
    pub max_answer_length: usize,
    /// v2.0: answer "" when the null score beats the best span's by more than this.
    pub null_score_diff_threshold: f64,
    /// An answer_start that does not point at its answer text is an error (else warned and counted).
    pub strict_answers: bool,
}

impl Default for QaConfig {
    fn default() -> Self {
        QaConfig {
            doc_stride: 128,
            version_2_with_negative: false,
            n_best_size: 20,
            max_answer_length: 30,
            null_score_diff_threshold: 0.0,
            strict_answers: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    Fp32,
    Bf16,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistConfig {
    /// Gradient bucket size in MB: gradients are summed across processes a bucket at a time,
    /// last layers first.
    pub bucket_mb: f64,
    /// Gradient reduction on the wire: "fp32", or "bf16" (half the traffic, summed in fp32).
    pub reduce_dtype: ReduceDtype,
    /// A collective that takes longer than this many seconds stops the whole job with an error.
    pub collective_timeout_s: f64,
    /// Pin each process's compute threads to its share of the node's physical cores, where
    /// sprtrain splits the node (ranks the launcher started bound keep its binding).
    pub pin_threads: bool,
    /// How fp32 gradient sums travel: "mpi" (the MPI library's allreduce), or "tcp" (a ring of
    /// TCP connections of sprtrain's own with blocking sockets, as Gloo: it waits without
    /// MPI's busy polling, which takes CPU from training where a node has no core to spare;
    /// SPRTRAIN_SOCKET_IFNAME picks its interface). bf16 sums and the rest stay on MPI.
    pub transport: Transport,
    /// ZeRO stage, as DeepSpeed numbers them: 0 = every process keeps the whole optimizer
    /// state and gradient; 1 = each keeps AdamW's moments for its 1/N of the parameters
    /// (gradients reduce-scattered, updated parameters all-gathered); 2 = also only its 1/N
    /// of the summed gradient (every micro-batch reduced as its backward completes); 3 = also
    /// only its 1/N of the parameters (each layer's weights gathered just before it runs, in
    /// forward and backward, and dropped after). Needs transport "mpi". Checkpoints are the
    /// same at every stage.
    pub zero_stage: u8,
}

impl DistConfig {
    fn validate(&self) -> Result<()> {
        if self.bucket_mb.is_nan() || self.bucket_mb <= 0.0 {
            bail!("dist.bucket_mb: must be positive");
        }
        match self.zero_stage {
            0 => {}
            1..=3 if self.transport == Transport::Tcp => bail!(
                "dist.zero_stage = {}: ZeRO's reduce-scatter and all-gather run over MPI; set dist.transport = \"mpi\"",
                self.zero_stage
            ),
            1..=3 => {}
            n => bail!("dist.zero_stage = {n}: must be 0, 1, 2 or 3 (DeepSpeed's ZeRO stages)"),
        }
        Ok(())
    }
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            bucket_mb: 25.0,
            reduce_dtype: ReduceDtype::Fp32,
            collective_timeout_s: 300.0,
            pin_threads: true,
            transport: Transport::Mpi,
            zero_stage: 0,
        }
    }
}

pub use crate::data::classification::DataFormat;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Training file: CSV, TSV, JSON Lines or Parquet (questions: SQuAD JSON, flat JSON, JSON
    /// Lines or Parquet); or `hf://datasets/OWNER/NAME[@REVISION]/PATH`; or
    /// `hf://datasets/OWNER/NAME[@REVISION]`, the file of `dataset_config`'s
    /// `train_split_name` split, found in the repository as the `datasets` library finds it.
    pub train_file: String,
    /// Evaluation file (same forms); empty to hold out `eval_split` of the training file instead.
    pub eval_file: String,
    /// Fraction of the training file held out for evaluation when `eval_file` is empty
    /// (a seeded shuffle, of whole articles for questions; 0 = no evaluation data).
    pub eval_split: f64,
    /// Hub data sets named without a file: the config (e.g. "mrpc" of "nyu-mll/glue"); empty
    /// for the default one.
    pub dataset_config: String,
    /// Hub data sets named without a file: the split `train_file` reads ...
    pub train_split_name: String,
    /// ... and the split `eval_file` reads.
    pub eval_split_name: String,
    /// A local file used instead when train_file or eval_file is on the Hub and the Hub cannot
    /// be reached: training data, with eval_split (or else 0.2) of it held out; empty = fail.
    pub offline_fallback_file: String,
    /// "auto" (from the extension), "csv", "tsv", "jsonl", "parquet", or "conll" (token
    /// classification: its "auto" reads .jsonl/.json as JSON Lines and anything else as CoNLL).
    pub format: DataFormat,
    /// Whether CSV/TSV files start with a header row; without one, columns are 0-based indices.
    pub has_header: bool,
    /// Column (or JSON field) holding the text.
    pub text_column: String,
    /// Column holding the second text of a pair; empty for single texts.
    pub text_pair_column: String,
    /// Column holding the label: a class id, a class name, or a number for regression.
    pub label_column: String,
    /// Class names in id order; empty to use integer labels as ids, or else the sorted names.
    pub label_names: Vec<String>,
    /// Skip rows with a missing column or a bad label (counted in one warning) instead of failing.
    pub skip_bad_rows: bool,
    /// Pad every batch to `model.max_seq_len` (run_glue.py's default) instead of to its longest example.
    pub pad_to_max_length: bool,
    /// Batch examples of similar length together (fewer pad tokens; order still seeded).
    pub group_by_length: bool,
    /// Language modelling on texts: concatenate them and cut blocks of model.max_seq_len
    /// tokens (run_clm.py's and run_mlm.py's group_texts; the held-out part is the end of the
    /// stream); false = one text per sequence, truncated (masked LM: run_mlm.py's
    /// line_by_line, blank lines skipped).
    pub packing: bool,
    /// Packing: tokens between the starts of consecutive training blocks; 0 = the block length
    /// (disjoint blocks, as run_clm.py). Smaller strides train on overlapping windows at more
    /// offsets, as nanoGPT's random windows do; evaluation blocks stay disjoint.
    pub block_stride: usize,
    /// Instruction tuning: JSON field of the prompt (not scored) ...
    pub prompt_column: String,
    /// ... and of the completion the loss is computed on.
    pub completion_column: String,
    /// Chat tuning: JSON field with a list of {role, content} messages, rendered with the
    /// tokenizer's chat template; the loss is on the last (assistant) message.
    pub messages_column: String,
    /// Token classification, JSON Lines: field with the list of words ...
    pub tokens_column: String,
    /// ... and field with their tags (names, or ids into `label_names`).
    pub tags_column: String,
    /// Token classification: label every sub-token of a word (B- tags become I- after the
    /// first) instead of the first only (run_ner.py's `label_all_tokens`).
    pub label_all_tokens: bool,
    /// Masked LM: the share of tokens chosen for prediction (run_mlm.py's mlm_probability).
    pub mlm_probability: f64,
    /// Masked LM: choose whole words (a token and the WordPiece "##" tokens continuing it)
    /// instead of single tokens.
    pub whole_word_mask: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train_file: String::new(),
            eval_file: String::new(),
            eval_split: 0.0,
            dataset_config: String::new(),
            train_split_name: "train".into(),
            eval_split_name: "validation".into(),
            offline_fallback_file: String::new(),
            format: DataFormat::Auto,
            has_header: true,
            text_column: "sentence".into(),
            text_pair_column: String::new(),
            label_column: "label".into(),
            label_names: Vec::new(),
            skip_bad_rows: false,
            pad_to_max_length: false,
            group_by_length: false,
            packing: true,
            block_stride: 0,
            prompt_column: "prompt".into(),
            completion_column: "completion".into(),
            messages_column: "messages".into(),
            tokens_column: "tokens".into(),
            tags_column: "ner_tags".into(),
            label_all_tokens: false,
            mlm_probability: 0.15,
            whole_word_mask: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Directory for checkpoints, metrics, the plot and the final model.
    pub output_dir: String,
    /// Allow writing into an output directory that already holds checkpoints (they are removed).
    pub overwrite_output_dir: bool,
    /// Passes over the training data (ignored when `max_steps` > 0).
    pub epochs: usize,
    /// Total optimizer steps; 0 = derived from `epochs`.
    pub max_steps: usize,
    /// Examples per forward pass on each process.
    pub batch_size: usize,
    /// Forward/backward passes per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// AdamW decoupled weight decay (never on biases or LayerNorm weights).
    pub weight_decay: f64,
    /// AdamW beta1.
    pub adam_beta1: f64,
    /// AdamW beta2.
    pub adam_beta2: f64,
    /// AdamW epsilon.
    pub adam_epsilon: f64,
    /// Clip gradients to this global L2 norm; 0 = no clipping.
    pub max_grad_norm: f64,
    /// Activation checkpointing (transformers' name): every layer keeps only its input in
    /// forward and runs again in backward, its dropout masks redrawn from the same seeds: the
    /// same losses and gradients for one layer's activations at a time instead of all of them,
    /// at the cost of a second forward pass of the layers.
    pub gradient_checkpointing: bool,
    /// Learning-rate schedule after warmup: "linear", "cosine" or "constant".
    pub lr_scheduler: crate::optim::ScheduleKind,
    /// Warmup steps (wins over `warmup_ratio` when > 0).
    pub warmup_steps: usize,
    /// Warmup as a fraction of the total steps.
    pub warmup_ratio: f64,
    /// "cosine" only: decay to this fraction of learning_rate instead of 0 (transformers'
    /// cosine_with_min_lr min_lr_rate; nanoGPT's min_lr / learning_rate).
    pub min_lr_rate: f64,
    /// Drop the last incomplete batch of each epoch.
    pub drop_last: bool,
    /// Log metrics every this many optimizer steps.
    pub logging_steps: usize,
    /// Save a checkpoint every this many optimizer steps; 0 = only at the end.
    pub save_steps: usize,
    /// Keep at most this many checkpoints (oldest removed first, never the best with
    /// `load_best_model_at_end`); 0 = keep all.
    pub save_total_limit: usize,
    /// Saved weights above this size are split into `model-0000K-of-0000N.safetensors` shards
    /// with a `model.safetensors.index.json` (transformers' `max_shard_size`): bytes, or a
    /// number with KB/MB/GB (powers of 1000) or KiB/MiB/GiB (powers of 1024).
    pub save_max_shard_size: String,
    /// Save a checkpoint at every evaluation and make the final model the one that scored
    /// best on `eval.metric_for_best_model` (its evaluation is the final eval_results.json).
    pub load_best_model_at_end: bool,
    /// Where metrics go besides metrics.jsonl: ["tensorboard"] writes TensorBoard event files
    /// into `output_dir`/runs; [] = nowhere else.
    pub report_to: Vec<String>,
    /// Resume even when batch size x accumulation x processes differs from the checkpoint's
    /// (the run then no longer follows the saved run's batches exactly).
    pub allow_global_batch_change: bool,
    /// What a failed checkpoint save (a full disk, a lost mount) does: "stop" ends the run with
    /// the error, "continue" warns and trains on (earlier checkpoints stay intact either way;
    /// the final model's save always counts).
    pub on_save_error: OnSaveError,
    /// On SIGTERM or SIGINT (what schedulers and Ctrl-C send), save a checkpoint at the next
    /// step boundary, then exit non-zero (128 + the signal); a second signal ends the process
    /// at once. false: the signal ends the process as it would any program.
    pub save_on_signal: bool,
}

/// `train.on_save_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnSaveError {
    Stop,
    Continue,
}

impl TrainConfig {
    /// `save_max_shard_size` in bytes.
    pub fn max_shard_bytes(&self) -> Result<u64> {
        parse_size(&self.save_max_shard_size)
            .with_context(|| format!("train.save_max_shard_size: {:?}", self.save_max_shard_size))
    }
}

/// A size as transformers' `convert_file_size_to_int` reads it: bytes, or a number with KB, MB,
/// GB (powers of 1000) or KiB, MiB, GiB (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let number: f64 = number
        .parse()
        .map_err(|_| anyhow!("not a size (e.g. 5GB, 500MB, 2GiB, or bytes)"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => bail!("unknown unit {other:?} (KB, MB, GB, KiB, MiB or GiB)"),
    };
    let bytes = (number * scale as f64).round();
    if bytes < 1.0 {
        bail!("must be at least 1 byte");
    }
    Ok(bytes as u64)
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            output_dir: "runs/sprtrain".into(),
            overwrite_output_dir: false,
            epochs: 3,
            max_steps: 0,
            batch_size: 32,
            gradient_accumulation_steps: 1,
            learning_rate: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            gradient_checkpointing: false,
            lr_scheduler: crate::optim::ScheduleKind::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            min_lr_rate: 0.0,
            drop_last: false,
            logging_steps: 10,
            save_steps: 500,
            save_total_limit: 0,
            save_max_shard_size: "5GB".into(),
            load_best_model_at_end: false,
            report_to: Vec::new(),
            allow_global_batch_change: false,
            on_save_error: OnSaveError::Stop,
            save_on_signal: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalStrategy {
    No,
    Steps,
    Epoch,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// When to evaluate during training: "no", "steps" (every `steps`) or "epoch"; the final
    /// model is always evaluated when there is evaluation data.
    pub strategy: EvalStrategy,
    /// Evaluation interval in optimizer steps, for strategy "steps".
    pub steps: usize,
    /// Examples per evaluation forward pass.
    pub batch_size: usize,
    /// The metric that picks the best model (`train.load_best_model_at_end`) and drives early
    /// stopping, with or without its `eval_` prefix (e.g. "f1", "accuracy", "loss").
    pub metric_for_best_model: String,
    /// Whether a larger metric is better; unset: true, unless the metric is a loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub greater_is_better: Option<bool>,
    /// Stop training after this many evaluations in a row without improving the metric by
    /// more than `early_stopping_threshold` (transformers' EarlyStoppingCallback); 0 = never.
    pub early_stopping_patience: usize,
    /// The improvement an evaluation must exceed to count for early stopping.
    pub early_stopping_threshold: f64,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            strategy: EvalStrategy::Epoch,
            steps: 500,
            batch_size: 64,
            metric_for_best_model: "loss".into(),
            greater_is_better: None,
            early_stopping_patience: 0,
            early_stopping_threshold: 0.0,
        }
    }
}

impl EvalConfig {
    /// The metric's key in evaluation results (`eval_` prefixed).
    pub fn best_metric_key(&self) -> String {
        let m = &self.metric_for_best_model;
        if m.starts_with("eval_") {
            m.clone()
        } else {
            format!("eval_{m}")
        }
    }

    /// Whether `candidate` is better than `best` by more than `threshold`.
    pub fn improves(&self, candidate: f64, best: f64, threshold: f64) -> bool {
        let greater = self
            .greater_is_better
            .unwrap_or(!self.metric_for_best_model.ends_with("loss"));
        let better = if greater {
            candidate > best
        } else {
            candidate < best
        };
        better && (candidate - best).abs() > threshold
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Local directory (config.json, model.safetensors or a sharded index, tokenizer.json) or a
    /// Hugging Face Hub id resolved into the standard HF cache.
    pub name_or_path: String,
    /// Hub revision (branch, tag or commit hash); ignored for local directories.
    pub revision: String,
    /// Head to train: "seq-cls", "token-cls", "qa", "mlm" (encoders) or "causal-lm" (decoders:
    /// gpt2, llama, mistral, qwen2, qwen3).
    pub task: TaskName,
    /// Labels of a new classification head; 0 keeps config.json's count.
    pub num_labels: usize,
    /// Sequence classification loss: "auto" (as transformers infers it), "single_label_classification",
    /// "multi_label_classification" or "regression".
    pub problem_type: ProblemTypeSetting,
    /// Tokens per example including special tokens; longer inputs are truncated.
    pub max_seq_len: usize,
    /// Build the model from config.json alone, randomly initialised as transformers does (for
    /// shapes without weights: benchmarks, or pretraining-style runs).
    pub random_init: bool,
    /// tokenizer.json to use instead of the model directory's.
    pub tokenizer_file: String,
    /// A local directory with a config.json of the same architecture: when name_or_path is a
    /// Hub id and the Hub cannot be reached, the model is built from it with random weights
    /// (with a warning) instead of failing; empty = fail.
    pub offline_fallback: String,
    /// dtype of the frozen base weights under LoRA (PEFT users load with `torch_dtype`):
    /// "fp32", or "bf16" (half their memory; the adapters and their optimizer state stay
    /// fp32). bf16 weights compute in bf16: `runtime.precision` must resolve to "bf16".
    pub dtype: WeightDtype,
}

/// The dtype frozen weights are kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    Fp32,
    Bf16,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name_or_path: "distilbert-base-uncased".into(),
            revision: "main".into(),
            task: TaskName::SeqCls,
            num_labels: 0,
            problem_type: ProblemTypeSetting::Auto,
            max_seq_len: 128,
            random_init: false,
            tokenizer_file: String::new(),
            offline_fallback: String::new(),
            dtype: WeightDtype::Fp32,
        }
    }
}

/// What a run trains; each name is one module of `crate::tasks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum TaskName {
    /// Sequence classification or regression (`*ForSequenceClassification`).
    #[serde(rename = "seq-cls")]
    #[value(name = "seq-cls")]
    SeqCls,
    /// Token classification, e.g. named entities (`*ForTokenClassification`).
    #[serde(rename = "token-cls")]
    #[value(name = "token-cls")]
    TokenCls,
    /// Extractive question answering (`*ForQuestionAnswering`).
    #[serde(rename = "qa")]
    #[value(name = "qa")]
    Qa,
    /// Masked language modelling (`*ForMaskedLM`).
    #[serde(rename = "mlm")]
    #[value(name = "mlm")]
    Mlm,
    /// Causal language modelling and instruction tuning (`*ForCausalLM`).
    #[serde(rename = "causal-lm")]
    #[value(name = "causal-lm")]
    CausalLm,
}

impl TaskName {
    /// The transformers head this task trains and predicts with: the one place a task maps
    /// to a head.
    pub fn head(self) -> Head {
        match self {
            TaskName::SeqCls => Head::SequenceClassification,
            TaskName::TokenCls => Head::TokenClassification,
            TaskName::Qa => Head::QuestionAnswering,
            TaskName::Mlm => Head::MaskedLm,
            TaskName::CausalLm => Head::CausalLm,
        }
    }
}

/// `model.problem_type`: which loss a sequence-classification head trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemTypeSetting {
    /// As transformers infers it: regression for one label, else single-label classification.
    Auto,
    SingleLabelClassification,
    MultiLabelClassification,
    Regression,
}

impl ProblemTypeSetting {
    /// The problem type of a head with `num_labels` labels (0: not fixed by the config).
    pub fn resolve(self, num_labels: usize) -> ProblemType {
        match self {
            ProblemTypeSetting::Auto if num_labels == 1 => ProblemType::Regression,
            ProblemTypeSetting::Auto => ProblemType::SingleLabel,
            ProblemTypeSetting::SingleLabelClassification => ProblemType::SingleLabel,
            ProblemTypeSetting::MultiLabelClassification => ProblemType::MultiLabel,
            ProblemTypeSetting::Regression => ProblemType::Regression,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// "fp32", "bf16" (bf16 compute, fp32 master weights) or "auto" (bf16 only where the CPU
    /// has AMX-BF16 or AVX512-BF16).
    pub precision: Precision,
    /// libtorch intra-op threads per process; 0 = the physical cores of the rank's domain (the
    /// launcher's binding, else its share of the node), less one for the communication thread
    /// with several processes, capped by a cgroup CPU quota (OMP_NUM_THREADS, when set, also
    /// decides).
    pub threads: usize,
    /// Seed for head initialisation, dropout and data order.
    pub seed: u64,
    /// The C allocator under libtorch: "auto" (tcmalloc where installed, else the system's),
    /// "tcmalloc", "jemalloc" or "system". sprtrain re-executes itself once with it preloaded.
    pub allocator: Allocator,
    /// A word-embedding table that only the input lookup reads (classification, QA, token
    /// classification, decoders with their own LM head): backward adds just the looked-up rows
    /// into its gradient, and AdamW moves just the rows a step looked up, each row catching up
    /// on the steps it missed when it is next used (the same values as updating every row
    /// every step). false: every row every step, as torch does.
    pub sparse_embedding_updates: bool,
    /// Record libtorch's operator profile (what torch.profiler records) over this many steps,
    /// 0 = off: rank 0 writes `<output_dir>/profile/trace.json` (Chrome trace) and `ops.md`
    /// (each operator's calls and self time a step).
    pub profile_steps: u64,
    /// The first step profiled (1-based); the steps before it warm caches and allocators.
    pub profile_start_step: u64,
    /// The library of fp32 matrix products (linear layers, per-pair attention): "blas"
    /// (libtorch's at::mm: MKL), "onednn" (libtorch's oneDNN: matmul for the layers, the brgemm
    /// microkernel for attention; needs AVX-512 BW/VL/DQ), "blas+brgemm" (the BLAS for the
    /// layers, oneDNN's microkernel for attention) or "auto" (oneDNN on AMD CPUs with AVX-512,
    /// where MKL runs its generic AVX2 code; "blas+brgemm" on other CPUs with AVX-512; else the
    /// BLAS).
    pub fp32_gemm: Fp32Gemm,
    /// Before training, estimate each rank's peak memory (weights, gradients, optimizer state,
    /// activations for the batch and sequence length) and stop with the settings that would
    /// fit where it exceeds the memory each rank of the node has (docs/memory.md).
    pub memory_preflight: bool,
    /// The memory the preflight takes this node to have for all its ranks, in GB; 0 = what
    /// the kernel reports available (MemAvailable, or a smaller cgroup limit).
    pub memory_limit_gb: f64,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            precision: Precision::Auto,
            threads: 0,
            seed: 42,
            allocator: Allocator::Auto,
            sparse_embedding_updates: true,
            profile_steps: 0,
            profile_start_step: 10,
            fp32_gemm: Fp32Gemm::Auto,
            memory_preflight: true,
            memory_limit_gb: 0.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp32Gemm {
    Auto,
    Blas,
    Onednn,
    /// The BLAS for the linear layers, oneDNN's brgemm microkernel for per-pair attention.
    #[serde(rename = "blas+brgemm")]
    BlasBrgemm,
}

impl Fp32Gemm {
    /// `auto` becomes oneDNN where the CPU prefers it ([`CpuInfo::prefers_onednn_fp32`]), else
    /// the BLAS, with attention through oneDNN's microkernel where the CPU has AVX-512 (on an
    /// Intel Xeon with AMX, MKL ran the layers faster than oneDNN's matmul and the microkernel
    /// ran attention faster than MKL: docs/benchmarks.md, round 13).
    pub fn resolve(self, cpu: &CpuInfo) -> Fp32Gemm {
        match self {
            Fp32Gemm::Auto if cpu.prefers_onednn_fp32() => Fp32Gemm::Onednn,
            Fp32Gemm::Auto if cpu.avx512_bw_vl_dq => Fp32Gemm::BlasBrgemm,
            Fp32Gemm::Auto => Fp32Gemm::Blas,
            g => g,
        }
    }

    /// Picks the library of this process's fp32 products (`runtime.fp32_gemm`, resolved for this
    /// CPU) before any product runs, and returns the one in use. Where oneDNN refuses the CPU, an
    /// explicit "onednn" is an error and "auto" falls back to the BLAS with a warning.
    pub fn select(self) -> Result<Fp32Gemm> {
        let resolved = self.resolve(&CpuInfo::detect());
        match crate::models::layers::use_onednn_fp32(
            resolved.layers_onednn(),
            resolved.attention_brgemm(),
        ) {
            Ok(()) => Ok(resolved),
            Err(e) if self == Fp32Gemm::Auto => {
                tracing::warn!("fp32 products through the BLAS: oneDNN refused this CPU ({e})");
                Ok(Fp32Gemm::Blas)
            }
            Err(e) => bail!("runtime.fp32_gemm = \"onednn\": {e}"),
        }
    }

    /// Whether the linear layers' products go through oneDNN's matmul.
    pub fn layers_onednn(self) -> bool {
        self == Fp32Gemm::Onednn
    }

    /// Whether the per-pair attention's products go through oneDNN's brgemm microkernel.
    pub fn attention_brgemm(self) -> bool {
        matches!(self, Fp32Gemm::Onednn | Fp32Gemm::BlasBrgemm)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Allocator {
    Auto,
    Tcmalloc,
    Jemalloc,
    System,
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
            // toml's messages put their detail on a second line: one line for the user.
            anyhow!("line {line}: {}", e.message().trim().replace('\n', "; "))
        })?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                // The path runs down to the offending key, unknown keys included.
                let key = e.path().to_string();
                let message = e.inner().message().trim().replace('\n', "; ");
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
        let t = &self.train;
        if t.batch_size == 0 {
            bail!("train.batch_size: must be at least 1");
        }
        if t.gradient_accumulation_steps == 0 {
            bail!("train.gradient_accumulation_steps: must be at least 1");
        }
        t.max_shard_bytes()?;
        self.dist.validate()?;
        for target in &self.train.report_to {
            if !matches!(target.as_str(), "tensorboard" | "none") {
                bail!("train.report_to: {target:?} is not supported (\"tensorboard\" is)");
            }
        }
        let e = &self.eval;
        if (self.train.load_best_model_at_end || e.early_stopping_patience > 0)
            && e.strategy == EvalStrategy::No
        {
            bail!("train.load_best_model_at_end and eval.early_stopping_patience need evaluations during training: set eval.strategy to \"steps\" or \"epoch\"");
        }
        if e.early_stopping_threshold < 0.0 {
            bail!("eval.early_stopping_threshold: must not be negative");
        }
        if self.eval.batch_size == 0 {
            bail!("eval.batch_size: must be at least 1");
        }
        if self.model.dtype == WeightDtype::Bf16 && self.lora.r == 0 {
            bail!("model.dtype = \"bf16\" keeps LoRA's frozen base in bf16: set lora.r (full fine-tuning keeps fp32 weights, as its optimizer updates them)");
        }
        let l = &self.lora;
        if l.bias != "none" {
            bail!("lora.bias: {:?} is not supported (only \"none\")", l.bias);
        }
        if !(0.0..1.0).contains(&l.dropout) {
            bail!("lora.dropout: {} is not in [0, 1)", l.dropout);
        }
        if l.r > 0 && self.model.task != TaskName::CausalLm {
            bail!("lora.r: LoRA trains causal language models (model.task = \"causal-lm\") only");
        }
        if t.epochs == 0 && t.max_steps == 0 {
            bail!("train.epochs: must be at least 1 when train.max_steps is 0");
        }
        if !(0.0..1.0).contains(&self.data.eval_split) {
            bail!("data.eval_split: {} is not in [0, 1)", self.data.eval_split);
        }
        if !(0.0..=1.0).contains(&t.min_lr_rate) {
            bail!("train.min_lr_rate: {} is not in [0, 1]", t.min_lr_rate);
        }
        if !(0.0..=1.0).contains(&t.warmup_ratio) {
            bail!("train.warmup_ratio: {} is not in [0, 1]", t.warmup_ratio);
        }
        if t.learning_rate.is_nan() || t.learning_rate <= 0.0 {
            bail!("train.learning_rate: must be positive");
        }
        let q = &self.qa;
        if q.n_best_size == 0 || q.max_answer_length == 0 {
            bail!("qa.n_best_size and qa.max_answer_length must be at least 1");
        }
        Ok(())
    }

    /// Every field as a `section.key = value` line, for comparing configs between processes.
    pub fn dotted_lines(&self) -> Result<Vec<String>> {
        let value = toml::Value::try_from(self).context("cannot serialise config")?;
        let mut lines = Vec::new();
        for (section, fields) in value.as_table().into_iter().flatten() {
            for (key, v) in fields.as_table().into_iter().flatten() {
                lines.push(format!("{section}.{key} = {v}"));
            }
        }
        Ok(lines)
    }

    /// The length every batch is padded to (`data.pad_to_max_length`), if any; else each
    /// batch is padded to its longest example.
    pub fn pad_to(&self) -> Option<usize> {
        self.data
            .pad_to_max_length
            .then_some(self.model.max_seq_len)
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
    fn shard_sizes_read_as_transformers_reads_them() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        for bad in ["", "GB", "5XB", "0", "-1MB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

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
    fn problem_type_is_typed_and_resolved_as_transformers_infers_it() {
        let c = Config::from_toml_str("[model]\nproblem_type = \"regression\"\n", &[]).unwrap();
        assert_eq!(c.model.problem_type, ProblemTypeSetting::Regression);
        let err =
            Config::from_toml_str("[model]\nproblem_type = \"regresion\"\n", &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("model.problem_type: unknown variant"),
            "{err}"
        );
        let auto = ProblemTypeSetting::Auto;
        assert_eq!(auto.resolve(1), ProblemType::Regression);
        assert_eq!(auto.resolve(0), ProblemType::SingleLabel);
        assert_eq!(auto.resolve(3), ProblemType::SingleLabel);
        assert_eq!(
            ProblemTypeSetting::MultiLabelClassification.resolve(1),
            ProblemType::MultiLabel
        );
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

    #[test]
    fn auto_fp32_gemm_is_onednn_on_amd_and_brgemm_attention_on_intel_with_avx512() {
        let cpu = |vendor: &str, avx512: bool| CpuInfo {
            vendor: vendor.into(),
            avx512_bw_vl_dq: avx512,
            ..Default::default()
        };
        let auto = |c: CpuInfo| Fp32Gemm::Auto.resolve(&c);
        assert_eq!(auto(cpu("AuthenticAMD", true)), Fp32Gemm::Onednn);
        assert_eq!(auto(cpu("AuthenticAMD", false)), Fp32Gemm::Blas);
        assert_eq!(auto(cpu("GenuineIntel", true)), Fp32Gemm::BlasBrgemm);
        assert_eq!(auto(cpu("GenuineIntel", false)), Fp32Gemm::Blas);
        assert_eq!(
            Fp32Gemm::Blas.resolve(&cpu("AuthenticAMD", true)),
            Fp32Gemm::Blas
        );
        assert_eq!(
            Fp32Gemm::Onednn.resolve(&cpu("GenuineIntel", false)),
            Fp32Gemm::Onednn
        );
        let parsed = CpuInfo::parse(
            "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512dq avx512bw avx512vl\n",
        );
        assert!(parsed.prefers_onednn_fp32());
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

    /// Every config shipped in configs/ parses and validates.
    #[test]
    fn shipped_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path, &[]).unwrap_or_else(|e| panic!("{e:#}"));
                n += 1;
            }
        }
        assert!(n >= 4, "found {n} configs");
    }
}
