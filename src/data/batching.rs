//! Tokenized examples and the batch plan.
//!
//! The sample order is a function of the seed and the epoch alone. An optimizer step consumes
//! one *global batch* of `batch_size x accumulation x world` examples, cut into micro-batches of
//! `batch_size`; micro-batch `m` of a step belongs to process `m / accumulation`. So N processes
//! see exactly the global batches one process sees with N-fold accumulation.

use anyhow::Result;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

use crate::models::{EncoderInputs, Labels};

/// What a feature is trained towards; it also decides the batch's [`Labels`].
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// A class id (single-label classification).
    Class(usize),
    /// A regression value.
    Value(f64),
    /// Start and end token positions of an answer (question answering).
    Span(i64, i64),
    /// Causal LM: every token from position `from` on is a target (the prompt before it is not
    /// scored; 0 for plain text).
    NextTokens { from: usize },
    /// One label per token, aligned with `input_ids`, -100 where nothing is scored (token
    /// classification; masked LM once masked).
    Tokens(Vec<i64>),
    /// Masked LM before masking: the labels are drawn when the feature is batched.
    Masked,
}

/// One tokenized example (or one window of one, in question answering).
#[derive(Debug, Clone, PartialEq)]
pub struct Feature {
    pub input_ids: Vec<i64>,
    pub type_ids: Vec<i64>,
    pub target: Target,
}

impl Feature {
    /// The ids and token types of one encoding, with its target.
    pub fn from_encoding(enc: &tokenizers::Encoding, target: Target) -> Self {
        Feature {
            input_ids: enc.get_ids().iter().map(|&i| i as i64).collect(),
            type_ids: enc.get_type_ids().iter().map(|&i| i as i64).collect(),
            target,
        }
    }
}

/// Serialises features for exchange between processes: per feature, u32 length, the ids as
/// u32, the type ids as u8, then a tag byte and the target: 0 and a u64 class id, 1 and an
/// f64 value, 2 and two i64 span positions, 3 and the u64 first scored position, 4 and one
/// i32 label per token, or 5 alone (masked LM) (little-endian).
pub fn encode_features(features: &[Feature]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in features {
        out.extend((f.input_ids.len() as u32).to_le_bytes());
        for &id in &f.input_ids {
            out.extend((id as u32).to_le_bytes());
        }
        out.extend(f.type_ids.iter().map(|&t| t as u8));
        match f.target {
            Target::Class(c) => {
                out.push(0);
                out.extend((c as u64).to_le_bytes());
            }
            Target::Value(v) => {
                out.push(1);
                out.extend(v.to_le_bytes());
            }
            Target::Span(s, e) => {
                out.push(2);
                out.extend(s.to_le_bytes());
                out.extend(e.to_le_bytes());
            }
            Target::NextTokens { from } => {
                out.push(3);
                out.extend((from as u64).to_le_bytes());
            }
            Target::Tokens(ref labels) => {
                out.push(4);
                for &l in labels {
                    out.extend((l as i32).to_le_bytes());
                }
            }
            Target::Masked => out.push(5),
        }
    }
    out
}

/// The inverse of [`encode_features`].
pub fn decode_features(bytes: &[u8]) -> Result<Vec<Feature>> {
    fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8]> {
        let s = bytes
            .get(*at..*at + n)
            .ok_or_else(|| anyhow::anyhow!("truncated feature data"))?;
        *at += n;
        Ok(s)
    }
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let n = u32::from_le_bytes(take(bytes, &mut at, 4)?.try_into()?) as usize;
        let input_ids = take(bytes, &mut at, 4 * n)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect();
        let type_ids = take(bytes, &mut at, n)?.iter().map(|&t| t as i64).collect();
        let target = match take(bytes, &mut at, 1)?[0] {
            0 => Target::Class(u64::from_le_bytes(take(bytes, &mut at, 8)?.try_into()?) as usize),
            1 => Target::Value(f64::from_le_bytes(take(bytes, &mut at, 8)?.try_into()?)),
            2 => Target::Span(
                i64::from_le_bytes(take(bytes, &mut at, 8)?.try_into()?),
                i64::from_le_bytes(take(bytes, &mut at, 8)?.try_into()?),
            ),
            3 => Target::NextTokens {
                from: u64::from_le_bytes(take(bytes, &mut at, 8)?.try_into()?) as usize,
            },
            4 => Target::Tokens(
                take(bytes, &mut at, 4 * n)?
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                    .collect(),
            ),
            5 => Target::Masked,
            tag => anyhow::bail!("unknown feature target tag {tag}"),
        };
        out.push(Feature {
            input_ids,
            type_ids,
            target,
        });
    }
    Ok(out)
}

/// A seeded stream for one purpose, so data order never depends on other random draws.
fn rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream);
    r
}

/// Splits indices 0..n into (train, held-out) with `fraction` held out, seeded.
pub fn holdout_split(n: usize, fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(&mut rng(seed, 1));
    let held = ((n as f64) * fraction).round() as usize;
    // The first `held` of the shuffled order are held out.
    let mut train = idx.split_off(held.min(n));
    train.sort_unstable();
    idx.sort_unstable();
    (train, idx)
}

/// Moves a seeded `fraction` of `examples` out (as [`holdout_split`] picks them) and returns
/// it; the rest stay, in order.
pub fn split_off_held_out<T: Clone>(examples: &mut Vec<T>, fraction: f64, seed: u64) -> Vec<T> {
    let (keep, held) = holdout_split(examples.len(), fraction, seed);
    let held: Vec<T> = held.iter().map(|&i| examples[i].clone()).collect();
    *examples = keep.iter().map(|&i| examples[i].clone()).collect();
    held
}

/// How examples become global batches.
#[derive(Debug, Clone, Copy)]
pub struct BatchPlan {
    pub micro_batch: usize,
    pub accumulation: usize,
    pub world: usize,
    pub seed: u64,
    pub drop_last: bool,
    pub group_by_length: bool,
}

impl BatchPlan {
    /// Examples per optimizer step over all processes.
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.accumulation * self.world
    }

    pub fn steps_per_epoch(&self, n: usize) -> usize {
        if self.drop_last {
            n / self.global_batch()
        } else {
            n.div_ceil(self.global_batch())
        }
    }

    /// The global batches of one epoch, as example indices.
    pub fn epoch(&self, lengths: &[usize], epoch: usize) -> Vec<Vec<usize>> {
        let g = self.global_batch();
        let mut order: Vec<usize> = (0..lengths.len()).collect();
        order.shuffle(&mut rng(self.seed, 1000 + epoch as u64));
        if self.group_by_length {
            // transformers' LengthGroupedSampler: sort megabatches of 50 batches by length,
            // longest first, so pad tokens shrink while the order stays random between groups.
            for mega in order.chunks_mut(50 * g) {
                mega.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
            }
        }
        let mut batches: Vec<Vec<usize>> = order.chunks(g).map(<[usize]>::to_vec).collect();
        if self.drop_last && batches.last().is_some_and(|b| b.len() < g) {
            batches.pop();
        }
        batches
    }

    /// This process's micro-batches of a global batch.
    pub fn micro_batches<'a>(&self, global: &'a [usize], rank: usize) -> Vec<&'a [usize]> {
        global
            .chunks(self.micro_batch)
            .enumerate()
            .filter(|(m, _)| m / self.accumulation == rank)
            .map(|(_, c)| c)
            .collect()
    }
}

/// Pads a set of features to their longest (or to `pad_to`) and builds (B, T) tensors; returns
/// the number of real tokens too.
pub fn collate(
    features: &[&Feature],
    pad_id: i64,
    pad_to: Option<usize>,
) -> (EncoderInputs, usize) {
    let b = features.len();
    let longest = features
        .iter()
        .map(|f| f.input_ids.len())
        .max()
        .unwrap_or(1);
    let t = pad_to.unwrap_or(longest).max(longest);
    let mut ids = vec![pad_id; b * t];
    let mut mask = vec![0i64; b * t];
    let mut types = vec![0i64; b * t];
    let mut real = 0;
    for (row, f) in features.iter().enumerate() {
        let n = f.input_ids.len();
        ids[row * t..row * t + n].copy_from_slice(&f.input_ids);
        types[row * t..row * t + n].copy_from_slice(&f.type_ids);
        mask[row * t..row * t + n].fill(1);
        real += n;
    }
    let shape = [b as i64, t as i64];
    (
        EncoderInputs {
            input_ids: Tensor::from_slice(&ids).view(shape),
            attention_mask: Tensor::from_slice(&mask).view(shape),
            token_type_ids: Some(Tensor::from_slice(&types).view(shape)),
        },
        real,
    )
}

/// A batch's labels, of the kind its features' targets are: (B) class ids, (B) regression
/// values, (B) start and (B) end positions, or (B, `seq_len`) token labels (-100 on a prompt,
/// unscored tokens and the padding). An empty batch, one mixing kinds, or masked-LM features
/// not yet masked, is an error.
pub fn batch_labels(features: &[&Feature], seq_len: usize) -> Result<Labels> {
    let (mut classes, mut values, mut starts, mut ends) = (vec![], vec![], vec![], vec![]);
    let mut tokens = Vec::new();
    for f in features {
        match f.target {
            Target::Class(c) => classes.push(c as i64),
            Target::Value(v) => values.push(v as f32),
            Target::Span(s, e) => {
                starts.push(s);
                ends.push(e);
            }
            Target::NextTokens { from } => {
                let mut row = vec![-100i64; seq_len];
                for (i, &id) in f.input_ids.iter().enumerate().skip(from).take(seq_len) {
                    row[i] = id;
                }
                tokens.push(row);
            }
            Target::Tokens(ref labels) => {
                let mut row = vec![-100i64; seq_len];
                let n = labels.len().min(seq_len);
                row[..n].copy_from_slice(&labels[..n]);
                tokens.push(row);
            }
            Target::Masked => anyhow::bail!("masked-LM features are batched before masking"),
        }
    }
    let n = features.len();
    if !tokens.is_empty() {
        if tokens.len() != n {
            anyhow::bail!("a batch mixes targets of different kinds");
        }
        return Ok(Labels::Tokens(
            Tensor::from_slice(&tokens.concat()).view([n as i64, seq_len as i64]),
        ));
    }
    Ok(match (classes.len(), values.len(), starts.len()) {
        _ if n == 0 => anyhow::bail!("an empty batch has no labels"),
        (c, _, _) if c == n => Labels::Classes(Tensor::from_slice(&classes)),
        (_, v, _) if v == n => Labels::Values(Tensor::from_slice(&values)),
        (_, _, s) if s == n => Labels::Spans {
            start: Tensor::from_slice(&starts),
            end: Tensor::from_slice(&ends),
        },
        _ => anyhow::bail!("a batch mixes targets of different kinds"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(micro: usize, accum: usize, world: usize) -> BatchPlan {
        BatchPlan {
            micro_batch: micro,
            accumulation: accum,
            world,
            seed: 7,
            drop_last: false,
            group_by_length: false,
        }
    }

    #[test]
    fn order_depends_on_seed_and_epoch_only() {
        let lengths = vec![5; 103];
        let a = plan(4, 1, 1).epoch(&lengths, 0);
        assert_eq!(a, plan(4, 1, 1).epoch(&lengths, 0));
        assert_ne!(a, plan(4, 1, 1).epoch(&lengths, 1));
        let mut seen: Vec<usize> = a.concat();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..103).collect::<Vec<_>>(),
            "every example once per epoch"
        );
    }

    #[test]
    fn world_size_does_not_change_the_global_batches() {
        let lengths: Vec<usize> = (0..64).map(|i| 3 + i % 11).collect();
        // 2 processes x accumulation 1 against 1 process x accumulation 2, micro-batch 4.
        let two = plan(4, 1, 2);
        let one = plan(4, 2, 1);
        assert_eq!(two.epoch(&lengths, 3), one.epoch(&lengths, 3));
        let global = &two.epoch(&lengths, 3)[0];
        let mut both: Vec<&[usize]> = two.micro_batches(global, 0);
        both.extend(two.micro_batches(global, 1));
        assert_eq!(both, one.micro_batches(global, 0));
    }

    #[test]
    fn length_grouping_cuts_padding() {
        let lengths: Vec<usize> = (0..400).map(|i| 4 + (i * 37) % 120).collect();
        let pad = |p: BatchPlan| -> usize {
            p.epoch(&lengths, 0)
                .iter()
                .map(|b| {
                    b.iter().map(|&i| lengths[i]).max().unwrap() * b.len()
                        - b.iter().map(|&i| lengths[i]).sum::<usize>()
                })
                .sum()
        };
        let grouped = BatchPlan {
            group_by_length: true,
            ..plan(8, 1, 1)
        };
        assert!(
            pad(grouped) * 4 < pad(plan(8, 1, 1)),
            "grouped {} vs random {}",
            pad(grouped),
            pad(plan(8, 1, 1))
        );
    }

    #[test]
    fn features_survive_the_exchange_format() {
        let f = vec![
            Feature {
                input_ids: vec![101, 2023, 30521, 102],
                type_ids: vec![0, 0, 1, 1],
                target: Target::Class(2),
            },
            Feature {
                input_ids: vec![0],
                type_ids: vec![0],
                target: Target::Value(-0.25),
            },
            Feature {
                input_ids: vec![101, 7, 102, 9, 102],
                type_ids: vec![0, 0, 0, 1, 1],
                target: Target::Span(3, 4),
            },
            Feature {
                input_ids: vec![4, 5, 6],
                type_ids: vec![0, 0, 0],
                target: Target::NextTokens { from: 2 },
            },
            Feature {
                input_ids: vec![101, 8, 9, 102],
                type_ids: vec![0; 4],
                target: Target::Tokens(vec![-100, 3, -100, -100]),
            },
            Feature {
                input_ids: vec![101, 102],
                type_ids: vec![0; 2],
                target: Target::Masked,
            },
        ];
        let back = decode_features(&encode_features(&f)).unwrap();
        assert_eq!(back, f);
        assert!(decode_features(&encode_features(&f)[..10]).is_err());
    }

    #[test]
    fn labels_follow_the_targets() {
        let feature = |target| Feature {
            input_ids: vec![1, 2],
            type_ids: vec![0, 0],
            target,
        };
        let (a, b) = (feature(Target::Class(2)), feature(Target::Class(0)));
        let Labels::Classes(y) = batch_labels(&[&a, &b], 2).unwrap() else {
            panic!("class targets make class labels")
        };
        assert_eq!(Vec::<i64>::try_from(&y).unwrap(), [2, 0]);
        let v = feature(Target::Value(-0.25));
        let Labels::Values(y) = batch_labels(&[&v], 2).unwrap() else {
            panic!("values make value labels")
        };
        assert_eq!(Vec::<f32>::try_from(&y).unwrap(), [-0.25]);
        let s = feature(Target::Span(3, 4));
        let Labels::Spans { start, end } = batch_labels(&[&s, &s], 2).unwrap() else {
            panic!("spans make span labels")
        };
        assert_eq!(Vec::<i64>::try_from(&start).unwrap(), [3, 3]);
        assert_eq!(Vec::<i64>::try_from(&end).unwrap(), [4, 4]);
        assert!(batch_labels(&[&a, &v], 2).is_err());
        assert!(batch_labels(&[], 2).is_err());
        // Causal LM: the prompt and the padding are not scored.
        let prompted = Feature {
            input_ids: vec![5, 6, 7],
            type_ids: vec![0; 3],
            target: Target::NextTokens { from: 1 },
        };
        let text = Feature {
            input_ids: vec![8, 9],
            type_ids: vec![0; 2],
            target: Target::NextTokens { from: 0 },
        };
        let Labels::Tokens(y) = batch_labels(&[&prompted, &text], 4).unwrap() else {
            panic!("next-token targets make token labels")
        };
        assert_eq!(y.size(), [2, 4]);
        assert_eq!(
            Vec::<i64>::try_from(&y.view([-1])).unwrap(),
            [-100, 6, 7, -100, 8, 9, -100, -100]
        );
        assert!(batch_labels(&[&prompted, &a], 4).is_err());
        // Token labels are padded with -100.
        let tagged = Feature {
            input_ids: vec![1, 2, 3],
            type_ids: vec![0; 3],
            target: Target::Tokens(vec![-100, 4, 0]),
        };
        let Labels::Tokens(y) = batch_labels(&[&tagged], 5).unwrap() else {
            panic!("token labels make token labels")
        };
        assert_eq!(
            Vec::<i64>::try_from(&y.view([-1])).unwrap(),
            [-100, 4, 0, -100, -100]
        );
        let unmasked = Feature {
            target: Target::Masked,
            ..tagged
        };
        assert!(batch_labels(&[&unmasked], 3).is_err());
    }

    #[test]
    fn drop_last_and_holdout() {
        let p = BatchPlan {
            drop_last: true,
            ..plan(4, 1, 1)
        };
        assert_eq!(p.steps_per_epoch(10), 2);
        assert!(p.epoch(&[1; 10], 0).iter().all(|b| b.len() == 4));
        assert_eq!(plan(4, 1, 1).steps_per_epoch(10), 3);
        let (train, eval) = holdout_split(100, 0.1, 3);
        assert_eq!((train.len(), eval.len()), (90, 10));
        assert!(eval.iter().all(|i| !train.contains(i)));
        assert_eq!(holdout_split(100, 0.1, 3), (train, eval));
    }
}
