//! Gradient synchronisation for data parallelism: the flat gradient is cut into buckets in
//! backward order, and on the last micro-batch of a step backward runs layer by layer so each
//! bucket is summed across processes as soon as it is complete, while backward goes on
//! (llm.c and PyTorch DDP do the same). Also the start-of-run agreement: every process checks
//! it runs the same job, then takes rank 0's weights.
//!
//! Under ZeRO (`dist.zero_stage`, DeepSpeed's stages) each rank owns its chunk of every
//! bucket (`dist::chunk`): stage 1 reduce-scatters each bucket (a rank gets the sum of its
//! chunk only) and keeps optimizer state for its chunks alone; stage 2 also drops the full
//! gradient once a bucket is sent, so every micro-batch's backward is reduced as it completes
//! and the sums accumulate into the shard. After the step each rank's updated chunks are
//! all-gathered (`LayerShards::refresh`), and every rank again holds the whole model.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::Result;
use tch::Tensor;

use crate::checkpoint::streamed::StreamedSafetensors;
use crate::config::{Config, ReduceDtype};
use crate::dist::{chunk, Dist, Pending};
use crate::models::{backward_by_stages, Stages, TaskModel};
use crate::optim::{FlatParams, Optimizer, Shard, Slot};

use super::layer_shards::LayerShards;

/// A run of whole parameters reduced together: elements of the flat buffer and the slots
/// (parameters) they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub elems: Range<usize>,
    pub slots: Range<usize>,
}

/// Cuts the flat buffer into buckets of about `bytes` (never splitting a parameter), in
/// buffer order, i.e. the order backward fills them; with `stage`, also wherever the stage
/// changes (under ZeRO a layer's buckets are gathered alone).
pub fn plan_buckets(
    slots: &[Slot],
    bytes: usize,
    stage: Option<&dyn Fn(&str) -> usize>,
) -> Vec<Bucket> {
    let cap = (bytes / 4).max(1);
    let mut out = Vec::new();
    let (mut start, mut first) = (0usize, 0usize);
    for (i, slot) in slots.iter().enumerate() {
        let end = (slot.offset + slot.numel) as usize;
        let stage_ends = match (stage, slots.get(i + 1)) {
            (Some(stage), Some(next)) => stage(&slot.name) != stage(&next.name),
            _ => false,
        };
        if end - start >= cap || i + 1 == slots.len() || stage_ends {
            out.push(Bucket {
                elems: start..end,
                slots: first..i + 1,
            });
            (start, first) = (end, i + 1);
        }
    }
    out
}

/// Every rank must run the same job on the same model: compares the resolved config, the
/// parameter layout and the number of training examples with rank 0's before the first
/// collective that depends on them, then starts every rank from rank 0's weights.
pub fn agree_and_broadcast(
    dist: &Dist,
    config: &Config,
    flat: &FlatParams,
    train_examples: usize,
) -> Result<()> {
    let mut fingerprint = config.dotted_lines()?;
    fingerprint.extend(
        flat.slots
            .iter()
            .map(|s| format!("tensor {} {:?} float32", s.name, s.shape)),
    );
    fingerprint.push(format!("training examples {train_examples}"));
    dist.check_same(
        "the resolved configuration or parameter layout",
        &fingerprint,
    )?;
    if dist.topo.world > 1 {
        // SAFETY: nothing else reads or writes the parameters until the broadcast returns.
        dist.broadcast_into("initial parameters", unsafe { flat.params_mut() })?;
    }
    Ok(())
}

/// The buckets of a run and the sums of the current step in flight.
pub struct GradSync {
    buckets: Vec<Bucket>,
    /// The backward stage after which each bucket's gradients are complete.
    stages: Vec<usize>,
    /// Send buffers, one per bucket, reused step after step (stage 0; under ZeRO they are
    /// freed after each use, as the memory is what ZeRO saves).
    bufs: Vec<Vec<f32>>,
    bf16: bool,
    pending: Vec<Pending>,
    step: usize,
    /// The ZeRO stage in effect: `dist.zero_stage`, or 0 in a world of one.
    zero_stage: u8,
    /// This rank's chunk of each bucket (flat elements), under ZeRO, and where each chunk
    /// starts in the shard's state (the chunks lie back to back there).
    own: Vec<Range<usize>>,
    own_at: Vec<usize>,
}

/// This rank's chunk of each bucket: the shard of the flat buffer it updates under ZeRO.
pub fn own_chunks(buckets: &[Bucket], world: usize, rank: usize) -> Vec<Range<usize>> {
    buckets
        .iter()
        .map(|b| {
            let c = chunk(b.elems.len(), world, rank);
            b.elems.start + c.start..b.elems.start + c.end
        })
        .collect()
}

impl GradSync {
    pub fn new(flat: &FlatParams, model: &TaskModel, config: &Config, dist: &Dist) -> Self {
        let (world, rank) = (dist.topo.world, dist.topo.rank);
        let zero_stage = if world > 1 { config.dist.zero_stage } else { 0 };
        let stage_of = |name: &str| model.backward_stage(name);
        let buckets = plan_buckets(
            &flat.slots,
            (config.dist.bucket_mb * 1024.0 * 1024.0) as usize,
            (zero_stage > 0).then_some(&stage_of as &dyn Fn(&str) -> usize),
        );
        let own = own_chunks(&buckets, world, rank);
        let own_at = own
            .iter()
            .scan(0, |at, r| {
                let start = *at;
                *at += r.len();
                Some(start)
            })
            .collect();
        // A bucket is ready once backward has passed the stage of its last (deepest) parameter.
        let stages = buckets
            .iter()
            .map(|b| model.backward_stage(&flat.slots[b.slots.end - 1].name))
            .collect();
        let bufs = buckets
            .iter()
            .map(|b| Vec::with_capacity(b.elems.len()))
            .collect();
        GradSync {
            buckets,
            stages,
            bufs,
            bf16: config.dist.reduce_dtype == ReduceDtype::Bf16,
            pending: Vec::new(),
            step: 0,
            zero_stage,
            own,
            own_at,
        }
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// The ZeRO stage in effect (0 in a world of one, where there is nothing to shard).
    pub fn zero_stage(&self) -> u8 {
        self.zero_stage
    }

    /// The part of the flat buffer whose optimizer state this rank keeps: all of it, or under
    /// ZeRO its chunk of every bucket.
    pub fn shard(&self, numel: usize) -> Shard {
        if self.zero_stage == 0 {
            return Shard::whole(numel);
        }
        Shard {
            ranges: self.own.clone(),
        }
    }

    /// Under ZeRO, where each layer's weights are: at stage 3 gathered and dropped around
    /// their use, at stages 1-2 gathered after each step as the next forward reaches them (the
    /// buckets never straddle two stages under ZeRO); None at stage 0.
    pub fn layer_shards(&self, layers: usize) -> Option<LayerShards> {
        (self.zero_stage > 0).then(|| {
            let buckets = self.buckets.iter().map(|b| b.elems.clone()).collect();
            LayerShards::new(
                buckets,
                self.own.clone(),
                &self.stages,
                layers,
                self.zero_stage,
            )
        })
    }

    /// Whether every micro-batch's gradient is reduced as its backward completes (stage 2,
    /// which keeps no full gradient from one micro-batch to the next), rather than the last
    /// micro-batch's alone.
    pub fn reduces_every_micro_batch(&self) -> bool {
        self.zero_stage >= 2
    }

    /// Starts optimizer step `step` (1-based, for messages): no bucket launched yet.
    pub fn begin(&mut self, step: usize) {
        self.pending.clear();
        self.step = step;
    }

    /// Launches every bucket whose parameters all have their gradients (stage <= `done`).
    fn launch_ready(&mut self, opt: &Optimizer, dist: &Dist, done: usize) -> Result<()> {
        let flat = &opt.flat;
        while let Some(b) = self.buckets.get(self.pending.len()) {
            let i = self.pending.len();
            if self.stages[i] > done {
                break;
            }
            // Stage 2 keeps no full gradient: the bucket's leaves with its sum.
            match opt.adamw.has_shard_grads() {
                true => flat.take_grads(b.elems.clone(), &mut self.bufs[i]),
                false => flat.read_grads(b.elems.clone(), &mut self.bufs[i]),
            }
            let what = format!(
                "gradient bucket {i} (elements {}..{}) of step {}",
                b.elems.start, b.elems.end, self.step
            );
            let send = std::mem::take(&mut self.bufs[i]);
            let (own, at, bf16) = (self.own[i].clone(), self.own_at[i], self.bf16);
            // SAFETY: the destination (the bucket, this rank's chunk of it, or that chunk's
            // place in the shard's gradient) is touched by nothing but the sum until `finish`
            // has waited for it; buckets are disjoint, and so are their chunks.
            let pending = unsafe {
                if self.zero_stage == 0 {
                    let dst = flat.grads_mut(b.elems.clone());
                    dist.start_allreduce_into(what, send, dst, bf16)?
                } else if let Some(shard) = opt.adamw.shard_grads_mut(at..at + own.len()) {
                    dist.start_reduce_scatter_into(what, send, shard, bf16, true)?
                } else {
                    dist.start_reduce_scatter_into(what, send, flat.grads_mut(own), bf16, false)?
                }
            };
            self.pending.push(pending);
        }
        Ok(())
    }

    /// Backward of the last micro-batch of a step (under ZeRO stage 2, of every one), from a
    /// `forward_staged` pass: the heads and last layer first, then one layer at a time down to
    /// the embeddings, each bucket launched as soon as backward has completed it.
    pub fn backward_staged(
        &mut self,
        loss: &Tensor,
        stages: &Stages,
        opt: &Optimizer,
        dist: &Dist,
    ) -> Result<()> {
        backward_by_stages(loss, stages, |done| self.launch_ready(opt, dist, done))
    }

    /// Launches the buckets not launched yet (a rank without a micro-batch in a short last
    /// step still takes part, with zeros), then waits for every sum: the flat gradient (or
    /// under ZeRO this rank's shard of it) then holds the sum over all processes.
    pub fn finish(&mut self, opt: &Optimizer, dist: &Dist) -> Result<()> {
        self.launch_ready(opt, dist, usize::MAX)?;
        for (i, pending) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            let send = pending.wait(dist)?;
            if self.zero_stage == 0 {
                self.bufs[i] = send;
            }
        }
        Ok(())
    }

    /// Under ZeRO stage 3, the weights (each rank keeps its own chunk of each bucket) gathered
    /// a bucket at a time, in buffer order, and given to `sink` on rank 0 as they arrive: the
    /// flat buffer's values from first to last, no rank holding more than a bucket of others'.
    /// The first error `sink` returns comes back once every gather is done, so that every
    /// rank leaves them together.
    pub fn gather_params_to_root(
        &self,
        flat: &FlatParams,
        dist: &Dist,
        mut sink: impl FnMut(&[f32]) -> Result<()>,
    ) -> Result<Result<()>> {
        let mut written = Ok(());
        for (i, own) in self.own.iter().enumerate() {
            let mine = flat.params.narrow(0, own.start as i64, own.len() as i64);
            let what = format!("weights of bucket {i}, to save");
            let parts = dist.all_gather_f32(&what, Vec::<f32>::try_from(&mine)?)?;
            if dist.is_root() && written.is_ok() {
                written = parts.iter().try_for_each(|part| sink(part));
            }
        }
        Ok(written)
    }

    /// The moments of a sharded optimizer gathered a bucket at a time (no rank holds more than
    /// one bucket of another rank's state) and written by rank 0 to `path` as they arrive: a
    /// checkpoint's optimizer.safetensors, the same whatever the stage and world size. Rank 0
    /// gets the written file, or why it could not write it (the gathers go on to the end either
    /// way, so that every rank leaves them together); the others get None.
    pub fn write_moments(
        &self,
        moments: &[(String, Tensor)],
        dist: &Dist,
        path: &Path,
    ) -> Result<Option<Result<PathBuf>>> {
        let numel = self.buckets.last().map_or(0, |b| b.elems.end);
        let names: Vec<(String, Vec<usize>)> = moments
            .iter()
            .map(|(n, _)| (n.clone(), vec![numel]))
            .collect();
        let mut file = dist
            .is_root()
            .then(|| StreamedSafetensors::create(path, &names));
        for (name, shard) in moments {
            for (i, own) in self.own.iter().enumerate() {
                let mine = shard.narrow(0, self.own_at[i] as i64, own.len() as i64);
                let what = format!("optimizer state {name}, bucket {i}");
                let parts = dist.all_gather_f32(&what, Vec::<f32>::try_from(&mine)?)?;
                if let Some(Ok(out)) = &mut file {
                    if let Err(e) = parts.iter().try_for_each(|part| out.append(part)) {
                        file = Some(Err(e));
                    }
                }
            }
        }
        Ok(file.map(|f| f.and_then(StreamedSafetensors::finish)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_backward_order_without_splitting_parameters() {
        let slot = |offset, numel| Slot {
            name: String::new(),
            offset,
            numel,
            shape: vec![numel],
        };
        let slots = [slot(0, 100), slot(100, 500), slot(600, 200), slot(800, 300)];
        let elems = |b: Vec<Bucket>| b.into_iter().map(|b| b.elems).collect::<Vec<_>>();
        assert_eq!(
            elems(plan_buckets(&slots, 2400, None)),
            vec![0..600, 600..1100]
        );
        assert_eq!(plan_buckets(&slots, 2400, None)[1].slots, 2..4);
        assert_eq!(
            elems(plan_buckets(&slots, 4 * 1_000_000, None)),
            vec![0..1100]
        );
        // ZeRO also cuts where the stage changes (here between the second and third).
        let stage = |name: &str| usize::from(name == "deep");
        let mut staged = slots.clone();
        staged[2].name = "deep".into();
        staged[3].name = "deep".into();
        let got = elems(plan_buckets(&staged, 4 * 1_000_000, Some(&stage)));
        assert_eq!(got, vec![0..600, 600..1100]);
    }
}
