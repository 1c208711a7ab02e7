#!/usr/bin/env bash
# Can O_DIRECT disk I/O overlap with compute on this VM? dd alone vs dd while both cores run matmuls.
set -u
F=${1:-/tmp}/io_probe.bin  # a directory on the disk to probe (4 GiB written, then removed)
dd if=/dev/zero of=$F bs=16M count=256 oflag=direct status=none
burn() { python - <<'PY' &
import torch, time
torch.set_num_threads(1)
a = torch.randn(1024, 1024); t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < 20:
    a @ a; n += 1
print(f"burner: {n / (time.perf_counter() - t0):.1f} matmuls/s")
PY
}
echo "== read alone"; dd if=$F of=/dev/null bs=16M iflag=direct 2>&1 | tail -1
echo "== write alone"; dd if=/dev/zero of=$F bs=16M count=256 oflag=direct 2>&1 | tail -1
echo "== burners alone (10 s)"; python -c "
import torch, time
torch.set_num_threads(1); a = torch.randn(1024, 1024); t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < 10: a @ a; n += 1
print(f'single burner alone: {n / (time.perf_counter() - t0):.1f} matmuls/s')"
echo "== read + 2 burners"; burn; burn; sleep 2
dd if=$F of=/dev/null bs=16M iflag=direct 2>&1 | tail -1
dd if=/dev/zero of=$F bs=16M count=256 oflag=direct 2>&1 | tail -1
/usr/bin/time -f "dd read: user %U s sys %S s wall %e s" dd if=$F of=/dev/null bs=16M iflag=direct status=none
wait
rm -f $F
