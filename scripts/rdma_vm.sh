#!/usr/bin/env bash
# Run a command inside a soft-RoCE (rdma_rxe) QEMU guest, for hosts whose kernel has no RDMA.
#
#   scripts/rdma_vm.sh [options] -- CMD [ARG...]
#   scripts/rdma_vm.sh -- .venv/bin/python -m pytest -m rdma_vm tests/transport -x
#
# The guest boots Debian's stock kernel (downloaded once with `apt-get download`, cached under the
# work dir) under QEMU TCG, loads rdma_rxe, creates `rxe0` on a veth with 10.99.0.1/24 (GID index 1
# is then the RoCE v2 IPv4-mapped GID), mounts the host's `/` read-only over 9p and chroots into
# it, so it runs the host's binaries and this checkout's .venv. The checkout is mounted read-only
# at its host path; /tmp, /run and /var/tmp are tmpfs. CMD runs as root with the checkout as its
# working directory; its output streams to stdout and its exit status is this script's exit
# status (124 when the guest command or QEMU ran out of time).
#
# Environment seen by CMD: LYNX_RDMA_DEVICE=rxe0, LYNX_RDMA_GID_INDEX=1, LYNX_RDMA_IPV4=10.99.0.1,
# LYNX_RDMA_VM=1, LYNX_VM_OUT (a writable folder copied back to --out on the host), HOME=/tmp,
# PYTHONDONTWRITEBYTECODE=1, PYTEST_ADDOPTS="-p no:cacheprovider", PY_COLORS=0,
# HYPOTHESIS_STORAGE_DIRECTORY.
#
# Options:
#   --workdir DIR   kernel/initrd cache and per-run folders (default /var/tmp/lynx-rdma-vm)
#   --timeout S     guest command deadline in seconds (default 600); QEMU gets S + 180
#   --mem MB        guest memory (default 2048)      --smp N   guest CPUs (default 2)
#   --out DIR       copy the guest's $LYNX_VM_OUT here after the run
# Needs: qemu-system-x86, busybox-static, cpio, kmod, rdma-core, iproute2 (scripts/apt-packages.txt)
# and a reachable Debian mirror the first time (the kernel package). Run as root: 9p passthrough
# reads the host root with QEMU's permissions.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=/var/tmp/lynx-rdma-vm
CMD_TIMEOUT=600
MEM=2048
SMP=2
OUT=""
die() { printf '[rdma_vm] error: %s\n' "$*" >&2; exit 2; }
log() { printf '[rdma_vm] %s\n' "$*" >&2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) WORK=$2; shift 2 ;;
    --timeout) CMD_TIMEOUT=$2; shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --smp) SMP=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (the guest command goes after --)" ;;
  esac
done
[ $# -gt 0 ] || die "no guest command given: scripts/rdma_vm.sh [options] -- CMD [ARG...]"
for v in "$CMD_TIMEOUT" "$MEM" "$SMP"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "--timeout/--mem/--smp take positive integers, got '$v'"
done
for t in qemu-system-x86_64 busybox cpio depmod modprobe apt-get dpkg-deb flock; do
  command -v "$t" >/dev/null || die "'$t' not found: run scripts/install.sh (scripts/apt-packages.txt)"
done
[ -x /usr/bin/rdma ] || die "/usr/bin/rdma (iproute2) missing on the host; the guest runs the host's"
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
T0=$(date +%s)

# ---- kernel + modules (cached per kernel version; flock so concurrent runs share one download) --
kpkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
KPKG=$(kpkg)
if [ -z "$KPKG" ]; then
  timeout 300 apt-get update -qq || true
  KPKG=$(kpkg)
fi
[ -n "$KPKG" ] || die "apt-cache knows no linux-image-amd64 dependency (apt sources?)"
KVER=${KPKG#linux-image-}
KDIR=$WORK/kernel-$KVER
exec 9>"$WORK/.lock"
flock -w 600 9 || die "timed out waiting for $WORK/.lock (another run building the kernel cache?)"
if [ ! -f "$KDIR/ready" ]; then
  log "fetching $KPKG (first run; cached in $KDIR)"
  rm -rf "$KDIR"; mkdir -p "$KDIR"; chmod 777 "$KDIR"  # apt's _apt sandbox user writes here
  if ! (cd "$KDIR" && timeout 300 apt-get download -q "$KPKG" >/dev/null 2>&1); then
    timeout 300 apt-get update -qq || true
    (cd "$KDIR" && timeout 300 apt-get download -q "$KPKG") || die "apt-get download $KPKG failed"
  fi
  timeout 300 dpkg-deb -x "$KDIR"/"$KPKG"_*.deb "$KDIR/kx"
  depmod -b "$KDIR/kx" "$KVER"
  cp "$KDIR/kx/boot/vmlinuz-$KVER" "$KDIR/vmlinuz"
  rm -f "$KDIR"/*.deb
  touch "$KDIR/ready"
fi

# ---- initrd: busybox + the modules rxe and 9p need; rebuilt when this script changes -----------
# crc32_generic/crc32_pclmul: rdma_rxe computes ICRCs with crc32 and fails to load without them.
MODS="crc32_generic crc32_pclmul virtio_pci 9pnet_virtio 9p veth rdma_rxe ib_uverbs rdma_ucm"
IHASH=$(sha256sum "$0" | cut -c1-16)
INITRD=$KDIR/initrd-$IHASH.gz
if [ ! -f "$INITRD" ]; then
  log "building initrd for $KVER"
  IR=$(mktemp -d "$WORK/initrd.XXXXXX")
  mkdir -p "$IR"/{bin,proc,sys,dev,mnt}
  cp "$(command -v busybox)" "$IR/bin/busybox"
  for m in $MODS; do modprobe -d "$KDIR/kx" -S "$KVER" --show-depends "$m" | awk '/^insmod/{print $2}'; done |
    sort -u | while read -r f; do
      r=${f#"$KDIR"/kx/}; mkdir -p "$IR/$(dirname "$r")"; cp "$f" "$IR/$r"
    done
  touch "$IR/lib/modules/$KVER"/modules.{order,builtin,builtin.modinfo}
  depmod -b "$IR" "$KVER"
  # The init script is fixed; everything run-specific lives in the per-run "work" share.
  cat > "$IR/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
echo /bin/modprobe > /proc/sys/kernel/modprobe
for m in $MODS; do modprobe \$m || echo "[guest] modprobe \$m FAILED"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /mnt || { echo "[guest] no hostroot"; poweroff -f; }
for d in proc sys dev; do mount --bind /\$d /mnt/\$d; done
for d in tmp run var/tmp dev/shm; do mkdir -p /mnt/\$d 2>/dev/null; mount -t tmpfs tmpfs /mnt/\$d; done
mkdir -p /mnt/tmp/work
mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=524288 work /mnt/tmp/work || { echo "[guest] no work share"; poweroff -f; }
P=\$(cat /mnt/tmp/work/project_root)
mkdir -p /mnt\$P 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose project /mnt\$P || { echo "[guest] no project share"; poweroff -f; }
echo "[guest] root ready at \$(cut -d' ' -f1 /proc/uptime)s"
chroot /mnt /bin/bash /tmp/work/guest.sh
echo \$? > /mnt/tmp/work/rc
sync; poweroff -f
EOF
  chmod +x "$IR/init"
  (cd "$IR" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$INITRD.tmp") && mv "$INITRD.tmp" "$INITRD"
  find "$KDIR" -maxdepth 1 -name 'initrd-*.gz' ! -name "${INITRD##*/}" -delete
  rm -rf "$IR"
fi
flock -u 9

# ---- per-run share: the guest script, the command, the exit status and LYNX_VM_OUT ------------
RUN=$(mktemp -d "$WORK/run.XXXXXX")
trap 'rm -rf "$RUN"' EXIT
mkdir -p "$RUN/out"
printf '%s\n' "$ROOT" > "$RUN/project_root"
{
  echo '#!/bin/bash'
  echo 'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
  echo 'set -u; ulimit -l unlimited'
  echo 'step() { timeout 60 "$@" || { echo "[guest] setup step failed: $*"; exit 3; }; }'
  echo 'step ip link set lo up'
  echo 'step ip link add veth0 type veth peer name veth1'
  echo 'step ip addr add 10.99.0.1/24 dev veth0'
  echo 'step ip link set veth0 up; step ip link set veth1 up'
  echo 'step rdma link add rxe0 type rxe netdev veth0'
  # GID 1 (IPv4-mapped) appears asynchronously after the address is assigned.
  echo 'for i in $(seq 50); do [ -s /sys/class/infiniband/rxe0/ports/1/gids/1 ] &&'
  echo '  ! grep -q "^0000:0000:0000:0000:0000:0000:0000:0000$" /sys/class/infiniband/rxe0/ports/1/gids/1 && break; sleep 0.2; done'
  echo 'echo "[guest] rxe0 gid1 $(cat /sys/class/infiniband/rxe0/ports/1/gids/1)"'
  echo 'export HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTEST_ADDOPTS="-p no:cacheprovider" PY_COLORS=0'
  echo 'export HYPOTHESIS_STORAGE_DIRECTORY=/tmp/hypothesis XDG_CACHE_HOME=/tmp/.cache'
  echo 'export LYNX_RDMA_DEVICE=rxe0 LYNX_RDMA_GID_INDEX=1 LYNX_RDMA_IPV4=10.99.0.1'
  echo 'export LYNX_RDMA_VM=1 LYNX_VM_OUT=/tmp/work/out'
  printf 'cd %q || exit 3\n' "$ROOT"
  printf 'echo %q\n' "[guest] running:$(printf ' %q' "$@")"
  printf 'exec timeout -k 10 %s' "$CMD_TIMEOUT"
  printf ' %q' "$@"
  printf ' </dev/null 2>&1\n'
} > "$RUN/guest.sh"

T1=$(date +%s)
log "kernel $KVER; booting QEMU (TCG, ${SMP} CPUs, ${MEM} MiB); guest command deadline ${CMD_TIMEOUT}s"
QEMU_RC=0
# The serial console carries the guest command's output. sed -u (line by line, so CI logs stream)
# undoes ONLCR's \r and drops the firmware's terminal escape sequences.
timeout -k 10 $((CMD_TIMEOUT + 180)) qemu-system-x86_64 -accel tcg,thread=multi -cpu max \
  -m "$MEM" -smp "$SMP" -nographic -no-reboot -nic none \
  -kernel "$KDIR/vmlinuz" -initrd "$INITRD" \
  -append "console=ttyS0 rdinit=/init panic=-1 quiet loglevel=3" \
  -fsdev local,id=r,path=/,security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=r,mount_tag=hostroot \
  -fsdev local,id=p,path="$ROOT",security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=p,mount_tag=project \
  -fsdev local,id=w,path="$RUN",security_model=none \
  -device virtio-9p-pci,fsdev=w,mount_tag=work </dev/null 2>&1 |
  sed -u -e 's/\r//g' -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1bc//g' || QEMU_RC=$?
T2=$(date +%s)
[ -z "$OUT" ] || { mkdir -p "$OUT" && cp -a "$RUN/out/." "$OUT/"; }
log "times: prepare=$((T1 - T0))s qemu=$((T2 - T1))s total=$((T2 - T0))s"
if [ -s "$RUN/rc" ]; then
  RC=$(cat "$RUN/rc")
  log "guest command exit status $RC"
  exit "$RC"
fi
if [ "$QEMU_RC" = 124 ] || [ "$QEMU_RC" = 137 ]; then
  log "QEMU killed after $((CMD_TIMEOUT + 180))s without a guest exit status"
  exit 124
fi
log "guest ended without an exit status (QEMU status $QEMU_RC); see the console output above"
exit 1
