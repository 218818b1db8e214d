//! `sprtrain generate`: text from a causal language model, one token at a time with a key/value
//! cache, as transformers' `generate`: greedy, or sampling with temperature, top-k and top-p
//! from a seeded generator.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use crate::data::chat::ChatTemplate;
use crate::data::tokenizer::load_untruncated;
use crate::io::hf_files::TOKENIZER_FILE;
use crate::io::hub;
use crate::models::{self, lora, Head, TaskModel};

/// `sprtrain generate` options.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Model directory or Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as a user message through the tokenizer's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0 = greedy (the most likely token each step); above 0, sample from the softmax of
    /// logits / temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample only among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample only among the most likely tokens whose probabilities sum to p (1 = all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
}

impl Sampling {
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be 0 (greedy) or positive");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1]");
        }
        Ok(())
    }

    /// The next token from one position's logits (V): transformers' warpers in their order
    /// (temperature, top-k, top-p), then a draw from `rng`.
    pub fn pick(&self, logits: &[f32], rng: &mut ChaCha8Rng) -> i64 {
        let argmax = |xs: &[f32]| {
            // First maximum, as torch.argmax.
            let mut best = 0;
            for (i, &x) in xs.iter().enumerate() {
                if x > xs[best] {
                    best = i;
                }
            }
            best as i64
        };
        if self.temperature == 0.0 {
            return argmax(logits);
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if self.top_k > 0 {
            order.truncate(self.top_k);
        }
        let scaled: Vec<f64> = order
            .iter()
            .map(|&i| logits[i] as f64 / self.temperature)
            .collect();
        let max = scaled[0];
        let weights: Vec<f64> = scaled.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        // Top-p: the smallest head of the sorted tokens whose probability reaches p.
        let mut keep = weights.len();
        if self.top_p < 1.0 {
            let mut cumulative = 0.0;
            for (n, w) in weights.iter().enumerate() {
                cumulative += w / total;
                if cumulative >= self.top_p {
                    keep = n + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = weights[..keep].iter().sum();
        let mut draw = rng.random::<f64>() * kept_total;
        for (n, w) in weights[..keep].iter().enumerate() {
            draw -= w;
            if draw <= 0.0 {
                return order[n] as i64;
            }
        }
        order[keep - 1] as i64
    }
}

/// Continues `prompt` (token ids) by up to `max_new` tokens, stopping after any of `stop`.
/// Models with learned positions (GPT-2) continue past their last position with the context
/// cut to the positions they have. Returns the new tokens.
pub fn generate(
    model: &TaskModel,
    prompt: &[i64],
    max_new: usize,
    sampling: Sampling,
    stop: &[i64],
    seed: u64,
) -> Result<Vec<i64>> {
    sampling.validate()?;
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    // Learned positions (GPT-2) end at max_position_embeddings; rotary ones do not.
    let limit = if model.config.rope.is_some() {
        i64::MAX as usize
    } else {
        model.config.max_position_embeddings as usize
    };
    if prompt.len() >= limit {
        bail!(
            "the prompt has {} tokens; the model's {} positions leave no room to generate",
            prompt.len(),
            limit
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut cache = model.new_cache();
    let mut input = Tensor::from_slice(prompt).unsqueeze(0); // (1, T)
    let mut all = prompt.to_vec();
    tch::no_grad(|| -> Result<()> {
        while all.len() - prompt.len() < max_new {
            if (cache.len + input.size()[1]) as usize > limit {
                // Past the last learned position: the last positions again, without the
                // cache, as nanoGPT samples past its block size.
                cache = model.new_cache();
                input = Tensor::from_slice(&all[all.len() - (limit - 1)..]).unsqueeze(0);
            }
            let logits = model.forward_cached(&input, &mut cache)?; // (1, T, V)
            let last = logits.select(1, -1).squeeze_dim(0).to_kind(Kind::Float);
            let next = sampling.pick(&Vec::<f32>::try_from(&last)?, &mut rng);
            all.push(next);
            if stop.contains(&next) {
                break;
            }
            input = Tensor::from_slice(&[next]).unsqueeze(0);
        }
        Ok(())
    })?;
    Ok(all.split_off(prompt.len()))
}

/// `sprtrain generate`: prints the prompt's continuation.
pub fn run(args: &GenerateArgs) -> Result<String> {
    crate::config::Fp32Gemm::Auto.select()?;
    let dir: PathBuf = hub::resolve_model_dir(&args.model, &args.revision)?;
    // A LoRA adapter runs on its base model.
    let pretrained = if lora::is_adapter_dir(&dir) {
        crate::commands::merge::load(&dir, None, Head::CausalLm)?.1
    } else {
        models::from_pretrained(&dir, Head::CausalLm, |_| Ok(()), 0).with_context(|| {
            format!("cannot load a causal language model from {}", dir.display())
        })?
    };
    let model = &pretrained.model;
    for line in pretrained.report.summary_lines(&model.class_name(), &dir) {
        tracing::warn!("{line}");
    }
    let tokenizer = load_untruncated(&dir.join(TOKENIZER_FILE))?;
    let (text, special) = if args.chat {
        let template = ChatTemplate::find(&dir)?.with_context(|| {
            format!(
                "--chat: the tokenizer in {} has no chat template",
                dir.display()
            )
        })?;
        let message = serde_json::json!({"role": "user", "content": args.prompt});
        (template.render(&[message], true)?, false)
    } else {
        (args.prompt.clone(), true)
    };
    let enc = tokenizer.encode(text.as_str(), special).map_err(|e| {
        anyhow!(
            "cannot tokenize the prompt with {}: {e}",
            dir.join(TOKENIZER_FILE).display()
        )
    })?;
    let prompt: Vec<i64> = enc.get_ids().iter().map(|&i| i as i64).collect();
    let stop = if args.ignore_eos {
        Vec::new()
    } else {
        model.config.eos_token_ids.clone()
    };
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    let new = generate(
        model,
        &prompt,
        args.max_new_tokens,
        sampling,
        &stop,
        args.seed,
    )?;
    let ids: Vec<u32> = new.iter().map(|&i| i as u32).collect();
    let continuation = tokenizer
        .decode(&ids, true)
        .map_err(|e| anyhow!("cannot decode the generated tokens: {e}"))?;
    Ok(continuation)
}
