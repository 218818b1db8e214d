//! The run's data set: files resolved (locally or through the Hub), read by the task, and
//! tokenized with the work shared between processes.

use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::config::Config;
use crate::data::batching::{decode_features, encode_features, Feature};
use crate::dist::Dist;
use crate::io::hub::{self, SplitChoice};
use crate::tasks::{DataFiles, Shards};

/// Training and evaluation files, and the fraction to hold out when there is no evaluation
/// file; `data.offline_fallback_file` stands in for Hub files the Hub cannot serve.
pub fn resolve_data(config: &Config, report: bool) -> Result<DataFiles> {
    let dc = &config.data;
    let resolve = || -> Result<DataFiles> {
        if dc.train_file.is_empty() {
            bail!("data.train_file: no training file given");
        }
        let choice = |split| SplitChoice {
            config: &dc.dataset_config,
            split,
        };
        Ok(DataFiles {
            train: hub::resolve_data_file(&dc.train_file, choice(&dc.train_split_name))?,
            eval: (!dc.eval_file.is_empty())
                .then(|| hub::resolve_data_file(&dc.eval_file, choice(&dc.eval_split_name)))
                .transpose()?,
            eval_split: dc.eval_split,
        })
    };
    let on_hub = |f: &str| f.starts_with("hf://");
    match resolve() {
        Ok(files) => Ok(files),
        Err(e)
            if !dc.offline_fallback_file.is_empty()
                && (on_hub(&dc.train_file) || on_hub(&dc.eval_file)) =>
        {
            let split = if dc.eval_split > 0.0 {
                dc.eval_split
            } else {
                0.2
            };
            if report {
                tracing::warn!(
                    "cannot get the data from the Hugging Face Hub ({e:#}); using {} instead, {split} of it held out for evaluation (data.offline_fallback_file)",
                    dc.offline_fallback_file
                );
            }
            Ok(DataFiles {
                train: PathBuf::from(&dc.offline_fallback_file),
                eval: None,
                eval_split: split,
            })
        }
        Err(e) => Err(e),
    }
}

/// Tokenization shared over the job's processes: each takes a contiguous 1/N of the
/// examples, then the token ids are exchanged so every process holds them all, in order.
pub struct MpiShards<'a>(pub &'a Dist);

impl Shards for MpiShards<'_> {
    fn tokenize_shared(
        &self,
        what: &str,
        n: usize,
        tokenize: &dyn Fn(Range<usize>) -> Result<Vec<Feature>>,
    ) -> Result<Vec<Feature>> {
        let (rank, world) = (self.0.topo.rank, self.0.topo.world);
        if world == 1 {
            return tokenize(0..n);
        }
        let mine = encode_features(&tokenize(n * rank / world..n * (rank + 1) / world)?);
        let mut all = Vec::with_capacity(n);
        for bytes in self
            .0
            .all_gather_bytes(&format!("tokenized {what} data"), mine)?
        {
            all.extend(decode_features(&bytes)?);
        }
        Ok(all)
    }
}
