#!/usr/bin/env bash
# Shaped links on one box: two network namespaces joined by a veth pair, tbf-shaped both ways.
# (Adapted from the shared netlab recipe; names are parameterised so parallel runs don't collide.)
#
#   scripts/netlab.sh up NAME            # namespaces NAME-a (10.79.0.1, sender) and NAME-b (10.79.0.2)
#   scripts/netlab.sh rate NAME RATE [fifo|prio|htb]  # RATE like 1gbit, 5gbit, 500mbit, or none
#                                        # prio: pfifo_fast (3-band strict priority by TOS) under tbf
#                                        # htb: sender side classifies by DSCP: EF (ANCHOR) -> 1:10,
#                                        #      anything else -> 1:20 (per-class byte counters)
#   scripts/netlab.sh down NAME
#
# NAME: at most 10 characters of [a-z0-9]. Needs root and iproute2 (ip, tc).
set -euo pipefail
cmd=${1:?usage: netlab.sh up|rate|down NAME ...}
N=${2:?NAME missing}
[[ $N =~ ^[a-z0-9]{1,10}$ ]] || { echo "netlab: NAME must be 1-10 chars of [a-z0-9]" >&2; exit 2; }
A=$N-a; B=$N-b; VA=$N-va; VB=$N-vb
tc_rate_bps() { local r=${1,,}; case $r in *gbit) echo $(( ${r%gbit} * 1000000000 ));;
  *mbit) echo $(( ${r%mbit} * 1000000 ));; *kbit) echo $(( ${r%kbit} * 1000 ));; *) echo "$r";; esac; }
case $cmd in
up)
  ip netns add "$A"; ip netns add "$B"
  ip link add "$VA" type veth peer name "$VB"
  ip link set "$VA" netns "$A"; ip link set "$VB" netns "$B"
  ip -n "$A" addr add 10.79.0.1/24 dev "$VA"; ip -n "$B" addr add 10.79.0.2/24 dev "$VB"
  for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
  ip -n "$A" link set "$VA" up; ip -n "$B" link set "$VB" up
  ;;
rate)
  R=${3:?RATE missing}; MODE=${4:-fifo}
  for pair in "$A $VA" "$B $VB"; do
    set -- $pair
    tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
    [ "$R" = none ] && continue
    BPS=$(tc_rate_bps "$R")
    if [ "$MODE" = htb ] && [ "$1" = "$A" ]; then
      tc -n "$1" qdisc add dev "$2" root handle 1: htb default 20
      tc -n "$1" class add dev "$2" parent 1: classid 1:1 htb rate "$R" ceil "$R" burst 256k cburst 256k
      tc -n "$1" class add dev "$2" parent 1:1 classid 1:10 htb rate $(( BPS * 9 / 10 ))bit ceil "$R" prio 0 burst 256k cburst 256k
      tc -n "$1" class add dev "$2" parent 1:1 classid 1:20 htb rate $(( BPS / 10 ))bit ceil "$R" prio 1 burst 256k cburst 256k
      # DSCP EF (TOS byte 0xb8) -> 1:10
      tc -n "$1" filter add dev "$2" parent 1: protocol ip prio 1 u32 match ip tos 0xb8 0xfc flowid 1:10
      continue
    fi
    # burst ~1 ms of data, at least 256 KiB (veth does TSO/GSO: 64 KiB super-packets)
    BURST=$(( BPS / 8 / 1000 )); [ $BURST -lt 262144 ] && BURST=262144
    # queue limit ~5 ms at rate, at least 1 MiB
    LIM=$(( BPS / 8 / 200 )); [ $LIM -lt 1048576 ] && LIM=1048576
    tc -n "$1" qdisc add dev "$2" root handle 1: tbf rate "$R" burst $BURST limit $LIM
    if [ "$MODE" = prio ]; then
      tc -n "$1" qdisc add dev "$2" parent 1:1 handle 10: pfifo_fast
    fi
  done
  ;;
down)
  ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true
  ;;
*) echo "usage: netlab.sh up|rate|down NAME ..." >&2; exit 2;;
esac
