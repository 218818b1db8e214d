//! Optimization over one flat parameter buffer: AdamW as `torch.optim.AdamW`, the schedules of
//! transformers' `get_scheduler`, and clipping by global norm.
//!
//! Every trainable parameter becomes a view into one contiguous fp32 buffer, gradients are
//! gathered into a second one, and AdamW is one fused pass over the whole model instead of
//! several ops per tensor. Parameters are laid out in the order backward produces their
//! gradients (heads, last layer ... first layer, embeddings), so the flat gradient cuts into
//! buckets that data parallelism can reduce as soon as they are ready (`train::grad_sync`).

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use tch::{Kind, Tensor};

/// One trainable parameter's place in the flat buffers.
#[derive(Debug, Clone)]
pub struct Slot {
    pub name: String,
    pub offset: i64,
    pub numel: i64,
    pub shape: Vec<i64>,
}

/// The model's trainable parameters laid out in one buffer.
pub struct FlatParams {
    /// (N) fp32; every parameter's data is a view into it.
    pub params: Tensor,
    /// (N) fp32 gradients: every parameter's `.grad` is a view into it, so backward
    /// accumulates here directly.
    pub grads: Tensor,
    /// The parameters, in buffer order.
    pub vars: Vec<Tensor>,
    pub slots: Vec<Slot>,
    /// (start, len, takes weight decay) pieces of at most 64K elements covering the buffer:
    /// the unit of the fused optimizer's parallel pass.
    chunks: Vec<(usize, usize, bool)>,
}

/// The elements of the flat buffer whose optimizer state this rank keeps, in buffer order:
/// all of them, or under ZeRO (`dist.zero_stage` 1-2) this rank's chunk of every gradient
/// bucket. Their moments (and, at stage 2, their summed gradient) lie back to back in this
/// order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub ranges: Vec<std::ops::Range<usize>>,
}

impl Shard {
    /// Every element of a buffer of `numel`.
    pub fn whole(numel: usize) -> Shard {
        Shard {
            ranges: std::iter::once(0..numel).collect(),
        }
    }

    pub fn numel(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }
}

/// A run of elements the fused pass updates as one task: its offset in the flat buffers and
/// in the shard's state, its length, and whether it takes weight decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    flat: usize,
    state: usize,
    len: usize,
    decay: bool,
}

/// The flat buffer's chunks (see `FlatParams::chunks`) cut to `shard`, with their places in
/// the shard's state.
fn pieces(chunks: &[(usize, usize, bool)], shard: &Shard) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut state = 0;
    let mut next_chunk = 0;
    for range in &shard.ranges {
        // Chunks lie in buffer order, as do the shard's ranges: resume where the last ended.
        while let Some(&(start, len, decay)) = chunks.get(next_chunk) {
            if start >= range.end {
                break;
            }
            let (lo, hi) = (start.max(range.start), (start + len).min(range.end));
            if lo < hi {
                out.push(Piece {
                    flat: lo,
                    state: state + lo - range.start,
                    len: hi - lo,
                    decay,
                });
            }
            if start + len > range.end {
                break; // the rest of this chunk belongs to the next range, if any
            }
            next_chunk += 1;
        }
        state += range.len();
    }
    out
}

/// The helpers of src/optim_buffers.cpp.
mod buffers {
    use tch::Tensor;
    use torch_sys::C_tensor;

    extern "C" {
        fn sprtrain_lazy_zeros(numel: i64) -> *mut C_tensor;
        fn sprtrain_set_grad(var: *mut C_tensor, grad: *const C_tensor);
    }

    /// (numel) fp32 zeros whose pages are zeroed by the kernel when first written (an
    /// anonymous mapping), instead of by a pass over the buffer now; `torch.zeros` where the
    /// mapping fails.
    pub fn lazy_zeros(numel: i64) -> Tensor {
        // SAFETY: returns a new at::Tensor* that nobody else owns, or null.
        let t = unsafe { sprtrain_lazy_zeros(numel) };
        if t.is_null() {
            Tensor::zeros([numel], (tch::Kind::Float, tch::Device::Cpu))
        } else {
            // SAFETY: see above.
            unsafe { Tensor::from_ptr(t) }
        }
    }

    /// Makes `grad` the `.grad` of `var`.
    pub fn set_grad(var: &mut Tensor, grad: &Tensor) {
        debug_assert!(var.size() == grad.size() && var.kind() == grad.kind());
        // SAFETY: both pointers are live tensors for the call; libtorch copies the handle.
        unsafe { sprtrain_set_grad(var.as_mut_ptr(), grad.as_ptr()) }
    }
}

/// Makes every variable's `.grad` a view of its slot in `grads`. libtorch's AccumulateGrad
/// adds into an existing `.grad` in place, so from then on backward writes the flat buffer:
/// no per-step copy, and no second copy of the gradients in memory.
fn bind_grads(vars: &mut [Tensor], slots: &[Slot], grads: &Tensor) {
    for (var, slot) in vars.iter_mut().zip(slots) {
        let view = grads
            .narrow(0, slot.offset, slot.numel)
            .view(slot.shape.as_slice());
        buffers::set_grad(var, &view);
    }
}

/// transformers' Trainer exempts biases and normalisation weights from weight decay: names
/// containing `bias`, `layernorm`, `rmsnorm`, a `norm` segment or `_norm`, and the parameters
/// of `nn.LayerNorm` modules (GPT-2's are named `ln_1`, `ln_2`, `ln_f`).
pub fn takes_weight_decay(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let segments: Vec<&str> = lower.split('.').collect();
    let norm_module = segments.iter().any(|s| {
        *s == "norm"
            || s.ends_with("_norm")
            || *s == "ln_f"
            || s.strip_prefix("ln_")
                .is_some_and(|n| n.parse::<u32>().is_ok())
    });
    !(lower.contains("bias")
        || lower.contains("layernorm")
        || lower.contains("rmsnorm")
        || lower.contains("layer_norm")
        || norm_module)
}

impl FlatParams {
    /// Moves the trainable variables into one buffer, ordered by `stage` (the backward order:
    /// lower stages get their gradients first), then by name.
    pub fn new(vs: &tch::nn::VarStore, stage: impl Fn(&str) -> usize) -> Self {
        let mut named: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        named.sort_by(|a, b| (stage(&a.0), &a.0).cmp(&(stage(&b.0), &b.0)));
        let total: i64 = named.iter().map(|(_, t)| t.numel() as i64).sum();
        // Every element is copied in below: no need to zero it first (a pass over all weights).
        let params = Tensor::empty([total], (Kind::Float, tch::Device::Cpu));
        let mut slots = Vec::with_capacity(named.len());
        let mut vars = Vec::with_capacity(named.len());
        let mut chunks = Vec::new();
        let mut offset = 0i64;
        for (name, mut var) in named {
            let numel = var.numel() as i64;
            let shape = var.size();
            let mut view = params.narrow(0, offset, numel).view(shape.as_slice());
            tch::no_grad(|| view.copy_(&var));
            var.set_data(&view);
            let decay = takes_weight_decay(&name);
            let mut start = offset as usize;
            while start < (offset + numel) as usize {
                let len = ((offset + numel) as usize - start).min(1 << 16);
                chunks.push((start, len, decay));
                start += len;
            }
            slots.push(Slot {
                name,
                offset,
                numel,
                shape,
            });
            vars.push(var);
            offset += numel;
        }
        let grads = buffers::lazy_zeros(total);
        bind_grads(&mut vars, &slots, &grads);
        FlatParams {
            params,
            grads,
            vars,
            slots,
            chunks,
        }
    }

    /// Copies a range of the flat gradient into `into` (reused).
    pub fn read_grads(&self, range: std::ops::Range<usize>, into: &mut Vec<f32>) {
        into.clear();
        // SAFETY: a read of a range no libtorch op writes to while the caller holds it (the
        // caller reads a bucket once backward is past all of its parameters).
        into.extend_from_slice(unsafe {
            &f32_slice_mut(&self.grads, self.numel() as usize)[range]
        });
    }

    /// All parameters as one mutable slice, for a broadcast to write into in place (a copy
    /// would touch another buffer of the model's size, whose fresh pages the kernel must
    /// zero: a cost that then lands in the first steps).
    ///
    /// # Safety
    /// No other slice of the parameters may be alive, and no libtorch op may use them, while
    /// the returned slice is in use.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn params_mut(&self) -> &mut [f32] {
        f32_slice_mut(&self.params, self.numel() as usize)
    }

    /// A range of the flat gradient as a mutable slice, for reductions to write into.
    ///
    /// # Safety
    /// No other slice of the same range may be alive, and no libtorch op may use `grads`,
    /// while the returned slice is in use.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn grads_mut(&self, range: std::ops::Range<usize>) -> &mut [f32] {
        &mut f32_slice_mut(&self.grads, self.numel() as usize)[range]
    }

    pub fn numel(&self) -> i64 {
        self.params.numel() as i64
    }

    /// Moves `range` of the flat gradient into `into` (reused), leaving zeros, and marks its
    /// whole pages free (MADV_FREE): under ZeRO stage 2 a bucket's full gradient is dropped as
    /// its sum is sent. The copy and the zeroing go a few pages at a time, so the zeros are
    /// written while the values are still in cache. The kernel takes such pages back when
    /// memory runs short (without swap: they hold nothing to keep), and until then the next
    /// backward writes them again without a page fault. (Giving them back at once,
    /// MADV_DONTNEED, made every step fault the whole gradient in again: backward 1.66 s ->
    /// 2.20 s on Llama-125M, docs/memory.md.) Either way they read as zeros.
    pub fn take_grads(&self, range: std::ops::Range<usize>, into: &mut Vec<f32>) {
        // SAFETY: the caller is done with this range of the gradient until the next backward
        // (backward is past all of its parameters), and nothing else reads or writes it.
        let grads = unsafe { self.grads_mut(range) };
        into.clear();
        into.reserve(grads.len());
        for piece in grads.chunks_mut(TAKE_PIECE) {
            into.extend_from_slice(piece);
            piece.fill(0.0);
        }
        give_back_pages(grads, libc::MADV_FREE);
    }

    /// A range of the parameters as a mutable slice, for an all-gather to write into.
    ///
    /// # Safety
    /// As [`FlatParams::params_mut`], for this range.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn params_range_mut(&self, range: std::ops::Range<usize>) -> &mut [f32] {
        &mut f32_slice_mut(&self.params, self.numel() as usize)[range]
    }

    /// Drops `range` of the parameters until it is gathered again (ZeRO stage 3: a layer's
    /// weights that other ranks own, once the layer is done): its whole pages marked free
    /// (MADV_FREE). The kernel takes such pages back when memory runs short (they then read as
    /// zeros), and until then the next gather writes them again without a page fault: giving
    /// them back at once (MADV_DONTNEED) cost Llama-125M at 2 ranks 20% of its tokens/s
    /// (docs/performance-notes.md). Debug builds also fill the range with NaN, so that a layer
    /// run without its weights fails loudly whether or not the kernel took the pages; release
    /// builds leave the last gathered values (a stale layer shows in the stage-3 equivalence
    /// tests, and the fill cost 4% of the step).
    pub fn release_params(&self, range: std::ops::Range<usize>) {
        // SAFETY: the caller is done with this range until it gathers it again, and nothing
        // else reads or writes it meanwhile.
        let params = unsafe { self.params_range_mut(range) };
        if cfg!(debug_assertions) {
            params.fill(f32::NAN);
        }
        give_back_pages(params, libc::MADV_FREE);
    }

    /// (name, numel) of every parameter in buffer order: what a checkpoint's optimizer state
    /// must match to be restored.
    pub fn layout(&self) -> Vec<(String, i64)> {
        self.slots
            .iter()
            .map(|s| (s.name.clone(), s.numel))
            .collect()
    }

    /// The gradient's global L2 norm.
    pub fn grad_norm(&self) -> f64 {
        self.grads.norm().double_value(&[])
    }
}

/// Elements [`FlatParams::take_grads`] copies then zeroes at a time: 64 KB, within L2.
const TAKE_PIECE: usize = 16 * 1024;

/// Advises the kernel (`advice`: MADV_FREE or MADV_DONTNEED) of the whole pages inside
/// `values`, a range of a private anonymous mapping (the flat buffers: `buffers::lazy_zeros`,
/// or a heap allocation of their size) that nothing uses until it is written again. Advice
/// only: where the kernel refuses it the pages simply stay.
fn give_back_pages(values: &mut [f32], advice: libc::c_int) {
    let addr = values.as_mut_ptr() as usize;
    let first_page = addr.next_multiple_of(4096);
    let end = (addr + std::mem::size_of_val(values)) / 4096 * 4096;
    if end > first_page {
        // SAFETY: whole pages inside `values`, which the caller has to itself.
        unsafe {
            libc::madvise(first_page as *mut libc::c_void, end - first_page, advice);
        }
    }
}

/// The factor `torch.nn.utils.clip_grad_norm_` multiplies gradients of global L2 norm `norm`
/// by, `max_norm / (norm + 1e-6)` at most 1, as f32; 1 with no clipping (`max_norm` 0).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f32 {
    if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0) as f32
    } else {
        1.0
    }
}

/// AdamW hyperparameters; transformers' defaults.
#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments) on flat buffers.
pub struct AdamW {
    pub config: AdamWConfig,
    /// The elements this rank updates (of the flat buffer's), and the fused pass's pieces.
    flat_numel: usize,
    shard: Shard,
    pieces: Vec<Piece>,
    /// First and second moments of the shard, (S) fp32 each.
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// ZeRO stage 2: the shard's summed gradient, (S) fp32, which the step reads instead of
    /// the flat gradient.
    shard_grads: Option<Tensor>,
    /// Optimizer steps taken.
    pub step: i64,
    /// A table whose untouched rows wait (see [`LazyRows`]).
    lazy: Option<LazyRows>,
    /// The scalars of steps `history_from + 1 ..= step`, for rows that catch up.
    history: Vec<FusedAdamW>,
    history_from: i64,
}

/// The rows of a lookup table (a word embedding no output layer shares) that a step leaves
/// alone while their gradient is zero. AdamW's update of a row whose gradient is zero depends
/// only on that row's p, m, v and the step's scalars, so the missed steps can be replayed when
/// the row is next read or next has a gradient, through the same kernel with a zero gradient:
/// the very bits the dense pass would have written. Each step then moves the table's rows
/// that its tokens looked up instead of all V of them (MiniLM's table is half its weights).
struct LazyRows {
    /// The table's first element in the flat buffers, its rows and their width.
    offset: usize,
    rows: usize,
    width: usize,
    decay: bool,
    /// The optimizer step each row's parameters and moments are current through.
    current: Vec<i64>,
}

/// Rows of one table handed to rayon at a time.
const LAZY_ROWS_PER_TASK: usize = 256;

impl AdamW {
    /// AdamW over all of `flat`'s parameters.
    pub fn new(config: AdamWConfig, flat: &FlatParams) -> Self {
        Self::sharded(config, flat, Shard::whole(flat.numel() as usize), false)
    }

    /// AdamW over `shard` of `flat`'s parameters; with `own_grads` (ZeRO stage 2) the
    /// shard's gradient lives here (see [`AdamW::shard_grads_mut`]), not in `flat`.
    pub fn sharded(config: AdamWConfig, flat: &FlatParams, shard: Shard, own_grads: bool) -> Self {
        let numel = shard.numel() as i64;
        AdamW {
            config,
            pieces: pieces(&flat.chunks, &shard),
            flat_numel: flat.numel() as usize,
            shard,
            // Zero pages until the first step writes them (torch creates its state then).
            exp_avg: buffers::lazy_zeros(numel),
            exp_avg_sq: buffers::lazy_zeros(numel),
            shard_grads: own_grads.then(|| buffers::lazy_zeros(numel)),
            step: 0,
            lazy: None,
            history: Vec::new(),
            history_from: 0,
        }
    }

    /// Updates the rows of `table` (one of `flat`'s parameters, (V, C)) lazily from now on:
    /// only where the gradient is nonzero, the other rows catching up when [`AdamW::catch_up`]
    /// or [`AdamW::settle`] asks. The caller promises that nothing but a lookup reads the table,
    /// and calls `catch_up` with the ids before each lookup. Returns the table's name; None
    /// when it is not one of `flat`'s parameters.
    pub fn defer_untouched_rows(&mut self, flat: &FlatParams, table: &Tensor) -> Option<String> {
        if !self.is_whole() {
            return None; // the rows' state would be spread over the ranks
        }
        let found = flat.vars.iter().zip(&flat.slots).find(|(var, slot)| {
            var.data_ptr() == table.data_ptr() && slot.shape.len() == 2 && slot.numel > 0
        });
        let (_, slot) = found?;
        let rows = slot.shape[0] as usize;
        self.lazy = Some(LazyRows {
            offset: slot.offset as usize,
            rows,
            width: slot.shape[1] as usize,
            decay: takes_weight_decay(&slot.name),
            current: vec![self.step; rows],
        });
        self.history.clear();
        self.history_from = self.step;
        Some(slot.name.clone())
    }

    /// Brings the rows `ids` of the deferred table (all of them when None) up to the current
    /// step, before something reads them; ids outside the table are left for the lookup to
    /// refuse.
    pub fn catch_up(&mut self, flat: &FlatParams, ids: Option<&[i64]>) {
        let bufs = self.buffers(flat);
        let Some(lazy) = self.lazy.as_mut() else {
            return;
        };
        let step = self.step;
        let stale: Vec<usize> = match ids {
            Some(ids) => {
                let mut rows: Vec<usize> = ids
                    .iter()
                    .filter_map(|&id| usize::try_from(id).ok())
                    .filter(|&row| row < lazy.rows && lazy.current[row] < step)
                    .collect();
                rows.sort_unstable();
                rows.dedup();
                rows
            }
            None => (0..lazy.rows).filter(|&r| lazy.current[r] < step).collect(),
        };
        let (history, from) = (&self.history, self.history_from);
        let (offset, width, decay) = (lazy.offset, lazy.width, lazy.decay);
        let current = &lazy.current;
        stale.par_chunks(LAZY_ROWS_PER_TASK).for_each(|rows| {
            let mut zeros = vec![0.0f32; width];
            for &row in rows {
                // SAFETY: the rows are distinct (deduplicated) and within the table.
                let (p, m, v, _) = unsafe { bufs.slices_at(offset + row * width, width) };
                for k in &history[(current[row] - from) as usize..] {
                    k.apply(p, m, v, &mut zeros, decay);
                }
            }
        });
        for row in stale {
            lazy.current[row] = step;
        }
        if ids.is_none() {
            self.history.clear();
            self.history_from = step;
        }
    }

    /// Every deferred row up to the current step, as a checkpoint, an evaluation or the final
    /// model need them.
    pub fn settle(&mut self, flat: &FlatParams) {
        self.catch_up(flat, None);
    }

    /// Whether this optimizer keeps the state of every element of the flat buffer (its shard
    /// ranges are disjoint, so as many elements as the buffer's are all of them).
    fn is_whole(&self) -> bool {
        self.shard.numel() == self.flat_numel
    }

    /// The parameter, moment and gradient buffers of `flat` and this optimizer.
    fn buffers(&self, flat: &FlatParams) -> Buffers {
        let (n, s) = (flat.numel() as usize, self.shard.numel());
        // SAFETY: distinct, contiguous fp32 CPU tensors of n (flat) or s (shard) elements that
        // this struct and `flat` own; callers use them while no libtorch op runs on them (the
        // training thread is in the optimizer).
        unsafe {
            let grads = match &self.shard_grads {
                Some(g) => f32_slice_mut(g, s).as_mut_ptr(),
                None => f32_slice_mut(&flat.grads, n).as_mut_ptr(),
            };
            Buffers {
                base: [
                    f32_slice_mut(&flat.params, n).as_mut_ptr() as usize,
                    f32_slice_mut(&self.exp_avg, s).as_mut_ptr() as usize,
                    f32_slice_mut(&self.exp_avg_sq, s).as_mut_ptr() as usize,
                    grads as usize,
                ],
                grads_in_shard: self.shard_grads.is_some(),
            }
        }
    }

    /// The shard's ranges of the flat buffer, in order; their state lies back to back.
    pub fn shard(&self) -> &Shard {
        &self.shard
    }

    /// Whether this rank sums its gradient into a shard of its own (ZeRO stage 2) rather than
    /// into its chunks of the flat gradient.
    pub fn has_shard_grads(&self) -> bool {
        self.shard_grads.is_some()
    }

    /// ZeRO stage 2: `range` (in the shard's state order) of the shard's gradient, for the
    /// reduce-scatter to add into; None where the gradient lives in the flat buffer.
    ///
    /// # Safety
    /// No other slice of the same range may be alive, and no libtorch op may use the buffer,
    /// while the returned slice is in use.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn shard_grads_mut(&self, range: std::ops::Range<usize>) -> Option<&mut [f32]> {
        let grads = self.shard_grads.as_ref()?;
        Some(&mut f32_slice_mut(grads, self.shard.numel())[range])
    }

    /// The sum of squares of this rank's gradient (its shard's, before clipping), in f64: the
    /// ranks' sums add up to the square of the global norm.
    pub fn shard_grad_square_sum(&self, flat: &FlatParams) -> f64 {
        let bufs = self.buffers(flat);
        self.pieces
            .par_iter()
            .map(|piece| {
                // SAFETY: a read of the piece; nothing writes the buffers meanwhile.
                let (_, _, _, g) = unsafe { bufs.slices(piece) };
                g.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>()
            })
            .sum()
    }

    /// After a step, where the shard keeps its own gradient (ZeRO stages 2 and 3): its pages,
    /// zeroed by the step, marked free (MADV_FREE), so that what follows a step (a save that
    /// gathers the whole model) can have them; the next step's sums write them again.
    pub fn release_shard_grads(&self) {
        if let Some(grads) = &self.shard_grads {
            // SAFETY: the step is done with the gradient, and the next reduction has not begun.
            let grads = unsafe { f32_slice_mut(grads, grads.numel()) };
            give_back_pages(grads, libc::MADV_FREE);
        }
    }

    /// The shard's moments by the names torch's `state_dict` gives them (after
    /// [`AdamW::settle`]): what checkpoints save, gathered from every rank's shard.
    pub fn moments(&self) -> [(String, Tensor); 2] {
        debug_assert!(self
            .lazy
            .as_ref()
            .is_none_or(|l| l.current.iter().all(|&c| c == self.step)));
        [
            ("exp_avg".to_string(), self.exp_avg.shallow_clone()),
            ("exp_avg_sq".to_string(), self.exp_avg_sq.shallow_clone()),
        ]
    }

    /// Restores saved moments (see [`AdamW::moments`]) and the step count; `origin` names
    /// where they came from, for messages.
    pub fn restore(
        &mut self,
        saved: &BTreeMap<String, Tensor>,
        step: i64,
        origin: &std::path::Path,
    ) -> Result<()> {
        for (name, moment) in self.moments() {
            let src = saved
                .get(&name)
                .with_context(|| format!("{}: optimizer state lacks {name}", origin.display()))?;
            if src.numel() != self.flat_numel || src.kind() != Kind::Float {
                bail!(
                    "{}: optimizer state {name} has {} values of {:?}, this model {} of Float",
                    origin.display(),
                    src.numel(),
                    src.kind(),
                    self.flat_numel
                );
            }
            // Saved whole, whatever the stage and world size that saved it: take this shard.
            let mut state = 0i64;
            for range in &self.shard.ranges {
                let len = range.len() as i64;
                let mut dst = moment.narrow(0, state, len);
                tch::no_grad(|| dst.copy_(&src.narrow(0, range.start as i64, len)));
                state += len;
            }
        }
        self.step = step;
        if let Some(lazy) = self.lazy.as_mut() {
            lazy.current.fill(step);
        }
        self.history.clear();
        self.history_from = step;
        Ok(())
    }

    /// One update of `flat.params` from `flat.grads` times `grad_scale` (clipping's factor)
    /// at learning rate `lr`: torch's gradient scaling, single-tensor AdamW and zeroing of the
    /// gradient per element, fused into one parallel pass over the flat buffers (each of p, m,
    /// v, g read and written once; nothing allocated). The gradient is left zero for the next
    /// accumulation window.
    pub fn step(&mut self, flat: &FlatParams, lr: f64, grad_scale: f32) {
        let c = self.config;
        self.step += 1;
        let bias_correction1 = 1.0 - c.beta1.powi(self.step as i32);
        let bias_correction2_sqrt = (1.0 - c.beta2.powi(self.step as i32)).sqrt();
        let k = FusedAdamW {
            decay: (1.0 - lr * c.weight_decay) as f32,
            one_minus_beta1: (1.0 - c.beta1) as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            step_size: (lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2_sqrt as f32,
            eps: c.eps as f32,
            grad_scale,
        };
        if self.lazy.is_some() {
            self.history.push(k);
        }
        let bufs = self.buffers(flat);
        let lazy = self
            .lazy
            .as_ref()
            .map_or(0..0, |l| l.offset..l.offset + l.rows * l.width);
        self.pieces
            .par_iter()
            .filter(|piece| !lazy.contains(&piece.flat))
            .for_each(|piece| {
                // SAFETY: the piece's elements are its alone.
                let (p, m, v, g) = unsafe { bufs.slices(piece) };
                k.apply(p, m, v, g, piece.decay);
            });
        let Some(lazy) = self.lazy.as_mut() else {
            return;
        };
        // The table: rows with a gradient catch up on the steps they missed, then take this
        // one; the others wait.
        let (history, from, step) = (&self.history, self.history_from, self.step);
        let (offset, width, decay) = (lazy.offset, lazy.width, lazy.decay);
        lazy.current
            .par_chunks_mut(LAZY_ROWS_PER_TASK)
            .enumerate()
            .for_each(|(block, current)| {
                let mut zeros = vec![0.0f32; width];
                for (i, row_step) in current.iter_mut().enumerate() {
                    let row = block * LAZY_ROWS_PER_TASK + i;
                    // SAFETY: each task has its own rows of the table.
                    let (p, m, v, g) = unsafe { bufs.slices_at(offset + row * width, width) };
                    // Bits, not values: a -0.0 is a gradient the dense pass would have seen.
                    if g.iter().fold(0u32, |acc, x| acc | x.to_bits()) == 0 {
                        continue;
                    }
                    let missed = &history[(*row_step - from) as usize..(step - 1 - from) as usize];
                    for past in missed {
                        past.apply(p, m, v, &mut zeros, decay);
                    }
                    k.apply(p, m, v, g, decay);
                    *row_step = step;
                }
            });
    }
}

/// Base addresses of the parameter, moment and gradient buffers, to hand disjoint ranges of
/// them to rayon's threads.
#[derive(Clone, Copy)]
struct Buffers {
    /// p (flat), m, v (shard), g (flat, or shard where `grads_in_shard`).
    base: [usize; 4],
    grads_in_shard: bool,
}

type Slices<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32], &'a mut [f32]);

impl Buffers {
    /// (p, m, v, g) of `piece`.
    ///
    /// # Safety
    /// The piece lies within the buffers, and no other slice of it is alive meanwhile.
    unsafe fn slices<'a>(&self, piece: &Piece) -> Slices<'a> {
        let at = |i: usize, start: usize| {
            std::slice::from_raw_parts_mut((self.base[i] as *mut f32).add(start), piece.len)
        };
        let g = if self.grads_in_shard {
            piece.state
        } else {
            piece.flat
        };
        (
            at(0, piece.flat),
            at(1, piece.state),
            at(2, piece.state),
            at(3, g),
        )
    }

    /// (p, m, v, g) over `[start, start + len)` of an unsharded optimizer.
    ///
    /// # Safety
    /// As [`Buffers::slices`].
    unsafe fn slices_at<'a>(&self, start: usize, len: usize) -> Slices<'a> {
        self.slices(&Piece {
            flat: start,
            state: start,
            len,
            decay: false,
        })
    }
}

/// # Safety
/// `t` must be a contiguous fp32 CPU tensor of `n` elements not aliased during the borrow.
unsafe fn f32_slice_mut<'a>(t: &Tensor, n: usize) -> &'a mut [f32] {
    debug_assert!(t.kind() == Kind::Float && t.is_contiguous() && t.numel() == n);
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n)
}

/// The scalars of one AdamW step, in f32 as torch's CPU kernels use them.
#[derive(Clone, Copy)]
struct FusedAdamW {
    decay: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    /// Clipping's factor on the gradient (exactly 1 without clipping).
    grad_scale: f32,
}

impl FusedAdamW {
    #[inline]
    fn apply(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &mut [f32], decay: bool) {
        for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let grad = *g * self.grad_scale; // grads.mul_(clip_coef_clamped)
            *g = 0.0; // zero_grad for the next window
            let g = grad;
            if decay {
                *p *= self.decay; // param.mul_(1 - lr * weight_decay)
            }
            *m += self.one_minus_beta1 * (g - *m); // exp_avg.lerp_(grad, 1 - beta1)
            *v = *v * self.beta2 + self.one_minus_beta2 * (g * g); // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
            let denom = v.sqrt() / self.bias_correction2_sqrt + self.eps;
            *p -= self.step_size * (*m / denom); // param.addcdiv_(exp_avg, denom, -step_size)
        }
    }
}

/// transformers' schedule names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Linear,
    Cosine,
    Constant,
}

/// Learning rate as a function of the optimizer step, as transformers' `get_scheduler`
/// (`get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup` with half a cycle,
/// `get_constant_schedule_with_warmup`). Step k (from 0) uses `lr(k)`.
#[derive(Debug, Clone, Copy)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub base_lr: f64,
    pub warmup_steps: i64,
    pub total_steps: i64,
    /// Cosine: the floor as a fraction of `base_lr` (transformers' `cosine_with_min_lr`
    /// `min_lr_rate`; nanoGPT's min_lr / learning_rate).
    pub min_lr_rate: f64,
}

impl LrSchedule {
    pub fn new(
        kind: ScheduleKind,
        base_lr: f64,
        warmup_steps: i64,
        total_steps: i64,
    ) -> Result<Self> {
        if total_steps <= 0 {
            bail!("the run has no optimizer steps");
        }
        Ok(LrSchedule {
            kind,
            base_lr,
            warmup_steps,
            total_steps,
            min_lr_rate: 0.0,
        })
    }

    /// transformers' `get_warmup_steps`: explicit steps win, else ceil(ratio * total).
    pub fn warmup_from(steps: i64, ratio: f64, total_steps: i64) -> i64 {
        if steps > 0 {
            steps
        } else {
            (ratio * total_steps as f64).ceil() as i64
        }
    }

    pub fn lr(&self, step: i64) -> f64 {
        let (w, t) = (self.warmup_steps, self.total_steps);
        if step < w {
            return self.base_lr * step as f64 / w.max(1) as f64;
        }
        let factor = match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => ((t - step) as f64 / (t - w).max(1) as f64).max(0.0),
            ScheduleKind::Cosine => {
                let progress = (step - w) as f64 / (t - w).max(1) as f64;
                let cosine = (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0);
                cosine * (1.0 - self.min_lr_rate) + self.min_lr_rate
            }
        };
        self.base_lr * factor
    }
}

/// One optimizer step as training takes it: clip the summed gradient to its global norm,
/// AdamW at the schedule's rate, then clear the gradient for the next step.
pub struct Optimizer {
    pub flat: FlatParams,
    pub adamw: AdamW,
    pub schedule: LrSchedule,
    /// Clip to this global L2 norm; 0 = no clipping.
    pub max_grad_norm: f64,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepUpdate {
    /// The gradient's L2 norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
}

impl Optimizer {
    /// Brings the rows of a lazily updated table that `ids` (any shape, int64) will look up
    /// up to date (see [`AdamW::defer_untouched_rows`]).
    pub fn catch_up(&mut self, ids: &Tensor) -> Result<()> {
        if self.adamw.lazy.is_none() {
            return Ok(());
        }
        let ids = Vec::<i64>::try_from(ids.flatten(0, -1)).context("token ids")?;
        self.adamw.catch_up(&self.flat, Some(&ids));
        Ok(())
    }

    /// Every lazily updated row up to date, for whatever reads all parameters next.
    pub fn settle(&mut self) {
        self.adamw.settle(&self.flat);
    }

    /// Takes step `step` (0-based: the first step's learning rate is the schedule's at 0).
    pub fn step(&mut self, step: usize) -> StepUpdate {
        let grad_norm = self.flat.grad_norm();
        self.step_with_norm(step, grad_norm)
    }

    /// Takes step `step` with the gradient's global norm given: under ZeRO each rank holds
    /// only its shard of the summed gradient, and the ranks add up the norm's square (see
    /// [`AdamW::shard_grad_square_sum`]). This rank's shard of the parameters moves; the
    /// caller gathers the others'.
    pub fn step_with_norm(&mut self, step: usize, grad_norm: f64) -> StepUpdate {
        let lr = self.schedule.lr(step as i64);
        let grad_scale = clip_coefficient(grad_norm, self.max_grad_norm);
        self.adamw.step(&self.flat, lr, grad_scale);
        if !self.adamw.is_whole() && self.adamw.shard_grads.is_none() {
            // ZeRO stage 1: the step zeroed its shard of the flat gradient; the rest holds
            // this rank's own, unsummed gradients, which the next window must not add to.
            tch::no_grad(|| {
                let _ = self.flat.grads.shallow_clone().zero_();
            });
        }
        StepUpdate { grad_norm, lr }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_match_transformers() {
        // Values of transformers' lambdas times base lr, warmup 2 of 10 steps.
        let lin = LrSchedule::new(ScheduleKind::Linear, 1.0, 2, 10).unwrap();
        let got: Vec<f64> = (0..11).map(|s| lin.lr(s)).collect();
        let want = [
            0.0, 0.5, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0,
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
        let cos = LrSchedule::new(ScheduleKind::Cosine, 1.0, 2, 10).unwrap();
        assert!((cos.lr(6) - 0.5).abs() < 1e-12);
        assert!((cos.lr(10)).abs() < 1e-12);
        // cosine_with_min_lr, min_lr_rate 0.1: halfway is 0.1 + 0.9 * 0.5, the end 0.1.
        let floored = LrSchedule {
            min_lr_rate: 0.1,
            ..cos
        };
        assert!((floored.lr(6) - 0.55).abs() < 1e-12);
        assert!((floored.lr(10) - 0.1).abs() < 1e-12);
        assert_eq!(floored.lr(1), 0.5);
        let constant = LrSchedule::new(ScheduleKind::Constant, 2.0, 4, 10).unwrap();
        assert_eq!((constant.lr(1), constant.lr(9)), (0.5, 2.0));
        assert_eq!(LrSchedule::warmup_from(0, 0.06, 1000), 60);
        assert_eq!(LrSchedule::warmup_from(0, 0.1, 15), 2);
        assert_eq!(LrSchedule::warmup_from(7, 0.5, 100), 7);
    }

    #[test]
    fn parameters_are_laid_out_in_backward_order() {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let root = vs.root();
        for (i, n) in [(0, 300), (1, 200), (2, 500), (3, 100)] {
            let _ = (&root / format!("p{i}")).zeros("weight", &[n]);
        }
        // Stage = reverse index: p3 fills first.
        let flat = FlatParams::new(&vs, |name| 3 - name[1..2].parse::<usize>().unwrap());
        let order: Vec<&str> = flat.slots.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(order, ["p3.weight", "p2.weight", "p1.weight", "p0.weight"]);
        let offsets: Vec<i64> = flat.slots.iter().map(|s| s.offset).collect();
        assert_eq!(offsets, [0, 100, 600, 800]);
    }

    #[test]
    fn decay_excludes_biases_and_layer_norms() {
        assert!(takes_weight_decay(
            "bert.encoder.layer.0.attention.self.query.weight"
        ));
        assert!(!takes_weight_decay(
            "bert.encoder.layer.0.attention.self.query.bias"
        ));
        assert!(!takes_weight_decay("bert.embeddings.LayerNorm.weight"));
        assert!(!takes_weight_decay(
            "distilbert.transformer.layer.0.sa_layer_norm.weight"
        ));
        assert!(!takes_weight_decay("roberta.lm_head.layer_norm.weight"));
        // Decoders, as Trainer's name patterns and LayerNorm module type decide.
        for name in [
            "transformer.h.0.ln_1.weight",
            "transformer.h.3.ln_2.bias",
            "transformer.ln_f.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.self_attn.q_norm.weight",
            "model.norm.weight",
        ] {
            assert!(!takes_weight_decay(name), "{name}");
        }
        for name in [
            "transformer.wte.weight",
            "transformer.h.0.attn.c_attn.weight",
            "model.layers.0.mlp.down_proj.weight",
            "lm_head.weight",
        ] {
            assert!(takes_weight_decay(name), "{name}");
        }
    }

    #[test]
    fn adamw_matches_the_closed_form_first_step() {
        // First step: m = (1-b1) g, v = (1-b2) g^2, update = lr * g / (|g| + eps') per element.
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let w = (vs.root() / "w").var_copy("weight", &Tensor::from_slice(&[1.0f32, -2.0, 3.0]));
        let flat = FlatParams::new(&vs, |_| 0);
        let loss = (&flat.vars[0] * Tensor::from_slice(&[0.5f32, -1.0, 2.0])).sum(Kind::Float);
        loss.backward();
        let mut opt = AdamW::new(
            AdamWConfig {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            &flat,
        );
        opt.step(&flat, 0.01, 1.0);
        let got = Vec::<f32>::try_from(&flat.params).unwrap();
        // decay: p *= 1 - 0.001; then p -= 0.01 * sign(g) (eps negligible)
        let want = [1.0 * 0.999 - 0.01, -2.0 * 0.999 + 0.01, 3.0 * 0.999 - 0.01];
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{got:?}");
        }
        // The variable sees the update: it is a view of the flat buffer.
        assert!((w.double_value(&[0]) - want[0]).abs() < 1e-6);
        // The step leaves the gradient zero for the next accumulation window.
        assert_eq!(Vec::<f32>::try_from(&flat.grads).unwrap(), [0.0; 3]);
    }

    /// A table updated lazily ends bit-identical to the same table updated densely, whatever
    /// rows each step touches and reads: parameters when read and at the end, and both moments.
    #[test]
    fn lazy_rows_match_the_dense_update_bitwise() {
        let (rows, width) = (40i64, 5i64);
        let build = || {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let init = Tensor::arange(rows * width + 7, (Kind::Float, tch::Device::Cpu))
                .sin()
                .g_mul_scalar(0.1);
            let root = vs.root();
            let table = (&root / "embeddings" / "word_embeddings").var_copy(
                "weight",
                &init.narrow(0, 0, rows * width).view([rows, width]),
            );
            let _ = (&root / "head").var_copy("bias", &init.narrow(0, rows * width, 7));
            let flat = FlatParams::new(&vs, |name| usize::from(name.starts_with("embeddings")));
            (vs, flat, table)
        };
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let (_vs_d, dense_flat, _) = build();
        let (_vs_l, lazy_flat, table) = build();
        let mut dense = AdamW::new(config, &dense_flat);
        let mut lazy = AdamW::new(config, &lazy_flat);
        assert_eq!(
            lazy.defer_untouched_rows(&lazy_flat, &table).as_deref(),
            Some("embeddings.word_embeddings.weight")
        );
        let stranger = Tensor::zeros([3], (Kind::Float, tch::Device::Cpu));
        assert!(dense.defer_untouched_rows(&dense_flat, &stranger).is_none());
        let n = dense_flat.numel() as usize;
        // The head's 7 first, then the table.
        assert_eq!(lazy_flat.slots[1].name, "embeddings.word_embeddings.weight");
        let offset = lazy_flat.slots[1].offset as usize;
        for step in 0..30usize {
            // Rows 3k + step % 3 get a gradient at this step, and row 39 only at step 25.
            let mut grad = vec![0.0f32; n];
            for (i, g) in grad.iter_mut().enumerate().take(offset) {
                *g = ((i + step) as f32).cos();
            }
            for row in (step % 3..rows as usize - 1).step_by(3) {
                for c in 0..width as usize {
                    grad[offset + row * width as usize + c] = ((row * 7 + c + step) as f32).sin();
                }
            }
            if step == 25 {
                grad[offset + 39 * width as usize] = 2.0;
            }
            let g = Tensor::from_slice(&grad);
            for flat in [&dense_flat, &lazy_flat] {
                let mut grads = flat.grads.shallow_clone();
                tch::no_grad(|| grads.copy_(&g));
            }
            let (lr, scale) = (
                1e-2 * (1.0 + step as f64 / 10.0),
                if step % 4 == 0 { 0.5 } else { 1.0 },
            );
            dense.step(&dense_flat, lr, scale);
            lazy.step(&lazy_flat, lr, scale);
            // Reading some rows brings exactly those up to date.
            let read = [0i64, 5, (step as i64 * 7) % rows, 17];
            lazy.catch_up(&lazy_flat, Some(&read));
            let (d, l) = (
                Vec::<f32>::try_from(&dense_flat.params).unwrap(),
                Vec::<f32>::try_from(&lazy_flat.params).unwrap(),
            );
            for &row in &read {
                let at = offset + row as usize * width as usize;
                let span = at..at + width as usize;
                assert_eq!(d[span.clone()], l[span], "step {step}: row {row}");
            }
            assert_eq!(
                d[..offset],
                l[..offset],
                "step {step}: the dense parameters"
            );
        }
        // Something waited: without settling, the rows differ somewhere.
        assert_ne!(
            Vec::<f32>::try_from(&dense_flat.params).unwrap(),
            Vec::<f32>::try_from(&lazy_flat.params).unwrap()
        );
        lazy.settle(&lazy_flat);
        let all = |f: &FlatParams, o: &AdamW| {
            [&f.params, &o.exp_avg, &o.exp_avg_sq, &f.grads]
                .map(|t| Vec::<f32>::try_from(t).unwrap())
        };
        let (d, l) = (all(&dense_flat, &dense), all(&lazy_flat, &lazy));
        for (what, (d, l)) in ["params", "exp_avg", "exp_avg_sq", "grads"]
            .iter()
            .zip(d.iter().zip(&l))
        {
            let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(d), bits(l), "{what}");
        }
        // Resuming puts every row at the restored step.
        let saved: BTreeMap<String, Tensor> = lazy.moments().into_iter().collect();
        lazy.restore(&saved, 30, std::path::Path::new("saved"))
            .unwrap();
        lazy.settle(&lazy_flat);
        assert_eq!(
            Vec::<f32>::try_from(&lazy_flat.params).unwrap(),
            all(&dense_flat, &dense)[0]
        );
    }

    #[test]
    fn clipping_scales_the_gradient_inside_the_step() {
        // torch: coef = max_norm / (norm + 1e-6), clamped to 1.
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(4.0, 1.0), (1.0 / (4.0 + 1e-6)) as f32);
        assert_eq!(clip_coefficient(4.0, 0.0), 1.0);
        // Without weight decay and with beta1 = 0, the second step's update is lr * g2 /
        // sqrt(beta2 v1 + (1 - beta2) g2^2): it sees the scaled second gradient.
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _ = (vs.root() / "w").var_copy("weight", &Tensor::from_slice(&[0.0f32]));
        let flat = FlatParams::new(&vs, |_| 0);
        let mut opt = AdamW::new(
            AdamWConfig {
                beta1: 0.0,
                beta2: 0.5,
                eps: 0.0,
                weight_decay: 0.0,
            },
            &flat,
        );
        let set_grad = |g: f32| {
            let mut grads = flat.grads.shallow_clone();
            tch::no_grad(|| grads.copy_(&Tensor::from_slice(&[g])));
        };
        set_grad(1.0);
        opt.step(&flat, 1.0, 1.0);
        let p1 = flat.params.double_value(&[0]);
        set_grad(4.0);
        opt.step(&flat, 1.0, 0.25); // clipped to 1.0
        let update = p1 - flat.params.double_value(&[0]);
        // v1 = 0.5, v2 = 0.25 + 0.5 * 1 = 0.75; bias corrections 0.5 and 0.75: denom 1.
        assert!((update - 1.0).abs() < 1e-6, "{update}");
    }
}
