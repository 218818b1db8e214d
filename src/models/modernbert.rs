//! ModernBERT: a pre-norm encoder with rotary positions, GeGLU feed-forward blocks, norms
//! without biases, and attention alternating between global layers and local ones that see
//! only keys within half `local_attention` of the query.
//!
//! Mirrors transformers/models/modernbert/modeling_modernbert.py (transformers 5.23.0), its
//! padded (SDPA) path.

use tch::{nn, Kind, Tensor};

use super::hf_config::{Activation, HfConfig, ModernBertSettings, Rope, RopeScaling};
use super::layers::{
    activate, causal_attention, dropout, CausalMask, Embedding, LayerNorm, Linear,
};
use super::llama::{apply_rotary, Rotary};
use super::{run_stack, EncoderInputs, Stages};

/// `ModernBertEncoderLayer`: `attn_norm` (none in layer 0), `attn.{Wqkv,Wo}`, `mlp_norm`,
/// `mlp.{Wi,Wo}`.
#[derive(Debug)]
struct ModernBertLayer {
    attn_norm: Option<LayerNorm>,
    wqkv: Linear,
    wo: Linear,
    mlp_norm: LayerNorm,
    wi: Linear,
    mlp_wo: Linear,
    local: bool,
    num_heads: i64,
    activation: Activation,
    attention_dropout: f64,
    mlp_dropout: f64,
}

/// What every layer shares: (cos, sin) and the mask of each attention kind.
struct LayerContext {
    global: (Tensor, Tensor, CausalMask),
    local: (Tensor, Tensor, CausalMask),
}

impl ModernBertLayer {
    fn new(p: nn::Path, i: i64, c: &HfConfig, m: &ModernBertSettings) -> Self {
        let (h, inter, r, eps) = (
            c.hidden_size,
            c.intermediate_size,
            c.initializer_range,
            c.layer_norm_eps,
        );
        ModernBertLayer {
            attn_norm: (i > 0).then(|| LayerNorm::with_bias(&p / "attn_norm", h, eps, m.norm_bias)),
            wqkv: Linear::with_bias(&p / "attn" / "Wqkv", h, 3 * h, r, m.attention_bias),
            wo: Linear::with_bias(&p / "attn" / "Wo", h, h, r, m.attention_bias),
            mlp_norm: LayerNorm::with_bias(&p / "mlp_norm", h, eps, m.norm_bias),
            wi: Linear::with_bias(&p / "mlp" / "Wi", h, 2 * inter, r, m.mlp_bias),
            mlp_wo: Linear::with_bias(&p / "mlp" / "Wo", inter, h, r, m.mlp_bias),
            local: m.local_layers.get(i as usize).copied().unwrap_or(false),
            num_heads: c.num_heads,
            activation: c.activation,
            attention_dropout: c.attention_dropout,
            mlp_dropout: m.mlp_dropout,
        }
    }

    fn forward(&self, x: &Tensor, ctx: &LayerContext, train: bool) -> Tensor {
        let (b, t, c) = x.size3().expect("(B, T, C)");
        let normed = match &self.attn_norm {
            Some(n) => n.forward(x),
            None => x.shallow_clone(),
        };
        let (heads, d) = (self.num_heads, c / self.num_heads);
        let qkv = self.wqkv.forward(&normed).view([b, t, 3, heads, d]);
        let split = |i: i64| qkv.select(2, i).transpose(1, 2); // (B, H, T, D)
        let (cos, sin, mask) = if self.local { &ctx.local } else { &ctx.global };
        let q = apply_rotary(&split(0), cos, sin);
        let k = apply_rotary(&split(1), cos, sin);
        let attended = causal_attention(&q, &k, &split(2), mask, self.attention_dropout, train); // (B, T, C)
        let x = x + dropout(&self.wo.forward(&attended), self.attention_dropout, train);
        let gates = self.wi.forward(&self.mlp_norm.forward(&x)).chunk(2, -1); // 2 x (B, T, I)
        let inner = activate(self.activation, &gates[0]) * &gates[1];
        &x + self
            .mlp_wo
            .forward(&dropout(&inner, self.mlp_dropout, train))
    }
}

/// `ModernBertModel`: `embeddings.{tok_embeddings,norm}`, `layers`, `final_norm`.
#[derive(Debug)]
pub struct ModernBertModel {
    tok_embeddings: Embedding,
    embedding_norm: LayerNorm,
    embedding_dropout: f64,
    layers: Vec<ModernBertLayer>,
    final_norm: LayerNorm,
    global_rotary: Rotary,
    local_rotary: Rotary,
    half_window: i64,
}

impl ModernBertModel {
    pub fn new(p: nn::Path, c: &HfConfig, m: &ModernBertSettings) -> Self {
        let (h, eps) = (c.hidden_size, c.layer_norm_eps);
        let rotary = |theta: f64| {
            Rotary::new(
                &Rope {
                    theta,
                    scaling: RopeScaling::None,
                },
                h / c.num_heads,
            )
        };
        ModernBertModel {
            tok_embeddings: Embedding::new(
                &p / "embeddings" / "tok_embeddings",
                c.vocab_size,
                h,
                c.initializer_range,
                Some(c.pad_token_id),
            ),
            embedding_norm: LayerNorm::with_bias(&p / "embeddings" / "norm", h, eps, m.norm_bias),
            embedding_dropout: c.embedding_dropout,
            layers: (0..c.num_layers)
                .map(|i| ModernBertLayer::new(&p / "layers" / i, i, c, m))
                .collect(),
            final_norm: LayerNorm::with_bias(&p / "final_norm", h, eps, m.norm_bias),
            global_rotary: rotary(m.global_rope_theta),
            local_rotary: rotary(m.local_rope_theta),
            half_window: m.half_window,
        }
    }

    pub fn word_embeddings(&self) -> &Tensor {
        &self.tok_embeddings.weight
    }

    pub fn word_embeddings_mut(&mut self) -> &mut Embedding {
        &mut self.tok_embeddings
    }

    /// The last hidden state (after `final_norm`), (B, T, C); with `stages`, cut at every
    /// layer's input.
    pub fn forward_staged<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
    ) -> Tensor {
        let ids = &inputs.input_ids;
        let (b, t) = ids.size2().expect("input ids are (B, T)");
        let keys = inputs.attention_mask.ne(0).view([b, 1, 1, t]);
        let positions = Tensor::arange(t, (Kind::Int64, ids.device()));
        let near = (positions.view([-1, 1]) - positions.view([1, -1]))
            .abs()
            .le(self.half_window)
            .view([1, 1, t, t]);
        let full_mask = keys.expand([b, 1, t, t], false);
        let (gc, gs) = self.global_rotary.tables(0, t);
        let (lc, ls) = self.local_rotary.tables(0, t);
        let ctx = LayerContext {
            global: (gc, gs, CausalMask::Explicit(full_mask)),
            local: (lc, ls, CausalMask::Explicit(keys.logical_and(&near))),
        };
        let x = dropout(
            &self
                .embedding_norm
                .forward(&self.tok_embeddings.forward(ids)),
            self.embedding_dropout,
            train,
        );
        let x = run_stack(x, &self.layers, stages, move |layer, x| {
            layer.forward(x, &ctx, train)
        });
        self.final_norm.forward(&x)
    }
}

/// `ModernBertPredictionHead`: `dense` -> `classifier_activation` -> `norm`, before every
/// task head.
#[derive(Debug)]
pub struct PredictionHead {
    dense: Linear,
    activation: Activation,
    norm: LayerNorm,
}

impl PredictionHead {
    pub fn new(p: nn::Path, c: &HfConfig, m: &ModernBertSettings) -> Self {
        let h = c.hidden_size;
        PredictionHead {
            dense: Linear::with_bias(&p / "dense", h, h, c.initializer_range, m.classifier_bias),
            activation: m.classifier_activation,
            norm: LayerNorm::with_bias(&p / "norm", h, c.layer_norm_eps, m.norm_bias),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.norm
            .forward(&activate(self.activation, &self.dense.forward(x)))
    }
}

/// Sequence classification's pooling: the first token, or the mean over real tokens.
pub fn pool(hidden: &Tensor, attention_mask: &Tensor, mean: bool) -> Tensor {
    if !mean {
        return hidden.select(1, 0); // (B, C)
    }
    let m = attention_mask.unsqueeze(-1).to_kind(hidden.kind()); // (B, T, 1)
    (hidden * &m).sum_dim_intlist(1, false, None) / attention_mask.sum_dim_intlist(1, true, None)
}
