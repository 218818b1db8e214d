//! Data parallelism across nodes, on a simulated cluster (scripts/sim_cluster.sh): two "nodes",
//! each its own network and UTS namespace with its own hostname, wired through a bridge; Hydra
//! (MPICH's mpirun, or Intel MPI's mpiexec.hydra under scripts/test_intel_mpi.sh) launches the
//! ranks into them through scripts/sim_launch.sh in place of ssh, and they talk TCP over the
//! veth links. Each test starts its own cluster and tears it down, also when it fails. Needs
//! root (network namespaces) and MPI: skipped with a message elsewhere, required under CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{
    logged_steps, losses, max_rel_diff, max_weight_diff, mpi_config, mpi_data, rank_pid, require,
    require_mpirun, run_ok, weights,
};

const BIN: &str = env!("CARGO_BIN_EXE_sprtrain");

/// One cluster at a time: each job has 4 ranks on this machine's cores, and the fault tests
/// time how fast a job ends.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
}

/// A running simulated cluster of two nodes; dropping it tears it down.
struct Cluster {
    name: String,
}

impl Cluster {
    /// Starts cluster `cfoo<pid>` with unshaped links, or skips (None) where namespaces
    /// cannot be made (not root, no iproute2).
    fn up(tag: &str) -> Option<Cluster> {
        Cluster::up_with(tag, 2, &[])
    }

    /// `up` with `nodes` nodes and extra `sim_cluster.sh up` flags.
    fn up_with(tag: &str, nodes: usize, flags: &[&str]) -> Option<Cluster> {
        let root = unsafe { libc::geteuid() } == 0;
        let ip = Command::new("ip")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        require(
            (root && ip).then_some(()),
            "a simulated cluster needs root and iproute2 (network namespaces)",
        )?;
        let name = format!("c{tag}{}", std::process::id() % 100_000);
        let out = Command::new(script("sim_cluster.sh"))
            .args(["up", "--name", &name, "--nodes", &nodes.to_string()])
            .args(flags)
            .output()
            .unwrap();
        let cluster = Cluster { name };
        assert!(
            out.status.success(),
            "sim_cluster.sh up failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(cluster)
    }

    /// The CPUs a process started on node k may run on (its `Cpus_allowed_list`).
    fn node_cpus(&self, k: usize) -> Vec<usize> {
        let out = Command::new(script("sim_cluster.sh"))
            .args([
                "exec",
                &self.host(k),
                "grep",
                "Cpus_allowed_list",
                "/proc/self/status",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let list = text.split(':').nth(1).unwrap_or("").trim().to_string();
        list.split(',')
            .flat_map(|part| {
                let (a, b) = part.split_once('-').unwrap_or((part, part));
                a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()
            })
            .collect()
    }

    fn host(&self, k: usize) -> String {
        format!("{}-n{k}", self.name)
    }

    /// (sent, received) bytes on node k's link so far, headers included.
    fn link_bytes(&self, k: usize) -> (u64, u64) {
        let out = Command::new(script("sim_cluster.sh"))
            .args(["bytes", &self.host(k)])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Vec<u64> = text
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        (v[0], v[1])
    }

    fn set_link(&self, k: usize, state: &str) {
        let status = Command::new(script("sim_cluster.sh"))
            .args(["link", &self.host(k), state])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// `mpirun -f HOSTFILE` run on node 0, as a user logged in there would run it, with
    /// Hydra's ssh launcher replaced by ours, and MPI told to use the nodes' network; the
    /// caller adds the ranks. Both MPIs take these flags.
    fn launch(&self, mpirun: &str, dir: &Path) -> Command {
        let hostfile = dir.join("hostfile");
        std::fs::write(
            &hostfile,
            format!("{}:2\n{}:2\n", self.host(0), self.host(1)),
        )
        .unwrap();
        let mut cmd = Command::new(script("sim_cluster.sh"));
        cmd.args(["exec", &self.host(0), mpirun, "-f"])
            .arg(&hostfile)
            .args(["-bootstrap", "ssh", "-bootstrap-exec"])
            .arg(script("sim_launch.sh"));
        // Over the nodes' eth0, by TCP: UCX (MPICH) would otherwise see the other "node" as
        // reachable by shared memory (it is the same kernel); Intel MPI reaches the network
        // through libfabric's tcp provider.
        for (k, v) in [
            ("UCX_TLS", "tcp"),
            ("UCX_NET_DEVICES", "eth0"),
            ("FI_PROVIDER", "tcp"),
            ("FI_TCP_IFACE", "eth0"),
        ] {
            cmd.args(["-genv", k, v]);
        }
        cmd
    }

    /// The real command: `mpirun -f HOSTFILE -n 4 -ppn 2 sprtrain --config CONFIG` on node 0
    /// (see `launch`); `parts` holds each MPMD part's extra arguments, the parts sharing the
    /// 4 ranks in order.
    fn mpirun(&self, mpirun: &str, dir: &Path, config: &Path, parts: &[&[&str]]) -> Command {
        let mut cmd = self.launch(mpirun, dir);
        let per_part = 4 / parts.len();
        for (i, extra) in parts.iter().enumerate() {
            if i > 0 {
                cmd.arg(":");
            }
            cmd.args(["-n", &per_part.to_string()]);
            if i == 0 {
                cmd.args(["-ppn", "2"]);
            }
            cmd.args([BIN, "--config"]).arg(config).args(*extra);
        }
        cmd
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script("sim_cluster.sh"))
            .args(["down", "--name", &self.name])
            .output();
    }
}

/// What each test starts with: the one-cluster lock, the MPI launcher, and a new cluster
/// (None, the test skipped, where either is missing).
fn start(tag: &str) -> Option<(MutexGuard<'static, ()>, String, Cluster)> {
    let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let mpirun = require_mpirun()?;
    let cluster = Cluster::up(tag)?;
    Some((one, mpirun, cluster))
}

/// The cores each rank's pin-map line names:
/// `rank R/N on HOST (local L/S): cores 0-1,4, split by sprtrain, ...`.
fn pin_map(stderr: &str) -> Vec<(usize, String, Vec<usize>)> {
    let mut out = Vec::new();
    for line in stderr.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("rank ") else {
            continue;
        };
        let Some((rank, rest)) = rest.split_once('/') else {
            continue;
        };
        let Some((_, rest)) = rest.split_once(" on ") else {
            continue;
        };
        let Some((host, rest)) = rest.split_once(' ') else {
            continue;
        };
        let Some(cores) = rest.split_once("): cores ").map(|(_, c)| c) else {
            continue;
        };
        let cores = cores.split(", ").next().unwrap_or("");
        out.push((
            rank.parse().unwrap(),
            host.to_string(),
            sprtrain::runtime::placement::parse_cpu_ranges(cores).unwrap(),
        ));
    }
    out
}

/// `up --own-cores` gives each node its own slice of this machine's physical cores (as real
/// nodes have their own cores: the layout of scripts/scaling.sh), and what `exec` starts on a
/// node is bound to that slice; without the flag a node may use every CPU; more nodes than
/// cores is refused with one line.
#[test]
fn own_cores_give_each_node_its_own_cpus() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let root = unsafe { libc::geteuid() } == 0;
    if require(root.then_some(()), "a simulated cluster needs root").is_none() {
        return;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = sprtrain::runtime::placement::physical_cores().len();
    if cores >= 2 {
        let Some(cluster) = Cluster::up_with("oc", 2, &["--own-cores"]) else {
            return;
        };
        let (a, b) = (cluster.node_cpus(0), cluster.node_cpus(1));
        eprintln!("node 0: cpus {a:?}, node 1: cpus {b:?}");
        assert!(!a.is_empty() && !b.is_empty());
        assert!(a.iter().all(|c| !b.contains(c)), "nodes share cpus");
        assert_eq!(a.len() + b.len(), cpus, "every cpu belongs to a node");
        drop(cluster);
        let Some(shared) = Cluster::up_with("sh", 2, &[]) else {
            return;
        };
        assert_eq!(shared.node_cpus(0).len(), cpus);
    }
    let name = format!("cox{}", std::process::id() % 100_000);
    let nodes = (cores + 1).to_string();
    let out = Command::new(script("sim_cluster.sh"))
        .args(["up", "--name", &name, "--nodes", &nodes, "--own-cores"])
        .output()
        .unwrap();
    let _ = Command::new(script("sim_cluster.sh"))
        .args(["down", "--name", &name])
        .output();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--own-cores needs a core per node"), "{err}");
}

/// Runs one process with batch 4 and 4-fold accumulation on `data` and checks that the
/// 4-rank run in `out4` matched it: per-step losses within 1e-5 relative and final weights
/// within 1e-5 (fp32; the runs differ only in summation order). Returns the 4-rank run's
/// losses and the model's parameter count.
fn like_accumulation(dir: &Path, data: &Path, out4: &Path, steps: usize) -> (Vec<f64>, u64) {
    let (c1, out1) = mpi_config(dir, data, "accumulation", 4, 4, steps);
    let mut one = Command::new(BIN);
    one.arg("--config").arg(&c1);
    run_ok(one);
    let (l4, l1) = (losses(out4), losses(&out1));
    assert_eq!(l4.len(), steps);
    let worst = max_rel_diff(&l1, &l4);
    eprintln!("per-step loss max relative difference {worst:e}");
    assert!(worst <= 1e-5, "losses {l1:?} vs {l4:?}");
    let (w4, w1) = (weights(out4), weights(&out1));
    let wmax = max_weight_diff(&w1, &w4);
    eprintln!("final weights max abs difference {wmax:e}");
    assert!(wmax <= 1e-5, "weights differ by {wmax}");
    (l4, w1.iter().map(|(_, t)| t.numel() as u64).sum())
}

/// 4 ranks on 2 nodes with batch 4 each against one process with batch 4 and 4-fold
/// accumulation: per-step losses within 1e-5 relative and final weights within 1e-5, as the
/// single-host test. Ranks 0-1 run on node 0 and 2-3 on node 1, each node's two on different
/// cores; the gradients crossed the link (node 1 sent and received at least its 4-byte share
/// of every parameter on every step); and bf16 on the wire, summed node-first, sends under
/// 0.6 of fp32's bytes over the link (half the payload; TCP/IP headers and the step's small
/// fp32 sums, the same in both runs, add a few percent: measured 0.51).
#[test]
fn two_nodes_train_like_one_process_with_accumulation() {
    let Some((_one, mpirun, cluster)) = start("eq") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let steps = 30;
    let (c4, out4) = mpi_config(tmp.path(), &data, "two-nodes", 4, 1, steps);
    let before = cluster.link_bytes(1);
    let run = cluster
        .mpirun(&mpirun, tmp.path(), &c4, &[&[]])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(run.status.success(), "{stderr}");
    let after = cluster.link_bytes(1);

    let map = pin_map(&stderr);
    eprintln!("pin map: {map:?}");
    assert_eq!(map.len(), 4, "{stderr}");
    for (rank, host, cores) in &map {
        assert_eq!(host, &cluster.host(rank / 2), "rank {rank}");
        assert!(!cores.is_empty(), "rank {rank} is not pinned");
    }
    for node in [0, 2] {
        let (a, b) = (
            &map.iter().find(|m| m.0 == node).unwrap().2,
            &map.iter().find(|m| m.0 == node + 1).unwrap().2,
        );
        assert!(
            a.iter().all(|c| !b.contains(c)),
            "ranks {node} and {} share cores",
            node + 1
        );
    }

    let (l4, params) = like_accumulation(tmp.path(), &data, &out4, steps);

    // Node 1's partial gradient must reach node 0 and the sum come back, every step.
    let must_cross = steps as u64 * params * 4;
    let (sent, received) = (after.0 - before.0, after.1 - before.1);
    eprintln!("node 1's link: sent {sent} B, received {received} B; gradients need {must_cross} B each way");
    assert!(sent >= must_cross && received >= must_cross);

    // What metrics.jsonl says each rank sent per step: the fp32 gradient and the step's f64
    // totals, 2 (N-1)/N of each.
    let per_step = common::bytes_per_step(&out4);
    let want = sprtrain::dist::allreduce_bytes(params as usize, 4, 4)
        + sprtrain::dist::allreduce_bytes(sprtrain::train::STEP_TOTALS, 8, 4);
    assert_eq!(per_step.len(), steps);
    assert!(
        per_step.iter().all(|&b| b == want as f64),
        "{per_step:?} vs {want}"
    );

    // bf16 on the wire: the same run to bf16 rounding, and fewer bytes over the link.
    let (cb, outb) = mpi_config(tmp.path(), &data, "two-nodes-bf16", 4, 1, steps);
    let before = cluster.link_bytes(1);
    let run = cluster
        .mpirun(
            &mpirun,
            tmp.path(),
            &cb,
            &[&["--set", "dist.reduce_dtype=bf16"]],
        )
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let after = cluster.link_bytes(1);
    let bf16_sent = after.0 - before.0;
    eprintln!(
        "bf16 on the wire: node 1 sent {bf16_sent} B, {:.3} of fp32's",
        bf16_sent as f64 / sent as f64
    );
    assert!(
        (bf16_sent as f64) < 0.6 * sent as f64,
        "bf16 on the wire sent {bf16_sent} B against fp32's {sent} B"
    );
    let worst = max_rel_diff(&losses(&outb), &l4);
    assert!(worst < 1e-2, "bf16 wire: {worst}");
}

/// `dist.transport = "tcp"`: the same 4 ranks on 2 nodes with the gradients summed over
/// sprtrain's own TCP ring train like one process with 4-fold accumulation (per-step losses
/// and final weights within 1e-5, as over MPI), and the gradients crossed the link: the ring
/// 0 -> 1 -> 2 -> 3 -> 0 has one connection each way between the nodes, and node 1 sends
/// 2 (N-1)/N of every 4-byte gradient on it each step (1.5 x 4 bytes a parameter at N = 4).
#[test]
fn the_tcp_ring_trains_like_one_process_across_nodes() {
    let Some((_one, mpirun, cluster)) = start("tcp") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let steps = 30;
    let (c4, out4) = mpi_config(tmp.path(), &data, "ring", 4, 1, steps);
    let before = cluster.link_bytes(1);
    let run = cluster
        .mpirun(
            &mpirun,
            tmp.path(),
            &c4,
            &[&["--set", "dist.transport=tcp"]],
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(run.status.success(), "{stderr}");
    let after = cluster.link_bytes(1);

    let (_, params) = like_accumulation(tmp.path(), &data, &out4, steps);
    let ring_share = steps as u64 * sprtrain::dist::allreduce_bytes(params as usize, 4, 4);
    let (sent, received) = (after.0 - before.0, after.1 - before.1);
    eprintln!("node 1's link: sent {sent} B, received {received} B; the ring needs {ring_share} B each way");
    assert!(sent >= ring_share && received >= ring_share);
}

/// ZeRO stages 2 and 3 across the 2 nodes (4 ranks, each keeping a quarter of the optimizer
/// state and of the summed gradient, and at stage 3 of the parameters between uses) train
/// like one process with 4-fold accumulation, as stage 0 does (per-step losses and final
/// weights within 1e-5). Each rank sends per step, at stage 2, a reduce-scatter and an
/// all-gather of the parameters: 2 x 3/4 x 4 bytes each, what stage 0's allreduce sends; at
/// stage 3 up to one all-gather more (the layers are gathered in forward and again in
/// backward; the embeddings and heads once a step).
#[test]
fn zero_stages_2_and_3_train_like_one_process_across_nodes() {
    let Some((_one, mpirun, cluster)) = start("zero") else {
        return;
    };
    let steps = 20;
    let mut sent = Vec::new();
    for stage in [2, 3] {
        // A directory each: the one-process run is repeated (same output directory name).
        let tmp = tempfile::tempdir().unwrap();
        let data = mpi_data(tmp.path());
        let name = format!("zero{stage}");
        let (c4, out4) = mpi_config(tmp.path(), &data, &name, 4, 1, steps);
        let set = format!("dist.zero_stage={stage}");
        let run = cluster
            .mpirun(&mpirun, tmp.path(), &c4, &[&["--set", &set]])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert!(run.status.success(), "{stderr}");
        assert!(stderr.contains(&format!("ZeRO stage {stage}")), "{stderr}");
        let (_, params) = like_accumulation(tmp.path(), &data, &out4, steps);
        let per_step = common::bytes_per_step(&out4);
        assert_eq!(per_step.len(), steps);
        // (At stage 3 the first step starts with the whole model: it gathers its embeddings
        // and heads no more than the layers.)
        assert!(
            per_step[1..].iter().all(|&b| b == per_step[1]),
            "{per_step:?}"
        );
        assert!(per_step[0] <= per_step[1], "{per_step:?}");
        let scatter = sprtrain::dist::scatter_bytes(params as usize, 4, 4) as f64;
        let totals = sprtrain::dist::allreduce_bytes(sprtrain::train::STEP_TOTALS, 8, 4) as f64;
        let step = per_step[1];
        let gathers = (step - totals) / scatter;
        eprintln!("stage {stage}: {step} bytes a step, {gathers:.3} all-gathers of the model");
        sent.push(step);
        match stage {
            2 => assert_eq!(step, 2.0 * scatter + totals),
            _ => assert!(step > sent[0] && step <= 3.0 * scatter + totals),
        }
    }
}

/// bf16 on the wire across 2 nodes x 2 ranks, where sums go node-first (fp32 within the node,
/// bf16 between nodes): the test runs itself on the cluster, and each rank checks that its
/// sums are within the bf16 rounding bound of the exact sums and equal on every rank
/// (`common::bf16_wire_rank_check`).
#[test]
fn bf16_wire_sums_agree_across_nodes() {
    if std::env::var_os(common::BF16_RANK_CHECK).is_some() {
        return common::bf16_wire_rank_check();
    }
    let Some((_one, mpirun, cluster)) = start("bf") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = cluster.launch(&mpirun, tmp.path());
    cmd.args(["-n", "4", "-ppn", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "bf16_wire_sums_agree_across_nodes",
            "--nocapture",
        ])
        .env(common::BF16_RANK_CHECK, "1");
    run_ok(cmd);
}

/// Starts a long 4-rank job on the cluster and waits until it trains. Returns the running
/// launcher and the config and output directory that identify its ranks.
fn start_long_job(
    cluster: &Cluster,
    mpirun: &str,
    dir: &Path,
    extra: &[&str],
) -> (std::process::Child, PathBuf) {
    let data = mpi_data(dir);
    let (c, out) = mpi_config(dir, &data, "long", 4, 1, 1_000_000);
    let job = cluster
        .mpirun(mpirun, dir, &c, &[extra])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while logged_steps(&out) < 3 {
        assert!(Instant::now() < deadline, "training never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    (job, c)
}

/// Waits at most `limit` for `job` to end, then for every rank of `config` to be gone;
/// returns the job's status, how long it took and its stderr.
fn wait_for_end(
    mut job: std::process::Child,
    config: &Path,
    limit: Duration,
) -> (std::process::ExitStatus, Duration, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = job.kill();
            for r in 0..4 {
                if let Some(pid) = rank_pid(config, r) {
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            panic!("the job outlived the fault by {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = start.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut stderr).unwrap();
    // Ranks the launcher could not reach end by themselves (their own collective timeout).
    while (0..4).any(|r| rank_pid(config, r).is_some()) {
        assert!(
            start.elapsed() < limit,
            "ranks outlived the fault by {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (status, took, stderr)
}

/// `kill -9` of a rank on node 1: every rank on both nodes ends, and the job exits non-zero,
/// within 30 s; with the gradients on MPI and on the TCP ring (the launcher sees the death
/// and ends the job at once, before a neighbour's broken connection can: that path is
/// `dist::ring`'s unit test).
#[test]
fn killing_a_rank_on_another_node_ends_the_job() {
    let Some((_one, mpirun, cluster)) = start("kill") else {
        return;
    };
    for transport in ["mpi", "tcp"] {
        let tmp = tempfile::tempdir().unwrap();
        let set = format!("dist.transport={transport}");
        let (job, config) = start_long_job(&cluster, &mpirun, tmp.path(), &["--set", &set]);
        let victim = rank_pid(&config, 2).expect("rank 2's process");
        unsafe { libc::kill(victim, libc::SIGKILL) };
        let (status, took, _) = wait_for_end(job, &config, Duration::from_secs(30));
        eprintln!(
            "{transport}: job ended {took:?} after rank 2 (node 1) was killed, status {status}"
        );
        assert!(!status.success());
    }
}

/// Node 1's link fails mid-run (its switch port goes down): a rank reports the collective it
/// waited for past `dist.collective_timeout_s`, naming itself, and the whole job ends non-zero
/// instead of hanging; with the gradients on MPI and on the TCP ring, each on a new cluster.
#[test]
fn a_dead_link_trips_the_collective_timeout() {
    for transport in ["mpi", "tcp"] {
        let Some((_one, mpirun, cluster)) = start("link") else {
            return;
        };
        a_dead_link_with(&cluster, &mpirun, transport);
    }
}

/// `a_dead_link_trips_the_collective_timeout` with the gradients on `transport`.
fn a_dead_link_with(cluster: &Cluster, mpirun: &str, transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let set = format!("dist.transport={transport}");
    let (job, config) = start_long_job(
        cluster,
        mpirun,
        tmp.path(),
        &["--set", "dist.collective_timeout_s=5", "--set", &set],
    );
    cluster.set_link(1, "down");
    // The ranks give up after 5 s and abort the job; a launcher still waiting on node 1 gives
    // up when TCP does (the simulated nodes retransmit for about 13 s, tcp_retries2 = 5).
    let (status, took, stderr) = wait_for_end(job, &config, Duration::from_secs(60));
    eprintln!(
        "{stderr}\n{transport}: job ended {took:?} after node 1's link went down, status {status}"
    );
    assert!(!status.success());
    // Whichever rank times out first reports (its abort may end the others before they do).
    let reported = stderr.lines().any(|l| {
        l.starts_with("sprtrain: rank ")
            && l.contains(": error: collective ")
            && l.ends_with(
                "did not finish within 5 s (dist.collective_timeout_s); aborting the job",
            )
    });
    assert!(reported, "{stderr}");
}

/// Node 1's ranks started with another learning rate (an MPMD launch: the second part of
/// the command lands on node 1): every rank stops with the key and the ranks named.
#[test]
fn a_different_config_on_another_node_is_refused() {
    let Some((_one, mpirun, cluster)) = start("cfg") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let (c, _) = mpi_config(tmp.path(), &data, "mpmd", 4, 1, 5);
    let start = Instant::now();
    let out = cluster
        .mpirun(
            &mpirun,
            tmp.path(),
            &c,
            &[&[], &["--set", "train.learning_rate=2e-3"]],
        )
        .output()
        .unwrap();
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        stderr.contains("differs between rank 0 and rank 2: rank 0 has `train.learning_rate = 0.001`, rank 2 has `train.learning_rate = 0.002`"),
        "{stderr}"
    );
}
