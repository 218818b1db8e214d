//! ZeRO stage 3 (FSDP's FULL_SHARD): besides its shard of the optimizer state and gradient, a
//! rank keeps only its own chunk of each parameter bucket. A layer's weights are all-gathered
//! just before the layer runs, in forward and again in backward (before its recomputation
//! under activation checkpointing), the next layer's gather already on the wire while this one
//! computes, and dropped as soon as the layer is done (`FlatParams::release_params`). The embeddings and the
//! heads (stages L + 1 and 0, which tied LM heads and DeBERTa's relative positions use across
//! the whole pass) are gathered at the start of a step and dropped at its end. Evaluation runs
//! layer by layer as training's forward does; saving gathers a bucket at a time to rank 0,
//! which writes it (`GradSync::gather_params_to_root`); only LoRA's adapters and the best
//! model loaded at the end (`train.load_best_model_at_end`) are held whole
//! ([`LayerShards::hold_whole`], FSDP's `summon_full_params`).
//!
//! Under stages 1 and 2 the whole model stays on every rank ([`LayerShards::keeps_whole`]):
//! after the optimizer step only this rank's chunks are current, and the gathers of the
//! others' start at once, in the order the next forward needs them, each layer waiting for its
//! own before it runs (the gather no longer stands between one step and the next).
//!
//! The buckets of a ZeRO run never straddle two stages, so a stage is a run of whole
//! buckets; each rank's chunk of a bucket is the one it updates (`dist::chunk`), so the
//! parameters it keeps are exactly those its optimizer steps.

use std::cell::{Cell, RefCell};
use std::ops::Range;

use anyhow::Result;

use crate::dist::{Dist, Pending};
use crate::models::LayerParams;
use crate::optim::FlatParams;

/// Where a stage's weights are.
enum Weights {
    /// Only this rank's chunks.
    Released,
    /// Being all-gathered: one pending gather per bucket.
    Fetching(Vec<Pending>),
    /// Whole.
    Whole,
}

/// The stage-3 bookkeeping of a run: which buckets make up each stage, this rank's chunk of
/// each, and where each stage's weights are now.
pub struct LayerShards {
    /// Each bucket's elements of the flat buffer, and this rank's chunk of it.
    buckets: Vec<Range<usize>>,
    own: Vec<Range<usize>>,
    /// Stage s (backward numbering: heads 0, layers L..1, embeddings L + 1) is buckets
    /// `stages[s]`.
    stages: Vec<Range<usize>>,
    held: RefCell<Vec<Weights>>,
    /// The last layer's weights, used in forward, are kept for backward, which starts with it.
    keep_last_layer: Cell<bool>,
    /// ZeRO stages 1-2: nothing is ever dropped; only the gathers after a step are waited for
    /// layer by layer.
    keep_whole: bool,
    /// The first failed collective of a pass, reported when the pass is over (models, which
    /// ask for the weights, know nothing of MPI errors).
    error: RefCell<Option<anyhow::Error>>,
}

impl LayerShards {
    /// `buckets` (elements) with this rank's chunk of each and each bucket's stage, in buffer
    /// order (stages ascending), for a model of `layers` layers, at ZeRO stage `zero_stage`
    /// (1-3); every stage is held whole at first (all ranks start from the broadcast model). A
    /// stage with nothing to train (LoRA's) has no buckets.
    pub fn new(
        buckets: Vec<Range<usize>>,
        own: Vec<Range<usize>>,
        bucket_stages: &[usize],
        layers: usize,
        zero_stage: u8,
    ) -> LayerShards {
        let count = layers + 2;
        let mut stages = vec![0..0; count];
        for (i, &s) in bucket_stages.iter().enumerate() {
            stages[s] = match stages[s].is_empty() {
                true => i..i + 1,
                false => stages[s].start..i + 1,
            };
        }
        LayerShards {
            buckets,
            own,
            held: RefCell::new((0..count).map(|_| Weights::Whole).collect()),
            keep_last_layer: Cell::new(false),
            keep_whole: zero_stage < 3,
            stages,
            error: RefCell::new(None),
        }
    }

    /// Whether the whole model stays on every rank (stages 1-2) rather than each layer's
    /// weights only around their use (stage 3).
    pub fn keeps_whole(&self) -> bool {
        self.keep_whole
    }

    /// Stages 0 and L + 1: held across a whole step's passes.
    fn ends(&self) -> [usize; 2] {
        [0, self.stages.len().saturating_sub(1)]
    }

    /// Starts gathering stage `s`'s buckets, unless they are held or on their way.
    fn fetch(&self, s: usize, flat: &FlatParams, dist: &Dist) -> Result<()> {
        let mut held = self.held.borrow_mut();
        if !matches!(held[s], Weights::Released) {
            return Ok(());
        }
        let mut pending = Vec::with_capacity(self.stages[s].len());
        for b in self.stages[s].clone() {
            let (bucket, own) = (self.buckets[b].clone(), self.own[b].clone());
            // SAFETY: the bucket's other chunks were released and nothing reads them until
            // `wait` below; this rank's chunk is only read (copied) here, and buckets are
            // disjoint.
            let dst = unsafe { flat.params_range_mut(bucket.clone()) };
            let mine = dst[own.start - bucket.start..own.end - bucket.start].to_vec();
            let what = format!("parameters of stage {s}, bucket {b}");
            // SAFETY: as above; the gather is waited for before any layer reads the bucket.
            pending.push(unsafe { dist.start_all_gather_into(what, mine, dst)? });
        }
        held[s] = Weights::Fetching(pending);
        Ok(())
    }

    /// Stage `s` whole: its gather started if need be, then waited for.
    fn hold(&self, s: usize, flat: &FlatParams, dist: &Dist) -> Result<()> {
        self.fetch(s, flat, dist)?;
        let state = std::mem::replace(&mut self.held.borrow_mut()[s], Weights::Whole);
        if let Weights::Fetching(pending) = state {
            for p in pending {
                p.wait(dist)?;
            }
        }
        Ok(())
    }

    /// Drops stage `s`'s weights but for this rank's chunks.
    fn release(&self, s: usize, flat: &FlatParams, dist: &Dist) -> Result<()> {
        if matches!(self.held.borrow()[s], Weights::Released) {
            return Ok(());
        }
        // A gather in flight writes into the pages: it finishes first.
        self.hold(s, flat, dist)?;
        for b in self.stages[s].clone() {
            let (bucket, own) = (&self.buckets[b], &self.own[b]);
            flat.release_params(bucket.start..own.start);
            flat.release_params(own.end..bucket.end);
        }
        self.held.borrow_mut()[s] = Weights::Released;
        Ok(())
    }

    /// Before a step's first pass: the layers dropped (after the optimizer step, or an
    /// evaluation that held the whole model), the embeddings and heads gathered, and the first
    /// layer's gather started.
    pub fn begin_step(&self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        let ends = self.ends();
        if self.keep_whole {
            return ends.iter().try_for_each(|&s| self.hold(s, flat, dist));
        }
        for s in 0..self.stages.len() {
            if !ends.contains(&s) {
                self.release(s, flat, dist)?;
            }
        }
        for s in ends {
            self.hold(s, flat, dist)?;
        }
        let first_layer = self.stages.len().saturating_sub(2);
        match self.is_layer(first_layer) {
            true => self.fetch(first_layer, flat, dist),
            false => Ok(()),
        }
    }

    /// After a step's last backward: nothing but this rank's chunks kept, for the optimizer
    /// step (which updates just those).
    pub fn end_step(&self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        if self.keep_whole {
            return Ok(());
        }
        for s in 0..self.stages.len() {
            self.release(s, flat, dist)?;
        }
        Ok(())
    }

    /// After the optimizer step, at stages 1-2: this rank updated its own chunks alone, so
    /// every stage's gather starts, the embeddings and heads first, then the layers in forward
    /// order; the next step's passes wait for each as they reach it. (Stage 3 gathers in
    /// `begin_step` and as the layers come.)
    pub fn refresh(&self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        if !self.keep_whole {
            return Ok(());
        }
        let layers = (1..self.stages.len().saturating_sub(1)).rev();
        for s in self.ends().into_iter().chain(layers) {
            self.hold(s, flat, dist)?; // none is in flight after a step: nothing to wait for
            self.held.borrow_mut()[s] = Weights::Released;
            self.fetch(s, flat, dist)?;
        }
        Ok(())
    }

    /// The whole model on every rank, for evaluation and saving: every stage gathered, all
    /// gathers in flight at once.
    pub fn hold_whole(&self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        for s in 0..self.stages.len() {
            self.fetch(s, flat, dist)?;
        }
        for s in 0..self.stages.len() {
            self.hold(s, flat, dist)?;
        }
        Ok(())
    }

    /// What the layers are told in a pass, for `flat` over `dist`.
    pub fn for_pass<'r>(&'r self, flat: &'r FlatParams, dist: &'r Dist) -> PassParams<'r> {
        PassParams {
            shards: self,
            flat,
            dist,
        }
    }

    /// The first collective that failed during a pass, if any.
    pub fn take_error(&self) -> Result<()> {
        match self.error.borrow_mut().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The gathers a micro-batch's forward and backward make, without computing: a rank with
    /// no micro-batch left in a step's last round takes part in every collective all the same.
    pub fn idle_pass(&self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        let pass = self.for_pass(flat, dist);
        let layers = self.forward_gathers(&pass);
        for s in 1..=layers {
            pass.need(s, s + 1);
            pass.done(s);
        }
        self.take_error()
    }

    /// The gathers an evaluation batch's forward makes, without computing: a rank whose shard
    /// of the evaluation set has a batch fewer takes part all the same.
    pub fn idle_forward(&self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        self.forward_gathers(&self.for_pass(flat, dist));
        self.take_error()
    }

    /// What a forward pass tells `pass` (the layers from the first, stage L, to the last, 1);
    /// the number of layers.
    fn forward_gathers(&self, pass: &PassParams) -> usize {
        let layers = self.stages.len().saturating_sub(2);
        for s in (1..=layers).rev() {
            pass.need(s, s - 1);
            pass.done(s);
        }
        layers
    }

    fn is_layer(&self, s: usize) -> bool {
        s >= 1 && s + 1 < self.stages.len()
    }
}

/// [`LayerShards`] as the layers of one pass see it.
pub struct PassParams<'r> {
    shards: &'r LayerShards,
    flat: &'r FlatParams,
    dist: &'r Dist,
}

impl PassParams<'_> {
    fn keep_error(&self, r: Result<()>) {
        if let Err(e) = r {
            self.shards.error.borrow_mut().get_or_insert(e);
        }
    }
}

impl LayerParams for PassParams<'_> {
    fn need(&self, stage: usize, next: usize) {
        let s = self.shards;
        if !s.is_layer(stage) {
            return;
        }
        let mut r = s.hold(stage, self.flat, self.dist);
        if r.is_ok() && s.is_layer(next) {
            r = s.fetch(next, self.flat, self.dist);
        }
        // The last layer in forward (the heads come next): backward starts with it.
        s.keep_last_layer.set(stage == 1 && next == 0);
        self.keep_error(r);
    }

    fn done(&self, stage: usize) {
        let s = self.shards;
        if s.is_layer(stage) && !s.keep_last_layer.replace(false) && !s.keep_whole {
            self.keep_error(s.release(stage, self.flat, self.dist));
        }
    }
}
