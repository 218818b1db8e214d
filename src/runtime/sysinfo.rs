//! What the machine offers for training: CPU features (which decide `precision = "auto"` and
//! the fp32 kernels), the process's age and peak memory, the libtorch build, the host name.

/// CPU features that decide the training precision and kernels.
#[derive(Debug, Clone, Default)]
pub struct CpuInfo {
    pub model: String,
    /// `vendor_id`: "GenuineIntel", "AuthenticAMD", ...
    pub vendor: String,
    pub avx2: bool,
    pub avx512f: bool,
    pub avx512_bf16: bool,
    pub amx_bf16: bool,
    pub amx_tile: bool,
    /// AVX-512 BW, VL and DQ together: what oneDNN's fp32 matmul needs in libtorch.
    pub avx512_bw_vl_dq: bool,
}

impl CpuInfo {
    /// Parses /proc/cpuinfo text (the first processor's model name and flags).
    pub fn parse(cpuinfo: &str) -> Self {
        let value = |key: &str| {
            cpuinfo
                .lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(key))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        let flags = value("flags");
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        CpuInfo {
            model: value("model name"),
            vendor: value("vendor_id"),
            avx2: has("avx2"),
            avx512f: has("avx512f"),
            avx512_bf16: has("avx512_bf16"),
            amx_bf16: has("amx_bf16"),
            amx_tile: has("amx_tile"),
            avx512_bw_vl_dq: has("avx512bw") && has("avx512vl") && has("avx512dq"),
        }
    }

    pub fn detect() -> Self {
        std::fs::read_to_string("/proc/cpuinfo")
            .map(|s| Self::parse(&s))
            .unwrap_or_default()
    }

    /// bf16 pays off only with bf16 units (AMX or AVX512-BF16); elsewhere it is emulated and slow.
    pub fn has_bf16_units(&self) -> bool {
        self.amx_bf16 || self.avx512_bf16
    }

    /// Whether fp32 products run faster through oneDNN than through libtorch's BLAS (MKL): on
    /// AMD CPUs with AVX-512, where MKL takes its generic AVX2 path and oneDNN its AVX-512
    /// kernels (5-15% faster at the bench models' shapes on a Zen 4 EPYC; docs/benchmarks.md,
    /// round 11). On Intel CPUs MKL runs its own AVX-512 kernels: on a Xeon with AMX a
    /// DistilBERT step took 2.55 s with MKL's layers against 3.35 with oneDNN's (round 13).
    pub fn prefers_onednn_fp32(&self) -> bool {
        self.vendor == "AuthenticAMD" && self.avx512_bw_vl_dq
    }
}

/// Seconds since this process started, from /proc (clock-tick resolution, 10 ms): startup as
/// the user waits for it, dynamic loading of libtorch included.
pub fn process_age_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state);
    // field 22 is the start time in clock ticks since boot.
    let after_name = stat.rsplit_once(')')?.1;
    let start_ticks: f64 = after_name.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks_per_s > 0.0).then(|| uptime - start_ticks / ticks_per_s)
}

/// The most resident memory this process has held so far (VmHWM), in MiB.
pub fn peak_rss_mib() -> Option<f64> {
    status_kib("VmHWM:").map(|kib| kib / 1024.0)
}

/// A `/proc/self/status` line's value in KiB.
fn status_kib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub fn libtorch_version() -> &'static str {
    env!("SPRTRAIN_LIBTORCH_VERSION")
}

/// This machine's host name (the UTS namespace's, so each simulated node has its own).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sapphire_rapids_flags_select_bf16() {
        let text = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\
                    flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n";
        let cpu = CpuInfo::parse(text);
        assert_eq!(cpu.model, "Intel(R) Xeon(R) Platinum 8480+");
        assert!(cpu.avx512f && cpu.amx_tile && cpu.has_bf16_units());
    }

    #[test]
    fn avx2_only_stays_fp32() {
        let cpu = CpuInfo::parse("model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n");
        assert!(cpu.avx2 && !cpu.avx512f && !cpu.has_bf16_units());
    }
}
