//! Building blocks shared by the encoder families. Parameter names are PyTorch's (`weight`,
//! `bias`) so that a `VarStore` path spells the Hugging Face state-dict key.

use std::cell::Cell;

use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use super::hf_config::Activation;

thread_local! {
    /// The lower-precision compute dtype in force on this thread, like PyTorch's autocast
    /// state: `None` runs everything in the parameters' dtype.
    static AUTOCAST: Cell<Option<Kind>> = const { Cell::new(None) };
}

/// Restores the previous autocast state when dropped.
#[must_use = "autocast lasts as long as the guard"]
pub struct AutocastGuard(Option<Kind>);

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.0));
    }
}

/// Runs matrix products (linear layers, attention, the MLM decoder) in `kind` until the guard
/// drops, as `torch.autocast(device_type="cpu", dtype=kind)` does; parameters, gradients,
/// LayerNorm, the residual stream and losses stay fp32.
pub fn autocast(kind: Option<Kind>) -> AutocastGuard {
    AutocastGuard(AUTOCAST.with(|a| a.replace(kind)))
}

/// `x @ w.T + b`, in the autocast dtype when one is in force.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    match AUTOCAST.with(Cell::get) {
        Some(k) => x.to_kind(k).linear(&w.to_kind(k), Some(&b.to_kind(k))),
        None => x.linear(w, Some(b)),
    }
}

/// `torch.nn.Linear`, initialised as transformers' `_init_weights` does (normal(0, range), zero bias).
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor, // (out, in)
    pub bias: Tensor,   // (out)
}

impl Linear {
    pub fn new(p: nn::Path, in_dim: i64, out_dim: i64, init_range: f64) -> Self {
        let weight = p.var(
            "weight",
            &[out_dim, in_dim],
            Init::Randn {
                mean: 0.0,
                stdev: init_range,
            },
        );
        let bias = p.var("bias", &[out_dim], Init::Const(0.0));
        Linear { weight, bias }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        linear(x, &self.weight, &self.bias)
    }
}

/// `torch.nn.LayerNorm` over the last dimension.
#[derive(Debug)]
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    eps: f64,
    dim: i64,
}

impl LayerNorm {
    pub fn new(p: nn::Path, dim: i64, eps: f64) -> Self {
        let weight = p.var("weight", &[dim], Init::Const(1.0));
        let bias = p.var("bias", &[dim], Init::Const(0.0));
        LayerNorm {
            weight,
            bias,
            eps,
            dim,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.layer_norm(
            [self.dim],
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            false,
        )
    }
}

/// `torch.nn.Embedding`. The padding row is zeroed at initialisation and, as in PyTorch,
/// receives no gradient.
#[derive(Debug)]
pub struct Embedding {
    pub weight: Tensor, // (V, C)
    /// -1 when there is no padding row (libtorch's convention).
    padding_idx: i64,
}

impl Embedding {
    pub fn new(p: nn::Path, num: i64, dim: i64, init_range: f64, padding_idx: Option<i64>) -> Self {
        let weight = p.var(
            "weight",
            &[num, dim],
            Init::Randn {
                mean: 0.0,
                stdev: init_range,
            },
        );
        if let Some(idx) = padding_idx {
            tch::no_grad(|| {
                let _ = weight.get(idx).zero_();
            });
        }
        Embedding {
            weight,
            padding_idx: padding_idx.unwrap_or(-1),
        }
    }

    /// A table of fixed values (DistilBERT's sinusoidal positions), registered but not trained.
    pub fn frozen(p: nn::Path, table: Tensor) -> Self {
        let weight = p.add("weight", table, false);
        Embedding {
            weight,
            padding_idx: -1,
        }
    }

    pub fn forward(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.weight, ids, self.padding_idx, false, false)
    }
}

pub fn activate(act: Activation, x: &Tensor) -> Tensor {
    match act {
        Activation::Gelu => x.gelu("none"),
        Activation::GeluTanh => x.gelu("tanh"),
        Activation::Relu => x.relu(),
        Activation::Silu => x.silu(),
        Activation::Tanh => x.tanh(),
    }
}

/// Dropout that is the identity outside training or at p = 0 (no RNG draw, no copy).
pub fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x.shallow_clone()
    }
}

/// Key-padding mask for attention: (B, T) of 1/0 to (B, 1, 1, T) booleans, true where a key
/// is attended. Padded query rows still see the real keys, so their outputs match
/// transformers' too; a boolean mask suits every compute dtype.
pub fn key_mask(attention_mask: &Tensor) -> Tensor {
    let (b, t) = attention_mask.size2().expect("attention mask is (B, T)");
    attention_mask.ne(0).view([b, 1, 1, t])
}

/// Multi-head scaled dot-product attention on already-projected q, k, v of shape (B, T, C).
/// Returns (B, T, C).
pub fn multi_head_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    num_heads: i64,
    dropout_p: f64,
    train: bool,
) -> Tensor {
    let (b, t, c) = q.size3().expect("attention input is (B, T, C)");
    let d = c / num_heads;
    let split = |x: &Tensor| x.view([b, t, num_heads, d]).transpose(1, 2); // (B, H, T, D)
    let p = if train { dropout_p } else { 0.0 };
    let ctx = Tensor::scaled_dot_product_attention(
        &split(q),
        &split(k),
        &split(v),
        Some(mask),
        p,
        false,
        None,
        false,
    ); // (B, H, T, D)
    ctx.transpose(1, 2).contiguous().view([b, t, c])
}
