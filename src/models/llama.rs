//! The Llama family: RMSNorm pre-norm blocks, rotary positions, grouped-query attention and a
//! SwiGLU MLP, without biases. Mistral adds a sliding attention window, Qwen2 biases on the
//! query/key/value projections, Qwen3 an RMSNorm on each head's queries and keys.
//!
//! Mirrors transformers/models/llama/modeling_llama.py, mistral/modeling_mistral.py,
//! qwen2/modeling_qwen2.py and qwen3/modeling_qwen3.py (transformers 5.23.0).

use std::f64::consts::PI;

use tch::{nn, Kind, Tensor};

use super::hf_config::{Activation, HfConfig, Rope, RopeScaling};
use super::layers::{
    activate, causal_attention, fused_projection, qkv_projection, CausalMask, Embedding, KvCache,
    Linear, RmsNorm,
};
use super::{run_stack, EncoderInputs, Stages};

/// RoPE's inverse frequencies (D/2), as transformers' `ROPE_INIT_FUNCTIONS` compute them.
pub fn inverse_frequencies(rope: &Rope, head_dim: i64) -> Vec<f64> {
    let d = head_dim as f64;
    (0..head_dim / 2)
        .map(|i| {
            // transformers computes the exponent in fp32 and the power in fp32 too.
            let exponent = ((2 * i) as f32 / d as f32) as f64;
            let inv = (1.0 / (rope.theta as f32).powf(exponent as f32)) as f64;
            match rope.scaling {
                RopeScaling::None => inv,
                RopeScaling::Linear { factor } => inv / factor,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: old,
                } => {
                    let wavelen = 2.0 * PI / inv;
                    let low_freq_wavelen = old / low_freq_factor;
                    let high_freq_wavelen = old / high_freq_factor;
                    if wavelen < high_freq_wavelen {
                        inv
                    } else if wavelen > low_freq_wavelen {
                        inv / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * inv / factor + smooth * inv
                    }
                }
            }
        })
        .collect()
}

/// `LlamaRotaryEmbedding`: cos and sin tables for positions, applied with `rotate_half`.
#[derive(Debug)]
pub(super) struct Rotary {
    inv_freq: Tensor, // (D/2) fp32
}

impl Rotary {
    pub(super) fn new(rope: &Rope, head_dim: i64) -> Self {
        let inv: Vec<f32> = inverse_frequencies(rope, head_dim)
            .into_iter()
            .map(|f| f as f32)
            .collect();
        Rotary {
            inv_freq: Tensor::from_slice(&inv),
        }
    }

    /// (T, D) cos and sin of positions `start..start + t`, fp32.
    pub(super) fn tables(&self, start: i64, t: i64) -> (Tensor, Tensor) {
        let pos = Tensor::arange_start(start, start + t, (Kind::Float, self.inv_freq.device()));
        let freqs = pos.unsqueeze(1) * self.inv_freq.unsqueeze(0); // (T, D/2)
        let emb = Tensor::cat(&[&freqs, &freqs], -1); // (T, D)
        (emb.cos(), emb.sin())
    }
}

/// x * cos + rotate_half(x) * sin for (B, H, T, D) x, in x's dtype.
pub(super) fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    let rotated = Tensor::cat(&[&(-x2), &x1], -1);
    let kind = x.kind();
    x * cos.to_kind(kind) + rotated * sin.to_kind(kind)
}

/// `LlamaDecoderLayer`: `input_layernorm`, `self_attn.{q,k,v,o}_proj` (+ `q_norm`, `k_norm`
/// in Qwen3), `post_attention_layernorm`, `mlp.{gate,up,down}_proj`.
#[derive(Debug)]
struct LlamaLayer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    activation: Activation,
    attention_dropout: f64,
}

impl LlamaLayer {
    fn new(p: nn::Path, c: &HfConfig) -> Self {
        let (h, r) = (c.hidden_size, c.initializer_range);
        let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let attn = &p / "self_attn";
        let mlp = &p / "mlp";
        let eps = c.layer_norm_eps;
        let lora = c.lora.as_ref();
        LlamaLayer {
            input_layernorm: RmsNorm::new(&p / "input_layernorm", h, eps),
            q_proj: Linear::adapted(&attn / "q_proj", h, q_dim, r, c.qkv_bias, lora),
            k_proj: Linear::adapted(&attn / "k_proj", h, kv_dim, r, c.qkv_bias, lora),
            v_proj: Linear::adapted(&attn / "v_proj", h, kv_dim, r, c.qkv_bias, lora),
            o_proj: Linear::adapted(&attn / "o_proj", q_dim, h, r, c.output_bias, lora),
            q_norm: c
                .qk_norm
                .then(|| RmsNorm::new(&attn / "q_norm", c.head_dim, eps)),
            k_norm: c
                .qk_norm
                .then(|| RmsNorm::new(&attn / "k_norm", c.head_dim, eps)),
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, eps),
            gate_proj: Linear::adapted(
                &mlp / "gate_proj",
                h,
                c.intermediate_size,
                r,
                c.mlp_bias,
                lora,
            ),
            up_proj: Linear::adapted(
                &mlp / "up_proj",
                h,
                c.intermediate_size,
                r,
                c.mlp_bias,
                lora,
            ),
            down_proj: Linear::adapted(
                &mlp / "down_proj",
                c.intermediate_size,
                h,
                r,
                c.mlp_bias,
                lora,
            ),
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            activation: c.activation,
            attention_dropout: c.attention_dropout,
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        mask: &CausalMask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        let (b, t, _) = x.size3().expect("decoder layer input is (B, T, C)");
        let normed = self.input_layernorm.forward(x);
        let (q, k, v) = qkv_projection(&normed, &self.q_proj, &self.k_proj, &self.v_proj, train);
        let split = |y: &Tensor, heads: i64, norm: &Option<RmsNorm>| {
            let y = y.view([b, t, heads, self.head_dim]); // (B, T, heads, D)
            let y = match norm {
                Some(n) => n.forward(&y),
                None => y,
            };
            y.transpose(1, 2) // (B, heads, T, D)
        };
        let q = split(&q, self.num_heads, &self.q_norm);
        let k = split(&k, self.num_kv_heads, &self.k_norm);
        let v = split(&v, self.num_kv_heads, &None);
        let (cos, sin) = rope;
        let q = apply_rotary(&q, cos, sin);
        let mut k = apply_rotary(&k, cos, sin);
        let mut v = v;
        if let Some((cache, layer)) = cache {
            (k, v) = cache.extend(layer, k, v);
        }
        let ctx = causal_attention(&q, &k, &v, mask, self.attention_dropout, train); // (B, T, H*D)
        let x = x + self.o_proj.forward_t(&ctx, train);
        let h = self.post_attention_layernorm.forward(&x);
        // gate_proj and up_proj as one GEMM.
        let gate_up = fused_projection(&h, &[&self.gate_proj, &self.up_proj], train);
        let gated = activate(self.activation, &gate_up[0]) * &gate_up[1];
        &x + self.down_proj.forward_t(&gated, train)
    }
}

/// `LlamaModel` (and Mistral's, Qwen2's, Qwen3's): `embed_tokens`, `layers.{i}`, `norm`.
#[derive(Debug)]
pub struct LlamaModel {
    embed_tokens: Embedding,
    layers: Vec<LlamaLayer>,
    norm: RmsNorm,
    rotary: Rotary,
    sliding_window: Option<i64>,
}

impl LlamaModel {
    pub fn new(p: nn::Path, c: &HfConfig) -> Self {
        let rope = c.rope.expect("the Llama family has RoPE parameters");
        LlamaModel {
            embed_tokens: Embedding::new(
                &p / "embed_tokens",
                c.vocab_size,
                c.hidden_size,
                c.initializer_range,
                c.has_pad_token.then_some(c.pad_token_id),
            ),
            layers: (0..c.num_layers)
                .map(|i| LlamaLayer::new(&p / "layers" / i, c))
                .collect(),
            norm: RmsNorm::new(&p / "norm", c.hidden_size, c.layer_norm_eps),
            rotary: Rotary::new(&rope, c.head_dim),
            sliding_window: c.sliding_window,
        }
    }

    pub fn word_embeddings(&self) -> &Tensor {
        &self.embed_tokens.weight
    }

    pub fn word_embeddings_mut(&mut self) -> &mut Embedding {
        &mut self.embed_tokens
    }

    /// The final hidden state (B, T, C); with `stages`, cut at each layer's input.
    pub fn forward_staged<'a>(
        &'a self,
        inputs: &EncoderInputs,
        train: bool,
        stages: Option<&mut Stages<'a>>,
    ) -> Tensor {
        let ids = &inputs.input_ids; // (B, T)
        let t = ids.size()[1];
        let x = self.embed_tokens.forward(ids); // (B, T, C)
        let rope = self.rotary.tables(0, t);
        let mask = CausalMask::new(&inputs.attention_mask, self.sliding_window);
        let x = run_stack(x, &self.layers, stages, move |layer, x| {
            layer.forward(x, &rope, &mask, None, train)
        });
        self.norm.forward(&x)
    }

    /// Inference on `ids` (B, T) after the positions in `cache`, extending it.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Tensor {
        let t = ids.size()[1];
        let start = cache.len;
        let mut x = self.embed_tokens.forward(ids);
        let rope = self.rotary.tables(start, t);
        let mask = CausalMask::after_cache(start, t, self.sliding_window, ids.device());
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &rope, &mask, Some((cache, i)), false);
        }
        cache.len += t;
        self.norm.forward(&x)
    }
}
