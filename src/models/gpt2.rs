//! GPT-2: learned positions, pre-LayerNorm blocks, fused query/key/value in `Conv1D` layers
//! (weights stored (in, out)), tanh-GELU MLP.
//!
//! Mirrors transformers/models/gpt2/modeling_gpt2.py (transformers 5.23.0).

use tch::{nn, Kind, Tensor};

use super::hf_config::{Activation, HfConfig};
use super::layers::{
    activate, causal_attention, dropout, CausalMask, Conv1D, Embedding, KvCache, LayerNorm,
};
use super::{run_stack, EncoderInputs, Stages};

/// `GPT2Block`: `ln_1`, `attn.{c_attn,c_proj}`, `ln_2`, `mlp.{c_fc,c_proj}`.
#[derive(Debug)]
struct Gpt2Block {
    ln_1: LayerNorm,
    c_attn: Conv1D,
    attn_proj: Conv1D,
    ln_2: LayerNorm,
    c_fc: Conv1D,
    mlp_proj: Conv1D,
    num_heads: i64,
    activation: Activation,
    resid_dropout: f64,
    attn_dropout: f64,
}

impl Gpt2Block {
    fn new(p: nn::Path, c: &HfConfig) -> Self {
        let (h, r) = (c.hidden_size, c.initializer_range);
        // transformers scales the init of the residual projections by 1/sqrt(2 * layers).
        let proj_std = r / (2.0 * c.num_layers as f64).sqrt();
        let lora = c.lora.as_ref();
        Gpt2Block {
            ln_1: LayerNorm::new(&p / "ln_1", h, c.layer_norm_eps),
            c_attn: Conv1D::new(&p / "attn" / "c_attn", h, 3 * h, r, lora),
            attn_proj: Conv1D::new(&p / "attn" / "c_proj", h, h, proj_std, lora),
            ln_2: LayerNorm::new(&p / "ln_2", h, c.layer_norm_eps),
            c_fc: Conv1D::new(&p / "mlp" / "c_fc", h, c.intermediate_size, r, lora),
            mlp_proj: Conv1D::new(
                &p / "mlp" / "c_proj",
                c.intermediate_size,
                h,
                proj_std,
                lora,
            ),
            num_heads: c.num_heads,
            activation: c.activation,
            resid_dropout: c.hidden_dropout,
            attn_dropout: c.attention_dropout,
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        mask: &CausalMask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        let (b, t, c) = x.size3().expect("GPT-2 block input is (B, T, C)");
        let heads = |y: &Tensor| y.view([b, t, self.num_heads, -1]).transpose(1, 2); // (B, H, T, D)
        let qkv = self
            .c_attn
            .forward(&self.ln_1.forward(x), train)
            .split(c, -1);
        let (q, mut k, mut v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
        if let Some((cache, layer)) = cache {
            (k, v) = cache.extend(layer, k, v);
        }
        let ctx = causal_attention(&q, &k, &v, mask, self.attn_dropout, train); // (B, T, C)
        let x = x + dropout(
            &self.attn_proj.forward(&ctx, train),
            self.resid_dropout,
            train,
        );
        let m = activate(
            self.activation,
            &self.c_fc.forward(&self.ln_2.forward(&x), train),
        );
        &x + dropout(&self.mlp_proj.forward(&m, train), self.resid_dropout, train)
    }
}

/// `GPT2Model`: `wte`, `wpe`, `h.{i}`, `ln_f`.
#[derive(Debug)]
pub struct Gpt2Model {
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Gpt2Block>,
    ln_f: LayerNorm,
    embedding_dropout: f64,
}

impl Gpt2Model {
    pub fn new(p: nn::Path, c: &HfConfig) -> Self {
        let r = c.initializer_range;
        Gpt2Model {
            wte: Embedding::new(&p / "wte", c.vocab_size, c.hidden_size, r, None),
            wpe: Embedding::new(
                &p / "wpe",
                c.max_position_embeddings,
                c.hidden_size,
                r,
                None,
            ),
            h: (0..c.num_layers)
                .map(|i| Gpt2Block::new(&p / "h" / i, c))
                .collect(),
            ln_f: LayerNorm::new(&p / "ln_f", c.hidden_size, c.layer_norm_eps),
            embedding_dropout: c.embedding_dropout,
        }
    }

    pub fn word_embeddings(&self) -> &Tensor {
        &self.wte.weight
    }

    pub fn word_embeddings_mut(&mut self) -> &mut Embedding {
        &mut self.wte
    }

    /// The final hidden state (B, T, C); with `stages`, cut at each block's input.
    pub fn forward_staged<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
    ) -> Tensor {
        let ids = &inputs.input_ids; // (B, T)
        let t = ids.size()[1];
        let positions = Tensor::arange(t, (Kind::Int64, ids.device())).unsqueeze(0);
        let x = self.wte.forward(ids) + self.wpe.forward(&positions); // (B, T, C)
        let x = dropout(&x, self.embedding_dropout, train);
        let mask = CausalMask::new(&inputs.attention_mask, None);
        let x = run_stack(x, &self.h, stages, move |block, x| {
            block.forward(x, &mask, None, train)
        });
        self.ln_f.forward(&x)
    }

    /// Inference on `ids` (B, T) after the positions in `cache`, extending it.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Tensor {
        let t = ids.size()[1];
        let start = cache.len;
        let positions =
            Tensor::arange_start(start, start + t, (Kind::Int64, ids.device())).unsqueeze(0);
        let mut x = self.wte.forward(ids) + self.wpe.forward(&positions);
        let mask = CausalMask::after_cache(start, t, None, ids.device());
        for (i, block) in self.h.iter().enumerate() {
            x = block.forward(&x, &mask, Some((cache, i)), false);
        }
        cache.len += t;
        self.ln_f.forward(&x)
    }
}
