//! Where a rank's compute threads run: which cores, how many threads, and who chose them.
//!
//! The launcher owns the binding. A rank that starts with a narrower CPU mask than its
//! node-mates' (Intel MPI's default pinning domains, `srun --cpu-bind=cores`, `mpirun
//! -bind-to core`, `taskset`, `numactl`) keeps that mask as its domain: its threads are the
//! mask's physical cores, with no second split and no pinning of sprtrain's own. Only ranks
//! that all start with the same mask (nobody bound them) split its cores among themselves, and
//! pin to their share. A cgroup CPU quota (cgroup v2 `cpu.max`, as Kubernetes and Docker set
//! it) caps the automatic thread count.
//!
//! [`plan`] decides from the facts alone (testable on any machine's layout); [`place_threads`]
//! reads the facts from this machine, agrees on the masks with the node's other ranks, and
//! applies the plan.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Result};

use crate::dist::{Dist, Topology};

/// A logical CPU's physical core: (package, core id).
pub type CoreKey = (u32, u32);

/// What a rank starts with.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuFacts {
    /// The logical CPUs this process may run on when it starts (its affinity mask), ascending.
    pub mask: Vec<usize>,
    /// The start masks of the ranks on this node, by local rank (this rank's included).
    pub local_masks: Vec<Vec<usize>>,
    /// Each online logical CPU's physical core.
    pub core_of: BTreeMap<usize, CoreKey>,
    /// The cgroup CPU quota in CPUs (quota / period), where one is set.
    pub quota: Option<f64>,
}

/// What the run asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub local_rank: usize,
    pub local_size: usize,
    pub world: usize,
    /// `runtime.threads`; 0 decides from the cores.
    pub threads: usize,
    /// OMP_NUM_THREADS, where set to a positive number.
    pub omp_threads: Option<usize>,
    /// `dist.pin_threads`.
    pub pin: bool,
}

/// Who chose the rank's cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChosenBy {
    /// The rank started bound to its own cores: they are all its own.
    Launcher,
    /// The node's ranks started with the same mask: sprtrain split it among them.
    Sprtrain,
    /// One rank alone on the whole node.
    Alone,
}

/// Where this process's compute threads run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadPlacement {
    /// libtorch intra-op threads.
    pub count: usize,
    /// One logical CPU per physical core of the rank's domain.
    pub cores: Vec<usize>,
    /// Whether sprtrain binds the process to `cores` (never inside a launcher's binding).
    pub pinned: bool,
    pub chosen_by: ChosenBy,
    /// The rank's share of a cgroup CPU quota, in whole CPUs, where one is set.
    pub quota: Option<usize>,
}

/// One logical CPU per physical core among `cpus`, in order (the first sibling of each core).
fn one_per_core(cpus: &[usize], core_of: &BTreeMap<usize, CoreKey>) -> Vec<usize> {
    let mut seen = std::collections::BTreeSet::new();
    cpus.iter()
        .copied()
        .filter(|cpu| seen.insert(core_of.get(cpu).copied().unwrap_or((u32::MAX, *cpu as u32))))
        .collect()
}

/// Local rank `rank`'s even share of `cores` among `size` ranks (a core each, shared round
/// robin, where there are fewer cores than ranks).
fn split(cores: &[usize], rank: usize, size: usize) -> Vec<usize> {
    if cores.is_empty() {
        return Vec::new();
    }
    if cores.len() < size {
        return vec![cores[rank % cores.len()]];
    }
    let per_rank = cores.len() / size;
    cores[rank * per_rank..(rank + 1) * per_rank].to_vec()
}

/// Threads for `cpus` CPUs: all of them, less one for the communication thread when there are
/// several processes and cores to spare.
fn threads_for(cpus: usize, world: usize) -> usize {
    if world > 1 && cpus > 2 {
        cpus - 1
    } else {
        cpus.max(1)
    }
}

/// The placement of one rank: its domain, who chose it, its thread count.
pub fn plan(facts: &CpuFacts, req: &Request) -> ThreadPlacement {
    let physical = one_per_core(&facts.mask, &facts.core_of);
    let same_masks = facts.local_masks.iter().all(|m| m == &facts.mask);
    let (cores, chosen_by) = if req.local_size > 1 && same_masks {
        (
            split(&physical, req.local_rank, req.local_size),
            ChosenBy::Sprtrain,
        )
    } else if req.local_size > 1 || facts.mask.len() < facts.core_of.len() {
        (physical, ChosenBy::Launcher)
    } else {
        (physical, ChosenBy::Alone)
    };
    // The node's ranks share the container's quota.
    let quota = facts
        .quota
        .map(|q| ((q / req.local_size.max(1) as f64).floor() as usize).max(1));
    let automatic = threads_for(cores.len(), req.world);
    let count = if req.threads > 0 {
        req.threads
    } else if let Some(n) = req.omp_threads {
        n
    } else {
        quota.map_or(automatic, |q| automatic.min(threads_for(q, req.world)))
    };
    ThreadPlacement {
        count,
        pinned: req.pin && req.world > 1 && chosen_by != ChosenBy::Launcher && !cores.is_empty(),
        cores,
        chosen_by,
        quota,
    }
}

/// CPU lists as Linux writes them: `0-13,28-41`.
pub fn cpu_ranges(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// The inverse of [`cpu_ranges`] (also /sys's `online` files); None on malformed text.
pub fn parse_cpu_ranges(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.trim().parse::<usize>().ok()?..=b.trim().parse().ok()?),
            None => out.push(part.trim().parse().ok()?),
        }
    }
    Some(out)
}

impl ThreadPlacement {
    /// `rank R/N on HOST (local L/S): cores 0-13, split by sprtrain, 13 threads[, quota 8]`.
    pub fn describe(&self, topo: &Topology) -> String {
        let who = match self.chosen_by {
            ChosenBy::Launcher => "bound by the launcher",
            ChosenBy::Sprtrain => "split by sprtrain",
            ChosenBy::Alone => "the whole node",
        };
        let pinned = if self.pinned { ", pinned" } else { "" };
        let quota = self
            .quota
            .map(|q| format!(", quota {q}"))
            .unwrap_or_default();
        format!(
            "rank {}/{} on {} (local {}/{}): cores {}, {who}{pinned}, {} threads{quota}",
            topo.rank,
            topo.world,
            topo.host,
            topo.local_rank,
            topo.local_size,
            cpu_ranges(&self.cores),
            self.count
        )
    }
}

/// The CPUs this process may run on now.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the zeroed set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            return (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
        }
    }
    (0..num_cpus::get()).collect()
}

/// Each online logical CPU's physical core, from /sys (a CPU without topology files is a core
/// of its own).
pub fn core_map() -> BTreeMap<usize, CoreKey> {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|t| parse_cpu_ranges(&t))
        .unwrap_or_else(|| (0..num_cpus::get()).collect());
    online
        .into_iter()
        .map(|cpu| {
            let topo = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
            let read = |f: &str| -> Option<u32> {
                std::fs::read_to_string(format!("{topo}/{f}"))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            let key = (read("physical_package_id").unwrap_or(0), read("core_id"));
            (cpu, (key.0, key.1.unwrap_or(cpu as u32 | 1 << 31)))
        })
        .collect()
}

/// One logical CPU per physical core among those this process may run on, in order.
pub fn physical_cores() -> Vec<usize> {
    one_per_core(&allowed_cpus(), &core_map())
}

/// cgroup v2's `cpu.max` ("QUOTA PERIOD" or "max PERIOD") in CPUs.
pub fn parse_cpu_max(text: &str) -> Option<f64> {
    let mut fields = text.split_whitespace();
    let quota: f64 = fields.next()?.parse().ok()?;
    let period: f64 = fields.next().unwrap_or("100000").parse().ok()?;
    (quota > 0.0 && period > 0.0).then_some(quota / period)
}

/// The tightest CPU quota on this process's cgroup (v2) or its ancestors, or cgroup v1's CFS
/// quota, in CPUs.
pub fn cgroup_quota() -> Option<f64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.is_empty() {
            // cgroup v2: cpu.max on the process's group and every group above it.
            let mut dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            let mut tightest: Option<f64> = None;
            loop {
                let here = std::fs::read_to_string(dir.join("cpu.max"))
                    .ok()
                    .and_then(|t| parse_cpu_max(&t));
                tightest = match (tightest, here) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                if !dir.pop() || !dir.starts_with("/sys/fs/cgroup") {
                    return tightest;
                }
            }
        }
        if controllers.split(',').any(|c| c == "cpu") {
            let dir = Path::new("/sys/fs/cgroup")
                .join(controllers)
                .join(path.trim_start_matches('/'));
            let read = |f: &str| -> Option<f64> {
                std::fs::read_to_string(dir.join(f))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            let (quota, period) = (read("cpu.cfs_quota_us")?, read("cpu.cfs_period_us")?);
            return (quota > 0.0 && period > 0.0).then_some(quota / period);
        }
    }
    None
}

/// Decides this rank's placement from this machine's facts and the node's other ranks' start
/// masks, binds the process where sprtrain split the node, and returns the placement.
pub fn place_threads(dist: &Dist, configured: usize, pin: bool) -> Result<ThreadPlacement> {
    let topo = &dist.topo;
    let mask = allowed_cpus();
    let line = format!("{}\t{}", topo.host, cpu_ranges(&mask));
    let gathered = dist.all_gather_bytes("start masks", line.into_bytes())?;
    let local_masks: Vec<Vec<usize>> = gathered
        .iter()
        .filter_map(|b| {
            let text = String::from_utf8_lossy(b);
            let (host, cpus) = text.split_once('\t')?;
            (host == topo.host)
                .then(|| parse_cpu_ranges(cpus))
                .flatten()
        })
        .collect();
    let facts = CpuFacts {
        mask,
        local_masks,
        core_of: core_map(),
        quota: cgroup_quota(),
    };
    let omp_threads = std::env::var("OMP_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0);
    let request = Request {
        local_rank: topo.local_rank,
        local_size: topo.local_size,
        world: topo.world,
        threads: configured,
        omp_threads,
        pin,
    };
    let placement = plan(&facts, &request);
    if placement.pinned {
        bind(&placement.cores, topo.rank)?;
    }
    Ok(placement)
}

/// Binds this thread (and so every thread it starts later, libtorch's pool included) to
/// `cores`.
fn bind(cores: &[usize], rank: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t filled with valid CPU indices, applied to this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "rank {rank}: cannot pin to cores {}: {}",
                cpu_ranges(cores),
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-socket node of `cores` physical cores with hyper-threading: CPUs 0..cores are
    /// the first siblings (socket 0 first), cores..2*cores their second siblings, as Linux
    /// numbers Xeons.
    fn two_sockets(cores: usize) -> BTreeMap<usize, CoreKey> {
        let per_socket = cores / 2;
        (0..2 * cores)
            .map(|cpu| {
                let core = cpu % cores;
                (
                    cpu,
                    ((core / per_socket) as u32, (core % per_socket) as u32),
                )
            })
            .collect()
    }

    fn range(a: usize, b: usize) -> Vec<usize> {
        (a..b).collect()
    }

    fn request(local_rank: usize, local_size: usize, world: usize) -> Request {
        Request {
            local_rank,
            local_size,
            world,
            threads: 0,
            omp_threads: None,
            pin: true,
        }
    }

    /// Intel MPI's default domains on a 56-core node, 2 ranks: each rank starts bound to its
    /// socket's cores and their siblings, and keeps all 28 (27 threads beside the
    /// communication thread), unpinned by sprtrain.
    #[test]
    fn intel_mpi_domains_are_kept_whole() {
        let core_of = two_sockets(56);
        let domains = [
            [range(0, 28), range(56, 84)].concat(),
            [range(28, 56), range(84, 112)].concat(),
        ];
        for (rank, mask) in domains.iter().enumerate() {
            let facts = CpuFacts {
                mask: mask.clone(),
                local_masks: domains.to_vec(),
                core_of: core_of.clone(),
                quota: None,
            };
            let p = plan(&facts, &request(rank, 2, 4));
            assert_eq!(p.cores, range(28 * rank, 28 * rank + 28));
            assert_eq!((p.count, p.pinned), (27, false));
            assert_eq!(p.chosen_by, ChosenBy::Launcher);
        }
    }

    /// `srun --cpu-bind=cores -c 14` on a 112-core node, 4 tasks: each task's mask is 14
    /// cores and their siblings; a single bound rank (taskset) is the launcher's too.
    #[test]
    fn srun_core_binding_and_a_lone_bound_rank() {
        let core_of = two_sockets(112);
        let masks: Vec<Vec<usize>> = (0..4)
            .map(|t| {
                [
                    range(14 * t, 14 * t + 14),
                    range(112 + 14 * t, 126 + 14 * t),
                ]
                .concat()
            })
            .collect();
        let facts = CpuFacts {
            mask: masks[2].clone(),
            local_masks: masks.clone(),
            core_of: core_of.clone(),
            quota: None,
        };
        let p = plan(&facts, &request(2, 4, 8));
        assert_eq!(p.cores, range(28, 42));
        assert_eq!(
            (p.count, p.pinned, p.chosen_by),
            (13, false, ChosenBy::Launcher)
        );

        let alone = CpuFacts {
            mask: range(0, 8),
            local_masks: vec![range(0, 8)],
            core_of,
            quota: None,
        };
        let p = plan(&alone, &request(0, 1, 2));
        assert_eq!(
            (p.cores.len(), p.count, p.chosen_by),
            (8, 7, ChosenBy::Launcher)
        );
    }

    /// No binding: two ranks with the whole 56-core node split it, 28 physical cores each
    /// (never two siblings of one core), and pin to their share; one rank alone keeps it all.
    #[test]
    fn unbound_ranks_split_the_node() {
        let core_of = two_sockets(56);
        let all = range(0, 112);
        for rank in 0..2 {
            let facts = CpuFacts {
                mask: all.clone(),
                local_masks: vec![all.clone(); 2],
                core_of: core_of.clone(),
                quota: None,
            };
            let p = plan(&facts, &request(rank, 2, 2));
            assert_eq!(p.cores, range(28 * rank, 28 * rank + 28));
            assert_eq!(
                (p.count, p.pinned, p.chosen_by),
                (27, true, ChosenBy::Sprtrain)
            );
        }
        let facts = CpuFacts {
            mask: all.clone(),
            local_masks: vec![all],
            core_of,
            quota: None,
        };
        let p = plan(&facts, &request(0, 1, 1));
        assert_eq!((p.cores.len(), p.count, p.pinned), (56, 56, false));
        assert_eq!(p.chosen_by, ChosenBy::Alone);
        // Explicit threads and OMP_NUM_THREADS still win.
        let p = plan(
            &facts,
            &Request {
                omp_threads: Some(6),
                ..request(0, 1, 1)
            },
        );
        assert_eq!(p.count, 6);
    }

    /// A pod limited to 8 CPUs on a 64-core node: 8 threads alone, 3 + 1 communication thread
    /// for each of two ranks sharing the quota; `runtime.threads` still overrides it.
    #[test]
    fn a_cgroup_quota_caps_the_threads() {
        let core_of: BTreeMap<usize, CoreKey> = (0..64).map(|c| (c, (0, c as u32))).collect();
        let all = range(0, 64);
        let facts = CpuFacts {
            mask: all.clone(),
            local_masks: vec![all.clone()],
            core_of: core_of.clone(),
            quota: Some(8.0),
        };
        let p = plan(&facts, &request(0, 1, 1));
        assert_eq!((p.count, p.quota), (8, Some(8)));
        let two = CpuFacts {
            local_masks: vec![all.clone(); 2],
            ..facts.clone()
        };
        let p = plan(&two, &request(1, 2, 2));
        assert_eq!((p.count, p.quota, p.cores.len()), (3, Some(4), 32));
        let p = plan(
            &facts,
            &Request {
                threads: 16,
                ..request(0, 1, 1)
            },
        );
        assert_eq!(p.count, 16);
        assert_eq!(parse_cpu_max("800000 100000\n"), Some(8.0));
        assert_eq!(parse_cpu_max("150000 100000"), Some(1.5));
        assert_eq!(parse_cpu_max("max 100000"), None);
    }

    #[test]
    fn cpu_lists_round_trip() {
        let cpus = [0, 1, 2, 3, 8, 10, 11];
        assert_eq!(cpu_ranges(&cpus), "0-3,8,10-11");
        assert_eq!(parse_cpu_ranges("0-3,8,10-11\n").unwrap(), cpus);
        assert_eq!(cpu_ranges(&[]), "");
        assert!(parse_cpu_ranges("0-x").is_none());
    }
}
