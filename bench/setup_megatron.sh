#!/usr/bin/env bash
# The bench-only Megatron Core environment bench/megatron_step.py runs as specc's peer: never a
# dependency of specc. Installs megatron-core 0.19.2 into bench/.megatron (ignored by git) next to
# the venv's torch, numpy and packaging:
#   - its wheel declares Python >= 3.12 but its files work on 3.11: --ignore-requires-python;
#   - --no-deps: it must not pull another torch;
#   - `import megatron.core` reaches an unconditional `import triton` in the MoE paged-stash
#     kernels, which a dense GPT on the CPU never calls: that one module is replaced by a stub
#     that raises if called.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TARGET=bench/.megatron
VERSION=0.19.2
if [ -f "$TARGET/.installed-$VERSION" ]; then
    echo "bench/setup_megatron.sh: megatron-core $VERSION already in $TARGET"
    exit 0
fi
rm -rf "$TARGET.partial"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python \
    --target "$TARGET.partial" "megatron-core==$VERSION"
cat > "$TARGET.partial/megatron/core/transformer/moe/ops/paged_stash.py" <<'PY'
"""Stub written by specc's bench/setup_megatron.sh in place of the Triton MoE paged-stash kernels
(the original imports triton unconditionally; a dense GPT on the CPU never calls them)."""

GLOBAL_BLOCK_SIZE = 1024

__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]


def _needs_triton(*args, **kwargs):
    raise RuntimeError("the MoE paged stash needs triton (stubbed by specc's bench/setup_megatron.sh)")


paged_stash_copy_kernel = paged_stash_pop_kernel = _needs_triton
PY
touch "$TARGET.partial/.installed-$VERSION"
rm -rf "$TARGET"
mv "$TARGET.partial" "$TARGET"
echo "bench/setup_megatron.sh: megatron-core $VERSION installed in $TARGET"
