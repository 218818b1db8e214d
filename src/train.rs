//! Fine-tuning: `sprtrain --config X.toml`. The loop is [`train`], read top to bottom.
//!
//! Each optimizer step consumes one global batch (see `data::batching`): each process runs
//! forward and backward on its micro-batches, gradients are gathered into the flat buffer and
//! summed across processes bucket by bucket, then clipped and applied by AdamW — identically on
//! every process. Dropout is reseeded from (seed, step, micro-batch) so a resumed run, or a run
//! on another number of processes, draws the same masks. Rank 0 alone writes files and the
//! progress bar; an error on any rank stops them all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tch::Kind;

use crate::checkpoint::{self, ModelFiles, TrainerState};
use crate::config::{Config, EvalStrategy, Precision, ReduceDtype, TaskName};
use crate::data::batching::{self, BatchPlan, Feature};
use crate::data::classification::{self, Example, LabelKind};
use crate::data::squad::{self, QaExample, QaFeature, QaReadOptions};
use crate::data::tokenizer::{TextTokenizer, Truncation};
use crate::dist::{Dist, Pending};
use crate::hub;
use crate::metrics;
use crate::models::{self, ProblemType, Task, TaskModel};
use crate::optim::{AdamW, AdamWConfig, Bucket, FlatParams, LrSchedule};
use crate::qa::{self, PostProcess};
use crate::report::{MetricsLog, Progress};
use crate::sysinfo::CpuInfo;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Whether this process is rank 0, the one that reports.
    pub root: bool,
    pub output_dir: PathBuf,
    pub steps: usize,
    pub epochs_done: f64,
    pub train_loss: f64,
    pub wall_s: f64,
    pub samples_per_s: f64,
    pub eval: BTreeMap<String, f64>,
}

/// One step's gradient sums in flight: buckets are launched in order as backward completes
/// their stages, then awaited and written into the flat gradient.
struct GradSync<'a> {
    buckets: &'a [Bucket],
    stages: &'a [usize],
    bufs: &'a mut [Vec<f32>],
    pending: Vec<Pending>,
    step: usize,
}

impl<'a> GradSync<'a> {
    fn new(
        buckets: &'a [Bucket],
        stages: &'a [usize],
        bufs: &'a mut [Vec<f32>],
        step: usize,
    ) -> Self {
        GradSync {
            buckets,
            stages,
            bufs,
            pending: Vec::with_capacity(buckets.len()),
            step,
        }
    }

    /// Launches every bucket whose parameters all have their gradients (stage <= `done`).
    fn launch_ready(
        &mut self,
        flat: &FlatParams,
        dist: &Dist,
        done: usize,
        bf16: bool,
    ) -> Result<()> {
        while let Some(b) = self.buckets.get(self.pending.len()) {
            let i = self.pending.len();
            if self.stages[i] > done {
                break;
            }
            flat.read_grads(b.elems.clone(), &mut self.bufs[i]);
            let what = format!(
                "gradient bucket {i} (elements {}..{}) of step {}",
                b.elems.start, b.elems.end, self.step
            );
            let send = std::mem::take(&mut self.bufs[i]);
            // SAFETY: this range of the flat gradient is touched by nothing but the sum until
            // `finish` has waited for it; buckets are disjoint.
            let pending = unsafe {
                dist.start_allreduce_into(what, send, flat.grads_mut(b.elems.clone()), bf16)?
            };
            self.pending.push(pending);
        }
        Ok(())
    }

    /// Waits for every bucket's sum (they land in the flat gradient).
    fn finish(&mut self, dist: &Dist) -> Result<()> {
        for (i, pending) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            self.bufs[i] = pending.wait(dist)?;
        }
        Ok(())
    }
}

/// The dropout stream's seed for one micro-batch: the same on every rank for the same
/// micro-batch of the global batch.
fn dropout_seed(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(1_000_003)
        .wrapping_add(step as u64 * 4096 + micro as u64)
}

/// Evaluation data, tokenized.
pub enum EvalSet {
    /// Sequence classification: one feature per example.
    Classification(Vec<Feature>),
    /// Question answering: the questions and their windows.
    Qa {
        examples: Vec<QaExample>,
        windows: Vec<QaFeature>,
    },
}

impl EvalSet {
    /// The model inputs, one per example or window.
    pub fn features(&self) -> Vec<&Feature> {
        match self {
            EvalSet::Classification(f) => f.iter().collect(),
            EvalSet::Qa { windows, .. } => windows.iter().map(|w| &w.input).collect(),
        }
    }
}

/// How evaluation batches and answers are made.
pub struct EvalOptions<'a> {
    pub batch_size: usize,
    pub pad_id: i64,
    pub pad_to: Option<usize>,
    pub post: PostProcess,
    /// Where rank 0 writes predictions.json and nbest_predictions.json (question answering).
    pub predictions_dir: Option<&'a Path>,
}

/// Evaluates on `set`, each process a contiguous shard of the features, outputs gathered:
/// mean loss and the task's metrics (SQuAD exact match and F1 for questions), keys prefixed
/// `eval_`, the same on every process.
pub fn evaluate(
    model: &TaskModel,
    set: &EvalSet,
    opts: &EvalOptions,
    dist: &Dist,
) -> Result<BTreeMap<String, f64>> {
    let regression = model.config.resolved_problem_type() == ProblemType::Regression;
    let features = set.features();
    let (rank, world) = (dist.topo.rank, dist.topo.world);
    let shard = &features[features.len() * rank / world..features.len() * (rank + 1) / world];
    let (mut loss_sum, mut outputs) = (0.0, Vec::with_capacity(shard.len()));
    for chunk in shard.chunks(opts.batch_size) {
        let (inputs, _) = batching::collate(chunk, opts.pad_id, opts.pad_to);
        let out = tch::no_grad(|| model.forward(&inputs, false));
        let labels = batching::batch_labels(chunk, regression);
        loss_sum += model.loss(&out, &labels)?.double_value(&[]) * chunk.len() as f64;
        match set {
            // Each window's start then end logits over its real tokens.
            EvalSet::Qa { .. } => {
                let (start, end) = out.span_logits();
                let (start, end) = (start.to_kind(Kind::Float), end.to_kind(Kind::Float));
                for (row, f) in chunk.iter().enumerate() {
                    let n = f.input_ids.len() as i64;
                    for t in [&start, &end] {
                        outputs.extend(Vec::<f32>::try_from(t.get(row as i64).narrow(0, 0, n))?);
                    }
                }
            }
            // A regression score, or the predicted class id (exact in f32).
            EvalSet::Classification(_) => {
                let out = if regression {
                    out.logits.view([-1]).to_kind(Kind::Float)
                } else {
                    out.logits.argmax(-1, false).to_kind(Kind::Float)
                };
                outputs.extend(Vec::<f32>::try_from(out)?);
            }
        }
    }
    let outputs: Vec<f32> = dist.all_gather_f32("evaluation outputs", outputs)?.concat();
    let loss_sum = dist.allreduce_sum_f64("evaluation loss", vec![loss_sum])?[0];
    let mut m = match set {
        EvalSet::Qa {
            examples, windows, ..
        } => {
            let (mut starts, mut ends, mut at) = (Vec::new(), Vec::new(), 0);
            for f in &features {
                let n = f.input_ids.len();
                starts.push(outputs[at..at + n].to_vec());
                ends.push(outputs[at + n..at + 2 * n].to_vec());
                at += 2 * n;
            }
            let predictions = qa::postprocess(examples, windows, &starts, &ends, &opts.post)?;
            if let (true, Some(dir)) = (dist.is_root(), opts.predictions_dir) {
                qa::write_predictions(dir, &predictions, opts.post.version_2_with_negative)?;
            }
            qa::score(examples, &predictions, opts.post.version_2_with_negative)
        }
        EvalSet::Classification(_) if regression => {
            let gold: Vec<f64> = features.iter().map(|f| f.value()).collect();
            let pred: Vec<f64> = outputs.iter().map(|&x| x as f64).collect();
            metrics::regression_report(&pred, &gold)
        }
        EvalSet::Classification(_) => {
            let pred: Vec<usize> = outputs.iter().map(|&p| p as usize).collect();
            let gold: Vec<usize> = features.iter().map(|f| f.value() as usize).collect();
            metrics::classification_report(&pred, &gold, model.config.num_labels())
        }
    };
    m.insert("loss".into(), loss_sum / features.len().max(1) as f64);
    Ok(m.into_iter()
        .map(|(k, v)| (format!("eval_{k}"), v))
        .collect())
}

/// Tokenizes `examples` with each process taking a contiguous 1/N share, then exchanges the
/// token ids so every process holds them all, in order.
fn tokenize_shared(
    tok: &TextTokenizer,
    examples: &[Example],
    dist: &Dist,
    what: &str,
) -> Result<Vec<Feature>> {
    let (rank, world) = (dist.topo.rank, dist.topo.world);
    if world == 1 {
        return batching::tokenize(tok, examples);
    }
    let share = &examples[examples.len() * rank / world..examples.len() * (rank + 1) / world];
    let mine = batching::encode_features(&batching::tokenize(tok, share)?);
    let mut all = Vec::with_capacity(examples.len());
    for bytes in dist.all_gather_bytes(&format!("tokenized {what} data"), mine)? {
        all.extend(batching::decode_features(&bytes)?);
    }
    Ok(all)
}

/// The run's model from `dir` as `config.model` describes it, and its tokenizer.json. A
/// `fresh` run honours `model.tokenizer_file`, and `random` builds it from config.json alone
/// with random weights; a resumed one takes both from its checkpoint. With `report`, says
/// what the load did; checks `max_seq_len`.
pub fn load_model(
    config: &Config,
    dir: &Path,
    task: Task,
    adapt: impl FnOnce(&mut models::EncoderConfig) -> Result<()>,
    fresh: bool,
    random: bool,
    report: bool,
) -> Result<(models::Pretrained, PathBuf)> {
    let seed = config.runtime.seed as i64;
    let random = fresh && random;
    let loaded = if random {
        models::from_config(dir, task, adapt, seed)?
    } else {
        models::from_pretrained(dir, task, adapt, seed)?
    };
    let class = loaded.model.class_name();
    if report && random {
        let config_json = dir.join(hub::CONFIG_FILE);
        tracing::warn!(
            "{class} randomly initialised from {}: no pretrained weights",
            config_json.display()
        );
    } else if report {
        for line in loaded.report.summary_lines(&class, dir) {
            tracing::warn!("{line}");
        }
    }
    let c = &loaded.model.config;
    let usable = c.max_input_tokens();
    if config.model.max_seq_len > usable {
        bail!(
            "model.max_seq_len {} exceeds the {usable} tokens the model's {} position embeddings allow",
            config.model.max_seq_len,
            c.max_position_embeddings
        );
    }
    let tokenizer = if fresh && !config.model.tokenizer_file.is_empty() {
        PathBuf::from(&config.model.tokenizer_file)
    } else {
        dir.join(hub::TOKENIZER_FILE)
    };
    Ok((loaded, tokenizer))
}

/// The model directory, and whether to build it with random weights: `model.random_init`, or
/// the `model.offline_fallback` directory when the Hub cannot be reached.
pub fn resolve_model(config: &Config, report: bool) -> Result<(PathBuf, bool)> {
    let m = &config.model;
    match hub::resolve_model_dir(&m.name_or_path, &m.revision) {
        Ok(dir) => Ok((dir, m.random_init)),
        Err(e) if !m.offline_fallback.is_empty() && !Path::new(&m.name_or_path).exists() => {
            if report {
                tracing::warn!(
                    "cannot get {} from the Hugging Face Hub ({e:#}); building its architecture from {}/config.json with RANDOM weights instead (model.offline_fallback): a smoke run, not a fine-tuning of the pretrained model",
                    m.name_or_path,
                    m.offline_fallback
                );
            }
            Ok((PathBuf::from(&m.offline_fallback), true))
        }
        Err(e) => Err(e),
    }
}

/// Training and evaluation files, and the fraction to hold out when there is no evaluation
/// file; `data.offline_fallback_file` stands in for Hub files the Hub cannot serve.
fn resolve_data(config: &Config, report: bool) -> Result<(PathBuf, Option<PathBuf>, f64)> {
    let dc = &config.data;
    let resolve = || -> Result<(PathBuf, Option<PathBuf>)> {
        if dc.train_file.is_empty() {
            bail!("data.train_file: no training file given");
        }
        let train = hub::resolve_data_file(&dc.train_file)?;
        let eval = (!dc.eval_file.is_empty())
            .then(|| hub::resolve_data_file(&dc.eval_file))
            .transpose()?;
        Ok((train, eval))
    };
    let on_hub = |f: &str| f.starts_with("hf://");
    match resolve() {
        Ok((train, eval)) => Ok((train, eval, dc.eval_split)),
        Err(e)
            if !dc.offline_fallback_file.is_empty()
                && (on_hub(&dc.train_file) || on_hub(&dc.eval_file)) =>
        {
            let split = if dc.eval_split > 0.0 {
                dc.eval_split
            } else {
                0.2
            };
            if report {
                tracing::warn!(
                    "cannot get the data from the Hugging Face Hub ({e:#}); using {} instead, {split} of it held out for evaluation (data.offline_fallback_file)",
                    dc.offline_fallback_file
                );
            }
            Ok((PathBuf::from(&dc.offline_fallback_file), None, split))
        }
        Err(e) => Err(e),
    }
}

/// A run's texts, before tokenization.
enum Texts {
    Classification {
        train: Vec<Example>,
        eval: Vec<Example>,
        labels: LabelKind,
        regression: bool,
    },
    Qa {
        train: Vec<QaExample>,
        eval: Vec<QaExample>,
    },
}

/// Reads the training and evaluation data of `config.model.task`.
fn load_texts(config: &Config, report: bool) -> Result<Texts> {
    let dc = &config.data;
    let seed = config.runtime.seed;
    let (train_file, eval_file, split) = resolve_data(config, report)?;
    match config.model.task {
        TaskName::Qa => {
            let options = QaReadOptions {
                strict_answers: config.qa.strict_answers,
                skip_bad_rows: dc.skip_bad_rows,
            };
            let read = |path: &Path| -> Result<Vec<QaExample>> {
                let (examples, found) = squad::load_squad(path, options)?;
                if report && found.mismatched_answers > 0 {
                    tracing::warn!(
                        "{}: {} answers do not start where answer_start says (first: {}); their labels follow answer_start, as run_qa.py's do (qa.strict_answers = true makes this an error)",
                        path.display(),
                        found.mismatched_answers,
                        found.first_mismatch.unwrap_or_default()
                    );
                }
                if report && found.skipped > 0 {
                    tracing::warn!(
                        "{}: skipped {} questions with an empty question or context (data.skip_bad_rows)",
                        path.display(),
                        found.skipped
                    );
                }
                Ok(examples)
            };
            let train = read(&train_file)?;
            let (train, eval) = match eval_file {
                Some(path) => (train, read(&path)?),
                None if split > 0.0 => squad::split_by_article(train, split, seed),
                None => (train, Vec::new()),
            };
            Ok(Texts::Qa { train, eval })
        }
        TaskName::SeqCls => {
            let regression = config.model.problem_type == "regression"
                || (config.model.problem_type == "auto" && config.model.num_labels == 1);
            if config.model.problem_type == ProblemType::MultiLabel.as_hf_str() {
                bail!("model.problem_type: multi-label training data is not supported yet");
            }
            let (mut train, labels) =
                classification::load_examples(&train_file, dc, regression, None)?;
            let eval = if let Some(path) = eval_file {
                classification::load_examples(&path, dc, regression, Some(&labels))?.0
            } else if split > 0.0 {
                let (keep, held) = batching::holdout_split(train.len(), split, seed);
                let held: Vec<_> = held.iter().map(|&i| train[i].clone()).collect();
                train = keep.iter().map(|&i| train[i].clone()).collect();
                held
            } else {
                Vec::new()
            };
            if let LabelKind::Classes(names) = &labels {
                if config.model.num_labels > 0 && config.model.num_labels != names.len() {
                    bail!(
                        "model.num_labels is {} but the training data has {} labels ({})",
                        config.model.num_labels,
                        names.len(),
                        names.join(", ")
                    );
                }
            }
            Ok(Texts::Classification {
                train,
                eval,
                labels,
                regression,
            })
        }
        TaskName::Mlm => {
            bail!("model.task: \"mlm\" training is not supported yet (\"seq-cls\" and \"qa\" are)")
        }
    }
}

impl Texts {
    /// The head these texts train, and how config.json is adapted to it.
    fn task(&self) -> Task {
        match self {
            Texts::Classification { .. } => Task::SequenceClassification,
            Texts::Qa { .. } => Task::QuestionAnswering,
        }
    }

    fn has_eval(&self) -> bool {
        match self {
            Texts::Classification { eval, .. } => !eval.is_empty(),
            Texts::Qa { eval, .. } => !eval.is_empty(),
        }
    }

    fn adapt(&self, c: &mut models::EncoderConfig) -> Result<()> {
        if let Texts::Classification {
            labels, regression, ..
        } = self
        {
            c.id2label = classification::id2label(labels);
            c.problem_type = Some(if *regression {
                ProblemType::Regression
            } else {
                ProblemType::SingleLabel
            });
        }
        Ok(())
    }

    /// Tokenizes training (unless `eval_only`) and evaluation texts; questions become run_qa.py's
    /// windows.
    fn tokenize(
        self,
        config: &Config,
        tokenizer_json: &Path,
        pad_id: i64,
        dist: &Dist,
        eval_only: bool,
    ) -> Result<(Vec<Feature>, Option<EvalSet>)> {
        let max_len = config.model.max_seq_len;
        match self {
            Texts::Classification { train, eval, .. } => {
                let tok = TextTokenizer::from_file(
                    tokenizer_json,
                    pad_id,
                    max_len,
                    Truncation::LongestFirst,
                )?;
                let train = if eval_only {
                    Vec::new()
                } else {
                    tokenize_shared(&tok, &train, dist, "training")?
                };
                let eval = tokenize_shared(&tok, &eval, dist, "evaluation")?;
                Ok((
                    train,
                    (!eval.is_empty()).then_some(EvalSet::Classification(eval)),
                ))
            }
            Texts::Qa { train, eval } => {
                // Every process builds all windows (tokenizers runs them in parallel): cheap
                // next to training, and it keeps each window's text offsets local.
                if config.qa.doc_stride >= max_len {
                    bail!(
                        "qa.doc_stride: {} must be below model.max_seq_len ({max_len})",
                        config.qa.doc_stride
                    );
                }
                let tok = squad::qa_tokenizer(tokenizer_json, max_len, config.qa.doc_stride)?;
                let train = if eval_only {
                    Vec::new()
                } else {
                    squad::qa_features(&tok, &train)?
                        .into_iter()
                        .map(|w| w.input)
                        .collect()
                };
                if eval.is_empty() {
                    return Ok((train, None));
                }
                let windows = squad::qa_features(&tok, &eval)?;
                Ok((
                    train,
                    Some(EvalSet::Qa {
                        examples: eval,
                        windows,
                    }),
                ))
            }
        }
    }
}

/// `sprtrain eval`: evaluates the model in `model_dir` (default: the final model in
/// `train.output_dir`) on the config's evaluation data, as training's final evaluation does;
/// question answering writes predictions.json and nbest_predictions.json into `output_dir`
/// (default `train.output_dir`). Returns the metrics on rank 0, None elsewhere.
pub fn evaluate_saved(
    config: &Config,
    model_dir: Option<&Path>,
    output_dir: Option<&Path>,
) -> Result<Option<BTreeMap<String, f64>>> {
    let dist = Dist::init(config.dist.collective_timeout_s)?;
    let _rank =
        (dist.topo.world > 1).then(|| tracing::info_span!("rank", r = dist.topo.rank).entered());
    let result = (|| {
        let root = dist.is_root();
        let default_dir = PathBuf::from(&config.train.output_dir);
        let dir = model_dir.unwrap_or(&default_dir);
        if !dir.join(hub::CONFIG_FILE).is_file() {
            bail!(
                "no model in {} (no {}): train first, or pass --model DIR",
                dir.display(),
                hub::CONFIG_FILE
            );
        }
        let texts = load_texts(config, root)?;
        if !texts.has_eval() {
            bail!("no evaluation data: set data.eval_file, or data.eval_split to hold out part of data.train_file");
        }
        let _autocast = set_up_numerics(config, &dist)?;
        let (pretrained, tokenizer_json) = load_model(
            config,
            dir,
            texts.task(),
            |c| texts.adapt(c),
            false,
            false,
            root,
        )?;
        let model = pretrained.model;
        let pad_id = model.config.pad_token_id;
        let (_, eval_set) = texts.tokenize(config, &tokenizer_json, pad_id, &dist, true)?;
        let set = eval_set.context("no evaluation data")?;
        let out = output_dir.unwrap_or(&default_dir);
        if root {
            std::fs::create_dir_all(out)
                .with_context(|| format!("cannot create {}", out.display()))?;
        }
        let opts = EvalOptions {
            batch_size: config.eval.batch_size,
            pad_id,
            pad_to: config
                .data
                .pad_to_max_length
                .then_some(config.model.max_seq_len),
            post: PostProcess::from_config(&config.qa),
            predictions_dir: Some(out),
        };
        let m = evaluate(&model, &set, &opts, &dist)?;
        Ok(root.then_some(m))
    })();
    stop_every_rank_on_error(&dist, result)
}

/// Refuses to overwrite earlier checkpoints unless asked to.
fn prepare_output_dir(out: &Path, resume: bool, overwrite: bool) -> Result<()> {
    let existing = checkpoint::list_checkpoints(out)?;
    if !existing.is_empty() && !resume {
        if !overwrite {
            bail!(
                "output directory {} already holds checkpoints ({}); pass --resume latest to continue, or set train.overwrite_output_dir = true",
                out.display(),
                existing.iter().map(|(s, _)| format!("checkpoint-{s}")).collect::<Vec<_>>().join(", ")
            );
        }
        for (_, dir) in existing {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
        }
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create output directory {}", out.display()))
}

/// Runs the fine-tuning described by `config`; `resume` is `latest` or a checkpoint path.
/// Under an MPI launcher this process is one rank of the job; an error on any rank is printed
/// with its rank and stops every rank.
pub fn train(config: &Config, resume: Option<&str>) -> Result<Summary> {
    let dist = Dist::init(config.dist.collective_timeout_s)?;
    let _rank =
        (dist.topo.world > 1).then(|| tracing::info_span!("rank", r = dist.topo.rank).entered());
    let result = train_on(config, resume, &dist);
    stop_every_rank_on_error(&dist, result)
}

/// With several processes, an error on one is printed with its rank and stops them all (a
/// lone error would leave the others waiting in a collective).
fn stop_every_rank_on_error<T>(dist: &Dist, result: Result<T>) -> Result<T> {
    match result {
        Err(e) if dist.topo.world > 1 => {
            crate::dist::eprint_line(&format!("sprtrain: rank {}: error: {e:#}", dist.topo.rank));
            dist.abort(1)
        }
        r => r,
    }
}

/// Resolves the precision (bf16 compute on fp32 master weights, for training and evaluation
/// alike, while the returned guard lives) and places this process's threads.
fn set_up_numerics(config: &Config, dist: &Dist) -> Result<models::layers::AutocastGuard> {
    let precision = config.runtime.precision.resolve(&CpuInfo::detect());
    let autocast =
        models::layers::autocast((precision == Precision::Bf16).then_some(Kind::BFloat16));
    let threads =
        crate::sysinfo::place_threads(&dist.topo, config.runtime.threads, config.dist.pin_threads)?;
    tch::set_num_threads(threads.count as i32);
    if dist.is_root() {
        tracing::info!(
            "precision {precision:?}, {} process(es), allocator {}",
            dist.topo.world,
            crate::allocator::in_use()
        );
    }
    tracing::info!("{}", threads.describe(&dist.topo));
    Ok(autocast)
}

fn train_on(config: &Config, resume: Option<&str>, dist: &Dist) -> Result<Summary> {
    let started = Instant::now();
    let root = dist.is_root();
    let (tc, dc) = (&config.train, &config.data);
    let out = PathBuf::from(&tc.output_dir);
    if root {
        prepare_output_dir(&out, resume.is_some(), tc.overwrite_output_dir)?;
    }
    let resume_dir = resume
        .map(|spec| checkpoint::resume_dir(&out, spec))
        .transpose()?;

    let _autocast = set_up_numerics(config, dist)?;

    // Data: class labels come from the training file and fix the head's size.
    let (model_dir, random) = resolve_model(config, root)?;
    let texts = load_texts(config, root)?;

    // Model: the pretrained one with a head for this task, or the checkpoint to resume.
    let source = resume_dir.as_deref().unwrap_or(&model_dir);
    let (pretrained, tokenizer_json) = load_model(
        config,
        source,
        texts.task(),
        |c| texts.adapt(c),
        resume_dir.is_none(),
        random,
        root,
    )?;
    let (vs, model) = (pretrained.vs, pretrained.model);
    let regression = model.config.resolved_problem_type() == ProblemType::Regression;

    // Tokenize once, in parallel.
    let pad_id = model.config.pad_token_id;
    let (train_features, eval_set) =
        texts.tokenize(config, &tokenizer_json, pad_id, dist, false)?;
    let lengths: Vec<usize> = train_features.iter().map(|f| f.input_ids.len()).collect();
    let pad_to = dc.pad_to_max_length.then_some(config.model.max_seq_len);
    let eval_options = EvalOptions {
        batch_size: config.eval.batch_size,
        pad_id,
        pad_to,
        post: PostProcess::from_config(&config.qa),
        predictions_dir: Some(&out),
    };

    // The plan: batches, steps, schedule.
    let plan = BatchPlan {
        micro_batch: tc.batch_size,
        accumulation: tc.gradient_accumulation_steps,
        world: dist.topo.world,
        seed: config.runtime.seed,
        drop_last: tc.drop_last,
        group_by_length: dc.group_by_length,
    };
    let steps_per_epoch = plan.steps_per_epoch(train_features.len());
    if steps_per_epoch == 0 {
        bail!(
            "{} training examples make no full global batch of {} (train.drop_last is set)",
            train_features.len(),
            plan.global_batch()
        );
    }
    let total_steps = if tc.max_steps > 0 {
        tc.max_steps
    } else {
        tc.epochs * steps_per_epoch
    };
    let warmup =
        LrSchedule::warmup_from(tc.warmup_steps as i64, tc.warmup_ratio, total_steps as i64);
    let schedule = LrSchedule::new(
        tc.lr_scheduler,
        tc.learning_rate,
        warmup,
        total_steps as i64,
    )?;

    // Optimizer over the flat parameter buffer, restored when resuming.
    let mut flat = FlatParams::new(&vs, |name| model.backward_stage(name));
    // Every rank must run the same job on the same model: compare before the first collective
    // that depends on it, then start from rank 0's weights.
    let mut fingerprint = config.dotted_lines()?;
    fingerprint.extend(
        flat.slots
            .iter()
            .map(|s| format!("tensor {} {:?} float32", s.name, s.shape)),
    );
    fingerprint.push(format!("training examples {}", train_features.len()));
    dist.check_same(
        "the resolved configuration or parameter layout",
        &fingerprint,
    )?;
    if dist.topo.world > 1 {
        let mut weights = Vec::new();
        flat.read_params(&mut weights);
        let weights = dist.broadcast("initial parameters", weights)?;
        flat.write_params(&weights);
    }
    let buckets = flat.buckets((config.dist.bucket_mb * 1024.0 * 1024.0) as usize);
    // A bucket is ready once backward has passed the stage of its last (deepest) parameter.
    let bucket_stages: Vec<usize> = buckets
        .iter()
        .map(|b| model.backward_stage(&flat.slots[b.slots.end - 1].name))
        .collect();
    let mut bucket_bufs: Vec<Vec<f32>> = buckets
        .iter()
        .map(|b| Vec::with_capacity(b.elems.len()))
        .collect();
    let distributed = dist.topo.world > 1;
    let reduce_bf16 = config.dist.reduce_dtype == ReduceDtype::Bf16;
    let adam = AdamWConfig {
        beta1: tc.adam_beta1,
        beta2: tc.adam_beta2,
        eps: tc.adam_epsilon,
        weight_decay: tc.weight_decay,
    };
    let mut opt = AdamW::new(adam, &flat);
    let layout: Vec<(String, i64)> = flat
        .slots
        .iter()
        .map(|s| (s.name.clone(), s.numel))
        .collect();
    let mut state = TrainerState {
        global_step: 0,
        epoch: 0,
        batch_in_epoch: 0,
        total_steps,
        optimizer_step: 0,
        layout: layout.clone(),
        log_history: Vec::new(),
    };
    if let Some(dir) = &resume_dir {
        let (saved, moments) = checkpoint::load_training_state(dir)?;
        if saved.layout != layout {
            bail!(
                "{}: the checkpoint's parameters differ from this config's model",
                dir.display()
            );
        }
        for (name, mut dst) in [
            ("exp_avg", opt.exp_avg.shallow_clone()),
            ("exp_avg_sq", opt.exp_avg_sq.shallow_clone()),
        ] {
            let src = moments
                .get(name)
                .with_context(|| format!("{}: optimizer state lacks {name}", dir.display()))?;
            tch::no_grad(|| dst.f_copy_(src)).with_context(|| {
                format!(
                    "{}: optimizer state {name} has the wrong size",
                    dir.display()
                )
            })?;
        }
        opt.step = saved.optimizer_step;
        if saved.total_steps != total_steps {
            tracing::warn!(
                "resuming with {total_steps} total steps; the checkpoint planned {}",
                saved.total_steps
            );
        }
        state = TrainerState {
            total_steps,
            ..saved
        };
        tracing::info!(
            "resumed from {} at step {}",
            dir.display(),
            state.global_step
        );
    }
    let resolved = config.to_toml()?;
    let files = ModelFiles {
        model: &model,
        vs: &vs,
        tokenizer_json: &tokenizer_json,
        resolved_config: &resolved,
    };
    let mut log = root
        .then(|| MetricsLog::open(&out.join("metrics.jsonl"), resume_dir.is_some()))
        .transpose()?;
    let mut progress = Progress::new(total_steps, state.global_step, root);
    if root {
        tracing::info!(
            "{} examples ({} held for evaluation), {} steps of {} examples, {} parameters in {} gradient buckets",
            train_features.len(),
            eval_set.as_ref().map_or(0, |e| e.features().len()),
            total_steps,
            plan.global_batch(),
            flat.numel(),
            buckets.len()
        );
    }

    // Everything before the first step is startup: libtorch loading, model, data, optimizer.
    if root {
        let startup_s = crate::sysinfo::process_age_s();
        let unix_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if let Some(log) = log.as_mut() {
            log.write(&json!({
                "event": "train_begin", "step": state.global_step, "unix_time": unix_time,
                "startup_s": startup_s,
            }))?;
        }
        if let Some(s) = startup_s {
            tracing::info!("ready to train {s:.2} s after the process started");
        }
    }

    // The loop.
    let (mut window_loss, mut window_steps, mut window_samples, mut window_tokens) =
        (0.0, 0usize, 0usize, 0usize);
    let (mut t_data, mut t_fwd, mut t_bwd, mut t_comm, mut t_opt, mut window_start) =
        (0.0, 0.0, 0.0, 0.0, 0.0, Instant::now());
    let (mut run_loss, mut run_steps, mut run_samples) = (0.0, 0usize, 0usize);
    let mut final_eval = BTreeMap::new();
    while state.global_step < total_steps {
        let batches = plan.epoch(&lengths, state.epoch);
        let mut epoch_done = false;
        for (index, global) in batches.iter().enumerate().skip(state.batch_in_epoch) {
            let micro = plan.micro_batches(global, dist.topo.rank);
            // Each micro-batch's mean loss counts 1/(micro-batches in the whole step): the
            // gradient is their mean whatever the number of processes, tails included.
            let micro_in_step = global.len().div_ceil(plan.micro_batch) as f64;
            let (mut step_loss, mut step_tokens) = (0.0, 0usize);
            let mut sync = GradSync::new(
                &buckets,
                &bucket_stages,
                &mut bucket_bufs,
                state.global_step + 1,
            );
            for (m, indices) in micro.iter().enumerate() {
                let t = Instant::now();
                let refs: Vec<&Feature> = indices.iter().map(|&i| &train_features[i]).collect();
                let (inputs, real_tokens) = batching::collate(&refs, pad_id, pad_to);
                let labels = batching::batch_labels(&refs, regression);
                t_data += t.elapsed().as_secs_f64();
                let t = Instant::now();
                let micro_index = dist.topo.rank * plan.accumulation + m;
                models::layers::seed_dropout(dropout_seed(
                    config.runtime.seed,
                    state.global_step,
                    micro_index,
                ));
                // The last micro-batch of a step, with several processes, runs backward stage
                // by stage so each gradient bucket leaves as soon as it is complete.
                let staged = distributed && m + 1 == micro.len();
                let (output, boundaries) = if staged {
                    model.forward_staged(&inputs, true)
                } else {
                    (model.forward(&inputs, true), Vec::new())
                };
                let loss = model.loss(&output, &labels)? / micro_in_step;
                t_fwd += t.elapsed().as_secs_f64();
                let t = Instant::now();
                loss.backward();
                if staged {
                    sync.launch_ready(&flat, dist, 1, reduce_bf16)?;
                    let layers = boundaries.len();
                    for (k, b) in boundaries.iter().enumerate().rev() {
                        (&b.below * b.leaf.grad()).sum(Kind::Float).backward();
                        sync.launch_ready(&flat, dist, layers + 1 - k, reduce_bf16)?;
                    }
                }
                step_loss += loss.double_value(&[]);
                t_bwd += t.elapsed().as_secs_f64();
                step_tokens += real_tokens;
            }
            let t = Instant::now();
            if distributed {
                // Buckets not launched yet (a rank without a micro-batch in a short last step
                // still takes part, with zeros); then wait for all and fill the flat gradient.
                sync.launch_ready(&flat, dist, usize::MAX, reduce_bf16)?;
                sync.finish(dist)?;
            }
            let totals =
                dist.allreduce_sum_f64("step loss", vec![step_loss, step_tokens as f64])?;
            (step_loss, step_tokens) = (totals[0], totals[1] as usize);
            t_comm += t.elapsed().as_secs_f64();
            window_tokens += step_tokens;
            let t = Instant::now();
            let grad_norm = flat.clip_grad_norm(tc.max_grad_norm);
            let lr = schedule.lr(state.global_step as i64);
            opt.step(&flat, lr);
            flat.zero_grads();
            t_opt += t.elapsed().as_secs_f64();
            if !step_loss.is_finite() {
                bail!("loss became {step_loss} at step {}", state.global_step + 1);
            }

            state.global_step += 1;
            state.optimizer_step = opt.step;
            state.batch_in_epoch = index + 1;
            if state.batch_in_epoch == batches.len() {
                state.epoch += 1;
                state.batch_in_epoch = 0;
                epoch_done = true;
            }
            let samples = global.len();
            window_loss += step_loss;
            window_steps += 1;
            window_samples += samples;
            run_loss += step_loss;
            run_steps += 1;
            run_samples += samples;
            progress.step(step_loss, samples);
            let epoch_f = state.epoch as f64 + state.batch_in_epoch as f64 / batches.len() as f64;
            let last = state.global_step == total_steps;

            if state.global_step % tc.logging_steps.max(1) == 0 || last {
                let wall = window_start.elapsed().as_secs_f64();
                let record = json!({
                    "step": state.global_step, "epoch": epoch_f, "loss": window_loss / window_steps as f64, "lr": lr,
                    "grad_norm": grad_norm, "samples_per_s": window_samples as f64 / wall, "tokens_per_s": window_tokens as f64 / wall,
                    "time_data_s": t_data / window_steps as f64, "time_forward_s": t_fwd / window_steps as f64,
                    "time_backward_s": t_bwd / window_steps as f64, "time_optimizer_s": t_opt / window_steps as f64,
                    "time_comm_exposed_s": t_comm / window_steps as f64,
                });
                if let Some(log) = log.as_mut() {
                    log.write(&record)?;
                }
                progress.log(&record);
                state.log_history.push(record);
                (window_loss, window_steps, window_samples, window_tokens) = (0.0, 0, 0, 0);
                (t_data, t_fwd, t_bwd, t_comm, t_opt, window_start) =
                    (0.0, 0.0, 0.0, 0.0, 0.0, Instant::now());
            }
            let eval_now = match config.eval.strategy {
                EvalStrategy::Steps => state.global_step % config.eval.steps.max(1) == 0,
                EvalStrategy::Epoch => epoch_done,
                EvalStrategy::No => false,
            };
            if let Some(set) = eval_set.as_ref().filter(|_| eval_now || last) {
                let mut m = evaluate(&model, set, &eval_options, dist)?;
                let mut record = json!({"step": state.global_step, "epoch": epoch_f});
                for (k, v) in &m {
                    record[k] = json!(v);
                }
                if let Some(log) = log.as_mut() {
                    log.write(&record)?;
                }
                progress.log(&record);
                state.log_history.push(record);
                if last {
                    m.insert("epoch".into(), epoch_f);
                    final_eval = m;
                }
            }
            if root && ((tc.save_steps > 0 && state.global_step % tc.save_steps == 0) || last) {
                let moments = [
                    ("exp_avg".to_string(), opt.exp_avg.shallow_clone()),
                    ("exp_avg_sq".to_string(), opt.exp_avg_sq.shallow_clone()),
                ];
                let dir = checkpoint::save_checkpoint(
                    &out,
                    &files,
                    &state,
                    &moments,
                    tc.save_total_limit,
                )?;
                progress.note(&format!("saved {}", dir.display()));
            }
            if last || epoch_done {
                break;
            }
        }
        if !epoch_done && state.global_step < total_steps {
            // Only reachable when resuming exactly at an epoch's end.
            state.epoch += 1;
            state.batch_in_epoch = 0;
        }
    }
    progress.finish();
    if let Some(log) = log.as_mut() {
        log.write(&json!({
            "event": "train_end", "step": state.global_step,
            "peak_rss_mib": crate::sysinfo::peak_rss_mib(),
        }))?;
    }

    // The final model at the root, results and plot.
    checkpoint::save_final(&out, &files)?;
    if !final_eval.is_empty() {
        checkpoint::write_atomic(
            &out.join("eval_results.json"),
            (serde_json::to_string_pretty(&final_eval)? + "\n").as_bytes(),
        )?;
    }
    if let Err(e) = crate::report::plot(&out.join("training.png"), &state.log_history) {
        tracing::warn!("no plot: {e:#}");
    }
    let wall_s = started.elapsed().as_secs_f64();
    Ok(Summary {
        root,
        output_dir: out,
        steps: state.global_step,
        epochs_done: state.epoch as f64 + state.batch_in_epoch as f64 / steps_per_epoch as f64,
        train_loss: run_loss / run_steps.max(1) as f64,
        wall_s,
        samples_per_s: run_samples as f64 / wall_s,
        eval: final_eval,
    })
}
