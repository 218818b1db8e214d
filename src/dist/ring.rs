//! fp32 sums over a ring of TCP connections of our own, with blocking sockets, as Gloo sums
//! on CPUs. MPI libraries make progress by polling (MPICH over UCX's tcp transport spins on
//! `epoll_wait` with a zero timeout), which takes a core's worth of CPU for as long as a sum
//! runs; where a node has no core to spare that comes out of training. A thread blocked in
//! `read` costs nothing while it waits, so here a sum's CPU is the kernel's copies and the
//! additions. MPI still launches the job and carries everything else (addresses are exchanged
//! over it); only the gradient sums travel here.
//!
//! Rank r sends to rank r+1 and receives from rank r-1 (mod N) on two connections. A sum is a
//! reduce-scatter then an all-gather over the ring, N-1 steps each, every step moving 1/N of
//! the buffer: 2 (N-1)/N of it each way in all, as MPI's long-message allreduce.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::chunk;

/// The first bytes of a ring connection, both ways, so that a stray connection to our port
/// (another job, a scanner) is turned away rather than taken for a peer.
const MAGIC: &[u8; 8] = b"sprring1";

/// Received data is added a piece at a time so the piece is still in cache: 256 Ki f32s.
const PIECE: usize = 1 << 18;

/// The environment variable that names the network interface the ring uses (as Gloo's
/// GLOO_SOCKET_IFNAME); unset, every interface's IPv4 address is offered.
pub const IFNAME_VAR: &str = "SPRTRAIN_SOCKET_IFNAME";

/// Where a rank listens for its left neighbour: its host name, port, and the addresses to
/// try in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub addrs: Vec<IpAddr>,
}

impl Endpoint {
    /// `host port addr,addr,...`: one line, for the all-gather over MPI.
    pub fn encode(&self) -> Vec<u8> {
        let addrs: Vec<String> = self.addrs.iter().map(|a| a.to_string()).collect();
        format!("{} {} {}", self.host, self.port, addrs.join(",")).into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Endpoint> {
        let text = std::str::from_utf8(bytes).context("ring endpoint is not UTF-8")?;
        let mut parts = text.split(' ');
        let (Some(host), Some(port), Some(addrs), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            bail!("malformed ring endpoint `{text}`")
        };
        let addrs = addrs
            .split(',')
            .filter(|a| !a.is_empty())
            .map(|a| a.parse().with_context(|| format!("bad address `{a}`")))
            .collect::<Result<Vec<IpAddr>>>()?;
        Ok(Endpoint {
            host: host.to_string(),
            port: port.parse().with_context(|| format!("bad port `{port}`"))?,
            addrs,
        })
    }
}

/// A bound listener and the endpoint to announce for it.
pub struct Listening {
    listener: TcpListener,
    pub endpoint: Endpoint,
}

/// Listens on every interface, on a port the kernel picks.
pub fn listen(host: &str) -> Result<Listening> {
    let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        .context("cannot open a listening socket for the gradient ring")?;
    let port = listener.local_addr()?.port();
    let ifname = std::env::var(IFNAME_VAR).ok();
    let mut addrs = local_ipv4_addrs(ifname.as_deref());
    if addrs.is_empty() {
        match ifname {
            Some(name) => {
                bail!("{IFNAME_VAR}={name}: no interface of that name with an IPv4 address")
            }
            None => bail!("no network interface with an IPv4 address for the gradient ring"),
        }
    }
    // Loopback last: it only reaches a neighbour on this host.
    addrs.sort_by_key(|a| a.is_loopback());
    let endpoint = Endpoint {
        host: host.to_string(),
        port,
        addrs: addrs.into_iter().map(IpAddr::V4).collect(),
    };
    Ok(Listening { listener, endpoint })
}

/// IPv4 addresses of the interfaces that are up (only `only`'s, when given).
fn local_ipv4_addrs(only: Option<&str>) -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we walk read-only and then free.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        if ifa.ifa_addr.is_null() || !up {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points to a sockaddr of its sa_family.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        if let Some(only) = only {
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            if name.to_bytes() != only.as_bytes() {
                continue;
            }
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        out.push(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// The two connections of one rank.
pub struct Ring {
    rank: usize,
    world: usize,
    /// To rank + 1.
    right: TcpStream,
    /// From rank - 1.
    left: TcpStream,
    right_name: String,
    left_name: String,
    timeout_s: u64,
}

/// A job-wide value both ends of a connection know: a hash of every endpoint.
fn job_token(peers: &[Endpoint]) -> u64 {
    // FNV-1a
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in peers.iter().flat_map(|p| p.encode()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn hello(rank: usize, token: u64) -> [u8; 24] {
    let mut m = [0u8; 24];
    m[..8].copy_from_slice(MAGIC);
    m[8..16].copy_from_slice(&(rank as u64).to_le_bytes());
    m[16..].copy_from_slice(&token.to_le_bytes());
    m
}

/// Reads the peer's hello and checks it is rank `want` of this job.
fn expect_hello(stream: &mut TcpStream, want: usize, token: u64) -> Result<()> {
    let mut m = [0u8; 24];
    stream.read_exact(&mut m)?;
    if m != hello(want, token) {
        bail!("not rank {want} of this job");
    }
    Ok(())
}

/// Connects to rank `r` at `peer`, trying its addresses in turn (loopback first when it shares
/// our host) until one answers as rank `r` of this job, or `deadline` passes.
fn connect_right(
    me: &Endpoint,
    peer: &Endpoint,
    rank: usize,
    r: usize,
    token: u64,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut candidates: Vec<IpAddr> = Vec::new();
    if peer.host == me.host {
        candidates.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    candidates.extend(peer.addrs.iter().filter(|a| !a.is_loopback()));
    loop {
        let mut last = anyhow!("no address to try");
        for addr in &candidates {
            let at = SocketAddr::new(*addr, peer.port);
            let attempt = || -> Result<TcpStream> {
                let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                s.write_all(&hello(rank, token))?;
                expect_hello(&mut s, r, token)?;
                Ok(s)
            };
            match attempt() {
                Ok(s) => return Ok(s),
                Err(e) => last = e.context(format!("at {at}")),
            }
        }
        if Instant::now() > deadline {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Accepts rank `l`'s connection; others (a stray connection, a wrong hello) are dropped.
fn accept_left(
    listener: &TcpListener,
    rank: usize,
    l: usize,
    token: u64,
    deadline: Instant,
) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                if expect_hello(&mut s, l, token).is_ok()
                    && s.write_all(&hello(rank, token)).is_ok()
                {
                    return Ok(s);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    bail!("no connection");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context("accepting the gradient ring's connection"),
        }
    }
}

impl Ring {
    /// Connects rank `rank` to its neighbours, given every rank's endpoint (by rank): first
    /// to the right neighbour (its listener queues us even before it accepts), then accepts
    /// the left one. A neighbour on this host is tried over loopback first. Gives up after
    /// `timeout`, naming the neighbour.
    pub fn connect(
        listening: Listening,
        rank: usize,
        peers: &[Endpoint],
        timeout: Duration,
    ) -> Result<Ring> {
        let world = peers.len();
        if world < 2 || rank >= world {
            bail!("a ring needs two ranks or more (rank {rank} of {world})");
        }
        let token = job_token(peers);
        let (r, l) = ((rank + 1) % world, (rank + world - 1) % world);
        let name = |k: usize| format!("rank {k} ({})", peers[k].host);
        let deadline = Instant::now() + timeout;
        let me = &listening.endpoint;

        // Accepting runs beside connecting: every rank connects first, and a connection is
        // only taken once each side has checked the other's hello.
        let listener = &listening.listener;
        let (right, left) = std::thread::scope(|scope| {
            let left = scope.spawn(|| accept_left(listener, rank, l, token, deadline));
            let right = connect_right(me, &peers[r], rank, r, token, deadline);
            let left = left
                .join()
                .unwrap_or_else(|_| Err(anyhow!("the ring's accepting thread panicked")));
            (right, left)
        });
        let right = right.with_context(|| {
            format!(
                "rank {rank}: cannot connect the gradient ring to {}",
                name(r)
            )
        })?;
        let left = left.with_context(|| {
            format!(
                "rank {rank}: {} did not connect to the gradient ring within {} s",
                name(l),
                timeout.as_secs_f64()
            )
        })?;
        for s in [&right, &left] {
            s.set_nodelay(true)?;
            // A safety net against a hang: the training thread reports a sum slower than
            // `timeout` itself (naming the collective), so the sockets wait twice as long.
            s.set_read_timeout(Some(2 * timeout))?;
            s.set_write_timeout(Some(2 * timeout))?;
        }
        Ok(Ring {
            rank,
            world,
            right,
            left,
            right_name: name(r),
            left_name: name(l),
            timeout_s: timeout.as_secs(),
        })
    }

    /// Sums `send` over the ring into `out` (same length on every rank). Each chunk's sum
    /// is computed once, by one rank, and copied to the others, so every rank ends with the
    /// same bits. A failed connection is an error naming the neighbour.
    pub fn allreduce_sum(&self, send: &[f32], out: &mut [f32]) -> Result<()> {
        if send.len() != out.len() {
            bail!("ring sum of {} values into {}", send.len(), out.len());
        }
        let plan = RingSum::new(send, out, self.rank, self.world);
        let plan = &plan;
        std::thread::scope(|scope| -> Result<()> {
            let (received_tx, received_rx) = mpsc::channel::<()>();
            let (sent_tx, sent_rx) = mpsc::channel::<()>();
            let sender = scope.spawn(move || self.send_side(plan, received_rx, sent_tx));
            let received = self
                .receive_side(plan, sent_rx, &received_tx)
                .map_err(|e| self.receive_error(e));
            if received.is_err() {
                // Unblock a sender stuck writing to a neighbour that no longer reads.
                let _ = self.right.shutdown(Shutdown::Both);
            }
            drop(received_tx);
            let sent = sender
                .join()
                .map_err(|_| anyhow!("rank {}: the gradient ring's sender panicked", self.rank))?;
            // The sender's error, if any, is the cause; the receiver's then only follows it.
            sent.and(received)
        })
    }

    /// The sending thread: chunk `sent_at(t)` at each step, once the receiver has written it.
    fn send_side(
        &self,
        plan: &RingSum,
        received_rx: mpsc::Receiver<()>,
        sent_tx: mpsc::Sender<()>,
    ) -> Result<()> {
        let mut right = &self.right;
        let result = (|| -> Result<()> {
            for t in 0..plan.steps {
                let c = plan.sent_at(t);
                if t == 0 {
                    right.write_all(bytemuck::cast_slice(&plan.send[plan.ranges[c].clone()]))?;
                } else {
                    // The receiver finished step t - 1, which wrote chunk c.
                    if received_rx.recv().is_err() {
                        return Ok(()); // the receiver failed and says why
                    }
                    right.write_all(bytemuck::cast_slice(&plan.lock(c)[..]))?;
                }
                let _ = sent_tx.send(());
            }
            Ok(())
        })();
        if result.is_err() {
            // Unblock the receiver: the sum cannot finish.
            let _ = self.left.shutdown(Shutdown::Both);
        }
        result.with_context(|| {
            format!(
                "rank {}: sending to {} in the gradient ring",
                self.rank, self.right_name
            )
        })
    }

    /// The receiving side (this thread): the first n - 1 steps add what arrives to this
    /// rank's own values, the last n - 1 copy complete chunks.
    fn receive_side(
        &self,
        plan: &RingSum,
        sent_rx: mpsc::Receiver<()>,
        received_tx: &mpsc::Sender<()>,
    ) -> std::io::Result<()> {
        let n = plan.n;
        let mut left = &self.left;
        let mut piece = vec![0f32; PIECE.min(plan.ranges[0].len().max(1))];
        let mut sent = 0;
        for t in 0..plan.steps {
            let c = plan.received_at(t);
            // Chunk c went out at step t + 1 - n, if there was one: wait till it has.
            while sent + n < t + 2 {
                if sent_rx.recv().is_err() {
                    return Ok(()); // the sender failed and says why
                }
                sent += 1;
            }
            let mut dst = plan.lock(c);
            if t < n - 1 {
                let own = &plan.send[plan.ranges[c].clone()];
                for (o, s) in dst.chunks_mut(piece.len()).zip(own.chunks(piece.len())) {
                    let p = &mut piece[..o.len()];
                    left.read_exact(bytemuck::cast_slice_mut(p))?;
                    for ((o, s), p) in o.iter_mut().zip(s).zip(p.iter()) {
                        *o = s + p;
                    }
                }
            } else {
                left.read_exact(bytemuck::cast_slice_mut(&mut dst[..]))?;
            }
            drop(dst);
            let _ = received_tx.send(());
        }
        Ok(())
    }

    /// A failed receive said as what it is, naming the left neighbour.
    fn receive_error(&self, e: std::io::Error) -> anyhow::Error {
        let e = match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                anyhow!("the connection was closed (did that rank end?)")
            }
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                anyhow!("nothing arrived for {} s", 2 * self.timeout_s)
            }
            _ => anyhow!(e),
        };
        e.context(format!(
            "rank {}: receiving from {} in the gradient ring",
            self.rank, self.left_name
        ))
    }
}

/// One ring sum's chunks and schedule. Step t sends chunk (rank - t) and receives chunk
/// (rank - t - 1), mod n: the first n - 1 steps reduce (after them chunk rank + 1 is complete
/// here), the last n - 1 gather. The two sides take turns on each chunk: the sender reads
/// what the receiver wrote a step before, and the receiver, which can run up to n - 1 steps
/// ahead, overwrites a chunk only after the sender has sent its old value (two channels
/// count the steps done). Each chunk of the output sits behind its own lock, held by one
/// side at a time.
struct RingSum<'a> {
    send: &'a [f32],
    ranges: Vec<std::ops::Range<usize>>,
    chunks: Vec<Mutex<&'a mut [f32]>>,
    rank: usize,
    n: usize,
    steps: usize,
}

impl<'a> RingSum<'a> {
    fn new(send: &'a [f32], out: &'a mut [f32], rank: usize, n: usize) -> Self {
        let ranges: Vec<std::ops::Range<usize>> = (0..n).map(|c| chunk(send.len(), n, c)).collect();
        let mut rest = out;
        let mut chunks = Vec::with_capacity(n);
        for c in &ranges {
            let (this, tail) = rest.split_at_mut(c.len());
            chunks.push(Mutex::new(this));
            rest = tail;
        }
        RingSum {
            send,
            ranges,
            chunks,
            rank,
            n,
            steps: 2 * (n - 1),
        }
    }

    // (t + 1 <= steps < 2n, so adding 2n keeps the differences non-negative.)
    fn sent_at(&self, t: usize) -> usize {
        (self.rank + 2 * self.n - t) % self.n
    }

    fn received_at(&self, t: usize) -> usize {
        (self.rank + 2 * self.n - t - 1) % self.n
    }

    fn lock(&self, c: usize) -> std::sync::MutexGuard<'_, &'a mut [f32]> {
        self.chunks[c].lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rings of 2, 3 and 4 ranks (threads of this process over loopback): every rank ends
    /// with the same bits, within fp32 rounding of the exact sum (each sum adds N values of
    /// magnitude <= 1, so its error is below N ulp of N: 1e-5 relative to N is ample).
    #[test]
    fn ring_sums_are_equal_on_every_rank_and_exact_to_rounding() {
        for n in [2usize, 3, 4] {
            // Lengths that do not divide by n, and one shorter than n.
            for len in [1_000_003usize, 2] {
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|r| {
                        (0..len)
                            .map(|i| (((i * 7919 + r * 104_729) % 2001) as f32 - 1000.0) / 1000.0)
                            .collect()
                    })
                    .collect();
                let outs = run_ring(n, &inputs);
                for i in (0..len).step_by(997) {
                    let exact: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
                    assert!(
                        (f64::from(outs[0][i]) - exact).abs() <= 1e-5 * n as f64,
                        "n {n} len {len} i {i}: {} vs {exact}",
                        outs[0][i]
                    );
                }
                for (r, o) in outs.iter().enumerate() {
                    assert!(
                        o.iter()
                            .zip(&outs[0])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "n {n}: rank {r} differs from rank 0"
                    );
                }
            }
        }
    }

    fn endpoints(n: usize) -> (Vec<Listening>, Vec<Endpoint>) {
        let listening: Vec<Listening> = (0..n).map(|_| listen("testhost").unwrap()).collect();
        let peers = listening.iter().map(|l| l.endpoint.clone()).collect();
        (listening, peers)
    }

    /// Connects rings of `listening.len()` ranks, one thread each, and returns what `each`
    /// makes of every rank's ring, by rank.
    fn on_every_rank<T: Send>(
        listening: Vec<Listening>,
        peers: &[Endpoint],
        each: impl Fn(usize, Ring) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = listening
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let each = &each;
                    s.spawn(move || {
                        each(
                            r,
                            Ring::connect(l, r, peers, Duration::from_secs(20)).unwrap(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn run_ring(n: usize, inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let (listening, peers) = endpoints(n);
        on_every_rank(listening, &peers, |r, ring| {
            let mut out = vec![0f32; inputs[r].len()];
            // Twice: a ring is reused for every bucket of every step.
            ring.allreduce_sum(&inputs[r], &mut out).unwrap();
            ring.allreduce_sum(&inputs[r], &mut out).unwrap();
            out
        })
    }

    /// A neighbour that goes away mid-job: the next sum fails at once with the neighbour
    /// named, instead of waiting for the collective timeout.
    #[test]
    fn a_vanished_neighbour_is_an_error_naming_it() {
        let (listening, peers) = endpoints(2);
        let errors = on_every_rank(listening, &peers, |r, ring| {
            if r == 1 {
                return None; // drops its connections
            }
            std::thread::sleep(Duration::from_millis(200));
            let send = vec![1f32; 1 << 20];
            let mut out = vec![0f32; 1 << 20];
            ring.allreduce_sum(&send, &mut out).err()
        });
        let err = errors
            .into_iter()
            .next()
            .flatten()
            .expect("the sum with a vanished neighbour succeeded");
        let text = format!("{err:#}");
        assert!(text.contains("rank 0: "), "{text}");
        assert!(text.contains("rank 1 (testhost)"), "{text}");
    }

    #[test]
    fn endpoints_round_trip_and_stray_connections_are_refused() {
        let e = Endpoint {
            host: "node-a".into(),
            port: 40123,
            addrs: vec!["10.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap()],
        };
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
        assert!(Endpoint::decode(b"node-a 70000 10.0.0.2").is_err());
        assert!(Endpoint::decode(b"node-a").is_err());

        // A stranger connects first and says something else: rank 1 drops it and keeps
        // waiting for rank 0.
        let (listening, peers) = endpoints(2);
        let mut stray = TcpStream::connect((Ipv4Addr::LOCALHOST, peers[1].port)).unwrap();
        stray.write_all(&[0u8; 24]).unwrap();
        let inputs = [[10.0, 20.0, 30.0], [1.0, 2.0, 3.0]];
        let outs = on_every_rank(listening, &peers, |r, ring| {
            let mut out = [0f32; 3];
            ring.allreduce_sum(&inputs[r], &mut out).unwrap();
            out
        });
        assert_eq!(outs, [[11.0, 22.0, 33.0]; 2]);
    }
}
