# Source from the project's root on the GPU machine (copied into .whl/ by gpu_wheels.sh).
W=${W:-$(mktemp -d)}; export W
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site \
  .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; return 1; }
python3 -c "import lineax" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --no-compile --target $W/site .whl/extra/*.whl >/dev/null 2>&1
# pdefit from the wheel built from this checkout; the checkout's own pdefit/ must not shadow
# it (PYTHONSAFEPATH keeps the working directory off sys.path). benchmarks/ for its scripts'
# imports of each other.
export PYTHONSAFEPATH=1 PYTHONPATH=$W/site:$PWD/benchmarks PATH=$W/site/bin:$PATH
python3 -c "import jax, lineax, zarr, hydra, scipy, yaml, pdefit; print('jax', jax.__version__, jax.devices(), 'zarr', zarr.__version__)" \
  || { echo "imports failed"; return 1; }
