//! BERT, RoBERTa (and XLM-RoBERTa) and ELECTRA encoders. RoBERTa is BERT with position ids
//! that start after the padding index and skip padding; ELECTRA is BERT with embeddings of
//! their own width projected to the hidden size (`embeddings_project`), so one implementation
//! serves all.
//!
//! Mirrors transformers/models/bert/modeling_bert.py, transformers/models/roberta/modeling_roberta.py
//! and transformers/models/electra/modeling_electra.py (transformers 5.23.0).

use tch::{nn, Kind, Tensor};

use super::hf_config::{Activation, Arch, HfConfig};
use super::layers::{
    activate, attention_inputs, dropout, key_mask, multi_head_attention, Embedding, LayerNorm,
    Linear, Positions,
};
use super::{run_stack_reading, EncoderInputs, Stages};

/// How position ids are derived from the input ids.
#[derive(Debug, Clone, Copy)]
enum PositionIds {
    /// 0..T for every row (BERT).
    Absolute,
    /// padding_idx + 1 + index among non-padding tokens; padding keeps padding_idx (RoBERTa's
    /// `create_position_ids_from_input_ids`).
    AfterPadding(i64),
}

/// `BertEmbeddings` / `RobertaEmbeddings`.
#[derive(Debug)]
pub struct BertEmbeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
    positions: PositionIds,
    dropout: f64,
}

impl BertEmbeddings {
    fn new(p: nn::Path, c: &HfConfig) -> Self {
        let r = c.initializer_range;
        let (positions, position_padding) = match c.arch {
            Arch::Roberta | Arch::XlmRoberta => (
                PositionIds::AfterPadding(c.pad_token_id),
                Some(c.pad_token_id),
            ),
            _ => (PositionIds::Absolute, None),
        };
        BertEmbeddings {
            word_embeddings: Embedding::new(
                &p / "word_embeddings",
                c.vocab_size,
                c.embedding_size,
                r,
                Some(c.pad_token_id),
            ),
            position_embeddings: Embedding::new(
                &p / "position_embeddings",
                c.max_position_embeddings,
                c.embedding_size,
                r,
                position_padding,
            ),
            token_type_embeddings: Embedding::new(
                &p / "token_type_embeddings",
                c.type_vocab_size.max(1),
                c.embedding_size,
                r,
                None,
            ),
            layer_norm: LayerNorm::new(&p / "LayerNorm", c.embedding_size, c.layer_norm_eps),
            positions,
            dropout: c.hidden_dropout,
        }
    }

    fn forward(&self, inputs: &EncoderInputs, train: bool) -> Tensor {
        let ids = &inputs.input_ids; // (B, T)
        let (b, t) = ids.size2().expect("input ids are (B, T)");
        let position_ids = match self.positions {
            PositionIds::Absolute => Tensor::arange(t, (Kind::Int64, ids.device())).unsqueeze(0),
            PositionIds::AfterPadding(pad) => {
                let not_pad = ids.ne(pad).to_kind(Kind::Int64);
                not_pad.cumsum(1, Kind::Int64) * &not_pad + pad
            }
        };
        let token_types = match &inputs.token_type_ids {
            Some(tt) => tt.shallow_clone(),
            None => Tensor::zeros([b, t], (Kind::Int64, ids.device())),
        };
        let x = self.word_embeddings.forward(ids)
            + self.position_embeddings.forward(&position_ids)
            + self.token_type_embeddings.forward(&token_types); // (B, T, C)
        dropout(&self.layer_norm.forward(&x), self.dropout, train)
    }

    pub fn word_embeddings(&self) -> &Tensor {
        &self.word_embeddings.weight
    }

    pub fn word_embeddings_mut(&mut self) -> &mut Embedding {
        &mut self.word_embeddings
    }
}

/// `BertLayer`: `attention.self.{query,key,value}`, `attention.output.{dense,LayerNorm}`,
/// `intermediate.dense`, `output.{dense,LayerNorm}`.
#[derive(Debug)]
struct BertLayer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_output: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
    num_heads: i64,
    activation: Activation,
    hidden_dropout: f64,
    attention_dropout: f64,
}

impl BertLayer {
    fn new(p: nn::Path, c: &HfConfig) -> Self {
        let (h, i, r) = (c.hidden_size, c.intermediate_size, c.initializer_range);
        let attn = &p / "attention";
        BertLayer {
            query: Linear::new(&attn / "self" / "query", h, h, r),
            key: Linear::new(&attn / "self" / "key", h, h, r),
            value: Linear::new(&attn / "self" / "value", h, h, r),
            attention_output: Linear::new(&attn / "output" / "dense", h, h, r),
            attention_norm: LayerNorm::new(&attn / "output" / "LayerNorm", h, c.layer_norm_eps),
            intermediate: Linear::new(&p / "intermediate" / "dense", h, i, r),
            output: Linear::new(&p / "output" / "dense", i, h, r),
            output_norm: LayerNorm::new(&p / "output" / "LayerNorm", h, c.layer_norm_eps),
            num_heads: c.num_heads,
            activation: c.activation,
            hidden_dropout: c.hidden_dropout,
            attention_dropout: c.attention_dropout,
        }
    }

    /// (B, T, C) -> (B, T, C), or (B, 1, C) for `Positions::First`.
    fn forward(&self, x: &Tensor, mask: &Tensor, train: bool, positions: Positions) -> Tensor {
        let projections = (&self.query, &self.key, &self.value);
        let (q, k, v, x) = attention_inputs(x, projections, positions, train);
        let ctx = multi_head_attention(
            &q,
            &k,
            &v,
            mask,
            self.num_heads,
            self.attention_dropout,
            train,
        ); // (B, T, C)
        let attended = self.attention_norm.forward(
            &(dropout(
                &self.attention_output.forward(&ctx),
                self.hidden_dropout,
                train,
            ) + &x),
        );
        let inner = activate(self.activation, &self.intermediate.forward(&attended)); // (B, T, I)
        self.output_norm.forward(
            &(dropout(&self.output.forward(&inner), self.hidden_dropout, train) + attended),
        )
    }
}

/// `BertModel` / `RobertaModel` without the pooler, `ElectraModel`: embeddings (projected to
/// the hidden size where their width differs) and the encoder stack.
#[derive(Debug)]
pub struct BertEncoder {
    pub embeddings: BertEmbeddings,
    /// ELECTRA's `embeddings_project` (E -> C), when `embedding_size` != `hidden_size`.
    embeddings_project: Option<Linear>,
    layers: Vec<BertLayer>,
}

impl BertEncoder {
    pub fn new(p: nn::Path, c: &HfConfig) -> Self {
        let layer_path = &p / "encoder" / "layer";
        BertEncoder {
            embeddings: BertEmbeddings::new(&p / "embeddings", c),
            embeddings_project: (c.embedding_size != c.hidden_size).then(|| {
                Linear::new(
                    &p / "embeddings_project",
                    c.embedding_size,
                    c.hidden_size,
                    c.initializer_range,
                )
            }),
            layers: (0..c.num_layers)
                .map(|i| BertLayer::new(&layer_path / i, c))
                .collect(),
        }
    }

    /// Returns the last hidden state, (B, T, C).
    pub fn forward(&self, inputs: &EncoderInputs, train: bool) -> Tensor {
        self.forward_staged(inputs, train, None, Positions::All)
    }

    /// As `forward`, the last hidden state at the positions `read` ((B, 1, C) for the first
    /// only); with `stages`, each layer's input is cut from the graph (a leaf that
    /// requires grad) and recorded with the tensor it was cut from, so backward can run layer
    /// by layer (see `TaskModel::forward_staged`).
    pub fn forward_staged<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
        read: Positions,
    ) -> Tensor {
        let mask = key_mask(&inputs.attention_mask);
        let embedded = self.embeddings.forward(inputs, train); // (B, T, E)
        let embedded = match &self.embeddings_project {
            Some(project) => project.forward(&embedded), // (B, T, C)
            None => embedded,
        };
        run_stack_reading(
            embedded,
            &self.layers,
            stages,
            read,
            move |layer, x, positions| layer.forward(x, &mask, train, positions),
        )
    }
}

/// `BertPooler`: dense + tanh on the first token.
#[derive(Debug)]
pub struct BertPooler {
    dense: Linear,
}

impl BertPooler {
    pub fn new(p: nn::Path, c: &HfConfig) -> Self {
        BertPooler {
            dense: Linear::new(
                &p / "dense",
                c.hidden_size,
                c.hidden_size,
                c.initializer_range,
            ),
        }
    }

    /// (B, T, C) -> (B, C)
    pub fn forward(&self, hidden: &Tensor) -> Tensor {
        self.dense.forward(&hidden.select(1, 0)).tanh()
    }
}
