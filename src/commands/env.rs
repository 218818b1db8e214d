//! `sprtrain env`: what this machine offers for training, and what `auto` picks on it.

use std::fmt::Write as _;

use crate::config::Fp32Gemm;
use crate::runtime::sysinfo::{libtorch_version, CpuInfo};

/// The `sprtrain env` report.
pub fn report() -> String {
    let cpu = CpuInfo::detect();
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "cpu              {}",
        if cpu.model.is_empty() {
            "unknown"
        } else {
            &cpu.model
        }
    );
    let _ = writeln!(
        s,
        "cpu flags        avx2={} avx512f={} avx512_bf16={} amx_bf16={} amx_tile={}",
        yes_no(cpu.avx2),
        yes_no(cpu.avx512f),
        yes_no(cpu.avx512_bf16),
        yes_no(cpu.amx_bf16),
        yes_no(cpu.amx_tile)
    );
    let _ = writeln!(
        s,
        "cores            {} physical, {} logical",
        num_cpus::get_physical(),
        num_cpus::get()
    );
    let _ = writeln!(s, "libtorch         {}", libtorch_version());
    let _ = writeln!(
        s,
        "oneDNN (mkldnn)  {}   openmp {}   mkl {}",
        if tch::utils::has_mkldnn() {
            "on"
        } else {
            "off"
        },
        yes_no(tch::utils::has_openmp()),
        yes_no(tch::utils::has_mkl())
    );
    let _ = writeln!(
        s,
        "torch threads    intra-op {}, inter-op {}   (OMP_NUM_THREADS={})",
        tch::get_num_threads(),
        tch::get_num_interop_threads(),
        std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );
    let mpi = mpi::environment::library_version().unwrap_or_else(|_| "unknown".into());
    let (major, minor) = mpi::environment::version();
    let _ = writeln!(
        s,
        "MPI              standard {major}.{minor}: {}",
        mpi.lines().next().unwrap_or("").trim()
    );
    let _ = writeln!(
        s,
        "fp32 gemm auto   {}",
        match Fp32Gemm::Auto.resolve(&cpu) {
            Fp32Gemm::Onednn => {
                "onednn (an AMD CPU with AVX-512: MKL would take its generic AVX2 path)"
            }
            Fp32Gemm::BlasBrgemm => {
                "blas+brgemm (libtorch's at::mm for the layers, oneDNN's brgemm for attention)"
            }
            _ => "blas (libtorch's at::mm)",
        }
    );
    let _ = writeln!(
        s,
        "precision auto   {}",
        if cpu.has_bf16_units() {
            "bf16 (the CPU has bf16 units)"
        } else {
            "fp32 (no AMX-BF16 or AVX512-BF16 on this CPU)"
        }
    );
    s
}
