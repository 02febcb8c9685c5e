#!/usr/bin/env bash
# Builds the carry bundle for a GPU run on a lent, offline machine (see bench/gpu_offline.sh):
#
#   bash bench/gpu_bundle.sh [BUNDLE_DIR]    # default .devrun in the repo root (or GPU_BUNDLE_DIR)
#
# Then, on the device, from the repo root (the run tool with carry [".devrun"], timeout_s 600):
#
#   bash .devrun/go.sh                       # E2E_ONLY=1 / QUICK=1 / RATES=... pass through
#
# The bundle (about 20 MB; the device's carry allows 64 MiB):
#   wheels/     cp312 manylinux x86_64 wheels (pip download, no deps) of msgspec, structlog,
#               websockets, redis and gguf, at the versions installed in .venv;
#   bin/        this machine's redis-server (`command -v redis-server`);
#   lib/        its liblzf and libjemalloc (safe on LD_LIBRARY_PATH);
#   lib/extra/  the other libraries ldd lists for it, less glibc's own (libc, libm, libpthread,
#               libdl, librt, ld-linux): used only through a redis-server wrapper, if needed;
#   model/      SmolLM2-135M-Instruct's config and tokenizer files, no weights (the run fills
#               a copy with random ones), from the prepared model folder
#               ${ORCAPOD_CACHE_DIR:-~/.cache/orcapod}/models/SmolLM2-135M-Instruct
#               (`.venv/bin/python -m orcapod model prepare` makes it);
#   go.sh       a two-line stub that runs bench/gpu_offline.sh on the bundle (one copy of
#               the logic: the script in bench/).
# A bundle inside the repo is added to .git/info/exclude (`/.devrun/`) if it is not there yet.
#
# Needs: .venv (or VENV_PY=python) with those packages and pip, pip's index reachable,
# redis-server and ldd on PATH, the prepared model folder. Everything it (re)writes in
# BUNDLE_DIR is listed above; nothing else there is touched.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || exit 1
BUNDLE=${1:-${GPU_BUNDLE_DIR:-$REPO/.devrun}}
VENV_PY=${VENV_PY:-$REPO/.venv/bin/python}
MODEL_SRC=${ORCAPOD_CACHE_DIR:-$HOME/.cache/orcapod}/models/SmolLM2-135M-Instruct
PACKAGES=(msgspec structlog websockets redis gguf)
# The model folder's config and tokenizer (everything in it but model.safetensors and
# orcapod-prepared.json).
MODEL_FILES=(config.json generation_config.json special_tokens_map.json tokenizer.json
    tokenizer_config.json)
# glibc's own libraries: the device has them (and must use its own).
GLIBC_RE='^(libc|libm|libpthread|libdl|librt|ld-linux[^.]*)\.so'

die() { echo "gpu_bundle.sh: $*" >&2; exit 1; }

command -v ldd >/dev/null || die "ldd not found"
REDIS=$(command -v redis-server) || die "redis-server not found on PATH"
[[ -x "$VENV_PY" ]] || die "$VENV_PY not found (set VENV_PY)"
for f in "${MODEL_FILES[@]}"; do
    [[ -f "$MODEL_SRC/$f" ]] || die "$MODEL_SRC/$f missing (prepare the model:" \
        "'$VENV_PY -m orcapod model prepare')"
done

mkdir -p "$BUNDLE" || die "cannot create $BUNDLE"
BUNDLE=$(cd "$BUNDLE" && pwd) || exit 1
[[ "$BUNDLE" != "$REPO" && "$BUNDLE" != / ]] || die "refusing to build into $BUNDLE"
echo "bundle: $BUNDLE"

echo "== wheels (cp312, manylinux x86_64) =="
specs=()
for p in "${PACKAGES[@]}"; do
    v=$("$VENV_PY" -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$p") \
        || die "$p is not installed in $VENV_PY"
    specs+=("$p==$v")
done
echo "${specs[*]}"
# Into a fresh folder first: a failed download leaves the old wheels/ as it was.
tmp_wheels=$(mktemp -d "$BUNDLE/.wheels.XXXXXX") || exit 1
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
        manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
if ! "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 "${platforms[@]}" -d "$tmp_wheels" "${specs[@]}"; then
    rm -rf "$tmp_wheels"
    die "pip download failed"
fi
rm -rf "${BUNDLE:?}/wheels"
mv "$tmp_wheels" "$BUNDLE/wheels" || die "cannot write $BUNDLE/wheels"
chmod 755 "$BUNDLE/wheels"  # mktemp made it 700
ls "$BUNDLE/wheels"

echo "== redis-server ($REDIS) and its libraries =="
rm -rf "${BUNDLE:?}/bin" "${BUNDLE:?}/lib"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib/extra"
cp -L "$REDIS" "$BUNDLE/bin/redis-server" || die "cannot copy $REDIS"
chmod 755 "$BUNDLE/bin/redis-server"
# ldd lines: "libfoo.so.1 => /path/libfoo.so.1 (0x...)"; vdso and ld-linux have no "=> /path".
while read -r name arrow path _; do
    [[ "$arrow" == "=>" && "$path" == /* ]] || continue
    if [[ "$name" =~ $GLIBC_RE ]]; then
        continue
    elif [[ "$name" == liblzf.so* || "$name" == libjemalloc.so* ]]; then
        dest="$BUNDLE/lib/$name"
    else
        dest="$BUNDLE/lib/extra/$name"
    fi
    cp -L "$path" "$dest" || die "cannot copy $path"
    chmod 644 "$dest"
    echo "${dest#"$BUNDLE"/}"
done < <(ldd "$REDIS")
[[ -n "$(ls "$BUNDLE/lib")" ]] || die "ldd listed no libraries for $REDIS"
"$BUNDLE/bin/redis-server" --version || die "the copied redis-server does not run here"

echo "== model: config and tokenizer ($MODEL_SRC) =="
rm -rf "${BUNDLE:?}/model"
mkdir -p "$BUNDLE/model"
for f in "${MODEL_FILES[@]}"; do
    cp "$MODEL_SRC/$f" "$BUNDLE/model/$f" || die "cannot copy $MODEL_SRC/$f"
done
ls "$BUNDLE/model"

echo "== go.sh (runs bench/gpu_offline.sh) =="
cat >"$BUNDLE/go.sh" <<'EOF'
#!/usr/bin/env bash
# Made by bench/gpu_bundle.sh. From the orcapod repo root: bash .devrun/go.sh
# (E2E_ONLY=1 / QUICK=1 / RATES=... pass through). The logic is bench/gpu_offline.sh.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) || exit 1
for repo in "$PWD" "$here/.."; do
    [[ -f "$repo/bench/gpu_offline.sh" ]] && exec bash "$repo/bench/gpu_offline.sh" "$here" "$@"
done
echo "go.sh: bench/gpu_offline.sh not found: run it from the orcapod repo root" >&2
exit 1
EOF

# Keep a bundle inside the repo out of git (and so carried as an ignored path).
case "$BUNDLE/" in
    "$REPO"/*)
        rel=${BUNDLE#"$REPO"}
        if exclude=$(git -C "$REPO" rev-parse --git-path info/exclude 2>/dev/null); then
            [[ "$exclude" == /* ]] || exclude="$REPO/$exclude"
            if ! grep -qxF "$rel/" "$exclude" 2>/dev/null; then
                mkdir -p "$(dirname "$exclude")" && echo "$rel/" >>"$exclude" \
                    && echo "added $rel/ to $exclude"
            fi
        fi
        ;;
esac

echo "== done =="
du -sh "$BUNDLE"
size_kib=$(du -sk "$BUNDLE" | cut -f1)
((size_kib < 64 * 1024)) || echo "WARNING: over the device's 64 MiB carry limit"
case "$BUNDLE/" in
    "$REPO"/*)
        rel=${BUNDLE#"$REPO"/}
        echo "On the device (run tool, carry [\"$rel\"], timeout_s 600), from the repo root:"
        echo "  bash $rel/go.sh"
        echo "  E2E_ONLY=1 bash $rel/go.sh    # only the end-to-end part"
        ;;
    *)
        echo "Not inside the repo: the device's carry takes only paths in the repo. Here:"
        echo "  bash bench/gpu_offline.sh $BUNDLE"
        ;;
esac
