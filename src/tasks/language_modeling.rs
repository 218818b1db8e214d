//! Language modelling. Causal, as transformers' run_clm.py (texts tokenized, concatenated and
//! cut into blocks of `model.max_seq_len`, or one text per sequence), and instruction tuning
//! as TRL's SFTTrainer with `completion_only_loss` (prompt/completion pairs, or chat messages
//! rendered with the tokenizer's chat template; only the completion is scored). Masked, as
//! run_mlm.py (the same blocks, or one line per sequence with `data.packing = false`; tokens
//! masked as they are batched, see `data::masking`). Evaluation reports the loss per scored
//! token and its perplexity.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;
use tch::{Kind, Reduction};

use super::{DataFiles, EvalSet, Shards, TaskData, TokenizeOptions, Tokenized};
use crate::config::{Config, DataConfig, TaskName};
use crate::data::batching::{batch_labels, split_off_held_out, Feature, Target};
use crate::data::chat::{validate_messages, ChatTemplate};
use crate::data::masking::{Masking, EVAL_KEY};
use crate::data::tokenizer::{load_tokenizer, load_untruncated, Truncation};
use crate::models::{HfConfig, Labels, ModelOutput};

/// One training example.
#[derive(Debug, Clone, PartialEq)]
pub enum LmExample {
    /// Plain text, every token scored.
    Text(String),
    /// A prompt (not scored) and its completion (scored, ended by end-of-sequence).
    Prompted { prompt: String, completion: String },
    /// A conversation whose last message, the assistant's, is scored.
    Chat(Vec<Json>),
}

/// Where each kind of example sits in a JSON Lines record.
struct Fields<'a> {
    text: &'a str,
    prompt: &'a str,
    completion: &'a str,
    messages: &'a str,
}

impl<'a> Fields<'a> {
    fn of(data: &'a DataConfig) -> Self {
        Fields {
            text: &data.text_column,
            prompt: &data.prompt_column,
            completion: &data.completion_column,
            messages: &data.messages_column,
        }
    }
}

/// Reads a plain text file (one example per line, line breaks kept, as the `datasets` text
/// loader with run_clm.py's keep_linebreaks) or JSON Lines (`.jsonl`/`.json`: messages,
/// prompt/completion or text fields).
pub fn read_examples(path: &Path, data: &DataConfig) -> Result<Vec<LmExample>> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let mut out = Vec::new();
    if !matches!(ext.as_str(), "jsonl" | "json") {
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader
                .read_line(&mut line)
                .with_context(|| format!("cannot read {} (is it UTF-8 text?)", path.display()))?;
            if n == 0 {
                break;
            }
            out.push(LmExample::Text(line.clone()));
        }
        return Ok(out);
    }
    let fields = Fields::of(data);
    for (i, line) in reader.lines().enumerate() {
        let at = || format!("{}:{}", path.display(), i + 1);
        let line = line.with_context(|| format!("cannot read {}", at()))?;
        if line.trim().is_empty() {
            continue;
        }
        let record: Json =
            serde_json::from_str(&line).with_context(|| format!("{}: not a JSON object", at()))?;
        let text = |key: &str| -> Option<String> {
            record.get(key).and_then(|v| v.as_str()).map(str::to_string)
        };
        let example = if let Some(messages) = record.get(fields.messages) {
            validate_messages(messages).with_context(at)?;
            LmExample::Chat(messages.as_array().cloned().unwrap_or_default())
        } else if let (Some(prompt), Some(completion)) =
            (text(fields.prompt), text(fields.completion))
        {
            LmExample::Prompted { prompt, completion }
        } else if let Some(t) = text(fields.text) {
            LmExample::Text(t)
        } else {
            bail!(
                "{}: no \"{}\" list, \"{}\"/\"{}\" strings or \"{}\" string (data.messages_column, data.prompt_column/completion_column, data.text_column)",
                at(),
                fields.messages,
                fields.prompt,
                fields.completion,
                fields.text
            );
        };
        out.push(example);
    }
    Ok(out)
}

/// Masked LM's settings (`data.mlm_probability`, `data.whole_word_mask`, the run's seed).
#[derive(Debug, Clone, Copy)]
struct MaskedLm {
    probability: f64,
    whole_word: bool,
    seed: u64,
}

/// Language-modelling examples.
pub struct LmData {
    /// Masked LM; None for causal.
    masked: Option<MaskedLm>,
    train: Vec<LmExample>,
    eval: Vec<LmExample>,
    /// Held-out fraction of the packed training stream (no eval file, packing on).
    stream_holdout: f64,
    packing: bool,
    /// Tokens between the starts of consecutive training blocks (0: the block length).
    stride: usize,
}

impl LmData {
    pub fn read(config: &Config, files: &DataFiles, report: bool) -> Result<Self> {
        let masked = (config.model.task == TaskName::Mlm).then_some(MaskedLm {
            probability: config.data.mlm_probability,
            whole_word: config.data.whole_word_mask,
            seed: config.runtime.seed,
        });
        let read = |path: &Path| -> Result<Vec<LmExample>> {
            let mut examples = read_examples(path, &config.data)?;
            if masked.is_some() {
                if examples.iter().any(|e| !matches!(e, LmExample::Text(_))) {
                    bail!(
                        "{}: masked-LM training reads plain text (lines, or a text field), not prompts or messages",
                        path.display()
                    );
                }
                if !config.data.packing {
                    // run_mlm.py's line_by_line skips empty and whitespace-only lines.
                    examples.retain(|e| !matches!(e, LmExample::Text(t) if t.trim().is_empty()));
                }
            }
            Ok(examples)
        };
        let mut train = read(&files.train)?;
        if train.is_empty() {
            bail!("{} holds no examples", files.train.display());
        }
        let plain = train.iter().all(|e| matches!(e, LmExample::Text(_)));
        let packing = config.data.packing && plain;
        if config.data.packing && !plain && report {
            tracing::info!(
                "instruction data: one example per sequence (data.packing applies to plain text)"
            );
        }
        let mut stream_holdout = 0.0;
        let eval = if let Some(path) = &files.eval {
            read(path)?
        } else if files.eval_split > 0.0 && packing {
            // The end of the text, as nanoGPT's and most LM splits: no block of it is seen in
            // training, and no held-out block overlaps a training one.
            stream_holdout = files.eval_split;
            Vec::new()
        } else if files.eval_split > 0.0 {
            split_off_held_out(&mut train, files.eval_split, config.runtime.seed)
        } else {
            Vec::new()
        };
        let stride = match config.data.block_stride {
            0 => config.model.max_seq_len,
            s => s,
        };
        Ok(LmData {
            masked,
            train,
            eval,
            stream_holdout,
            packing,
            stride,
        })
    }

    /// The tokenizer as this data wants it: masked LM's sequences keep their closing special
    /// token when truncated, as run_mlm.py's truncating tokenizer does; causal texts are cut
    /// after tokenization.
    fn tokenizer<'o>(&self, options: &TokenizeOptions<'o>) -> Result<LmTokenizer<'o>> {
        let dir = options
            .tokenizer_json
            .parent()
            .unwrap_or_else(|| Path::new("."));
        let tokenizer = if self.masked.is_some() && !self.packing {
            load_tokenizer(
                options.tokenizer_json,
                options.max_seq_len,
                Truncation::LongestFirst,
                0,
            )?
        } else {
            load_untruncated(options.tokenizer_json)?
        };
        Ok(LmTokenizer {
            tokenizer,
            path: options.tokenizer_json,
            chat: ChatTemplate::find(dir)?,
            eos_id: options.eos_id,
            max_len: options.max_seq_len,
            whole: self.packing,
        })
    }
}

/// Tokenizes examples into features, prompts unscored.
struct LmTokenizer<'a> {
    tokenizer: tokenizers::Tokenizer,
    /// tokenizer.json, named in encoding errors.
    path: &'a Path,
    chat: Option<ChatTemplate>,
    eos_id: Option<i64>,
    max_len: usize,
    /// Keep whole texts (packing cuts them later) instead of truncating.
    whole: bool,
}

impl LmTokenizer<'_> {
    fn encode(&self, text: &str, special: bool) -> Result<Vec<i64>> {
        let enc = self
            .tokenizer
            .encode(text, special)
            .map_err(|e| anyhow!("tokenization with {} failed: {e}", self.path.display()))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    /// A prompt and its completion as one feature; None when nothing is left to score.
    fn prompted(&self, prompt_ids: Vec<i64>, mut completion: Vec<i64>) -> Result<Feature> {
        if prompt_ids.len() >= self.max_len {
            bail!(
                "a prompt of {} tokens leaves no room for its completion within model.max_seq_len = {}",
                prompt_ids.len(),
                self.max_len
            );
        }
        let from = prompt_ids.len();
        let mut ids = prompt_ids;
        ids.append(&mut completion);
        ids.truncate(self.max_len);
        Ok(Feature {
            type_ids: vec![0; ids.len()],
            input_ids: ids,
            target: Target::NextTokens { from },
        })
    }

    fn feature(&self, example: &LmExample) -> Result<Option<Feature>> {
        Ok(match example {
            LmExample::Text(text) => {
                let mut ids = self.encode(text, true)?;
                if !self.whole {
                    ids.truncate(self.max_len);
                }
                // A single token predicts nothing.
                (ids.len() >= if self.whole { 1 } else { 2 }).then(|| Feature {
                    type_ids: vec![0; ids.len()],
                    input_ids: ids,
                    target: Target::NextTokens { from: 0 },
                })
            }
            LmExample::Prompted { prompt, completion } => {
                let mut completion = self.encode(completion, false)?;
                completion.extend(self.eos_id);
                Some(self.prompted(self.encode(prompt, true)?, completion)?)
            }
            LmExample::Chat(messages) => {
                let chat = self.chat.as_ref().context(
                    "chat examples need a chat template (chat_template.jinja, or chat_template in tokenizer_config.json beside tokenizer.json)",
                )?;
                let full = chat.render(messages, false)?;
                let prompt = chat.render(&messages[..messages.len() - 1], true)?;
                let full_ids = self.encode(&full, false)?;
                let prompt_ids = self.encode(&prompt, false)?;
                // The scored part starts where the prompt's tokens stop matching (templates
                // can render the reply's start differently from the generation prompt).
                let from = prompt_ids
                    .iter()
                    .zip(&full_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                let completion = full_ids[from..].to_vec();
                Some(self.prompted(full_ids[..from].to_vec(), completion)?)
            }
        })
    }

    /// Features of `examples`, numbered from `first` in messages.
    fn features(&self, what: &str, examples: &[LmExample], first: usize) -> Result<Vec<Feature>> {
        let mut out = Vec::new();
        for (i, e) in examples.iter().enumerate() {
            let at = || format!("{what} example {}", first + i + 1);
            if let Some(f) = self.feature(e).with_context(at)? {
                out.push(f);
            }
        }
        Ok(out)
    }
}

/// run_clm.py's group_texts: all tokens in one stream, cut into blocks of `block` tokens
/// starting every `stride` tokens (`block`: disjoint blocks, the remainder dropped).
pub fn pack(features: &[Feature], block: usize, stride: usize) -> Vec<Feature> {
    blocks(&stream(features), block, stride)
}

/// Every feature's tokens, one after another.
fn stream(features: &[Feature]) -> Vec<i64> {
    features
        .iter()
        .flat_map(|f| f.input_ids.iter().copied())
        .collect()
}

fn blocks(stream: &[i64], block: usize, stride: usize) -> Vec<Feature> {
    let starts = if stream.len() < block {
        0
    } else {
        (stream.len() - block) / stride.max(1) + 1
    };
    (0..starts)
        .map(|i| {
            let ids = &stream[i * stride..i * stride + block];
            Feature {
                input_ids: ids.to_vec(),
                type_ids: vec![0; block],
                target: Target::NextTokens { from: 0 },
            }
        })
        .collect()
}

impl TaskData for LmData {
    fn adapt(&self, config: &mut HfConfig) -> Result<()> {
        match (self.masked.is_some(), config.arch.is_decoder()) {
            (false, false) => bail!(
                "model.task \"causal-lm\" needs a decoder (gpt2, llama, mistral, qwen2, qwen3); the model is {}",
                config.arch.class_stem()
            ),
            (true, true) => bail!(
                "model.task \"mlm\" needs an encoder ({}); the model is {}",
                crate::models::hf_config::ENCODER_MODEL_TYPES,
                config.arch.class_stem()
            ),
            _ => Ok(()),
        }
    }

    fn has_eval(&self) -> bool {
        !self.eval.is_empty() || self.stream_holdout > 0.0
    }

    fn tokenize(
        self: Box<Self>,
        options: &TokenizeOptions,
        shards: &dyn Shards,
        eval_only: bool,
    ) -> Result<Tokenized> {
        let tok = self.tokenizer(options)?;
        let features = |what: &str, examples: &[LmExample]| {
            shards.tokenize_shared(what, examples.len(), &|share| {
                tok.features(what, &examples[share.clone()], share.start)
            })
        };
        let block = options.max_seq_len;
        let (train, eval) = if self.stream_holdout > 0.0 {
            let stream = stream(&features("training", &self.train)?);
            let cut = ((stream.len() as f64) * (1.0 - self.stream_holdout)).round() as usize;
            (
                blocks(&stream[..cut], block, self.stride),
                blocks(&stream[cut..], block, block),
            )
        } else {
            let train = if eval_only {
                Vec::new()
            } else {
                features("training", &self.train)?
            };
            let eval = features("evaluation", &self.eval)?;
            if self.packing {
                (pack(&train, block, self.stride), pack(&eval, block, block))
            } else {
                (train, eval)
            }
        };
        let mut train = if eval_only { Vec::new() } else { train };
        if !eval_only && train.is_empty() {
            bail!(
                "the training data makes no sequence of model.max_seq_len = {block} tokens (too little text?)"
            );
        }
        let masking = self
            .masked
            .map(|m| Masking::new(options.tokenizer_json, m.probability, m.whole_word, m.seed))
            .transpose()?;
        let eval = match &masking {
            Some(masking) => mask_once(masking, &mut train, eval),
            None => eval,
        };
        let eval: Option<Box<dyn EvalSet>> = (!eval.is_empty()).then(|| {
            Box::new(LmEval {
                features: eval,
                causal: masking.is_none(),
            }) as Box<dyn EvalSet>
        });
        Ok(Tokenized {
            train,
            eval,
            masking,
        })
    }
}

/// Masked LM: training features are masked as they are batched (from the step), evaluation
/// features once, the same every evaluation.
fn mask_once(masking: &Masking, train: &mut [Feature], eval: Vec<Feature>) -> Vec<Feature> {
    for f in train.iter_mut() {
        f.target = Target::Masked;
    }
    eval.iter()
        .enumerate()
        .map(|(i, f)| masking.mask(f, EVAL_KEY, i))
        .collect()
}

/// Held-out sequences, scored by the loss per predicted token.
struct LmEval {
    features: Vec<Feature>,
    /// Position t predicts token t + 1 (causal); else each scored position its own token.
    causal: bool,
}

impl EvalSet for LmEval {
    fn features(&self) -> Vec<&Feature> {
        self.features.iter().collect()
    }

    /// Per row: the summed negative log-likelihood of its scored tokens and their count.
    fn batch_outputs(&self, output: &ModelOutput, batch: &[&Feature]) -> Result<Vec<f32>> {
        let (b, t, v) = output.logits.size3()?;
        let Labels::Tokens(labels) = batch_labels(batch, t as usize)? else {
            bail!("language-model evaluation needs token labels");
        };
        let (logits, targets) = if self.causal {
            (
                output.logits.narrow(1, 0, t - 1),
                labels.narrow(1, 1, t - 1),
            )
        } else {
            (output.logits.shallow_clone(), labels)
        };
        let positions = targets.size()[1];
        let nll = logits
            .to_kind(Kind::Float)
            .reshape([-1, v])
            .cross_entropy_loss::<tch::Tensor>(
                &targets.reshape([-1]),
                None,
                Reduction::None,
                -100,
                0.0,
            )
            .view([b, positions]);
        let sums = Vec::<f32>::try_from(nll.sum_dim_intlist(1, false, Kind::Float))?;
        let counts = Vec::<f32>::try_from(targets.ne(-100).sum_dim_intlist(1, false, Kind::Float))?;
        Ok(sums
            .into_iter()
            .zip(counts)
            .flat_map(|(s, c)| [s, c])
            .collect())
    }

    fn metrics(
        &self,
        outputs: &[f32],
        _predictions_dir: Option<&Path>,
    ) -> Result<BTreeMap<String, f64>> {
        let (mut nll, mut tokens) = (0.0f64, 0.0f64);
        for pair in outputs.chunks_exact(2) {
            nll += pair[0] as f64;
            tokens += pair[1] as f64;
        }
        if tokens == 0.0 {
            bail!("the evaluation data has no scored tokens");
        }
        let loss = nll / tokens;
        Ok(BTreeMap::from([
            ("loss".to_string(), loss),
            ("perplexity".to_string(), loss.exp()),
            ("tokens".to_string(), tokens),
        ]))
    }
}
