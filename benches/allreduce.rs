//! Gradient allreduce bandwidth per bucket size, through the path training uses
//! (`Dist::start_allreduce_into` on the MPI thread), fp32 and bf16 on the wire.
//!
//!   cargo bench --bench allreduce           re-runs itself under `mpirun -n 2`
//!   mpirun -n 4 target/release/deps/allreduce-*   any other world size
//!   ALLREDUCE_TRANSPORT=tcp cargo bench --bench allreduce   fp32 over the TCP ring
//!                                                           (`dist.transport = "tcp"`)
//!
//! algbw = bucket bytes / time; busbw = algbw x 2 (n - 1) / n, the traffic each link carries in
//! a ring allreduce (nccl-tests' convention), comparable across world sizes.

use std::time::Instant;

use anyhow::{bail, Result};
use sprtrain::dist::{Dist, Transport};

/// Whether an MPI launcher started this process (MPICH/Intel MPI, Open MPI, PMIx).
fn under_launcher() -> bool {
    ["PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

fn main() -> Result<()> {
    if !under_launcher() {
        let mpirun = std::env::var("SPRTRAIN_MPIRUN").unwrap_or_else(|_| "mpirun".into());
        let status = std::process::Command::new(&mpirun)
            .args(["-n", "2"])
            .arg(std::env::current_exe()?)
            .status()
            .map_err(|e| anyhow::anyhow!("cannot start {mpirun}: {e}"))?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let transport = match std::env::var("ALLREDUCE_TRANSPORT").as_deref() {
        Ok("tcp") => Transport::Tcp,
        Ok("mpi") | Err(_) => Transport::Mpi,
        Ok(other) => bail!("ALLREDUCE_TRANSPORT={other}: want mpi or tcp"),
    };
    let dist = Dist::init(120.0, transport)?;
    let world = dist.topo.world;
    if dist.is_root() {
        println!(
            "allreduce over {world} processes (sprtrain's MPI thread, non-blocking; fp32 over {transport:?})"
        );
        println!("| bucket MB | wire | ms per allreduce | algbw GB/s | busbw GB/s |");
        println!("| ---: | --- | ---: | ---: | ---: |");
    }
    for mb in [1usize, 4, 16, 25, 64, 256] {
        for bf16 in [false, true] {
            let n = mb * 1024 * 1024 / 4;
            let mut dst = vec![0f32; n];
            let mut send = vec![(dist.topo.rank + 1) as f32; n];
            let want = (world * (world + 1) / 2) as f32;
            // About 2 s of traffic at 5 GB/s, at least 5 repetitions after 2 unmeasured.
            let reps = (10_000 / (mb * 4)).clamp(5, 200);
            let mut best = f64::MAX;
            let mut total = 0.0;
            for rep in 0..reps + 2 {
                let t = Instant::now();
                // SAFETY: `dst` is used by nothing else until `wait` returns.
                let pending = unsafe {
                    dist.start_allreduce_into(format!("bench {mb} MB"), send, &mut dst, bf16)?
                };
                send = pending.wait(&dist)?;
                let dt = t.elapsed().as_secs_f64();
                if dst[0] != want || dst[n - 1] != want {
                    bail!("wrong sum: {} and {}, want {want}", dst[0], dst[n - 1]);
                }
                if rep >= 2 {
                    best = best.min(dt);
                    total += dt;
                }
            }
            let mean = total / reps as f64;
            let bytes = (n * 4) as f64;
            let algbw = bytes / mean / 1e9;
            if dist.is_root() {
                println!(
                    "| {mb} | {} | {:.2} (best {:.2}) | {algbw:.2} | {:.2} |",
                    if bf16 { "bf16" } else { "fp32" },
                    mean * 1e3,
                    best * 1e3,
                    algbw * 2.0 * (world - 1) as f64 / world as f64
                );
            }
        }
    }
    Ok(())
}
