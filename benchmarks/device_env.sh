# Sourced by the device scripts (from the repository root): the wheels carried in .whl/ (diffusers;
# the device has torch, triton, transformers, accelerate and safetensors) go to /tmp/site, and
# src/ goes first on PYTHONPATH. Creates $OUT (default ./out).
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
