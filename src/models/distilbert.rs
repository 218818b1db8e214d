//! DistilBERT encoder.
//!
//! Mirrors transformers/models/distilbert/modeling_distilbert.py (transformers 5.23.0).

use tch::{nn, Kind, Tensor};

use super::hf_config::{Activation, HfConfig};
use super::layers::{
    activate, attention_inputs, dropout, key_mask, multi_head_attention, Embedding, LayerNorm,
    Linear, Positions,
};
use super::{run_stack_reading, EncoderInputs, Stages};

/// `Embeddings`: word + position, LayerNorm, dropout (no token types).
#[derive(Debug)]
pub struct DistilBertEmbeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    layer_norm: LayerNorm,
    dropout: f64,
}

/// transformers' `create_sinusoidal_embeddings`: sin on even columns, cos on odd ones.
fn sinusoidal_table(n_pos: i64, dim: i64) -> Tensor {
    let pos = Tensor::arange(n_pos, (Kind::Double, tch::Device::Cpu)).unsqueeze(1); // (P, 1)
    let j = Tensor::arange(dim, (Kind::Double, tch::Device::Cpu)); // (C)
    let exponent = (&j / 2).floor() * 2.0 / dim as f64;
    let angles = pos / Tensor::from(10000.0f64).pow(&exponent).unsqueeze(0); // (P, C)
    let table = Tensor::zeros([n_pos, dim], (Kind::Double, tch::Device::Cpu));
    let even = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, tch::Device::Cpu));
    let odd = Tensor::arange_start_step(1, dim, 2, (Kind::Int64, tch::Device::Cpu));
    let table = table.index_copy(1, &even, &angles.index_select(1, &even).sin());
    table
        .index_copy(1, &odd, &angles.index_select(1, &odd).cos())
        .to_kind(Kind::Float)
}

impl DistilBertEmbeddings {
    fn new(p: nn::Path, c: &HfConfig) -> Self {
        let r = c.initializer_range;
        let position_embeddings = if c.sinusoidal_pos_embds {
            Embedding::frozen(
                &p / "position_embeddings",
                sinusoidal_table(c.max_position_embeddings, c.hidden_size),
            )
        } else {
            Embedding::new(
                &p / "position_embeddings",
                c.max_position_embeddings,
                c.hidden_size,
                r,
                None,
            )
        };
        DistilBertEmbeddings {
            word_embeddings: Embedding::new(
                &p / "word_embeddings",
                c.vocab_size,
                c.hidden_size,
                r,
                Some(c.pad_token_id),
            ),
            position_embeddings,
            layer_norm: LayerNorm::new(&p / "LayerNorm", c.hidden_size, c.layer_norm_eps),
            dropout: c.hidden_dropout,
        }
    }

    fn forward(&self, ids: &Tensor, train: bool) -> Tensor {
        let t = ids.size()[1];
        let positions = Tensor::arange(t, (Kind::Int64, ids.device())).unsqueeze(0);
        let x = self.word_embeddings.forward(ids) + self.position_embeddings.forward(&positions); // (B, T, C)
        dropout(&self.layer_norm.forward(&x), self.dropout, train)
    }

    pub fn word_embeddings(&self) -> &Tensor {
        &self.word_embeddings.weight
    }

    pub fn word_embeddings_mut(&mut self) -> &mut Embedding {
        &mut self.word_embeddings
    }
}

/// `TransformerBlock`: `attention.{q_lin,k_lin,v_lin,out_lin}`, `sa_layer_norm`,
/// `ffn.{lin1,lin2}`, `output_layer_norm` (post-norm, like BERT).
#[derive(Debug)]
struct TransformerBlock {
    q_lin: Linear,
    k_lin: Linear,
    v_lin: Linear,
    out_lin: Linear,
    sa_layer_norm: LayerNorm,
    lin1: Linear,
    lin2: Linear,
    output_layer_norm: LayerNorm,
    num_heads: i64,
    activation: Activation,
    dropout: f64,
    attention_dropout: f64,
}

impl TransformerBlock {
    fn new(p: nn::Path, c: &HfConfig) -> Self {
        let (h, i, r, eps) = (
            c.hidden_size,
            c.intermediate_size,
            c.initializer_range,
            c.layer_norm_eps,
        );
        let attn = &p / "attention";
        TransformerBlock {
            q_lin: Linear::new(&attn / "q_lin", h, h, r),
            k_lin: Linear::new(&attn / "k_lin", h, h, r),
            v_lin: Linear::new(&attn / "v_lin", h, h, r),
            out_lin: Linear::new(&attn / "out_lin", h, h, r),
            sa_layer_norm: LayerNorm::new(&p / "sa_layer_norm", h, eps),
            lin1: Linear::new(&p / "ffn" / "lin1", h, i, r),
            lin2: Linear::new(&p / "ffn" / "lin2", i, h, r),
            output_layer_norm: LayerNorm::new(&p / "output_layer_norm", h, eps),
            num_heads: c.num_heads,
            activation: c.activation,
            dropout: c.hidden_dropout,
            attention_dropout: c.attention_dropout,
        }
    }

    /// (B, T, C) -> (B, T, C), or (B, 1, C) for `Positions::First`.
    fn forward(&self, x: &Tensor, mask: &Tensor, train: bool, positions: Positions) -> Tensor {
        let projections = (&self.q_lin, &self.k_lin, &self.v_lin);
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
        let sa = self
            .sa_layer_norm
            .forward(&(self.out_lin.forward(&ctx) + &x));
        let ffn = self
            .lin2
            .forward(&activate(self.activation, &self.lin1.forward(&sa)));
        self.output_layer_norm
            .forward(&(dropout(&ffn, self.dropout, train) + sa))
    }
}

/// `DistilBertModel`: embeddings and `transformer.layer.*`.
#[derive(Debug)]
pub struct DistilBertEncoder {
    pub embeddings: DistilBertEmbeddings,
    layers: Vec<TransformerBlock>,
}

impl DistilBertEncoder {
    pub fn new(p: nn::Path, c: &HfConfig) -> Self {
        let layer_path = &p / "transformer" / "layer";
        DistilBertEncoder {
            embeddings: DistilBertEmbeddings::new(&p / "embeddings", c),
            layers: (0..c.num_layers)
                .map(|i| TransformerBlock::new(&layer_path / i, c))
                .collect(),
        }
    }

    /// Returns the last hidden state, (B, T, C). Token type ids are ignored, as in transformers.
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
        run_stack_reading(
            self.embeddings.forward(&inputs.input_ids, train),
            &self.layers,
            stages,
            read,
            move |layer, x, positions| layer.forward(x, &mask, train, positions),
        )
    }
}
