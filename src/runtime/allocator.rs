//! The memory allocator under libtorch. Training frees and re-allocates hundreds of MB of
//! activations every step; glibc's malloc hands blocks that large back to the kernel on free,
//! so every step pays page faults again (measured: 0.6 s of a 5.7 s DistilBERT step). tcmalloc
//! keeps them, with a lower peak than glibc tuned to keep them (docs/benchmarks.md). libtorch
//! allocates through the C allocator, so the choice must be made before the process starts: we
//! re-execute ourselves once with the library in `LD_PRELOAD`, as users of PyTorch on CPU do by
//! hand. The binary does so before libtorch's initialisers run (main.rs, `.preinit_array`), so
//! libtorch initialises once; `main` re-executes only where that early look could not decide.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use crate::config::Allocator;

/// Set in the re-executed process, so that it never re-executes again.
const REEXEC_MARK: &str = "SPRTRAIN_ALLOCATOR";

/// Shared-library names of each allocator, most specific first.
fn library_names(choice: Allocator) -> &'static [&'static str] {
    match choice {
        Allocator::Auto | Allocator::Tcmalloc => &["libtcmalloc_minimal.so.4", "libtcmalloc.so.4"],
        Allocator::Jemalloc => &["libjemalloc.so.2"],
        Allocator::System => &[],
    }
}

/// The first of `names` found in LD_LIBRARY_PATH or the system library directories.
fn find_library(names: &[&str]) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/local/lib",
            "/usr/local/lib64",
        ]
        .map(PathBuf::from),
    );
    names
        .iter()
        .flat_map(|name| dirs.iter().map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// A malloc replacement the user already preloads, if any.
fn preloaded_by_user() -> Option<String> {
    std::env::var("LD_PRELOAD")
        .ok()?
        .split([':', ' '])
        .find(|lib| {
            lib.contains("tcmalloc") || lib.contains("jemalloc") || lib.contains("mimalloc")
        })
        .map(str::to_string)
}

/// The allocator this process runs with: the preloaded library's path, or "system".
pub fn in_use() -> String {
    std::env::var(REEXEC_MARK)
        .ok()
        .or_else(preloaded_by_user)
        .unwrap_or_else(|| "system".into())
}

/// Whether this process already runs under a chosen allocator: re-executed by us, or under
/// one the user preloads.
pub fn already_chosen() -> bool {
    std::env::var_os(REEXEC_MARK).is_some() || preloaded_by_user().is_some()
}

/// Re-executes this program with `choice` preloaded, unless it already runs under it (or
/// under one the user preloads), or it is `system`, or (for `auto`) no tcmalloc is installed.
/// Returns only when no re-execution happens; an allocator asked for by name but not found is
/// a warning, not an error.
pub fn reexec_with(choice: Allocator) -> anyhow::Result<()> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    reexec_with_args(choice, &args)
}

/// `reexec_with` for a process whose arguments (`args[0]` the program) are given: before
/// `main` (see `sprtrain`'s early re-execution) the standard library does not know them yet.
pub fn reexec_with_args(choice: Allocator, args: &[std::ffi::OsString]) -> anyhow::Result<()> {
    if choice == Allocator::System || already_chosen() {
        return Ok(());
    }
    let Some(lib) = find_library(library_names(choice)) else {
        if choice != Allocator::Auto {
            tracing::warn!(
                "runtime.allocator = {choice:?}: none of {:?} found; using the system allocator",
                library_names(choice)
            );
        }
        return Ok(());
    };
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", lib.display()),
        _ => lib.display().to_string(),
    };
    let exe = std::env::current_exe()?;
    let err = std::process::Command::new(&exe)
        .args(args.iter().skip(1))
        .env("LD_PRELOAD", &preload)
        .env(REEXEC_MARK, lib.as_os_str())
        .exec();
    // exec returns only on failure: carry on with the system allocator.
    tracing::warn!(
        "could not re-execute {} with {} preloaded ({err}); using the system allocator",
        exe.display(),
        lib.display()
    );
    Ok(())
}

/// Hands the memory the allocator keeps free back to the kernel: tcmalloc's
/// `MallocExtension_ReleaseFreeMemory` where tcmalloc is preloaded, else glibc's `malloc_trim`.
/// Called once the model has moved into its flat buffer: tcmalloc would otherwise keep the
/// parameters' first home (the model's size: 4.4 GB for a 1.1B model) for good.
pub fn release_free_memory() {
    // SAFETY: a lookup of a C function by name in the loaded libraries; called only with the
    // signature tcmalloc's C API gives it (no arguments, no result).
    unsafe {
        let name = c"MallocExtension_ReleaseFreeMemory";
        let release = libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr());
        if !release.is_null() {
            let release: extern "C" fn() = std::mem::transmute(release);
            release();
            return;
        }
        libc::malloc_trim(0);
    }
}
