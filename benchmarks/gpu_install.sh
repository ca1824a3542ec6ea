# Source on the device, after the carries (benchmarks/gpu.py): joins split wheels, installs
# every wheel of /root/stash into /tmp/site (no index: the device has no network) and puts
# it and this checkout on PYTHONPATH. Records the seconds it took in INSTALL_S.
t0=$(date +%s.%N)
cd /root/stash && for first in *.part0; do
  [ -e "$first" ] || continue
  base=${first%.part0}; cat $(ls "$base".part* | sort -t t -k2 -n) > "$base" && rm "$base".part*
done; cd - >/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stash/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD
export INSTALL_S=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
