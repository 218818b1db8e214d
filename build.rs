//! Compiles the seeded dropout/attention kernels (src/models/seeded.cpp), the linear layers that
//! accumulate their weight gradients in place (src/models/linear_grad.cpp), the optimizer's
//! buffer helpers (src/optim_buffers.cpp) and the operator profiler's bridge
//! (src/train/profile.cpp) against libtorch,
//! embeds an rpath to libtorch's lib directory so the binary runs without LD_LIBRARY_PATH and
//! without an activated venv, and records the libtorch version for `sprtrain env`.
use std::path::PathBuf;

fn main() {
    // torch-sys (links = "tch") tells its dependents where it found libtorch, whether from
    // LIBTORCH or from Python (LIBTORCH_USE_PYTORCH).
    let lib_dir = std::env::var_os("DEP_TCH_LIBTORCH_LIB")
        .map(PathBuf::from)
        .expect("torch-sys did not report libtorch's lib directory (DEP_TCH_LIBTORCH_LIB)");
    let lib_dir = lib_dir.canonicalize().unwrap_or(lib_dir);
    let root = lib_dir.parent().map(PathBuf::from).unwrap_or_default();
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());

    println!("cargo:rerun-if-changed=src/models/seeded.cpp");
    println!("cargo:rerun-if-changed=src/models/linear_grad.cpp");
    println!("cargo:rerun-if-changed=src/models/ffi.h");
    println!("cargo:rerun-if-changed=src/models/gemm.h");
    println!("cargo:rerun-if-changed=src/optim_buffers.cpp");
    println!("cargo:rerun-if-changed=src/train/profile.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .opt_level(3)
        // libtorch's headers as system headers: their own warnings are not ours.
        .flag("-isystem")
        .flag(root.join("include").display().to_string())
        .flag("-isystem")
        .flag(
            root.join("include/torch/csrc/api/include")
                .display()
                .to_string(),
        )
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag_if_supported("-Wno-unused-parameter")
        // seeded.cpp's 64-byte float vectors live only in inlined helpers: no call passes one.
        .flag_if_supported("-Wno-psabi")
        // at::parallel_for is a header template: without OpenMP it compiles to a serial loop,
        // and the kernels' loops over pairs and mask chunks ran on one thread.
        .flag("-fopenmp")
        .file("src/models/seeded.cpp")
        .file("src/models/linear_grad.cpp")
        .file("src/optim_buffers.cpp")
        .file("src/train/profile.cpp")
        .compile("sprtrain_seeded");
    // libgomp.so.1, the soname libtorch's own copy has: the binary's rpath finds that one, so
    // one OpenMP runtime (one thread pool, set by at::set_num_threads) serves both.
    println!("cargo:rustc-link-lib=dylib=gomp");

    // PyPI wheels carry version.py; standalone libtorch zips carry build-version.
    let version = std::fs::read_to_string(root.join("version.py"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("__version__ = ")
                    .map(|v| v.trim_matches(['\'', '"']).to_string())
            })
        })
        .or_else(|| {
            std::fs::read_to_string(root.join("build-version"))
                .ok()
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SPRTRAIN_LIBTORCH_VERSION={version}");
}
