//! DeBERTa-v2 and -v3 encoders: disentangled attention, where each head scores
//! content-to-content, content-to-position (c2p) and position-to-content (p2c) terms, the
//! positions being relative distances, log-bucketed beyond half the bucket count.
//!
//! Mirrors transformers/models/deberta_v2/modeling_deberta_v2.py (transformers 5.23.0).
//! The ConvLayer of the v2 xlarge checkpoints (`conv_kernel_size` > 0) is not supported.

use tch::{nn, Kind, Tensor};

use super::hf_config::{Activation, DebertaSettings, HfConfig};
use super::layers::{activate, dropout, Embedding, LayerNorm, Linear};
use super::{run_stack, EncoderInputs, Stages};

/// `build_relative_position`: (T, T) query position minus key position, log-bucketed as
/// `make_log_bucket_position` does (in fp32, as there) when `buckets` > 0.
fn relative_positions(t: i64, buckets: i64, max_position: i64, device: tch::Device) -> Tensor {
    let ids = Tensor::arange(t, (Kind::Int64, device));
    let rel = ids.unsqueeze(1) - ids.unsqueeze(0); // (T, T)
    if buckets <= 0 || max_position <= 0 {
        return rel;
    }
    let mid = buckets / 2;
    let sign = rel.sign();
    let near = rel.lt(mid).logical_and(&rel.gt(-mid));
    let abs_pos = rel
        .abs()
        .where_self(&near.logical_not(), &Tensor::from(mid - 1));
    let base = Tensor::from(((max_position - 1) as f64 / mid as f64) as f32).log();
    let log_pos = ((abs_pos.to_kind(Kind::Float) / mid as f64).log() / base * (mid - 1) as f64)
        .ceil()
        + mid as f64;
    rel.to_kind(Kind::Float)
        .where_self(&abs_pos.le(mid), &(log_pos * sign))
        .to_kind(Kind::Int64)
}

/// `DebertaV2Embeddings`: word (+ absolute positions) (+ token types), projected to the
/// hidden size where `embedding_size` differs, LayerNorm, zeroed at padding, dropout.
#[derive(Debug)]
pub struct DebertaEmbeddings {
    word_embeddings: Embedding,
    position_embeddings: Option<Embedding>,
    token_type_embeddings: Option<Embedding>,
    embed_proj: Option<Linear>,
    layer_norm: LayerNorm,
    dropout: f64,
}

impl DebertaEmbeddings {
    fn new(p: nn::Path, c: &HfConfig, d: &DebertaSettings) -> Self {
        let (e, r) = (c.embedding_size, c.initializer_range);
        DebertaEmbeddings {
            word_embeddings: Embedding::new(
                &p / "word_embeddings",
                c.vocab_size,
                e,
                r,
                Some(c.pad_token_id),
            ),
            position_embeddings: d.position_biased_input.then(|| {
                Embedding::new(
                    &p / "position_embeddings",
                    c.max_position_embeddings,
                    e,
                    r,
                    None,
                )
            }),
            token_type_embeddings: (c.type_vocab_size > 0).then(|| {
                Embedding::new(&p / "token_type_embeddings", c.type_vocab_size, e, r, None)
            }),
            embed_proj: (e != c.hidden_size)
                .then(|| Linear::with_bias(&p / "embed_proj", e, c.hidden_size, r, false)),
            layer_norm: LayerNorm::new(&p / "LayerNorm", c.hidden_size, c.layer_norm_eps),
            dropout: c.hidden_dropout,
        }
    }

    fn forward(&self, inputs: &EncoderInputs, train: bool) -> Tensor {
        let ids = &inputs.input_ids; // (B, T)
        let (b, t) = ids.size2().expect("input ids are (B, T)");
        let x = self.word_embeddings.forward(ids); // (B, T, E)
        let x = match &self.position_embeddings {
            Some(pe) => {
                x + pe.forward(&Tensor::arange(t, (Kind::Int64, ids.device())).unsqueeze(0))
            }
            None => x,
        };
        let x = match &self.token_type_embeddings {
            Some(te) => {
                let types = match &inputs.token_type_ids {
                    Some(tt) => tt.shallow_clone(),
                    None => Tensor::zeros([b, t], (Kind::Int64, ids.device())),
                };
                x + te.forward(&types)
            }
            None => x,
        };
        let x = match &self.embed_proj {
            Some(proj) => proj.forward(&x), // (B, T, C)
            None => x,
        };
        let x = self.layer_norm.forward(&x);
        let keep = inputs.attention_mask.unsqueeze(2).to_kind(x.kind());
        dropout(&(x * keep), self.dropout, train)
    }

    pub fn word_embeddings(&self) -> &Tensor {
        &self.word_embeddings.weight
    }

    pub fn word_embeddings_mut(&mut self) -> &mut Embedding {
        &mut self.word_embeddings
    }
}

/// `(B, T, C)` -> `(B * H, T, D)`, as `transpose_for_scores`.
fn split_heads(x: &Tensor, heads: i64) -> Tensor {
    let (b, t, c) = x.size3().expect("(B, T, C)");
    x.view([b, t, heads, c / heads])
        .permute([0, 2, 1, 3])
        .contiguous()
        .view([b * heads, t, c / heads])
}

/// `DebertaV2Layer`: `attention.self.{query_proj,key_proj,value_proj[,pos_key_proj,
/// pos_query_proj]}`, `attention.output.{dense,LayerNorm}`, `intermediate.dense`,
/// `output.{dense,LayerNorm}`.
#[derive(Debug)]
struct DebertaLayer {
    query: Linear,
    key: Linear,
    value: Linear,
    pos_key: Option<Linear>,
    pos_query: Option<Linear>,
    attention_output: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
    num_heads: i64,
    activation: Activation,
    hidden_dropout: f64,
    attention_dropout: f64,
    settings: DebertaSettings,
}

/// What every layer shares: the pairwise mask and relative positions, and the relative
/// embedding table with its LayerNorm.
struct LayerContext<'a> {
    /// (B, 1, T, T) true where query i may attend key j (both real tokens).
    pair_mask: Tensor,
    /// (T, T) bucketed relative positions.
    relative: Tensor,
    rel_embeddings: Option<&'a Embedding>,
    rel_norm: Option<&'a LayerNorm>,
}

impl DebertaLayer {
    fn new(p: nn::Path, c: &HfConfig, d: &DebertaSettings) -> Self {
        let (h, i, r) = (c.hidden_size, c.intermediate_size, c.initializer_range);
        let attn = &p / "attention";
        let own = !d.share_att_key && d.relative_attention;
        DebertaLayer {
            query: Linear::new(&attn / "self" / "query_proj", h, h, r),
            key: Linear::new(&attn / "self" / "key_proj", h, h, r),
            value: Linear::new(&attn / "self" / "value_proj", h, h, r),
            pos_key: (own && d.c2p).then(|| Linear::new(&attn / "self" / "pos_key_proj", h, h, r)),
            pos_query: (own && d.p2c)
                .then(|| Linear::new(&attn / "self" / "pos_query_proj", h, h, r)),
            attention_output: Linear::new(&attn / "output" / "dense", h, h, r),
            attention_norm: LayerNorm::new(&attn / "output" / "LayerNorm", h, c.layer_norm_eps),
            intermediate: Linear::new(&p / "intermediate" / "dense", h, i, r),
            output: Linear::new(&p / "output" / "dense", i, h, r),
            output_norm: LayerNorm::new(&p / "output" / "LayerNorm", h, c.layer_norm_eps),
            num_heads: c.num_heads,
            activation: c.activation,
            hidden_dropout: c.hidden_dropout,
            attention_dropout: c.attention_dropout,
            settings: d.clone(),
        }
    }

    /// `disentangled_attention_bias`: the c2p and p2c scores, (B * H, T, T).
    fn relative_bias(
        &self,
        q: &Tensor,
        k: &Tensor,
        ctx: &LayerContext,
        scale_factor: f64,
        train: bool,
    ) -> Option<Tensor> {
        let table = ctx.rel_embeddings?;
        let s = &self.settings;
        let mut rel = table.weight.shallow_clone();
        if let Some(norm) = ctx.rel_norm {
            rel = norm.forward(&rel);
        }
        let rel = dropout(&rel, self.hidden_dropout, train);
        let span = s.span();
        let rel = rel.narrow(0, 0, 2 * span).unsqueeze(0); // (1, 2S, C)
        let bh = q.size()[0];
        let t = q.size()[1];
        let per_batch = bh / self.num_heads;
        let project = |proj: &Linear| {
            split_heads(&proj.forward(&rel), self.num_heads).repeat([per_batch, 1, 1])
        }; // (B*H, 2S, D)
        let d = q.size()[2];
        let scale = ((d as f32) * scale_factor as f32).sqrt() as f64;
        let mut score: Option<Tensor> = None;
        if s.c2p {
            let pos_key = project(self.pos_key.as_ref().unwrap_or(&self.key));
            let c2p = q.bmm(&pos_key.transpose(-1, -2)); // (B*H, T, 2S)
            let index = (&ctx.relative + span)
                .clamp(0, 2 * span - 1)
                .expand([bh, t, t], false);
            let c2p = c2p.gather(-1, &index, false) / scale;
            score = Some(c2p);
        }
        if s.p2c {
            let pos_query = project(self.pos_query.as_ref().unwrap_or(&self.query));
            let p2c = k.bmm(&pos_query.transpose(-1, -2)); // (B*H, T, 2S)
            let index = (-&ctx.relative + span)
                .clamp(0, 2 * span - 1)
                .expand([bh, t, t], false);
            let p2c = p2c.gather(-1, &index, false).transpose(-1, -2) / scale;
            score = Some(match score {
                Some(c2p) => c2p + p2c,
                None => p2c,
            });
        }
        score
    }

    fn forward(&self, x: &Tensor, ctx: &LayerContext, train: bool) -> Tensor {
        let (b, t, c) = x.size3().expect("(B, T, C)");
        let heads = self.num_heads;
        let q = split_heads(&self.query.forward(x), heads); // (B*H, T, D)
        let k = split_heads(&self.key.forward(x), heads);
        let v = split_heads(&self.value.forward(x), heads);
        let s = &self.settings;
        let relative = s.relative_attention;
        let scale_factor = 1.0 + f64::from(relative && s.c2p) + f64::from(relative && s.p2c);
        let d = q.size()[2];
        let scale = ((d as f32) * scale_factor as f32).sqrt() as f64;
        let scores = q.bmm(&(k.transpose(-1, -2) / scale)); // (B*H, T, T)
        let bias = relative
            .then(|| self.relative_bias(&q, &k, ctx, scale_factor, train))
            .flatten();
        let scores = match bias {
            Some(bias) => scores + bias,
            None => scores,
        };
        let scores = scores
            .view([b, heads, t, t])
            .masked_fill(&ctx.pair_mask.logical_not(), f32::MIN as f64);
        let probs = dropout(
            &scores.softmax(-1, scores.kind()),
            self.attention_dropout,
            train,
        );
        let attended = probs
            .view([b * heads, t, t])
            .bmm(&v)
            .view([b, heads, t, c / heads])
            .permute([0, 2, 1, 3])
            .contiguous()
            .view([b, t, c]); // (B, T, C)
        let attended = self.attention_norm.forward(
            &(dropout(
                &self.attention_output.forward(&attended),
                self.hidden_dropout,
                train,
            ) + x),
        );
        let inner = activate(self.activation, &self.intermediate.forward(&attended));
        self.output_norm.forward(
            &(dropout(&self.output.forward(&inner), self.hidden_dropout, train) + attended),
        )
    }
}

/// `DebertaV2Model`: embeddings, the layers, the relative-position table
/// (`encoder.rel_embeddings`, `encoder.LayerNorm`).
#[derive(Debug)]
pub struct DebertaEncoder {
    pub embeddings: DebertaEmbeddings,
    layers: Vec<DebertaLayer>,
    rel_embeddings: Option<Embedding>,
    rel_norm: Option<LayerNorm>,
    settings: DebertaSettings,
}

impl DebertaEncoder {
    pub fn new(p: nn::Path, c: &HfConfig, d: &DebertaSettings) -> Self {
        let enc = &p / "encoder";
        let layer_path = &enc / "layer";
        DebertaEncoder {
            embeddings: DebertaEmbeddings::new(&p / "embeddings", c, d),
            layers: (0..c.num_layers)
                .map(|i| DebertaLayer::new(&layer_path / i, c, d))
                .collect(),
            rel_embeddings: d.relative_attention.then(|| {
                Embedding::new(
                    &enc / "rel_embeddings",
                    2 * d.span(),
                    c.hidden_size,
                    c.initializer_range,
                    None,
                )
            }),
            rel_norm: (d.relative_attention && d.norm_rel_embeddings)
                .then(|| LayerNorm::new(&enc / "LayerNorm", c.hidden_size, c.layer_norm_eps)),
            settings: d.clone(),
        }
    }

    /// The last hidden state, (B, T, C); with `stages`, cut at every layer's input (the
    /// relative table's LayerNorm is recomputed in each layer, so every stage has its own
    /// graph to it).
    pub fn forward_staged<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
    ) -> Tensor {
        let mask = &inputs.attention_mask; // (B, T)
        let (b, t) = mask.size2().expect("attention mask is (B, T)");
        let m = mask.view([b, 1, 1, t]);
        let pair_mask = (&m * m.view([b, 1, t, 1])).ne(0); // (B, 1, T, T)
        let s = &self.settings;
        let ctx = LayerContext {
            pair_mask,
            relative: relative_positions(
                t,
                s.position_buckets,
                s.max_relative_positions,
                mask.device(),
            ),
            rel_embeddings: self.rel_embeddings.as_ref(),
            rel_norm: self.rel_norm.as_ref(),
        };
        run_stack(
            self.embeddings.forward(inputs, train),
            &self.layers,
            stages,
            move |layer, x| layer.forward(x, &ctx, train),
        )
    }
}

/// `ContextPooler`: dropout -> `pooler.dense` -> `pooler_hidden_act` on the first token.
#[derive(Debug)]
pub struct ContextPooler {
    dense: Linear,
    dropout: f64,
    activation: Activation,
}

impl ContextPooler {
    pub fn new(p: nn::Path, c: &HfConfig, d: &DebertaSettings) -> Self {
        ContextPooler {
            dense: Linear::new(
                &p / "dense",
                d.pooler_hidden_size,
                d.pooler_hidden_size,
                c.initializer_range,
            ),
            dropout: d.pooler_dropout,
            activation: d.pooler_activation,
        }
    }

    /// (B, T, C) -> (B, C)
    pub fn forward(&self, hidden: &Tensor, train: bool) -> Tensor {
        let first = dropout(&hidden.select(1, 0), self.dropout, train);
        activate(self.activation, &self.dense.forward(&first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// v3's buckets (256, max 512): distances below 128 stay, larger ones grow with the log.
    #[test]
    fn relative_positions_are_log_bucketed_past_half_the_buckets() {
        let rel = relative_positions(400, 256, 512, tch::Device::Cpu);
        let at = |i: i64, j: i64| rel.int64_value(&[i, j]);
        assert_eq!(at(5, 2), 3);
        assert_eq!(at(2, 5), -3);
        assert_eq!(at(127, 0), 127);
        // ceil(ln(d / 128) / ln(511 / 128) * 127) + 128
        let bucket =
            |d: f64| ((d / 128.0).ln() / (511.0f64 / 128.0).ln() * 127.0).ceil() as i64 + 128;
        assert_eq!(at(300, 0), bucket(300.0));
        assert_eq!(at(0, 399), -bucket(399.0));
        assert!(at(399, 0) < 256);
    }
}
