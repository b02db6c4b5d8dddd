# Source on the GPU machine (bash), once build/deps/deepspeed from test/gpu/deepspeed_deps.sh is
# there: installs DeepSpeed into build/deps/ds_site (once; no registry needed) and sets what its
# just-in-time ops need. Source it after building horovod_zero: it sets TORCH_CUDA_ARCH_LIST=9.0
# (DeepSpeed's op builder cannot parse the machine's 9.0a) and CFLAGS/LDFLAGS for libaio.
# DS_DEPS, DS_SITE, PYTHON and TORCH_EXTENSIONS_DIR override the defaults.
_hvdz_ds_setup() {
  local root deps site py tag wheels=() w name mod
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  deps=${DS_DEPS:-$root/build/deps/deepspeed}
  site=${DS_SITE:-$root/build/deps/ds_site}
  py=${PYTHON:-python3}
  if [ ! -f "$deps/VERSION" ]; then
    echo "deepspeed_env: no $deps/VERSION; run 'bash test/gpu/deepspeed_deps.sh' on a developer machine" \
         "and carry build/deps/deepspeed" >&2
    return 1
  fi
  # The binary wheels were downloaded for one Python; a mismatch fails at import with an obscure error.
  tag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  if ! ls "$deps"/wheels/pydantic_core-*-"$tag"-*.whl > /dev/null 2>&1; then
    echo "deepspeed_env: the wheels in $deps/wheels are not for this Python ($tag);" \
         "rerun deepspeed_deps.sh with PYVER=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" >&2
    return 1
  fi
  if [ ! -f "$site/.installed" ] || ! cmp -s "$deps/VERSION" "$site/.installed"; then
    for w in "$deps"/wheels/*.whl; do
      name=$(basename "$w"); name=${name%%-*}
      # What the machine's own environment already has stays its own (one numpy, one packaging).
      case $name in
        einops|tqdm|psutil|packaging|numpy) mod=$name ;;
        *) mod= ;;
      esac
      if [ -n "$mod" ] && "$py" -c "import $mod" 2> /dev/null; then continue; fi
      wheels+=("$w")
    done
    rm -rf "$site"
    "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" "${wheels[@]}" || return 1
    cp "$deps/VERSION" "$site/.installed"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$site/bin:$PATH"
  export DS_SKIP_CUDA_CHECK=1 DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0
  local aio=$deps/libaio
  export CPATH="$aio/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # async_io's compatibility probe compiles a test program with CFLAGS/LDFLAGS only.
  export CFLAGS="-I$aio/include${CFLAGS:+ $CFLAGS}" LDFLAGS="-L$aio/lib${LDFLAGS:+ $LDFLAGS}"
  # JIT-built ops land here: under build/, so a warm machine reuses them between calls.
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/build/torch_extensions}
  mkdir -p "$TORCH_EXTENSIONS_DIR"
  "$py" -c 'import numpy' 2> /dev/null \
    || echo "deepspeed_env: warning: numpy is missing here; rerun deepspeed_deps.sh with WITH_NUMPY=1" >&2
  echo "deepspeed_env: $(cat "$deps/VERSION") from $site; ops build in $TORCH_EXTENSIONS_DIR"
}
_hvdz_ds_setup
