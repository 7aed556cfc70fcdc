# Helpers of deploy/slurm/jetrl.sbatch. Sourced by it; also run on each node by srun as
# `bash lib.sh keep NAME MAX CMD...` (the restart loop of one part).
#
# Nothing here starts a process at source time; every function reads the settings the sbatch
# script exported (see its header and deploy/slurm/README.md).

# ------------------------------------------------------------------ node lists

# jetrl_expand_nodelist LIST: one host per line, in order. LIST is Slurm's compressed form
# (`gpu[01-03,07],cpu5`) or a plain comma/space separated list. Used where `scontrol` is absent
# (the dry run); inside a job the script asks `scontrol show hostnames` instead.
jetrl_expand_nodelist() {
    local list="$1" item="" ch depth=0 i
    local -a items=()
    for ((i = 0; i < ${#list}; i++)); do
        ch="${list:i:1}"
        case "$ch" in
            "[") depth=$((depth + 1)); item+="$ch" ;;
            "]") depth=$((depth - 1)); item+="$ch" ;;
            "," | " " | $'\t' | $'\n')
                if ((depth > 0)); then
                    item+="$ch"
                else
                    [[ -n "$item" ]] && items+=("$item")
                    item=""
                fi
                ;;
            *) item+="$ch" ;;
        esac
    done
    [[ -n "$item" ]] && items+=("$item")
    local prefix ranges suffix range lo hi width n
    local -a parts
    for item in "${items[@]}"; do
        if [[ "$item" =~ ^([^][]*)\[([^][]+)\](.*)$ ]]; then
            prefix="${BASH_REMATCH[1]}"
            ranges="${BASH_REMATCH[2]}"
            suffix="${BASH_REMATCH[3]}"
            IFS=, read -r -a parts <<<"$ranges"
            for range in "${parts[@]}"; do
                if [[ "$range" =~ ^([0-9]+)-([0-9]+)$ ]]; then
                    lo="${BASH_REMATCH[1]}"
                    hi="${BASH_REMATCH[2]}"
                    width=${#lo}
                    for ((n = 10#$lo; n <= 10#$hi; n++)); do
                        printf '%s%0*d%s\n' "$prefix" "$width" "$n" "$suffix"
                    done
                elif [[ "$range" =~ ^[0-9]+$ ]]; then
                    printf '%s%s%s\n' "$prefix" "$range" "$suffix"
                else
                    echo "jetrl: cannot read node range '$range' in '$item'" >&2
                    return 2
                fi
            done
        elif [[ "$item" == *"["* || "$item" == *"]"* ]]; then
            echo "jetrl: cannot read node list item '$item'" >&2
            return 2
        else
            printf '%s\n' "$item"
        fi
    done
}

# jetrl_hosts: the allocation's hosts, one a line. JETRL_NODELIST (any form above) wins, so a
# dry run needs no Slurm; otherwise `scontrol show hostnames "$SLURM_JOB_NODELIST"`.
jetrl_hosts() {
    if [[ -n "${JETRL_NODELIST:-}" ]]; then
        jetrl_expand_nodelist "$JETRL_NODELIST"
    elif [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST"
    elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        jetrl_expand_nodelist "$SLURM_JOB_NODELIST"
    else
        echo "jetrl: no node list: run under sbatch, or set JETRL_NODELIST (with DRY_RUN=1)" >&2
        return 2
    fi
}

# jetrl_join SEP ITEMS...: the items joined by SEP.
jetrl_join() {
    local sep="$1" out="" x
    shift
    for x in "$@"; do
        out+="${out:+$sep}$x"
    done
    printf '%s' "$out"
}

# ------------------------------------------------------------------ launching

# jetrl_quote CMD...: the command as one shell-quoted line (what a node runs, exactly).
jetrl_quote() {
    local out="" x
    for x in "$@"; do
        if [[ ! "$x" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            x="'${x//\'/\'\\\'\'}'" # single quotes; a ' inside as '\''
        fi
        out+="${out:+ }$x"
    done
    printf '%s' "$out"
}

# jetrl_plan_line HOST ROLE CMD...: the dry run's record of one command on one node.
jetrl_plan_line() {
    local host="$1" role="$2"
    shift 2
    printf '[%s] %s: %s\n' "$host" "$role" "$(jetrl_quote "$@")"
}

# jetrl_keep NAME MAX CMD...: run CMD; when it exits non-zero, start it again, at most MAX
# times (a part rebuilds itself from the log, so a restart is safe). Exit status: CMD's last.
jetrl_keep() {
    local name="$1" max="$2" n=0 rc
    shift 2
    while :; do
        "$@" && rc=0 || rc=$?
        if ((rc == 0)); then
            echo "jetrl: $name exited 0"
            return 0
        fi
        # Stopped on purpose (SIGTERM/SIGINT from the job's clean-up): no restart.
        if ((rc == 143 || rc == 130)); then
            echo "jetrl: $name stopped (exit $rc)"
            return "$rc"
        fi
        if ((n >= max)); then
            echo "jetrl: $name failed (exit $rc) after $n restart(s); giving up" >&2
            return "$rc"
        fi
        n=$((n + 1))
        echo "jetrl: $name exited $rc; restart $n of $max in ${JETRL_RESTART_DELAY_S:-5}s" >&2
        sleep "${JETRL_RESTART_DELAY_S:-5}"
    done
}

# jetrl_wait_port HOST PORT TIMEOUT_S: wait until HOST:PORT accepts a TCP connection.
jetrl_wait_port() {
    local host="$1" port="$2" deadline=$((SECONDS + $3))
    while ((SECONDS < deadline)); do
        if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then
            return 0
        fi
        sleep 1
    done
    echo "jetrl: $host:$port did not open within $3 s" >&2
    return 1
}

# Run as a program (on a node, under srun): `bash lib.sh keep NAME MAX CMD...`.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -uo pipefail
    case "${1:-}" in
        keep)
            shift
            jetrl_keep "$@"
            exit $?
            ;;
        *)
            echo "usage: bash lib.sh keep NAME MAX CMD..." >&2
            exit 2
            ;;
    esac
fi
