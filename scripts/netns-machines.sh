#!/usr/bin/env bash
# Several "machines" on this one host, for multi-machine runs without a cluster: each machine is its own Linux
# network namespace (its own network stack, 10.77.0.1, 10.77.0.2, …), its own /dev/shm (a tmpfs of its own) and
# its own hostname, and all of them hang off a bridge (a switch in a namespace of its own) through one veth pair
# each, whose two ends are rate-limited with tc's token bucket (`tbf`): a full-duplex link of --rate per machine.
# There is no added delay: `netem` does not work on this project's VM kernel, so the link is a rate limit only.
#
# Why the separate /dev/shm: ddp-core's CPU backend decides that a group's ranks share a machine when they can all
# map one shared-memory segment (rank 0 creates /dev/shm/accel-rs-<pid>-<random> with a random nonce, every other
# rank opens it and checks the nonce; crates/ddp-core/src/cpu/shm.rs). Network namespaces alone share the host's
# /dev/shm, so ranks on two simulated machines would still talk through shared memory and nothing would cross
# the link. Here ranks of one machine see one /dev/shm (shared memory between them), ranks of different machines
# see different ones (TCP through the veth, at --rate). The backend never looks at the hostname; each machine gets
# its own anyway (UTS namespace, `accel-m0`, …, listed in each machine's /etc/hosts) as a real cluster would.
# Machines share everything else: the CPUs, the file system, the PID space, the cgroup hierarchies (mounted again
# inside each machine, where `ip netns exec`'s own /sys hides them, so a memory cgroup can cap a rank there too).
#
#   scripts/netns-machines.sh up [--machines N (default 2)] [--rate RATE (default 100mbit)] [--port P (default 29500)]
#   scripts/netns-machines.sh exec I COMMAND [ARGS...]      # COMMAND inside machine I (0-based), in the caller's
#                                                           # directory, with the caller's environment
#   scripts/netns-machines.sh launch I -- [accel launch flags] PROGRAM [ARGS...]
#                  # `accel launch` on machine I, with --num_machines, --machine_rank, --main_process_ip (machine
#                  # 0's address) and --main_process_port filled in; run it once per machine, machine 0 hosts the
#                  # rendezvous store; ACCEL_RUN_TOKEN is set to the token `up` drew unless already set
#   scripts/netns-machines.sh status                        # machines, addresses, bytes sent/received per link
#   scripts/netns-machines.sh down                          # tears everything down (idempotent; stops what still
#                                                           # runs inside the machines)
#   scripts/netns-machines.sh check [--rate RATE]           # the CI test (below)
#
# RATE is a number and tc's unit: bit, kbit, mbit, gbit (e.g. 200mbit, 1gbit). Needs root, iproute2 (`ip netns`,
# `tc`) and util-linux (`unshare`, `flock`). The binaries come from ${CARGO_TARGET_DIR:-target}/debug (override
# with ACCEL_BIN=path/to/accel for `launch`); `check` builds them (under `flock ${ACCEL_BUILD_LOCK:-/tmp/accel-build.lock}`,
# for machines where several checkouts share one target directory). ACCEL_NETNS_PREFIX (default `accel`) names the
# namespaces (`accel-m0`, …, `accel-sw`), so two clusters can coexist; `check` uses its own (`accel-check`) and
# leaves a cluster that is up alone; ACCEL_NETNS_BUILD=0 makes it use the binaries already built. State lives in
# /run/accel-netns/PREFIX.
#
# A benchmark across 2 simulated machines on a 100 Mbit/s link (4 processes in all, dp2 × tp2, tp inside machines),
# from the repository root (the machines share this host's cores: the link is what is simulated, not the CPUs):
#
#   cargo build -p accel-examples --bin accel_gpt -p accel-cli --bin accel
#   scripts/netns-machines.sh up --machines 2 --rate 100mbit
#   for i in 0 1; do
#       scripts/netns-machines.sh launch "$i" -- --num_processes 4 --parallelism_config_dp_replicate_size 2 \
#           --parallelism_config_tp_size 2 "${CARGO_TARGET_DIR:-target}/debug/accel_gpt" --steps 20 --sample-len 0 \
#           >"machine$i.log" 2>&1 &
#   done
#   wait
#   scripts/netns-machines.sh status    # bytes that crossed each link
#   scripts/netns-machines.sh down
#
# `check` (CI, `.ci/run`): brings up 2 machines on a --rate link (default 100mbit), trains accel_gpt for 5 steps as
# dp2 × tp2 across them (2 processes per machine; tp groups are consecutive ranks, so tp stays inside a machine
# and dp crosses the link) and as one process with the same global batch (--batch-size is per data-parallel
# replica: 4 per replica at dp2 = 8 in one process), and fails unless the per-step losses agree (relative 1e-5,
# the tolerance of examples/tests/suite/nd_equivalence.rs, widened to the 4 decimals accel_gpt prints), every
# group inside one machine uses shared memory and every group spanning machines uses TCP (the backend's debug
# lines), and the link carried at least the data-parallel ring traffic the run reports (tc's byte counters
# before and after). Then it runs accel_gpt with `--parallelism auto` across the machines and fails unless the
# start-up probe saw the slow link (the ping-pong across machines at least 5× slower than the all-reduce inside
# one) and the chosen layout keeps tp inside a machine (tp ≤ 2). Last, an elastic job (`--num_machines 1:2`,
# train_gpt) has machine 1's link cut after step 5 and must end on machine 0 alone with one process's losses, machine
# 1's launcher ending on its own (check_elastic). It tears the machines down on every exit (trap).
set -euo pipefail
self=$(realpath "$0")
caller_dir=$PWD # `exec` and `launch` run their command here, not in the repository
cd "$(dirname "$0")/.."

prefix=${ACCEL_NETNS_PREFIX:-accel}
subnet=10.77.0 # machine i is $subnet.(i+1)/24
state_root=/run/accel-netns

die() { echo "netns-machines: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$self" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

require_root() {
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, tc, mounts): run it with sudo, or as root in CI"
    command -v ip >/dev/null || die "\`ip\` (iproute2) not found: install iproute2"
    ip netns list >/dev/null 2>&1 ||
        die "\`ip netns\` is unavailable here (iproute2 without netns support, or a kernel without network namespaces)"
    local tool
    for tool in tc unshare mount flock; do
        command -v "$tool" >/dev/null || die "\`$tool\` not found (tc: iproute2; unshare, mount, flock: util-linux)"
    done
}

# Names and state, for the current $prefix.
set_prefix() {
    prefix=$1
    [[ $prefix =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,30}$ ]] || die "ACCEL_NETNS_PREFIX '$prefix': letters, digits, - and _ only"
    state=$state_root/$prefix
    sw_ns=$prefix-sw
}
set_prefix "$prefix"
machine_ns() { echo "$prefix-m$1"; }
machine_ip() { echo "$subnet.$(($1 + 1))"; }

load_state() {
    [[ -f $state/machines ]] || die "no simulated machines are up (prefix '$prefix'): run \`$0 up\` first"
    machines=$(<"$state/machines")
    rate=$(<"$state/rate")
    port=$(<"$state/port")
}

# "100mbit" → bits per second.
rate_bits() {
    [[ ${1,,} =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit)$ ]] ||
        die "--rate '$1': a whole number and bit, kbit, mbit or gbit (e.g. 100mbit)"
    local n=${BASH_REMATCH[1]} mult
    case ${BASH_REMATCH[2]} in
        bit) mult=1 ;; kbit) mult=1000 ;; mbit) mult=1000000 ;; gbit) mult=1000000000 ;; tbit) mult=1000000000000 ;;
    esac
    ((n > 0)) || die "--rate '$1' must be positive"
    echo $((n * mult))
}

# tbf on one link end: the bucket holds 4 ms at the rate (at least 64 KiB, so a GSO packet fits), the queue 50 ms.
shape() {
    local ns=$1 dev=$2 bits burst
    bits=$(rate_bits "$rate")
    burst=$((bits / 8 / 250))
    ((burst >= 65536)) || burst=65536
    tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 50ms
}

# No IPv6 in namespace $1: no router solicitations or duplicate-address probes in the links' byte counters.
no_ipv6() {
    ip netns exec "$1" sh -c 'for k in all default; do echo 1 >/proc/sys/net/ipv6/conf/$k/disable_ipv6; done' \
        2>/dev/null || true
}

# The switch and $1 machines (see the header).
make_machines() {
    local n=$1
    ip netns add "$sw_ns" || die "cannot create a network namespace here (a container without CAP_SYS_ADMIN?)"
    ip -n "$sw_ns" link set lo up
    no_ipv6 "$sw_ns"
    ip -n "$sw_ns" link add br0 type bridge
    ip -n "$sw_ns" link set br0 up
    local i ns hosts
    hosts=$(
        echo "127.0.0.1 localhost"
        for ((i = 0; i < n; i++)); do echo "$(machine_ip "$i") $(machine_ns "$i")"; done
    )
    for ((i = 0; i < n; i++)); do
        ns=$(machine_ns "$i")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        no_ipv6 "$ns"
        ip -n "$ns" link add eth0 type veth peer name "m$i" netns "$sw_ns"
        ip -n "$ns" addr add "$(machine_ip "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$sw_ns" link set "m$i" master br0 up
        shape "$ns" eth0        # machine → switch
        shape "$sw_ns" "m$i"    # switch → machine
        # The machine's own /dev/shm (bind-mounted over /dev/shm by `exec`) and /etc/hosts (ip netns exec mounts
        # /etc/netns/NAME/* over /etc/*).
        mkdir -p "$state/m$i/shm" "/etc/netns/$ns"
        mount -t tmpfs -o mode=1777 "$ns-shm" "$state/m$i/shm"
        echo "$hosts" >"/etc/netns/$ns/hosts"
        echo "$ns" >"/etc/netns/$ns/hostname"
    done
}

cmd_up() {
    local n=2 r=100mbit p=29500
    while (($#)); do
        case $1 in
            --machines) n=${2:?--machines needs a number}; shift 2 ;;
            --machines=*) n=${1#*=}; shift ;;
            --rate) r=${2:?--rate needs a value, e.g. 100mbit}; shift 2 ;;
            --rate=*) r=${1#*=}; shift ;;
            --port) p=${2:?--port needs a number}; shift 2 ;;
            --port=*) p=${1#*=}; shift ;;
            *) die "up: unknown argument '$1' (--machines N, --rate RATE, --port P)" ;;
        esac
    done
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 250)) || die "--machines '$n': 1 to 250"
    [[ $p =~ ^[0-9]+$ ]] && ((p >= 1 && p <= 65535)) || die "--port '$p': 1 to 65535"
    rate=$r
    rate_bits "$rate" >/dev/null
    require_root
    if [[ -e $state ]] || ip netns list | grep -qE "^$prefix-(sw|m[0-9]+)( |$)"; then
        die "machines with prefix '$prefix' are already up (or left behind): run \`$0 down\` first"
    fi
    mkdir -p "$state"
    echo "$n" >"$state/machines"
    echo "$rate" >"$state/rate"
    echo "$p" >"$state/port"
    # The job's run token (every machine's launcher needs the same one): `launch` exports it.
    (umask 077 && od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$state/run_token")
    machines=$n
    port=$p
    # The host's cgroup file systems (`exec` mounts them again inside each machine), in the host's mount order: a
    # tmpfs at /sys/fs/cgroup (cgroup v1's usual layout; mounted writable inside, where the hierarchies need
    # their mount points made), each hierarchy.
    awk '$2 == "/sys/fs/cgroup" && $3 == "tmpfs" {print $3, $2, $4}
         $2 ~ /^\/sys\/fs\/cgroup/ && ($3 == "cgroup" || $3 == "cgroup2") {print $3, $2, $4}' /proc/self/mounts \
        >"$state/cgroup-mounts"

    # Built in a subshell under `set -e`: if any step fails, what was made so far is removed again.
    set +e
    (set -e; make_machines "$n")
    local made=$?
    set -e
    if ((made != 0)); then
        cmd_down >/dev/null 2>&1 || true
        die "up failed (above); removed what it had made"
    fi
    echo "up: $n machine(s) ($(machine_ns 0) … $(machine_ns $((n - 1))), $(machine_ip 0) … $(machine_ip $((n - 1))))," \
        "each linked to a switch at $rate each way (tbf); rendezvous at $(machine_ip 0):$port"
}

cmd_down() {
    require_root
    local ns pids left i
    left=$(ip netns list | awk '{print $1}' | grep -E "^$prefix-(sw|m[0-9]+)$" || true)
    # Whatever still runs inside the machines (a launcher, its workers) is stopped: TERM, then KILL.
    for ns in $left; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [[ -n $pids ]] && kill -TERM $pids 2>/dev/null || true
    done
    for ns in $left; do
        for i in $(seq 20); do
            [[ -z $(ip netns pids "$ns" 2>/dev/null || true) ]] && break
            sleep 0.1
        done
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true
    done
    for ns in $left; do ip netns del "$ns" 2>/dev/null || true; done
    local d
    if [[ -d $state ]]; then
        for d in "$state"/m*/shm; do
            if mountpoint -q "$d" 2>/dev/null; then umount -l "$d" 2>/dev/null || true; fi
        done
        rm -rf "$state"
    fi
    rm -rf /etc/netns/"$prefix"-m[0-9]* 2>/dev/null || true
    rmdir /etc/netns "$state_root" 2>/dev/null || true # when empty
    if [[ -n $left ]]; then
        echo "down: removed $(echo "$left" | wc -l) namespace(s) of '$prefix'"
    else
        echo "down: nothing of '$prefix' was up"
    fi
}

check_machine() {
    [[ $1 =~ ^[0-9]+$ ]] && (($1 < machines)) || die "machine '$1': 0 to $((machines - 1)) ($machines machine(s) are up)"
    ip netns list | grep -qE "^$(machine_ns "$1")( |$)" ||
        die "machine $1 ($(machine_ns "$1")) is gone: run \`$0 down\` and \`up\` again"
}

# Runs "$@" in machine $1: its network namespace, its /dev/shm, its hostname, in the caller's working directory
# with the caller's environment; it replaces this shell.
in_machine() {
    local i=$1 ns
    shift
    ns=$(machine_ns "$i")
    cd "$caller_dir"
    # `ip netns exec` mounts a sysfs of the namespace over /sys, which hides the host's cgroup file systems: the
    # machine mounts them again from the list `up` recorded (the same hierarchies, so a cgroup made inside is the
    # host's cgroup; a memory limit set on it holds, and the start-up probe reads it as on a real machine).
    exec ip netns exec "$ns" unshare --mount --uts --propagation private -- sh -c '
        mount --bind "$1" /dev/shm && echo "$2" >/proc/sys/kernel/hostname || exit 1
        if [ -f "$3" ]; then
            while read -r fstype dir opts; do
                case $fstype in
                    tmpfs) mount -t tmpfs -o "$(echo "$opts" | sed "s/^ro,/rw,/; s/,ro,/,rw,/; s/,ro\$/,rw/")" \
                        cgroup_root "$dir" ;;
                    *) mkdir -p "$dir" && mount -t "$fstype" -o "$opts" cgroup "$dir" ;;
                esac 2>/dev/null ||
                    echo "netns-machines: could not mount the host cgroup file system $dir inside $2: memory cgroup limits are not seen there" >&2
            done <"$3"
        fi
        shift 3
        exec "$@"' sh "$state/m$i/shm" "$ns" "$state/cgroup-mounts" "$@"
}

cmd_exec() {
    (($# >= 2)) || die "usage: $0 exec MACHINE COMMAND [ARGS...]"
    require_root
    load_state
    check_machine "$1"
    in_machine "$@"
}

cmd_launch() {
    (($# >= 1)) || die "usage: $0 launch MACHINE -- [accel launch flags] PROGRAM [ARGS...]"
    local i=$1
    shift
    [[ ${1:-} == -- ]] && shift
    (($# >= 1)) || die "launch: nothing to launch (usage: $0 launch MACHINE -- [accel launch flags] PROGRAM [ARGS...])"
    require_root
    load_state
    check_machine "$i"
    local a
    for a in "$@"; do
        case ${a%%=*} in
            --num_machines | --num-machines | --nnodes | --machine_rank | --machine-rank | --node_rank | --node-rank | \
                --main_process_ip | --main-process-ip | --master_addr | --master-addr | --main_process_port | \
                --main-process-port | --master_port | --master-port)
                die "launch: $a is filled in by this script ($machines machines, rendezvous" \
                    "$(machine_ip 0):$port): leave it out" ;;
        esac
    done
    local accel=${ACCEL_BIN:-}
    if [[ -z $accel ]]; then
        accel=${CARGO_TARGET_DIR:-target}/debug/accel
    elif [[ $accel != /* ]]; then
        accel=$caller_dir/$accel
    fi
    [[ -x $accel ]] || die "launch: $accel not found: build it (cargo build -p accel-cli --bin accel) or set ACCEL_BIN"
    accel=$(realpath "$accel") # the command runs in the caller's directory
    # The run token `up` drew, unless ACCEL_RUN_TOKEN is set. A launcher's or an outer job's variables must not
    # leak into this machine's launcher (ACCEL_CPU_HOST would override the address the workers advertise).
    local token=${ACCEL_RUN_TOKEN:-$(<"$state/run_token")}
    in_machine "$i" env -u RANK -u LOCAL_RANK -u WORLD_SIZE -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR \
        -u MASTER_PORT -u ACCEL_CPU_HOST ACCEL_RUN_TOKEN="$token" "$accel" launch \
        --num_machines "${ACCEL_NETNS_NNODES:-$machines}" \
        --machine_rank "$i" --main_process_ip "$(machine_ip 0)" --main_process_port "$port" "$@"
}

# "tx rx" bytes of machine $1's link: tc's counters of its egress (machine → switch) and of the switch port's
# egress (switch → machine).
link_bytes() {
    local tx rx
    tx=$(tc -n "$(machine_ns "$1")" -s qdisc show dev eth0 | awk '/Sent/ {print $2; exit}')
    rx=$(tc -n "$sw_ns" -s qdisc show dev "m$1" | awk '/Sent/ {print $2; exit}')
    echo "${tx:-0} ${rx:-0}"
}

cmd_status() {
    require_root
    load_state
    echo "$machines machine(s), prefix '$prefix', $rate per link each way, rendezvous $(machine_ip 0):$port"
    local i b
    for ((i = 0; i < machines; i++)); do
        b=($(link_bytes "$i"))
        printf '  machine %d  %-16s %-10s sent %12d B  received %12d B\n' "$i" "$(machine_ns "$i")" "$(machine_ip "$i")" \
            "${b[0]}" "${b[1]}"
    done
}

now_ms() { echo $(($(date +%s%N) / 1000000)); }
secs() { printf '%d.%03d s' $(($1 / 1000)) $(($1 % 1000)); }

# `accel launch FLAGS…` on machines 0 and 1 at once, each one's output in $log_dir/NAME<i>.log (check's $log_dir);
# ends the check when a launcher fails, with the tail of its log.
launch_both() {
    local name=$1 i rc=0 pids=()
    shift
    for i in 0 1; do
        timeout -k 10 120 bash "$self" launch "$i" -- "$@" >"$log_dir/$name$i.log" 2>&1 9>&- &
        pids+=($!)
    done
    for i in 0 1; do
        wait "${pids[$i]}" ||
            { echo "check: machine $i's launcher ($name) exited with $?:" >&2; tail -n 30 "$log_dir/$name$i.log" >&2; rc=1; }
    done
    ((rc == 0)) || exit 1
}

# Compares per-step losses ("STEP LOSS" lines; a later line for a step replaces an earlier one, as a resumed run
# prints the steps it redoes again) of $3 against $4 for steps 1..$1, printing a table headed $2. Relative 1e-5 as
# nd_equivalence.rs; the examples print 4 decimals, so also 1 in the last printed digit.
compare_losses() {
    awk -v steps="$1" -v label="$2" '
        NR == FNR { m[$1] = $2; next } { s[$1] = $2 }
        END {
            printf "step  %22s  1 process\n", label
            for (k = 1; k <= steps; k++) {
                if (!(k in m) || !(k in s)) { printf "check: step %d missing from a log\n", k; bad = 1; continue }
                d = m[k] - s[k]; if (d < 0) d = -d; a = s[k] < 0 ? -s[k] : s[k]
                tol = 1e-5 * a; if (tol < 1e-4 + 1e-9) tol = 1e-4 + 1e-9
                flag = ""
                if (d > tol || m[k] != m[k] || s[k] != s[k]) { flag = sprintf("  <- differs by %g > %g", d, tol); bad = 1 }
                printf "%4d  %22s  %9s%s\n", k, m[k], s[k], flag
            }
            exit bad
        }' "$3" "$4"
}

# Waits up to $2 seconds for the file $1; false when it never came.
wait_for_file() {
    local deadline=$((SECONDS + $2))
    while [[ ! -e $1 ]]; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# An elastic job (`--num_machines 1:2`, the Trainer's train_gpt resuming from its newest checkpoint) across the two
# machines: machine 1's link is cut mid-run. Machine 0 must go on alone from the newest checkpoint (its workers'
# collectives time out after ACCEL_TIMEOUT) with the global batch kept, and end at its step count with the losses of
# one process at that global batch; machine 1's launcher, cut off, must end on its own within 30 s saying it
# lost machine 0 (no hang). (A machine that comes back and joins: examples/tests/suite/elastic.rs, on one host.)
# Appends to the caller's `failed`.
check_elastic() {
    local tg=$1 steps=30 out=$log_dir/elastic-run i
    local -a tg_args=(--data-dir "$PWD/data/shakespeare" --max-steps "$steps" --save-strategy steps --save-steps 5
        --logging-steps 1 --eval-strategy no --sample-len 0 --block-size 16 --seed 7)
    echo
    echo "check: an elastic job (--num_machines 1:2) losing machine 1's link after step 5"
    local pids=() t_cut
    for i in 0 1; do
        ACCEL_NETNS_NNODES=1:2 ACCEL_TIMEOUT=10 timeout -k 10 300 bash "$self" launch "$i" -- --cpu --num_processes 2 \
            --max_restarts 3 --rdzv_conf last_call_timeout=2 "$tg" "${tg_args[@]}" --per-device-train-batch-size 4 \
            --output-dir "$out" --resume-from-checkpoint latest >"$log_dir/elastic$i.log" 2>&1 9>&- &
        pids+=($!)
    done
    wait_for_file "$out/checkpoint-5/trainer_state.json" 120 || { failed+=("elastic: no checkpoint-5"); return; }
    ip -n "$(machine_ns 1)" link set eth0 down
    t_cut=$(now_ms)
    local deadline=$((SECONDS + 120))
    until grep -q 'round 1: machine 1 left' "$log_dir/elastic0.log"; do
        ((SECONDS < deadline)) || { failed+=("elastic: machine 0 did not go on alone within 120 s"); return; }
        sleep 0.1
    done
    local alone_ms=$(($(now_ms) - t_cut))
    wait "${pids[0]}" || failed+=("elastic: machine 0's launcher exited with $?: $(tail -n 5 "$log_dir/elastic0.log")")
    wait "${pids[1]}" && failed+=("elastic: machine 1's launcher, cut off, exited 0")
    local m1_ms=$(($(now_ms) - t_cut))
    ip -n "$(machine_ns 1)" link set eth0 up
    grep -q "lost machine 0's store" "$log_dir/elastic1.log" ||
        failed+=("elastic: machine 1's launcher did not say it lost machine 0: $(tail -n 3 "$log_dir/elastic1.log")")
    ((m1_ms < 30000)) || failed+=("elastic: machine 1's launcher took $(secs "$m1_ms") to end after the cut")
    grep -h '^\[launcher\] machine .: round' "$log_dir"/elastic[01].log || true
    echo "elastic: from the cut to training again on machine 0 alone: $(secs "$alone_ms"); machine 1's launcher" \
        "ended $(secs "$m1_ms") after the cut"

    env -u RANK "$tg" "${tg_args[@]}" --per-device-train-batch-size 8 --output-dir "$log_dir/elastic-single" \
        >"$log_dir/elastic-single.log" 2>&1 || { failed+=("elastic: the single-process run failed"); return; }
    local losses='s/^(\[rank 0\] )?step ([0-9]+)\/[0-9]+ \| epoch [^|]*\| loss ([0-9.eE+-]+|NaN|inf) .*/\2 \3/p'
    compare_losses "$steps" "elastic 1:2 machines" <(sed -nE "$losses" "$log_dir/elastic0.log") \
        <(sed -nE "$losses" "$log_dir/elastic-single.log") ||
        failed+=("elastic: the per-step losses differ from one process's at the same global batch")
}

cmd_check() {
    local r=100mbit
    while (($#)); do
        case $1 in
            --rate) r=${2:?--rate needs a value}; shift 2 ;;
            --rate=*) r=${1#*=}; shift ;;
            *) die "check: unknown argument '$1' (--rate RATE)" ;;
        esac
    done
    require_root
    local t0
    t0=$(now_ms)
    # Its own namespaces (a cluster someone has up stays untouched), one check at a time on this host.
    set_prefix accel-check
    export ACCEL_NETNS_PREFIX=$prefix
    local lock=/run/lock/accel-netns-check.lock
    mkdir -p /run/lock
    exec 9>"$lock"
    flock -w 900 9 || die "check: another check held $lock for 15 minutes"

    local target=${CARGO_TARGET_DIR:-target}
    if [[ ${ACCEL_NETNS_BUILD:-1} != 0 ]]; then
        echo "check: building accel_gpt and accel (dev profile, $target)"
        # A lock shared with other builds on this machine (several checkouts build into one target directory).
        flock "${ACCEL_BUILD_LOCK:-/tmp/accel-build.lock}" \
            cargo build -q -p accel-examples --bin accel_gpt --bin train_gpt -p accel-cli --bin accel
    fi
    [[ -x $target/debug/accel_gpt && -x $target/debug/accel ]] || die "check: $target/debug/accel_gpt or accel missing"
    local gpt accel
    gpt=$(realpath "$target/debug/accel_gpt")
    accel=$(realpath "$target/debug/accel")
    export ACCEL_BIN=$accel

    local log_dir
    log_dir=$(mktemp -d)
    # Whatever happens, the machines go; the logs stay when the check failed.
    trap 'rc=$?; cmd_down >/dev/null 2>&1 || true
          if ((rc == 0)); then rm -rf "'"$log_dir"'"; else echo "check: FAILED; logs in '"$log_dir"'" >&2; fi
          exit $rc' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    cmd_down >/dev/null # a check killed before its trap ran
    local t_build
    t_build=$(now_ms)
    cmd_up --machines 2 --rate "$r"
    load_state

    # No config file of the user's (the default one under $HF_HOME) may change the run.
    mkdir -p "$log_dir/hf_home"
    export HF_HOME=$log_dir/hf_home
    local steps=5
    # The model and data of every run here; the step count is each run's own.
    local -a gpt_args=(--data-dir "$PWD/data/shakespeare" --seed 1234 --log-every 1 --sample-len 0
        --block-size 16 --d-model 64 --n-layer 2 --d-ff 128 --lr 1e-2)

    local -a before=() after=()
    local i
    for i in 0 1; do before+=($(link_bytes "$i")); done
    echo "check: dp2 × tp2 over 2 machines (2 processes each), batch 4 per replica"
    local t_run
    t_run=$(now_ms)
    RUST_LOG=ddp_core::cpu=debug launch_both machine --cpu --num_processes 4 \
        --parallelism_config_dp_replicate_size 2 --parallelism_config_tp_size 2 "$gpt" "${gpt_args[@]}" \
        --steps "$steps" --batch-size 4
    local multi_ms=$(($(now_ms) - t_run))
    for i in 0 1; do after+=($(link_bytes "$i")); done

    echo "check: the same run in one process, batch 8"
    env -u RANK -u PARALLELISM_CONFIG_TP_SIZE -u PARALLELISM_CONFIG_PP_SIZE -u PARALLELISM_CONFIG_DP_REPLICATE_SIZE \
        "$gpt" "${gpt_args[@]}" --steps "$steps" --batch-size 8 >"$log_dir/single.log" 2>&1 ||
        { echo "check: the single-process run failed:" >&2; tail -n 30 "$log_dir/single.log" >&2; exit 1; }

    # Per-step losses: rank 0's lines on machine 0, the single process's lines. Every comparison runs; the check
    # fails at the end, naming each that failed.
    local multi single failed=()
    multi=$(sed -nE 's/^\[rank 0\] step ([0-9]+)\/[0-9]+: loss ([0-9.eE+-]+|NaN|inf),.*/\1 \2/p' "$log_dir/machine0.log")
    single=$(sed -nE 's/^step ([0-9]+)\/[0-9]+: loss ([0-9.eE+-]+|NaN|inf),.*/\1 \2/p' "$log_dir/single.log")
    echo
    # Relative 1e-5 as nd_equivalence.rs; accel_gpt prints 4 decimals, so also 1 in the last printed digit.
    compare_losses "$steps" "2 machines (dp2 x tp2)" <(echo "$multi") <(echo "$single") || failed+=("the per-step losses differ from one process's")

    # Shared memory exactly inside machines: every group of ≥ 2 ranks reports `shm=` once per rank; ranks 0-1 run
    # on machine 0, 2-3 on machine 1.
    echo
    cat "$log_dir"/machine[01].log | sed 's/\x1b\[[0-9;]*m//g' |
        sed -nE 's/^\[rank ([0-9]+)\].*cpu backend connected .*world_size=([0-9]+) group=([^ ]+) shm=(true|false).*/\1 \2 \3 \4/p' |
        sort -n -k1,1 |
        awk '$2 > 1 {
                 n[$3]++; size[$3] = $2; mach[$3, int($1 / 2)] = 1; ranks[$3] = ranks[$3] (ranks[$3] == "" ? "" : ",") $1
                 if ($4 == "true") shm[$3]++
             }
             END {
                 for (g in n) {
                     across = ((g, 0) in mach) && ((g, 1) in mach)
                     if (n[g] != size[g]) { printf "check: group %s: %d of %d ranks reported\n", g, n[g], size[g]; bad = 1 }
                     if (across && shm[g] > 0) {
                         printf "check: group %s (ranks %s) spans both machines but uses shared memory\n", g, ranks[g]
                         bad = 1
                     }
                     if (!across && shm[g] != n[g]) {
                         printf "check: group %s (ranks %s) is inside one machine but uses TCP\n", g, ranks[g]
                         bad = 1
                     }
                     if (across) { cross++; xl = xl " {" ranks[g] "}" } else { inside++; il = il " {" ranks[g] "}" }
                 }
                 printf "process groups inside one machine (shared memory expected): %d:%s\n", inside, il
                 printf "process groups across the machines (TCP expected):         %d:%s\n", cross, xl
                 if (inside == 0 || cross == 0) {
                     print "check: expected groups of both kinds (tp inside machines, dp and the world across)"
                     bad = 1
                 }
                 exit bad
             }' || failed+=("shared memory vs TCP does not follow the machines")

    # The bytes that crossed the link: at least every rank's data-parallel ring traffic, every step.
    local sent=0 recv=0 ring
    for i in 0 1; do
        local tx=$((after[2 * i] - before[2 * i])) rx=$((after[2 * i + 1] - before[2 * i + 1]))
        printf 'machine %d (%s): sent %d B, received %d B over the %s link\n' "$i" "$(machine_ip "$i")" "$tx" "$rx" "$rate"
        sent=$((sent + tx))
        recv=$((recv + rx))
    done
    ring=$(sed -nE 's/^\[rank 0\] data-parallel traffic per optimizer step \(rank 0\): [0-9]+ B of payload, ([0-9]+) B sent by ring.*/\1/p' \
        "$log_dir/machine0.log" | head -n 1)
    if [[ -z $ring ]]; then
        failed+=("no 'data-parallel traffic per optimizer step' line from rank 0")
    else
        local want=$((4 * ring * steps))
        echo "crossed between the machines: $sent B sent, $recv B received; the data-parallel rings alone send $want B" \
            "(4 ranks × $ring B × $steps steps)"
        ((sent >= want && recv >= want)) ||
            failed+=("less crossed the link than the data-parallel rings send: the machines did not talk over it")
    fi

    # The automatic layout across the same machines: the probe must see the slow link (the ping-pong across machines
    # far slower than the all-reduce inside one), and the chooser must keep tp inside a machine (tp ≤ 2 processes).
    echo
    echo "check: --parallelism auto over the 2 machines"
    launch_both auto --cpu --num_processes 4 "$gpt" "${gpt_args[@]}" --steps 2 --parallelism auto --global-batch-size 8
    local probe chosen flags
    probe=$(grep -m1 '^\[rank 0\] auto layout probe' "$log_dir/auto0.log" || true)
    chosen=$(grep -m1 '^\[rank 0\] chosen: ' "$log_dir/auto0.log" | sed 's/^\[rank 0\] //' || true)
    flags=$(grep -m1 '^\[rank 0\] auto_layout flags: ' "$log_dir/auto0.log" || true)
    echo "${probe#\[rank 0\] }"
    echo "$chosen"
    # β in bytes/s from "β 371.3 MB/s" (B/s, kB/s, MB/s, GB/s): the first is inside machine 0, the last across.
    local betas
    betas=$(grep -oE 'β [0-9.]+ [kMG]?B/s' <<<"$probe" |
        awk '{ v = $2; u = $3; m = (u ~ /^k/) ? 1e3 : (u ~ /^M/) ? 1e6 : (u ~ /^G/) ? 1e9 : 1; print v * m }')
    local inside across
    inside=$(head -n 1 <<<"$betas")
    across=$(tail -n 1 <<<"$betas")
    if [[ -z $probe || $probe != *"across machines (ping-pong)"* || -z $inside ]]; then
        failed+=("the auto run printed no probe of 2 machines")
    elif ! awk -v a="$across" -v i="$inside" 'BEGIN { exit !(a * 5 < i) }'; then
        failed+=("the probe did not see the slow link: across machines $across B/s, inside one $inside B/s")
    fi
    local tp
    tp=$(sed -nE 's/.*--tp-size ([0-9]+).*/\1/p' <<<"$flags")
    if [[ -z $tp ]]; then
        failed+=("the auto run printed no chosen flags")
    elif ((tp > 2)); then
        failed+=("auto chose tp $tp across the slow link (more than a machine's 2 processes)")
    fi
    grep -q '^\[rank 0\] accel_gpt done: 2 steps' "$log_dir/auto0.log" || failed+=("the auto run did not train its 2 steps")

    check_elastic "$(realpath "$target/debug/train_gpt")"

    if ((${#failed[@]})); then
        printf 'check: %s\n' "${failed[@]}" >&2
        exit 1
    fi
    echo "check: passed in $(secs $(($(now_ms) - t_build))) after the build (the 2-machine run:" \
        "$(secs "$multi_ms"); the build: $(secs $((t_build - t0))))"
}

(($# >= 1)) || usage
cmd=$1
shift
case $cmd in
    up) cmd_up "$@" ;;
    down) (($# == 0)) || die "down takes no arguments"; cmd_down ;;
    exec) cmd_exec "$@" ;;
    launch) cmd_launch "$@" ;;
    status) cmd_status "$@" ;;
    check) cmd_check "$@" ;;
    -h | --help | help) usage ;;
    *) die "unknown command '$cmd' (up, down, exec, launch, status, check)" ;;
esac
