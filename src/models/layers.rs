//! Building blocks shared by the encoder families. Parameter names are PyTorch's (`weight`,
//! `bias`) so that a `VarStore` path spells the Hugging Face state-dict key.

use std::cell::Cell;

use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use super::hf_config::{Activation, LoraSpec};

thread_local! {
    /// The lower-precision compute dtype in force on this thread, like PyTorch's autocast
    /// state: `None` runs everything in the parameters' dtype.
    static AUTOCAST: Cell<Option<Kind>> = const { Cell::new(None) };
    /// The dropout stream: (seed, masks drawn since it was seeded). Each dropout draws its
    /// mask from its own seed, derived from these two.
    static DROPOUT_STREAM: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    /// Weights left uninitialised ([`skeleton`]): their pages are never touched, so a model's
    /// shapes cost no memory or time, whatever its size.
    static SKELETON: Cell<bool> = const { Cell::new(false) };
}

/// Runs `build` with [`normal_var`] leaving its weights uninitialised: a model whose shapes,
/// names and dtypes are real and whose values are garbage, for the memory preflight.
pub fn skeleton<T>(build: impl FnOnce() -> T) -> T {
    let before = SKELETON.with(|s| s.replace(true));
    let built = build();
    SKELETON.with(|s| s.set(before));
    built
}

/// Restarts this thread's dropout stream: the masks that follow depend only on `seed` and on
/// their order, not on threads, chunking or libtorch's generator.
pub fn seed_dropout(seed: u64) {
    DROPOUT_STREAM.with(|s| s.set((seed, 0)));
}

/// Where this thread's dropout stream stands: what [`set_dropout_stream`] takes to draw the
/// same masks again (activation checkpointing's recomputation).
pub fn dropout_stream() -> (u64, u64) {
    DROPOUT_STREAM.with(|s| s.get())
}

/// Puts this thread's dropout stream back where [`dropout_stream`] saw it.
pub fn set_dropout_stream(position: (u64, u64)) {
    DROPOUT_STREAM.with(|s| s.set(position));
}

/// The seed of the next dropout mask (splitmix64 of the stream position).
fn next_dropout_seed() -> i64 {
    let (seed, n) = DROPOUT_STREAM.with(|s| {
        let (seed, n) = s.get();
        s.set((seed, n + 1));
        (seed, n)
    });
    let mut z = seed ^ n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as i64
}

/// Dropout with its mask drawn from `seed` (element i kept when a hash of (seed, i) says so),
/// regenerated in backward rather than kept.
pub fn seeded_dropout(x: &Tensor, p: f64, seed: i64) -> Tensor {
    kernels::dropout(x, p, seed)
}

/// Scaled dot-product attention of (B, H, T, D) q, k, v over the keys where `key_mask` (B, 1,
/// 1, T), or per query (B, 1, T, T), is true, with dropout on the probabilities: element i of the (B, H, T, T)
/// probabilities is dropped exactly where `seeded_dropout` with the same seed drops element i
/// of a (B, H, T, T) tensor. Backward recomputes the probabilities. Returns (B, H, T, D).
pub fn seeded_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_mask: &Tensor,
    p: f64,
    seed: i64,
) -> Tensor {
    seeded_attention_with(q, k, v, key_mask, p, seed, SEEDED_BATCHED_UP_TO)
}

/// `seeded_attention` under the causal mask as well (query i sees keys 0..=i; q, k, v of one
/// length T): batched at most `batched_up_to` score elements, else the loop over pairs, which
/// takes the queries in tiles against the keys up to each tile's end and so skips most of the
/// masked half of the work.
pub fn seeded_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_mask: &Tensor,
    p: f64,
    seed: i64,
    batched_up_to: i64,
) -> Tensor {
    kernels::attention(q, k, v, key_mask, p, seed, batched_up_to, true)
}

/// The most (B, H, T, T) score elements for which seeded attention runs as batched products
/// over all (batch, head) pairs (it then holds a few such tensors, 32 MiB each in fp32, for
/// one layer's call); above it, a loop over the pairs keeps each (T, T) block in cache. Short
/// sequences (MiniLM on sentences, batch 32) are batched; DistilBERT's seq 384 x batch 8 loops.
pub const SEEDED_BATCHED_UP_TO: i64 = 1 << 23;

/// `seeded_attention`, batched when the scores have at most `batched_up_to` elements (0: always
/// the loop over pairs; `i64::MAX`: always batched). Both draw the same mask.
pub fn seeded_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_mask: &Tensor,
    p: f64,
    seed: i64,
    batched_up_to: i64,
) -> Tensor {
    kernels::attention(q, k, v, key_mask, p, seed, batched_up_to, false)
}

/// The C++ units' entry points: src/models/seeded.cpp's dropout and attention, whose backward
/// regenerates the dropout mask from its seed (and recomputes attention probabilities) instead
/// of keeping them, and src/models/linear_grad.cpp's linear layers, whose backward adds the
/// weight gradients into the weights' `.grad` itself.
mod kernels {
    use std::ffi::{c_char, CStr};

    use tch::{Kind, Tensor};
    use torch_sys::C_tensor;

    extern "C" {
        fn sprtrain_seeded_dropout(
            x: *const C_tensor,
            p: f64,
            seed: i64,
            error: *mut *mut c_char,
        ) -> *mut C_tensor;
        fn sprtrain_seeded_attention(
            q: *const C_tensor,
            k: *const C_tensor,
            v: *const C_tensor,
            key_mask: *const C_tensor,
            p: f64,
            seed: i64,
            batched_up_to: i64,
            causal: bool,
            error: *mut *mut c_char,
        ) -> *mut C_tensor;
        fn sprtrain_accumulating_linear(
            x: *const C_tensor,
            weights: *const *const C_tensor,
            n_weights: usize,
            biases: *const *const C_tensor,
            n_biases: usize,
            compute: std::ffi::c_int,
            error: *mut *mut c_char,
        ) -> *mut C_tensor;
        fn sprtrain_chunked_lm_loss(
            hidden: *const C_tensor,
            weight: *const C_tensor,
            targets: *const C_tensor,
            compute: std::ffi::c_int,
            chunk: i64,
            error: *mut *mut c_char,
        ) -> *mut C_tensor;
        fn sprtrain_set_fp32_gemm(
            onednn: bool,
            attention_brgemm: bool,
            error: *mut *mut c_char,
        ) -> bool;
        fn sprtrain_free_error(error: *mut c_char);
    }

    /// Runs the layers' fp32 products through oneDNN's matmul (`onednn`) or libtorch's BLAS,
    /// and attention's through oneDNN's brgemm microkernel (`attention_brgemm`) or the BLAS,
    /// from now on, in the whole process (src/models/gemm.h); Err with oneDNN's reason where it
    /// refuses this CPU.
    pub fn set_fp32_gemm(onednn: bool, attention_brgemm: bool) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: no tensors cross; on failure `error` is set.
        if unsafe { sprtrain_set_fp32_gemm(onednn, attention_brgemm, &mut error) } {
            return Ok(());
        }
        Err(take_error(error))
    }

    /// A kernel's error message, freed: on failure the kernels return a NUL-terminated message
    /// from malloc.
    fn take_error(error: *mut c_char) -> String {
        // SAFETY: see above; nothing else holds the message.
        let msg = unsafe { CStr::from_ptr(error) }
            .to_string_lossy()
            .into_owned();
        unsafe { sprtrain_free_error(error) };
        msg
    }

    /// Takes ownership of a kernel's result, or turns its error into a panic: the kernels fail
    /// only on shapes the model code itself builds, i.e. on a bug.
    fn wrap(out: *mut C_tensor, error: *mut c_char, what: &str) -> Tensor {
        if out.is_null() {
            panic!("{what}: {}", take_error(error));
        }
        // SAFETY: `out` is a new at::Tensor* that nobody else owns.
        unsafe { Tensor::from_ptr(out) }
    }

    pub fn dropout(x: &Tensor, p: f64, seed: i64) -> Tensor {
        let mut error = std::ptr::null_mut();
        // SAFETY: the tensor pointer is valid for the call; the kernel copies what it keeps.
        let out = unsafe { sprtrain_seeded_dropout(x.as_ptr(), p, seed, &mut error) };
        wrap(out, error, "seeded dropout")
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        p: f64,
        seed: i64,
        batched_up_to: i64,
        causal: bool,
    ) -> Tensor {
        let mut error = std::ptr::null_mut();
        // SAFETY: as for dropout.
        let out = unsafe {
            sprtrain_seeded_attention(
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                mask.as_ptr(),
                p,
                seed,
                batched_up_to,
                causal,
                &mut error,
            )
        };
        wrap(out, error, "seeded attention")
    }

    /// ATen's `ScalarType` number of the floating dtypes a product can run in (tch keeps its
    /// own mapping private); -1, the weights' own dtype, for any other.
    fn scalar_type_code(kind: Kind) -> std::ffi::c_int {
        match kind {
            Kind::Half => 5,
            Kind::Float => 6,
            Kind::Double => 7,
            Kind::BFloat16 => 15,
            _ => -1,
        }
    }

    /// `x @ cat(weights).T + cat(biases)` (no biases, or one per weight), the products in
    /// `compute` (else the weights' dtype).
    pub fn accumulating_linear(
        x: &Tensor,
        weights: &[&Tensor],
        biases: &[&Tensor],
        compute: Option<Kind>,
    ) -> Tensor {
        let weights: Vec<*const C_tensor> = weights.iter().map(|w| w.as_ptr()).collect();
        let biases: Vec<*const C_tensor> = biases.iter().map(|b| b.as_ptr()).collect();
        let mut error = std::ptr::null_mut();
        // SAFETY: as for dropout; the pointer arrays outlive the call.
        let out = unsafe {
            sprtrain_accumulating_linear(
                x.as_ptr(),
                weights.as_ptr(),
                weights.len(),
                biases.as_ptr(),
                biases.len(),
                compute.map_or(-1, scalar_type_code),
                &mut error,
            )
        };
        wrap(out, error, "linear layer")
    }

    /// The summed cross-entropy of the head `weight` over `hidden` against `targets`, the
    /// logits made `chunk` rows at a time (src/models/linear_grad.cpp).
    pub fn chunked_lm_loss(
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        compute: Option<Kind>,
        chunk: i64,
    ) -> Tensor {
        let mut error = std::ptr::null_mut();
        // SAFETY: as for dropout.
        let out = unsafe {
            sprtrain_chunked_lm_loss(
                hidden.as_ptr(),
                weight.as_ptr(),
                targets.as_ptr(),
                compute.map_or(-1, scalar_type_code),
                chunk,
                &mut error,
            )
        };
        wrap(out, error, "chunked LM loss")
    }
}

/// The largest (rows, V) fp32 block of logits [`lm_cross_entropy`] makes at once: 32 MB.
pub const LM_LOSS_CHUNK_BYTES: i64 = 32 << 20;

/// Mean cross-entropy of the LM head `weight` (V, C) over `hidden` (N, C) against `targets`
/// (N; -100 not counted, as PyTorch's `ignore_index`), equal to `cross_entropy(hidden @
/// weight.T, targets)` in the autocast dtype, without the (N, V) logits: they are made a few
/// hundred rows at a time in forward and again in backward.
pub fn lm_cross_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = weight.size()[0].max(1);
    lm_cross_entropy_in_chunks(hidden, weight, targets, LM_LOSS_CHUNK_BYTES / (4 * vocab))
}

/// [`lm_cross_entropy`] with the logits made `rows` rows at a time.
pub fn lm_cross_entropy_in_chunks(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    rows: i64,
) -> Tensor {
    let sum = kernels::chunked_lm_loss(hidden, weight, targets, autocast_kind(), rows.max(1));
    let counted = targets.ne(-100).sum(Kind::Float);
    sum / counted
}

/// Runs the models' fp32 matrix products through oneDNN or through libtorch's BLAS,
/// process-wide: the linear layers through oneDNN's matmul where `layers`, the per-pair
/// attention through its brgemm microkernel where `attention`. Err with the reason where
/// oneDNN's matmul refuses this CPU (the BLAS is then in use for both).
pub fn use_onednn_fp32(layers: bool, attention: bool) -> Result<(), String> {
    kernels::set_fp32_gemm(layers, attention)
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

/// The compute dtype of matrix products in force on this thread, if lower than fp32.
pub fn autocast_kind() -> Option<Kind> {
    AUTOCAST.with(Cell::get)
}

/// `x @ w.T + b`, in the autocast dtype when one is in force.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let biases: Vec<&Tensor> = b.into_iter().collect();
    linear_of_parts(x, &[w], &biases)
}

/// `x @ cat(weights).T + cat(biases)`: several layers of one input as one product (no biases,
/// or one per weight), in the autocast dtype when one is in force. The backward adds each
/// weight's gradient into its `.grad` itself (src/models/linear_grad.cpp) rather than
/// returning it for autograd to add: with `.grad` bound to the flat buffer, that addition was
/// a pass over every weight's gradient each micro-step (under autocast, two: the cast back to
/// fp32, then the addition).
fn linear_of_parts(x: &Tensor, weights: &[&Tensor], biases: &[&Tensor]) -> Tensor {
    kernels::accumulating_linear(x, weights, biases, autocast_kind())
}

/// A parameter drawn from normal(0, `std`), as transformers' `_init_weights` draws weights:
/// drawn once into uninitialised memory ([`super::init`]), from a stream keyed by one draw of
/// libtorch's seeded generator, so the weights depend on the seed and on the order the
/// parameters are created in.
pub fn normal_var(p: &nn::Path, name: &str, dims: &[i64], std: f64) -> Tensor {
    let t = p.add(name, Tensor::empty(dims, (Kind::Float, p.device())), true);
    if SKELETON.with(|s| s.get()) {
        return t;
    }
    let key = Tensor::randint(i64::MAX, [1], (Kind::Int64, tch::Device::Cpu)).int64_value(&[0]);
    super::init::fill_normal(&t, key as u64, std as f32);
    t
}

/// `torch.nn.Linear`, initialised as transformers' `_init_weights` does (normal(0, range), zero bias).
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,       // (out, in)
    pub bias: Option<Tensor>, // (out)
    /// A LoRA update, where one targets this layer.
    pub lora: Option<LoraAdapter>,
}

impl Linear {
    pub fn new(p: nn::Path, in_dim: i64, out_dim: i64, init_range: f64) -> Self {
        Self::with_bias(p, in_dim, out_dim, init_range, true)
    }

    /// `nn.Linear(in, out, bias=bias)`.
    pub fn with_bias(p: nn::Path, in_dim: i64, out_dim: i64, init_range: f64, bias: bool) -> Self {
        let weight = normal_var(&p, "weight", &[out_dim, in_dim], init_range);
        let bias = bias.then(|| p.var("bias", &[out_dim], Init::Const(0.0)));
        Linear {
            weight,
            bias,
            lora: None,
        }
    }

    /// As `with_bias`, with a LoRA adapter when `lora` targets this layer.
    pub fn adapted(
        p: nn::Path,
        in_dim: i64,
        out_dim: i64,
        init_range: f64,
        bias: bool,
        lora: Option<&LoraSpec>,
    ) -> Self {
        let adapter = LoraAdapter::for_module(&p, in_dim, out_dim, lora);
        Linear {
            lora: adapter,
            ..Self::with_bias(p, in_dim, out_dim, init_range, bias)
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_t(x, false)
    }

    /// The layer's output; `train` drops out the LoRA input in training.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        with_lora(
            linear(x, &self.weight, self.bias.as_ref()),
            &self.lora,
            x,
            train,
        )
    }
}

/// `y`, a layer's output on `x`, plus the layer's LoRA update if it has one.
/// Whether a variable belongs to an adapter.
pub fn is_adapter_variable(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

/// One layer's low-rank update.
#[derive(Debug)]
pub struct LoraAdapter {
    pub a: Tensor, // (r, in)
    pub b: Tensor, // (out, r)
    scale: f64,
    dropout: f64,
}

impl LoraAdapter {
    /// The adapter of the module at `p` when `spec` targets it.
    pub fn for_module(
        p: &nn::Path,
        in_dim: i64,
        out_dim: i64,
        spec: Option<&LoraSpec>,
    ) -> Option<Self> {
        let path = p.components().collect::<Vec<_>>().join(".");
        let spec = spec.filter(|s| s.targets(&path))?;
        // kaiming_uniform_(a=sqrt(5)) on an (r, in) weight: U(-1/sqrt(in), 1/sqrt(in)).
        let bound = 1.0 / (in_dim as f64).sqrt();
        let a = (p / "lora_A").var(
            "weight",
            &[spec.r, in_dim],
            nn::Init::Uniform {
                lo: -bound,
                up: bound,
            },
        );
        let b = (p / "lora_B").var("weight", &[out_dim, spec.r], nn::Init::Const(0.0));
        Some(LoraAdapter {
            a,
            b,
            scale: spec.scale(),
            dropout: spec.dropout,
        })
    }

    /// (alpha / r) B A dropout(x): what the adapter adds to the layer's output.
    pub fn delta(&self, x: &Tensor, train: bool) -> Tensor {
        let x = dropout(x, self.dropout, train);
        linear(&linear(&x, &self.a, None), &self.b, None) * self.scale
    }
}

fn with_lora(y: Tensor, lora: &Option<LoraAdapter>, x: &Tensor, train: bool) -> Tensor {
    match lora {
        Some(l) => y + l.delta(x, train),
        None => y,
    }
}

/// GPT-2's `Conv1D`: a linear layer whose weight is stored (in, out), transposed from
/// `nn.Linear`'s.
#[derive(Debug)]
pub struct Conv1D {
    pub weight: Tensor, // (in, out)
    pub bias: Tensor,   // (out)
    /// A LoRA update (PEFT's fan_in_fan_out layout: A (r, in), B (out, r) as for Linear).
    pub lora: Option<LoraAdapter>,
}

impl Conv1D {
    pub fn new(
        p: nn::Path,
        in_dim: i64,
        out_dim: i64,
        init_std: f64,
        lora: Option<&LoraSpec>,
    ) -> Self {
        let adapter = LoraAdapter::for_module(&p, in_dim, out_dim, lora);
        let weight = normal_var(&p, "weight", &[in_dim, out_dim], init_std);
        let bias = p.var("bias", &[out_dim], Init::Const(0.0));
        Conv1D {
            weight,
            bias,
            lora: adapter,
        }
    }

    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        with_lora(
            linear(x, &self.weight.tr(), Some(&self.bias)),
            &self.lora,
            x,
            train,
        )
    }
}

/// `LlamaRMSNorm` (and Mistral's, Qwen's): x / sqrt(mean(x^2) + eps) * weight, over the last
/// dimension, in fp32.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(p: nn::Path, dim: i64, eps: f64) -> Self {
        let weight = p.var("weight", &[dim], Init::Const(1.0));
        RmsNorm { weight, eps }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let x = x.to_kind(Kind::Float);
        let variance = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = x * (variance + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}

/// Several linear layers of the same input `x` (B, T, C) as one product, e.g. the query, key
/// and value projections as one (C, 3C) GEMM: a wider GEMM runs closer to the machine's peak
/// than narrow ones (fp32 on 2 cores: about 200 against 155-190 GFLOP/s). The weights stay
/// separate parameters with their HF names; the concatenation costs a copy of them per call.
/// Returns each layer's (B, T, out) output, LoRA updates included.
pub fn fused_projection(x: &Tensor, layers: &[&Linear], train: bool) -> Vec<Tensor> {
    let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
    // The layers of one projection have biases alike (all of q/k/v, or none).
    let biases: Vec<&Tensor> = layers.iter().filter_map(|l| l.bias.as_ref()).collect();
    let fused = linear_of_parts(x, &weights, &biases); // (B, T, sum of outs)
    let sizes: Vec<i64> = layers.iter().map(|l| l.weight.size()[0]).collect();
    let parts = fused.split_with_sizes(sizes, -1);
    // LoRA updates apply to their own layer's share.
    parts
        .into_iter()
        .zip(layers)
        .map(|(part, layer)| with_lora(part, &layer.lora, x, train))
        .collect()
}

/// The query, key and value projections of `x` as one product ([`fused_projection`]).
pub fn qkv_projection(
    x: &Tensor,
    q: &Linear,
    k: &Linear,
    v: &Linear,
    train: bool,
) -> (Tensor, Tensor, Tensor) {
    let mut out = fused_projection(x, &[q, k, v], train).into_iter();
    let mut next = || out.next().expect("three projections");
    (next(), next(), next())
}

/// The positions of a layer's output that anything reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positions {
    All,
    /// The first only: the last layer under a classification head that reads the first
    /// token. That layer's queries, attention output and feed-forward then run on one position
    /// a row instead of T (its keys and values still cover all T), and its output is (B, 1, C):
    /// the same values at that position, for about 5/6 less of the layer's work.
    First,
}

/// A self-attention layer's query, key and value projections of `x` (B, T, C), and the input
/// its residual adds back: queries and residual at every position, or at the first only.
pub fn attention_inputs(
    x: &Tensor,
    (q, k, v): (&Linear, &Linear, &Linear),
    positions: Positions,
    train: bool,
) -> (Tensor, Tensor, Tensor, Tensor) {
    match positions {
        Positions::All => {
            let (q, k, v) = qkv_projection(x, q, k, v, train);
            (q, k, v, x.shallow_clone())
        }
        Positions::First => {
            let first = x.narrow(1, 0, 1); // (B, 1, C)
            let mut kv = fused_projection(x, &[k, v], train).into_iter();
            let mut next = || kv.next().expect("two projections");
            let (k, v) = (next(), next());
            (q.forward_t(&first, train), k, v, first)
        }
    }
}

/// `torch.nn.LayerNorm` over the last dimension.
#[derive(Debug)]
pub struct LayerNorm {
    pub weight: Tensor,
    /// None for `bias=False` (ModernBERT's norms).
    pub bias: Option<Tensor>,
    eps: f64,
    dim: i64,
}

impl LayerNorm {
    pub fn new(p: nn::Path, dim: i64, eps: f64) -> Self {
        Self::with_bias(p, dim, eps, true)
    }

    pub fn with_bias(p: nn::Path, dim: i64, eps: f64, bias: bool) -> Self {
        let weight = p.var("weight", &[dim], Init::Const(1.0));
        let bias = bias.then(|| p.var("bias", &[dim], Init::Const(0.0)));
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
            self.bias.as_ref(),
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
    /// Backward yields the looked-up rows only (a sparse gradient, which AccumulateGrad adds
    /// into a dense `.grad` row by row) instead of a (V, C) tensor of mostly zeros. Off by
    /// default, as `nn.Embedding(sparse=False)`: with no dense `.grad` bound, `.grad` would be
    /// sparse.
    pub sparse_grad: bool,
}

impl Embedding {
    pub fn new(p: nn::Path, num: i64, dim: i64, init_range: f64, padding_idx: Option<i64>) -> Self {
        let weight = normal_var(&p, "weight", &[num, dim], init_range);
        if let Some(idx) = padding_idx {
            tch::no_grad(|| {
                let _ = weight.get(idx).zero_();
            });
        }
        Embedding {
            weight,
            padding_idx: padding_idx.unwrap_or(-1),
            sparse_grad: false,
        }
    }

    /// A table of fixed values (DistilBERT's sinusoidal positions), registered but not trained.
    pub fn frozen(p: nn::Path, table: Tensor) -> Self {
        let weight = p.add("weight", table, false);
        Embedding {
            weight,
            padding_idx: -1,
            sparse_grad: false,
        }
    }

    pub fn forward(&self, ids: &Tensor) -> Tensor {
        let rows = Tensor::embedding(&self.weight, ids, self.padding_idx, false, self.sparse_grad);
        // A frozen bf16 table (LoRA's `model.dtype = "bf16"`) still starts an fp32 residual
        // stream, as an fp32 table does under autocast.
        match rows.kind() {
            Kind::BFloat16 => rows.to_kind(Kind::Float),
            _ => rows,
        }
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

/// Dropout that is the identity outside training or at p = 0 (no RNG draw, no copy). In
/// training the mask comes from this thread's dropout stream ([`seed_dropout`]) and is
/// regenerated in backward, not kept.
pub fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        seeded_dropout(x, p, next_dropout_seed())
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

/// Multi-head scaled dot-product attention on already-projected q (B, Tq, C) and k, v (B, T,
/// C); Tq is T, or 1 where only the first position's output is needed ([`Positions`]).
/// Returns (B, Tq, C).
pub fn multi_head_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    num_heads: i64,
    dropout_p: f64,
    train: bool,
) -> Tensor {
    let (b, tq, c) = q.size3().expect("attention input is (B, T, C)");
    let d = c / num_heads;
    // (B, T, C) -> (B, H, T, D)
    let split = |x: &Tensor| x.view([b, -1, num_heads, d]).transpose(1, 2);
    let ctx = if train && dropout_p > 0.0 {
        // libtorch's fused kernel has no dropout on CPU and its fallback keeps three (B, H,
        // T, T) tensors per layer: ours keeps none.
        seeded_attention(
            &split(q),
            &split(k),
            &split(v),
            mask,
            dropout_p,
            next_dropout_seed(),
        )
    } else {
        Tensor::scaled_dot_product_attention(
            &split(q),
            &split(k),
            &split(v),
            Some(mask),
            0.0,
            false,
            None,
            false,
        )
    }; // (B, H, Tq, D)
    ctx.transpose(1, 2).contiguous().view([b, tq, c])
}

/// Which keys each query of a decoder may attend to.
#[derive(Debug)]
pub enum CausalMask {
    /// Keys up to the query's own position: no padding, no window.
    Causal,
    /// Every key: one new query after cached keys, in generation.
    All,
    /// (B, 1, T, T) booleans, true where attended: causal and padding (and window) together.
    Explicit(Tensor),
    /// Keys up to the query's own position that are not padding: `keys` (B, 1, 1, T) true at
    /// real tokens, `full` the (B, 1, T, T) mask of both (what `Explicit` would hold).
    CausalPadded { keys: Tensor, full: Tensor },
}

impl CausalMask {
    /// The mask of a (B, T) batch: plain causal when nothing is padded and no window cuts in;
    /// else causal, key padding and the sliding window of `window` tokens (`None`: no window).
    pub fn new(attention_mask: &Tensor, window: Option<i64>) -> Self {
        let (b, t) = attention_mask.size2().expect("attention mask is (B, T)");
        let padded = attention_mask.eq(0).any().int64_value(&[]) != 0;
        let windowed = window.is_some_and(|w| t > w);
        if !padded && !windowed {
            return CausalMask::Causal;
        }
        let allowed = Self::allowed(0, t, window, attention_mask.device());
        let keys = attention_mask.ne(0).view([b, 1, 1, t]);
        let full = allowed.logical_and(&keys);
        if windowed {
            CausalMask::Explicit(full)
        } else {
            CausalMask::CausalPadded { keys, full }
        }
    }

    /// The mask of `t` new queries after `cached` cached positions (generation, no padding),
    /// the sliding window of `window` tokens applying to cached keys too.
    pub fn after_cache(cached: i64, t: i64, window: Option<i64>, device: tch::Device) -> Self {
        let windowed = window.is_some_and(|w| cached + t > w);
        match (cached, t) {
            _ if windowed => CausalMask::Explicit(Self::allowed(cached, t, window, device)),
            (0, _) => CausalMask::Causal,
            (_, 1) => CausalMask::All,
            _ => CausalMask::Explicit(Self::allowed(cached, t, None, device)),
        }
    }

    /// (1, 1, T, start + T) booleans: query `start + i` sees keys up to itself and, with a
    /// window, after `query - window` (transformers' sliding window).
    fn allowed(start: i64, t: i64, window: Option<i64>, device: tch::Device) -> Tensor {
        let query = Tensor::arange_start(start, start + t, (Kind::Int64, device)).view([-1, 1]);
        let key = Tensor::arange(start + t, (Kind::Int64, device)).view([1, -1]);
        let mut allowed = key.le_tensor(&query);
        if let Some(w) = window {
            allowed = allowed.logical_and(&key.gt_tensor(&(&query - w)));
        }
        allowed.view([1, 1, t, start + t])
    }
}

/// The causal sequence length from which training attention takes the per-pair loop's causal
/// tiles (`seeded_causal_attention`) instead of libtorch's fused kernel or the batched
/// products. At the Llama-125M bench row's shape (batch 1, seq 512, 12 heads of 64) forward +
/// backward took 18.5 ms against the fused kernel's 25.8 in fp32, 13.6 against 23.6 in bf16
/// (`cargo bench --bench attention`).
pub const CAUSAL_TILES_FROM: i64 = 256;

/// Grouped-query attention of (B, H, T, D) queries over (B, KV, Tk, D) keys and values (each
/// key/value head serves H / KV query heads), masked by `mask`, scaled by 1/sqrt(D), with dropout on
/// the probabilities in training. Returns (B, T, H * D).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &CausalMask,
    dropout_p: f64,
    train: bool,
) -> Tensor {
    let (b, h, t, d) = q.size4().expect("queries are (B, H, T, D)");
    let (kv, tk) = (k.size()[1], k.size()[2]);
    // Each key/value head repeated for its group of query heads, as transformers' repeat_kv.
    let repeat = |x: &Tensor| {
        if kv == h {
            x.shallow_clone()
        } else {
            x.unsqueeze(2)
                .expand([b, kv, h / kv, tk, d], false)
                .reshape([b, h, tk, d])
        }
    };
    let (mut q, mut k, mut v) = (q.shallow_clone(), repeat(k), repeat(v));
    // Attention runs in the autocast dtype, as under torch.autocast (Qwen3's q/k norms return
    // fp32).
    if let Some(kind) = autocast_kind() {
        (q, k, v) = (q.to_kind(kind), k.to_kind(kind), v.to_kind(kind));
    }
    let q = &q;
    let tiles = train && t >= CAUSAL_TILES_FROM && matches!(q.kind(), Kind::Float | Kind::BFloat16);
    let dropout = train && dropout_p > 0.0;
    // The key mask of a plain causal mask, where the seeded kernel takes it.
    let causal_keys = match mask {
        _ if !(tiles || dropout) => None,
        CausalMask::Causal => Some(Tensor::ones([b, 1, 1, t], (Kind::Bool, q.device()))),
        CausalMask::CausalPadded { keys, .. } => Some(keys.shallow_clone()),
        CausalMask::All | CausalMask::Explicit(_) => None,
    };
    let ctx = match (causal_keys, mask) {
        // Long causal blocks: the per-pair loop's query tiles skip most of the masked half, and
        // run with or without dropout faster than libtorch's fused kernel; short ones with
        // dropout: batched products under the causal mask.
        (Some(keys), _) => {
            let batched_up_to = if tiles { 0 } else { SEEDED_BATCHED_UP_TO };
            seeded_causal_attention(
                q,
                &k,
                &v,
                &keys,
                dropout_p,
                next_dropout_seed(),
                batched_up_to,
            )
        }
        (_, CausalMask::Explicit(m)) if dropout => {
            seeded_attention(q, &k, &v, m, dropout_p, next_dropout_seed())
        }
        (_, CausalMask::All) if dropout => {
            let keys = Tensor::ones([b, 1, 1, tk], (Kind::Bool, q.device()));
            seeded_attention(q, &k, &v, &keys, dropout_p, next_dropout_seed())
        }
        (_, CausalMask::Causal) => {
            Tensor::scaled_dot_product_attention::<Tensor>(q, &k, &v, None, 0.0, true, None, false)
        }
        (_, CausalMask::All) => {
            Tensor::scaled_dot_product_attention::<Tensor>(q, &k, &v, None, 0.0, false, None, false)
        }
        (_, CausalMask::Explicit(m) | CausalMask::CausalPadded { full: m, .. }) => {
            Tensor::scaled_dot_product_attention(q, &k, &v, Some(m), 0.0, false, None, false)
        }
    }; // (B, H, T, D)
    ctx.transpose(1, 2).contiguous().view([b, t, h * d])
}

/// Keys and values of the positions already seen, per layer, so that generation runs each new
/// token alone.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer, (B, KV, T, D) keys and values.
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Positions cached so far.
    pub len: i64,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            layers: (0..num_layers).map(|_| None).collect(),
            len: 0,
        }
    }

    /// Appends this pass's (B, KV, T, D) keys and values of `layer`; returns all of them.
    pub fn extend(&mut self, layer: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let merged = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[pk, k], 2), Tensor::cat(&[pv, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some((merged.0.shallow_clone(), merged.1.shallow_clone()));
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::FlatParams;
    use tch::Device;

    fn leaf(dims: &[i64]) -> Tensor {
        Tensor::randn(dims, (Kind::Float, Device::Cpu)).set_requires_grad(true)
    }

    fn copy(t: &Tensor) -> Tensor {
        t.detach().copy().set_requires_grad(true)
    }

    /// Training at a long causal length (the causal tiles, GQA: 4 query heads on 2 key/value
    /// heads), unpadded and with the second sequence padded after 250 tokens, against
    /// libtorch's fused kernel (what evaluation runs) on copies of the same leaves: outputs and
    /// gradients agree to 1e-5 (fp32 sums of 300 terms in another order; a tile that saw one
    /// key too many or too few moves outputs by ~1e-2).
    #[test]
    fn causal_tiles_in_training_equal_the_fused_kernel() {
        let t = CAUSAL_TILES_FROM + 44;
        let lengths = Tensor::from_slice(&[t, 250]).view([2, 1]);
        let padded = Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .view([1, t])
            .lt_tensor(&lengths)
            .to_kind(Kind::Int64);
        let masks = [
            CausalMask::new(&Tensor::ones([2, t], (Kind::Int64, Device::Cpu)), None),
            CausalMask::new(&padded, None),
        ];
        assert!(matches!(masks[0], CausalMask::Causal));
        assert!(matches!(masks[1], CausalMask::CausalPadded { .. }));
        for mask in &masks {
            check_causal_tiles(mask, t);
        }
    }

    /// Short causal blocks with attention dropout (the seeded kernel's batched products, the
    /// causal mask built from its flag), unpadded and padded, against the seeded kernel under
    /// the explicit (B, 1, T, T) mask on the same dropout seed: the same mask elements, so the
    /// outputs agree to fp32 rounding (1e-6; one element dropped differently moves them ~1e-1).
    #[test]
    fn short_causal_blocks_with_dropout_take_the_causal_flag() {
        let t = 37;
        let lengths = Tensor::from_slice(&[t, 20]).view([2, 1]);
        let padded = Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .view([1, t])
            .lt_tensor(&lengths)
            .to_kind(Kind::Int64);
        for attention_mask in [Tensor::ones([2, t], (Kind::Int64, Device::Cpu)), padded] {
            let (q, k, v) = (
                leaf(&[2, 4, t, 16]),
                leaf(&[2, 4, t, 16]),
                leaf(&[2, 4, t, 16]),
            );
            let mask = CausalMask::new(&attention_mask, None);
            seed_dropout(11);
            let flagged = causal_attention(&q, &k, &v, &mask, 0.2, true);
            let keys = attention_mask.ne(0).view([2, 1, 1, t]);
            let full = CausalMask::allowed(0, t, None, Device::Cpu).logical_and(&keys);
            seed_dropout(11);
            let explicit = seeded_attention(&q, &k, &v, &full, 0.2, next_dropout_seed())
                .transpose(1, 2)
                .reshape([2, t, 64]);
            let diff = (&flagged - &explicit).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "outputs differ by {diff}");
        }
    }

    fn check_causal_tiles(mask: &CausalMask, t: i64) {
        tch::manual_seed(7);
        let (q, k, v) = (
            leaf(&[2, 4, t, 16]),
            leaf(&[2, 2, t, 16]),
            leaf(&[2, 2, t, 16]),
        );
        let grad_out = Tensor::randn([2, t, 64], (Kind::Float, Device::Cpu));
        let run = |q: &Tensor, k: &Tensor, v: &Tensor, train: bool| {
            let out = causal_attention(q, k, v, mask, 0.0, train);
            (&out * &grad_out).sum(Kind::Float).backward();
            out.detach()
        };
        let (q2, k2, v2) = (copy(&q), copy(&k), copy(&v));
        let (tiled, fused) = (run(&q, &k, &v, true), run(&q2, &k2, &v2, false));
        let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        assert!(
            diff(&tiled, &fused) < 1e-5,
            "outputs differ by {}",
            diff(&tiled, &fused)
        );
        for (name, a, b) in [("q", &q, &q2), ("k", &k, &k2), ("v", &v, &v2)] {
            let d = diff(&a.grad(), &b.grad());
            assert!(d < 1e-5, "gradients of {name} differ by {d}");
        }
    }

    /// `linear_of_parts` on x (2, 5, 8) and layers of 8 inputs, backward twice,
    /// against autograd's gradients of the plain product of copies: each gradient must come out
    /// twice autograd's. Tolerance 1e-4: fp32 sums of 8-term products of N(0, 1) values over
    /// 10 rows, added in another order.
    fn check_two_backwards(x: &Tensor, weights: &[&Tensor], biases: &[&Tensor]) {
        check_two_backwards_in(None, x, weights, biases)
    }

    /// The same under autocast to `compute`, against torch.autocast's path: copies cast to
    /// `compute`, multiplied, their gradients cast back.
    fn check_two_backwards_in(
        compute: Option<Kind>,
        x: &Tensor,
        weights: &[&Tensor],
        biases: &[&Tensor],
    ) {
        for t in weights.iter().chain(biases) {
            // Left by an earlier check on the same layers.
            if t.grad().defined() {
                let _ = t.grad().zero_();
            }
        }
        let outs: i64 = weights.iter().map(|w| w.size()[0]).sum();
        let dy = Tensor::randn([2, 5, outs], (Kind::Float, Device::Cpu));
        let (xr, wr, br) = (
            copy(x),
            weights.iter().map(|w| copy(w)).collect::<Vec<_>>(),
            biases.iter().map(|b| copy(b)).collect::<Vec<_>>(),
        );
        let kind = compute.unwrap_or(Kind::Float);
        let b = (!br.is_empty()).then(|| Tensor::cat(&br, 0).to_kind(kind));
        let yr = xr
            .to_kind(kind)
            .linear(&Tensor::cat(&wr, 0).to_kind(kind), b.as_ref());
        (&yr * &dy).sum(Kind::Float).backward();
        let _autocast = autocast(compute);
        for _ in 0..2 {
            let y = linear_of_parts(x, weights, biases);
            assert_eq!(y.kind(), kind, "the product's dtype");
            let d = f64::try_from((&y - &yr).abs().max()).unwrap();
            assert!(d < 1e-5, "outputs differ by {d:e}");
            (&y * &dy).sum(Kind::Float).backward();
        }
        let ours = std::iter::once(x)
            .chain(weights.iter().copied())
            .chain(biases.iter().copied());
        let theirs = std::iter::once(&xr).chain(&wr).chain(&br);
        for (i, (ours, theirs)) in ours.zip(theirs).enumerate() {
            assert_eq!(
                ours.grad().kind(),
                Kind::Float,
                "input {i}'s gradient dtype"
            );
            let d = f64::try_from((ours.grad() - theirs.grad() * 2.0).abs().max()).unwrap();
            assert!(
                d < 1e-4,
                "input {i} of [x, weights, biases]: gradient differs by {d:e}"
            );
        }
    }

    /// Without a `.grad` (the first backward) the gradients go back through autograd; after
    /// it, the backward GEMM adds each weight's share into its own `.grad`.
    #[test]
    fn weight_gradients_accumulate_in_place_as_autograd_adds_them() {
        tch::manual_seed(0);
        let (w1, w2, b1, b2) = (leaf(&[3, 8]), leaf(&[4, 8]), leaf(&[3]), leaf(&[4]));
        check_two_backwards(&leaf(&[2, 5, 8]), &[&w1, &w2], &[&b1, &b2]);

        // Frozen weights (LoRA's base layers) get none; the input still does.
        let frozen = [2, 3].map(|o| Tensor::randn([o, 8], (Kind::Float, Device::Cpu)));
        for layers in [&frozen[..1], &frozen[..]] {
            let x = leaf(&[2, 5, 8]);
            let layers: Vec<&Tensor> = layers.iter().collect();
            linear_of_parts(&x, &layers, &[])
                .sum(Kind::Float)
                .backward();
            assert!(
                layers.iter().all(|w| !w.grad().defined()),
                "a frozen weight got a gradient"
            );
            let expected = Tensor::cat(&layers, 0).sum_dim_intlist(0, false, Kind::Float);
            let d = f64::try_from((x.grad() - expected).abs().max()).unwrap();
            assert!(
                d < 1e-5,
                "input gradient through frozen layers differs by {d:e}"
            );
        }
    }

    /// With `.grad`s bound to the flat buffer: weights whose gradients lie side by side take
    /// one product into both; with biases between them, one product whose rows are added
    /// into each; one layer, its own product. Products in `compute` (autocast), if given.
    fn check_flat_buffer_layouts(compute: Option<Kind>) {
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let (a, b) = (
            normal_var(&root, "a", &[3, 8], 1.0),
            normal_var(&root, "b", &[4, 8], 1.0),
        );
        let lin = Linear::new(&root / "lin", 8, 3, 1.0);
        let lin2 = Linear::new(&root / "lin2", 8, 4, 1.0);
        let flat = FlatParams::new(&vs, |_| 0);
        assert_eq!(
            a.grad().data_ptr() as usize + 3 * 8 * 4,
            b.grad().data_ptr() as usize,
            "the test needs a's and b's gradients adjacent"
        );
        check_two_backwards_in(compute, &leaf(&[2, 5, 8]), &[&a, &b], &[]);
        let biases = [lin.bias.as_ref().unwrap(), lin2.bias.as_ref().unwrap()];
        let (weights, x) = ([&lin.weight, &lin2.weight], leaf(&[2, 5, 8]));
        check_two_backwards_in(compute, &x, &weights, &biases);
        check_two_backwards_in(compute, &leaf(&[2, 5, 8]), &weights[1..], &biases[1..]);
        drop(flat);
    }

    #[test]
    fn weight_gradients_accumulate_into_the_flat_buffer() {
        tch::manual_seed(0);
        check_flat_buffer_layouts(None);
    }

    /// Under bf16 autocast the same layouts, and the bf16 products' gradients (made, then
    /// added into the fp32 .grads) against torch.autocast's path. The values come out the
    /// same (the gradients to 1e-4 as above): both make the one bf16 product of the same
    /// bf16 operands and widen it exactly.
    #[test]
    fn bf16_products_add_their_gradients_as_autocast_does() {
        tch::manual_seed(1);
        let bf16 = Some(Kind::BFloat16);
        check_flat_buffer_layouts(bf16);
        // Without a flat buffer (the first backward's path above, every time here).
        let (w, bias) = (leaf(&[3, 8]), leaf(&[3]));
        check_two_backwards_in(bf16, &leaf(&[2, 5, 8]), &[&w], &[&bias]);
    }

    /// The LM loss made a chunk of logits at a time, against `cross_entropy(linear(h, w), y)`
    /// on copies of the same leaves (fp32; bf16 products under autocast), with targets not
    /// counted (-100) and chunks that do not divide the rows, the weight's gradient returned
    /// to autograd and, bound to the flat buffer, added into it: loss and gradients agree to
    /// 1e-5 in fp32 (sums of 50 terms in another order; a row counted twice or a target off
    /// by one moves them by ~1e-2) and to 2e-2 relative in bf16 (bf16 rounding of the
    /// gradient before its products, on both sides, summed in another order).
    fn check_lm_cross_entropy(compute: Option<Kind>, rows: i64, bound: f64) {
        let _autocast = autocast(compute);
        let (n, c, v) = (10, 16, 50);
        let targets = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let _ = targets.get(3).fill_(-100);
        let _ = targets.get(7).fill_(-100);
        let vs = nn::VarStore::new(Device::Cpu);
        let bound_weight = normal_var(&vs.root(), "w", &[v, c], 1.0);
        let flat = FlatParams::new(&vs, |_| 0);
        for weight in [leaf(&[v, c]), bound_weight.shallow_clone()] {
            let h = leaf(&[n, c]);
            let (h2, w2) = (copy(&h), copy(&weight));
            let reference = linear(&h2, &w2, None)
                .to_kind(Kind::Float)
                .cross_entropy_loss::<Tensor>(&targets, None, tch::Reduction::Mean, -100, 0.0);
            reference.backward();
            let chunked = lm_cross_entropy_in_chunks(&h, &weight, &targets, rows);
            chunked.backward();
            let rel = |a: &Tensor, b: &Tensor| {
                let scale = b.abs().max().double_value(&[]).max(1e-12);
                (a - b).abs().max().double_value(&[]) / scale
            };
            assert!(
                rel(&chunked, &reference) < bound,
                "loss {chunked} vs {reference}"
            );
            assert!(rel(&h.grad(), &h2.grad()) < bound, "hidden gradient");
            assert!(rel(&weight.grad(), &w2.grad()) < bound, "weight gradient");
        }
        drop(flat);
    }

    #[test]
    fn lm_loss_in_chunks_equals_the_cross_entropy_of_the_logits() {
        tch::manual_seed(2);
        for rows in [1, 3, 4, 10, 64] {
            check_lm_cross_entropy(None, rows, 1e-5);
        }
        check_lm_cross_entropy(Some(Kind::BFloat16), 3, 2e-2);
    }
}
