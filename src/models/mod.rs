//! Hugging Face models in libtorch: BERT, DistilBERT and RoBERTa encoders and GPT-2 and
//! Llama-family decoders, with the task heads of transformers' `*ForSequenceClassification`,
//! `*ForTokenClassification`, `*ForQuestionAnswering`, `*ForMaskedLM` and `*ForCausalLM`. Variable paths in the
//! `VarStore` are the transformers state-dict keys.
//!
//! Models know nothing of MPI, data files or training: they map token ids to outputs and losses.

pub mod bert;
pub mod deberta_v2;
pub mod distilbert;
pub mod gpt2;
pub mod hf_config;
pub mod init;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod modernbert;
pub mod weights;

use anyhow::{bail, Context, Result};
use tch::{nn, Reduction, Tensor};

use bert::{BertEncoder, BertPooler};
use deberta_v2::{ContextPooler, DebertaEncoder};
use distilbert::DistilBertEncoder;
use gpt2::Gpt2Model;
use hf_config::ModernBertSettings;
pub use hf_config::{Activation, Arch, HfConfig, ProblemType};
pub use layers::KvCache;
use layers::{activate, dropout, Embedding, LayerNorm, Linear, Positions};
use llama::LlamaModel;
use modernbert::{ModernBertModel, PredictionHead};

/// Which transformers head sits on the backbone (`BertModel`, `BertForQuestionAnswering`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// The bare encoder (`BertModel`): outputs the last hidden state.
    Base,
    SequenceClassification,
    /// One class per token (`*ForTokenClassification`, NER).
    TokenClassification,
    QuestionAnswering,
    MaskedLm,
    /// Next-token prediction (`*ForCausalLM`, GPT-2's `LMHeadModel`).
    CausalLm,
}

impl Head {
    fn class_suffix(self) -> &'static str {
        match self {
            Head::Base => "Model",
            Head::SequenceClassification => "ForSequenceClassification",
            Head::TokenClassification => "ForTokenClassification",
            Head::QuestionAnswering => "ForQuestionAnswering",
            Head::MaskedLm => "ForMaskedLM",
            Head::CausalLm => "ForCausalLM",
        }
    }
}

/// One batch of token ids. All tensors are (B, T) int64 on the model's device.
#[derive(Debug)]
pub struct EncoderInputs {
    pub input_ids: Tensor,
    /// 1 for real tokens, 0 for padding.
    pub attention_mask: Tensor,
    /// Segment ids for sentence pairs; `None` means all zeros. DistilBERT ignores them.
    pub token_type_ids: Option<Tensor>,
}

/// Targets for [`TaskModel::loss`].
#[derive(Debug)]
pub enum Labels {
    /// (B) class ids, single-label classification.
    Classes(Tensor),
    /// (B, L) 0/1 floats, multi-label classification.
    MultiHot(Tensor),
    /// (B) or (B, L) floats, regression.
    Values(Tensor),
    /// (B) start and end token positions, question answering.
    Spans { start: Tensor, end: Tensor },
    /// (B, T) token ids, -100 where no prediction is scored: masked LM, and causal LM (where
    /// the model shifts them: position t's logits predict label t + 1).
    Tokens(Tensor),
}

/// A cut between two backward stages: `leaf` (a layer's input, cut from the graph) and
/// `below`, the tensor it was cut from (the output of the stage underneath). Under activation
/// checkpointing that output was computed without a graph, and `recompute` runs the layer
/// underneath again, with one, when backward reaches it.
pub struct Boundary<'a> {
    pub leaf: Tensor,
    below: Tensor,
    recompute: Option<Recompute<'a>>,
}

/// One layer's forward again from its saved input, with its dropout masks redrawn from where
/// the first pass drew them.
type Recompute<'a> = Box<dyn Fn() -> Tensor + 'a>;

impl Boundary<'_> {
    /// The output of the stage underneath, with its graph: as recorded, or computed again
    /// (activation checkpointing).
    pub fn below(&self) -> Tensor {
        match &self.recompute {
            Some(again) => again(),
            None => self.below.shallow_clone(),
        }
    }
}

impl std::fmt::Debug for Boundary<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Boundary")
            .field("leaf", &self.leaf.size())
            .field("recomputed", &self.recompute.is_some())
            .finish()
    }
}

/// A forward pass cut into backward stages: the cut at each layer's input, and whether the
/// layers keep only their input, to be run again in backward (activation checkpointing,
/// transformers' `gradient_checkpointing`); then one more cut, at the last layer's output.
pub struct Stages<'a> {
    pub cuts: Vec<Boundary<'a>>,
    checkpoint: bool,
    /// Told when each layer's stage runs, where its weights are not always held (ZeRO 3).
    params: Option<&'a dyn LayerParams>,
}

/// Where the layers' weights live when a rank does not hold them all the time (ZeRO stage 3,
/// FSDP's FULL_SHARD): told just before a layer's stage runs, in forward and again in backward
/// (with its recomputation), and when it is done with them. Stages are numbered as
/// [`TaskModel::backward_stage`] numbers them: layers L (the first) to 1 (the last).
pub trait LayerParams {
    /// Layer stage `stage` is about to run; `next` runs after it (its weights may be fetched
    /// meanwhile).
    fn need(&self, stage: usize, next: usize);
    /// Layer stage `stage` is done with its weights until it next needs them.
    fn done(&self, stage: usize);
}

/// Backward of a forward pass cut into `stages`: `loss.backward()` (the heads, and the last
/// layer unless it is checkpointed: stages 0 and 1, see `TaskModel::backward_stage`), then
/// from the top cut down `(below * leaf.grad()).sum().backward()`, the layer underneath
/// recomputed first under checkpointing. `after(done)` runs once backward has completed
/// stages 0..=done.
pub fn backward_by_stages(
    loss: &Tensor,
    stages: &Stages,
    mut after: impl FnMut(usize) -> Result<()>,
) -> Result<()> {
    // Checkpointing adds a cut at the last layer's output: the loss reaches only the heads.
    let layers = stages
        .cuts
        .len()
        .saturating_sub(usize::from(stages.checkpoint));
    let (need, done) = stages.announcers();
    // Without checkpointing the loss's backward also runs the last layer (stage 1).
    let first = if stages.checkpoint { 0 } else { 1 };
    need(first);
    loss.backward();
    after(first)?;
    done(first);
    for (k, cut) in stages.cuts.iter().enumerate().rev() {
        let stage = layers + 1 - k;
        need(stage);
        let below = cut.below();
        // Below a frozen stage (LoRA's embeddings) there is nothing left to differentiate.
        if below.requires_grad() {
            (&below * cut.leaf.grad()).sum(tch::Kind::Float).backward();
        }
        drop(below);
        after(stage)?;
        done(stage);
    }
    Ok(())
}

impl Stages<'_> {
    /// `need(stage)` and `done(stage)` for backward, which runs stages upwards: the layer
    /// params told of each layer stage (1..=L), or nothing.
    fn announcers(&self) -> (impl Fn(usize) + '_, impl Fn(usize) + '_) {
        let layers = self.cuts.len().saturating_sub(usize::from(self.checkpoint));
        let layer = move |s: usize| (1..=layers).contains(&s);
        let need = move |s: usize| {
            if let Some(p) = self.params.filter(|_| layer(s)) {
                p.need(s, s + 1);
            }
        };
        let done = move |s: usize| {
            if let Some(p) = self.params.filter(|_| layer(s)) {
                p.done(s);
            }
        };
        (need, done)
    }
}

/// Runs `layers` in order from `x`; with `stages`, cuts the graph at each layer's input
/// (a leaf that requires grad) and records the cut, for backward by stages.
fn run_stack<'a, L>(
    x: Tensor,
    layers: &'a [L],
    stages: Option<&mut Stages<'a>>,
    forward: impl Fn(&L, &Tensor) -> Tensor + 'a,
) -> Tensor {
    run_stack_reading(x, layers, stages, Positions::All, move |layer, x, _| {
        forward(layer, x)
    })
}

/// As [`run_stack`], the last layer computing only the positions `read` of its output. Under
/// checkpointing every layer runs without a graph, its input kept for backward, and the last
/// layer's output is cut too.
fn run_stack_reading<'a, L>(
    mut x: Tensor,
    layers: &'a [L],
    mut stages: Option<&mut Stages<'a>>,
    read: Positions,
    forward: impl Fn(&L, &Tensor, Positions) -> Tensor + 'a,
) -> Tensor {
    let forward = std::rc::Rc::new(forward);
    let checkpoint = stages.as_ref().is_some_and(|s| s.checkpoint);
    let params = stages.as_ref().and_then(|s| s.params);
    let n = layers.len();
    // How to compute `x` again, with a graph, when it came from a checkpointed layer.
    let mut again: Option<Recompute<'a>> = None;
    for (i, layer) in layers.iter().enumerate() {
        let last = i + 1 == layers.len();
        let positions = if last { read } else { Positions::All };
        if let Some(s) = stages.as_deref_mut() {
            let leaf = x.detach().set_requires_grad(true);
            s.cuts.push(Boundary {
                leaf: leaf.shallow_clone(),
                below: x,
                recompute: again.take(),
            });
            x = leaf;
        }
        // This layer's stage (see `TaskModel::backward_stage`), its weights fetched first.
        let stage = n - i;
        if let Some(p) = params {
            p.need(stage, stage - 1);
        }
        if checkpoint {
            let (input, stream) = (x.shallow_clone(), layers::dropout_stream());
            x = tch::no_grad(|| forward(layer, &x, positions));
            let forward = forward.clone();
            again = Some(Box::new(move || {
                let now = layers::dropout_stream();
                layers::set_dropout_stream(stream);
                let out = forward(layer, &input, positions);
                layers::set_dropout_stream(now);
                out
            }));
        } else {
            x = forward(layer, &x, positions);
        }
        if let Some(p) = params {
            p.done(stage);
        }
    }
    if let (Some(s), Some(again)) = (stages, again) {
        // The last layer's output, recomputed when backward has come down from the heads.
        let leaf = x.detach().set_requires_grad(true);
        s.cuts.push(Boundary {
            leaf: leaf.shallow_clone(),
            below: x,
            recompute: Some(again),
        });
        x = leaf;
    }
    x
}

/// A forward pass's results.
#[derive(Debug)]
pub struct ModelOutput {
    /// Last hidden state, (B, T, C); (B, 1, C), the first position only, under the
    /// classification heads that read no other (`TaskModel::positions_read`).
    pub hidden: Tensor,
    /// Sequence classification (B, L); token classification (B, T, L); question answering
    /// (B, T, 2); masked and causal LM (B, T, V), undefined for a causal LM in training with
    /// `TaskModel::chunked_lm_loss`; the hidden state for the bare encoder.
    pub logits: Tensor,
}

impl ModelOutput {
    /// Question answering: (start, end) logits, each (B, T).
    pub fn span_logits(&self) -> (Tensor, Tensor) {
        (self.logits.select(-1, 0), self.logits.select(-1, 1))
    }

    /// The outputs of example `i` of the batch alone, as a batch of one.
    pub fn row(&self, i: i64) -> ModelOutput {
        ModelOutput {
            hidden: self.hidden.narrow(0, i, 1),
            logits: self.logits.narrow(0, i, 1),
        }
    }
}

enum Backbone {
    Bert {
        encoder: BertEncoder,
        pooler: Option<BertPooler>,
    },
    DistilBert(DistilBertEncoder),
    Deberta {
        encoder: DebertaEncoder,
        pooler: Option<ContextPooler>,
    },
    ModernBert(ModernBertModel),
    Gpt2(Gpt2Model),
    Llama(LlamaModel),
}

impl Backbone {
    fn word_embeddings_mut(&mut self) -> &mut Embedding {
        match self {
            Backbone::Bert { encoder, .. } => encoder.embeddings.word_embeddings_mut(),
            Backbone::DistilBert(e) => e.embeddings.word_embeddings_mut(),
            Backbone::Deberta { encoder, .. } => encoder.embeddings.word_embeddings_mut(),
            Backbone::ModernBert(m) => m.word_embeddings_mut(),
            Backbone::Gpt2(m) => m.word_embeddings_mut(),
            Backbone::Llama(m) => m.word_embeddings_mut(),
        }
    }

    fn word_embeddings(&self) -> &Tensor {
        match self {
            Backbone::Bert { encoder, .. } => encoder.embeddings.word_embeddings(),
            Backbone::DistilBert(e) => e.embeddings.word_embeddings(),
            Backbone::Deberta { encoder, .. } => encoder.embeddings.word_embeddings(),
            Backbone::ModernBert(m) => m.word_embeddings(),
            Backbone::Gpt2(m) => m.word_embeddings(),
            Backbone::Llama(m) => m.word_embeddings(),
        }
    }
}

/// Sequence-classification heads; each family pools the first token its own way.
enum ClassifierHead {
    /// `BertForSequenceClassification`: pooler (dense + tanh) -> dropout -> `classifier`.
    Pooled { classifier: Linear, dropout: f64 },
    /// `DistilBertForSequenceClassification`: `pre_classifier` -> ReLU -> dropout -> `classifier`.
    PreClassifier {
        pre_classifier: Linear,
        classifier: Linear,
        dropout: f64,
    },
    /// `RobertaClassificationHead` (tanh) and `ElectraClassificationHead` (GELU): dropout ->
    /// `classifier.dense` -> activation -> dropout -> `classifier.out_proj`.
    DenseOut {
        dense: Linear,
        out_proj: Linear,
        activation: Activation,
        dropout: f64,
    },
    /// `DebertaV2ForSequenceClassification`: `pooler` (ContextPooler) -> dropout -> `classifier`.
    ContextPooled { classifier: Linear, dropout: f64 },
    /// `ModernBertForSequenceClassification`: the first token or the mean of the real ones ->
    /// `head` -> dropout -> `classifier`.
    ModernBert {
        head: PredictionHead,
        classifier: Linear,
        dropout: f64,
        mean_pooling: bool,
    },
    /// Decoders' `*ForSequenceClassification`: `score` (no bias) on the last token that is not
    /// padding (the rightmost token whose id differs from `pad_token_id`).
    LastToken { score: Linear, pad_token_id: i64 },
}

/// The masked-LM transform shared by the encoder families, with names that differ:
/// dense -> activation -> LayerNorm -> decoder (the word embeddings unless untied) + bias.
/// ELECTRA's generator transforms to its embedding width.
struct MlmHead {
    dense: Linear,
    norm: LayerNorm,
    /// (V, E) own decoder weight when `tie_word_embeddings` is false.
    untied_decoder: Option<Tensor>,
    /// (V) the output bias in use: the head's `bias`, or, untied, the decoder's own
    /// (transformers 5 then leaves BERT's and RoBERTa's head `bias` unused but saved).
    bias: Tensor,
    activation: Activation,
}

enum HeadLayers {
    None,
    Classifier(ClassifierHead),
    /// `*ForTokenClassification`: (ModernBERT's `head` ->) dropout -> `classifier` on every
    /// position.
    TokenClassifier {
        head: Option<PredictionHead>,
        classifier: Linear,
        dropout: f64,
    },
    /// `*ForQuestionAnswering`: (ModernBERT's `head` ->) dropout -> `qa_outputs` (ModernBERT's
    /// `classifier`), start and end logits.
    Qa {
        head: Option<PredictionHead>,
        qa_outputs: Linear,
        dropout: f64,
    },
    Mlm(MlmHead),
    /// `lm_head` (no bias): its own (V, C) weight, or the word embeddings when tied.
    CausalLm {
        untied: Option<Tensor>,
    },
}

/// A transformers `*Model` / `*For*` class: one backbone and one head.
pub struct TaskModel {
    pub config: HfConfig,
    pub head: Head,
    backbone: Backbone,
    head_layers: HeadLayers,
    /// A causal LM's training forward leaves its logits to [`TaskModel::loss`], which makes
    /// them a chunk of rows at a time (`layers::lm_cross_entropy`): the trainer's choice.
    pub chunked_lm_loss: bool,
}

impl TaskModel {
    /// Creates the variables under `root`, newly initialised as transformers initialises them
    /// (the backbone's first, then the head's: the order of the draws).
    /// Load a checkpoint over them with [`weights::load_checkpoint`].
    pub fn new(root: &nn::Path, config: HfConfig, head: Head) -> Result<Self> {
        refuse_head(&config, head)?;
        let backbone = backbone(root, &config, head)?;
        let head_layers = head_layers(root, &config, head)?;
        Ok(TaskModel {
            config,
            head,
            backbone,
            head_layers,
            chunked_lm_loss: false,
        })
    }

    /// For training: the trainable word-embedding table (V, C) when nothing but the input
    /// lookup reads it (no masked-LM or LM head shares it), after making its gradient sparse
    /// (the looked-up rows only, see [`Embedding::sparse_grad`]); its rows then change only
    /// where a step's tokens looked them up, which lets the optimizer update them lazily.
    /// None for tied tables and frozen ones.
    pub fn sparse_lookup_table(&mut self) -> Option<Tensor> {
        let shared = match &self.head_layers {
            HeadLayers::Mlm(m) => m.untied_decoder.is_none(),
            HeadLayers::CausalLm { untied } => untied.is_none(),
            _ => false,
        };
        let table = self.backbone.word_embeddings_mut();
        if shared || !table.weight.requires_grad() {
            return None;
        }
        table.sparse_grad = true;
        Some(table.weight.shallow_clone())
    }

    /// The transformers class this model mirrors, e.g. `BertForQuestionAnswering`.
    pub fn class_name(&self) -> String {
        if (self.config.arch, self.head) == (Arch::Gpt2, Head::CausalLm) {
            return "GPT2LMHeadModel".into();
        }
        format!(
            "{}{}",
            self.config.arch.class_stem(),
            self.head.class_suffix()
        )
    }

    /// Whether a variable is allowed to be absent from a checkpoint (then newly initialised):
    /// task heads and the pooler, as transformers allows.
    pub fn may_be_newly_initialised(&self, name: &str) -> bool {
        if self.head == Head::Base {
            return name.starts_with("pooler.");
        }
        let prefix = self.config.arch.prefix();
        match name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('.'))
        {
            Some(rest) => rest.starts_with("pooler."),
            None => true,
        }
    }

    /// When backward produces a parameter's gradient, as a rank: heads and pooler 0, encoder
    /// layers from the last (1) to the first (L), embeddings L + 1.
    pub fn backward_stage(&self, name: &str) -> usize {
        let layers = self.config.num_layers as usize;
        let prefix = format!("{}.", self.config.arch.prefix());
        let rest = name.strip_prefix(&prefix).unwrap_or(name);
        if ["embeddings.", "wte.", "wpe.", "embed_tokens."]
            .iter()
            .any(|e| rest.starts_with(e))
        {
            return layers + 1;
        }
        // ELECTRA's projection and DeBERTa's relative-position table are complete only when
        // backward has passed every layer.
        if [
            "embeddings_project.",
            "encoder.rel_embeddings.",
            "encoder.LayerNorm.",
        ]
        .iter()
        .any(|e| rest.starts_with(e))
        {
            return layers + 1;
        }
        let layer = ["encoder.layer.", "transformer.layer.", "h.", "layers."]
            .iter()
            .find_map(|p| rest.strip_prefix(p))
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        match layer {
            Some(i) if i < layers => layers - i,
            _ => 0,
        }
    }

    pub fn forward(&self, inputs: &EncoderInputs, train: bool) -> ModelOutput {
        self.forward_impl(inputs, train, None)
    }

    /// As `forward`, with the graph cut at every encoder layer's input, for backward by stages:
    /// `loss.backward()` then yields the gradients of backward stages 0 and 1 (heads and the
    /// last layer, see `backward_stage`), and for boundary k = L-1 down to 0,
    /// `(below * leaf.grad()).sum().backward()` yields stage L + 1 - k — the same gradients as
    /// one backward pass, available layer by layer.
    ///
    /// With `checkpoint`, every layer keeps only its input and runs again in backward
    /// ([`backward_by_stages`]): the same values (its dropout masks are redrawn from the same
    /// seeds), for one layer's activations at a time instead of all of them.
    pub fn forward_staged(
        &self,
        inputs: &EncoderInputs,
        train: bool,
        checkpoint: bool,
    ) -> (ModelOutput, Stages<'_>) {
        self.forward_sharded(inputs, train, checkpoint, None)
    }

    /// As [`TaskModel::forward_staged`], telling `params` when each layer needs its weights
    /// (in forward, and in backward by stages): ZeRO stage 3 fetches them then.
    pub fn forward_sharded<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        checkpoint: bool,
        params: Option<&'a dyn LayerParams>,
    ) -> (ModelOutput, Stages<'a>) {
        let mut stages = Stages {
            cuts: Vec::new(),
            checkpoint,
            params,
        };
        let out = self.forward_impl(inputs, train, Some(&mut stages));
        (out, stages)
    }

    /// The positions of the last hidden state the head reads: the first only for the
    /// classification heads that pool the first token of BERT-like and DistilBERT encoders,
    /// whose last layer then computes just that position.
    fn positions_read(&self) -> Positions {
        let first_token = matches!(
            self.head_layers,
            HeadLayers::Classifier(
                ClassifierHead::Pooled { .. }
                    | ClassifierHead::PreClassifier { .. }
                    | ClassifierHead::DenseOut { .. }
            )
        );
        let encoder = matches!(
            self.backbone,
            Backbone::Bert { .. } | Backbone::DistilBert(_)
        );
        if first_token && encoder {
            Positions::First
        } else {
            Positions::All
        }
    }

    fn forward_impl<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
    ) -> ModelOutput {
        let (hidden, pooled) = self.backbone_forward(inputs, train, stages);
        let logits = match &self.head_layers {
            HeadLayers::None => hidden.shallow_clone(),
            HeadLayers::Classifier(head) => head.forward(&hidden, pooled, inputs, train),
            HeadLayers::TokenClassifier {
                head,
                classifier,
                dropout: p,
            } => classifier.forward(&dropout(&head_input(head, &hidden), *p, train)), // (B, T, L)
            HeadLayers::Qa {
                head,
                qa_outputs,
                dropout: p,
            } => qa_outputs.forward(&dropout(&head_input(head, &hidden), *p, train)),
            HeadLayers::Mlm(m) => {
                let x = m
                    .norm
                    .forward(&activate(m.activation, &m.dense.forward(&hidden)));
                let decoder = m
                    .untied_decoder
                    .as_ref()
                    .unwrap_or_else(|| self.backbone.word_embeddings());
                layers::linear(&x, decoder, Some(&m.bias)) // (B, T, V)
            }
            // Left to the loss, which makes them a chunk at a time: undefined.
            HeadLayers::CausalLm { .. } if train && self.chunked_lm_loss => Tensor::new(),
            HeadLayers::CausalLm { untied } => {
                let weight = untied
                    .as_ref()
                    .unwrap_or_else(|| self.backbone.word_embeddings());
                layers::linear(&hidden, weight, None) // (B, T, V)
            }
        };
        ModelOutput { hidden, logits }
    }

    /// The backbone's last hidden state (B, T, C), and the pooled first token (B, C) where the
    /// model has a pooler.
    fn backbone_forward<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
    ) -> (Tensor, Option<Tensor>) {
        let read = self.positions_read();
        match &self.backbone {
            Backbone::Bert { encoder, pooler } => {
                let hidden = encoder.forward_staged(inputs, train, stages, read);
                let pooled = pooler.as_ref().map(|p| p.forward(&hidden));
                (hidden, pooled)
            }
            Backbone::DistilBert(e) => (e.forward_staged(inputs, train, stages, read), None),
            Backbone::ModernBert(m) => (m.forward_staged(inputs, train, stages), None),
            Backbone::Deberta { encoder, pooler } => {
                let hidden = encoder.forward_staged(inputs, train, stages);
                let pooled = pooler.as_ref().map(|p| p.forward(&hidden, train));
                (hidden, pooled)
            }
            Backbone::Gpt2(m) => (m.forward_staged(inputs, train, stages), None),
            Backbone::Llama(m) => (m.forward_staged(inputs, train, stages), None),
        }
    }

    /// An empty key/value cache for [`TaskModel::forward_cached`].
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.num_layers as usize)
    }

    /// Causal-LM inference without recomputing the past: logits (B, T, V) of `ids` (B, T)
    /// following the positions already in `cache`, which grows by T.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let HeadLayers::CausalLm { untied } = &self.head_layers else {
            bail!(
                "{} has no causal-LM head to generate with",
                self.class_name()
            );
        };
        let hidden = match &self.backbone {
            Backbone::Gpt2(m) => m.forward_cached(ids, cache),
            Backbone::Llama(m) => m.forward_cached(ids, cache),
            _ => bail!("{} is not a decoder", self.class_name()),
        };
        let weight = untied
            .as_ref()
            .unwrap_or_else(|| self.backbone.word_embeddings());
        Ok(layers::linear(&hidden, weight, None))
    }

    /// The loss transformers computes for this head and these labels (mean over the batch).
    pub fn loss(&self, out: &ModelOutput, labels: &Labels) -> Result<Tensor> {
        if let (false, HeadLayers::CausalLm { untied }, Labels::Tokens(y)) =
            (out.logits.defined(), &self.head_layers, labels)
        {
            // Logits left undefined by `chunked_lm_loss`: position t predicts token t + 1.
            let (_, t, c) = out.hidden.size3()?;
            let hidden = out.hidden.narrow(1, 0, t - 1).reshape([-1, c]); // (B (T-1), C)
            let targets = y.narrow(1, 1, t - 1).reshape([-1]);
            let weight = untied
                .as_ref()
                .unwrap_or_else(|| self.backbone.word_embeddings());
            return Ok(layers::lm_cross_entropy(&hidden, weight, &targets));
        }
        let problem = self.config.resolved_problem_type();
        // Losses run in fp32 whatever the compute dtype, as under autocast.
        let out = &ModelOutput {
            hidden: out.hidden.shallow_clone(),
            logits: out.logits.to_kind(tch::Kind::Float),
        };
        Ok(match (self.head, labels) {
            (Head::SequenceClassification, Labels::Classes(y))
                if problem == ProblemType::SingleLabel =>
            {
                mean_cross_entropy(&out.logits, y, self.config.num_labels() as i64)
            }
            (Head::SequenceClassification, Labels::MultiHot(y))
                if problem == ProblemType::MultiLabel =>
            {
                out.logits.binary_cross_entropy_with_logits::<Tensor>(
                    &y.to_kind(out.logits.kind()),
                    None,
                    None,
                    Reduction::Mean,
                )
            }
            (Head::SequenceClassification, Labels::Values(y))
                if problem == ProblemType::Regression =>
            {
                let y = y.to_kind(out.logits.kind());
                if self.config.num_labels() == 1 {
                    out.logits.squeeze().mse_loss(&y.squeeze(), Reduction::Mean)
                } else {
                    out.logits.mse_loss(&y, Reduction::Mean)
                }
            }
            (Head::QuestionAnswering, Labels::Spans { start, end }) => {
                let (s, e) = out.span_logits();
                // Positions outside the sequence are clamped to T and ignored, as in transformers.
                let t = s.size()[1];
                let ce = |logits: &Tensor, y: &Tensor| {
                    logits.cross_entropy_loss::<Tensor>(
                        &y.clamp(0, t),
                        None,
                        Reduction::Mean,
                        t,
                        0.0,
                    )
                };
                (ce(&s, start) + ce(&e, end)) / 2.0
            }
            (Head::TokenClassification, Labels::Tokens(y)) => {
                mean_cross_entropy(&out.logits, y, self.config.num_labels() as i64)
            }
            (Head::MaskedLm, Labels::Tokens(y)) => {
                mean_cross_entropy(&out.logits, y, self.config.vocab_size)
            }
            (Head::CausalLm, Labels::Tokens(y)) => {
                // Position t predicts token t + 1: drop the last logits and the first labels.
                let t = out.logits.size()[1];
                let logits = out.logits.narrow(1, 0, t - 1);
                let targets = y.narrow(1, 1, t - 1);
                mean_cross_entropy(&logits, &targets, self.config.vocab_size)
            }
            (head, labels) => bail!(
                "labels {:?} do not fit head {head:?} with problem type {}",
                std::mem::discriminant(labels),
                problem.as_hf_str()
            ),
        })
    }
}

impl ClassifierHead {
    /// Logits (B, L) from the last hidden state (B, T, C) and, for pooled heads, the pooler's
    /// output.
    fn forward(
        &self,
        hidden: &Tensor,
        pooled: Option<Tensor>,
        inputs: &EncoderInputs,
        train: bool,
    ) -> Tensor {
        let first = hidden.select(1, 0); // (B, C)
        match self {
            ClassifierHead::Pooled {
                classifier,
                dropout: p,
            }
            | ClassifierHead::ContextPooled {
                classifier,
                dropout: p,
            } => {
                let pooled = pooled.expect("pooled classification builds its pooler");
                classifier.forward(&dropout(&pooled, *p, train))
            }
            ClassifierHead::PreClassifier {
                pre_classifier,
                classifier,
                dropout: p,
            } => {
                let x = pre_classifier.forward(&first).relu();
                classifier.forward(&dropout(&x, *p, train))
            }
            ClassifierHead::DenseOut {
                dense,
                out_proj,
                activation,
                dropout: p,
            } => {
                let x = activate(*activation, &dense.forward(&dropout(&first, *p, train)));
                out_proj.forward(&dropout(&x, *p, train))
            }
            ClassifierHead::ModernBert {
                head,
                classifier,
                dropout: p,
                mean_pooling,
            } => {
                let pooled = modernbert::pool(hidden, &inputs.attention_mask, *mean_pooling);
                classifier.forward(&dropout(&head.forward(&pooled), *p, train))
            }
            ClassifierHead::LastToken {
                score,
                pad_token_id,
            } => {
                // Scoring every position then picking one, as transformers does.
                let logits = score.forward(hidden); // (B, T, L)
                let ids = &inputs.input_ids;
                let t = ids.size()[1];
                let positions = Tensor::arange(t, (tch::Kind::Int64, ids.device()));
                let last =
                    (positions * ids.ne(*pad_token_id).to_kind(tch::Kind::Int64)).argmax(-1, false); // (B)
                let rows = Tensor::arange(ids.size()[0], (tch::Kind::Int64, ids.device()));
                logits.index(&[Some(rows), Some(last)])
            }
        }
    }
}

/// A head the architecture does not have is refused before any variable is made.
fn refuse_head(c: &HfConfig, head: Head) -> Result<()> {
    match (c.arch.is_decoder(), head) {
        (true, Head::MaskedLm) => bail!(
            "{} is a causal language model: it has no masked-LM head (model.task \"mlm\")",
            c.arch.class_stem()
        ),
        (true, Head::TokenClassification) => bail!(
            "{} is a causal language model: token classification (model.task \"token-cls\") needs an encoder",
            c.arch.class_stem()
        ),
        (false, Head::CausalLm) => bail!(
            "{} is an encoder: it has no causal-LM head (model.task \"causal-lm\" needs gpt2, llama, mistral, qwen2 or qwen3)",
            c.arch.class_stem()
        ),
        _ => Ok(()),
    }
}

fn modernbert_settings(c: &HfConfig) -> Result<&ModernBertSettings> {
    c.modernbert
        .as_ref()
        .context("a ModernBERT config without its settings")
}

/// ModernBERT's task heads start with its prediction head; the others have none.
fn prediction_head(root: &nn::Path, c: &HfConfig) -> Result<Option<PredictionHead>> {
    Ok(match c.arch {
        Arch::ModernBert => Some(PredictionHead::new(
            root / "head",
            c,
            modernbert_settings(c)?,
        )),
        _ => None,
    })
}

/// The backbone's variables: under `root` for the bare model, under `bert.` / `distilbert.` /
/// `roberta.` ... for a task model.
fn backbone(root: &nn::Path, c: &HfConfig, head: Head) -> Result<Backbone> {
    let bb = if head == Head::Base {
        root.clone()
    } else {
        root / c.arch.prefix()
    };
    Ok(match c.arch {
        Arch::Bert | Arch::Roberta | Arch::XlmRoberta | Arch::Electra => {
            // Only BERT's classifier and the bare model use the pooler (add_pooling_layer);
            // ELECTRA has none.
            let pooled = c.arch != Arch::Electra
                && matches!(
                    (c.arch, head),
                    (Arch::Bert, Head::SequenceClassification) | (_, Head::Base)
                );
            Backbone::Bert {
                encoder: BertEncoder::new(bb.clone(), c),
                pooler: pooled.then(|| BertPooler::new(&bb / "pooler", c)),
            }
        }
        Arch::DistilBert => Backbone::DistilBert(DistilBertEncoder::new(bb, c)),
        Arch::ModernBert => {
            Backbone::ModernBert(ModernBertModel::new(bb, c, modernbert_settings(c)?))
        }
        Arch::DebertaV2 => {
            let d = c
                .deberta
                .as_ref()
                .context("a DeBERTa-v2 config without its settings")?;
            Backbone::Deberta {
                encoder: DebertaEncoder::new(bb, c, d),
                pooler: (head == Head::SequenceClassification)
                    .then(|| ContextPooler::new(root / "pooler", c, d)),
            }
        }
        Arch::Gpt2 => Backbone::Gpt2(Gpt2Model::new(bb, c)),
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 => {
            Backbone::Llama(LlamaModel::new(bb, c))
        }
    })
}

/// The head's variables, named as the transformers class names them.
fn head_layers(root: &nn::Path, c: &HfConfig, head: Head) -> Result<HeadLayers> {
    let (h, r) = (c.hidden_size, c.initializer_range);
    let modernbert = c.arch == Arch::ModernBert;
    Ok(match head {
        Head::Base => HeadLayers::None,
        Head::SequenceClassification => HeadLayers::Classifier(classifier_head(root, c)?),
        Head::TokenClassification => HeadLayers::TokenClassifier {
            head: prediction_head(root, c)?,
            classifier: Linear::new(root / "classifier", h, c.num_labels() as i64, r),
            // DistilBERT and DeBERTa drop out at their general rate; the others at the
            // classifier's (ModernBERT: its classifier_dropout).
            dropout: match c.arch {
                Arch::DistilBert | Arch::DebertaV2 => c.hidden_dropout,
                _ => c.classifier_dropout,
            },
        },
        Head::CausalLm => HeadLayers::CausalLm {
            untied: (!c.tie_word_embeddings)
                .then(|| layers::normal_var(&root.sub("lm_head"), "weight", &[c.vocab_size, h], r)),
        },
        Head::QuestionAnswering => HeadLayers::Qa {
            head: prediction_head(root, c)?,
            qa_outputs: Linear::new(
                root / if modernbert {
                    "classifier"
                } else {
                    "qa_outputs"
                },
                h,
                2,
                r,
            ),
            dropout: if modernbert {
                c.classifier_dropout
            } else {
                c.qa_dropout
            },
        },
        Head::MaskedLm => HeadLayers::Mlm(mlm_head(root, c)?),
    })
}

/// `*ForSequenceClassification`'s head of each family.
fn classifier_head(root: &nn::Path, c: &HfConfig) -> Result<ClassifierHead> {
    let (h, r, n) = (c.hidden_size, c.initializer_range, c.num_labels() as i64);
    Ok(match c.arch {
        Arch::Bert => ClassifierHead::Pooled {
            classifier: Linear::new(root / "classifier", h, n, r),
            dropout: c.classifier_dropout,
        },
        Arch::DistilBert => ClassifierHead::PreClassifier {
            pre_classifier: Linear::new(root / "pre_classifier", h, h, r),
            classifier: Linear::new(root / "classifier", h, n, r),
            dropout: c.classifier_dropout,
        },
        Arch::DebertaV2 => ClassifierHead::ContextPooled {
            classifier: Linear::new(root / "classifier", h, n, r),
            dropout: c.classifier_dropout,
        },
        Arch::ModernBert => ClassifierHead::ModernBert {
            head: PredictionHead::new(root / "head", c, modernbert_settings(c)?),
            classifier: Linear::new(root / "classifier", h, n, r),
            dropout: c.classifier_dropout,
            mean_pooling: modernbert_settings(c)?.mean_pooling,
        },
        Arch::Roberta | Arch::XlmRoberta | Arch::Electra => ClassifierHead::DenseOut {
            dense: Linear::new(root / "classifier" / "dense", h, h, r),
            out_proj: Linear::new(root / "classifier" / "out_proj", h, n, r),
            activation: if c.arch == Arch::Electra {
                Activation::Gelu
            } else {
                Activation::Tanh
            },
            dropout: c.classifier_dropout,
        },
        _ => ClassifierHead::LastToken {
            score: Linear::with_bias(root / "score", h, n, r, false),
            pad_token_id: c.pad_token_id,
        },
    })
}

/// Where each family keeps its masked-LM head: (transform, its LayerNorm, owner of the bias,
/// owner of an untied decoder weight, the transform's activation).
fn mlm_paths<'a>(
    root: &nn::Path<'a>,
    c: &HfConfig,
) -> Result<(
    nn::Path<'a>,
    nn::Path<'a>,
    nn::Path<'a>,
    nn::Path<'a>,
    Activation,
)> {
    Ok(match c.arch {
        // DeBERTa-v2's `legacy` head is BERT's.
        Arch::Bert | Arch::DebertaV2 => {
            let p = root / "cls" / "predictions";
            (
                &p / "transform" / "dense",
                &p / "transform" / "LayerNorm",
                p.clone(),
                &p / "decoder",
                c.activation,
            )
        }
        Arch::DistilBert => {
            let proj = root / "vocab_projector";
            let (dense, norm) = (root / "vocab_transform", root / "vocab_layer_norm");
            (dense, norm, proj.clone(), proj, c.activation)
        }
        Arch::Roberta | Arch::XlmRoberta => {
            let l = root / "lm_head";
            let (dense, norm) = (&l / "dense", &l / "layer_norm");
            (dense, norm, l.clone(), &l / "decoder", Activation::Gelu)
        }
        Arch::ModernBert => {
            let d = root / "decoder";
            let (dense, norm) = (root / "head" / "dense", root / "head" / "norm");
            let activation = modernbert_settings(c)?.classifier_activation;
            (dense, norm, d.clone(), d, activation)
        }
        Arch::Electra => {
            let g = root / "generator_predictions";
            let lm = root / "generator_lm_head";
            let (dense, norm) = (&g / "dense", &g / "LayerNorm");
            (dense, norm, lm.clone(), lm, Activation::Gelu)
        }
        _ => bail!("{} has no masked-LM head", c.arch.class_stem()),
    })
}

/// The masked-LM head: transform, LayerNorm, and a decoder tied to the word embeddings or its
/// own.
fn mlm_head(root: &nn::Path, c: &HfConfig) -> Result<MlmHead> {
    let (dense, norm, bias, decoder, activation) = mlm_paths(root, c)?;
    let (h, r, v, e) = (
        c.hidden_size,
        c.initializer_range,
        c.vocab_size,
        c.embedding_size,
    );
    let head_bias = bias.zeros("bias", &[v]);
    let (untied_decoder, bias) = if c.tie_word_embeddings {
        (None, head_bias)
    } else {
        let weight = layers::normal_var(&decoder, "weight", &[v, e], r);
        // DistilBERT's decoder is `vocab_projector` itself, whose bias is the head bias;
        // ELECTRA's is `generator_lm_head`.
        let own_bias = if matches!(c.arch, Arch::DistilBert | Arch::Electra | Arch::ModernBert) {
            head_bias
        } else {
            decoder.zeros("bias", &[v])
        };
        (Some(weight), own_bias)
    };
    // ModernBERT's head has no biases by default.
    let (dense_bias, norm_bias) = match &c.modernbert {
        Some(m) => (m.classifier_bias, m.norm_bias),
        None => (true, true),
    };
    Ok(MlmHead {
        dense: Linear::with_bias(dense, h, e, r, dense_bias),
        norm: LayerNorm::with_bias(norm, e, c.layer_norm_eps, norm_bias),
        untied_decoder,
        bias,
        activation,
    })
}

/// The hidden state through ModernBERT's prediction head, where there is one.
fn head_input(head: &Option<PredictionHead>, hidden: &Tensor) -> Tensor {
    match head {
        Some(h) => h.forward(hidden),
        None => hidden.shallow_clone(),
    }
}

/// Cross-entropy over (.., classes) logits, averaged over targets that are not -100
/// (PyTorch's default `ignore_index`).
fn mean_cross_entropy(logits: &Tensor, targets: &Tensor, classes: i64) -> Tensor {
    logits.reshape([-1, classes]).cross_entropy_loss::<Tensor>(
        &targets.reshape([-1]),
        None,
        Reduction::Mean,
        -100,
        0.0,
    )
}

/// A model built from a pretrained directory, with its variables and what the load did.
pub struct Pretrained {
    pub vs: nn::VarStore,
    pub model: TaskModel,
    pub report: weights::LoadReport,
}

/// Reads `dir`'s config.json and lets `adapt` change it.
pub fn read_config(
    dir: &std::path::Path,
    adapt: impl FnOnce(&mut HfConfig) -> Result<()>,
) -> Result<HfConfig> {
    let config_path = dir.join(crate::io::hf_files::CONFIG_FILE);
    if !config_path.is_file() {
        bail!(
            "no {} in model directory {}",
            crate::io::hf_files::CONFIG_FILE,
            dir.display()
        );
    }
    let mut config = HfConfig::from_file(&config_path)?;
    adapt(&mut config)?;
    Ok(config)
}

/// Creates the model's variables for `config`, initialised as transformers initialises them
/// (seeded).
fn build(config: HfConfig, head: Head, seed: i64) -> Result<(nn::VarStore, TaskModel)> {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = TaskModel::new(&vs.root(), config, head)?;
    if model.config.lora.is_some() {
        // Only the adapters train: the base model's weights are frozen.
        for (name, var) in vs.variables() {
            if !lora::is_adapter_variable(&name) {
                let _ = var.set_requires_grad(false);
            }
        }
    }
    Ok((vs, model))
}

/// The `head` model's variables for `config` with their weights uninitialised (no memory
/// touched, whatever the model's size): what the memory preflight counts.
pub fn skeleton(config: HfConfig, head: Head) -> Result<(nn::VarStore, TaskModel)> {
    layers::skeleton(|| build(config, head, 0))
}

/// Builds the `head` model from `dir` (config.json + safetensors), like transformers'
/// `AutoModelFor*.from_pretrained`. `adapt` may change the config first (labels of a new
/// head, problem type). New heads are initialised from `seed`.
pub fn from_pretrained(
    dir: &std::path::Path,
    head: Head,
    adapt: impl FnOnce(&mut HfConfig) -> Result<()>,
    seed: i64,
) -> Result<Pretrained> {
    from_pretrained_with(dir, read_config(dir, adapt)?, head, seed)
}

/// [`from_pretrained`] with `dir`'s config.json already read (and adapted) into `config`.
pub fn from_pretrained_with(
    dir: &std::path::Path,
    config: HfConfig,
    head: Head,
    seed: i64,
) -> Result<Pretrained> {
    use anyhow::Context;
    let (vs, model) = build(config, head, seed)?;
    let checkpoint = weights::read_checkpoint(dir)?;
    let report = weights::load_checkpoint(&vs, &model, checkpoint)
        .with_context(|| format!("cannot load {} from {}", model.class_name(), dir.display()))?;
    Ok(Pretrained { vs, model, report })
}

/// Builds the `head` model from `dir`'s config.json alone, every parameter initialised as
/// transformers' `_init_weights` does (seeded); the report lists them all as new.
pub fn from_config(
    dir: &std::path::Path,
    head: Head,
    adapt: impl FnOnce(&mut HfConfig) -> Result<()>,
    seed: i64,
) -> Result<Pretrained> {
    from_config_with(read_config(dir, adapt)?, head, seed)
}

/// [`from_config`] with the config already read (and adapted).
pub fn from_config_with(config: HfConfig, head: Head, seed: i64) -> Result<Pretrained> {
    let (vs, model) = build(config, head, seed)?;
    let mut newly_initialised: Vec<String> = vs.variables().into_keys().collect();
    newly_initialised.sort();
    let report = weights::LoadReport {
        loaded: 0,
        unused: Vec::new(),
        newly_initialised,
    };
    Ok(Pretrained { vs, model, report })
}
