//! Data parallelism over MPI. Knows nothing of models: it moves f32 buffers and bytes.
//!
//! One communication thread owns every MPI call (it initialises MPI, so MPI_THREAD_FUNNELED
//! holds from its point of view); the training thread hands it jobs through a channel and waits
//! for each reply with a timeout, so a collective that never finishes is reported instead of
//! hanging. Buffers travel by ownership (moved there and back), nothing is copied or shared.
//! Without a launcher (no PMI_RANK / PMI_SIZE in the environment) the world is one process and
//! MPI is not initialised at all. With `Transport::Tcp` the fp32 gradient sums travel over a
//! ring of TCP connections of our own instead of MPI (see `ring`), still from this thread.

mod ring;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

/// Writes one line to stderr in a single write, so lines of several ranks sharing a pipe never
/// interleave mid-line.
pub fn eprint_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}

/// Where this process stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub rank: usize,
    pub world: usize,
    /// Rank among the processes sharing this node's memory, and how many there are.
    pub local_rank: usize,
    pub local_size: usize,
    pub host: String,
}

/// Where a sum lands: `len` f32s at `addr`, memory the caller leaves alone until the reply.
struct Destination {
    addr: usize,
    len: usize,
}

impl Destination {
    fn of(buf: &mut [f32]) -> Destination {
        Destination {
            addr: buf.as_mut_ptr() as usize,
            len: buf.len(),
        }
    }
}

enum Job {
    /// Sum into `Destination`; the send buffer comes back for reuse.
    AllreduceInto(Vec<f32>, Destination, bool, Sender<Vec<f32>>),
    AllreduceF64(Vec<f64>, Sender<Vec<f64>>),
    /// Sum, keeping only this rank's chunk (see [`chunk`]), written or (true) added into
    /// `Destination`; the send buffer is freed once summed. The bool before it: bf16 on the wire.
    ReduceScatterInto(Vec<f32>, Destination, bool, bool, Sender<Vec<f32>>),
    /// Every rank's chunk of `Destination` (the whole buffer) into every rank's copy; this
    /// rank's chunk is the first buffer, which comes back.
    AllGatherInto(Vec<f32>, Destination, Sender<Vec<f32>>),
    /// Rank 0's values into `Destination` on every rank.
    BroadcastInto(Destination, Sender<()>),
    AllGatherBytes(Vec<u8>, Sender<Vec<Vec<u8>>>),
    AllGatherF32(Vec<f32>, Sender<Vec<Vec<f32>>>),
    Abort(i32),
}

/// A started sum; `wait` for its result.
pub struct Pending {
    what: String,
    reply: Option<Receiver<Vec<f32>>>,
    ready: Option<Vec<f32>>,
}

impl Pending {
    /// A collective that was done locally (a world of one).
    fn ready(what: String, buf: Vec<f32>) -> Pending {
        Pending {
            what,
            reply: None,
            ready: Some(buf),
        }
    }

    /// The summed buffer; past the collective timeout the job is stopped (see `Dist::call`).
    pub fn wait(self, dist: &Dist) -> Result<Vec<f32>> {
        if let Some(v) = self.ready {
            return Ok(v);
        }
        let rx = self.reply.context("no reply channel")?;
        match rx.recv_timeout(dist.timeout) {
            Ok(v) => Ok(v),
            Err(_) => dist.timed_out(&self.what),
        }
    }
}

/// The process group. A world of one performs every collective locally.
pub struct Dist {
    pub topo: Topology,
    jobs: Option<Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    timeout: Duration,
    /// Payload bytes this rank has sent in sums (see `allreduce_bytes`).
    bytes_sent: AtomicU64,
}

/// Whether an MPI launcher (MPICH / Intel MPI Hydra, or any PMI launcher) started us.
fn launched_by_mpi() -> bool {
    [
        "PMI_RANK",
        "PMI_SIZE",
        "PMIX_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// How fp32 gradient sums travel between processes (`dist.transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The MPI library's allreduce.
    Mpi,
    /// Our own TCP ring with blocking sockets (see `ring`); MPI carries everything else.
    Tcp,
}

/// The communicators the MPI thread works with.
struct Comms {
    world: SimpleCommunicator,
    /// The ranks of this node (shared memory).
    node: SimpleCommunicator,
    /// The ranks with this local rank, one per node, when every node has the same number of
    /// ranks and there are several nodes with several ranks each: then bf16 sums go
    /// node-first (see `allreduce_bf16_by_node`).
    across: Option<SimpleCommunicator>,
    /// The TCP gradient ring, with `Transport::Tcp`.
    ring: Option<ring::Ring>,
}

impl Comms {
    fn new(world: SimpleCommunicator) -> Comms {
        let node = world.split_shared(world.rank());
        let local = node.size();
        let (mut fewest, mut most) = (0, 0);
        world.all_reduce_into(&local, &mut fewest, SystemOperation::min());
        world.all_reduce_into(&local, &mut most, SystemOperation::max());
        let across = world.split_by_color_with_key(Color::with_value(node.rank()), world.rank());
        let across = across.filter(|a| fewest == most && local > 1 && a.size() > 1);
        Comms {
            world,
            node,
            across,
            ring: None,
        }
    }

    /// Every rank opens a listener, the endpoints are all-gathered over MPI, and each rank
    /// connects to its ring neighbours.
    fn connect_ring(&mut self, host: &str, timeout: Duration) -> Result<()> {
        let listening = ring::listen(host)?;
        let peers = all_gather_varcount(&self.world, &listening.endpoint.encode())
            .iter()
            .enumerate()
            .map(|(r, bytes)| ring::Endpoint::decode(bytes).with_context(|| format!("rank {r}")))
            .collect::<Result<Vec<_>>>()?;
        let rank = self.world.rank() as usize;
        self.ring = Some(ring::Ring::connect(listening, rank, &peers, timeout)?);
        Ok(())
    }
}

fn serve(comms: Comms, jobs: Receiver<Job>) {
    let world = &comms.world;
    for job in jobs {
        match job {
            Job::AllreduceInto(send, dst, bf16, reply) => {
                // SAFETY: the requester owns this memory and does not touch it until it gets
                // the reply (see `Dist::start_allreduce_into`).
                let out = unsafe { std::slice::from_raw_parts_mut(dst.addr as *mut f32, dst.len) };
                if let (false, Some(ring)) = (bf16, &comms.ring) {
                    if let Err(e) = ring.allreduce_sum(&send, out) {
                        eprint_line(&format!("sprtrain: {e:#}; aborting the job"));
                        world.abort(3);
                    }
                } else if let (true, Some(across)) = (bf16, &comms.across) {
                    allreduce_bf16_by_node(&comms.node, across, &send, out);
                } else if bf16 {
                    allreduce_bf16_wire(world, &send, out);
                } else {
                    world.all_reduce_into(&send[..], out, SystemOperation::sum());
                }
                let _ = reply.send(send);
            }
            Job::ReduceScatterInto(send, dst, bf16, add, reply) => {
                // SAFETY: as for AllreduceInto (see `Dist::start_reduce_scatter_into`).
                let out = unsafe { std::slice::from_raw_parts_mut(dst.addr as *mut f32, dst.len) };
                let mut mine = vec![0f32; out.len()];
                if bf16 {
                    reduce_scatter_bf16_wire(world, &send, &mut mine);
                } else {
                    reduce_scatter_f32(world, &send, &mut mine);
                }
                if add {
                    out.iter_mut().zip(&mine).for_each(|(o, m)| *o += m);
                } else {
                    out.copy_from_slice(&mine);
                }
                drop(send);
                let _ = reply.send(Vec::new());
            }
            Job::AllGatherInto(mine, dst, reply) => {
                // SAFETY: as for AllreduceInto (see `Dist::start_all_gather_into`).
                let out = unsafe { std::slice::from_raw_parts_mut(dst.addr as *mut f32, dst.len) };
                let n = world.size() as usize;
                let parts: Vec<std::ops::Range<usize>> =
                    (0..n).map(|r| chunk(out.len(), n, r)).collect();
                let counts: Vec<i32> = parts.iter().map(|c| c.len() as i32).collect();
                let displs: Vec<i32> = parts.iter().map(|c| c.start as i32).collect();
                let mut recv = PartitionMut::new(out, &counts[..], &displs[..]);
                world.all_gather_varcount_into(&mine[..], &mut recv);
                let _ = reply.send(mine);
            }
            Job::AllreduceF64(send, reply) => {
                let mut recv = vec![0f64; send.len()];
                world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
                let _ = reply.send(recv);
            }
            Job::BroadcastInto(dst, reply) => {
                // SAFETY: the requester holds this memory borrowed, untouched, until it gets
                // the reply (see `Dist::broadcast_into`).
                let buf = unsafe { std::slice::from_raw_parts_mut(dst.addr as *mut f32, dst.len) };
                world.process_at_rank(0).broadcast_into(buf);
                let _ = reply.send(());
            }
            Job::AllGatherBytes(bytes, reply) => {
                let _ = reply.send(all_gather_varcount(world, &bytes));
            }
            Job::AllGatherF32(values, reply) => {
                let _ = reply.send(all_gather_varcount(world, &values));
            }
            Job::Abort(code) => world.abort(code),
        }
    }
    // Every rank's last messages have arrived before any rank leaves (see `Dist::init`).
    world.barrier();
}

/// Bytes each rank sends to sum `len` elements of `elem_bytes` bytes over `world` ranks with a
/// bandwidth-optimal allreduce: a reduce-scatter then an all-gather, each moving (N-1)/N of
/// the buffer. That is what the bf16 wire does, and what MPICH and Intel MPI do for long
/// messages; short ones (a few KB) may take other algorithms, where this is an estimate.
pub fn allreduce_bytes(len: usize, elem_bytes: usize, world: usize) -> u64 {
    if world < 2 {
        return 0;
    }
    (2 * (world - 1) * len * elem_bytes / world) as u64
}

/// Bytes each rank sends in a reduce-scatter or an all-gather of `len` elements over `world`
/// ranks: (N-1)/N of the buffer, half of an allreduce.
pub fn scatter_bytes(len: usize, elem_bytes: usize, world: usize) -> u64 {
    ((world.max(1) - 1) * len * elem_bytes / world.max(1)) as u64
}

/// Element range of rank `rank`'s chunk when `len` elements are cut among `world` ranks: what
/// a reduce-scatter leaves on each rank.
pub fn chunk(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    len * rank / world..len * (rank + 1) / world
}

/// Sums `send` over all ranks, keeping this rank's chunk in `out`: MPI_Reduce_scatter (rsmpi
/// has only the equal-block form).
fn reduce_scatter_f32(world: &SimpleCommunicator, send: &[f32], out: &mut [f32]) {
    let n = world.size() as usize;
    let counts: Vec<i32> = (0..n)
        .map(|r| chunk(send.len(), n, r).len() as i32)
        .collect();
    debug_assert_eq!(out.len(), counts[world.rank() as usize] as usize);
    // SAFETY: `send` holds the sum of `counts` floats, `out` this rank's count; both stay
    // borrowed for the blocking call; the datatype, op and communicator are live MPI handles.
    unsafe {
        mpi::ffi::MPI_Reduce_scatter(
            send.as_ptr().cast(),
            out.as_mut_ptr().cast(),
            counts.as_ptr(),
            mpi::ffi::RSMPI_FLOAT,
            mpi::ffi::RSMPI_SUM,
            world.as_raw(),
        );
    }
}

/// The first half of [`allreduce_bf16_wire`]: this rank's chunk of the sum, summed in fp32 in
/// rank order from bf16 copies and rounded to bf16 (the very values the allreduce gives it).
fn reduce_scatter_bf16_wire(world: &SimpleCommunicator, send: &[f32], out: &mut [f32]) {
    for (o, h) in out.iter_mut().zip(bf16_chunk_sum(world, send)) {
        *o = bf16_to_f32(h);
    }
}

/// Each rank sends every other rank that rank's chunk of its bf16 buffer (an all-to-all) and
/// sums the N copies of its own chunk in fp32 in rank order; the sum rounded to bf16.
fn bf16_chunk_sum(world: &SimpleCommunicator, send: &[f32]) -> Vec<u16> {
    let n = world.size() as usize;
    let rank = world.rank() as usize;
    let len = send.len();
    let wire: Vec<u16> = send.iter().map(|&x| f32_to_bf16(x)).collect();
    let chunks: Vec<std::ops::Range<usize>> = (0..n).map(|r| chunk(len, n, r)).collect();
    let m = chunks[rank].len();
    let send_counts: Vec<i32> = chunks.iter().map(|c| c.len() as i32).collect();
    let send_displs: Vec<i32> = chunks.iter().map(|c| c.start as i32).collect();
    let recv_counts = vec![m as i32; n];
    let recv_displs: Vec<i32> = (0..n).map(|r| (r * m) as i32).collect();
    // copies[r * m..(r + 1) * m]: rank r's values of this rank's chunk.
    let mut copies = vec![0u16; n * m];
    {
        let sendbuf = Partition::new(&wire[..], &send_counts[..], &send_displs[..]);
        let mut recvbuf = PartitionMut::new(&mut copies[..], &recv_counts[..], &recv_displs[..]);
        world.all_to_all_varcount_into(&sendbuf, &mut recvbuf);
    }
    let mut sum = vec![0f32; m];
    for r in 0..n {
        for (s, &h) in sum.iter_mut().zip(&copies[r * m..(r + 1) * m]) {
            *s += bf16_to_f32(h);
        }
    }
    sum.iter().map(|&x| f32_to_bf16(x)).collect()
}

/// Sums `send` over all ranks into `out` with bf16 on the wire: a reduce-scatter then an
/// all-gather, as a ring allreduce moves data. Each rank sends every other rank that rank's
/// chunk of its bf16 buffer (an all-to-all), sums the N copies of its own chunk in fp32 in
/// rank order and rounds the sum to bf16, and the rounded chunks are all-gathered. Each rank
/// sends and receives 2 (N-1)/N x 2 bytes per element (fp32's ring allreduce: 2 (N-1)/N x 4),
/// and every rank ends with the same values: each chunk's sum is computed once, by its owner.
fn allreduce_bf16_wire(world: &SimpleCommunicator, send: &[f32], out: &mut [f32]) {
    let rounded = bf16_chunk_sum(world, send);
    let mut at = 0;
    for part in all_gather_varcount(world, &rounded) {
        for (o, &h) in out[at..at + part.len()].iter_mut().zip(&part) {
            *o = bf16_to_f32(h);
        }
        at += part.len();
    }
}

/// bf16 sums over several nodes of several ranks each, so that the network carries bf16
/// once per node rather than once per rank: the node's ranks sum in fp32 over shared memory;
/// local rank i sums its slice i of the node sums across nodes with bf16 on the wire (with
/// its peers of the same local rank on the other nodes); the slices are gathered within the
/// node. Each node sends and receives 2 (M-1)/M x 2 bytes per element over the network for M
/// nodes (the flat algorithm: about twice that per rank). Every rank ends with the same
/// values: each slice's sum is computed by one owner and copied.
fn allreduce_bf16_by_node(
    node: &SimpleCommunicator,
    across: &SimpleCommunicator,
    send: &[f32],
    out: &mut [f32],
) {
    let mut node_sum = vec![0f32; send.len()];
    node.all_reduce_into(send, &mut node_sum[..], SystemOperation::sum());
    let mine = chunk(send.len(), node.size() as usize, node.rank() as usize);
    let mut slice = vec![0f32; mine.len()];
    allreduce_bf16_wire(across, &node_sum[mine], &mut slice);
    let mut at = 0;
    for part in all_gather_varcount(node, &slice) {
        out[at..at + part.len()].copy_from_slice(&part);
        at += part.len();
    }
}

fn all_gather_varcount<T: Equivalence + Default + Clone>(
    world: &SimpleCommunicator,
    data: &[T],
) -> Vec<Vec<T>> {
    let n = world.size() as usize;
    let mut counts = vec![0i32; n];
    world.all_gather_into(&(data.len() as i32), &mut counts[..]);
    let displs: Vec<i32> = counts
        .iter()
        .scan(0, |acc, &c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect();
    let total: i32 = counts.iter().sum();
    let mut all = vec![T::default(); total as usize];
    {
        let mut partition = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        world.all_gather_varcount_into(data, &mut partition);
    }
    counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec())
        .collect()
}

impl Dist {
    /// Joins the world: MPI when a launcher started us, else a world of one.
    /// `transport` says how the fp32 gradient sums travel (other collectives use MPI).
    pub fn init(collective_timeout_s: f64, transport: Transport) -> Result<Dist> {
        let timeout = Duration::from_secs_f64(collective_timeout_s.max(1.0));
        let host = crate::runtime::sysinfo::hostname();
        if !launched_by_mpi() {
            let topo = Topology {
                rank: 0,
                world: 1,
                local_rank: 0,
                local_size: 1,
                host,
            };
            return Ok(Dist {
                topo,
                jobs: None,
                thread: None,
                timeout,
                bytes_sent: AtomicU64::new(0),
            });
        }
        let (tx, rx) = channel::<Job>();
        let (topo_tx, topo_rx) = channel::<Result<Topology, String>>();
        let thread = std::thread::Builder::new()
            .name("sprtrain-mpi".into())
            .spawn(move || {
                let Some((universe, _level)) =
                    mpi::initialize_with_threading(mpi::Threading::Funneled)
                else {
                    let _ = topo_tx.send(Err("MPI was already initialised".into()));
                    return;
                };
                let mut comms = Comms::new(universe.world());
                if transport == Transport::Tcp && comms.world.size() > 1 {
                    let host = mpi::environment::processor_name()
                        .unwrap_or_else(|_| crate::runtime::sysinfo::hostname());
                    if let Err(e) = comms.connect_ring(&host, timeout) {
                        let _ = topo_tx.send(Err(format!("{e:#}")));
                        // No MPI_Finalize: the other ranks may never reach it. The error
                        // ends this process, and the launcher the job.
                        std::mem::forget(universe);
                        return;
                    }
                }
                let topo = Topology {
                    rank: comms.world.rank() as usize,
                    world: comms.world.size() as usize,
                    local_rank: comms.node.rank() as usize,
                    local_size: comms.node.size() as usize,
                    host: mpi::environment::processor_name()
                        .unwrap_or_else(|_| crate::runtime::sysinfo::hostname()),
                };
                let _ = topo_tx.send(Ok(topo));
                let several_nodes = comms.node.size() < comms.world.size();
                serve(comms, rx);
                if several_nodes {
                    // Every rank has passed the final barrier, so no message is in flight; but
                    // MPICH 4.0 over UCX's tcp transport can hang in MPI_Finalize across nodes
                    // (one rank closing its connections while the others wait in Finalize's
                    // own barrier: about one run in three on the simulated cluster). So tell
                    // the launcher this rank is done, as Finalize would, and leave MPI as is.
                    pmi_finalize();
                    std::mem::forget(universe);
                }
                // Otherwise `universe` drops here: MPI_Finalize, on this thread.
            })
            .context("cannot start the MPI communication thread")?;
        let topo = topo_rx
            .recv_timeout(timeout)
            .map_err(|_| {
                anyhow!("MPI initialisation did not finish within {collective_timeout_s} s")
            })?
            .map_err(|e| anyhow!(e))?;
        Ok(Dist {
            topo,
            jobs: Some(tx),
            thread: Some(thread),
            timeout,
            bytes_sent: AtomicU64::new(0),
        })
    }

    pub fn is_root(&self) -> bool {
        self.topo.rank == 0
    }

    /// Payload bytes this rank has sent in sums so far: what the training loop's gradient and
    /// loss sums put on the network, for metrics.jsonl (the veth counters of
    /// scripts/sim_cluster.sh measure the same traffic with its headers).
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn count_sum(&self, len: usize, elem_bytes: usize) {
        self.count_bytes(allreduce_bytes(len, elem_bytes, self.topo.world));
    }

    fn count_bytes(&self, bytes: u64) {
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Sends a job and waits for its reply; a reply that does not come in time is fatal for the
    /// whole job: reported with this rank and `what`, then every rank is stopped.
    fn call<T>(&self, what: &str, make: impl FnOnce(Sender<T>) -> Job) -> Result<T> {
        let Some(jobs) = &self.jobs else {
            bail!("no MPI world")
        };
        let (tx, rx) = channel();
        jobs.send(make(tx))
            .map_err(|_| anyhow!("rank {}: the MPI thread has stopped", self.topo.rank))?;
        match rx.recv_timeout(self.timeout) {
            Ok(v) => Ok(v),
            Err(_) => self.timed_out(what),
        }
    }

    fn timed_out(&self, what: &str) -> ! {
        eprint_line(&format!(
            "sprtrain: rank {}: error: collective {what} did not finish within {} s (dist.collective_timeout_s); aborting the job",
            self.topo.rank,
            self.timeout.as_secs_f64()
        ));
        // The MPI thread is stuck inside the collective. Abort the job through MPI from this
        // thread (outside MPI_THREAD_FUNNELED's rules, but the process ends either way): the
        // launcher then stops every rank on every node, and gives up on a node it can no
        // longer reach, where a plain exit leaves it waiting on that node for good. Should the
        // abort itself block on the stuck thread, leave without it after a few seconds.
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(5));
            std::process::exit(3);
        });
        // Give the launcher time to forward the line above: an abort (ours, or another rank's
        // a moment later) ends its output forwarding, and the line could be lost with it.
        std::thread::sleep(Duration::from_millis(500));
        if self.jobs.is_some() {
            // SAFETY: MPI is initialised (a world of several processes) and not finalised:
            // the MPI thread is still inside the collective.
            unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 3) };
        }
        std::process::exit(3);
    }

    /// Element-wise sum of small f64 statistics (losses, counts).
    pub fn allreduce_sum_f64(&self, what: &str, buf: Vec<f64>) -> Result<Vec<f64>> {
        if self.topo.world == 1 {
            return Ok(buf);
        }
        self.count_sum(buf.len(), 8);
        self.call(what, |tx| Job::AllreduceF64(buf, tx))
    }

    /// Overwrites `buf` with rank 0's values, in place, on every rank. `buf` stays borrowed
    /// until the MPI thread is done with it: `call` returns only with its reply, or not at
    /// all (the timeout ends the process).
    pub fn broadcast_into(&self, what: &str, buf: &mut [f32]) -> Result<()> {
        if self.topo.world == 1 {
            return Ok(());
        }
        let dst = Destination::of(buf);
        self.call(what, |tx| Job::BroadcastInto(dst, tx))
    }

    /// Starts summing `send` over all ranks into `dst` and returns at once; the MPI thread
    /// works through started sums in order while the caller computes. `bf16` puts bf16 on the
    /// wire (half fp32's bytes: a reduce-scatter and an all-gather, summed in fp32, the sum
    /// rounded to bf16). `Pending::wait` gives the send buffer back.
    ///
    /// # Safety
    /// `dst` must stay valid, and be neither read nor written by anyone else, until `wait`
    /// on the returned `Pending` has returned.
    pub unsafe fn start_allreduce_into(
        &self,
        what: String,
        send: Vec<f32>,
        dst: &mut [f32],
        bf16: bool,
    ) -> Result<Pending> {
        if self.topo.world == 1 {
            dst.copy_from_slice(&send);
            return Ok(Pending::ready(what, send));
        }
        self.count_sum(send.len(), if bf16 { 2 } else { 4 });
        let dst = Destination::of(dst);
        self.start(what, |tx| Job::AllreduceInto(send, dst, bf16, tx))
    }

    /// Starts summing `send` over all ranks, keeping this rank's chunk (`chunk(send.len(),
    /// world, rank)`) in `dst`, overwritten or, with `add`, added to; returns at once, as
    /// [`Dist::start_allreduce_into`] (whose `bf16` it shares). `send` is freed as soon as the
    /// sum is done (`wait` gives an empty buffer): under ZeRO the buckets of a whole backward
    /// are in flight at once, and their send buffers together are the size of the gradient.
    ///
    /// # Safety
    /// As [`Dist::start_allreduce_into`].
    pub unsafe fn start_reduce_scatter_into(
        &self,
        what: String,
        send: Vec<f32>,
        dst: &mut [f32],
        bf16: bool,
        add: bool,
    ) -> Result<Pending> {
        let world = self.topo.world;
        debug_assert_eq!(dst.len(), chunk(send.len(), world, self.topo.rank).len());
        if world == 1 {
            if add {
                dst.iter_mut().zip(&send).for_each(|(d, s)| *d += s);
            } else {
                dst.copy_from_slice(&send);
            }
            return Ok(Pending::ready(what, Vec::new()));
        }
        self.count_bytes(scatter_bytes(send.len(), if bf16 { 2 } else { 4 }, world));
        let dst = Destination::of(dst);
        self.start(what, |tx| Job::ReduceScatterInto(send, dst, bf16, add, tx))
    }

    /// Starts gathering every rank's chunk of `dst` (`chunk(dst.len(), world, rank)`; this
    /// rank's is `mine`) into `dst` on every rank; returns at once. `wait` gives `mine` back.
    ///
    /// # Safety
    /// As [`Dist::start_allreduce_into`].
    pub unsafe fn start_all_gather_into(
        &self,
        what: String,
        mine: Vec<f32>,
        dst: &mut [f32],
    ) -> Result<Pending> {
        let (world, rank) = (self.topo.world, self.topo.rank);
        debug_assert_eq!(mine.len(), chunk(dst.len(), world, rank).len());
        if world == 1 {
            dst.copy_from_slice(&mine);
            return Ok(Pending::ready(what, mine));
        }
        self.count_bytes(scatter_bytes(dst.len(), 4, world));
        let dst = Destination::of(dst);
        self.start(what, |tx| Job::AllGatherInto(mine, dst, tx))
    }

    /// Hands `job` to the MPI thread without waiting for it.
    fn start(&self, what: String, job: impl FnOnce(Sender<Vec<f32>>) -> Job) -> Result<Pending> {
        let Some(jobs) = &self.jobs else {
            bail!("no MPI world")
        };
        let (tx, rx) = channel();
        jobs.send(job(tx))
            .map_err(|_| anyhow!("rank {}: the MPI thread has stopped", self.topo.rank))?;
        Ok(Pending {
            what,
            reply: Some(rx),
            ready: None,
        })
    }

    /// Every rank's bytes, by rank.
    pub fn all_gather_bytes(&self, what: &str, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        if self.topo.world == 1 {
            return Ok(vec![bytes]);
        }
        self.call(what, |tx| Job::AllGatherBytes(bytes, tx))
    }

    /// Every rank's values, by rank.
    pub fn all_gather_f32(&self, what: &str, values: Vec<f32>) -> Result<Vec<Vec<f32>>> {
        if self.topo.world == 1 {
            return Ok(vec![values]);
        }
        self.call(what, |tx| Job::AllGatherF32(values, tx))
    }

    /// Checks that every rank holds the same `lines` (the resolved config and the parameter
    /// layout, one `key = value` per line); on a mismatch every rank fails with the first
    /// differing line and the ranks involved, so none is left waiting.
    pub fn check_same(&self, what: &str, lines: &[String]) -> Result<()> {
        let all = self.all_gather_bytes(what, lines.join("\n").into_bytes())?;
        let texts: Vec<String> = all
            .iter()
            .map(|b| String::from_utf8_lossy(b).to_string())
            .collect();
        for (r, text) in texts.iter().enumerate().skip(1) {
            if *text == texts[0] {
                continue;
            }
            let (a, b): (Vec<&str>, Vec<&str>) =
                (texts[0].lines().collect(), text.lines().collect());
            let i = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x != y)
                .unwrap_or(a.len().min(b.len()));
            let show = |v: &[&str]| v.get(i).map_or("(nothing)".to_string(), |s| s.to_string());
            bail!(
                "{what} differs between rank 0 and rank {r}: rank 0 has `{}`, rank {r} has `{}`",
                show(&a),
                show(&b)
            );
        }
        Ok(())
    }

    /// Stops every rank of the job (MPI_Abort) after this rank's error was printed.
    pub fn abort(&self, code: i32) -> ! {
        if let Some(jobs) = &self.jobs {
            // A moment for other ranks that failed the same way to print their own message.
            std::thread::sleep(Duration::from_millis(500));
            let _ = jobs.send(Job::Abort(code));
            // MPI_Abort never returns; if the MPI thread is stuck in a collective, exit anyway.
            std::thread::sleep(Duration::from_secs(5));
        }
        std::process::exit(code);
    }
}

impl Drop for Dist {
    fn drop(&mut self) {
        // Closing the channel ends the MPI thread's loop at a barrier of all ranks.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Tells a PMI-1 process manager (MPICH's and Intel MPI's Hydra, through the socket in
/// $PMI_FD) that this process has finished, as MPI_Finalize does: without it Hydra takes the
/// exit for a crash and kills the ranks still finishing. Best effort: without $PMI_FD, or on
/// any error, it does nothing.
fn pmi_finalize() {
    use std::io::{Read, Write};
    use std::os::fd::FromRawFd;
    let Some(fd) = std::env::var("PMI_FD")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return;
    };
    // SAFETY: the PMI socket is open for the life of the process and nothing else uses it
    // now (the MPI thread is done); ManuallyDrop keeps it open after we are done.
    let mut pmi = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
    if pmi.write_all(b"cmd=finalize\n").is_err() {
        return;
    }
    let _ = pmi.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while !reply.ends_with(b"\n") && pmi.read(&mut byte).is_ok_and(|n| n == 1) {
        reply.push(byte[0]);
    }
}

/// Round to nearest even, as PyTorch converts fp32 to bf16 (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    ((bits.wrapping_add(rounding)) >> 16) as u16
}

/// The fp32 value of a bf16 bit pattern (exact).
fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_torch() {
        // torch.tensor([1.0, 1.00390625, 1.01171875, -3.14159]).bfloat16() bit patterns; the
        // middle two lie exactly halfway between bf16 neighbours.
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie rounds to even (down)
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie rounds to even (up)
        assert_eq!(f32_to_bf16(f32::from_bits(0xc049_0fd0)), 0xc049);
    }

    #[test]
    fn allreduce_bytes_is_two_n_minus_one_over_n() {
        assert_eq!(allreduce_bytes(1000, 4, 1), 0);
        assert_eq!(allreduce_bytes(1000, 4, 2), 4000);
        assert_eq!(allreduce_bytes(1000, 4, 4), 6000);
        // bf16 at 4 ranks: 0.5 of fp32's bytes.
        assert_eq!(allreduce_bytes(1000, 2, 4), 3000);
    }

    #[test]
    fn chunks_cover_the_buffer_in_rank_order() {
        for (len, world) in [(10, 4), (3, 4), (0, 2), (1_000_003, 8)] {
            let mut next = 0;
            for rank in 0..world {
                let c = chunk(len, world, rank);
                assert_eq!(c.start, next);
                assert!(c.len() <= len.div_ceil(world));
                next = c.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn a_world_of_one_reduces_locally() {
        let d = Dist::init(5.0, Transport::Mpi).unwrap();
        if d.topo.world != 1 {
            return; // under a launcher this test has nothing to say
        }
        assert_eq!(
            d.allreduce_sum_f64("t", vec![1.0, 2.0]).unwrap(),
            vec![1.0, 2.0]
        );
        let mut buf = [3.0];
        d.broadcast_into("t", &mut buf).unwrap();
        assert_eq!(buf, [3.0]);
        d.check_same("config", &["a = 1".to_string()]).unwrap();
    }
}
