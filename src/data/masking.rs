//! Masked-LM masking as transformers' `DataCollatorForLanguageModeling` draws it: each token
//! that is not special is chosen with probability `mlm_probability`; a chosen token becomes
//! the mask token (80%), a random token of the vocabulary (10%) or stays (10%), and is the
//! only one scored. With whole-word masking, words (a token and the WordPiece `##` tokens
//! that continue it) are chosen instead of tokens, all their tokens together.
//!
//! The draws of a feature depend only on the seed, a key (the optimizer step, or evaluation)
//! and the feature's index in its data set: the masks are the same whatever the number of
//! processes, the batch it lands in, or a resume in between.

use std::path::Path;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::batching::{Feature, Target};
use super::tokenizer::load_untruncated;

/// The key of evaluation masks (training uses the optimizer step).
pub const EVAL_KEY: u64 = u64::MAX;

/// How features are masked.
#[derive(Debug, Clone)]
pub struct Masking {
    pub probability: f64,
    pub mask_id: i64,
    /// Random replacements are drawn from 0..vocab (the tokenizer's length, added tokens
    /// included, as `len(tokenizer)`).
    pub vocab: usize,
    /// Per token id: never masked (the tokenizer's special tokens).
    special: Vec<bool>,
    /// Whole-word masking: per token id, whether it continues the word before it.
    continues_word: Option<Vec<bool>>,
    seed: u64,
}

impl Masking {
    /// Masking for the tokenizer in `tokenizer_json`: its special tokens, its `[MASK]` or
    /// `<mask>` token, its vocabulary; `whole_word` needs a WordPiece tokenizer.
    pub fn new(
        tokenizer_json: &Path,
        probability: f64,
        whole_word: bool,
        seed: u64,
    ) -> Result<Self> {
        let tok = load_untruncated(tokenizer_json)?;
        let vocab = tok.get_vocab_size(true);
        let mut special = vec![false; vocab];
        let mut mask_id = None;
        for (id, token) in tok.get_added_tokens_decoder() {
            if token.special {
                if let Some(s) = special.get_mut(id as usize) {
                    *s = true;
                }
                if matches!(token.content.as_str(), "[MASK]" | "<mask>") {
                    mask_id = Some(id as i64);
                }
            }
        }
        let Some(mask_id) = mask_id else {
            bail!(
                "{}: the tokenizer has no special mask token ([MASK] or <mask>) to mask with",
                tokenizer_json.display()
            );
        };
        let continues_word = if whole_word {
            let prefix = match tok.get_model() {
                tokenizers::ModelWrapper::WordPiece(wp) => wp.continuing_subword_prefix.clone(),
                _ => bail!(
                    "data.whole_word_mask needs a WordPiece tokenizer (BERT's, whose \"##\" tokens continue a word); {} is not one",
                    tokenizer_json.display()
                ),
            };
            let mut continues = vec![false; vocab];
            for (token, id) in tok.get_vocab(true) {
                if let Some(c) = continues.get_mut(id as usize) {
                    *c = token.starts_with(&prefix);
                }
            }
            Some(continues)
        } else {
            None
        };
        if !(0.0..1.0).contains(&probability) || probability == 0.0 {
            bail!("data.mlm_probability must be in (0, 1), got {probability}");
        }
        Ok(Masking {
            probability,
            mask_id,
            vocab,
            special,
            continues_word,
            seed,
        })
    }

    fn is_special(&self, id: i64) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// `feature` (its tokens unmasked) masked with the draws of (`key`, `index`): masked input
    /// ids, and token labels (the original id where chosen, else -100).
    pub fn mask(&self, feature: &Feature, key: u64, index: usize) -> Feature {
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        rng.set_stream(index as u64);
        let ids = &feature.input_ids;
        // Which tokens are chosen: one draw per token, or per word.
        let chosen: Vec<bool> = match &self.continues_word {
            None => ids
                .iter()
                .map(|&id| {
                    let draw = rng.random::<f64>() < self.probability;
                    draw && !self.is_special(id)
                })
                .collect(),
            Some(continues) => {
                let mut chosen = vec![false; ids.len()];
                let mut word_chosen = false;
                for (t, &id) in ids.iter().enumerate() {
                    let continuation =
                        t > 0 && continues.get(id as usize).copied().unwrap_or(false);
                    if !continuation {
                        word_chosen = rng.random::<f64>() < self.probability;
                    }
                    chosen[t] = word_chosen && !self.is_special(id);
                }
                chosen
            }
        };
        let mut input_ids = ids.clone();
        let mut labels = vec![-100i64; ids.len()];
        for (t, &c) in chosen.iter().enumerate() {
            if !c {
                continue;
            }
            labels[t] = ids[t];
            // The two draws of the collator: [MASK] with 0.8, then random with 0.1 / 0.2.
            if rng.random::<f64>() < 0.8 {
                input_ids[t] = self.mask_id;
            } else if rng.random::<f64>() < 0.5 {
                input_ids[t] = rng.random_range(0..self.vocab as i64);
            }
        }
        Feature {
            input_ids,
            type_ids: feature.type_ids.clone(),
            target: Target::Tokens(labels),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masking(vocab: usize, whole_word: Option<Vec<bool>>) -> Masking {
        let mut special = vec![false; vocab];
        special[0] = true; // [CLS]
        special[1] = true; // [SEP]
        Masking {
            probability: 0.15,
            mask_id: 2,
            vocab,
            special,
            continues_word: whole_word,
            seed: 42,
        }
    }

    fn feature(ids: Vec<i64>) -> Feature {
        Feature {
            type_ids: vec![0; ids.len()],
            input_ids: ids,
            target: Target::Masked,
        }
    }

    /// Over 200,000 tokens the shares are within 1% (absolute) of 15%, 80% and 10%: the
    /// binomial standard deviations are 0.08%, 0.2% and 0.15%.
    #[test]
    fn masking_statistics_follow_the_collator() {
        let m = masking(1000, None);
        let ids: Vec<i64> = (0..200)
            .map(|i| if i % 50 == 0 { 0 } else { 10 + i })
            .collect();
        let f = feature(ids.clone());
        let (mut maskable, mut chosen, mut to_mask, mut kept, mut special_chosen) = (0, 0, 0, 0, 0);
        for index in 0..1000 {
            let masked = m.mask(&f, 3, index);
            let Target::Tokens(labels) = &masked.target else {
                panic!("masking gives token labels")
            };
            for t in 0..ids.len() {
                maskable += usize::from(ids[t] != 0);
                if labels[t] == -100 {
                    assert_eq!(masked.input_ids[t], ids[t], "unchosen tokens stay");
                    continue;
                }
                assert_eq!(labels[t], ids[t], "labels are the original tokens");
                chosen += 1;
                special_chosen += usize::from(ids[t] == 0);
                to_mask += usize::from(masked.input_ids[t] == 2);
                kept += usize::from(masked.input_ids[t] == ids[t]);
            }
        }
        let share = |a: usize, b: usize| a as f64 / b as f64;
        assert_eq!(special_chosen, 0, "special tokens are never masked");
        assert!(
            (share(chosen, maskable) - 0.15).abs() < 0.01,
            "{chosen}/{maskable}"
        );
        assert!(
            (share(to_mask, chosen) - 0.8).abs() < 0.01,
            "{to_mask}/{chosen}"
        );
        assert!((share(kept, chosen) - 0.1).abs() < 0.01, "{kept}/{chosen}");
    }

    #[test]
    fn masks_depend_on_seed_key_and_index_only() {
        let m = masking(1000, None);
        let f = feature((10..100).collect());
        assert_eq!(m.mask(&f, 5, 7), m.mask(&f, 5, 7));
        assert_ne!(m.mask(&f, 5, 7), m.mask(&f, 6, 7));
        assert_ne!(m.mask(&f, 5, 7), m.mask(&f, 5, 8));
    }

    #[test]
    fn whole_words_are_masked_together() {
        // Ids 500.. continue a word ("##" tokens).
        let continues: Vec<bool> = (0..1000).map(|i| i >= 500).collect();
        let m = masking(1000, Some(continues));
        let ids: Vec<i64> = (0..100).flat_map(|w| [10 + w, 500 + w, 600 + w]).collect();
        let mut words_chosen = 0;
        for index in 0..50 {
            let masked = m.mask(&feature(ids.clone()), 1, index);
            let Target::Tokens(labels) = &masked.target else {
                panic!("masking gives token labels")
            };
            for word in labels.chunks(3) {
                let n = word.iter().filter(|&&l| l != -100).count();
                assert!(
                    n == 0 || n == 3,
                    "a word is masked whole or not at all: {word:?}"
                );
                words_chosen += usize::from(n == 3);
            }
        }
        let share = words_chosen as f64 / 5000.0;
        assert!((share - 0.15).abs() < 0.03, "{share}");
    }
}
