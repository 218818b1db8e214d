//! Embeds an rpath to libtorch's lib directory so the binary runs without LD_LIBRARY_PATH
//! and without an activated venv, and records the libtorch version for `sprtrain env`.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Some(libtorch) = std::env::var_os("LIBTORCH") else {
        // LIBTORCH_USE_PYTORCH builds: torch-sys finds the library through Python; the loader
        // then needs LD_LIBRARY_PATH, which the README's commands do not use.
        println!("cargo:warning=LIBTORCH is not set: no rpath embedded for libtorch");
        println!("cargo:rustc-env=SPRTRAIN_LIBTORCH_VERSION=unknown");
        return;
    };
    let root = PathBuf::from(libtorch);
    let root = root.canonicalize().unwrap_or(root);
    println!(
        "cargo:rustc-link-arg=-Wl,-rpath,{}",
        root.join("lib").display()
    );
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
